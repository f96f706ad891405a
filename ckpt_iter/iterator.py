"""DataIterator: a checkpointable iterator over a Grain dataset.

Its state is a versioned value (see `state.IteratorState`): format version,
the pipeline's fingerprint and the Grain position of the next unread element.
Restoring validates everything first and then sets the position directly:
O(1) in the position, no element is replayed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import numbers
from typing import Any, Callable, Collection, Mapping

import grain

from ckpt_iter import _drift
from ckpt_iter import _permutation
from ckpt_iter import _global_batch
from ckpt_iter import _graph
from ckpt_iter import _workers
from ckpt_iter import _item as item_lib
from ckpt_iter import _records
from ckpt_iter import elastic
from ckpt_iter import errors
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib

# Reading in the calling thread: on small records Grain's 16 default threads
# cost more than they save on 2 cores, and make the first next() after a
# restore wait for a fresh thread pool (measured in benchmarks/).
DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class DataIterator(item_lib.V1Checkpointable, state_lib.RestorableIterator, grain.DatasetIterator):
  """Iterates a Grain dataset; `get_state`/`set_state` follow Grain's protocol.

  Args:
    dataset: a `grain.MapDataset` (e.g. from `make_dataset`) or a
      `grain.IterDataset`.
    read_options: Grain read options for a MapDataset; defaults to reading in
      the calling thread.
    allow_drift: fingerprint fields a restored state may differ in. Use
      `ckpt_iter.ELASTIC_FIELDS` to resume with another process count;
      `"content"` (or a ContentDriftError's `content.<field>`) accepts what
      the pipeline produces now where the content check would refuse it
      (the way through for a caller that cannot pass `check_content=False`,
      such as a Tunix learner's `allow_drift`).
    check_content: for a MapDataset, record a digest of the element produced
      last in each state, and on restore produce that element again and
      compare (ContentDriftError names the first differing field). Off, the
      state says so and a restore checks nothing of the content.

  Guarantees:
    After `set_state(s)` on a fresh iterator over the same pipeline, the
    elements are exactly those the iterator that produced `s` would have
    yielded next. `set_state` raises a `CkptIterError` and leaves the iterator
    untouched when the state is malformed, from a newer version, or was written
    by a pipeline with other defining fields -- except a change that keeps the
    stream (more or fewer epochs, a slice end, a batch size at a batch
    boundary; `_drift.reconcile`, "Same stream" in
    https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/guarantees.md), which
    resumes at the same element and logs one line per change on the
    "ckpt_iter" logger. A MapDataset pipeline defined as before whose element
    before the saved position is no longer the one saved raises
    ContentDriftError (`check_content`). A `make_dataset` pipeline under
    `mp_prefetch` also resumes with another worker count, at the next element in the same order
    (`_workers.resume_workers`); other pipelines need the saved count. After a
    restore of a pipeline with worker processes (`mp_prefetch`), prefetching
    starts at once (google/grain#1211).
  """

  def __init__(
      self,
      dataset: grain.MapDataset | grain.IterDataset,
      *,
      read_options: grain.ReadOptions | None = None,
      allow_drift: Collection[str] = (),
      check_content: bool = True,
  ):
    if isinstance(dataset, grain.MapDataset):
      self._length: int | None = len(dataset)
      self._iter_dataset = dataset.to_iter_dataset(read_options or DEFAULT_READ_OPTIONS)
    elif isinstance(dataset, grain.IterDataset):
      if read_options is not None:
        raise errors.InvalidArgumentError(
            "read_options applies to a MapDataset only; this is an IterDataset "
            "whose reading was configured when it was built."
        )
      self._length = None
      self._iter_dataset = dataset
    elif isinstance(dataset, grain.DataLoader):
      raise errors.InvalidArgumentError(
          "DataIterator iterates datasets; for a grain.DataLoader use "
          "ckpt_iter.DataLoaderIterator(loader), which has the same state, "
          "checkpoint item and drift checks."
      )
    else:
      raise errors.InvalidArgumentError(
          f"DataIterator needs a grain.MapDataset or grain.IterDataset, got "
          f"{type(dataset).__qualname__}. Build one with ckpt_iter.make_dataset(...) "
          "or grain.MapDataset.source(...)."
      )
    self._dataset = dataset
    nodes = _global_batch.pipeline_nodes(dataset)
    self._spec = nodes.spec
    # make_dataset's node when the position can count its stream records.
    self._records = nodes.record_node
    # The same node when it is the pipeline itself: a state then records its last batch by the batch's last row.
    self._rows = self._records if self._records is dataset else None
    # make_dataset's node anywhere on the chain: it owns the run's skips (`skips_lib.Skips`).
    self._spec_node = nodes.spec_node
    self._fingerprint = nodes.fingerprint
    # Before any iterator takes the workers' init function.
    if self._has_workers and not _workers.exit_workers_with_parent(self._iter_dataset):
      _drift.LOGGER.warning(_workers.WORKERS_NOT_WATCHED)
    self._inner = self._new_inner()
    super().__init__(self._inner)
    self._allow_drift = frozenset(allow_drift)
    self._check_content = bool(check_content)
    self._records_last = self._length is not None and self._check_content
    # The element produced last (its dict copied: a consumer adding keys does
    # not change it), digested only when a state is taken.
    self._last: Any = _NOTHING
    self._digested: tuple[Any, Any] = (_NOTHING, None)
    self._restored_content: Any = None
    self._lineage: Any = None
    # What the last restore's content check found (its log line says it).
    self.restored_content_check: str | None = None

  @property
  def dataset(self) -> grain.MapDataset | grain.IterDataset:
    """The Grain dataset this iterator reads."""
    return self._dataset

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The defining fields of this pipeline, as stored in its state."""
    return dict(self._fingerprint)

  @property
  def spec(self) -> _global_batch.DatasetSpec | None:
    """The make_dataset spec of the pipeline, if it was built by make_dataset."""
    return self._spec

  def __next__(self) -> Any:
    element = next(self._inner)
    if self._records_last:
      self._last = dict(element) if type(element) is dict else element
    return element

  def skip(self, count: int) -> None:
    """Deprecated (too like `ckpt_iter.Skip`, which declares records to skip): `advance(count)`."""
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.warn("DataIterator.skip(count) is renamed advance(count) (too like ckpt_iter.Skip); the old name "
                  "goes in 0.4.0.", DeprecationWarning, stacklevel=2)
    self.advance(count)

  def advance(self, count: int) -> None:
    """Moves past the next `count` elements of a MapDataset pipeline in O(1) (indices, not produced).

    For a caller that must pass over elements it knows were consumed (a
    legacy resume). An IterDataset pipeline raises UnsupportedConfigError:
    its elements can only be passed by reading them.
    """
    if self._length is None:
      raise errors.UnsupportedConfigError(
          f"{self}: advance() needs a MapDataset pipeline; an IterDataset's elements can only be read past.")
    next_index = self._inner.get_state()["next_index"]
    self._inner.set_state({"next_index": min(next_index + int(count), self._length)})
    self._last = _NOTHING  # what was read before the new position is not known
    self._restored_content = {"check": _CONTENT_SKIPPED} if self._records_last else None

  def position(self) -> Any:
    """The position of the next unread element, as a state holds it.

    For a make_dataset pipeline (with only per-batch maps after it), the
    stream record the next batch starts at (`{"next_record": R}`, and a
    mixture's ledger); otherwise Grain's own iterator state.
    """
    grain_position = self._inner.get_state()
    if self._records is not None:
      return self._records.cursor.position(grain_position["next_index"])
    # Through JSON and back: the state holds what a checkpoint would.
    return codec.position_from_json(codec.position_to_json(grain_position))

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value."""
    return state_lib.IteratorState(
        kind="data",
        fingerprint=self._fingerprint,
        position=self.position(),
        content=self.content(),
        lineage=self._lineage,
    )

  def state_dict(self) -> dict[str, Any]:
    """`get_state()` under the name torch and Hugging Face use: the state as a plain dict.

    Save it with the model as you save a `state_dict()` (it is JSON-able; a
    checkpoint item is better: `ckpt_iter.IteratorSave(iterator)` writes it
    in the model's Orbax step). Restore with `load_state_dict`.
    """
    return self.get_state()

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """`set_state(state)` under the name torch and Hugging Face use.

    Checks `state` as `set_state` does before anything changes (another
    pipeline raises `ConfigDriftError` naming the field), then continues the
    stream exactly where `state_dict()` was taken.
    """
    self.set_state(state)

  def content(self) -> dict[str, Any] | None:
    """The content record a state taken now holds (`content_of` the last element)."""
    if not self._records_last:
      return self.content_of(None)
    if self._last is _NOTHING:
      return self._restored_content  # nothing produced since the restore
    if self._digested[0] is not self._last:
      self._digested = (self._last, self.content_of(self._last))
    return self._digested[1]

  def content_of(self, element: Any) -> dict[str, Any]:
    """The content record of a state taken right after this iterator produced `element`.

    For a reader that keeps the elements it consumed: a Tunix learner reads
    ahead of what it trained, so its checkpoint records an earlier element.
    """
    if self._length is None:
      return {"check": _drift.ITER_DATASET}
    if not self._check_content:
      return {"check": _CONTENT_OFF}
    if self._rows is not None and element is not None:
      record = _drift.row_record(element)
      if record is not None:
        return record
    return _drift.content_digest(element)

  def check_restore(
      self,
      state: state_lib.IteratorState,
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> Callable[[], None]:
    """The check half of `state_lib.Restorable`: validates, mutates nothing.

    Returns:
      The apply half: moves this iterator to the state's position and cannot
      fail.
    """
    # A state's skip ranges decode into many small objects (`state_lib.collection_paused`).
    with state_lib.collection_paused():
      apply = self._checked_restore(state, allow_drift=allow_drift, origin=origin)

    def apply_paused() -> None:
      with state_lib.collection_paused():
        apply()

    return apply_paused

  def _checked_restore(self, state: state_lib.IteratorState, *, allow_drift: Collection[str],
                       origin: str) -> Callable[[], None]:
    state_lib.check_kind(state, "data", "DataIterator", origin)
    # The run's skips are no defining field: a restore keeps the saved ones and adds the declared (`skips_lib.Skips`).
    # The stream fields first, by the one check `ckpt-iter verify` also asks (`_records.check_stream_fields`).
    saved_skips = _records.check_stream_fields(state.fingerprint, state.position, origin=origin)
    if skips_lib.SKIPS_FIELD in state.fingerprint:
      state = _without_skips(state)
    if saved_skips and self._spec_node is None:
      raise errors.InvalidStateError(
          f"{origin}: the state skips {saved_skips.describe()}, but this pipeline has no ckpt_iter.make_dataset "
          "node to skip them: restore it into the make_dataset pipeline that wrote it.")
    return self._check_restore_fields(state, allow_drift, origin, saved_skips)

  def _check_restore_fields(
      self, state: state_lib.IteratorState, allow_drift: Collection[str], origin: str, saved_skips: skips_lib.Skips,
  ) -> Callable[[], None]:
    """`check_restore` of a state without skips against this pipeline's fingerprint without them."""
    current = self._fingerprint_without_skips
    allowed = self._allow_drift | frozenset(allow_drift)
    # Content names accept the content check's refusal; they are no fingerprint field.
    content_allowed = {name for name in allowed if name == "content" or name.startswith("content.")}
    allowed -= content_allowed
    # Declared changes of a mixture (`_drift.WEIGHTS`, `_drift.SOURCES`): no fingerprint field either. Nor are
    # the shard lanes' fields where neither side has lanes (shard_lanes=1, what shard_lanes=jax.process_count()
    # gives on one host): a launch script that always declares the global batch's change runs there too.
    declared = allowed & _DECLARED_CHANGES
    declared |= {name for name in allowed & _LANE_FIELDS if name not in state.fingerprint and name not in current}
    # Before the general check, and whatever allow_drift says: another
    # mp_prefetch worker count is translated to this one, or refused with the
    # reason (_workers.resume_workers, docs/guarantees.md "Worker processes").
    # Only where a worker count is saved or set: no other restore enters the rule.
    workers = (_workers.resume_workers(state.fingerprint, current, state.position, self._dataset, origin=origin)
               if self._has_workers or _graph.has_workers(state.fingerprint)
               else _workers.WorkerResume(position=dict(state.position)))
    allowed |= workers.accepted
    if allowed & elastic.ELASTIC_FIELDS:
      self._check_elastic(state.fingerprint, allowed, origin)
    # Stream-preserving changes (docs/guarantees.md, "Same stream") are
    # accepted and may move the position; every other difference is refused.
    resume = _drift.reconcile(
        state.fingerprint, current, workers.position,
        allow_drift=allowed, origin=origin, parent_length=self._parent_length,
    )
    state_lib.check_fingerprint(
        state.fingerprint, current, allow_drift=(allowed - declared) | resume.accepted, origin=origin
    )
    position = resume.position
    if self._records is not None:
      return self._check_record_position(state, position, resume, content_allowed, origin, saved_skips)
    skips = _global_batch.merged_skips(self._spec_node, saved_skips, None, position, origin)
    if self._length is not None:
      next_index = position.get("next_index")
      if (
          set(position) != {"next_index"}
          or isinstance(next_index, bool)
          or not isinstance(next_index, numbers.Integral)
          or not 0 <= next_index <= self._length
      ):
        raise errors.InvalidStateError(
            f"{origin}: field 'position' is {_short(position)}; this pipeline's "
            f"position is {{'next_index': 0..{self._length}}}."
        )
      changed = position != state.position or bool(state_lib.differing_fields(state.fingerprint, current))
      content_check = self._unchecked_content(state, content_allowed, changed)
      if content_check is None and skips.added:
        content_check = _CONTENT_SKIPS_ADDED
      elif content_check is None:
        with self._spec_node_skipping(skips.effective):
          content_check = self._check_same_content(state.content, next_index, origin)

      def apply() -> None:
        self._apply_skips(skips)
        self._inner.set_state(position)
        self._adopt(state, content_carried=not changed)
        self.restored_content_check = content_check
        resume.log()

      return apply
    # An IterDataset position can only be validated by setting it: on a fresh
    # inner iterator, which then replaces the current one.
    fresh = self._new_inner()
    try:
      fresh.set_state(position)
    except Exception as e:  # Grain raises many types for a bad state.
      fresh.close()
      raise errors.InvalidStateError(
          f"{origin}: field 'position' {_short(position)} does not fit this "
          f"pipeline ({type(e).__name__}: {e})."
      ) from None

    def apply_fresh() -> None:
      self._apply_skips(skips)
      self._replace_inner(fresh)
      self._adopt(state)
      self.restored_content_check = "not applicable (no random access to the element before)"
      for line in workers.changes:
        _drift.LOGGER.info(line)
      resume.log()
      if self._has_workers:
        self._start_prefetch()

    return apply_fresh

  def _check_record_position(
      self, state: state_lib.IteratorState, position: Mapping[str, Any], resume: _drift.Reconciled,
      content_allowed: Collection[str], origin: str, saved_skips: skips_lib.Skips,
  ) -> Callable[[], None]:
    """The rest of `check_restore` for a position that counts stream records: make_dataset's own
    restore (`GlobalBatchDataset.check_record_restore`), given this iterator's content check."""
    node = self._records
    # Another batch plan or process count: the saved content describes no element of this pipeline.
    changed = bool(resume.changes or state_lib.differing_fields(state.fingerprint, self._fingerprint_without_skips))
    unchecked = self._unchecked_content(state, content_allowed, changed)
    restore = node.check_record_restore(
        position, saved_skips, bare=not state.fingerprint, origin=origin,
        differences=state_lib.differing_fields(state.fingerprint, self._fingerprint),
        check_element=None if unchecked else lambda index: self._check_same_content(state.content, index, origin))
    content_check = unchecked or restore.content_check

    def apply() -> None:
      self._apply_skips(restore.skips)
      node.restart_at(restore)
      # Grain's MapDataset iterator keeps the length it started with: a new one sees the plan's.
      self._length = len(self._dataset)
      fresh = self._new_inner()
      fresh.set_state({"next_index": restore.next_index})
      self._replace_inner(fresh)
      self._adopt(state, content_carried=not changed)
      self.restored_content_check = content_check
      resume.log()

    return apply

  def _unchecked_content(self, state: state_lib.IteratorState, content_allowed: Collection[str],
                         changed: bool) -> str | None:
    """Why a restore checks none of the content (its log line says so), or None when it checks."""
    if state.content is None:
      return "none recorded"
    if not self._check_content:
      return "off (check_content=False)"
    if content_allowed:
      return "not checked (allow_drift names the content)"
    if changed:
      return "not applicable (the pipeline changed; the stream was checked instead)"
    return None

  # -- skips

  @property
  def _fingerprint_without_skips(self) -> dict[str, Any]:
    return {k: v for k, v in self._fingerprint.items() if k != skips_lib.SKIPS_FIELD}

  def _apply_skips(self, change: _global_batch.SkipChange) -> None:
    """The apply half of the skips: the node skips them, the states carry them, the log says what changed."""
    if self._spec_node is None:
      return
    text = _global_batch.apply_skips(self._spec_node, change)
    self._fingerprint = self._fingerprint_without_skips
    if text is not None:
      self._fingerprint[skips_lib.SKIPS_FIELD] = text

  @contextlib.contextmanager
  def _spec_node_skipping(self, skips: skips_lib.Skips) -> Any:
    """The make_dataset node skips `skips` for the duration (a restore's content check)."""
    node = self._spec_node
    if node is None:
      yield
      return
    before = node.skips
    node.set_skips(skips)
    try:
      yield
    finally:
      node.set_skips(before)

  def _check_same_content(self, saved: Any, next_index: int, origin: str) -> str:
    """Produces the element before `next_index` again and compares it with the saved digest.

    Only for a pipeline defined exactly as the saved one, at the saved
    position: then that element must be the one the checkpoint saw. Costs
    one element's production, or one record's where the state recorded the
    batch's last row (`_drift.BY_ROW`). Elements a filter dropped (None) are
    skipped, at most `_CONTENT_LOOKBACK` of them.

    Returns:
      What was checked, for the restore's log line.
    """
    compared = self._compared(saved)
    if isinstance(compared, str):
      return compared
    produce, difference_of = compared
    for index in range(next_index - 1, max(-1, next_index - 1 - _CONTENT_LOOKBACK), -1):
      element = produce(index)
      if element is not None:
        break
    else:
      return "not applicable (no element before the position)"
    difference, unchecked = difference_of(saved, element)
    if unchecked is not None:
      return unchecked
    if difference is not None:
      raise errors.ContentDriftError(*difference, index=index, origin=origin,
                                     recorded_at=self._element_recorded_near(saved, index))
    return f"same element at index {index}" + (" (its last row)" if saved.get("check") == _drift.BY_ROW else "")

  def _compared(self, saved: Any) -> tuple[Callable[[int], Any], Callable[..., Any]] | str:
    """How the saved content record is checked: (what produces element i again, what compares it), or why not."""
    check = saved.get("check")
    if check == _drift.BY_ROW:
      if self._rows is None:
        return "not applicable (a batch's last row was recorded; this pipeline is more than make_dataset's)"
      return self._rows.last_row, _drift.row_difference
    if check != _drift.BY_INDEX:
      # The saving pipeline could not record it, or had the check off.
      return f"not recorded ({check})"
    return self._dataset.__getitem__, _drift.content_difference

  def _element_recorded_near(self, saved: Any, index: int) -> int | None:
    """The element within `_POSITION_SEARCH` of `index` that the content record `saved` describes, or None.

    Only when the content check failed: an element near the position that
    is the recorded one says the position moved, not the data.
    """
    produce, difference_of = self._compared(saved)
    length = len(self._dataset)
    for distance in range(1, _POSITION_SEARCH + 1):
      for candidate in (index - distance, index + distance):
        if 0 <= candidate < length:
          element = produce(candidate)
          if element is not None and difference_of(saved, element) == (None, None):
            return candidate
    return None

  def _adopt(self, state: state_lib.IteratorState, *, content_carried: bool = True) -> None:
    """Carries the restored state's content record and lineage on.

    A restore into a changed pipeline (another batch size or process count,
    a moved position) carries no content record: the element it describes
    is no element of this pipeline, and a later restore of a state saved
    before any batch is read would check this pipeline against it.
    """
    self._last = _NOTHING
    self._digested = (_NOTHING, None)
    restored = state.content if content_carried else {"check": _CONTENT_RECUT}
    self._restored_content = restored if self._records_last else None
    self._lineage = state.lineage

  @property
  def _has_workers(self) -> bool:
    return _graph.has_workers(self._fingerprint)

  def _start_prefetch(self) -> None:
    """Starts the worker processes now, not at the first next() (google/grain#1211).

    A restore replaces the inner iterator, whose workers Grain starts only
    at the first `next()`; starting them here overlaps their start-up with
    the rest of the restore (the model). It is an optimisation: if Grain
    cannot start them now, the first `next()` does, and raises there.
    """
    start = getattr(self._inner, "start_prefetch", None)
    if start is None:
      return
    try:
      start()
    except Exception as e:  # pylint: disable=broad-except
      _drift.LOGGER.warning("could not start prefetch after the restore: %s: %s", type(e).__name__, e)

  def _new_inner(self) -> Any:
    """A new iterator over the pipeline, independent of the current one."""
    dataset = self._iter_dataset
    if type(dataset).__name__ == "ElasticIterator":
      # Grain's ElasticIterator hands out one cached iterator from every
      # __iter__ call; a shallow copy without the cache makes a new one.
      dataset = copy.copy(dataset)
      vars(dataset).pop("_default_iterator", None)
    return dataset.__iter__()

  def _parent_length(self, node_index: int) -> int | None:
    """Length of the input of this pipeline's node[node_index], if it has one."""
    try:
      parents = _graph.walk_nodes(self._dataset)[node_index].parents
      return len(parents[0]) if len(parents) == 1 else None
    except Exception:  # pylint: disable=broad-except  (an IterDataset has no length)
      return None

  def _check_elastic(self, fingerprint: Mapping[str, Any], allowed: frozenset[str], origin: str) -> None:
    reason = elastic.resize_refusal("data", self._fingerprint)
    if reason is not None:
      raise errors.UnsupportedConfigError(
          f"{origin}: elastic resume (allow_drift of "
          f"{sorted(allowed & elastic.ELASTIC_FIELDS)}) {reason} Resume with the "
          "same shard_count."
      )
    # Only Grain's ElasticIterator counts its position in global batches of a fixed size.
    if (fingerprint.get(_global_batch.POSITION_SCOPE_FIELD) == "global"
        and fingerprint.get("global_batch_size") != self._fingerprint.get("global_batch_size")):
      saved = fingerprint.get("global_batch_size")
      here = self._fingerprint.get("global_batch_size")
      raise errors.ConfigDriftError(
          {"global_batch_size": (saved, here)},
          origin=f"{origin} (elastic resume keeps the global batch: "
          f"choose batch_size = {saved} // shard_count)",
      )

  def _replace_inner(self, new_inner: Any) -> None:
    old, self._inner = self._inner, new_inner
    self._parents = (new_inner,)
    old.close()  # its threads or worker processes would otherwise leak

  def close(self) -> None:
    """Closes the inner Grain iterator: its prefetch threads and worker processes stop."""
    # Also runs from __del__ when __init__ raised before _inner existed.
    inner = getattr(self, "_inner", None)
    if inner is not None:
      inner.close()

  def __str__(self) -> str:
    return f"DataIterator({self._dataset})"


_short = state_lib.short_repr
_NOTHING = object()
_CONTENT_OFF = "off: check_content=False"
_CONTENT_SKIPPED = "unavailable: elements skipped, none read since"
_CONTENT_RECUT = "unavailable: restored into a changed pipeline (batches, processes), no batch read since"
_DECLARED_CHANGES = frozenset({_drift.WEIGHTS, _drift.SOURCES})
_LANE_FIELDS = frozenset({_permutation.LANES_FIELD, _permutation.LANE_ROWS_FIELD})
_CONTENT_SKIPS_ADDED = "not applicable (skips added at this restore)"


def _without_skips(state: state_lib.IteratorState) -> state_lib.IteratorState:
  fingerprint = {k: v for k, v in state.fingerprint.items() if k != skips_lib.SKIPS_FIELD}
  return dataclasses.replace(state, fingerprint=fingerprint)


_CONTENT_LOOKBACK = 64
_POSITION_SEARCH = 16  # elements either side a failed content check looks through for the recorded one


class GrainIteratorView:
  """A plain Grain iterator (`iter(dataset)`, what a Grain user writes) as ckpt_iter saves and restores it.

  Its state is Grain's own position with the fingerprint of the dataset it
  reads (`dataset.describe_grain_iterator`), so a restore into a pipeline
  with another seed or source is refused by name, as a `DataIterator`'s is.
  States without that field keep Grain's rules (`_item.check_restore_into`):
  a bare Grain state is restored unchecked, a ckpt_iter iterator's refused.
  """

  def __init__(self, iterator: Any, fingerprint: Mapping[str, Any]):
    self._iterator = iterator
    self._fingerprint = dict(fingerprint)

  def state(self) -> state_lib.IteratorState:
    return state_lib.IteratorState(kind="data", fingerprint=self._fingerprint,
                                   position=item_lib.grain_state_dict(self._iterator.get_state()))

  def check_restore(self, value: state_lib.IteratorState, *, allow_drift: Collection[str] = (),
                    origin: str = "the checkpoint") -> Callable[[], None]:
    if _global_batch.GRAIN_ITERATOR_FIELD not in value.fingerprint:
      return item_lib.check_restore_into(self._iterator, value, allow_drift=allow_drift, origin=origin)
    state_lib.check_fingerprint(value.fingerprint, self._fingerprint, allow_drift=allow_drift, origin=origin)
    return lambda: self._iterator.set_state(dict(value.position))


def grain_iterator_view(item: Any) -> Any:
  """`item` as ckpt_iter saves and restores it: a plain Grain iterator whose dataset is known as a
  `GrainIteratorView`, anything else unchanged."""
  if isinstance(item, grain.DatasetIterator) and not hasattr(item, "check_restore"):
    fingerprint = _global_batch.describe_grain_iterator(item)
    if fingerprint is not None:
      return GrainIteratorView(item, fingerprint)
  return item
