"""The local shard cache (ckpt_iter.sources.ShardCache), on local files standing in for a store.

A cache copies any file, local or gs://, so its logic is tested here on local
files: atomic downloads, eviction by last use that never removes a copy in
use, one download between processes, the full-disk error; and a JsonlSource
through it reads exactly what it reads without it.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
import time

import pytest

from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import sources
import support


def _write(path, count: int, first: int = 0, width: int = 20) -> str:
  with open(path, "w") as f:
    for i in range(first, first + count):
      f.write(json.dumps({"id": i, "text": "x" * width}) + "\n")
  return str(path)


@pytest.fixture
def shards(tmp_path):
  directory = tmp_path / "store"
  directory.mkdir()
  return [_write(directory / f"part-{i}.jsonl", 50, first=50 * i) for i in range(4)]


def test_a_cached_source_reads_what_the_files_hold(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  plain = sources.JsonlSource(shards, index_cache_dir="")
  cached = sources.JsonlSource(shards, cache=cache)
  assert len(cached) == len(plain) == 200
  assert [cached[i] for i in range(200)] == [plain[i] for i in range(200)]
  assert [cached[i] for i in (199, 3, 120, 51)] == [{"id": i, "text": "x" * 20} for i in (199, 3, 120, 51)]
  names = sorted(os.listdir(cache.directory))
  assert sum(n.endswith(".index.npy") for n in names) == 4 and sum(n.endswith(".count") for n in names) == 4
  assert not [n for n in names if ".tmp-" in n]
  # Picklable (Grain workers), and a fresh source reads counts and indexes from the cache.
  again = pickle.loads(pickle.dumps(cached))
  assert again[77] == plain[77]
  assert sources.resolve_source(cached)[1] == sources.resolve_source(shards)[1]


def test_a_second_source_on_the_same_host_downloads_nothing(tmp_path, shards, monkeypatch):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  sources.JsonlSource(shards, cache=cache)[0]
  calls = []
  real = _storage.download
  monkeypatch.setattr(_storage, "download", lambda *a: (calls.append(a[0]), real(*a)))
  source = sources.JsonlSource(shards, cache=cache)
  assert [source[i]["id"] for i in (0, 60, 199)] == [0, 60, 199]
  assert calls == []


def test_a_changed_file_is_a_new_entry_never_the_old_copy(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  assert sources.JsonlSource(shards, cache=cache)[0]["id"] == 0
  _write(shards[0], 50, first=1000)
  assert sources.JsonlSource(shards, cache=cache)[0]["id"] == 1000


def test_eviction_is_by_last_use_and_never_of_a_copy_in_use(tmp_path, shards):
  size = max(os.path.getsize(p) for p in shards)
  cache = sources.ShardCache(tmp_path / "cache", 2 * size + 10)
  found = [_storage.identity(p) for p in shards]
  held = cache.open(shards[0], found[0])  # in use
  cache.fetch(shards[1], found[1])
  time.sleep(0.01)
  cache.fetch(shards[2], found[2])  # over the limit: shard 1 (idle) goes, shard 0 (held) stays
  cached = {os.path.basename(e).split("-", 2)[2] for e, _, _ in cache.entries()}
  assert cached == {"part-0.jsonl", "part-2.jsonl"}
  os.close(held)
  os.utime(cache.entry_path(shards[2], found[2]))  # shard 2 used last: shard 0 goes next
  cache.fetch(shards[3], found[3])
  cached = {os.path.basename(e).split("-", 2)[2] for e, _, _ in cache.entries()}
  assert cached == {"part-2.jsonl", "part-3.jsonl"}
  assert cache.usage() <= cache.max_bytes


def test_a_copy_downloaded_for_a_reader_is_not_evicted_before_the_reader_opens_it(tmp_path, shards, monkeypatch):
  # Another thread's download makes room right between this reader's download and its open (the race a
  # cache of one file lost 8 times in a row under load): the copy is held from its publication on.
  size = os.path.getsize(shards[0])
  cache = sources.ShardCache(tmp_path / "cache", size + 10)
  downloads = []
  real_download = _storage.download
  monkeypatch.setattr(_storage, "download", lambda *a: (downloads.append(a[0]), real_download(*a)))
  real_open = sources.ShardCache._open_locked
  monkeypatch.setattr(sources.ShardCache, "_open_locked",
                      staticmethod(lambda entry: (cache.make_room(cache.max_bytes), real_open(entry))[1]))
  fd = cache.open(shards[0])
  try:
    assert os.read(fd, 8) == b'{"id": 0'
  finally:
    os.close(fd)
  assert downloads == [shards[0]]


def test_when_every_copy_is_in_use_the_cache_runs_over_rather_than_fail(tmp_path, shards):
  size = os.path.getsize(shards[0])
  cache = sources.ShardCache(tmp_path / "cache", size + 10)
  held = [cache.open(p) for p in shards[:2]]
  assert len(cache.entries()) == 2
  for fd in held:
    os.close(fd)


def test_a_source_through_a_small_cache_reads_every_record(tmp_path, shards):
  size = os.path.getsize(shards[0])
  cache = sources.ShardCache(tmp_path / "cache", 2 * size)
  source = sources.JsonlSource(shards, cache=cache, max_open_files=1, prefetch_files=0)
  assert [source[i]["id"] for i in range(200)] == list(range(200))
  assert [source[i]["id"] for i in reversed(range(200))] == list(reversed(range(200)))
  assert len(cache.entries()) <= 2


def test_a_download_is_atomic_a_failed_one_leaves_no_copy(tmp_path, shards, monkeypatch):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)

  def half_then_fail(path, f, found):
    f.write(b"{" * (found.size // 2))
    raise OSError(errno.EIO, "injected", path)

  monkeypatch.setattr(_storage, "download", half_then_fail)
  with pytest.raises(OSError, match="injected"):
    cache.fetch(shards[0])
  assert sorted(os.listdir(cache.directory)) == sorted([
      os.path.basename(cache.entry_path(shards[0], _storage.identity(shards[0]))) + ".lock", "ckpt_iter-usage.lock"])


def test_a_full_disk_is_an_error_naming_the_cache_and_the_bytes_needed(tmp_path, shards, monkeypatch):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)

  def no_space(path, f, found):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(_storage, "download", no_space)
  size = os.path.getsize(shards[0])
  with pytest.raises(errors.StorageError) as caught:
    sources.JsonlSource(shards[:1], cache=cache)
  assert caught.value.cause == "no_space" and caught.value.path == cache.directory
  assert f"shard cache {cache.directory}: no space left" in str(caught.value)
  assert f"{size:,} bytes needed for {shards[0]}" in str(caught.value)
  assert not [n for n in os.listdir(cache.directory) if ".tmp-" in n]


def test_two_threads_download_a_file_once_and_both_read_the_copy(tmp_path, shards, monkeypatch):
  # Each thread its own cache object, as two processes have: the download lock is an
  # flock on the entry's .lock file, which two opens of it exclude (tests/integration/
  # test_bucket_cache.py checks two processes).
  calls = []
  real = _storage.download

  def slow(*args):
    calls.append(1)
    time.sleep(0.3)
    return real(*args)

  monkeypatch.setattr(_storage, "download", slow)
  barrier, found = threading.Barrier(2), []

  def fetch():
    cache = sources.ShardCache(tmp_path / "cache", 10**7)
    barrier.wait()
    found.append(open(cache.fetch(shards[0]), "rb").read())

  threads = [threading.Thread(target=fetch) for _ in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(60)
  assert len(calls) == 1 and found == [open(shards[0], "rb").read()] * 2


def test_prefetch_downloads_the_next_files_in_the_background(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  source = sources.JsonlSource(shards[:1], cache=cache)  # only shard 0 cached
  del source
  source = sources.JsonlSource(shards, cache=cache, prefetch_files=2)
  before = {e for e, _, _ in cache.entries()}
  source.prefetch([1, 2])
  cache.wait()
  after = {e for e, _, _ in cache.entries()}
  assert after >= before and len(after) == 4


def test_the_cache_takes_its_place_from_the_environment(tmp_path, monkeypatch):
  monkeypatch.delenv(sources._shard_cache.CACHE_ENV, raising=False)
  assert sources.ShardCache.from_env() is None
  monkeypatch.setenv(sources._shard_cache.CACHE_ENV, str(tmp_path / "c"))
  monkeypatch.setenv(sources._shard_cache.CACHE_BYTES_ENV, "1e6")
  cache = sources.ShardCache.from_env()
  assert cache.max_bytes == 10**6 and cache.directory == str(tmp_path / "c")
  with pytest.raises(errors.InvalidArgumentError):
    sources.ShardCache("gs://bucket/cache", 10)


def test_parquet_and_array_record_sources_read_their_copies_in_the_cache(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  parquet, array_record = [], []
  for part in range(2):
    records = [{"id": part * 30 + i, "text": f"r{i}"} for i in range(30)]
    parquet.append(str(tmp_path / f"p-{part}.parquet"))
    pq.write_table(pa.Table.from_pylist(records), parquet[-1], row_group_size=8)
    array_record.append(str(tmp_path / f"a-{part}.array_record"))
    writer = array_record_module.ArrayRecordWriter(array_record[-1], "group_size:1")
    for record in records:
      writer.write(json.dumps(record).encode())
    writer.close()
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  for kind, paths in ((sources.ParquetSource, parquet), (sources.ArrayRecordSource, array_record)):
    plain, cached = kind(paths), kind(paths, cache=cache)
    assert [cached[i] for i in range(60)] == [plain[i] for i in range(60)]
    assert sources.resolve_source(cached)[1] == sources.resolve_source(paths)[1]
    again = pickle.loads(pickle.dumps(cached))
    assert again[59] == plain[59]
  assert len(cache.entries()) == 4


# -- integrity: a copy, its seal and its companions ------------------------------------------------


def _entry(cache, path):
  return cache.entry_path(path, _storage.identity(path))


def _flip_one_byte(path: str, offset: int = 5) -> None:
  """Alters one byte in place, same size (a JSON digit for another: still valid JSONL)."""
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(b"9" if byte != b"9" else b"8")


def test_a_copy_altered_on_disk_is_caught_before_it_is_read_and_downloaded_again(tmp_path, shards, caplog):
  directory = tmp_path / "cache"
  assert sources.JsonlSource(shards, cache=sources.ShardCache(directory, 10**7))[0] == {"id": 0, "text": "x" * 20}
  cache = sources.ShardCache(directory, 10**7)
  entry = _entry(cache, shards[0])
  _flip_one_byte(entry, offset=len('{"id": '))  # record 0's id 0 -> 9: same size, valid JSON
  assert os.path.getsize(entry) == os.path.getsize(shards[0])
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    source = sources.JsonlSource(shards, cache=cache)  # another process, as it were: a new cache object
    assert [source[i]["id"] for i in range(200)] == list(range(200))
  assert "altered on disk after its download" in caplog.text and entry in caplog.text
  assert open(entry, "rb").read() == open(shards[0], "rb").read()


def test_open_cached_opens_only_a_complete_checked_copy_and_never_downloads(tmp_path, shards, caplog):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  found = _storage.identity(shards[0])
  assert cache.open_cached(shards[0], found) is None and not cache.has(shards[0], found)  # nothing fetched
  os.close(cache.open(shards[0], found))
  fd = cache.open_cached(shards[0], found)
  try:
    assert os.pread(fd, 9, 0) == b'{"id": 0,'
  finally:
    os.close(fd)
  entry = _entry(cache, shards[0])
  _flip_one_byte(entry, offset=len('{"id": '))
  fresh = sources.ShardCache(tmp_path / "cache", 10**7)  # another process: it checks the copy first
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    assert fresh.open_cached(shards[0], found) is None
  assert "altered on disk after its download" in caplog.text and not os.path.exists(entry)  # for a download


def test_a_copy_altered_while_this_process_had_checked_it_is_checked_again_at_its_next_open(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  os.close(cache.open(shards[1]))
  entry = _entry(cache, shards[1])
  _flip_one_byte(entry, offset=len('{"id": '))
  fd = cache.open(shards[1])
  try:
    assert os.pread(fd, 10, 0) == b'{"id": 50,'
  finally:
    os.close(fd)


def test_a_copy_without_a_seal_is_never_trusted(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  os.close(cache.open(shards[0]))
  entry = _entry(cache, shards[0])
  os.unlink(entry + ".seal")
  _flip_one_byte(entry, offset=len('{"id": '))
  fresh = sources.ShardCache(tmp_path / "cache", 10**7)
  fd = fresh.open(shards[0])
  try:
    assert os.pread(fd, 9, 0) == b'{"id": 0,'  # a local source has no store checksum: downloaded again
  finally:
    os.close(fd)
  assert os.path.exists(entry + ".seal")


@pytest.mark.parametrize("edit", ["count_number", "count_garbage", "index_value", "index_shape", "index_garbage"])
def test_a_companion_that_disagrees_with_its_copy_is_rebuilt(tmp_path, shards, edit, caplog, monkeypatch):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _jsonl  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_jsonl, "_SMALL_COPY_BYTES", 0)  # the index kept beside a copy: read for a large one
  directory = tmp_path / "cache"
  assert len(sources.JsonlSource(shards, cache=sources.ShardCache(directory, 10**7))) == 200
  cache = sources.ShardCache(directory, 10**7)
  entry = _entry(cache, shards[2])
  if edit == "count_number":
    text = open(entry + ".count").read()
    open(entry + ".count", "w").write(text.replace("records 50 ", "records 40 "))
  elif edit == "count_garbage":
    open(entry + ".count", "w").write("40")
  elif edit == "index_value":
    array = np.load(entry + ".index.npy")
    array[0, 3] += 7
    np.save(entry + ".index.npy", array)
  elif edit == "index_shape":
    np.save(entry + ".index.npy", np.load(entry + ".index.npy")[:, :40])
  else:
    open(entry + ".index.npy", "wb").write(b"\x93NUMPY garbage")
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    source = sources.JsonlSource(shards, cache=cache)
    assert len(source) == 200
    assert [source[i]["id"] for i in range(200)] == list(range(200))
  assert "rebuilt" in caplog.text or "rebuilding" in caplog.text
  assert cache.read_count(shards[2], _storage.identity(shards[2])) == 50


def test_a_small_copy_is_read_whole_and_indexed_from_its_bytes_not_from_its_edited_index(tmp_path, shards):
  import numpy as np  # pylint: disable=g-import-not-at-top

  directory = tmp_path / "cache"
  assert len(sources.JsonlSource(shards, cache=sources.ShardCache(directory, 10**7))) == 200
  cache = sources.ShardCache(directory, 10**7)
  entry = _entry(cache, shards[2])
  array = np.load(entry + ".index.npy")
  array[0, 3] += 7  # an index a large copy would be refused by (and rebuilt): a small one never reads it
  np.save(entry + ".index.npy", array)
  source = sources.JsonlSource(shards, cache=cache)
  assert [source[i]["id"] for i in range(200)] == list(range(200))
  assert all(copy.fd is None and copy.data for copy in source._held.values())  # pylint: disable=protected-access
  assert not source._open  # pylint: disable=protected-access  # no descriptor kept


def test_small_copies_held_in_memory_drop_the_least_recently_used_past_their_bound(tmp_path, shards, monkeypatch):
  from ckpt_iter import _jsonl  # pylint: disable=g-import-not-at-top

  sizes = [os.path.getsize(path) for path in shards]
  monkeypatch.setattr(_jsonl, "_HELD_BYTES", sizes[2] + sizes[3])
  source = sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "cache", 10**7), prefetch_files=0)
  assert source.files_kept_open() == 4  # small, but more than the bound holds: all of them are opened again
  assert [source[i]["id"] for i in range(0, 200, 10)] == list(range(0, 200, 10))
  assert list(source._held) == [2, 3]  # pylint: disable=protected-access  # the two read last
  assert source._held_bytes == sizes[2] + sizes[3]  # pylint: disable=protected-access
  source.release([3])
  assert list(source._held) == [3] and source._held_bytes == sizes[3]  # pylint: disable=protected-access


def test_a_count_that_disagrees_with_the_copy_read_is_refused_by_name(tmp_path, shards, monkeypatch):
  # The count a source was built with and the copy it reads must agree: never a record read past
  # or short of what the source numbered.
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  source = sources.JsonlSource(shards, cache=cache, prefetch_files=0)
  source._offsets = [0, 50, 90, 150, 200]  # as if built from a count of 40 for file 1
  with pytest.raises(errors.InvalidStateError, match=r"part-1.jsonl: its copy .* holds 50 records, this source "
                     r"was built counting 40"):
    source[60]


# -- liveness, and a cache directory that cannot be written -----------------------------------------


def test_a_live_download_is_never_taken_for_abandoned_whatever_pid_its_name_holds(tmp_path, shards):
  # Its name's pid means nothing to a process in another PID namespace: the locks say it is live.
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  found = _storage.identity(shards[0])
  entry = cache.entry_path(shards[0], found)
  live = f"{entry}.tmp-999999999-1"  # no such process here
  with cache._download_lock(entry):
    with cache._cache_file(live, "wb") as f:
      f.write(b"partial")
      sources.ShardCache(tmp_path / "cache", 10**7)  # another process opens the cache: its sweep
      assert os.path.exists(live)
  abandoned = f"{entry}.index.npy.tmp-999999999-2"
  open(abandoned, "wb").write(b"left by a dead writer")
  open(live, "wb").write(b"its writer died too")
  sources.ShardCache(tmp_path / "cache", 10**7)  # abandoned temporaries are swept when a cache is opened
  assert not os.path.exists(abandoned) and not os.path.exists(live)


def test_a_lock_file_that_cannot_be_created_is_a_storage_error_naming_the_directory(tmp_path, shards, monkeypatch):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  real_open = open

  def no_inode(path, *args, **kwargs):
    if str(path).endswith(".lock"):
      raise OSError(errno.ENOSPC, "No space left on device", path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr("builtins.open", no_inode)
  with pytest.raises(errors.StorageError) as caught:
    cache.fetch(shards[0])
  assert caught.value.cause == "no_space" and caught.value.path == cache.directory
  assert f"shard cache {cache.directory}: no space left on its disk" in str(caught.value)


def test_an_index_write_failing_without_an_errno_is_a_storage_error_naming_the_directory(tmp_path, shards,
                                                                                           monkeypatch):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  real = cache._cache_file

  def failing(target, mode):
    if target.split(".tmp-")[0].endswith(".index.npy"):
      raise OSError("write failed")  # no errno, as some filesystems give
    return real(target, mode)

  monkeypatch.setattr(cache, "_cache_file", failing)
  with pytest.raises(errors.StorageError) as caught:
    sources.JsonlSource(shards[:1], cache=cache)
  assert caught.value.cause == "cache" and caught.value.path == cache.directory
  message = str(caught.value)
  assert f"shard cache {cache.directory}: cannot write" in message and "write failed" in message
  assert "point the cache at another directory" in message


def test_a_cache_directory_that_cannot_be_made_is_a_storage_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(errors.StorageError) as caught:
    sources.ShardCache(blocker / "cache", 10**7)
  assert caught.value.cause == "cache" and "cannot write" in str(caught.value)


def test_a_global_shuffle_through_a_cache_smaller_than_the_corpus_warns_at_build(tmp_path, shards, caplog):
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  small = sources.ShardCache(tmp_path / "small", 2 * os.path.getsize(shards[0]))
  source = sources.JsonlSource(shards, cache=small)
  needed = sum(source.cached_bytes())
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    ckpt_iter.make_dataset(source, batch_size=4, seed=0)
  assert f"max_bytes={needed}" in caplog.text and 'shuffle="shards"' in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    ckpt_iter.make_dataset(source, batch_size=4, seed=None)  # in file order: a file at a time
    ckpt_iter.make_dataset(source, batch_size=4, seed=0, shuffle="shards", shuffle_window=1)
    ckpt_iter.make_dataset(sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "big", needed)),
                           batch_size=4, seed=0)
  assert "global shuffle" not in caplog.text


# -- processes sharing a cache: an open never fails while the copy can be had ----------------------


def test_a_copy_evicted_between_being_found_and_opened_is_had_under_the_download_lock(tmp_path, shards,
                                                                                       monkeypatch):
  # The race that ended in "evicted 8 times while being opened" when four processes shared a small
  # cache: every time the copy is found complete, another process evicts it before the open. The
  # open then downloads it under the download lock, holding it from its publication on.
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  os.close(cache.open(shards[0]))
  real_open = sources.ShardCache._open_locked
  evictions = []

  def evicted_first(entry):
    if not evictions or len(evictions) < 20:
      evictions.append(entry)
      cache.evict(entry)  # as another process does
    return real_open(entry)

  monkeypatch.setattr(sources.ShardCache, "_open_locked", staticmethod(evicted_first))
  fd = cache.open(shards[0])
  try:
    assert os.pread(fd, 9, 0) == b'{"id": 0,'
  finally:
    os.close(fd)
  assert 1 <= len(evictions) <= 3


def test_a_shard_shuffle_through_a_cache_below_two_windows_warns_at_build(tmp_path, shards, caplog):
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  probe = sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "probe", 10**7))
  two_windows = sum(sorted(probe.cached_bytes(), reverse=True)[:4])
  small = sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "small", two_windows - 1))
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    ckpt_iter.make_dataset(small, batch_size=4, seed=0, shuffle="shards", shuffle_window=2)
  assert f"max_bytes={two_windows} or more" in caplog.text and "shuffle_window=2" in caplog.text
  caplog.clear()
  enough = sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "enough", two_windows))
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    ckpt_iter.make_dataset(enough, batch_size=4, seed=0, shuffle="shards", shuffle_window=2)
  assert "make_dataset" not in caplog.text
  # One process reading two shard lanes reads a window in each, each prefetching its next: twice the bytes.
  window_of_one = sum(sorted(probe.cached_bytes(), reverse=True)[:2])
  one_lane = sources.JsonlSource(shards, cache=sources.ShardCache(tmp_path / "one_lane", window_of_one))
  for lanes, count, warned in ((2, 2, False), (2, 1, True)):
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckpt_iter"):
      ckpt_iter.make_dataset(one_lane, batch_size=4 // count, seed=0, shuffle="shards", shuffle_window=1,
                             shard_lanes=lanes, shard_index=0, shard_count=count)
    assert ("in each of the 2 lane(s) this process reads" in caplog.text) == warned, caplog.text
  assert f"max_bytes={two_windows} or more" in caplog.text


def _corpus_of(tmp_path, kind):
  """8 files of 40 records of ~200 bytes each (`kind`: "parquet" or "array_record"), by the tests' writers."""
  paths = [str(tmp_path / f"part-{part}.{kind}") for part in range(8)]
  for part, path in enumerate(paths):
    support.FILE_WRITERS[kind](path, [{"id": part * 40 + i, "text": "x" * 200} for i in range(40)])
  return paths


