"""The files of one data item: `process_<i>-of-<n>.json` (+ `.npz`) per process.

Plus `ckpt_iter.json`, written by process 0 through the checkpoint handler:
`{"process_count": n}`, so an elastic restore learns the saved count from
one small file instead of listing the 2n names (items written before it
existed are listed, as before).

This module is the only one that names, lists, writes or reads them, through
`_storage` (a local directory or an object store). A file is written in one
piece, with no temporary and rename (object stores have none): the item is
published by the Orbax step commit it is written inside. Reads are hardened
against truncated, garbled or hostile files: each file is read whole in one
request, at most a bound known before the read (a header's limit; for an npz
the bytes its header's manifest allows), the npz's member count is checked
before its zip directory is parsed, arrays must be stored (not compressed)
plain .npy members whose dtype and shape match the header, and every error
names the file.

The npz is zipfile's and numpy's format, and they do most of the work: zipfile
writes it and parses its directory, numpy writes and parses .npy headers. Two
pieces are this module's own, for figures measured on the files of
docs/benchmarks.md section 14 (fresh processes, same run): members padded so
that each array starts at a 64-byte offset, and a reader that slices the
arrays out of its one buffer of the file (CRC-32 checked) instead of reading
each member into a copy through zipfile and numpy. 100,000 pending items
restore in 0.13 s with 51 MiB of extra memory (through zipfile and numpy: 0.22 s,
66 MiB); 10,000 items of 2,048 tokens take 1.04x their bytes of extra memory
(3.0x); the same 100,000 items as formats 1-2 stored them, 4.5 s (15.5 s). And
the zip end record is read by hand, to count members before zipfile parses a
directory of any size.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import re
import struct
import time
import zipfile
import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_HEADER_BYTES = 64 * 2**20
COUNT_FILE = "ckpt_iter.json"
# Header field binding a header to its npz: a digest of the npz's zip
# directory, which holds every member's name, size and CRC-32 (zipfile checks
# each member's CRC as it reads it). Headers written before it have none.
ARRAYS_DIGEST = "arrays_digest"
# Header fields of a process that shares another's arrays (`share_arrays`):
# the process whose npz holds them, and the SHA-256 of the arrays
# (`arrays_sha256`), which the reader checks what it loads against.
ARRAYS_FROM = "arrays_from"
ARRAYS_SHA256 = "arrays_sha256"
# Header field: the Orbax step the state was saved in (when its directory
# names one), which `ckpt-iter audit` compares with the step holding it.
# Not part of the state: readers that predate it ignore it.
SAVED_STEP = "saved_step"
# Far above any pod; a larger value is a garbled file, not a job.
MAX_PROCESS_COUNT = 2**24
# What an npz may hold beyond its arrays' data: per member, the .npy header
# (numpy pads it to at most 4096 bytes) and the zip local and central entries
# with their zip64 extras; per archive, the end records.
_NPY_HEADER_BYTES = 4096
_ZIP_MEMBER_BYTES = 384  # a member's local and central entries, zip64 fields and alignment padding
_ZIP_ARCHIVE_BYTES = 1024
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
) -> None:
  """Writes one process's files: one object each (header, npz, count file).

  The npz is streamed from the arrays themselves (no second copy of them in
  memory). A header that shares another process's arrays (`ARRAYS_FROM`,
  see `_item.share_arrays`) comes with no arrays, and no npz is written.
  With `count_file` (the checkpoint handler), process 0 also writes
  `COUNT_FILE`, the saved process count an elastic restore reads.

  Raises:
    OSError: naming the file that could not be written (nothing partial of
      it is left behind).
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  if arrays:
    tail = _TailKeeper(_directory_bytes_bound(arrays))

    def produce(f: Any) -> None:
      tail.target = f
      _write_npz(tail, arrays)

    _storage.write_stream(os.path.join(directory, stem + ".npz"), produce)
    header = {**header, ARRAYS_DIGEST: tail.directory_digest()}
  # Compact: a state is read by programs (`ckpt-iter inspect` shows it to people).
  text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
  _storage.write_bytes(os.path.join(directory, stem + ".json"), text)
  if count_file and process_index == 0:
    count = json.dumps({"process_count": process_count}).encode()
    _storage.write_bytes(os.path.join(directory, COUNT_FILE), count)


