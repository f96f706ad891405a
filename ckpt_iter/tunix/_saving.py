"""The one writer of ckpt_iter's items into a Tunix checkpoint, for every learner.

Tunix's `CheckpointManager` saves a trainer's model and optimizer state;
ckpt_iter adds its own items to the same Orbax step, so model and data state
are always one checkpoint. RL, SFT and agentic learners differ only in what
they add (`StepItems`); how the items reach Orbax (v0: a stand-in for the
Orbax manager, v1: a wrapper of Tunix's `_save_checkpointables`), the item
handlers and the critic's deferred write live here once.
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

from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _api as api

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


def weight_filter(model: Any) -> Any:
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
    items[CRITIC_PARAMS_ITEM] = Pytree(nnx.state(critic_model, weight_filter(critic_model)))
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
    for name, item in items.items():
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
