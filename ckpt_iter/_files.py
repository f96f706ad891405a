"""The files of one data item: `process_<i>-of-<n>.json` (+ `.npz`) per process.

Plus `ckpt_iter.json`, written by process 0 through the checkpoint handler:
`{"process_count": n}`, so an elastic restore learns the saved count from
one small file instead of listing the 2n names (items written before it
existed are listed, as before). From format 5 it also holds the pod part
of the headers (`split_header`): the fingerprint without its per-process
fields, and the lineage, which every process of a pod holds alike. It is
written there once, and a header that refers to it (`POD_SHA256`) is read
whole again by `read_header`, the one place every reader passes through.

This module is the only one that names, lists, writes or reads them (the npz's
contents through `_npz`), through `_storage` (a local directory or an object store). A file is written in one
piece, with no temporary and rename (object stores have none): the item is
published by the Orbax step commit it is written inside. Reads are hardened
against truncated, garbled or hostile files: each file is read whole in one
request, at most a bound known before the read (a header's limit; for an npz
the bytes its header's manifest allows), the npz's member count is checked
before its zip directory is parsed, arrays must be stored (not compressed)
plain .npy members whose dtype and shape match the header, and every error
names the file.

The npz's format (written aligned, read as slices of one buffer) is `_npz`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import AbstractSet, Any, Callable, Collection, Mapping, Sequence

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import _npz
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_HEADER_BYTES = 64 * 2**20
COUNT_FILE = "ckpt_iter.json"
# Header field of a process that shares another's arrays (`share_arrays`):
# the process whose npz holds them (with their SHA-256, `_npz.ARRAYS_SHA256`).
ARRAYS_FROM = "arrays_from"
# Header field: the Orbax step the state was saved in (when its directory
# names one), which `ckpt-iter audit` compares with the step holding it.
# Not part of the state: readers that predate it ignore it.
SAVED_STEP = "saved_step"
# Process 0's header field, where every process of its save reported a state that is process 0's but for its
# own rows (`elastic.agreement_sha256`, `_pod_exchange.share_arrays`): that digest. Readers that predate it ignore it.
AGREED_SHA256 = "agreed_sha256"
# Header field of a process whose pod part is in `COUNT_FILE` (format 5): the pod part's SHA-256,
# where the header's `lineage` was. The count file holds the same digest and the part itself.
POD_SHA256 = "pod_sha256"
# Far above any pod; a larger value is a garbled file, not a job.
MAX_PROCESS_COUNT = 2**24
# A count file with a pod part, exactly as `write_files` lays it out: the digest covers the
# bytes after `"pod":` up to the closing brace, so it is checked without serializing anything.
_POD_COUNT_FILE = re.compile(rb'\{"process_count":([1-9][0-9]{0,8}),"pod_sha256":"([0-9a-f]{64})","pod":')
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PROCESS_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")
_PROCESS_FILES_IN_LISTING = re.compile(r"^process_(\d+)-of-(\d+)\.json$", re.MULTILINE)


def process_file_stem(process_index: int, process_count: int) -> str:
  """`process_<i>-of-<n>`: the name of a process's files, without extension."""
  return f"process_{process_index}-of-{process_count}"


def header_path(directory: str | os.PathLike[str], process_index: int, process_count: int) -> str:
  """The path of a process's state header (`.json`) in an item directory."""
  return os.path.join(os.fspath(directory), process_file_stem(process_index, process_count) + ".json")


