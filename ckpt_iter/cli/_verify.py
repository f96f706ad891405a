"""`ckpt-iter verify`: checks a data checkpoint in full, one problem per line.

For each step: the item directory exists; the process files form one complete
set (process_0..n-1 of n); every state parses, is of a readable format version
and its arrays have the dtypes and shapes its header records (read with
`_files.read_state`, which validates all of it); and every process has the
same defining fields, except the per-process ones (shard_index).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from ckpt_iter import _files
from ckpt_iter import _storage
from ckpt_iter import elastic
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.cli import _inspect as inspection


@dataclasses.dataclass(frozen=True)
class Problem:
  """One thing wrong with a checkpoint: where, and what."""

  step: int
  path: str
  message: str

  def line(self) -> str:
    return f"step {self.step}: {self.path}: {self.message}"


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """What verifying one step found.

  `removed`: the step was deleted while it was read (a writer's retention,
  `inspection.removed_while_read`), so nothing of it was checked and what
  the read ran into is no problem of the checkpoint.
  """

  step: int
  files_read: int
  arrays_read: int
  problems: tuple[Problem, ...]
  removed: bool = False


def verify_step(layout: inspection.Layout, step: int) -> StepCheck:
  """Checks one step: files present, states readable, fingerprints consistent."""
  item_dir = layout.item_dir(step)
  try:
    names = _storage.list_names(item_dir)
  except (FileNotFoundError, NotADirectoryError):
    names = None
  if names is None:
    if inspection.removed_while_read(layout, step):
      return StepCheck(step, 0, 0, (), removed=True)
    step_dir = os.path.dirname(item_dir)
    return StepCheck(step, 0, 0, (Problem(
        step, item_dir,
        f"missing: the step holds no {layout.item!r} item (it holds: "
        f"{', '.join(inspection.subdirectories_or_none(step_dir) or ['nothing'])}).",
    ),))
  check = _check_files(step, item_dir, _files.process_files_in(names))
  if check.problems and inspection.removed_while_read(layout, step, names):
    return StepCheck(step, 0, 0, (), removed=True)
  return check


def _check_files(step: int, item_dir: str, files: list[tuple[int, int]]) -> StepCheck:
  """Checks the process files `files` of one step's item directory."""
  problems = [Problem(step, path, message) for path, message in _files.process_set_problems(item_dir, files)]
  count_files: dict[str, Any] = {}  # the count file (and the pod part the headers refer to), read once
  if not problems:  # the count file is judged against a sound set only
    problems = [Problem(step, path, message)
                for path, message in _files.count_file_problems(item_dir, files, count_files=count_files)]
  states: dict[tuple[int, int], state_lib.IteratorState] = {}
  arrays_read = 0
  for index, count in files:
    if index >= count:
      continue  # reported as a process set problem
    path = _files.header_path(item_dir, index, count)
    try:
      states[(index, count)], num_arrays = _read_full_state(item_dir, index, count, count_files, step=step)
      arrays_read += num_arrays
    except errors.CkptIterError as e:
      problems.append(_problem_from_error(step, path, str(e)))
    except OSError as e:  # e.g. permissions: the file exists but cannot be read
      problems.append(Problem(step, path, f"cannot read it ({e.strerror or e})."))
  fingerprint_problems = _fingerprint_problems(step, item_dir, states)
  problems.extend(fingerprint_problems)
  if not problems:
    problems.extend(_agreement_problems(step, item_dir, states, _agreed(item_dir, files, count_files)))
  return StepCheck(step, len(states), arrays_read, tuple(problems))


def _agreed(item_dir: str, files: list[tuple[int, int]], count_files: dict[str, Any]) -> str | None:
  """What process 0's header records all the step's processes agreed on when saved, or None."""
  first = [count for index, count in files if index == 0]
  if len(files) < 2 or len(first) != 1:
    return None
  path = _files.header_path(item_dir, 0, first[0])
  return _files.agreed_in(_files.read_header(path, count_files=count_files), path)


