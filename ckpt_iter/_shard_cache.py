"""A bounded local cache of whole source files (shards), shared by the processes of one host.

A file source given a `ShardCache` copies each of its files whole into the
cache directory the first time it reads it (one bounded, typed `_storage`
read per file, pinned to the object's generation), then reads its records
from the local copy. The directory's layout, per cached file:

  <key>-<version>-<name>            the complete copy (published by rename)
  <key>-<version>-<name>.seal       its size and CRC-32, written before it is published
  <key>-<version>-<name>.index.npy  a companion (e.g. a JSONL line index), evicted with it
  <key>-<version>-<name>.count      its record count (a few bytes; kept after eviction)
  <key>-<version>-<name>.footer     a file's footer (or index count) where its copy said otherwise (kept too)
  ckpt_iter-footers-<digest>.json   a source's footers or index counts, one object for its files (kept)
  <key>-<version>-<name>.lock       the download lock (fcntl.flock)
  <key>-<version>-<name>.tmp-P-T    a download under way (process P, thread T)
  ckpt_iter-usage.lock              the bytes of the copies and companions (`_cache_usage`)

The companions are `_cache_companions`'; writing into the directory, and its
errors, `_cache_disk`'s; the byte total and the eviction order, `_cache_usage`'s.

`key` is a hash of the file's path or URL and `version` one of its identity
(size and generation, or a local file's inode and times): a replaced object
is a new entry, never the old copy.

Sharing: a download holds an exclusive flock on the entry's `.lock`, so two
processes never download one file twice; a reader of a complete copy takes
no lock but a shared flock on the copy it has open, which is what "in use"
means: eviction (least recently used first, by the copy's mtime, which each
open refreshes) takes an exclusive non-blocking flock on a copy before
removing it, and skips it when a reader holds one. When every copy is in use
the cache may run over its limit (logged), rather than fail a read. A copy
is published or evicted, and counted, in one hold of the byte total's lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterable, Iterator

from ckpt_iter import _cache_companions
from ckpt_iter import _cache_disk
from ckpt_iter import _cache_usage
from ckpt_iter import _checksums
from ckpt_iter import _compression
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter.store_bounds import object_store_bounds

__all__ = ["ShardCache"]

CACHE_ENV = _cache_disk.CACHE_ENV  # where a cache comes from when none is given
CACHE_BYTES_ENV = "CKPT_ITER_SHARD_CACHE_BYTES"
DEFAULT_MAX_BYTES = 64 * 2**30  # a cache's limit when CKPT_ITER_SHARD_CACHE_BYTES does not say
_COMPANIONS = (_cache_companions.INDEX_SUFFIX,)
_SIDECARS = (".count", ".lock", ".seal", _cache_companions.FOOTER_SUFFIX)
# A copy failing its seal is downloaded again at most this often in one open.
_OPEN_TRIES = 3
_log = logging.getLogger(__name__)


class ShardCache(_cache_companions.CompanionFiles):
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
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise self.cache_error(self.directory, 0, e) from e
    if not os.path.isdir(self.directory):
      raise errors.InvalidArgumentError(
          f"ShardCache directory {self.directory!r} is not a directory: point the cache at a directory.")
    self._init_local()
    # Once per opening: temporaries a killed process abandoned swept, the total written again from a listing
    # (whatever a killed process left undone), and back under the limit (copies it held are idle now).
    _cache_disk.remove_abandoned(self.directory)
    self._reconcile()
    self.make_room(0)

  def _init_local(self) -> None:
    self._pool: futures.ThreadPoolExecutor | None = None
    self._pending: dict[str, futures.Future] = {}
    self._lock = threading.RLock()  # a done callback may run inside `prefetch`, which holds it
    self._pid = os.getpid()
    # entry -> the change key (inode, size, change time) of the copy when this process last checked it.
    self._verified: dict[str, tuple[int, ...]] = {}
    # entry -> (when, why) its last download here failed after all its attempts (`_recent_failure`).
    self._failures: dict[str, tuple[float, BaseException]] = {}
    self._thread = threading.local()  # `prefetching`: set in this cache's prefetch threads
    self._entries: dict[tuple[str, int, str | None], str] = {}  # `entry_path`'s answers (two hashes each)
    self._ledger = _cache_usage.Ledger(self.directory)
    self._order = _cache_usage.EvictionOrder()  # this process's view of the copies by last use

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
      max_bytes = int(float(text)) if text else DEFAULT_MAX_BYTES
    except ValueError:
      raise errors.InvalidArgumentError(f"{CACHE_BYTES_ENV}={text!r}: a number of bytes.") from None
    return cls(directory, max_bytes)

  # -- entries ---------------------------------------------------------------

  def entry_path(self, path: str, found: _storage.Identity) -> str:
    """Where the complete local copy of `path` (as `found` describes it) is, or will be."""
    known = self._entries.get((path, found.size, found.version))
    if known is not None:
      return known
    key = hashlib.sha256(_storage.absolute(path).encode()).hexdigest()[:16]
    version = f"size={found.size},{found.version}"
    version_hash = hashlib.sha256(version.encode()).hexdigest()[:16]
    name = os.path.basename(path.rstrip("/")) or "file"
    entry = os.path.join(self.directory, f"{key}-{version_hash}-{name}")
    self._entries[(path, found.size, found.version)] = entry
    return entry

  def fetch(self, path: str, found: _storage.Identity | None = None) -> str:
    """The local copy of `path`, downloaded first if missing (one download per host at a time), checked.

    Raises:
      StorageError: the disk is full (cause "no_space"), naming the cache
        directory and the bytes needed; the cache directory cannot be
        written (cause "cache"); the download's bytes are not the object's
        after every try (cause "corrupt"); or the store's typed errors.
      InvalidStateError: the file changed since `found` described it.
    """
    found = found or _storage.identity(path)
    os.close(self.open(path, found))
    return self.entry_path(path, found)

  def open(self, path: str, found: _storage.Identity | None = None) -> int:
    """A read-only descriptor of the local copy of `path` (fetched if missing), checked and held "in use".

    The descriptor holds a shared flock until closed (os.close): eviction
    never removes a copy while it is open. A copy this process has not
    checked since it last changed is compared with its seal first (its
    CRC-32 recorded when it was published): one altered on disk is
    removed, with a warning naming it, and downloaded again. Opening
    refreshes the copy's last use (its mtime).

    Raises:
      StorageError: as `fetch`; cause "corrupt" also when a copy fails its
        seal again right after its download (the disk under the cache
        alters what is written).
    """
    found = found or _storage.identity(path)
    entry = self.entry_path(path, found)
    self._wait_for_prefetch(entry)
    for _ in range(_OPEN_TRIES):
      fd = self._open_complete(entry, _copy_size(path, found))
      if fd is None:
        fd = self._download_held(path, found, entry)
      if self._checked(entry, fd, found):
        self._mark_used(entry, fd)
        return fd
      os.close(fd)
      self._discard(entry)
    raise errors.StorageError(
        f"{path}: its copy in the shard cache {self.directory} fails its checksum right after being "
        f"downloaded, {_OPEN_TRIES} times: the disk under the cache alters what is written. Point the "
        "cache at another disk.", path=self.directory, operation="cache", cause="corrupt")

  def open_cached(self, path: str, found: _storage.Identity) -> int | None:
    """`open` of a copy already complete in the cache, or None (nothing downloaded; a copy that fails its
    check is removed, as `open` removes it, for a download to replace)."""
    entry = self.entry_path(path, found)
    fd = self._open_complete(entry, _copy_size(path, found))
    if fd is None:
      return None
    if not self._checked(entry, fd, found):
      os.close(fd)
      self._discard(entry)
      return None
    self._mark_used(entry, fd)
    return fd

  def _mark_used(self, entry: str, fd: int) -> None:
    """The checked copy open as `fd` just used (its mtime, for eviction), still known as checked."""
    with contextlib.suppress(OSError):
      os.utime(fd)  # by its descriptor: no second lookup of the name
      self._verified[entry] = _change_key(os.fstat(fd))

  def wait_for(self, path: str, found: _storage.Identity) -> bool:
    """Waits for this process's prefetch of `path` under way, if any (then its `then` has run): whether one was."""
    return self._wait_for_prefetch(self.entry_path(path, found))

  def _wait_for_prefetch(self, entry: str) -> bool:
    """Waits for this process's prefetch of `entry` under way (a prefetch thread's own opens do not)."""
    if self._pid != os.getpid() or getattr(self._thread, "prefetching", False):
      return False
    with self._lock:
      pending = self._pending.get(entry)
    if pending is not None:
      futures.wait([pending])
    return pending is not None

  def _recent_failure(self, entry: str) -> BaseException | None:
    """Why a download of `entry` here failed after all its attempts, if that was within one operation bound.

    A download is one operation with `StoreBounds.retries`, wherever it
    starts (a prefetch, a read, another read thread): one that failed
    moments ago is the answer of every open of the file that comes within
    `operation_seconds` after it, so a file that cannot be downloaded costs
    one budget, not one per caller. Later, an open tries afresh.
    """
    with self._lock:
      failed = self._failures.get(entry)
    if failed is not None and time.monotonic() - failed[0] <= object_store_bounds().operation_seconds:
      return failed[1]
    return None

  def _download_held(self, path: str, found: _storage.Identity, entry: str) -> int:
    """A descriptor holding the shared lock of `entry`: found complete under the download lock, or downloaded.

    The lock is taken before the copy is published: another thread's or
    process's eviction cannot remove it between the download and the
    reader's own use (a race a cache that holds few files lost repeatedly).
    """
    with self._download_lock(entry):
      if _complete(entry, _copy_size(path, found)):  # another process or thread downloaded it meanwhile
        fd = self._open_locked(entry)
        if fd is not None:
          return fd
      failed = self._recent_failure(entry)
      if failed is not None:  # this file's budget was just spent here (a prefetch, another thread): its answer
        raise failed
      self.make_room(found.size)
      tries = object_store_bounds().retries + 1
      try:
        for attempt in range(1, tries + 1):
          try:
            return self._download(path, found, entry)
          except errors.StorageError as e:
            if e.cause != "corrupt" or attempt == tries:
              raise
            _log.warning("%s: download %d of %d received bytes that are not the object's (%s); downloading "
                         "again", path, attempt, tries, e)
      except Exception as e:
        with self._lock:
          self._failures[entry] = (time.monotonic(), e)
        raise
    raise AssertionError("unreachable")

  def _download(self, path: str, found: _storage.Identity, entry: str) -> int:
    """Downloads `path` into a temporary, seals and publishes it; a descriptor holding its shared lock."""
    temporary = f"{entry}.tmp-{os.getpid()}-{threading.get_ident()}"
    held = None
    try:
      compression = _compression.compression_of(path)
      with self._cache_file(temporary, "wb") as f:
        # A decompressed copy's size is known only once it is written: a full disk is measured to the end.
        writer = _cache_disk.CacheWriter(f, measure_after_failure=compression is not None)
        # A compressed file is kept decompressed: its bytes are decompressed as they arrive (the
        # download's checksum is over what arrives, the compressed object's).
        inflating = _compression.DecompressingWriter(writer, compression) if compression else None
        try:
          _storage.download(path, inflating or writer, found)
          if inflating is not None:
            inflating.finish()
        except ValueError as e:  # the decompressor's: the object is not what its name says
          if inflating is None:
            raise
          raise errors.InvalidStateError(f"{path}: not a whole {compression} file ({e}).") from None
        writer.finish()
      held = os.open(temporary, os.O_RDONLY)
      fcntl.flock(held, fcntl.LOCK_SH)  # nobody else knows the temporary: never blocks
      written = os.fstat(held).st_size
      if compression is None and written != found.size:
        raise errors.InvalidStateError(
            f"{path}: downloaded {written:,} bytes into the shard cache, {found.size:,} expected.")
      # The seal first: a copy published is never without the checksum it is opened against.
      seal = _checksums.seal_of(held, written)
      self.write_atomic(entry + ".seal", lambda f: f.write(_cache_companions.seal_text(written, seal).encode()))
      with self._ledger_held() as ledger:  # published and counted in one hold: a listing sees both or neither
        replaced = _cache_usage.bytes_on_disk(entry)  # an incomplete copy left there is replaced
        os.replace(temporary, entry)
        ledger.add(written - replaced)
      info = os.fstat(held)
      self._verified[entry] = _change_key(info)
      self._order.note(entry, info.st_mtime)
      return held
    except BaseException as e:
      if held is not None:
        os.close(held)
      with contextlib.suppress(OSError):
        os.unlink(temporary)
      cache_side = isinstance(e, _cache_disk.CacheWriteFailed)
      decompressed = cache_side and e.decompressed
      needed = e.needed if decompressed else found.size
      e = e.error if cache_side else e
      if isinstance(e, OSError) and not isinstance(e, errors.CkptIterError) and (
          cache_side or e.errno in (errno.ENOSPC, errno.EDQUOT) or e.filename == temporary):
        # The cache's disk, not the store.
        raise self.cache_error(path, needed, e, decompressed_from=found.size if decompressed else None) from e
      raise

  def _checked(self, entry: str, fd: int, found: _storage.Identity) -> bool:
    """Whether the open copy `fd` of `entry` holds the bytes that were checked when it was published.

    Compared in full the first time this process opens the copy, and again
    whenever it has changed since (its inode's change time moves with any
    write, and cannot be set back). A copy without a seal (written before
    seals, or its seal lost) is checked against the store's checksum and
    sealed; with neither, it cannot be vouched for and is downloaded again.
    """
    info = os.fstat(fd)
    if self._verified.get(entry) == _change_key(info):
      return True
    seal = _cache_companions.read_seal(entry + ".seal")
    size_expected = info.st_size if _compression.compression_of(entry) else found.size
    if seal is not None:
      size, crc = seal
      good = size == size_expected == info.st_size and _checksums.seal_of(fd, size) == crc
    elif _compression.compression_of(entry):
      # The store's checksum is the compressed object's: a decompressed copy without its seal is unknown.
      _log.info("%s: a decompressed copy in the shard cache with no seal: downloading it again", entry)
      return False
    else:
      expected = getattr(found, "checksum", None)
      good = expected is not None and info.st_size == found.size and _checksums.store_checksum_of(
          fd, found.size, expected.kind) == expected.value
      if good:
        crc = _checksums.seal_of(fd, found.size)
        self.write_atomic(entry + ".seal", lambda f: f.write(_cache_companions.seal_text(found.size, crc).encode()))
      else:
        _log.info("%s: a copy in the shard cache with no seal and no store checksum: downloading it again", entry)
        return False
    if not good:
      _log.warning("%s: the copy in the shard cache %s is not the bytes checked when it was downloaded "
                   "(altered on disk after its download); removing it and downloading it again",
                   entry, self.directory)
    return good

  def _discard(self, entry: str) -> None:
    """Removes a copy that failed its check, with its seal and companions (whoever holds it open)."""
    self._verified.pop(entry, None)
    self._remove_counted(entry)

  def _remove_counted(self, entry: str) -> int:
    """Removes a copy, its seal and its companions, and takes their bytes off the total; those bytes."""
    counted = [entry] + [entry + suffix for suffix in _COMPANIONS]
    with self._ledger_held() as ledger:
      freed = _cache_usage.bytes_on_disk(*counted)
      for name in [entry + ".seal"] + counted:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(name)
      ledger.add(-freed)
    return freed

  @classmethod
  def _open_complete(cls, entry: str, size: int | None) -> int | None:
    """`_open_locked` of a complete copy (`_complete`), its size told by the descriptor's own stat."""
    if size is None:  # a decompressed copy: its seal tells the size
      return cls._open_locked(entry) if _complete(entry, None) else None
    fd = cls._open_locked(entry)
    if fd is not None and os.fstat(fd).st_size != size:  # not a whole copy of this version: downloaded again
      os.close(fd)
      return None
    return fd

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
    return fd

  def has(self, path: str, found: _storage.Identity) -> bool:
    """Whether the complete local copy of `path` is in the cache now."""
    return _complete(self.entry_path(path, found), _copy_size(path, found))

  def touch(self, path: str, found: _storage.Identity) -> None:
    """Marks the local copy of `path` as just used (for the eviction order).

    A copy this process checked stays checked: its change time moves with the
    touch, and only with it.
    """
    entry = self.entry_path(path, found)
    with contextlib.suppress(OSError):
      before = _change_key(os.stat(entry))
      os.utime(entry)
      if self._verified.get(entry) == before:
        self._verified[entry] = _change_key(os.stat(entry))

  def write_atomic(self, target: str, produce: Callable[[Any], Any], *, counted: bool = False) -> None:
    """Writes a cache file (a companion or a count) atomically: a temporary file, then a rename.

    The temporary is held under an exclusive flock while it is written, which
    is how another process (in any PID namespace) tells it is not abandoned.
    `counted`: a companion, whose bytes the cache's total counts (renamed in
    and counted in one hold of the ledger).

    Raises:
      StorageError: the cache directory cannot be written: its disk is full
        (cause "no_space") or any other error (cause "cache"), naming it.
    """
    for attempt in range(2):
      temporary = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
      try:
        with self._cache_file(temporary, "wb") as f:
          produce(f)
          f.flush()
          if counted:
            with self._ledger_held() as ledger:
              ledger.add(os.fstat(f.fileno()).st_size - _cache_usage.bytes_on_disk(target))
              os.replace(temporary, target)
          else:
            os.replace(temporary, target)  # still locked: never taken for abandoned before it is published
        return
      except BaseException as e:
        with contextlib.suppress(OSError):
          os.unlink(temporary)
        if isinstance(e, FileNotFoundError) and attempt == 0 and os.path.isdir(self.directory):
          continue  # removed under us as if abandoned (a sweep between its creation and its lock): once more
        if isinstance(e, OSError) and not isinstance(e, errors.CkptIterError):
          raise self.cache_error(target, 0, e) from e
        raise

  def _cache_file(self, target: str, mode: str) -> Any:
    """A file of the cache opened for writing, held under an exclusive flock while open (`_cache_disk`)."""
    return _cache_disk.locked_file(target, mode)

  def cache_error(self, path: str, needed: int, error: OSError, *,
                  decompressed_from: int | None = None) -> errors.StorageError:
    """The error of this cache's directory that cannot be written (`_cache_disk.cache_error`)."""
    return _cache_disk.cache_error(self.directory, self.max_bytes, path, needed, error,
                                   decompressed_from=decompressed_from)

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
      if ".tmp-" in name or name.endswith(_SIDECARS + _COMPANIONS) or name.startswith(
          _cache_companions.FOOTERS_PREFIX):
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
    """Evicts least recently used copies not in use until `needed` more bytes fit under max_bytes.

    O(1) while they fit: one read of the total the cache's processes keep
    (`_cache_usage.Ledger`); past it, the oldest copies of this process's
    eviction order, the directory listed again only when that runs out.
    """
    total = self._ledger_total()
    if total is None:  # the ledger removed or garbled: counted again
      total = self._reconcile()
    if total + needed <= self.max_bytes:
      return
    excess = total + needed - self.max_bytes
    for relisted in (False, True):
      if relisted or not self._order.listed:
        self._reconcile()
      in_use = []
      for entry in self._order.oldest():
        freed = _evict_counted(entry, self._remove_counted)
        if freed is None:
          in_use.append(entry)
          continue
        excess -= freed
        if excess <= 0:
          break
      self._order.keep(in_use)
      if excess <= 0:
        return
    _log.info("shard cache %s: %s more bytes needed than fit under its %s-byte limit: the copies left are in use",
              self.directory, f"{excess:,}", f"{self.max_bytes:,}")

  @contextlib.contextmanager
  def _ledger_held(self) -> Iterator[_cache_usage.Held]:
    """The ledger under its lock (`_cache_usage.Ledger.held`); a directory that cannot hold it is this cache's
    error (a full disk, no inode left, a read-only mount)."""
    try:
      with self._ledger.held() as held:
        yield held
    except OSError as e:
      if isinstance(e, errors.CkptIterError) or e.filename != self._ledger.path:
        raise
      raise self.cache_error(self._ledger.path, 0, e) from e

  def _ledger_total(self) -> int | None:
    try:
      return self._ledger.total()
    except OSError as e:
      raise self.cache_error(self._ledger.path, 0, e) from e

  def evict(self, entry: str) -> bool:
    """Removes the copy `entry` (an `entries` path) and its companions unless a reader holds it; whether it
    is gone."""
    return _evict_counted(entry, self._remove_counted) is not None

  def _reconcile(self) -> int:
    """Lists the cache (O(files)) under the ledger's lock, writes the total again, and orders the copies by
    last use; the total."""
    with self._ledger_held() as ledger:
      copies = self.entries()
      ledger.set(sum(size for _, size, _ in copies))
      total = ledger.total
    self._order.reset([(entry, last_use) for entry, _, last_use in copies])
    return total

  @contextlib.contextmanager
  def _download_lock(self, entry: str) -> Iterator[None]:
    try:
      lock = open(entry + ".lock", "a+b")  # pylint: disable=consider-using-with
    except OSError as e:
      raise self.cache_error(entry + ".lock", 0, e) from e
    with lock:
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
    `then(path, identity, fd)` runs after a download (e.g. to build an index),
    given the checked copy's descriptor the prefetch holds (its shared lock):
    valid for the call only, `os.dup` it to keep the copy open beyond (the
    duplicate shares the lock), so the copy is not opened and checked twice.
    A failed prefetch is logged; it spent the download's retries, so an
    open of the file soon after raises its error (`_recent_failure`).
    """
    if self._pid != os.getpid():  # a forked worker: the parent's threads and lock state are not its own
      self._init_local()
    with self._lock:
      for path, found in files:
        entry = self.entry_path(path, found)
        if entry in self._pending or (then is None and _complete(entry, _copy_size(path, found))):
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
    self._thread.prefetching = True
    try:
      fd = self.open(path, found)
    except Exception as e:  # pylint: disable=broad-except
      _log.info("prefetching %s into %s failed (%s); a read of it soon after raises it", path, self.directory, e)
      return
    try:
      if then is not None:
        then(path, found, fd)  # the copy held meanwhile: not evicted between its download and `then`
    except Exception as e:  # pylint: disable=broad-except
      _log.info("after prefetching %s into %s: %s; the read that needs it will retry", path, self.directory, e)
    finally:
      os.close(fd)

  def wait(self) -> None:
    """Waits for the prefetches under way."""
    with self._lock:
      pending = list(self._pending.values())
    futures.wait(pending)


def _complete(entry: str, size: int | None) -> bool:
  """Whether `entry` is a complete copy: of `size` bytes, or (a decompressed copy, size None) of its seal's."""
  try:
    found = os.stat(entry).st_size
  except OSError:
    return False
  if size is None:
    seal = _cache_companions.read_seal(entry + ".seal")
    return seal is not None and seal[0] == found
  return found == size


def _copy_size(path: str, found: _storage.Identity) -> int | None:
  """The size a complete copy of `path` has: the object's, or None for a compressed one (kept decompressed)."""
  return None if _compression.compression_of(path) else found.size


def _evict_counted(entry: str, remove: Callable[[str], int]) -> int | None:
  """Removes a copy and its companions with `remove` (which counts them off the total) unless a reader holds
  it: the bytes freed, or None when it is in use."""
  try:
    fd = os.open(entry, os.O_RDONLY)
  except FileNotFoundError:
    return 0  # evicted meanwhile, by whoever counted it off
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return None
    return remove(entry)
  finally:
    os.close(fd)


def copy_identity(fd: int) -> tuple[int, ...]:
  """Which copy `fd` is (its device, inode and size), for what a process keeps of a copy `open` checked: a
  copy evicted and downloaded again is another inode, and one altered fails its check at the open."""
  info = os.fstat(fd)
  return (info.st_dev, info.st_ino, info.st_size)


def _change_key(info: os.stat_result) -> tuple[int, ...]:
  """What changes with any write to a file: its inode, size and change time (which cannot be set back)."""
  return (info.st_dev, info.st_ino, info.st_size, info.st_ctime_ns)
