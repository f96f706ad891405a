"""State values <-> their stored form: a JSON header plus named numpy arrays.

Two codecs, both lossless and both refusing what they cannot store exactly:
  * Grain positions <-> JSON. Grain states may hold int dict keys and tuples
    (interleave's `future_states`), which plain JSON turns into strings and
    lists; numpy scalars, which Grain's own handler rejects.
  * Pending items <-> a JSON structure plus named arrays for npz. Per item
    (format versions 1 and 2; read, no longer written): each item's
    structure, one array per leaf (`decode_pytree`). By structure (version 3
    on, written: `encode_items` / `decode_items`): the items that share a
    structure (the same tree, leaf dtypes and shapes) are one group; each
    array leaf of a group is one array stacked along a new first axis, each
    Python scalar leaf one list. A queue of 100,000 small items is then a few
    arrays, not 200,000 npz members under a 16 MB header.

Only registered dataclasses are ever built back, so a file cannot name an
arbitrary type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import sys
from collections.abc import Mapping, Sequence  # not typing's: its isinstance is ~3x slower
from typing import Any, Callable

import numpy as np

from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.state import IteratorState

MAX_ARRAY_BYTES = 16 * 2**30
MAX_NESTING = state_lib.MAX_NESTING

_RESERVED_ITEMS = "__ckpt_iter_items__"
_RESERVED_TUPLE = "__ckpt_iter_tuple__"
_short = state_lib.short_repr
_is_int = state_lib.is_int
_is_json_scalar = state_lib.is_json_scalar

# ---------------------------------------------------------------------------
# JSON form of Grain positions: keeps int dict keys and tuples, turns numpy
# scalar types (Grain's own handler would reject them) into JSON numbers.


def position_to_json(value: Any, _depth: int = 0) -> Any:
  """Converts a Grain iterator state to JSON-safe values, losslessly."""
  if _depth > MAX_NESTING:
    raise errors.InvalidStateError("position is nested deeper than 64 levels.")
  if isinstance(value, Mapping):
    keys = list(value)
    if all(isinstance(k, str) for k in keys) and not (
        {_RESERVED_ITEMS, _RESERVED_TUPLE} & set(keys)
    ):
      return {k: position_to_json(v, _depth + 1) for k, v in value.items()}
    return {
        _RESERVED_ITEMS: [
            [position_to_json(k, _depth + 1), position_to_json(v, _depth + 1)]
            for k, v in value.items()
        ]
    }
  if isinstance(value, tuple):
    return {_RESERVED_TUPLE: [position_to_json(v, _depth + 1) for v in value]}
  if isinstance(value, list):
    return [position_to_json(v, _depth + 1) for v in value]
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, np.generic):
    return value.item()
  if _is_json_scalar(value):
    return value
  if isinstance(value, bytes):
    raise errors.InvalidStateError(
        "position holds bytes; ckpt_iter stores Grain states as JSON. Use a "
        "Grain dataset iterator (not the DataLoader) as the source."
    )
  raise errors.InvalidStateError(
      f"position holds a {type(value).__name__} ({_short(value)}), which is not "
      "JSON data; a Grain iterator state must be made of dicts, lists and scalars."
  )


def position_from_json(value: Any, _depth: int = 0) -> Any:
  """Inverse of `position_to_json`."""
  if _depth > MAX_NESTING:
    raise errors.InvalidStateError("position is nested deeper than 64 levels.")
  if isinstance(value, Mapping):
    # len + membership: the same test as set(value) == {key}, without building sets.
    if len(value) == 1 and _RESERVED_ITEMS in value:
      pairs = value[_RESERVED_ITEMS]
      if not isinstance(pairs, list) or not all(
          isinstance(p, list) and len(p) == 2 for p in pairs
      ):
        raise errors.InvalidStateError(
            f"position: {_RESERVED_ITEMS} must be a list of [key, value] pairs."
        )
      result = {}
      for k, v in pairs:
        key = position_from_json(k, _depth + 1)
        try:
          hash(key)  # also catches a tuple holding a list
        except TypeError:
          raise errors.InvalidStateError(f"position: unhashable key {_short(key)}.") from None
        result[key] = position_from_json(v, _depth + 1)
      return result
    if len(value) == 1 and _RESERVED_TUPLE in value:
      items = value[_RESERVED_TUPLE]
      if not isinstance(items, list):
        raise errors.InvalidStateError(f"position: {_RESERVED_TUPLE} must be a list.")
      return tuple(position_from_json(v, _depth + 1) for v in items)
    return {k: position_from_json(v, _depth + 1) for k, v in value.items()}
  if isinstance(value, list):
    return [position_from_json(v, _depth + 1) for v in value]
  return value




def encode_state(state: IteratorState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Splits a state into a JSON header and named numpy arrays."""
  arrays: dict[str, np.ndarray] = {}
  header = state.to_dict()
  header["position"] = position_to_json(header["position"])
  if state.pending is not None:
    header["pending"] = {
        "groups": encode_items(state.pending.items, arrays, prefix="a"),
        "schedule": list(state.pending.schedule),
    }
  header["arrays"] = {
      name: {"dtype": array.dtype.str, "shape": list(array.shape)}
      for name, array in arrays.items()
  }
  return header, arrays


