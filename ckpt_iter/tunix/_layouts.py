"""Puts restored model and optimizer leaves back on the shardings they were saved with.

Tunix restores the actor's params and optimizer state with the shardings of
the freshly built model, but in the uninterrupted run the train step's outputs
drifted to the shardings XLA chose. On a mesh of several devices the next
update would then run another program (another reduction order) and give
other bits. Orbax keeps each leaf's sharding in the step's metadata, so a
resume can put it back. Single-device models need none of this.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax

from ckpt_iter.tunix import _api as api


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
