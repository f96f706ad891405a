"""DataIterator: a checkpointable iterator over a Grain dataset.

Its state is a versioned value (see `state.IteratorState`): format version,
the pipeline's fingerprint and the Grain position of the next unread element.
Restoring validates everything first and then sets the position directly:
O(1) in the position, no element is replayed.
"""

from __future__ import annotations

import numbers
from typing import Any, Collection, Mapping

import grain

from ckpt_iter import dataset as dataset_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib

# Reading in the calling thread: on small records Grain's 16 default threads
# cost more than they save on 2 cores, and make the first next() after a
# restore wait for a fresh thread pool (measured in benchmarks/).
DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class DataIterator(grain.DatasetIterator):
  """Iterates a Grain dataset; `get_state`/`set_state` follow Grain's protocol.

  Args:
    dataset: a `grain.MapDataset` (e.g. from `make_dataset`) or a
      `grain.IterDataset`.
    read_options: Grain read options for a MapDataset; defaults to reading in
      the calling thread.
    allow_drift: fingerprint fields a restored state may differ in. Use
      `ckpt_iter.ELASTIC_FIELDS` to resume with another process count.

  Guarantees:
    After `set_state(s)` on a fresh iterator over the same pipeline, the
    elements are exactly those the iterator that produced `s` would have
    yielded next. `set_state` raises a `CkptIterError` and leaves the iterator
    untouched when the state is malformed, from a newer version, or was written
    by a pipeline with other defining fields.
  """

  def __init__(
      self,
      dataset: grain.MapDataset | grain.IterDataset,
      *,
      read_options: grain.ReadOptions | None = None,
      allow_drift: Collection[str] = (),
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
    else:
      raise errors.InvalidArgumentError(
          f"DataIterator needs a grain.MapDataset or grain.IterDataset, got "
          f"{type(dataset).__qualname__}. Build one with ckpt_iter.make_dataset(...) "
          "or grain.MapDataset.source(...)."
      )
    self._dataset = dataset
    self._inner = self._iter_dataset.__iter__()
    super().__init__(self._inner)
    self._fingerprint = dataset_lib.describe_pipeline(dataset)
    self._spec, self._above_spec = dataset_lib.find_spec(dataset)
    self._allow_drift = frozenset(allow_drift)

  @property
  def dataset(self) -> grain.MapDataset | grain.IterDataset:
    return self._dataset

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The defining fields of this pipeline, as stored in its state."""
    return dict(self._fingerprint)

  @property
  def spec(self) -> dataset_lib.DatasetSpec | None:
    """The make_dataset spec of the pipeline, if it was built by make_dataset."""
    return self._spec

  def __next__(self) -> Any:
    return next(self._inner)

  def get_state(self) -> dict[str, Any]:
    return self.state().to_dict()

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value."""
    return state_lib.IteratorState(
        kind="data",
        fingerprint=self._fingerprint,
        position=state_lib.position_from_json(
            state_lib.position_to_json(self._inner.get_state())
        ),
    )

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.restore_state(state_lib.IteratorState.from_dict(state))

  def restore_state(
      self,
      state: state_lib.IteratorState,
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> None:
    """Validates `state` in full, then moves to its position in O(1)."""
    if state.kind != "data":
      raise errors.InvalidStateError(
          f"{origin} was written by a {state.kind!r} iterator; a DataIterator "
          "restores 'data' states only. Restore it into the same iterator type."
      )
    new_inner = self.check_restorable(
        state.fingerprint, state.position, allow_drift=allow_drift, origin=origin
    )
    self._apply(new_inner, state.position)

  def check_restorable(
      self,
      fingerprint: Mapping[str, Any],
      position: Mapping[str, Any],
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> Any:
    """Raises unless (fingerprint, position) can be restored; mutates nothing.

    Returns:
      A fresh inner iterator already at `position` when the position could
      only be validated by setting it (IterDataset pipelines), else None.
    """
    allowed = self._allow_drift | frozenset(allow_drift)
    if allowed & dataset_lib.ELASTIC_FIELDS:
      self._check_elastic(fingerprint, allowed, origin)
    state_lib.check_fingerprint(
        fingerprint, self._fingerprint, allow_drift=allowed, origin=origin
    )
    if self._length is not None:
      next_index = position.get("next_index") if isinstance(position, Mapping) else None
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
      return None
    fresh = self._iter_dataset.__iter__()
    try:
      fresh.set_state(dict(position))
    except Exception as e:  # Grain raises many types for a bad state.
      raise errors.InvalidStateError(
          f"{origin}: field 'position' {_short(position)} does not fit this "
          f"pipeline ({type(e).__name__}: {e})."
      ) from None
    return fresh

  def _check_elastic(self, fingerprint: Mapping[str, Any], allowed: frozenset[str], origin: str) -> None:
    if self._spec is None:
      raise errors.UnsupportedConfigError(
          f"{origin}: elastic resume (allow_drift of {sorted(allowed & dataset_lib.ELASTIC_FIELDS)}) "
          "needs a pipeline built by ckpt_iter.make_dataset, whose position is "
          "global; this pipeline's position is per process."
      )
    non_elementwise = [name for name in self._above_spec if name != "MapMapDataset"]
    if non_elementwise:
      raise errors.UnsupportedConfigError(
          f"{origin}: elastic resume is refused because the pipeline applies "
          f"{non_elementwise} after make_dataset, per process: with another "
          "process count those steps would see other rows and the data would "
          "change. Resume with the same shard_count, or move the step into "
          "make_dataset(transform=...)."
      )
    if fingerprint.get("global_batch_size") != self._fingerprint.get("global_batch_size"):
      saved = fingerprint.get("global_batch_size")
      here = self._fingerprint.get("global_batch_size")
      raise errors.ConfigDriftError(
          {"global_batch_size": (saved, here)},
          origin=f"{origin} (elastic resume keeps the global batch: "
          f"choose batch_size = {saved} // shard_count)",
      )

  def _apply(self, new_inner: Any, position: Mapping[str, Any]) -> None:
    if new_inner is None:
      self._inner.set_state(dict(position))
    else:
      self._inner = new_inner
      self._parents = (new_inner,)

  def close(self) -> None:
    # Also runs from __del__ when __init__ raised before _inner existed.
    inner = getattr(self, "_inner", None)
    if inner is not None:
      inner.close()

  def __str__(self) -> str:
    return f"DataIterator({self._dataset})"


_short = state_lib.short_repr
