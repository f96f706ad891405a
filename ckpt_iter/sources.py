"""Random-access record sources: in-memory, JSONL, Parquet, ArrayRecord, Hugging Face.

Every source here has `__len__` and `__getitem__` (Grain's RandomAccessDataSource
protocol), returns one record (a dict) per index, and reads files lazily: a
JSONL file is indexed by line offsets (16 bytes per line), cached between runs
(see `index_cache_location`), and records are read by byte range (`os.pread`
locally, one ranged GET on an object store); Parquet is read one row group at
a time; ArrayRecord files hold one UTF-8 JSON object per record; a Hugging
Face `datasets.Dataset` is Arrow memory-mapped from its cache. All are
picklable, so Grain worker processes can use them.

File paths may be local or URLs (gs://...): JSONL and Parquet files are read
through `_storage` (fsspec), ArrayRecord files by array_record's own reader,
which opens gs:// itself.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
from typing import Any, Sequence, Union

import numpy as np

from ckpt_iter import _shard_cache
from ckpt_iter import _storage
from ckpt_iter._shard_cache import ShardCache
from ckpt_iter import errors
from ckpt_iter import state as state_lib

__all__ = [
    "ArrayRecordSource",
    "HuggingFaceSource",
    "JsonlSource",
    "ParquetSource",
    "ShardCache",
    "SourceIdentity",
    "resolve_source",
]

FILE_SUFFIXES = (".jsonl", ".parquet", ".array_record")
INDEX_CACHE_ENV = "CKPT_ITER_INDEX_CACHE_DIR"
_INDEX_CHUNK_BYTES = 16 * 2**20
_DIGEST_SAMPLES = 64
_LISTED_FILES = 4


@dataclasses.dataclass(frozen=True)
class SourceIdentity:
  """What identifies a source in a fingerprint.

  Attributes:
    description: kind and file names with byte sizes (not absolute paths, so
      a checkpoint survives moving the data to another mount point).
    length: number of records.
    digest: sha256 prefix over up to 64 evenly spaced records; for files
      on an object store, over each file's name, size and version
      (generation and crc32c) instead, from metadata fetched in parallel
      (`sample_digest`): a rewritten object changes it either way.
  """

  description: str
  length: int
  digest: str


class _FileReader:
  """Per-thread reading state that survives pickling (for Grain workers)."""

  _paths: list[str]

  def __getstate__(self):
    state = self.__dict__.copy()
    state.pop("_local", None)
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._local = threading.local()

  @property
  def paths(self) -> list[str]:
    """The files, in the order their records are numbered."""
    return list(self._paths)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({len(self._paths)} files, {len(self)} records)"


class JsonlSource(_FileReader):
  """Records of one or more JSONL files, indexed by line offset.

  The line index of each file is cached (see `_index_cache`), so a restart
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
      (in use, so never evicted) at most.
  """

  def __init__(self, paths: PathsArg, *, index_cache_dir: str | None = None,
               cache: _shard_cache.ShardCache | None = None, prefetch_files: int = 2,
               max_open_files: int = 16):
    """Indexes `paths` (or reads their cached indexes); see the class docstring for the arguments."""
    self._paths = [_storage.absolute(p) for p in _expand_paths(paths, "JsonlSource")]
    # One metadata request per file, in parallel on an object store.
    self._identities = _storage.identities(self._paths)
    self._cache = cache
    self._prefetch_files = max(0, int(prefetch_files))
    self._planned = False  # `follow_plan`: prefetch by plan, not by file index
    self._max_open_files = max(1, int(max_open_files))
    self._local = threading.local()
    self._init_open()
    if cache is not None:
      counts = self._cached_counts()
      self._starts: list[np.ndarray] = []
      self._ends: list[np.ndarray] = []
      self._readers: list[_storage.RangeReader] = []
    else:
      cache_dir = index_cache_location(index_cache_dir)
      self._starts, self._ends, self._readers = [], [], []
      for path, found in zip(self._paths, self._identities):
        starts, ends = _cached_line_index(path, cache_dir, found)
        self._starts.append(starts)
        self._ends.append(ends)
        # Pinned to the version the index was made of.
        self._readers.append(_storage.RangeReader(path, found))
      counts = [len(s) for s in self._starts]
    self._offsets = np.cumsum([0] + counts).tolist()

  @property
  def cache(self) -> _shard_cache.ShardCache | None:
    """The `ShardCache` the files are read through, or None."""
    return self._cache

  def identities(self) -> list[_storage.Identity]:
    """Each file's size and version (generation and crc32c on an object store), as read when built."""
    return list(self._identities)

  def __len__(self) -> int:
    return self._offsets[-1]

  def __getitem__(self, index: int) -> Any:
    file_index, line = _locate(self._offsets, index, len(self))
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
    for name in ("_open", "_open_lock", "_open_pid"):
      state.pop(name, None)
    return state

  def __setstate__(self, state):
    super().__setstate__(state)
    self._init_open()

  def _init_open(self) -> None:
    # This process's open local copies: file index -> _OpenCopy, least recently used first.
    self._open: collections.OrderedDict[int, _OpenCopy] = collections.OrderedDict()
    self._open_lock = threading.Lock()
    self._open_pid = os.getpid()

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

    With no `cache` it does nothing. Files this process has open are
    skipped; files already cached are marked as just used (so eviction
    spares them), the others queued in the given order. The reader calls it
    with the next `prefetch_files` files when it enters a file; a plan that
    knows its next files (a shard-aware shuffle) calls it with them.
    """
    if self._cache is None or not file_indices:
      return
    count = len(self._paths)
    if self._open_pid != os.getpid():  # a forked worker: its own descriptors, and its own lock
      self._init_open()
    with self._open_lock:
      wanted = [i for i in dict.fromkeys(i % count for i in file_indices) if i not in self._open]
    missing = []
    for i in wanted:
      path, found = self._paths[i], self._identities[i]
      entry = self._cache.entry_path(path, found)
      if self._cache.has(path, found) and os.path.exists(entry + ".index.npy"):
        self._cache.touch(path, found)
      else:
        missing.append((path, found))
    if missing:
      self._cache.prefetch(missing, then=self._prepare_index)

  def cached_bytes(self) -> list[int]:
    """What each file takes in the cache: its copy and its line index (16 bytes a line and a header)."""
    counts = np.diff(self._offsets).tolist()
    return [found.size + 16 * count + 128 for found, count in zip(self._identities, counts)]

  def release(self, keep: Sequence[int]) -> None:
    """Closes this process's copies of the files not in `keep` that no read holds: a plan is done with them.

    A closed copy is no longer in use, so the cache may evict it (its last
    use is left as it was: it goes before the files read now).
    """
    if self._cache is None or self._open_pid != os.getpid():
      return
    kept = set(keep)
    with self._open_lock:
      for i in [i for i, copy in self._open.items() if copy.readers == 0 and i not in kept]:
        os.close(self._open.pop(i).fd)

  def _cached_counts(self) -> list[int]:
    """Each file's line count: stored in the cache, else counted from a download (in parallel)."""
    cache = self._cache
    counts = [cache.read_count(p, f) for p, f in zip(self._paths, self._identities)]
    missing = [i for i, c in enumerate(counts) if c is None]
    if len(missing) > 1:
      cache.prefetch([(self._paths[i], self._identities[i]) for i in missing], then=self._prepare_index)
      cache.wait()
    for i in missing:
      counts[i] = cache.read_count(self._paths[i], self._identities[i])
      if counts[i] is None:  # not prefetched, or its prefetch failed: again here, raising its error
        self._prepare_index(self._paths[i], self._identities[i])
        counts[i] = cache.read_count(self._paths[i], self._identities[i])
    return counts

  def _prepare_index(self, path: str, found: _storage.Identity) -> None:
    fd = self._cache.open(path, found)
    try:
      self._load_index(path, found)
    finally:
      os.close(fd)

  def _load_index(self, path: str, found: _storage.Identity) -> tuple[np.ndarray, np.ndarray]:
    """The line index of the local copy of `path` (held open by the caller): beside it, or built there."""
    entry = self._cache.entry_path(path, found)
    index_path = entry + ".index.npy"
    try:
      array = np.load(index_path, mmap_mode="r", allow_pickle=False)
      if array.dtype == np.int64 and array.ndim == 2 and array.shape[0] == 2:
        return array[0], array[1]
    except (OSError, ValueError, EOFError):
      pass
    starts, ends = _index_lines(entry)
    array = np.stack([starts, ends]) if len(starts) else np.zeros((2, 0), np.int64)
    self._cache.write_atomic(index_path, lambda f: np.save(f, array, allow_pickle=False))
    self._cache.write_count(path, found, len(starts))
    return starts, ends

  def _cached_read(self, file_index: int, line: int) -> bytes:
    copy = self._open_copy(file_index)
    try:
      start, end = int(copy.starts[line]), int(copy.ends[line])
      return os.pread(copy.fd, end - start, start)
    finally:
      with self._open_lock:
        copy.readers -= 1

  def _open_copy(self, file_index: int) -> "_OpenCopy":
    """This process's open copy of a file, one reader more (the caller releases it)."""
    if self._open_pid != os.getpid():  # a forked worker: its own descriptors, and its own lock
      self._init_open()
    with self._open_lock:
      copy = self._open.get(file_index)
      if copy is not None:
        self._open.move_to_end(file_index)
        copy.readers += 1
        return copy
    # Entering a file this process has not open: the next ones are downloaded ahead (unless a plan says).
    if self._prefetch_files and not self._planned:
      self.prefetch(range(file_index + 1, file_index + 1 + self._prefetch_files))
    path, found = self._paths[file_index], self._identities[file_index]
    fd = self._cache.open(path, found)
    try:
      starts, ends = self._load_index(path, found)
    except BaseException:
      os.close(fd)
      raise
    with self._open_lock:
      copy = self._open.get(file_index)
      if copy is not None:  # another thread opened it meanwhile
        os.close(fd)
      else:
        copy = self._open[file_index] = _OpenCopy(fd, starts, ends)
        # Past the limit, close idle copies (least recently used first): they may be evicted.
        for other in [i for i, c in self._open.items() if c.readers == 0 and i != file_index]:
          if len(self._open) <= self._max_open_files:
            break
          self._cache.touch(self._paths[other], self._identities[other])  # its last use, for eviction
          os.close(self._open.pop(other).fd)
      copy.readers += 1
      return copy


