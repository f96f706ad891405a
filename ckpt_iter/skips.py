"""Skip ranges: records of make_dataset's stream a run passes over, as a value its states carry.

A user declares a `Skip` (a bad range found after a loss spike): stream ranges
`[start, stop)`, or every-epoch ranges `(start, stop, since)` of a single
unshuffled source (source records start..stop-1 of every epoch from stream
record `since` on). A restore resolves it against the restored position into
`Skips` (`resolve`): records read before it were trained. A state holds its
run's skips in the make_dataset fingerprint field `skips` (`Skips.to_text`),
so every later restore keeps them. Batches are cut from the stream with the
skipped records removed (`_records.BatchPlan`, in the *kept* coordinate of an
epoch, which counts only the records not skipped); a lookup costs O(ranges
touching the epoch), never O(position). Every operation sweeps sorted lists:
O(k) in the ranges.

Pure integer arithmetic: no Grain, JAX or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import numbers
from typing import Any, Iterable, Sequence

from ckpt_iter import errors

# ---------------------------------------------------------------------------
# Skip ranges: records of the stream a run passes over, as a value a state carries.

SKIPS_FIELD = "skips"  # the make_dataset fingerprint field holding a run's skips (`Skips.to_text`)
MAX_RANGES = 10_000  # ranges a state may hold (its text is ~20 bytes a range)
_MAX_TEXT = 64 * MAX_RANGES




def merged(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
  """Sorted, disjoint, non-adjacent ranges covering the same records (empty ones dropped)."""
  result: list[list[int]] = []
  for start, stop in sorted((int(a), int(b)) for a, b in ranges if b > a):
    if result and start <= result[-1][1]:
      result[-1][1] = max(result[-1][1], stop)
    else:
      result.append([start, stop])
  return tuple((a, b) for a, b in result)


def subtract(ranges: Sequence[tuple[int, int]], minus: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
  """The records of merged `ranges` not in merged `minus`: one sweep of both, O(len(ranges) + len(minus))."""
  result = []
  first = 0  # the first range of `minus` that ends after the current range's start
  for start, stop in ranges:
    while first < len(minus) and minus[first][1] <= start:
      first += 1
    cursor, index = start, first
    while index < len(minus) and minus[index][0] < stop:
      a, b = minus[index]
      if a > cursor:
        result.append((cursor, a))
      cursor = max(cursor, b)
      index += 1
    if cursor < stop:
      result.append((cursor, stop))
  return tuple(result)


class _Covers:
  """Every-epoch ranges (a, b, s) added so far: does one cover (start, stop, since)? O(log n) each.

  (a, b, s) covers it when a <= start, stop <= b and s <= since: the same
  source records or more, from the same stream record or earlier. Callers add
  ranges in the order of their starts and ask only about ranges starting at
  or after them (a <= start); this answers the rest: the least `since` of the
  ranges whose stop is >= stop (a Fenwick tree over the stops, largest first).
  """

  def __init__(self, stops: Iterable[int]):
    self._stops = sorted(set(stops))
    self._least: list[float] = [math.inf] * (len(self._stops) + 1)

  def add(self, stop: int, since: int) -> None:
    slot = len(self._stops) - bisect.bisect_left(self._stops, stop)
    while slot < len(self._least):
      self._least[slot] = min(self._least[slot], since)
      slot += slot & -slot

  def cover(self, stop: int, since: int) -> bool:
    slot, least = len(self._stops) - bisect.bisect_left(self._stops, stop), math.inf
    while slot > 0:
      least = min(least, self._least[slot])
      slot -= slot & -slot
    return least <= since


def covered(entries: Sequence[tuple[int, int, int]], by: Sequence[tuple[int, int, int]]) -> list[bool]:
  """For each every-epoch range of `entries`: does a range of `by` cover it (see `_Covers`)?

  One sweep over the starts: O((n + m) log m), where comparing every pair was O(n * m).
  """
  covers = _Covers(b for _, b, _ in by)
  # At equal starts `by`'s ranges come first (kind 0): a <= start.
  events = sorted([(a, 0, i) for i, (a, _, _) in enumerate(by)] + [(a, 1, i) for i, (a, _, _) in enumerate(entries)])
  result = [False] * len(entries)
  for _, kind, i in events:
    if kind == 0:
      covers.add(by[i][1], by[i][2])
    else:
      result[i] = covers.cover(entries[i][1], entries[i][2])
  return result


def count(ranges: Iterable[tuple[int, int]]) -> int:
  return sum(b - a for a, b in ranges)


def ranges_text(ranges: Any) -> str:
  """Record ranges as every message writes them: `[start, stop)`, stop excluded, as `skip=` takes them
  and `which --json` prints them."""
  return ", ".join(f"[{a}, {b})" for a, b in ranges)


@dataclasses.dataclass(frozen=True)
class Skips:
  """The records a run skips (see the module docstring). Build with `Skips.of`.

  Attributes:
    records: stream ranges [start, stop), sorted, disjoint and non-adjacent.
    every_epoch: (start, stop, since): source records [start, stop) of every
      epoch of a single unshuffled source, from stream record `since` on.
  """

  records: tuple[tuple[int, int], ...] = ()
  every_epoch: tuple[tuple[int, int, int], ...] = ()

  @classmethod
  def of(cls, records: Iterable[tuple[int, int]] = (),
         every_epoch: Iterable[tuple[int, int, int]] = ()) -> "Skips":
    """The normalized value: ranges merged; an every-epoch range covered by an earlier one dropped."""
    entries = sorted((int(a), int(b), int(s)) for a, b, s in every_epoch if b > a)
    kept: list[tuple[int, int, int]] = []
    covers = _Covers(b for _, b, _ in entries)
    for start, stop, since in entries:  # by start: every range kept before starts at or before this one
      if not covers.cover(stop, since):
        kept.append((start, stop, since))
        covers.add(stop, since)
    return cls(records=merged(records), every_epoch=tuple(kept))

  def __bool__(self) -> bool:
    return bool(self.records or self.every_epoch)

  def __len__(self) -> int:
    """The number of ranges."""
    return len(self.records) + len(self.every_epoch)

  def union(self, other: "Skips") -> "Skips":
    return Skips.of(self.records + other.records, self.every_epoch + other.every_epoch)

  def covers(self, other: "Skips") -> bool:
    """Every record `other` skips, this skips too (as far as the forms compare)."""
    if subtract(other.records, self.records):
      return False
    return all(covered(other.every_epoch, self.every_epoch))

  def added_to(self, before: "Skips") -> "Skips":
    """The ranges this skips beyond `before`."""
    every = tuple(entry for entry, old in zip(self.every_epoch, covered(self.every_epoch, before.every_epoch))
                  if not old)
    return Skips(records=subtract(self.records, before.records), every_epoch=every)

  # -- the fingerprint field

  def to_text(self) -> str:
    value: dict[str, Any] = {}
    if self.records:
      value["records"] = [list(r) for r in self.records]
    if self.every_epoch:
      value["every_epoch"] = [list(r) for r in self.every_epoch]
    return json.dumps(value, separators=(",", ":"))

  @classmethod
  def from_text(cls, text: Any, *, origin: str) -> "Skips":
    """The value of a fingerprint's `skips` field (None or absent: no skips).

    Raises:
      InvalidStateError: the text is not a valid skip list (the message shows it).
    """
    if text is None:
      return NO_SKIPS
    value = None
    if isinstance(text, str) and len(text) <= _MAX_TEXT:
      try:
        value = json.loads(text)
      except ValueError:
        value = None
    records = value.get("records", []) if isinstance(value, dict) else None
    every = value.get("every_epoch", []) if isinstance(value, dict) else None
    if (
        not isinstance(value, dict) or not set(value) <= {"records", "every_epoch"}
        or not isinstance(records, list) or not isinstance(every, list)
        or len(records) + len(every) > MAX_RANGES
        or not all(isinstance(r, list) and len(r) == 2 and all(map(is_count, r)) and r[0] < r[1] for r in records)
        or not all(isinstance(r, list) and len(r) == 3 and all(map(is_count, r)) and r[0] < r[1] for r in every)
    ):
      shown = text if not isinstance(text, str) or len(text) <= 120 else text[:117] + "..."
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field {SKIPS_FIELD!r} is {shown!r}; expected JSON "
          '{"records": [[start, stop], ...], "every_epoch": [[start, stop, since], ...]} of at most '
          f"{MAX_RANGES} ranges, each start < stop. The state is corrupt or edited: restore another step.")
    result = cls.of(records=[tuple(r) for r in records], every_epoch=[tuple(r) for r in every])
    return result

  def describe(self, *, limit: int = 8) -> str:
    """`stream records [100, 200), [300, 340); source records [5, 9) of every epoch from stream record 120`.

    Ranges are written as `skip=` takes them: [start, stop), stop excluded (`ranges_text`).
    """
    parts = []
    if self.records:
      shown = ranges_text(self.records[:limit])
      more = len(self.records) - limit
      parts.append(f"stream records {shown}{f' (+{more} more ranges)' if more > 0 else ''} "
                   f"({count(self.records)} records)")
    for start, stop, since in self.every_epoch[:limit]:
      parts.append(f"source records {ranges_text([(start, stop)])} of every epoch from stream record {since}")
    return "; ".join(parts) or "none"

  # -- where the skipped records are

  def skipped_in_stream(self, start: int, stop: int) -> int:
    """Stream ranges' records in [start, stop) (every-epoch ranges not counted: they need the epoch length)."""
    total = 0
    index = max(bisect.bisect_right(self._starts, start) - 1, 0)
    for a, b in self.records[index:]:
      if a >= stop:
        break
      total += max(0, min(b, stop) - max(a, start))
    return total

  @functools.cached_property
  def _starts(self) -> list[int]:
    return [a for a, _ in self.records]

  @functools.cached_property
  def _skipped_before(self) -> list[int]:
    """Records of the stream ranges before range i (a prefix sum, one more than the ranges)."""
    sums = [0]
    for a, b in self.records:
      sums.append(sums[-1] + b - a)
    return sums

  def kept_before(self, record: int) -> int:
    """Stream records before `record` not skipped by a stream range (a stream without epochs)."""
    index = bisect.bisect_right(self._starts, record) - 1
    if index < 0:
      return record
    a, b = self.records[index]
    return record - self._skipped_before[index] - (min(b, record) - a)

  @functools.cached_property
  def _kept_starts(self) -> list[int]:
    """Kept records before range i: the kept coordinate where range i sits."""
    return [a - before for (a, _), before in zip(self.records, self._skipped_before)]

  def stream_record_of_kept(self, kept: int) -> int:
    """The stream record of the `kept`-th record not skipped (a stream without epochs): O(log ranges)."""
    return kept + self._skipped_before[bisect.bisect_right(self._kept_starts, kept)]

  def kept_records(self, start: int, stop: int, *, base: int = 0) -> Sequence[int]:
    """base + the stream records of kept records start..stop-1 (a stream without epochs), in order.

    O(log ranges + records): the first is found by binary search, the rest
    by walking on, jumping over the ranges met (merged ranges end on a kept record).
    """
    if stop <= start:
      return ()
    record = self.stream_record_of_kept(start)
    index = bisect.bisect_right(self._starts, record)  # the first range after `record` (a kept one)
    ranges = self.records
    if index == len(ranges) or ranges[index][0] >= record + (stop - start):
      return range(base + record, base + record + stop - start)
    result = []
    for _ in range(stop - start):
      result.append(base + record)
      record += 1
      if index < len(ranges) and ranges[index][0] == record:
        record = ranges[index][1]
        index += 1
    return result

  @property
  def skipped_count(self) -> int:
    """Records of the stream ranges."""
    return self._skipped_before[-1]

  def skipped(self, record: int, epoch_length: int | None) -> bool:
    """Whether stream record `record` is skipped."""
    index = bisect.bisect_right(self._starts, record) - 1
    if index >= 0 and record < self.records[index][1]:
      return True
    if epoch_length:
      offset = record % epoch_length
      return any(record >= since and a <= offset < b for a, b, since in self.every_epoch)
    return False

  def in_epoch(self, epoch: int, epoch_length: int) -> tuple[tuple[int, int], ...]:
    """The skipped offsets of epoch `epoch` (records epoch*L + offset), merged."""
    return self.of_epoch(epoch, epoch_length).records

  def of_epoch(self, epoch: int, epoch_length: int) -> "Skips":
    """The skipped offsets of epoch `epoch` as stream ranges of the epoch alone.

    Its kept coordinates are the epoch's: `kept_before(offset)`,
    `stream_record_of_kept(kept)` and `kept_records` answer in O(log ranges of the epoch).
    Epochs between two `epoch_breaks` skip the same offsets, so one answer
    serves all of them: the last few such answers are kept, and memory stays
    O(ranges) however many epochs a run reads.
    """
    breaks = self.__dict__.setdefault("_breaks", {})
    found_breaks = breaks.get(epoch_length)
    if found_breaks is None:
      if len(breaks) >= _KEPT_EPOCH_CLASSES:
        breaks.clear()
      found_breaks = breaks[epoch_length] = self.epoch_breaks(epoch_length)
    cache = self.__dict__.setdefault("_epochs", {})
    key = (bisect.bisect_right(found_breaks, epoch) - 1, epoch_length)  # the class of epochs it is in
    found = cache.get(key)
    if found is None:
      if len(cache) >= _KEPT_EPOCH_CLASSES:
        del cache[next(iter(cache))]  # the oldest
      found = cache[key] = Skips(records=_in_epoch(self, epoch, epoch_length))
    return found

  def epoch_breaks(self, epoch_length: int) -> list[int]:
    """Epochs where the skipped offsets may change: between two breaks, every epoch skips the same."""
    breaks = {0}
    for start, stop in self.records:
      for epoch in (start // epoch_length, (stop - 1) // epoch_length):
        breaks.update((epoch, epoch + 1))
    for _, _, since in self.every_epoch:
      breaks.update((since // epoch_length, since // epoch_length + 1))
    return sorted(breaks)


NO_SKIPS = Skips()
# Classes of epochs (`Skips.epoch_breaks`) whose skipped offsets `of_epoch` keeps.
_KEPT_EPOCH_CLASSES = 8


def _in_epoch(skips: Skips, epoch: int, length: int) -> tuple[tuple[int, int], ...]:
  low, high = epoch * length, (epoch + 1) * length
  intervals = []
  index = max(bisect.bisect_right(skips._starts, low) - 1, 0)  # pylint: disable=protected-access
  for a, b in skips.records[index:]:
    if a >= high:
      break
    if b > low:
      intervals.append((max(a, low) - low, min(b, high) - low))
  for a, b, since in skips.every_epoch:
    if since < high:
      start = max(a, since - low)
      if start < min(b, length):
        intervals.append((start, min(b, length)))
  return merged(intervals)


# ---------------------------------------------------------------------------
# What a user declares.


@dataclasses.dataclass(frozen=True)
class Skip:
  """Records to skip, as a user declares them (resolved against a run by `resolve`).

  Attributes:
    records: stream-record ranges [start, stop): positions in the run's data
      order (`ckpt-iter which --json` prints a batch's `stream_records`).
    source_records: source-record ranges [start, stop) of a single unshuffled
      source: skipped in every epoch from the restart on.
  """

  records: tuple[tuple[int, int], ...] = ()
  source_records: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    for name in ("records", "source_records"):
      object.__setattr__(self, name, _checked_ranges(getattr(self, name), name))
    if len(self.records) + len(self.source_records) > MAX_RANGES:
      raise errors.InvalidArgumentError(
          f"Skip holds {len(self.records) + len(self.source_records)} ranges; at most {MAX_RANGES} are supported.")

  def __bool__(self) -> bool:
    return bool(self.records or self.source_records)

  @classmethod
  def of(cls, value: Any) -> "Skip":
    """A Skip from a Skip, a list of (start, stop) stream ranges, or None (nothing)."""
    if value is None:
      return cls()
    if isinstance(value, Skip):
      return value
    return cls(records=value)

  def union(self, other: "Skip") -> "Skip":
    """Both declarations' ranges in one (they are merged when resolved against a run)."""
    return Skip(records=self.records + other.records, source_records=self.source_records + other.source_records)

  @classmethod
  def parse(cls, text: str) -> "Skip":
    """`records:100-199,300-339;source:5-8`: inclusive ranges (a single number is one record).

    Raises:
      InvalidArgumentError: the text does not follow that form (the message shows it).
    """
    records, source = [], []
    for part in (p.strip() for p in str(text).split(";")):
      if not part:
        continue
      kind, _, ranges = part.partition(":")
      target = {"records": records, "source": source}.get(kind.strip())
      if target is None or not ranges.strip():
        raise errors.InvalidArgumentError(
            f"skip {text!r}: {part!r} is not `records:A-B,...` or `source:A-B,...` (inclusive ranges of "
            "stream or source records, e.g. records:1200-1263;source:5-8).")
      for item in ranges.split(","):
        target.append(_inclusive_range(item.strip(), text))
    return cls(records=tuple(records), source_records=tuple(source))

  def describe(self) -> str:
    """The declaration in words, e.g. `stream records [40, 56); source records [5, 9)`."""
    parts = []
    if self.records:
      parts.append("stream records " + ranges_text(self.records))
    if self.source_records:
      parts.append("source records " + ranges_text(self.source_records))
    return "; ".join(parts) or "nothing"


def _inclusive_range(item: str, text: str) -> tuple[int, int]:
  first, _, last = item.partition("-")
  if not (first.isdigit() and (not last or last.isdigit())) or (last and int(last) < int(first)):
    raise errors.InvalidArgumentError(
        f"skip {text!r}: {item!r} is not a record or an inclusive range A-B with A <= B (e.g. 1200-1263).")
  return int(first), int(last or first) + 1


def _checked_ranges(ranges: Any, name: str) -> tuple[tuple[int, int], ...]:
  try:
    items = [tuple(r) for r in ranges]
  except TypeError:
    items = None
  if items is None or not all(len(r) == 2 and all(map(is_count, r)) and r[0] < r[1] for r in items):
    shown = repr(ranges)
    raise errors.InvalidArgumentError(
        f"Skip({name}={shown[:80]}): expected ranges (start, stop) of integers 0 <= start < stop "
        "(stop excluded), e.g. [(1200, 1264)].")
  return tuple((int(a), int(b)) for a, b in items)


def resolve(declared: Skip, *, from_record: int | None, epoch_length: int | None, shuffled: bool,
            mixture: bool, origin: str) -> tuple[Skips, tuple[tuple[int, int], ...]]:
  """A declaration as skips from stream record `from_record` on, and the stream ranges already read.

  Args:
    declared: what the user declared.
    from_record: the restored position (records before it were read:
      they are not skipped), or None where the position is not a stream
      record (a Grain index above make_dataset): everything declared applies.
    epoch_length: the single source's length, or None (a mixture).
    shuffled: the source is shuffled (source records have no cheap stream position).
    mixture: the pipeline is a mixture.
    origin: what errors name.

  Returns:
    (the skips, the declared stream ranges before `from_record`, not skipped).

  Raises:
    UnsupportedConfigError: source records of a shuffled source or a mixture.
  """
  start = from_record or 0
  records = merged(declared.records)
  already = tuple((a, min(b, start)) for a, b in records if a < start)
  records = tuple((max(a, start), b) for a, b in records if b > start)
  every = tuple((a, b, start) for a, b in declared.source_records)
  check_skips(Skips(every_epoch=every), epoch_length=epoch_length, shuffled=shuffled, mixture=mixture,
              named=f"Skip(source_records={list(declared.source_records)[:4]})", origin=origin)
  return Skips.of(records, every), already


def check_skips(skips: Skips, *, epoch_length: int | None, shuffled: bool, mixture: bool, named: str, origin: str,
                global_batch_size: int | None = None, drop_remainder: bool = True,
                stream_length: int | None = None, restored: bool = False) -> None:
  """The one rule of which skips a make_dataset pipeline can keep, declared or restored.

  Every-epoch ranges need a single unshuffled source and must fall inside
  it. With `global_batch_size` (make_dataset's own batches), the every-epoch
  ranges must leave each epoch at least one batch (one record without
  drop_remainder): otherwise every epoch from their start on yields none,
  and an endless stream would never yield again.

  Args:
    skips: the skips (resolved, or as a state holds them).
    named: how the message names them (`Skip(source_records=...)`, the state's field ...).
    stream_length: records in the stream, None without an end.
    restored: they come from a state (its errors say so), not from a declaration.

  Raises:
    UnsupportedConfigError: every-epoch ranges of a shuffled source or a
      mixture; restored skips that leave this pipeline less than a batch per epoch.
    InvalidArgumentError: declared ranges past the source, or leaving less than a batch per epoch.
    InvalidStateError: restored every-epoch ranges past the source.
  """
  every = skips.every_epoch
  if not every:
    return
  if mixture or shuffled or epoch_length is None:
    raise errors.UnsupportedConfigError(
        f"{origin}: {named} needs a single unshuffled "
        f"source ({'a mixture' if mixture else 'seed is set: the source is shuffled'}): a shuffled "
        "epoch places source records by Grain's permutation, which has no inverse short of evaluating "
        "the whole epoch. Skip stream records instead (`ckpt-iter which --json` prints a batch's "
        "`stream_records`), or drop the records by content with make_dataset(filter=...).")
  over = [(a, b) for a, b, _ in every if b > epoch_length]
  if over:
    if restored:
      raise errors.InvalidStateError(
          f"{origin}: {named} holds source records {short_text(over[:4])} of every epoch, past the source's "
          f"{epoch_length} records. The state is corrupt or edited, or was written for another source: "
          "restore another step, or the pipeline that wrote it.")
    raise errors.InvalidArgumentError(
        f"{origin}: {named} reaches past the source's {epoch_length} records: source records "
        f"{short_text(over[:4])}. Skip source records below {epoch_length}.")
  applied = [entry for entry in every if stream_length is None or entry[2] < stream_length]
  if global_batch_size is None or not applied:
    return
  kept = epoch_length - count(merged((a, b) for a, b, _ in applied))
  needed = global_batch_size if drop_remainder else 1
  if kept >= needed:
    return
  since = max(s for _, _, s in applied)
  left = (f"{kept} of the source's {epoch_length} records per epoch, fewer than one global batch of "
          f"{global_batch_size} (drop_remainder=True)" if drop_remainder and kept else
          f"no record of the source's {epoch_length} in any epoch")
  consequence = (f"every epoch from stream record {since} on would yield no batch"
                 + (" and the stream, which has no end, none ever again" if stream_length is None else ""))
  if restored:
    raise errors.UnsupportedConfigError(
        f"{origin}: {named} leaves {left} of this pipeline: {consequence}. "
        + (f"Restore it with a global batch of at most {kept} or drop_remainder=False." if kept else
           "The state is corrupt or edited: restore another step."))
  raise errors.InvalidArgumentError(
      f"{origin}: {named} leaves {left}: {consequence}. Skip fewer source records"
      + (f", use a global batch of at most {kept}, or pass drop_remainder=False" if kept else "") + ".")


def is_count(value: Any) -> bool:
  """A non-negative integer, not a bool."""
  if type(value) is int:  # what JSON gives: the ABC check below costs ~1 us, and a restore asks ~70 times
    return value >= 0
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def short_text(value: Any) -> str:
  """repr(value), cut to 120 characters for a message."""
  text = repr(value)
  return text if len(text) <= 120 else text[:117] + "..."
