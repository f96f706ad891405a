"""Grain's per-epoch shuffle, as the positions of a make_dataset stream need it.

`grain.MapDataset.source(records).shuffle(seed)` gives index e*L + p the
record `index_shuffle(p, L - 1, (seed + e) % 2**32, rounds=4)`: every epoch its
own permutation (grain/_src/python/dataset/transformations/shuffle.py). The
data map (`datamap`) asks that for every record it names, from a state alone,
so this module calls Grain's compiled `index_shuffle` directly: loaded by its
file under Grain's own module name, without importing Grain's package (which
imports JAX: 1.5 s for a command that reads a few headers); a later `import
grain` finds it loaded. Where the file is not found (another Grain
layout), Grain's public `MapDataset.range(L).shuffle(seed)` answers instead
(same values, slower). tests/unit/test_permutation.py holds both equal to Grain's
shuffle. Where many indices are asked at once (an epoch's order of every file,
a window's records ranked), `_index_shuffle` computes them in one numpy pass,
once it agreed with the extension in this process.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ckpt_iter import _index_shuffle as index_shuffle_lib

_MODULE = "index_shuffle_module"
_PACKAGE = "grain._src.python.experimental.index_shuffle.python"
_RELATIVE = os.path.join(*_PACKAGE.split(".")[1:])
_ROUNDS = 4  # what Grain's ShuffleMapDataset uses


@functools.lru_cache(maxsize=1)
def _compiled() -> Callable[[int, int, int, int], int] | None:
  name = f"{_PACKAGE}.{_MODULE}"
  if name in sys.modules:  # Grain loaded it: one copy of an extension per process
    return sys.modules[name].index_shuffle
  spec = importlib.util.find_spec("grain")
  if spec is None or not spec.submodule_search_locations:
    return None
  for base in spec.submodule_search_locations:
    directory = os.path.join(base, _RELATIVE)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
      path = os.path.join(directory, _MODULE + suffix)
      if os.path.isfile(path):
        # Under Grain's own name, so that a later `import grain` finds it loaded and loads no second copy.
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(module_spec)
        loader.exec_module(module)
        sys.modules[name] = module
        return module.index_shuffle
  return None


@functools.lru_cache(maxsize=16)
def _public(length: int, seed: int):
  import grain  # pylint: disable=g-import-not-at-top

  return grain.MapDataset.range(length).shuffle(seed=seed)


def shuffled(index: int, length: int, seed: int | None) -> int:
  """The source record at index `index` of `MapDataset.source(L records).shuffle(seed)` (None: no shuffle).

  `index` may pass the length: index e*L + p is epoch e's record at p.
  """
  epoch, offset = divmod(index, length)
  if seed is None:
    return offset
  compiled = _compiled()
  if compiled is None:
    return int(_public(length, seed)[index])  # a range wraps: its value is the offset in the epoch
  return compiled(offset, length - 1, (seed + epoch) % 2**32, _ROUNDS)


def epoch_function(epoch: int, length: int, seed: int | None) -> Callable[[int], int]:
  """p -> the source record at position p of epoch `epoch` (one lookup per call, no setup per record)."""
  if seed is None:
    return lambda offset: offset
  compiled = _compiled()
  if compiled is None:
    dataset = _public(length, seed)
    return lambda offset: int(dataset[epoch * length + offset])
  epoch_seed, last = (seed + epoch) % 2**32, length - 1
  return lambda offset: compiled(offset, last, epoch_seed, _ROUNDS)


# ---------------------------------------------------------------------------
# The shard-aware shuffle (make_dataset(shuffle="shards")).
#
# Epoch e reads the source's shards (its files, or fixed-size blocks of
# records) in an order of its own, cut into windows of `window` consecutive
# shards; the records of one window are read in an order of their own, before
# any record of the next window. So a reader has at most `window` shards open
# at a time and reads each of them whole before it moves on; and the source
# record at any stream index is still computed from (seed, epoch, index)
# alone, with Grain's `index_shuffle`:
#
#   order_e   = permutation(shards, seed(seed, e, "order"))       the shards, in reading order
#   window w  = order_e[w*window : (w+1)*window]; its records are one block of positions of the epoch
#   in window = permutation(records of w, seed(seed, e, w))        the window's records, in reading order
#
# permutation(n, s) at q is index_shuffle(q, n - 1, s) for n > RANKED_MAX. For
# a smaller domain index_shuffle walks cycles of a much larger one (measured
# here: 1.7 ms a call at n = 10, 23 us at 1,000, 2.7 us at 60,000), so there
# it is the ranks of index_shuffle keys in the uint32 domain (position q holds
# the index with the q-th smallest key): n calls of ~2.5 us, once per window.
# The seeds are derived by hashing, not by adding (as Grain's per-epoch seed
# does), so that (e, w) and (e + 1, w - 1) draw independent permutations.
#
# With V lanes (make_dataset(shard_lanes=V)) the epoch's reading order (order_e's
# shards, each shard's records in turn) is cut into V consecutive shares, and
# the windows above are taken within each lane's share (a shard cut by a
# share's end is a piece in each of the two lanes); offset o of the epoch is
# row o mod G of its global batch (G = V * R), lane (o mod G) div R's position
# (o div G) * R + (o mod G) mod R. V = 1 is the order above, record for record
# (lane 0's windows draw the seeds above). docs/guarantees.md gives it whole.

SHUFFLE_FIELD = "shuffle"
WINDOW_FIELD = "shuffle_window"
SHARDS_FIELD = "shuffle_shards"
LANES_FIELD = "shuffle_lanes"  # make_dataset(shard_lanes=V), written only when V > 1
LANE_ROWS_FIELD = "shuffle_lane_rows"  # the rows each lane gives a global batch (global batch / V)
GLOBAL = "global"  # Grain's full shuffle: no fingerprint field says it (states written before keep their fields)
SHARDS = "shards"
KINDS = (GLOBAL, SHARDS)
DEFAULT_WINDOW = 8  # shards a make_dataset(shuffle="shards") window holds when shuffle_window is not given
RANKED_MAX = 2**16
# The most shards a layout may name (a shard is a file or a block of records): its decode is bounded by it.
MAX_SHARDS = 2**24
MAX_LANES = 2**20  # make_dataset(shard_lanes=...) and its fingerprint field are bounded by it
_KEY_DOMAIN = 2**32


def source_shards_field(name: str) -> str:
  """The fingerprint field of a mixture source's shard layout: `shuffle_shards[name]`."""
  return f"{SHARDS_FIELD}[{name}]"


