"""Reading ckpt_iter data states out of a checkpoint directory (for the CLI).

Finds the steps and the data item of an Orbax or Tunix checkpoint, summarizes
each process's state from its JSON header alone (no array and no model is
loaded, Tunix is not imported) and compares states. Checking a step in full
is `cli/_verify`'s.

Layouts understood:
  <root>/<step>/<item>/process_<i>-of-<n>.json  (+ .npz)   plain Orbax root
  <root>/actor/<step>/data/process_<i>-of-<n>.json         Tunix root
Steps are the integer-named directories; Orbax's temporary step directories
(`<step>.orbax-checkpoint-tmp-<n>`) are not steps and are ignored. On an
object store (gs://), where Orbax commits a step by writing
`commit_success.txt` into it instead of renaming it, a step directory
without that file is uncommitted and ignored too. Paths may be local or
URLs (read through `_storage`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Collection, Mapping

from ckpt_iter import _files
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib

DEFAULT_ITEM = "data"
TUNIX_ACTOR_DIR = "actor"
ABSENT = state_lib.ABSENT
# Orbax's marker of a committed step where there is no rename (object stores).
COMMIT_FILE = "commit_success.txt"


class UsageError(Exception):
  """The command line names a path, step or item that is not there."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the steps and the data item of a checkpoint are.

  Attributes:
    root: the directory holding the step directories.
    item: the name of the item directory holding ckpt_iter state files.
    steps: the step numbers, ascending.
    names: each step's directory name (Orbax's `step_prefix` and
      `step_format_fixed_length` make it other than the number).
    held_state: the steps whose item held state files when listed, and
    step_entries: each step directory's names when listed (a step that has
      lost some is being deleted, or was: `removed_while_read`).
  """

  root: str
  item: str
  steps: tuple[int, ...]
  names: Mapping[int, str] = dataclasses.field(default_factory=dict)
  held_state: frozenset[int] = frozenset()
  step_entries: Mapping[int, frozenset[str]] = dataclasses.field(default_factory=dict)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.root, self.names.get(step, str(step)))

  def item_dir(self, step: int) -> str:
    return os.path.join(self.step_dir(step), self.item)

  def choose_step(self, step: int | None) -> int:
    """`step`, or the latest step when None; UsageError if there is none such."""
    if step is None:
      return self.steps[-1]
    if step not in self.steps:
      raise UsageError(
          f"no step {step} in {self.root} (steps: {format_steps(self.steps)})."
      )
    return step


def find_layout(
    path: str, item: str | None = None, *, require_state: bool = True, step: int | None = None
) -> Layout:
  """Finds the steps and the ckpt_iter item of the checkpoint at `path`.

  `require_state=False` (the audit) takes a root none of whose steps holds a
  data state, e.g. one written by stock Tunix, with `item` or "data".
  `step` (`--step N`): only that step is opened, so the cost does not grow
  with the kept steps (on an object store: two listings, one commit check,
  then the step's own files); the other steps are as listed.

  Raises:
    UsageError: `path` is not a directory, has no steps, or no step holds
      ckpt_iter state files (in `item`, when given) and `require_state`.
  """
  if not _storage.is_dir(path):
    raise UsageError(f"{path}: no such directory.")
  root = _steps_root(path)
  names = step_directories(root, committed=step is None)
  if step is not None and step in names and _storage.is_url(root) and not _committed(root, names[step]):
    del names[step]  # an unfinished save: not a step
  steps = sorted(names)
  if step is not None and steps and step not in names:
    raise UsageError(f"no step {step} in {root} (steps: {format_steps(steps)}).")
  if not steps:
    raise UsageError(
        f"{path}: not a checkpoint: no step directories (Orbax's step names) here "
        f"or in {os.path.join(path, TUNIX_ACTOR_DIR)}. Pass an Orbax checkpoint "
        "root or a Tunix checkpoint root."
    )
  entries: dict[int, frozenset[str]] = {}
  items = _items_with_state(root, names if step is None or step not in names else {step: names[step]}, entries)
  if not require_state and (not items or item is not None and item not in items):
    chosen = item or DEFAULT_ITEM
  else:
    chosen = _choose_item(root, steps, items, item, names)
  return Layout(root=root, item=chosen, steps=tuple(steps), names=names,
                held_state=frozenset(items.get(chosen, ())), step_entries=entries)


def _steps_root(path: str) -> str:
  actor = os.path.join(path, TUNIX_ACTOR_DIR)
  if TUNIX_ACTOR_DIR in subdirectories(path) and step_directories(actor, committed=False):
    return actor
  return path


def _committed(root: str, name: str) -> bool:
  return _storage.is_file(os.path.join(root, name, COMMIT_FILE))


def step_directories(directory: str, *, committed: bool = True) -> dict[int, str]:
  """Step -> directory name of the step directories of `directory`.

  Named as Orbax names them (`_item.step_of_directory_name`: the number,
  zero-padded, or after a `step_prefix`); Orbax's tmp directories are not steps.
  At a URL, `committed` keeps only those with Orbax's commit file (one
  request each).
  """
  names = {}
  for name in subdirectories(directory):
    step = item_lib.step_of_directory_name(name)
    if step is not None:
      names.setdefault(step, name)
  if committed and _storage.is_url(directory):
    names = {step: name for step, name in names.items() if _committed(directory, name)}
  return dict(sorted(names.items()))


def _items_with_state(
    root: str, names: Mapping[int, str], entries: dict[int, frozenset[str]]
) -> dict[str, list[int]]:
  """Item name -> the steps in which that item holds process state files; each step's names into `entries`."""
  found: dict[str, list[int]] = {}
  for step, step_name in names.items():
    try:
      listed = _storage.list_entries(os.path.join(root, step_name))
    except (FileNotFoundError, NotADirectoryError):
      continue  # deleted since the root was listed (a writer's retention): its reader says so
    entries[step] = frozenset(name for name, _ in listed)
    for name in sorted(name for name, is_dir in listed if is_dir):
      if _process_files_or_none(os.path.join(root, step_name, name)):
        found.setdefault(name, []).append(step)
  return found