def state_parts(state: IteratorState) -> dict[str, str]:
  """A SHA-256 of each part of a state as it is stored: its header fields and each array.

  Two states are bit-identical exactly when their parts are, and comparing
  parts names what differs.
  """
  header, arrays = encode_state(state)
  parts = header_parts(header)
  for name, array in arrays.items():
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    parts[f"array {name}"] = digest.hexdigest()
  return parts


def header_parts(header: Mapping[str, Any]) -> dict[str, str]:
  """A SHA-256 of each field of a state's header (each fingerprint field on its own)."""
  parts = {}
  for name, value in header.items():
    if name == "fingerprint" and isinstance(value, Mapping):
      for field, field_value in value.items():
        parts[f"fingerprint.{field}"] = _json_digest(field_value)
    else:
      parts[name] = _json_digest(value)
  return parts


def _json_digest(value: Any) -> str:
  text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(text.encode()).hexdigest()


def array_specs(header: Mapping[str, Any], *, origin: str) -> dict[str, ArraySpec]:
  """Validates the 'arrays' manifest of a header, without reading any array."""
  manifest = header.get("arrays", {})
  if not isinstance(manifest, Mapping):
    raise errors.InvalidStateError(f"{origin}: field 'arrays' must be a dict, got {_short(manifest)}.")
  specs = {}
  # A pending queue holds many arrays of a few kinds: each (dtype, shape)
  # is validated once (the checks depend on nothing else).
  checked: dict[tuple[Any, ...], ArraySpec] = {}
  for name, spec in manifest.items():
    if not isinstance(name, str) or not name.isidentifier():
      raise errors.InvalidStateError(
          f"{origin}: array name {_short(name)} is not a plain identifier "
          "(names may not be paths)."
      )
    if not isinstance(spec, Mapping) or len(spec) != 2 or "dtype" not in spec or "shape" not in spec:
      raise errors.InvalidStateError(f"{origin}: arrays[{name!r}] must be {{dtype, shape}}, got {_short(spec)}.")
    key = _spec_key(spec)
    known = checked.get(key) if key is not None else None
    if known is not None:
      specs[name] = known
      continue
    try:
      # Only the dtype strings ckpt_iter writes: a dict or list spec would
      # build a structured dtype (and can overflow inside numpy).
      if not isinstance(spec["dtype"], str):
        raise TypeError("not a dtype string")
      dtype = np.dtype(spec["dtype"])
    except (TypeError, ValueError, OverflowError):
      raise errors.InvalidStateError(
          f"{origin}: arrays[{name!r}].dtype {_short(spec['dtype'])} is not a numpy dtype."
      ) from None
    if dtype.hasobject or dtype.kind == "V":
      raise errors.InvalidStateError(
          f"{origin}: arrays[{name!r}].dtype {dtype} is not allowed (object and void dtypes need pickling)."
      )
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**40 for d in shape) or len(shape) > 32:
      raise errors.InvalidStateError(f"{origin}: arrays[{name!r}].shape {_short(shape)} is not a valid shape.")
    result = ArraySpec(dtype=dtype.str, shape=tuple(int(d) for d in shape))
    if result.nbytes > MAX_ARRAY_BYTES:
      raise errors.InvalidStateError(
          f"{origin}: arrays[{name!r}] claims {result.nbytes} bytes "
          f"(shape {list(result.shape)}, {dtype}); the limit is {MAX_ARRAY_BYTES}. "
          "The state is corrupt."
      )
    specs[name] = result
    if key is not None:
      checked[key] = result
  return specs


def _spec_key(spec: Mapping[str, Any]) -> tuple[Any, ...] | None:
  """A hashable form of a manifest entry whose fields are plain (a str and a list of ints)."""
  dtype, shape = spec["dtype"], spec["shape"]
  if type(dtype) is not str or type(shape) is not list or not all(type(d) is int for d in shape):
    return None
  return (dtype, *shape)


