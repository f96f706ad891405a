"""The learner's input, as positions a checkpoint can hold.

A Tunix learner reads full batches and, when the micro batch is smaller,
splits each into micro-batches. The position of the next unread input
micro-batch is therefore (the source position of the full batch it comes from,
how many micro-batches of it were taken). A Grain source moves to a position
in O(1); a plain iterable can only get there by replaying what was read.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

import grain

from ckpt_iter import errors
from ckpt_iter import iterator as iterator_lib

_LOG = logging.getLogger("ckpt_iter")


class GrainSource:
  """Full batches from a Grain dataset; positions restored in O(1)."""

  def __init__(self, data_iterator: iterator_lib.DataIterator):
    self._iterator = data_iterator

  @property
  def fingerprint(self) -> dict[str, Any]:
    return self._iterator.fingerprint

  def position(self) -> dict[str, Any]:
    return dict(self._iterator.state().position)

  def check(self, fingerprint, position, *, allow_drift, origin) -> Any:
    return self._iterator.check_restorable(
        fingerprint, position, allow_drift=allow_drift, origin=origin
    )

  def apply(self, checked: Any, position: Mapping[str, Any]) -> None:
    self._iterator._apply(checked, position)  # pylint: disable=protected-access

  def seek_full_batches(self, count: int) -> bool:
    """Moves to full batch `count` in O(1) when the position is an index."""
    if set(self.position()) != {"next_index"}:
      return False
    self._move_to({"next_index": count})
    return True

  def __next__(self) -> Any:
    return next(self._iterator)

  def peek(self) -> Any:
    position = self.position()
    element = next(self._iterator)
    self._move_to(position)
    return element

  def _move_to(self, position: Mapping[str, Any]) -> None:
    checked = self._iterator.check_restorable(self.fingerprint, position, origin="the input")
    self.apply(checked, position)


class ReplaySource:
  """Full batches from any iterable; a position is a count of batches read."""

  def __init__(self, iterable: Iterable[Any]):
    self._iterable = iterable
    self._iterator = iter(iterable)
    self._read = 0
    self._lookahead: list[Any] = []
    self._warned = False

  @property
  def fingerprint(self) -> dict[str, Any]:
    return {"source": f"iterable:{type(self._iterable).__qualname__}"}

  def position(self) -> dict[str, Any]:
    return {"full_batches_read": self._read}

  def check(self, fingerprint, position, *, allow_drift, origin) -> Any:
    from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

    state_lib.check_fingerprint(fingerprint, self.fingerprint, allow_drift=allow_drift, origin=origin)
    count = position.get("full_batches_read") if isinstance(position, Mapping) else None
    if (
        not isinstance(position, Mapping) or set(position) != {"full_batches_read"}
        or not isinstance(count, int) or isinstance(count, bool) or count < 0
    ):
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {position!r}; an iterable's position is "
          "{'full_batches_read': N}."
      )
    return None

  def apply(self, checked: Any, position: Mapping[str, Any]) -> None:
    del checked
    self._replay(position["full_batches_read"])

  def seek_full_batches(self, count: int) -> bool:
    self._replay(count)
    return True

  def _replay(self, count: int) -> None:
    """Skips the first `count` full batches; called on a fresh source only.

    Works for one-shot iterators (generators) too: nothing is restarted, the
    peeked batch counts as read.
    """
    if self._read:
      raise errors.CkptIterError(
          f"cannot move an iterable input that already yielded {self._read} batches; "
          "positions are restored before training starts."
      )
    if count and not self._warned:
      _LOG.warning(
          "ckpt_iter: the training input is a plain iterable, so its position is "
          "restored by replaying %d full batches. Pass a Grain dataset "
          "(ckpt_iter.make_dataset) to restore in O(1).", count,
      )
      self._warned = True
    for _ in range(count):
      next(self)

  def __next__(self) -> Any:
    element = self._lookahead.pop() if self._lookahead else next(self._iterator)
    self._read += 1
    return element

  def peek(self) -> Any:
    if not self._lookahead:
      self._lookahead.append(next(self._iterator))
    return self._lookahead[-1]


def make_source(train_ds: Any) -> GrainSource | ReplaySource:
  if isinstance(train_ds, iterator_lib.DataIterator):
    return GrainSource(train_ds)
  if isinstance(train_ds, (grain.MapDataset, grain.IterDataset)):
    return GrainSource(iterator_lib.DataIterator(train_ds))
  if isinstance(train_ds, (str, bytes)) or not hasattr(train_ds, "__iter__"):
    raise errors.InvalidArgumentError(
        f"train_ds of type {type(train_ds).__qualname__} is not iterable; pass a "
        "Grain dataset (ckpt_iter.make_dataset) or an iterable of batch dicts."
    )
  return ReplaySource(train_ds)


class MicroBatchInput:
  """Input micro-batches with a position that includes the split offset."""

  def __init__(self, source: GrainSource | ReplaySource, split: Callable[[Any], list[Any]]):
    self._source = source
    self._split = split
    self._micro_batches: list[Any] | None = None
    self._taken = 0
    self._batch_position: dict[str, Any] | None = None

  @property
  def source(self) -> GrainSource | ReplaySource:
    return self._source

  def next_micro_batch(self) -> Any:
    if self._micro_batches is None:
      self._batch_position = self._source.position()
      self._micro_batches = self._split(next(self._source))
      self._taken = 0
    micro_batch = self._micro_batches[self._taken]
    self._taken += 1
    if self._taken == len(self._micro_batches):
      self._micro_batches, self._taken, self._batch_position = None, 0, None
    return micro_batch

  def position(self) -> dict[str, Any]:
    """Where the next unread micro-batch is."""
    if self._micro_batches is None:
      return {"full_batch": self._source.position(), "micro_batches_taken": 0}
    return {"full_batch": dict(self._batch_position), "micro_batches_taken": self._taken}

  def check(self, fingerprint, position, *, allow_drift, origin) -> Any:
    taken = position.get("micro_batches_taken") if isinstance(position, Mapping) else None
    if (
        not isinstance(position, Mapping)
        or set(position) != {"full_batch", "micro_batches_taken"}
        or not isinstance(taken, int) or isinstance(taken, bool) or taken < 0
        or not isinstance(position["full_batch"], Mapping)
    ):
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {position!r}; expected "
          "{'full_batch': <source position>, 'micro_batches_taken': N}."
      )
    return self._source.check(
        fingerprint, position["full_batch"], allow_drift=allow_drift, origin=origin
    )

  def apply(self, checked: Any, position: Mapping[str, Any]) -> None:
    self._source.apply(checked, position["full_batch"])
    self._micro_batches, self._taken, self._batch_position = None, 0, None
    taken = position["micro_batches_taken"]
    if taken:
      self._batch_position = self._source.position()
      self._micro_batches = self._split(next(self._source))
      self._taken = taken

  def seek_micro_batches(self, count: int, micro_per_full: int) -> None:
    """Moves past the first `count` micro-batches (legacy fast-forward)."""
    full, taken = divmod(count, micro_per_full)
    if not self._source.seek_full_batches(full):
      for _ in range(full):
        next(self._source)
    self._micro_batches, self._taken, self._batch_position = None, 0, None
    for _ in range(taken):
      self.next_micro_batch()

  def peek_full_batch(self) -> Any:
    """The full batch the next micro-batch comes from, without consuming it."""
    return self._source.peek()
