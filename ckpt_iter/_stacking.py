"""Records stacked into a batch, and why a batch's records do not stack, said in the records' terms.

`stack_records` (make_dataset's batches, a StreamingIterator's) stacks first and asks here only when numpy or the
tree walk refused: the happy path pays nothing. The answer names the field
(its path in the record), the rows of the batch and their shapes or keys, and
the fix. Ragged fields are not batched as object arrays: JAX takes none, and
a pending item holding one could not be checkpointed (ckpt_iter never
pickles).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from ckpt_iter import errors

_SHOWN_ROWS = 8
_RAGGED = "ragged"


def stack_records(records: list[Any], *, batch_index: int | None = None) -> Any:
  """Stacks records into one batch: leaves gain a leading batch dimension.

  Raises:
    InvalidArgumentError: the records' fields differ in shape or keys; names
      the field, the rows and their shapes.
  """
  if not records:
    raise ValueError("cannot stack an empty list of records")
  # A list in a record is data (a JSON array, a Parquet list), not structure:
  # it becomes one array with the batch dimension in front.
  try:
    return jax.tree.map(_stacked, *records, is_leaf=_is_list)
  except (ValueError, TypeError) as e:  # diagnosed only now: the happy path pays nothing
    raise unstackable_error(records, batch_index, e) from None


def _stacked(*leaves: Any) -> np.ndarray:
  if len(leaves) == 1:
    # What np.stack makes of one row (same dtype, shape, values, memory order; a copy), at a
    # quarter of its cost: batches of one record are common (RL prompts per process).
    return np.asarray(leaves[0])[np.newaxis].copy(order="K")
  return np.stack([np.asarray(x) for x in leaves])


def _is_list(value: Any) -> bool:
  return isinstance(value, list)


def unstackable_error(records: list[Any], batch_index: int | None, cause: Exception) -> errors.InvalidArgumentError:
  """The error to raise for `records` that `stack_records` could not stack.

  Args:
    records: the batch's records, in row order.
    batch_index: the dataset element they form, when known.
    cause: what numpy or jax raised (shown when no field explains it).
  """
  where = "a batch" if batch_index is None else f"batch {batch_index}"
  fix = ("Give every record the same fields and shapes in make_dataset's `transform` (pad or truncate "
         "token lists to one length, e.g. with an attention mask), or batch ragged fields yourself "
         "after make_dataset; they are not stacked as object arrays, which JAX cannot take and a "
         "checkpoint cannot hold without pickling.")
  structure = _structure_difference(records)
  if structure is not None:
    return errors.InvalidArgumentError(f"{where}: the records have different fields: {structure}. {fix}")
  field = _first_ragged_field(records)
  if field is not None:
    name, shapes = field
    return errors.InvalidArgumentError(
        f"{where}: field {name!r} has different shapes in its rows, so it cannot be stacked into "
        f"one array: {_rows_by_shape(shapes)}. {fix}"
    )
  return errors.InvalidArgumentError(f"{where}: the records cannot be stacked ({type(cause).__name__}: {cause}). {fix}")


def _is_leaf(value: Any) -> bool:
  # As stack_records: a list in a record is data, not structure.
  return isinstance(value, list)


def _structure_difference(records: list[Any]) -> str | None:
  """How the first record of another structure differs from row 0's, or None."""
  first = jax.tree.structure(records[0], is_leaf=_is_leaf)
  for row, record in enumerate(records[1:], start=1):
    if jax.tree.structure(record, is_leaf=_is_leaf) != first:
      if isinstance(records[0], dict) and isinstance(record, dict):
        missing, extra = sorted(set(records[0]) - set(record), key=str), sorted(set(record) - set(records[0]), key=str)
        parts = ([f"lacks {missing}"] if missing else []) + ([f"has {extra} too"] if extra else [])
        if parts:
          return f"row {row} {' and '.join(parts)}, against row 0's keys {sorted(records[0], key=str)}"
      return f"row {row} is {_kind(record)}, row 0 is {_kind(records[0])}"
  return None


def _kind(record: Any) -> str:
  """A record's structure, for a message."""
  return errors.shown_value(str(jax.tree.structure(record, is_leaf=_is_leaf)), 80)


def _first_ragged_field(records: list[Any]) -> tuple[str, list[tuple[int, ...]]] | None:
  """(field name, each row's shape) of the first leaf whose shapes differ, or None."""
  flat = [jax.tree_util.tree_flatten_with_path(record, is_leaf=_is_leaf)[0] for record in records]
  for position, (path, _) in enumerate(flat[0]):
    shapes = [_shape(leaves[position][1]) for leaves in flat]
    if len(set(shapes)) > 1:
      return _field_name(path), shapes
  return None


def _shape(leaf: Any) -> tuple[int, ...] | str:
  try:
    return np.asarray(leaf).shape
  except ValueError:  # a ragged nested list: numpy cannot give it one shape
    return _RAGGED


def _rows_by_shape(shapes: list[Any]) -> str:
  """`rows [0, 2] have shape (3,), row 1 has shape (2,)`, most common shape first."""
  rows = collections.defaultdict(list)
  for row, shape in enumerate(shapes):
    rows[shape].append(row)
  parts = []
  for shape, members in sorted(rows.items(), key=lambda item: (-len(item[1]), item[1][0])):
    shown = members[:_SHOWN_ROWS] + (["..."] if len(members) > _SHOWN_ROWS else [])
    label = f"row {members[0]}" if len(members) == 1 else f"rows {shown}".replace("'...'", "...")
    if shape == _RAGGED:
      parts.append(f"{label} {'is' if len(members) == 1 else 'are'} ragged (nested lists of different lengths)")
    else:
      parts.append(f"{label} {'has' if len(members) == 1 else 'have'} shape {shape}")
  return ", ".join(parts)


def _field_name(path: tuple[Any, ...]) -> str:
  """`tokens`, `meta.ids`, `pair[1]`: a leaf's path as written; `<record>` for a bare leaf."""
  name = ""
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      name += f".{key.key}" if name else str(key.key)
    elif isinstance(key, jax.tree_util.SequenceKey):
      name += f"[{key.idx}]"
    elif isinstance(key, jax.tree_util.GetAttrKey):
      name += f".{key.name}" if name else key.name
    else:
      name += str(key)
  return name or "<record>"
