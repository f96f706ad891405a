"""The Orbax items of a Tunix learner's step: what an RL learner adds, and reading them back.

`data` (the data state), `rollout_params` (the rollout model's weights, for a
step inside a global step after which a rollout reads them before the next
weight sync) and, for learners with a critic, `critic_params`
and `critic_optimizer_state`. `_saving` writes them into the same Orbax step
as `model_params`; `read_step_state` is the one reader of a step's data item
for RL, SFT and agentic learners.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import numpy as np
from tunix.rl import rl_learner

from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _saving
from ckpt_iter.tunix import _settings as settings_lib
from ckpt_iter import _files
from ckpt_iter import _item as item_lib
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import lineage as lineage_lib
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

DATA_ITEM = _saving.DATA_ITEM
ROLLOUT_ITEM = _saving.ROLLOUT_ITEM
CRITIC_PARAMS_ITEM = _saving.CRITIC_PARAMS_ITEM
CRITIC_OPTIMIZER_ITEM = _saving.CRITIC_OPTIMIZER_ITEM


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
    saved = _read_saved(data_dir, origin)
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


def _read_saved(data_dir: str, origin: str) -> Any:
  """This process's saved state of the step (or the one all saved processes share)."""
  try:
    saved = item_lib.read_item_if_present(data_dir, jax.process_index(), jax.process_count())
  except errors.ProcessCountError as e:
    # Another process count: exact when every saved process holds the same
    # state (Tunix's default, every process feeding the same batches).
    try:
      saved = item_lib.read_replicated_item(data_dir, e.saved_count)
    except errors.UnsupportedConfigError as refusal:
      joined = _joined_sharded_item(data_dir, e.saved_count)
      if joined is not None:
        return joined
      # The generic advice (elastic=True) does not apply to a learner's state.
      raise errors.ProcessCountError(
          f"{origin}: written by {e.saved_count} JAX process(es); resuming with "
          f"{e.process_count} is exact only when every saved process holds the "
          f"same data state. {refusal}",
          saved_count=e.saved_count, process_count=e.process_count,
      ) from None
  return saved


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
  joined = merged_across_processes(states, data_dir)
  if joined is None:
    return None
  return item_lib.SavedState(
      joined, resized=True, origin=data_dir, step=lineage_lib.step_of_item_directory(data_dir))


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
  return _saving.weight_filter(learner.rl_cluster.actor_trainer.model if model is None else model)


def rollout_params(learner: Any) -> Any:
  """The rollout model's weights, each leaf in a form Orbax can write."""
  weights = nnx.state(learner.rl_cluster.rollout.model(), weight_filter(learner))
  return jax.tree.map(_with_addressable_shards, weights)


def _with_addressable_shards(leaf: Any) -> Any:
  """`leaf`, or the same buffers re-assembled when it cannot list its shards.

  Tunix moves weights to a rollout mesh with `jax.device_put`; across
  processes, onto the same devices in another mesh shape, that can give an
  array held as one multi-device piece, whose `addressable_shards` (which
  Orbax's writer reads) raises. Re-assembling its per-device buffers makes
  a plain global array of the same sharding, without copying data.
  """
  if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
    return leaf
  try:
    _ = leaf.addressable_shards
    return leaf
  except ValueError:
    pass
  pieces = [leaf.addressable_data(i) for i in range(len(leaf.sharding.addressable_devices))]
  return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces)


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


@dataclasses.dataclass(frozen=True)
class ShardedArray:
  """A pending leaf that was a global array sharded across processes at save time.

  Each process stores the blocks it holds (its addressable shards, each
  once), keyed by where they sit in the whole array ("start:stop" per axis,
  comma-joined). A restore with the saved process count re-creates the
  array from each process's own blocks; with another count the blocks of
  all saved processes are joined first (`merged_across_processes`), which
  needs every other part of the saved states to agree.

  Attributes:
    blocks: {"start:stop,...": this block's values}.
    shape: the whole array's shape.
    mesh_role: the `tunix.rl.rl_cluster.Role` value whose mesh it lived on.
    spec: its PartitionSpec, as a tuple of entries.
  """

  blocks: dict[str, np.ndarray]
  shape: tuple[int, ...]
  mesh_role: str
  spec: tuple[Any, ...]


codec.register_pytree_dataclass("ckpt_iter.tunix.ShardedArray", ShardedArray)


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
  bounds = (axis.indices(size)[:2] for axis, size in zip(index, shape))
  return ",".join(f"{start}:{stop}" for start, stop in bounds)


