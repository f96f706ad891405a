"""The files of one data item: `process_<i>-of-<n>.json` (+ `.npz`) per process.

Plus `ckpt_iter.json`, written by process 0 through the checkpoint handler:
`{"process_count": n}`, so an elastic restore learns the saved count from
one small file instead of listing the 2n names (items written before it
existed are listed, as before).

This module is the only one that names, lists, writes or reads them. Writes
are atomic (a file appears whole or not at all); reads are hardened against
truncated, garbled or hostile files: sizes are checked before anything is
allocated, arrays must be stored (not compressed) plain .npy members whose
dtype and shape match the header, and every error names the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import zipfile
from typing import Any, Mapping, Sequence

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_HEADER_BYTES = 64 * 2**20
COUNT_FILE = "ckpt_iter.json"
# Far above any pod; a larger value is a garbled file, not a job.
MAX_PROCESS_COUNT = 2**24
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
  """Writes one process's files; each appears whole or not at all.

  With `count_file` (the checkpoint handler), process 0 also writes
  `COUNT_FILE`, the saved process count an elastic restore reads.
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  if arrays:
    _atomic_write(os.path.join(directory, stem + ".npz"), lambda f: np.savez(f, **arrays))
  # Compact: a state is read by programs (`ckpt-iter inspect` shows it to people).
  text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
  _atomic_write(os.path.join(directory, stem + ".json"), lambda f: f.write(text))
  if count_file and process_index == 0:
    count = json.dumps({"process_count": process_count}).encode()
    _atomic_write(os.path.join(directory, COUNT_FILE), lambda f: f.write(count))


