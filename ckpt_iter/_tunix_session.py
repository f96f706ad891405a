"""The data side of one Resumable `train()` call.

A `DataSession` owns the learner's input (at a known position), the
repeat-order key chain and a record of what each mini-batch put in the
trainer's queue. At save time it turns those into the data state of the
checkpoint (what the trainer consumed, never what the producer read ahead);
at restore time it validates a saved state in full and applies it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from typing import Any

import jax

from ckpt_iter import _tunix_api as api
from ckpt_iter import _tunix_input
from ckpt_iter import _tunix_items as items
from ckpt_iter import _tunix_layouts as layouts_lib
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import errors
from ckpt_iter import repeat as repeat_lib
from ckpt_iter import state as state_lib

_LOG = logging.getLogger("ckpt_iter")
# The producer of a mini-batch never blocks, so this only trips on a hang.
_PRODUCER_TIMEOUT_SECONDS = 600.0


@dataclasses.dataclass
class MiniBatch:
  """What one mini-batch put in the trainer's queue, and where it left the input."""

  start_iter_steps: int  # actor trainer iter_steps when it began
  global_steps: int  # rl_cluster.global_steps while it runs
  index_in_global_step: int
  queue: list[Any] = dataclasses.field(default_factory=list)
  position_after: dict[str, Any] | None = None
  key_after: tuple[int, ...] | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


class DataSession:
  """The data side of one `train()` call: input, key chain, queue records."""

  def __init__(self, learner: Any, train_ds: Any):
    self.learner = learner
    self.input = _tunix_input.MicroBatchInput(
        _tunix_input.make_source(train_ds), split=self._split
    )
    self.key = learner._ci_initial_key  # pylint: disable=protected-access
    self.current: MiniBatch | None = None
    self.index_in_global_step = 0
    self._restored_pending: list[Any] | None = None
    self._first_global_step: int | None = None
    self._lock = threading.Lock()
    config = api.training_config(learner)
    first = self.input.peek_full_batch()  # as Tunix: the size of the first batch
    self.full_batch_size = len(first["prompts"])
    self.mini_batch_size = config.mini_batch_size or self.full_batch_size
    self.micro_batch_size = config.train_micro_batch_size or self.mini_batch_size
    self.mini_batches_per_global_step = self.full_batch_size // self.mini_batch_size
    self.fingerprint = {
        **self.input.source.fingerprint,
        "learner": items.tunix_learner_name(learner),
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

  def _split(self, full_batch: Any) -> list[Any]:
    if self.micro_batch_size == len(full_batch["prompts"]):
      return [full_batch]
    return api.split_full_batch(self.learner, full_batch, self.micro_batch_size)

  def tunix_input(self) -> list[Any]:
    """What Tunix's train() reads to size its batches (nothing else is read)."""
    return [{"prompts": [None] * self.full_batch_size}]

  # --- producer side ------------------------------------------------------------

  def begin_mini_batch(self) -> MiniBatch:
    cluster = self.learner.rl_cluster
    mini_batch = MiniBatch(
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
      pending_items = list(self._restored_pending or [])
      remaining = (self._first_global_step or 0) - (1 if pending_items else 0)
      # At a boundary the restore added the increment a finished global step
      # gets; the state records the step before it, as every other save does.
      mid_global_step = bool(pending_items) or remaining > 0
      global_steps = learner.rl_cluster.global_steps - (0 if mid_global_step else 1)
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
      # A rollout still due for several repeats is queued several times:
      # store it once, with the schedule saying where it comes back.
      first_index: dict[int, int] = {}
      for example in pending_items:
        first_index.setdefault(id(example), len(first_index))
      distinct = {index: example for example in pending_items
                  for index in [first_index[id(example)]]}
      origin = f"checkpoint step {step}"
      pending = state_lib.Pending(
          items=tuple(items.for_checkpoint(learner, distinct[i], origin) for i in range(len(distinct))),
          schedule=tuple(first_index[id(example)] for example in pending_items),
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
    data_dir = os.path.join(step_dir, items.DATA_ITEM)
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
    critic_state = items.read_critic_state(learner, manager, step, origin)
    mid_global_step = value.pending is not None or counters["remaining_mini_batches"] > 0
    rollout_params = None
    if learner.should_sync_weights and mid_global_step:
      rollout_params = items.read_rollout_params(learner, manager, step, origin)
    layouts = layouts_lib.read_saved_layouts(trainer, manager, step)
    # Placed before anything is applied: a pending global array whose mesh
    # this cluster lacks fails here, with nothing changed.
    saved_items = value.pending.items if value.pending is not None else ()
    on_device = [items.to_device(learner, item, origin) for item in saved_items]
    # All checks passed and everything is read: apply.
    self.input.apply(checked, value.position)
    self.key = repeat_lib.key_from_ints(value.shuffle_key)
    if value.pending is not None:
      self._restored_pending = [on_device[i] for i in value.pending.schedule]
    remaining = counters["remaining_mini_batches"]
    if mid_global_step:
      self._first_global_step = remaining + (1 if value.pending is not None else 0)
      global_steps = counters["global_steps"]
    else:
      global_steps = counters["global_steps"] + 1
    api.set_learner_iter_steps(learner, int(trainer.iter_steps))
    layouts_lib.apply_saved_layouts(trainer, layouts)
    if critic_state is not None:
      items.apply_critic_state(learner, critic_state, step)
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
    if rollout_params is None:
      # At a global-step boundary the uninterrupted run syncs the restored
      # actor weights right after the checkpoint: do that sync now.
      self._sync_rollout_from_actor()
    else:
      learner.rl_cluster.rollout.update_params(rollout_params, items.weight_filter(learner))

  def _sync_rollout_from_actor(self) -> None:
    """Tunix's weight sync, without the global-step increment that comes with it."""
    cluster = self.learner.rl_cluster
    global_steps = cluster.global_steps
    cluster.sync_weights()
    cluster.global_steps = global_steps

  def _restore_legacy(self, step: int, step_dir: str, policy: str) -> None:
    learner = self.learner
    mu = api.num_iterations(learner)
    grad_acc = api.training_config(learner).get_with_default("gradient_accumulation_steps", 1)
    if policy == "raise":
      raise errors.LegacyCheckpointError(
          f"checkpoint step {step} ({step_dir}) has no '{items.DATA_ITEM}' item: it was "
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
      self._sync_rollout_from_actor()
    _LOG.warning(
        "ckpt_iter: checkpoint step %d has no data state (legacy). Fast-forwarded "
        "%d input micro-batches (ceil(%d / num_iterations=%d) mini-batches x %d). "
        "%s The repeat-order key restarts at data_shuffle_seed.",
        step, micro_batches, step, mu, grad_acc,
        f"The last {lost} update(s) of the rollout that step {step} fell inside "
        "cannot be recovered and are skipped." if lost else "",
    )