@pytest.mark.parametrize("kind, make, held", [
    ("parquet", lambda paths, cache: sources.ParquetSource(paths, cache=cache), 1),  # a copy while it is read
    ("array_record", lambda paths, cache: sources.ArrayRecordSource(paths, cache=cache, max_open_files=1), 2),
])
def test_a_corpus_larger_than_its_cache_reads_through_it_a_window_at_a_time(tmp_path, kind, make, held):
  # issue 59 item 2: Parquet and ArrayRecord sources held every file and refused a cache smaller than it.
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  paths = _corpus_of(tmp_path, kind)
  largest = max(os.path.getsize(p) for p in paths)
  max_bytes = 3 * largest  # under half the corpus
  cache = sources.ShardCache(tmp_path / "cache", max_bytes)
  source = make(paths, cache)
  assert cache.entries() == [] and len(source) == 320  # the build read the footers only
  in_place = ckpt_iter.make_dataset(paths, batch_size=4, seed=3, shuffle="shards", shuffle_window=1)
  cached = ckpt_iter.make_dataset(source, batch_size=4, seed=3, shuffle="shards", shuffle_window=1)
  got = []
  for number in range(len(cached)):
    got.append(cached[number]["id"].tolist())
    cache.wait()
    assert sum(size for _, size, _ in cache.entries()) <= max_bytes + held * largest  # the copies in use past it
  assert got == [in_place[number]["id"].tolist() for number in range(len(in_place))]
  assert sorted(i for b in got for i in b) == list(range(320))


