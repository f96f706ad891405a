"""Exact resume for Tunix RL learners (GRPO, PPO and their variants).

    from ckpt_iter.tunix import ResumableGRPOLearner   # instead of GRPOLearner
    learner = ResumableGRPOLearner(rl_cluster=..., algo_config=..., reward_fns=...)
    learner.train(ckpt_iter.make_dataset("prompts.jsonl", batch_size=8, seed=0))

Every actor checkpoint Tunix writes (the forced one in `close()` included)
also holds a `data` item, in the same Orbax step: the position of the next
input micro-batch the trainer has not consumed, the repeat-order key chain,
the produced TrainExamples not yet trained with their remaining schedule, and
the learner counters. A new process that builds the same learner restores it
in O(1) and trains the pending repeats first, from the checkpoint, without a
new rollout. See https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix.md for what is
guaranteed and what is not.
"""

from __future__ import annotations

try:
  import tunix  # noqa: F401  pylint: disable=unused-import  (before anything below imports it)
except ModuleNotFoundError as _missing:
  if _missing.name != "tunix":
    raise
  raise ModuleNotFoundError(
      f"ckpt_iter.tunix needs Tunix, which is not installed ({_missing}). "
      "Install it with: pip install 'ckpt_iter[tunix]'",
      name="tunix",
  ) from None

import importlib
import logging
from typing import TYPE_CHECKING, Any, Collection, Iterable

import jax
import numpy as np
from tunix.perf.experimental import constants as perf_constants
from tunix.rl import common as tunix_common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import dapo_learner
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _items
from ckpt_iter.tunix import _session
from ckpt_iter.tunix import _signature
from ckpt_iter.tunix.agentic import ResumableAgentic, ResumableAgenticGRPOLearner
from ckpt_iter.tunix.sft import ResumableDPOTrainer, ResumablePeftTrainer, ResumableSft
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import errors
from ckpt_iter import repeat as repeat_lib
from ckpt_iter import _codec as codec

_LOG = logging.getLogger("ckpt_iter")

LEGACY_POLICIES = ("raise", "fast_forward")

for _name, _cls in (
    ("tunix.rl.common.TrainExample", tunix_common.TrainExample),
    ("tunix.rl.grpo.TrainExample", grpo_learner.TrainExample),
    ("tunix.rl.ppo.TrainExample", ppo_learner.TrainExample),
):
  codec.register_pytree_dataclass(_name, _cls)

# Tunix main saves through Orbax v1, whose Context snapshots the handler
# registry when Tunix builds its CheckpointManager: register ckpt_iter's v1
# handler now, before any learner exists, so steps record it (and its metadata).
checkpoint_lib.register_v1_handler()
_items.silence_tunix_restore_warning()


def _session_of(learner: Any) -> "_session.DataSession | None":
  """The running session, or None: then every override is stock Tunix.

  None before `train()` and for subclasses that bypass `__init__` and drive
  Tunix internals directly (Tunix's own tests do): they get stock behaviour.
  """
  return getattr(learner, "_ci_session", None)