@dataclasses.dataclass
class _OpenCopy:
  """A local copy a process holds open (a shared flock: in use), with its line index."""

  fd: int
  starts: np.ndarray
  ends: np.ndarray
  readers: int = 0



def _index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns start and end byte offsets of the non-blank lines of a file.

  Reads the file in 16 MiB chunks: memory is 16 bytes per line, not the file.
  """
  starts, ends = [], []
  position = 0
  line_start = 0
  with _storage.open_read(path) as f:
    while True:
      chunk = f.read(_INDEX_CHUNK_BYTES)
      if not chunk:
        break
      newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + position
      if len(newlines):
        chunk_starts = np.concatenate([[line_start], newlines[:-1] + 1])
        starts.append(chunk_starts)
        ends.append(newlines)
        line_start = int(newlines[-1]) + 1
      position += len(chunk)
  if line_start < position:
    starts.append(np.array([line_start]))
    ends.append(np.array([position]))
  if not starts:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  start = np.concatenate(starts).astype(np.int64)
  end = np.concatenate(ends).astype(np.int64)
  # Drop blank lines ("" or "\r"); a record line is never that short.
  keep = end - start > 1
  short = np.flatnonzero(end - start == 1)
  if len(short):
    with _storage.open_read(path) as f:
      for i in short:
        f.seek(int(start[i]))
        keep[i] = f.read(1) not in (b"\r", b" ", b"\t")
  return start[keep], end[keep]


# ---------------------------------------------------------------------------
# The JSONL line-index cache: one local .npy per file, an int64 array
#   [magic, version, size, version_digest, line_count, starts..., ends...]
# written atomically, read with allow_pickle=False, and used only when the
# file's size and version (`_storage.identity`: inode, mtime and ctime of a
# local file; generation and checksum of an object) match, and, for a local
# file, the offsets agree with spot-checked bytes of the file. An object's
# generation changes with every write, so a remote file is not spot-checked
# (each check would be a request).

# Smaller files are scanned every time: that takes about a millisecond, and
# caching them would only litter the cache directory.
INDEX_CACHE_MIN_BYTES = 2**20
_CACHE_MAGIC = 0x636B70746964780A  # "ckptidx\n"
_CACHE_VERSION = 2
_CACHE_HEADER = 5
_CACHE_SPOT_CHECKS = 8
_CACHE_MAX_TAIL_BYTES = 64 * 2**10
_LINE_SPACE = frozenset(b"\r\n \t")

_log = logging.getLogger(__name__)


def index_cache_location(index_cache_dir: str | None = None) -> str | None:
  """The directory JSONL line indexes are cached in, or None when disabled."""
  if index_cache_dir is None:
    index_cache_dir = os.environ.get(INDEX_CACHE_ENV)
  if index_cache_dir is None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    index_cache_dir = os.path.join(base, "ckpt_iter", "jsonl_index")
  if index_cache_dir and _storage.is_url(index_cache_dir):
    raise errors.InvalidArgumentError(
        f"index_cache_dir={index_cache_dir!r}: the JSONL index cache must be a local directory "
        f"(it is memory-mapped); pass a local path, or set {INDEX_CACHE_ENV} to one."
    )
  return index_cache_dir or None


def index_cache_path(path: str, cache_dir: str) -> str:
  """The cache file of one JSONL file: keyed by its absolute path or URL."""
  path = _storage.absolute(path)
  key = hashlib.sha256(path.encode()).hexdigest()[:24]
  return os.path.join(cache_dir, f"{key}.{os.path.basename(path)}.ckpt_iter-index.npy")


def _cached_line_index(path: str, cache_dir: str | None,
                       identity: _storage.Identity | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The line index of `path` (`identity`: its identity, if just read): from its cache if valid, else built."""
  identity = identity or _storage.identity(path)
  if cache_dir is None or identity.size < INDEX_CACHE_MIN_BYTES or identity.version is None:
    return _index_lines(path)
  cache_path = index_cache_path(path, cache_dir)
  cached = _read_index_cache(cache_path, path, identity)
  if cached is not None:
    return cached
  starts, ends = _index_lines(path)
  # Cache only an index of a file that did not change while it was read.
  if _storage.identity(path) == identity:
    _write_index_cache(cache_path, identity, starts, ends)
  return starts, ends


