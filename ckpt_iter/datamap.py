"""The data map: which source records a run read, batch by batch, from its checkpoints.

A make_dataset run reads one deterministic stream (`_records`): stream record
g is, for a single source of L records, record perm_{g // L}(g % L) of the
source (Grain's per-epoch shuffle, or with shuffle="shards" the shard-aware
order its fingerprint defines: `_permutation`), and for a weighted
mixture the record its interleave and its ledger pick (`_records.Mixture`),
in that source's own shuffle. Batches are cut from the stream by the batch
plan in effect (`_records.BatchPlan`: batches keep to their epoch; after a
restart under another batch size the restored epoch's batches start at the
restored record), without the records the run skips (`skips_lib.Skips`). A state's
position is the stream record after the last batch read.

So from a state and the lineage it carries (no data, no model, no user code)
this module says which source records any batch of the run held; right
after a restore, the last batch is the run before's, which the lineage's
last resumes describe (where they cannot, a mixture reweighted at that
restore or a start no longer recorded, the error names the step to ask):

  * `RecordStream`: stream record -> source record, and the plan from any record;
  * `last_batch`: the batch that ends at a state's position (its start by
    the plan in effect: for an epoch's short last batch, the restored record
    of the segment it was read in, when known);
  * `RunMap`: the run's segments between resumes (each a batch size, a start
    record, its skips; from the lineage every state records), hence global
    batch K of the run across its resumes, and the whole order, streamed;
  * `learner_step`: for a Tunix RL learner's state, the prompts of the
    global step the checkpoint is in and each `num_iterations` repeat's
    updates, trained or pending.

Pipelines whose rows user code computes (a filtered or packed make_dataset, a
hand-built Grain pipeline) are answered with the pipeline itself:
`ckpt_iter.which(pipeline, state)` (`provenance`).

No JAX or Grain import (Grain's compiled shuffle is loaded by its file).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, Iterator

from ckpt_iter import _permutation
from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib

LANES_SCOPE = "lanes"
# What the CLI and the errors name as the way through where a state alone cannot answer.
PIPELINE_API = "ckpt_iter.which(pipeline, state)"
# How to keep the steps a run resumed from, which the data map and the audit need: `which`, `order`
# and `audit` all say it in these words (ckpt_iter/keep.py).
KEEP_RESUMED_STEPS = ("save with ocp.CheckpointManagerOptions(preservation_policy=ckpt_iter.KeepResumedSteps(ROOT, "
                      "max_to_keep=N)) in place of max_to_keep=N")


@dataclasses.dataclass(frozen=True)
class SourceRecord:
  """One record of a batch.

  Attributes:
    stream_record: its position in the run's stream.
    source: the mixture source it came from ("" for a single source).
    index: its index in that source (its row or line, counting from 0).
    epoch: the source's epoch it was read in.
    row: its row in the global batch.
    process_index: the process that held that row.
  """

  stream_record: int
  source: str
  index: int
  epoch: int
  row: int
  process_index: int

  def to_json(self) -> dict[str, Any]:
    """This source record as a JSON object (`which --json`)."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Batch:
  """One global batch of a run.

  Attributes:
    records: its records, in row order.
    batch_size: the global batch size in effect when it was read.
    process_count: the processes that shared it (each held batch_size / process_count rows).
    how: how its place in the stream was decided (which plan, which restart).
    number: its global batch number in the run (counting from 0, across resumes), when the
      run's resumes are known.
    segment: the segment of the run it was read in (0 before the first resume).
  """

  records: tuple[SourceRecord, ...]
  batch_size: int
  process_count: int
  how: str
  number: int | None = None
  segment: int | None = None

  @property
  def stream_ranges(self) -> tuple[tuple[int, int], ...]:
    """Its stream records as [start, stop) ranges: what `Skip(records=...)` takes to skip it."""
    return skips_lib.merged((r.stream_record, r.stream_record + 1) for r in self.records)

  def to_json(self) -> dict[str, Any]:
    """This batch as a JSON object (`which --json`, one line of `order`)."""
    return {
        "number": self.number, "records": [r.index for r in self.records],
        "sources": [r.source for r in self.records] if any(r.source for r in self.records) else None,
        "stream_records": [list(r) for r in self.stream_ranges], "batch_size": self.batch_size,
        "process_count": self.process_count, "segment": self.segment, "how": self.how,
    }


def _input_fields(value: state_lib.IteratorState) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
  inner = value.innermost
  return inner.fingerprint, (inner.position if isinstance(inner.position, Mapping) else {})


