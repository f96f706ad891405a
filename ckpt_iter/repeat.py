"""RepeatIterator: the repeat queue of an RL learner, checkpointable exactly.

An RL learner with `num_iterations = mu` reads a group of inputs, makes one
rollout per input (`produce`), and trains on the produced group mu times,
optionally in a new random order each time. This module models that queue
without any RL framework so its guarantees can be property-tested, and holds
the repeat-order rule shared with the Tunix integration.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Collection

import jax
import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import iterator as iterator_lib
from ckpt_iter import state as state_lib

REPEAT_FIELDS = state_lib.REPEAT_FIELDS
PARENT = state_lib.NESTED["repeat"]


def initial_key(seed: int) -> np.ndarray:
  """The key chain's start for `seed`, as Tunix builds it (legacy uint32[2])."""
  return np.asarray(jax.random.PRNGKey(seed))


def shuffled_order(key: np.ndarray, size: int) -> tuple[list[int], np.ndarray]:
  """One shuffled pass over `size` items and the next key of the chain.

  The key is split once: the first half permutes, the second half carries on.
  This is the rule of Tunix's `RLLearner._prepare_data` (enqueue_examples).
  """
  permute_key, next_key = jax.random.split(key)
  order = np.asarray(jax.random.permutation(permute_key, size)).tolist()
  return order, np.asarray(next_key)


def repeat_schedule(
    size: int, num_repeats: int, key: np.ndarray | None
) -> tuple[list[int], np.ndarray | None]:
  """The order in which a produced group of `size` items is yielded.

  Returns:
    (indices, num_repeats * size of them; the key after the group). Without a
    key every repeat is in production order.
  """
  schedule: list[int] = []
  for _ in range(num_repeats):
    if key is None:
      schedule.extend(range(size))
    else:
      order, key = shuffled_order(key, size)
      schedule.extend(order)
  return schedule, key


key_to_ints, key_from_ints = codec.key_to_ints, codec.key_from_ints


