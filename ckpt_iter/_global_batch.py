"""make_dataset's node: the global batches of the record plan, the position a state holds, its own restore.

`GlobalBatchDataset` reads its parents' records in the order of a
`_records.BatchPlan` (and a mixture's interleave), one global batch per
element, this process's rows of it; `DatasetSpec` holds the defining fields
that make the plan and the fingerprint. A restore of a record position is the
node's own (`check_record_restore`: the position, the skips the restored run
keeps and adds, where it continues, the content check of the batch before),
applied by `restart_at`. An iterator finds the node in any pipeline, with the
pipeline's fingerprint, by one call (`pipeline_nodes`). Building the pipeline
from make_dataset's arguments is `dataset`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping

import grain

from ckpt_iter import _graph
from ckpt_iter import _lanes
from ckpt_iter import _permutation
from ckpt_iter import _records
from ckpt_iter import _stacking
from ckpt_iter import errors
from ckpt_iter import sources as sources_lib
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib


# ckpt_iter's one logger (the restore's INFO lines; docs/getting_started.md shows how to see them).
LOGGER = logging.getLogger("ckpt_iter")
NEXT_RECORD = _records.NEXT_RECORD
MIXTURE = _records.MIXTURE


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """The defining fields of a make_dataset pipeline.

  `source` is the one source, or None for a mixture, whose named sources
  and integer shares are `sources` and `shares` (same order).
  """

  source: sources_lib.SourceIdentity | None
  batch_size: int
  seed: int | None
  num_epochs: int | None
  drop_remainder: bool
  shard_index: int
  shard_count: int
  transform: str | None
  sources: tuple[tuple[str, sources_lib.SourceIdentity], ...] = ()
  shares: tuple[tuple[str, int], ...] = ()
  # shuffle="shards": shards per window and the shard layout (`_permutation.layout_text`) of the source, or
  # of each source of a mixture (name, layout); None and (): Grain's shuffle.
  shuffle_window: int | None = None
  shuffle_shards: str | None = None
  source_shards: tuple[tuple[str, str], ...] = ()
  # shuffle="shards" with shard_lanes > 1: the lanes and the rows each gives a global batch; 1 and None: none.
  shuffle_lanes: int = 1

  @property
  def shuffle_lane_rows(self) -> int | None:
    return None if self.shuffle_lanes == 1 else self.global_batch_size // self.shuffle_lanes

  @property
  def shuffle(self) -> str:
    return _permutation.GLOBAL if self.shuffle_window is None else _permutation.SHARDS

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.shard_count

  @property
  def is_mixture(self) -> bool:
    return self.source is None

  def stream_length(self) -> int:
    """Records in the stream of a single source (INFINITE without num_epochs)."""
    if self.num_epochs is None:
      return _records.INFINITE
    return self.source.length * self.num_epochs

  def source_limits(self) -> dict[str, int]:
    """name -> records of its own stream a mixture may read (num_epochs of its epochs)."""
    return {name: _records.INFINITE if self.num_epochs is None else identity.length * self.num_epochs
            for name, identity in self.sources}

  def initial_plan(self) -> _records.BatchPlan:
    return self.plan_at(0, None)

  def plan_at(self, next_record: int, mixture: _records.Mixture | None,
              skips: skips_lib.Skips = skips_lib.NO_SKIPS) -> _records.BatchPlan:
    """The batches of this pipeline that start at stream record `next_record`, the records `skips` removed."""
    if self.is_mixture:
      stream_length = (mixture or self.initial_mixture()).length(self.source_limits())
      epoch_length = None
    else:
      stream_length, epoch_length = self.stream_length(), self.source.length
    return _records.BatchPlan.at(
        next_record, batch_size=self.global_batch_size, drop_remainder=self.drop_remainder,
        epoch_length=epoch_length, stream_length=stream_length, skips=skips)

  def initial_mixture(self) -> _records.Mixture:
    return _records.Mixture(shares=dict(self.shares))

  @property
  def batches_per_epoch(self) -> int | None:
    """Global batches per epoch of a single source (None for a mixture: its sources have no common epoch)."""
    return None if self.is_mixture else self.initial_plan().batches_per_epoch

  def fingerprint(self) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if self.is_mixture:
      fields["source"] = "mixture[" + ",".join(name for name, _ in self.sources) + "]"
      for name, identity in self.sources:
        fields[f"source[{name}]"] = identity.description
        fields[f"source_length[{name}]"] = identity.length
        fields[f"source_digest[{name}]"] = identity.digest
      for name, share in self.shares:
        fields[f"weight[{name}]"] = share
    else:
      fields.update({
          "source": self.source.description,
          "source_length": self.source.length,
          "source_digest": self.source.digest,
      })
    fields.update({
        "seed": self.seed,
        "num_epochs": self.num_epochs,
        "drop_remainder": self.drop_remainder,
        "batch_size": self.batch_size,
        "global_batch_size": self.global_batch_size,
        "batches_per_epoch": self.batches_per_epoch,
        "shard_index": self.shard_index,
        "shard_count": self.shard_count,
        "transform": self.transform,
    })
    if self.shuffle_window is not None:  # only then: a default pipeline's fingerprint is what it always was
      fields.update({_permutation.SHUFFLE_FIELD: _permutation.SHARDS, _permutation.WINDOW_FIELD: self.shuffle_window})
      if self.is_mixture:
        fields.update({_permutation.source_shards_field(name): layout for name, layout in self.source_shards})
      else:
        fields[_permutation.SHARDS_FIELD] = self.shuffle_shards
      if self.shuffle_lanes > 1:  # only then: a pipeline without lanes keeps the fields it always had
        fields.update({_permutation.LANES_FIELD: self.shuffle_lanes,
                       _permutation.LANE_ROWS_FIELD: self.shuffle_lane_rows})
    return fields


def check_node_can_skip(node: "GlobalBatchDataset | _lanes.LaneDataset", skips: skips_lib.Skips, *, origin: str,
                restored: bool = False, saved: skips_lib.Skips | None = None) -> None:
  """`skips_lib.check_skips` of `skips` against make_dataset's node `node`.

  Args:
    node: make_dataset's node.
    skips: what the node declared (resolved), or a state's skips (`restored`),
      or both merged (`saved`: the state's, checked before).
    origin: what errors name.
    restored: `skips` are a state's.
    saved: the state's skips that `skips` adds the declared ones to.

  The batch rule (at least one batch per epoch) applies to make_dataset's
  own batches; lanes fill their rows from later chunks.
  """
  spec = node.spec
  if restored:
    named = f"the state's fingerprint field {skips_lib.SKIPS_FIELD!r} ({skips.describe(limit=4)})"
  else:
    named = f"skip={errors.shown_value(node.declared, 120)}"
    if saved:
      named += f" added to the state's skips ({saved.describe(limit=4)})"
  skips_lib.check_skips(
      skips, epoch_length=None if spec.is_mixture else spec.source.length, shuffled=is_shuffled(spec),
      mixture=spec.is_mixture, named=named, origin=origin, restored=restored,
      global_batch_size=spec.global_batch_size if isinstance(node, GlobalBatchDataset) else None,
      drop_remainder=spec.drop_remainder,
      stream_length=None if spec.is_mixture or spec.num_epochs is None else spec.stream_length())


def is_shuffled(spec: DatasetSpec) -> bool:
  return spec.seed is not None


class GlobalBatchDataset(grain.MapDataset):
  """This process's rows of each global batch, stacked into one batch.

  Element k is this process's rows of global batch k of its `BatchPlan`.
  A fresh dataset's plan starts at stream record 0; a `DataIterator`
  restoring a position moves it (`restart_at`), so that the next element
  starts at exactly the restored record whatever the batch size. Carries the
  DatasetSpec that fingerprints it.
  """

  def __init__(self, parents: list[grain.MapDataset], spec: DatasetSpec):
    super().__init__(parents)
    self.spec = spec
    self._names = [name for name, _ in spec.sources]
    # Where it reads (a value, replaced as a whole): the plan, the mixture, the last restart.
    self.cursor = _records.Cursor(spec.initial_plan(), spec.initial_mixture() if spec.is_mixture else None)
    self.declared = skips_lib.Skip()  # what `declare` was given
    self._skips = skips_lib.NO_SKIPS  # what the run skips now
    # Sparse: element k is record k of the stream or None (Grain's filter form), for a
    # pipeline whose position is not a stream record (set by DataIterator).
    self.sparse = False
    # (stream record, mixture) -> None: read the files from that record on first, set by make_dataset
    # only over a source that prefetches by plan (shuffle="shards" through a cache), so no other restore
    # enters the prefetcher.
    self.restore_prefetch: Callable[[int, Any], None] | None = None

  @property
  def plan(self) -> _records.BatchPlan:
    return self.cursor.plan

  @property
  def skips(self) -> skips_lib.Skips:
    return self._skips

  def declare(self, skip: skips_lib.Skip) -> None:
    """Records to skip: for a fresh run from its first record on (see `with_skip`)."""
    self.declared = skip
    self._skips, _ = skips_lib.resolve(
        skip, from_record=0, epoch_length=None if self.spec.is_mixture else self.spec.source.length,
        shuffled=is_shuffled(self.spec), mixture=self.spec.is_mixture, origin="make_dataset(skip=...)")
    check_node_can_skip(self, self._skips, origin="make_dataset")
    self._replan(self.spec.plan_at(0, self.mixture, self._plan_skips))

  @property
  def _plan_skips(self) -> skips_lib.Skips:
    return skips_lib.NO_SKIPS if self.sparse else self._skips

  def use_sparse(self) -> None:
    """Element k is stream record k, or None where it is skipped (before the pipeline is read)."""
    self.sparse = True
    self._replan(self.spec.plan_at(0, self.mixture))

  def _replan(self, plan: _records.BatchPlan) -> None:
    self.cursor = dataclasses.replace(self.cursor, plan=plan)

  def set_skips(self, skips: skips_lib.Skips) -> None:
    """The skips a restore settled on (its apply step; the plan is set by `restart_at`)."""
    self._skips = skips

  @property
  def mixture(self) -> _records.Mixture | None:
    return self.cursor.mixture

  def __len__(self) -> int:
    return len(self.cursor.plan)

  def __str__(self) -> str:
    shard = f"{self.spec.shard_index}/{self.spec.shard_count}"
    return f"GlobalBatchDataset(batch_size={self.spec.batch_size}, shard={shard})"

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    # Past the length is allowed: Grain's MapDataset contract, on which a
    # `repeat` after make_dataset relies. It continues into later epochs,
    # each with its own permutation, as Grain's shuffle does.
    if index < 0:
      raise IndexError(f"batch index {index} is negative")
    # This process's rows only: O(per-process batch) at any process count, with skips too.
    rows = self.cursor.plan.rows(index, self.spec.shard_index * self.spec.batch_size, self.spec.batch_size)
    if self.sparse and self._skips and any(self._skips.skipped(g, self._epoch_length) for g in rows):
      return None  # a skipped record, dropped as Grain drops what a filter rejects
    if self.mixture is None:
      parent = self._parent
      return _stacking.stack_records([parent[g] for g in rows], batch_index=index)
    return _stacking.stack_records([self.record(g) for g in rows], batch_index=index)

  def last_row(self, index: int) -> Any:
    """Batch `index`'s last row, produced from its record alone, as a batch of one: what a content record of
    that batch's last row (`_drift.row_record`) is checked against, one record read where the batch is many."""
    rows = self.cursor.plan.rows(index, self.spec.shard_index * self.spec.batch_size, self.spec.batch_size)
    return _stacking.stack_records([self.record(rows[-1])], batch_index=index)

  @property
  def _epoch_length(self) -> int | None:
    return None if self.spec.is_mixture else self.spec.source.length

  def record(self, stream_record: int) -> Any:
    """Record `stream_record` of the global stream."""
    if self.mixture is None:
      return self._parent[stream_record]
    name, index = self.mixture.source_of(stream_record)
    return self.parents[self._names.index(name)][index]

  def locate(self, stream_record: int) -> tuple[str, int]:
    """(source name, index in that source's own stream) of a stream record ("" for a single source)."""
    if self.mixture is None:
      return "", stream_record
    return self.mixture.source_of(stream_record)

  # -- the position a state holds: `cursor.position(next_index)`

  def position_of_index(self, next_index: int) -> dict[str, Any]:
    """The position of batch `next_index` of this pipeline as built (plan and mixture from the start)."""
    mixture = self.spec.initial_mixture() if self.spec.is_mixture else None
    return _records.Cursor(self.spec.initial_plan(), mixture).position(next_index)

  def spec_mixture(self, position: Mapping[str, Any], *, origin: str) -> _records.Mixture | None:
    """The mixture a reconciled position continues (None for a single source)."""
    if not self.spec.is_mixture:
      return None
    return _records.Mixture.from_json(position.get(MIXTURE), dict(self.spec.shares), position[NEXT_RECORD],
                                      origin=origin)

  # -- make_dataset's own restore: where a saved record position continues (`DataIterator` applies it)

  def record_position(self, position: Mapping[str, Any], *, bare: bool, origin: str) -> dict[str, Any]:
    """A reconciled state position as this pipeline's record position, checked.

    `bare`: a state with no fingerprint (Grain's own, format 0), whose
    `{"next_index": k}` is batch k of this pipeline as built.

    Raises:
      InvalidStateError: the position is not {NEXT_RECORD[, MIXTURE]} (or a bare index out of range).
    """
    if bare and set(position) == {"next_index"}:
      position = self.position_of_index(self._bare_index(position["next_index"], origin))
    expected = {NEXT_RECORD} | ({MIXTURE} if self.spec.is_mixture else set())
    if set(position) != expected:
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {state_lib.short_repr(dict(position))}; this make_dataset pipeline's "
          f"position is {{'{NEXT_RECORD}': <stream records passed>"
          + (f", '{MIXTURE}': <ledger>" if self.spec.is_mixture else "") + "}.")
    return dict(position)

  def _bare_index(self, next_index: Any, origin: str) -> int:
    length = len(self.spec.initial_plan())
    if not state_lib.is_int(next_index) or not 0 <= next_index <= length:
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {{'next_index': {state_lib.short_repr(next_index)}}}; this pipeline's "
          f"position is {{'next_index': 0..{length}}}.")
    return int(next_index)

  def restore_at(self, position: Mapping[str, Any], skips: skips_lib.Skips, *, origin: str,
                 differences: Mapping[str, Any]) -> "RecordRestore":
    """Where a record position continues: the plan from its record under `skips`, and its batch index.

    Args:
      position: a `record_position`.
      skips: what the restored run skips.
      origin: what errors name.
      differences: the saved fingerprint's differences from this pipeline's (for the refusal's words).

    Raises:
      InvalidStateError, ConfigDriftError: the record is past the end of this pipeline's stream.
    """
    next_record = position[NEXT_RECORD]
    mixture = self.spec_mixture(position, origin=origin)
    plan = self.spec.plan_at(next_record, mixture, skips)
    next_index = plan.index_of(next_record)
    if next_index is None or next_record > plan.stream_length or next_index > len(plan):
      message = (f"the saved position (stream record {next_record}) is past the end of this pipeline's "
                 f"stream ({plan.stream_length} records)")
      if differences:
        raise errors.ConfigDriftError(differences, origin=origin, way=(
            f"Not a stream-preserving change: {message}, and no allow_drift moves it. Rebuild the pipeline "
            f"with a stream that reaches past record {next_record} (e.g. more epochs), or restore an earlier step."))
      raise errors.InvalidStateError(
          f"{origin}: {message}. Restore it into the pipeline that wrote it, or one with more epochs.")
    # The files at the restored position first (the batch before it is read first, by the content check):
    # this process's first row of it, which with shard lanes is in this process's lanes.
    before = plan.full_batch_before(next_record)
    if self.restore_prefetch is not None:
      start, first = next_record if before is None else before, self.spec.shard_index * self.spec.batch_size
      self.restore_prefetch(skips.stream_record_of_kept(skips.kept_before(start) + first) if skips else start + first,
                            mixture)
    return RecordRestore(plan, mixture, next_record, next_index, before)

  def check_batch_before(self, restore: "RecordRestore", skips: skips_lib.Skips,
                         check_element: Callable[[int], str]) -> str:
    """The content check of a record position: the full batch that ends at it, produced again.

    `check_element(index)` produces the pipeline's element before `index`
    under the plan in effect and compares it (the iterator's content check).
    Not the batch before the restored plan's first one: after a restart
    under another batch size, an epoch's batches started at the restored
    record, so the batch that ended an epoch is found by its end, not by the
    epoch's first record. An epoch's short last batch cannot be found so
    (its start depends on earlier restarts): not checked.
    """
    start = restore.batch_before
    if start is None:
      return "not applicable (the batch before is an epoch's last, whose start depends on earlier restarts)"
    check_plan = self.spec.plan_at(start, restore.mixture, skips)
    with self.planned(check_plan, restore.mixture):
      return check_element(check_plan.index_of(start) + 1)

  def check_record_restore(self, position: Mapping[str, Any], saved_skips: skips_lib.Skips, *, bare: bool,
                           differences: Mapping[str, Any], check_element: Callable[[int], str] | None,
                           origin: str) -> "RecordRestore":
    """make_dataset's own restore of a reconciled position, checked (the check half; `restart_at` applies it).

    The record position (`record_position`), the skips the restored run keeps and adds (`merged_skips`),
    where it continues (`restore_at`) and, given `check_element`, the content check of the batch before
    (`check_batch_before`).

    Raises:
      InvalidStateError, ConfigDriftError, UnsupportedConfigError: the position, the skips or the content.
    """
    position = self.record_position(position, bare=bare, origin=origin)
    skips = merged_skips(self, saved_skips, position[NEXT_RECORD], position, origin)
    restore = self.restore_at(position, skips.effective, origin=origin, differences=differences)
    content = None if check_element is None else self.check_batch_before(restore, skips.effective, check_element)
    return dataclasses.replace(restore, skips=skips, content_check=content)

  def restart_at(self, restore: "RecordRestore") -> None:
    """Moves the batches to the restore's plan and mixture, batch `next_index` at `next_record`: its apply step."""
    self.cursor = _records.Cursor(restore.plan, restore.mixture, (restore.next_index, restore.next_record))

  @contextlib.contextmanager
  def skipping(self, skips: skips_lib.Skips) -> Iterator[None]:
    """Reads with `skips` for the duration (its plan re-cut from its origin), then as before."""
    before = self.cursor, self._skips
    self._skips = skips
    self._replan(self.spec.plan_at(self.cursor.origin[1], self.mixture, self._plan_skips))
    try:
      yield
    finally:
      self.cursor, self._skips = before

  @contextlib.contextmanager
  def planned(self, plan: _records.BatchPlan, mixture: _records.Mixture | None) -> Iterator[None]:
    """Reads under `plan` for the duration (a restore's content check), then as before."""
    before = self.cursor
    self.cursor = dataclasses.replace(before, plan=plan, mixture=mixture)
    try:
      yield
    finally:
      self.cursor = before


