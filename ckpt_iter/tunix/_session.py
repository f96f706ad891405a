"""The data side of one Resumable `train()` call.

A `DataSession` owns the learner's input (at a known position), the
repeat-order key chain and a record of what each mini-batch put in the
trainer's queue. At save time it turns those into the data state of the
checkpoint (what the trainer consumed, never what the producer read ahead);
at restore time it validates a saved state in full and applies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from typing import Any, Callable, Iterator

from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _settings as settings_lib
from ckpt_iter.tunix import _input
from ckpt_iter.tunix import _items as items
from ckpt_iter.tunix import _shardings as shardings
from ckpt_iter import _codec as codec
from ckpt_iter import _drift
from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import replay as replay_lib
from ckpt_iter import state as state_lib

_LOG = logging.getLogger("ckpt_iter")
# The learner's batch geometry: fields a resume may change when the input
# continues at the same prompt (`DataSession._continuation`; the audit's rule too).
_CONTINUABLE_LEARNER_FIELDS = _drift.LEARNER_GEOMETRY
# How a mini-batch is cut into trainer inputs and rollout batches; a resume may
# change them when the mini-batches stay the same (`_resplit_micro_batches`).
_MICRO_BATCH_FIELDS = ("train_micro_batch_size", "rollout_micro_batch_size", "compute_logps_micro_batch_size")
_SPLIT_FIELDS = ("full_batch_size", "mini_batch_size")
# The producer of a mini-batch never blocks, so this only trips on a hang.
_PRODUCER_TIMEOUT_SECONDS = 600.0
# Counter of a mid-global-step state: 1 when the step holds the rollout weights.
ROLLOUT_WEIGHTS_COUNTER = "rollout_weights"


def _position_in_micro_batches(position: Any, saved_micro_batch: Any, micro_batch: int) -> Any:
  """A saved input position re-counted in micro-batches of `micro_batch` prompts.

  `micro_batches_taken` counts micro-batches of the size that saved it; the
  rows they hold are what a resume with another size must skip. Malformed
  positions are returned as they are, for the input's check to refuse.
  """
  if (
      saved_micro_batch == micro_batch or not isinstance(position, dict)
      or not state_lib.is_int(position.get("micro_batches_taken")) or not state_lib.is_int(saved_micro_batch)
      or not state_lib.is_int(position.get("rows_taken", 0))
  ):
    return position
  rows = position.get("rows_taken", position["micro_batches_taken"] * saved_micro_batch)
  taken, rest = divmod(rows, micro_batch)
  result = {key: value for key, value in position.items() if key != "rows_taken"}
  result["micro_batches_taken"] = taken
  if rest:
    result["rows_taken"] = rows
  return result


def _inside_global_step(value: state_lib.IteratorState) -> str | None:
  """Why the batch geometry cannot change at `value`'s checkpoint (None: it is at a global-step boundary)."""
  if value.pending is not None or value.counters["remaining_mini_batches"] > 0:
    return "the checkpoint falls inside a global step, whose pending inputs belong to the old batches"
  return None


def _inside_full_batch(position: dict[str, Any]) -> str | None:
  """Why a record-counting input cannot continue at its saved state (None: the next prompt starts it)."""
  rows = position.get("rows_taken", position.get("micro_batches_taken"))
  if rows:
    return ("the checkpoint is inside a full batch of the old size, whose rest the saved input state "
            "does not start")
  return None


def _changes_text(differences: dict[str, Any]) -> str:
  return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(differences.items()))


