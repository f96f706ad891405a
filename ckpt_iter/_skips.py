"""Skip ranges: records of the stream a run passes over, as a value a state carries.

A make_dataset run may be told to pass over records (a bad range found after
a loss spike). What it skips is a set of records of its global stream
(`_records`): absolute positions in the run's data order, which no restart,
batch size or process count changes. Two forms:

  * stream ranges `[start, stop)`: stream records start..stop-1;
  * every-epoch ranges `(start, stop, since)`: of a single unshuffled source,
    source records start..stop-1 of every epoch, from stream record `since`
    on (epoch e holds source record p at stream record e * L + p).

A state holds its run's skips in the make_dataset fingerprint field `skips`
(`to_text`), so they travel with every position form (stream records, lanes,
a Grain index above make_dataset) and every nested state, and each later
restore keeps them. Batches are cut from the stream with the skipped records
removed: the *kept* coordinate of an epoch (`kept_offset`, `stream_offset`)
counts only the records not skipped. Every lookup costs O(number of ranges
touching the epoch), never O(position).

`Skip` is what a user declares (stream records, source records); a restore
resolves it against the restored position into `Skips` (`resolve`): records
already read before the position are not skipped (they were trained).

Pure integer arithmetic: no Grain, JAX or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import numbers
from typing import Any, Iterable, Iterator, Sequence

from ckpt_iter import errors

FIELD = "skips"  # the make_dataset fingerprint field holding a run's skips (`Skips.to_text`)
MAX_RANGES = 10_000  # ranges a state may hold (its text is ~20 bytes a range)
_MAX_TEXT = 64 * MAX_RANGES


def _is_count(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


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
  """The records of merged `ranges` not in merged `minus`."""
  result = []
  for start, stop in ranges:
    cursor = start
    for a, b in minus:
      if b <= cursor or a >= stop:
        continue
      if a > cursor:
        result.append((cursor, a))
      cursor = max(cursor, b)
    if cursor < stop:
      result.append((cursor, stop))
  return tuple(result)


def count(ranges: Iterable[tuple[int, int]]) -> int:
  return sum(b - a for a, b in ranges)


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
    kept: list[tuple[int, int, int]] = []
    for start, stop, since in sorted((int(a), int(b), int(s)) for a, b, s in every_epoch if b > a):
      if not any(s <= since and a <= start and stop <= b for a, b, s in kept):
        kept.append((start, stop, since))
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
    return all(any(s <= since and a <= start and stop <= b for a, b, s in self.every_epoch)
               for start, stop, since in other.every_epoch)

  def added_to(self, before: "Skips") -> "Skips":
    """The ranges this skips beyond `before`."""
    every = tuple(entry for entry in self.every_epoch
                  if not any(s <= entry[2] and a <= entry[0] and entry[1] <= b for a, b, s in before.every_epoch))
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
        or not all(isinstance(r, list) and len(r) == 2 and all(map(_is_count, r)) and r[0] < r[1] for r in records)
        or not all(isinstance(r, list) and len(r) == 3 and all(map(_is_count, r)) and r[0] < r[1] for r in every)
    ):
      shown = text if not isinstance(text, str) or len(text) <= 120 else text[:117] + "..."
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field {FIELD!r} is {shown!r}; expected JSON "
          '{"records": [[start, stop], ...], "every_epoch": [[start, stop, since], ...]} of at most '
          f"{MAX_RANGES} ranges, each start < stop. The state is corrupt or edited: restore another step.")
    result = cls.of(records=[tuple(r) for r in records], every_epoch=[tuple(r) for r in every])
    return result

  def describe(self, *, limit: int = 8) -> str:
    """`stream records 100-199, 300-339; source records 5-8 of every epoch from stream record 120`."""
    parts = []
    if self.records:
      shown = ", ".join(f"{a}-{b - 1}" for a, b in self.records[:limit])
      more = len(self.records) - limit
      parts.append(f"stream records {shown}{f' (+{more} more ranges)' if more > 0 else ''} "
                   f"({count(self.records)} records)")
    for start, stop, since in self.every_epoch[:limit]:
      parts.append(f"source records {start}-{stop - 1} of every epoch from stream record {since}")
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

  def stream_record_of_kept(self, kept: int) -> int:
    """The stream record of the `kept`-th record not skipped (a stream without epochs)."""
    # Range i has s_i - S_i kept records before it (S_i: records skipped before it).
    low, high = 0, len(self.records)
    while low < high:
      middle = (low + high) // 2
      if self.records[middle][0] - self._skipped_before[middle] <= kept:
        low = middle + 1
      else:
        high = middle
    return kept + self._skipped_before[low]

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
    """The skipped offsets of epoch `epoch` (records epoch*L + offset), merged (the last 256 kept)."""
    cache = self.__dict__.setdefault("_epochs", {})
    key = (epoch, epoch_length)
    if key not in cache:
      if len(cache) >= 256:
        cache.clear()
      cache[key] = _in_epoch(self, epoch, epoch_length)
    return cache[key]

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


def kept_offset(intervals: Sequence[tuple[int, int]], offset: int) -> int:
  """The kept records of an epoch before `offset`, given its skipped `intervals`."""
  return offset - sum(min(b, offset) - a for a, b in intervals if a < offset)


def stream_offset(intervals: Sequence[tuple[int, int]], kept: int) -> int:
  """The offset of an epoch's `kept`-th kept record, given its skipped `intervals`."""
  offset = kept
  for a, b in intervals:
    if a <= offset:
      offset += b - a
    else:
      break
  return offset


def kept_offsets(intervals: Sequence[tuple[int, int]], start: int, stop: int) -> Iterator[int]:
  """The offsets of kept records start..stop-1 (kept coordinates) of an epoch: O(records + intervals)."""
  offset = stream_offset(intervals, start)
  index = bisect.bisect_right([a for a, _ in intervals], offset)
  for _ in range(stop - start):
    while index < len(intervals) and intervals[index][0] <= offset:
      offset = max(offset, intervals[index][1])
      index += 1
    yield offset
    offset += 1


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
    """The declaration in words, e.g. `stream records 40-55; source records 5-8`."""
    parts = []
    if self.records:
      parts.append("stream records " + ", ".join(f"{a}-{b - 1}" for a, b in self.records))
    if self.source_records:
      parts.append("source records " + ", ".join(f"{a}-{b - 1}" for a, b in self.source_records))
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
  if items is None or not all(len(r) == 2 and all(map(_is_count, r)) and r[0] < r[1] for r in items):
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
  every = ()
  if declared.source_records:
    if mixture or shuffled or epoch_length is None:
      raise errors.UnsupportedConfigError(
          f"{origin}: Skip(source_records={list(declared.source_records)[:4]}) needs a single unshuffled "
          f"source ({'a mixture' if mixture else 'seed is set: the source is shuffled'}): a shuffled "
          "epoch places source records by Grain's permutation, which has no inverse short of evaluating "
          "the whole epoch. Skip stream records instead (`ckpt-iter which --json` prints a batch's "
          "`stream_records`), or drop the records by content with make_dataset(filter=...).")
    over = [(a, b) for a, b in declared.source_records if b > epoch_length]
    if over:
      raise errors.InvalidArgumentError(
          f"{origin}: Skip(source_records={over[:4]}) reaches past the source's {epoch_length} records.")
    every = tuple((a, b, start) for a, b in declared.source_records)
  return Skips.of(records, every), already