@dataclasses.dataclass(frozen=True)
class RecordRestore:
  """Where a restored record position continues (`GlobalBatchDataset.check_record_restore`): its plan,
  mixture, record and batch index, where the full batch before it starts (None: an epoch's short last
  batch, not checked), the skips it settles on, and what its content check found."""

  plan: _records.BatchPlan
  mixture: _records.Mixture | None
  next_record: int
  next_index: int
  batch_before: int | None = None
  skips: "SkipChange | None" = None
  content_check: str | None = None


def apply_skips(node: "GlobalBatchDataset | _lanes.LaneDataset", change: "SkipChange") -> str | None:
  """A restore's apply step for its skips: `node` skips them, the log says what changed.

  Returns:
    The skips' fingerprint text (`skips_lib.SKIPS_FIELD`), or None when the run skips nothing.
  """
  node.set_skips(change.effective)
  for level, line in change.lines():
    LOGGER.log(level, line)
  return change.effective.to_text() if change.effective else None


# ---------------------------------------------------------------------------
# The skips a restore keeps and adds: make_dataset's node owns the run's skips.


@dataclasses.dataclass(frozen=True)
class SkipChange:
  """The skips a restore settles on: all of them, those it adds, and declared ranges already read."""

  effective: skips_lib.Skips
  added: skips_lib.Skips
  already_read: tuple[tuple[int, int], ...]

  def lines(self) -> list[tuple[int, str]]:
    """(logging level, line): a declared skip that is not (fully) applied is a WARNING, shown by default."""
    lines = []
    if self.added:
      lines.append((logging.INFO, f"skips added at this restore: {self.added.describe()}; the run now skips "
                                  f"{self.effective.describe()}."))
    if self.already_read:
      shown = skips_lib.ranges_text(self.already_read)
      lines.append((logging.WARNING, f"declared skip of stream records {shown} not applied: they were read "
                                     "before the restored position (restore an earlier step to skip them)."))
    return lines