def _write_npz(out: Any, arrays: Mapping[str, np.ndarray]) -> None:
  """Writes `arrays` as np.savez would (stored .npy members), from their own buffers.

  np.savez copies each array in 16 MiB pieces and wants a seekable file;
  here each array's memory goes to the zip writer as it is, and the zip is
  written front to back (sizes in data descriptors), so it can be streamed.
  """
  with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
    for name, array in arrays.items():
      header = np.lib.format.header_data_from_array_1_0(array)
      data = array.T if header["fortran_order"] else np.ascontiguousarray(array)
      npy_header = io.BytesIO()
      try:
        np.lib.format.write_array_header_1_0(npy_header, header)
      except ValueError:  # a header over 64 KiB: numpy's next version
        np.lib.format.write_array_header_2_0(npy_header, header)
      info = zipfile.ZipInfo(name + ".npy", date_time=time.localtime(time.time())[:6])  # as zipfile dates it
      info.extra = _padding_extra(out.tell(), len(info.filename.encode()), len(npy_header.getvalue()))
      with archive.open(info, mode="w", force_zip64=True) as member:
        member.write(npy_header.getvalue())
        member.write(_bytes_of(data))


# The array bytes of each member start at a multiple of _ALIGN in the file, so
# the reader's arrays are views of its one buffer of the file (`_npy_array`;
# the figures that call for it are in the module docstring): a zip extra field
# of this id pads the local header, as Android's zipalign does (readers skip
# unknown ids).
_ALIGN = 64
_PADDING_EXTRA_ID = 0xD935
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local header, up to its name and extra-field lengths
_LOCAL_ZIP64_EXTRA_BYTES = 20  # force_zip64: sizes in an extra field of the local header


def _padding_extra(offset: int, name_bytes: int, npy_header_bytes: int) -> bytes:
  """The extra field that puts a member's array bytes, written at `offset`, at a multiple of _ALIGN."""
  start = offset + _LOCAL_HEADER.size + name_bytes + _LOCAL_ZIP64_EXTRA_BYTES + npy_header_bytes
  pad = -start % _ALIGN
  if pad == 0:
    return b""
  if pad < 4:  # an extra field is at least its 4-byte id and length
    pad += _ALIGN
  return struct.pack("<HH", _PADDING_EXTRA_ID, pad - 4) + bytes(pad - 4)


def _directory_bytes_bound(arrays: Mapping[str, np.ndarray]) -> int:
  """The most bytes an npz's zip directory and end records take (what `_TailKeeper` keeps)."""
  return _ZIP_ARCHIVE_BYTES + sum(_ZIP_MEMBER_BYTES + 2 * len(name) for name in arrays)


