"""Parquet and ArrayRecord files read a file at a time through a ShardCache (`ckpt_iter/_cached_files.py`).

Local files stand in for a store (a cache copies any file): an ArrayRecord
copy's record count held to its footer's, the footers counted where the
store's files are and, where array_record's reader cannot open them, from the
copies, that count's wait bounded by the store's operation bound, and a
shuffled read hopping between open copies asking for no prefetch. The window
at a time read of both kinds: tests/unit/test_shard_cache.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from ckpt_iter import _cached_files
from ckpt_iter import errors
from ckpt_iter import sources
import support


def test_an_array_record_copy_with_another_record_count_is_refused(tmp_path):
  path = str(tmp_path / "a.array_record")
  support.write_array_record(path, [{"id": i} for i in range(5)])
  source = sources.ArrayRecordSource([path], cache=sources.ShardCache(tmp_path / "cache", 10**8))
  source._offsets = [0, 6]  # pylint: disable=protected-access  (as a footer read wrong would count it)
  with pytest.raises(errors.InvalidStateError, match=r"holds 5 records, this source was built with 6 records"):
    source[0]


def test_where_array_records_reader_cannot_open_a_stores_file_the_copies_are_counted(tmp_path, monkeypatch):
  path = str(tmp_path / "a.array_record")
  support.write_array_record(path, [{"id": i} for i in range(5)])
  real = _cached_files.record_counts
  monkeypatch.setattr(_cached_files, "record_counts", lambda paths: real(paths) if "cache" in paths[0] else 1 / 0)
  cache = sources.ShardCache(tmp_path / "cache", 10**8)
  source = sources.ArrayRecordSource([path], cache=cache)
  assert len(source) == 5 and [source[i] for i in range(5)] == [{"id": i} for i in range(5)]
  assert len(cache.entries()) == 1  # the copy it counted


def test_a_footer_count_that_hangs_on_a_store_is_bounded_by_the_operation_bound(tmp_path, monkeypatch):
  # array_record's own reader takes no timeout of ours: the wait for it is bounded, then the copies count.
  import dataclasses  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  released = threading.Event()

  class Hanging:
    def __init__(self, *unused):
      released.wait()

  bounds = dataclasses.replace(_cached_files.store_bounds.object_store_bounds(), operation_seconds=0.2)
  monkeypatch.setattr(_cached_files.store_bounds, "object_store_bounds", lambda: bounds)
  monkeypatch.setattr(array_record_module, "ArrayRecordReader", Hanging)
  monkeypatch.setattr(_cached_files._storage, "is_url", lambda path: True)  # pylint: disable=protected-access
  try:
    with pytest.raises(futures.TimeoutError):
      _cached_files.record_counts(["gs://bucket/a.array_record"])
  finally:
    released.set()


def test_a_shuffled_read_hopping_between_open_array_record_copies_asks_for_no_prefetch(tmp_path):
  # A global shuffle enters another file at nearly every record: prefetching by file index at each hop
  # (a cache lookup for every next file) cost a warm cached read 0.41 of local disk (benchmarks/bucket.py).
  paths = []
  for part in range(4):
    paths.append(str(tmp_path / f"a-{part}.array_record"))
    support.write_array_record(paths[-1], [{"id": part * 50 + i} for i in range(50)])
  source = sources.ArrayRecordSource(paths, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  asked = []
  real = source.prefetch
  source.prefetch = lambda indices: (asked.append(list(indices)), real(indices))
  order = np.random.default_rng(0).permutation(len(source))
  first = [source[int(i)]["id"] for i in order]  # opens every file's copy as it first reads it
  source.cache.wait()
  asked_while_opening = len(asked)
  assert 0 < asked_while_opening <= len(paths)
  assert [source[int(i)]["id"] for i in order] == first == [int(i) for i in order]
  assert len(asked) == asked_while_opening  # every file open: the hops ask for nothing
