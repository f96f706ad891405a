"""Files read a whole file at a time through a ShardCache: what Parquet and ArrayRecord sources share.

Counted without a download: from the footer kept in the cache by an earlier
build (`ShardCache.read_footer`), else from the corpus index beside the files
(`_corpus_index`), else from the file's footer where it is: a Parquet file's
row groups by ranged reads of its tail, pinned to the version the source
identifies it by, an ArrayRecord file's records by array_record's own reader,
its wait bounded by the store's (`known_footers`). What a build read is kept
in the cache; a copy whose footer disagrees replaces it and stops the read. Read from their copies: an
ArrayRecord file through a reader of its copy, at most `max_open` of them open;
a Parquet file through its copy while a row group is read. Prefetched by file
index, or by make_dataset's plan once it says so (`FilesThroughCache`). The
sources themselves, and JSONL's own cache path, are in `sources` and `_jsonl`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from typing import Any, Callable, Sequence

from ckpt_iter import _corpus_index
from ckpt_iter import _open_files
from ckpt_iter import _shard_cache
from ckpt_iter import _source_files
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import store_bounds

_log = logging.getLogger(__name__)


class FilesThroughCache(_source_files.FileSource):
  """What a source read a file at a time through a ShardCache (Parquet, ArrayRecord) gives make_dataset's
  plan: prefetch by file index on entering a file, or by the plan once it says so (`_plan_prefetch`), and
  the readers of its copies it keeps open (`OpenReaders`).

  The subclass sets `_paths`, `_identities` and `_copies` (with a cache), `_cache`, `_prefetch_files`,
  `_planned` and a thread-local `_local`. (JsonlSource has its own: its copies carry their line indexes.)
  """

  _paths: list[str]
  _identities: list[_storage.Identity]
  _cache: _shard_cache.ShardCache | None
  _prefetch_files: int
  _planned: bool
  _local: threading.local
  _copies: "OpenReaders"

  @property
  def cache(self) -> _shard_cache.ShardCache | None:
    """The `ShardCache` the files are read through, or None."""
    return self._cache

  @property
  def prefetch_files(self) -> int:
    """How many files ahead a cached source downloads (0: no prefetch, by file index or by plan)."""
    return self._prefetch_files if self._cache is not None else 0

  def follow_plan(self) -> None:
    """Stops prefetching the next files by index: make_dataset(shuffle="shards")'s plan names them."""
    self._planned = True

  def prefetch(self, file_indices: Sequence[int]) -> None:
    """Downloads these files (indices into `paths`, modulo their count) in the background; with no cache,
    nothing. A file already cached is marked as just used, so eviction spares it."""
    if self._cache is None or not file_indices:
      return
    files = [(self._paths[i], self._identities[i]) for i in dict.fromkeys(i % len(self._paths) for i in file_indices)
             if not self._is_open(i % len(self._paths))]  # open here: in use, so no eviction takes it
    for path, found in files:
      if self._cache.has(path, found):
        self._cache.touch(path, found)
    self._cache.prefetch([(path, found) for path, found in files if not self._cache.has(path, found)])

  def cached_bytes(self) -> list[int]:
    """What each file takes in the cache: its copy."""
    return [found.size for found in self._identities]

  def identities(self) -> list[_storage.Identity]:
    """Each file's size and version (generation and checksum on an object store), as read when built."""
    return list(self._identities)

  def release(self, keep: Sequence[int]) -> None:
    """Closes this process's idle copies of the files not in `keep`: a plan is done with them."""
    if self._cache is not None:
      self._copies.close_idle(keep)

  def _is_open(self, file_index: int) -> bool:
    """Whether this process holds file `file_index`'s copy open."""
    return self._cache is not None and self._copies.is_open(file_index)

  def _entering(self, file_index: int) -> None:
    """A read of file `file_index` by this thread: entering a file not open here, the next files are
    downloaded ahead (a shuffled read hops between open files at every record: no prefetch then)."""
    previous = getattr(self._local, "file", None)
    if previous == file_index:
      return
    self._local.file = file_index
    # Only for a thread reading the files in order: a global shuffle hops between files (the next by index is
    # no guess, and asking the cache about it costs what a read does).
    if (self.prefetch_files and not self._planned and previous in (None, file_index - 1)
        and not self._is_open(file_index)):
      self.prefetch(range(file_index + 1, file_index + 1 + self._prefetch_files))