class _TailKeeper:
  """A write-only, front-to-back file that forwards to `target` and keeps the last bytes.

  Not seekable, so zipfile writes each member once, in order; the kept tail
  holds the zip directory, whose digest binds the header to the npz.
  """

  def __init__(self, keep: int):
    self.target: Any = None
    self._keep = keep
    self._tail = bytearray()
    self._written = 0

  def write(self, data: Any) -> int:
    view = memoryview(data).cast("B")
    self.target.write(view)
    self._written += len(view)
    self._tail += view[-self._keep:]
    del self._tail[:-self._keep]
    return len(view)

  def tell(self) -> int:
    return self._written

  def flush(self) -> None:
    self.target.flush()

  def directory_digest(self) -> str:
    """`_directory_digest` of the whole file written, from its kept tail."""
    skipped = self._written - len(self._tail)
    end = _end_record(self._tail, base=skipped)
    if end is None:
      return "none"
    _, size, offset = end
    return hashlib.sha256(memoryview(self._tail)[offset - skipped:offset - skipped + size]).hexdigest()[:32]


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
  """SHA-256 of named arrays: each one's name, dtype, shape and bytes, in name order."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    array = np.ascontiguousarray(arrays[name])
    digest.update(f"{name}:{array.dtype.str}:{list(array.shape)};".encode())
    digest.update(_bytes_of(array))
  return digest.hexdigest()


def _bytes_of(array: np.ndarray) -> memoryview:
  """The memory of a C-contiguous array, as bytes, without a copy (any dtype numpy can view)."""
  return memoryview(array.reshape(-1).view(np.uint8))


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


def read_header(path: str) -> dict[str, Any]:
  """Reads and parses a state header file, with errors that name the file.

  Raises:
    FileNotFoundError: there is no such file (the caller says what that means).
    InvalidStateError: anything else, and a directory outside its root (`check_item_directory`).
  """
  check_item_directory(os.path.dirname(path))
  try:
    data = _storage.read_bytes(path, max_bytes=MAX_HEADER_BYTES)
  except (FileNotFoundError, errors.StorageError):
    raise  # a missing file or the store's own error: the caller / the message says it
  except _storage.TooLargeError as e:
    raise errors.InvalidStateError(
        f"{path}: state header is {e.shown_size} bytes, over the {MAX_HEADER_BYTES} limit; the "
        "file is corrupt or not a ckpt_iter state."
    ) from None
  except OSError as e:
    raise errors.InvalidStateError(f"{path}: cannot read the state file ({e.strerror or e}).") from None
  try:
    return _DECODER.decode(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    # RecursionError: JSON nested deeper than the parser's recursion limit.
    raise errors.InvalidStateError(
        f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
        "is truncated or garbled. Restore an earlier step."
    ) from None


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
) -> state_lib.IteratorState:
  """Reads and validates one process's state (header and arrays).

  With `load_arrays=False` only the header is read (the npz is not opened):
  each pending array is a read-only stand-in with the saved dtype and shape
  and no data (zero strides), for callers that need the state's structure
  and global fields but not that process's rows (`elastic.read_for_process`).

  `count_is_saved`: `process_count` is the one the item records
  (`saved_process_count`), so a missing file means an incomplete step, not
  a restore with another process count.

  Raises:
    ItemNotFoundError: the directory holds no state file at all.
    ProcessCountError, InvalidStateError, StateVersionError: see the message.
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  json_path = os.path.join(directory, stem + ".json")
  header = _read_process_header(directory, process_index, process_count, count_is_saved)
  if not load_arrays or (isinstance(header, dict) and not header.get("arrays")):
    # No manifest, no array to load (a pending node naming one is refused by
    # decode_state first), so the npz is not looked for.
    return codec.decode_state(header, _stand_in, origin=json_path)
  shared_from = _shared_from(header, process_index, process_count, json_path)
  npz_stem = stem if shared_from is None else process_file_stem(shared_from, process_count)
  reader = _ArrayReader(os.path.join(directory, npz_stem + ".npz"), header, origin=json_path)
  value = codec.decode_state(header, reader.load, origin=json_path)
  if shared_from is None:
    reader.check_same_save()
  else:
    reader.check_content(header[ARRAYS_SHA256])
  return value


def read_saved_header(
    directory: str | os.PathLike[str], process_index: int, process_count: int
) -> tuple[dict[str, Any], str | None]:
  """A saved process's header, validated, without what binds it to its files; and its arrays' SHA-256.

  The digest is the one a multi-process save records (`ARRAYS_SHA256`, see
  `_item.share_arrays`): "" when the state has no arrays, None when it was
  saved without the digest (one process, or an older ckpt_iter). Two
  processes hold the same state exactly when both are equal.
  `process_count` is the saved count.
  """
  directory = os.fspath(directory)
  header = _read_process_header(directory, process_index, process_count, True)
  codec.decode_state(header, _stand_in, origin=header_path(directory, process_index, process_count))
  digest = header.get(ARRAYS_SHA256) if header.get("arrays") else ""
  fields = {k: v for k, v in header.items() if k not in (ARRAYS_DIGEST, ARRAYS_FROM, ARRAYS_SHA256)}
  return fields, digest if isinstance(digest, str) else None


def _read_process_header(directory: str, process_index: int, process_count: int, count_is_saved: bool) -> Any:
  try:
    return read_header(header_path(directory, process_index, process_count))
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
  digest = header.get(ARRAYS_SHA256)
  if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
    raise errors.InvalidStateError(
        f"{origin}: field {ARRAYS_SHA256!r} is {state_lib.short_repr(digest)}, not a SHA-256; "
        "the file is garbled: restore an earlier step."
    )
  return int(source)


def _stand_in(name: str, spec: codec.ArraySpec) -> np.ndarray:
  """An array of the spec's dtype and shape that holds no data (not read)."""
  del name
  return np.broadcast_to(np.zeros((), dtype=np.dtype(spec.dtype)), spec.shape)


def npz_size_bound(specs: Mapping[str, codec.ArraySpec]) -> int:
  """The most bytes an npz of these arrays takes, as np.savez writes it."""
  return _ZIP_ARCHIVE_BYTES + sum(
      spec.nbytes + _NPY_HEADER_BYTES + _ZIP_MEMBER_BYTES + 2 * len(name) for name, spec in specs.items()
  )


