"""Exact resume for Tunix's agentic GRPO learner (`tunix.rl.agentic`).

Stock `AgenticRLLearner.train` trains groups in rollout *completion* order and
keeps the position inside a global step in locals; on resume it drops
`global_steps` full batches with `next()`. `ResumableAgenticGRPOLearner` runs
its own consumer loop (`_agentic_loop.py`) with a deterministic order:

* groups are trained in *prompt* order: a completed group waits in a buffer
  until every earlier prompt's group has been taken (the cost: a slow rollout
  holds back the groups after it);
* with actor and rollout sharing one model, every prompt handed to the
  rollout is rolled out before the next optimizer update (with separate
  models: before the next weight sync), so the weights a rollout uses depend
  only on when its prompt was fed, never on timing;
* with num_iterations > 1 the installed Tunix's order of updates is kept:
  0.1.7 trains each group's input num_iterations times in a row, main trains
  the full batch once and then replays it whole (`_api.agentic_iteration_order`);
* every actor save waits for the rollouts of every fed prompt, then
  carries, in the same Orbax step, the produced trainer inputs not yet
  trained (arrays, bit for bit), the input position of the next batch (O(1)
  to restore for a Grain dataset) and the loop's counters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Collection, Iterable

from tunix.rl.agentic import agentic_grpo_learner
from tunix.rl.agentic import agentic_rl_learner

from ckpt_iter import _codec as codec
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _agentic_loop
from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _input
from ckpt_iter.tunix import _items
from ckpt_iter.tunix import _signature

_LOG = logging.getLogger("ckpt_iter")

LEARNER_FIELD = "agentic_learner"
codec.register_pytree_dataclass("tunix.rl.agentic.TrainExample", agentic_rl_learner.TrainExample)


def refuse_unmirrored_settings(learner: Any) -> None:
  """Raises UnsupportedConfigError for what stock's agentic `train()` does and this loop does not.

  The loop replaces Tunix's `train()`; a setting that changes what stock
  trains and that the loop does not reproduce is refused by name when
  `train()` starts, rather than trained differently.
  """
  config = api.training_config(learner)
  budget = getattr(config, "max_seq_token_per_tpu", None)
  if budget is not None:
    raise errors.UnsupportedConfigError(
        f"max_seq_token_per_tpu={budget!r}: stock Tunix's agentic learner packs "
        "trainer inputs with rl_utils.pack_sequences, which "
        "ResumableAgenticGRPOLearner does not reproduce (it would train them "
        "unpacked). Set RLTrainingConfig.max_seq_token_per_tpu=None, or use the "
        "stock learner without exact resume."
    )
  if hasattr(api.agentic_cluster(learner), "critic_trainer"):
    raise errors.UnsupportedConfigError(
        "the RL cluster has a critic (critic_trainer): stock Tunix's agentic "
        "learner updates it after every actor update, which "
        "ResumableAgenticGRPOLearner does not reproduce. Build the cluster "
        "without a critic model, or use the stock learner without exact resume."
    )


class ResumableAgentic:
  """Mixin that makes an `AgenticRLLearner` subclass resume exactly.

  Put it first in the bases; the constructor is the Tunix class's, unchanged:
  the class binds and shows (`inspect.signature`) exactly its parameters.

  Guarantees (single process; see
  https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix.md#agentic-learners):
    * after a checkpoint at any optimizer update (inside a num_iterations
      repeat or full-batch replay, with gradient accumulation included) no prompt is skipped or
      trained twice, and the trainer inputs already produced are restored from
      the checkpoint bit for bit, never regenerated;
    * a save waits until every prompt fed to the rollout is rolled out, so
      the checkpoint holds its group and a resume rolls out nothing again
      (the rollout weights of the last sync are in no checkpoint);
    * the input position is restored in O(1) for a Grain dataset (a plain
      iterable is replayed, with a warning);
    * the data state is written in the same Orbax step as the actor.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _signature.presents_stock_signature(cls, ResumableAgentic)

  if not TYPE_CHECKING:  # so that type checkers see the Tunix constructor

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      api.require_api(self, api.check_agentic_api(self))
      self._ci_loop: _agentic_loop.ConsumerLoop | None = None

  def train(
      self,
      train_dataset: Iterable[Any],
      eval_dataset: Iterable[Any] | None = None,
      skip_jit: bool = False,
      *,
      on_legacy_checkpoint: str = "raise",
      allow_drift: Collection[str] = (),
  ) -> None:
    """Trains with a deterministic order, resuming exactly from the latest actor checkpoint.

    Args:
      train_dataset: a Grain dataset of full batches (restored in O(1)) or any
        iterable of batch dicts (restored by replaying it).
      eval_dataset: as in Tunix.
      skip_jit: as in Tunix.
      on_legacy_checkpoint: what to do when the actor was restored from a
        step without a data state (written by stock Tunix): "raise" (default)
        or "fast_forward" (skip `global_steps` full batches as stock Tunix
        does, with a warning: inexact, see
        https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix.md).
      allow_drift: fingerprint fields the checkpoint may differ in.

    Raises:
      LegacyCheckpointError: the checkpoint has no data state (see above).
      ConfigDriftError: the checkpoint was written by another configuration.
      InvalidStateError: the data state is corrupt; nothing was changed.
    """
    if on_legacy_checkpoint not in ("raise", "fast_forward"):
      raise errors.InvalidArgumentError(
          f"on_legacy_checkpoint={on_legacy_checkpoint!r}: expected 'raise' or 'fast_forward'."
      )
    # Refused here, before anything is read, restored or trained, not in the
    # constructor: the learner's other methods are stock's, and Tunix's own
    # tests build packed learners to call them.
    refuse_unmirrored_settings(self)
    source = _input.make_source(train_dataset)
    loop = _agentic_loop.ConsumerLoop(self, source, eval_dataset, skip_jit)
    self._ci_loop = loop
    trainer = api.agentic_cluster(self).actor_trainer
    _items.install(trainer.checkpoint_manager, _items.DataStateOnly(self._ci_snapshot))
    loop.run(*self._ci_read_state(loop, frozenset(allow_drift), on_legacy_checkpoint))

  def _ci_snapshot(self, step: int) -> state_lib.IteratorState | None:
    loop = self._ci_loop
    return None if loop is None or not loop.started else loop.snapshot(step)

  def _ci_read_state(self, loop: Any, allow_drift: frozenset[str], on_legacy: str) -> tuple[Any, Any, Any]:
    """The data state of the step Tunix restored the actor from, its input's checked
    apply step and the loop's position, or (None, None, None) for a fresh run."""
    trainer = api.agentic_cluster(self).actor_trainer
    step = int(trainer.train_steps)
    if not step:
      return None, None, None
    data_dir = _items.restored_data_directory(trainer.checkpoint_manager, step)
    origin = f"checkpoint step {step} ({data_dir})"
    value = None
    if data_dir is not None:
      value = _items.read_step_state(
          data_dir, step, learner_field=LEARNER_FIELD, writer="ResumableAgenticGRPOLearner")
    if value is None:
      skipped = int(api.agentic_cluster(self).global_steps)
      if data_dir is not None and on_legacy == "raise":
        raise errors.LegacyCheckpointError(
            f"{origin} has no 'data' item: it was written by stock Tunix, whose "
            "agentic learner saves no data position, so it cannot be resumed "
            f"exactly. Pass on_legacy_checkpoint='fast_forward' to skip {skipped} "
            "full batches as stock Tunix does (inexact), or start a new run."
        )
      # No data state (a stock checkpoint, or no checkpointing and a second
      # train() call): stock semantics, skip `global_steps` full batches.
      if data_dir is not None:
        _LOG.warning(
            "ckpt_iter: %s has no data state; skipping %d full batches as stock "
            "Tunix does. Prompts of a global step cut by the checkpoint are lost "
            "or trained twice.", origin, skipped,
        )
      loop.skip_full_batches(skipped)
      return None, None, None
    saved_input, position = _input.input_part(value, origin)
    state_lib.check_learner_position(value, origin)
    checked = _input.check_learner_state(
        value.fingerprint, loop.fingerprint, loop.source, saved_input, allow_drift=allow_drift, origin=origin,
        optional_learner_fields=("num_iterations_order",),
    )
    return value, checked, position


class ResumableAgenticGRPOLearner(ResumableAgentic, agentic_grpo_learner.GRPOLearner):
  """`tunix.rl.agentic.agentic_grpo_learner.GRPOLearner` that resumes exactly."""