# --- the cache's own files, bounded and never a false alarm (issue 64 items 4, 6, 11, 12) ---


def test_a_decompressed_copy_that_fills_the_disk_says_what_its_text_needs(tmp_path, monkeypatch):
  # The message counted the compressed size and advised lowering max_bytes, which does not help.
  import gzip  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top

  text = b"".join(json.dumps({"id": i, "text": "w" * 200}).encode() + b"\n" for i in range(5000))
  path = tmp_path / "big.jsonl.gz"
  path.write_bytes(gzip.compress(text))
  real_cache_file = _shard_cache.ShardCache._cache_file  # pylint: disable=protected-access

  class FillsAt:
    def __init__(self, f, room):
      self._f, self._room = f, room

    def write(self, data):
      if len(data) > self._room:
        raise OSError(errno.ENOSPC, "No space left on device")
      self._room -= len(data)
      return self._f.write(data)

    def __getattr__(self, name):
      return getattr(self._f, name)

  import contextlib  # pylint: disable=g-import-not-at-top

  @contextlib.contextmanager
  def small_disk(self, target, mode):
    with real_cache_file(self, target, mode) as f:
      yield FillsAt(f, 100_000) if ".tmp-" in target and not target.endswith((".seal", ".count")) and \
          ".seal.tmp" not in target else f

  monkeypatch.setattr(_shard_cache.ShardCache, "_cache_file", small_disk)
  cache = sources.ShardCache(tmp_path / "cache", 10**9)
  with pytest.raises(errors.StorageError) as caught:
    sources.JsonlSource([str(path)], cache=cache)
  message = str(caught.value)
  assert caught.value.cause == "no_space", message
  assert (f"no space left on its disk for the decompressed text of {path}: it is {len(text):,} bytes "
          f"({path.stat().st_size:,} compressed" in message), message
  assert "lower its max_bytes" not in message
  assert not [n for n in os.listdir(cache.directory) if ".tmp-" in n]


