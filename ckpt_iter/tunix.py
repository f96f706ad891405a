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
new rollout. See docs/tunix.md for what is guaranteed and what is not.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import threading
from typing import Any, Collection, Iterable

from flax import nnx
import jax
import numpy as np
import orbax.checkpoint as ocp
from tunix.perf.experimental import constants as perf_constants
from tunix.rl import common as tunix_common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import rl_learner
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

from ckpt_iter import _tunix_api as api
from ckpt_iter import _tunix_input
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import errors
from ckpt_iter import repeat as repeat_lib
from ckpt_iter import state as state_lib

_LOG = logging.getLogger("ckpt_iter")

DATA_ITEM = "data"
ROLLOUT_ITEM = "rollout_params"
CRITIC_PARAMS_ITEM = "critic_params"
CRITIC_OPTIMIZER_ITEM = "critic_optimizer_state"
LEGACY_POLICIES = ("raise", "fast_forward")
# The producer of a mini-batch never blocks, so this only trips on a hang.
_PRODUCER_TIMEOUT_SECONDS = 600.0

for _name, _cls in (
    ("tunix.rl.common.TrainExample", tunix_common.TrainExample),
    ("tunix.rl.grpo.TrainExample", grpo_learner.TrainExample),
    ("tunix.rl.ppo.TrainExample", ppo_learner.TrainExample),
):
  state_lib.register_pytree_dataclass(_name, _cls)


@dataclasses.dataclass
class _MiniBatch:
  """What one mini-batch put in the trainer's queue, and where it left the input."""

  start_iter_steps: int  # actor trainer iter_steps when it began
  global_steps: int  # rl_cluster.global_steps while it runs
  index_in_global_step: int
  queue: list[Any] = dataclasses.field(default_factory=list)
  position_after: dict[str, Any] | None = None
  key_after: tuple[int, ...] | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
  """A data state taken at save time (IteratorSave reads it via .state())."""

  value: state_lib.IteratorState

  def state(self) -> state_lib.IteratorState:
    return self.value