def lane_fields(fingerprint: Any) -> tuple[int, int | None]:
  """(lanes, rows per lane of a global batch) a fingerprint names (1, None: no lanes), decoded within bounds.

  Raises:
    ValueError: the fields are not 2 to MAX_LANES lanes whose rows make the
      fingerprint's global batch, of a single source (the caller names the state).
  """
  if LANES_FIELD not in fingerprint and LANE_ROWS_FIELD not in fingerprint:
    return 1, None
  lanes, rows = fingerprint.get(LANES_FIELD), fingerprint.get(LANE_ROWS_FIELD)
  batch = fingerprint.get("global_batch_size")
  ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (lanes, rows, batch))
  if (not ints or not 2 <= lanes <= MAX_LANES or rows < 1 or lanes * rows != batch
      or any(str(name).startswith(SHARDS_FIELD + "[") for name in fingerprint)):
    raise ValueError(
        f"fingerprint fields {LANES_FIELD!r}={_short(lanes)} and {LANE_ROWS_FIELD!r}={_short(rows)} do not "
        f"describe shard lanes of a single source: 2 to {MAX_LANES:,} lanes whose rows make the global batch "
        f"(global_batch_size={_short(batch)}), as make_dataset(shard_lanes=...) writes them")
  return lanes, rows


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def _derived_seed(seed: int, *parts: object) -> int:
  text = ":".join(str(p) for p in (seed, *parts))
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def _index_shuffle(index: int, size: int, seed: int) -> int:
  """Position `index` of Grain's permutation of range(size) drawn by `seed`."""
  compiled = _compiled()
  if compiled is None:
    return int(_public(size, seed)[index])  # epoch 0 of Grain's shuffle: index_shuffle with `seed` itself
  return compiled(index, size - 1, seed, _ROUNDS)