class _ArrayReader:
  """Loads named arrays from an npz read whole, checking its size and members first.

  The npz is read at the first `load`, once decode_state has validated the
  header whose manifest bounds it; zipfile parses its directory, and each
  array is then sliced from the file's bytes (`_member_bytes`, `_npy_array`).
  """

  def __init__(self, path: str, header: Mapping[str, Any], *, origin: str):
    self._path = path
    self._header = header
    self._origin = origin
    self._data = bytearray()
    self._members: dict[str, zipfile.ZipInfo] | None = None
    self._digest: str | None = None
    self._loaded: dict[str, np.ndarray] = {}

  def check_same_save(self) -> None:
    """Raises unless the npz read is the one its header was written with.

    After every array was read and checked, so that a damaged member is
    reported as such; what is left is a sound npz of another save (a torn
    pair: a partial copy, two writers), which only this binding tells apart.
    """
    expected = self._header.get(ARRAYS_DIGEST)
    if self._digest is None or expected is None or self._digest == expected:
      return
    raise errors.InvalidStateError(
        f"{self._path}: belongs to another save than its header {os.path.basename(self._origin)} "
        f"({ARRAYS_DIGEST} {state_lib.short_repr(expected, 40)} there, {self._digest} here): a "
        "partial copy or two writers mixed the step's files. Restore an earlier step."
    )

  def check_content(self, expected: str) -> None:
    """Raises unless the arrays loaded are the ones `expected` (their SHA-256) names.

    For a header that shares another process's npz: that npz's own header
    binds it by its zip directory, this one by content.
    """
    if self._loaded and arrays_sha256(self._loaded) == expected:
      return
    raise errors.InvalidStateError(
        f"{self._origin}: shares the arrays of {self._path}, but they are not the ones it was "
        f"saved with ({ARRAYS_SHA256} {expected[:16]}...): a partial copy or two writers mixed "
        "the step's files. Restore an earlier step."
    )

  def load(self, name: str, spec: codec.ArraySpec) -> np.ndarray:
    if self._members is None:
      self._members = self._open(name)
    try:
      info = self._members[name + ".npy"]
    except KeyError:
      raise errors.InvalidStateError(
          f"{self._path}: has no array {name!r} (the state header lists it)."
      ) from None
    array = _npy_array(self._path, name, self._member_bytes(name, info, spec), spec)
    self._loaded[name] = array
    return array

  def _open(self, name: str) -> dict[str, zipfile.ZipInfo]:
    """Reads the npz whole, checks its end record, and returns its members by name."""
    path = self._path
    specs = codec.array_specs(self._header, origin=self._origin)
    bound = npz_size_bound(specs)
    unreadable = (f"the state refers to array {name!r}. The file is truncated or garbled: restore an "
                  "earlier step.")
    check_item_directory(os.path.dirname(path))  # again: the link may have been put there since the header
    try:
      # Writable: arrays are then views of it, not copies (`_npy_array`).
      self._data = _storage.read_bytes(path, max_bytes=bound, writable=True)
    except errors.StorageError:
      raise  # the store's error (permission, stall...), not a damaged file
    except FileNotFoundError:
      raise errors.InvalidStateError(
          f"{path}: missing; the state refers to array {name!r}. "
          "The checkpoint is incomplete: restore an earlier step."
      ) from None
    except _storage.TooLargeError as e:
      raise errors.InvalidStateError(
          f"{path}: {e.shown_size} bytes, more than the {bound:,} its header's {len(specs)} "
          "array(s) allow; the file is garbled or padded. Restore an earlier step."
      ) from None
    except OSError as e:
      raise errors.InvalidStateError(f"{path}: not a readable npz ({e.strerror or e}); {unreadable}") from None
    end = _end_record(self._data)
    if end is None or end[0] > len(specs):
      # Checked before zipfile parses the directory, which it cannot be asked
      # to skip: a 60 MiB npz within a 64 MiB array's bound, padded with
      # 700,000 empty members, costs zipfile 4.6 s and 415 MiB (measured);
      # its end record, 20 us.
      shown = "no zip end record" if end is None else f"{end[0]} members, its header lists {len(specs)}"
      raise errors.InvalidStateError(f"{path}: not a readable npz ({shown}); {unreadable}")
    self._digest = _directory_digest(self._data, end)
    try:
      with zipfile.ZipFile(_BufferFile(self._data)) as archive:
        return {info.filename: info for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as e:
      raise errors.InvalidStateError(f"{path}: not a readable npz ({e}); {unreadable}") from None

  def _member_bytes(self, name: str, info: zipfile.ZipInfo, spec: codec.ArraySpec) -> memoryview:
    """A member's .npy bytes, a view of the file's: checked against the spec and the file, and by CRC-32."""
    size = len(self._data)
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} is compressed or its sizes disagree; "
          "ckpt_iter writes stored members only."
      )
    if info.header_offset + info.compress_size > size:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} claims {info.compress_size} bytes at offset "
          f"{info.header_offset}, but the file holds only {size}; the "
          "file is truncated or garbled."
      )
    if info.file_size > spec.nbytes + _NPY_HEADER_BYTES:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} takes {info.file_size} bytes, more than "
          f"its {spec.nbytes}-byte spec allows."
      )
    start = info.header_offset  # negative when the directory's offsets overshoot the file (zipfile allows it)
    local = _LOCAL_HEADER.unpack_from(self._data, start) if 0 <= start <= size - _LOCAL_HEADER.size else None
    if info.flag_bits & 0x1:
      problem = "it is flagged encrypted; ckpt_iter writes plain members"
    elif local is None or local[0] != b"PK\x03\x04":
      problem = f"no zip local header at offset {start}"
    else:
      _, name_length, extra_length = local
      begin = start + _LOCAL_HEADER.size + name_length + extra_length
      member = memoryview(self._data)[begin:begin + info.compress_size]
      if len(member) != info.compress_size:
        problem = "it runs past the end of the file"
      elif zlib.crc32(member) != info.CRC:
        problem = f"bad CRC-32 for {info.filename!r}"
      else:
        return member
    raise errors.InvalidStateError(f"{self._path}: array {name!r} is unreadable ({problem}).")


