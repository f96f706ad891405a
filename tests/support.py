"""Helpers the tests share: writing source files, reading whole checkpoints."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from ckpt_iter import _files
from ckpt_iter import elastic
from ckpt_iter import state as state_lib


def orbax_save(directory: str | os.PathLike[str], step: int, **items: Any) -> None:
  """One Orbax step holding `items` (v0 args), written and finished."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(directory)
  manager.save(step, args=ocp.args.Composite(**items))
  manager.wait_until_finished()
  manager.close()


def orbax_restore(directory: str | os.PathLike[str], step: int, **items: Any) -> Any:
  """The Composite restored from one Orbax step (v0 args)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(directory)
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  finally:
    manager.close()


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
