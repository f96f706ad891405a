"""What the `ckpt-iter` verbs print: the inspect report, the diff's rows, values in words, escaped.

Every string a checkpoint holds reaches the terminal through `terminal_safe`
(the reading verbs' stdout and stderr are escaped while they run,
`escaped_output`): a crafted state cannot rewrite what the operator sees.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from typing import Any, Mapping

from ckpt_iter import state
from ckpt_iter.cli import _inspect as inspection

_SCHEDULE_SHOWN = 16


# What a checkpoint's string could use to rewrite what the operator sees:
# control characters (escape sequences, carriage return, backspace...),
# invisible and direction-changing format characters, lone surrogates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u2069\ufeff\ud800-\udfff]")
_UNSAFE_OR_NEWLINE = re.compile(_UNSAFE.pattern[:-1] + "\n]")


def terminal_safe(text: str, *, newlines: bool = True) -> str:
  """`text` with every character that could rewrite a terminal shown as an escape (\\x1b).

  `newlines=False` escapes line breaks too: for a value inside a line.
  """
  pattern = _UNSAFE if newlines else _UNSAFE_OR_NEWLINE
  return pattern.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii")
                     if ord(m.group()) < 0xd800 or ord(m.group()) > 0xdfff else f"\\u{ord(m.group()):04x}", text)


class _EscapingStream:
  """A text stream that writes `terminal_safe` text to `stream`."""

  def __init__(self, stream: Any):
    self._stream = stream

  def write(self, text: str) -> int:
    return self._stream.write(terminal_safe(text))

  @property
  def unescaped(self) -> Any:
    """The stream itself, for text of the verb's own that must reach the terminal as it is (a progress
    bar's carriage returns): never a checkpoint's string."""
    return self._stream

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


@contextlib.contextmanager
def escaped_output() -> Any:
  """stdout and stderr escaped while a reading verb runs (a crafted state cannot rewrite the screen)."""
  saved = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = _EscapingStream(sys.stdout), _EscapingStream(sys.stderr)
  try:
    yield
  finally:
    sys.stdout, sys.stderr = saved


def render_inspect(layout: inspection.Layout, step: int, processes: list[inspection.ProcessState]) -> list[str]:
  """The text report of `inspect`: aligned `key  value` lines."""
  latest = " (latest)" if step == layout.steps[-1] else ""
  lines = aligned([
      ("checkpoint", layout.root),
      ("step", f"{step}{latest}; steps: {inspection.format_steps(layout.steps)}"),
      ("item", f"{layout.item}, {plural(len(processes), 'process', 'processes')}"),
  ])
  readable = [p.summary for p in processes if p.summary is not None]
  shared = _shared_fields([s["fingerprint"] for s in readable])
  for process in processes:
    lines.append("")
    lines.append(f"process {process.process_index} of {process.process_count}  {process.path}")
    if process.error is not None:
      lines.append(f"  error: {process.error}")
      continue
    lines.extend(aligned(_state_rows(process.summary, shared), indent=2))
  if readable:
    title = "fingerprint" if len(readable) == 1 else "fingerprint (same in every process)"
    lines.append("")
    lines.append(title)
    lines.extend(aligned([(k, _scalar(v)) for k, v in shared.items()], indent=2))
  return lines


def _state_rows(summary: Mapping[str, Any], shared: Mapping[str, Any]) -> list[tuple[str, str]]:
  rows = [
      ("format_version", str(summary["format_version"])),
      ("kind", summary["kind"]),
      ("position", describe_position(summary)),
  ]
  rows.extend((name, _scalar(summary[name])) for name in inspection.LEARNER_POSITION_FIELDS if name in summary)
  rows.append(("shuffle_key", _NO_SHUFFLE_KEY.get(summary["kind"], "none") if summary["shuffle_key"] is None
               else str(summary["shuffle_key"])))
  if summary.get("skips"):
    rows.append(("skips", summary["skips"]["text"] + " (kept by every restore; ckpt-iter audit accounts for them)"))
  rows.append(("pending", describe_pending(summary["pending"])))
  if summary["pending"] is not None:
    rows.append(("pending schedule", _schedule(summary["pending"]["schedule"])))
    if summary["pending"]["item_types"]:
      rows.append(("pending types", ", ".join(summary["pending"]["item_types"])))
  rows.extend((f"counter {k}", str(v)) for k, v in summary["counters"].items())
  if summary["content"] is not None:
    shown = {"index": "by index (checked on restore)", "row": "the batch's last row (checked on restore)"}
    rows.append(("content check", shown.get(summary["content"], summary["content"])))
  resumes = summary["resumes"]
  run = summary["run_first_saved_at"]
  rows.append(("resumes", ("none" if not resumes else
               f"{resumes} (last from step {_scalar(summary['last_resume_from'])}); ckpt-iter audit checks them")
               + ("" if run is None else f"; the run first saved at step {_scalar(run)}")))
  rows.extend(
      (f"fingerprint {k}", _scalar(v)) for k, v in summary["fingerprint"].items() if k not in shared
  )
  return rows


# Why a state has no shuffle key: only the repeat order has one.
_NO_SHUFFLE_KEY = {
    "data": "none (the key of the repeat order; a data pipeline's order is its seed, in the fingerprint)",
    "repeat": "none (shuffle_seed=None: repeats in the order produced)",
    "tunix": "none (data_shuffle_seed=None: repeats in the order produced)",
}


def describe_position(summary: Mapping[str, Any]) -> str:
  """`epoch 1, 5 of 64 batches read (next_index 69)`, or the raw Grain state."""
  return state.position_text(summary["kind"], summary, summary["position"])


def describe_pending(pending: Mapping[str, Any] | None) -> str:
  if pending is None:
    return "none"
  return (
      f"{plural(pending['items'], 'item')}, {pending['remaining']} still to yield; "
      f"{plural(pending['arrays'], 'array')}, {_bytes(pending['array_bytes'])}"
  )


def _schedule(schedule: list[int]) -> str:
  shown = " ".join(map(str, schedule[:_SCHEDULE_SHOWN]))
  more = len(schedule) - _SCHEDULE_SHOWN
  return f"[{shown}{f' ... +{more} more' if more > 0 else ''}]"


def _shared_fields(fingerprints: list[Mapping[str, Any]]) -> dict[str, Any]:
  if not fingerprints:
    return {}
  first = fingerprints[0]
  return {
      k: v for k, v in first.items()
      if all(k in other and inspection.changed_fields({k: v}, {k: other[k]}) == {} for other in fingerprints)
  }


def diff_rows(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, str]]:
  """`key  before -> after` rows for what differs between two summaries."""
  differences = inspection.diff_summaries(a, b)
  if not differences:
    return [("state", "identical")]
  rows = []
  fingerprint = differences.get("fingerprint", {})
  if not fingerprint:
    rows.append(("fingerprint", f"same ({plural(len(a['fingerprint']), 'field')})"))
  rows.extend((f"fingerprint {k}", _change(x, y)) for k, (x, y) in fingerprint.items())
  rows.extend((f"fingerprint {k}", f"{_change(x, y)} (the same code: the same function, no pipeline change)")
              for k, (x, y) in differences.get("fingerprint_same_function", {}).items())
  if "kind" in differences:
    rows.append(("kind", _change(a["kind"], b["kind"])))
  if "position" in differences:
    rows.append(("position", f"{describe_position(a)} -> {describe_position(b)}"))
    rows.extend((name, _change(*differences["position"][name], delta=True))
                for name in inspection.LEARNER_POSITION_FIELDS if name in differences["position"])
  if "shuffle_key" in differences:
    rows.append(("shuffle_key", _change(a["shuffle_key"], b["shuffle_key"])))
  if "pending" in differences:
    rows.append(("pending", f"{describe_pending(a['pending'])} -> {describe_pending(b['pending'])}"))
  rows.extend((f"counter {k}", _change(x, y, delta=True)) for k, (x, y) in differences.get("counters", {}).items())
  return rows


def _change(before: Any, after: Any, *, delta: bool = False) -> str:
  text = f"{_scalar(before)} -> {_scalar(after)}"
  if delta and inspection.is_int(before) and inspection.is_int(after):
    text += f" ({after - before:+d})"
  return text


# ---------------------------------------------------------------------------
# Text helpers.


def aligned(rows: list[tuple[str, str]], indent: int = 0) -> list[str]:
  if not rows:
    return []
  # A value is one line: a newline inside one could forge the next row.
  rows = [(terminal_safe(key, newlines=False), terminal_safe(value, newlines=False)) for key, value in rows]
  width = max(len(key) for key, _ in rows)
  return [f"{' ' * indent}{key.ljust(width)}  {value}" for key, value in rows]


def _scalar(value: Any) -> str:
  if value is None:
    return "none"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return value if value and value == value.strip() else repr(value)
  return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def plural(count: int, singular: str, plural: str | None = None) -> str:
  return f"{count} {singular if count == 1 else (plural or singular + 's')}"


def _bytes(count: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if count >= size:
      return f"{count / size:.1f} {unit} ({count} B)"
  return f"{count} B"