def subdirectories(directory: str) -> list[str]:
  """The names of the directories in `directory`, sorted (one listing)."""
  return sorted(name for name, is_dir in _storage.list_entries(directory) if is_dir)


def subdirectories_or_none(directory: str) -> list[str] | None:
  """`subdirectories`, or None when `directory` is gone (deleted since it was listed)."""
  try:
    return subdirectories(directory)
  except (FileNotFoundError, NotADirectoryError):
    return None


# A step being deleted (Orbax deletes a step's files first, then its directories) is
# awaited this long; one that may be, this long without a change first (`removed_while_read`).
REMOVAL_WAIT_SECONDS = 10.0
REMOVAL_QUIET_SECONDS = 0.5
_REMOVAL_POLL_SECONDS = 0.05


def removed_while_read(layout: Layout, step: int, seen: Collection[str] = ()) -> bool:
  """Whether `step` was deleted while it was read, by a writer's retention (Orbax's max_to_keep).

  Asked after reading the step failed or found no state; `seen`: the names
  the read listed in its item. A step is removed once its directory is
  gone. Orbax deletes a committed step whole (files first, in a thread of
  the writer that can stall for tens of ms) and changes it in no other way:
    * a step that has lost something since it was seen (an entry of its
      directory when the layout was listed, a name in `seen`, the state files
      its item held then), or is empty, is being deleted: it is awaited, at
      most `REMOVAL_WAIT_SECONDS`;
    * a step with no state seen, in a root whose other steps have one, may
      have lost it before it was first listed: it is watched
      `REMOVAL_QUIET_SECONDS`, and awaited if it changes;
    * any other (its state files as they were, or a root without state) is
      not being deleted: what its read found stands (present but unreadable
      is damaged).
  A step that outlives the wait was not removed either.
  """
  if not seen and not layout.held_state:  # a root without state (stock Tunix): only whether it is gone
    return not _storage.is_dir(layout.step_dir(step))
  snapshot = _step_snapshot(layout, step)
  if snapshot is None:
    return True
  entries, names = snapshot
  before = layout.step_entries.get(step)
  holds_state = bool(_files.process_files_in(sorted(names)))
  if (not entries or (before is not None and not before <= entries) or not set(seen) <= names
      or (step in layout.held_state and not holds_state)):
    return _gone_within(layout, step, REMOVAL_WAIT_SECONDS)
  if holds_state or not _changes_within(layout, step, snapshot, REMOVAL_QUIET_SECONDS):
    return False
  return _gone_within(layout, step, REMOVAL_WAIT_SECONDS)


def _step_snapshot(layout: Layout, step: int) -> tuple[frozenset[str], frozenset[str]] | None:
  """The names in a step's directory and in its item (empty when it has none); None when the step is gone."""
  try:
    entries = frozenset(_storage.list_names(layout.step_dir(step)))
  except (FileNotFoundError, NotADirectoryError):
    return None
  try:
    names = frozenset(_storage.list_names(layout.item_dir(step)))
  except (FileNotFoundError, NotADirectoryError):
    names = frozenset()
  return entries, names


