"""The Orbax items of a Tunix learner's step: what an RL learner adds, and reading them back.

`data` (the data state), `rollout_params` (the rollout model's weights, for a
step inside a global step after which a rollout reads them before the next
weight sync) and, for learners with a critic, `critic_params`
and `critic_optimizer_state`, in the same Orbax step as `model_params`, so
model and data state are always one checkpoint. RL, SFT and agentic learners
differ only in what they add (`StepItems`); how the items reach Orbax (v0: a
stand-in for Tunix's manager, v1: a wrapper of its `_save_checkpointables`),
the item handlers and the critic's deferred write are here once, and
`read_step_state` is the one reader of a step's data item for every learner.

Where the step's arrays live (the shardings they are saved with and put back
on) is `_shardings`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Callable, Protocol

from flax import nnx
import jax
import orbax.checkpoint as ocp
from tunix.rl import rl_learner

from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _settings as settings_lib
from ckpt_iter.tunix import _shardings as shardings
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import _item as item_lib
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib


# ---------------------------------------------------------------------------
# Writing: the one writer of ckpt_iter's items into a Tunix checkpoint, for every learner.

DATA_ITEM = "data"
ROLLOUT_ITEM = "rollout_params"
CRITIC_PARAMS_ITEM = "critic_params"
CRITIC_OPTIMIZER_ITEM = "critic_optimizer_state"
_OWN_ITEMS = frozenset({DATA_ITEM, ROLLOUT_ITEM, CRITIC_PARAMS_ITEM, CRITIC_OPTIMIZER_ITEM})


class _OwnItemsNotRestoredByTunix(logging.Filter):
  """Drops Orbax's `Item "data" was found in the checkpoint, but could not be restored`
  where it only means that Tunix's own restore left ckpt_iter's items alone.

  Tunix's `CheckpointManager` restores the model and optimizer and names no
  handler for the other items of the step (google-tunix 0.1.7 logs it twice
  per resume); ckpt_iter reads its items itself and logs what it restored.
  Only that warning, only for ckpt_iter's item names, and only from inside
  Tunix's checkpoint manager: a user's own Orbax restore still warns.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    if not (isinstance(record.msg, str) and record.msg.startswith('Item "%s" was found in the checkpoint')):
      return True
    if not (record.args and record.args[0] in _OWN_ITEMS):
      return True
    frame = sys._getframe(1)  # pylint: disable=protected-access  (a warning: rare, once per item)
    while frame is not None:
      if frame.f_code.co_filename.endswith(os.path.join("tunix", "sft", "checkpoint_manager.py")):
        return False
      frame = frame.f_back
    return True


def silence_tunix_restore_warning() -> None:
  """Installs the filter on absl's logger (which Orbax logs through), once."""
  logger = logging.getLogger("absl")
  if not any(isinstance(f, _OwnItemsNotRestoredByTunix) for f in logger.filters):
    logger.addFilter(_OwnItemsNotRestoredByTunix())


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """A data state taken at save time (IteratorSave reads it via .state())."""

  value: state_lib.IteratorState

  def state(self) -> state_lib.IteratorState:
    return self.value


@dataclasses.dataclass(frozen=True)
class Pytree:
  """An item ckpt_iter adds that is a pytree of arrays (weights, optimizer state)."""

  tree: Any


class StepItems(Protocol):
  """What one learner adds to each save of its trainer."""

  def add_items(self, step: int, items: dict[str, Any], custom_metadata: Any) -> Any:
    """Adds this learner's items to `items` (in place); returns the custom metadata to save."""

  def critic(self) -> Any:
    """The critic's trainer whose update K must be in step K too, or None."""


class DataStateOnly:
  """Adds the data item only: SFT trainers and the agentic learner's actor trainer."""

  def __init__(self, snapshot: Callable[[int], state_lib.IteratorState | None]):
    self._snapshot = snapshot

  def add_items(self, step: int, items: dict[str, Any], custom_metadata: Any) -> Any:
    value = self._snapshot(step)
    if value is not None:  # no feed: a save outside ckpt_iter's train()
      items[DATA_ITEM] = Snapshot(value)
    return custom_metadata

  def critic(self) -> Any:
    return None