def known_footers(cache: _shard_cache.ShardCache, paths: list[str], identities: list[_storage.Identity], *,
                  read: Callable[[list[int]], list[list[int]]], use_index: bool, row_groups: bool,
                  indexes: dict[str, Any] | None = None) -> tuple[list[list[int]], set[str]]:
  """Each file's footer as a build needs it (`row_groups`: a Parquet file's groups' sizes; else a one-entry
  list, an ArrayRecord file's record count), and the paths whose came from a corpus index.

  Kept in the cache first (a file's own record, written where its copy
  disagreed; else one object for these files at these versions), then the
  corpus index (one read per directory, `use_index`, unless `indexes` holds
  it: those the source's files were named from), then `read(file
  indices)` from the files; what the last two gave is kept in the cache as
  one object, so a warm restart reads no footer and no index.

  Raises:
    InvalidStateError: as `_corpus_index.entries` (a stale or garbled index).
  """
  kept = cache.read_footers(paths, identities)  # one object: a warm restart opens nothing a file
  if kept is not None and (row_groups or all(len(groups) == 1 for groups in kept)):
    return kept, set()
  found: list[list[int] | None] = [cache.read_footer(p, f) for p, f in zip(paths, identities)]
  missing = [i for i, groups in enumerate(found) if groups is None]
  indexed: set[str] = set()
  if missing and use_index:
    for i, entry in zip(missing, _corpus_index.entries([paths[i] for i in missing],
                                                      [identities[i] for i in missing], indexes)):
      if entry is not None and (not row_groups or "row_groups" in entry):
        found[i] = list(entry["row_groups"]) if row_groups else [entry["records"]]
        indexed.add(paths[i])
    missing = [i for i, groups in enumerate(found) if groups is None]
  learned = bool(missing or indexed)
  if missing:
    for i, groups in zip(missing, read(missing)):
      found[i] = groups
  if learned:
    with contextlib.suppress(errors.StorageError):  # a cache that cannot be written only forgets it
      cache.write_footers(paths, identities, found)  # type: ignore[arg-type]
  return found, indexed  # type: ignore[return-value]


def miscounted(cache: _shard_cache.ShardCache, path: str, found: _storage.Identity, holds: list[int],
               built: list[int], indexed: bool, what: Callable[[list[int]], str],
               source_files: tuple[list[str], list[_storage.Identity]]) -> errors.InvalidStateError:
  """A copy whose footer says `holds` where the source was built with `built`: the footer kept in the cache is
  the copy's from now on, and what was kept for the source's files (`source_files`) is dropped (a build again
  reads it); the error names where the wrong one came from."""
  with contextlib.suppress(errors.StorageError):
    cache.write_footer(path, found, holds)
  cache.forget_footers(*source_files)
  directory = path.rsplit("/", 1)[0]
  return errors.InvalidStateError(
      f"{path}: its copy in the shard cache {cache.directory} holds {what(holds)}, this source was built with "
      f"{what(built)}" + (f" (from {_corpus_index.location(directory)}, which is wrong for it: index the corpus "
                          f"again with {errors.index_command(directory)})" if indexed else "")
      + ". Build the source again (make_dataset).")


def footers(pq: Any, paths: list[str], generations: list[str | None],
             identities: list[_storage.Identity | None]) -> list[list[int]]:
  """Each Parquet file's row-group sizes, from its footer (in parallel on an object store)."""
  def footer(path: str, generation: str | None, found: _storage.Identity | None) -> list[int]:
    # Read once more if it does not parse (bytes a transfer altered: a footer's ranged read has no
    # checksum to compare; what it says is checked again against the checked copy at its first read).
    for attempt in range(2):
      try:
        if found is not None and _storage.is_url(path):  # its identity known: ranged GETs of the tail only
          metadata = pq.ParquetFile(RangedFile(_storage.RangeReader(path, found), found.size)).metadata
        else:
          with parquet_file(pq, path, generation) as parquet:
            metadata = parquet.metadata
        return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
      except (OSError, ValueError) as e:
        if isinstance(e, (FileNotFoundError, errors.CkptIterError)):
          raise
        if attempt:
          raise errors.InvalidStateError(
              f"{path}: its Parquet footer cannot be read twice over ({e}): not a Parquet file, or a "
              "truncated one. Check the file (pyarrow.parquet.read_metadata), or leave it out.") from None
    raise AssertionError("unreachable")

  if len(paths) <= 1 or not any(_storage.is_url(p) for p in paths):
    return [footer(p, g, found) for p, g, found in zip(paths, generations, identities)]
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  with futures.ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
    return list(pool.map(footer, paths, generations, identities))