def write_files(
    directory: str | os.PathLike[str],
    header: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    process_index: int,
    process_count: int,
    count_file: bool = False,
    pod_text: bytes | None = None,
    agreed: Callable[[], str | None] | None = None,
) -> None:
  """Writes one process's files: one object each (header, npz, count file).

  The npz is streamed from the arrays themselves (no second copy of them in
  memory). A header that shares another process's arrays (`ARRAYS_FROM`,
  see `_pod_exchange.share_arrays`) comes with no arrays, and no npz is written.
  With `count_file` (the checkpoint handler), process 0 also writes
  `COUNT_FILE`, the saved process count an elastic restore reads, and
  `pod_text` in it (`split_header`), which headers refer to by its digest.
  `agreed()`, process 0's, is asked once its npz is written, before its
  header: the digest all saved processes agreed on (`AGREED_SHA256`), or None.

  Raises:
    OSError: naming the file that could not be written (nothing partial of
      it is left behind).
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  if arrays:
    tail = _npz.TailKeeper(_npz.directory_bytes_bound(arrays))

    def produce(f: Any) -> None:
      tail.target = f
      _npz.write_npz(tail, arrays)

    _storage.write_stream(os.path.join(directory, stem + ".npz"), produce)
    header = {**header, _npz.ARRAYS_DIGEST: tail.directory_digest()}
  agreed_sha256 = agreed() if agreed is not None and process_index == 0 else None
  if agreed_sha256 is not None:
    header = {**header, AGREED_SHA256: agreed_sha256}
  # Compact: a state is read by programs (`ckpt-iter inspect` shows it to people).
  text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
  _storage.write_bytes(os.path.join(directory, stem + ".json"), text)
  if count_file and process_index == 0:
    if pod_text is None:
      count = json.dumps({"process_count": process_count}).encode()
    else:
      digest = hashlib.sha256(pod_text).hexdigest()
      count = b'{"process_count":%d,"pod_sha256":"%s","pod":%s}' % (process_count, digest.encode(), pod_text)
    _storage.write_bytes(os.path.join(directory, COUNT_FILE), count)


def split_header(
    header: Mapping[str, Any], per_process: Collection[str]
) -> tuple[dict[str, Any], bytes, str]:
  """A header as a process writes it when the count file holds its pod part; that part's text and SHA-256.

  The pod part is what every process of a pod that reads the same stream holds
  alike: the fingerprints without their `per_process` fields, the state's own
  and those of the states it nests (a repeat's parent, a learner's input,
  outermost first), and the lineage (`{"fingerprints": [...], "lineage": {...}}`,
  compact JSON). The header keeps the rest, each fingerprint with only its
  `per_process` fields, and `POD_SHA256` where its lineage was, so
  `read_header` puts the header back together in its own order. Whether a
  process may refer to process 0's pod part (theirs the same) is the
  caller's to decide (`_item.write`).
  """
  fingerprints: list[dict[str, Any]] = []

  def own_fields(fingerprint: Any) -> Any:  # the pod's fields to the pod part, outermost first
    if not isinstance(fingerprint, Mapping):
      return fingerprint
    fingerprints.append({k: v for k, v in fingerprint.items() if k not in per_process})
    return {k: v for k, v in fingerprint.items() if k in per_process}

  own_fingerprint, own_position = each_fingerprint(
      header.get("kind"), header.get("fingerprint") or {}, header.get("position"), own_fields)
  own = {**header, "fingerprint": own_fingerprint}
  if own_position is not header.get("position"):
    own["position"] = own_position
  pod: dict[str, Any] = {"fingerprints": fingerprints}
  if header.get("lineage") is not None:
    pod["lineage"] = header["lineage"]
  text = json.dumps(pod, separators=(",", ":"), allow_nan=False).encode()
  digest = hashlib.sha256(text).hexdigest()
  own = {POD_SHA256 if key == "lineage" else key: digest if key == "lineage" else value
         for key, value in own.items()}
  own.setdefault(POD_SHA256, digest)  # a state without a lineage
  return own, text, digest


def pod_common(kind: Any, fingerprint: Any, position: Any, per_process: AbstractSet[str]) -> tuple[Any, Any]:
  """A state's fingerprint and position as a pod's processes hold them alike: without `per_process` fields."""
  def common(found: Any) -> Any:
    if isinstance(found, Mapping) and not per_process.isdisjoint(found):
      return {k: v for k, v in found.items() if k not in per_process}
    return found
  return each_fingerprint(kind, fingerprint, position, common)


def each_fingerprint(kind: Any, fingerprint: Any, position: Any, change: Callable[[Any], Any]) -> tuple[Any, Any]:
  """THE walk of the pod part's cut: the fingerprint and position with `change` applied to the state's
  fingerprint and each nested state's (`state.NESTED`), outermost first; what it leaves is the same object."""
  fingerprint = change(fingerprint)
  key = state_lib.NESTED.get(kind) if isinstance(kind, str) else None
  part = position.get(key) if key is not None and isinstance(position, Mapping) else None
  if isinstance(part, Mapping):
    inner, inner_position = each_fingerprint(part.get("kind"), part.get("fingerprint"), part.get("position"), change)
    if inner is not part.get("fingerprint") or inner_position is not part.get("position"):
      changed = {**part, "fingerprint": inner}
      if "position" in part:
        changed["position"] = inner_position
      position = {**position, key: changed}
  return fingerprint, position