def test_a_copys_line_index_is_read_by_its_own_size(tmp_path):
  # Loading it asked for 16 bytes per byte of the copy: a 1.6 GB shard raised MemoryError on a 24 GB host.
  import tracemalloc  # pylint: disable=g-import-not-at-top

  path = _write(tmp_path / "wide.jsonl", 2000, width=4000)  # 8 MB of text in 2,000 lines
  cache = sources.ShardCache(tmp_path / "cache", 10**9)
  assert len(sources.JsonlSource([path], cache=cache)) == 2000
  found = _storage.identity(path)
  index_bytes = os.path.getsize(cache.index_path(path, found))
  fd = cache.open(path, found)  # the copy checked against its seal first (read in chunks)
  try:
    tracemalloc.start()
    starts, _ = sources.JsonlSource([path], cache=cache)._load_index(path, found, fd)  # pylint: disable=protected-access
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
    os.close(fd)
  assert len(starts) == 2000
  assert peak < 4 * index_bytes + 2**20, (peak, index_bytes, os.path.getsize(path))


def test_an_index_and_its_count_written_by_another_process_are_never_taken_for_torn(tmp_path, shards, monkeypatch,
                                                                                     caplog):
  # The index and the count that binds it were written in two unlocked steps: a reader between them
  # warned "edited, torn or stale" (2 of 4 processes of a bucket restart). Each reader here has its own cache
  # object, as a process has; the writer lingers between the two files.
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top

  real_write_count = _shard_cache.ShardCache.write_count

  def lingering(self, *args, **kwargs):
    time.sleep(0.05)
    return real_write_count(self, *args, **kwargs)

  monkeypatch.setattr(_shard_cache.ShardCache, "write_count", lingering)
  directory = tmp_path / "cache"
  sources.ShardCache(directory, 10**7).fetch(shards[0])  # the copy, without its index yet
  barrier, failures = threading.Barrier(6), []

  def read():
    try:
      barrier.wait()
      source = sources.JsonlSource(shards[:1], cache=sources.ShardCache(directory, 10**7), prefetch_files=0)
      assert [source[i]["id"] for i in range(50)] == list(range(50))
    except BaseException as e:  # pylint: disable=broad-except
      failures.append(e)

  with caplog.at_level("WARNING", logger="ckpt_iter"):
    threads = [threading.Thread(target=read) for _ in range(6)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  assert not failures, failures
  assert "not bound" not in caplog.text and "rebuilding" not in caplog.text, caplog.text


def test_a_failed_prefetch_is_the_reads_answer_not_a_second_budget(tmp_path, shards, monkeypatch):
  # The build's prefetch failed after its retries, was forgotten, and the read tried all of them again.
  calls = []

  def unavailable(path, f, found):
    calls.append(path)
    raise errors.StorageError(f"{path}: the store answered 503", path=path, operation="read", cause="server")

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import store_bounds  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_storage, "download", unavailable)
  before = store_bounds.object_store_bounds()
  ckpt_iter.set_object_store_bounds(operation_seconds=0.5)
  try:
    cache = sources.ShardCache(tmp_path / "cache", 10**7)
    cache.prefetch([(shards[0], _storage.identity(shards[0]))])
    cache.wait()
    assert len(calls) == 1
    for _ in range(3):  # a read, and other read threads soon after
      with pytest.raises(errors.StorageError, match="503"):
        cache.open(shards[0], _storage.identity(shards[0]))
    assert len(calls) == 1  # the prefetch's outcome, not another try
    time.sleep(0.6)  # past one operation bound: an open tries afresh
    with pytest.raises(errors.StorageError, match="503"):
      cache.open(shards[0], _storage.identity(shards[0]))
    assert len(calls) == 2
  finally:
    ckpt_iter.set_object_store_bounds(operation_seconds=before.operation_seconds)