class RangedFile(io.RawIOBase):
  """A read-only file of known size over an object's ranged GETs (`_storage.RangeReader`: pinned, bounded,
  typed): what pyarrow reads a footer through, with no metadata request to open it (gcsfs asks one)."""

  def __init__(self, reader: _storage.RangeReader, size: int):
    super().__init__()
    self._reader, self._size, self._at = reader, size, 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self._at

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    self._at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence] + offset
    return self._at

  def readinto(self, buffer: Any) -> int:
    end = min(self._size, self._at + len(buffer))
    data = self._reader.read(self._at, end) if end > self._at else b""
    buffer[:len(data)] = data
    self._at += len(data)
    return len(data)


@contextlib.contextmanager
def parquet_file(pq: Any, path: str, generation: str | None = None) -> Any:
  """A pyarrow ParquetFile of a local path (read natively) or a URL (through `_storage`)."""
  if not _storage.is_url(path):
    yield pq.ParquetFile(path)
    return
  with _storage.open_read(path, generation) as f:
    yield pq.ParquetFile(f)


def record_counts(paths: list[str]) -> list[int]:
  """Each ArrayRecord file's record count, from its footer (array_record's reader; in parallel on a store)."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  def count(path: str) -> int:
    reader = array_record_module.ArrayRecordReader(path, RANDOM_ACCESS)
    try:
      return int(reader.num_records())
    finally:
      reader.close()

  if not any(_storage.is_url(p) for p in paths):
    return [count(p) for p in paths]
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  # array_record's reader takes no timeout of ours: the wait is bounded here (one operation's bound for
  # the lot, as they run in parallel); past it, futures.TimeoutError, and the copies are counted instead.
  pool = futures.ThreadPoolExecutor(max_workers=min(16, len(paths)))
  try:
    return list(pool.map(count, paths, timeout=store_bounds.object_store_bounds().operation_seconds))
  finally:
    pool.shutdown(wait=False, cancel_futures=True)


RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"
# The variable array_record's own GCS client takes an emulator's address from (gcsfs's is STORAGE_EMULATOR_HOST).
ARRAY_RECORD_EMULATOR_ENV = "CLOUD_STORAGE_EMULATOR_ENDPOINT"


def _emulator_mismatch(paths: list[str]) -> str | None:
  """Why array_record's reader would not reach the store gcsfs reads (an emulator set for one client only)."""
  if not any(_storage.is_url(p) for p in paths) or not os.environ.get("STORAGE_EMULATOR_HOST"):
    return None
  if os.environ.get(ARRAY_RECORD_EMULATOR_ENV):
    return None
  return (f"STORAGE_EMULATOR_HOST is set ({os.environ['STORAGE_EMULATOR_HOST']}) but {ARRAY_RECORD_EMULATOR_ENV}, "
          "which array_record's own GCS reader takes, is not: it would read the real store, not the emulator. Set "
          f"{ARRAY_RECORD_EMULATOR_ENV} to the same address")


class _ArrayRecordCopies:
  """How an ArrayRecord copy is opened, closed and footed (its record count)."""

  @staticmethod
  def open(copy: str) -> Any:
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

    return array_record_module.ArrayRecordReader(copy, RANDOM_ACCESS)

  @staticmethod
  def footer(reader: Any) -> list[int]:
    return [int(reader.num_records())]

  @staticmethod
  def close(reader: Any) -> None:
    reader.close()

  @staticmethod
  def says(footer: list[int]) -> str:
    return f"{footer[0]:,} records"