def _read_index_cache(
    cache_path: str, path: str, identity: _storage.Identity
) -> tuple[np.ndarray, np.ndarray] | None:
  """The cached (starts, ends) if the cache is intact and matches the file."""
  try:
    # Mapped, not read: the checks below touch the offsets once, and the
    # index is then used in place (no copy of 16 bytes per line).
    array = np.load(cache_path, mmap_mode="r", allow_pickle=False)
  except FileNotFoundError:
    return None
  except (OSError, ValueError, EOFError) as e:  # truncated, not an .npy, pickled
    _log.info("ignoring the unreadable JSONL index cache %s (%s)", cache_path, e)
    return None
  if (
      array.dtype != np.int64 or array.ndim != 1 or len(array) < _CACHE_HEADER
      or array[0] != _CACHE_MAGIC or array[1] != _CACHE_VERSION
  ):
    _log.info("ignoring the JSONL index cache %s: not a version %d index", cache_path, _CACHE_VERSION)
    return None
  size, version, count = (int(v) for v in array[2:5])
  if (size, version) != (identity.size, _storage.version_digest(identity.version)):
    return None  # stale: the file changed since it was indexed
  if len(array) != _CACHE_HEADER + 2 * count:
    return None
  starts = array[_CACHE_HEADER:_CACHE_HEADER + count]
  ends = array[_CACHE_HEADER + count:]
  if not _storage.is_url(path) and not _offsets_agree_with_file(path, size, starts, ends):
    _log.info("ignoring the JSONL index cache %s: it disagrees with %s", cache_path, path)
    return None
  return np.asarray(starts), np.asarray(ends)