def rollout_reads_before_sync(
    *,
    remaining_mini_batches: int,
    pending_inputs: int,
    has_eval_input: bool,
    evaluates: bool,
    eval_every_n_steps: int,
    train_steps: int,
    gradient_accumulation_steps: int,
    packed: bool,
) -> bool:
  """Whether a rollout runs on the rollout model after this checkpoint, before the next weight sync.

  Tunix syncs the rollout model from the actor at the end of a global step.
  Before that, the rollout model is read by the rollouts of the global step's
  remaining mini-batches and by an evaluation rollout, which Tunix runs at
  the first trainer input of a mini-batch whose train step is a multiple of
  `eval_every_n_steps` when the mini-batch has no evaluation input yet. The
  pending inputs of the current mini-batch are restored, never rolled out
  again. So a checkpoint needs the rollout weights only where one of those
  rollouts follows it.
  """
  if remaining_mini_batches > 0:
    return True
  if not pending_inputs or not evaluates or has_eval_input:
    return False
  if packed:
    return True  # packed trainer inputs: their train steps are not known here
  updates = -(-pending_inputs // gradient_accumulation_steps)
  return any((train_steps + update) % eval_every_n_steps == 0 for update in range(updates))


@dataclasses.dataclass
class MiniBatch:
  """What one mini-batch put in the trainer's queue, and where it left the input."""

  start_iter_steps: int  # actor trainer iter_steps when it began
  start_train_steps: int  # actor trainer train_steps when it began
  global_steps: int  # rl_cluster.global_steps while it runs
  index_in_global_step: int
  queue: list[Any] = dataclasses.field(default_factory=list)
  # The evaluation input Tunix gives this mini-batch's trainer inputs once it
  # prepared one (at its first input at a multiple of eval_every_n_steps),
  # and whether it came from the checkpoint rather than from a rollout here.
  eval_input: list[Any] | None = None
  eval_restored: bool = False
  position_after: dict[str, Any] | None = None
  key_after: tuple[int, ...] | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None  # what ended the producer, if it failed


class DataSession:
  """The data side of one `train()` call: input, key chain, queue records."""

  def __init__(self, learner: Any, train_ds: Any):
    self.learner = learner
    source = _input.make_source(train_ds)
    self.key = learner._ci_initial_key  # pylint: disable=protected-access
    self.current: MiniBatch | None = None
    self.index_in_global_step = 0
    self.evaluates = False  # whether train() was given an evaluation input (Tunix's truth test)
    self._restored_pending: list[Any] | None = None
    self._restored_eval: list[Any] | None = None
    self._first_global_step: int | None = None
    self.lineage: Any = None  # the restored state's, with its resume
    self._lock = threading.Lock()
    config = api.training_config(learner)
    first = source.peek()  # as Tunix: the sizes come from the first batch
    self.full_batch_size = len(first["prompts"])
    self.mini_batch_size = config.mini_batch_size or self.full_batch_size
    self.micro_batch_size = config.train_micro_batch_size or self.mini_batch_size
    # As Tunix: full batches pass through untouched (whatever their size) when
    # the micro batch is the first batch's size; otherwise Tunix re-batches.
    self.input = _input.MicroBatchInput(
        source,
        None if self.micro_batch_size == self.full_batch_size else self.micro_batch_size,
        rebatch=lambda full_batches, size: api.micro_batch_iterator(learner, full_batches, size),
    )
    self.mini_batches_per_global_step = self.full_batch_size // self.mini_batch_size
    # Sequence packing: the trainer takes packed inputs, not queue items.
    self.packing = api.packing_budget(learner)
    self.packing_per_pass = self.packing is not None and api.packing_updates_per_pass()
    # The learner's own fields; the input's are in its state, which the
    # learner's position nests (`_input.INPUT`).
    self.fingerprint = {
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
    if self.packing is not None:
      # Another budget packs the pending sequences into other trainer inputs.
      self.fingerprint["max_seq_token_per_tpu"] = int(self.packing)
    # Changeable on resume, with a warning (not compared as the fields above are).
    settings: dict[str, Any] = api.algorithm_settings(learner)
    settings[settings_lib.TUNIX_VERSION] = api.tunix_version()
    self.fingerprint[settings_lib.SETTINGS_FIELD] = settings_lib.encode_settings(settings)

  def tunix_input(self) -> list[Any]:
    """What Tunix's train() reads to size its batches (nothing else is read)."""
    return [{"prompts": [None] * self.full_batch_size}]

  # --- producer side ------------------------------------------------------------

  def begin_mini_batch(self) -> MiniBatch:
    cluster = self.learner.rl_cluster
    mini_batch = MiniBatch(
        start_iter_steps=cluster.actor_trainer.iter_steps,
        start_train_steps=cluster.actor_trainer.train_steps,
        global_steps=cluster.global_steps,
        index_in_global_step=self.index_in_global_step,
    )
    self.index_in_global_step += 1
    with self._lock:
      self.current = mini_batch
    return mini_batch

  def finished(self) -> bool:
    """True when the restored step is the run's last: max_steps reached at a global-step boundary."""
    trainer = self.learner.rl_cluster.actor_trainer
    max_steps = api.training_config(self.learner).max_steps
    return (
        max_steps is not None and trainer.train_steps >= max_steps
        and self._restored_pending is None and self._first_global_step is None
    )

  def take_restored_pending(self, mini_batch: MiniBatch) -> list[Any] | None:
    """The restored pending inputs, for `mini_batch` (with the evaluation input they had)."""
    pending, self._restored_pending = self._restored_pending, None
    restored_eval, self._restored_eval = self._restored_eval, None
    if pending is not None and restored_eval is not None:
      mini_batch.eval_input, mini_batch.eval_restored = restored_eval, True
    return pending

  # --- evaluation inputs ---------------------------------------------------------
  #
  # Tunix prepares one evaluation input per mini-batch, at its first trainer
  # input whose train step is a multiple of eval_every_n_steps, and passes it
  # to that and every later update of the mini-batch (each update with one
  # evaluates). A checkpoint inside a mini-batch holds that input, so the
  # resumed rest of the mini-batch evaluates with it, as the uninterrupted run
  # does, rather than with none (the restored mini-batch starts later).

  def current_eval_input(self) -> list[Any] | None:
    with self._lock:
      mini_batch = self.current
    return None if mini_batch is None else mini_batch.eval_input

  def record_eval_input(self, eval_input: list[Any]) -> None:
    with self._lock:
      mini_batch = self.current
    if mini_batch is not None and mini_batch.eval_input is None:
      mini_batch.eval_input = eval_input

  @contextlib.contextmanager
  def restored_evaluation(self) -> Iterator[None]:
    """While training: an update Tunix gives no evaluation input gets the restored one.

    Only the mini-batch a mid-mini-batch checkpoint resumed has one (its
    `eval_restored`); every other update is passed through unchanged.
    """
    cluster = self.learner.rl_cluster
    names = [name for name in ("update_actor", "update_critic") if hasattr(cluster, name)]
    own = {name: vars(cluster).get(name) for name in names}

    def with_restored_eval(update: Any) -> Any:
      def call(train_ds, eval_ds=None, skip_jit=False):
        if eval_ds is None:
          with self._lock:
            mini_batch = self.current
          if mini_batch is not None and mini_batch.eval_restored:
            eval_ds = mini_batch.eval_input
        return update(train_ds, eval_ds, skip_jit)
      return call

    for name in names:
      setattr(cluster, name, with_restored_eval(getattr(cluster, name)))
    try:
      yield
    finally:
      for name in names:
        if own[name] is None:
          delattr(cluster, name)
        else:
          setattr(cluster, name, own[name])

  def take_first_global_step_size(self, per_global_step: int) -> int:
    size, self._first_global_step = self._first_global_step, None
    return per_global_step if size is None else size

  # --- save side ------------------------------------------------------------

  def snapshot(self, step: int) -> tuple[state_lib.IteratorState, bool]:
    """The data state matching actor checkpoint `step`, and whether it needs the rollout weights.

    With a separate rollout model, a step inside a global step holds its
    weights only where a rollout reads them before the next weight sync
    (`rollout_reads_before_sync`); its counter `rollout_weights` says which.
    """
    learner = self.learner
    trainer = learner.rl_cluster.actor_trainer
    self.lineage = item_lib.started(self.lineage, step)
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
      position, key = self.input.position(), codec.key_to_ints(self.key)
    else:
      if not mini_batch.done.wait(_PRODUCER_TIMEOUT_SECONDS):
        raise errors.CkptIterError(
            f"checkpoint step {step}: the data producer did not finish its mini-batch "
            f"in {_PRODUCER_TIMEOUT_SECONDS:.0f}s; not saving a data state that could be wrong."
        )
      if mini_batch.error is not None:
        raise errors.CkptIterError(
            f"checkpoint step {step}: the data producer failed on its mini-batch ({type(mini_batch.error).__name__}: "
            f"{mini_batch.error}); not saving a data state that could be wrong."
        ) from mini_batch.error
      pending_items = self._unconsumed(mini_batch, step)
      remaining = self.mini_batches_per_global_step - 1 - mini_batch.index_in_global_step
      global_steps = mini_batch.global_steps
      position, key = _input.settled(mini_batch.position_after), mini_batch.key_after
    pending = None
    eval_input = () if mini_batch is None or mini_batch.eval_input is None else tuple(mini_batch.eval_input)
    if mini_batch is None and self._restored_eval is not None:
      eval_input = tuple(self._restored_eval)
    if pending_items:
      # A rollout still due for several repeats is queued several times:
      # store it once, with the schedule saying where it comes back. The
      # mini-batch's evaluation input follows, outside the schedule.
      first_index: dict[int, int] = {}
      for example in pending_items:
        first_index.setdefault(id(example), len(first_index))
      distinct = {index: example for example in pending_items
                  for index in [first_index[id(example)]]}
      origin = f"checkpoint step {step}"
      stored = [distinct[i] for i in range(len(distinct))] + list(eval_input)
      pending = state_lib.Pending(
          items=tuple(shardings.for_checkpoint(learner, item, origin) for item in stored),
          schedule=tuple(first_index[id(example)] for example in pending_items),
      )
    else:
      eval_input = ()  # at a mini-batch boundary the next one decides afresh
    mid_global_step = bool(pending_items) or remaining > 0
    config = api.training_config(learner)
    rollout_weights = mid_global_step and learner.should_sync_weights and rollout_reads_before_sync(
        remaining_mini_batches=remaining,
        pending_inputs=len(pending_items),
        has_eval_input=bool(eval_input),
        evaluates=self.evaluates,
        eval_every_n_steps=int(config.eval_every_n_steps),
        train_steps=int(trainer.train_steps),
        gradient_accumulation_steps=int(config.get_with_default("gradient_accumulation_steps", 1)),
        packed=self.packing is not None,
    )
    value = state_lib.IteratorState(
        kind="tunix",
        fingerprint=self.fingerprint,
        position=position,
        shuffle_key=key,
        pending=pending,
        lineage=self.lineage,
        counters={
            "train_steps": int(trainer.train_steps),
            "actor_iter_steps": int(trainer.iter_steps),
            "global_steps": int(global_steps),
            "remaining_mini_batches": int(remaining),
            "mini_batches_per_global_step": int(self.mini_batches_per_global_step),
            **({"eval_items": len(eval_input)} if eval_input else {}),
            **({ROLLOUT_WEIGHTS_COUNTER: int(rollout_weights)}
               if mid_global_step and learner.should_sync_weights else {}),
        },
    )
    return value, rollout_weights

  def _unconsumed(self, mini_batch: MiniBatch, step: int) -> list[Any]:
    """What `mini_batch` queued that the trainer has not trained with yet."""
    trainer = self.learner.rl_cluster.actor_trainer
    queue = mini_batch.queue
    consumed = int(trainer.iter_steps) - mini_batch.start_iter_steps
    if self.packing is None:
      # One trainer input per queue item.
      if not 0 <= consumed <= len(queue):
        raise errors.CkptIterError(
            f"checkpoint step {step}: the trainer consumed {consumed} inputs of a "
            f"mini-batch that queued {len(queue)}; refusing to save a wrong state."
        )
      return queue[consumed:]
    if self.packing_per_pass:
      return self._unconsumed_passes(mini_batch, step, consumed)
    return self._unconsumed_packed_rows(queue, step, consumed)

  def _unconsumed_passes(self, mini_batch: MiniBatch, step: int, consumed: int) -> list[Any]:
    """Tunix main: packed chunks update once per pass of mini_batch_size x num_generations sequences.

    A checkpoint follows an update, so the trainer has consumed whole passes:
    the queue items after them are pending, and packing them again from an
    empty packer gives the chunks the uninterrupted run trains next.
    """
    trainer = self.learner.rl_cluster.actor_trainer
    queue = mini_batch.queue
    updates = int(trainer.train_steps) - mini_batch.start_train_steps
    per_update = self.mini_batch_size * api.num_generations(self.learner)
    sequences = updates * per_update
    if not 0 <= updates <= consumed:
      raise errors.CkptIterError(
          f"checkpoint step {step}: {updates} packed updates from {consumed} packed "
          "trainer inputs of this mini-batch; refusing to save a wrong state."
      )
    done = 0
    for index, example in enumerate(queue):
      if done == sequences:
        return queue[index:]
      done += api.rows_of(example)
    if done == sequences:
      return []
    raise errors.CkptIterError(
        f"checkpoint step {step}: {updates} packed updates of {per_update} sequences "
        f"do not end between two of the {len(queue)} queued inputs ({done} sequences); "
        "refusing to save a wrong state."
    )

  def _unconsumed_packed_rows(self, queue: list[Any], step: int, consumed: int) -> list[Any]:
    """google-tunix 0.1.7: one packed row per trainer input, greedy, in queue order.

    Replays the packer's decisions (its own unpadding, its own token counts)
    to find the sequence the next packed row starts with. The pending inputs
    start there: the rest of that queue item (its leading rows dropped), then
    the items after it. Tunix's packer starts every row from an empty buffer,
    so packing them again gives exactly the rows the uninterrupted run trains
    next, bit for bit.
    """
    if consumed == 0:
      return list(queue)
    budget = self.packing
    packed = tokens_in_row = 0
    for index, example in enumerate(queue):
      for row, tokens in enumerate(api.unpadded_lengths(example)):
        if tokens > budget:
          continue  # Tunix skips it (with a warning), wherever it is
        if tokens_in_row + tokens > budget:
          packed, tokens_in_row = packed + 1, 0
          if packed == consumed:
            rest = [api.drop_leading_rows(example, row)] if row else [example]
            return rest + queue[index + 1:]
        tokens_in_row += tokens
    if tokens_in_row:
      packed += 1
    if packed == consumed:
      return []
    raise errors.CkptIterError(
        f"checkpoint step {step}: the trainer consumed {consumed} packed inputs of a "
        f"mini-batch that packs into {packed}; refusing to save a wrong state."
    )

  # --- restore side ------------------------------------------------------------

  def restore(self, on_legacy_checkpoint: str, allow_drift: frozenset[str]) -> None:
    learner = self.learner
    trainer = learner.rl_cluster.actor_trainer
    step = int(trainer.train_steps)
    data_dir = items.restored_data_directory(trainer.checkpoint_manager, step)
    if data_dir is None:
      return  # checkpointing off, or a fresh run
    origin = f"checkpoint step {step} ({data_dir})"
    value = items.read_step_state(data_dir, step, learner_field="learner", writer="a Resumable RL learner")
    if value is None:
      self._restore_legacy(step, os.path.dirname(data_dir), on_legacy_checkpoint)
      return
    # Its position against its batch geometry, its counters (verify's check too).
    state_lib.check_learner_position(value, origin, step=step)
    counters = value.counters
    eval_items = counters.get("eval_items", 0)
    saved_settings = settings_lib.split_settings(value.fingerprint)[1]
    current_settings = settings_lib.split_settings(self.fingerprint)[1]
    move_input = self._continuation(value, allow_drift, origin)
    critic_state = items.read_critic_state(learner, step, origin)
    mid_global_step = value.pending is not None or counters["remaining_mini_batches"] > 0
    rollout_params = None
    # States written before the counter existed always hold the weights mid-step.
    if learner.should_sync_weights and mid_global_step and counters.get(ROLLOUT_WEIGHTS_COUNTER, 1):
      rollout_params = items.read_rollout_params(learner, step, origin)
    layouts = shardings.read_saved_layouts(trainer, step)
    # Placed before anything is applied: a pending global array whose mesh
    # this cluster lacks fails here, with nothing changed.
    saved_items = value.pending.items if value.pending is not None else ()
    on_device = [shardings.to_device(learner, item, origin) for item in saved_items]
    # All checks passed and everything is read: apply.
    content_check = move_input()
    self.key = codec.key_from_ints(value.shuffle_key)
    self.lineage = value.lineage
    if value.pending is not None:
      self._restored_pending = [on_device[i] for i in value.pending.schedule]
      if eval_items:
        self._restored_eval = on_device[len(on_device) - eval_items:]
    remaining = counters["remaining_mini_batches"]
    if mid_global_step:
      self._first_global_step = remaining + (1 if value.pending is not None else 0)
      global_steps = counters["global_steps"]
    else:
      global_steps = counters["global_steps"] + 1
    if self.packing is not None and "actor_iter_steps" in counters:
      # Packed, a trainer input is a packed row or chunk, not train_steps x
      # gradient_accumulation_steps of them (what Tunix restores).
      api.set_trainer_steps(trainer, step, int(counters["actor_iter_steps"]))
    api.set_learner_iter_steps(learner, int(trainer.iter_steps))
    shardings.apply_saved_layouts(trainer, layouts)
    if critic_state is not None:
      items.apply_critic_state(learner, critic_state, step)
    self._restore_rollout_weights(rollout_params)
    learner.rl_cluster.global_steps = global_steps
    settings_lib.warn_settings_changes(settings_lib.settings_changes(saved_settings, current_settings), origin)
    _LOG.info(
        "ckpt_iter: restored the data state of step %d: %s; %d pending trainer inputs, "
        "%d more mini-batches in this global step%s; content check: %s.",
        step, state_lib.position_text(value.kind, state_lib.position_fields(value), value.position),
        len(value.pending or ()), remaining,
        "" if rollout_params is None else ", the rollout weights of the last sync",
        content_check,
    )

  def _resplit_micro_batches(
      self, value: state_lib.IteratorState, saved: dict[str, Any], allow_drift: frozenset[str], origin: str
  ) -> frozenset[str]:
    """The micro-batch sizes that changed where only how a mini-batch is split changes.

    A smaller micro-batch (after an out-of-memory crash, say) with the same
    full and mini-batch sizes cuts the same mini-batches into more pieces:
    which prompts come next does not change, so the input continues at the
    same prompt, as stock Tunix does. Pending inputs of a repeat in progress
    are micro-batches of the old size, so such a checkpoint is refused unless
    the change is allowed explicitly.

    Raises:
      ConfigDriftError: the checkpoint holds pending inputs of the old size.
    """
    changed = {name: (saved.get(name), self.fingerprint[name]) for name in _MICRO_BATCH_FIELDS
               if name in saved and saved[name] != self.fingerprint[name]}
    if not changed or any(saved.get(name) != self.fingerprint[name] for name in _SPLIT_FIELDS):
      return frozenset()
    if value.pending is not None and not set(changed) <= allow_drift:
      old = saved.get("train_micro_batch_size")
      raise errors.ConfigDriftError(changed, origin=(
          f"{origin} (a repeat is in progress: its {len(value.pending.schedule)} pending trainer "
          f"inputs are micro-batches of {old} prompts; resume with train_micro_batch_size={old} "
          "until the next global step starts, or from a checkpoint at a global-step boundary)"))
    _LOG.warning(
        "ckpt_iter: %s: the micro-batch sizes changed (%s) with the same full and mini-batches; "
        "the input continues at the same prompt, in micro-batches of the new size.",
        origin, ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())),
    )
    return frozenset(changed)

  def _continuation(
      self, value: state_lib.IteratorState, allow_drift: frozenset[str], origin: str
  ) -> Callable[[], str]:
    """Where the input continues from `value`: the one answer, for an RL learner, to "does a
    changed input continue the saved stream, and where".

    * Only the micro-batch sizes changed (`_resplit_micro_batches`): the same
      prompts come next, in micro-batches of the new size.
    * The full or mini-batch size changed, at a global-step boundary, over an
      input whose position counts stream records (`_input.counts_records`, a
      make_dataset pipeline): the input is handed its saved state, and its own
      restore continues at the saved record under the new batch size
      (`_drift.reconcile`).
    * Otherwise the input's own restore decides (`_input.check_learner_state`);
      where it refuses an input that cannot count records (a hand-built
      MapDataset of batches), the prompt count decides
      (`_prompt_count_continuation`).

    Returns:
      The apply step: moves the input, returns what its content check found.

    Raises:
      ConfigDriftError: naming the fields, and why the stream cannot continue.
      InvalidStateError: the position is malformed.
    """
    saved_input, position = _input.input_part(value, origin)
    saved, _ = settings_lib.split_settings(value.fingerprint)
    current, _ = settings_lib.split_settings(self.fingerprint)
    resplit = self._resplit_micro_batches(value, saved, allow_drift, origin)
    position = _position_in_micro_batches(position, saved.get("train_micro_batch_size"), self.micro_batch_size)
    state_lib.check_micro_batch_position(position, origin)
    drift = state_lib.differing_fields(saved, current, allow_drift=allow_drift | resplit)
    regeometry = set(drift) & _CONTINUABLE_LEARNER_FIELDS
    accepted = allow_drift | resplit
    if regeometry and _input.counts_records(saved_input) and set(drift) <= _CONTINUABLE_LEARNER_FIELDS:
      reason = _inside_global_step(value) or _inside_full_batch(position)
      if reason is not None:
        raise errors.ConfigDriftError(drift, origin=f"{origin} (it cannot continue here: {reason})")
      accepted |= regeometry  # the input's own restore decides where its stream continues
    try:
      checked = _input.check_learner_state(
          saved, current, self.input.source, saved_input, allow_drift=accepted, origin=origin,
          optional_learner_fields=("max_seq_token_per_tpu",),
      )
    except errors.ConfigDriftError as refused:
      return self._prompt_count_continuation(value, saved_input, position, refused, origin)
    if not regeometry:
      def apply() -> str:
        return self.input.apply(checked, position)
      return apply
    _LOG.warning(
        "ckpt_iter: %s: the batch geometry changed at a global-step boundary (%s); the input's own "
        "restore continues its stream at the saved record, continuing at prompt %s.",
        origin, _changes_text(drift), position.get("stream_rows", saved_input.position.get(_input.NEXT_RECORD)),
    )

    def apply_regeometry() -> str:
      return f"{self.input.apply(checked, position)} (the batches are cut anew from the saved record)"

    return apply_regeometry

  def _prompt_count_continuation(
      self, value: state_lib.IteratorState, saved_input: state_lib.IteratorState, position: dict[str, Any],
      drift: errors.ConfigDriftError, origin: str,
  ) -> Callable[[], str]:
    """Where a changed input that cannot count records continues, or `drift` re-raised with the reason.

    Tunix's own tests resume with another global batch size, or on a dataset
    the first run saw a prefix of (`ds[0:1]` then `ds`), over hand-built
    MapDatasets of batches, whose position is a batch index. That continues
    when nothing but the input and the batch geometry changed, the
    checkpoint is at a global-step boundary (no pending examples of the old
    geometry), and this input holds, just before a batch boundary at the
    same prompt count, the prompts the checkpoint's run trained last
    (`GrainSource.row_boundary`). An input that counts records has decided
    by its own restore: its refusal stands.
    """
    if isinstance(drift, errors.ContentDriftError) or _input.counts_records(saved_input):
      # The same pipeline produced other data, or the input's own rule refused the change.
      raise drift
    if replay_lib.refuses_stream(drift.differences):
      raise drift  # a replayed iterable that is not the saved stream: its message says why
    blocking = (set(drift.differences) & set(self.fingerprint)) - _CONTINUABLE_LEARNER_FIELDS
    reason = None
    if blocking:
      reason = f"{sorted(blocking)} change what the saved state means"
    else:
      reason = _inside_global_step(value)
    if reason is None and not isinstance(position.get("stream_rows"), int):
      reason = "the checkpoint does not record how many prompts were consumed (written by an older ckpt_iter)"
    if reason is None:
      next_index, reason = self.input.source.row_boundary(position["stream_rows"], _input.saved_last_rows(position))
    if reason is not None:
      raise errors.ConfigDriftError(
          drift.differences, origin=f"{origin} (it cannot continue here: {reason})") from None
    _LOG.warning(
        "ckpt_iter: the input changed since the checkpoint (%s); continuing at prompt %d "
        "of the new input, which holds the same prompts up to there.",
        _changes_text(drift.differences), position["stream_rows"],
    )

    def apply() -> str:
      self.input.continue_at(next_index, position)
      return "not applicable (a changed pipeline continues at the same prompt)"

    return apply

  def _restore_rollout_weights(self, rollout_params: Any) -> None:
    learner = self.learner
    if not learner.should_sync_weights:
      return  # the rollout model is the actor model
    if rollout_params is None:
      # At a global-step boundary the uninterrupted run syncs the restored
      # actor weights right after the checkpoint: do that sync now. Inside a
      # global step whose checkpoint needed no rollout weights, nothing reads
      # the rollout model before the next sync; the restored actor's weights
      # are the closest it can hold meanwhile.
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
    if policy == "fast_forward" and self.packing is not None and not self.packing_per_pass:
      raise errors.UnsupportedConfigError(
          f"checkpoint step {step} ({step_dir}) has no '{items.DATA_ITEM}' item, and "
          f"on_legacy_checkpoint='fast_forward' cannot skip by train steps with "
          f"max_seq_token_per_tpu={self.packing} on this Tunix: a train step is "
          "a packed row, not a mini-batch, so how many prompts were consumed was "
          "never recorded. Start from an empty checkpoint directory."
      )
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