class _ParquetCopies:
  """How a Parquet copy is opened (pyarrow's own file, its footer parsed once), closed and footed."""

  @staticmethod
  def open(copy: str) -> Any:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    return pq.ParquetFile(copy)

  @staticmethod
  def footer(reader: Any) -> list[int]:
    metadata = reader.metadata
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]

  @staticmethod
  def close(reader: Any) -> None:
    reader.close()

  @staticmethod
  def says(footer: list[int]) -> str:
    return f"row groups of {footer[:8]} rows"


COPY_KINDS = {"array_record": _ArrayRecordCopies, "parquet": _ParquetCopies}


class OpenReaders:
  """This process's open readers of a source's copies in a ShardCache (ArrayRecord or Parquet, `kind`), least
  recently used first.

  A copy is held (its descriptor open: a shared flock, in use) while its
  reader is open; past `max_open` the idle ones are closed, so the cache may
  evict them. A reader is opened once for many reads: its footer parsed and
  checked against the one the source was built with at its opening only.
  Picklable: a Grain worker opens its own.
  """

  def __init__(self, cache: _shard_cache.ShardCache, paths: list[str], identities: list[_storage.Identity],
               max_open: int, kind: str = "array_record"):
    self.cache, self.paths, self.identities, self.max_open = cache, paths, identities, max_open
    self.kind = kind
    self._open = _open_files.OpenFiles()  # file index -> OpenFile (its descriptor and reader)

  def counts(self, indices: Sequence[int]) -> list[int]:
    """The record counts of ArrayRecord files `indices`: from their footers where they are (array_record's own
    reader, in parallel), else, where that reader cannot open the store's files, from the files' copies,
    downloaded."""
    paths = [self.paths[i] for i in indices]
    mismatch = _emulator_mismatch(paths)
    try:
      if mismatch is not None:
        raise RuntimeError(mismatch)  # it would wait out the operation bound on the real store
      return record_counts(paths)
    except Exception as e:  # pylint: disable=broad-except  (its reader raises bare RuntimeErrors; or timed out)
      _log.warning("ArrayRecord: counting %d files' records where they are failed (%s): downloading every file "
                   "to count its copy instead", len(paths), e)
    found = []
    for path, identity in zip(paths, [self.identities[i] for i in indices]):
      fd = self.cache.open(path, identity)
      try:
        found.append(record_counts([self.cache.entry_path(path, identity)])[0])
      finally:
        os.close(fd)
    return found

  def read(self, file_index: int, use: Callable[[Any], Any], footer: list[int], indexed: bool = False) -> Any:
    """`use(reader)` of file `file_index`'s copy, whose footer must be `footer` (`indexed`: the footer the
    source was built with came from a corpus index)."""
    entry = self._open.use(file_index) or self._opened(file_index, footer, indexed)
    try:
      return use(entry.reader)
    finally:
      self._open.done(entry)

  def _opened(self, file_index: int, footer: list[int], indexed: bool) -> _open_files.OpenFile:
    kind = COPY_KINDS[self.kind]
    path, found = self.paths[file_index], self.identities[file_index]
    fd = self.cache.open(path, found)
    try:
      reader = kind.open(self.cache.entry_path(path, found))
      holds = kind.footer(reader)
      if holds != footer:
        kind.close(reader)
        raise miscounted(self.cache, path, found, holds, footer, indexed, kind.says, (self.paths, self.identities))
    except BaseException:
      os.close(fd)
      raise
    opened = _open_files.OpenFile(fd, reader)
    entry, evicted = self._open.add(file_index, opened, limit=self.max_open, evict=self._evict)
    if entry is not opened:  # another thread opened it meanwhile
      self._close(opened)
    if evicted:
      self.cache.make_room(0)
    return entry

  def _evict(self, file_index: int, entry: _open_files.OpenFile) -> None:
    self.cache.touch(self.paths[file_index], self.identities[file_index])  # its last use, for eviction
    self._close(entry)

  def is_open(self, file_index: int) -> bool:
    """Whether this process has file `file_index`'s reader open."""
    return file_index in self._open

  def close_idle(self, keep: Sequence[int]) -> None:
    closing = self._open.take_idle(set(keep))
    for _, entry in closing:
      self._close(entry)
    if closing:
      self.cache.make_room(0)

  def _close(self, entry: _open_files.OpenFile) -> None:
    COPY_KINDS[self.kind].close(entry.reader)
    os.close(entry.fd)