def merged_skips(node: "GlobalBatchDataset | _lanes.LaneDataset | None", saved: skips_lib.Skips,
                 from_record: int | None, position: Mapping[str, Any], origin: str) -> SkipChange:
  """What the restored run skips: the saved skips and `node`'s declared ones from the position on.

  `from_record`: the restored stream record, or None where the position
  is no stream record (a Grain index above make_dataset, lanes): then
  everything declared applies from the restart on.

  Raises:
    UnsupportedConfigError: skips this pipeline cannot keep (the message says why and what to do).
  """
  if node is None:
    return SkipChange(saved, skips_lib.NO_SKIPS, ())
  declared = node.declared
  if not saved and not declared.records and not declared.source_records:
    return SkipChange(saved, skips_lib.NO_SKIPS, ())  # nothing saved or declared: nothing to check or add
  spec = node.spec
  check_node_can_skip(node, saved, origin=origin, restored=True)
  new, already = skips_lib.resolve(
      node.declared, from_record=from_record, epoch_length=None if spec.is_mixture else spec.source.length,
      shuffled=is_shuffled(spec), mixture=spec.is_mixture, origin=origin)
  effective = saved.union(new)
  if new:
    check_node_can_skip(node, effective, origin=origin, saved=saved)
  change = SkipChange(effective, effective.added_to(saved), already)
  if isinstance(node, GlobalBatchDataset) and node.sparse:
    check_sparse_skips(node, effective, origin)
  if isinstance(node, _lanes.LaneDataset) and change.added:
    _lanes.check_added_skips(node, position, change.added, origin=origin)
  return change


