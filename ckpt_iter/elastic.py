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

Cost: process j of M reads only what it needs. Saved file i holds the
fraction [i/N, (i+1)/N) of every pending leaf's rows and process j needs
[j/M, (j+1)/M), so its rows come from the at most ceil(N/M)+1 files that
overlap (`overlapping_files`); their arrays are read, no other file's. The
saved count N comes from the item's count file, not from listing the 2N
names. What else it reads depends on what process 0's header records:

  - all N agreed (`agreement_sha256`, compared through JAX's job store when
    saved, `_pod_exchange.share_arrays`, and recorded in process 0's header):
    process 0's header, checked to hash to that digest, stands for every
    file; the files of its rows are read only for rows of their own
    (pending items, lane positions), each checked the same way. A plain
    make_dataset state: 2 reads (the count file, process 0's header).
  - otherwise (one process saved by hand, an older item, a process that
    disagreed or did not report): process 0's header and a window of
    ceil(N/M)+1 headers around its slice (`checked_files`), each compared
    with process 0's; the windows of all M processes cover every saved file.

Files and bytes read per process are O(1 + N/M) and O(pending / M) (see
docs/multihost.md, "At scale", for what that means for completeness and
consistency checks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent import futures
from typing import Any, Mapping, Sequence

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter import state as state_lib

# Headers read at once for `lanes_reached` (each a small read; on a bucket mostly waiting).
LANES_READ_THREADS = 16
# Fingerprint fields that differ from one process of a checkpoint to another.
PER_PROCESS_FIELDS = frozenset({"shard_index"})
# Fingerprint fields a resume with another process count changes.
ELASTIC_FIELDS = PER_PROCESS_FIELDS | {"shard_count", "batch_size"}
"""Fingerprint fields a resume with another process count changes (`shard_index`, `shard_count`, `batch_size`).

An elastic restore lets them drift; every other field is checked as usual.
"""

# Pipeline steps after make_dataset that keep a resume elastic: they map each
# batch on its own, so they commute with re-slicing the global batch.
_ELEMENTWISE_STEPS = frozenset({"MapMapDataset"})


def resize_refusal(kind: str, fingerprint: Mapping[str, Any]) -> str | None:
  """Why a state cannot resume with another process count, or None if it can.

  The one rule, for saved states and live pipelines alike: the position must
  be global, i.e. written by a `make_dataset` pipeline (its fingerprint has
  `global_batch_size`) with only elementwise steps after it, or by Grain's
  `ElasticIterator` (its fingerprint has `position_scope="global"`: Grain
  keeps one global position, the same on every process); and the state must
  not be a Tunix learner's (shaped by the per-process batch).
  """
  if kind == "tunix":
    return (
        "is not supported for a Tunix learner's data state by re-slicing: its "
        "pending TrainExamples and mini-batch counters are shaped by the "
        "per-process batch size. The learner itself resumes with another count "
        "when every saved process holds the same state (`read_replicated`)."
    )
  if fingerprint.get("position_scope") == "global":
    return None  # set only for a bare ElasticIterator (_global_batch.describe_pipeline)
  if str(fingerprint.get("source", "")).startswith(state_lib.STREAM_SOURCE_PREFIX):
    return (
        "is refused for a streaming source (StreamingIterator): each process's position is its "
        "own stream's state (Hugging Face's split_dataset_by_node gives each rank its shards or "
        "every world_size-th example, by the count), which no other process count continues. "
        "Resume with the saved process count, or read the files through ckpt_iter.make_dataset, "
        "whose position is global."
    )
  if "global_batch_size" not in fingerprint:
    return (
        "needs a pipeline built by ckpt_iter.make_dataset, whose position is "
        "global; this one was hand-built and its position is per process."
    )
  steps = [s for s in str(fingerprint.get("pipeline") or "").split("<") if s]
  per_process = [s for s in steps if s not in _ELEMENTWISE_STEPS]
  if per_process:
    return (
        f"is refused because the pipeline applies {per_process} after "
        "make_dataset, per process: with another process count those steps would "
        "see other rows and the data would change. A per-record step belongs in "
        "make_dataset(transform=...); filtering and packing in make_dataset(filter=..., "
        f"pack=...), whose stream is the same for every process count ({_urls.doc_url('changing_the_run.md')})."
    )
  return None


def data_part(state: state_lib.IteratorState) -> state_lib.IteratorState:
  """The data state a re-sliced state's position rests on (`innermost`); a learner's state is never
  re-sliced (`elastic.read_replicated`), so its own."""
  return state if state.kind == "tunix" else state.innermost


def state_refusal(state: state_lib.IteratorState) -> str | None:
  """`resize_refusal` of a saved state (a repeat state's by its parent's pipeline)."""
  if state.kind == "tunix":
    return resize_refusal("tunix", state.fingerprint)
  return resize_refusal("data", data_part(state).fingerprint)


def agreement_sha256(state: state_lib.IteratorState) -> str | None:
  """The SHA-256 of what a re-sliced restore may take from any one saved process for all of them.

  That is the state without its per-process parts: the fingerprints'
  `PER_PROCESS_FIELDS`, a lane position (`_records.LANES`, `FIRST_LANE`), the pending
  arrays' rows (only their count and schedule are in it), the content record
  (a process's own last row, which a resized restore does not check) and the
  lineage (the pod part, which headers share by reference). Every field
  `_check_agree` compares is in it, so two states with the same digest pass
  it. A pod's save compares each process's with process 0's and records in
  process 0's header that all N agreed (`_pod_exchange.share_arrays`); a restore
  with another count then reads that header for all (`read_for_process`).
  None for a state that cannot be re-sliced (`state_refusal`).
  """
  if state_refusal(state) is not None:
    return None
  position = data_part(state).position
  if _records.LANES in position:  # which lanes a process holds, and where each is: its own
    state = _with_data_position(
        state, {k: v for k, v in position.items() if k not in (_records.LANES, _records.FIRST_LANE)})
  fingerprint, position_json = _files.pod_common(
      state.kind, state.fingerprint, codec.position_to_json(state.position_dict()), PER_PROCESS_FIELDS)
  position_json = _without_records(state.kind, position_json)
  pending = None if state.pending is None else [list(state.pending.schedule), len(state.pending.items)]
  text = json.dumps(
      [state.format_version, state.kind, fingerprint, position_json,
       None if state.shuffle_key is None else list(state.shuffle_key), pending, dict(state.counters)],
      sort_keys=True, separators=(",", ":"), default=repr)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _without_records(kind: Any, position: Any) -> Any:
  """A position whose nested states (`state.NESTED`) leave out their content record and lineage."""
  key = state_lib.NESTED.get(kind) if isinstance(kind, str) else None
  part = position.get(key) if key is not None and isinstance(position, Mapping) else None
  if not isinstance(part, Mapping):
    return position
  kept = {k: v for k, v in part.items() if k not in ("content", "lineage")}
  if "position" in kept:
    kept["position"] = _without_records(kept.get("kind"), kept["position"])
  return {**position, key: kept}


def read_for_process(
    directory: str | os.PathLike[str],
    process_index: int,
    process_count: int,
    *,
    saved_count: int | None = None,
    count_files: dict[str, Any] | None = None,
    saved_first: list[state_lib.IteratorState] | None = None,
) -> state_lib.IteratorState:
  """The state process `process_index` of `process_count` resumes from.

  With the process count that wrote the checkpoint this is that process's own
  state (one header, and its npz if it has pending arrays). With another count
  it is the same position, key, schedule and counters as process 0's, and the
  pending items re-sliced for M processes (see the module docstring), read
  from the saved files that hold this process's rows only. The fingerprint is
  process 0's: the per-process fields (`ckpt_iter.ELASTIC_FIELDS`) keep their
  saved values and the caller lets them drift; everything else is global.

  The result equals `redistribute` over all N saved states, bit for bit.

  The saved count comes from the item's count file (`_files.saved_process_count`:
  one small file; a directory listing only for items written without it).
  With the saved count it reads its own files only (a missing one is
  refused by the process it belongs to). With another count, where process
  0's header records that all saved processes agreed (`agreement_sha256`),
  it stands for the others; otherwise the headers of this process's window
  (`checked_files`) are read and compared with process 0's.
  `saved_first`, where given, receives process 0's state as saved (the state a
  resume with another count restores: a lane position differs per process).

  Raises:
    InvalidStateError: a file of this process's window is missing (the
      message lists what is wrong with the whole set), or one it reads
      disagrees with process 0's (see `checked_files`) or with the
      agreement its step recorded (`check_agreed`).
    UnsupportedConfigError: the state cannot be resumed with another process
      count (not a make_dataset pipeline, a per-process step after it, a
      Tunix learner state, or pending items that are not batch-major).
  """
  directory = os.fspath(directory)
  if not 0 <= process_index < process_count:
    raise errors.InvalidArgumentError(
        f"process_index={process_index} is not in [0, {process_count})."
    )
  # The count file is read once: for the count, then for the pod part the headers refer to.
  count_files = {} if count_files is None else count_files
  if saved_count is None:  # a caller that already read it passes it (and its count_files)
    saved_count = _files.saved_process_count(directory, count_files=count_files)
  if saved_count == process_count:
    # Its own files, as a plain restore: a missing one is refused by the process it belongs to.
    return _files.read_state(directory, process_index, process_count, count_is_saved=True,
                             count_files=count_files)
  rows_from = overlapping_files(saved_count, process_index, process_count)
  # Process 0's header first, alone: if the kind of state cannot be resized
  # the refusal then gives the real reason, before any other file is read.
  agreed: list[str | None] = []
  states = {0: _read(directory, 0, saved_count, load_arrays=0 in rows_from, count_files=count_files,
                     agreed=agreed)}
  _check_resizable(directory, states[0], saved_count, process_count)
  if saved_first is not None:
    saved_first.append(states[0])
  if agreed[0] is not None:
    # Every saved process reported process 0's state but for its own rows: no other header is read unless
    # the state holds rows of its own, and then only the files of this process's rows, each checked.
    check_agreed(directory, 0, saved_count, states[0], agreed[0])
    if states[0].pending is not None or _records.LANES in data_part(states[0]).position:
      for index in rows_from:
        if index not in states:
          states[index] = _read(directory, index, saved_count, load_arrays=True, count_files=count_files)
          check_agreed(directory, index, saved_count, states[index], agreed[0])
  else:
    for index in checked_files(saved_count, process_index, process_count):
      if index not in states:
        states[index] = _read(directory, index, saved_count, load_arrays=index in rows_from,
                              count_files=count_files)
  _check_agree(directory, states, saved_count)  # (and that each file is the process its name says)
  return _resliced(
      states, rows_from, saved_count, process_index, process_count,
      origin=f"{directory} (written by {saved_count} processes, restored by {process_count})",
  )


def check_agreed(directory: str, index: int, saved_count: int, state: state_lib.IteratorState, agreed: str) -> None:
  """Raises InvalidStateError unless saved process `index`'s state hashes to what process 0's header
  records all the step's processes agreed on (`agreement_sha256`): a restore with another count and `verify`."""
  own = agreement_sha256(state)
  if own != agreed:
    raise errors.InvalidStateError(
        f"{_files.header_path(directory, index, saved_count)}: its data state is not the one all "
        f"{saved_count} processes agreed on when the step was saved ({_files.process_file_stem(0, saved_count)}"
        f".json records {agreed[:16]}..., this file {str(own)[:16]}...): the file was edited or comes from "
        "another save. Restore an earlier step.")


def read_replicated(directory: str | os.PathLike[str], saved_count: int) -> state_lib.IteratorState:
  """The one state all `saved_count` saved processes hold, for a process of any count.

  A Tunix learner's state cannot be re-sliced (its pending TrainExamples and
  mini-batch counters are shaped by the per-process batch), but in Tunix's
  default every process feeds the same batches and so saves the same state.
  Then that state is exactly what every process of another count would hold
  too. Every saved header is read and compared, with the SHA-256 of its
  arrays each records (`_pod_exchange.share_arrays`); then process 0's arrays, the
  one copy the pod wrote. (Items saved before that digest was recorded have
  every process's arrays read and digested.)

  Raises:
    UnsupportedConfigError: two saved processes hold different states (the
      message names the first part that differs); nothing can be resumed
      with another count.
    InvalidStateError: a saved file is missing or corrupt.
  """
  directory = os.fspath(directory)
  count_files: dict[str, Any] = {}  # the pod part the headers refer to: read once
  saved = [_files.read_saved_header(directory, index, saved_count, count_files=count_files)
           for index in range(saved_count)]
  if all(digest is not None for _, digest in saved):
    # Each header records its arrays' SHA-256: the N headers and one npz are read.
    parts_of = [{**codec.header_parts(header), "arrays": digest} for header, digest in saved]
    states = None
  else:  # saved before the digest was recorded: every process's arrays are read
    states = [_read(directory, index, saved_count, load_arrays=True, count_files=count_files)
              for index in range(saved_count)]
    parts_of = [codec.state_parts(state) for state in states]
  first = parts_of[0]
  for index, parts in enumerate(parts_of[1:], start=1):
    if parts == first:
      continue
    differ = sorted(k for k in set(parts) | set(first) if parts.get(k) != first.get(k))
    raise errors.UnsupportedConfigError(
        f"{directory}: process {index} of {saved_count} saved another data state than "
        f"process 0 (they differ in {', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}): "
        "the processes fed different data, so no saved state is the one a process of "
        f"another count would hold. Resume with {saved_count} processes."
    )
  return states[0] if states is not None else _read(directory, 0, saved_count, load_arrays=True,
                                                     count_files=count_files)


def _read(
    directory: str, index: int, saved_count: int, *, load_arrays: bool, count_files: dict[str, Any] | None = None,
    agreed: list[str | None] | None = None,
) -> state_lib.IteratorState:
  return _files.read_state(directory, index, saved_count, load_arrays=load_arrays, count_is_saved=True,
                           count_files=count_files, agreed=agreed)


def overlapping_files(saved_count: int, process_index: int, process_count: int) -> range:
  """The saved files holding rows of process `process_index` of `process_count`.

  File i holds the fraction [i/N, (i+1)/N) of every pending leaf's rows,
  process j of M needs [j/M, (j+1)/M): files floor(jN/M) .. ceil((j+1)N/M)-1,
  at most ceil(N/M)+1 of them.
  """
  first = process_index * saved_count // process_count
  end = -(-(process_index + 1) * saved_count // process_count)  # ceil
  return range(first, end)


def checked_files(saved_count: int, process_index: int, process_count: int) -> list[int]:
  """The saved files whose headers process j checks against process 0's.

  Process 0's, the overlapping files, and the files after them (before them
  at the end) up to a window of ceil(N/M)+1: the windows of neighbouring
  processes overlap, so each file is checked by at least one new process and
  a file next to a slice boundary by two.
  """
  rows_from = overlapping_files(saved_count, process_index, process_count)
  size = min(saved_count, -(-saved_count // process_count) + 1)  # ceil(N/M) + 1
  start = min(rows_from.start, saved_count - size)
  window = range(start, start + max(size, len(rows_from)))
  return sorted({0, *window})


def redistribute(
    states: Sequence[state_lib.IteratorState],
    process_index: int,
    process_count: int,
    *,
    origin: str = "the state",
) -> state_lib.IteratorState:
  """The state of process j of M from the agreeing states of all N processes."""
  count = len(states)
  return _resliced(
      dict(enumerate(states)), overlapping_files(count, process_index, process_count),
      count, process_index, process_count, origin=origin,
  )


def _resliced(
    states: Mapping[int, state_lib.IteratorState],
    rows_from: range,
    saved_count: int,
    process_index: int,
    process_count: int,
    *,
    origin: str,
) -> state_lib.IteratorState:
  """Process 0's state with each pending item cut to process j's rows.

  `states` holds some of the N saved states, keyed by process index; the
  arrays of those in `rows_from` are real, the others may be stand-ins that
  have only dtype and shape (they take part in the checks, not the data).
  """
  first = states[0]
  if _records.LANES in data_part(first).position:
    first = _with_data_position(first, _records.gathered(
        {i: data_part(states[i]).position for i in rows_from}, saved_count, process_index, process_count,
        origin=origin))
  pending = None
  if first.pending is not None:
    items = []
    for number in range(len(first.pending.items)):
      nodes = {i: s.pending.items[number] for i, s in sorted(states.items())}  # type: ignore[union-attr]
      cut = _RowCut(rows_from, saved_count, process_index, process_count, origin)
      items.append(cut.node(nodes, f"pending item {number}"))
    pending = state_lib.Pending(items=tuple(items), schedule=first.pending.schedule)
  return dataclasses.replace(first, pending=pending)


# ---------------------------------------------------------------------------


def _check_resizable(
    directory: str, state: state_lib.IteratorState, saved_count: int, process_count: int
) -> None:
  reason = state_refusal(state)
  if reason is not None:
    raise errors.UnsupportedConfigError(
        f"{directory}: elastic resume from {saved_count} to {process_count} "
        f"processes {reason} Restore with {saved_count} processes."
    )


def check_agree(directory: str, states: Sequence[state_lib.IteratorState]) -> None:
  """Raises InvalidStateError unless all N states agree on every global field.

  Kind, format and defining fields always; position, key, pending schedule
  and counters too when the position is global (see `resize_refusal`).
  """
  _check_agree(directory, dict(enumerate(states)), len(states))


def _check_agree(
    directory: str, states: Mapping[int, state_lib.IteratorState], count: int
) -> None:
  """`check_agree` for some of the `count` states, keyed by process index (0 included)."""
  first = states[0]
  global_position = state_refusal(first) is None
  reference = _files.process_file_stem(0, count) + ".json"
  for index, state in sorted(states.items()):
    name = _files.process_file_stem(index, count) + ".json"

    def disagree(field: str, here: Any, there: Any) -> errors.InvalidStateError:
      return errors.InvalidStateError(
          f"{directory}: {name} has {field}={_short(here)}, but {reference} has "
          f"{_short(there)}; the processes of one checkpoint must agree on it. "
          "The files come from different runs or steps: restore an earlier step."
      )

    fingerprint = data_part(state).fingerprint
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
      fields += ("shuffle_key", "counters")
    for field in fields:
      if getattr(state, field) != getattr(first, field):
        raise disagree(field, getattr(state, field), getattr(first, field))
    # Lanes are per process by design (`_lanes`): each process saved its own.
    lanes = _records.LANES in data_part(first).position
    if global_position and not lanes and data_part(state).position != data_part(first).position:
      raise disagree("position", data_part(state).position, data_part(first).position)
    for prefix, here_fields, there_fields in _fingerprints(state, first):
      for field in sorted(set(here_fields) | set(there_fields)):
        if field in PER_PROCESS_FIELDS:
          continue
        here, there = here_fields.get(field, state_lib.ABSENT), there_fields.get(field, state_lib.ABSENT)
        if type(here) is not type(there) or here != there:
          raise disagree(f"{prefix}fingerprint.{field}", here, there)
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


def lanes_reached(directory: str, saved_count: int, *, count_files: dict[str, Any] | None = None) -> int:
  """The end of the furthest chunk any lane of a filtered or packed run reached at this step
  (`_lane_mixture.EXTENT`), from every saved process's header: read only by a restore that changes such a
  mixture's weights or sources (N small reads, once; process 0's first, for the count file the others
  refer to, then up to LANES_READ_THREADS at a time)."""
  count_files = {} if count_files is None else count_files
  first = data_part(_read(directory, 0, saved_count, load_arrays=False, count_files=count_files))
  num_lanes, chunk_size = first.fingerprint.get("num_lanes"), first.fingerprint.get("chunk_size")
  if not (state_lib.is_int(num_lanes) and state_lib.is_int(chunk_size)):
    raise errors.InvalidStateError(f"{directory}: its states are no filtered or packed make_dataset's lanes.")

  def reached(index: int) -> int:
    state = first if index == 0 else data_part(
        _read(directory, index, saved_count, load_arrays=False, count_files=count_files))
    if _records.LANES not in state.position:
      raise errors.InvalidStateError(f"{directory}: process {index}'s state holds no lanes.")
    return _lane_mixture.extent([state.position], num_lanes=num_lanes, chunk_size=chunk_size)

  with futures.ThreadPoolExecutor(max_workers=max(1, min(LANES_READ_THREADS, saved_count))) as pool:
    return max(pool.map(reached, range(saved_count)))


def with_lanes_reached(state: state_lib.IteratorState, reached: int) -> state_lib.IteratorState:
  """`state` whose lanes position carries `reached` to the restore's same-stream rule (`_drift`)."""
  return _with_data_position(state, {**data_part(state).position, _lane_mixture.EXTENT: reached})


def _with_data_position(state: state_lib.IteratorState, position: Mapping[str, Any]) -> state_lib.IteratorState:
  """`state` whose data state (itself, or a repeat's parent) has `position`."""
  if state.kind == "repeat" and state.part is not None:
    part = dataclasses.replace(state.part, position=position)
    return dataclasses.replace(state, position={**state.position, state_lib.NESTED["repeat"]: part})
  return dataclasses.replace(state, position=position)


def _fingerprints(state: state_lib.IteratorState, first: state_lib.IteratorState) -> list[tuple[str, Any, Any]]:
  """(field prefix, this state's fingerprint, process 0's) for a state and the data state it nests."""
  pairs = [("", state.fingerprint, first.fingerprint)]
  if state.kind == "repeat" and state.part is not None and first.part is not None:
    pairs.append((f"position.{state_lib.NESTED['repeat']}.", state.part.fingerprint, first.part.fingerprint))
  return pairs


@dataclasses.dataclass(frozen=True)
class _RowCut:
  """Cuts process j of M's rows out of the saved processes' pytrees."""

  rows_from: range  # saved files whose arrays hold process j's rows
  saved_count: int
  index: int
  count: int
  origin: str

  def node(self, nodes: Mapping[int, Any], path: str) -> Any:
    """Process j's part of one pending node, given it for some saved processes.

    `nodes` maps saved process index -> its node (0 and `rows_from` among
    them); all of them must agree on structure, dtype and shape.
    """
    first = nodes[0]
    values = list(nodes.values())
    if isinstance(first, np.ndarray) and first.ndim >= 1:
      return self._rows(nodes, path)
    if isinstance(first, (np.ndarray, np.generic)):
      raise self._refuse(path, f"it is a scalar array ({first.dtype}), which has no rows to split")
    if first is None or isinstance(first, (bool, int, float, str)):
      if any(type(n) is not type(first) or n != first for n in values):
        raise self._refuse(path, f"it is a plain value that differs across processes ({values!r})")
      return first
    if isinstance(first, Mapping):
      if any(not isinstance(n, Mapping) or list(n) != list(first) for n in values):
        raise self._refuse(path, "its dict keys differ across processes")
      return {k: self.node({i: n[k] for i, n in nodes.items()}, f"{path}[{k!r}]") for k in first}
    if isinstance(first, (list, tuple)):
      if any(type(n) is not type(first) or len(n) != len(first) for n in values):
        raise self._refuse(path, "its structure differs across processes")
      return type(first)([
          self.node({i: n[k] for i, n in nodes.items()}, f"{path}[{k}]") for k in range(len(first))
      ])
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
      if any(type(n) is not type(first) for n in values):
        raise self._refuse(path, "its type differs across processes")
      return type(first)(**{
          f.name: self.node({i: getattr(n, f.name) for i, n in nodes.items()}, f"{path}.{f.name}")
          for f in dataclasses.fields(first)
      })
    raise self._refuse(path, f"it holds a {type(first).__qualname__}")

  def _rows(self, nodes: Mapping[int, Any], path: str) -> np.ndarray:
    """Rows [j*R, (j+1)*R) of the saved arrays concatenated in process order."""
    values = list(nodes.values())
    if not all(isinstance(n, np.ndarray) and n.ndim >= 1 for n in values):
      raise self._refuse(path, "it is an array on some processes only")
    if len({(n.dtype.str, n.shape) for n in values}) != 1:
      shapes = [f"{n.dtype}{list(n.shape)}" for n in values]
      raise self._refuse(path, f"its arrays differ across processes ({', '.join(shapes)})")
    saved_rows = nodes[0].shape[0]
    total = saved_rows * self.saved_count
    if total % self.count:
      raise self._refuse(
          path,
          f"its {self.saved_count} x {saved_rows} = {total} rows do not split "
          f"into {self.count} equal parts",
      )
    rows = total // self.count
    start, stop = self.index * rows, (self.index + 1) * rows
    pieces = [
        nodes[i][max(start - i * saved_rows, 0) : max(min(stop - i * saved_rows, saved_rows), 0)]
        for i in self.rows_from
    ]
    return np.concatenate(pieces, axis=0)  # a fresh contiguous array

  def _refuse(self, path: str, reason: str) -> errors.UnsupportedConfigError:
    return errors.UnsupportedConfigError(
        f"{self.origin}: cannot redistribute {path}: {reason}. Elastic resume in the "
        "middle of a repeat needs batch-major produced items: every array leaf "
        "has one leading row (or the same number of rows) per batch row, so the "
        "global item is the processes' arrays concatenated in process order and "
        f"splits into {self.count} equal parts. Resume with the saved process count, "
        "or checkpoint at a group boundary (no pending items)."
    )


def _short(value: Any) -> str:
  return state_lib.short_repr(value, limit=120)
