"""A shard cache's bookkeeping: its byte total, shared by the processes of a host, and its eviction order.

The total lives in one small file of the cache directory (`LEDGER_NAME`),
under an exclusive flock that is also the cache's commit lock: a copy or a
companion is renamed into place, or evicted, and the total changed, in one
hold of it (`Ledger.held`). A process that lists the directory while holding
it (`ShardCache`, when a cache is opened) sees the copies and the total
agree, and writes the total again: whatever a killed process left undone is
made good there.

So an open, a close and a download cost O(1) whatever the number of files:
a read of the total, and, when something must be evicted, the next copies of
an `EvictionOrder` a process keeps from its last listing (a copy's last use
is its mtime, which every open refreshes). The order is looked at lazily: a
copy used since it was noted goes back in order, one evicted by another
process is dropped. The directory is listed when a cache is opened, and
again only when the order runs out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import os
from typing import Iterator

# The ledger's name ends in ".lock", as an entry's download lock does: nothing that lists copies takes it
# for one (`ShardCache.entries`, tests/cache_probe.py).
LEDGER_NAME = "ckpt_iter-usage.lock"
_LEDGER_MAX_BYTES = 64


class Ledger:
  """The byte total of a cache's complete copies and their companions, shared through a locked file."""

  def __init__(self, directory: str):
    self.path = os.path.join(directory, LEDGER_NAME)

  def total(self) -> int | None:
    """The total now (under a shared lock: never a half-written one); None when absent or not a total."""
    try:
      fd = os.open(self.path, os.O_RDONLY)
    except FileNotFoundError:
      return None
    try:
      fcntl.flock(fd, fcntl.LOCK_SH)
      return _parsed(os.pread(fd, _LEDGER_MAX_BYTES, 0))
    finally:
      os.close(fd)

  @contextlib.contextmanager
  def held(self) -> Iterator["Held"]:
    """The ledger under its exclusive lock: publish or evict inside, and say by how much the total moved.

    Raises:
      OSError: the ledger cannot be opened or written (the cache's directory).
    """
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      held = Held(fd, _parsed(os.pread(fd, _LEDGER_MAX_BYTES, 0)))
      yield held
      if held.changed:
        text = f"{max(held.total or 0, 0)}\n".encode()
        try:
          os.pwrite(fd, text, 0)
          os.ftruncate(fd, len(text))
        except OSError as e:
          raise OSError(e.errno, e.strerror, self.path) from e
    finally:
      os.close(fd)  # the lock goes with it


@dataclasses.dataclass
class Held:
  """The ledger while a process holds it: `total` (None when it was absent or garbled), `add`, `set`."""

  fd: int
  total: int | None
  changed: bool = False

  def add(self, delta: int) -> None:
    """Moves the total by `delta` bytes (a total that was not known stays unknown: a listing sets it)."""
    if delta and self.total is not None:
      self.total += delta
      self.changed = True

  def set(self, total: int) -> None:
    self.total, self.changed = total, True


def _parsed(data: bytes) -> int | None:
  try:
    value = int(data.decode("ascii").strip())
  except (UnicodeDecodeError, ValueError):
    return None
  return value if value >= 0 else None


def bytes_on_disk(*paths: str) -> int:
  """The bytes of those of `paths` that exist."""
  total = 0
  for path in paths:
    with contextlib.suppress(OSError):
      total += os.stat(path).st_size
  return total


class EvictionOrder:
  """Copies by last use, oldest first, as a process last saw them: a heap looked at lazily."""

  def __init__(self) -> None:
    self._heap: list[tuple[float, str]] = []
    self.listed = False  # filled from a listing since this process opened the cache

  def reset(self, copies: list[tuple[str, float]]) -> None:
    """The order of a listing: (copy path, last use) of every complete copy."""
    self._heap = [(last_use, path) for path, last_use in copies]
    heapq.heapify(self._heap)
    self.listed = True

  def note(self, path: str, last_use: float) -> None:
    """A copy this process published or used."""
    heapq.heappush(self._heap, (last_use, path))

  def oldest(self) -> Iterator[str]:
    """The copies least recently used first, each checked against its mtime now (used since: put back in
    order; gone: dropped). A copy the caller could not evict is kept (`keep`)."""
    while self._heap:
      noted, path = heapq.heappop(self._heap)
      try:
        last_use = os.stat(path).st_mtime
      except OSError:
        continue  # evicted by another process
      if last_use > noted:
        heapq.heappush(self._heap, (last_use, path))
        continue
      yield path

  def keep(self, paths: list[str]) -> None:
    """Copies `oldest` gave that are in use: back in the order, as they were."""
    for path in paths:
      with contextlib.suppress(OSError):
        heapq.heappush(self._heap, (os.stat(path).st_mtime, path))