def _offsets_agree_with_file(path: str, size: int, starts: np.ndarray, ends: np.ndarray) -> bool:
  """Offsets ordered and in range; spot-checked lines start and end at newlines.

  Reads at most a few dozen bytes plus the tail after the last line: the last
  line must end where the file's records end (only blank space after it).
  """
  count = len(starts)
  if count == 0:
    return _only_space(path, 0, size)
  if starts[0] < 0 or ends[-1] > size or np.any(ends <= starts):
    return False
  if count > 1 and np.any(starts[1:] <= ends[:-1]):
    return False
  checks = sorted({(i * count) // _CACHE_SPOT_CHECKS for i in range(_CACHE_SPOT_CHECKS)} | {count - 1})
  with _storage.open_read(path) as f:
    for i in checks:
      start, end = int(starts[i]), int(ends[i])
      if start > 0:
        f.seek(start - 1)
        if f.read(1) != b"\n":
          return False
      if end < size:
        f.seek(end)
        if f.read(1) != b"\n":
          return False
  return _only_space(path, int(ends[-1]), size)


def _only_space(path: str, start: int, size: int) -> bool:
  if size - start > _CACHE_MAX_TAIL_BYTES:
    return False
  with _storage.open_read(path) as f:
    f.seek(start)
    return all(byte in _LINE_SPACE for byte in f.read(size - start))


def _write_index_cache(
    cache_path: str, identity: _storage.Identity, starts: np.ndarray, ends: np.ndarray
) -> None:
  """Writes the cache atomically; a directory that is not writable is skipped."""
  header = np.array([
      _CACHE_MAGIC, _CACHE_VERSION, identity.size, _storage.version_digest(identity.version), len(starts)
  ], np.int64)
  temporary = f"{cache_path}.tmp-{os.getpid()}-{threading.get_ident()}"
  try:
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with open(temporary, "wb") as f:
      # One .npy array written in parts: no second copy of the index in memory.
      np.lib.format.write_array_header_1_0(f, {
          "descr": np.dtype(np.int64).str, "fortran_order": False,
          "shape": (len(header) + 2 * len(starts),)})
      for part in (header, starts, ends):
        np.ascontiguousarray(part, dtype=np.int64).tofile(f)
    os.replace(temporary, cache_path)
  except OSError as e:
    _log.info("not caching the JSONL line index at %s (%s)", cache_path, e)
    try:
      os.unlink(temporary)
    except OSError:
      pass


class _HeldCopies:
  """Local copies in a ShardCache of every file of a source, held open (in use) while this lives.

  Downloaded in parallel (the cache's prefetch threads) when made. Picklable:
  a Grain worker holds its own, fetching again a copy evicted meanwhile.
  """

  def __init__(self, cache: _shard_cache.ShardCache, paths: list[str], identities: list[_storage.Identity]):
    self.cache, self.paths, self.identities = cache, list(paths), list(identities)
    self._hold()

  def _hold(self) -> None:
    files = list(zip(self.paths, self.identities))
    if len(files) > 1:
      self.cache.prefetch(files)
      self.cache.wait()
    self.fds: list[int] = []
    for path, found in files:
      self.fds.append(self.cache.open(path, found))
    self.local_paths = [self.cache.entry_path(path, found) for path, found in files]

  def __getstate__(self) -> dict[str, Any]:
    return {"cache": self.cache, "paths": self.paths, "identities": self.identities}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._hold()

  def __del__(self) -> None:
    for fd in getattr(self, "fds", ()):
      with contextlib.suppress(OSError):
        os.close(fd)


class ParquetSource(_FileReader):
  """Records of one or more Parquet files, decoded one row group at a time.

  Shuffled access decodes a whole row group per record it misses in the
  cache; write files with small row groups (e.g. 1k rows) for shuffled reads.
  On gs:// each file is read at the generation it had when the source was
  built: a file replaced later is refused, not read half old, half new.

  Args:
    paths: the Parquet files (local or gs://), in order: one path, a glob,
      or a list of them (a glob's matches sorted).
    cache: a `ShardCache`: every file is downloaded whole into it when the
      source is built (in parallel) and read there, held in use while the
      source lives; None reads them in place.
  """

  def __init__(self, paths: PathsArg, *, cache: _shard_cache.ShardCache | None = None):
    """Opens `paths` (their footers, pinned to their current generation on gs://); see the class docstring."""
    pq = _import_pyarrow_parquet()
    self._paths = [_storage.absolute(p) for p in _expand_paths(paths, "ParquetSource")]
    self._cache = cache
    if cache is not None:
      self._identities = _storage.identities(self._paths)
      self._copies = _HeldCopies(cache, self._paths, self._identities)
      self._read_paths = self._copies.local_paths
      self._generations: list[str | None] = [None] * len(self._paths)
    else:
      self._read_paths = self._paths
      # On an object store each file's generation now: every later read is of it.
      self._generations = [_storage.pinned_generation(p) for p in self._paths]
    group_rows = []
    for path, generation in zip(self._read_paths, self._generations):
      with _parquet_file(pq, path, generation) as parquet:
        metadata = parquet.metadata
      group_rows.append(
          [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
      )
    # (file, group) pairs in order, with the global index of each group's first row.
    self._groups = [(f, g) for f, rows in enumerate(group_rows) for g in range(len(rows))]
    counts = [n for rows in group_rows for n in rows]
    self._group_offsets = np.cumsum([0] + counts).tolist()
    self._local = threading.local()

  def __len__(self) -> int:
    return self._group_offsets[-1]

  def __getitem__(self, index: int) -> Any:
    group, row = _locate(self._group_offsets, index, len(self))
    cached = getattr(self._local, "cache", None)
    if cached is None or cached[0] != group or getattr(self._local, "pid", None) != os.getpid():
      pq = _import_pyarrow_parquet()
      file_index, group_index = self._groups[group]
      with _parquet_file(pq, self._read_paths[file_index], self._generations[file_index]) as parquet:
        table = parquet.read_row_group(group_index)
      cached = self._local.cache = (group, table)
      self._local.pid = os.getpid()
    return cached[1].slice(row, 1).to_pylist()[0]

  @property
  def cache(self) -> _shard_cache.ShardCache | None:
    """The `ShardCache` the files are read through, or None."""
    return self._cache

  def identities(self) -> list[_storage.Identity] | None:
    """Each file's size and version as read when built through a cache; None without one."""
    return list(self._identities) if self._cache is not None else None



@contextlib.contextmanager
def _parquet_file(pq: Any, path: str, generation: str | None = None) -> Any:
  """A pyarrow ParquetFile of a local path (read natively) or a URL (through `_storage`)."""
  if not _storage.is_url(path):
    yield pq.ParquetFile(path)
    return
  with _storage.open_read(path, generation) as f:
    yield pq.ParquetFile(f)


class ArrayRecordSource:
  """Records of ArrayRecord files whose records are UTF-8 JSON objects.

  Args:
    paths: the ArrayRecord files (local or gs://, read by array_record's own
      reader), in order: one path, a glob, or a list of them (a glob's
      matches sorted).
    cache: a `ShardCache`: every file is downloaded whole into it when the
      source is built (in parallel) and read there, held in use while the
      source lives; None reads them in place.
  """

  def __init__(self, paths: PathsArg, *, cache: _shard_cache.ShardCache | None = None):
    """Opens `paths` with array_record's reader; see the class docstring."""
    import grain  # pylint: disable=g-import-not-at-top

    paths = _expand_paths(paths, "ArrayRecordSource")
    self._cache = cache
    self._copies = None
    read_paths = list(paths)
    if cache is not None:
      self._identities = _storage.identities([_storage.absolute(p) for p in paths])
      self._copies = _HeldCopies(cache, [_storage.absolute(p) for p in paths], self._identities)
      read_paths = self._copies.local_paths
    self._read_paths = read_paths
    try:
      self._source = grain.sources.ArrayRecordDataSource(read_paths)
    except ImportError as e:
      raise errors.InvalidArgumentError(
          f"reading .array_record files needs the array_record package ({e}). "
          "Install it with: pip install 'ckpt_iter[files]' (or 'array-record>=0.8')"
      ) from None
    self._paths = [_storage.absolute(p) for p in paths]

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> Any:
    return json.loads(self._source[index])

  @property
  def paths(self) -> list[str]:
    """The files, in the order their records are numbered."""
    return list(self._paths)

  @property
  def cache(self) -> _shard_cache.ShardCache | None:
    """The `ShardCache` the files are read through, or None."""
    return self._cache

  def identities(self) -> list[_storage.Identity] | None:
    """Each file's size and version as read when built through a cache; None without one."""
    return list(self._identities) if self._cache is not None else None

  def file_offsets(self) -> list[int]:
    """The global index of each file's first record, and the total (each file's length read once)."""
    import grain  # pylint: disable=g-import-not-at-top

    lengths = [len(grain.sources.ArrayRecordDataSource([path])) for path in self._read_paths]
    return np.cumsum([0] + lengths).tolist()

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self._paths)} files, {len(self)} records)"


