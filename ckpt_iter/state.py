"""The versioned iterator state: a plain, immutable value.

This module is the contract between a running pipeline and a checkpoint on
disk. It knows nothing of JAX, Grain, Orbax or files: it validates state
values, compares fingerprints, migrates older format versions and names the
check-then-apply protocol every restorable iterator follows. Their on-disk
form (JSON header plus named arrays) is `_codec`'s.

A composite state holds its part's whole state, as Grain nests a parent's
under `parent`. A Tunix learner (RL, SFT, agentic) keeps its input's state
under `position.input` beside its own position fields, so a restore hands
the input its state unchanged (the input's `check_restore` decides what it
accepts) and compares the learner's own fields by itself, and a reader (the
CLI) finds the input's position in one place for every learner
(`IteratorState.innermost`). Format 1 mixed the two; `migrate_learner_v1` nests such a
state, the learner's fields being fixed by what format 1 ever wrote.

The one describer of states in words is here too (`position_text`):
`ckpt-iter inspect`, `diff`, `audit` and the INFO line every restore logs
say a position the same way for every kind and learner family.

Format version history:
  0  A bare Grain iterator state, as `grain.checkpoint.CheckpointSave` writes
     it (`{"next_index": 12}`): no fingerprint. Migrates to 1 with an empty
     fingerprint, which means "defining fields unknown, not checked".
  1  `{format_version, kind, fingerprint, position, shuffle_key, pending,
     counters}` (see docs/state_format.md).
  2  A Tunix learner's state nests its input's (`IteratorState.part`).
  3  Pending items stored by structure (`_codec.encode_items`).
  4  One state all the way down: a composite state holds its part's whole
     state where Grain nests a parent's (a RepeatIterator's under
     `position.parent`, a Tunix learner's under `position.input`), and a
     make_dataset position counts stream records (`{"next_record": R}`), so
     a restart may change the batch size, the process count or a mixture's
     weights (docs/changing_the_run.md).
  5  What every process of a pod holds alike (its fingerprints without the
     per-process fields, its lineage) is written once, in the step's count
     file (`_files`; docs/state_format.md, "The pod part"); a header keeps
     its own fields. The value read is the same as format 4's. Every kind is
     written as 5; 0-4 migrate on read (`migrate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import numbers
import threading
import typing
from collections.abc import Mapping  # not typing's: its isinstance is ~3x slower
from typing import Any, Callable, Collection, Iterator, NoReturn, Sequence

from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import skips as skips_lib


# ---------------------------------------------------------------------------
# The state value.

FORMAT_VERSION = 5
"""The newest data-state `format_version`: this release reads every version up to it (migrating older ones),
refuses a newer one (StateVersionError) and writes every state in it."""
KINDS = ("data", "repeat", "tunix")
# Where a composite kind holds its part's state (in memory an IteratorState,
# on disk its dict form without format_version), as Grain nests `parent`.
NESTED = {"repeat": "parent", "tunix": "input"}
# A RepeatIterator's own fingerprint fields (format 1-3 kept them beside its source's).
REPEAT_FIELDS = ("num_repeats", "group_size", "shuffle_seed")


# Fail fast on absurd inputs instead of allocating for them.
MAX_PENDING_ITEMS = 1_000_000
MAX_SCHEDULE_LENGTH = 10_000_000
# The optional fields are small by construction; a larger one is corrupt.
MAX_CONTENT_FIELDS = 64
# How deep a state's JSON values may nest (a Grain position needs a few levels).
MAX_NESTING = 64
MAX_LINEAGE_RECENT = 64
LINEAGE_RUN = "run"  # a lineage's optional field: the step of its run's first save

JsonScalar = None | bool | int | float | str

# The graph fingerprint (`_graph.describe_graph`), added after format version
# 1 was first written: "graph" and one "node[i].Kind.param" field per node
# parameter. States written before it have none of these fields.
GRAPH_FIELD = "graph"
_GRAPH_FIELD_PREFIX = "node["

# A streaming source's state (`streaming.StreamingIterator`): its fingerprint's `source` starts with
# the prefix; its position counts what was read beside the source's own state, which restores it.
STREAM_SOURCE_PREFIX = "stream:"
STREAM_ELEMENTS_READ = "elements_read"
STREAM_RECORDS_READ = "records_read"
STREAM_SOURCE_STATE = "source_state"


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
    content: a digest of the element produced last (`_drift.content_digest`; of a
      make_dataset batch, its last row: `_drift.row_record`), which a restore
      produces again and compares; or why it cannot; or None.
    lineage: the resumes of the run that wrote it (`_item.extended`), or None.

  `content` and `lineage` describe how the state came about, not where the
  stream continues: equality and hashing leave them out.
  """

  kind: str
  fingerprint: Mapping[str, JsonScalar]
  position: Mapping[str, Any]
  shuffle_key: tuple[int, ...] | None = None
  pending: Pending | None = None
  counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
  format_version: int = FORMAT_VERSION
  content: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
  lineage: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    # Validated like a state read from a file, and copied: a caller who
    # mutates the dicts it passed in cannot change this value, and neither
    # can a reader of it (read-only views).
    fields = _checked_fields(
        {"kind": self.kind, "fingerprint": self.fingerprint, "position": self.position,
         "shuffle_key": self.shuffle_key, "pending": self.pending, "counters": self.counters,
         "content": self.content, "lineage": self.lineage},
        "IteratorState",
    )
    if self.format_version != FORMAT_VERSION:
      raise errors.InvalidStateError(
          f"IteratorState: format_version is {_short(self.format_version)}; a value is always of "
          f"the current format ({FORMAT_VERSION}): read older ones with IteratorState.from_dict."
      )
    for name, value in fields.items():
      object.__setattr__(self, name, value)
    object.__setattr__(self, "format_version", FORMAT_VERSION)

  @classmethod
  def _from_checked(cls, fields: Mapping[str, Any]) -> "IteratorState":
    """A value of fields `_checked_fields` just returned: not checked and copied twice."""
    value = object.__new__(cls)
    object.__setattr__(value, "content", None)
    object.__setattr__(value, "lineage", None)
    for name, field_value in fields.items():
      object.__setattr__(value, name, field_value)
    object.__setattr__(value, "format_version", FORMAT_VERSION)
    return value

  def with_lineage(self, lineage: Mapping[str, Any]) -> "IteratorState":
    """This value with another lineage (checked); the other fields are not checked again."""
    value = object.__new__(type(self))
    value.__dict__.update(self.__dict__)
    object.__setattr__(value, "lineage", _checked_lineage(lineage, "IteratorState"))
    return value

  def __hash__(self) -> int:
    # Over the JSON fields (pending arrays are unhashable): equal values hash equal.
    return hash((self.kind, _canonical_json(self.fingerprint), _canonical_json(self.position),
                 self.shuffle_key, _canonical_json(self.counters),
                 None if self.pending is None else self.pending.schedule))

  def nested_dict(self, *, content: bool = True) -> dict[str, Any]:
    """The dict form a composite state holds this one in: no format_version or lineage of its own."""
    result: dict[str, Any] = {
        "kind": self.kind, "fingerprint": dict(self.fingerprint), "position": _thawed(self.position, content=content),
    }
    if self.shuffle_key is not None:
      result["shuffle_key"] = list(self.shuffle_key)
    if self.counters:
      result["counters"] = dict(self.counters)
    if content and self.content is not None:
      result["content"] = _thawed(self.content)
    return result

  @property
  def part(self) -> "IteratorState | None":
    """The state of the part a composite state nests (a repeat's parent, a learner's input), or None."""
    key = NESTED.get(self.kind)
    part = None if key is None else self.position.get(key)
    return part if isinstance(part, IteratorState) else None

  @property
  def innermost(self) -> "IteratorState":
    """The state at the bottom of this one: `part` followed down (a learner's input, a repeat's parent),
    itself when it nests none. The one way down a composite state, as Grain follows `parent`."""
    value = self
    while (part := value.part) is not None:
      value = part
    return value

  @property
  def own_position(self) -> dict[str, Any]:
    """This state's own position fields beside the part it nests (a learner's counts); {} when it nests none."""
    if self.part is None:
      return {}
    key = NESTED[self.kind]
    return {k: v for k, v in self.position.items() if k != key}

  def position_dict(self) -> Any:
    """The position as `to_dict()` gives it (new mutable dicts), without copying the rest."""
    return _thawed(self.position)

  def to_dict(self) -> dict[str, Any]:
    """Returns the Grain-protocol dict form (format_version first), as new mutable dicts."""
    pending = None
    if self.pending is not None:
      pending = {
          "items": list(self.pending.items),
          "schedule": list(self.pending.schedule),
      }
    result = {
        "format_version": self.format_version,
        "kind": self.kind,
        "fingerprint": dict(self.fingerprint),
        "position": _thawed(self.position),
        "shuffle_key": None if self.shuffle_key is None else list(self.shuffle_key),
        "pending": pending,
        "counters": dict(self.counters),
    }
    # Written only when present: a state without them reads as before.
    if self.content is not None:
      result["content"] = _thawed(self.content)
    if self.lineage is not None:
      result["lineage"] = _thawed(self.lineage)
    return result

  @classmethod
  def from_dict(cls, value: Any, *, origin: str = "the state") -> "IteratorState":
    """Validates a dict form (any supported version) and returns the value.

    Raises:
      InvalidStateError: a field is missing, of the wrong type or out of range.
      StateVersionError: the state is from a newer format version.
    """
    value = migrate(value, origin=origin)
    return validated(value, origin)


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
  if version == 1 and isinstance(value.get("kind"), str) and value["kind"] == "tunix":
    value = migrate_learner_v1(value)
  if version < 4:
    return _to_v4(value)
  # 4 -> 5 changed only how a step's files hold a header (the pod part, `_files`), not its fields.
  return dict(value)


