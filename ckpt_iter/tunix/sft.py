"""Exact, O(1) resume for Tunix's SFT trainer (`tunix.sft.peft_trainer.PeftTrainer`).

Stock PeftTrainer restores the model and optimizer in its constructor and,
in `train()`, re-reads and drops the first `iter_steps` examples of the input
(its TODO: "restore the iterator state instead of skipping"). That is correct
for a deterministic input but costs O(position) reads, and wrong for an input
that is not the same sequence on every pass.

`ResumableSft` checkpoints the input position instead: every save Tunix makes
also writes a `data` item in the same Orbax step, holding the position of the
next example (micro-batch) not yet given to the train step, and
`train()` moves the input there in O(1). Nothing else of Tunix's loop changes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Collection, Iterable

from tunix.sft import peft_trainer as _peft_trainer
from tunix.sft.dpo import dpo_trainer as _dpo_trainer

from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _input
from ckpt_iter.tunix import _items
from ckpt_iter.tunix import _signature

_LOG = logging.getLogger("ckpt_iter")

DATA_ITEM = _items.DATA_ITEM  # the same item name as the RL learners'
_TRAINER_FIELD = "trainer"


class _Feed:
  """The trainer's input: a source at a known position, read one example at a time.

  It also does the two things stock `train()` does around `next()` that
  depend on the position: skipping what was trained (done here by moving the
  source, before training starts) and stopping at `max_steps` (done here
  before reading, so no example is read and dropped).
  """

  def __init__(self, trainer: Any, source: Any):
    self._trainer = trainer
    self.source = source
    self.examples_read = 0  # in the trainer's numbering: == iter_steps when in step

  def __iter__(self) -> "_Feed":
    return self

  def __next__(self) -> Any:
    trainer = self._trainer
    max_steps = trainer.config.max_steps
    if max_steps is not None and trainer.train_steps >= max_steps:
      raise StopIteration
    example = next(self.source)
    self.examples_read += 1
    return example

  def position(self) -> dict[str, Any]:
    """The trainer's position: the input's state at the next example not yet given to the train step.

    The input reads no further than the trainer, so its state is its own,
    the content record of the example trained last included.
    """
    if self.examples_read != self._trainer.iter_steps:
      raise errors.CkptIterError(
          f"the trainer is at iter_steps={self._trainer.iter_steps} but its input "
          f"has yielded {self.examples_read} examples: something other than "
          "PeftTrainer.train read from the input, so its position does not match "
          "the model. Do not iterate the dataset passed to train() elsewhere."
      )
    return {_input.INPUT: _input.settled_state(self.source.state())}


def _grad_acc_steps(trainer: Any) -> int:
  return int(trainer.config.get_with_default("gradient_accumulation_steps", 1) or 1)


def _tunix_trainer_name(trainer: Any) -> str:
  for cls in type(trainer).__mro__:
    if cls.__module__.startswith("tunix."):
      return cls.__name__
  return type(trainer).__name__


class ResumableSft:
  """Mixin that makes `PeftTrainer` (or a subclass) resume its input exactly.

  Put it first in the bases: `class MyTrainer(ResumableSft, DPOTrainer): pass`.
  The constructor is the Tunix class's, unchanged: the class binds and
  shows (`inspect.signature`) exactly the Tunix class's parameters.

  Guarantees (the input is a Grain dataset; see
  https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix.md):
    * every checkpoint Tunix writes (the forced one in `close()` included)
      holds, in the same Orbax step, the position of the next example not yet
      given to the train step: with gradient accumulation, the next
      micro-batch, so a step saved mid-accumulation resumes at the right one;
    * a restart from checkpoint k trains exactly the examples the
      uninterrupted run trains after k, in the same order;
    * the position is restored in O(1): nothing is re-read (a plain iterable
      is replayed, with a warning that says how far);
    * restoring into another pipeline (fingerprint field, gradient
      accumulation) raises ConfigDriftError naming the field, unless allowed.

  Stock behaviour is kept where there is no position to checkpoint: with
  `data_hooks`, when the trainer is managed externally (inside an RL
  learner), and for checkpoints without a `data` item (written by stock
  Tunix), which are resumed the stock way: skip `iter_steps` examples.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _signature.presents_stock_signature(cls, ResumableSft)

  if not TYPE_CHECKING:  # so that type checkers see the Tunix constructor

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      api.require_sft_api(self)
      # The step the constructor restored the model from (0: none).
      self._ci_restored_step = int(self.train_steps)
      self._ci_data_restored = False
      self._ci_lineage: Any = None  # the restored state's, with its resume
      self._ci_feed: _Feed | None = None

  def train(
      self,
      train_ds: Iterable[Any],
      eval_ds: Iterable[Any] | None = None,
      skip_jit: bool = False,
      *,
      allow_drift: Collection[str] = (),
      **kwargs: Any,
  ) -> None:
    """Tunix's training loop, with the input resumed from the checkpoint in O(1).

    Args:
      train_ds: a Grain dataset (position checkpointed, restored in O(1)) or
        any iterable (position restored by replaying it).
      eval_ds: as in Tunix.
      skip_jit: as in Tunix.
      allow_drift: fingerprint fields the checkpoint may differ in.
      **kwargs: passed to Tunix's `train` (e.g. `cache_nnx_graph`).

    Raises:
      ConfigDriftError: the checkpoint was written by another pipeline.
      InvalidStateError: the data state is corrupt; nothing was changed.
    """
    if self.is_managed_externally or getattr(self, "data_hooks", None) is not None:
      # No input of ours to position: Tunix reads it (or an RL learner drives).
      return super().train(train_ds, eval_ds, skip_jit, **kwargs)
    feed = _Feed(self, _input.make_source(train_ds))
    # The trainer's own fields; the input's are nested with its position.
    fingerprint = {
        _TRAINER_FIELD: _tunix_trainer_name(self),
        "gradient_accumulation_steps": _grad_acc_steps(self),
    }
    self._ci_fingerprint = fingerprint
    _items.install(self.checkpoint_manager, _items.DataStateOnly(self._ci_snapshot))
    self._ci_position_feed(feed, frozenset(allow_drift))
    self._ci_feed = feed
    # Managed externally: Tunix neither skips (the feed is already where it
    # must be) nor stops at max_steps (the feed does) nor closes (done below,
    # as stock does when it is not managed externally).
    self.is_managed_externally = True
    try:
      super().train(feed, eval_ds, skip_jit, **kwargs)
    finally:
      self.is_managed_externally = False
    self.close()

  def _ci_position_feed(self, feed: _Feed, allow_drift: frozenset[str]) -> None:
    """Moves the input to the next example to train, from the checkpoint if it has one."""
    step = int(self.train_steps)
    data_dir = None
    if not self._ci_data_restored and step == self._ci_restored_step:
      data_dir = _items.restored_data_directory(self.checkpoint_manager, step)
    self._ci_data_restored = True  # only the constructor's restore has a data item
    value = None
    if data_dir is not None:
      value = _items.read_step_state(data_dir, step, learner_field=_TRAINER_FIELD, writer="a ResumablePeftTrainer")
    if value is not None:
      self._ci_restore(feed, step, data_dir, value, allow_drift)
      return
    iter_steps = int(self.iter_steps)
    if data_dir is not None:
      _LOG.warning(
          "ckpt_iter: checkpoint step %d (%s) has no '%s' item (written by stock "
          "Tunix): skipping the first %d examples of the input, as stock Tunix does.",
          step, os.path.dirname(data_dir), DATA_ITEM, iter_steps,
      )
    # Stock semantics: train_ds starts at the beginning and the trainer skips
    # what it has trained. O(1) for a Grain MapDataset, a replay otherwise.
    feed.source.skip_full_batches(iter_steps)
    feed.examples_read = iter_steps

  def _ci_restore(
      self, feed: _Feed, step: int, data_dir: str, value: state_lib.IteratorState, allow_drift: frozenset[str]
  ) -> None:
    origin = f"checkpoint step {step} ({data_dir})"
    counters = value.counters
    iter_steps = counters.get("iter_steps")
    if not state_lib.is_int(iter_steps) or iter_steps < 0:
      raise errors.InvalidStateError(
          f"{origin}: counter 'iter_steps' is {iter_steps!r}, expected an integer >= 0."
      )
    grad_acc = _grad_acc_steps(self)
    if not step * grad_acc <= counters["iter_steps"] < (step + 1) * grad_acc:
      raise errors.InvalidStateError(
          f"{origin}: counter 'iter_steps' is {counters['iter_steps']}, but train "
          f"step {step} with gradient_accumulation_steps={grad_acc} needs "
          f"{step * grad_acc}..{(step + 1) * grad_acc - 1}."
      )
    saved_input, _ = _input.input_part(value, origin, learner_fields=False)
    checked = _input.check_learner_state(
        value.fingerprint, self._ci_fingerprint, feed.source, saved_input, allow_drift=allow_drift, origin=origin,
    )
    # All checks passed: apply.
    feed.source.apply(checked)
    self._ci_lineage = value.lineage
    api.set_trainer_steps(self, step, counters["iter_steps"])
    feed.examples_read = counters["iter_steps"]
    _LOG.info(
        "ckpt_iter: restored the input position of step %d (iter_steps=%d) in O(1): %s; content check: %s.",
        step, counters["iter_steps"], state_lib.summary_line(value), feed.source.restored_content_check(),
    )

  def _ci_snapshot(self, step: int) -> state_lib.IteratorState | None:
    """The data state matching the model now, saved in `step`, or None when there is no feed."""
    feed = self._ci_feed
    if feed is None:
      return None
    self._ci_lineage = item_lib.started(self._ci_lineage, step)
    return state_lib.IteratorState(
        kind="tunix",
        fingerprint=self._ci_fingerprint,
        position=feed.position(),
        counters={"train_steps": int(self.train_steps), "iter_steps": int(self.iter_steps)},
        lineage=self._ci_lineage,
    )


class ResumablePeftTrainer(ResumableSft, _peft_trainer.PeftTrainer):
  """`tunix.sft.peft_trainer.PeftTrainer` whose input resumes exactly, in O(1)."""


class ResumableDPOTrainer(ResumableSft, _dpo_trainer.DPOTrainer):
  """`tunix.sft.dpo.dpo_trainer.DPOTrainer` (DPO and ORPO) whose input resumes exactly."""