def decode_state(
    header: Mapping[str, Any],
    load_array: Callable[[str, ArraySpec], np.ndarray],
    *,
    origin: str = "the state",
) -> IteratorState:
  """Inverse of `encode_state`. `load_array` must check dtype and shape."""
  body = state_lib.migrate(header, origin=origin)
  specs = array_specs(body, origin=origin)
  body.pop("arrays", None)
  body["position"] = position_from_json(state_lib.require(body, "position", Mapping, origin))
  pending = body.get("pending")
  if pending is not None:

    def load(name: str) -> np.ndarray:
      if not isinstance(name, str) or name not in specs:
        raise errors.InvalidStateError(
            f"{origin}: pending refers to array {_short(name)}, which is not in the manifest."
        )
      return load_array(name, specs[name])

    if _by_structure(body, origin):
      items = decode_items(pending, load, origin=origin)
    else:
      state_lib.validated_pending(pending, origin)  # shape of the lists before decoding
      items = [decode_pytree(item, load, origin=origin) for item in pending["items"]]
    body["pending"] = {"items": items, "schedule": pending["schedule"]}
  return state_lib.validated(body, origin)


def header_state(header: Mapping[str, Any], *, origin: str) -> IteratorState:
  """The state a header holds, its arrays not read: for positions, schedules and lineage.

  Pending items are left as stored (by structure: each None), their count and
  schedule checked.
  """
  body = state_lib.migrate(header, origin=origin)
  pending = body.get("pending")
  if pending is not None and _by_structure(body, origin):
    count = item_count(pending, origin=origin)
    body["pending"] = {"items": [None] * count, "schedule": pending["schedule"]}
  return state_lib.validated(body, origin)


def _by_structure(body: Mapping[str, Any], origin: str) -> bool:
  """Whether a migrated header's pending items are stored by structure (its shape checked)."""
  if body["format_version"] < BY_STRUCTURE_VERSION:
    return False
  pending = body["pending"]
  if not isinstance(pending, Mapping) or set(pending) != {"groups", "schedule"}:
    raise errors.InvalidStateError(
        f"{origin}: field 'pending' must be a dict with 'groups' and 'schedule' "
        f"(format_version {body['format_version']}), got {_short(pending)}."
    )
  return True


# ---------------------------------------------------------------------------
# Pending items <-> a JSON structure plus named numpy arrays.

# The format version whose pending items are stored by structure.
BY_STRUCTURE_VERSION = 3


_DATACLASSES: dict[str, type] = {}
_DATACLASS_NAMES: dict[type, str] = {}