def _changes_within(layout: Layout, step: int, snapshot: Any, seconds: float) -> bool:
  """Whether the step changes (or goes) within `seconds`, polled."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    time.sleep(_REMOVAL_POLL_SECONDS)
    if _step_snapshot(layout, step) != snapshot:
      return True
  return False


def _gone_within(layout: Layout, step: int, seconds: float) -> bool:
  """Whether the step's directory is gone within `seconds`, polled."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    time.sleep(_REMOVAL_POLL_SECONDS)
    if not _storage.is_dir(layout.step_dir(step)):
      return True
  return False


def _choose_item(root: str, steps: list[int], items: Mapping[str, list[int]], item: str | None,
                 names: Mapping[int, str]) -> str:
  if item is not None:
    if item not in items:
      raise UsageError(
          f"{root}: no step holds ckpt_iter state in an item named {item!r} "
          f"(items with state files: {', '.join(sorted(items)) or 'none'})."
      )
    return item
  if not items:
    latest = os.path.join(root, names[steps[-1]])
    raise UsageError(
        f"{root}: not a ckpt_iter checkpoint: no item of any step holds "
        f"process_<i>-of-<n>.json state files (step {steps[-1]} holds: "
        f"{', '.join(subdirectories_or_none(latest) or ['nothing'])}). A checkpoint "
        "written by stock Tunix has no data state."
    )
  if len(items) == 1:
    return next(iter(items))
  if DEFAULT_ITEM in items:
    return DEFAULT_ITEM
  raise UsageError(
      f"{root}: several items hold ckpt_iter state ({', '.join(sorted(items))}); "
      "choose one with --item."
  )


def format_steps(steps: tuple[int, ...] | list[int]) -> str:
  """Steps as compact ranges: `1-4, 7, 9-10`."""
  ranges: list[list[int]] = []
  for step in steps:
    if ranges and step == ranges[-1][1] + 1:
      ranges[-1][1] = step
    else:
      ranges.append([step, step])
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


# ---------------------------------------------------------------------------
# Per-process summaries, from the header alone.


@dataclasses.dataclass(frozen=True)
class ProcessState:
  """One process's state file and its summary (or why it cannot be read)."""

  process_index: int
  process_count: int
  path: str
  summary: dict[str, Any] | None = None
  error: str | None = None


def read_summaries(layout: Layout, step: int) -> list[ProcessState]:
  """Summaries of every process state file of `step`, in process order.

  Raises:
    UsageError: the step has no state files in the layout's item.
  """
  item_dir = layout.item_dir(step)
  files = _process_files_or_none(item_dir)
  if not files:
    raise UsageError(
        f"{item_dir}: step {step} holds no ckpt_iter state (no "
        "process_<i>-of-<n>.json files); other steps do: "
        f"{format_steps(_steps_with_files(layout))}."
    )
  return [_read_summary(item_dir, index, count) for index, count in files]


def _steps_with_files(layout: Layout) -> list[int]:
  return [step for step in layout.steps if _process_files_or_none(layout.item_dir(step))]


def _process_files_or_none(item_dir: str) -> list[tuple[int, int]]:
  """The process files of an item directory; [] when there is no such directory."""
  try:
    return _files.list_process_files(item_dir)
  except (FileNotFoundError, NotADirectoryError):
    return []


def _read_summary(item_dir: str, index: int, count: int) -> ProcessState:
  path = _files.header_path(item_dir, index, count)
  try:
    summary = summarize(_files.read_header(path), origin=path)
  except errors.CkptIterError as e:
    return ProcessState(index, count, path, error=one_line(str(e)))
  return ProcessState(index, count, path, summary=summary)


def summarize(header: Any, *, origin: str) -> dict[str, Any]:
  """The inspectable fields of a state header (validated; arrays not read).

  Raises:
    CkptIterError: the header is not a valid state of a readable version.
  """
  value = codec.header_state(header, origin=origin)
  specs = codec.array_specs(header, origin=origin)
  skips = skips_lib.Skips.from_text(value.innermost.fingerprint.get(skips_lib.SKIPS_FIELD), origin=origin)
  return {
      "format_version": header.get("format_version", 0),
      "kind": value.kind,
      "position": value.to_dict()["position"],
      **position_fields(value),
      "shuffle_key": None if value.shuffle_key is None else list(value.shuffle_key),
      "pending": _pending_summary(header.get("pending"), value.pending, specs),
      "counters": dict(value.counters),
      "fingerprint": state_lib.flat_fingerprint(value),
      "content": None if value.content is None else value.content.get("check"),
      "resumes": 0 if value.lineage is None else value.lineage["resumes"],
      "last_resume_from": (value.lineage["recent"][-1]["step"]
                           if value.lineage is not None and value.lineage["recent"] else None),
      "run_first_saved_at": item_lib.run_of(value.lineage),
      "skips": None if not skips else {"text": skips.describe(), "records": [list(r) for r in skips.records],
                                       "every_epoch": [list(r) for r in skips.every_epoch]},
  }