def _to_v4(value: Mapping[str, Any]) -> dict[str, Any]:
  """A state of format 1-3 (a learner's already nested) reshaped as format 4.

  A repeat state nests its source's (the fingerprint fields that are not its
  own, the position, the content record); the make_dataset position of the
  data state inside becomes the stream record it stands for
  (`_records.next_record_of_index`). Anything malformed is left as it is, for
  validation to refuse naming the field.
  """
  result = dict(value)
  kind, fingerprint, position = value.get("kind"), value.get("fingerprint"), value.get("position")
  if not isinstance(fingerprint, Mapping) or not isinstance(position, Mapping):
    return result
  if kind == "data":
    result["position"] = _records.next_record_of_index(fingerprint, position)
  elif kind == "repeat" and NESTED["repeat"] not in position:
    parent = {"kind": "data", "fingerprint": {k: v for k, v in fingerprint.items() if k not in REPEAT_FIELDS},
              "position": position}
    parent["position"] = _records.next_record_of_index(parent["fingerprint"], position)
    if value.get("content") is not None:
      parent["content"] = value["content"]
    result["fingerprint"] = {k: v for k, v in fingerprint.items() if k in REPEAT_FIELDS}
    result["position"] = {NESTED["repeat"]: parent}
    result.pop("content", None)
  elif kind == "tunix" and isinstance(position.get(NESTED["tunix"]), Mapping):
    part = dict(position[NESTED["tunix"]])
    if isinstance(part.get("fingerprint"), Mapping) and isinstance(part.get("position"), Mapping):
      part["position"] = _records.next_record_of_index(part["fingerprint"], part["position"])
    result["position"] = {**position, NESTED["tunix"]: part}
  return result


def validated(value: Mapping[str, Any], origin: str) -> IteratorState:
  """The IteratorState of a migrated dict, every field checked (errors name `origin`)."""
  return IteratorState._from_checked(_checked_fields(value, origin))  # pylint: disable=protected-access


def _checked_fields(value: Mapping[str, Any], origin: str, depth: int = 0) -> dict[str, Any]:
  """The fields of a state, checked and copied into read-only form.

  The one validation of a state's fields: for a dict read from a file
  (`validated`) and for a value built in code (`IteratorState.__post_init__`).
  """
  kind = value.get("kind")
  if not isinstance(kind, str) or kind not in KINDS:  # `in` would compare an array elementwise
    raise errors.InvalidStateError(
        f"{origin}: field 'kind' is {_short(kind)}, expected one of {list(KINDS)}."
    )
  fingerprint = require(value, "fingerprint", Mapping, origin)
  # One pass over flat fields (no recursive copy: a restore's critical path): names are
  # strings, values JSON scalars, every string valid Unicode.
  for name, field_value in fingerprint.items():
    if not (type(name) is str and name.isascii()) and not _valid_text(name):
      if isinstance(name, str):
        _checked_copy(name, "fingerprint", origin)  # raises, naming the lone surrogate
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field names must be strings, got {_short(name)}."
      )
    if isinstance(field_value, str):
      if not field_value.isascii() and not _valid_text(field_value):
        _checked_copy(field_value, "fingerprint", origin)  # raises, naming the lone surrogate
    elif type(field_value) not in _JSON_SCALAR_TYPES and not is_json_scalar(field_value):
      raise errors.InvalidStateError(
          f"{origin}: fingerprint field {name!r} must be a JSON scalar (a finite float, no NaN), "
          f"got {_short(field_value)}."
      )
  position = require(value, "position", Mapping, origin)
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
  if pending is not None and not isinstance(pending, Pending):
    pending = validated_pending(pending, origin)
  counters = value.get("counters")
  if counters is None:  # not `or {}`: the truth value of an array raises
    counters = {}
  if not isinstance(counters, Mapping) or not all(
      isinstance(k, str) and _is_int(v) for k, v in counters.items()
  ):
    raise errors.InvalidStateError(
        f"{origin}: field 'counters' must map names to integers, got {_short(counters)}."
    )
  position = _checked_copy(position, "position", origin)
  key = NESTED.get(kind)
  if key is not None and isinstance(position.get(key), Mapping):
    position[key] = _nested_state(position[key], f"{origin} (position.{key})", depth)
  return {
      "kind": kind,
      "fingerprint": FrozenDict(fingerprint),
      "position": FrozenDict(position),
      "shuffle_key": shuffle_key,
      "pending": pending,
      "counters": FrozenDict({k: int(v) for k, v in counters.items()}),
      "content": _checked_content(value.get("content"), origin),
      "lineage": _checked_lineage(value.get("lineage"), origin),
  }


_NESTED_FIELDS = frozenset({"kind", "fingerprint", "position", "content", "shuffle_key", "counters"})
_MAX_NESTED_STATES = 4


def _nested_state(value: Mapping[str, Any], origin: str, depth: int) -> "IteratorState":
  """The state a composite's position nests, validated as a top-level one (no lineage or pending)."""
  if depth >= _MAX_NESTED_STATES:
    raise errors.InvalidStateError(f"{origin}: states nested more than {_MAX_NESTED_STATES} deep; none is.")
  extra = set(value) - _NESTED_FIELDS
  if extra:
    raise errors.InvalidStateError(
        f"{origin}: a nested state holds {sorted(extra)}; it may hold only {sorted(_NESTED_FIELDS)} "
        "(pending items and the lineage belong to the outermost state).")
  return IteratorState._from_checked(_checked_fields(value, origin, depth + 1))  # pylint: disable=protected-access


# Optional fields Grain's dict form (`RestorableIterator.get_state`) holds as
# JSON text; the dict form holds them as objects. Both are read.
_TEXT_FIELDS = ("content", "lineage")
_MAX_TEXT_FIELD_BYTES = 2**20