def _fields_for(cls: type, name: str, saved: Mapping[str, Any], origin: str) -> dict[str, Any]:
  """The saved fields `cls` is built from: another version of its library may add or drop some.

  A field the saved item lacks is left to its default in `cls`; a saved field
  `cls` lacks is dropped when it holds None (an optional field left unset).
  Anything else would change what the item means.

  Raises:
    PendingTypeError: a required field is missing, or a dropped one held a value.
  """
  fields = {f.name: f for f in dataclasses.fields(cls)}
  missing = sorted(
      n for n, f in fields.items() if n not in saved
      and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
  holding = sorted(n for n in saved if n not in fields and saved[n] is not None)
  if missing or holding:
    problems = []
    if holding:
      problems.append(f"holds {holding}, which {cls.__module__}.{cls.__qualname__} here does not have")
    if missing:
      problems.append(f"lacks {missing}, which it requires here")
    raise errors.PendingTypeError(
        f"{origin}: pending {name} {' and '.join(problems)}: it was written with another "
        f"version of the library that defines it (saved fields {sorted(saved)}, here "
        f"{sorted(fields)})."
    )
  return {n: v for n, v in saved.items() if n in fields}


def register_pytree_dataclass(name: str, cls: type) -> None:
  """Allows instances of dataclass `cls` in pending items, stored as `name`.

  Only registered classes are ever constructed when a state is read, so a
  checkpoint file cannot make ckpt_iter build an arbitrary type.
  """
  if not dataclasses.is_dataclass(cls):
    raise TypeError(f"{cls!r} is not a dataclass; only dataclasses can be registered.")
  if _DATACLASSES.get(name, cls) is not cls:
    raise ValueError(f"pytree dataclass name {name!r} is already taken by {_DATACLASSES[name]!r}.")
  _DATACLASSES[name] = cls
  _DATACLASS_NAMES[cls] = name


register_pytree_dataclass.__module__ = "ckpt_iter"  # public as ckpt_iter.register_pytree_dataclass


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """Dtype and shape an array file must have."""

  dtype: str
  shape: tuple[int, ...]

  @functools.cached_property
  def nbytes(self) -> int:
    return int(np.dtype(self.dtype).itemsize) * math.prod(self.shape)


def _is_jax_array(node: Any) -> bool:
  jax = sys.modules.get("jax")  # not imported: no leaf can be a jax.Array
  return jax is not None and isinstance(node, jax.Array)


def _aliases_host(node: Any) -> bool:
  """Whether np.asarray(node) may be a view of the JAX array's own buffer.

  On the CPU backend (or host memory kinds) it is: the buffer can be donated
  and overwritten after the snapshot. On an accelerator it is a fresh host
  buffer, which JAX caches read-only (a jax.Array is immutable).
  """
  memory_kind = getattr(node.sharding, "memory_kind", None)
  return memory_kind not in (None, "device") or any(d.platform == "cpu" for d in node.devices())


def _host_copy(node: Any) -> np.ndarray:
  """One host copy of an array leaf, which later writes to `node` cannot reach.

  numpy arrays are copied (the caller may reuse the buffer after the
  snapshot); JAX arrays on an accelerator are transferred, and the transfer is
  the copy (no second, defensive one).
  """
  if _is_jax_array(node) and not _aliases_host(node):
    return np.asarray(node)
  return np.array(node, copy=True)


def decode_pytree(
    structure: Any,
    load_array: Callable[[str], np.ndarray],
    *,
    origin: str,
) -> Any:
  """Rebuilds a pytree stored per item (formats 1-2); arrays via `load_array`."""

  def decode(node: Any, depth: int) -> Any:
    if depth > MAX_NESTING:
      raise errors.InvalidStateError(f"{origin}: a pending item is nested too deeply.")
    if node is None:
      return None
    if not isinstance(node, Mapping) or len(node) == 0:
      raise errors.InvalidStateError(f"{origin}: malformed pending node {_short(node)}.")
    if "value" in node and len(node) == 1:
      if not _is_json_scalar(node["value"]):
        raise errors.InvalidStateError(f"{origin}: malformed scalar {_short(node)}.")
      return node["value"]
    if set(node) == {"float"}:
      bits = node["float"]
      if not (isinstance(bits, str) and len(bits) == 16 and all(c in "0123456789abcdef" for c in bits)):
        raise errors.InvalidStateError(
            f"{origin}: malformed float {_short(node)}; expected 16 hex digits (its 8 bytes).")
      return struct.unpack("<d", bytes.fromhex(bits))[0]
    if "array" in node and set(node) <= {"array", "scalar", "dtype"}:
      if not isinstance(node["array"], str):
        raise errors.InvalidStateError(f"{origin}: array name must be a string, got {_short(node)}.")
      array = load_array(node["array"])
      if "dtype" in node:
        array = _from_storable(array, node["dtype"], origin)
      return array[()] if node.get("scalar") else array
    if set(node) == {"dict"} and isinstance(node["dict"], Mapping):
      return {str(k): decode(v, depth + 1) for k, v in node["dict"].items()}
    if set(node) == {"list"} and isinstance(node["list"], list):
      return [decode(v, depth + 1) for v in node["list"]]
    if set(node) == {"tuple"} and isinstance(node["tuple"], list):
      return tuple(decode(v, depth + 1) for v in node["tuple"])
    if set(node) == {"dataclass", "fields"} and isinstance(node["fields"], Mapping):
      cls = _registered(node["dataclass"], origin)
      fields = _fields_for(cls, node["dataclass"], node["fields"], origin)
      return cls(**{k: decode(v, depth + 1) for k, v in fields.items()})
    raise errors.InvalidStateError(f"{origin}: malformed pending node {_short(node)}.")

  return decode(structure, 0)


def _registered_name(node: Any) -> str:
  """The name dataclass instance `node`'s type is registered as (what a stored item names)."""
  name = _DATACLASS_NAMES.get(type(node))
  if name is None:
    raise errors.InvalidStateError(
        f"pending item of type {type(node).__qualname__} is not registered. "
        "Call ckpt_iter.register_pytree_dataclass(name, cls) for it."
    )
  return name


def _registered(name: Any, origin: str) -> type:
  """The dataclass registered as `name`: the only types a stored item can build."""
  cls = _DATACLASSES.get(name) if isinstance(name, str) else None
  if cls is None:
    raise errors.InvalidStateError(
        f"{origin}: pending item type {_short(name)} is not registered "
        f"here (registered: {sorted(_DATACLASSES)}). Import the integration that "
        "wrote it (e.g. ckpt_iter.tunix) before restoring."
    )
  return cls


def _storable(array: np.ndarray) -> tuple[np.ndarray, dict[str, str]]:
  """The array as npz can hold it, and the node fields needed to undo that.

  npz writes ml_dtypes arrays (bfloat16, float8, int4 ...) as void bytes that
  read back as void, which is refused; so their bits are stored as unsigned
  ints and the dtype by name.
  """
  if array.dtype.type.__module__.split(".")[0] != "ml_dtypes":
    return array, {}
  return array.view(f"u{array.dtype.itemsize}"), {"dtype": array.dtype.name}


def _from_storable(array: np.ndarray, name: Any, origin: str) -> np.ndarray:
  """Inverse of `_storable` for a node with a "dtype" field."""
  try:
    import ml_dtypes  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidStateError(
        f"{origin}: a pending array has dtype {_short(name)}; reading it needs "
        "ml_dtypes (pip install ml_dtypes)."
    ) from None
  scalar_type = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
  if not (isinstance(scalar_type, type) and issubclass(scalar_type, np.generic)):
    raise errors.InvalidStateError(
        f"{origin}: pending array dtype {_short(name)} is not an ml_dtypes type."
    )
  dtype = np.dtype(scalar_type)
  if array.dtype != np.dtype(f"u{dtype.itemsize}"):
    raise errors.InvalidStateError(
        f"{origin}: a pending {name} array must be stored as u{dtype.itemsize}, "
        f"got {array.dtype}."
    )
  return array.view(dtype)


# ---------------------------------------------------------------------------
# By structure (format version 3).
#
# pending = {"groups": [group, ...], "schedule": [...]}, each group
#   {"members": [[start, stop], ...],  the item indices it holds, as runs
#    "structure": template,             one item's tree, leaves by reference
#    "arrays": [name, ...],             leaf j's stacked array (first axis: member)
#    "columns": [[value, ...], ...]}    a Python scalar leaf's value per member
# A template is the per-item grammar (docs/state_format.md), with {"array": j} (plus "scalar" and
# "dtype" as there) naming arrays[j] and {"column": j} naming columns[j]; a
# column holds JSON scalars, and {"float": hex} for a non-finite float.


@dataclasses.dataclass
class _Group:
  template: Any
  members: list[int]
  leaves: list[list[Any]]
  values: list[list[Any]]


def encode_items(items: Sequence[Any], arrays: dict[str, np.ndarray], prefix: str) -> list[dict[str, Any]]:
  """The groups of `items` by structure; their stacked arrays go into `arrays`.

  Each leaf is copied to host once, into its group's stacked array (a group
  of one item keeps its one host copy, viewed with a leading axis of 1), so
  the caller may reuse or donate its buffers as soon as this returns.
  """
  groups: dict[str, _Group] = {}
  for index, item in enumerate(items):
    leaves: list[Any] = []
    values: list[Any] = []
    template = _template(item, leaves, values, 0)
    key = json.dumps([template, [(_stored_dtype(leaf.dtype)[0].str, list(leaf.shape)) for leaf in leaves]])
    group = groups.get(key)
    if group is None:
      group = groups[key] = _Group(template, [], [[] for _ in leaves], [[] for _ in values])
    group.members.append(index)
    for column, leaf in zip(group.leaves, leaves):
      column.append(leaf)
    for column, value in zip(group.values, values):
      column.append(value)
  for group in groups.values():  # every transfer started before the first is waited for
    for column in group.leaves:
      for leaf in column:
        if _is_jax_array(leaf) and not _aliases_host(leaf):
          leaf.copy_to_host_async()
  encoded = []
  for group in groups.values():
    names = []
    for column in group.leaves:
      names.append(f"{prefix}{len(arrays)}")
      arrays[names[-1]] = _stacked(column)
    encoded.append({"members": _runs(group.members), "structure": group.template,
                    "arrays": names, "columns": group.values})
  return encoded


def _template(node: Any, leaves: list[Any], values: list[Any], depth: int) -> Any:
  """`node`'s structure with its leaves by reference; the leaves go into `leaves` and `values`."""
  if depth > MAX_NESTING:
    raise errors.InvalidStateError("a pending item is nested deeper than 64 levels.")
  if node is None:
    return None
  if isinstance(node, float) and not isinstance(node, np.generic) and not math.isfinite(node):
    values.append({"float": struct.pack("<d", node).hex()})
    return {"column": len(values) - 1}
  if isinstance(node, (bool, int, float, str)) and not isinstance(node, np.generic):
    values.append(node)
    return {"column": len(values) - 1}
  if isinstance(node, Mapping):
    if not all(isinstance(k, str) for k in node):
      raise errors.InvalidStateError(
          f"pending items may hold dicts with string keys only, got keys {list(node)[:5]}."
      )
    return {"dict": {k: _template(v, leaves, values, depth + 1) for k, v in node.items()}}
  if isinstance(node, list):
    return {"list": [_template(v, leaves, values, depth + 1) for v in node]}
  if isinstance(node, tuple) and not hasattr(node, "_fields"):
    return {"tuple": [_template(v, leaves, values, depth + 1) for v in node]}
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    name = _registered_name(node)
    return {"dataclass": name,
            "fields": {f.name: _template(getattr(node, f.name), leaves, values, depth + 1)
                       for f in dataclasses.fields(node)}}
  scalar = isinstance(node, np.generic)
  if scalar or (hasattr(node, "__array__") and hasattr(node, "dtype")):
    if not (isinstance(node, np.ndarray) or _is_jax_array(node)):
      node = np.asarray(node)  # a numpy scalar, or another array type: numpy decides the dtype
    if np.dtype(node.dtype).hasobject:
      raise errors.InvalidStateError("pending items may not hold object arrays (they would need pickling).")
    leaves.append(node)
    entry: dict[str, Any] = {"array": len(leaves) - 1}
    if scalar:
      entry["scalar"] = True
    entry.update(_stored_dtype(node.dtype)[1])
    return entry
  raise errors.InvalidStateError(
      f"pending items must be pytrees of arrays (dict, list, tuple, registered "
      f"dataclass, numpy or JAX arrays), got {type(node).__qualname__}."
  )


def _stored_dtype(dtype: Any) -> tuple[np.dtype, dict[str, str]]:
  """The dtype an array of `dtype` is stored as, and the node fields that undo it (`_storable`)."""
  dtype = np.dtype(dtype)
  if dtype.type.__module__.split(".")[0] != "ml_dtypes":
    return dtype, {}
  return np.dtype(f"u{dtype.itemsize}"), {"dtype": dtype.name}


def _stacked(leaves: list[Any]) -> np.ndarray:
  """The leaves (one dtype and shape) as one host array, stacked along a new first axis."""
  if len(leaves) == 1:
    return _storable(_host_copy(leaves[0]))[0][np.newaxis]
  stored, _ = _stored_dtype(leaves[0].dtype)
  out = np.empty((len(leaves), *leaves[0].shape), stored)
  for row, leaf in enumerate(leaves):
    # np.asarray is a view of a numpy leaf (or of a JAX leaf on CPU); the row copy is the one copy.
    out[row] = _storable(np.asarray(leaf))[0]
  return out


def _runs(members: list[int]) -> list[list[int]]:
  """Ascending indices as [start, stop) runs."""
  runs: list[list[int]] = []
  for index in members:
    if runs and runs[-1][1] == index:
      runs[-1][1] = index + 1
    else:
      runs.append([index, index + 1])
  return runs


def decode_items(
    pending: Mapping[str, Any],
    load_array: Callable[[str], np.ndarray],
    *,
    origin: str,
) -> list[Any]:
  """The items of an `encode_items` form, in order. `load_array` returns a checked array by name.

  Raises:
    InvalidStateError: the form is malformed, or would build more nodes than
      its data pays for (`check_decode_budget`), refused before any is built.
  """
  count = item_count(pending, origin=origin)
  groups = pending["groups"]
  members = [_members(group, number, origin) for number, group in enumerate(groups)]
  sizes = [sum(stop - start for start, stop in runs) for runs in members]
  loaded: dict[str, np.ndarray] = {}

  def load(name: str) -> np.ndarray:  # each array read once: by the budget, then by its leaf
    if name not in loaded:
      loaded[name] = load_array(name)
    return loaded[name]

  check_decode_budget(groups, sizes, load, origin=origin)
  items: list[Any] = [None] * count
  taken: set[str] = set()
  for number, (group, runs, size) in enumerate(zip(groups, members, sizes)):
    where = f"{origin}: pending.groups[{number}]"
    build = _Builder(group, size, load, taken, where).compiled()
    row = 0
    for start, stop in runs:
      for index in range(start, stop):
        items[index] = build(row)
        row += 1
  return items


# How many nodes (containers, None, leaves) a decode may build beyond one per
# byte or value its data holds. A node costs about 130 bytes of Python objects
# (docs/benchmarks.md, section 14), so this is about 140 MB at most.
FREE_DECODED_NODES = 2**20


def check_decode_budget(
    groups: Sequence[Any], sizes: Sequence[int], load_array: Callable[[str], np.ndarray], *, origin: str
) -> None:
  """Refuses groups whose items would build more nodes than the state's data pays for.

  A group builds its member count times its structure's nodes, and a header
  states both in a few bytes: `[[0, 1000000]]` over a structure of 100,000
  nulls asks for 10^11 objects. So the nodes of all groups may number at most
  `FREE_DECODED_NODES` plus one per byte the groups' arrays hold (as loaded:
  a stand-in broadcast from one value holds one value's bytes) and one per
  column value. Honest items pay for themselves: each leaf row is bytes or a
  value. Cost: one walk of each structure, no item built.

  Raises:
    InvalidStateError: naming the group with the most nodes, its member and
      node counts, and the limit.
  """
  held = 0
  counted: set[str] = set()
  nodes_of = []
  for group, size in zip(groups, sizes):
    nodes_of.append(size * _template_nodes(group["structure"], 0))
    columns, names = group["columns"], group["arrays"]
    if isinstance(columns, list):
      held += size * sum(isinstance(c, list) and len(c) == size for c in columns)
    if isinstance(names, list):
      for name in names:
        if isinstance(name, str) and name not in counted:  # an array named twice pays once
          counted.add(name)
          held += _held_bytes(load_array(name))
  total = sum(nodes_of)
  if total <= FREE_DECODED_NODES + held:
    return
  number = max(range(len(nodes_of)), key=nodes_of.__getitem__)
  raise errors.InvalidStateError(
      f"{origin}: pending.groups[{number}] would build {sizes[number]:,} items of "
      f"{nodes_of[number] // sizes[number]:,} nodes each ({total:,} nodes in all groups), but the "
      f"pending arrays and columns hold {held:,} bytes and values: a state may build at most "
      f"{FREE_DECODED_NODES:,} nodes plus one per byte or value its data holds. Its 'members' or "
      "'structure' is corrupt or crafted: restore an earlier step.")


def _template_nodes(node: Any, depth: int) -> int:
  """The nodes one item of a structure builds; a malformed node counts one (its builder refuses it)."""
  if depth > MAX_NESTING or not isinstance(node, Mapping):
    return 1
  children: Any = ()
  if isinstance(node.get("dict"), Mapping):
    children = node["dict"].values()
  elif isinstance(node.get("fields"), Mapping):
    children = node["fields"].values()
  elif isinstance(node.get("list", node.get("tuple")), list):
    children = node.get("list", node.get("tuple"))
  return 1 + sum(_template_nodes(child, depth + 1) for child in children)


def _held_bytes(array: np.ndarray) -> int:
  """The bytes of data `array` holds: a dimension of stride 0 repeats the same bytes."""
  if array.size == 0:
    return 0
  return array.itemsize * math.prod(n for n, stride in zip(array.shape, array.strides) if stride != 0)


def item_count(pending: Mapping[str, Any], *, origin: str) -> int:
  """How many items an `encode_items` form holds (its groups' members checked, nothing decoded)."""
  groups = pending.get("groups")
  if not isinstance(groups, list) or len(groups) > state_lib.MAX_PENDING_ITEMS:
    raise errors.InvalidStateError(f"{origin}: field 'pending.groups' must be a list of groups, got {_short(groups)}.")
  return _check_cover([_members(group, number, origin) for number, group in enumerate(groups)], origin)


def _members(group: Any, number: int, origin: str) -> list[tuple[int, int]]:
  where = f"{origin}: pending.groups[{number}]"
  if not isinstance(group, Mapping) or set(group) != {"members", "structure", "arrays", "columns"}:
    raise errors.InvalidStateError(
        f"{where} must be {{members, structure, arrays, columns}}, got {_short(group)}.")
  runs = group["members"]
  if not isinstance(runs, list) or not runs or not all(
      isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1])
      and 0 <= r[0] < r[1] <= state_lib.MAX_PENDING_ITEMS for r in runs):
    raise errors.InvalidStateError(
        f"{where}.members must be a non-empty list of [start, stop] index runs "
        f"(0 <= start < stop <= {state_lib.MAX_PENDING_ITEMS}), got {_short(runs)}.")
  return [(int(r[0]), int(r[1])) for r in runs]