# From this many indices on, one numpy pass (`_index_shuffle`) costs less than a call into Grain's extension each.
_VECTORIZED_FROM = 64


@functools.lru_cache(maxsize=1)
def _vectorized() -> bool:
  """Whether `_index_shuffle.index_shuffle` may stand in for Grain's extension: only where the extension is
  here to compare it with, and agrees (checked once a process, about a millisecond)."""
  compiled = _compiled()
  return compiled is not None and index_shuffle_lib.agrees(compiled, _ROUNDS)


def _index_shuffle_range(size: int, domain: int, seed: int) -> list[int]:
  """[_index_shuffle(i, domain, seed) for i in range(size)], at once where it can be."""
  if size >= _VECTORIZED_FROM and _vectorized():
    return index_shuffle_lib.index_shuffle(np.arange(size, dtype=np.uint64), domain - 1, seed, _ROUNDS).tolist()
  return [_index_shuffle(i, domain, seed) for i in range(size)]


def _ranked(size: int, seed: int) -> list[int]:
  """range(size) permuted by `seed`, for size <= RANKED_MAX: the indices sorted by their index_shuffle key."""
  if size >= _VECTORIZED_FROM and _vectorized():
    keys = index_shuffle_lib.index_shuffle(np.arange(size, dtype=np.uint64), _KEY_DOMAIN - 1, seed, _ROUNDS)
    return np.argsort(keys, kind="stable").tolist()  # the keys are distinct (a permutation's): no tie to break
  keys = [_index_shuffle(i, _KEY_DOMAIN, seed) for i in range(size)]
  return sorted(range(size), key=keys.__getitem__)


def layout_text(offsets: Sequence[int]) -> str:
  """The shard sizes of `offsets` ([0, end of shard 0, ..., length]), run-length encoded: "1000x59,617".

  Exact for any layout, short for the usual ones (equal files, or equal
  blocks and a shorter last one): what the fingerprint field SHARDS_FIELD holds.
  """
  sizes = [b - a for a, b in zip(offsets, offsets[1:])]
  runs: list[list[int]] = []
  for size in sizes:
    if runs and runs[-1][0] == size:
      runs[-1][1] += 1
    else:
      runs.append([size, 1])
  return ",".join(f"{size}x{count}" if count > 1 else str(size) for size, count in runs)


def layout_offsets(text: str, length: int | None = None) -> list[int]:
  """The offsets a `layout_text` names ([0, ..., length]), decoded within bounds.

  At most MAX_SHARDS shards and, given `length` (the source's), shards
  summing to exactly `length`: a layout that names more is refused before
  any of it is built, so a hostile field costs what a real one does.

  Raises:
    ValueError: `text` is no layout, or one past the bounds (the caller names the field).
  """
  offsets = [0]
  for run in str(text).split(","):
    size, _, count = run.partition("x")
    size_value, count_value = int(size), int(count) if count else 1
    if size_value < 1 or count_value < 1:
      raise ValueError(f"shard run {run!r} is not positive")
    if length is not None and offsets[-1] + size_value * count_value > length:
      raise ValueError(f"shard run {run!r} runs past the source's {length:,} records")
    if len(offsets) - 1 + count_value > MAX_SHARDS:
      raise ValueError(f"shard run {run!r} makes more than {MAX_SHARDS:,} shards")
    for _ in range(count_value):
      offsets.append(offsets[-1] + size_value)
  if length is not None and offsets[-1] != length:
    raise ValueError(f"the shards hold {offsets[-1]:,} records, the source {length:,}")
  return offsets


