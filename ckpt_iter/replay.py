"""ReplayIterator: any iterable, its position restored by reading it again.

An input that is not a Grain dataset (a list of batch dicts, a generator)
has no position to jump to: the only way back to element N is to read the
first N again. A ReplayIterator counts what it yielded and records the
content record of the last element (`_drift.content_digest`, a CRC per leaf,
as the content check of a Grain pipeline does), so a restore replays N
elements and refuses the stream when element N-1 differs, naming the first
leaf that does: it is not the saved one. It is the input of a Tunix learner
given a plain iterable; a Grain dataset (`make_dataset`, `DataIterator`)
restores in O(1) instead.

The state is kind "data": fingerprint `{"source": "iterable:<type>"}`,
position `{"full_batches_read": N, "last_batch": <content record>}` (the
count's name is the first Tunix learners'; an element is a full batch
there). A state of ckpt_iter 0.2.0 holds `last_batch_digest` instead, which
is checked with the digest 0.2.0 took (`_drift.legacy_batch_digest`).
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any, Callable, Collection, Iterable, Mapping

from ckpt_iter import _drift
from ckpt_iter import errors
from ckpt_iter import state as state_lib

_LOG = logging.getLogger("ckpt_iter")
COUNT_FIELD = "full_batches_read"
# The content record of the last element read, and the field ckpt_iter 0.2.0 held
# `_drift.legacy_batch_digest` of it in instead (read, never written).
LAST_FIELD = "last_batch"
LEGACY_LAST_FIELD = "last_batch_digest"
_POSITION_FIELDS = frozenset({COUNT_FIELD, LAST_FIELD, LEGACY_LAST_FIELD})


def refuses_stream(differences: Mapping[str, Any]) -> bool:
  """Whether a `ConfigDriftError`'s differences are a replay's: the iterable is not the saved stream."""
  return any(name in _POSITION_FIELDS or name.startswith(f"{LAST_FIELD}.") for name in differences)


class ReplayIterator(state_lib.RestorableIterator):
  """Iterates `iterable`; a restore replays it to the saved count.

  A re-iterable (a list) is replayed on a fresh iterator, so a refused
  restore changes nothing. A generator cannot be read twice and is not
  buffered (that would hold O(position) elements): the replay reads it, and
  after a refusal it raises on use rather than yield from the wrong place.
  """

  def __init__(self, iterable: Iterable[Any]):
    self._iterable = iterable
    self._iterator = iter(iterable)
    # A generator is its own iterator: it cannot be read again from the start.
    self._one_shot = self._iterator is iterable
    self._read = 0
    self._last_record: Mapping[str, Any] | None = None
    self._lookahead: collections.deque[Any] = collections.deque()
    self._warned = False
    self._spent = False  # a generator read by a refused restore

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The iterable's type: all a restore can check of a plain iterable."""
    return {"source": f"iterable:{type(self._iterable).__qualname__}"}

  def position(self) -> dict[str, Any]:
    """How many elements were read, and the content record of the last one (a restore checks the element it
    replays to)."""
    position: dict[str, Any] = {COUNT_FIELD: self._read}
    if self._last_record is not None:
      position[LAST_FIELD] = self._last_record
    return position

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value."""
    return state_lib.IteratorState(
        kind="data", fingerprint=self.fingerprint, position=self.position(), lineage=self._lineage)

  def check_restore(
      self, state: state_lib.IteratorState, *, allow_drift: Collection[str] = (), origin: str = "the state"
  ) -> Callable[[], None]:
    """Validates `state` and replays to its position; the returned step applies it.

    Raises:
      InvalidStateError: the state is not a replayed iterable's.
      ConfigDriftError: this iterable is not the saved stream (shorter, or
        another element where the saved run read its last).
    """
    state_lib.check_kind(state, "data", "ReplayIterator", origin)
    checked = self._check(state.fingerprint, state.position, allow_drift=allow_drift, origin=origin)

    def apply() -> None:
      self._apply(checked)
      self._lineage = state.lineage

    return apply

  def skip(self, count: int) -> None:
    """Deprecated (too like `ckpt_iter.Skip`, which declares records to skip): `advance(count)`."""
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.warn("ReplayIterator.skip(count) is renamed advance(count) (too like ckpt_iter.Skip); the old name "
                  "goes in 0.4.0.", DeprecationWarning, stacklevel=2)
    self.advance(count)

  def advance(self, count: int) -> None:
    """Moves past the first `count` elements (a replay), as a stock resume's `next()` loop does."""
    self._apply(self._check(self.fingerprint, {COUNT_FIELD: count}, allow_drift=(), origin="the input"))

  def __iter__(self) -> "ReplayIterator":
    return self

  def __next__(self) -> Any:
    self._check_not_spent()
    element = self._lookahead.popleft() if self._lookahead else next(self._iterator)
    self._read += 1
    # Digested when read: the consumer may change the element afterwards.
    self._last_record = _drift.content_digest(element)
    return element

  def peek(self) -> Any:
    """The next element, left to be yielded."""
    self._check_not_spent()
    if not self._lookahead:
      self._lookahead.append(next(self._iterator))
    return self._lookahead[0]

  def _check(self, fingerprint: Any, position: Any, *, allow_drift: Collection[str], origin: str) -> Any:
    state_lib.check_fingerprint(fingerprint, self.fingerprint, allow_drift=allow_drift, origin=origin)
    count = position.get(COUNT_FIELD) if isinstance(position, Mapping) else None
    legacy = position.get(LEGACY_LAST_FIELD) if isinstance(position, Mapping) else None
    if (
        not isinstance(position, Mapping)
        or COUNT_FIELD not in position or not set(position) <= _POSITION_FIELDS
        or not state_lib.is_int(count) or count < 0
        or not (legacy is None or isinstance(legacy, str))
    ):
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {state_lib.short_repr(position)}; an iterable's position is "
          f"{{'{COUNT_FIELD}': N[, '{LAST_FIELD}': {{<content record>}}]}}."
      )
    saved_last = position.get(LAST_FIELD)
    if saved_last is not None:
      saved_last = state_lib.checked_content_record(saved_last, f"position.{LAST_FIELD}", origin)
    if self._read:
      raise errors.CkptIterError(
          f"cannot move an iterable input that already yielded {self._read} elements; "
          "positions are restored before iterating."
      )
    if count and not self._warned:
      _LOG.warning(
          "ckpt_iter: the input is a plain iterable, so its position is restored by "
          "replaying %d elements. Pass a Grain dataset (ckpt_iter.make_dataset), or read a "
          "stream that has state_dict() with ckpt_iter.StreamingIterator, to restore in O(1).", count,
      )
      self._warned = True
    if count == 0:
      return None, 0, None
    fresh = None
    if self._one_shot:
      # Replayed here, keeping only the last element (O(1) memory). A refused
      # restore leaves the generator read, and says so.
      available, last = 0, None
      while available < count:
        try:
          last = self._lookahead.popleft() if self._lookahead else next(self._iterator)
        except StopIteration:
          break
        available += 1
    else:
      fresh = iter(self._iterable)
      available, last = 0, None
      for element in itertools.islice(fresh, count):
        available, last = available + 1, element
    try:
      if available < count:
        error = errors.ConfigDriftError({COUNT_FIELD: (count, available)}, origin=origin)
        error.args = (
            f"{origin} was written after reading {count} elements of a plain iterable; this "
            f"iterable has only {available}, so it is not the stream the checkpoint's run read. "
            "Pass the same data in the same order.",
        )
        raise error
      _check_replayed(saved_last, legacy, last, count, origin)
    except errors.ConfigDriftError as refused:
      if self._one_shot:
        self._spent = True
        refused.args = (f"{refused.args[0]} (This generator was read by the replay: pass a new one.)",)
      raise
    return fresh, count, _drift.content_digest(last)

  def _apply(self, checked: Any) -> None:
    fresh, count, record = checked
    if fresh is not None:
      self._iterator = fresh
      self._lookahead.clear()
    self._read = count
    self._last_record = record

  def _check_not_spent(self) -> None:
    if self._spent:
      raise errors.CkptIterError(
          "this generator input was read by a refused restore, so it no longer starts "
          "where its position says; pass a new generator (or a Grain dataset)."
      )


