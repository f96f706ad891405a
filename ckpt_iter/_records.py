"""The global record stream of make_dataset and where its batches fall.

A make_dataset pipeline reads one stream of records, the same for every
process count and every batch size:

  * one source: epoch e is the epoch's permutation of the source, record r
    of the stream is record perm_{r // L}(r % L);
  * a weighted mixture of named sources: each source runs through its own
    epochs (its own permutation each), and record g of the stream comes from
    the source a deterministic interleave of the weights picks (`Mixture`).

A position is a count of the stream's records already passed (`next_record`),
so it means the same thing for any batch size and any process count. Batches
are cut from the stream by a `BatchPlan`: a single source's batches keep to
its epochs (the epoch's last batch holds what is left of it, dropped when
short with drop_remainder), a mixture's batches run on across the sources'
epoch ends (its sources have no common epoch). Restoring a position under
another batch size only changes where batches start (the plan's phase); no
record is skipped or read twice.

Skip ranges are records of that stream a run passes over (a bad range found
after a loss spike): stream ranges `[start, stop)`, or every-epoch ranges
`(start, stop, since)` of a single unshuffled source (source records
start..stop-1 of every epoch from stream record `since` on). A state holds
its run's skips in the make_dataset fingerprint field `skips` (`Skips.to_text`),
so every later restore keeps them; batches are cut from the stream with the
skipped records removed (the *kept* coordinate of an epoch counts only the
records not skipped), and a lookup costs O(ranges touching the epoch), never
O(position). `Skip` is what a user declares; a restore resolves it against the
restored position into `Skips` (`resolve`): records read before it were trained.

Pure integer arithmetic: no Grain, JAX or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import fractions
import functools
import hashlib
import json
import math
import numbers
import sys
from typing import Any, Iterator, Mapping, Sequence, Iterable

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
        or not all(isinstance(r, list) and len(r) == 2 and all(map(_is_count, r)) and r[0] < r[1] for r in records)
        or not all(isinstance(r, list) and len(r) == 3 and all(map(_is_count, r)) and r[0] < r[1] for r in every)
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
    """The skipped offsets of epoch `epoch` as stream ranges of the epoch alone (the last 256 epochs kept).

    Its kept coordinates are the epoch's: `kept_before(offset)`,
    `stream_record_of_kept(kept)` and `kept_records` answer in O(log ranges of the epoch).
    """
    cache = self.__dict__.setdefault("_epochs", {})
    key = (epoch, epoch_length)
    found = cache.get(key)
    if found is None:
      if len(cache) >= 256:
        cache.clear()
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
          f"{origin}: {named} holds source records {_short(over[:4])} of every epoch, past the source's "
          f"{epoch_length} records. The state is corrupt or edited, or was written for another source: "
          "restore another step, or the pipeline that wrote it.")
    raise errors.InvalidArgumentError(
        f"{origin}: {named} reaches past the source's {epoch_length} records: source records "
        f"{_short(over[:4])}. Skip source records below {epoch_length}.")
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


# ---------------------------------------------------------------------------
# The stream and its positions.

INFINITE = sys.maxsize
# A make_dataset position: the stream records already passed ...
NEXT_RECORD = "next_record"
# ... and for a mixture, where its shares took effect and what each source had given then.
MIXTURE = "mixture"
# A filtered or packed make_dataset position (`_lanes`): each lane's [chunk in lane, rows taken].
LANES = "lanes"
FIRST_LANE = "first_lane"
# Nodes above make_dataset's that keep a batch index a batch index (one output
# per input, by index): a position there can count records of the stream.
RECORD_ADDRESSED_ABOVE = frozenset({
    "MapMapDataset", "MapWithIndexMapDataset", "RandomMapMapDataset", "FilterMapDataset",
})
# A mixture's integer proportions stay small enough to multiply by any record index.
MAX_PROPORTION_TOTAL = 10**6
MAX_SOURCES = 64
_WEIGHT_DENOMINATOR = 1000


def shares_of(fingerprint: Mapping[str, Any]) -> dict[str, int] | None:
  """A mixture's name -> share from its make_dataset fingerprint (`weight[name]` fields), or None."""
  shares = {}
  for name, value in fingerprint.items():
    if name.startswith("weight[") and name.endswith("]"):
      shares[name[len("weight["):-1]] = value
  return shares or None