def grain_form(state: dict[str, Any]) -> dict[str, Any]:
  """A state's dict form (`to_dict`) as Grain's form holds it: content and lineage as JSON text."""
  for name in _TEXT_FIELDS:
    state[name] = json.dumps(state.get(name), sort_keys=True, separators=(",", ":"))
  return state


def _decoded_text(value: Any, name: str, origin: str) -> Any:
  """A field Grain's form holds as JSON text, decoded; any other value unchanged."""
  if not isinstance(value, str):
    return value
  if len(value) > _MAX_TEXT_FIELD_BYTES:
    raise errors.InvalidStateError(f"{origin}: field {name!r} is {len(value)} characters of text; "
                                   f"at most {_MAX_TEXT_FIELD_BYTES} are read.")
  try:
    return json.loads(value)
  except ValueError:
    raise errors.InvalidStateError(f"{origin}: field {name!r} is text that is not JSON: {_short(value)}.") from None


def _checked_content(content: Any, origin: str) -> FrozenDict | None:
  """`content`: {"check": str, "digest": str, "fields": {name: str}} (digest and fields optional)."""
  content = _decoded_text(content, "content", origin)
  return None if content is None else checked_content_record(content, "content", origin)


def checked_content_record(content: Any, field: str, origin: str) -> FrozenDict:
  """A content record (`_drift.content_digest`'s form) held in `field`, checked and copied.

  Raises:
    InvalidStateError: naming `field`.
  """
  fields = content.get("fields", {}) if isinstance(content, Mapping) else None
  if (
      not isinstance(content, Mapping)
      or not set(content) <= {"check", "digest", "fields"}
      or not isinstance(content.get("check"), str)
      or not isinstance(content.get("digest", ""), str)
      or not isinstance(fields, Mapping)
      or len(fields) > MAX_CONTENT_FIELDS
      or not all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
  ):
    raise errors.InvalidStateError(
        f"{origin}: field {field!r} must be {{'check': str, 'digest': str, 'fields': "
        f"{{name: str}} (at most {MAX_CONTENT_FIELDS})}}, got {_short(content)}."
    )
  return FrozenDict(_checked_copy(content, field, origin))


# What a resume entry records of where the data map's segment starts (a make_dataset position):
# the restored stream record, and the global batch size and process count in effect before it.
# Each with its least valid value.
_SEGMENT_ENTRY_FIELDS = {"record": 0, "batch_size": 1, "process_count": 1, "lanes": 1}


def _checked_lineage(lineage: Any, origin: str) -> FrozenDict | None:
  """`lineage`: {"resumes": int, "digest": str, "recent": [{"step": int|None, "state": str, ...}],
  "run": int (optional: the step of the run's first save)}.

  One pass over the entries, each a flat dict of JSON scalars (a restore reads
  up to MAX_LINEAGE_RECENT of them: the walk `_checked_copy` does for any
  field cost 15 us per entry here).
  """
  if type(lineage) is _CheckedLineage:
    return lineage  # checked already, and read-only since (`checked_lineage`)
  lineage = _decoded_text(lineage, "lineage", origin)
  if lineage is None:
    return None
  recent = lineage.get("recent") if isinstance(lineage, Mapping) else None
  entries = None
  if (
      isinstance(lineage, Mapping)
      and set(lineage) - {LINEAGE_RUN} == {"resumes", "digest", "recent"}
      and (LINEAGE_RUN not in lineage or (_is_int(lineage[LINEAGE_RUN]) and lineage[LINEAGE_RUN] >= 0))
      and _is_int(lineage["resumes"]) and lineage["resumes"] >= 0
      and _valid_text(lineage["digest"])
      and isinstance(recent, (list, tuple))
      and len(recent) <= min(MAX_LINEAGE_RECENT, lineage["resumes"])
  ):
    entries = [_checked_entry(entry) for entry in recent]
  if entries is None or None in entries:
    raise errors.InvalidStateError(
        f"{origin}: field 'lineage' must be {{'resumes': int, 'digest': str, 'recent': "
        f"[at most {MAX_LINEAGE_RECENT} {{'step': int, 'state': str[, 'record': int >= 0, 'batch_size': "
        "int >= 1, 'process_count': int >= 1]}], 'run': step (optional)}, "
        f"got {_short(lineage)}."
    )
  result = {"resumes": int(lineage["resumes"]), "digest": lineage["digest"], "recent": entries}
  if LINEAGE_RUN in lineage:
    result[LINEAGE_RUN] = int(lineage[LINEAGE_RUN])
  return _CheckedLineage(result)


def checked_lineage(lineage: Any, origin: str) -> Mapping[str, Any] | None:
  """A lineage read from a file, checked: a state built with the result does not walk its entries
  again (the pod part a step's processes share, `_files`, is checked once per text read, not once
  per state that holds it)."""
  return _checked_lineage(lineage, origin)


def carried_geometry(recent: Any) -> list[dict[str, Any]]:
  """Per resume entry of a lineage, its `batch_size`, `process_count`, `lanes` and `mixture`: its own, or those of
  the latest entry before it that recorded them (an entry leaves out what did not change:
  `_item.segment_fields`)."""
  carried: dict[str, Any] = {}
  result = []
  for entry in recent:
    for name in ("batch_size", "process_count", "lanes"):
      if _is_int(entry.get(name)):
        carried[name] = int(entry[name])
    if isinstance(entry.get("mixture"), str):
      carried["mixture"] = entry["mixture"]
    result.append(dict(carried))
  return result


def latest_geometry(recent: Sequence[Mapping[str, Any]], names: Collection[str]) -> dict[str, Any]:
  """`carried_geometry(recent)[-1]` of the fields `names`: read back from the latest entry only as far as
  needed (a resume adds an entry: its cost must not grow with the restarts before it)."""
  found: dict[str, Any] = {}
  for entry in reversed(recent):
    for name in names:
      value = entry.get(name)
      if value is None or name in found:  # most entries record no geometry
        continue
      if name == "mixture":
        if isinstance(value, str):
          found[name] = value
      elif _is_int(value):
        found[name] = int(value)
    if len(found) == len(names):
      break
  return found


def _valid_text(value: Any) -> bool:
  """A str that is valid Unicode (no lone surrogate, which JSON's escapes can make)."""
  if type(value) is not str and not isinstance(value, str):
    return False
  if value.isascii():
    return True
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _is_plain_entry(entry: Any) -> bool:
  """An entry as ckpt_iter writes it, JSON-read: exact types, ASCII text (a process's first read of a
  lineage checks its 64 entries; this costs half the general walk below)."""
  if type(entry) is not dict or not entry.keys() <= _PLAIN_ENTRY_KEYS:
    return False
  step, state = entry.get("step"), entry.get("state")
  if type(state) is not str or not state.isascii() or not (step is None or type(step) is int):
    return False
  for name, low in _SEGMENT_ENTRY_FIELDS.items():
    value = entry.get(name)
    if value is not None and not (type(value) is int and value >= low):
      return False
  mixture, resized = entry.get("mixture"), entry.get("resized")
  return (mixture is None or (type(mixture) is str and mixture.isascii())) and (resized is None or resized is True)


_PLAIN_ENTRY_KEYS = frozenset({"step", "state", *_SEGMENT_ENTRY_FIELDS, "mixture", "resized"})


def _checked_entry(entry: Any) -> dict[str, Any] | None:
  """A copy of one resume entry, or None when it is malformed."""
  if _is_plain_entry(entry):
    return dict(entry)
  if not isinstance(entry, Mapping):
    return None
  for key, value in entry.items():
    kind = type(value)
    if kind is str:
      if not value.isascii() and not _valid_text(value):
        return None
    elif not (kind is int or value is None or is_json_scalar(value)):
      return None
    if type(key) is not str or (not key.isascii() and not _valid_text(key)):
      return None
  copy = dict(entry)
  step = copy.get("step")
  if type(copy.get("state")) is not str or not (step is None or _is_int(step)):
    return None
  for name, low in _SEGMENT_ENTRY_FIELDS.items():
    value = copy.get(name)
    if value is not None and not (_is_int(value) and value >= low):
      return None
  return copy


