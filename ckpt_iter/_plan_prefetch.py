"""Prefetch by plan: make_dataset(shuffle="shards") tells a cached source which files it reads next.

A shard-aware shuffle knows, from (seed, epoch, index) alone, the shards a
reader reads next: the rest of its window, then the next window. When the
source reads through a `ShardCache` and can prefetch (the JSONL, Parquet
and ArrayRecord sources), the reader asks it for the files of those shards,
in the order it needs them, as it enters each window; a restore asks first
for the files at the restored position.

Bounded: the files of the reader's window and of the next window, and never
more bytes than the cache's `max_bytes` (a JSONL file's copy with its line
index: `cached_bytes`), so that a prefetch never evicts a file the plan
needs sooner (a copy in use is never evicted anyway). Entering a
window, the source closes its idle copies of every other file (`release`),
so that they, not the files prefetched, make room. With shard lanes
(make_dataset(shard_lanes=...)) the plan is the reader's lane's: a process
reading several lanes prefetches for each within max_bytes / those lanes, and
keeps every lane's files from `release`.

Only a speed-up: which record an index reads never depends on it. A failure
here is logged; a download that failed spent the file's budget of retries,
so a read of that file soon after raises its error (the store's typed
errors, as without prefetch) instead of trying as long again
(`ShardCache._recent_failure`).
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Any, Sequence

from ckpt_iter import _permutation
from ckpt_iter import _source_files

_log = logging.getLogger(__name__)

# benchmarks/bucket.py turns it off (before make_dataset) to measure the source's own prefetch by file index.
ENABLED = True
_WINDOWS = 2  # the reader's window and the next one
_SCAN = 1024  # positions scanned to order the current window's shards by first use
_SEEN_KEPT = 64
_MIXTURE_SCAN = 4096  # stream records a restore looks through for each mixture source's first one


class PlanPrefetch:
  """Prefetches, for one source read in a ShardShuffle's order, the files the plan reads next.

  Made by `for_source` (None when the source has nothing to prefetch).
  Picklable: a Grain worker gets its own, with nothing seen yet.
  """

  def __init__(self, order: _permutation.ShardShuffle, records: Any, file_offsets: list[int],
               file_sizes: list[int], max_bytes: int, epochs: int | None = None):
    self.order, self.records, self.epochs = order, records, epochs
    self.file_offsets, self.file_sizes, self.max_bytes = list(file_offsets), list(file_sizes), int(max_bytes)
    self._init_local()

  def _init_local(self) -> None:
    self._seen: dict[tuple[int, int, int], None] = {}  # (epoch, lane, window) prefetched for, oldest first
    self._lanes_read: dict[int, None] = {}  # with lanes: those this reader entered a window of, oldest first
    self._ahead: dict[int, list[int]] = {}  # lane -> the files last prefetched for it (kept from `release`)
    self._lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    for local in ("_seen", "_lanes_read", "_ahead", "_lock"):
      state.pop(local)
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._init_local()

  @classmethod
  def for_source(cls, order: _permutation.ShardShuffle, records: Any,
                 epochs: int | None = None) -> "PlanPrefetch | None":
    """The prefetcher of `records` read in `order` for `epochs` epochs (None: no end), or None (no cache,
    prefetch off, or nothing to fetch)."""
    if (not ENABLED or not isinstance(records, _source_files.FileSource) or records.cache is None
        or not records.prefetch_files):
      return None
    records.follow_plan()  # the plan, not the file index, says what comes next
    return cls(order, records, records.file_offsets(), records.cached_bytes(), records.cache.max_bytes, epochs)

  def at(self, index: int) -> None:
    """A read of stream index `index`: on entering a window not seen yet, prefetch what comes next."""
    key = self.order.window_key(index)
    if key in self._seen:
      return
    self.start_from(index, key)

  def start_from(self, index: int, key: tuple[int, int, int] | None = None) -> None:
    """Prefetches the files a reader at `index` reads next (a restore calls it before the first read)."""
    if not ENABLED:
      return
    try:
      if key is None:
        key = self.order.window_key(index)
      with self._lock:
        if key in self._seen:
          return
        self._seen[key] = None
        while len(self._seen) > _SEEN_KEPT:
          self._seen.pop(next(iter(self._seen)))
        lane = key[1]
        self._lanes_read.pop(lane, None)
        self._lanes_read[lane] = None  # the lanes this reader reads, the latest last
        while len(self._lanes_read) > self.order.lanes:
          self._lanes_read.pop(next(iter(self._lanes_read)))
        share = self.max_bytes // len(self._lanes_read)
      files = self.files_ahead(index, share)
      with self._lock:
        self._ahead = {n: f for n, f in self._ahead.items() if n in self._lanes_read}
        self._ahead[lane] = files
        keep = [f for lane_files in self._ahead.values() for f in lane_files]
      self.records.release(keep)  # the others closed where idle: their copies, not these, make room
      if files:
        self.records.prefetch(files)
    except Exception as e:  # pylint: disable=broad-except
      _log.info("prefetch by plan at stream index %d failed (%s); reads fetch their files themselves", index, e)

  def files_ahead(self, index: int, max_bytes: int | None = None) -> list[int]:
    """The files a reader at `index` reads next, in the order it first needs them, within `max_bytes`
    (default the cache's)."""
    limit = self.max_bytes if max_bytes is None else max_bytes
    shards = self.shards_ahead(index)
    files: list[int] = []
    total = 0
    for shard in shards:
      for f in self._files_of(shard):
        if f in files:
          continue
        if total + self.file_sizes[f] > limit:
          return files
        total += self.file_sizes[f]
        files.append(f)
    return files

  def shards_ahead(self, index: int) -> list[int]:
    """The shards of the reader's window (its lane's), by first read at or after `index`, then the next window's."""
    ahead = self.order.shards_ahead(index, windows=_WINDOWS, epochs=self.epochs)
    needed = self.order.window_shards_by_first_use(index, _SCAN)
    return needed + [s for s in ahead if s not in needed]

  def _files_of(self, shard: int) -> list[int]:
    """The files holding shard `shard`'s records (one, unless shards are blocks across files)."""
    first, end = self.order.offsets[shard], self.order.offsets[shard + 1]
    offsets = self.file_offsets
    low, high = bisect.bisect_right(offsets, first) - 1, bisect.bisect_left(offsets, end)
    return [f for f in range(low, high) if offsets[f + 1] > offsets[f]]  # not a file without records


def of_chain(dataset: Any) -> PlanPrefetch | None:
  """The PlanPrefetch in a source's dataset chain (its ShardShuffleDataset's), or None."""
  while True:
    found = getattr(dataset, "plan_prefetch", None)
    if isinstance(found, PlanPrefetch):
      return found
    parents = getattr(dataset, "parents", ())
    if len(parents) != 1:
      return None
    dataset = parents[0]


def start_restore(prefetches: Sequence[PlanPrefetch | None], names: Sequence[str], stream_record: int,
                  mixture: Any) -> None:
  """A restore's prefetch: each cached source's files read from stream record `stream_record` on, first.

  `prefetches`: each of make_dataset's sources' PlanPrefetch (`of_chain`) or
  None (`names`: a mixture's source names, in that order); `mixture`: the
  restored `_records.Mixture`, or None. make_dataset hands this to its node
  only when a source has one: no other restore enters this module.
  """
  if not ENABLED:
    return
  try:
    if mixture is None:
      firsts = {0: stream_record}
    else:  # each source's first record at or after it
      firsts = {}
      for record in range(stream_record, stream_record + _MIXTURE_SCAN):
        name, index = mixture.source_of(record)
        firsts.setdefault(list(names).index(name), index)
        if len(firsts) == len(prefetches):
          break
  except Exception as e:  # pylint: disable=broad-except
    _log.info("prefetch by plan at a restore (stream record %d) failed (%s)", stream_record, e)
    return
  for number, index in firsts.items():
    if prefetches[number] is not None:
      prefetches[number].start_from(index)