class Resumable:
  """Mixin that makes a `tunix.rl.rl_learner.RLLearner` subclass resume exactly.

  Put it first in the bases: `class MyLearner(Resumable, DAPOLearner): pass`.
  The constructor is the Tunix class's, unchanged.

  Guarantees (with a Grain dataset as input; see docs/tunix.md):
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

  def __init__(self, *args, **kwargs):
    # The Tunix class's own signature (PPO names its config ppo_config).
    bound = inspect.signature(super().__init__).bind(*args, **kwargs)
    self._ci_data_shuffle_seed = bound.arguments.get("data_shuffle_seed")
    super().__init__(*args, **kwargs)
    api.require_api(self)
    packing = api.training_config(self).max_seq_token_per_tpu
    if packing is not None:
      raise errors.UnsupportedConfigError(
          f"max_seq_token_per_tpu={packing}: sequence packing merges queue items "
          "into packed rows, so a checkpoint can fall inside a packed row and the "
          "trainer's step count no longer maps to queue items. ckpt_iter refuses "
          "it rather than resume it wrong. Set max_seq_token_per_tpu=None."
      )
    self._ci_initial_key = api.take_shuffle_key(self)
    self._ci_session: _DataSession | None = None

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
    session = _DataSession(self, train_ds)
    _install_saving_manager(self)
    session.restore(on_legacy_checkpoint, frozenset(allow_drift))
    self._ci_session = session
    super().train(session.tunix_input(), eval_ds, skip_jit)

  # --- overrides of Tunix internals -------------------------------------------

  def _run_global_step(self, full_batch_size, mini_batch_size, *args, **kwargs):
    session = self._ci_session
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
    if mode != rl_cluster_lib.Mode.TRAIN:
      return super()._prepare_data(
          iterator, proceed_num_steps, sample_repeat, batch_repeat,
          service_target_batch_size, data_queue, async_loading, mode,
      )
    del iterator  # the session reads the input itself, at a known position
    session = self._ci_session
    mini_batch = session.begin_mini_batch()

    def put(example: Any) -> None:
      mini_batch.queue.append(example)
      data_queue.put([example])

    try:
      pending = session.take_restored_pending()
      if pending is not None:
        for example in pending:
          put(example)
      else:
        self._ci_produce(
            session, proceed_num_steps, sample_repeat, batch_repeat,
            service_target_batch_size, put, async_loading,
        )
    finally:
      mini_batch.position_after = session.input.position()
      mini_batch.key_after = repeat_lib.key_to_ints(session.key)
      mini_batch.done.set()
      data_queue.put(None)

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


# ---------------------------------------------------------------------------


class _DataSession:
  """The data side of one `train()` call: input, key chain, queue records."""

  def __init__(self, learner: Resumable, train_ds: Any):
    self.learner = learner
    self.input = _tunix_input.MicroBatchInput(
        _tunix_input.make_source(train_ds), split=self._split
    )
    self.key = learner._ci_initial_key  # pylint: disable=protected-access
    self.current: _MiniBatch | None = None
    self.index_in_global_step = 0
    self._restored_pending: list[Any] | None = None
    self._first_global_step: int | None = None
    self._lock = threading.Lock()
    cluster = learner.rl_cluster
    config = api.training_config(learner)
    first = self.input.peek_full_batch()  # as Tunix: the size of the first batch
    self.full_batch_size = len(first["prompts"])
    self.mini_batch_size = config.mini_batch_size or self.full_batch_size
    self.micro_batch_size = config.train_micro_batch_size or self.mini_batch_size
    self.mini_batches_per_global_step = self.full_batch_size // self.mini_batch_size
    self.fingerprint = {
        **self.input.source.fingerprint,
        "learner": _tunix_learner_name(learner),
        "num_iterations": api.num_iterations(learner),
        "num_generations": api.num_generations(learner),
        "full_batch_size": self.full_batch_size,
        "mini_batch_size": self.mini_batch_size,
        "train_micro_batch_size": self.micro_batch_size,
        "rollout_micro_batch_size": config.rollout_micro_batch_size or self.micro_batch_size,
        "compute_logps_micro_batch_size": config.compute_logps_micro_batch_size or self.micro_batch_size,
        "data_shuffle_seed": learner._ci_data_shuffle_seed,  # pylint: disable=protected-access
        "async_rollout": bool(learner.can_enable_async_rollout),
        "separate_rollout_weights": bool(learner.should_sync_weights),
    }
    del cluster

  def _split(self, full_batch: Any) -> list[Any]:
    if self.micro_batch_size == len(full_batch["prompts"]):
      return [full_batch]
    return api.split_full_batch(self.learner, full_batch, self.micro_batch_size)

  def tunix_input(self) -> list[Any]:
    """What Tunix's train() reads to size its batches (nothing else is read)."""
    return [{"prompts": [None] * self.full_batch_size}]

  # --- producer side ------------------------------------------------------------

  def begin_mini_batch(self) -> _MiniBatch:
    cluster = self.learner.rl_cluster
    mini_batch = _MiniBatch(
        start_iter_steps=cluster.actor_trainer.iter_steps,
        global_steps=cluster.global_steps,
        index_in_global_step=self.index_in_global_step,
    )
    self.index_in_global_step += 1
    with self._lock:
      self.current = mini_batch
    return mini_batch

  def take_restored_pending(self) -> list[Any] | None:
    pending, self._restored_pending = self._restored_pending, None
    return pending

  def take_first_global_step_size(self, per_global_step: int) -> int:
    size, self._first_global_step = self._first_global_step, None
    return per_global_step if size is None else size

  # --- save side ------------------------------------------------------------

  def snapshot(self, step: int) -> tuple[state_lib.IteratorState, bool]:
    """The data state matching actor checkpoint `step`, and whether it is mid-global-step."""
    learner = self.learner
    trainer = learner.rl_cluster.actor_trainer
    with self._lock:
      mini_batch = self.current
    if mini_batch is None:
      # Nothing started in this session (e.g. the forced save of a run that
      # trained nothing): the state is the one it was restored at.
      pending_items: list[Any] = []
      remaining = self._first_global_step or 0
      global_steps = learner.rl_cluster.global_steps - (0 if remaining else 1)
      position, key = self.input.position(), repeat_lib.key_to_ints(self.key)
    else:
      if not mini_batch.done.wait(_PRODUCER_TIMEOUT_SECONDS):
        raise errors.CkptIterError(
            f"checkpoint step {step}: the data producer did not finish its mini-batch "
            f"in {_PRODUCER_TIMEOUT_SECONDS:.0f}s; not saving a data state that could be wrong."
        )
      consumed = trainer.iter_steps - mini_batch.start_iter_steps
      if not 0 <= consumed <= len(mini_batch.queue):
        raise errors.CkptIterError(
            f"checkpoint step {step}: the trainer consumed {consumed} inputs of a "
            f"mini-batch that queued {len(mini_batch.queue)}; refusing to save a wrong state."
        )
      pending_items = mini_batch.queue[consumed:]
      remaining = self.mini_batches_per_global_step - 1 - mini_batch.index_in_global_step
      global_steps = mini_batch.global_steps
      position, key = mini_batch.position_after, mini_batch.key_after
    pending = None
    if pending_items:
      pending = state_lib.Pending(
          items=tuple(pending_items), schedule=tuple(range(len(pending_items)))
      )
    mid_global_step = bool(pending_items) or remaining > 0
    value = state_lib.IteratorState(
        kind="tunix",
        fingerprint=self.fingerprint,
        position=position,
        shuffle_key=key,
        pending=pending,
        counters={
            "train_steps": int(trainer.train_steps),
            "actor_iter_steps": int(trainer.iter_steps),
            "global_steps": int(global_steps),
            "remaining_mini_batches": int(remaining),
            "mini_batches_per_global_step": int(self.mini_batches_per_global_step),
        },
    )
    return value, mid_global_step

  # --- restore side ------------------------------------------------------------

  def restore(self, on_legacy_checkpoint: str, allow_drift: frozenset[str]) -> None:
    learner = self.learner
    trainer = learner.rl_cluster.actor_trainer
    manager = api.orbax_manager(trainer.checkpoint_manager)
    step = int(trainer.train_steps)
    if manager is None or manager.latest_step() is None:
      return  # a fresh run
    step_dir = os.path.join(os.fspath(manager.directory), str(step))
    data_dir = os.path.join(step_dir, DATA_ITEM)
    if not os.path.isdir(data_dir):
      self._restore_legacy(step, step_dir, on_legacy_checkpoint)
      return
    value = checkpoint_lib.read_state(data_dir, jax.process_index(), jax.process_count())
    origin = f"checkpoint step {step} ({data_dir})"
    if value.kind != "tunix":
      raise errors.InvalidStateError(f"{origin}: data state kind is {value.kind!r}, expected 'tunix'.")
    counters = value.counters
    for name in ("train_steps", "global_steps", "remaining_mini_batches"):
      if name not in counters:
        raise errors.InvalidStateError(f"{origin}: counter {name!r} is missing.")
    if counters["train_steps"] != step:
      raise errors.InvalidStateError(
          f"{origin}: the data state was taken at train step {counters['train_steps']}, "
          f"but the model was restored at step {step}; they must come from one step."
      )
    state_lib.check_fingerprint(value.fingerprint, self.fingerprint, allow_drift=allow_drift, origin=origin)
    source_fields = set(self.input.source.fingerprint)
    checked = self.input.check(
        {k: v for k, v in value.fingerprint.items() if k in source_fields},
        value.position, allow_drift=allow_drift & source_fields, origin=origin,
    )
    critic_state = _read_critic_state(learner, manager, step, origin)
    mid_global_step = value.pending is not None or counters["remaining_mini_batches"] > 0
    rollout_params = None
    if learner.should_sync_weights and mid_global_step:
      rollout_params = _read_rollout_params(learner, manager, step, origin)
    # All checks passed and everything is read: apply.
    self.input.apply(checked, value.position)
    self.key = repeat_lib.key_from_ints(value.shuffle_key)
    if value.pending is not None:
      self._restored_pending = [
          _to_device(value.pending.items[i]) for i in value.pending.schedule
      ]
    remaining = counters["remaining_mini_batches"]
    if mid_global_step:
      self._first_global_step = remaining + (1 if value.pending is not None else 0)
      global_steps = counters["global_steps"]
    else:
      global_steps = counters["global_steps"] + 1
    api.set_learner_iter_steps(learner, int(trainer.iter_steps))
    if critic_state is not None:
      _apply_critic_state(learner, critic_state, step)
    self._restore_rollout_weights(rollout_params)
    learner.rl_cluster.global_steps = global_steps
    _LOG.info(
        "ckpt_iter: restored the data state of step %d: %d pending trainer inputs, "
        "%d more mini-batches in this global step.",
        step, len(value.pending or ()), remaining,
    )

  def _restore_rollout_weights(self, rollout_params: Any) -> None:
    learner = self.learner
    if not learner.should_sync_weights:
      return  # the rollout model is the actor model
    cluster = learner.rl_cluster
    if rollout_params is None:
      # At a global-step boundary the uninterrupted run syncs the restored
      # actor weights right after the checkpoint: do that sync now.
      global_steps = cluster.global_steps
      cluster.sync_weights()
      cluster.global_steps = global_steps
    else:
      cluster.rollout.update_params(rollout_params, _weight_filter(learner))

  def _restore_legacy(self, step: int, step_dir: str, policy: str) -> None:
    learner = self.learner
    mu = api.num_iterations(learner)
    grad_acc = api.training_config(learner).get_with_default("gradient_accumulation_steps", 1)
    if policy == "raise":
      raise errors.LegacyCheckpointError(
          f"checkpoint step {step} ({step_dir}) has no '{DATA_ITEM}' item: it was "
          "written by stock Tunix or before switching to ckpt_iter, so its data "
          "position, shuffle key and pending repeats were never saved and cannot "
          "be restored exactly. Pass on_legacy_checkpoint='fast_forward' to skip "
          f"ceil(train_steps / num_iterations) = {math.ceil(step / mu)} mini-batches "
          "and go on, or start from an empty checkpoint directory."
      )
    mini_batches = math.ceil(step / mu)
    micro_batches = mini_batches * grad_acc
    self.input.seek_micro_batches(micro_batches, self.full_batch_size // self.micro_batch_size)
    lost = mini_batches * mu - step
    index = mini_batches % self.mini_batches_per_global_step
    if index:
      self._first_global_step = self.mini_batches_per_global_step - index
    api.set_learner_iter_steps(learner, int(learner.rl_cluster.actor_trainer.iter_steps))
    if learner.should_sync_weights:
      global_steps = learner.rl_cluster.global_steps
      learner.rl_cluster.sync_weights()
      learner.rl_cluster.global_steps = global_steps
    _LOG.warning(
        "ckpt_iter: checkpoint step %d has no data state (legacy). Fast-forwarded "
        "%d input micro-batches (ceil(%d / num_iterations=%d) mini-batches x %d). "
        "%s The repeat-order key restarts at data_shuffle_seed.",
        step, micro_batches, step, mu, grad_acc,
        f"The last {lost} update(s) of the rollout that step {step} fell inside "
        "cannot be recovered and are skipped." if lost else "",
    )


def _tunix_learner_name(learner: Any) -> str:
  for cls in type(learner).__mro__:
    if cls.__module__.startswith("tunix.") and issubclass(cls, rl_learner.RLLearner):
      return cls.__name__
  return type(learner).__name__


def _weight_filter(learner: Any, model: Any = None) -> Any:
  from tunix.sft import utils as sft_utils  # pylint: disable=g-import-not-at-top

  model = learner.rl_cluster.actor_trainer.model if model is None else model
  return nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param


def _rollout_params(learner: Any) -> Any:
  return nnx.state(learner.rl_cluster.rollout.model(), _weight_filter(learner))


def _read_rollout_params(learner: Any, manager: Any, step: int, origin: str) -> Any:
  """The rollout weights saved with a mid-global-step checkpoint."""
  if not os.path.isdir(os.path.join(os.fspath(manager.directory), str(step), ROLLOUT_ITEM)):
    raise errors.InvalidStateError(
        f"{origin}: the checkpoint falls inside a global step but has no "
        f"'{ROLLOUT_ITEM}' item, so the rollout weights of the rest of the step "
        "are unknown. It was not written by this ckpt_iter configuration."
    )
  abstract = _rollout_params(learner)
  restored = manager.restore(step, args=ocp.args.Composite(**{ROLLOUT_ITEM: _pytree_restore(abstract)}))
  return restored[ROLLOUT_ITEM]


def _critic_abstract_state(learner: Any) -> tuple[Any, Any]:
  critic = _critic_trainer(learner)
  params = nnx.state(critic.model, _weight_filter(learner, critic.model))
  optimizer = nnx.state(critic.optimizer, nnx.optimizer.OptState)
  return params, optimizer


def _read_critic_state(learner: Any, manager: Any, step: int, origin: str) -> Any:
  """The critic's params and optimizer state saved in the actor's step."""
  if _critic_trainer(learner) is None:
    return None
  step_dir = os.path.join(os.fspath(manager.directory), str(step))
  for item in (CRITIC_PARAMS_ITEM, CRITIC_OPTIMIZER_ITEM):
    if not os.path.isdir(os.path.join(step_dir, item)):
      raise errors.InvalidStateError(
          f"{origin}: this learner trains a critic, but the step has no '{item}' "
          "item, so actor and critic cannot be restored to the same input."
      )
  params, optimizer = _critic_abstract_state(learner)
  restored = manager.restore(step, args=ocp.args.Composite(**{
      CRITIC_PARAMS_ITEM: _pytree_restore(params),
      CRITIC_OPTIMIZER_ITEM: _pytree_restore(optimizer),
  }))
  return restored[CRITIC_PARAMS_ITEM], restored[CRITIC_OPTIMIZER_ITEM]


def _apply_critic_state(learner: Any, critic_state: Any, step: int) -> None:
  critic = _critic_trainer(learner)
  params, optimizer = critic_state
  nnx.update(critic.model, params)
  nnx.update(critic.optimizer, optimizer)
  grad_acc = api.training_config(learner).get_with_default("gradient_accumulation_steps", 1)
  api.set_trainer_steps(critic, step, step * grad_acc)


def _pytree_restore(abstract: Any) -> Any:
  return ocp.args.PyTreeRestore(
      item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
  )


def _to_device(pytree: Any) -> Any:
  return jax.tree.map(lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, pytree)


class _SavingManager:
  """Stands in for the Orbax manager inside Tunix's actor CheckpointManager.

  Adds the data item (and the rollout weights when a step falls inside a
  global step) to every save Tunix makes, in the same Orbax step, and gives
  the forced save in `close()` the metadata every other save has.

  With a critic (PPO) the actor's save of step K waits until the critic has
  made its update K, then the one Orbax step also holds the critic's params
  and optimizer state: actor, critic and data state always come from the
  same trainer input, whatever moment the process dies.
  """

  def __init__(self, real: ocp.CheckpointManager, learner: Resumable):
    self._real = real
    self._learner = learner
    self._has_critic = _critic_trainer(learner) is not None
    self._deferred: tuple[Any, ...] | None = None

  def save(self, step, args=None, custom_metadata=None, force=False, **kwargs):
    learner = self._learner
    session = learner._ci_session  # pylint: disable=protected-access
    items = dict(args.items()) if args is not None else {}
    if session is not None:
      value, mid_global_step = session.snapshot(step)
      items[DATA_ITEM] = checkpoint_lib.IteratorSave(_Snapshot(value))
      if learner.should_sync_weights and mid_global_step:
        items[ROLLOUT_ITEM] = _pytree_save(_rollout_params(learner))
    if not custom_metadata:
      custom_metadata = learner.rl_cluster.actor_trainer.custom_checkpoint_metadata()
    if self._has_critic:
      self._deferred = (step, items, custom_metadata, force, kwargs)
      return True
    return self._save(step, items, custom_metadata, force, kwargs)

  def _save(self, step, items, custom_metadata, force, kwargs) -> bool:
    return self._real.save(
        step, args=ocp.args.Composite(**items), custom_metadata=custom_metadata,
        force=force, **kwargs,
    )

  def flush_with_critic(self, critic_model: Any, critic_optimizer: Any) -> None:
    """Writes the deferred actor step, now that the critic made the same update."""
    if self._deferred is None:
      return
    step, items, custom_metadata, force, kwargs = self._deferred
    self._deferred = None
    items[CRITIC_PARAMS_ITEM] = _pytree_save(nnx.state(critic_model, _weight_filter(self._learner, critic_model)))
    if critic_optimizer is not None:
      items[CRITIC_OPTIMIZER_ITEM] = _pytree_save(nnx.state(critic_optimizer, nnx.optimizer.OptState))
    self._save(step, items, custom_metadata, force, kwargs)

  def close(self) -> None:
    critic = _critic_trainer(self._learner)
    if critic is not None and self._deferred is not None:
      if critic.train_steps >= self._deferred[0]:
        self.flush_with_critic(critic.model, critic.optimizer)
      else:
        # Closed between the actor's and the critic's update of this step:
        # the step would pair the actor with a stale critic, so it is dropped.
        self._deferred = None
    self._real.close()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._real, name)


