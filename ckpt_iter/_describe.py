"""What a state says, in words: the one describer of states for the CLI and the logs.

`ckpt-iter inspect`, `diff` and `audit` and the INFO line every restore logs
describe a state's position the same way, for every kind and every learner
family: the input's position (a learner's is nested, `_learner_state`) as
epoch and batch when the fingerprint says how many batches an epoch has,
and the learner's own counts beside it. Pure: no JAX, Grain or Orbax.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ckpt_iter import _learner_state
from ckpt_iter import _records
from ckpt_iter import state as state_lib

# A Tunix learner's own position fields worth a line: RL's micro-batches into
# the full batch, the prompts consumed (RL), the next prompt (agentic).
LEARNER_POSITION_FIELDS = ("micro_batches_taken", "stream_rows", "prompt_index")


def position_fields(kind: str, fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> dict[str, Any]:
  """Where the input is: next_record with epoch and record in it, and a mixture's ledger (per source:
  records read, epoch, record in it); or a hand-built pipeline's next_index (with epoch and batch in
  it when its fingerprint says how many batches an epoch has). And a learner's own counts."""
  fingerprint, source_position, own = _learner_state.input_view(kind, fingerprint, position)
  fields: dict[str, Any] = {name: own[name] for name in LEARNER_POSITION_FIELDS if name in own}
  if not isinstance(source_position, Mapping):
    return fields
  next_record = source_position.get(_records.NEXT_RECORD)
  if state_lib.is_int(next_record):
    fields[_records.NEXT_RECORD] = next_record
    length = fingerprint.get("source_length")
    if state_lib.is_int(length) and length > 0:
      fields["epoch"], fields["record_in_epoch"] = divmod(next_record, length)
      fields["source_length"] = length
    ledger = _records.ledger(fingerprint, source_position)
    if ledger is not None:
      fields["ledger"] = {name: _source_reading(count, fingerprint.get(f"source_length[{name}]"))
                          for name, count in ledger.items()}
    return fields
  next_index = source_position.get("next_index")
  if state_lib.is_int(next_index):
    fields["next_index"] = next_index
    per_epoch = fingerprint.get("batches_per_epoch")
    if state_lib.is_int(per_epoch) and per_epoch > 0:
      fields["epoch"], fields["batch_in_epoch"] = divmod(next_index, per_epoch)
      fields["batches_per_epoch"] = per_epoch
  elif state_lib.is_int(source_position.get("full_batches_read")):
    fields["full_batches_read"] = source_position["full_batches_read"]
  return fields


def _source_reading(count: int, length: Any) -> dict[str, int]:
  """One ledger entry: records read, and as epoch and record in it when the source's length is known."""
  entry = {"read": count}
  if state_lib.is_int(length) and length > 0:
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
  if "full_batches_read" in fields:
    return f"{source}{fields['full_batches_read']} elements read (replayed on restore)"
  return json.dumps(position, sort_keys=True, default=repr)


def summary_line(value: state_lib.IteratorState) -> str:
  """One line: where the state continues, its learner counts and pending items."""
  fields = position_fields(value.kind, value.fingerprint, value.position)
  parts = [position_text(value.kind, fields, value.position)]
  parts += [f"{name} {fields[name]}" for name in LEARNER_POSITION_FIELDS if name in fields]
  if value.pending is not None:
    parts.append(f"{len(value.pending.schedule)} pending")
  return ", ".join(parts)