class HuggingFaceSource:
  """Records of a Hugging Face `datasets.Dataset` (Arrow-backed, random access).

  Loads by name or path and split: a directory written by
  `Dataset.save_to_disk` / `DatasetDict.save_to_disk` is read with
  `datasets.load_from_disk`, anything else with `datasets.load_dataset`
  (a Hub name, a local dataset script or folder, or a builder such as
  "json" / "parquet" with `data_files`). Or wrap a loaded Dataset:
  `HuggingFaceSource(dataset=ds)`.

  Args:
    path: the dataset's name or path.
    split: the split; needed when the dataset has several.
    name: the dataset's configuration (load_dataset's `name`).
    data_files: passed to load_dataset.
    cache_dir: load_dataset's cache directory (default: Hugging Face's).
    dataset: an already loaded `datasets.Dataset` instead of `path`.
  """

  def __init__(
      self, path: str | None = None, *, split: str | None = None, name: str | None = None,
      data_files: Any = None, cache_dir: str | None = None, dataset: Any = None,
  ):
    """Loads (or wraps) one split of a Hugging Face dataset; see the class docstring for the arguments."""
    if (path is None) == (dataset is None):
      raise errors.InvalidArgumentError("HuggingFaceSource needs exactly one of path= and dataset=.")
    datasets = _import_datasets()
    if dataset is None:
      path = os.fspath(path)
      dataset = _load_hf(datasets, path, split, name, data_files, cache_dir)
      label = path
      if _storage.is_dir(path):
        label = os.path.basename(path.rstrip("/") if _storage.is_url(path) else os.path.normpath(path))
    else:
      label = "dataset"
    if isinstance(dataset, datasets.DatasetDict):
      dataset = _one_split(dataset, split, label)
    if not isinstance(dataset, datasets.Dataset):
      from ckpt_iter import streaming  # pylint: disable=g-import-not-at-top  (the refusal's words)
      if streaming.is_hf_streaming(dataset):
        raise errors.InvalidArgumentError(streaming.hf_streaming_refusal(dataset, f"HuggingFaceSource({label!r})"))
      raise errors.InvalidArgumentError(
          f"Hugging Face source {label!r} is a {type(dataset).__qualname__}, not a datasets.Dataset; "
          "pass one split of a dataset loaded without streaming."
      )
    self._dataset = dataset
    parts = [label] + ([name] if name else []) + ([split] if split else [])
    # Name, configuration and split, no absolute path (as for files); the
    # content is checked by the length and the sampled digest.
    self.description = f"hf[{':'.join(str(p) for p in parts)}]"

  @property
  def dataset(self) -> Any:
    """The `datasets.Dataset` records are read from."""
    return self._dataset

  def __len__(self) -> int:
    return len(self._dataset)

  def __getitem__(self, index: int) -> Any:
    if not isinstance(index, (int, np.integer)):
      raise TypeError(f"record index must be an integer, got {type(index).__name__}")
    return self._dataset[int(index)]

  def __repr__(self) -> str:
    return f"HuggingFaceSource({self.description}, {len(self)} records)"