class RecordStream:
  """The stream of one make_dataset data state: its records' sources, and its batch plans.

  Args:
    fingerprint: the data state's fingerprint (a learner's input's).
    position: its position (a mixture's ledger is read from it).
    origin: what errors name.

  Raises:
    UnsupportedConfigError: the state's position does not count stream
      records (a filtered or packed make_dataset, or a hand-built pipeline):
      the message names `PIPELINE_API`, which answers with the pipeline.
    InvalidStateError: a field the map needs is missing or malformed.
  """

  def __init__(self, fingerprint: Mapping[str, Any], position: Mapping[str, Any], *, origin: str = "the state"):
    self.fingerprint, self.origin = fingerprint, origin
    refusal = _refusal(fingerprint, position)
    if refusal is not None:
      raise errors.UnsupportedConfigError(f"{origin}: {refusal}")
    self.next_record = int(position[_records.NEXT_RECORD])
    self.batch_size = _int_field(fingerprint, "global_batch_size", origin)
    self.process_count = _int_field(fingerprint, "shard_count", origin)
    self.drop_remainder = bool(fingerprint.get("drop_remainder", True))
    self.seed = fingerprint.get("seed")
    epochs = fingerprint.get("num_epochs")
    self.num_epochs = epochs if state_lib.is_int(epochs) else None
    self.skips = skips_lib.Skips.from_text(fingerprint.get(skips_lib.SKIPS_FIELD), origin=origin)
    shares = _records.shares_of(fingerprint)
    if shares is None:
      self.mixture = None
      self.length = _int_field(fingerprint, "source_length", origin)
      self.lengths = {"": self.length}
    else:
      self.mixture = _records.Mixture.from_json(position.get(_records.MIXTURE), shares, self.next_record,
                                                origin=origin)
      self.length = None
      # The sources its shares pick from: a source removed at a restart keeps its ledger entry
      # (`since`), but no record after the restart is its, and its length is no longer recorded.
      self.lengths = {name: _int_field(fingerprint, f"source_length[{name}]", origin) for name in shares}
    # name -> make_dataset(shuffle="shards")'s order of that source; {} for Grain's shuffle.
    self.shard_shuffles = _shard_shuffles(fingerprint, self.lengths, self.seed, self.mixture is not None, origin)

  @property
  def stream_length(self) -> int:
    """Records in the whole stream (INFINITE without num_epochs)."""
    if self.mixture is not None:
      limits = {name: _records.INFINITE if self.num_epochs is None else length * self.num_epochs
                for name, length in self.lengths.items()}
      return self.mixture.length(limits)
    return _records.INFINITE if self.num_epochs is None else self.length * self.num_epochs

  def plan_at(self, record: int) -> _records.BatchPlan:
    """The plan whose batches start at stream record `record`, under this state's batch size and skips."""
    return _records.BatchPlan.at(record, batch_size=self.batch_size, drop_remainder=self.drop_remainder,
                                 epoch_length=self.length, stream_length=self.stream_length, skips=self.skips)

  def source_of(self, stream_record: int) -> tuple[str, int, int]:
    """(source name, index in it, the source's epoch) of a stream record."""
    if self.mixture is None:
      name, own, length, seed = "", stream_record, self.length, self.seed
    else:
      name, own = self.mixture.source_of(stream_record)
      length = self.lengths[name]
      seed = None if self.seed is None else _records.source_seed(self.seed, name)
    if self.shard_shuffles:
      return name, self.shard_shuffles[name].source(own), own // length
    return name, _permutation.shuffled(own, length, seed), own // length

  def source_indices(self, records: Any) -> tuple[list[int], list[str] | None]:
    """(source indices, mixture source names or None) of stream records, in order: the fast path of `order`."""
    if self.mixture is not None:
      found = [self.source_of(g) for g in records]
      return [index for _, index, _ in found], [name for name, _, _ in found]
    indices = []
    for g in records:
      epoch, offset = divmod(g, self.length)
      if epoch != self._epoch:
        self._epoch, self._permute = epoch, (
            _permutation.epoch_function(epoch, self.length, self.seed) if not self.shard_shuffles
            else self.shard_shuffles[""].epoch_function(epoch))
      indices.append(self._permute(offset))
    return indices, None

  _epoch = -1
  _permute = None

  def batch(self, records: Any, *, how: str, number: int | None = None, segment: int | None = None,
            process_index: int | None = None) -> Batch:
    """A Batch of these stream records (in row order); `process_index`: the one process that read them all."""
    per_process = max(self.batch_size // max(self.process_count, 1), 1)
    rows = []
    for row, stream_record in enumerate(records):
      name, index, epoch = self.source_of(stream_record)
      process = row // per_process if process_index is None else process_index
      rows.append(SourceRecord(stream_record, name, index, epoch, row, process))
    return Batch(tuple(rows), self.batch_size, self.process_count, how, number, segment)


def _shard_shuffles(fingerprint: Mapping[str, Any], lengths: Mapping[str, int], seed: Any, mixture: bool,
                    origin: str) -> dict[str, _permutation.ShardShuffle]:
  """make_dataset(shuffle="shards")'s order of each source, from the fingerprint fields that define it.

  Returns:
    name ("" for a single source) -> its order; {} for Grain's shuffle.

  Raises:
    InvalidStateError: a shuffle kind this version does not know, or a malformed window, layout or seed.
  """
  kind = fingerprint.get(_permutation.SHUFFLE_FIELD, _permutation.GLOBAL)
  if kind == _permutation.GLOBAL:
    return {}
  if kind != _permutation.SHARDS:
    raise errors.InvalidStateError(
        f"{origin}: fingerprint field {_permutation.SHUFFLE_FIELD!r} is {state_lib.short_repr(kind)}; this "
        f"version knows {list(_permutation.KINDS)}. Read the state with the ckpt_iter version that wrote it.")
  window = _int_field(fingerprint, _permutation.WINDOW_FIELD, origin)
  lanes, lane_rows = _lane_fields(fingerprint, origin)
  orders = {}
  for name, length in lengths.items():
    field = _permutation.source_shards_field(name) if mixture else _permutation.SHARDS_FIELD
    layout = fingerprint.get(field)
    try:
      offsets = _permutation.layout_offsets(layout, length if state_lib.is_int(length) else None)
    except (TypeError, ValueError):
      offsets = None
    if offsets is None or offsets[-1] != length or not state_lib.is_int(seed):
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field {field!r} is {state_lib.short_repr(layout)} with seed "
          f"{state_lib.short_repr(seed)}; the data map needs shard sizes 'SIZExCOUNT,...' summing to the source's "
          f"length {length} and an integer seed (a make_dataset(shuffle=\"shards\") state has them).")
    orders[name] = _permutation.ShardShuffle(
        offsets, window, _records.source_seed(int(seed), name) if mixture else int(seed), lanes, lane_rows)
  return orders