LEARNER_POSITION_FIELDS = state_lib.LEARNER_POSITION_FIELDS
position_fields = state_lib.position_fields


def _pending_summary(
    encoded: Any, pending: state_lib.Pending | None, specs: Mapping[str, codec.ArraySpec]
) -> dict[str, Any] | None:
  if pending is None:
    return None
  return {
      "items": len(pending.items),
      "remaining": len(pending.schedule),
      "schedule": list(pending.schedule),
      "item_types": sorted(dataclass_names(encoded)),
      "arrays": len(specs),
      "array_bytes": sum(spec.nbytes for spec in specs.values()),
  }


def dataclass_names(node: Any, _depth: int = 0) -> set[str]:
  """The registered-dataclass names an encoded pending structure refers to."""
  if _depth > codec.MAX_NESTING:
    return set()
  names: set[str] = set()
  if isinstance(node, Mapping):
    if isinstance(node.get("dataclass"), str):
      names.add(node["dataclass"])
    for child in node.values():
      names |= dataclass_names(child, _depth + 1)
  elif isinstance(node, list):
    for child in node:
      names |= dataclass_names(child, _depth + 1)
  return names


# ---------------------------------------------------------------------------
# diff: two summaries, field by field.


def diff_summaries(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
  """What differs between two summaries: {section: {field: [a, b]}}.

  Sections: "kind", "fingerprint", "fingerprint_same_function" (a function
  whose name differs only where it is defined: the same code, no pipeline
  change, `state.same_function`), "position", "shuffle_key", "counters",
  "pending". A section that does not differ is absent.
  """
  result: dict[str, Any] = {}
  if a["kind"] != b["kind"]:
    result["kind"] = [a["kind"], b["kind"]]
  for section in ("fingerprint", "counters"):
    changed = changed_fields(a[section], b[section])
    if changed:
      result[section] = changed
  moved = {name: values for name, values in result.get("fingerprint", {}).items()
           if _same_function(name, a["fingerprint"], b["fingerprint"])}
  if moved:
    result["fingerprint_same_function"] = moved
    result["fingerprint"] = {k: v for k, v in result["fingerprint"].items() if k not in moved}
    if not result["fingerprint"]:
      del result["fingerprint"]
  position = changed_fields(_position_view(a), _position_view(b))
  if position:
    result["position"] = position
  if a["shuffle_key"] != b["shuffle_key"]:
    result["shuffle_key"] = [a["shuffle_key"], b["shuffle_key"]]
  pending = changed_fields(_pending_view(a["pending"]), _pending_view(b["pending"]))
  if pending:
    result["pending"] = pending
  return result


def _same_function(name: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
  """`state.same_function` on the flat view, where a learner's input fields are `input.<name>`."""
  prefix = f"{state_lib.INPUT}."
  if not name.startswith(prefix):
    return state_lib.same_function(name, a, b)

  def inputs(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}

  return state_lib.same_function(name[len(prefix):], inputs(a), inputs(b))


def changed_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, list[Any]]:
  return {
      name: [a.get(name, ABSENT), b.get(name, ABSENT)]
      for name in sorted(set(a) | set(b))
      if not same_value(a.get(name, ABSENT), b.get(name, ABSENT))
  }


_POSITION_FIELDS = (
    "epoch", "record_in_epoch", "next_record", "ledger", "batch_in_epoch", "next_index", "full_batches_read",
    *LEARNER_POSITION_FIELDS)


def _position_view(summary: Mapping[str, Any]) -> dict[str, Any]:
  view = {name: summary[name] for name in _POSITION_FIELDS if name in summary}
  if not {"next_record", "next_index", "full_batches_read"} & set(view):
    view["position"] = summary["position"]  # a Grain state with no index
  return view


def _pending_view(pending: Mapping[str, Any] | None) -> dict[str, Any]:
  if pending is None:
    return {"items": 0, "remaining": 0, "array_bytes": 0, "item_types": []}
  return {name: pending[name] for name in ("items", "remaining", "array_bytes", "item_types")}


# ---------------------------------------------------------------------------


same_value = state_lib.same_field_value
is_int = state_lib.is_int


def one_line(text: str) -> str:
  """`text` with every run of whitespace (newlines too) as one space."""
  return " ".join(text.split())