def _check_replayed(saved: Mapping[str, Any] | None, legacy: str | None, last: Any, count: int, origin: str) -> None:
  """Checks that a replay of `count` elements ended with the element the saving run read last.

  `saved`: the state's content record of it (`LAST_FIELD`); `legacy`: the
  digest a state of ckpt_iter 0.2.0 holds instead; neither in a state that
  predates both (then nothing is checked).

  Raises:
    ConfigDriftError: naming the field that differs: this iterable yields another stream.
  """
  if count == 0:
    return
  if saved is not None:
    difference, _ = _drift.content_difference(saved, last)
    if difference is None:
      return
    leaf, before, after = difference
    field = f"{LAST_FIELD}.{leaf}"
  elif legacy is not None:
    before, after = legacy, _drift.legacy_batch_digest(last)
    if before == after:
      return
    field = LEGACY_LAST_FIELD
  else:
    return
  error = errors.ConfigDriftError({field: (before, after)}, origin=origin)
  error.args = (
      f"{origin} was written after reading {count} batches of a plain iterable; replaying this "
      f"iterable gives another batch {count - 1}: field {errors.shown_value(field)} has digest "
      f"{before} there, {after} here, so it is not the stream the checkpoint's run read. Pass the "
      "iterable the checkpoint's run read (the same batches in the same order), or a Grain dataset "
      "(ckpt_iter.make_dataset), whose fingerprint names what changed.",
  )
  raise error