def _npy_array(path: str, name: str, member: memoryview, spec: codec.ArraySpec) -> np.ndarray:
  """The array of an .npy member, checked against its spec: a view of the member's bytes when aligned.

  The common case costs a comparison with the header numpy writes for the
  spec; any other header (Fortran order, another writer) is parsed by numpy.
  """
  expected = _npy_header(spec.dtype, spec.shape)
  if member[:len(expected)] == expected:
    data_start, fortran = len(expected), False
  else:
    data_start, fortran = _parsed_npy_header(path, name, member, spec)
  if len(member) - data_start != spec.nbytes:
    raise errors.InvalidStateError(
        f"{path}: array {name!r} holds {len(member) - data_start} data bytes, expected {spec.nbytes}; "
        "the file is truncated."
    )
  array = np.frombuffer(member[data_start:], dtype=np.dtype(spec.dtype)).reshape(
      spec.shape, order="F" if fortran else "C")
  # In place when the file put it at an aligned offset, as `_write_npz` does:
  # no second copy of a restored queue (see the module docstring).
  return array if array.flags.aligned else array.copy()


def _parsed_npy_header(path: str, name: str, member: memoryview, spec: codec.ArraySpec) -> tuple[int, bool]:
  """(where the data starts, Fortran order) of an .npy header numpy parses; raises unless it is the spec's."""
  f = io.BytesIO(member[:_NPY_HEADER_LIMIT])
  try:
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:
      raise errors.InvalidStateError(f"{path}: array {name!r} has npy format {version}; expected 1.0 or 2.0.")
    shape, fortran, dtype = read_header[version](f)
  except errors.InvalidStateError:
    raise  # already says what is wrong (it is a ValueError: not re-wrapped)
  except (ValueError, EOFError, SyntaxError) as e:
    raise errors.InvalidStateError(f"{path}: array {name!r} is unreadable ({e}).") from None
  if dtype.hasobject:
    raise errors.InvalidStateError(f"{path}: array {name!r} has an object dtype.")
  if np.dtype(dtype).str != spec.dtype or tuple(shape) != spec.shape:
    raise errors.InvalidStateError(
        f"{path}: array {name!r} is {np.dtype(dtype).str}{list(shape)}, "
        f"but the state header says {spec.dtype}{list(spec.shape)}."
    )
  return f.tell(), fortran


# The most of a member numpy's header parser is given: a version 1.0 header
# (its length a 2-byte field) and then some; numpy refuses longer ones.
_NPY_HEADER_LIMIT = 2**16 + 16


