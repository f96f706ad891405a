"""Prefetch by plan: make_dataset(shuffle="shards") over a cached source asks for the files it reads next.

Local files stand in for a bucket (the cache copies any file). What is held:
the files asked for are the plan's (the reader's window by first use, then
the next window), bounded by the cache's size; a restore asks for the files
at the restored position before it reads; reading never depends on it (the
same batches with prefetch off, and a failing prefetch leaves the read to
fetch its file itself, with the errors it raises without prefetch).
"""

from __future__ import annotations

import json
import os
import pickle

import pytest

import ckpt_iter
import support
from ckpt_iter import _plan_prefetch
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import sources

FILES, PER_FILE, BATCH, WINDOW, SEED = 10, 12, 4, 2, 5


@pytest.fixture
def files(tmp_path):
  directory = tmp_path / "store"
  directory.mkdir()
  paths = []
  for part in range(FILES):
    paths.append(str(directory / f"part-{part}.jsonl"))
    with open(paths[-1], "w") as f:
      f.writelines(json.dumps({"id": part * PER_FILE + i, "text": "x" * 30}) + "\n" for i in range(PER_FILE))
  return paths


def _cached(tmp_path, files, max_bytes=10**7, **kwargs):
  return sources.JsonlSource(files, cache=sources.ShardCache(tmp_path / "cache", max_bytes), **kwargs)


def _recorded(source):
  """Records every `prefetch` call of `source` (still prefetching)."""
  calls, real = [], source.prefetch
  source.prefetch = lambda indices: (calls.append(list(indices)), real(indices))
  return calls


def _dataset(source, calls=None, num_epochs=1):
  dataset = ckpt_iter.make_dataset(source, batch_size=BATCH, seed=SEED, shuffle="shards",
                                   shuffle_window=WINDOW, num_epochs=num_epochs)
  if calls is not None:
    calls.clear()  # a local source's digest read sample records, before the plan took over
  return dataset


def _ids(dataset):
  """Every batch's ids, read one at a time as DataIterator reads (iter() would read ahead in threads)."""
  return [dataset[number]["id"].tolist() for number in range(len(dataset))]


def _evict_copies(source, *others):
  """Closes the sources' copies and removes every copy (their line counts stay): a cache holding other files."""
  for each in (source, *others):
    each.cache.wait()  # a prefetch holds its copy open while it indexes it
    for _, copy in each._open.take_idle(()):  # pylint: disable=protected-access
      os.close(copy.fd)
  for entry, _, _ in source.cache.entries():
    assert source.cache.evict(entry)


def _order(dataset):
  return _plan_prefetch.of_chain(dataset.parents[0]).order


def _first_uses(order, start, end):
  """The shards of positions start..end-1 of epoch 0, in the order they are first read."""
  seen = []
  for position in range(start, end):
    shard = order.shard_of(order.source(position))
    if shard not in seen:
      seen.append(shard)
  return seen