class _CriticCheckpointManager:
  """Stands in for the critic trainer's Tunix CheckpointManager.

  Its save() runs right after each critic update: the moment the deferred
  actor step can be written with the critic's matching state.
  """

  def __init__(self, real: Any, actor_saving: _SavingManager):
    self._real = real
    self._actor_saving = actor_saving

  def save(self, step, model, optimizer=None, *args, **kwargs):
    self._actor_saving.flush_with_critic(model, optimizer)
    return self._real.save(step, model, optimizer, *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._real, name)


def _critic_trainer(learner: Any) -> Any:
  cluster = learner.rl_cluster
  return getattr(cluster, "critic_trainer", None) if hasattr(cluster, "critic_trainer") else None


def _pytree_save(tree: Any) -> Any:
  return ocp.args.PyTreeSave(item=tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), tree))


def _install_saving_manager(learner: Resumable) -> None:
  tunix_manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  current = api.orbax_manager(tunix_manager)
  if current is None or isinstance(current, _SavingManager):
    return
  current.wait_until_finished()
  directory = current.directory
  options = learner.rl_cluster.actor_trainer.config.checkpointing_options
  current.close()
  replacement = ocp.CheckpointManager(
      directory, item_handlers=_item_handlers(), options=options
  )
  saving = _SavingManager(replacement, learner)
  api.replace_orbax_manager(tunix_manager, saving)
  critic = _critic_trainer(learner)
  if critic is not None:
    critic.checkpoint_manager = _CriticCheckpointManager(critic.checkpoint_manager, saving)


def _item_handlers() -> dict[str, Any]:
  if "proxy" in os.getenv("JAX_PLATFORMS", ""):
    # Pathways: the same handler settings Tunix uses there.
    def pytree():
      return ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)
  else:
    pytree = ocp.PyTreeCheckpointHandler
  return {
      "model_params": pytree(),
      "optimizer_state": pytree(),
      "custom_metadata": ocp.JsonCheckpointHandler(),
      DATA_ITEM: checkpoint_lib.IteratorCheckpointHandler(),
      ROLLOUT_ITEM: pytree(),
      CRITIC_PARAMS_ITEM: pytree(),
      CRITIC_OPTIMIZER_ITEM: pytree(),
  }