def _atomic_write(path: str, write: Any) -> None:
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def read_header(path: str) -> dict[str, Any]:
  """Reads and parses a state header file, with errors that name the file.

  Raises:
    FileNotFoundError: there is no such file (the caller says what that means).
    InvalidStateError: anything else.
  """
  try:
    data = _read_small_file(path)
  except FileNotFoundError:
    raise
  except OSError as e:
    raise errors.InvalidStateError(f"{path}: cannot read the state file ({e.strerror}).") from None
  try:
    return _DECODER.decode(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    # RecursionError: JSON nested deeper than the parser's recursion limit.
    raise errors.InvalidStateError(
        f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
        "is truncated or garbled. Restore an earlier step."
    ) from None


def _read_small_file(path: str) -> bytes:
  """The bytes of a regular file of at most MAX_HEADER_BYTES.

  One open and an fstat of the open file, no stat of the path first: the
  regular-file check holds for the very file that is read.
  """
  f, size = _open_regular(path)
  with f:
    if size > MAX_HEADER_BYTES:
      raise errors.InvalidStateError(
          f"{path}: state header is {size} bytes, over the {MAX_HEADER_BYTES} limit; "
          "the file is corrupt or not a ckpt_iter state."
      )
    # Bounded by the measured size (read(n) allocates n bytes up front); a
    # raw read may return less than asked (FUSE, NFS), so read to the end.
    chunks, left = [], size + 1
    while left > 0:
      chunk = f.read(left)
      if not chunk:
        break
      chunks.append(chunk)
      left -= len(chunk)
  data = b"".join(chunks)
  if len(data) > size:
    raise errors.InvalidStateError(
        f"{path}: not valid JSON (ValueError: the file grew past its {size} bytes while being "
        "read); the file is truncated or garbled. Restore an earlier step."
    )
  return data


def _open_regular(path: str, buffering: int = 0) -> tuple[Any, int]:
  """`path` open for reading, and its size; OSError unless it is a regular file.

  A FIFO would block the reader forever and a device (/dev/zero) never ends,
  so a state file (or a symlink in its place) must be a regular file. The
  open is non-blocking, so a FIFO is refused at the fstat instead of hanging
  in open(); for a regular file O_NONBLOCK changes nothing. Unbuffered by
  default: a header is read whole, and a buffer would only add a copy (and an
  isatty probe).
  """
  f = open(path, "rb", buffering=buffering, opener=_nonblocking)  # pylint: disable=consider-using-with
  try:
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
      raise OSError(errno.EINVAL, "not a regular file", path)
  except BaseException:
    f.close()
    raise
  return f, info.st_size


def _nonblocking(path: str, flags: int) -> int:
  return os.open(path, flags | os.O_NONBLOCK)


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid in a state file")


# One decoder for every read: json.loads with a keyword builds a new one each call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


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
  """
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  json_path = os.path.join(directory, stem + ".json")
  try:
    header = read_header(json_path)
  except FileNotFoundError:
    if count_is_saved:
      raise incomplete_set_error(directory, process_index, process_count) from None
    raise _missing_process_file(directory, process_index, process_count) from None
  if not load_arrays or (isinstance(header, dict) and not header.get("arrays")):
    # No manifest, no array to load (a pending node naming one is refused by
    # decode_state first), so the npz is not looked for.
    return codec.decode_state(header, _stand_in, origin=json_path)
  npz_path = os.path.join(directory, stem + ".npz")
  with _ArrayReader(npz_path) as reader:
    return codec.decode_state(header, reader.load, origin=json_path)


def _stand_in(name: str, spec: codec.ArraySpec) -> np.ndarray:
  """An array of the spec's dtype and shape that holds no data (not read)."""
  del name
  return np.broadcast_to(np.zeros((), dtype=np.dtype(spec.dtype)), spec.shape)


class _ArrayReader:
  """Loads named arrays from an npz, checking dtype, shape and stored size first."""

  def __init__(self, path: str):
    self._path = path
    self._zip: zipfile.ZipFile | None = None
    self._file: _ClampedFile | None = None

  def __enter__(self) -> "_ArrayReader":
    return self

  def __exit__(self, *exc_info) -> None:
    if self._zip is not None:
      self._zip.close()
    if self._file is not None:
      self._file.close()

  def load(self, name: str, spec: codec.ArraySpec) -> np.ndarray:
    if self._zip is None:
      try:
        self._file = _ClampedFile(self._path)
      except FileNotFoundError:
        raise errors.InvalidStateError(
            f"{self._path}: missing; the state refers to array {name!r}. "
            "The checkpoint is incomplete: restore an earlier step."
        ) from None
      except OSError as e:
        raise errors.InvalidStateError(
            f"{self._path}: not a readable npz ({e}); the state refers to array "
            f"{name!r}. The file is truncated or garbled: restore an earlier step."
        ) from None
      try:
        self._zip = zipfile.ZipFile(self._file)
      except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as e:
        raise errors.InvalidStateError(
            f"{self._path}: not a readable npz ({e}); the state refers to array "
            f"{name!r}. The file is truncated or garbled: restore an earlier step."
        ) from None
    member = name + ".npy"
    try:
      info = self._zip.getinfo(member)
    except KeyError:
      raise errors.InvalidStateError(
          f"{self._path}: has no array {name!r} (the state header lists it)."
      ) from None
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} is compressed or its sizes disagree; "
          "ckpt_iter writes stored members only."
      )
    if info.header_offset + info.compress_size > self._file.size:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} claims {info.compress_size} bytes at offset "
          f"{info.header_offset}, but the file holds only {self._file.size}; the "
          "file is truncated or garbled."
      )
    if info.file_size > spec.nbytes + 4096:
      raise errors.InvalidStateError(
          f"{self._path}: array {name!r} takes {info.file_size} bytes, more than "
          f"its {spec.nbytes}-byte spec allows."
      )
    try:
      with self._zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
          shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
          shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
          raise errors.InvalidStateError(
              f"{self._path}: array {name!r} has npy format {version}; expected 1.0 or 2.0."
          )
        header_end = f.tell()
        if dtype.hasobject:
          raise errors.InvalidStateError(f"{self._path}: array {name!r} has an object dtype.")
        if np.dtype(dtype).str != spec.dtype or tuple(shape) != spec.shape:
          raise errors.InvalidStateError(
              f"{self._path}: array {name!r} is {np.dtype(dtype).str}{list(shape)}, "
              f"but the state header says {spec.dtype}{list(spec.shape)}."
          )
        if info.file_size - header_end != spec.nbytes:
          raise errors.InvalidStateError(
              f"{self._path}: array {name!r} holds {info.file_size - header_end} "
              f"data bytes, expected {spec.nbytes}; the file is truncated."
          )
        data = f.read(spec.nbytes)
    except errors.InvalidStateError:
      raise  # already says what is wrong (it is a ValueError: not re-wrapped)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as e:
      # RuntimeError: zipfile refuses members flagged as encrypted.
      raise errors.InvalidStateError(f"{self._path}: array {name!r} is unreadable ({e}).") from None
    if len(data) != spec.nbytes:
      raise errors.InvalidStateError(f"{self._path}: array {name!r} is truncated.")
    array = np.frombuffer(data, dtype=np.dtype(spec.dtype)).reshape(
        spec.shape, order="F" if fortran else "C"
    )
    return array.copy()


class _ClampedFile:
  """A read-only regular file whose reads never ask for more than it holds.

  A garbled zip can claim a central directory or a member of gigabytes, and
  zipfile then calls read(n) with that n, which allocates n bytes up front.
  Clamping n to what is left in the file bounds memory by the file's size.
  """

  def __init__(self, path: str):
    # Buffered: zipfile reads the directory and member headers in small pieces.
    self._f, self.size = _open_regular(path, buffering=-1)

  def read(self, n: int | None = -1) -> bytes:
    left = max(0, self.size - self._f.tell())
    return self._f.read(left if n is None or n < 0 else min(n, left))

  def seek(self, offset: int, whence: int = 0) -> int:
    return self._f.seek(offset, whence)

  def tell(self) -> int:
    return self._f.tell()

  def seekable(self) -> bool:
    return True

  def close(self) -> None:
    self._f.close()


def list_process_files(directory: str | os.PathLike[str]) -> list[tuple[int, int]]:
  """The (process_index, process_count) pairs of the state files in a directory."""
  names = os.listdir(os.fspath(directory))
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
  present = list_process_files(directory) if os.path.isdir(directory) else []
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
      os.stat(header_path(directory, index, process_count))
    except FileNotFoundError:
      raise incomplete_set_error(directory, index, process_count) from None
    except OSError:
      pass  # exists but unreadable: refused by whichever process reads it


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
