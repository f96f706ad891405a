"""One step's data item, whatever writes it: take a state, write it, read it, check it, and the resumes it records.

The one home of the item's logic below the Orbax layer: the v0 handler and
the v1 checkpointable (`checkpoint`), the iterators themselves as Orbax v1
checkpointables (`V1Checkpointable`), and the Tunix learners all save and
restore through here, so an item is written and validated one way. No Orbax
import: the read-only CLI reads items through here without loading it.

Every restore from a step adds one entry to the restored state's lineage
(`resumed`): the step and a digest of the state restored there (kind,
fingerprint, position, key, pending schedule, counters). A state keeps the
last `MAX_RECENT` entries, their count and a running digest over all, so it
stays small however often a run is preempted, and `ckpt-iter audit` proves
from the saved states alone that each resume started where its step had
stopped. A lineage also names its run (`started`: the step of the run's
first save), the same on every process with no coordination, so the audit
tells two jobs in one root apart. `set_state` (Grain's protocol) carries a
lineage unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Callable, Collection

import numpy as np

from ckpt_iter import _changed_files
from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _npz
from ckpt_iter import _pod_exchange
from ckpt_iter import _records
from ckpt_iter import elastic as elastic_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib


# ---------------------------------------------------------------------------
# The lineage of a state: which checkpoints the run that wrote it resumed from.

MAX_RECENT = state_lib.MAX_LINEAGE_RECENT
RUN = state_lib.LINEAGE_RUN
_START = "0" * 16  # the running digest of a run never resumed


def resume_digest(value: state_lib.IteratorState, *, per_process: bool = False) -> str:
  """A digest of where `value` continues: what a resume entry records of it.

  Computable from a header alone (pending items are not read: the schedule
  and the arrays' digest in the header stand for them), so the audit and
  the restore compute the same value. It leaves out the fingerprint's
  per-process fields (`elastic.PER_PROCESS_FIELDS`, in the state and in the
  one it nests): the processes of a pod that read the same stream record the
  same entries, so their lineage is written once for the pod (format 5).
  Formats 1-4 digested the whole fingerprint (`per_process=True`);
  `header_resume_digests` knows both.
  """
  return _digest_of_fields(
      value.kind, value.fingerprint, codec.position_to_json(value.position_dict()),
      value.shuffle_key, None if value.pending is None else value.pending.schedule, value.counters,
      per_process=per_process,
  )


def header_resume_digest(header: Mapping[str, Any], *, origin: str) -> str:
  """`resume_digest` of the state a header holds, without reading its arrays."""
  return _value_digest(codec.header_state(header, origin=origin))


def header_resume_digests(
    header: Mapping[str, Any], *, origin: str, value: state_lib.IteratorState | None = None
) -> tuple[str, ...]:
  """Every digest a restore of this header may have recorded: `header_resume_digest`, and for a
  header of an older format that migration reshapes (a format-1 Tunix state), the digest
  of it as written, which a ckpt_iter of that format recorded when it resumed from it.

  `value`: the header's state when the caller has read it already (not parsed again).
  """
  if value is None:
    value = codec.header_state(header, origin=origin)
  digests = (_value_digest(value),)
  version = header.get("format_version")
  if state_lib.is_int(version) and version < PER_PROCESS_LEFT_OUT_VERSION:
    # Formats 1-4 digested the whole fingerprint, the per-process fields with it.
    whole = _value_digest(value, per_process=True)
    digests += () if whole in digests else (whole,)
  if state_lib.is_int(version) and version < 4:
    # A ckpt_iter of that format recorded the digest of the state as it read it:
    # as written, and a format-1 learner state nested as formats 2-3 read it.
    forms = [header]
    if version == 1 and header.get("kind") == "tunix":
      forms.append(state_lib.migrate_learner_v1(header))
    for form in forms:
      digest = _written_digest(form)
      digests += () if digest is None or digest in digests else (digest,)
  return digests


def _written_digest(header: Mapping[str, Any]) -> str | None:
  """`resume_digest` of a header of an older format as that format read it (no reshaping), or None."""
  pending = header.get("pending")
  schedule = pending.get("schedule") if isinstance(pending, Mapping) else None
  try:
    position = codec.position_to_json(codec.position_from_json(header.get("position")))
    return _digest_of_fields(header.get("kind"), header.get("fingerprint"), position, header.get("shuffle_key"),
                             schedule, header.get("counters") or {}, per_process=True)
  except (errors.CkptIterError, TypeError, ValueError):
    return None


def _value_digest(value: state_lib.IteratorState, *, per_process: bool = False) -> str:
  position = codec.position_to_json(codec.position_from_json(value.position_dict()))
  return _digest_of_fields(
      value.kind, value.fingerprint, position, value.shuffle_key,
      None if value.pending is None else value.pending.schedule, value.counters, per_process=per_process,
  )


# The first format whose resume entries digest a state without its per-process fields.
PER_PROCESS_LEFT_OUT_VERSION = 5


def _digest_of_fields(kind, fingerprint, position, shuffle_key, schedule, counters, *, per_process=False) -> str:
  """The one digest of a resume entry's `state`; `per_process`: as formats 1-4 took it (every field)."""
  if not per_process:
    fingerprint, position = _files.pod_common(kind, fingerprint, position, elastic_lib.PER_PROCESS_FIELDS)
  # In the header's own key order (both sides read the same header), so no
  # sorting: a restore computes this once, on its critical path.
  text = json.dumps(
      [kind, fingerprint, position, None if shuffle_key is None else list(shuffle_key),
       None if schedule is None else list(schedule), counters],
      separators=(",", ":"), default=repr,
  )
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def resume_entry(restored: state_lib.IteratorState, step: int | None, *, resized: bool = False,
                 saved: state_lib.IteratorState | None = None) -> dict[str, Any]:
  """The entry a restore of `restored` from checkpoint `step` adds.

  Its `state` digests the state as saved (`saved`, process 0's for a resize:
  what the audit finds at that step), else `restored`.
  """
  entry: dict[str, Any] = {"step": step, "state": resume_digest(restored if saved is None else saved)}
  entry.update(segment_fields(restored))
  if resized:
    entry["resized"] = True  # restored by another process count (elastic)
  return entry


# The segment geometry a resume entry records (entry field, fingerprint field), each only when it changed
# since the entry before it that recorded it (`state.carried_geometry`): a run of one batch size pays once.
SEGMENT_GEOMETRY = (("batch_size", "global_batch_size"), ("process_count", "shard_count"),
                    ("lanes", "shuffle_lanes"))
# A geometry name's value where no entry recorded it: a make_dataset without shard lanes writes no lane field.
_GEOMETRY_DEFAULTS = {"lanes": 1}


def segment_fields(restored: state_lib.IteratorState) -> dict[str, int]:
  """Where the restored state's stream continues, for the data map: its stream record (`record`) and the
  global batch size, process count and shard lanes it was read with, so a checkpoint's last batch and the run's
  segments are known from its own lineage, whatever steps are kept; for a mixture, its segment
  (`_records.mixture_segment`). The batch size, process count and mixture are left out where the
  lineage's earlier entries carry the same. Empty for a position that counts
  no stream records (the data map does not answer those from states)."""
  inner = restored.innermost
  fingerprint, position = inner.fingerprint, inner.position
  record = position.get(_records.NEXT_RECORD) if isinstance(position, Mapping) else None
  if not state_lib.is_int(record) or record < 0:
    return {}
  fields = {"record": int(record)}
  mixture = _records.mixture_segment(fingerprint, position)
  recent = (restored.lineage or {}).get("recent") or ()
  names = [name for name, _ in SEGMENT_GEOMETRY] + ([] if mixture is None else ["mixture"])
  carried = state_lib.latest_geometry(recent, names)
  for name, field in SEGMENT_GEOMETRY:
    value = fingerprint.get(field, _GEOMETRY_DEFAULTS.get(name))
    if state_lib.is_int(value) and value >= 1 and carried.get(name, _GEOMETRY_DEFAULTS.get(name)) != value:
      fields[name] = int(value)
  if mixture is not None and carried.get("mixture") != mixture:
    fields["mixture"] = mixture  # the shares, lengths and ledger: changed only where the mixture changed
  return fields


def extended(lineage: Mapping[str, Any] | None, entry: Mapping[str, Any]) -> dict[str, Any]:
  """`lineage` with one more resume."""
  lineage = lineage or empty()
  # The entries before are shared, not copied: a state's lineage is read-only (a resume's cost stays flat).
  recent = [*lineage["recent"], dict(entry)][-MAX_RECENT:]
  result = {
      "resumes": lineage["resumes"] + 1,
      "digest": fold(lineage["digest"], entry),
      "recent": recent,
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
    restored: state_lib.IteratorState, step: int | None, *, resized: bool = False,
    saved: state_lib.IteratorState | None = None,
) -> state_lib.IteratorState:
  """`restored` with the resume from `step` added to its lineage (`saved`: see `resume_entry`)."""
  entry = resume_entry(restored, step, resized=resized, saved=saved)
  # The restored lineage was validated when it was read: only the new entry is checked.
  return state_lib.extended_lineage(restored, extended(restored.lineage, entry), entry)


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


# ---------------------------------------------------------------------------
# One step's data item, whatever writes it: take a state, write it, read it, check it.

_log = logging.getLogger(__name__)


def process(process_index: int | None = None, process_count: int | None = None) -> tuple[int, int]:
  """(index, count) of this process: JAX's, unless given."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  return process_index, process_count


def step_of(directory: Any) -> int | None:
  """The checkpoint step of an item directory (also while Orbax writes it), or None."""
  return step_of_item_directory(os.fspath(directory))


def write(directory: Any, header: dict[str, Any], arrays: dict[str, np.ndarray], index: int, count: int) -> None:
  """Writes a snapshot as this process's files of the item (and the count file on process 0).

  In the background (Orbax's write thread): arrays another process writes
  identically are not written again (`_pod_exchange.share_arrays`).
  """
  step = step_of(directory)
  if step is not None:
    # Where the state belongs: `ckpt-iter audit` refuses it in another step's directory.
    header = {**header, _files.SAVED_STEP: step}
  referring, pod_text, pod_digest = _files.split_header(header, elastic_lib.PER_PROCESS_FIELDS)
  shared = _pod_exchange.share_arrays(
      os.fspath(directory), header, arrays, index, count, pod_digest=pod_digest,
      agreement=lambda: elastic_lib.agreement_sha256(codec.header_state(header, origin=directory)))
  header, arrays = shared.header, shared.arrays
  if shared.pod_digest == pod_digest:
    # Process 0's count file holds the same pod part: only the reference is written here.
    referring = {**referring, **{k: header[k] for k in _SHARING_FIELDS if k in header}}
    header = referring
  _files.write_files(directory, header, arrays, process_index=index, process_count=count, count_file=True,
                     pod_text=pod_text if index == 0 and shared.pod_digest == pod_digest else None,
                     agreed=shared.agreed)


# What `_pod_exchange.share_arrays` adds to a header: kept beside a reference to the pod part.
_SHARING_FIELDS = (_npz.ARRAYS_SHA256, _files.ARRAYS_FROM)


def snapshot(item: Any, step: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Takes the state of `item` now, saved in checkpoint `step`: a JSON header and copies of its arrays.

  A ckpt_iter iterator's first save names its run after `step`
  (`_item.started`); the iterator keeps that lineage for later saves.

  The only copy of the pending arrays a save makes: each leaf copied once to
  host, into its group's stacked array (`_codec.encode_items`; a JAX array
  on an accelerator is transferred first, and in a group of one item that
  transfer is the copy). The handler writes these very arrays in Orbax's
  background thread, with no further defensive copy.
  """
  if hasattr(item, "state"):
    value = item.state()
    keep_lineage = getattr(item, "keep_lineage", None)
    lineage = started(value.lineage, step) if keep_lineage is not None else value.lineage
    if lineage is not value.lineage:
      value = value.with_lineage(lineage)
      keep_lineage(value.lineage)
  else:
    value = state_lib.IteratorState.from_dict(grain_state_dict(item.get_state()))
  return codec.encode_state(value)


def grain_state_dict(grain_state: Any) -> Any:
  """A plain Grain iterator's state as a dict: a DataLoader's comes as JSON bytes."""
  if isinstance(grain_state, bytes):
    try:
      return json.loads(grain_state.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise errors.InvalidStateError(
          f"the iterator's get_state() returned bytes that are not JSON ({e}); "
          "ckpt_iter stores Grain states as JSON. Wrap a grain.DataLoader in "
          "ckpt_iter.DataLoaderIterator."
      ) from None
  return grain_state


@dataclasses.dataclass(frozen=True)
class SavedState:
  """A data state as read from an item directory, for one process."""

  value: state_lib.IteratorState
  resized: bool  # written by another process count (re-sliced by elastic)
  origin: str  # what error messages name
  step: int | None = None  # the checkpoint step it was read from, when the path says
  # Process 0's state as saved, where a resize re-sliced a per-process position (lanes) from it.
  saved_first: state_lib.IteratorState | None = None
  # The end of the furthest chunk any saved lane reached (`elastic.lanes_reached`), read when asked.
  lanes_reached: Callable[[], int] | None = None

  def resumed(self) -> state_lib.IteratorState:
    """The value with this resume recorded in its lineage (what the receiver carries on)."""
    return resumed(self.value, self.step, resized=self.resized, saved=self.saved_first)


def read_item(
    directory: str | os.PathLike[str], process_index: int, process_count: int, *, elastic: bool = False,
    replicated: bool = False, join: Callable[[str, int], "SavedState | None"] | None = None,
) -> SavedState:
  """Reads process `process_index`'s state from an item directory, validated.

  The one read path of a data item (Orbax restores, the Tunix learners'
  restores), and the one place that decides what a step written by another
  process count gives:
    - `elastic`: the saved position re-sliced for this count
      (`elastic.read_for_process`: make_dataset states and their repeats);
    - `replicated`: the one state every saved process holds
      (`elastic.read_replicated`: a learner's state, which cannot be
      re-sliced), else `join(directory, saved_count)`'s state made of the
      saved processes' parts (None: they differ otherwise), recorded as
      resized;
    - neither: ProcessCountError, naming both counts.

  Raises:
    ProcessCountError: another process count and no way above takes it (with
      `replicated`, naming the first part the saved processes differ in).
  """
  directory = os.fspath(directory)
  step = step_of_item_directory(directory)
  if not elastic:
    try:
      return SavedState(
          _files.read_state(directory, process_index, process_count),
          resized=False,
          origin=_files.header_path(directory, process_index, process_count),
          step=step,
          lanes_reached=lambda: elastic_lib.lanes_reached(directory, process_count),
      )
    except errors.ProcessCountError as e:
      if not replicated:
        raise
      return _read_replicated(directory, e, step, join)
  count_files: dict[str, Any] = {}  # the count file, read once for the count and the pod part
  saved_count = _files.saved_process_count(directory, count_files=count_files)
  saved_first: list[state_lib.IteratorState] = []
  value = elastic_lib.read_for_process(
      directory, process_index, process_count, saved_count=saved_count, count_files=count_files,
      saved_first=saved_first,
  )
  # With the saved process count an elastic restore is an exact one: each
  # process gets its own file, so per-process fields are checked as usual
  # (and a per-process filter, refused only when the count changes, works).
  return SavedState(value, resized=saved_count != process_count, origin=directory, step=step,
                    saved_first=saved_first[0] if saved_first else None,
                    lanes_reached=lambda: elastic_lib.lanes_reached(directory, saved_count, count_files=count_files))


def _read_replicated(directory: str, error: errors.ProcessCountError, step: int | None,
                     join: Callable[[str, int], "SavedState | None"] | None) -> SavedState:
  """The state all of another count's saved processes hold alike (or `join`'s of their parts)."""
  try:
    return SavedState(elastic_lib.read_replicated(directory, error.saved_count), resized=True, origin=directory,
                      step=step)
  except errors.UnsupportedConfigError as refusal:
    joined = join(directory, error.saved_count) if join is not None else None
    if joined is not None:
      return joined
    raise errors.ProcessCountError(
        f"{directory}: written by {error.saved_count} JAX process(es); resuming with {error.process_count} is "
        f"exact only when every saved process holds the same data state. {refusal}",
        saved_count=error.saved_count, process_count=error.process_count) from None


def read_item_if_present(
    directory: str | os.PathLike[str], process_index: int, process_count: int, **other_count: Any
) -> SavedState | None:
  """`read_item` (`other_count`: its `elastic`, `replicated`, `join`), or None without a data item at all.

  For learners that resume steps written without one (stock Tunix): the
  header is read directly, and only its absence costs a listing.
  """
  try:
    return read_item(directory, process_index, process_count, **other_count)
  except errors.ItemNotFoundError:
    return None


def check_restore_saved(
    item: Any, saved: SavedState, *, allow_drift: Collection[str] = ()
) -> Callable[[], None]:
  """Checks a state read by `read_item` against `item`; returns the apply step.

  A state re-sliced for another process count may differ in the per-process
  fields (`elastic.ELASTIC_FIELDS`); everything else must match.
  """
  allowed = set(allow_drift) | (elastic_lib.ELASTIC_FIELDS if saved.resized else set())
  if not saved.value.fingerprint and hasattr(item, "check_restore"):
    # Every state ckpt_iter writes has a fingerprint; a bare Grain state has none.
    _log.warning(
        "%s: written in Grain's own format (a bare iterator state, no fingerprint), e.g. by "
        "grain.checkpoint or a Grain iterator saved by Orbax v1: restored without checking that "
        "it comes from this pipeline. Save with ckpt_iter (IteratorSave, or the ckpt_iter "
        "iterator itself) to have it checked.", saved.origin)
  # A ckpt_iter iterator carries the lineage on, with this resume in it.
  value = saved.resumed() if hasattr(item, "check_restore") else saved.value
  try:
    try:
      apply = check_restore_into(item, value, allow_drift=allowed, origin=saved.origin)
    except errors.ConfigDriftError as error:
      # A filtered or packed mixture changed: its new shares start after the furthest chunk any saved lane
      # reached, which every saved process's header tells (`_lane_mixture`); read them, check again.
      if not (getattr(error, "lanes_reached_needed", False) and saved.lanes_reached is not None):
        raise
      value = elastic_lib.with_lanes_reached(value, saved.lanes_reached())
      apply = check_restore_into(item, value, allow_drift=allowed, origin=saved.origin)
  except errors.ConfigDriftError as error:
    _changed_files.note(error, getattr(item, "spec", None), saved.origin)  # which files changed, where known
    raise

  def apply_and_log() -> None:
    apply()
    if not _log.isEnabledFor(logging.INFO):
      return  # the summary is formatted only for a log that shows it
    content = getattr(item, "restored_content_check", None)
    _log.info(
        "ckpt_iter: restored the %s state of step %s%s: %s%s (%s)",
        value.kind, saved.step, " (another process count)" if saved.resized else "",
        state_lib.summary_line(value), "" if content is None else f"; content check: {content}",
        saved.origin,
    )

  return apply_and_log


def check_restore_into(
    item: Any, value: state_lib.IteratorState, *, allow_drift: Collection[str] = (), origin: str
) -> Callable[[], None]:
  """Checks `value` for a ckpt_iter iterator (check, then apply) or a Grain one: raises or
  returns the apply step."""
  # What isinstance(item, state_lib.Restorable) decides, without typing's
  # protocol machinery, which walks the protocol's MRO on every call.
  check_restore = getattr(item, "check_restore", None)
  if check_restore is not None:
    return check_restore(value, allow_drift=allow_drift, origin=origin)
  if value.fingerprint:
    # Grain's set_state would take the position and check nothing of the pipeline.
    raise errors.InvalidArgumentError(
        f"{origin} was written by a ckpt_iter {value.kind!r} iterator (it records its pipeline's "
        f"fingerprint), but the iterator to restore into is a plain {type(item).__qualname__}, which "
        "would take the position without checking that it comes from this pipeline. Wrap the "
        "dataset, iterator = ckpt_iter.DataIterator(dataset) (a grain.DataLoader: "
        "ckpt_iter.DataLoaderIterator(loader)), read batches from it, and restore into that."
    )
  if allow_drift:
    raise errors.InvalidArgumentError(
        f"allow_drift/elastic need a ckpt_iter iterator; {type(item).__qualname__} "
        "has only set_state."
    )
  # A bare Grain state (Grain's handler, or IteratorSave of a plain Grain
  # iterator) into a plain Grain iterator: the position, in the form its
  # get_state gives (a DataLoader's iterator takes JSON bytes). Grain checks
  # it only when it is set.
  position = dict(value.position)
  if isinstance(item.get_state(), bytes):
    return lambda: item.set_state(json.dumps(position).encode("utf-8"))
  return lambda: item.set_state(position)




# ---------------------------------------------------------------------------
# Orbax v1: the save and load of a StatefulCheckpointable, in ckpt_iter's files.


async def v1_save(item: Any, directory: Any, index: int | None = None, count: int | None = None) -> Any:
  """Takes the state now; returns the background write (after Orbax created the directory)."""
  # The step directory's name is known before Orbax creates it.
  path = getattr(directory, "path", directory)
  try:
    header, arrays = snapshot(item, step_of(path) if isinstance(path, (str, os.PathLike)) else None)
  except BaseException:
    await _created(directory)
    raise
  index, count = process(index, count)

  async def write_in_background() -> None:
    write(await directory.await_creation(), header, arrays, index, count)

  return write_in_background()


# How long a failed save waits for Orbax to create the step's directories.
STEP_DIRECTORIES_WAIT_SECONDS = 60


async def _created(directory: Any) -> None:
  """Waits (bounded) until Orbax created `directory`, before an error leaves the save.

  Orbax v1 creates the step's directories in a background thread, which the
  other checkpointables' writes wait for: an error that ends the program
  before that thread ran leaves them waiting out Orbax's 300 s signal timeout
  at exit (as in `checkpoint._await_step_directories`, for v0).
  """
  await_creation = getattr(directory, "await_creation", None)
  if await_creation is None:
    return
  try:
    await asyncio.wait_for(await_creation(), STEP_DIRECTORIES_WAIT_SECONDS)
  except Exception:  # pylint: disable=broad-except  (the save's own error is the one to raise)
    pass


async def v1_load(
    item: Any, directory: Any, *, allow_drift: Collection[str] = (), elastic: bool = False,
    index: int | None = None, count: int | None = None,
) -> Any:
  """Reads and checks now, applies in the background step.

  Orbax wraps errors of the background step in NoEntryError but lets these
  through, so a refused restore raises the same errors as through the v0 API.
  """
  index, count = process(index, count)
  saved = read_item(os.fspath(directory), index, count, elastic=elastic)
  apply = check_restore_saved(item, saved, allow_drift=allow_drift)

  async def finish() -> None:
    apply()

  return finish()


class V1Checkpointable:
  """Makes an iterator an Orbax v1 checkpointable itself, as Grain's iterators are.

      ocp1.save_checkpointables(path, {"params": params, "data": iterator})
      ocp1.load_checkpointables(path, {"params": abstract, "data": iterator})

  Written in ckpt_iter's files and checked on load (ConfigDriftError names
  the field), like `ckpt_iter.IteratorCheckpointable(iterator)`, which also
  takes allow_drift and elastic.
  """

  async def save(self, directory: Any) -> Any:
    return await v1_save(self, directory)

  async def load(self, directory: Any) -> Any:
    return await v1_load(self, directory)