def model_weight_filter(model: Any) -> Any:
  """The nnx filter of a model's trained weights: LoRA params when it has them."""
  from tunix.sft import utils as sft_utils  # pylint: disable=g-import-not-at-top

  return nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param


class _DataSaver:
  """Adds a learner's items to every save Tunix makes, in the same Orbax step.

  Tunix's own save policy decides which steps are written: ckpt_iter never
  changes it. With a critic (PPO) the actor's save of step K waits until the
  critic has made its update K; then the one Orbax step also holds the
  critic's params and optimizer state, so actor, critic and data state always
  come from the same trainer input, whatever moment the process dies.

  Subclasses write one step through one Orbax API (`_write`).
  """

  def __init__(self, step_items: StepItems):
    self._step_items = step_items
    self._deferred: tuple[Any, ...] | None = None

  def save_with_data(self, step, items, custom_metadata, force, extra) -> bool:
    items = dict(items)
    custom_metadata = self._step_items.add_items(step, items, custom_metadata)
    if self._step_items.critic() is not None:
      self._deferred = (step, items, custom_metadata, force, extra)
      return True
    return self._write(step, items, custom_metadata, force, extra)

  def _write(self, step, items, custom_metadata, force, extra) -> bool:
    raise NotImplementedError

  def flush_with_critic(self, critic_model: Any, critic_optimizer: Any) -> None:
    """Writes the deferred actor step, now that the critic made the same update."""
    if self._deferred is None:
      return
    step, items, custom_metadata, force, extra = self._deferred
    self._deferred = None
    items[CRITIC_PARAMS_ITEM] = Pytree(nnx.state(critic_model, model_weight_filter(critic_model)))
    if critic_optimizer is not None:
      items[CRITIC_OPTIMIZER_ITEM] = Pytree(nnx.state(critic_optimizer, nnx.optimizer.OptState))
    self._write(step, items, custom_metadata, force, extra)

  def flush_on_close(self) -> None:
    critic = self._step_items.critic()
    if critic is None or self._deferred is None:
      return
    if critic.train_steps >= self._deferred[0]:
      self.flush_with_critic(critic.model, critic.optimizer)
    else:
      # Closed between the actor's and the critic's update of this step:
      # the step would pair the actor with a stale critic, so it is dropped.
      self._deferred = None


class _SavingManager(_DataSaver):
  """Orbax v0: stands in for the Orbax manager inside Tunix's CheckpointManager."""

  def __init__(self, real: ocp.CheckpointManager, step_items: StepItems):
    super().__init__(step_items)
    self._real = real

  def save(self, step, args=None, custom_metadata=None, force=False, **kwargs):
    items = dict(args.items()) if args is not None else {}
    return self.save_with_data(step, items, custom_metadata, force, kwargs)

  def _write(self, step, items, custom_metadata, force, extra) -> bool:
    args = {}
    # The data item first: Orbax awaits the items' writes in this order in its
    # background thread, and the data item's write runs when awaited
    # (`checkpoint._WriteWhenAwaited`), so it overlaps the model's.
    for name, item in sorted(items.items(), key=lambda entry: entry[0] != DATA_ITEM):
      if isinstance(item, Snapshot):
        item = checkpoint_lib.IteratorSave(item)
      elif isinstance(item, Pytree):
        item = _pytree_save(item.tree)
      args[name] = item
    return self._real.save(
        step, args=ocp.args.Composite(**args), custom_metadata=custom_metadata,
        force=force, **extra,
    )

  def close(self) -> None:
    self.flush_on_close()
    self._real.close()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._real, name)


class _CheckpointablesSaver(_DataSaver):
  """Orbax v1: wraps Tunix's `_save_checkpointables`, which applies Tunix's policy."""

  def __init__(self, original: Any, step_items: StepItems):
    super().__init__(step_items)
    self._original = original

  def __call__(self, step, checkpointables, force, custom_metadata) -> bool:
    return self.save_with_data(step, checkpointables, custom_metadata, force, None)

  def _write(self, step, items, custom_metadata, force, extra) -> bool:
    del extra
    checkpointables = {}
    for name, item in items.items():
      if isinstance(item, Snapshot):
        item = checkpoint_lib.IteratorCheckpointable(item)
      elif isinstance(item, Pytree):
        item = item.tree
      checkpointables[name] = item
    return self._original(step, checkpointables, force, custom_metadata)