def check_item_directory(directory: str) -> None:
  """Refuses a local item directory that resolves outside its checkpoint root.

  The rule (every reader of a step's files asks it: restores, the learners,
  every CLI verb): a step's data is read only inside the root that lists the
  step, `<root>/<step>/<item>`. A symbolic link on the way, the item or the
  step directory, whose target lies outside the root is refused, as a link
  in place of a state file is (`O_NOFOLLOW`): a file under a checkpoint
  root is read, never one elsewhere that a link planted in the root names.
  A link that stays inside the root is followed, and so is a root that is
  itself a link or under one (both sides are resolved). Orbax's own stance is
  alike: it refuses to delete a checkpoint through a link. Object stores have
  no links.

  Raises:
    InvalidStateError: naming the directory, where it leads and what to do.
  """
  if _storage.is_url(directory):
    return
  directory = os.path.normpath(os.fspath(directory))
  step_directory = os.path.dirname(directory)
  if not os.path.islink(directory) and not os.path.islink(step_directory):
    return  # <root>/<step>/<item> with no link below the root: inside it (two lstat calls, not two realpaths)
  root = os.path.dirname(step_directory) or os.curdir
  real_root, real = os.path.realpath(root), os.path.realpath(directory)
  if real == real_root or real.startswith(os.path.join(real_root, "")):
    return
  raise errors.InvalidStateError(
      f"{directory}: resolves to {real}, outside the checkpoint root {root} (a symbolic link in place "
      "of the step or item directory): a step's data is read only inside its root, never through a link "
      "out of it. Move or copy the directory into the root, or restore another step.")


def read_header(path: str, *, count_files: dict[str, "CountFile | None"] | None = None) -> dict[str, Any]:
  """Reads and parses a state header file, with errors that name the file.

  A header that refers to its step's pod part (`POD_SHA256`, format 5) is
  returned whole, as if it had been written whole: the pod part is read from
  the count file next to it, checked against the digest both files record,
  and put back in place. Callers that read several headers of one item pass
  one `count_files` dict (keyed by directory) to read the count file once.

  Raises:
    FileNotFoundError: there is no such file (the caller says what that means).
    InvalidStateError: anything else, and a directory outside its root (`check_item_directory`).
  """
  header = _read_json(path)
  if type(header) is dict and POD_SHA256 in header:
    directory = os.path.dirname(path)
    if count_files is not None and directory in count_files:
      count = count_files[directory]
    else:
      count = read_count_file(directory, directory_checked=True)
      if count_files is not None:
        count_files[directory] = count
    return _with_pod_part(header, path, count)
  return header


