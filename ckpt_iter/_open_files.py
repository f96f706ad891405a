"""A process's open files, least recently used first: `OpenFiles`, the one home of the files readers keep open.

Three readers keep local files open between reads: a JSONL source its copies
in a shard cache (`_jsonl`), an ArrayRecord or Parquet source its readers of
them (`_cached_files.OpenReaders`), and `_storage` the local files it reads
in place. Each keeps at most some number open: a file in a read is never
closed, the idle ones past the limit go least recently used first, two
threads opening one file keep one of the two, and a forked worker starts
with none of its parent's. What an entry holds and how it is closed is the
caller's: an eviction closes an entry by the caller's function, and what
else is taken out is handed back to the caller to close.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any, Callable, Collection, Hashable


@dataclasses.dataclass
class OpenFile:
  """An open descriptor, the reader over it if any, and how many reads hold it now."""

  fd: int
  reader: Any = None
  readers: int = 0


class OpenFiles:
  """Entries (anything with a `readers` count) of open files by key, least recently used first, in this process.

  Pickled empty: a Grain worker opens its own. After a fork it is empty too
  (the parent's descriptors are the parent's to close).
  """

  def __init__(self):
    self._reset()

  def _reset(self) -> None:
    self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self._lock = threading.Lock()
    self._pid = os.getpid()

  def __getstate__(self) -> dict[str, Any]:
    return {}

  def __setstate__(self, state: dict[str, Any]) -> None:
    del state
    self._reset()

  def _here(self) -> bool:
    """Whether the entries are this process's; a forked worker's start empty, with a lock of their own."""
    if self._pid == os.getpid():
      return True
    self._reset()
    return False

  def __contains__(self, key: Hashable) -> bool:
    return self._pid == os.getpid() and key in self._entries

  def __len__(self) -> int:
    return len(self._entries) if self._pid == os.getpid() else 0

  def use(self, key: Hashable) -> Any | None:
    """The open entry of `key`, one reader more and marked as just used; None when it is not open."""
    if self._pid != os.getpid():  # (`_here`, inline: a read's path)
      self._reset()
      return None
    with self._lock:
      entry = self._entries.get(key)
      if entry is not None:
        self._entries.move_to_end(key)
        entry.readers += 1
      return entry

  def done(self, entry: Any) -> None:
    """One reader of `entry` fewer (a read that `use` or `add` counted is over)."""
    with self._lock:
      entry.readers -= 1

  def add(self, key: Hashable, opened: Any, readers: int = 1, limit: int | None = None,
          evict: Callable[[Hashable, Any], None] | None = None) -> tuple[Any, int]:
    """Keeps `opened` (opened by the caller, outside the lock) as `key`'s entry, with `readers` readers more.

    Past `limit`, the idle entries least recently used first (never `key`'s)
    are taken out and given to `evict(key, entry)` to close, under the lock: a
    thread that finds one gone opens it again only once its eviction is over
    (a cache's touch of the copy then made, not racing the copy's check).
    Returns the entry kept and how many were evicted. When another thread
    opened `key` meanwhile, its entry is kept and returned: the caller closes
    `opened`.
    """
    self._here()
    evicted = 0
    with self._lock:
      entry = self._entries.get(key)
      if entry is None:
        entry = self._entries[key] = opened
        if limit is not None:
          for other in _least_recent_idle(self._entries, len(self._entries) - limit, key):
            evict(other, self._entries.pop(other))
            evicted += 1
      entry.readers += readers
    return entry, evicted

  def take_idle(self, keep: Collection[Hashable]) -> list[tuple[Hashable, Any]]:
    """Takes out the entries no read holds whose keys are not in `keep`, for the caller to close."""
    if not self._here():
      return []
    with self._lock:
      idle = [key for key, entry in self._entries.items() if entry.readers == 0 and key not in keep]
      return [(key, self._entries.pop(key)) for key in idle]


def _least_recent_idle(entries: collections.OrderedDict, count: int, keep: Hashable) -> list[Hashable]:
  """The first `count` keys of `entries` (least recently used first) that no read holds, but `keep`.

  Walked only as far as they are found: a list of every open entry at each
  open is O(open) per open (1 ms a read with 10,000 copies open).
  """
  found: list[Hashable] = []
  if count <= 0:
    return found
  for key, entry in entries.items():
    if key != keep and entry.readers == 0:
      found.append(key)
      if len(found) == count:
        break
  return found