def _check_cover(members: list[list[tuple[int, int]]], origin: str) -> int:
  """The item count, once the groups' runs are checked to hold each of 0..count-1 exactly once."""
  runs = sorted(run for group in members for run in group)
  end = 0
  for start, stop in runs:
    if start != end:
      problem = "twice" if start < end else "in no group"
      index = start if start < end else end
      raise errors.InvalidStateError(
          f"{origin}: pending item {index} is {problem} (pending.groups' members must hold "
          "each item index exactly once). The state is corrupt.")
    end = stop
  if end > state_lib.MAX_PENDING_ITEMS:
    raise errors.InvalidStateError(
        f"{origin}: 'pending' holds {end} items; the limit is {state_lib.MAX_PENDING_ITEMS}. The state is corrupt.")
  return end


class _Builder:
  """Compiles one group's template into a function from a member's row to its item."""

  def __init__(self, group: Mapping[str, Any], size: int, load_array: Callable[[str], np.ndarray],
               taken: set[str], where: str):
    self._size, self._where = size, where
    names, columns = group["arrays"], group["columns"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
      raise errors.InvalidStateError(f"{where}.arrays must be a list of array names, got {_short(names)}.")
    if len(set(names)) != len(names) or taken & set(names):
      raise errors.InvalidStateError(f"{where}.arrays names an array another leaf already uses: {_short(names)}.")
    taken.update(names)
    if not isinstance(columns, list) or not all(isinstance(c, list) and len(c) == size for c in columns):
      raise errors.InvalidStateError(
          f"{where}.columns must be a list of lists of {size} values (one per member), got {_short(columns)}.")
    self._names, self._columns = names, columns
    self._load = load_array
    self._used_arrays: set[int] = set()
    self._used_columns: set[int] = set()
    self._template = group["structure"]

  def compiled(self) -> Callable[[int], Any]:
    build = self._node(self._template, 0)
    unused = [f"arrays[{j}]" for j in range(len(self._names)) if j not in self._used_arrays]
    unused += [f"columns[{j}]" for j in range(len(self._columns)) if j not in self._used_columns]
    if unused:
      raise errors.InvalidStateError(f"{self._where}: {', '.join(unused)} is named by no leaf of its structure.")
    return build

  def _malformed(self, node: Any) -> errors.InvalidStateError:
    return errors.InvalidStateError(f"{self._where}.structure: malformed node {_short(node)}.")

  def _index(self, node: Mapping[str, Any], field: str, used: set[int], length: int) -> int:
    j = node[field]
    if not _is_int(j) or not 0 <= j < length or j in used:
      raise errors.InvalidStateError(
          f"{self._where}.structure: {field} {_short(j)} must index one of the group's {length} "
          f"{field}s, each named once.")
    used.add(int(j))
    return int(j)

  def _node(self, node: Any, depth: int) -> Callable[[int], Any]:
    if depth > MAX_NESTING:
      raise errors.InvalidStateError(f"{self._where}: a pending item is nested too deeply.")
    if node is None:
      return _none
    if not isinstance(node, Mapping) or not node:
      raise self._malformed(node)
    if "array" in node and set(node) <= {"array", "scalar", "dtype"}:
      return self._array(node)
    if set(node) == {"column"}:
      j = self._index(node, "column", self._used_columns, len(self._columns))
      return [self._value(v, j) for v in self._columns[j]].__getitem__
    if set(node) == {"dict"} and isinstance(node["dict"], Mapping):
      fields = [(str(k), self._node(v, depth + 1)) for k, v in node["dict"].items()]
      return lambda row: {k: build(row) for k, build in fields}
    if set(node) == {"list"} and isinstance(node["list"], list):
      parts = [self._node(v, depth + 1) for v in node["list"]]
      return lambda row: [build(row) for build in parts]
    if set(node) == {"tuple"} and isinstance(node["tuple"], list):
      parts = [self._node(v, depth + 1) for v in node["tuple"]]
      return lambda row: tuple(build(row) for build in parts)
    if set(node) == {"dataclass", "fields"} and isinstance(node["fields"], Mapping):
      cls = _registered(node["dataclass"], self._where)
      fields = [(k, self._node(v, depth + 1))
                for k, v in _fields_for(cls, node["dataclass"], node["fields"], self._where).items()]
      return lambda row: cls(**{k: build(row) for k, build in fields})
    raise self._malformed(node)

  def _array(self, node: Mapping[str, Any]) -> Callable[[int], Any]:
    j = self._index(node, "array", self._used_arrays, len(self._names))
    scalar = node.get("scalar", False)
    if scalar is not True and "scalar" in node:
      raise self._malformed(node)
    array = self._load(self._names[j])
    if array.ndim < 1 or array.shape[0] != self._size or (scalar and array.ndim != 1):
      raise errors.InvalidStateError(
          f"{self._where}: array {self._names[j]!r} has shape {list(array.shape)}; its group has "
          f"{self._size} members, so it must be [{self._size}{'' if scalar else ', ...'}].")
    if "dtype" in node:
      array = _from_storable(array, node["dtype"], self._where)
    # Rows are views of the one loaded array: a numpy scalar for a scalar leaf,
    # an array (0-d too) for an array leaf.
    rows = list(array) if scalar or array.ndim > 1 else [array[row, ...] for row in range(self._size)]
    return rows.__getitem__

  def _value(self, value: Any, j: int) -> Any:
    if type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
      return value
    if isinstance(value, Mapping) and set(value) == {"float"}:
      bits = value["float"]
      if isinstance(bits, str) and len(bits) == 16 and all(c in "0123456789abcdef" for c in bits):
        return struct.unpack("<d", bytes.fromhex(bits))[0]
    raise errors.InvalidStateError(
        f"{self._where}.columns[{j}] holds {_short(value)}; a column holds JSON scalars, "
        "and {\"float\": 16 hex digits} for a non-finite float.")


def _none(row: int) -> None:
  del row


# ---------------------------------------------------------------------------
# The repeat-order shuffle key (a JAX PRNG key's uint32 words) <-> the state's integers.


def key_to_ints(key: np.ndarray | None) -> tuple[int, ...] | None:
  """A shuffle key as the state's `shuffle_key` holds it."""
  return None if key is None else tuple(int(k) for k in np.asarray(key).ravel())


def key_from_ints(values: Sequence[int] | None) -> np.ndarray | None:
  """The shuffle key a state's `shuffle_key` holds."""
  return None if values is None else np.asarray(values, dtype=np.uint32)