def _import_datasets():
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidArgumentError(
        "reading Hugging Face datasets needs the datasets package. Install it with: "
        "pip install 'ckpt_iter[hf]' (or pip install datasets)"
    ) from None
  return datasets


def _is_saved_to_disk(path: str) -> bool:
  """A directory written by save_to_disk (a Dataset's or a DatasetDict's)."""
  return _storage.is_dir(path) and any(
      _storage.is_file(os.path.join(path, marker)) for marker in ("state.json", "dataset_dict.json")
  )


def _load_hf(datasets: Any, path: str, split: str | None, name: str | None, data_files: Any,
             cache_dir: str | None) -> Any:
  if _is_saved_to_disk(path):
    if name is not None or data_files is not None:
      raise errors.InvalidArgumentError(
          f"{path!r} was written by save_to_disk: name= and data_files= do not apply to it."
      )
    return datasets.load_from_disk(path)
  try:
    return datasets.load_dataset(path, name, data_files=data_files, split=split, cache_dir=cache_dir)
  except ValueError as e:  # an unknown split or configuration: HF's message names the choices
    raise errors.InvalidArgumentError(f"Hugging Face dataset {path!r}: {e}") from None


def _one_split(dataset_dict: Any, split: str | None, label: str) -> Any:
  splits = sorted(dataset_dict)
  if split is None:
    if len(splits) == 1:
      return dataset_dict[splits[0]]
    raise errors.InvalidArgumentError(
        f"Hugging Face dataset {label!r} has splits {splits}; choose one with split=."
    )
  if split not in dataset_dict:
    raise errors.InvalidArgumentError(
        f"Hugging Face dataset {label!r} has no split {split!r}; it has {splits}."
    )
  return dataset_dict[split]


def _is_hf_dataset(source: Any) -> bool:
  """A datasets.Dataset or DatasetDict, recognised without importing datasets."""
  module = type(source).__module__ or ""
  return module.split(".")[0] == "datasets" and type(source).__name__ in ("Dataset", "DatasetDict")


def _is_iterable_only(source: Any) -> bool:
  """An iterable with no random access (a generator, a stream), which make_dataset cannot place records in."""
  if isinstance(source, (str, bytes, dict)) or (type(source).__module__ or "").startswith("grain"):
    return False
  return hasattr(source, "__iter__") or type(source).__name__ == "IterableDatasetDict"


