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

Batches are cut from the stream with a run's skip ranges removed (`skips`:
the ranges, what a user declares, and how a restore resolves them).

Pure integer arithmetic: no Grain, JAX or files.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import sys
from typing import Any, Iterator, Mapping, Sequence

from ckpt_iter import _permutation
from ckpt_iter import errors
from ckpt_iter import skips as skips_lib


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


def shares_of(fingerprint: Mapping[str, Any]) -> dict[str, int] | None:
  """A mixture's name -> share from its make_dataset fingerprint (`weight[name]` fields), or None."""
  try:
    if "\0weight[" not in "\0" + "\0".join(fingerprint):
      return None  # no mixture: one scan in C (a restore asks four times)
  except TypeError:
    pass  # a name that is no string: the walk below
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
  is_count = skips_lib.is_count
  if not (is_count(since_record) and isinstance(since, Mapping) and all(map(is_count, lengths.values()))
          and all(map(is_count, shares.values())) and all(map(is_count, since.values()))):
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
  if (shares is None or not skips_lib.is_count(next_record)
      or not all(skips_lib.is_count(v) and v > 0 for v in shares.values())):
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
  if (set(position) != {"next_index"} or not all(skips_lib.is_count(v) for v in (next_index, per_epoch, length, batch))
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
        skips_lib.is_count(v) and v > 0 for v in shares.values()) or sum(shares.values()) > MAX_PROPORTION_TOTAL:
      raise errors.InvalidStateError(
          f"{origin}: the fingerprint's weight[...] fields {skips_lib.short_text(dict(shares))} must be positive "
          f"integers (at most {MAX_SOURCES} sources, {MAX_PROPORTION_TOTAL} in total).")
    since = value.get("since") if isinstance(value, Mapping) else None
    since_record = value.get("since_record") if isinstance(value, Mapping) else None
    if (
        not isinstance(value, Mapping) or set(value) != {"since_record", "since"}
        or not skips_lib.is_count(since_record) or since_record > next_record
        or not isinstance(since, Mapping) or len(since) > MAX_SOURCES
        or not all(isinstance(k, str) and skips_lib.is_count(v) for k, v in since.items())
    ):
      raise errors.InvalidStateError(
          f"{origin}: position field {MIXTURE!r} must be {{'since_record': int <= next_record "
          f"({next_record}), 'since': {{source name: int >= 0}} (at most {MAX_SOURCES})}}, got "
          f"{skips_lib.short_text(value)}.")
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
  if not skips_lib.is_count(next_record):
    raise errors.InvalidStateError(
        f"{origin}: position field {NEXT_RECORD!r} must be an integer >= 0, got {skips_lib.short_text(next_record)}.")
  shares = shares_of(fingerprint)
  if shares is not None:
    return int(next_record), Mixture.from_json(position.get(MIXTURE), shares, next_record, origin=origin)
  if MIXTURE in position:
    raise errors.InvalidStateError(
        f"{origin}: the position holds a mixture's ledger ({MIXTURE!r}) but the fingerprint "
        "names no weights: the state is corrupt or edited.")
  return int(next_record), None


def check_stream_fields(fingerprint: Mapping[str, Any], position: Any, *, origin: str) -> skips_lib.Skips:
  """Checks the stream fields of a data state (a make_dataset's, or any other) as a restore does; its skips.

  The one check of them, without the pipeline: `DataIterator.check_restore`
  asks it first, and `ckpt-iter verify`, `which`, `order` and `audit` ask it
  of every state they read, so each refuses a field a restore refuses, with
  the restore's message. The fingerprint's `skips` (`skips_lib.Skips.from_text`); where
  the position counts stream records, `checked_record_position`; shard lanes
  (`_permutation.lane_fields`).

  Raises:
    InvalidStateError: a field is malformed (the message names it).
  """
  skips = skips_lib.Skips.from_text(fingerprint.get(skips_lib.SKIPS_FIELD), origin=origin)
  if isinstance(position, Mapping) and NEXT_RECORD in position:
    checked_record_position(fingerprint, position, origin=origin)
  if _permutation.LANES_FIELD in fingerprint or _permutation.LANE_ROWS_FIELD in fingerprint:
    try:
      _permutation.lane_fields(fingerprint)
    except ValueError as e:
      raise errors.InvalidStateError(f"{origin}: {e}. Restore it with the pipeline that wrote it.") from None
  return skips


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
  skips: skips_lib.Skips = skips_lib.NO_SKIPS

  @classmethod
  def at(cls, next_record: int, *, batch_size: int, drop_remainder: bool, epoch_length: int | None,
         stream_length: int, skips: skips_lib.Skips = skips_lib.NO_SKIPS) -> "BatchPlan":
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
    once, `skips_lib.Skips.of_epoch`): the kept records are found from the batch's
    start in kept coordinates (`skips_lib.Skips.kept_records`), never by listing the
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


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Where make_dataset's node reads: its plan, its mixture (None: one source) and its last restart
  (`origin`: batch index, stream record), the position until a batch is read (the record may lie in an
  epoch's dropped rest, which the plan's next batch passes over)."""

  plan: BatchPlan
  mixture: Mixture | None = None
  origin: tuple[int, int] = (0, 0)

  def position(self, next_index: int) -> dict[str, Any]:
    """The state position of batch `next_index`: the stream record it starts at (and a mixture's ledger)."""
    origin_index, origin_record = self.origin
    next_record = origin_record if next_index == origin_index else self.plan.next_record(next_index)
    position: dict[str, Any] = {NEXT_RECORD: next_record}
    if self.mixture is not None:
      position[MIXTURE] = self.mixture.to_json()
    return position


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
          f"{origin}: process {index}'s lane position {skips_lib.short_text(position)} is not its "
          f"{per_saved} lanes from lane {index * per_saved}.")
    for offset, lane_position in enumerate(lanes):
      by_lane[index * per_saved + offset] = lane_position
  missing = [lane for lane in wanted if lane not in by_lane]
  if missing:
    raise errors.InvalidStateError(f"{origin}: no saved position holds lanes {missing}.")
  gathered_position = {FIRST_LANE: wanted.start, LANES: [list(by_lane[lane]) for lane in wanted]}
  if MIXTURE in first:  # a mixture's schedule (`_lane_mixture`): every process holds the same
    gathered_position[MIXTURE] = first[MIXTURE]
  return gathered_position


def lanes_of(position: Any) -> Iterator[tuple[int, int, int]]:
  """(lane, chunk in lane, rows taken) of a lane position (for the CLI)."""
  for offset, (chunk, rows) in enumerate(position.get(LANES) or ()):
    yield position.get(FIRST_LANE, 0) + offset, chunk, rows