class RepeatIterator(item_lib.V1Checkpointable, state_lib.RestorableIterator):
  """Yields each produced group `num_repeats` times; checkpointable mid-group.

  Reads `group_size` elements from `source`, calls `produce(element)` on each
  (a rollout, in RL: returns a pytree of numpy arrays), then yields the
  produced group `num_repeats` times. With `shuffle_seed`, each repeat is
  permuted by a JAX PRNG key split once per repeat (Tunix's rule). A last
  group that the source cannot fill is dropped, as Tunix drops it.

  Guarantees:
    `get_state()` holds the source position after the current group, the key,
    and the pending items with the remaining schedule (arrays as arrays).
    After `set_state` on a fresh RepeatIterator over the same pipeline the
    output equals the uninterrupted output element for element, the pending
    items bit for bit, and `produce` is never called for them.
  """

  def __init__(
      self,
      source: iterator_lib.DataIterator,
      *,
      produce: Callable[[Any], Any],
      num_repeats: int,
      group_size: int = 1,
      shuffle_seed: int | None = None,
      allow_drift: Collection[str] = (),
  ):
    if not isinstance(source, iterator_lib.DataIterator):
      raise errors.InvalidArgumentError(
          f"source must be a ckpt_iter.DataIterator, got {type(source).__qualname__}; "
          "wrap the dataset with ckpt_iter.DataIterator(dataset)."
      )
    if not callable(produce):
      raise errors.InvalidArgumentError(f"produce={produce!r} is not callable.")
    for name, value in (("num_repeats", num_repeats), ("group_size", group_size)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(f"{name}={value!r} must be a positive integer.")
    if shuffle_seed is not None and (
        isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)
        or not 0 <= shuffle_seed < 2**32
    ):
      raise errors.InvalidArgumentError(
          f"shuffle_seed={shuffle_seed!r} must be None or an integer in [0, 2**32)."
      )
    self._source = source
    self._produce = produce
    self._num_repeats = num_repeats
    self._group_size = group_size
    self._shuffle_seed = shuffle_seed
    self._allow_drift = frozenset(allow_drift)
    self._key = None if shuffle_seed is None else initial_key(shuffle_seed)
    self._items: list[Any] = []
    self._schedule: collections.deque[int] = collections.deque()
    # Over the run, resumes included: yielded = num_repeats x produced - pending
    # (what `ckpt-iter audit` checks).
    self._yielded = 0
    self._produced = 0
    self._counted = True
    self._lineage: Any = None

  @property
  def restored_content_check(self) -> str | None:
    """Its source's: the content a restore checks is the source's (the restore's log line)."""
    return getattr(self._source, "restored_content_check", None)

  @property
  def fingerprint(self) -> dict[str, Any]:
    """Its own defining fields; its source's are in the source's state (`position.parent`)."""
    return {
        "num_repeats": self._num_repeats,
        "group_size": self._group_size,
        "shuffle_seed": self._shuffle_seed,
    }

  def __iter__(self) -> "RepeatIterator":
    return self

  def __next__(self) -> Any:
    if not self._schedule:
      self._start_group()
    item = self._items[self._schedule.popleft()]
    if not self._schedule:
      self._items = []
    self._yielded += 1
    return item

  def _start_group(self) -> None:
    elements = []
    for _ in range(self._group_size):
      elements.append(next(self._source))  # StopIteration drops a partial group.
    items = [self._produce(element) for element in elements]
    self._produced += len(items)
    schedule, self._key = repeat_schedule(len(items), self._num_repeats, self._key)
    self._items = items
    self._schedule = collections.deque(schedule)

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value (pending items by reference)."""
    pending = None
    if self._schedule:
      # Keep only items still to come, renumbered in first-use order.
      renumber: dict[int, int] = {}
      for index in self._schedule:
        renumber.setdefault(index, len(renumber))
      pending = state_lib.Pending(
          items=tuple(self._items[i] for i in renumber),
          schedule=tuple(renumber[i] for i in self._schedule),
      )
    return state_lib.IteratorState(
        kind="repeat",
        fingerprint=self.fingerprint,
        position={PARENT: self._source.state_part()},
        shuffle_key=key_to_ints(self._key),
        pending=pending,
        # Not counted on from a state written without them (an older ckpt_iter).
        counters={"yielded": self._yielded, "produced": self._produced} if self._counted else {},
        lineage=self._lineage,
    )

  def check_restore(
      self,
      state: state_lib.IteratorState,
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> Callable[[], None]:
    """The check half of `state_lib.Restorable`; returns the apply half."""
    state_lib.check_kind(state, "repeat", "RepeatIterator", origin)
    allowed = self._allow_drift | frozenset(allow_drift)
    state_lib.check_fingerprint(
        state.fingerprint, self.fingerprint, allow_drift=allowed & set(REPEAT_FIELDS), origin=origin
    )
    if (state.shuffle_key is None) != (self._shuffle_seed is None):
      raise errors.InvalidStateError(
          f"{origin}: field 'shuffle_key' is {state.shuffle_key!r}, but this "
          f"iterator has shuffle_seed={self._shuffle_seed!r}."
      )
    # self._key has the shape of this JAX's PRNG key data; another length
    # would restore fine and then fail inside jax.random at the next group.
    if state.shuffle_key is not None and len(state.shuffle_key) != np.asarray(self._key).size:
      raise errors.InvalidStateError(
          f"{origin}: field 'shuffle_key' has {len(state.shuffle_key)} integers, "
          f"but a PRNG key here has {np.asarray(self._key).size}. The state is "
          "corrupt, or was written with another jax PRNG implementation."
      )
    # The source owns its part of the state, handed to it unchanged.
    if state.part is None or set(state.position) != {PARENT}:
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {state_lib.short_repr(state.position)}; a repeat state's "
          f"position is {{'{PARENT}': <its source's state>}}.")
    apply_source = self._source.check_restore(
        state.part, allow_drift=allowed - set(REPEAT_FIELDS), origin=origin
    )

    def apply() -> None:
      apply_source()
      self._counted = {"yielded", "produced"} <= set(state.counters)
      self._yielded = state.counters.get("yielded", 0)
      self._produced = state.counters.get("produced", 0)
      self._lineage = state.lineage
      self._key = key_from_ints(state.shuffle_key)
      if state.pending is None:
        self._items, self._schedule = [], collections.deque()
      else:
        self._items = list(state.pending.items)
        self._schedule = collections.deque(state.pending.schedule)

    return apply