def check_sparse_skips(node: GlobalBatchDataset, skips: skips_lib.Skips, origin: str) -> None:
  """A make_dataset under other Grain steps skips a record by yielding None: one record per element only.

  Raises:
    UnsupportedConfigError: skips with a global batch of more than one record.
  """
  if skips and node.spec.global_batch_size > 1:
    raise errors.UnsupportedConfigError(
        f"{origin}: skipping {skips.describe()} under other Grain steps (this pipeline applies steps after "
        f"make_dataset that are not per-batch maps, so its position is not a stream record) works only with "
        f"a global batch of one record; this one has {node.spec.global_batch_size} "
        f"(batch_size={node.spec.batch_size} x shard_count={node.spec.shard_count}). Batch with "
        "make_dataset(batch_size=...) itself, or drop the records by content with make_dataset(filter=...).")


# ---------------------------------------------------------------------------
# make_dataset's node in a pipeline, and the pipeline's fingerprint.

# A fingerprint field saying the position means the same on every process
# (set for Grain's ElasticIterator; make_dataset says it by global_batch_size).
POSITION_SCOPE_FIELD = "position_scope"


def spec_node(dataset: Any) -> "GlobalBatchDataset | _lanes.LaneDataset | None":
  """make_dataset's node of `dataset` on its chain of single parents, or None."""
  return _find_spec_node(dataset)[0]


