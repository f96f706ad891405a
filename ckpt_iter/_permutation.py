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
shuffle.
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

SHUFFLE_FIELD = "shuffle"
WINDOW_FIELD = "shuffle_window"
SHARDS_FIELD = "shuffle_shards"
GLOBAL = "global"  # Grain's full shuffle: no fingerprint field says it (states written before keep their fields)
SHARDS = "shards"
KINDS = (GLOBAL, SHARDS)
DEFAULT_WINDOW = 8  # shards a make_dataset(shuffle="shards") window holds when shuffle_window is not given
RANKED_MAX = 2**16
# The most shards a layout may name (a shard is a file or a block of records): its decode is bounded by it.
MAX_SHARDS = 2**24
_KEY_DOMAIN = 2**32


def source_shards_field(name: str) -> str:
  """The fingerprint field of a mixture source's shard layout: `shuffle_shards[name]`."""
  return f"{SHARDS_FIELD}[{name}]"


def _derived_seed(seed: int, *parts: object) -> int:
  text = ":".join(str(p) for p in (seed, *parts))
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def _index_shuffle(index: int, size: int, seed: int) -> int:
  """Position `index` of Grain's permutation of range(size) drawn by `seed`."""
  compiled = _compiled()
  if compiled is None:
    return int(_public(size, seed)[index])  # epoch 0 of Grain's shuffle: index_shuffle with `seed` itself
  return compiled(index, size - 1, seed, _ROUNDS)


def _ranked(size: int, seed: int) -> list[int]:
  """range(size) permuted by `seed`, for size <= RANKED_MAX: the indices sorted by their index_shuffle key."""
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
  """One window of an epoch: its shards in reading order, where their records start in it, its permutation."""

  def __init__(self, offsets: list[int], shards: list[int], seed: int):
    self.shards, self.seed = shards, seed
    self.starts = [0]
    for s in shards:
      self.starts.append(self.starts[-1] + offsets[s + 1] - offsets[s])
    size = self.starts[-1]
    self.ranked = _ranked(size, seed) if size <= RANKED_MAX else None

  def source(self, offsets: list[int], in_window: int) -> int:
    """The source record at position `in_window` of this window."""
    if self.ranked is not None:
      record = self.ranked[in_window]
    else:
      record = _index_shuffle(in_window, self.starts[-1], self.seed)
    k = bisect.bisect_right(self.starts, record) - 1
    return offsets[self.shards[k]] + record - self.starts[k]


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


class _EpochPlan:
  """One epoch of a ShardShuffle: the shards in reading order and where each window starts."""

  _WINDOWS_KEPT = 8  # a reader reads one window at a time; its read threads may reach into the next

  def __init__(self, shuffle: "ShardShuffle", epoch: int):
    offsets, count = shuffle.offsets, shuffle.shard_count
    order_seed = _derived_seed(shuffle.seed, epoch, "order")
    if count <= RANKED_MAX:
      self.order = _ranked(count, order_seed)
    else:
      self.order = [_index_shuffle(k, count, order_seed) for k in range(count)]
    self.window_starts = [0]
    for first in range(0, count, shuffle.window):
      shards = self.order[first:first + shuffle.window]
      self.window_starts.append(self.window_starts[-1] + sum(offsets[s + 1] - offsets[s] for s in shards))
    self._shuffle, self._epoch = shuffle, epoch
    self._windows = _Kept(self._WINDOWS_KEPT)

  def window(self, number: int) -> _Window:
    size = self._shuffle.window
    return self._windows.get_or_make(number, lambda: _Window(
        self._shuffle.offsets, self.order[number * size:(number + 1) * size],
        _derived_seed(self._shuffle.seed, self._epoch, number)))

  def source(self, offset: int) -> int:
    number = bisect.bisect_right(self.window_starts, offset) - 1
    return self.window(number).source(self._shuffle.offsets, offset - self.window_starts[number])


class ShardShuffle:
  """make_dataset(shuffle="shards")'s order: stream index -> source record (see the comment above).

  Args:
    offsets: the shards' first records and the source's length ([0, ..., L]), increasing.
    window: shards per window.
    seed: the run's seed (uint32).
  """

  _EPOCHS_KEPT = 4  # a reader is in one epoch; the data map may look back at the one before

  def __init__(self, offsets: Sequence[int], window: int, seed: int):
    self.offsets = [int(o) for o in offsets]
    if len(self.offsets) < 2 or self.offsets[0] != 0 or any(
        b <= a for a, b in zip(self.offsets, self.offsets[1:])):
      raise ValueError(f"shard offsets must increase from 0, got {self.offsets[:8]}...")
    if window < 1:
      raise ValueError(f"window={window} must be positive")
    self.window, self.seed = int(window), int(seed)
    self.length, self.shard_count = self.offsets[-1], len(self.offsets) - 1
    self._epochs = _Kept(self._EPOCHS_KEPT)

  def __getstate__(self) -> dict[str, Any]:
    # What defines it, not its caches (their lock does not pickle): mp_prefetch workers get a copy.
    return {"offsets": self.offsets, "window": self.window, "seed": self.seed}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["offsets"], state["window"], state["seed"])

  def plan(self, epoch: int) -> _EpochPlan:
    return self._epochs.get_or_make(epoch, lambda: _EpochPlan(self, epoch))

  def source(self, index: int) -> int:
    """The source record at stream index `index` (which may pass the length: epoch index // L)."""
    epoch, offset = divmod(int(index), self.length)
    return self.plan(epoch).source(offset)

  def epoch_function(self, epoch: int) -> Callable[[int], int]:
    """p -> the source record at position p of epoch `epoch`."""
    return self.plan(epoch).source

  def windows(self, epoch: int) -> list[list[int]]:
    """The shards of epoch `epoch`, window by window, in reading order (what a cache prefetches next)."""
    order = self.plan(epoch).order
    return [order[first:first + self.window] for first in range(0, self.shard_count, self.window)]

  def shards_ahead(self, index: int, windows: int = 2) -> list[int]:
    """The shards a reader at stream index `index` reads next, in order: its window's and `windows` - 1 more.

    Crosses into the next epoch. A shard's records are `offsets[k]` to
    `offsets[k + 1]` (which files hold them: `sources.file_offsets`).
    """
    epoch, offset = divmod(int(index), self.length)
    plan = self.plan(epoch)
    number = bisect.bisect_right(plan.window_starts, offset) - 1
    ahead: list[int] = []
    for _ in range(windows):
      if number * self.window >= self.shard_count:
        epoch, number, plan = epoch + 1, 0, self.plan(epoch + 1)
      ahead.extend(plan.order[number * self.window:(number + 1) * self.window])
      number += 1
    return ahead

  def shard_of(self, record: int) -> int:
    """The shard holding source record `record`."""
    return bisect.bisect_right(self.offsets, record) - 1