def _lane_fields(fingerprint: Mapping[str, Any], origin: str) -> tuple[int, int | None]:
  try:
    return _permutation.lane_fields(fingerprint)
  except ValueError as e:
    raise errors.InvalidStateError(f"{origin}: {e}.") from None


def _refusal(fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> str | None:
  way = (f", so which records it read is computed by the pipeline's own code: answer with {PIPELINE_API} in "
         "Python, with the pipeline that wrote the state.")
  if fingerprint.get("position_scope") == LANES_SCOPE or _records.LANES in position:
    return "it is a filtered or packed make_dataset (lanes: rows come from its filter and packer)" + way
  if not state_lib.is_int(position.get(_records.NEXT_RECORD)):
    if "global_batch_size" in fingerprint:
      return ("its position is not a stream record (steps after make_dataset that are not per-batch maps: "
              f"position {state_lib.short_repr(dict(position), 60)})" + way)
    return (f"it was not written by a ckpt_iter.make_dataset pipeline (pipeline "
            f"{state_lib.short_repr(fingerprint.get('graph') or fingerprint.get('pipeline'), 60)}, position "
            f"{state_lib.short_repr(dict(position), 40)}): only its own code knows which records it read. Build "
            "the pipeline with ckpt_iter.make_dataset to have its records mapped.")
  return None


def _int_field(fingerprint: Mapping[str, Any], name: str, origin: str) -> int:
  value = fingerprint.get(name)
  if not state_lib.is_int(value) or value < 1:
    raise errors.InvalidStateError(
        f"{origin}: fingerprint field {name!r} is {state_lib.short_repr(value)}; the data map needs a "
        "positive integer (a make_dataset state has it).")
  return int(value)


# ---------------------------------------------------------------------------
# The last batch before a position.


def last_batch(stream: RecordStream, *, segment_start: int | None = None, resumed_from: int | None = None) -> Batch:
  """The batch that ends at `stream.next_record`: the last one read before the state was taken.

  Args:
    stream: the state's stream.
    segment_start: the stream record its segment started at (the restored
      position of its last resume; 0 for a run never resumed), or None when
      not known (a resumed state whose restored step is not at hand).
    resumed_from: the step that restore came from, for the explanation.

  Raises:
    InvalidStateError: nothing was read before the position (0), or the
      position is no batch end of the plan in effect.
  """
  end = stream.next_record
  if end == 0:
    raise errors.InvalidStateError(f"{stream.origin}: position 0: no batch was read before this state.")
  start = 0 if segment_start is None else segment_start
  if segment_start is not None and end <= segment_start:
    raise errors.InvalidStateError(
        f"{stream.origin}: no batch was read since the restore at stream record {segment_start}: the last "
        "batch was read by the run before it (give its steps: the chain answers it).")
  plan = stream.plan_at(start) if segment_start is not None else _plan_ending_at(stream, end)
  index = plan.index_of(end)
  if index is None or index == 0:
    raise errors.InvalidStateError(
        f"{stream.origin}: stream record {end} is not the end of a batch of {stream.batch_size} of the plan "
        f"from record {start}: the state does not fit its own pipeline.")
  return stream.batch(plan.records(index - 1), how=_how(stream, plan, index - 1, segment_start, resumed_from))


def last_batch_of(value: state_lib.IteratorState, *, origin: str = "the state") -> Batch:
  """The last batch read before state `value` was taken, from the state and its lineage: `last_batch` from
  where its segment started (`segment_start`). The one answer of `ckpt_iter.which`, `ckpt-iter which
  --step` and a learner's global step.

  Right after a restore (nothing read since), that batch is the last one the run before it read: the
  lineage's last resume records the position it ended at and the batch size and process count it was
  read with, and the resume before it where that segment began. Where the lineage cannot say (a mixture
  reweighted at that restore, or the segment's start dropped from a lineage that keeps the last
  `MAX_RECENT` resumes), the error names the step to ask instead (`ckpt-iter which --step`)."""
  lineage = value.lineage or {}
  recent = lineage.get("recent") or ()
  fingerprint, position = _input_fields(value)
  stream = RecordStream(fingerprint, position, origin=origin)
  start = segment_start(value)
  if start is not None and start > 0 and stream.next_record == start and recent:
    return _last_batch_before_the_restore(stream, fingerprint, position, lineage, origin)
  return last_batch(stream, segment_start=start, resumed_from=recent[-1].get("step") if recent else None)


def _last_batch_before_the_restore(stream: RecordStream, fingerprint: Mapping[str, Any], position: Mapping[str, Any],
                                   lineage: Mapping[str, Any], origin: str) -> Batch:
  """The last batch of the segment a state was restored from, by its lineage (`last_batch_of`)."""
  recent = list(lineage["recent"])
  step = recent[-1].get("step")
  ask = f"ask for step {step} (`ckpt-iter which --step {step}`)" if state_lib.is_int(step) else "ask the step restored"
  # The resume that began the segment which read the batch: back past restores with nothing read between.
  last = len(recent) - 1
  while last >= 1 and recent[last - 1].get("record") == stream.next_record:
    last -= 1
  if last >= 1:
    began, resumed_from = recent[last - 1].get("record"), recent[last - 1].get("step")
  elif lineage.get("resumes") == len(recent):  # every resume is recorded: the segment began the run
    began, resumed_from = 0, None
  else:
    began, resumed_from = None, None
  if not state_lib.is_int(began) or began >= stream.next_record:
    raise errors.InvalidStateError(
        f"{origin}: no batch was read since the restore at stream record {stream.next_record}, and the lineage "
        f"no longer records where the run before it began (it keeps the last resumes): {ask}.")
  geometry = state_lib.carried_geometry(recent)[last]  # of the state the segment ended in
  if stream.mixture is not None and geometry.get("mixture") != _records.mixture_segment(fingerprint, position):
    raise errors.InvalidStateError(
        f"{origin}: no batch was read since the restore at stream record {stream.next_record}, which changed the "
        f"mixture: the run before it read under the saved one, which this state does not hold: {ask}.")
  before = _segment_fingerprint(fingerprint, geometry) if "batch_size" in geometry and "process_count" in geometry \
      else dict(fingerprint)
  previous = RecordStream(before, position, origin=origin)
  return last_batch(previous, segment_start=int(began), resumed_from=resumed_from)


def _plan_ending_at(stream: RecordStream, end: int) -> _records.BatchPlan:
  """Without the segment's start: the plan whose batches keep the rule from the epoch's first record."""
  if stream.length is None:
    return stream.plan_at(end)
  epoch = end // stream.length
  plan = stream.plan_at(end)
  if plan.phase_epoch > epoch or plan.phase == 0:
    return plan
  # A position inside an epoch with another phase: batches from the epoch's first record reach it only
  # when it is a whole number of batches in; else its batch started at a restart (told in `how`).
  return stream.plan_at(epoch * stream.length)


def _how(stream: RecordStream, plan: _records.BatchPlan, index: int, segment_start: int | None,
         resumed_from: int | None) -> str:
  start, stop = plan.span(index)
  records = len(plan.records(index))
  short = records < stream.batch_size
  if segment_start is None:
    rule = (f"batches of {stream.batch_size} from the epoch's first record (the restore point of this segment "
            "is not known: a restart inside the epoch under another batch size would move a short batch's start)")
  elif segment_start == 0:
    rule = f"batches of {stream.batch_size} from the run's first record"
  else:
    at = f" (resume from step {resumed_from})" if resumed_from is not None else ""
    rule = f"batches of {stream.batch_size} from the restored stream record {segment_start}{at}"
  text = f"stream records {skips_lib.ranges_text([(start, stop)])}; {rule}"
  if short:
    text += f"; the epoch's short last batch ({records} of {stream.batch_size} records, drop_remainder=False)"
  if stream.skips and plan.skips.skipped_in_stream(start, stop) + (stop - start - records) > 0:
    text += f"; {stop - start - records} skipped records passed over"
  return text


# ---------------------------------------------------------------------------
# A run's segments between resumes.


class OrderRow(typing.NamedTuple):
  """One global batch in the order file: its number, segment, source indices, mixture source names (or
  None) and the stream records it spans, [stream_start, stream_stop) (the run's skips inside it excluded)."""

  batch: int
  segment: int
  records: list[int]
  sources: list[str] | None
  stream_start: int
  stream_stop: int


@dataclasses.dataclass(frozen=True)
class Segment:
  """The batches a run read between two resumes and kept (the next restore continued after them).

  Attributes:
    number: 0 before the first resume, i after the i-th.
    stream: the stream in effect (its batch size, skips and mixture).
    start_record: where it started (the restored position; 0 for the first).
    stop_record: where the next segment took over (or the latest position).
    resumed_from: the step its restore came from (None for the first).
    first_batch: the run's global batch number of its first batch.
  """

  number: int
  stream: RecordStream
  start_record: int
  stop_record: int
  resumed_from: int | None
  first_batch: int

  @functools.cached_property
  def plan(self) -> _records.BatchPlan:
    return self.stream.plan_at(self.start_record)

  @functools.cached_property
  def first_index(self) -> int:
    return self.plan.index_of(self.start_record)

  @functools.cached_property
  def count(self) -> int:
    """Its batches."""
    return self.plan.index_of(self.stop_record) - self.first_index

  def order_row(self, offset: int) -> "OrderRow":
    """Its batch `offset` as the order file holds it (without the explanation `batch` builds)."""
    records = self.plan.records(self.first_index + offset)
    indices, names = self.stream.source_indices(records)
    return OrderRow(self.first_batch + offset, self.number, indices, names, records[0], records[-1] + 1)

  def batch(self, offset: int) -> Batch:
    plan, index = self.plan, self.first_index + offset
    return self.stream.batch(plan.records(index), how=_how(self.stream, plan, index, self.start_record,
                                                           self.resumed_from),
                             number=self.first_batch + offset, segment=self.number)


class RunMap:
  """A run's global batches in order, across its resumes, from the states its checkpoints keep.

  Built by `from_states` from the state of the last step and those of the
  steps it resumed from (its lineage). Global batch K is found in
  O(segments); a batch's records cost O(batch size + skip ranges).
  """

  def __init__(self, segments: list[Segment]):
    self.segments = segments

  @property
  def total(self) -> int:
    """The run's batches up to its last state's position."""
    return sum(s.count for s in self.segments)

  def batch(self, number: int) -> Batch:
    """Global batch `number` of the run.

    Raises:
      InvalidArgumentError: the run has not read that batch (yet).
    """
    for segment in self.segments:
      if number < segment.first_batch + segment.count:
        return segment.batch(number - segment.first_batch)
    raise errors.InvalidArgumentError(
        f"the run read {self.total} global batches up to its latest kept step; batch {number} is not among them "
        f"(0..{self.total - 1}).")

  def order(self, start: int = 0) -> Iterator["OrderRow"]:
    """Every global batch from `start` on, as the order file's rows (O(1) memory in the run's length)."""
    for segment in self.segments:
      for offset in range(max(start - segment.first_batch, 0), segment.count):
        yield segment.order_row(offset)

  def batches(self, start: int = 0) -> Iterator[Batch]:
    """Every global batch from `start` on, in order (one at a time: O(1) memory in the run's length)."""
    for segment in self.segments:
      for offset in range(max(start - segment.first_batch, 0), segment.count):
        yield segment.batch(offset)

  def last(self) -> Batch:
    """The last batch read before the last state (the latest segment that read one)."""
    if not self.total:
      raise errors.InvalidArgumentError("the run read no batch before this state.")
    return self.batch(self.total - 1)

  @classmethod
  def from_states(cls, states: Mapping[int, state_lib.IteratorState], last_step: int, *,
                  keep_policy: str = "") -> "RunMap":
    """The run that state `last_step` ends, from `states` (step -> state; process 0's).

    Args:
      states: the kept steps' states; those the last step's lineage resumed from are needed.
      last_step: the step whose state ends the run.
      keep_policy: what to name when a needed step is not kept (e.g. "Orbax's max_to_keep").

    Raises:
      ItemNotFoundError: a step the lineage resumed from is not kept, or the
        lineage holds fewer resumes than the run had (only the last 64 are recorded).
      InvalidStateError: the chain rolls back, or a state does not fit its pipeline.
      UnsupportedConfigError: the positions are not stream records (see `RecordStream`).
    """
    last = states[last_step]
    lineage = last.lineage or {"resumes": 0, "recent": []}
    entries = list(lineage["recent"])
    if lineage["resumes"] > len(entries):
      raise errors.ItemNotFoundError(
          f"step {last_step}: the run resumed {lineage['resumes']} times, but a state records only the last "
          f"{len(entries)} resumes: the batches before the resume from step {entries[0]['step']} cannot be "
          "numbered. `--step` still answers for a kept step.")
    last_stream = _stream(last, f"step {last_step}")
    geometry = state_lib.carried_geometry(entries)
    restored = [(entry.get("step"), _restored_stream({**entry, **carried}, states, last_stream, keep_policy))
                for entry, carried in zip(entries, geometry)]
    return cls(_segments(last_step, last_stream, restored))


def _restored_stream(entry: Mapping[str, Any], states: Mapping[int, state_lib.IteratorState], last: RecordStream,
                     keep_policy: str) -> RecordStream:
  """The stream a resume restored: its step's state when kept, else what the resume entry records of it.

  An entry records the restored record, batch size and process count, and a mixture's segment
  (`_item.segment_fields`, carried from earlier entries where unchanged); the skips are the last
  state's (skips only grow, and a later declaration applies from its restart on). An entry written
  before ckpt_iter recorded these needs its step.
  """
  step = entry.get("step")
  if step is not None and step in states:
    return _stream(states[step], f"step {step}")
  fields = {name: entry.get(name) for name in ("record", "batch_size", "process_count")}
  origin = f"the resume from step {step}"
  if all(state_lib.is_int(v) for v in fields.values()):
    fingerprint = _segment_fingerprint(last.fingerprint, entry)
    position: dict[str, Any] = {_records.NEXT_RECORD: fields["record"]}
    if last.mixture is None:
      return RecordStream(fingerprint, position, origin=origin)
    if isinstance(entry.get("mixture"), str):
      # The mixture of that segment: its shares, its sources' lengths and its ledger, as the entry records them.
      shares, lengths, position[_records.MIXTURE] = _records.parse_mixture_segment(entry["mixture"], origin=origin)
      fingerprint = {k: v for k, v in fingerprint.items() if not k.startswith(("weight[", "source_length["))}
      fingerprint.update({f"weight[{n}]": v for n, v in shares.items()})
      fingerprint.update({f"source_length[{n}]": v for n, v in lengths.items()})
      try:
        return RecordStream(fingerprint, position, origin=origin)
      except errors.InvalidStateError:
        pass  # a per-source field the entry does not record (a removed source's shard layout): needs the step
  policy = f" ({keep_policy})" if keep_policy else ""
  what = "a mixture's ledger" if last.mixture is not None else "where that segment started"
  raise errors.ItemNotFoundError(
      f"the run resumed from step {step}, which is no longer kept{policy}, and {what} is not in the resume's "
      f"record: the batches after it cannot be numbered. To keep the steps a run resumes from, "
      f"{KEEP_RESUMED_STEPS}; `--step` still answers for a kept step.")


def _segment_fingerprint(fingerprint: Mapping[str, Any], geometry: Mapping[str, Any]) -> dict[str, Any]:
  """`fingerprint` under the geometry a resume entry records of its segment (`_item.segment_fields`): its
  global batch, process count and shard lanes, whose rows follow the global batch (one lane where the
  lineage records none: a pipeline without lanes)."""
  result = dict(fingerprint, global_batch_size=geometry["batch_size"], shard_count=geometry["process_count"],
                batch_size=geometry["batch_size"] // max(geometry["process_count"], 1))
  for field in (_permutation.LANES_FIELD, _permutation.LANE_ROWS_FIELD):
    result.pop(field, None)
  lanes = geometry.get("lanes", 1)
  if state_lib.is_int(lanes) and lanes >= 2:
    result[_permutation.LANES_FIELD], result[_permutation.LANE_ROWS_FIELD] = lanes, geometry["batch_size"] // lanes
  return result


def segment_start(value: state_lib.IteratorState) -> int | None:
  """The stream record the segment of `value` started at: 0 for a run never resumed, else the record its
  last resume restored (its lineage records it); None for a state whose lineage does not (written
  before ckpt_iter recorded it)."""
  lineage = value.lineage
  if not lineage or not lineage.get("resumes"):
    return 0
  recent = lineage.get("recent") or ()
  record = recent[-1].get("record") if recent else None
  return int(record) if state_lib.is_int(record) else None


def _segments(last_step: int, last: RecordStream, restored: list[tuple[int | None, RecordStream]]) -> list[Segment]:
  # Segment j runs from restore j's position to restore j+1's (the last one to the last state's);
  # its stream (batch size, skips, mixture) is that of the state that ends it.
  starts = [(0, None)] + [(stream.next_record, step) for step, stream in restored]
  ends = restored + [(last_step, last)]
  segments: list[Segment] = []
  first_batch = 0
  for number, ((start, resumed_from), (step, stream)) in enumerate(zip(starts, ends)):
    if stream.next_record < start:
      raise errors.InvalidStateError(
          f"step {step}: position {stream.next_record} is behind the restored position {start}: the chain "
          "rolls back (ckpt-iter audit says more); its batches cannot be numbered.")
    segment = Segment(number, stream, start, stream.next_record, resumed_from, first_batch)
    if segment.plan.index_of(stream.next_record) is None:
      raise errors.InvalidStateError(
          f"step {step}: stream record {stream.next_record} is not a batch end of the plan from the restored "
          f"record {start} (batches of {stream.batch_size}): the state does not fit the chain.")
    segments.append(segment)
    first_batch += segment.count
  return segments


def _stream(value: state_lib.IteratorState, origin: str) -> RecordStream:
  fingerprint, position = _input_fields(value)
  return RecordStream(fingerprint, position, origin=origin)


# ---------------------------------------------------------------------------
# A Tunix RL learner's global step.


@dataclasses.dataclass(frozen=True)
class LearnerStep:
  """The global step a Tunix RL learner's checkpoint is in.

  Attributes:
    global_step: the learner's global step (Tunix's `global_steps` counter).
    prompts: the global step's full batch (its prompts' source records).
    first_update, last_update: the optimizer updates (train steps) of the
      global step, 1-based as Tunix numbers its checkpoints.
    saved_after: the update the checkpoint was saved after.
    repeats: one line per mini-batch of the global step (its prompts and
      updates) and, for the checkpoint's mini-batch, one per `num_iterations`
      repeat: which updates were trained before the checkpoint and which
      remain pending.
    mid_step: the checkpoint falls inside the global step.
  """

  global_step: int
  prompts: Batch
  first_update: int
  last_update: int
  saved_after: int
  repeats: tuple[str, ...]
  mid_step: bool

  def to_json(self) -> dict[str, Any]:
    """This learner step as a JSON object (`which --json` on a Tunix root)."""
    return {"global_step": self.global_step, "updates": [self.first_update, self.last_update],
            "saved_after_update": self.saved_after, "mid_step": self.mid_step, "repeats": list(self.repeats),
            "prompts": self.prompts.to_json()}


def learner_step(value: state_lib.IteratorState, *, run: RunMap | None = None,
                 origin: str = "the state") -> LearnerStep:
  """Which prompts the global step of a Tunix RL learner's state trained, and its repeats' updates.

  From the state alone: the global step's full batch is the input batch the
  position is inside (micro-batches of it taken) or the one it just ended;
  a global step is `mini_batches_per_global_step` mini-batches, each rolled
  out once and trained `num_iterations` times, one optimizer update per
  mini-batch and repeat; the pending schedule holds the current
  mini-batch's trainer inputs still to train.

  Args:
    value: the learner's state (kind "tunix", an RL learner's).
    run: the run this state ends (`RunMap.from_states`), when its chain is
      at hand: the full batch is then numbered; else from the state alone.
    origin: what errors name.

  Raises:
    UnsupportedConfigError: not an RL learner's state (SFT, agentic).
  """
  counters, fingerprint = value.counters, value.fingerprint
  needed = ("train_steps", "global_steps", "remaining_mini_batches", "mini_batches_per_global_step")
  if value.kind != "tunix" or "learner" not in fingerprint or not all(n in counters for n in needed):
    raise errors.UnsupportedConfigError(
        f"{origin}: not a Tunix RL learner's state (kind {value.kind!r}, learner "
        f"{fingerprint.get('learner', fingerprint.get('trainer', fingerprint.get('agentic_learner')))!r}); "
        "global steps and repeats are an RL learner's (GRPO, PPO).")
  own = value.own_position
  mu = int(fingerprint.get("num_iterations") or 1)
  mini = int(fingerprint.get("mini_batch_size") or fingerprint.get("full_batch_size") or 1)
  micro = int(fingerprint.get("train_micro_batch_size") or mini)
  inputs_per_update = max(mini // max(micro, 1), 1)
  per_step = int(counters["mini_batches_per_global_step"])
  remaining = int(counters["remaining_mini_batches"])
  eval_items = int(counters.get("eval_items", 0))
  pending = 0 if value.pending is None else len(value.pending.schedule)
  mid = pending > 0 or remaining > 0
  current = per_step - 1 - remaining  # the mini-batch the checkpoint is in (or the step's last)
  trained_inputs = mu * inputs_per_update - pending
  done = (current * mu + trained_inputs // inputs_per_update) if mid else per_step * mu
  saved_after = int(counters["train_steps"])
  first = saved_after - done + 1
  prompts = _full_batch(value, own, run, origin)
  first_update = first + current * mu
  lines = []
  for mini_batch in range(per_step):
    rows = prompts.records[mini_batch * mini:(mini_batch + 1) * mini]
    names = " ".join((f"{r.source}:{r.index}" if r.source else str(r.index)) for r in rows)
    head = f"mini-batch {mini_batch + 1} of {per_step} (source records {names or 'none'}): "
    updates = f"updates {first + mini_batch * mu}-{first + (mini_batch + 1) * mu - 1}"
    if mid and mini_batch == current:
      lines.append(head + "the checkpoint's mini-batch")
      lines.extend("  " + line for line in _repeat_lines(mu, inputs_per_update, trained_inputs, first_update,
                                                          eval_items))
    elif mini_batch < current or not mid:
      lines.append(head + f"{updates}, all {mu} repeats trained before the checkpoint")
    else:
      lines.append(head + f"{updates}, not started (rolled out after a restore)")
  return LearnerStep(int(counters["global_steps"]), prompts, first, first + per_step * mu - 1, saved_after,
                     tuple(lines), mid)


def _full_batch(value: state_lib.IteratorState, own: Mapping[str, Any], run: RunMap | None, origin: str) -> Batch:
  """The full batch of the learner's global step: the one its position is inside, or the one it just ended."""
  fingerprint, position = _input_fields(value)
  stream = RecordStream(fingerprint, position, origin=origin)
  if not (own.get("micro_batches_taken") or own.get("rows_taken")):
    if run is not None:
      return run.last()
    return last_batch_of(value, origin=origin)
  plan = run.segments[-1].plan if run is not None else stream.plan_at(stream.next_record)
  index = plan.index_of(stream.next_record)
  return stream.batch(plan.records(index), how="the full batch the position is inside (micro-batches of it taken)",
                      number=None if run is None else run.total, segment=None if run is None else
                      run.segments[-1].number)


def _repeat_lines(mu: int, inputs_per_update: int, trained_inputs: int, first_update: int,
                  eval_items: int) -> tuple[str, ...]:
  lines = []
  for repeat in range(mu):
    update = first_update + repeat
    done = min(max(trained_inputs - repeat * inputs_per_update, 0), inputs_per_update)
    if done == inputs_per_update:
      state = "trained before the checkpoint"
    elif done == 0:
      state = "pending (restored from the checkpoint, not rolled out again)"
    else:
      state = f"{done} of {inputs_per_update} micro-batches trained, the rest pending"
    lines.append(f"repeat {repeat + 1} of {mu}: update {update}: {state}")
  if eval_items:
    lines.append(f"{eval_items} evaluation input(s) pending (never trained)")
  return tuple(lines)