def record_node(dataset: Any) -> "GlobalBatchDataset | None":
  """make_dataset's node, when a position of `dataset` can count its stream records.

  That holds when every node above it maps one batch index to the same index
  (`_records.RECORD_ADDRESSED_ABOVE`), so batch k of the pipeline is batch k
  of make_dataset's plan.
  """
  if not isinstance(dataset, grain.MapDataset):
    return None
  node, above = _find_spec_node(dataset)
  if not isinstance(node, GlobalBatchDataset) or any(kind not in _records.RECORD_ADDRESSED_ABOVE for kind in above):
    return None
  return node


def find_spec(dataset: Any) -> tuple[DatasetSpec | None, list[str]]:
  """Finds the make_dataset spec of a pipeline and the node types above it.

  Returns:
    (spec or None, class names of the nodes between `dataset` and the
    make_dataset node, outermost first; the whole chain when there is none).
  """
  node, above = _find_spec_node(dataset)
  return (None if node is None else node.spec), above


def _find_spec_node(dataset: Any) -> tuple["GlobalBatchDataset | _lanes.LaneDataset | None", list[str]]:
  # Follows single parents only: `pipeline` (elastic.resize_refusal parses
  # it) keeps the meaning it had when older states were written.
  above: list[str] = []
  node = dataset
  while node is not None:
    if isinstance(node, (GlobalBatchDataset, _lanes.LaneDataset)):
      return node, above
    above.append(type(node).__name__)
    parents = getattr(node, "parents", ())
    node = parents[0] if len(parents) == 1 else None
  return None, above