def resolve_source(source: Any) -> tuple[Any, SourceIdentity]:
  """Turns the `source` argument of make_dataset into a random-access source.

  Raises:
    InvalidArgumentError: naming the value and what is accepted.
  """
  paths = _as_paths(source)
  if paths is not None:
    kinds = {os.path.splitext(p)[1] for p in paths}
    if len(kinds) != 1:
      raise errors.InvalidArgumentError(
          f"source mixes file types {sorted(kinds)}; pass files of one type "
          f"({', '.join(FILE_SUFFIXES)})."
      )
    suffix = kinds.pop()
    # On an object store, the shard cache the environment names (ShardCache.from_env), if any.
    cache = _shard_cache.ShardCache.from_env() if any(_storage.is_url(p) for p in paths) else None
    reader = {".jsonl": JsonlSource, ".parquet": ParquetSource, ".array_record": ArrayRecordSource}[suffix]
    resolved = reader(paths, cache=cache)
    description = _describe_files(suffix[1:], paths, _identities_of(resolved))
  elif isinstance(source, (JsonlSource, ParquetSource, ArrayRecordSource)) and source.cache is not None:
    # Described by its files, as the same paths given to make_dataset are: a run may turn
    # its cache on or off.
    resolved = source
    kind = os.path.splitext(source.paths[0])[1][1:]
    description = _describe_files(kind, source.paths, source.identities())
  elif isinstance(source, HuggingFaceSource) or _is_hf_dataset(source):
    resolved = source if isinstance(source, HuggingFaceSource) else HuggingFaceSource(dataset=source)
    description = resolved.description
  elif _is_random_access(source):
    resolved = source
    if isinstance(source, (list, tuple)):
      description = "records"
    else:
      description = f"{type(source).__module__}.{type(source).__qualname__}"
  elif _is_iterable_only(source):
    from ckpt_iter import streaming  # pylint: disable=g-import-not-at-top  (the refusal's words)
    raise errors.InvalidArgumentError(streaming.make_dataset_refusal(source, "make_dataset(source=...)"))
  else:
    raise errors.InvalidArgumentError(
        f"source={_short(source)} is not supported. Pass a list of records "
        f"(dicts), a path, glob or list of paths to {', '.join(FILE_SUFFIXES)} "
        "files, a Hugging Face datasets.Dataset (or HuggingFaceSource), or a "
        "random-access data source (with __len__ and __getitem__)."
    )
  length = len(resolved)
  if length == 0:
    raise errors.InvalidArgumentError(
        f"source {description} holds no records; a dataset needs at least one."
    )
  return resolved, SourceIdentity(description, length, sample_digest(resolved, length))


def _describe_files(kind: str, paths: list[str], identities: list[_storage.Identity] | None = None) -> str:
  """Names and byte sizes of the files, not their directory; short for many files.

  Beyond a few files the list is summarized by count, first and last name
  and a digest of all names and sizes, so a state stays well under 1 KB.
  `identities`: the files' (`_storage.identities`), when already fetched.
  """
  identities = identities or _storage.identities(paths)
  entries = [f"{os.path.basename(p)}:{found.size}" for p, found in zip(paths, identities)]
  if len(entries) <= _LISTED_FILES:
    return f"{kind}[{','.join(entries)}]"
  digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]
  return f"{kind}[{len(entries)} files {entries[0]}..{entries[-1]} sha256:{digest}]"


def _as_paths(source: Any) -> list[str] | None:
  """Expands make_dataset's path, glob or list of paths; None when `source` is not paths."""
  candidates = _path_strings(source)
  if candidates is None:
    return None
  for candidate in candidates:
    if not candidate.endswith(FILE_SUFFIXES):
      raise errors.InvalidArgumentError(
          f"source path {candidate!r} does not end in one of {', '.join(FILE_SUFFIXES)}. "
          "Pass JSONL, Parquet or ArrayRecord files, or a list of record dicts."
      )
  return _expanded(candidates, "source")


# What the file sources take: one path, a glob, or a list of them.
PathsArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


class _ExpandedPaths(list):
  """Paths already expanded: not globbed again (a file's name may hold `[` or `*`)."""


def _expand_paths(paths: PathsArg, owner: str) -> list[str]:
  """The files a file source reads, in order: each glob's matches sorted.

  One path (str or os.PathLike, local or gs://), a glob, or a list of them,
  as make_dataset takes them. A single string is one path, never a sequence
  of characters.

  Raises:
    InvalidArgumentError: `paths` is not paths, names no file, or a file
      or glob match is missing; the message names `owner`.
  """
  if isinstance(paths, _ExpandedPaths):
    return list(paths)
  candidates = _path_strings(paths)
  if candidates is None:
    shown = "[]" if isinstance(paths, (list, tuple)) and not paths else _short(paths)
    raise errors.InvalidArgumentError(
        f"{owner}: paths={shown} ({type(paths).__name__}) names no file. Pass a path "
        "(str or os.PathLike, local or gs://), a glob such as 'data/part-*.jsonl', "
        "or a non-empty list of them."
    )
  return _expanded(candidates, owner)


def _path_strings(source: Any) -> list[str] | None:
  """The path strings of a path or non-empty list of paths; None for anything else."""
  if isinstance(source, os.PathLike):
    source = os.fspath(source)
  if isinstance(source, str):
    return [source]
  if isinstance(source, (list, tuple)) and source and all(
      isinstance(s, (str, os.PathLike)) for s in source
  ):
    strings = [os.fspath(s) for s in source]
    return strings if all(isinstance(s, str) for s in strings) else None
  return None