def block_offsets(length: int, shard_size: int) -> list[int]:
  """Offsets of fixed blocks of `shard_size` records over `length` (the last block may be shorter)."""
  return list(range(0, length, shard_size)) + [length]


class _Window:
  """One window of a lane's epoch: its pieces of shards in reading order and its permutation.

  A piece is (first source record, records): a whole shard, or the part of
  one that falls in the lane (lanes split the epoch's reading order where
  their shares end).
  """

  def __init__(self, pieces: list[tuple[int, int]], seed: int):
    self.pieces, self.seed = pieces, seed
    self.starts = [0]
    for _, size in pieces:
      self.starts.append(self.starts[-1] + size)
    size = self.starts[-1]
    self.ranked = _ranked(size, seed) if size <= RANKED_MAX else None

  def source(self, in_window: int) -> int:
    """The source record at position `in_window` of this window."""
    if self.ranked is not None:
      record = self.ranked[in_window]
    else:
      record = _index_shuffle(in_window, self.starts[-1], self.seed)
    k = bisect.bisect_right(self.starts, record) - 1
    return self.pieces[k][0] + record - self.starts[k]


class _Kept(dict):
  """A few values by key, the oldest dropped first; safe under Grain's read threads."""

  def __init__(self, limit: int):
    super().__init__()
    self._limit, self._lock = limit, threading.Lock()

  def get_or_make(self, key: Any, make: Callable[[], Any]) -> Any:
    found = self.get(key)
    if found is None:
      found = make()  # outside the lock: two threads may both build it, the same value
      with self._lock:
        while len(self) >= self._limit:
          self.pop(next(iter(self)))
        self[key] = found
    return found


class _Lane:
  """One lane's share of one epoch: its pieces of shards in reading order, cut into windows."""

  _WINDOWS_KEPT = 8  # a reader reads one window of a lane at a time; its read threads may reach into the next

  def __init__(self, shuffle: "ShardShuffle", epoch: int, lane: int, pieces: list[tuple[int, int]]):
    self.pieces = pieces
    self.window_starts = [0]
    for first in range(0, len(pieces), shuffle.window):
      self.window_starts.append(self.window_starts[-1] + sum(n for _, n in pieces[first:first + shuffle.window]))
    self._shuffle, self._epoch, self._lane = shuffle, epoch, lane
    self._windows = _Kept(self._WINDOWS_KEPT)

  @property
  def window_count(self) -> int:
    return len(self.window_starts) - 1

  def window_of(self, position: int) -> int:
    """The number of the window holding lane position `position`."""
    return bisect.bisect_right(self.window_starts, position) - 1

  def window(self, number: int) -> _Window:
    size = self._shuffle.window
    return self._windows.get_or_make(number, lambda: _Window(
        self.pieces[number * size:(number + 1) * size], self._shuffle.window_seed(self._epoch, self._lane, number)))

  def window_shards(self, number: int) -> list[int]:
    """The shards of window `number`, in reading order."""
    size = self._shuffle.window
    return [self._shuffle.shard_of(first) for first, _ in self.pieces[number * size:(number + 1) * size]]

  def source(self, position: int) -> int:
    number = self.window_of(position)
    return self.window(number).source(position - self.window_starts[number])