def mixture_segment(fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> str | None:
  """A mixture state's segment as one line of text, what a resume entry records of it (`_item.segment_fields`):
  `since_record;name=share/length/since,...` (the shares in effect, each source's length, and the ledger
  where the shares took effect). None for a state that is no mixture, or whose fields do not parse."""
  shares, mixture = shares_of(fingerprint), position.get(MIXTURE)
  if shares is None or not isinstance(mixture, Mapping):
    return None
  since, since_record = mixture.get("since"), mixture.get("since_record")
  lengths = {name: fingerprint.get(f"source_length[{name}]") for name in shares}
  if not (_is_count(since_record) and isinstance(since, Mapping) and all(map(_is_count, lengths.values()))
          and all(map(_is_count, shares.values())) and all(map(_is_count, since.values()))):
    return None
  names = list(shares) + [name for name in since if name not in shares]
  parts = [f"{n}={shares.get(n, 0)}/{lengths.get(n, 0)}/{since.get(n, 0)}" for n in names]
  return f"{since_record};" + ",".join(parts)


def parse_mixture_segment(text: Any, *, origin: str) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
  """(shares, lengths, the position's `mixture` field) of a `mixture_segment` text.

  Raises:
    InvalidStateError: the text is not one `mixture_segment` writes.
  """
  try:
    since_record, rest = text.split(";", 1)
    shares, lengths, since = {}, {}, {}
    for part in rest.split(","):
      name, numbers = part.split("=", 1)
      share, length, count = (int(v) for v in numbers.split("/"))
      if not name.isidentifier() or min(share, length, count) < 0:
        raise ValueError(part)
      since[name] = count
      if share:
        shares[name], lengths[name] = share, length
    mixture = {"since_record": int(since_record), "since": since}
    if mixture["since_record"] < 0 or not shares:
      raise ValueError(text)
  except (AttributeError, ValueError):
    raise errors.InvalidStateError(
        f"{origin}: the resume record's field 'mixture' is {text!r}; expected "
        "'since_record;name=share/length/since,...'. The state is corrupt or edited.") from None
  return shares, lengths, mixture


def ledger(fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> dict[str, int] | None:
  """name -> records each source of a mixture has given before the position, or None (not a mixture).

  Computed from the state alone: the shares in the fingerprint, where they took
  effect and each source's count then in the position.
  """
  shares, next_record = shares_of(fingerprint), position.get(NEXT_RECORD)
  if shares is None or not _is_count(next_record) or not all(_is_count(v) and v > 0 for v in shares.values()):
    return None
  try:
    mixture = Mixture.from_json(position.get(MIXTURE), shares, next_record, origin="the state")
  except errors.InvalidStateError:
    return None
  return mixture.read(next_record)


def next_record_of_index(fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> Mapping[str, Any]:
  """A make_dataset position of format 1-3 (`{"next_index": k}`, a batch index) as format 4 counts it.

  Until format 4 a make_dataset pipeline had one batch size for its whole run
  and every epoch's batches started at its first record, so batch k is
  global batch k % B of epoch k // B (B batches per epoch): its first record
  is the stream record the position stands for. Any other position (a
  hand-built pipeline's, Grain's) is returned as it is.
  """
  next_index = position.get("next_index")
  per_epoch, length = fingerprint.get("batches_per_epoch"), fingerprint.get("source_length")
  batch = fingerprint.get("global_batch_size")
  above = [kind for kind in str(fingerprint.get("pipeline") or "").split("<") if kind]
  if (set(position) != {"next_index"} or not all(_is_count(v) for v in (next_index, per_epoch, length, batch))
      or per_epoch == 0 or any(kind not in RECORD_ADDRESSED_ABOVE for kind in above)):
    return position
  epoch, index = divmod(int(next_index), int(per_epoch))
  return {NEXT_RECORD: epoch * int(length) + index * int(batch)}


# ---------------------------------------------------------------------------
# Mixture: which source holds record g.


def source_seed(seed: int, name: str) -> int:
  """The shuffle seed of a mixture's source `name`: its own, derived from the run's seed."""
  digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little")


def proportions(weights: Mapping[str, Any]) -> dict[str, int]:
  """Integer proportions of positive weights, in lowest terms, same order.

  0.7 and 0.3 give 7 and 3; weights are read to three significant decimals
  of their ratio (1/3 and 2/3 give 1 and 2).

  Raises:
    InvalidArgumentError: a weight is not a positive finite number, or the
      proportions need more than MAX_PROPORTION_TOTAL in total.
  """
  if not weights:
    raise errors.InvalidArgumentError("weights is empty; a mixture needs at least one source.")
  if len(weights) > MAX_SOURCES:
    raise errors.InvalidArgumentError(f"a mixture has {len(weights)} sources; at most {MAX_SOURCES} are supported.")
  for name, weight in weights.items():
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight <= 0:
      raise errors.InvalidArgumentError(
          f"weights[{name!r}]={weight!r} must be a positive finite number (a relative weight).")
  smallest = min(float(w) for w in weights.values())
  ratios = {name: fractions.Fraction(float(w) / smallest).limit_denominator(_WEIGHT_DENOMINATOR)
            for name, w in weights.items()}
  denominator = math.lcm(*(r.denominator for r in ratios.values()))
  ints = {name: int(r * denominator) for name, r in ratios.items()}
  divisor = math.gcd(*ints.values())
  ints = {name: value // divisor for name, value in ints.items()}
  if sum(ints.values()) > MAX_PROPORTION_TOTAL:
    raise errors.InvalidArgumentError(
        f"weights {dict(weights)} need integer proportions {ints}, more than {MAX_PROPORTION_TOTAL} "
        "in total; round them (e.g. to two decimals).")
  return ints


def counts(records: int, shares: Sequence[int]) -> list[int]:
  """How many of the first `records` records of an interleave each source gives.

  The interleave: of the first n records, source 0 gives n - floor(n * W1 / W0)
  where W_i is the sum of the shares from source i on, and the rest are shared
  the same way among sources 1, 2, ... So the counts sum to n, each is
  non-decreasing in n, every sum(shares) records each source gives exactly
  its share, and in between source j gives fewer than n*s_j/S + 1 and no
  fewer than n*s_j/S - j*s_j/W_j (S = W_0): a later source may trail its share by
  up to j records (shares 1, 1, 3: after 2 records the third has 0 of 1.2).
  """
  remaining_records, remaining_share = records, sum(shares)
  result = []
  for share in shares:
    rest = remaining_records * (remaining_share - share) // remaining_share if remaining_share else 0
    result.append(remaining_records - rest)
    remaining_records, remaining_share = rest, remaining_share - share
  return result


def pick(record: int, shares: Sequence[int]) -> tuple[int, int]:
  """(source number, how many records that source gave before) for record `record`."""
  before, after = counts(record, shares), counts(record + 1, shares)
  for number, (a, b) in enumerate(zip(before, after)):
    if b != a:
      return number, a
  raise AssertionError(f"no source holds record {record} of shares {list(shares)}")  # unreachable


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Named sources interleaved by integer shares from record `since_record` on.

  Attributes:
    shares: name -> integer proportion of the sources read now, in order.
    since_record: the stream record where these shares took effect (0, or
      the restart that changed them).
    since: name -> the source's records read before `since_record`, for
      every source the run ever read (a source no longer mixed keeps its
      entry, so mixing it again continues it).
  """

  shares: Mapping[str, int]
  since_record: int = 0
  since: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def source_of(self, record: int) -> tuple[str, int]:
    """(source name, index in that source's own stream) of stream record `record`."""
    names = list(self.shares)
    number, before = pick(record - self.since_record, [self.shares[n] for n in names])
    name = names[number]
    return name, self.since.get(name, 0) + before

  def read(self, next_record: int) -> dict[str, int]:
    """The ledger: name -> records of that source read before stream record `next_record`."""
    ledger = dict(self.since)
    names = list(self.shares)
    for name, count in zip(names, counts(next_record - self.since_record, [self.shares[n] for n in names])):
      ledger[name] = self.since.get(name, 0) + count
    return ledger

  def restarted(self, next_record: int, shares: Mapping[str, int]) -> "Mixture":
    """These records' continuation under new shares: each source from its own next record."""
    return Mixture(shares=dict(shares), since_record=next_record, since=self.read(next_record))

  def length(self, limits: Mapping[str, int]) -> int:
    """Stream records before the first source would pass its limit (records of its own stream)."""
    if all(limits[name] >= INFINITE for name in self.shares):
      return INFINITE
    shares = [self.shares[n] for n in self.shares]
    room = [limits[n] - self.since.get(n, 0) for n in self.shares]
    if min(room) < 0:
      return self.since_record
    fits = lambda n: all(c <= r for c, r in zip(counts(n, shares), room))
    # A source's count is within len(shares) of its exact share n * share / total,
    # so past this many records the tightest finite source has overflowed.
    total = sum(shares)
    low, high = 0, min((r + len(shares) + 1) * total // s + 2
                       for r, s, name in zip(room, shares, self.shares) if limits[name] < INFINITE)
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if fits(middle) else (low, middle)
    return self.since_record + low

  def to_json(self) -> dict[str, Any]:
    return {"since_record": self.since_record, "since": dict(self.since)}

  @classmethod
  def from_json(cls, value: Any, shares: Mapping[str, int], next_record: int, *, origin: str) -> "Mixture":
    """The mixture a state's `mixture` position field holds, with the shares it was saved under.

    Raises:
      InvalidStateError: the field is malformed or does not fit `next_record`.
    """
    if not shares or len(shares) > MAX_SOURCES or not all(
        _is_count(v) and v > 0 for v in shares.values()) or sum(shares.values()) > MAX_PROPORTION_TOTAL:
      raise errors.InvalidStateError(
          f"{origin}: the fingerprint's weight[...] fields {_short(dict(shares))} must be positive "
          f"integers (at most {MAX_SOURCES} sources, {MAX_PROPORTION_TOTAL} in total).")
    since = value.get("since") if isinstance(value, Mapping) else None
    since_record = value.get("since_record") if isinstance(value, Mapping) else None
    if (
        not isinstance(value, Mapping) or set(value) != {"since_record", "since"}
        or not _is_count(since_record) or since_record > next_record
        or not isinstance(since, Mapping) or len(since) > MAX_SOURCES
        or not all(isinstance(k, str) and _is_count(v) for k, v in since.items())
    ):
      raise errors.InvalidStateError(
          f"{origin}: position field {MIXTURE!r} must be {{'since_record': int <= next_record "
          f"({next_record}), 'since': {{source name: int >= 0}} (at most {MAX_SOURCES})}}, got "
          f"{_short(value)}.")
    return cls(shares=dict(shares), since_record=int(since_record), since={k: int(v) for k, v in since.items()})


def checked_record_position(
    fingerprint: Mapping[str, Any], position: Mapping[str, Any], *, origin: str
) -> tuple[int, Mixture | None]:
  """(next_record, the mixture it was saved under or None) of a position that counts stream records.

  What a restore checks of such a position before it compares any pipeline
  (`_drift.reconcile`), and `ckpt-iter verify` with it: its keys, its
  `next_record`, and a mixture's weights and ledger (`Mixture.from_json`).

  Raises:
    InvalidStateError: a field is malformed (the message names it and shows its value).
  """
  extra = set(position) - {NEXT_RECORD, MIXTURE}
  if extra:
    raise errors.InvalidStateError(
        f"{origin}: field 'position' holds {sorted(extra)}; a make_dataset position is "
        f"{{'{NEXT_RECORD}': <stream records passed>[, '{MIXTURE}': <ledger>]}}.")
  next_record = position.get(NEXT_RECORD)
  if not _is_count(next_record):
    raise errors.InvalidStateError(
        f"{origin}: position field {NEXT_RECORD!r} must be an integer >= 0, got {_short(next_record)}.")
  shares = shares_of(fingerprint)
  if shares is not None:
    return int(next_record), Mixture.from_json(position.get(MIXTURE), shares, next_record, origin=origin)
  if MIXTURE in position:
    raise errors.InvalidStateError(
        f"{origin}: the position holds a mixture's ledger ({MIXTURE!r}) but the fingerprint "
        "names no weights: the state is corrupt or edited.")
  return int(next_record), None


def check_stream_fields(fingerprint: Mapping[str, Any], position: Any, *, origin: str) -> Skips:
  """Checks the stream fields of a data state (a make_dataset's, or any other) as a restore does; its skips.

  The one check of them, without the pipeline: `DataIterator.check_restore`
  asks it first, and `ckpt-iter verify`, `which`, `order` and `audit` ask it
  of every state they read, so each refuses a field a restore refuses, with
  the restore's message. The fingerprint's `skips` (`Skips.from_text`); where
  the position counts stream records, `checked_record_position`.

  Raises:
    InvalidStateError: a field is malformed (the message names it).
  """
  skips = Skips.from_text(fingerprint.get(SKIPS_FIELD), origin=origin)
  if isinstance(position, Mapping) and NEXT_RECORD in position:
    checked_record_position(fingerprint, position, origin=origin)
  return skips


def _is_count(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------
# Batches over the stream.


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """Where each batch of a pipeline starts in the record stream.

  Batches are cut from the stream with the skipped records (`skips`)
  removed: offsets below count *kept* records (the skip ranges above). Batch k holds the
  kept records [start(k), start(k) + batch_size), cut short at the end of
  its epoch (`epoch_length`, a single source) or of the stream
  (`stream_length`). With `epoch_length`, every epoch's batches start at its
  first kept record, except in epoch `phase_epoch`, where they start at kept
  offset `phase` (a restore under another batch size mid-epoch). Without it
  (a mixture) batches start at kept record `phase`, `phase` + batch_size, ...

  Attributes:
    batch_size: global batch size, records.
    drop_remainder: drop a batch shorter than `batch_size`.
    epoch_length: records per epoch of a single source, or None (a mixture).
    stream_length: records in the whole stream (INFINITE without an end).
    phase_epoch, phase: see above; (0, 0) for a pipeline never restored
      under another batch size.
    skips: the records the run skips.
  """

  batch_size: int
  drop_remainder: bool
  epoch_length: int | None
  stream_length: int
  phase_epoch: int = 0
  phase: int = 0
  skips: Skips = NO_SKIPS

  @classmethod
  def at(cls, next_record: int, *, batch_size: int, drop_remainder: bool, epoch_length: int | None,
         stream_length: int, skips: Skips = NO_SKIPS) -> "BatchPlan":
    """The plan whose batches start at stream record `next_record` (the one with the least phase)."""
    plan = cls(batch_size, drop_remainder, epoch_length, stream_length, 0, 0, skips)
    if epoch_length is None:
      return dataclasses.replace(plan, phase=skips.kept_before(next_record) % batch_size)
    epoch, offset = plan.locate(next_record)
    return dataclasses.replace(plan, phase_epoch=epoch, phase=offset % batch_size)

  # -- kept coordinates

  def locate(self, record: int) -> tuple[int, int]:
    """(epoch, kept offset in it) of stream record `record`; an epoch's kept end is the next epoch's start."""
    epoch, offset = divmod(record, self.epoch_length)
    if not self.skips:
      return epoch, offset
    kept = self.skips.of_epoch(epoch, self.epoch_length).kept_before(offset)
    if kept and kept == self._kept(epoch):
      return epoch + 1, 0
    return epoch, kept

  def _kept(self, epoch: int) -> int:
    """Kept records of epoch `epoch`."""
    if not self.skips:
      return self.epoch_length
    return self.epoch_length - self.skips.of_epoch(epoch, self.epoch_length).skipped_count

  def _record(self, epoch: int, kept: int) -> int:
    """The stream record of epoch `epoch`'s kept record `kept`."""
    if not self.skips:
      return epoch * self.epoch_length + kept
    return epoch * self.epoch_length + self.skips.of_epoch(epoch, self.epoch_length).stream_record_of_kept(kept)

  def _end(self, epoch: int, kept_stop: int) -> int:
    """One past the stream record of epoch `epoch`'s kept record `kept_stop - 1` (a batch's end)."""
    if not self.skips or kept_stop == 0:
      return epoch * self.epoch_length + kept_stop
    return self._record(epoch, kept_stop - 1) + 1

  def _in_epoch(self, phase: int, kept: int | None = None) -> int:
    """Batches of one epoch of `kept` kept records whose first batch starts at `phase`."""
    full, rest = divmod(max((self.epoch_length if kept is None else kept) - phase, 0), self.batch_size)
    return full + (1 if rest and not self.drop_remainder else 0)

  @functools.cached_property
  def _segments(self) -> tuple[list[int], list[int], list[int]]:
    """(first epoch, batches per epoch, batches before it) of runs of epochs that skip alike (phase 0)."""
    firsts = self.skips.epoch_breaks(self.epoch_length) if self.skips else [0]
    counts = [self._in_epoch(0, self._kept(epoch)) for epoch in firsts]
    before = [0]
    for first, following, per_epoch in zip(firsts, firsts[1:], counts):
      before.append(before[-1] + (following - first) * per_epoch)
    return firsts, counts, before

  def _before(self, epoch: int) -> int:
    """Batches of the epochs before `epoch`, all from their first record."""
    firsts, counts, before = self._segments
    index = bisect.bisect_right(firsts, epoch) - 1
    return before[index] + (epoch - firsts[index]) * counts[index]

  def _epoch_at(self, index: int, earliest: int) -> tuple[int, int]:
    """(epoch >= earliest, batch in it) of batch `index` counted from the first epoch, all from offset 0."""
    firsts, counts, before = self._segments
    segment = max(bisect.bisect_right(before, index) - 1, 0)
    epoch = firsts[segment] + ((index - before[segment]) // counts[segment] if counts[segment] else 0)
    epoch = max(epoch, earliest)
    return epoch, index - self._before(epoch)

  @property
  def _phase_extra(self) -> int:
    """Batches the phase epoch has beyond an epoch read from its first record (may be negative)."""
    kept = self._kept(self.phase_epoch)
    return self._in_epoch(self.phase, kept) - self._in_epoch(0, kept)

  @property
  def batches_per_epoch(self) -> int:
    return self._in_epoch(0)

  def __len__(self) -> int:
    if self.epoch_length is None:
      if self.stream_length >= INFINITE:
        return INFINITE
      kept = self.skips.kept_before(self.stream_length)
      full, rest = divmod(max(kept - self.phase, 0), self.batch_size)
      return full + (1 if rest and not self.drop_remainder else 0)
    if self.stream_length >= INFINITE:
      return INFINITE
    epochs = self.stream_length // self.epoch_length
    if self.phase_epoch >= epochs:
      return self._before(epochs)
    return self._before(epochs) + self._phase_extra

  def span(self, index: int) -> tuple[int, int]:
    """Stream records [start, stop) of batch `index` (past the length: as if the stream went on).

    With skips, the batch holds the kept records of the span (`records`).
    """
    if self.epoch_length is None:
      start = self.phase + index * self.batch_size
      stop = start + self.batch_size
      if not self.drop_remainder and self.stream_length < INFINITE:
        stop = min(stop, self.skips.kept_before(self.stream_length))
      if not self.skips:
        return start, stop
      first = self.skips.stream_record_of_kept(start)
      return first, (self.skips.stream_record_of_kept(stop - 1) + 1 if stop > start else first)
    if self._unskipped is not None:  # the common case, in a few integer operations
      per_epoch, before, in_phase = self._unskipped
      if index < before:
        epoch, batch = divmod(index, per_epoch)
        offset = batch * self.batch_size
      elif index < before + in_phase:
        epoch, offset = self.phase_epoch, self.phase + (index - before) * self.batch_size
      else:
        epoch, batch = divmod(index - in_phase + per_epoch, per_epoch)
        offset = batch * self.batch_size
      base = epoch * self.epoch_length
      return base + offset, base + min(offset + self.batch_size, self.epoch_length)
    epoch, offset = self._epoch_offset(index)
    stop = min(offset + self.batch_size, self._kept(epoch))
    return self._record(epoch, offset), self._end(epoch, stop)

  @functools.cached_property
  def _unskipped(self) -> tuple[int, int, int] | None:
    """(batches per epoch, batches before the phase epoch, batches of the phase epoch) of a single
    source without skips (what `_epoch_offset` computes, in closed form); None otherwise."""
    if self.skips or self.epoch_length is None or self._in_epoch(0) == 0:
      return None
    per_epoch = self._in_epoch(0)
    return per_epoch, self.phase_epoch * per_epoch, self._in_epoch(self.phase)

  def records(self, index: int) -> Sequence[int]:
    """The stream records batch `index` holds, in order (a range without skips)."""
    return self.rows(index, 0, self.batch_size)

  def rows(self, index: int, first: int, count: int) -> Sequence[int]:
    """Rows first..first+count-1 of batch `index`: `records(index)[first:first + count]`.

    What one process of many reads of a global batch. It costs
    O(count + log ranges), with skips too (an epoch's ranges are gathered
    once, `Skips.of_epoch`): the kept records are found from the batch's
    start in kept coordinates (`Skips.kept_records`), never by listing the
    global batch.
    """
    if not self.skips:
      start, stop = self.span(index)
      return range(min(start + first, stop), min(start + first + count, stop))
    if self.epoch_length is None:
      start = self.phase + index * self.batch_size
      stop = start + self.batch_size
      if not self.drop_remainder and self.stream_length < INFINITE:
        stop = min(stop, self.skips.kept_before(self.stream_length))
      kept = range(start, max(start, stop))[first:first + count]
      return self.skips.kept_records(kept.start, kept.stop)
    epoch, offset = self._epoch_offset(index)
    skipped = self.skips.of_epoch(epoch, self.epoch_length)
    stop = min(offset + self.batch_size, self.epoch_length - skipped.skipped_count)  # the epoch's kept end
    kept = range(offset, max(offset, stop))[first:first + count]
    return skipped.kept_records(kept.start, kept.stop, base=epoch * self.epoch_length)

  def _epoch_offset(self, index: int) -> tuple[int, int]:
    """(epoch, kept offset) where batch `index` starts."""
    before, in_phase, extra = self._phase_batches
    if index < before:
      epoch, batch = self._epoch_at(index, 0)
      return epoch, batch * self.batch_size
    if index < before + in_phase:
      return self.phase_epoch, self.phase + (index - before) * self.batch_size
    epoch, batch = self._epoch_at(index - extra, self.phase_epoch + 1)
    return epoch, batch * self.batch_size

  @functools.cached_property
  def _phase_batches(self) -> tuple[int, int, int]:
    """(batches before the phase epoch, batches of it, `_phase_extra`): the same for every batch."""
    return (self._before(self.phase_epoch), self._in_epoch(self.phase, self._kept(self.phase_epoch)),
            self._phase_extra)

  def next_record(self, next_index: int) -> int:
    """The stream position after reading batches 0..next_index-1 of this plan: the end of the last.

    An epoch's dropped rest is not passed yet: a restore under another batch
    size may still fit it into a batch (`index_of` of a position inside it is
    the next epoch's first batch when it does not).
    """
    if next_index == 0:
      return 0
    return self.span(next_index - 1)[1]

  def full_batch_before(self, record: int) -> int | None:
    """The stream record where the full batch that ends at `record` starts, whatever the plan's phase.

    A batch that ends inside an epoch is full, and so is every batch with
    drop_remainder: it is the batch_size kept records before `record`.
    None where the batch before may be an epoch's (or the stream's) short
    last batch, whose start depends on where earlier restarts put the
    batches, or where fewer records precede it.
    """
    if self.epoch_length is None:
      kept = self.skips.kept_before(record)
      if kept < self.batch_size or (not self.drop_remainder and record >= self.stream_length):
        return None
      return self.skips.stream_record_of_kept(kept - self.batch_size)
    epoch, offset = divmod(record, self.epoch_length)
    if offset == 0 and epoch:  # the previous epoch's end
      epoch, kept = epoch - 1, self._kept(epoch - 1)
      if not self.drop_remainder:
        return None
    else:
      kept = self.skips.of_epoch(epoch, self.epoch_length).kept_before(offset) if self.skips else offset
      if not self.drop_remainder and kept == self._kept(epoch):
        return None
    if kept < self.batch_size:
      return None
    return self._record(epoch, kept - self.batch_size)

  def index_of(self, next_record: int) -> int | None:
    """The batch index that starts at `next_record` (an epoch's or the stream's end included), or None."""
    if self.epoch_length is None:
      if next_record >= self.stream_length and self.stream_length < INFINITE:
        return len(self)
      kept = self.skips.kept_before(next_record)
      if self.stream_length < INFINITE and kept >= self.skips.kept_before(self.stream_length):
        return len(self)
      index, rest = divmod(kept - self.phase, self.batch_size)
      return index if rest == 0 and index >= 0 else None
    epoch, offset = self.locate(next_record)
    if epoch < self.phase_epoch:
      first, phase = self._before(epoch), 0
    elif epoch == self.phase_epoch:
      first, phase = self._before(epoch), self.phase
      if offset == 0 and self.phase:  # the epoch's start, before its first (phased) batch
        return None
    else:
      first, phase = self._before(epoch) + self._phase_extra, 0
    batch, rest = divmod(offset - phase, self.batch_size)
    return first + batch if rest == 0 else None


# ---------------------------------------------------------------------------
# Lanes (`_lanes`): a filtered or packed stream's positions.


def gathered(positions: Mapping[int, Mapping[str, Any]], saved_count: int, process_index: int,
             process_count: int, *, origin: str) -> dict[str, Any]:
  """Process j of M's lane position from the saved positions of the processes that held its lanes.

  Saved process i held lanes [i*V/N, (i+1)*V/N): the lanes are laid out like
  rows, so `positions` holds the saved processes overlapping j's lanes.

  Raises:
    UnsupportedConfigError: M does not divide the number of lanes.
    InvalidStateError: a saved position is malformed.
  """
  first = next(iter(positions.values()))
  per_saved = len(first.get(LANES) or ())
  num_lanes = per_saved * saved_count
  if num_lanes == 0 or num_lanes % process_count:
    raise errors.UnsupportedConfigError(
        f"{origin}: the run has {num_lanes} lanes, which {process_count} processes cannot share equally. "
        f"Resume with a process count dividing {num_lanes}.")
  per_process = num_lanes // process_count
  wanted = range(process_index * per_process, (process_index + 1) * per_process)
  by_lane: dict[int, Any] = {}
  for index, position in positions.items():
    lanes = position.get(LANES)
    if not isinstance(lanes, list) or len(lanes) != per_saved or position.get(FIRST_LANE) != index * per_saved:
      raise errors.InvalidStateError(
          f"{origin}: process {index}'s lane position {_short(position)} is not its "
          f"{per_saved} lanes from lane {index * per_saved}.")
    for offset, lane_position in enumerate(lanes):
      by_lane[index * per_saved + offset] = lane_position
  missing = [lane for lane in wanted if lane not in by_lane]
  if missing:
    raise errors.InvalidStateError(f"{origin}: no saved position holds lanes {missing}.")
  return {FIRST_LANE: wanted.start, LANES: [list(by_lane[lane]) for lane in wanted]}


def lanes_of(position: Any) -> Iterator[tuple[int, int, int]]:
  """(lane, chunk in lane, rows taken) of a lane position (for the CLI)."""
  for offset, (chunk, rows) in enumerate(position.get(LANES) or ()):
    yield position.get(FIRST_LANE, 0) + offset, chunk, rows