def _read_json(path: str) -> Any:
  """One JSON file read whole (bounded) and parsed, with errors that name it."""
  check_item_directory(os.path.dirname(path))
  data = _read_bytes(path)
  try:
    return _DECODER.decode(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    # RecursionError: JSON nested deeper than the parser's recursion limit.
    raise errors.InvalidStateError(
        f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
        "is truncated or garbled. Restore an earlier step."
    ) from None


def _read_bytes(path: str) -> bytes:
  try:
    return _storage.read_bytes(path, max_bytes=MAX_HEADER_BYTES)
  except (FileNotFoundError, errors.StorageError):
    raise  # a missing file or the store's own error: the caller / the message says it
  except _storage.TooLargeError as e:
    raise errors.InvalidStateError(
        f"{path}: state header is {e.shown_size} bytes, over the {MAX_HEADER_BYTES} limit; the "
        "file is corrupt or not a ckpt_iter state."
    ) from None
  except OSError as e:
    raise errors.InvalidStateError(f"{path}: cannot read the state file ({e.strerror or e}).") from None


@dataclasses.dataclass(frozen=True)
class CountFile:
  """An item's `COUNT_FILE` as read: the saved process count, and the pod part's text when it holds one."""

  path: str
  process_count: int
  pod_sha256: str | None = None
  pod_text: bytes | None = None  # exactly the bytes `pod_sha256` covers


def read_count_file(directory: str, *, directory_checked: bool = False) -> CountFile | None:
  """The item's `COUNT_FILE`, or None if it has none (written before it existed, or without the handler).

  `directory_checked`: the caller just read a header there (`check_item_directory` asked).

  Raises:
    InvalidStateError: unreadable or garbled (naming it and what to do).
  """
  path = os.path.join(directory, COUNT_FILE)
  if not directory_checked:
    check_item_directory(directory)
  try:
    data = _read_bytes(path)
  except FileNotFoundError:
    return None
  match = _POD_COUNT_FILE.match(data)
  if match is not None and data.endswith(b"}"):
    count = int(match.group(1))
    if count <= MAX_PROCESS_COUNT:
      return CountFile(path, count, match.group(2).decode("ascii"), data[match.end():-1])
  try:
    value = _DECODER.decode(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise errors.InvalidStateError(
        f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file is truncated or garbled. "
        f"Restore an earlier step, or delete {COUNT_FILE} if no header refers to it (no {POD_SHA256!r})."
    ) from None
  count = value.get("process_count") if isinstance(value, dict) else None
  if not state_lib.is_int(count) or not 1 <= count <= MAX_PROCESS_COUNT:
    shown = state_lib.short_repr(count if isinstance(value, dict) else value)
    raise errors.InvalidStateError(
        f"{path}: field 'process_count' is {shown}, expected the number of processes that "
        "wrote this step (an integer >= 1). The file is garbled: restore an earlier step, or "
        f"delete {COUNT_FILE} to have the process files listed instead (if no header refers to it)."
    )
  return CountFile(path, int(count))


# Pod parts already parsed and checked, by the SHA-256 of their text: the same bytes give the same
# checked value, so the N headers of a pod, or the steps a run saved between two resumes, cost one
# check of their lineage. Bounded; never trusted by the digest a file claims, only by the text's own.
_CHECKED_PODS: dict[str, dict[str, Any]] = {}
_CHECKED_PODS_KEPT = 16
_CHECKED_POD_MAX_BYTES = 2**20
_MAX_NESTED_FINGERPRINTS = 8  # a state and the states it nests (a few; a state refuses more than 4 deep)


def _with_pod_part(header: dict[str, Any], path: str, count: CountFile | None) -> dict[str, Any]:
  """`header` with its step's pod part put back: the header as if written whole.

  The count file's process count is checked against the header's own name
  here, where every reader of a header passes (restores, verify, audit,
  inspect, which, order): one verdict on an edited count.
  """
  match = _PROCESS_FILE.match(os.path.basename(path))
  if count is not None and match is not None and int(match.group(2)) != count.process_count:
    raise errors.InvalidStateError(
        f"{count.path}: says {count.process_count} processes, but {os.path.basename(path)} is one of "
        f"{int(match.group(2))}: the count file was edited or comes from another save. Restore an earlier "
        f"step, or set its process_count back to {int(match.group(2))}.")
  pod = _pod_part(header[POD_SHA256], path, count)
  if "lineage" in header:
    raise errors.InvalidStateError(
        f"{path}: refers to the pod part in {COUNT_FILE} ({POD_SHA256!r}) but holds field 'lineage' beside "
        "it. The file is garbled: restore an earlier step.")
  whole = _merged_state(header, pod["fingerprints"], path, "")
  if pod.get("lineage") is None:
    del whole[POD_SHA256]
  else:  # in the reference's place
    whole = {"lineage" if key == POD_SHA256 else key: pod["lineage"] if key == POD_SHA256 else value
             for key, value in whole.items()}
  return whole


def _merged_state(state: dict[str, Any], fingerprints: list[dict], path: str, prefix: str) -> dict[str, Any]:
  """`state` with `fingerprints` (its own, then those of the states it nests) put back in place."""
  fingerprint = state.get("fingerprint")
  if type(fingerprint) is not dict:
    raise errors.InvalidStateError(
        f"{path}: field '{prefix}fingerprint' is {state_lib.short_repr(fingerprint)}; a header that refers to "
        f"the pod part in {COUNT_FILE} holds its per-process fields there. The file is garbled: restore an "
        "earlier step.")
  whole = {**state, "fingerprint": {**fingerprints[0], **fingerprint}}  # (a field in both: the header's own)
  if len(fingerprints) > 1:
    key = state_lib.NESTED.get(state.get("kind"))  # type: ignore[arg-type]
    position = state.get("position")
    part = position.get(key) if key is not None and type(position) is dict else None
    if type(part) is not dict:
      raise errors.InvalidStateError(
          f"{path}: the pod part in {COUNT_FILE} holds the fingerprint of a state nested in "
          f"'{prefix}position', which holds none. The files come from different saves: restore an earlier step.")
    whole["position"] = {**position, key: _merged_state(part, fingerprints[1:], path, f"{prefix}position.{key}.")}
  return whole


def _pod_part(digest: Any, path: str, count: CountFile | None) -> dict[str, Any]:
  """The pod part `path` refers to by `digest`: read from its count file, its digest checked, parsed once."""
  if type(digest) is not str or not _SHA256.fullmatch(digest):
    raise errors.InvalidStateError(
        f"{path}: field {POD_SHA256!r} is {state_lib.short_repr(digest)}, not a SHA-256; the file is "
        "garbled: restore an earlier step.")
  count_path = os.path.join(os.path.dirname(path), COUNT_FILE)
  if count is None or count.pod_text is None:
    held = "is missing" if count is None else "holds no pod part (or not as ckpt_iter writes it)"
    raise errors.InvalidStateError(
        f"{path}: its fingerprint and lineage are in the pod part of {count_path} ({POD_SHA256!r}), "
        f"but that file {held}. The checkpoint is incomplete or was edited: restore an earlier step.")
  text_digest = hashlib.sha256(count.pod_text).hexdigest()
  if text_digest != count.pod_sha256:
    raise errors.InvalidStateError(
        f"{count.path}: its pod part (the fingerprint and lineage every process's header shares) does not "
        f"hash to its field {POD_SHA256!r} {count.pod_sha256[:16]}... ({text_digest[:16]}... now), so it is "
        f"not what the save wrote for {path}: the file was edited or is garbled. Restore an earlier step.")
  if digest != text_digest:
    raise errors.InvalidStateError(
        f"{path}: field {POD_SHA256!r} is {digest[:16]}..., but the pod part in {count.path} is "
        f"{text_digest[:16]}...: the two files come from different saves. Restore an earlier step.")
  pod = _CHECKED_PODS.get(text_digest)
  if pod is not None:
    return pod
  origin = f"{count.path} (pod part)"
  try:
    value = _DECODER.decode(count.pod_text.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise errors.InvalidStateError(
        f"{origin}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); restore an earlier step.") from None
  fingerprints = value.get("fingerprints") if type(value) is dict else None
  if not (type(fingerprints) is list and set(value) - {"lineage"} == {"fingerprints"}
          and 1 <= len(fingerprints) <= _MAX_NESTED_FINGERPRINTS and all(type(f) is dict for f in fingerprints)):
    raise errors.InvalidStateError(
        f"{origin}: must be {{'fingerprints': [{{...}}, ...], 'lineage': {{...}} (optional)}}, got "
        f"{state_lib.short_repr(value)}. Restore an earlier step.")
  # Checked here once per text (the fingerprints' flat fields are checked with each state, as ever).
  pod = {"fingerprints": fingerprints, "lineage": state_lib.checked_lineage(value.get("lineage"), origin)}
  if len(count.pod_text) <= _CHECKED_POD_MAX_BYTES:  # (a pod part is a few KB; a huge one is not kept)
    if len(_CHECKED_PODS) >= _CHECKED_PODS_KEPT:
      _CHECKED_PODS.clear()  # (one dict operation each: safe from any thread)
    _CHECKED_PODS[text_digest] = pod
  return pod


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid in a state file")


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):  # 1e400: JSON allows the digits, not the infinity
    raise ValueError(f"number {text[:40]} is out of the float range")
  return value


# One decoder for every read: json.loads with a keyword builds a new one each call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def read_state(
    directory: str | os.PathLike[str],
    process_index: int,
    process_count: int,
    *,
    load_arrays: bool = True,
    count_is_saved: bool = False,
    count_files: dict[str, CountFile | None] | None = None,
    agreed: list[str | None] | None = None,
) -> state_lib.IteratorState:
  """Reads and validates one process's state (header and arrays).

  With `load_arrays=False` only the header is read (the npz is not opened):
  each pending array is a read-only stand-in with the saved dtype and shape
  and no data (zero strides), for callers that need the state's structure
  and global fields but not that process's rows (`elastic.read_for_process`).

  `count_is_saved`: `process_count` is the one the item records
  (`saved_process_count`), so a missing file means an incomplete step, not
  a restore with another process count. `count_files`: see `read_header`.
  `agreed`, where given, receives the header's `AGREED_SHA256` (or None).

  Raises:
    ItemNotFoundError: the directory holds no state file at all.
    ProcessCountError, InvalidStateError, StateVersionError: see the message.
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  json_path = os.path.join(directory, stem + ".json")
  header = _read_process_header(directory, process_index, process_count, count_is_saved, count_files)
  agreed_sha256 = agreed_in(header, json_path)  # (a garbled one is refused by every reader)
  if agreed is not None:
    agreed.append(agreed_sha256)
  if not load_arrays or (isinstance(header, dict) and not header.get("arrays")):
    # No manifest, no array to load (a pending node naming one is refused by
    # decode_state first), so the npz is not looked for.
    return codec.decode_state(header, _stand_in, origin=json_path)
  shared_from = _shared_from(header, process_index, process_count, json_path)
  npz_stem = stem if shared_from is None else process_file_stem(shared_from, process_count)
  reader = _npz.ArrayReader(os.path.join(directory, npz_stem + ".npz"), header, origin=json_path,
                           check_directory=check_item_directory)
  value = codec.decode_state(header, reader.load, origin=json_path)
  if shared_from is None:
    reader.check_same_save()
  else:
    reader.check_content(header[_npz.ARRAYS_SHA256])
  return value


def read_saved_header(
    directory: str | os.PathLike[str], process_index: int, process_count: int,
    *, count_files: dict[str, CountFile | None] | None = None,
) -> tuple[dict[str, Any], str | None]:
  """A saved process's header, validated, without what binds it to its files; and its arrays' SHA-256.

  The digest is the one a multi-process save records (`_npz.ARRAYS_SHA256`, see
  `_pod_exchange.share_arrays`): "" when the state has no arrays, None when it was
  saved without the digest (one process, or an older ckpt_iter). Two
  processes hold the same state exactly when both are equal.
  `process_count` is the saved count. A header that refers to its pod part
  is given whole (`read_header`), so a process that wrote its header whole
  and one that referred to the pod part compare equal when their states are.
  """
  directory = os.fspath(directory)
  header = _read_process_header(directory, process_index, process_count, True, count_files)
  codec.decode_state(header, _stand_in, origin=header_path(directory, process_index, process_count))
  digest = header.get(_npz.ARRAYS_SHA256) if header.get("arrays") else ""
  fields = {k: v for k, v in header.items()
            if k not in (_npz.ARRAYS_DIGEST, ARRAYS_FROM, _npz.ARRAYS_SHA256, AGREED_SHA256)}
  return fields, digest if isinstance(digest, str) else None


def agreed_in(header: Any, origin: str) -> str | None:
  """A header's `AGREED_SHA256` (process 0's, where its save recorded one), or None; a garbled one refused."""
  digest = header.get(AGREED_SHA256) if isinstance(header, Mapping) else None
  if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
    raise errors.InvalidStateError(
        f"{origin}: field {AGREED_SHA256!r} is {state_lib.short_repr(digest)}, not a SHA-256; the file is "
        "garbled: restore an earlier step.")
  return digest


def _read_process_header(
    directory: str, process_index: int, process_count: int, count_is_saved: bool,
    count_files: dict[str, CountFile | None] | None = None,
) -> Any:
  try:
    return read_header(header_path(directory, process_index, process_count), count_files=count_files)
  except FileNotFoundError:
    if count_is_saved:
      raise incomplete_set_error(directory, process_index, process_count) from None
    raise _missing_process_file(directory, process_index, process_count) from None


def _shared_from(header: Mapping[str, Any], process_index: int, process_count: int, origin: str) -> int | None:
  """The process whose npz holds this header's arrays, when not its own."""
  source = header.get(ARRAYS_FROM) if isinstance(header, Mapping) else None  # decode_state refuses a non-dict
  if source is None:
    return None
  if not (state_lib.is_int(source) and 0 <= source < process_count and source != process_index):
    raise errors.InvalidStateError(
        f"{origin}: field {ARRAYS_FROM!r} is {state_lib.short_repr(source)}; it must name another "
        f"process of the {process_count}. The file is garbled: restore an earlier step."
    )
  digest = header.get(_npz.ARRAYS_SHA256)
  if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
    raise errors.InvalidStateError(
        f"{origin}: field {_npz.ARRAYS_SHA256!r} is {state_lib.short_repr(digest)}, not a SHA-256; "
        "the file is garbled: restore an earlier step."
    )
  return int(source)


