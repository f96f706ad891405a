"""The lineage of a state: which checkpoints the run that wrote it resumed from.

Every restore from a checkpoint step adds one entry to the restored state's
lineage: the step and a digest of the state restored there (kind,
fingerprint, position, key, pending schedule, counters). The state keeps the
last `MAX_RECENT` entries, the number of all of them and a running digest
over all, so it stays small however often a run is preempted, and
`ckpt-iter audit` can prove from the saved states alone that each resume
started exactly where the step it came from had stopped (`cli._audit`).

Entries are added where the step is known: the Orbax handlers and the
Tunix learners. `set_state` (Grain's protocol) carries a lineage unchanged.

A lineage also names its run: `run` is the step of the run's first save
(`started`), taken where the step is known and carried through every
resume. It is the same on every process of a pod with no coordination, and
a second job started from scratch into the same root gets another one, so
the audit tells the two apart even with the same pipeline and seed.
Pure: no JAX, Grain or Orbax.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ckpt_iter import _codec as codec
from ckpt_iter import _learner_state
from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_RECENT = state_lib.MAX_LINEAGE_RECENT
RUN = state_lib.LINEAGE_RUN
_START = "0" * 16  # the running digest of a run never resumed


def state_digest(value: state_lib.IteratorState) -> str:
  """A digest of where `value` continues: what a resume entry records of it.

  Computable from a header alone (pending items are not read: the schedule
  and the arrays' digest in the header stand for them), so the audit and
  the restore compute the same value.
  """
  return _digest_of_fields(
      value.kind, value.fingerprint, codec.position_to_json(value.to_dict()["position"]),
      value.shuffle_key, None if value.pending is None else value.pending.schedule, value.counters,
  )


def header_digest(header: Mapping[str, Any], *, origin: str) -> str:
  """`state_digest` of the state a header holds, without reading its arrays."""
  return _value_digest(codec.header_state(header, origin=origin))


def header_digests(
    header: Mapping[str, Any], *, origin: str, value: state_lib.IteratorState | None = None
) -> tuple[str, ...]:
  """Every digest a restore of this header may have recorded: `header_digest`, and for a
  header of an older format that migration reshapes (a format-1 Tunix state), the digest
  of it as written, which a ckpt_iter of that format recorded when it resumed from it.

  `value`: the header's state when the caller has read it already (not parsed again).
  """
  if value is None:
    value = codec.header_state(header, origin=origin)
  digests = (_value_digest(value),)
  version = header.get("format_version")
  if state_lib.is_int(version) and version < state_lib.FORMAT_VERSION:
    # A ckpt_iter of that format recorded the digest of the state as it read it:
    # as written, and a format-1 learner state nested as formats 2-3 read it.
    forms = [header]
    if version == 1 and header.get("kind") == "tunix":
      forms.append(_learner_state.migrate_v1(header))
    for form in forms:
      digest = _written_digest(form)
      digests += () if digest is None or digest in digests else (digest,)
  return digests


def _written_digest(header: Mapping[str, Any]) -> str | None:
  """`state_digest` of a header of an older format as that format read it (no reshaping), or None."""
  pending = header.get("pending")
  schedule = pending.get("schedule") if isinstance(pending, Mapping) else None
  try:
    position = codec.position_to_json(codec.position_from_json(header.get("position")))
    return _digest_of_fields(header.get("kind"), header.get("fingerprint"), position, header.get("shuffle_key"),
                             schedule, header.get("counters") or {})
  except (errors.CkptIterError, TypeError, ValueError):
    return None


def _value_digest(value: state_lib.IteratorState) -> str:
  position = codec.position_to_json(codec.position_from_json(value.to_dict()["position"]))
  return _digest_of_fields(
      value.kind, value.fingerprint, position, value.shuffle_key,
      None if value.pending is None else value.pending.schedule, value.counters,
  )


def _digest_of_fields(kind, fingerprint, position, shuffle_key, schedule, counters) -> str:
  # In the header's own key order (both sides read the same header), so no
  # sorting: a restore computes this once, on its critical path.
  text = json.dumps(
      [kind, fingerprint, position, None if shuffle_key is None else list(shuffle_key),
       None if schedule is None else list(schedule), counters],
      separators=(",", ":"), default=repr,
  )
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def resume_entry(restored: state_lib.IteratorState, step: int | None, *, resized: bool = False) -> dict[str, Any]:
  """The entry a restore of `restored` from checkpoint `step` adds."""
  entry: dict[str, Any] = {"step": step, "state": state_digest(restored)}
  if resized:
    entry["resized"] = True  # restored by another process count (elastic)
  return entry


def extended(lineage: Mapping[str, Any] | None, entry: Mapping[str, Any]) -> dict[str, Any]:
  """`lineage` with one more resume."""
  lineage = lineage or empty()
  recent = [dict(e) for e in lineage["recent"]] + [dict(entry)]
  result = {
      "resumes": lineage["resumes"] + 1,
      "digest": fold(lineage["digest"], entry),
      "recent": recent[-MAX_RECENT:],
  }
  if RUN in lineage:
    result[RUN] = lineage[RUN]  # the same run, resumed
  return result


def empty() -> dict[str, Any]:
  return {"resumes": 0, "digest": _START, "recent": []}


def run_of(lineage: Mapping[str, Any] | None) -> int | None:
  """The step the run that holds `lineage` first saved at; None before its first save (or
  for a state written before ckpt_iter recorded runs)."""
  return None if lineage is None else lineage.get(RUN)


def started(lineage: Mapping[str, Any] | None, step: int | None) -> Mapping[str, Any] | None:
  """`lineage` as saved at `step`: a run's first save names the run after that step.

  Unchanged once the run is named (after its first save, or restored from a
  state that had one), or where the step is not known.
  """
  if step is None or run_of(lineage) is not None:
    return lineage
  return {**(lineage or empty()), RUN: step}


def fold(digest: str, entry: Mapping[str, Any]) -> str:
  """The running digest after `entry`."""
  text = digest + json.dumps(dict(entry), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def resumed(
    restored: state_lib.IteratorState, step: int | None, *, resized: bool = False
) -> state_lib.IteratorState:
  """`restored` with the resume from `step` added to its lineage."""
  entry = resume_entry(restored, step, resized=resized)
  return restored.with_lineage(extended(restored.lineage, entry))


def step_of_item_directory(directory: str) -> int | None:
  """The step of `<root>/<step dir>/<item>`, or None when the parent is not a step directory.

  Also while Orbax writes the step: its temporary names add a suffix to the
  step's and the item's directories (`7.orbax-checkpoint-tmp/data.orbax-checkpoint-tmp`).
  """
  parent = directory.rstrip("/").rsplit("/", 2)
  return step_of_directory_name(_ORBAX_TMP_SUFFIX.sub("", parent[-2]) if len(parent) >= 2 else "")


_ORBAX_TMP_SUFFIX = re.compile(r"\.orbax-checkpoint-tmp(?:-\d+)?$")


# Orbax's step directory names: the step ("12"), zero-padded with
# `step_format_fixed_length` ("00000012"), or after `step_prefix` ("ckpt_12").
# The rule of orbax.checkpoint.path.step.step_from_checkpoint_name (without
# importing Orbax, which the read-only CLI does not); a test holds them equal.
_STEP_DIRECTORY = re.compile(r"^(?:.+_)?(\d+)$")


def step_of_directory_name(name: str) -> int | None:
  """The step an Orbax step directory's name stands for; None for any other name (a tmp directory)."""
  match = _STEP_DIRECTORY.match(name)
  return int(match.group(1)) if match and name.isascii() else None