def _block_slices(key: Any, shape: tuple[int, ...], where: str) -> tuple[slice, ...]:
  """The slices block `key` names, checked against the array's shape."""
  parts = key.split(",") if isinstance(key, str) else []
  if len(parts) != len(shape):
    raise errors.InvalidStateError(
        f"{where}: block key {key!r} does not name one 'start:stop' per axis of shape {shape}.")
  slices = []
  for part, size in zip(parts, shape):
    bounds = part.split(":")
    if len(bounds) != 2 or not all(b.isdigit() for b in bounds):
      raise errors.InvalidStateError(f"{where}: block key {key!r} has malformed bounds {part!r}.")
    start, stop = (int(b) for b in bounds)
    if not start <= stop <= size:
      raise errors.InvalidStateError(
          f"{where}: block key {key!r} reaches outside an axis of size {size}.")
    slices.append(slice(start, stop))
  return tuple(slices)


def for_checkpoint(learner: Any, pytree: Any, origin: str) -> Any:
  """`pytree` with each global (not fully addressable) array as a GlobalArray or ShardedArray."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  meshes = learner.rl_cluster.r2m

  def wrap(path: Any, leaf: Any) -> Any:
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      return leaf
    where = f"{origin}: pending leaf {jax.tree_util.keystr(path)}"
    sharding = leaf.sharding
    role = None
    if isinstance(sharding, NamedSharding):
      role = next((r for r, mesh in meshes.items() if mesh == sharding.mesh), None)
    if role is None:
      raise errors.UnsupportedConfigError(
          f"{where} lives on a mesh that is none of the cluster's role meshes "
          f"({sorted(r.value for r in meshes)}), so it could not be re-created on restore."
      )
    spec = tuple(sharding.spec)
    if leaf.is_fully_replicated:
      return GlobalArray(value=np.asarray(leaf), mesh_role=role.value, spec=spec)
    blocks = {}
    for shard in _with_addressable_shards(leaf).addressable_shards:
      key = _block_key(shard.index, leaf.shape)
      if key not in blocks:  # a block held by several local devices is stored once
        blocks[key] = np.asarray(shard.data)
    return ShardedArray(blocks=blocks, shape=tuple(leaf.shape), mesh_role=role.value, spec=spec)

  return jax.tree_util.tree_map_with_path(wrap, pytree)


def to_device(learner: Any, pytree: Any, origin: str) -> Any:
  """A restored pending item on device; Global/ShardedArrays become global arrays again."""

  def place(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
      return jax.device_put(leaf)
    if isinstance(leaf, GlobalArray):
      if not isinstance(leaf.value, np.ndarray):
        raise errors.InvalidStateError(
            f"{origin}: a pending global array holds {type(leaf.value).__name__}, not an array."
        )
      value = leaf.value
      # Each process supplies its own copy, as the uninterrupted run held it.
      return jax.make_array_from_callback(
          value.shape, _role_sharding(learner, leaf, origin), lambda index: value[index])
    if isinstance(leaf, ShardedArray):
      return _sharded_to_device(learner, leaf, origin)
    return leaf

  return jax.tree.map(place, pytree)


def _role_sharding(learner: Any, leaf: GlobalArray | ShardedArray, origin: str) -> Any:
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  meshes = learner.rl_cluster.r2m
  role = next((r for r in meshes if r.value == leaf.mesh_role), None)
  if role is None:
    raise errors.InvalidStateError(
        f"{origin}: a pending global array was saved on the mesh of role "
        f"{leaf.mesh_role!r}, which this cluster does not have "
        f"(roles: {sorted(r.value for r in meshes)})."
    )
  return NamedSharding(meshes[role], PartitionSpec(*leaf.spec))


def _sharded_to_device(learner: Any, leaf: ShardedArray, origin: str) -> Any:
  """The global array whose blocks `leaf` holds, each process supplying its own devices' part."""
  where = f"{origin}: pending sharded array"
  shape = leaf.shape
  if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
    raise errors.InvalidStateError(f"{where}: field 'shape' is {shape!r}, not a tuple of sizes.")
  if not isinstance(leaf.blocks, dict) or not leaf.blocks:
    raise errors.InvalidStateError(f"{where}: field 'blocks' holds no blocks.")
  blocks = {}
  for key, block in leaf.blocks.items():
    slices = _block_slices(key, shape, where)
    extent = tuple(s.stop - s.start for s in slices)
    if not isinstance(block, np.ndarray) or block.shape != extent:
      raise errors.InvalidStateError(
          f"{where}: block {key!r} is {getattr(block, 'shape', type(block).__name__)}, "
          f"not an array of shape {extent}.")
    if blocks and block.dtype != next(iter(blocks.values())).dtype:
      raise errors.InvalidStateError(f"{where}: block {key!r} is {block.dtype}, another dtype than the others.")
    blocks[key] = block
  sharding = _role_sharding(learner, leaf, origin)
  whole: list[tuple[np.ndarray, np.ndarray]] = []  # (values, which are saved), built once if needed

  def block_at(index: tuple[slice, ...]) -> np.ndarray:
    key = _block_key(index, shape)
    if key in blocks:  # the same mesh: a device takes the block it held
      return blocks[key]
    if not whole:  # another layout: cut from the blocks put together
      if math.prod(shape) > sum(block.size for block in blocks.values()):
        raise errors.InvalidStateError(
            f"{where}: the saved blocks ({sorted(blocks)}) hold fewer values than shape "
            f"{shape}, so they do not cover {key!r}, which a device of this process needs.")
      first = next(iter(blocks.values()))
      values, saved = np.zeros(shape, first.dtype), np.zeros(shape, bool)
      for block_key, block in blocks.items():
        where_ = _block_slices(block_key, shape, where)
        values[where_], saved[where_] = block, True
      whole.append((values, saved))
    values, saved = whole[0]
    if not saved[index].all():
      raise errors.InvalidStateError(
          f"{where}: the saved blocks ({sorted(blocks)}) do not cover {key!r}, which a "
          "device of this process needs; a process of this count must read the blocks "
          "of every saved process (restored with the saved count but another mesh?).")
    return values[index]

  return jax.make_array_from_callback(shape, sharding, block_at)