def _expanded(candidates: list[str], owner: str) -> _ExpandedPaths:
  """Globs expanded (sorted), every file checked to exist; errors name `owner`."""
  paths = _ExpandedPaths()
  for candidate in candidates:
    magic = _storage.has_magic(candidate)
    matches = _storage.glob(candidate) if magic else [candidate]
    if not matches:
      raise errors.InvalidArgumentError(f"{owner} glob {candidate!r} matches no file.")
    for match in matches:
      # An object a listing found exists: no metadata request per match (the source's
      # identities, fetched in parallel, fail on one that went away).
      if not (magic and _storage.is_url(match)) and not _storage.is_file(match):
        where = "" if _storage.is_url(match) else f" (working directory {os.getcwd()!r})"
        raise errors.InvalidArgumentError(f"{owner} file {match!r} does not exist{where}.")
    paths.extend(matches)
  return paths


def _is_random_access(source: Any) -> bool:
  return hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(
      source, (str, bytes, dict)
  )


def _identities_of(source: Any) -> list[_storage.Identity] | None:
  """The identities a file source fetched when built, if it keeps them."""
  if isinstance(source, (JsonlSource, ParquetSource, ArrayRecordSource)):
    return source.identities()
  return None


def _remote_files(source: Any) -> list[str] | None:
  """The files of a file source when any is on an object store; None otherwise."""
  if isinstance(source, (_FileReader, ArrayRecordSource)):
    paths = source.paths
    if any(_storage.is_url(p) for p in paths):
      return paths
  return None


def metadata_digest(paths: list[str], identities: list[_storage.Identity]) -> str:
  """sha256 prefix over each file's name, size and version (generation, crc32c): no content read."""
  digest = hashlib.sha256(b"files-by-metadata\n")
  for path, found in zip(paths, identities):
    digest.update(f"{os.path.basename(path)}:{found.size}:{found.version}\n".encode())
  return digest.hexdigest()[:16]


def sample_digest(source: Any, length: int) -> str:
  """sha256 prefix over up to 64 evenly spaced records and the last one.

  The one source digest: make_dataset's `source_digest` and the graph
  fingerprint's `SourceMapDataset.digest` are both this. For a file source
  with files on an object store, `metadata_digest` of its files instead
  (one metadata request per file, in parallel, or none when the source kept
  them): a read of 65 records there is 65 sequential round trips.
  """
  remote = _remote_files(source)
  if remote is not None:
    return metadata_digest(remote, _identities_of(source) or _storage.identities(remote))
  count = min(length, _DIGEST_SAMPLES)
  indices = sorted({(i * length) // count for i in range(count)} | {length - 1})
  digest = hashlib.sha256()
  for index in indices:
    digest.update(json.dumps(source[index], sort_keys=True, default=repr).encode())
  return digest.hexdigest()[:16]


def _locate(offsets: list[int], index: int, length: int) -> tuple[int, int]:
  if not isinstance(index, (int, np.integer)):
    raise TypeError(f"record index must be an integer, got {type(index).__name__}")
  index = int(index)
  if not -length <= index < length:
    raise IndexError(f"record index {index} out of range for {length} records")
  index %= length
  block = bisect.bisect_right(offsets, index) - 1
  return block, index - offsets[block]


def _import_pyarrow_parquet():
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidArgumentError(
        "reading .parquet files needs pyarrow. Install it with: pip install 'ckpt_iter[files]' (or 'pyarrow>=15')"
    ) from None
  return pq


def _short(value: Any) -> str:
  return state_lib.short_repr(value, limit=60)


def file_position(source: Any, index: int) -> tuple[str, str] | None:
  """(file, "line N" or "row N") of record `index` of a file source (1-based lines, 0-based rows); None otherwise.

  For `ckpt-iter which --source`: where a record the data map names is, in the files the run read.
  """
  if isinstance(source, JsonlSource):
    file_index, line = _locate(source._offsets, index, len(source))  # pylint: disable=protected-access
    return source.paths[file_index], f"line {line + 1}"
  if isinstance(source, ParquetSource):
    group, row = _locate(source._group_offsets, index, len(source))  # pylint: disable=protected-access
    file_index, _ = source._groups[group]  # pylint: disable=protected-access
    first_group = next(g for g, (f, _) in enumerate(source._groups) if f == file_index)  # pylint: disable=protected-access
    row += source._group_offsets[group] - source._group_offsets[first_group]  # pylint: disable=protected-access
    return source.paths[file_index], f"row {row}"
  if isinstance(source, ArrayRecordSource):
    offsets = source.file_offsets()
    file_index, record = _locate(offsets, index, len(source))
    return source.paths[file_index], f"record {record}"
  return None


def file_offsets(source: Any) -> list[int] | None:
  """The global index of each file's first record and the total, for a file source; None for another source.

  The shards of make_dataset(shuffle="shards") when no shard_size is given.
  """
  if isinstance(source, JsonlSource):
    return list(source._offsets)  # pylint: disable=protected-access
  if isinstance(source, ParquetSource):
    groups, offsets = source._groups, source._group_offsets  # pylint: disable=protected-access
    return [offsets[g] for g, (f, _) in enumerate(groups) if g == 0 or groups[g - 1][0] != f] + [offsets[-1]]
  if isinstance(source, ArrayRecordSource):
    return source.file_offsets()
  return None