def extended_lineage(value: "IteratorState", lineage: Mapping[str, Any], entry: Mapping[str, Any]) -> "IteratorState":
  """`value` with `lineage` (its own lineage, validated, with `entry` appended by `_item.extended`): only
  the new entry is checked."""
  if _checked_entry(entry) is None:
    raise errors.InvalidStateError(f"IteratorState: resume entry {_short(dict(entry))} is malformed.")
  result = object.__new__(type(value))
  result.__dict__.update(value.__dict__)
  object.__setattr__(result, "lineage", _extended_checked(value.lineage, lineage))
  return result


def _extended_checked(before: Mapping[str, Any] | None, lineage: Mapping[str, Any]) -> FrozenDict:
  """`lineage`, checked: when its earlier entries are `before`'s own (shared, checked already), only
  its scalars are; a state built from it (a `dataclasses.replace`) does not walk the entries again."""
  earlier = list(lineage["recent"][:-1])
  before_recent = [] if before is None else before["recent"]
  shared = (before is None or type(before) is _CheckedLineage) and len(earlier) <= len(before_recent) and all(
      mine is theirs for mine, theirs in zip(earlier, before_recent[len(before_recent) - len(earlier):]))
  if not shared:
    return _checked_lineage(lineage, "IteratorState")
  result = {**lineage, "recent": [*earlier, _checked_entry(lineage["recent"][-1])]}
  if (
      result["recent"][-1] is not None
      and set(result) - {LINEAGE_RUN} == {"resumes", "digest", "recent"}
      and _is_int(result["resumes"]) and result["resumes"] >= len(result["recent"])
      and _valid_text(result["digest"]) and len(result["recent"]) <= MAX_LINEAGE_RECENT
      and (LINEAGE_RUN not in result or (_is_int(result[LINEAGE_RUN]) and result[LINEAGE_RUN] >= 0))
  ):
    return _CheckedLineage(result)
  return _checked_lineage(lineage, "IteratorState")  # raises, naming what is wrong


class FrozenDict(dict):
  """A dict that refuses changes: the mapping fields of an IteratorState.

  A dict subclass, so JSON, equality with a dict and repr are a dict's; a
  copy or pickle of it is a plain (mutable) dict.
  """

  def _refuse(self, *args: Any, **kwargs: Any) -> Any:
    raise TypeError("an IteratorState is immutable: its mappings cannot be changed "
                    "(build a new state, e.g. with dataclasses.replace).")

  __setitem__ = __delitem__ = __ior__ = _refuse
  clear = pop = popitem = setdefault = update = _refuse

  def __reduce__(self) -> Any:
    return (dict, (dict(self),))

  def __copy__(self) -> dict:
    return dict(self)

  def __deepcopy__(self, memo: Any) -> dict:
    return _thawed(self)


class _CheckedLineage(FrozenDict):
  """A lineage `_checked_lineage` built: read-only, so checking it again returns it unchanged."""


def _checked_copy(value: Any, field: str, origin: str, depth: int = 0) -> Any:
  """`_thawed(value)`, refusing what a state file could hold but a state cannot.

  Nesting deeper than MAX_NESTING (a recursion bomb for every later walk)
  and strings that are not valid Unicode (JSON's "\\ud800" escapes decode to
  lone surrogates, which no file or terminal can encode).

  Raises:
    InvalidStateError: naming `field`.
  """
  if depth > MAX_NESTING:
    raise errors.InvalidStateError(
        f"{origin}: field {field!r} is nested deeper than {MAX_NESTING} levels; no iterator "
        "state is. The state is corrupt or hostile: restore an earlier step.")
  kind = type(value)
  if kind is str and value.isascii():
    return value  # the common case, without the encode
  if kind is int or kind is bool or value is None:
    return value  # nor the ABC checks below
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:
      raise errors.InvalidStateError(
          f"{origin}: field {field!r} holds a string that is not valid Unicode (a lone "
          f"surrogate): {value.encode('utf-8', 'backslashreplace').decode('ascii', 'replace')[:80]!r}. "
          "The state is corrupt or hostile: restore an earlier step.") from None
    return value
  if kind is dict or isinstance(value, Mapping):
    return {_checked_copy(k, field, origin, depth + 1): _checked_copy(v, field, origin, depth + 1)
            for k, v in value.items()}
  if isinstance(value, list):
    return [_checked_copy(v, field, origin, depth + 1) for v in value]
  if isinstance(value, tuple):
    return tuple(_checked_copy(v, field, origin, depth + 1) for v in value)
  return value


def _thawed(value: Any, *, content: bool = True) -> Any:
  """A deep copy of a JSON-like value as plain dicts and lists (tuples stay tuples:
  a Grain position tells them apart); a nested state as its dict form."""
  if isinstance(value, IteratorState):
    return value.nested_dict(content=content)
  if isinstance(value, Mapping):
    return {k: _thawed(v, content=content) for k, v in value.items()}
  if isinstance(value, list):
    return [_thawed(v, content=content) for v in value]
  if isinstance(value, tuple):
    return tuple(_thawed(v, content=content) for v in value)
  return value


def _canonical_json(value: Any) -> str:
  # Without nested content records: equality leaves them out, so hashing does too.
  return json.dumps(_thawed(value, content=False), sort_keys=True, default=repr)