def merged_across_processes(states: list[state_lib.IteratorState], origin: str) -> state_lib.IteratorState | None:
  """The state of `states` with each ShardedArray holding every saved process's blocks.

  None unless the states differ only in those blocks (every process fed the
  same batches, and only where a pending leaf was sharded across processes
  does each hold another part): then a process of any count can take its
  devices' blocks from the joined state.
  """
  def without_blocks(state: state_lib.IteratorState) -> state_lib.IteratorState:
    return _map_sharded(state, lambda leaf: dataclasses.replace(leaf, blocks={}))

  first = codec.state_parts(without_blocks(states[0]))
  if any(codec.state_parts(without_blocks(s)) != first for s in states[1:]):
    return None
  joined_blocks: list[dict[str, np.ndarray]] = []

  def collect(leaf: ShardedArray) -> ShardedArray:
    joined_blocks.append({})
    return leaf

  _map_sharded(states[0], collect)
  if not joined_blocks:
    return None  # no sharded leaf: the states differ in something else
  for state in states:
    counter = iter(range(len(joined_blocks)))

    def join(leaf: ShardedArray) -> ShardedArray:
      into = joined_blocks[next(counter)]
      for key, block in leaf.blocks.items():
        if key in into and not np.array_equal(into[key], block):
          raise errors.InvalidStateError(
              f"{origin}: two saved processes hold different values for block {key!r} "
              "of a pending sharded array.")
        into.setdefault(key, block)
      return leaf

    _map_sharded(state, join)
  counter = iter(range(len(joined_blocks)))
  return _map_sharded(states[0], lambda leaf: dataclasses.replace(leaf, blocks=joined_blocks[next(counter)]))


def _map_sharded(state: state_lib.IteratorState, fn: Any) -> state_lib.IteratorState:
  """`state` with `fn` applied to each ShardedArray of its pending items, in a fixed order."""
  if state.pending is None:
    return state
  is_sharded = lambda node: isinstance(node, ShardedArray)  # noqa: E731
  items = tuple(
      jax.tree.map(lambda node: fn(node) if is_sharded(node) else node, item, is_leaf=is_sharded)
      for item in state.pending.items
  )
  return dataclasses.replace(state, pending=dataclasses.replace(state.pending, items=items))


class RlStepItems:
  """What an RL learner adds to each actor save (`_saving.StepItems`).

  The data item, the rollout weights when a rollout reads them before the
  next weight sync (`_session.rollout_reads_before_sync`), and the metadata every
  other save has for the forced save in `close()`. A critic's update K goes
  with actor step K (see `_saving._DataSaver`).
  """

  def __init__(self, learner: Any):
    self._learner = learner

  def add_items(self, step: int, items: dict[str, Any], custom_metadata: Any) -> Any:
    learner = self._learner
    value, rollout_weights = learner._ci_session.snapshot(step)  # pylint: disable=protected-access
    items[DATA_ITEM] = _saving.Snapshot(value)
    if rollout_weights:
      items[ROLLOUT_ITEM] = _saving.Pytree(rollout_params(learner))
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
  _saving.install(learner.rl_cluster.actor_trainer.checkpoint_manager, RlStepItems(learner))
