"""State values <-> their stored form: a JSON header plus named numpy arrays.

Two codecs, both lossless and both refusing what they cannot store exactly:
  * Grain positions <-> JSON. Grain states may hold int dict keys and tuples
    (interleave's `future_states`), which plain JSON turns into strings and
    lists; numpy scalars, which Grain's own handler rejects.
  * Pending pytrees <-> a JSON structure plus arrays for npz. Only registered
    dataclasses are ever built back, so a file cannot name an arbitrary type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import sys
from collections.abc import Mapping  # not typing's: its isinstance is ~3x slower
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

# scalar types (Grain's own handler would reject them).


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


# ---------------------------------------------------------------------------
# Pytrees of arrays (the pending items): JSON structure + named arrays.

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


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """Dtype and shape an array file must have."""

  dtype: str
  shape: tuple[int, ...]

  @functools.cached_property
  def nbytes(self) -> int:
    return int(np.dtype(self.dtype).itemsize) * math.prod(self.shape)


def encode_pytree(value: Any, arrays: dict[str, np.ndarray], prefix: str) -> Any:
  """Returns the JSON structure of `value`; its arrays go into `arrays`.

  Each array leaf is copied to host memory exactly once (`_host_copy`), so
  the caller may reuse or donate its buffers as soon as this returns; the
  device-to-host transfers of JAX leaves are all started before the first
  one is waited for.
  """
  leaves: list[tuple[str, Any, dict[str, Any]]] = []

  def encode(node: Any, depth: int) -> Any:
    if depth > MAX_NESTING:
      raise errors.InvalidStateError("a pending item is nested deeper than 64 levels.")
    if node is None:
      return None
    if isinstance(node, float) and not isinstance(node, np.generic) and not math.isfinite(node):
      # JSON has no NaN or infinity: the float's 8 bytes, so every bit (sign,
      # NaN payload) comes back. A NaN reward must not make a step unsavable.
      return {"float": struct.pack("<d", node).hex()}
    if isinstance(node, (bool, int, float, str)) and not isinstance(node, np.generic):
      return {"value": node}
    if isinstance(node, np.generic):
      name = f"{prefix}{len(arrays)}"
      arrays[name], extra = _storable(np.asarray(node))
      return {"array": name, "scalar": True, **extra}
    if isinstance(node, Mapping):
      if not all(isinstance(k, str) for k in node):
        raise errors.InvalidStateError(
            f"pending items may hold dicts with string keys only, got keys {list(node)[:5]}."
        )
      return {"dict": {k: encode(v, depth + 1) for k, v in node.items()}}
    if isinstance(node, list):
      return {"list": [encode(v, depth + 1) for v in node]}
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
      return {"tuple": [encode(v, depth + 1) for v in node]}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
      name = _DATACLASS_NAMES.get(type(node))
      if name is None:
        raise errors.InvalidStateError(
            f"pending item of type {type(node).__qualname__} is not registered. "
            "Call ckpt_iter.register_pytree_dataclass(name, cls) for it."
        )
      return {
          "dataclass": name,
          "fields": {
              f.name: encode(getattr(node, f.name), depth + 1)
              for f in dataclasses.fields(node)
          },
      }
    if hasattr(node, "__array__") and hasattr(node, "dtype"):
      if not (isinstance(node, np.ndarray) or _is_jax_array(node)):
        node = np.asarray(node)  # another array type: numpy decides the dtype
      if np.dtype(node.dtype).hasobject:
        raise errors.InvalidStateError(
            "pending items may not hold object arrays (they would need pickling)."
        )
      name = f"{prefix}{len(arrays)}"
      arrays[name] = None  # the name is taken; the copy is made below
      entry = {"array": name}
      leaves.append((name, node, entry))
      return entry
    raise errors.InvalidStateError(
        f"pending items must be pytrees of arrays (dict, list, tuple, registered "
        f"dataclass, numpy or JAX arrays), got {type(node).__qualname__}."
    )

  structure = encode(value, 0)
  for _, node, _ in leaves:
    if _is_jax_array(node) and not _aliases_host(node):
      node.copy_to_host_async()
  for name, node, entry in leaves:
    arrays[name], extra = _storable(_host_copy(node))
    entry.update(extra)
  return structure


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
  """Rebuilds a pytree from `encode_pytree` output; arrays via `load_array`."""

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
      cls = _DATACLASSES.get(node["dataclass"]) if isinstance(node["dataclass"], str) else None
      if cls is None:
        raise errors.InvalidStateError(
            f"{origin}: pending item type {_short(node['dataclass'])} is not registered "
            f"here (registered: {sorted(_DATACLASSES)}). Import the integration that "
            "wrote it (e.g. ckpt_iter.tunix) before restoring."
        )
      fields = _fields_for(cls, node["dataclass"], node["fields"], origin)
      return cls(**{k: decode(v, depth + 1) for k, v in fields.items()})
    raise errors.InvalidStateError(f"{origin}: malformed pending node {_short(node)}.")

  return decode(structure, 0)


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


def encode_state(state: IteratorState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Splits a state into a JSON header and named numpy arrays."""
  arrays: dict[str, np.ndarray] = {}
  header = state.to_dict()
  header["position"] = position_to_json(state.position)
  if state.pending is not None:
    header["pending"] = {
        "items": [
            encode_pytree(item, arrays, prefix="a")
            for item in state.pending.items
        ],
        "schedule": list(state.pending.schedule),
    }
  header["arrays"] = {
      name: {"dtype": array.dtype.str, "shape": list(array.shape)}
      for name, array in arrays.items()
  }
  return header, arrays


def state_parts(state: IteratorState) -> dict[str, str]:
  """A SHA-256 of each part of a state as it is stored: its header fields and each array.

  Two states are bit-identical exactly when their parts are; `state_digest`
  joins them into one digest, and comparing parts names what differs.
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


def state_digest(state: IteratorState) -> str:
  """One SHA-256 of everything a state stores (equal digests: bit-identical states)."""
  return _json_digest(sorted(state_parts(state).items()))


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
    state_lib.validated_pending(pending, origin)  # shape of the lists before decoding
    used: set[str] = set()

    def load(name: str) -> np.ndarray:
      if name not in specs:
        raise errors.InvalidStateError(
            f"{origin}: pending refers to array {name!r}, which is not in the manifest."
        )
      used.add(name)
      return load_array(name, specs[name])

    body["pending"] = {
        "items": [
            decode_pytree(item, load, origin=origin) for item in pending["items"]
        ],
        "schedule": pending["schedule"],
    }
  return state_lib.validated(body, origin)


# ---------------------------------------------------------------------------