def _stand_in(name: str, spec: codec.ArraySpec) -> np.ndarray:
  """An array of the spec's dtype and shape that holds no data (not read)."""
  del name
  return np.broadcast_to(np.zeros((), dtype=np.dtype(spec.dtype)), spec.shape)




def list_process_files(directory: str | os.PathLike[str]) -> list[tuple[int, int]]:
  """The (process_index, process_count) pairs of the state files in a directory.

  One listing. Raises FileNotFoundError when there is no such directory.
  """
  return _process_files_named(_storage.list_names(os.fspath(directory)))


def process_files_in(names: Sequence[str]) -> list[tuple[int, int]]:
  """The (process_index, process_count) pairs of the state files among a directory's `names`."""
  return _process_files_named(names)


def _process_files_named(names: Sequence[str]) -> list[tuple[int, int]]:
  listing = "\n".join(names)
  if listing.count("\n") == max(len(names) - 1, 0):
    # One regex pass over the whole listing: a pod's item directory holds 2N
    # names, and matching them one by one in Python dominated an elastic
    # restore at N = 1,024. (Names with a newline take the loop below.)
    found = [(int(i), int(n)) for i, n in _PROCESS_FILES_IN_LISTING.findall(listing)]
  else:
    found = []
    for name in names:
      match = _PROCESS_FILE.match(name)
      if match:
        found.append((int(match.group(1)), int(match.group(2))))
  return sorted(found)


