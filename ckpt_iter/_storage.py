"""Bytes on any filesystem: local paths and object stores (gs://, s3://, ...).

Every file ckpt_iter reads or writes — data items, CLI reads, source files,
the JSONL index cache's subject — goes through this module, so a checkpoint
root or a source can be wherever Orbax and Grain can put theirs.

Each public function is one call on the backend of its path (`_backend`),
chosen once per call by the path's form:

- `_LocalBackend`, for a local path, uses the OS: reads refuse anything but
  a regular file (a FIFO would block forever, /dev/zero never ends) and know
  the size before they read; writes are fsynced, so Orbax's step commit (a
  rename) publishes durable files.
- `_ObjectStoreBackend`, for a URL (`scheme://...`), uses fsspec, the
  filesystem layer `etils.epath` runs gs:// on when TensorFlow is absent
  (gcsfs), with the same credentials and `STORAGE_EMULATOR_HOST`. It calls
  fsspec directly for the two operations epath makes costly on an object
  store: a whole-object read is one ranged GET (epath's open() first fetches
  the object's metadata) and a write is one upload (epath's open("wb") starts
  a two-request resumable upload). Every call is made through
  `_object_store`, the store client: bounded (`StoreBounds`), and guarded by
  its `translate`, the one place a store's error becomes ckpt_iter's.

Object stores have no rename, so nothing here writes a temporary and renames
it: atomicity comes from the caller's commit (Orbax's step commit, see
docs/failure_modes.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob as glob_lib
import hashlib
import os
import re
import shutil
import stat
import threading
from typing import Any, BinaryIO, Callable, NoReturn, Protocol, Sequence

from ckpt_iter import _checksums
from ckpt_iter import _object_store as store
from ckpt_iter import _open_files
from ckpt_iter import errors

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str | os.PathLike[str]) -> bool:
  """A `scheme://...` location (an object store), as opposed to a local path."""
  return bool(_URL.match(os.fspath(path)))



# ---------------------------------------------------------------------------
# The operations: one line each, on the path's backend.


class TooLargeError(OSError):
  """A file holds more bytes than the reader allows.

  `size` is the file's size when `exact`, else a lower bound (an object
  store read stops one byte past the limit).
  """

  def __init__(self, path: str, size: int, max_bytes: int, *, exact: bool):
    self.shown_size = f"{size:,}" if exact else f"{size:,}+"
    super().__init__(errno.EFBIG, f"{self.shown_size} bytes, over the {max_bytes}-byte limit", path)
    self.size = size
    self.max_bytes = max_bytes
    self.exact = exact


@dataclasses.dataclass(frozen=True)
class Identity:
  """What a cache may trust a file by.

  Attributes:
    size: bytes.
    version: changes with every write of the content; None when the store
      offers nothing such (then nothing is cached). Local: inode, mtime and
      ctime (ctime cannot be set back: `touch -r`, `cp -p`, `rsync -t` keep
      the mtime of an edited file, not its ctime). Object store: the
      object's generation (GCS), version id or ETag, with its checksum.
    generation: the object's generation where its store's reads can pin
      one (GCS: `_object_store.StoreProfile.pins`); None locally or without.
    checksum: the store's checksum of the object (crc32c, else md5), which
      `download` compares the bytes it receives with; None locally or
      where the store gives none.
  """

  size: int
  version: str | None
  generation: str | None = dataclasses.field(default=None, compare=False)
  checksum: _checksums.StoreChecksum | None = dataclasses.field(default=None, compare=False)


def absolute(path: str | os.PathLike[str]) -> str:
  """`path` made absolute; a URL is already (os.path.abspath would mangle it)."""
  return _backend(path).absolute(os.fspath(path))


def read_bytes(path: str, *, max_bytes: int, writable: bool = False) -> bytes | bytearray:
  """The whole content of a file of at most `max_bytes`, in one read (one GET).

  `writable`: as a bytearray, for arrays that are views of it (a local file
  is always read in place into one; an object's bytes are copied into it).

  Raises:
    FileNotFoundError: there is no such file.
    TooLargeError: it holds more than `max_bytes` (nothing more is read).
    OSError: it cannot be read, or (local) is not a regular file.
  """
  return _backend(path).read_bytes(path, max_bytes, writable)


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file (one upload on an object store).

  Not atomic by itself: a crash can leave a partial local file. Callers
  write inside an Orbax step, whose commit is the atomic unit. A failed
  write removes what it wrote.

  Raises:
    OSError: naming `path` (e.g. ENOSPC).
  """
  _backend(path).write_bytes(path, data)


def replace_bytes(path: str, data: bytes) -> None:
  """Writes a whole file that others may be reading: a reader sees the old content or the new, never part.

  Locally a temporary beside it, fsynced, then renamed over it (a writer
  killed midway leaves the old file); on an object store one upload, which
  the store publishes whole.

  Raises:
    OSError: naming `path` (e.g. ENOSPC); the old file is left as it was.
  """
  if is_url(path):
    _OBJECT_STORE.write_bytes(path, data)
    return
  temporary = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
  _LOCAL.write_bytes(temporary, data)  # fsynced; a failed write removes it
  try:
    os.replace(temporary, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.unlink(temporary)
    raise OSError(e.errno, f"cannot write it ({e.strerror or e})", path) from e


def write_stream(path: str, produce: Callable[[BinaryIO], None]) -> None:
  """Writes a file as `produce(f)` writes it, in pieces, with no whole copy in memory.

  For files too large to assemble first (a step's pending arrays): on an
  object store one streamed upload, published only when `produce` returns
  (one simple upload from memory when it is at most SMALL_UPLOAD_BYTES).
  Like `write_bytes`, a failed write removes (or never publishes) what it wrote.

  Raises:
    OSError: naming `path`.
  """
  _backend(path).write_stream(path, produce)


def list_entries(directory: str) -> list[tuple[str, bool]]:
  """(name, is_directory) of each entry of `directory`, from one listing.

  Raises:
    FileNotFoundError: no such directory (on an object store: no object
      under that prefix).
  """
  return _backend(directory).list_entries(directory)


def list_names(directory: str) -> list[str]:
  """The names in `directory`, from one listing (see `list_entries`)."""
  return _backend(directory).list_names(directory)


def remove_tree(path: str) -> None:
  """Deletes `path` and everything under it (on an object store: every object under that prefix)."""
  if is_url(path):
    fs, key = store.filesystem(path)
    store.bounded(fs, path, "delete", fs.rm, key, recursive=True)
  else:
    shutil.rmtree(path)


def is_dir(path: str) -> bool:
  """Whether `path` is a directory (on an object store: a non-empty prefix)."""
  return _backend(path).is_dir(path)


def is_file(path: str) -> bool:
  """Whether `path` is a file (an object)."""
  return _backend(path).is_file(path)


def glob(pattern: str) -> list[str]:
  """The paths matching a glob pattern, sorted (URLs keep their scheme)."""
  return _backend(pattern).glob(pattern)


def has_magic(pattern: str) -> bool:
  """Whether `pattern` holds glob wildcards (the same rule for a path and a URL)."""
  return glob_lib.has_magic(pattern)


def open_read(path: str, generation: str | None = None) -> BinaryIO:
  """A seekable binary file for streaming reads (line indexing, Parquet).

  `generation` (an object store's, from the file's `Identity`): every read is
  of that generation of the object; a replaced object is refused
  (`InvalidStateError`) instead of read as another version. Each request is
  bounded and the store's errors typed.
  """
  return _backend(path).open_read(path, generation)


def identity(path: str) -> Identity:
  """The size and version of a file (one stat, or one metadata request).

  Raises:
    FileNotFoundError: no such file.
  """
  return _backend(path).identity(path)


def identities_as_recorded(urls: Sequence[str], recorded: Sequence[tuple[int, str]]) -> list[Identity]:
  """The identities of objects as a record of them says (a corpus index's size and version for each),
  without a request: the generation reads pin and the checksum a download is checked against, read back
  from the version `identity` wrote ("generation=...,crc32c=...")."""
  found = []
  for url, (size, version) in zip(urls, recorded):
    if not is_url(url):
      raise ValueError(f"{url}: a local file's identity is its stat, not a record")
    info: dict[str, Any] = dict(part.split("=", 1) for part in version.split(",") if "=" in part)
    found.append(_identity_of(store.profile(url), {**info, "size": size}))
  return found


def identities(paths: list[str], *, threads: int = 16, listed: dict[str, Identity] | None = None) -> list[Identity]:
  """`identity` of each path, fetched in parallel (at most `threads` requests at once) for URLs.

  One metadata request per object (generation, size, crc32c on GCS): what a
  source's identity on a bucket is made of, instead of reads of its content;
  none for an object in `listed` (a glob's listing said it: `glob_identities`),
  and one listing for the objects of a directory that holds several asked.
  Local paths are stat'ed in order (no threads).

  Raises:
    FileNotFoundError: naming the first missing path.
  """
  listed = dict(listed or {})
  listed.update(directory_identities([p for p in paths if p not in listed]))
  asked = [p for p in paths if p not in listed]
  if not any(is_url(p) for p in asked) or len(asked) <= 1:
    found = {p: identity(p) for p in asked}
  else:
    from concurrent import futures  # pylint: disable=g-import-not-at-top

    with futures.ThreadPoolExecutor(max_workers=max(1, min(threads, len(asked)))) as pool:
      found = dict(zip(asked, pool.map(identity, asked)))
  return [listed[p] if p in listed else found[p] for p in paths]


# 2001 to 2286: a generation outside is not a time (an emulator or a store counting otherwise).
_PLAUSIBLE_SECONDS = (1e9, 1e10)


def written_at(found: Identity) -> float | None:
  """When the file `found` describes was last written, in seconds since the epoch, where its identity says:
  a GCS object's generation (microseconds), a local file's change time; None on another store."""
  if found.generation is not None and found.generation.isdigit():
    seconds = int(found.generation) / 1e6  # GCS's generations are the write's time in microseconds
    return seconds if _PLAUSIBLE_SECONDS[0] < seconds < _PLAUSIBLE_SECONDS[1] else None
  times = dict(part.split("=", 1) for part in (found.version or "").split(",") if "=" in part)
  if times.get("ctime", "").isdigit() and times.get("mtime", "").isdigit():
    return max(int(times["mtime"]), int(times["ctime"])) / 1e9
  return None


def newest_write(directory: str) -> float | None:
  """When the newest file directly in `directory` was written (`written_at`), from one listing; None when
  it holds none or its store does not say. For error messages: never on a restore's common path."""
  if is_url(directory):
    scheme, rest = directory.rstrip("/").split("://", 1)
    times = [written_at(found) for found in glob_identities(f"{scheme}://{glob_lib.escape(rest)}/*").values()]
  else:
    times = []
    with os.scandir(directory) as entries:
      for entry in entries:
        if entry.is_file(follow_symlinks=False):
          info = entry.stat(follow_symlinks=False)
          times.append(max(info.st_mtime_ns, info.st_ctime_ns) / 1e9)
  known = [t for t in times if t is not None]
  return max(known) if known else None


# From this many objects of one directory on, their identities come from one listing of it.
_LIST_A_DIRECTORY_AT = 4


def directory_identities(paths: list[str]) -> dict[str, Identity]:
  """The identities of those of the URLs `paths` that a listing of their directory describes, one listing per
  directory holding several of them (a listing page describes a thousand objects; gcsfs's stat of one path
  asks about 4 requests: a list of 20,480 paths cost ~82,000 at every start). Paths it does not hold (local
  ones, missing objects, directories of one asked path) are left out. The listing asks for the names that
  begin as every asked one does: a store lists a directory's subdirectories whole, so a directory's other
  objects (another format's shards beside these, say) would cost pages of their own."""
  by_directory: dict[str, set[str]] = {}
  for path in paths:
    if is_url(path):
      by_directory.setdefault(path.rsplit("/", 1)[0], set()).add(path)
  found: dict[str, Identity] = {}
  for directory, asked in by_directory.items():
    if len(asked) >= _LIST_A_DIRECTORY_AT:
      scheme, rest = directory.split("://", 1)
      common = os.path.commonprefix([path[len(directory) + 1:] for path in asked])
      listing = glob_identities(f"{scheme}://{glob_lib.escape(rest)}/{glob_lib.escape(common)}*")
      found.update({path: listing[path] for path in asked if path in listing})
  return found


def glob_identities(pattern: str) -> dict[str, Identity]:
  """The objects matching a URL glob, each with its identity, from the listing alone (no request per
  object: a listing page describes a thousand objects as a metadata request describes one)."""
  return _OBJECT_STORE.glob_identities(pattern)


# The most bytes `download` asks for in one request (a larger file takes several).
DOWNLOAD_CHUNK_BYTES = 256 * 2**20


def download(path: str, f: BinaryIO, found: Identity) -> None:
  """Copies the whole file `path` described by `found` (from `identity`) into open local file `f`.

  On an object store one bounded, typed ranged GET per DOWNLOAD_CHUNK_BYTES
  (one for most shards), each of `found.generation` when the store has one:
  an object replaced since `found` is refused (`InvalidStateError`), never
  copied half old, half new. The bytes received are compared with the
  store's checksum of the object (`found.checksum`), when it gives one. A
  local file is read through a descriptor checked to be the file `found`
  described.

  Raises:
    InvalidStateError: the file changed since `found`, or holds fewer bytes.
    StorageError: cause "corrupt": the bytes received are not the object's
      (their checksum differs from the store's); `f` holds them: discard it.
    OSError: a write to `f` failed (e.g. ENOSPC), or the store's typed errors.
  """
  backend = _backend(path)
  expected = getattr(found, "checksum", None) if is_url(path) else None
  running = expected.running() if expected is not None else None
  if is_url(path):
    pin: Any = found.generation
  else:
    pin = backend.pin(path)
    if backend.identity(path) != found:
      raise store.replaced_error(path, "its size or version changed since it was described", "file")
  local = threading.local()
  start = 0
  while start < found.size:
    end = min(found.size, start + DOWNLOAD_CHUNK_BYTES)
    data = backend.read_range(path, pin, start, end, local)
    if len(data) != end - start:
      raise store.replaced_error(path, f"{start + len(data):,} bytes where {found.size:,} were described", "file")
    if running is not None:
      running.update(data)
    f.write(data)
    start = end
  if getattr(local, "fd", None) is not None:
    os.close(local.fd)
  if running is not None and running.value() != expected.value:
    raise corrupt_download_error(path, expected, running.value())


def corrupt_download_error(path: str, expected: _checksums.StoreChecksum, received: str) -> errors.StorageError:
  """The error of bytes received that are not the object's (their checksum is not the store's)."""
  return errors.StorageError(
      f"{path}: the bytes downloaded are not the object's: their {expected.kind} is {received}, the "
      f"store's is {expected.value} (corrupted in transit). Nothing of them was kept; retry, and if it "
      "persists check the network path to the store (a proxy, a faulty NIC).",
      path=path, operation="read", cause="corrupt")


def version_digest(version: str) -> int:
  """A version string as a signed int64 (the JSONL index cache stores int64s)."""
  return int.from_bytes(hashlib.blake2b(version.encode(), digest_size=8).digest(), "little", signed=True)


class RangeReader:
  """Reads byte ranges of one file from any thread or Grain worker process.

  Pinned, when made, to the file there then: a local file by its device,
  inode, size and mtime (each descriptor, one per thread and process, is
  checked to be that file when opened), an object by its generation (every
  read is a ranged GET of it). A file replaced under a live source is refused
  (`InvalidStateError`), never read by some threads or workers as the new
  version through the old one's index. Picklable: descriptors are not carried
  over, the pin is.
  """

  def __init__(self, path: str, found: Identity | None = None):
    """`found`: the object's identity (from `identity`) to pin, saving the request `pin` makes."""
    self.path = path
    self._backend = _backend(path)
    if found is not None and found.generation is not None and is_url(path):
      self._pin = found.generation
    else:
      self._pin = self._backend.pin(path)
    self._local = threading.local()

  def __getstate__(self) -> dict[str, Any]:
    return {"path": self.path, "_pin": self._pin}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._backend = _backend(self.path)
    self._local = threading.local()

  def read(self, start: int, end: int) -> bytes:
    return self._backend.read_range(self.path, self._pin, start, end, self._local)




# ---------------------------------------------------------------------------
# The backends.


class _Backend(Protocol):
  """The operations of a storage backend: the public functions' contracts, plus a `RangeReader`'s two.

  `pin(path)` is what the reader checks its reads against (the file or the
  version there now); `read_range` reads bytes [start, end) of the pinned file,
  `local` holding the reader's per-thread state.
  """

  def absolute(self, path: str) -> str: ...
  def read_bytes(self, path: str, max_bytes: int, writable: bool) -> bytes | bytearray: ...
  def write_bytes(self, path: str, data: bytes) -> None: ...
  def write_stream(self, path: str, produce: Callable[[BinaryIO], None]) -> None: ...
  def list_entries(self, directory: str) -> list[tuple[str, bool]]: ...
  def list_names(self, directory: str) -> list[str]: ...
  def is_dir(self, path: str) -> bool: ...
  def is_file(self, path: str) -> bool: ...
  def glob(self, pattern: str) -> list[str]: ...
  def open_read(self, path: str, generation: str | None) -> BinaryIO: ...
  def generation(self, path: str) -> str | None: ...
  def identity(self, path: str) -> Identity: ...
  def pin(self, path: str) -> Any: ...
  def read_range(self, path: str, pin: Any, start: int, end: int, local: threading.local) -> bytes: ...


class _LocalBackend:
  """Local paths (and FUSE or NFS mounts) through the OS."""

  def absolute(self, path: str) -> str:
    return os.path.abspath(path)

  def read_bytes(self, path: str, max_bytes: int, writable: bool) -> bytes | bytearray:
    del writable  # read in place into a bytearray either way: copying it into bytes would cost memory
    # One non-blocking open and an fstat of the open file, no stat of the
    # path first: the check holds for the very file that is read, and a FIFO
    # is refused at the fstat instead of hanging in open(). For a regular
    # file O_NONBLOCK changes nothing.
    with open(path, "rb", buffering=0, opener=_nonblocking) as f:
      info = os.fstat(f.fileno())
      if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
      if info.st_size > max_bytes:
        raise TooLargeError(path, info.st_size, max_bytes, exact=True)
      return _read_into_bytearray(f, path, info.st_size)

  def write_bytes(self, path: str, data: bytes) -> None:
    # The file descriptor itself: open, fstat, write, fsync, close (a buffered
    # file object adds an fstat, an isatty ioctl and an lseek per file).
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
      raise OSError(e.errno, f"cannot write it ({e.strerror or e})", path) from e
    regular = False
    try:
      try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        view = memoryview(data)
        while view:
          view = view[os.write(fd, view):]
        os.fsync(fd)
      finally:
        os.close(fd)
    except BaseException as e:
      _failed_write(path, regular, e)

  def write_stream(self, path: str, produce: Callable[[BinaryIO], None]) -> None:
    regular = False
    try:
      with open(path, "wb") as f:
        regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
        produce(f)
        f.flush()
        os.fsync(f.fileno())
    except BaseException as e:
      _failed_write(path, regular, e)

  def list_entries(self, directory: str) -> list[tuple[str, bool]]:
    with os.scandir(directory) as entries:
      return [(entry.name, entry.is_dir()) for entry in entries]

  def list_names(self, directory: str) -> list[str]:
    return os.listdir(directory)

  def is_dir(self, path: str) -> bool:
    return os.path.isdir(path)

  def is_file(self, path: str) -> bool:
    return os.path.isfile(path)

  def glob(self, pattern: str) -> list[str]:
    return sorted(glob_lib.glob(pattern))

  def open_read(self, path: str, generation: str | None) -> BinaryIO:
    del generation  # a local file has none
    return open(path, "rb")  # pylint: disable=consider-using-with

  def generation(self, path: str) -> str | None:
    del path
    return None

  def identity(self, path: str) -> Identity:
    info = os.stat(path)
    return Identity(info.st_size, f"ino={info.st_ino},mtime={info.st_mtime_ns},ctime={info.st_ctime_ns}")

  def pin(self, path: str) -> tuple[int, int, int, int]:
    return _file_key(os.stat(path))

  def read_range(self, path: str, pin: Any, start: int, end: int, local: threading.local) -> bytes:
    del local  # the process's descriptors are shared by its threads (a positioned read needs no lock)
    return _RANGE_FILES.pread(path, pin, start, end)


class _RangeFiles:
  """A process's descriptors of the local files `RangeReader`s read, at most a quarter of its open-file limit.

  A corpus read in place may have more files than the process may open: the
  idle descriptors read least recently are closed past the limit (a file in
  a read is never closed under it), and a file opened again is checked
  against its pin again (replaced since: refused, as at its first open).
  """

  def __init__(self):
    self._open = _open_files.OpenFiles()  # (path, pin) -> OpenFile

  def pread(self, path: str, pin: Any, start: int, end: int) -> bytes:
    key = (path, pin)
    entry = self._open.use(key) or self._opened(path, pin, key)
    try:
      return os.pread(entry.fd, end - start, start)
    finally:
      self._open.done(entry)

  def _opened(self, path: str, pin: Any, key: tuple[str, Any]) -> _open_files.OpenFile:
    fd = os.open(path, os.O_RDONLY)
    found = _file_key(os.fstat(fd))
    if found != pin:
      os.close(fd)
      raise store.replaced_error(path, f"size, inode or mtime changed: {pin} then, {found} now", "file")
    opened = _open_files.OpenFile(fd)
    # The limit asked at each open: a program may change it; the cache takes half.
    entry, _ = self._open.add(key, opened, limit=max(16, _open_file_limit() // 4),
                              evict=lambda _, idle: os.close(idle.fd))
    if entry is not opened:  # another thread opened it meanwhile
      os.close(fd)
    return entry


def _open_file_limit() -> int:
  import resource  # pylint: disable=g-import-not-at-top

  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  return soft if soft != resource.RLIM_INFINITY else 2**16


_RANGE_FILES = _RangeFiles()


def _file_key(info: os.stat_result) -> tuple[int, int, int, int]:
  return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _nonblocking(path: str, flags: int) -> int:
  try:
    # O_NOFOLLOW: a symlink put in place of a checkpoint file would read
    # whatever it points to, outside the item directory.
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise OSError(errno.ELOOP, "is a symbolic link; a checkpoint's files are read only as "
                    "regular files inside their item directory, never through a link", path) from None
    raise


def _read_into_bytearray(f: Any, path: str, size: int) -> bytearray:
  """The rest of open file `f`, of `size` bytes when measured, read in place into one bytearray.

  Bounded by the measured size; a raw read may return less than asked (FUSE,
  NFS), so it reads until the file ends.
  """
  data = bytearray(size)
  with memoryview(data) as view:
    filled = 0
    while filled < size:
      count = f.readinto(view[filled:])
      if not count:
        break
      filled += count
  if filled == size and f.read(1):  # it grew while being read
    raise TooLargeError(path, size + 1, size, exact=False)
  del data[filled:]  # it shrank while being read: what there was
  return data




class _ObjectStoreBackend:
  """URLs through fsspec: every call bounded by `StoreBounds`, its errors typed by `_object_store.translate`."""

  def absolute(self, path: str) -> str:
    return path

  def read_bytes(self, path: str, max_bytes: int, writable: bool) -> bytes | bytearray:
    fs, key = store.filesystem(path)
    # One ranged request: a larger object shows itself by the extra byte.
    data = store.bounded(fs, path, "read", fs.cat_file, key, start=0, end=max_bytes + 1)
    if len(data) > max_bytes:
      raise TooLargeError(path, len(data), max_bytes, exact=False)
    return bytearray(data) if writable else data

  def write_bytes(self, path: str, data: bytes) -> None:
    fs, key = store.filesystem(path)
    store.bounded(fs, path, "write", fs.pipe_file, key, data)

  def write_stream(self, path: str, produce: Callable[[BinaryIO], None]) -> None:
    fs, key = store.filesystem(path)
    spool = store.Spool(lambda: store.StoreFile(
        store.guarded((path, "write", None), fs.open, key, "wb", **store.profile(path).file_options()), path,
        "write"))
    try:
      produce(spool)  # type: ignore[arg-type]
      if spool.stream is None:  # small: one simple upload, as write_bytes makes
        store.bounded(fs, path, "write", fs.pipe_file, key, bytes(spool.buffer))
      else:
        spool.stream.close()
    except BaseException:
      spool.discard()
      raise

  def list_entries(self, directory: str) -> list[tuple[str, bool]]:
    fs, key = store.filesystem(directory)
    fs.invalidate_cache(key)  # another client (Orbax's) may have written since
    found = []
    for info in store.bounded(fs, directory, "list", fs.ls, key, detail=True):
      name = info["name"].rstrip("/").rsplit("/", 1)[-1]
      if info["name"].rstrip("/") != key.rstrip("/"):  # ls of a file lists the file
        found.append((name, info.get("type") == "directory"))
    return found

  def list_names(self, directory: str) -> list[str]:
    return [name for name, _ in self.list_entries(directory)]

  def is_dir(self, path: str) -> bool:
    fs, key = store.filesystem(path)
    fs.invalidate_cache(key)
    return store.bounded(fs, path, "list", fs.isdir, key)

  def is_file(self, path: str) -> bool:
    fs, key = store.filesystem(path)
    return store.bounded(fs, path, "stat", fs.isfile, key)

  def glob(self, pattern: str) -> list[str]:
    fs, key = store.filesystem(pattern)
    return sorted(fs.unstrip_protocol(match) for match in store.bounded(fs, pattern, "list", fs.glob, key))

  def open_read(self, path: str, generation: str | None) -> BinaryIO:
    fs, key = store.filesystem(path, versioned=bool(generation))
    profile = store.profile(path)
    f = store.guarded((path, "read", generation), fs.open, profile.pinned_target(key, generation), "rb",
                      **profile.file_options())
    return store.StoreFile(f, path, "read", generation)  # type: ignore[return-value]

  def generation(self, path: str) -> str | None:
    fs, key = store.filesystem(path)
    fs.invalidate_cache(key)
    return store.profile(path).pin_of(store.bounded(fs, path, "stat", fs.info, key))

  def identity(self, path: str) -> Identity:
    fs, key = store.filesystem(path)
    fs.invalidate_cache(key)
    return _identity_of(store.profile(path), store.bounded(fs, path, "stat", fs.info, key))

  def glob_identities(self, pattern: str) -> dict[str, Identity]:
    fs, key = store.filesystem(pattern)
    fs.invalidate_cache(key.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0].rsplit("/", 1)[0])  # the listing afresh
    found = store.bounded(fs, pattern, "list", fs.glob, key, detail=True)
    return {fs.unstrip_protocol(name): _identity_of(store.profile(pattern), info) for name, info in found.items()
            if info.get("type", "file") == "file"}

  def pin(self, path: str) -> str | None:
    return self.generation(path)

  def read_range(self, path: str, pin: Any, start: int, end: int, local: threading.local) -> bytes:
    del local  # one request per read: no state kept
    fs, key = store.filesystem(path)
    return store.bounded(fs, path, "read", fs.cat_file, key, start=start, end=end, reads_generation=pin,
                         **store.profile(path).pinned_range(pin))


_VERSION_KEYS = ("generation", "version_id", "VersionId", "ETag", "etag", "crc32c", "md5Hash")


def _identity_of(profile: store.StoreProfile, info: dict[str, Any]) -> Identity:
  """An object's identity from its metadata, as a stat or a listing gives it (the same fields)."""
  parts = [f"{k}={info[k]}" for k in _VERSION_KEYS if info.get(k) not in (None, "")]
  return Identity(int(info["size"]), ",".join(parts) or None, profile.pin_of(info),
                  _checksums.StoreChecksum.of_metadata(info))
_LOCAL = _LocalBackend()
_OBJECT_STORE = _ObjectStoreBackend()


def _backend(path: str | os.PathLike[str]) -> _Backend:
  """The backend of a path: the one place a local path and a URL part ways."""
  return _OBJECT_STORE if is_url(path) else _LOCAL


def _failed_write(path: str, regular: bool, error: BaseException) -> NoReturn:
  """Removes the partial file a failed local write left (only a regular file of ours, never a device a
  symlink pointed to) and raises: an OSError named for the file, anything else as it is."""
  if regular:
    try:
      os.unlink(path)
    except OSError:
      pass
  if isinstance(error, OSError):
    raise OSError(error.errno, f"cannot write it ({error.strerror or error})", path) from error
  raise error