class _CriticCheckpointManager:
  """Stands in for the critic trainer's Tunix CheckpointManager.

  Its save() runs right after each critic update: the moment the deferred
  actor step can be written with the critic's matching state.
  """

  def __init__(self, real: Any, actor_saving: _DataSaver):
    self._real = real
    self._actor_saving = actor_saving

  def save(self, step, model, optimizer=None, *args, **kwargs):
    self._actor_saving.flush_with_critic(model, optimizer)
    return self._real.save(step, model, optimizer, *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._real, name)


def _pytree_save(tree: Any) -> Any:
  return ocp.args.PyTreeSave(item=tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), tree))


def writes_checkpoints(tunix_manager: Any) -> bool:
  """Whether Tunix's CheckpointManager writes real Orbax steps.

  False with checkpointing off, and for a stand-in (tests mock Tunix's
  CheckpointManager): the learner then behaves as stock.
  """
  backend = api.checkpoint_backend(tunix_manager)
  if backend == api.ORBAX_V0:
    return isinstance(api.orbax_manager(tunix_manager), (ocp.CheckpointManager, _SavingManager))
  if backend == api.ORBAX_V1:
    return api.orbax_checkpointer(tunix_manager) is not None
  return False


def restored_data_directory(tunix_manager: Any, step: int) -> str | None:
  """Where the data item of the step the model was restored from is; None when there is none to read.

  The one answer, for every learner, to "is there a checkpoint to restore
  the data from": None with checkpointing off or a stand-in manager
  (`writes_checkpoints`, the same answer `install` gets) and in a fresh run
  (step 0, or no checkpoint yet). A directory that holds no data item is a
  checkpoint stock Tunix wrote: each learner's legacy policy decides.
  """
  if not step or not writes_checkpoints(tunix_manager) or api.latest_step(tunix_manager) is None:
    return None
  return api.item_directory(tunix_manager, step, DATA_ITEM)


def install(tunix_manager: Any, step_items: StepItems) -> None:
  """Makes every save of this Tunix CheckpointManager carry `step_items` (idempotent).

  With a critic, the critic trainer's manager is wrapped too, so the actor's
  step K is written right after the critic's update K.
  """
  if not writes_checkpoints(tunix_manager):
    return
  if api.checkpoint_backend(tunix_manager) == api.ORBAX_V1:
    saving = _install_v1(tunix_manager, step_items)
  else:
    saving = _install_v0(tunix_manager, step_items)
  if saving is None:
    return
  critic = step_items.critic()
  if critic is not None:
    critic.checkpoint_manager = _CriticCheckpointManager(critic.checkpoint_manager, saving)


def _install_v0(tunix_manager: Any, step_items: StepItems) -> _DataSaver | None:
  current = api.orbax_manager(tunix_manager)
  if isinstance(current, _SavingManager):
    return None
  current.wait_until_finished()
  directory = current.directory
  # The options Tunix built its manager with: its own default policy when
  # checkpointing_options is None, the user's otherwise.
  options = api.orbax_manager_options(current)
  current.close()
  replacement = ocp.CheckpointManager(directory, item_handlers=_item_handlers(), options=options)
  saving = _SavingManager(replacement, step_items)
  api.replace_orbax_manager(tunix_manager, saving)
  return saving


def _install_v1(tunix_manager: Any, step_items: StepItems) -> _DataSaver | None:
  made: list[_DataSaver] = []

  def make(original: Any) -> Any:
    made.append(_CheckpointablesSaver(original, step_items))
    return made[0]

  if not api.wrap_save_checkpointables(tunix_manager, make):
    return None
  saving = made[0]
  close = tunix_manager.close

  def close_after_flush() -> None:
    saving.flush_on_close()
    close()

  tunix_manager.close = close_after_flush
  return saving


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


# ---------------------------------------------------------------------------
# Reading a step back.


