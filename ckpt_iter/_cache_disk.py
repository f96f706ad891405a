"""Writing into a shard cache's directory: files held under an flock while written, and the errors of a disk
that cannot take them.

A file of the cache is written under an exclusive flock (`locked_file`): that
lock, never a process id, is how a sweep tells a live temporary from an
abandoned one (`is_held`, `remove_abandoned`: a cache's build sweeps its
directory). A download writes through a `CacheWriter`, whose
write errors are the cache's disk's (`CacheWriteFailed`), never the store's;
`cache_error` words them: a full disk with the bytes needed and free (a
decompressed copy measured to its end), anything else naming the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from typing import Any, Iterator

from ckpt_iter import errors

CACHE_ENV = "CKPT_ITER_SHARD_CACHE_DIR"


@contextlib.contextmanager
def locked_file(target: str, mode: str) -> Iterator[Any]:
  """A file of the cache opened for writing, held under an exclusive flock while open.

  A sweep may take a temporary for abandoned between its creation and its
  lock, and remove it (holding the lock): one found unlinked once locked is
  created again.
  """
  while True:
    f = open(target, mode)  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
      if os.fstat(f.fileno()).st_nlink > 0:
        break
    except BaseException:
      f.close()
      raise
    f.close()
  with f:
    yield f


def cache_error(directory: str, max_bytes: int, path: str, needed: int, error: OSError, *,
              decompressed_from: int | None = None) -> errors.StorageError:
  """The error of a cache directory that cannot be written: a full disk, permissions, a read-only mount.

  `decompressed_from`: the compressed object's size, when `needed` is its decompressed text's.
  """
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    return no_space_error(directory, max_bytes, path, needed, error, decompressed_from=decompressed_from)
  shown = error.strerror or str(error) or type(error).__name__
  return errors.StorageError(
      f"shard cache {directory}: cannot write {os.path.basename(path)} there ({shown}). Make the "
      "directory writable by this process (its owner, its mode, a read-only mount) and check its disk, "
      "or point the cache at another directory (ShardCache(directory=...) or "
      f"{CACHE_ENV}).", path=directory, operation="cache", cause="cache")

def no_space_error(directory: str, max_bytes: int, path: str, needed: int, error: OSError, *,
                 decompressed_from: int | None = None) -> errors.StorageError:
  """The error of a full disk under the cache: names the directory, the bytes needed and free.

  `decompressed_from`: the compressed object's size, when `needed` is its decompressed text's.
  """
  try:
    free = f"{shutil.disk_usage(directory).free:,} bytes free"
  except OSError:
    free = "free space unknown"
  if decompressed_from is not None:
    # The cache made room for the object's size; its text is what must fit.
    return errors.StorageError(
        f"shard cache {directory}: no space left on its disk for the decompressed text of {path}: "
        f"it is {needed:,} bytes ({decompressed_from:,} compressed; {free}; {error.strerror or error}). "
        f"Free at least {needed:,} bytes there, or point the cache at a larger disk: a compressed "
        "file is kept decompressed, and its text, not the object, must fit on the disk.",
        path=directory, operation="cache", cause="no_space")
  needed_text = f"{needed:,} bytes needed for {path}" if needed else f"writing {path}"
  return errors.StorageError(
      f"shard cache {directory}: no space left on its disk ({needed_text}; {free}; "
      f"{error.strerror or error}). Free space there, point the cache at a larger disk, or lower "
      f"its max_bytes ({max_bytes:,}) below the disk's free space.",
      path=directory, operation="cache", cause="no_space")


class CacheWriteFailed(Exception):
  """A write into the cache failed (told apart from the store's errors a download raises).

  `needed`: the bytes the copy takes (`decompressed`: measured to its end, past the failure).
  """

  def __init__(self, error: OSError, needed: int = 0, decompressed: bool = False):
    super().__init__(str(error))
    self.error, self.needed, self.decompressed = error, needed, decompressed


class CacheWriter:
  """The temporary file a download writes into: its write errors are the cache's, not the store's.

  With `measure_after_failure` (a decompressed copy, whose size nothing
  says beforehand), a failed write is held back and the rest only counted,
  so that `finish` raises it with the size the whole copy needs.
  """

  def __init__(self, f: Any, measure_after_failure: bool = False):
    self._f, self._measure = f, measure_after_failure
    self._written = 0
    self._failed: OSError | None = None

  def write(self, data: Any) -> int:
    size = memoryview(data).nbytes
    if self._failed is None:
      try:
        self._f.write(data)
      except OSError as e:
        if not self._measure:
          raise CacheWriteFailed(e, self._written + size) from e
        self._failed = e
    self._written += size
    return size

  def finish(self) -> None:
    """Flushes and fsyncs what was written (raises a failure held back, with the size measured)."""
    if self._failed is not None:
      raise CacheWriteFailed(self._failed, self._written, decompressed=True) from self._failed
    try:
      self._f.flush()
      os.fsync(self._f.fileno())
    except OSError as e:
      raise CacheWriteFailed(e, self._written, decompressed=self._measure) from e


def is_held(lock_path: str) -> bool:
  """Whether someone holds an flock on `lock_path` (False when it does not exist)."""
  try:
    fd = os.open(lock_path, os.O_RDONLY)
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
  except BlockingIOError:
    return True
  finally:
    os.close(fd)


def remove_abandoned(directory: str) -> None:
  """Removes the temporaries in a cache's `directory` of writes that no one is making any more.

  A temporary is live while its writer holds its exclusive flock, or, for
  a download, the entry's download lock: liveness rests on locks the
  kernel drops when the writer dies, never on process ids (which mean
  nothing to a process in another PID namespace sharing the disk).
  """
  for name in os.listdir(directory):
    if ".tmp-" not in name:
      continue
    temporary = os.path.join(directory, name)
    download_lock = temporary.rsplit(".tmp-", 1)[0] + ".lock"
    if is_held(download_lock):
      continue  # a download of that entry is under way
    try:
      fd = os.open(temporary, os.O_RDONLY)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      if not is_held(download_lock):  # again: a download may have begun since
        with contextlib.suppress(OSError):
          os.unlink(temporary)
    except BlockingIOError:
      pass  # being written
    finally:
      os.close(fd)