# --- the cache's bookkeeping: O(1) per open, close and download (issue 65 item 1) ---


def test_making_room_lists_nothing_while_the_copies_fit(tmp_path, monkeypatch):
  # make_room listed and stat'ed the whole directory at every call (per record under a global shuffle past
  # max_open_files, per download, per window released): 13.9 ms a call at 1,000 cached files.
  store = tmp_path / "store"
  store.mkdir()
  paths = [_write(store / f"part-{i}.jsonl", 2, first=2 * i) for i in range(200)]
  cache = sources.ShardCache(tmp_path / "cache", 10**8)
  source = sources.JsonlSource(paths, cache=cache, max_open_files=4, prefetch_files=0)
  listed = []
  real_listdir, real_scandir = os.listdir, os.scandir
  monkeypatch.setattr(os, "listdir", lambda *a: (listed.append(a), real_listdir(*a))[1])
  monkeypatch.setattr(os, "scandir", lambda *a: (listed.append(a), real_scandir(*a))[1])
  # Every record in another file than the last: a copy closed (past max_open_files) at every read.
  assert [source[i]["id"] for i in range(0, 400, 2)] == list(range(0, 400, 2))
  for _ in range(100):
    cache.make_room(0)
  assert listed == []


def test_processes_sharing_a_cache_share_its_total(tmp_path, shards):
  # Each cache object stands for a process: what one publishes, the other's total counts.
  one = sources.ShardCache(tmp_path / "cache", 10**7)
  two = sources.ShardCache(tmp_path / "cache", 10**7)
  for path in shards[:2]:
    os.close(one.open(path))
  os.close(two.open(shards[2]))
  assert one._ledger.total() == two._ledger.total() == one.usage()  # pylint: disable=protected-access
  # A cache of three copies' worth: the other process's new download evicts the oldest, not its own.
  small = sources.ShardCache(tmp_path / "cache", one.usage() + 10)
  os.close(small.open(shards[3]))
  cached = {os.path.basename(e).split("-", 2)[2] for e, _, _ in small.entries()}
  assert "part-3.jsonl" in cached and "part-0.jsonl" not in cached, cached
  assert small.usage() <= small.max_bytes and small._ledger.total() == small.usage()  # pylint: disable=protected-access