def read_step_state(
    data_dir: str, step: int, *, learner_field: str, writer: str
) -> state_lib.IteratorState | None:
  """The data state of actor step `step`, checked as every learner needs; None when it has none.

  The one reader of a learner's data item (RL, SFT and agentic learners):
  this process's state, the resume recorded in its lineage, then the checks
  that do not depend on the learner: kind `tunix`, written by the same
  family (`learner_field` in the fingerprint; `writer` names the class for
  the message), and taken at the step the model was restored from. None
  means the step has no data item (written by stock Tunix): each learner's
  legacy policy decides.

  With another process count than the step's, every process reads all the
  saved states; when they are identical (Tunix's default: every process feeds
  the same batches) that state is this process's too, and the resume is
  recorded as resized.

  Raises:
    ProcessCountError: written by another number of JAX processes whose
      states differ (each fed its own data).
    InvalidStateError: corrupt, another learner's, or from another step.
  """
  origin = f"checkpoint step {step} ({data_dir})"
  try:
    # Another process count: exact when every saved process holds the same state (Tunix's default, every
    # process feeding the same batches), or their parts of a sharded pending leaf (joined).
    saved = item_lib.read_item_if_present(data_dir, jax.process_index(), jax.process_count(), replicated=True,
                                          join=_joined_sharded_item)
  except errors.PendingTypeError as e:
    raise _across_tunix_versions(e, data_dir) from None
  if saved is None:
    return None
  value = saved.resumed()  # this resume recorded in its lineage
  if value.kind != "tunix" or value.fingerprint.get(learner_field) is None:
    raise errors.InvalidStateError(
        f"{origin}: the data state was written by a {value.kind!r} iterator without "
        f"a {learner_field!r} field, not by {writer}. Restore it with the class that wrote it."
    )
  train_steps = value.counters.get("train_steps")
  if train_steps != step:
    raise errors.InvalidStateError(
        f"{origin}: the data state was taken at train step {train_steps!r}, "
        f"but the model was restored at step {step}; they must come from one step."
    )
  return value


def _joined_sharded_item(data_dir: str, saved_count: int) -> Any:
  """The saved state with every process's blocks of its sharded pending leaves, or None.

  Every process fed the same batches but held another part of a pending
  leaf sharded across processes: all N states are read (their arrays are
  the parts), and joined when nothing else differs.
  """
  states = [
      _files.read_state(data_dir, index, saved_count, count_is_saved=True)
      for index in range(saved_count)
  ]
  joined = shardings.merged_across_processes(states, data_dir)
  if joined is None:
    return None
  return item_lib.SavedState(
      joined, resized=True, origin=data_dir, step=item_lib.step_of_item_directory(data_dir))


def _across_tunix_versions(error: errors.PendingTypeError, data_dir: str) -> errors.PendingTypeError:
  """`error` with the two Tunix versions named and the ways through."""
  saved = None
  try:
    header = _files.read_header(_files.header_path(data_dir, 0, _files.saved_process_count(data_dir)))
    saved = settings_lib.saved_tunix_version(header.get("fingerprint") or {})
  except (OSError, errors.CkptIterError):
    pass  # the version is only named when the header says it
  written = f"google-tunix {saved}" if saved else "another google-tunix (not recorded)"
  return errors.PendingTypeError(
      f"{error} This process runs google-tunix {api.tunix_version()}; the checkpoint was "
      f"written with {written}, and the pending repeat it holds is of that Tunix's trainer "
      f"input type. Finish the repeat on {written}: resume there and stop at the next "
      "global-step boundary (a checkpoint with no pending inputs), which any Tunix version "
      "resumes; or resume here from an earlier checkpoint at a global-step boundary."
  )


def tunix_learner_name(learner: Any) -> str:
  for cls in type(learner).__mro__:
    if cls.__module__.startswith("tunix.") and issubclass(cls, rl_learner.RLLearner):
      return cls.__name__
  return type(learner).__name__


def weight_filter(learner: Any, model: Any = None) -> Any:
  return model_weight_filter(learner.rl_cluster.actor_trainer.model if model is None else model)


