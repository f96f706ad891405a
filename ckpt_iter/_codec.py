"""State values <-> their stored form: a JSON header plus named numpy arrays.

Two codecs, both lossless and both refusing what they cannot store exactly:
  * Grain positions <-> JSON. Grain states may hold int dict keys and tuples
    (interleave's `future_states`), which plain JSON turns into strings and
    lists; numpy scalars, which Grain's own handler rejects.
  * Pending pytrees <-> a JSON structure plus arrays for npz (`_pytree`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping  # not typing's: its isinstance is ~3x slower
from typing import Any, Callable

import numpy as np

from ckpt_iter import _pytree
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter._pytree import ArraySpec
from ckpt_iter._pytree import decode_pytree
from ckpt_iter._pytree import register_pytree_dataclass  # noqa: F401  (re-exported: ckpt_iter.register_pytree_dataclass)
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




def encode_state(state: IteratorState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Splits a state into a JSON header and named numpy arrays."""
  arrays: dict[str, np.ndarray] = {}
  header = state.to_dict()
  header["position"] = position_to_json(header["position"])
  if state.pending is not None:
    header["pending"] = {
        "groups": _pytree.encode_items(state.pending.items, arrays, prefix="a"),
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

    def load(name: str) -> np.ndarray:
      if not isinstance(name, str) or name not in specs:
        raise errors.InvalidStateError(
            f"{origin}: pending refers to array {_short(name)}, which is not in the manifest."
        )
      return load_array(name, specs[name])

    if _by_structure(body, origin):
      items = _pytree.decode_items(pending, load, origin=origin)
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
    count = _pytree.item_count(pending, origin=origin)
    body["pending"] = {"items": [None] * count, "schedule": pending["schedule"]}
  return state_lib.validated(body, origin)


def _by_structure(body: Mapping[str, Any], origin: str) -> bool:
  """Whether a migrated header's pending items are stored by structure (its shape checked)."""
  if body["format_version"] < _pytree.BY_STRUCTURE_VERSION:
    return False
  pending = body["pending"]
  if not isinstance(pending, Mapping) or set(pending) != {"groups", "schedule"}:
    raise errors.InvalidStateError(
        f"{origin}: field 'pending' must be a dict with 'groups' and 'schedule' "
        f"(format_version {body['format_version']}), got {_short(pending)}."
    )
  return True
