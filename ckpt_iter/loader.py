"""DataLoaderIterator: a `grain.DataLoader`'s iterator with ckpt_iter's state.

Tunix examples and many MaxText configs iterate a `grain.DataLoader`, whose
iterator's `get_state` returns JSON *bytes* (Grain's own format). This sibling
of `DataIterator` follows the same protocol (`state()`, `get_state` /
`set_state`, `state.Restorable`), so `IteratorSave` / `IteratorRestore` save
and restore it, and it refuses a state written by another loader naming the
field (`_graph.describe_loader`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Collection, Mapping

import grain

from ckpt_iter import _codec as codec
from ckpt_iter import _graph
from ckpt_iter import _workers
from ckpt_iter import _item as item_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib


class DataLoaderIterator(item_lib.V1Checkpointable, state_lib.RestorableIterator):
  """Iterates a `grain.DataLoader` with a checkpointable, fingerprinted state.

  Args:
    loader: the `grain.DataLoader`.
    allow_drift: fingerprint fields a restored state may differ in.

  Guarantees:
    After `set_state(s)` (or an `IteratorRestore`) on an iterator over the
    same loader definition, the batches are exactly those the iterator that
    produced `s` would have yielded next: Grain's DataLoader position is
    per-record (`last_seen_indices`), so the restore is O(1) in the position.
    A state from a loader with another source, sampler (seed, shuffle,
    epochs, sharding), operation or worker count raises `ConfigDriftError`
    naming the field and leaves the iterator untouched. `set_state` also
    takes the bytes of Grain's own `DataLoaderIterator.get_state()` (no
    fingerprint: not checked).
  """

  def __init__(self, loader: grain.DataLoader, *, allow_drift: Collection[str] = ()):
    if not isinstance(loader, grain.DataLoader):
      raise errors.InvalidArgumentError(
          f"DataLoaderIterator needs a grain.DataLoader, got {type(loader).__qualname__}; "
          "for a grain.MapDataset or IterDataset use ckpt_iter.DataIterator."
      )
    self._loader = loader
    self._fingerprint = _graph.describe_loader(loader)
    self._allow_drift = frozenset(allow_drift)
    # Before any iterator takes the workers' init function.
    if self._fingerprint["loader.worker_count"] > 0 and not _workers.exit_loader_workers_with_parent(loader):
      logging.getLogger("ckpt_iter").warning(_workers.WORKERS_NOT_WATCHED)
    self._inner = iter(loader)

  @property
  def loader(self) -> grain.DataLoader:
    """The `grain.DataLoader` this iterator reads."""
    return self._loader

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The defining fields of this loader, as stored in its state."""
    return dict(self._fingerprint)

  def __iter__(self) -> "DataLoaderIterator":
    return self

  def __next__(self) -> Any:
    return next(self._inner)

  def start_prefetch(self) -> None:
    """Grain's `start_prefetch`: start producing batches in the background."""
    self._inner.start_prefetch()

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value; the position is Grain's own state."""
    position = json.loads(self._inner.get_state().decode())
    return state_lib.IteratorState(
        kind="data",
        fingerprint=self._fingerprint,
        position=codec.position_from_json(codec.position_to_json(position)),
        # A DataLoader is read through worker processes, in its sampler's order:
        # an element cannot be produced again by index here.
        content={"check": _NO_CONTENT_CHECK},
        lineage=self._lineage,
    )

  def set_state(self, state: Mapping[str, Any] | bytes) -> None:
    """Restores a state: `get_state()`'s dict, or the bytes of Grain's own `DataLoaderIterator.get_state()`."""
    if isinstance(state, (bytes, bytearray)):
      try:
        state = json.loads(bytes(state).decode())
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise errors.InvalidStateError(
            f"the state is bytes but not Grain's JSON DataLoader state ({e})."
        ) from None
    self.restore_state(state_lib.IteratorState.from_dict(state))

  def check_restore(
      self,
      state: state_lib.IteratorState,
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> Callable[[], None]:
    """The check half of `state_lib.Restorable`: validates, mutates nothing."""
    state_lib.check_kind(state, "data", "DataLoaderIterator", origin)
    if state.fingerprint and "loader" not in state.fingerprint:
      raise errors.InvalidStateError(
          f"{origin} was written by a DataIterator over a Grain dataset, not by a "
          "grain.DataLoader; restore it into ckpt_iter.DataIterator over that dataset."
      )
    allowed = self._allow_drift | frozenset(allow_drift)
    state_lib.check_fingerprint(
        state.fingerprint, self._fingerprint, allow_drift=allowed, origin=origin
    )
    # Grain validates (worker count, sampler and source reprs) and sets the
    # position in one call: do it on a fresh iterator, which replaces ours.
    fresh = iter(self._loader)
    try:
      fresh.set_state(json.dumps(dict(state.position)).encode())
    except Exception as e:  # Grain raises ValueError, KeyError, TypeError ...
      _close(fresh)
      raise errors.InvalidStateError(
          f"{origin}: field 'position' {state_lib.short_repr(dict(state.position))} "
          f"does not fit this DataLoader ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
      ) from None

    def apply() -> None:
      old, self._inner = self._inner, fresh
      self._lineage = state.lineage
      _close(old)

    return apply

  def close(self) -> None:
    """Closes the inner Grain DataLoader iterator: its prefetch threads and worker processes stop."""
    _close(getattr(self, "_inner", None))

  def __str__(self) -> str:
    return f"DataLoaderIterator({self._fingerprint.get('loader.sampler')})"


_NO_CONTENT_CHECK = "unavailable: a grain.DataLoader cannot produce an element again"


def _close(iterator: Any) -> None:
  """Closes a Grain DataLoaderIterator's pipeline (its threads or worker processes)."""
  inner = getattr(iterator, "_iterator", None)
  close = getattr(inner, "close", None)
  if close is not None:
    close()