def _missing_process_file(directory: str, process_index: int, process_count: int) -> errors.CkptIterError:
  """The error for a missing header, from one listing (an error path only)."""
  try:
    names = _storage.list_names(directory)
  except (FileNotFoundError, NotADirectoryError):
    names = []
  present = _process_files_named(names)
  if not names:
    return errors.ItemNotFoundError(
        f"{directory}: no data item here (no process_<i>-of-<n>.json, and the directory is empty "
        "or absent). Restore a step that has one, or check the item name."
    )
  counts = sorted({count for _, count in present})
  if counts and process_count not in counts:
    return errors.ProcessCountError(
        f"{directory}: written by {counts[0]} process(es) "
        f"({', '.join(process_file_stem(i, n) + '.json' for i, n in present)}), "
        f"but this run has {process_count}. Restore with {counts[0]} processes, or "
        "pass elastic=True to IteratorRestore (make_dataset pipelines only).",
        saved_count=counts[0], process_count=process_count,
    )
  return errors.InvalidStateError(
      f"{directory}: {process_file_stem(process_index, process_count)}.json is missing "
      f"(present: {[process_file_stem(i, n) for i, n in present] or 'none'}). "
      "The checkpoint is incomplete: restore an earlier step."
  )


def process_set_problems(
    directory: str, present: Sequence[tuple[int, int]]
) -> list[tuple[str, str]]:
  """What is wrong with a set of process files, as (path, message) pairs.

  A step is written by one set of processes: files of one count n, one for
  each index 0..n-1. Read from a listing alone, without touching a file.
  """
  if not present:
    return [(directory, "holds no process_<i>-of-<n>.json state file.")]
  problems = []
  counts = sorted({count for _, count in present})
  if len(counts) > 1:
    problems.append((
        directory,
        f"state files of different process counts ({', '.join(map(str, counts))}); "
        "a checkpoint is written by one set of processes.",
    ))
  for count in counts:
    indices = {index for index, n in present if n == count}
    for index in sorted(set(range(count)) - indices):
      problems.append((
          header_path(directory, index, count),
          f"missing: process {index} of {count} wrote no state; the step is incomplete.",
      ))
    for index in sorted(i for i in indices if i >= count):
      problems.append((
          header_path(directory, index, count),
          f"process index {index} is out of range for {count} processes.",
      ))
  return problems