def test_a_total_a_killed_process_left_wrong_is_made_good_when_a_cache_is_opened(tmp_path, shards):
  cache = sources.ShardCache(tmp_path / "cache", 10**7)
  sources.JsonlSource(shards, cache=cache)
  ledger = tmp_path / "cache" / "ckpt_iter-usage.lock"
  for wrong in (b"5\n", b"not a total", b""):  # a publication or an eviction not counted; garbled; emptied
    ledger.write_bytes(wrong)
    again = sources.ShardCache(tmp_path / "cache", 10**7)
    assert again._ledger.total() == again.usage() > 0  # pylint: disable=protected-access
  ledger.unlink()
  cache.make_room(0)  # a process that opened the cache before: counted again, from a listing
  assert cache._ledger.total() == cache.usage()  # pylint: disable=protected-access


def test_a_copy_opened_again_reuses_its_line_index_and_the_build_says_what_to_set(tmp_path, monkeypatch, caplog):
  # issue 65 item 2: past max_open_files a global shuffle re-opens a copy at two reads in three, and every
  # re-open read the copy's whole line index again (942 us a record against 37 from local disk).
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _jsonl  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_jsonl, "_SMALL_COPY_BYTES", 0)  # copies kept open, not held in memory
  store = tmp_path / "store"
  store.mkdir()
  paths = [_write(store / f"part-{i}.jsonl", 5, first=5 * i) for i in range(40)]
  source = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "cache", 10**8), max_open_files=4)
  loads, opens = [], []
  real, real_open = _shard_cache.ShardCache.record_index, _shard_cache.ShardCache.open
  monkeypatch.setattr(_shard_cache.ShardCache, "record_index",
                      lambda self, path, *a, **k: (loads.append(path), real(self, path, *a, **k))[1])
  monkeypatch.setattr(_shard_cache.ShardCache, "open",
                      lambda self, path, *a, **k: (opens.append(path), real_open(self, path, *a, **k))[1])
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    dataset = ckpt_iter.make_dataset(source, batch_size=4, seed=3, num_epochs=3)
  assert "keeps 4 of them open (max_open_files)" in caplog.text and "max_open_files=40" in caplog.text
  ids = [i for batch in dataset for i in batch["id"].tolist()]
  assert sorted(ids) == sorted(list(range(200)) * 3)
  # Hundreds of re-opens; a copy's index read at its first open (a few twice: Grain's threads opening a
  # file at once), then kept.
  assert len(opens) > 200 and len(loads) <= 2 * 40, (len(opens), len(loads))


