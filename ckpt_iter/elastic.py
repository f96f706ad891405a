"""Elastic resume: the data state of process j of M from a checkpoint of N processes.

A `make_dataset` pipeline is defined over global batches, so the part of its
state that says where the run is (position, repeat-order key, remaining
schedule) is the same on every process. What is per process is which rows of
each global batch a process holds: in the pending items a RepeatIterator has
produced but not yet yielded. Resuming with M processes therefore keeps the
global part and re-slices the pending rows:

  pending item p, process j of M  =  concat(item p of processes 0..N-1)[j*R : (j+1)*R]

with R = (total rows) / M. Global batch rows are laid out process-major
(process i holds rows [i*B, (i+1)*B)), so this is exactly the slice process j
would have produced itself with M processes, as long as `produce` maps a local
batch to arrays whose leading dimension follows the batch rows ("batch-major").

Everything that cannot be re-sliced that way is refused with an
`UnsupportedConfigError` that says why; an inconsistent or incomplete set of
process files is an `InvalidStateError` that names the file.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import dataset as dataset_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib

# Pipeline steps after make_dataset that keep a resume elastic: they map each
# batch on its own, so they commute with re-slicing the global batch.
_ELEMENTWISE_STEPS = frozenset({"MapMapDataset"})


def saved_process_count(directory: str | os.PathLike[str]) -> int:
  """The number of processes that wrote the state files in `directory`.

  Raises:
    InvalidStateError: there are no state files, or files of several counts.
  """
  directory = os.fspath(directory)
  try:
    present = checkpoint_lib.list_process_files(directory)
  except OSError as e:
    raise errors.InvalidStateError(
        f"{directory}: cannot list the data state files ({e.strerror})."
    ) from None
  counts = sorted({count for _, count in present})
  if not counts:
    raise errors.InvalidStateError(
        f"{directory}: holds no process_<i>-of-<n>.json state file; it is not a "
        "ckpt_iter item or the checkpoint is incomplete. Restore an earlier step."
    )
  if len(counts) > 1:
    raise errors.InvalidStateError(
        f"{directory}: holds state files of several process counts "
        f"({_names(present)}); a checkpoint step is written by one set of "
        "processes. The directory was tampered with: restore an earlier step."
    )
  return counts[0]


def check_complete(directory: str | os.PathLike[str], process_count: int) -> None:
  """Raises InvalidStateError naming the first missing `process_<i>-of-<n>.json`."""
  directory = os.fspath(directory)
  for index in range(process_count):
    name = checkpoint_lib.process_file_stem(index, process_count) + ".json"
    if not os.path.exists(os.path.join(directory, name)):
      present = checkpoint_lib.list_process_files(directory)
      raise errors.InvalidStateError(
          f"{directory}: {name} is missing (present: {_names(present) or 'none'}); "
          f"a checkpoint written by {process_count} processes has one file per "
          "process. The checkpoint is incomplete: restore an earlier step."
      )


def read_all(directory: str | os.PathLike[str]) -> list[state_lib.IteratorState]:
  """Reads every process's state and checks that they agree on the global part.

  For `ckpt-iter verify`-style checks. Every state must agree on the kind and
  on the fingerprint fields other than ELASTIC_FIELDS; when the position is
  global (a make_dataset pipeline with only elementwise steps after it) they
  must also agree on the position, key, pending schedule and counters.

  Returns:
    The N states, in process order.

  Raises:
    InvalidStateError: a file is missing, unreadable, or disagrees with
      process 0 on a global field (the message names the file and field).
  """
  directory = os.fspath(directory)
  count = saved_process_count(directory)
  check_complete(directory, count)
  states = [checkpoint_lib.read_state(directory, i, count) for i in range(count)]
  check_agree(directory, states, global_position=_resize_refusal(states[0]) is None)
  return states


def read_for_process(
    directory: str | os.PathLike[str], process_index: int, process_count: int
) -> state_lib.IteratorState:
  """The state process `process_index` of `process_count` resumes from.

  With the process count that wrote the checkpoint this is that process's own
  state. With another count it is built from all N process states: the same
  position, key, schedule and counters, and the pending items re-sliced for M
  processes (see the module docstring). The fingerprint is process 0's: the
  per-process fields (`ckpt_iter.ELASTIC_FIELDS`) keep their saved values and
  the caller lets them drift; everything else is global.

  Raises:
    InvalidStateError: the file set is incomplete or inconsistent.
    UnsupportedConfigError: the state cannot be resumed with another process
      count (not a make_dataset pipeline, a per-process step after it, a
      Tunix learner state, or pending items that are not batch-major).
  """
  directory = os.fspath(directory)
  if not 0 <= process_index < process_count:
    raise errors.InvalidArgumentError(
        f"process_index={process_index} is not in [0, {process_count})."
    )
  saved_count = saved_process_count(directory)
  if saved_count == process_count:
    check_complete(directory, process_count)
    return checkpoint_lib.read_state(directory, process_index, process_count)
  check_complete(directory, saved_count)
  # Refuse on the first file alone when the kind of state cannot be resized,
  # before reading the others: the reason is then the real one.
  first = checkpoint_lib.read_state(directory, 0, saved_count)
  _check_resizable(directory, first, saved_count, process_count)
  states = [first] + [
      checkpoint_lib.read_state(directory, i, saved_count) for i in range(1, saved_count)
  ]
  check_agree(directory, states)
  return redistribute(
      states, process_index, process_count,
      origin=f"{directory} (written by {saved_count} processes, restored by {process_count})",
  )


def redistribute(
    states: Sequence[state_lib.IteratorState],
    process_index: int,
    process_count: int,
    *,
    origin: str = "the state",
) -> state_lib.IteratorState:
  """The state of process j of M from the agreeing states of N processes."""
  first = states[0]
  pending = None
  if first.pending is not None:
    items = []
    for number in range(len(first.pending.items)):
      nodes = [s.pending.items[number] for s in states]  # type: ignore[union-attr]
      items.append(
          _slice_node(nodes, process_index, process_count, f"pending item {number}", origin)
      )
    pending = state_lib.Pending(items=tuple(items), schedule=first.pending.schedule)
  return dataclasses.replace(first, pending=pending)


# ---------------------------------------------------------------------------


def _check_resizable(
    directory: str, state: state_lib.IteratorState, saved_count: int, process_count: int
) -> None:
  reason = _resize_refusal(state)
  if reason is not None:
    raise errors.UnsupportedConfigError(
        f"{directory}: elastic resume from {saved_count} to {process_count} "
        f"processes {reason} Restore with {saved_count} processes."
    )


def has_global_position(state: state_lib.IteratorState) -> bool:
  """Whether every process of a checkpoint must be at the same position."""
  fingerprint = state.fingerprint
  if "global_batch_size" not in fingerprint:
    return False
  steps = [s for s in str(fingerprint.get("pipeline") or "").split("<") if s]
  return all(s in _ELEMENTWISE_STEPS for s in steps)


def _resize_refusal(state: state_lib.IteratorState) -> str | None:
  """Why `state` cannot be resumed with another process count, or None."""
  if state.kind == "tunix":
    return (
        "is not supported for a Tunix learner's data state: the learner restores "
        "its state itself, per process, and its pending TrainExamples and "
        "mini-batch counters are shaped by the per-process batch size."
    )
  fingerprint = state.fingerprint
  if "global_batch_size" not in fingerprint:
    return (
        "needs a pipeline built by ckpt_iter.make_dataset, whose position is "
        "global; this checkpoint was written by a hand-built pipeline whose "
        "position is per process."
    )
  steps = [s for s in str(fingerprint.get("pipeline") or "").split("<") if s]
  per_process = [s for s in steps if s not in _ELEMENTWISE_STEPS]
  if per_process:
    return (
        f"is refused because the pipeline that wrote it applies {per_process} after "
        "make_dataset, per process: with another process count those steps would "
        "see other rows and the data would change (a per-record step belongs in "
        "make_dataset(transform=...))."
    )
  return None


def check_agree(
    directory: str, states: Sequence[state_lib.IteratorState], *, global_position: bool = True
) -> None:
  """Raises InvalidStateError unless all states agree on every global field.

  With `global_position=False` (a pipeline whose position is per process) only
  the kind, format and defining fields are compared.
  """
  count = len(states)
  first = states[0]
  reference = checkpoint_lib.process_file_stem(0, count) + ".json"
  for index, state in enumerate(states):
    name = checkpoint_lib.process_file_stem(index, count) + ".json"

    def disagree(field: str, here: Any, there: Any) -> errors.InvalidStateError:
      return errors.InvalidStateError(
          f"{directory}: {name} has {field}={_short(here)}, but {reference} has "
          f"{_short(there)}; the processes of one checkpoint must agree on it. "
          "The files come from different runs or steps: restore an earlier step."
      )

    fingerprint = state.fingerprint
    if "shard_count" in fingerprint and (
        fingerprint.get("shard_index") != index or fingerprint.get("shard_count") != count
    ):
      raise errors.InvalidStateError(
          f"{directory}: {name} was written by shard "
          f"{fingerprint.get('shard_index')} of {fingerprint.get('shard_count')}; "
          f"expected shard {index} of {count}. The files were renamed or mixed up."
      )
    if index == 0:
      continue
    fields = ("kind", "format_version")
    if global_position:
      fields += ("position", "shuffle_key", "counters")
    for field in fields:
      if getattr(state, field) != getattr(first, field):
        raise disagree(field, getattr(state, field), getattr(first, field))
    for field in sorted(set(fingerprint) | set(first.fingerprint)):
      if field in dataset_lib.ELASTIC_FIELDS:
        continue
      here, there = fingerprint.get(field, "<absent>"), first.fingerprint.get(field, "<absent>")
      if type(here) is not type(there) or here != there:
        raise disagree(f"fingerprint.{field}", here, there)
    if not global_position:
      continue
    if (state.pending is None) != (first.pending is None):
      raise disagree(
          "pending", "None" if state.pending is None else f"{len(state.pending)} items",
          "None" if first.pending is None else f"{len(first.pending)} items",
      )
    if state.pending is not None and first.pending is not None:
      if state.pending.schedule != first.pending.schedule:
        raise disagree("pending.schedule", state.pending.schedule, first.pending.schedule)
      if len(state.pending.items) != len(first.pending.items):
        raise disagree("len(pending.items)", len(state.pending.items), len(first.pending.items))


def _slice_node(nodes: list[Any], index: int, count: int, path: str, origin: str) -> Any:
  """Slice `index` of `count` of the concatenation of `nodes` (one per saved process)."""
  first = nodes[0]

  def refuse(reason: str) -> errors.UnsupportedConfigError:
    return errors.UnsupportedConfigError(
        f"{origin}: cannot redistribute {path}: {reason}. Elastic resume in the "
        "middle of a repeat needs batch-major produced items: every array leaf "
        "has one leading row (or the same number of rows) per batch row, so the "
        "global item is the processes' arrays concatenated in process order and "
        f"splits into {count} equal parts. Resume with the saved process count, "
        "or checkpoint at a group boundary (no pending items)."
    )

  if isinstance(first, np.ndarray) and first.ndim >= 1:
    if not all(isinstance(n, np.ndarray) and n.ndim >= 1 for n in nodes):
      raise refuse("it is an array on some processes only")
    if len({(n.dtype.str, n.shape) for n in nodes}) != 1:
      shapes = [f"{n.dtype}{list(n.shape)}" for n in nodes]
      raise refuse(f"its arrays differ across processes ({', '.join(shapes)})")
    total = first.shape[0] * len(nodes)
    if total % count:
      raise refuse(
          f"its {len(nodes)} x {first.shape[0]} = {total} rows do not split "
          f"into {count} equal parts"
      )
    rows = total // count
    whole = np.concatenate(nodes, axis=0)
    return np.ascontiguousarray(whole[index * rows : (index + 1) * rows])
  if isinstance(first, (np.ndarray, np.generic)):
    raise refuse(f"it is a scalar array ({first!r}), which has no rows to split")
  if first is None or isinstance(first, (bool, int, float, str)):
    if any(type(n) is not type(first) or n != first for n in nodes):
      raise refuse(f"it is a plain value that differs across processes ({nodes!r})")
    return first
  if isinstance(first, Mapping):
    if any(not isinstance(n, Mapping) or list(n) != list(first) for n in nodes):
      raise refuse("its dict keys differ across processes")
    return {k: _slice_node([n[k] for n in nodes], index, count, f"{path}[{k!r}]", origin) for k in first}
  if isinstance(first, (list, tuple)):
    if any(type(n) is not type(first) or len(n) != len(first) for n in nodes):
      raise refuse("its structure differs across processes")
    parts = [
        _slice_node([n[i] for n in nodes], index, count, f"{path}[{i}]", origin)
        for i in range(len(first))
    ]
    return type(first)(parts)
  if dataclasses.is_dataclass(first) and not isinstance(first, type):
    if any(type(n) is not type(first) for n in nodes):
      raise refuse("its type differs across processes")
    return type(first)(**{
        f.name: _slice_node(
            [getattr(n, f.name) for n in nodes], index, count, f"{path}.{f.name}", origin
        )
        for f in dataclasses.fields(first)
    })
  raise refuse(f"it holds a {type(first).__qualname__}")


def _names(present: Sequence[tuple[int, int]]) -> str:
  return ", ".join(checkpoint_lib.process_file_stem(i, n) + ".json" for i, n in present)


def _short(value: Any) -> str:
  return state_lib.short_repr(value, limit=120)