class _EpochPlan:
  """One epoch of a ShardShuffle: the shards in reading order and each lane's share of it."""

  def __init__(self, shuffle: "ShardShuffle", epoch: int):
    offsets, count = shuffle.offsets, shuffle.shard_count
    order_seed = _derived_seed(shuffle.seed, epoch, "order")
    if count <= RANKED_MAX:
      self.order = _ranked(count, order_seed)
    else:
      self.order = _index_shuffle_range(count, count, order_seed)
    self.reading_starts = [0]  # where each shard of `order` starts in the epoch's reading order
    for s in self.order:
      self.reading_starts.append(self.reading_starts[-1] + offsets[s + 1] - offsets[s])
    self._shuffle, self._epoch = shuffle, epoch
    # Every lane a process reads at once is kept (a process reads lanes / processes of them).
    self._lanes = _Kept(max(shuffle.lanes, 1))

  def lane(self, number: int) -> _Lane:
    return self._lanes.get_or_make(number, lambda: self._make_lane(number))

  def _make_lane(self, number: int) -> _Lane:
    offsets, starts = self._shuffle.offsets, self.reading_starts
    first, end = self._shuffle.lane_starts[number], self._shuffle.lane_starts[number + 1]
    pieces = []
    k = bisect.bisect_right(starts, first) - 1
    while first < end:
      shard = self.order[k]
      stop = min(end, starts[k + 1])
      pieces.append((offsets[shard] + first - starts[k], stop - first))
      first, k = stop, k + 1
    return _Lane(self._shuffle, self._epoch, number, pieces)

  def source(self, offset: int) -> int:
    lane, position = self._shuffle.lane_position(offset)
    return self.lane(lane).source(position)


