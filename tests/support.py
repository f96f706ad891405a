"""Helpers the tests share: writing source files, reading whole checkpoints."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from ckpt_iter import _files
from ckpt_iter import elastic
from ckpt_iter import state as state_lib


def write_array_record(path: str, records: Sequence[Any]) -> None:
  """Writes records as JSON objects into one ArrayRecord file."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  try:
    for record in records:
      writer.write(json.dumps(record).encode("utf-8"))
  finally:
    writer.close()


def read_all(directory: str | os.PathLike[str]) -> list[state_lib.IteratorState]:
  """Every process's state of an item directory, checked to agree (as verify does)."""
  directory = os.fspath(directory)
  count = _files.saved_process_count(directory)
  states = [_files.read_state(directory, i, count) for i in range(count)]
  elastic.check_agree(directory, states)
  return states