def count_file_problems(
    directory: str, present: Sequence[tuple[int, int]], *, count_files: dict[str, CountFile | None] | None = None
) -> list[tuple[str, str]]:
  """What is wrong with `COUNT_FILE` next to a sound set of process files, as (path, message).

  For `ckpt-iter verify`: a garbled count file, or one that names another
  count than the files' (restores trust it to learn the count).
  """
  path = os.path.join(directory, COUNT_FILE)
  try:
    record = read_count_file(directory)
    if count_files is not None:
      count_files[directory] = record  # the headers read next refer to it
    recorded = None if record is None else record.process_count
  except errors.InvalidStateError as e:
    return [(path, str(e).removeprefix(f"{path}: "))]
  except OSError as e:
    return [(path, f"cannot read it ({e.strerror or e}).")]
  counts = {count for _, count in present}
  if recorded is None or not counts or counts == {recorded}:
    return []
  return [(path, f"says {recorded} processes, but the state files are the set of {min(counts)}. "
                 f"Delete {COUNT_FILE} to have the process files listed instead.")]


def incomplete_set_error(directory: str, process_index: int, process_count: int) -> errors.InvalidStateError:
  """The error for a file missing from a set whose count the item records.

  An error path only: it lists the directory once to say everything that is
  wrong with the set (`process_set_problems`), not just the one file.
  """
  path = header_path(directory, process_index, process_count)
  try:
    present = list_process_files(directory)
  except OSError:
    present = []
  problems = process_set_problems(directory, present)
  counts = {count for _, count in present}
  if not problems and counts != {process_count}:
    # A complete set of another count: the count file is stale or was edited.
    problems = [(os.path.join(directory, COUNT_FILE),
                 f"says {process_count} processes, but the state files are the set of {min(counts)}.")]
  shown = [f"{p}: {message}" for p, message in problems[:3]]
  if not any(p == path for p, _ in problems[:3]):
    shown.insert(0, f"{path}: missing: process {process_index} of {process_count} wrote no state.")
  if len(problems) > 3:
    shown.append(f"({len(problems) - 3} more problems)")
  return errors.InvalidStateError(
      " ".join(shown) + " The checkpoint is incomplete or was tampered with: restore an earlier "
      "step (`ckpt-iter verify` lists every problem)."
  )


