"""Where a learner's restored arrays live: the shardings a Tunix step's arrays are saved with and put back on.

A pending leaf that was a global array at save time is stored as this
process's copy (`GlobalArray`) or the blocks it held (`ShardedArray`) by
`for_checkpoint`, merged across the saved processes at a read
(`merged_across_processes`) and put back on its role's mesh by `to_device`;
the rollout's weights are saved with listable shards
(`with_addressable_shards`). And a restore puts the model and optimizer
leaves back on the shardings they were saved with (`read_saved_layouts`,
`apply_saved_layouts`): Tunix restores them with the freshly built model's
shardings, while the uninterrupted run's train step had left them on the ones
XLA chose; on a mesh of several devices the next update would then run
another program and give other bits. Orbax keeps each leaf's sharding in the
step's metadata; single-device models need none of this. `_items` writes and
reads the step's items.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import numpy as np

from ckpt_iter.tunix import _api as api
from ckpt_iter import errors
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib


def with_addressable_shards(leaf: Any) -> Any:
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
    for shard in with_addressable_shards(leaf).addressable_shards:
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


# ---------------------------------------------------------------------------
# Puts restored model and optimizer leaves back on the shardings they were saved with.


def _path_key(path: Any) -> tuple[str, ...]:
  """A pytree path as plain strings, so nnx state and Orbax metadata paths compare."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _layout_targets(trainer: Any) -> dict[str, Any]:
  """The objects Tunix saves as `model_params` / `optimizer_state`, and their state."""
  targets = {"model_params": (trainer.model, nnx.state(trainer.model))}
  if trainer.optimizer is not None:
    targets["optimizer_state"] = (trainer.optimizer, nnx.state(trainer.optimizer, nnx.optimizer.OptState))
  return targets


def read_saved_layouts(trainer: Any, step: int) -> dict[str, dict[tuple[str, ...], Any]]:
  """Partition specs the actor's params and optimizer state had when `step` was saved.

  Empty when every leaf lives on a single device (nothing to put back).
  """
  multi_device = any(
      isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1
      for leaf in jax.tree.leaves(nnx.state(trainer.model))
  )
  if not multi_device:
    return {}
  metadata = api.saved_item_metadata(trainer.checkpoint_manager, step)
  layouts = {}
  for item in ("model_params", "optimizer_state"):
    if metadata.get(item) is None:
      continue
    specs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(metadata[item]):
      layout = _saved_layout(leaf)
      if layout is not None:
        specs[_path_key(path)] = layout
    layouts[item] = specs
  return layouts


def _saved_layout(leaf: Any) -> tuple[tuple[str, ...], tuple[Any, ...]] | None:
  """(mesh axis names, partition spec) of a leaf of Orbax's item metadata, or None.

  Orbax v0's metadata leaf holds the sharding as Orbax's own record
  (`.sharding`); v1's (what Tunix main saves through) holds it as
  `.sharding_metadata`, and its `.sharding` builds a JAX sharding on this
  process's devices, which is not needed to read the spec.
  """
  sharding = getattr(leaf, "sharding_metadata", None) or getattr(leaf, "sharding", None)
  spec = getattr(sharding, "partition_spec", None)
  if spec is None:
    return None
  return tuple(sharding.axis_names), tuple(spec)


def apply_saved_layouts(trainer: Any, layouts: dict[str, dict[tuple[str, ...], Any]]) -> int:
  """Reshards restored params / optimizer leaves to their saved specs; returns how many."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  total = 0
  for item, (target, state) in _layout_targets(trainer).items():
    saved = layouts.get(item)
    if not saved:
      continue
    moved = 0

    def reshard(path: Any, leaf: Any) -> Any:
      nonlocal moved
      entry = saved.get(_path_key(path))
      if entry is None or not isinstance(leaf, jax.Array) or not isinstance(leaf.sharding, NamedSharding):
        return leaf
      axis_names, spec = entry
      mesh = leaf.sharding.mesh
      if tuple(mesh.axis_names) != axis_names:
        return leaf
      wanted = NamedSharding(mesh, PartitionSpec(*spec))
      # Equal, not merely equivalent: P("fsdp") and P("fsdp", "tp") with tp=1
      # place the same bytes but are different inputs to the compiled step.
      if wanted == leaf.sharding:
        return leaf
      moved += 1
      return jax.device_put(leaf, wanted)  # moves data only: the values are unchanged

    resharded = jax.tree_util.tree_map_with_path(reshard, state)
    if moved:
      nnx.update(target, resharded)
      total += moved
  return total