class Resumable:
  """Mixin that makes a `tunix.rl.rl_learner.RLLearner` subclass resume exactly.

  Put it first in the bases: `class MyLearner(Resumable, DAPOLearner): pass`.
  The constructor is the Tunix class's, unchanged: the class binds and
  shows (`inspect.signature`) exactly the Tunix class's parameters.

  Guarantees (with a Grain dataset as input; see
  https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix.md):
    * a checkpoint after any optimizer update, mid-repeat included, resumes
      with exactly the trainer inputs the uninterrupted run would have used:
      the same prompts in the same order, the pending repeats bit for bit
      (restored, never regenerated), nothing skipped or trained twice;
    * the input position is restored in O(1) (a plain iterable is replayed,
      with a warning that says how far);
    * the data state is written in the same Orbax step as the model, so they
      never disagree;
    * with a separate rollout mesh, rollouts after a resume use the weights
      the uninterrupted run would have used.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _signature.presents_stock_signature(cls, Resumable)

  if not TYPE_CHECKING:  # so that type checkers see the Tunix constructor

    def __init__(self, *args, **kwargs):
      # Arguments go to the Tunix class untouched: it accepts what it accepts
      # (rl_cluster= and/or rl_engine=, ppo_config= or algo_config=) and
      # raises TypeError for anything else.
      super().__init__(*args, **kwargs)
      api.require_api(self)
      self._ci_initial_key = api.take_shuffle_key(self)
      # What the fingerprint records: the seed as given, or (passed
      # positionally) the key it made, as integers.
      self._ci_data_shuffle_seed = kwargs.get(
          "data_shuffle_seed",
          None if self._ci_initial_key is None else list(codec.key_to_ints(self._ci_initial_key)),
      )
      self._ci_session: _session.DataSession | None = None

  # --- public API ------------------------------------------------------------

  def train(
      self,
      train_ds: Iterable[Any],
      eval_ds: Iterable[Any] | None = None,
      skip_jit: bool = False,
      *,
      on_legacy_checkpoint: str = "raise",
      allow_drift: Collection[str] = (),
  ) -> None:
    """Tunix's training loop, resumed exactly from the latest actor checkpoint.

    Args:
      train_ds: what Tunix accepts: a Grain dataset (restored in O(1)) or any
        iterable of batch dicts (restored by replaying what was consumed).
      eval_ds: as in Tunix.
      skip_jit: as in Tunix.
      on_legacy_checkpoint: what to do when the latest checkpoint has no data
        state (written by stock Tunix): "raise" (default) or "fast_forward"
        (skip ceil(train_steps / num_iterations) mini-batches, with a warning).
      allow_drift: fingerprint fields the checkpoint may differ in.

    Raises:
      LegacyCheckpointError: the checkpoint has no data state (see above).
      ConfigDriftError: the checkpoint was written by another configuration.
      InvalidStateError: the data state is corrupt; nothing was changed.
    """
    if on_legacy_checkpoint not in LEGACY_POLICIES:
      raise errors.InvalidArgumentError(
          f"on_legacy_checkpoint={on_legacy_checkpoint!r}: expected one of {list(LEGACY_POLICIES)}."
      )
    # Set before the saving manager exists: every save it makes has a session.
    self._ci_session = session = _session.DataSession(self, train_ds)
    session.evaluates = bool(eval_ds)  # as Tunix tests it before each evaluation
    _items.install_saving_manager(self)
    session.restore(on_legacy_checkpoint, frozenset(allow_drift))
    if session.finished():
      # Restored from the checkpoint of the last update: the uninterrupted run
      # stopped there. Stock Tunix would start another global step.
      _LOG.info("ckpt_iter: the restored checkpoint is the run's last (max_steps reached); nothing to train.")
      self.rl_cluster.close()
      return
    with session.restored_evaluation():
      super().train(session.tunix_input(), eval_ds, skip_jit)

  # --- overrides of Tunix internals -------------------------------------------

  def _run_global_step(self, full_batch_size, mini_batch_size, *args, **kwargs):
    session = _session_of(self)
    if session is None:
      return super()._run_global_step(full_batch_size, mini_batch_size, *args, **kwargs)
    per_global_step = full_batch_size // mini_batch_size
    todo = session.take_first_global_step_size(per_global_step)
    session.index_in_global_step = per_global_step - todo
    return super()._run_global_step(todo * mini_batch_size, mini_batch_size, *args, **kwargs)

  def _prepare_data(
      self,
      iterator,
      proceed_num_steps,
      sample_repeat,
      batch_repeat,
      service_target_batch_size,
      data_queue,
      async_loading=False,
      mode=rl_cluster_lib.Mode.TRAIN,
  ):
    session = _session_of(self)
    if session is not None and mode == rl_cluster_lib.Mode.EVAL:
      return self._ci_prepare_eval(
          session, iterator, proceed_num_steps, sample_repeat, batch_repeat,
          service_target_batch_size, data_queue, async_loading,
      )
    if mode != rl_cluster_lib.Mode.TRAIN or session is None:
      return super()._prepare_data(
          iterator, proceed_num_steps, sample_repeat, batch_repeat,
          service_target_batch_size, data_queue, async_loading, mode,
      )
    del iterator  # the session reads the input itself, at a known position
    mini_batch = session.begin_mini_batch()

    def put(example: Any) -> None:
      mini_batch.queue.append(example)
      data_queue.put([example])

    try:
      pending = session.take_restored_pending(mini_batch)
      if pending is not None:
        # Also opens this global step's train metrics buffer, which Tunix's
        # evaluation path expects a rollout to have opened.
        self.rl_cluster.buffer_metrics(
            {"ckpt_iter/restored_pending_inputs": (len(pending), np.sum)}, mode=rl_cluster_lib.Mode.TRAIN
        )
        for example in pending:
          put(example)
      else:
        self._ci_produce(
            session, proceed_num_steps, sample_repeat, batch_repeat,
            service_target_batch_size, put, async_loading,
        )
    except BaseException as e:
      mini_batch.error = e  # the next save raises it, with its cause, instead of waiting for the producer
      raise
    finally:
      try:
        mini_batch.position_after = session.input.unsettled_position()
        mini_batch.key_after = codec.key_to_ints(session.key)
      except BaseException as e:
        mini_batch.error = mini_batch.error or e
        raise
      finally:
        mini_batch.done.set()  # always: a save waits on it
        data_queue.put(None)

  def _ci_prepare_eval(
      self, session, iterator, proceed_num_steps, sample_repeat, batch_repeat,
      service_target_batch_size, data_queue, async_loading,
  ) -> None:
    """Tunix's evaluation input for the current mini-batch: restored if it has one, else Tunix's.

    Tunix takes the first item it queues (`eval_data_queue.get()`); the
    session keeps it, so a checkpoint inside the mini-batch can hold it.
    """
    restored = session.current_eval_input()
    if restored is not None:
      data_queue.put(restored)
      data_queue.put(None)
      return
    queued: list[Any] = []

    class _Recording:
      def put(self, item, *args, **kwargs):
        if item is not None and not queued:
          queued.append(item)
        return data_queue.put(item, *args, **kwargs)

      def __getattr__(self, name):
        return getattr(data_queue, name)

    super()._prepare_data(
        iterator, proceed_num_steps, sample_repeat, batch_repeat,
        service_target_batch_size, _Recording(), async_loading, rl_cluster_lib.Mode.EVAL,
    )
    if queued:
      session.record_eval_input(queued[0])

  def _ci_produce(
      self, session, proceed_num_steps, sample_repeat, batch_repeat,
      service_target_batch_size, put, async_loading,
  ) -> None:
    """Tunix's production of one mini-batch, with ckpt_iter's key chain.

    Mirrors `RLLearner._prepare_data` in TRAIN mode: the same merging up to
    the service batch size, the same calls, the same queue order (with async
    rollout each production's first repeat is queued as soon as it exists).
    """
    mode = rl_cluster_lib.Mode.TRAIN
    micro_batches: list[Any] = []
    micro_batch_sizes: list[int] = []
    accumulated = 0
    waiting_for_repeats: list[Any] = []

    def enqueue(examples: list[Any], repeats: int) -> None:
      for _ in range(repeats if examples else 0):
        if session.key is None:
          order = range(len(examples))
        else:
          order, session.key = repeat_lib.shuffled_order(session.key, len(examples))
        for index in order:
          put(examples[index])

    def enqueue_or_hold(produced: list[Any]) -> None:
      if not produced:
        return
      if async_loading:
        enqueue(produced, 1)
      if not async_loading or batch_repeat > 1:
        waiting_for_repeats.extend(produced)

    for _ in range(proceed_num_steps):
      with self.rl_cluster.perf.span("data_loading"), self.rl_cluster.perf_v2.span(
          perf_constants.DATA_LOADING,
          tags={perf_constants.STEP: self.rl_cluster.global_steps},
      ):
        example = session.input.next_micro_batch()
      size = len(example["prompts"])
      micro_batch_sizes.append(size * sample_repeat)
      accumulated += size
      example = jax.tree.map(lambda x: np.repeat(x, sample_repeat, axis=0), example)
      micro_batches.append(example)
      ids = api.trajectory_ids(self, example, api.learner_iter_steps(self))
      example["trajectory_ids"] = ids
      for trajectory_id in ids:
        self.rl_cluster.buffer_metrics({"trajectory_ids": (trajectory_id, None)}, mode=mode)
      with jax.profiler.StepTraceAnnotation("sampler", step_num=api.learner_iter_steps(self)):
        produced = []
        if accumulated >= service_target_batch_size:
          produced = api.process_accumulated_batches(self, micro_batches, micro_batch_sizes, mode)
          micro_batches.clear()
          micro_batch_sizes.clear()
          accumulated = 0
        enqueue_or_hold(produced)
      api.set_learner_iter_steps(self, api.learner_iter_steps(self) + 1)

    tail = api.process_accumulated_batches(self, micro_batches, micro_batch_sizes, mode)
    if not async_loading:
      waiting_for_repeats.extend(tail)
      enqueue(waiting_for_repeats, batch_repeat)
    else:
      enqueue_or_hold(tail)
      enqueue(waiting_for_repeats, batch_repeat - 1)


class ResumableGRPOLearner(Resumable, grpo_learner.GRPOLearner):
  """`tunix.rl.grpo.grpo_learner.GRPOLearner` that resumes exactly."""


class ResumablePPOLearner(Resumable, ppo_learner.PPOLearner):
  """`tunix.rl.ppo.ppo_learner.PPOLearner` that resumes exactly."""


class ResumableDAPOLearner(Resumable, dapo_learner.DAPOLearner):
  """`tunix.rl.grpo.dapo_learner.DAPOLearner` that resumes exactly."""


def _optional_tunix_class(module: str, name: str) -> type | None:
  try:
    return getattr(importlib.import_module(module), name, None)
  except ImportError:
    return None


_DrGRPOLearner = _optional_tunix_class("tunix.rl.grpo.drgrpo_learner", "DrGRPOLearner")

__all__ = [
    "Resumable",
    "ResumableGRPOLearner",
    "ResumablePPOLearner",
    "ResumableDAPOLearner",
    "ResumableSft",
    "ResumablePeftTrainer",
    "ResumableDPOTrainer",
]

# The name exists here exactly when this Tunix has Dr.GRPO's learner class
# (google-tunix 0.1.7 and upstream main both do).
if _DrGRPOLearner is not None:

  class ResumableDrGRPOLearner(Resumable, _DrGRPOLearner):
    """`tunix.rl.grpo.drgrpo_learner.DrGRPOLearner` that resumes exactly."""

  __all__.append("ResumableDrGRPOLearner")

# Agentic learners (tunix.rl.agentic) run their own deterministic consumer loop.
__all__ += ["ResumableAgentic", "ResumableAgenticGRPOLearner"]