def test_a_global_shuffle_over_small_files_opens_each_copy_once_and_asks_for_no_open_files(tmp_path, monkeypatch,
                                                                                           caplog):
  # issue 65 item 2: a small copy is held in memory once read, whatever max_open_files says: a global shuffle
  # over thousands of small objects does not close one copy and open another at most reads.
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top

  store = tmp_path / "store"
  store.mkdir()
  paths = [_write(store / f"part-{i}.jsonl", 5, first=5 * i) for i in range(40)]
  source = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "cache", 10**8), max_open_files=4)
  assert source.files_kept_open() == 0
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    dataset = ckpt_iter.make_dataset(source, batch_size=4, seed=3, num_epochs=3)
  assert "max_open_files" not in caplog.text
  opens = []  # while reading three epochs
  real_open = _shard_cache.ShardCache.open
  monkeypatch.setattr(_shard_cache.ShardCache, "open",
                      lambda self, path, *a, **k: (opens.append(path), real_open(self, path, *a, **k))[1])
  ids = [i for batch in dataset for i in batch["id"].tolist()]
  assert sorted(ids) == sorted(list(range(200)) * 3)
  assert len(opens) <= 2 * 40 and set(opens) == set(paths), len(opens)  # once each (twice: threads at once)


def test_a_source_keeps_every_copy_open_where_the_cache_holds_them_all(tmp_path, shards):
  # issue 65 item 2: max_open_files=None (the default) keeps every file open when the cache holds them all,
  # so a global shuffle never re-opens a copy; a cache smaller than the files keeps 16 (copies it may evict).
  store = tmp_path / "many"
  store.mkdir()
  paths = [_write(store / f"part-{i}.jsonl", 3, first=3 * i) for i in range(24)]  # more than 16
  roomy = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "roomy", 10**8))
  assert roomy.max_open_files == 24
  one_copy = os.path.getsize(paths[0]) + 16 * 3 + 128
  tight = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "tight", 4 * one_copy))
  assert tight.max_open_files == 16
  assert sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "roomy", 10**8),
                             max_open_files=2).max_open_files == 2  # as given