@functools.lru_cache(maxsize=256)
def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
  """The .npy header numpy writes (version 1.0) for a C-order array of `dtype` and `shape`."""
  buffer = io.BytesIO()
  np.lib.format.write_array_header_1_0(buffer, {
      "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
  return buffer.getvalue()


class _BufferFile(io.RawIOBase):
  """A read-only file over a buffer, for zipfile to parse the npz's directory from.

  io.BytesIO would copy the bytearray, a second copy of the whole file: 10,000
  items of 2,048 tokens would take 2.04x their bytes of extra memory, not 1.04x.
  """

  def __init__(self, data: bytearray):
    super().__init__()
    self._data = data
    self._position = 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}[whence]
    if base + offset < 0:
      raise ValueError("negative seek position")
    self._position = base + offset
    return self._position

  def readinto(self, buffer: Any) -> int:
    data = memoryview(self._data)[self._position:self._position + len(buffer)]
    buffer[:len(data)] = data
    self._position += len(data)
    return len(data)

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


def _end_record(data: bytes | bytearray | memoryview, base: int = 0) -> tuple[int, int, int] | None:
  """(member count, directory size, directory offset) from a zip's end records.

  Read before zipfile parses anything. np.savez writes no archive comment,
  so the end record is the last 22 bytes; None when it is not there
  (truncated, or not a zip) or points outside the file. `data` may be the
  file's tail from offset `base` on (offsets stay the whole file's); then
  the directory must lie in it.
  """
  size_of_file = base + len(data)
  if len(data) < _EOCD.size:
    return None
  signature, _, _, _, total, size, offset, comment = _EOCD.unpack_from(data, len(data) - _EOCD.size)
  if signature != b"PK\x05\x06" or comment:
    return None
  if 0xFFFF in (total,) or 0xFFFFFFFF in (size, offset):
    locator_at = len(data) - _EOCD.size - _ZIP64_LOCATOR.size
    if locator_at < 0:
      return None
    signature, _, record_at, _ = _ZIP64_LOCATOR.unpack_from(data, locator_at)
    record_at -= base
    if signature != b"PK\x06\x07" or record_at < 0 or record_at + _ZIP64_EOCD.size > locator_at:
      return None
    fields = _ZIP64_EOCD.unpack_from(data, record_at)
    if fields[0] != b"PK\x06\x06":
      return None
    total, size, offset = fields[7], fields[8], fields[9]
  if offset < base or offset + size > size_of_file:
    return None
  return total, size, offset


def _directory_digest(data: bytes | memoryview, end: tuple[int, int, int] | None = None) -> str:
  """sha256 (32 hex digits) of an npz's zip directory: names, sizes and CRC-32s of every member."""
  end = _end_record(data) if end is None else end
  if end is None:
    return "none"
  _, size, offset = end
  return hashlib.sha256(memoryview(data)[offset:offset + size]).hexdigest()[:32]


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
    directory: str, present: Sequence[tuple[int, int]]
) -> list[tuple[str, str]]:
  """What is wrong with `COUNT_FILE` next to a sound set of process files, as (path, message).

  For `ckpt-iter verify`: a garbled count file, or one that names another
  count than the files' (restores trust it to learn the count).
  """
  path = os.path.join(directory, COUNT_FILE)
  try:
    recorded = _read_count_file(directory)
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


def require_headers(directory: str, process_count: int, indices: Sequence[int]) -> None:
  """Raises `incomplete_set_error` unless these processes' headers exist (one stat each)."""
  for index in indices:
    try:
      exists = _storage.is_file(header_path(directory, index, process_count))
    except OSError:
      continue  # exists but unreadable: refused by whichever process reads it
    if not exists:
      raise incomplete_set_error(directory, index, process_count)


def saved_process_count(directory: str | os.PathLike[str]) -> int:
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
  count = _read_count_file(directory)
  if count is not None:
    return count
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


def _read_count_file(directory: str) -> int | None:
  """The process count `COUNT_FILE` records, or None if the item has none."""
  path = os.path.join(directory, COUNT_FILE)
  try:
    value = read_header(path)
  except FileNotFoundError:
    return None
  count = value.get("process_count") if isinstance(value, dict) else None
  if not state_lib.is_int(count) or not 1 <= count <= MAX_PROCESS_COUNT:
    shown = state_lib.short_repr(count if isinstance(value, dict) else value)
    raise errors.InvalidStateError(
        f"{path}: field 'process_count' is {shown}, expected the number of processes that "
        "wrote this step (an integer >= 1). The file is garbled: restore an earlier step, or "
        f"delete {COUNT_FILE} to have the process files listed instead."
    )
  return int(count)
