"""The Orbax items a Resumable learner adds to Tunix's actor checkpoints.

`data` (the data state), `rollout_params` (the rollout model's weights, for a
step inside a global step) and, for learners with a critic, `critic_params`
and `critic_optimizer_state`. They are written by standing in for the Orbax
manager inside Tunix's actor CheckpointManager, so they land in the same
Orbax step as `model_params`, and read back on restore.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx
import jax
import numpy as np
import orbax.checkpoint as ocp
from tunix.rl import rl_learner

from ckpt_iter.tunix import _api as api
from ckpt_iter import _item as item_lib
from ckpt_iter import _storage
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import elastic as elastic_lib
from ckpt_iter import errors
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

DATA_ITEM = "data"
ROLLOUT_ITEM = "rollout_params"
CRITIC_PARAMS_ITEM = "critic_params"
CRITIC_OPTIMIZER_ITEM = "critic_optimizer_state"


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """A data state taken at save time (IteratorSave reads it via .state())."""

  value: state_lib.IteratorState

  def state(self) -> state_lib.IteratorState:
    return self.value


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

  Raises:
    ProcessCountError: written by another number of JAX processes.
    InvalidStateError: corrupt, another learner's, or from another step.
  """
  origin = f"checkpoint step {step} ({data_dir})"
  try:
    saved = item_lib.read_item_if_present(data_dir, jax.process_index(), jax.process_count())
  except errors.ProcessCountError as e:
    # The generic advice (elastic=True) does not apply to a learner's state.
    raise errors.ProcessCountError(
        f"{origin}: written by {e.saved_count} JAX process(es); resuming with "
        f"{e.process_count} {elastic_lib.resize_refusal('tunix', {})} "
        f"Resume with {e.saved_count} processes.",
        saved_count=e.saved_count, process_count=e.process_count,
    ) from None
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


def tunix_learner_name(learner: Any) -> str:
  for cls in type(learner).__mro__:
    if cls.__module__.startswith("tunix.") and issubclass(cls, rl_learner.RLLearner):
      return cls.__name__
  return type(learner).__name__


def weight_filter(learner: Any, model: Any = None) -> Any:
  from tunix.sft import utils as sft_utils  # pylint: disable=g-import-not-at-top

  model = learner.rl_cluster.actor_trainer.model if model is None else model
  return nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param


def rollout_params(learner: Any) -> Any:
  return nnx.state(learner.rl_cluster.rollout.model(), weight_filter(learner))


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


@dataclasses.dataclass(frozen=True)
class GlobalArray:
  """A pending leaf that was a global array (not fully addressable) at save time.

  With several JAX processes Tunix hands the trainer TrainExamples whose
  log-prob fields are mesh-wide replicated arrays while the other fields are
  process-local, and its `shard_input` leaves such an input as it is. A
  restored leaf must be global again, with the same sharding, or the trainer
  would assemble another batch. Single-process states never hold one.

  Attributes:
    value: this process's copy of the (fully replicated) array.
    mesh_role: the `tunix.rl.rl_cluster.Role` value whose mesh it lived on.
    spec: its PartitionSpec, as a tuple of entries.
  """

  value: np.ndarray
  mesh_role: str
  spec: tuple[Any, ...]


codec.register_pytree_dataclass("ckpt_iter.tunix.GlobalArray", GlobalArray)


def for_checkpoint(learner: Any, pytree: Any, origin: str) -> Any:
  """`pytree` with each global (not fully addressable) array as a GlobalArray."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  meshes = learner.rl_cluster.r2m

  def wrap(path: Any, leaf: Any) -> Any:
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      return leaf
    where = f"{origin}: pending leaf {jax.tree_util.keystr(path)}"
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding) or not leaf.is_fully_replicated:
      raise errors.UnsupportedConfigError(
          f"{where} is a global array sharded across processes ({sharding}); "
          "ckpt_iter saves global pending arrays only when they are fully "
          "replicated, so this state cannot be saved exactly."
      )
    role = next((r for r, mesh in meshes.items() if mesh == sharding.mesh), None)
    if role is None:
      raise errors.UnsupportedConfigError(
          f"{where} lives on a mesh that is none of the cluster's role meshes "
          f"({sorted(r.value for r in meshes)}), so it could not be re-created on restore."
      )
    return GlobalArray(value=np.asarray(leaf), mesh_role=role.value, spec=tuple(sharding.spec))

  return jax.tree_util.tree_map_with_path(wrap, pytree)


def to_device(learner: Any, pytree: Any, origin: str) -> Any:
  """A restored pending item on device; GlobalArrays become global arrays again."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  def place(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
      return jax.device_put(leaf)
    if not isinstance(leaf, GlobalArray):
      return leaf
    meshes = learner.rl_cluster.r2m
    role = next((r for r in meshes if r.value == leaf.mesh_role), None)
    if not isinstance(leaf.value, np.ndarray):
      raise errors.InvalidStateError(
          f"{origin}: a pending global array holds {type(leaf.value).__name__}, not an array."
      )
    if role is None:
      raise errors.InvalidStateError(
          f"{origin}: a pending global array was saved on the mesh of role "
          f"{leaf.mesh_role!r}, which this cluster does not have "
          f"(roles: {sorted(r.value for r in meshes)})."
      )
    sharding = NamedSharding(meshes[role], PartitionSpec(*leaf.spec))
    value = leaf.value
    # Each process supplies its own copy, as the uninterrupted run held it.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree.map(place, pytree)


