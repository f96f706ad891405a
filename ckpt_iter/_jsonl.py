"""JSONL files as a record source: `JsonlSource`.

A JSONL file is indexed by the byte offsets of its lines (`_line_index`: 16
bytes per line, blank lines left out, cached between runs), and each record
is read by its byte range (`os.pread` locally, one ranged GET on an object
store). Through a `ShardCache`, each file is copied whole on its first read
and its index kept beside the copy; a process keeps a bounded number of
copies open, and small copies read whole in memory.

`JsonlSource` is public as `ckpt_iter.sources.JsonlSource`, and named so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import threading
from typing import Any, Sequence

import numpy as np

from ckpt_iter import _compression
from ckpt_iter import _corpus_index
from ckpt_iter import _line_index
from ckpt_iter import _open_files
from ckpt_iter import _shard_cache
from ckpt_iter import _source_files
from ckpt_iter import _storage
from ckpt_iter import errors

# A copy this small is read whole when opened (checked), indexed from those bytes and kept in memory, its
# descriptor closed: one read, where the index kept beside it costs three (its seal, its index, its count) and
# each record a read of its own, and no descriptor held, so a global shuffle over many small files does not
# open them again and again past `max_open_files`. A source keeps at most _HELD_BYTES of them, least recently
# used dropped first.
_SMALL_COPY_BYTES = 64 * 2**10
_HELD_BYTES = 64 * 2**20
_INDEX_HEADER_BYTES = 4096  # an .npy header is 128 bytes; anything read past the lines' 16 bytes is not an index


class JsonlSource(_source_files.FileSource):
  """Records of one or more JSONL files, indexed by line offset.

  The line index of each file is cached (see `index_cache_location`), so a restart
  reads a few bytes per unchanged file instead of the whole file.

  With `cache` (a `ShardCache`), each file is downloaded whole into the cache
  on its first read and read there: its line index is built from the local
  copy and kept beside it (evicted with it), so no index of the whole corpus
  is held; a restart on the same host reads only the files' metadata. When a
  record's file differs from the one this thread read before, the next
  `prefetch_files` files (by index) are downloaded in the background; read
  by make_dataset(shuffle="shards"), the files the plan reads next instead.

  Args:
    paths: the JSONL files, in order: one path (str or os.PathLike), a glob,
      or a list of them, local or gs:// (a glob's matches sorted).
    index_cache_dir: where line indexes are cached. None: the directory in
      the CKPT_ITER_INDEX_CACHE_DIR environment variable, else
      `~/.cache/ckpt_iter/jsonl_index` (not next to the data, which may be
      read-only or shared). "" disables the cache. Not used with `cache`.
    cache: a `ShardCache` to copy the files into (local files too), or None
      to read them in place (one ranged GET per record on gs://).
    prefetch_files: with `cache`, how many files after the current one to
      download ahead (0: none, neither by index nor by a shard plan).
    max_open_files: with `cache`, how many local copies a process keeps open
      (in use, so never evicted) at most. None: every file when the cache
      holds them all (a global shuffle then never re-opens a copy), within
      half the process's open-file limit; else 16.
    corpus_index: with `cache`, take each file's record count from the
      index object `ckpt-iter index` wrote beside the files
      (`ckpt_iter_index.json`), when it indexes the file as it is now: a
      new host then reads one small object per directory instead of
      downloading every file to count it (
      https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/bucket.md).
    files_from_index: name the files, and on an object store take their
      versions, from the index objects of their directories instead of
      listing the store: a start reads one object per directory (a
      listing costs a request per thousand objects, in every process). The
      index is then the corpus: a file written after `ckpt-iter index` is
      not read, and an object rewritten since is refused when read.
  """

  # Its public home: a hand-built Grain graph's fingerprint names its source by module and class
  # (`_graph._source_params`), and pickles name the class by it, as they did before this module existed.
  __module__ = "ckpt_iter.sources"
  suffixes = (".jsonl",) + tuple(".jsonl" + suffix for suffix in _compression.COMPRESSED_SUFFIXES)

  def __init__(self, paths: _source_files.PathsArg, *, index_cache_dir: str | None = None,
               cache: _shard_cache.ShardCache | None = None, prefetch_files: int = 2,
               max_open_files: int | None = None, corpus_index: bool = True, files_from_index: bool = False):
    """Indexes `paths` (or reads their cached indexes); see the class docstring for the arguments."""
    _source_files.check_index_options("JsonlSource", corpus_index, files_from_index)
    expanded = _source_files.expand_paths(paths, "JsonlSource", files_from_index=files_from_index)
    self._paths = [_storage.absolute(p) for p in expanded]
    self._file_index = {path: index for index, path in enumerate(self._paths)}  # a prefetch's file, by path
    # From a glob's listing, else one metadata request per file, in parallel on an object store.
    self._identities = _storage.identities(self._paths, listed=getattr(expanded, "listed", None))
    if cache is None and any(_compression.compression_of(p) for p in self._paths):
      # A compressed file has no byte ranges to read in place: it is read decompressed from a cache.
      cache = _shard_cache.ShardCache.from_env() or _shard_cache.ShardCache(
          _line_index.default_decompression_cache(), _shard_cache.DEFAULT_MAX_BYTES)
    self._cache = cache
    self._prefetch_files = max(0, int(prefetch_files))
    self._planned = False  # `follow_plan`: prefetch by plan, not by file index
    self._max_open_files = max(1, int(max_open_files or _DEFAULT_OPEN_FILES))
    self._local = threading.local()
    self._init_open()
    self._indexed: set[str] = set()  # the files whose count came from a corpus index object
    self._use_corpus_index = bool(corpus_index)
    if cache is not None:
      counts = self._cached_counts(getattr(expanded, "indexes", None))
      self._starts: list[np.ndarray] = []
      self._ends: list[np.ndarray] = []
      self._readers: list[_storage.RangeReader] = []
    else:
      cache_dir = _line_index.index_cache_location(index_cache_dir)
      self._starts, self._ends, self._readers = [], [], []
      for path, found in zip(self._paths, self._identities):
        starts, ends = _line_index.cached_line_index(path, cache_dir, found)
        self._starts.append(starts)
        self._ends.append(ends)
        # Pinned to the version the index was made of.
        self._readers.append(_storage.RangeReader(path, found))
      counts = [len(s) for s in self._starts]
    self._offsets = np.cumsum([0] + counts).tolist()
    if cache is not None and max_open_files is None and sum(self.cached_bytes()) <= cache.max_bytes:
      self._max_open_files = max(self._max_open_files, min(len(self._paths), _open_file_allowance()))

  @property
  def cache(self) -> _shard_cache.ShardCache | None:
    """The `ShardCache` the files are read through, or None."""
    return self._cache

  def file_offsets(self) -> list[int]:
    """The index of each file's first record, and the total (the files' line counts, summed)."""
    return list(self._offsets)

  def file_position(self, index: int) -> tuple[str, str]:
    """(file, "line N") of record `index` (lines numbered from 1, blank lines counted out)."""
    file_index, line = _source_files.locate(self._offsets, index, len(self))
    return self._paths[file_index], f"line {line + 1}"

  def identities(self) -> list[_storage.Identity]:
    """Each file's size and version (generation and crc32c on an object store), as read when built."""
    return list(self._identities)

  def __len__(self) -> int:
    return self._offsets[-1]

  def __getitem__(self, index: int) -> Any:
    file_index, line = _source_files.locate(self._offsets, index, len(self))
    if self._cache is not None:
      data = self._cached_read(file_index, line)
    else:
      start = int(self._starts[file_index][line])
      end = int(self._ends[file_index][line])
      data = self._readers[file_index].read(start, end)
    try:
      return json.loads(data)
    except ValueError as e:
      raise errors.InvalidStateError(
          f"{self._paths[file_index]} line {line + 1}: not valid JSON ({e})."
      ) from None

  # -- through a ShardCache --------------------------------------------------

  def __getstate__(self):
    state = super().__getstate__()
    for name in ("_open", "_closed", "_closed_bytes", "_held", "_held_bytes", "_open_lock", "_open_pid"):
      state.pop(name, None)
    return state

  def __setstate__(self, state):
    super().__setstate__(state)
    self._init_open()

  def _init_open(self) -> None:
    # This process's open local copies: file index -> _OpenCopy, least recently used first.
    self._open = _open_files.OpenFiles()
    # The line indexes of copies it closed, by file index, while the copy is the same (`_kept_index`).
    self._closed: collections.OrderedDict[int, _OpenCopy] = collections.OrderedDict()
    self._closed_bytes = 0
    # The small copies read whole (`_SMALL_COPY_BYTES`), no descriptor open, least recently used first; they
    # and the closed copies' indexes under `_open_lock` (the open copies under their own).
    self._held: collections.OrderedDict[int, _OpenCopy] = collections.OrderedDict()
    self._held_bytes = 0
    self._open_lock = threading.Lock()
    self._open_pid = os.getpid()

  @property
  def max_open_files(self) -> int:
    """How many local copies a process keeps open (with `cache`)."""
    return self._max_open_files

  def files_kept_open(self) -> int:
    """How many of its files a process must keep open to read them all without opening one again: those
    not held in memory once read (larger than `_SMALL_COPY_BYTES`, compressed, or all when the small
    ones take more than `_HELD_BYTES`)."""
    small = [found.size for path, found in zip(self._paths, self._identities)
             if found.size <= _SMALL_COPY_BYTES and not _compression.compression_of(path)]
    return len(self._paths) if sum(small) > _HELD_BYTES else len(self._paths) - len(small)

  @property
  def prefetch_files(self) -> int:
    """How many files ahead a cached source downloads (0: no prefetch, by file index or by plan)."""
    return self._prefetch_files if self._cache is not None else 0

  def follow_plan(self) -> None:
    """Stops prefetching the next files by index: a plan that knows its next files prefetches them instead.

    make_dataset(shuffle="shards") calls it (see `_plan_prefetch`).
    """
    self._planned = True

  def prefetch(self, file_indices: Sequence[int]) -> None:
    """Downloads these files (indices into `paths`, modulo their count) and their indexes in the background.

    With no `cache` it does nothing. Files this process has open or holds
    are skipped; files already cached are marked as just used (so eviction
    spares them), the others queued in the given order. The reader calls it
    with the next `prefetch_files` files when it enters a file; a plan that
    knows its next files (a shard-aware shuffle) calls it with them, and each
    is then held open until the plan releases it: a small one already cached
    opened here, the others by the prefetch threads.
    """
    if self._cache is None or not file_indices:
      return
    count = len(self._paths)
    if self._open_pid != os.getpid():  # a forked worker: its own descriptors, and its own lock
      self._init_open()
    with self._open_lock:
      wanted = [i for i in dict.fromkeys(i % count for i in file_indices)
                if i not in self._open and i not in self._held]
    if self._planned:
      # Held open from now until the plan releases them: in use, so no process of this host evicts a
      # file a reader here will read (each file is downloaded once per epoch and host). A small file already
      # cached is opened here, read whole: handing it to a prefetch thread costs more than that open.
      later = []
      for i in wanted:
        path, found = self._paths[i], self._identities[i]
        try:
          fd = self._cache.open_cached(path, found) if found.size <= _SMALL_COPY_BYTES else None
          if fd is not None:
            self._adopt(i, fd, readers=0)
            continue
        except (errors.StorageError, errors.InvalidStateError, OSError):
          pass  # a copy that fails here is the background's to fetch again, or to log
        later.append(i)
      self._cache.prefetch([(self._paths[i], self._identities[i]) for i in later], then=self._hold)
      return
    missing = []
    for i in wanted:
      path, found = self._paths[i], self._identities[i]
      if self._cache.has(path, found) and os.path.exists(self._cache.index_path(path, found)):
        self._cache.touch(path, found)
      else:
        missing.append((path, found))
    if missing:
      self._cache.prefetch(missing, then=self._prepare_index)

  def _hold(self, path: str, found: _storage.Identity, fd: int) -> None:
    """Keeps the prefetch's copy of `path` open in this process (a prefetch by plan), idle until read or
    released: its descriptor duplicated (the same shared lock), not the copy opened and checked again."""
    del found
    file_index = self._file_index[path]
    with self._open_lock:
      if file_index in self._open or file_index in self._held:
        return
    self._adopt(file_index, os.dup(fd), readers=0)

  def cached_bytes(self) -> list[int]:
    """What each file takes in the cache: its copy and its line index (16 bytes a line and a header)."""
    counts = np.diff(self._offsets).tolist()
    return [found.size + 16 * count + 128 for found, count in zip(self._identities, counts)]

  def release(self, keep: Sequence[int]) -> None:
    """Closes this process's copies of the files not in `keep` that no read holds: a plan is done with them.

    A closed copy is no longer in use, so the cache may evict it (its last
    use is left as it was: it goes before the files read now); it does so
    at once when the cache is over its limit, so that the cache exceeds
    `max_bytes` by no more than the copies its readers hold open.
    """
    if self._cache is None or self._open_pid != os.getpid():
      return
    kept = set(keep)
    closing = self._open.take_idle(kept)
    with self._open_lock:
      for i, copy in closing:
        self._close(i, copy)
      for i in [i for i in self._held if i not in kept]:  # no descriptor: only the memory to give back
        self._held_bytes -= len(self._held.pop(i).data)
    if closing:
      self._cache.make_room(0)

  def _cached_counts(self, indexes: dict[str, Any] | None) -> list[int]:
    """Each file's line count: stored in the cache (from its copy, else as the corpus index gave it), else in
    the corpus's index object beside the files (`_corpus_index`, one read per directory unless `indexes`
    holds it, its counts then kept in the cache: a warm restart reads no index), else counted from a
    download (in parallel)."""
    cache = self._cache
    # The index's counts as a build kept them, one object for these files at these versions: a warm restart
    # opens nothing a file (dropped when a copy says otherwise: `_miscounted`).
    kept = cache.read_footers(self._paths, self._identities) if self._use_corpus_index else None
    if kept is not None and all(len(count) == 1 for count in kept):
      self._indexed = set(self._paths)
      counts: list[int | None] = [count[0] for count in kept]
    else:
      counts = [cache.read_count(p, f) for p, f in zip(self._paths, self._identities)]
    missing = [i for i, c in enumerate(counts) if c is None]
    if missing and self._use_corpus_index:
      indexed = _corpus_index.counts([self._paths[i] for i in missing], [self._identities[i] for i in missing],
                                     indexes)
      for i, count in zip(missing, indexed):
        counts[i] = count
        if count is not None:
          self._indexed.add(self._paths[i])
      if any(count is not None for count in indexed) and all(count is not None for count in counts):
        with contextlib.suppress(errors.StorageError):  # a cache that cannot be written only forgets it
          cache.write_footers(self._paths, self._identities, [[count] for count in counts])
    # A file counted 0 is never opened, so no read would check its count again: one with bytes is
    # counted from its copy here (a file of blank lines only is rare; its copy is then read at builds).
    zeros = {i for i, c in enumerate(counts) if c == 0 and self._identities[i].size > 0}
    missing = [i for i, c in enumerate(counts) if c is None or i in zeros]
    if len(missing) > 1:
      cache.prefetch([(self._paths[i], self._identities[i]) for i in missing], then=self._prepare_index)
      cache.wait()
    for i in missing:
      path, found = self._paths[i], self._identities[i]
      counts[i] = None if i in zeros else cache.read_count(path, found)
      if counts[i] is None:  # not prefetched, its prefetch failed (raised here), or a zero to look at
        self._prepare_index(path, found)
        counts[i] = cache.read_count(path, found)
      if i in zeros and counts[i] and path in self._indexed:
        raise self._miscounted(path, counts[i], 0)
    return counts

  def _miscounted(self, path: str, holds: int, counted: int) -> errors.InvalidStateError:
    """The error of a copy holding another number of records than the source was built counting; the count
    kept from an index is the copy's from now on (the build the error asks for counts it right)."""
    if path in self._indexed:
      self._cache.forget_footers(self._paths, self._identities)
    directory = path.rsplit("/", 1)[0]
    return errors.InvalidStateError(
        f"{path}: its copy in the shard cache {self._cache.directory} holds {holds:,} records, "
        f"this source was built counting {counted:,}"
        + (f" (the count of {_corpus_index.location(directory)}, which is wrong for it: index the corpus "
           f"again with {errors.index_command(directory)})" if path in self._indexed else "")
        + ". Build the source again (make_dataset).")

  def _prepare_index(self, path: str, found: _storage.Identity, fd: int | None = None) -> None:
    """Builds the line index of the copy of `path` (open as `fd`, from a prefetch; else opened here)."""
    if fd is not None:
      self._load_index(path, found, fd)
      return
    fd = self._cache.open(path, found)
    try:
      self._load_index(path, found, fd)
    finally:
      os.close(fd)

  def _load_index(self, path: str, found: _storage.Identity, fd: int) -> tuple[np.ndarray, np.ndarray]:
    """The line index of the local copy of `path` (open as `fd`, checked): kept beside it, or built there."""
    # An index holds 16 bytes a line, and a line takes a byte of the copy at least.
    array = self._cache.record_index(path, found, fd, build=_line_index.line_index_array,
                                     max_bytes=_INDEX_HEADER_BYTES + 16 * (os.fstat(fd).st_size + 1))
    if array.ndim != 2 or len(array) != 2:
      raise errors.InvalidStateError(f"{path}: the index beside its copy in {self._cache.directory} is not a line "
                                     "index (edited). Delete it; it is rebuilt from the copy.")
    return array[0], array[1]

  def _cached_read(self, file_index: int, line: int) -> bytes:
    copy = self._open_copy(file_index)
    if copy.data is not None:  # held whole: no count of readers to give back
      return copy.data[int(copy.starts[line]):int(copy.ends[line])]
    try:
      start = int(copy.starts[line])
      return os.pread(copy.fd, int(copy.ends[line]) - start, start)
    finally:
      self._open.done(copy)

  def _open_copy(self, file_index: int) -> "_OpenCopy":
    """This process's copy of a file: held whole, or open with one reader more (the caller releases it)."""
    if self._open_pid != os.getpid():  # a forked worker: its own descriptors, and its own lock
      self._init_open()
    copy = self._in_memory(file_index)
    if copy is not None:
      return copy
    # Entering a file this process has not open: the next ones are downloaded ahead (unless a plan says), when
    # this thread reads the files in order (a global shuffle hops between files: the next by index is no guess).
    previous, self._local.entered = getattr(self._local, "entered", None), file_index
    if self._prefetch_files and not self._planned and previous in (None, file_index - 1):
      self.prefetch(range(file_index + 1, file_index + 1 + self._prefetch_files))
    path, found = self._paths[file_index], self._identities[file_index]
    if self._planned and self._cache.wait_for(path, found):
      copy = self._in_memory(file_index)  # the plan's prefetch of this file, under way, holds it open now (`_hold`)
      if copy is not None:
        return copy
    return self._adopt(file_index, self._cache.open(path, found), readers=1)

  def _adopt(self, file_index: int, fd: int, *, readers: int) -> "_OpenCopy":
    """This process's open copy of a file, from `fd` (a checked descriptor holding the copy's shared lock,
    now owned here) and its line index, with `readers` readers; the copy already open if another thread
    opened it meanwhile (then `fd` is closed)."""
    path, found = self._paths[file_index], self._identities[file_index]
    try:
      data = _small_copy_bytes(fd)
      if data is not None:
        key, (starts, ends) = (), _line_index.index_lines_of(data)
      else:
        key = _shard_cache.copy_identity(fd)
        starts, ends = self._kept_index(file_index, key) or self._load_index(path, found, fd)
      expected = self._offsets[file_index + 1] - self._offsets[file_index]
      if len(starts) != expected:
        if data is not None:
          self._load_index(path, found, fd)  # its count kept beside it: the build the error asks for reads it
        raise self._miscounted(path, len(starts), expected)
    except BaseException:
      os.close(fd)
      raise
    if data is not None:
      os.close(fd)  # the bytes, checked when opened, are all a read needs
      return self._keep_in_memory(file_index, _OpenCopy(None, starts, ends, data=data))
    # Past the limit, idle copies are closed (least recently used first): they may be evicted. A plan closes
    # the copies it is done with itself (`release`), and keeps those it reads next.
    opened = _OpenCopy(fd, starts, ends, key)
    copy, evicted = self._open.add(file_index, opened, readers, limit=None if self._planned else self._max_open_files,
                                   evict=self._evict)
    if copy is not opened:  # another thread opened it meanwhile
      os.close(fd)
    else:
      with self._open_lock:
        kept = self._closed.pop(file_index, None)
        if kept is not None:
          self._closed_bytes -= kept.starts.nbytes + kept.ends.nbytes
    if evicted:
      self._cache.make_room(0)  # what it closed may make the cache over its limit
    return copy

  def _evict(self, file_index: int, copy: "_OpenCopy") -> None:
    self._cache.touch(self._paths[file_index], self._identities[file_index])  # its last use, for eviction
    with self._open_lock:
      self._close(file_index, copy)

  def _in_memory(self, file_index: int) -> "_OpenCopy | None":
    """This process's copy of a file, open (one reader more) or held, marked as just used."""
    copy = self._open.use(file_index)
    if copy is not None:
      return copy
    with self._open_lock:
      copy = self._held.get(file_index)
      if copy is not None:
        self._held.move_to_end(file_index)
      return copy

  def _keep_in_memory(self, file_index: int, copy: "_OpenCopy") -> "_OpenCopy":
    """Holds a small copy read whole, dropping the least recently used past `_HELD_BYTES`; the copy held (one
    another thread kept meanwhile, if so). A read holds no count of it: a read under way keeps its own."""
    with self._open_lock:
      kept = self._held.get(file_index)
      if kept is None:
        kept = self._held[file_index] = copy
        self._held_bytes += len(copy.data)
        while self._held_bytes > _HELD_BYTES and len(self._held) > 1:
          self._held_bytes -= len(self._held.popitem(last=False)[1].data)
      else:
        self._held.move_to_end(file_index)
      return kept

  def _close(self, file_index: int, copy: "_OpenCopy") -> None:
    """Closes this process's copy of a file, taken out of the open ones (the open lock held), keeping its line
    index while memory allows."""
    os.close(copy.fd)
    size = copy.starts.nbytes + copy.ends.nbytes
    if size > _CLOSED_INDEX_BYTES:
      return
    self._closed[file_index] = copy
    self._closed_bytes += size
    while self._closed_bytes > _CLOSED_INDEX_BYTES:
      _, dropped = self._closed.popitem(last=False)
      self._closed_bytes -= dropped.starts.nbytes + dropped.ends.nbytes

  def _kept_index(self, file_index: int, key: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """The line index this process had of a copy it closed, when the copy open now is that one (the same
    inode, size and change time: a copy evicted and downloaded again, or altered, is indexed anew)."""
    with self._open_lock:
      kept = self._closed.get(file_index)  # left there until the copy is open (threads opening it at once)
    return (kept.starts, kept.ends) if kept is not None and kept.key == key else None


_DEFAULT_OPEN_FILES = 16


def _open_file_allowance() -> int:
  """How many copies a source may keep open when the cache holds them all: half the open-file limit."""
  import resource  # pylint: disable=g-import-not-at-top

  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  return max(_DEFAULT_OPEN_FILES, (soft if soft != resource.RLIM_INFINITY else 2**16) // 2)


# A process keeps the line indexes of the copies it closed up to this many bytes (16 a line): re-opening a
# copy then costs an open, not a read of its index (a global shuffle over more files than max_open_files
# re-opens one at most reads).
_CLOSED_INDEX_BYTES = 64 * 2**20


@dataclasses.dataclass
class _OpenCopy:
  """A local copy a process holds open (a shared flock: in use), with its line index and its key; or a small
  copy held in memory, read whole (`data`), no descriptor open."""

  fd: int | None
  starts: np.ndarray
  ends: np.ndarray
  key: tuple[int, ...] = ()
  readers: int = 0
  data: bytes | None = None  # the whole copy, when small (`_SMALL_COPY_BYTES`): records are sliced from it



def _small_copy_bytes(fd: int) -> bytes | None:
  """The whole copy open as `fd` (checked when opened) when it is small (`_SMALL_COPY_BYTES`), else None."""
  size = os.fstat(fd).st_size
  if size > _SMALL_COPY_BYTES:
    return None
  data = os.pread(fd, size, 0)
  return data if len(data) == size else None