# The fingerprint field of a state saved from a plain Grain iterator (`iter(dataset)`): the iterator
# classes above the MapDataset it reads ("" for `iter(map_dataset)` itself).
GRAIN_ITERATOR_FIELD = "grain_iterator"


def describe_grain_iterator(iterator: Any) -> dict[str, Any] | None:
  """The fingerprint of a plain Grain iterator: its MapDataset's (`describe_pipeline`) and the iterator
  steps above it (`GRAIN_ITERATOR_FIELD`); None where its dataset cannot be found (`_graph.iterator_dataset`)."""
  found = _graph.iterator_dataset(iterator)
  if found is None:
    return None
  dataset, above = found
  return {**describe_pipeline(dataset), GRAIN_ITERATOR_FIELD: "<".join(above)}


def describe_pipeline(dataset: Any) -> dict[str, Any]:
  """The fingerprint fields of any Grain dataset (make_dataset or hand-built).

  Returns:
    make_dataset's spec fields (when the pipeline has its node on a chain of
    single parents), `pipeline` (class names of the nodes above that node, or
    of the whole chain, joined by "<"), `dataset_length`, and the graph fields
    of `_graph.describe_graph` (`graph`, `node[i].Kind.param`): every node's
    kind and defining parameters, through mp_prefetch.
  """
  spec_node, above = _find_spec_node(dataset)
  fields: dict[str, Any] = {}
  if spec_node is not None:
    fields.update(spec_node.spec.fingerprint())
    if isinstance(spec_node, _lanes.LaneDataset):
      fields.update(spec_node.lanes.fingerprint())
    if spec_node.skips:
      fields[skips_lib.SKIPS_FIELD] = spec_node.skips.to_text()
  if type(dataset).__name__ == "ElasticIterator":
    # Its state ({"global_next_index"}) is the same on every process and for
    # every process count: the position is global (elastic.resize_refusal).
    try:
      fields.update(_graph.elastic_fields(dataset))
      fields[POSITION_SCOPE_FIELD] = "global"
    except AttributeError:  # another Grain release: no elastic resume
      pass
  fields["pipeline"] = "<".join(above) if above else ""
  # As built, without skips: they have their own field, and a restore may add to them.
  with (spec_node.skipping(skips_lib.NO_SKIPS) if isinstance(spec_node, GlobalBatchDataset)
        else contextlib.nullcontext()):
    try:
      fields["dataset_length"] = len(dataset)
    except TypeError:
      fields["dataset_length"] = None
  fields.update(_graph.describe_graph(dataset, described_spec_node=spec_node))
  return fields