class ShardShuffle:
  """make_dataset(shuffle="shards")'s order: stream index -> source record (see the comment above).

  With lanes (make_dataset(shard_lanes=V)), each epoch's reading order is cut
  into V consecutive shares, one per lane; lane v reads only its share, in
  windows of its own; and offset o of the epoch is row o % G of its batch
  (G = V * lane_rows, the global batch), which is row (o % G) % lane_rows of
  lane (o % G) // lane_rows. So the rows a process reads of each global batch
  (a contiguous run, its lanes' when the process count divides V) come from
  its lanes' shards alone. One lane is the order without lanes.

  Args:
    offsets: the shards' first records and the source's length ([0, ..., L]), increasing.
    window: shards per window.
    seed: the run's seed (uint32).
    lanes: the number of lanes (1: none).
    lane_rows: with lanes > 1, the rows each lane gives a global batch (global batch / lanes).
  """

  _EPOCHS_KEPT = 4  # a reader is in one epoch; the data map may look back at the one before

  def __init__(self, offsets: Sequence[int], window: int, seed: int, lanes: int = 1, lane_rows: int | None = None):
    self.offsets = [int(o) for o in offsets]
    if len(self.offsets) < 2 or self.offsets[0] != 0 or any(
        b <= a for a, b in zip(self.offsets, self.offsets[1:])):
      raise ValueError(f"shard offsets must increase from 0, got {self.offsets[:8]}...")
    if window < 1:
      raise ValueError(f"window={window} must be positive")
    if lanes < 1 or lanes > MAX_LANES:
      raise ValueError(f"lanes={lanes} must be in [1, {MAX_LANES:,}]")
    if lanes > 1 and (lane_rows is None or lane_rows < 1):
      raise ValueError(f"lane_rows={lane_rows} must be positive with {lanes} lanes")
    self.window, self.seed = int(window), int(seed)
    self.lanes, self.lane_rows = int(lanes), None if lanes == 1 else int(lane_rows)
    self.length, self.shard_count = self.offsets[-1], len(self.offsets) - 1
    self.lane_starts = self._lane_starts()
    self._epochs = _Kept(self._EPOCHS_KEPT)

  def _lane_starts(self) -> list[int]:
    """Where each lane's share starts in an epoch's reading order ([0, ..., L]): the same every epoch."""
    if self.lanes == 1:
      return [0, self.length]
    full, short = divmod(self.length, self.lanes * self.lane_rows)  # the epoch's last batch is `short` rows
    starts = [0]
    for lane in range(self.lanes):
      starts.append(starts[-1] + full * self.lane_rows + min(max(short - lane * self.lane_rows, 0), self.lane_rows))
    return starts

  def __getstate__(self) -> dict[str, Any]:
    # What defines it, not its caches (their lock does not pickle): mp_prefetch workers get a copy.
    return {"offsets": self.offsets, "window": self.window, "seed": self.seed, "lanes": self.lanes,
            "lane_rows": self.lane_rows}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["offsets"], state["window"], state["seed"], state.get("lanes", 1), state.get("lane_rows"))

  def lane_position(self, offset: int) -> tuple[int, int]:
    """(lane, position in the lane's share) of offset `offset` of an epoch."""
    if self.lanes == 1:
      return 0, offset
    batch, row = divmod(offset, self.lanes * self.lane_rows)
    lane, lane_row = divmod(row, self.lane_rows)
    return lane, batch * self.lane_rows + lane_row

  def window_seed(self, epoch: int, lane: int, number: int) -> int:
    # Lane 0 draws what the order without lanes draws, so one lane is that order exactly.
    if lane == 0:
      return _derived_seed(self.seed, epoch, number)
    return _derived_seed(self.seed, epoch, number, "lane", lane)

  def plan(self, epoch: int) -> _EpochPlan:
    return self._epochs.get_or_make(epoch, lambda: _EpochPlan(self, epoch))

  def source(self, index: int) -> int:
    """The source record at stream index `index` (which may pass the length: epoch index // L)."""
    epoch, offset = divmod(int(index), self.length)
    return self.plan(epoch).source(offset)

  def epoch_function(self, epoch: int) -> Callable[[int], int]:
    """p -> the source record at position p of epoch `epoch`."""
    return self.plan(epoch).source

  def windows(self, epoch: int, lane: int = 0) -> list[list[int]]:
    """The shards lane `lane` reads in epoch `epoch`, window by window, in reading order."""
    found = self.plan(epoch).lane(lane)
    return [found.window_shards(number) for number in range(found.window_count)]

  def window_key(self, index: int) -> tuple[int, int, int]:
    """(epoch, lane, window number) of the window stream index `index` reads from."""
    epoch, offset = divmod(int(index), self.length)
    lane, position = self.lane_position(offset)
    return epoch, lane, self.plan(epoch).lane(lane).window_of(position)

  def shards_ahead(self, index: int, windows: int = 2, epochs: int | None = None) -> list[int]:
    """The shards a reader at stream index `index` reads next, in order: its window's and `windows` - 1 more.

    Those of its lane only (a reader of other lanes reads them at their own
    indices). Crosses into the lane's share of the next epoch. A shard's
    records are `offsets[k]` to `offsets[k + 1]` (which files hold them:
    `sources.file_offsets`); a shard split between two lanes is named by both.
    With `epochs` (a stream of that many), never past its last epoch.
    """
    epoch, lane, number = self.window_key(index)
    ahead: list[int] = []
    found = self.plan(epoch).lane(lane)
    for _ in range(windows):
      if number >= found.window_count:
        if epochs is not None and epoch + 1 >= epochs:
          break
        epoch, number = epoch + 1, 0
        found = self.plan(epoch).lane(lane)
      ahead.extend(found.window_shards(number))
      number += 1
    return ahead

  def window_shards_by_first_use(self, index: int, scan: int) -> list[int]:
    """The shards of `index`'s window in the order its reader first reads them from `index` on.

    Looks at most `scan` positions of the lane ahead; shards not met by then are left out.
    """
    epoch, offset = divmod(int(index), self.length)
    lane, position = self.lane_position(offset)
    found = self.plan(epoch).lane(lane)
    number = found.window_of(position)
    size = len(found.window_shards(number))
    needed: list[int] = []
    for at in range(position, min(found.window_starts[number + 1], position + scan)):
      shard = self.shard_of(found.source(at))
      if shard not in needed:
        needed.append(shard)
        if len(needed) == size:
          break
    return needed

  def shard_of(self, record: int) -> int:
    """The shard holding source record `record`."""
    return bisect.bisect_right(self.offsets, record) - 1
