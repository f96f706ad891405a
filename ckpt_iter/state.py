"""The versioned iterator state: a plain, immutable value.

This module is the contract between a running pipeline and a checkpoint on
disk. It knows nothing of JAX, Grain or Orbax: it validates state values,
converts them to and from JSON plus named numpy arrays, compares fingerprints
and migrates older format versions.

Format version history:
  0  A bare Grain iterator state, as `grain.checkpoint.CheckpointSave` writes
     it (`{"next_index": 12}`): no fingerprint. Migrates to 1 with an empty
     fingerprint, which means "defining fields unknown, not checked".
  1  `{format_version, kind, fingerprint, position, shuffle_key, pending,
     counters}` (see docs/state_format.md).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Collection, Iterable, Mapping

import numpy as np

from ckpt_iter import errors

FORMAT_VERSION = 1
KINDS = ("data", "repeat", "tunix")

# Fail fast on absurd inputs instead of allocating for them.
MAX_PENDING_ITEMS = 1_000_000
MAX_SCHEDULE_LENGTH = 10_000_000
MAX_ARRAY_BYTES = 16 * 2**30
MAX_NESTING = 64

_RESERVED_ITEMS = "__ckpt_iter_items__"
_RESERVED_TUPLE = "__ckpt_iter_tuple__"

JsonScalar = None | bool | int | float | str


@dataclasses.dataclass(frozen=True)
class Pending:
  """Produced items not yet fully consumed, and the order still to come.

  Attributes:
    items: the distinct produced items (pytrees whose leaves are numpy arrays),
      each stored once however often it is still to be yielded.
    schedule: indices into `items`, in the order they are still to be yielded.
  """

  items: tuple[Any, ...]
  schedule: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "items", tuple(self.items))
    object.__setattr__(self, "schedule", tuple(int(i) for i in self.schedule))
    for position, index in enumerate(self.schedule):
      if not 0 <= index < len(self.items):
        raise errors.InvalidStateError(
            f"pending.schedule[{position}] is {index}, but there are only "
            f"{len(self.items)} pending items (valid indices 0..{len(self.items) - 1})."
        )

  def __len__(self) -> int:
    return len(self.schedule)


@dataclasses.dataclass(frozen=True)
class IteratorState:
  """Everything needed to continue an iterator exactly where it stopped.

  Attributes:
    kind: which iterator wrote it: "data", "repeat" or "tunix".
    fingerprint: the defining fields of the pipeline that wrote it, flat
      name -> JSON scalar, so a mismatch can be named field by field.
    position: the Grain iterator state of the next unread input (JSON).
    shuffle_key: the repeat-order PRNG key as plain integers, or None.
    pending: produced items not yet fully consumed, or None.
    counters: named integer counters (e.g. learner steps), for inspection and
      for integrations that must restore them.
    format_version: the format this value follows.
  """

  kind: str
  fingerprint: Mapping[str, JsonScalar]
  position: Mapping[str, Any]
  shuffle_key: tuple[int, ...] | None = None
  pending: Pending | None = None
  counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
  format_version: int = FORMAT_VERSION

  def to_dict(self) -> dict[str, Any]:
    """Returns the Grain-protocol dict form (format_version first)."""
    pending = None
    if self.pending is not None:
      pending = {
          "items": list(self.pending.items),
          "schedule": list(self.pending.schedule),
      }
    return {
        "format_version": self.format_version,
        "kind": self.kind,
        "fingerprint": dict(self.fingerprint),
        "position": self.position,
        "shuffle_key": None if self.shuffle_key is None else list(self.shuffle_key),
        "pending": pending,
        "counters": dict(self.counters),
    }

  @classmethod
  def from_dict(cls, value: Any, *, origin: str = "the state") -> "IteratorState":
    """Validates a dict form (any supported version) and returns the value.

    Raises:
      InvalidStateError: a field is missing, of the wrong type or out of range.
      StateVersionError: the state is from a newer format version.
    """
    value = migrate(value, origin=origin)
    return _validated(value, origin)


def migrate(value: Any, *, origin: str = "the state") -> dict[str, Any]:
  """Brings a state dict of any readable version to FORMAT_VERSION."""
  if not isinstance(value, Mapping):
    raise errors.InvalidStateError(
        f"{origin} must be a dict, got {type(value).__name__}: {_short(value)}."
    )
  if "format_version" not in value:
    if "kind" in value:
      raise errors.InvalidStateError(
          f"{origin} has no 'format_version' field. Every ckpt_iter state "
          "starts with it; this one is truncated or was edited by hand."
      )
    # Version 0: a bare Grain iterator state.
    return {
        "format_version": FORMAT_VERSION,
        "kind": "data",
        "fingerprint": {},
        "position": dict(value),
        "shuffle_key": None,
        "pending": None,
        "counters": {},
    }
  version = value["format_version"]
  if isinstance(version, bool) or not isinstance(version, numbers.Integral):
    raise errors.InvalidStateError(
        f"{origin}: field 'format_version' must be an integer, got {_short(version)}."
    )
  if version > FORMAT_VERSION:
    raise errors.StateVersionError(
        f"{origin} has format_version {version}, but this ckpt_iter reads "
        f"versions 0..{FORMAT_VERSION}. Upgrade ckpt_iter to restore it."
    )
  if version < 1:
    raise errors.StateVersionError(
        f"{origin} has format_version {version}; versions start at 1 (a bare "
        "Grain state has no format_version field at all)."
    )
  return dict(value)


def _validated(value: Mapping[str, Any], origin: str) -> IteratorState:
  kind = value.get("kind")
  if not isinstance(kind, str) or kind not in KINDS:  # `in` would compare an array elementwise
    raise errors.InvalidStateError(
        f"{origin}: field 'kind' is {_short(kind)}, expected one of {list(KINDS)}."
    )
  fingerprint = _require(value, "fingerprint", Mapping, origin)
  for name, field_value in fingerprint.items():
    if not isinstance(name, str):
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field names must be strings, got {_short(name)}."
      )
    if not _is_json_scalar(field_value):
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field {name!r} must be a JSON scalar, "
          f"got {_short(field_value)}."
      )
  position = _require(value, "position", Mapping, origin)
  shuffle_key = value.get("shuffle_key")
  if shuffle_key is not None:
    if not isinstance(shuffle_key, (list, tuple)) or not shuffle_key or not all(
        _is_int(k) and 0 <= k < 2**32 for k in shuffle_key
    ):
      raise errors.InvalidStateError(
          f"{origin}: field 'shuffle_key' must be a list of uint32 integers "
          f"(the PRNG key data), got {_short(shuffle_key)}."
      )
    shuffle_key = tuple(int(k) for k in shuffle_key)
  pending = value.get("pending")
  if pending is not None:
    pending = _validated_pending(pending, origin)
  counters = value.get("counters")
  if counters is None:  # not `or {}`: the truth value of an array raises
    counters = {}
  if not isinstance(counters, Mapping) or not all(
      isinstance(k, str) and _is_int(v) for k, v in counters.items()
  ):
    raise errors.InvalidStateError(
        f"{origin}: field 'counters' must map names to integers, got {_short(counters)}."
    )
  return IteratorState(
      kind=kind,
      fingerprint=dict(fingerprint),
      position=dict(position),
      shuffle_key=shuffle_key,
      pending=pending,
      counters={k: int(v) for k, v in counters.items()},
      format_version=FORMAT_VERSION,
  )


def _validated_pending(pending: Any, origin: str) -> Pending:
  if not isinstance(pending, Mapping):
    raise errors.InvalidStateError(
        f"{origin}: field 'pending' must be a dict with 'items' and 'schedule', "
        f"got {_short(pending)}."
    )
  items = pending.get("items")
  schedule = pending.get("schedule")
  if not isinstance(items, (list, tuple)):
    raise errors.InvalidStateError(
        f"{origin}: field 'pending.items' must be a list, got {_short(items)}."
    )
  if not isinstance(schedule, (list, tuple)) or not all(_is_int(i) for i in schedule):
    raise errors.InvalidStateError(
        f"{origin}: field 'pending.schedule' must be a list of integers, "
        f"got {_short(schedule)}."
    )
  if len(items) > MAX_PENDING_ITEMS or len(schedule) > MAX_SCHEDULE_LENGTH:
    raise errors.InvalidStateError(
        f"{origin}: 'pending' holds {len(items)} items and a schedule of "
        f"{len(schedule)}; the limits are {MAX_PENDING_ITEMS} and "
        f"{MAX_SCHEDULE_LENGTH}. The state is corrupt."
    )
  try:
    return Pending(items=tuple(items), schedule=tuple(schedule))
  except errors.InvalidStateError as e:
    raise e.with_origin(origin) from None


def check_fingerprint(
    saved: Mapping[str, JsonScalar],
    current: Mapping[str, JsonScalar],
    *,
    allow_drift: Collection[str] = (),
    origin: str = "the state",
) -> None:
  """Raises ConfigDriftError naming every field that differs.

  An empty saved fingerprint (a migrated bare Grain state) checks nothing.
  """
  if not saved:
    return
  unknown = set(allow_drift) - set(saved) - set(current)
  if unknown:
    raise errors.InvalidArgumentError(
        f"allow_drift names {sorted(unknown)}, which are not fingerprint fields. "
        f"Known fields: {sorted(set(saved) | set(current))}."
    )
  absent = "<absent>"
  differences = {}
  for name in set(saved) | set(current):
    if name in allow_drift:
      continue
    before, after = saved.get(name, absent), current.get(name, absent)
    if not same_field_value(before, after):
      differences[name] = (before, after)
  if differences:
    raise errors.ConfigDriftError(differences, origin=origin)


def same_field_value(a: Any, b: Any) -> bool:
  """Equal fingerprint values: True is not 1, int types may differ, NaN is NaN."""
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  return type(a) is type(b) and a == b or (_is_int(a) and _is_int(b) and a == b)


# ---------------------------------------------------------------------------
# JSON form of Grain positions: keeps int dict keys and tuples, drops numpy
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
    if set(value) == {_RESERVED_ITEMS}:
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
    if set(value) == {_RESERVED_TUPLE}:
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

  @property
  def nbytes(self) -> int:
    return int(np.dtype(self.dtype).itemsize) * math.prod(self.shape)


def encode_pytree(value: Any, arrays: dict[str, np.ndarray], prefix: str) -> Any:
  """Returns the JSON structure of `value`; its arrays go into `arrays`."""

  def encode(node: Any, depth: int) -> Any:
    if depth > MAX_NESTING:
      raise errors.InvalidStateError("a pending item is nested deeper than 64 levels.")
    if node is None:
      return None
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
      array = np.asarray(node)
      if array.dtype.hasobject:
        raise errors.InvalidStateError(
            "pending items may not hold object arrays (they would need pickling)."
        )
      name = f"{prefix}{len(arrays)}"
      # A copy: the caller may reuse the buffer after the snapshot is taken.
      arrays[name], extra = _storable(np.array(array, copy=True))
      return {"array": name, **extra}
    raise errors.InvalidStateError(
        f"pending items must be pytrees of arrays (dict, list, tuple, registered "
        f"dataclass, numpy or JAX arrays), got {type(node).__qualname__}."
    )

  return encode(value, 0)


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
      names = {f.name for f in dataclasses.fields(cls)}
      if set(node["fields"]) != names:
        raise errors.InvalidStateError(
            f"{origin}: pending {node['dataclass']} has fields "
            f"{sorted(node['fields'])}, expected {sorted(names)}."
        )
      return cls(**{k: decode(v, depth + 1) for k, v in node["fields"].items()})
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


def array_specs(header: Mapping[str, Any], *, origin: str) -> dict[str, ArraySpec]:
  """Validates the 'arrays' manifest of a header, without reading any array."""
  manifest = header.get("arrays", {})
  if not isinstance(manifest, Mapping):
    raise errors.InvalidStateError(f"{origin}: field 'arrays' must be a dict, got {_short(manifest)}.")
  specs = {}
  for name, spec in manifest.items():
    if not isinstance(name, str) or not name.isidentifier():
      raise errors.InvalidStateError(
          f"{origin}: array name {_short(name)} is not a plain identifier "
          "(names may not be paths)."
      )
    if not isinstance(spec, Mapping) or set(spec) != {"dtype", "shape"}:
      raise errors.InvalidStateError(f"{origin}: arrays[{name!r}] must be {{dtype, shape}}, got {_short(spec)}.")
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
  return specs


def decode_state(
    header: Mapping[str, Any],
    load_array: Callable[[str, ArraySpec], np.ndarray],
    *,
    origin: str = "the state",
) -> IteratorState:
  """Inverse of `encode_state`. `load_array` must check dtype and shape."""
  body = migrate(header, origin=origin)
  specs = array_specs(body, origin=origin)
  body.pop("arrays", None)
  body["position"] = position_from_json(_require(body, "position", Mapping, origin))
  pending = body.get("pending")
  if pending is not None:
    _validated_pending(pending, origin)  # shape of the lists before decoding
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
  return _validated(body, origin)


# ---------------------------------------------------------------------------


def _require(value: Mapping[str, Any], name: str, kind: type, origin: str) -> Any:
  if name not in value:
    raise errors.InvalidStateError(f"{origin} has no field {name!r}.")
  if not isinstance(value[name], kind):
    raise errors.InvalidStateError(
        f"{origin}: field {name!r} must be a {kind.__name__}, got {_short(value[name])}."
    )
  return value[name]


def is_int(value: Any) -> bool:
  """An integer that is not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_is_int = is_int


def _is_json_scalar(value: Any) -> bool:
  if value is None or isinstance(value, (bool, str)):
    return True
  if isinstance(value, float):
    return True
  return isinstance(value, int)


def short_repr(value: Any, limit: int = 80) -> str:
  """repr(value) cut to `limit` characters, for error messages."""
  try:
    text = repr(value)
  except RecursionError:  # a hostile value nested thousands deep
    text = f"<{type(value).__name__} nested too deeply to show>"
  return text if len(text) <= limit else text[: limit - 3] + "..."


_short = short_repr


def iter_arrays(pytree: Any) -> Iterable[np.ndarray]:
  """Yields the array leaves of a pending item (for sizes in reports)."""
  if pytree is None:
    return
  if isinstance(pytree, Mapping):
    for v in pytree.values():
      yield from iter_arrays(v)
  elif isinstance(pytree, (list, tuple)):
    for v in pytree:
      yield from iter_arrays(v)
  elif dataclasses.is_dataclass(pytree) and not isinstance(pytree, type):
    for f in dataclasses.fields(pytree):
      yield from iter_arrays(getattr(pytree, f.name))
  elif hasattr(pytree, "__array__") and hasattr(pytree, "dtype"):
    yield pytree