@pytest.mark.parametrize("num_epochs", [1, None])
def test_entering_a_window_asks_for_its_files_by_first_use_then_the_next_windows(tmp_path, files, num_epochs):
  source = _cached(tmp_path, files)
  calls = _recorded(source)
  dataset = _dataset(source, calls, num_epochs)
  ids = _ids(dataset) if num_epochs else [dataset[n]["id"].tolist() for n in range(FILES * PER_FILE // BATCH)]
  order = _order(dataset)
  windows = order.windows(0)
  starts = order.plan(0).lane(0).window_starts
  # Files are the shards here. One call per window, on entering it; none by file index (the plan took over).
  # The last window of a stream's last epoch asks for nothing past the stream's end.
  expected = []
  for number, shards in enumerate(windows):
    following = windows[number + 1] if number + 1 < len(windows) else order.windows(1)[0] if num_epochs is None else []
    expected.append(_first_uses(order, starts[number], starts[number + 1]) + following)
    assert sorted(expected[-1][:len(shards)]) == sorted(shards)
  assert calls == expected
  # Exact whatever prefetch does: the batches of the files read in place, and of a source with no prefetch.
  if num_epochs:
    assert ids == _ids(_dataset(files))
    assert ids == _ids(_dataset(_cached(tmp_path / "off", files, prefetch_files=0)))


def test_the_files_asked_for_are_bounded_by_the_caches_size(tmp_path, files):
  size = max(os.path.getsize(path) for path in files) + 16 * PER_FILE + 128  # a copy and its line index
  source = _cached(tmp_path, files, max_bytes=3 * size)
  calls = _recorded(source)
  dataset = _dataset(source, calls)
  ids = _ids(dataset)
  assert calls and all(len(call) == 3 for call in calls[:-1])  # 4 files ahead (2 windows of 2), 3 fit
  assert len(calls[-1]) == 2  # the last window's: nothing past the stream's one epoch
  order = _order(dataset)
  assert calls[0] == (_first_uses(order, 0, order.plan(0).lane(0).window_starts[1]) + order.windows(0)[1])[:3]
  assert ids == _ids(_dataset(files))


def test_blocks_across_files_ask_for_the_files_holding_them(tmp_path, files):
  source = _cached(tmp_path, files)
  calls = _recorded(source)
  dataset = ckpt_iter.make_dataset(source, batch_size=BATCH, seed=SEED, shuffle="shards", shard_size=18,
                                   shuffle_window=2, num_epochs=1)
  calls.clear()
  ids = _ids(dataset)
  order = _order(dataset)
  shards = order.shards_ahead(0, windows=2)
  wanted = {r // PER_FILE for s in shards for r in (order.offsets[s], order.offsets[s + 1] - 1)}
  assert set(calls[0]) == wanted and len(calls[0]) == len(set(calls[0]))
  assert ids == _ids(ckpt_iter.make_dataset(files, batch_size=BATCH, seed=SEED, shuffle="shards", shard_size=18,
                                            shuffle_window=2, num_epochs=1))


def test_a_restore_asks_first_for_the_files_at_the_restored_position(tmp_path, files, monkeypatch):
  source = _cached(tmp_path, files)
  iterator = ckpt_iter.DataIterator(_dataset(source))
  for _ in range(17):
    next(iterator)
  state, expected = iterator.get_state(), [b["id"].tolist() for b in iterator]
  _evict_copies(source)
  again = _cached(tmp_path, files)
  calls = _recorded(again)
  dataset = _dataset(again, calls)
  restored = ckpt_iter.DataIterator(dataset)
  monkeypatch.setattr(_plan_prefetch.PlanPrefetch, "at", lambda self, index: None)  # the restore's own
  restored.set_state(state)
  assert len(calls) == 1
  monkeypatch.undo()
  # Asked for before the content check's read of the batch before (records 64-67), from there on.
  order = _order(dataset)
  before = 17 * BATCH - BATCH
  window = next(n for n, start in enumerate(order.plan(0).lane(0).window_starts) if start > before) - 1
  assert calls[0][0] == order.shard_of(order.source(before))
  assert calls[0][:WINDOW] == _first_uses(order, before, order.plan(0).lane(0).window_starts[window + 1])[:WINDOW]
  assert [b["id"].tolist() for b in restored] == expected


def test_a_failing_prefetch_leaves_the_read_to_fetch_its_file(tmp_path, files, monkeypatch):
  source = _cached(tmp_path, files)
  expected = _ids(_dataset(files))
  # The source's prefetch itself raises: logged, the reads go on.
  broken = _cached(tmp_path / "broken", files)
  dataset = _dataset(broken)
  broken.prefetch = lambda indices: 1 / 0
  assert _ids(dataset) == expected
  # Every download in a prefetch thread fails. It spent the download's budget: a read of the file soon
  # after raises its error rather than a second budget (docs/storage.md); one past an operation bound
  # downloads its own file.
  _evict_copies(source)
  real = _storage.download

  def download(path, f, found):
    if "prefetch" in __import__("threading").current_thread().name:
      raise errors.StorageError("injected", path=path, operation="read", cause="unavailable")
    return real(path, f, found)

  monkeypatch.setattr(_storage, "download", download)
  with pytest.raises(errors.StorageError, match="injected"):
    _ids(_dataset(_cached(tmp_path, files)))
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import store_bounds  # pylint: disable=g-import-not-at-top

  before = store_bounds.object_store_bounds().operation_seconds
  ckpt_iter.set_object_store_bounds(operation_seconds=1e-6)
  try:
    assert _ids(_dataset(_cached(tmp_path, files))) == expected
  finally:
    ckpt_iter.set_object_store_bounds(operation_seconds=before)


def test_a_file_that_cannot_be_read_raises_the_stores_error_as_without_prefetch(tmp_path, files, monkeypatch):
  source = _cached(tmp_path, files)
  _evict_copies(source)
  real = _storage.download

  def download(path, f, found):
    if path.endswith("part-3.jsonl"):
      raise errors.StorageError("injected: part-3 is gone", path=path, operation="read", cause="not_found")
    return real(path, f, found)

  monkeypatch.setattr(_storage, "download", download)
  for prefetch_files in (2, 0):
    with pytest.raises(errors.StorageError, match="part-3 is gone"):
      _ids(_dataset(_cached(tmp_path, files, prefetch_files=prefetch_files)))


def test_a_cached_file_is_marked_used_and_an_evicted_one_fetched_again(tmp_path, files):
  source = _cached(tmp_path, files)
  cache = source.cache
  source.prefetch([1])  # cached by the build: only marked as just used
  cache.wait()
  _evict_copies(source)
  source.prefetch([1, 2])
  cache.wait()
  assert cache.has(files[1], source.identities()[1]) and cache.has(files[2], source.identities()[2])


def test_no_prefetch_without_a_cache_or_with_prefetch_off_and_it_pickles(tmp_path, files):
  assert _plan_prefetch.of_chain(_dataset(files).parents[0]) is None
  assert _plan_prefetch.of_chain(_dataset(_cached(tmp_path, files, prefetch_files=0)).parents[0]) is None
  prefetch = _plan_prefetch.of_chain(_dataset(_cached(tmp_path, files)).parents[0])
  prefetch.at(0)
  copy = pickle.loads(pickle.dumps(prefetch))
  assert not copy._seen and copy.files_ahead(0) == prefetch.files_ahead(0)  # pylint: disable=protected-access


def test_a_window_left_is_released_so_a_small_cache_downloads_each_file_once(tmp_path, files, monkeypatch):
  size = max(os.path.getsize(path) for path in files) + 16 * PER_FILE + 128  # a copy and its line index
  source = _cached(tmp_path, files, max_bytes=6 * size)
  expected = _ids(_dataset(files))
  again = _cached(tmp_path, files, max_bytes=6 * size)  # max_open_files 16: without release all would stay open
  dataset = _dataset(again)
  _evict_copies(source, again)  # and the copies a local source's digest read: reading starts with none
  downloads, real = [], _storage.download
  monkeypatch.setattr(_storage, "download", lambda path, f, found: (downloads.append(path), real(path, f, found)))
  ids = []
  for number in range(len(dataset)):
    ids.append(dataset[number]["id"].tolist())
    again.cache.wait()
    assert len(again._open) <= 2 * WINDOW  # pylint: disable=protected-access  # this window's and the last
  assert ids == expected
  assert sorted(downloads) == sorted(files)  # none evicted before it was read, none read twice


def test_only_a_restore_over_a_source_that_prefetches_by_plan_enters_the_prefetcher(tmp_path, files):
  # issue 58 item 12: every make_dataset restore entered _plan_prefetch; a source without a cache has nothing to ask.
  for source, expected in ((files, False), (_cached(tmp_path, files), True)):
    iterator = ckpt_iter.DataIterator(_dataset(source))
    next(iterator)
    state = iterator.get_state()
    restored = ckpt_iter.DataIterator(_dataset(source))
    assert ("_plan_prefetch.py" in support.modules_entered(lambda: restored.set_state(state))) is expected
    assert next(restored)["id"].tolist() == next(iterator)["id"].tolist()


@pytest.mark.parametrize("count", [1, 2])
def test_with_shard_lanes_a_process_asks_only_for_its_lanes_files(tmp_path, files, count):
  # 2 lanes of 4 rows each per global batch; with 2 processes each reads one lane, with 1 both.
  for index in range(count):
    source = _cached(tmp_path / str(index), files)
    calls = _recorded(source)
    dataset = ckpt_iter.make_dataset(source, batch_size=8 // count, seed=SEED, shuffle="shards", shuffle_window=WINDOW,
                                     num_epochs=1, shard_lanes=2, shard_index=index, shard_count=count)
    calls.clear()
    ids = _ids(dataset)
    order = _order(dataset)
    mine = range(index * 2 // count, (index + 1) * 2 // count)
    lane_files = {s for lane in mine for shards in order.windows(0, lane) for s in shards}  # files are the shards
    assert calls and {f for call in calls for f in call} <= lane_files
    assert {i // PER_FILE for batch in ids for i in batch} <= lane_files
    if count == 2:
      assert len(lane_files) < FILES  # a share, not the corpus (a file split between the lanes is in both)
    else:  # one process reading both lanes asks for each lane's windows as it enters them
      assert {f for call in calls for f in call} == set(range(FILES))