def rollout_params(learner: Any) -> Any:
  """The rollout model's weights, each leaf in a form Orbax can write."""
  weights = nnx.state(learner.rl_cluster.rollout.model(), weight_filter(learner))
  return jax.tree.map(shardings.with_addressable_shards, weights)




def read_rollout_params(learner: Any, step: int, origin: str) -> Any:
  """The rollout weights saved with a mid-global-step checkpoint."""
  tunix_manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  if not _storage.is_dir(api.item_directory(tunix_manager, step, ROLLOUT_ITEM)):
    raise errors.InvalidStateError(
        f"{origin}: the checkpoint falls inside a global step but has no "
        f"'{ROLLOUT_ITEM}' item, so the rollout weights of the rest of the step "
        "are unknown. It was not written by this ckpt_iter configuration."
    )
  return api.load_pytrees(tunix_manager, step, {ROLLOUT_ITEM: rollout_params(learner)})[ROLLOUT_ITEM]


def _critic_abstract_state(learner: Any) -> tuple[Any, Any]:
  critic = critic_trainer(learner)
  params = nnx.state(critic.model, weight_filter(learner, critic.model))
  optimizer = nnx.state(critic.optimizer, nnx.optimizer.OptState)
  return params, optimizer


def read_critic_state(learner: Any, step: int, origin: str) -> Any:
  """The critic's params and optimizer state saved in the actor's step."""
  if critic_trainer(learner) is None:
    return None
  tunix_manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  for item in (CRITIC_PARAMS_ITEM, CRITIC_OPTIMIZER_ITEM):
    if not _storage.is_dir(api.item_directory(tunix_manager, step, item)):
      raise errors.InvalidStateError(
          f"{origin}: this learner trains a critic, but the step has no '{item}' "
          "item, so actor and critic cannot be restored to the same input."
      )
  params, optimizer = _critic_abstract_state(learner)
  restored = api.load_pytrees(tunix_manager, step, {
      CRITIC_PARAMS_ITEM: params, CRITIC_OPTIMIZER_ITEM: optimizer,
  })
  return restored[CRITIC_PARAMS_ITEM], restored[CRITIC_OPTIMIZER_ITEM]


def apply_critic_state(learner: Any, critic_state: Any, step: int) -> None:
  critic = critic_trainer(learner)
  params, optimizer = critic_state
  nnx.update(critic.model, params)
  nnx.update(critic.optimizer, optimizer)
  grad_acc = api.training_config(learner).get_with_default("gradient_accumulation_steps", 1)
  iter_steps = step * grad_acc
  if api.packing_budget(learner) is not None:
    # The critic trains on every packed input the actor trains on.
    iter_steps = int(learner.rl_cluster.actor_trainer.iter_steps)
  api.set_trainer_steps(critic, step, iter_steps)




class RlStepItems:
  """What an RL learner adds to each actor save (`StepItems`).

  The data item, the rollout weights when a rollout reads them before the
  next weight sync (`_session.rollout_reads_before_sync`), and the metadata every
  other save has for the forced save in `close()`. A critic's update K goes
  with actor step K (see `_DataSaver`).
  """

  def __init__(self, learner: Any):
    self._learner = learner

  def add_items(self, step: int, items: dict[str, Any], custom_metadata: Any) -> Any:
    learner = self._learner
    value, rollout_weights = learner._ci_session.snapshot(step)  # pylint: disable=protected-access
    items[DATA_ITEM] = Snapshot(value)
    if rollout_weights:
      items[ROLLOUT_ITEM] = Pytree(rollout_params(learner))
    if not custom_metadata:
      custom_metadata = learner.rl_cluster.actor_trainer.custom_checkpoint_metadata()
    return custom_metadata

  def critic(self) -> Any:
    return critic_trainer(self._learner)


def critic_trainer(learner: Any) -> Any:
  """The critic's trainer (PPO), or None: RLCluster raises AttributeError without one."""
  return getattr(learner.rl_cluster, "critic_trainer", None)


def install_saving_manager(learner: Any) -> None:
  """Makes every actor save of this learner carry ckpt_iter's items (idempotent)."""
  install(learner.rl_cluster.actor_trainer.checkpoint_manager, RlStepItems(learner))