def _agreement_problems(
    step: int, item_dir: str, states: Mapping[tuple[int, int], state_lib.IteratorState], agreed: str | None
) -> list[Problem]:
  """Processes of one step must agree on a global position, key and schedule; where process 0's header
  records that they did when saved (`agreed`), each must hash to it, as a restore with another count checks."""
  problems = []
  if agreed is not None:
    for (index, count), value in sorted(states.items()):
      try:
        elastic.check_agreed(item_dir, index, count, value, agreed)
      except errors.CkptIterError as e:
        problems.append(_problem_from_error(step, _files.header_path(item_dir, index, count), str(e)))
  ordered = [value for _, value in sorted(states.items())]
  if len(ordered) < 2:
    return problems
  try:
    elastic.check_agree(item_dir, ordered)
  except errors.CkptIterError as e:
    problems.append(_problem_from_error(step, item_dir, str(e)))
  return problems


def _read_full_state(
    item_dir: str, index: int, count: int, count_files: dict[str, Any] | None = None, *, step: int | None = None
) -> tuple[state_lib.IteratorState, int]:
  """_files.read_state (with the pending item types it needs registered).

  Returns:
    (the state, how many arrays its header lists; read_state read them all).
  """
  path = _files.header_path(item_dir, index, count)
  header = _files.read_header(path, count_files=count_files)
  manifest = header.get("arrays") if isinstance(header, Mapping) else None
  if isinstance(header, Mapping):
    _register_item_types(inspection.dataclass_names(header.get("pending")), path)
  value = _files.read_state(item_dir, index, count, count_files=count_files)
  # What a restore checks of the state before it compares a pipeline, by the restore's own check.
  state_lib.input_stream_skips(value, origin=path, step=step)
  return value, len(manifest) if isinstance(manifest, Mapping) else 0


def _register_item_types(names: set[str], path: str) -> None:
  """Imports ckpt_iter.tunix when a state holds Tunix TrainExamples."""
  tunix_names = sorted(name for name in names if name.startswith("tunix."))
  if not tunix_names:
    return
  try:
    import ckpt_iter.tunix  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise errors.InvalidStateError(
        f"{path}: its pending items are {', '.join(tunix_names)}; checking them "
        f"needs ckpt_iter.tunix, which failed to import ({e}). Install "
        "ckpt_iter[tunix] to verify this checkpoint."
    ) from None


def _problem_from_error(step: int, path: str, message: str) -> Problem:
  """A Problem for `path`; a message that starts with a file names that file.

  The file is then dropped from the message, so that each line names it once.
  """
  message = inspection.one_line(message)
  stem = os.path.splitext(path)[0]
  for candidate in (path, stem + ".npz", os.path.dirname(path)):
    for separator in (": ", " "):
      if message.startswith(candidate + separator):
        return Problem(step, candidate, message[len(candidate + separator):])
  return Problem(step, path, message)


def _fingerprint_problems(
    step: int, item_dir: str, states: Mapping[tuple[int, int], state_lib.IteratorState]
) -> list[Problem]:
  """One problem per process whose defining fields differ from the first's."""
  problems = []
  for count in sorted({count for _, count in states}):
    group = sorted((index, value) for (index, n), value in states.items() if n == count)
    first_index, first = group[0]
    first_name = _files.process_file_stem(first_index, count) + ".json"
    for index, value in group[1:]:
      differences = defining_differences(first, value)
      if differences:
        described = "; ".join(
            f"{name}={here!r} here, {there!r} there" for name, (there, here) in differences.items()
        )
        problems.append(Problem(
            step, _files.header_path(item_dir, index, count),
            f"fingerprint differs from {first_name}: {described}.",
        ))
  return problems


def defining_differences(
    a: state_lib.IteratorState, b: state_lib.IteratorState
) -> dict[str, tuple[Any, Any]]:
  """Kind and fingerprint fields (per-process ones excluded) that differ."""
  fields_a = {"kind": a.kind, **state_lib.flat_fingerprint(a)}
  fields_b = {"kind": b.kind, **state_lib.flat_fingerprint(b)}
  return {
      name: (fields_a.get(name, inspection.ABSENT), fields_b.get(name, inspection.ABSENT))
      for name in sorted(set(fields_a) | set(fields_b))
      if name not in elastic.PER_PROCESS_FIELDS
      and not inspection.same_value(fields_a.get(name, inspection.ABSENT), fields_b.get(name, inspection.ABSENT))
  }
