"""A learner's data state nests its input's own state (format 2).

A Tunix learner (RL, SFT, agentic) reads an input that has a state of its
own: a Grain iterator's, or a replayed iterable's. Its checkpoint keeps that
state whole, as Grain nests a parent's state under `parent`:

    fingerprint: the learner's own fields (batch geometry, num_iterations...)
    position:    {"input": {"kind": "data", "fingerprint": {...}, "position": {...}},
                  ...the learner's own position fields}

so a restore hands the input its state unchanged (the input's `check_restore`
decides what it accepts) and compares the learner's fields by itself, and a
reader (the CLI) finds the input's position in one place for every learner.
A validated state (format 4) holds the nested state as an `IteratorState`
(`state.NESTED`), in memory as the learners keep it.

Format 1 mixed the two: the input's fingerprint fields beside the learner's,
and its position under a family's own key. `migrate_v1` nests such a state;
which fields were the learner's is fixed by what format 1 ever wrote.
Pure: dicts in, dicts out (no JAX, Grain or Tunix).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def family(fingerprint: Mapping[str, Any]) -> str | None:
  """"learner" (RL), "trainer" (SFT) or "agentic_learner": the field naming the learner."""
  for name in (_RL, _SFT, _AGENTIC):
    if name in fingerprint:
      return name
  return None


CONTENT = "content"


def split(position: Any) -> tuple[Mapping[str, Any], Any, dict[str, Any]] | None:
  """(the input's fingerprint, the input's position, the learner's own position fields).

  None when `position` does not nest a well-formed input state: the caller
  refuses it, naming the field.
  """
  if not isinstance(position, Mapping):
    return None
  state = position.get(INPUT)
  if _is_state(state):  # a validated state: the input's is an IteratorState
    if state.kind != INPUT_KIND:
      return None
    return state.fingerprint, state.position, {k: v for k, v in position.items() if k != INPUT}
  if (
      not isinstance(state, Mapping) or set(state) - {CONTENT} != {"kind", "fingerprint", "position"}
      or state["kind"] != INPUT_KIND or not isinstance(state["fingerprint"], Mapping)
      or not isinstance(state["position"], Mapping)
  ):
    return None
  return state["fingerprint"], state["position"], {k: v for k, v in position.items() if k != INPUT}


def _is_state(value: Any) -> bool:
  # An IteratorState, without importing `state` (which imports this module).
  return type(value).__name__ == "IteratorState" and hasattr(value, "nested_dict")


def migrate_v1(fields: Mapping[str, Any]) -> dict[str, Any]:
  """A format-1 learner state (kind "tunix") with its input's state nested.

  A state whose learner family cannot be told (no learner field: not written
  by ckpt_iter) is returned unchanged, for the learner's check to refuse.
  """
  fingerprint = fields.get("fingerprint")
  position = fields.get("position")
  name = family(fingerprint) if isinstance(fingerprint, Mapping) else None
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


def input_view(
    kind: str, fingerprint: Mapping[str, Any], position: Any
) -> tuple[Mapping[str, Any], Any, dict[str, Any]]:
  """(the input's fingerprint, its position, the learner's own position fields) of any state.

  A data or repeat state is its own input; a learner's nests it (format 2,
  which every older state is migrated to on read). A learner state whose
  position nests nothing well-formed shows its whole position as the input's.
  """
  if kind == "tunix":
    parts = split(position)
    if parts is not None:
      return parts
  if kind == "repeat" and isinstance(position, Mapping) and _is_state(position.get("parent")):
    part = position["parent"]
    return part.fingerprint, part.position, {}
  return fingerprint, position, {}


def flat_fingerprint(kind: str, fingerprint: Mapping[str, Any], position: Any) -> dict[str, Any]:
  """Every fingerprint field of a state in one dict: the input's as `input.<name>` in a learner's, a
  repeat state's source's beside its own."""
  input_fingerprint, _, _ = input_view(kind, fingerprint, position)
  if input_fingerprint is fingerprint:
    return dict(fingerprint)
  if kind == "repeat":  # its own three fields never collide with its source's
    return {**input_fingerprint, **fingerprint}
  return {**{f"{INPUT}.{k}": v for k, v in input_fingerprint.items()}, **fingerprint}