@dataclasses.dataclass(frozen=True)
class _Pytree:
  """An item ckpt_iter adds that is a pytree of arrays (weights, optimizer state)."""

  tree: Any


class _DataSaver:
  """Adds ckpt_iter's items to every actor save Tunix makes, in the same Orbax step.

  The data item (and the rollout weights when a step falls inside a global
  step) goes with every save, and the forced save in `close()` gets the
  metadata every other save has. Tunix's own save policy decides which steps
  are written: ckpt_iter never changes it.

  With a critic (PPO) the actor's save of step K waits until the critic has
  made its update K, then the one Orbax step also holds the critic's params
  and optimizer state: actor, critic and data state always come from the
  same trainer input, whatever moment the process dies.

  Subclasses write one step through one Orbax API (`_write`).
  """

  def __init__(self, learner: Any):
    self._learner = learner
    self._deferred: tuple[Any, ...] | None = None

  def save_with_data(self, step, items, custom_metadata, force, extra) -> bool:
    learner = self._learner
    session = learner._ci_session  # pylint: disable=protected-access
    items = dict(items)
    value, mid_global_step = session.snapshot(step)
    items[DATA_ITEM] = Snapshot(value)
    if learner.should_sync_weights and mid_global_step:
      items[ROLLOUT_ITEM] = _Pytree(rollout_params(learner))
    if not custom_metadata:
      custom_metadata = learner.rl_cluster.actor_trainer.custom_checkpoint_metadata()
    if critic_trainer(learner) is not None:
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
    items[CRITIC_PARAMS_ITEM] = _Pytree(nnx.state(critic_model, weight_filter(self._learner, critic_model)))
    if critic_optimizer is not None:
      items[CRITIC_OPTIMIZER_ITEM] = _Pytree(nnx.state(critic_optimizer, nnx.optimizer.OptState))
    self._write(step, items, custom_metadata, force, extra)

  def flush_on_close(self) -> None:
    critic = critic_trainer(self._learner)
    if critic is not None and self._deferred is not None:
      if critic.train_steps >= self._deferred[0]:
        self.flush_with_critic(critic.model, critic.optimizer)
      else:
        # Closed between the actor's and the critic's update of this step:
        # the step would pair the actor with a stale critic, so it is dropped.
        self._deferred = None


class _SavingManager(_DataSaver):
  """Orbax v0: stands in for the Orbax manager inside Tunix's CheckpointManager."""

  def __init__(self, real: ocp.CheckpointManager, learner: Any):
    super().__init__(learner)
    self._real = real

  def save(self, step, args=None, custom_metadata=None, force=False, **kwargs):
    items = dict(args.items()) if args is not None else {}
    return self.save_with_data(step, items, custom_metadata, force, kwargs)

  def _write(self, step, items, custom_metadata, force, extra) -> bool:
    args = {}
    for name, item in items.items():
      if isinstance(item, Snapshot):
        item = checkpoint_lib.IteratorSave(item)
      elif isinstance(item, _Pytree):
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

  def __init__(self, original: Any, learner: Any):
    super().__init__(learner)
    self._original = original

  def __call__(self, step, checkpointables, force, custom_metadata) -> bool:
    return self.save_with_data(step, checkpointables, custom_metadata, force, None)

  def _write(self, step, items, custom_metadata, force, extra) -> bool:
    del extra
    checkpointables = {}
    for name, item in items.items():
      if isinstance(item, Snapshot):
        item = checkpoint_lib.IteratorCheckpointable(item)
      elif isinstance(item, _Pytree):
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


def critic_trainer(learner: Any) -> Any:
  """The critic's trainer (PPO), or None: RLCluster raises AttributeError without one."""
  return getattr(learner.rl_cluster, "critic_trainer", None)


def _pytree_save(tree: Any) -> Any:
  return ocp.args.PyTreeSave(item=tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), tree))


def install_saving_manager(learner: Any) -> None:
  """Makes every actor save of this learner carry ckpt_iter's items (idempotent)."""
  tunix_manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  backend = api.checkpoint_backend(tunix_manager)
  if backend == api.ORBAX_V1:
    saving = _install_v1(learner, tunix_manager)
  else:
    saving = _install_v0(learner, tunix_manager)
  if saving is None:
    return
  critic = critic_trainer(learner)
  if critic is not None:
    critic.checkpoint_manager = _CriticCheckpointManager(critic.checkpoint_manager, saving)


def _install_v0(learner: Any, tunix_manager: Any) -> _DataSaver | None:
  current = api.orbax_manager(tunix_manager)
  if current is None or isinstance(current, _SavingManager):
    return None
  current.wait_until_finished()
  directory = current.directory
  # The options Tunix built its manager with: its own default policy when
  # checkpointing_options is None, the user's otherwise.
  options = api.orbax_manager_options(current)
  current.close()
  replacement = ocp.CheckpointManager(
      directory, item_handlers=_item_handlers(), options=options
  )
  saving = _SavingManager(replacement, learner)
  api.replace_orbax_manager(tunix_manager, saving)
  return saving


def _install_v1(learner: Any, tunix_manager: Any) -> _DataSaver | None:
  if api.orbax_checkpointer(tunix_manager) is None:
    return None
  made: list[_DataSaver] = []

  def make(original: Any) -> Any:
    made.append(_CheckpointablesSaver(original, learner))
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