def saved_process_count(
    directory: str | os.PathLike[str], *, count_files: dict[str, CountFile | None] | None = None
) -> int:
  """The number of processes that wrote the item in `directory`.

  From `COUNT_FILE` when the item has one (one small file: O(1) in the
  count); otherwise, for items written before it existed or without the
  handler, from one directory listing, which also checks that the set is
  complete. With `COUNT_FILE` the set is trusted to be complete, as Orbax
  commits a step only once every process wrote its files; a file a restore
  then needs and does not find is refused with `incomplete_set_error`.

  Raises:
    InvalidStateError: `COUNT_FILE` is unreadable or garbled, or (listing)
      the set is empty, mixed or incomplete (names the file).
  """
  directory = os.fspath(directory)
  record = read_count_file(directory)
  if count_files is not None:
    count_files[directory] = record  # the headers read next refer to it
  if record is not None:
    return record.process_count
  try:
    present = list_process_files(directory)
  except errors.StorageError:
    raise
  except OSError as e:
    raise errors.InvalidStateError(
        f"{directory}: cannot list the data state files ({e.strerror})."
    ) from None
  problems = process_set_problems(directory, present)
  if problems:
    path, message = problems[0]
    raise errors.InvalidStateError(
        f"{path}: {message} The checkpoint is incomplete or was tampered with: "
        "restore an earlier step."
    )
  return present[0][1]