@dataclasses.dataclass(frozen=True)
class PipelineNodes:
  """make_dataset's nodes of a pipeline, as an iterator reads it (`pipeline_nodes`)."""

  spec: DatasetSpec | None
  # make_dataset's node anywhere on the chain of single parents: it owns the run's skips.
  spec_node: "GlobalBatchDataset | _lanes.LaneDataset | None"
  # The same node when a position of the pipeline counts its stream records (`record_node`), else None.
  record_node: "GlobalBatchDataset | None"
  # The pipeline's fingerprint (`describe_pipeline`), with the node set as the iterator reads it.
  fingerprint: dict[str, Any]


def pipeline_nodes(dataset: Any) -> PipelineNodes:
  """make_dataset's nodes of `dataset` and its fingerprint; a node under other Grain steps is set to yield
  one record per element (`use_sparse`), its declared skips checked for that.

  Raises:
    UnsupportedConfigError: skips under other Grain steps with a global batch of more than one record.
  """
  node = spec_node(dataset)
  records = record_node(dataset)
  if isinstance(node, GlobalBatchDataset) and records is None:
    node.use_sparse()
    check_sparse_skips(node, node.skips, "make_dataset(skip=...)")
  return PipelineNodes(None if node is None else node.spec, node, records, describe_pipeline(dataset))