def validated_pending(pending: Any, origin: str) -> Pending:
  """The Pending of a dict form, its lists checked (items may still be encoded)."""
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
  Fields introduced after a state was written are not compared: a saved
  fingerprint without "graph" predates the graph fields, so this pipeline's
  "graph" and "node[...]" fields are left out (its other fields, which such a
  state has, are compared as before). See docs/state_format.md.
  """
  if not saved:
    return
  unknown = set(allow_drift) - set(saved) - set(current) if allow_drift else ()
  if unknown:
    raise errors.InvalidArgumentError(
        f"allow_drift names {sorted(unknown)}, which are not fingerprint fields. "
        f"Known fields: {sorted(set(saved) | set(current))}."
    )
  differences = differing_fields(saved, current, allow_drift=allow_drift)
  if differences:
    raise errors.ConfigDriftError(differences, origin=origin)


ABSENT = "<absent>"


def differing_fields(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, allow_drift: Collection[str] = ()
) -> dict[str, tuple[Any, Any]]:
  """name -> (saved, current) of the fingerprint fields that differ (ABSENT where missing).

  The one comparison of two fingerprints (`check_fingerprint`, `_drift.reconcile`).
  A saved fingerprint without "graph" predates the graph fields, so those
  of `current` are not compared. A function's name that differs only where
  the function is defined is no difference (`same_function`).
  """
  if GRAPH_FIELD not in saved:
    current = {k: v for k, v in current.items() if not is_graph_field(k)}
  elif saved == current and all(type(value) is type(current[name]) for name, value in saved.items()):
    return {}  # a restore's common case, asked once per concern: one comparison in C, then the types
  differences = {}
  # Usually both have the same fields: no union set to build then.
  names = saved.keys() if saved.keys() == current.keys() else saved.keys() | current.keys()
  for name in names:
    if name in allow_drift:
      continue
    before, after = saved.get(name, ABSENT), current.get(name, ABSENT)
    if type(before) is type(after) and before == after:
      continue  # same_field_value's common case, without the call
    if not same_field_value(before, after):
      differences[name] = (before, after)
  if differences:
    for name in [n for n in differences if same_function(n, saved, current)]:
      del differences[name]
  return differences


def same_function(name: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
  """Whether fingerprint field `name`, a function's qualified name, names the same function in both.

  The same when its code digest (`_graph.code_digest`, recorded beside the
  name) is known and equal and the function's own name (the last part of
  the qualified name) is the same: its module and enclosing class or
  function may differ (`__main__.tokenize` run as a script, `train.tokenize`
  imported). The own name still counts because the digest does not cover
  the names the code calls: `r.upper()` and `r.lower()` digest alike. Without
  a digest (a builtin) the whole name decides.
  """
  code = _code_field(name, saved)
  digest = saved.get(code) if code is not None else None
  before, after = saved.get(name), current.get(name)
  return (
      isinstance(digest, str) and current.get(code) == digest
      and isinstance(before, str) and isinstance(after, str)
      and before.rsplit(".", 1)[-1] == after.rsplit(".", 1)[-1]
  )


def _code_field(name: str, fingerprint: Mapping[str, Any]) -> str | None:
  """The field holding the code digest of the function named by field `name`, or None.

  `node[i].Kind.fn` (map, filter), `node[i].GlobalBatchDataset.transform`
  and a DataLoader's `loader.op[i]` have theirs beside them; make_dataset's
  top-level `transform` has its node's `transform_code`.
  """
  if name.startswith(_GRAPH_FIELD_PREFIX):
    return f"{name}_code" if name.endswith((".fn", ".transform")) else None
  if name.startswith("loader.op[") and name.endswith("]"):
    return f"{name}.code"
  if name == "transform":
    return next((field for field in fingerprint if field.endswith(".GlobalBatchDataset.transform_code")
                 and field[: -len("_code")] not in fingerprint), None)
  return None


def is_graph_field(name: str) -> bool:
  """A field of the graph fingerprint ("graph" or "node[i].Kind.param")."""
  return name == GRAPH_FIELD or name.startswith(_GRAPH_FIELD_PREFIX)


def same_field_value(a: Any, b: Any) -> bool:
  """Equal fingerprint values: True is not 1, int types may differ, NaN is NaN."""
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  return type(a) is type(b) and a == b or (_is_int(a) and _is_int(b) and a == b)


# ---------------------------------------------------------------------------
# Field checks, the value predicates the codec shares, and the restore protocol.


def require(value: Mapping[str, Any], name: str, kind: type, origin: str) -> Any:
  if name not in value:
    raise errors.InvalidStateError(f"{origin} has no field {name!r}.")
  if not isinstance(value[name], kind):
    raise errors.InvalidStateError(
        f"{origin}: field {name!r} must be a {kind.__name__}, got {_short(value[name])}."
    )
  return value[name]


def is_int(value: Any) -> bool:
  """An integer that is not a bool."""
  # The exact type first: an ABC isinstance costs ten times more.
  return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


_is_int = is_int


# The exact types JSON parsing gives; is_json_scalar also takes their subclasses.
_JSON_SCALAR_TYPES = frozenset({type(None), bool, int, str})  # floats: finite ones only (is_json_scalar)


def is_json_scalar(value: Any) -> bool:
  """None, a bool, an int, a str or a finite float (JSON has no NaN or infinity)."""
  if value is None or isinstance(value, (bool, str)):
    return True
  if isinstance(value, float):
    return math.isfinite(value)
  return isinstance(value, int)


def short_repr(value: Any, limit: int = 80) -> str:
  """repr(value) cut to `limit` characters, for error messages."""
  try:
    text = repr(value)
  except RecursionError:  # a hostile value nested thousands deep
    text = f"<{type(value).__name__} nested too deeply to show>"
  return text if len(text) <= limit else text[: limit - 3] + "..."


_short = short_repr


def check_kind(state: IteratorState, expected: str, receiver: str, origin: str) -> None:
  """Raises unless `state` was written by the kind of iterator `receiver` is."""
  if state.kind != expected:
    raise errors.InvalidStateError(
        f"{origin} was written by a {state.kind!r} iterator; a {receiver} "
        f"restores {expected!r} states only. Restore it into the same iterator type."
    )


@typing.runtime_checkable
class Restorable(typing.Protocol):
  """What a state is restored into: checked in full, then applied.

  `check_restore` validates `state` against the receiver (kind, fingerprint,
  position, key) and changes nothing; it returns the apply step, which cannot
  fail. So a refused restore leaves the receiver exactly as it was, and a
  composite receiver (a RepeatIterator over a DataIterator, a Tunix learner's
  input) checks every part before it applies any. Every ckpt_iter iterator
  implements it; `IteratorRestore` restores through it.
  """

  def check_restore(
      self,
      state: IteratorState,
      *,
      allow_drift: Collection[str] = (),
      origin: str = "the state",
  ) -> Callable[[], None]:
    ...


class RestorableIterator:
  """Grain's state protocol for a `Restorable` iterator with a `state()` value.

  `get_state` / `set_state` are Grain's dict forms; `restore_state` takes the
  value, checks it in full and only then applies it, so a refused state
  leaves the iterator as it was.
  """

  # The lineage its states carry: the restored state's (with the resume),
  # or the one its run's first save named (`keep_lineage`).
  _lineage: Any = None

  def state(self) -> IteratorState:
    raise NotImplementedError

  def state_part(self) -> IteratorState:
    """`state()` as a composite nests it: without a lineage (the outermost state holds the run's)."""
    return self.state().with_lineage(None)

  def keep_lineage(self, lineage: Mapping[str, Any] | None) -> None:
    """Called by the save handlers after a save named this run (`_item.started`):
    the iterator's later states carry that lineage."""
    self._lineage = lineage

  def check_restore(
      self, state: IteratorState, *, allow_drift: Collection[str] = (), origin: str = "the state"
  ) -> Callable[[], None]:
    raise NotImplementedError

  def get_state(self) -> dict[str, Any]:
    """Grain's dict form: `to_dict()` with the content record and the lineage as JSON text.

    Grain's handler and MaxText's save this. One string each (`"null"` when
    there is none yet) keeps the structure the same from the first call on,
    as Grain's own checkpoint helpers require, and carries both through:
    `set_state` checks the content as `IteratorRestore` does and carries the
    lineage on unchanged (Grain's protocol: after `set_state(s)`,
    `get_state()` is `s`; with no step number a resume could not be proven).
    """
    return grain_form(self.state().to_dict())

  def set_state(self, state: Mapping[str, Any]) -> None:
    with collection_paused():
      self.restore_state(IteratorState.from_dict(state))

  def restore_state(
      self, state: IteratorState, *, allow_drift: Collection[str] = (), origin: str = "the state"
  ) -> None:
    """Validates `state` in full, then applies it."""
    with collection_paused():
      self.check_restore(state, allow_drift=allow_drift, origin=origin)()


_PAUSE_LOCK = threading.Lock()
_pauses = [0, False]  # pauses in progress in any thread, and whether the collector was on before the first


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
  """The garbage collector off for the duration (back on after the last pause ends, if it was on).

  A restore decodes a state into many small objects that hold no cycle (10^4
  skip ranges: tens of thousands): collections during it only walk them again
  and again (such a restore ran 4x slower with the collector on). Counted
  across threads: a restore ending in one thread does not turn the collector
  back on under another's.
  """
  with _PAUSE_LOCK:
    if _pauses[0] == 0:
      _pauses[1] = gc.isenabled()
      gc.disable()
    _pauses[0] += 1
  try:
    yield
  finally:
    with _PAUSE_LOCK:
      _pauses[0] -= 1
      if _pauses[0] == 0 and _pauses[1]:
        gc.enable()


# ---------------------------------------------------------------------------
# A learner's data state nests its input's own state (format 2 on).

INPUT = "input"
INPUT_KIND = "data"

# The field that names the learner, per family, and the fields of its own that
# format 1 wrote into the fingerprint beside the input's (every version of it).
_RL = "learner"
_SFT = "trainer"
_AGENTIC = "agentic_learner"
_V1_LEARNER_FIELDS = {
    _RL: frozenset({
        "learner", "num_iterations", "num_generations", "full_batch_size", "mini_batch_size",
        "train_micro_batch_size", "rollout_micro_batch_size", "compute_logps_micro_batch_size",
        "data_shuffle_seed", "async_rollout", "separate_rollout_weights", "max_seq_token_per_tpu",
        "settings",
    }),
    _SFT: frozenset({"trainer", "gradient_accumulation_steps"}),
    _AGENTIC: frozenset({
        "num_iterations_order", "agentic_learner", "num_generations", "num_iterations",
        "off_policy_steps", "mini_batch_size", "train_micro_batch_size",
        "compute_logps_micro_batch_size",
    }),
}
# Where format 1 kept the input's position (None: the whole position was it).
_V1_INPUT_POSITION = {_RL: "full_batch", _SFT: None, _AGENTIC: "source"}


# A Tunix RL or SFT learner's own position fields beside its input's state (`tunix._input.MicroBatchInput`):
# micro-batches of the current full batch taken, rows taken (an uneven cut), the prompts of the stream before
# the next one (`stream_rows`), and the record of the last prompts trained (`last_prompts`, 0.2.0's `last_rows`).
LAST_PROMPTS = "last_prompts"
LEGACY_LAST_ROWS = "last_rows"
_MICRO_BATCH_POSITION_KEYS = frozenset({"micro_batches_taken", "rows_taken", "stream_rows", LAST_PROMPTS,
                                        LEGACY_LAST_ROWS})
# The agentic learner's: the next prompt, where it is in its fed batch, the batches fed after it, which
# pending updates close a micro-batch, and a replay of the step's inputs (checked against the config at restore).
_AGENTIC_COUNTS = ("prompt_index", "prompt_offset", "batches_fed")


def check_learner_position(value: "IteratorState", origin: str, *, step: int | None = None) -> None:
  """A Tunix learner's own position fields and counters, checked as its restore checks them before anything
  moves.

  The one check of them: the learner's restore and `ckpt-iter verify` (from the state alone, with no
  Tunix installed) call it, so every field the restore refuses, verify refuses by name. An RL learner's
  position is held to its batch geometry (`_check_rl_geometry`) and its counters to its pending items.

  Args:
    value: the state.
    origin: what errors name.
    step: the checkpoint step the state is stored in (its `train_steps` must be it), when known.

  Raises:
    InvalidStateError: naming the field, its value and what was expected.
  """
  if value.kind != "tunix":
    return
  train_steps = value.counters.get("train_steps")
  if step is not None and train_steps != step:
    raise errors.InvalidStateError(
        f"{origin}: the data state was taken at train step {train_steps!r}, "
        f"but the model was restored at step {step}; they must come from one step.")
  family = learner_family(value.fingerprint)
  _, own = learner_parts(value, origin, learner_fields=family != _SFT)
  if family == _AGENTIC:
    _check_agentic_position(own, origin)
  elif family != _SFT:
    check_micro_batch_position(own, origin)
    _check_rl_counters(value, origin)
    _check_rl_geometry(value, own, origin)


def _check_rl_counters(value: "IteratorState", origin: str) -> None:
  """An RL learner's counters: the global step's, and the evaluation input among the pending items."""
  counters = value.counters
  for name in ("global_steps", "remaining_mini_batches"):
    if name not in counters:
      raise errors.InvalidStateError(f"{origin}: counter {name!r} is missing.")
    if counters[name] < 0:
      raise errors.InvalidStateError(f"{origin}: counter {name!r} is {counters[name]}; it counts, from 0.")
  eval_items = counters.get("eval_items", 0)
  pending_items = len(value.pending.items) if value.pending is not None else 0
  scheduled = set(value.pending.schedule) if value.pending is not None else set()
  if eval_items < 0 or eval_items > pending_items or any(i >= pending_items - eval_items for i in scheduled):
    raise errors.InvalidStateError(
        f"{origin}: counter 'eval_items' is {eval_items!r}; it must count trailing "
        "pending items the schedule does not use (the mini-batch's evaluation input).")


def _check_rl_geometry(value: "IteratorState", own: Mapping[str, Any], origin: str) -> None:
  """An RL learner's position, held to what its full, mini- and micro-batch sizes allow.

  A checkpoint falls after a mini-batch's prompts were read (its repeats may
  be pending): the position is the rows taken of the full batch the next
  micro-batch starts in, in micro-batches (and `rows_taken` when the rows
  are not whole micro-batches). Where the input's batches all hold
  `full_batch_size` rows (a batch with drop_remainder), the mini-batches
  read of the global step fix those rows: (mini-batches per global step -
  remaining) x mini_batch_size, modulo the full batch. States written
  before these fields existed are taken as they are.
  """
  fingerprint, counters = value.fingerprint, value.counters
  full, mini, micro = (fingerprint.get(k) for k in ("full_batch_size", "mini_batch_size", "train_micro_batch_size"))
  if not all(_is_int(size) and size > 0 for size in (full, mini, micro)):
    return
  geometry = f"full_batch_size={full}, mini_batch_size={mini}, train_micro_batch_size={micro}"
  taken, rows_taken = own["micro_batches_taken"], own.get("rows_taken")
  rows = taken * micro if rows_taken is None else rows_taken

  def refuse(field: str, shown: Any, expected: str) -> NoReturn:
    raise errors.InvalidStateError(
        f"{origin}: field '{field}' is {_short(shown)} where {geometry}: {expected}. The position is not "
        "one this learner writes (edited or damaged): restore an earlier checkpoint.")

  if micro == full and rows:
    refuse("position.micro_batches_taken", taken, "full batches pass whole to the trainer, so none is taken")
  if rows_taken is not None and (rows_taken // micro != taken or rows_taken % micro == 0):
    refuse("position.rows_taken", rows_taken, f"it is written only for rows that are not whole micro-batches, "
           f"with micro_batches_taken={rows_taken // micro}")
  inner = value.innermost.fingerprint
  if inner.get("batch_size") != full:
    return  # an input whose batches this state does not size: the restore's first read checks it
  if rows >= full:
    refuse("position.rows_taken" if rows_taken is not None else "position.micro_batches_taken",
           rows_taken if rows_taken is not None else taken,
           f"the rows taken of a full batch ({rows}) are fewer than its {full}")
  per_step, remaining = counters.get("mini_batches_per_global_step"), counters.get("remaining_mini_batches")
  if per_step is None or remaining is None:
    return
  if per_step != full // mini or remaining >= per_step:
    refuse("counters", {"mini_batches_per_global_step": per_step, "remaining_mini_batches": remaining},
           f"a global step is {full // mini} mini-batches, fewer of them remaining")
  if inner.get("drop_remainder") is True and rows != (per_step - remaining) * mini % full:
    refuse("position.micro_batches_taken" if rows_taken is None else "position.rows_taken",
           taken if rows_taken is None else rows_taken,
           f"with {remaining} of the global step's {per_step} mini-batches remaining, "
           f"{(per_step - remaining) * mini % full} rows of the full batch are taken "
           f"({(per_step - remaining) * mini % full // micro} micro-batches)")


def learner_parts(value: "IteratorState", origin: str, *, learner_fields: bool = True
                  ) -> tuple["IteratorState", dict[str, Any]]:
  """(the input's state a learner's state nests, the learner's own position fields).

  Raises:
    InvalidStateError: the position nests no input state (or, with `learner_fields=False`, as an SFT
      trainer's, holds more than it).
  """
  part, own = value.part, value.own_position
  if part is None or (own and not learner_fields):
    fields = ", ...the learner's fields" if learner_fields else ""
    raise errors.InvalidStateError(
        f"{origin}: field 'position' is {_short(value.position)}; a learner's position is "
        f"{{'{INPUT}': <its input's state: kind, fingerprint, position[, content]>{fields}}}.")
  return part, own


def check_micro_batch_position(position: Mapping[str, Any], origin: str) -> None:
  """An RL or SFT learner's own position fields (beside its input's state).

  Raises:
    InvalidStateError: naming the field.
  """
  taken = position.get("micro_batches_taken")
  if set(position) - _MICRO_BATCH_POSITION_KEYS or not _is_int(taken) or taken < 0:
    raise errors.InvalidStateError(
        f"{origin}: field 'position' holds {_short(dict(position))} beside '{INPUT}'; expected "
        f"'micro_batches_taken': N[, 'rows_taken': R, 'stream_rows': N, '{LAST_PROMPTS}': {{...}}].")
  for name in ("rows_taken", "stream_rows"):
    if name in position and (not _is_int(position[name]) or position[name] < 0):
      raise errors.InvalidStateError(
          f"{origin}: field 'position.{name}' is {_short(position[name])}; expected a non-negative integer "
          "(the prompts taken of the current full batch, or of the stream before it).")
  for field, key, shape in ((LAST_PROMPTS, "content", "<content record>"), (LEGACY_LAST_ROWS, "digest", "'<hex>'")):
    saved = position.get(field)
    if saved is None:
      continue
    if (not isinstance(saved, Mapping) or set(saved) != {"count", key}
        or not _is_int(saved["count"]) or saved["count"] < 0
        or (field == LEGACY_LAST_ROWS and not isinstance(saved[key], str))):
      raise errors.InvalidStateError(
          f"{origin}: field 'position.{field}' is {_short(saved)}; expected {{'count': N, '{key}': {shape}}}.")
    if field == LAST_PROMPTS:
      checked_content_record(saved[key], f"position.{field}.{key}", origin)


def _check_agentic_position(position: Mapping[str, Any], origin: str) -> None:
  for name in _AGENTIC_COUNTS:
    if not _is_int(position.get(name)) or position[name] < 0:
      raise errors.InvalidStateError(
          f"{origin}: field 'position.{name}' is {_short(position.get(name, ABSENT))}; expected a non-negative "
          "integer (an agentic learner's prompt index, its offset in its fed batch, the batches fed after it).")
  ends = position.get("ends_micro_batch")
  if not isinstance(ends, (list, tuple)) or not all(isinstance(e, bool) for e in ends):
    raise errors.InvalidStateError(
        f"{origin}: field 'position.ends_micro_batch' is {_short(ends)}; expected a list of booleans (which "
        "pending updates close a micro-batch).")
  if position["prompt_offset"] > position["prompt_index"]:
    raise errors.InvalidStateError(
        f"{origin}: field 'position.prompt_offset' is {position['prompt_offset']}, past its prompt index "
        f"{position['prompt_index']}: the offset of a prompt in its fed batch is at most its index.")


def learner_family(fingerprint: Mapping[str, Any]) -> str | None:
  """"learner" (RL), "trainer" (SFT) or "agentic_learner": the field naming the learner."""
  for name in (_RL, _SFT, _AGENTIC):
    if name in fingerprint:
      return name
  return None


CONTENT = "content"


def migrate_learner_v1(fields: Mapping[str, Any]) -> dict[str, Any]:
  """A format-1 learner state (kind "tunix") with its input's state nested.

  A state whose learner family cannot be told (no learner field: not written
  by ckpt_iter) is returned unchanged, for the learner's check to refuse.
  """
  fingerprint = fields.get("fingerprint")
  position = fields.get("position")
  name = learner_family(fingerprint) if isinstance(fingerprint, Mapping) else None
  if name is None or not isinstance(position, Mapping):
    return dict(fields)
  own = _V1_LEARNER_FIELDS[name]
  key = _V1_INPUT_POSITION[name]
  if key is None:
    input_position, learner_position = position, {}
  elif key in position:
    input_position = position[key]
    learner_position = {k: v for k, v in position.items() if k != key}
  else:
    return dict(fields)
  result = dict(fields)
  result["fingerprint"] = {k: v for k, v in fingerprint.items() if k in own}
  input_fingerprint = {k: v for k, v in fingerprint.items() if k not in own}
  result["position"] = {
      INPUT: {"kind": INPUT_KIND, "fingerprint": input_fingerprint, "position": input_position},
      **learner_position,
  }
  return result


def input_stream_skips(value: "IteratorState", *, origin: str, step: int | None = None) -> skips_lib.Skips:
  """The skips of a state's input, its stream fields checked as its restore checks them.

  `_records.check_stream_fields` of its innermost state, a stream's position
  (`check_stream_position`) and a Tunix learner's own fields
  (`check_learner_position`): what the read-only CLI (`verify`, `which`,
  `order`, `audit`) asks of every state it reads, so it refuses each field a
  restore refuses, with the restore's message.

  `step`: the checkpoint step the state is stored in, when known (a learner's state must be its).

  Raises:
    InvalidStateError: a stream field of the input is malformed (the message names it).
  """
  check_learner_position(value, origin, step=step)
  inner = value.innermost
  if is_stream(inner.fingerprint):
    check_stream_position(inner.fingerprint, inner.position, origin)
  _lane_mixture.check_position(inner.fingerprint, inner.position, origin=origin)
  return _records.check_stream_fields(inner.fingerprint, inner.position, origin=origin)


def is_stream(fingerprint: Mapping[str, Any]) -> bool:
  """Whether a fingerprint is a StreamingIterator's (its source named "stream:...")."""
  source = fingerprint.get("source")
  return isinstance(source, str) and source.startswith(STREAM_SOURCE_PREFIX)


_STREAM_POSITION_FIELDS = frozenset({STREAM_ELEMENTS_READ, STREAM_RECORDS_READ, STREAM_SOURCE_STATE})
_HF_STATE_FIELDS = frozenset({"examples_iterable", "epoch"})


def check_stream_position(fingerprint: Mapping[str, Any], position: Mapping[str, Any], origin: str) -> None:
  """A StreamingIterator's position, checked as its restore checks it before the source sees it.

  Counts that are non-negative integers (records >= elements), a source
  state that is a mapping; a Hugging Face stream's state holds exactly its
  `examples_iterable` and a non-negative integer `epoch`, every count in it
  non-negative, every layer named; and a state at the stream's very start
  with records read is refused (loaded, it would read them all again).

  Raises:
    InvalidStateError: naming the field, its value and what was expected.
  """
  elements, records = position.get(STREAM_ELEMENTS_READ), position.get(STREAM_RECORDS_READ)
  saved = position.get(STREAM_SOURCE_STATE)
  if (set(position) != _STREAM_POSITION_FIELDS or not is_int(elements) or elements < 0
      or not is_int(records) or records < elements or not isinstance(saved, Mapping)):
    raise errors.InvalidStateError(
        f"{origin}: field 'position' is {_short(position)}; a streaming source's position is "
        f"{{'{STREAM_ELEMENTS_READ}': K, '{STREAM_RECORDS_READ}': N, '{STREAM_SOURCE_STATE}': {{...}}}} "
        "(N >= K >= 0).")
  where = f"{origin}: field 'position.{STREAM_SOURCE_STATE}'"
  if str(fingerprint.get("source", "")).startswith(STREAM_SOURCE_PREFIX + "hf["):
    if set(saved) != _HF_STATE_FIELDS or not isinstance(saved.get("examples_iterable"), Mapping):
      raise errors.InvalidStateError(
          f"{where} is {_short(saved)}; a Hugging Face stream's state holds exactly "
          f"{sorted(_HF_STATE_FIELDS)} (its examples_iterable a mapping). Restore a state its "
          "StreamingIterator wrote.")
    epoch = saved.get("epoch")
    if not is_int(epoch) or epoch < 0:
      raise errors.InvalidStateError(f"{where}.epoch is {_short(epoch)}, expected a non-negative integer.")
    _check_stream_leaves(saved["examples_iterable"], f"{where}.examples_iterable")
    layers = fingerprint.get("source_pipeline")
    if isinstance(layers, str) and stream_layer_types(saved) != layers:
      raise errors.InvalidStateError(
          f"{where} has the layers {_short(stream_layer_types(saved))}, the stream that wrote it "
          f"{_short(layers)} (fingerprint field 'source_pipeline'): edited, or of another pipeline. "
          "Restore a state its StreamingIterator wrote.")
    if records > 0 and epoch == 0 and _at_start(saved["examples_iterable"]):
      raise errors.InvalidStateError(
          f"{where} is the stream's start, but {records} records were read: loaded, it would read "
          "them all again. Restore a state its StreamingIterator wrote.")


def stream_layer_types(value: Any) -> str:
  """The layer types a Hugging Face state names, outermost first (`Formatted<Mapped<Arrow`), bounded."""
  types: list[str] = []

  def walk(node: Any, depth: int) -> None:
    if depth > 64:
      return
    if isinstance(node, Mapping):
      if isinstance(node.get("type"), str):
        types.append(node["type"].replace("ExamplesIterable", ""))
      for key, inner in node.items():
        if key not in ("previous_state", "previous_states"):
          walk(inner, depth + 1)
    elif isinstance(node, list):
      for inner in node:
        walk(inner, depth + 1)

  walk(value, 0)
  return "<".join(types)


def _check_stream_leaves(node: Any, where: str, depth: int = 0) -> None:
  """Every count in a Hugging Face layer state non-negative, every `type` a string (bounded depth)."""
  if depth > 64:
    raise errors.InvalidStateError(f"{where}: nested more than 64 levels deep.")
  if isinstance(node, Mapping):
    if "type" in node and not isinstance(node["type"], str):
      raise errors.InvalidStateError(f"{where}.type is {_short(node['type'])}, expected a layer's name.")
    for key, inner in node.items():
      _check_stream_leaves(inner, f"{where}.{key}", depth + 1)
  elif isinstance(node, (list, tuple)):
    for i, inner in enumerate(node):
      _check_stream_leaves(inner, f"{where}[{i}]", depth + 1)
  elif is_int(node) and node < 0:
    raise errors.InvalidStateError(f"{where} is {node}, expected a non-negative count.")


def _at_start(node: Any) -> bool:
  """Whether a Hugging Face layer state is a fresh stream's: no count past zero, no earlier state kept."""
  if isinstance(node, Mapping):
    return all(not inner if key.startswith("previous_state") else _at_start(inner) for key, inner in node.items())
  if isinstance(node, (list, tuple)):
    return all(_at_start(inner) for inner in node)
  return isinstance(node, bool) or not is_int(node) or node == 0


def flat_fingerprint(value: "IteratorState") -> dict[str, Any]:
  """Every fingerprint field of a state in one dict: the input's as `input.<name>` in a learner's, a
  repeat state's source's beside its own."""
  inner = value.innermost
  if inner is value:
    return dict(value.fingerprint)
  if value.kind == "repeat":  # its own three fields never collide with its source's
    return {**inner.fingerprint, **value.fingerprint}
  return {**{f"{INPUT}.{k}": v for k, v in inner.fingerprint.items()}, **value.fingerprint}


# ---------------------------------------------------------------------------
# What a state says, in words: the one describer of states for the CLI and the logs.

# A Tunix learner's own position fields worth a line: RL's micro-batches into
# the full batch, the prompts consumed (RL), the next prompt (agentic).
LEARNER_POSITION_FIELDS = ("micro_batches_taken", "stream_rows", "prompt_index")


def position_fields(value: "IteratorState") -> dict[str, Any]:
  """Where the input is: next_record with epoch and record in it, and a mixture's ledger (per source:
  records read, epoch, record in it); or a hand-built pipeline's next_index (with epoch and batch in
  it when its fingerprint says how many batches an epoch has). And a learner's own counts."""
  inner, own = value.innermost, value.own_position
  fingerprint, source_position = inner.fingerprint, inner.position
  fields: dict[str, Any] = {name: own[name] for name in LEARNER_POSITION_FIELDS if name in own}
  if not isinstance(source_position, Mapping):
    return fields
  next_record = source_position.get(_records.NEXT_RECORD)
  if is_int(next_record):
    fields[_records.NEXT_RECORD] = next_record
    length = fingerprint.get("source_length")
    if is_int(length) and length > 0:
      fields["epoch"], fields["record_in_epoch"] = divmod(next_record, length)
      fields["source_length"] = length
    ledger = _records.ledger(fingerprint, source_position)
    if ledger is not None:
      fields["ledger"] = {name: _source_reading(count, fingerprint.get(f"source_length[{name}]"))
                          for name, count in ledger.items()}
    return fields
  next_index = source_position.get("next_index")
  if is_int(next_index):
    fields["next_index"] = next_index
    per_epoch = fingerprint.get("batches_per_epoch")
    if is_int(per_epoch) and per_epoch > 0:
      fields["epoch"], fields["batch_in_epoch"] = divmod(next_index, per_epoch)
      fields["batches_per_epoch"] = per_epoch
  elif STREAM_SOURCE_STATE in source_position and is_int(source_position.get(STREAM_RECORDS_READ)):
    fields[STREAM_ELEMENTS_READ] = source_position.get(STREAM_ELEMENTS_READ)
    fields[STREAM_RECORDS_READ] = source_position[STREAM_RECORDS_READ]
  elif is_int(source_position.get("full_batches_read")):
    fields["full_batches_read"] = source_position["full_batches_read"]
  return fields


def _source_reading(count: int, length: Any) -> dict[str, int]:
  """One ledger entry: records read, and as epoch and record in it when the source's length is known."""
  entry = {"read": count}
  if is_int(length) and length > 0:
    entry["epoch"], entry["record_in_epoch"] = divmod(count, length)
    entry["source_length"] = length
  return entry


def _ledger_text(ledger: Mapping[str, Mapping[str, int]]) -> str:
  parts = []
  for name, entry in ledger.items():
    where = (f" (epoch {entry['epoch']}, {entry['record_in_epoch']} of {entry['source_length']})"
             if "epoch" in entry else "")
    parts.append(f"{name} {entry['read']}{where}")
  return "read " + ", ".join(parts)


def position_text(kind: str, fields: Mapping[str, Any], position: Any) -> str:
  """`epoch 1, 5 of 64 records read (next_record 69)`, a mixture's ledger, or the raw Grain state.

  `fields`: what `position_fields` found in `position`.
  """
  source = "input: " if kind == "tunix" else ""
  if _records.NEXT_RECORD in fields:
    if "ledger" in fields:
      return f"{source}stream record {fields[_records.NEXT_RECORD]}; {_ledger_text(fields['ledger'])}"
    if "epoch" in fields:
      return (f"{source}epoch {fields['epoch']}, {fields['record_in_epoch']} of {fields['source_length']} "
              f"records read (next_record {fields[_records.NEXT_RECORD]})")
    return f"{source}next_record {fields[_records.NEXT_RECORD]}"
  if "epoch" in fields:
    return (
        f"{source}epoch {fields['epoch']}, {fields['batch_in_epoch']} of "
        f"{fields['batches_per_epoch']} batches read (next_index {fields['next_index']})"
    )
  if "next_index" in fields:
    return f"{source}next_index {fields['next_index']}"
  if STREAM_RECORDS_READ in fields:
    return (f"{source}{fields[STREAM_ELEMENTS_READ]} elements, {fields[STREAM_RECORDS_READ]} records read "
            "(the stream's own state; restored without replay)")
  if "full_batches_read" in fields:
    return f"{source}{fields['full_batches_read']} elements read (replayed on restore)"
  return json.dumps(position, sort_keys=True, default=repr)


def summary_line(value: IteratorState) -> str:
  """One line: where the state continues, its learner counts and pending items."""
  fields = position_fields(value)
  parts = [position_text(value.kind, fields, value.position)]
  parts += [f"{name} {fields[name]}" for name in LEARNER_POSITION_FIELDS if name in fields]
  if value.pending is not None:
    parts.append(f"{len(value.pending.schedule)} pending")
  return ", ".join(parts)
