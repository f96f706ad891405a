"""A bounded local cache of whole source files (shards), shared by the processes of one host.

A file source given a `ShardCache` copies each of its files whole into the
cache directory the first time it reads it (one bounded, typed `_storage`
read per file, pinned to the object's generation), then reads its records
from the local copy. The directory's layout, per cached file:

  <key>-<version>-<name>            the complete copy (published by rename)
  <key>-<version>-<name>.index.npy  a companion (e.g. a JSONL line index), evicted with it
  <key>-<version>-<name>.count      its record count (a few bytes; kept after eviction)
  <key>-<version>-<name>.lock       the download lock (fcntl.flock)
  <key>-<version>-<name>.tmp-P-T    a download under way (process P, thread T)

`key` is a hash of the file's path or URL and `version` one of its identity
(size and generation, or a local file's inode and times): a replaced object
is a new entry, never the old copy.

Sharing: a download holds an exclusive flock on the entry's `.lock`, so two
processes never download one file twice; a reader of a complete copy takes
no lock but a shared flock on the copy it has open, which is what "in use"
means: eviction (least recently used first, by the copy's mtime, which each
open refreshes) takes an exclusive non-blocking flock on a copy before
removing it, and skips it when a reader holds one. When every copy is in use
the cache may run over its limit (logged), rather than fail a read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from concurrent import futures
from typing import Any, Callable, Iterable, Iterator

from ckpt_iter import _storage
from ckpt_iter import errors

__all__ = ["ShardCache"]

CACHE_ENV = "CKPT_ITER_SHARD_CACHE_DIR"
CACHE_BYTES_ENV = "CKPT_ITER_SHARD_CACHE_BYTES"
_COMPANIONS = (".index.npy",)
_SIDECARS = (".count", ".lock")
_log = logging.getLogger(__name__)


class ShardCache:
  """A bounded local cache of whole source files, for reading a bucket at local-disk speed.

  Pass one to a file source (`JsonlSource(paths, cache=ShardCache(...))`),
  or set the environment variables CKPT_ITER_SHARD_CACHE_DIR (and
  CKPT_ITER_SHARD_CACHE_BYTES) for `make_dataset("gs://...")` to use one.
  Each file is downloaded whole on its first read and then read locally; a
  restart on the same host reads no byte of a cached file again.

  Args:
    directory: a local directory (created if missing); processes of one
      host may share it.
    max_bytes: the size limit: least recently used copies not in use are
      evicted to stay under it. Make it hold the files a process reads at
      once (all of them under a global shuffle).
    prefetch_threads: downloads `prefetch` runs at once in the background.
  """

  def __init__(self, directory: str | os.PathLike[str], max_bytes: int, *, prefetch_threads: int = 2):
    """Makes (or opens) the cache at `directory`; see the class docstring for the arguments."""
    directory = os.fspath(directory)
    if _storage.is_url(directory):
      raise errors.InvalidArgumentError(
          f"ShardCache directory {directory!r}: the cache must be a local directory.")
    if not isinstance(max_bytes, int) or max_bytes <= 0:
      raise errors.InvalidArgumentError(f"ShardCache max_bytes={max_bytes!r}: a positive number of bytes.")
    self.directory = os.path.abspath(directory)
    self.max_bytes = max_bytes
    self.prefetch_threads = max(1, int(prefetch_threads))
    os.makedirs(self.directory, exist_ok=True)
    self._init_local()

  def _init_local(self) -> None:
    self._pool: futures.ThreadPoolExecutor | None = None
    self._pending: dict[str, futures.Future] = {}
    self._lock = threading.RLock()  # a done callback may run inside `prefetch`, which holds it
    self._pid = os.getpid()

  def __getstate__(self) -> dict[str, Any]:
    return {"directory": self.directory, "max_bytes": self.max_bytes, "prefetch_threads": self.prefetch_threads}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._init_local()

  def __repr__(self) -> str:
    return f"ShardCache({self.directory!r}, max_bytes={self.max_bytes:,})"

  @classmethod
  def from_env(cls) -> "ShardCache | None":
    """The cache CKPT_ITER_SHARD_CACHE_DIR names (limit CKPT_ITER_SHARD_CACHE_BYTES, default 64 GiB), or None."""
    directory = os.environ.get(CACHE_ENV)
    if not directory:
      return None
    text = os.environ.get(CACHE_BYTES_ENV, "").strip()
    try:
      max_bytes = int(float(text)) if text else 64 * 2**30
    except ValueError:
      raise errors.InvalidArgumentError(f"{CACHE_BYTES_ENV}={text!r}: a number of bytes.") from None
    return cls(directory, max_bytes)

  # -- entries ---------------------------------------------------------------

  def entry_path(self, path: str, found: _storage.Identity) -> str:
    """Where the complete local copy of `path` (as `found` describes it) is, or will be."""
    key = hashlib.sha256(_storage.absolute(path).encode()).hexdigest()[:16]
    version = f"size={found.size},{found.version}"
    version_hash = hashlib.sha256(version.encode()).hexdigest()[:16]
    name = os.path.basename(path.rstrip("/")) or "file"
    return os.path.join(self.directory, f"{key}-{version_hash}-{name}")

  def fetch(self, path: str, found: _storage.Identity | None = None) -> str:
    """The local copy of `path`, downloaded first if missing (one download per host at a time).

    Raises:
      StorageError: the disk is full (cause "no_space"), naming the cache
        directory and the bytes needed; or the store's typed errors.
      InvalidStateError: the file changed since `found` described it.
    """
    entry, held = self._fetch_held(path, found or _storage.identity(path))
    if held is not None:
      os.close(held)
    return entry

  def _fetch_held(self, path: str, found: _storage.Identity) -> tuple[str, int | None]:
    """`fetch`, and for a copy downloaded now a descriptor holding its shared lock (None for one found).

    The lock is taken before the copy is published: another thread's or
    process's eviction cannot remove it between the download and the
    reader's own open (a race a cache that holds few files lost repeatedly).
    """
    entry = self.entry_path(path, found)
    if _complete(entry, found.size):
      return entry, None
    with self._download_lock(entry):
      if _complete(entry, found.size):  # another process or thread downloaded it meanwhile
        return entry, None
      self.make_room(found.size)
      temporary = f"{entry}.tmp-{os.getpid()}-{threading.get_ident()}"
      held = None
      try:
        with open(temporary, "wb") as f:
          _storage.download(path, f, found)
          f.flush()
          os.fsync(f.fileno())
        written = os.path.getsize(temporary)
        if written != found.size:
          raise errors.InvalidStateError(
              f"{path}: downloaded {written:,} bytes into the shard cache, {found.size:,} expected.")
        held = os.open(temporary, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)  # nobody else knows the temporary: never blocks
        os.replace(temporary, entry)
      except BaseException as e:
        if held is not None:
          os.close(held)
        with contextlib.suppress(OSError):
          os.unlink(temporary)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
          raise self.no_space_error(path, found.size, e) from e
        raise
    return entry, held

  def open(self, path: str, found: _storage.Identity | None = None) -> int:
    """A read-only descriptor of the local copy of `path` (fetched if missing), held "in use".

    The descriptor holds a shared flock until closed (os.close): eviction
    never removes a copy while it is open. Opening refreshes the copy's
    last use (its mtime).
    """
    found = found or _storage.identity(path)
    for _ in range(8):
      entry, held = self._fetch_held(path, found)
      try:
        fd = self._open_locked(entry)
      finally:
        if held is not None:
          os.close(held)  # the reader's own descriptor holds the lock now
      if fd is not None:
        return fd
    raise errors.StorageError(
        f"{path}: its copy in the shard cache {self.directory} was evicted 8 times while being opened: "
        f"the cache ({self.max_bytes:,} bytes) is too small for the files read at once; raise max_bytes.",
        path=self.directory, operation="cache", cause="no_space")

  @staticmethod
  def _open_locked(entry: str) -> int | None:
    """A descriptor of `entry` holding its shared lock, or None when it was evicted meanwhile."""
    try:
      fd = os.open(entry, os.O_RDONLY)
    except FileNotFoundError:
      return None  # evicted between the fetch and the open
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)  # being evicted right now
      return None
    if os.fstat(fd).st_nlink == 0:  # evicted before the lock was taken
      os.close(fd)
      return None
    with contextlib.suppress(OSError):
      os.utime(entry)
    return fd

  def has(self, path: str, found: _storage.Identity) -> bool:
    """Whether the complete local copy of `path` is in the cache now."""
    return _complete(self.entry_path(path, found), found.size)

  def touch(self, path: str, found: _storage.Identity) -> None:
    """Marks the local copy of `path` as just used (for the eviction order)."""
    with contextlib.suppress(OSError):
      os.utime(self.entry_path(path, found))

  def read_count(self, path: str, found: _storage.Identity) -> int | None:
    """The record count stored for `path` (`write_count`), or None."""
    try:
      with open(self.entry_path(path, found) + ".count") as f:
        return int(f.read().strip())
    except (OSError, ValueError):
      return None

  def write_count(self, path: str, found: _storage.Identity, count: int) -> None:
    """Stores the record count of `path` (kept after the copy is evicted: a few bytes a file)."""
    self.write_atomic(self.entry_path(path, found) + ".count", lambda f: f.write(str(count).encode()))

  def write_atomic(self, target: str, produce: Callable[[Any], Any]) -> None:
    """Writes a cache file (a companion or a count) atomically: a temporary file, then a rename.

    Raises:
      StorageError: the disk is full (cause "no_space"), naming the cache directory.
    """
    temporary = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
      with open(temporary, "wb") as f:
        produce(f)
      os.replace(temporary, target)
    except BaseException as e:
      with contextlib.suppress(OSError):
        os.unlink(temporary)
      if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise self.no_space_error(target, 0, e) from e
      raise

  def no_space_error(self, path: str, needed: int, error: OSError) -> errors.StorageError:
    """The error of a full disk under the cache: names the directory, the bytes needed and free."""
    try:
      free = f"{shutil.disk_usage(self.directory).free:,} bytes free"
    except OSError:
      free = "free space unknown"
    needed_text = f"{needed:,} bytes needed for {path}" if needed else f"writing {path}"
    return errors.StorageError(
        f"shard cache {self.directory}: no space left on its disk ({needed_text}; {free}; "
        f"{error.strerror or error}). Free space there, point the cache at a larger disk, or lower "
        f"its max_bytes ({self.max_bytes:,}) below the disk's free space.",
        path=self.directory, operation="cache", cause="no_space")

  # -- size and eviction -------------------------------------------------------

  def entries(self) -> list[tuple[str, int, float]]:
    """(copy path, bytes with its companions, last use) of each complete copy in the cache."""
    names = os.listdir(self.directory)
    found = []
    sizes: dict[str, int] = {}
    for name in names:
      for suffix in _COMPANIONS:
        if name.endswith(suffix):
          with contextlib.suppress(OSError):
            sizes[name[: -len(suffix)]] = sizes.get(name[: -len(suffix)], 0) + os.stat(
                os.path.join(self.directory, name)).st_size
    for name in names:
      if ".tmp-" in name or name.endswith(_SIDECARS + _COMPANIONS):
        continue
      try:
        info = os.stat(os.path.join(self.directory, name))
      except OSError:
        continue
      found.append((os.path.join(self.directory, name), info.st_size + sizes.get(name, 0), info.st_mtime))
    return found

  def usage(self) -> int:
    """Bytes the complete copies and their companions take (downloads under way not counted)."""
    return sum(size for _, size, _ in self.entries())

  def make_room(self, needed: int) -> None:
    """Evicts least recently used copies not in use until `needed` more bytes fit under max_bytes."""
    self._remove_abandoned()
    entries = sorted(self.entries(), key=lambda e: e[2])
    total = sum(size for _, size, _ in entries)
    for entry, size, _ in entries:
      if total + needed <= self.max_bytes:
        return
      if _evict(entry):
        total -= size
    if total + needed > self.max_bytes:
      _log.info("shard cache %s: %s bytes in use and %s needed, over its %s-byte limit",
                self.directory, f"{total:,}", f"{needed:,}", f"{self.max_bytes:,}")

  def _remove_abandoned(self) -> None:
    """Removes the temporaries of downloads whose process is gone."""
    for name in os.listdir(self.directory):
      if ".tmp-" not in name:
        continue
      try:
        pid = int(name.rsplit(".tmp-", 1)[1].split("-")[0])
        os.kill(pid, 0)
      except ProcessLookupError:
        with contextlib.suppress(OSError):
          os.unlink(os.path.join(self.directory, name))
      except (ValueError, PermissionError, IndexError):
        pass

  @contextlib.contextmanager
  def _download_lock(self, entry: str) -> Iterator[None]:
    with open(entry + ".lock", "a+b") as lock:
      fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

  # -- prefetch ----------------------------------------------------------------

  def prefetch(self, files: Iterable[tuple[str, _storage.Identity]],
               then: Callable[[str, _storage.Identity], Any] | None = None) -> None:
    """Downloads `files` ((path, identity) pairs) in the background, at most `prefetch_threads` at once.

    Returns at once. A file already cached or already queued is skipped;
    `then(path, identity)` runs after a download (e.g. to build an index).
    A failed prefetch is logged and forgotten: the read that needs the file
    fetches it and raises the error.
    """
    if self._pid != os.getpid():  # a forked worker: the parent's threads and lock state are not its own
      self._init_local()
    with self._lock:
      for path, found in files:
        entry = self.entry_path(path, found)
        if entry in self._pending or (then is None and _complete(entry, found.size)):
          continue
        if self._pool is None:
          self._pool = futures.ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="ckpt_iter-prefetch")
        future = self._pool.submit(self._prefetch_one, path, found, then)
        self._pending[entry] = future
        future.add_done_callback(lambda _, entry=entry: self._forget(entry))

  def _forget(self, entry: str) -> None:
    with self._lock:
      self._pending.pop(entry, None)

  def _prefetch_one(self, path: str, found: _storage.Identity, then: Callable[..., Any] | None) -> None:
    try:
      self.fetch(path, found)
      if then is not None:
        then(path, found)
    except Exception as e:  # pylint: disable=broad-except
      _log.info("prefetching %s into %s failed (%s); the read that needs it will retry", path, self.directory, e)

  def wait(self) -> None:
    """Waits for the prefetches under way."""
    with self._lock:
      pending = list(self._pending.values())
    futures.wait(pending)


def _complete(entry: str, size: int) -> bool:
  try:
    return os.stat(entry).st_size == size
  except OSError:
    return False


def _evict(entry: str) -> bool:
  """Removes a copy and its companions unless a reader holds it; whether it did."""
  try:
    fd = os.open(entry, os.O_RDONLY)
  except FileNotFoundError:
    return True
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return False
    for path in [entry] + [entry + suffix for suffix in _COMPANIONS]:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True
  finally:
    os.close(fd)
