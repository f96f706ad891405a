"""The Orbax checkpoint item for ckpt_iter iterators.

    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator)))
    mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params),
        data=ckpt_iter.IteratorRestore(iterator)))

Each process writes `process_<i>-of-<n>.json` (the state header) and, when it
has pending arrays, `process_<i>-of-<n>.npz` (plain .npy members, never
pickled). The state is snapshotted synchronously in `save`; the files are
written in Orbax's background thread; Orbax makes the step visible only once
every item of every process is written, so a step that did not finish is
never restored.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
import zipfile
from typing import Any, Collection, Mapping

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_HEADER_BYTES = 64 * 2**20
_PROCESS_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")


def process_file_stem(process_index: int, process_count: int) -> str:
  return f"process_{process_index}-of-{process_count}"


# ---------------------------------------------------------------------------
# Writing and reading one process's files.


def snapshot(item: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Takes the state of `item` now: a JSON header and copies of its arrays."""
  if hasattr(item, "state"):
    value = item.state()
  else:
    value = state_lib.IteratorState.from_dict(item.get_state())
  return state_lib.encode_state(value)


def write_files(
    directory: str | os.PathLike[str],
    header: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    process_index: int,
    process_count: int,
) -> None:
  """Writes one process's files; each appears whole or not at all."""
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  if arrays:
    _atomic_write(os.path.join(directory, stem + ".npz"), lambda f: np.savez(f, **arrays))
  # Compact: a state is read by programs (`ckpt-iter inspect` shows it to people).
  text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
  _atomic_write(os.path.join(directory, stem + ".json"), lambda f: f.write(text))


def _atomic_write(path: str, write: Any) -> None:
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def read_header(path: str) -> dict[str, Any]:
  """Reads and parses a state header file, with errors that name the file."""
  try:
    size = _regular_file_size(path)
  except OSError as e:
    raise errors.InvalidStateError(f"{path}: cannot read the state file ({e.strerror}).") from None
  if size > MAX_HEADER_BYTES:
    raise errors.InvalidStateError(
        f"{path}: state header is {size} bytes, over the {MAX_HEADER_BYTES} limit; "
        "the file is corrupt or not a ckpt_iter state."
    )
  try:
    with open(path, "rb") as f:
      # Bounded by the measured size (read(n) allocates n bytes up front).
      data = f.read(size + 1)
    if len(data) > size:
      raise ValueError(f"the file grew past its {size} bytes while being read")
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    # RecursionError: JSON nested deeper than the parser's recursion limit.
    raise errors.InvalidStateError(
        f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
        "is truncated or garbled. Restore an earlier step."
    ) from None


def _regular_file_size(path: str) -> int:
  """The size of `path`; OSError unless it is a regular file.

  A FIFO would block the reader forever and a device (/dev/zero) never ends,
  so a state file (or a symlink in its place) must be a regular file.
  """
  info = os.stat(path)
  if not stat.S_ISREG(info.st_mode):
    raise OSError(errno.EINVAL, "not a regular file", path)
  return info.st_size


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid in a state file")


def read_state(
    directory: str | os.PathLike[str], process_index: int, process_count: int
) -> state_lib.IteratorState:
  """Reads and validates one process's state (header and arrays)."""
  directory = os.fspath(directory)
  stem = process_file_stem(process_index, process_count)
  json_path = os.path.join(directory, stem + ".json")
  if not os.path.exists(json_path):
    raise _missing_process_file(directory, process_index, process_count)
  header = read_header(json_path)
  npz_path = os.path.join(directory, stem + ".npz")
  with _ArrayReader(npz_path) as reader:
    return state_lib.decode_state(header, reader.load, origin=json_path)


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

  def load(self, name: str, spec: state_lib.ArraySpec) -> np.ndarray:
    if self._zip is None:
      if not os.path.exists(self._path):
        raise errors.InvalidStateError(
            f"{self._path}: missing; the state refers to array {name!r}. "
            "The checkpoint is incomplete: restore an earlier step."
        )
      try:
        self._file = _ClampedFile(self._path)
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
    self.size = _regular_file_size(path)
    self._f = open(path, "rb")

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
  found = []
  for name in sorted(os.listdir(os.fspath(directory))):
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
        "pass elastic=True to IteratorRestore (make_dataset pipelines only)."
    )
  return errors.InvalidStateError(
      f"{directory}: {process_file_stem(process_index, process_count)}.json is missing "
      f"(present: {[process_file_stem(i, n) for i, n in present] or 'none'}). "
      "The checkpoint is incomplete: restore an earlier step."
  )


# ---------------------------------------------------------------------------
# Orbax handler and args.


class IteratorCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores ckpt_iter iterators as an Orbax checkpoint item."""

  def __init__(self, process_index: int | None = None, process_count: int | None = None):
    self._process_index = process_index
    self._process_count = process_count

  def _process(self) -> tuple[int, int]:
    index = jax.process_index() if self._process_index is None else self._process_index
    count = jax.process_count() if self._process_count is None else self._process_count
    return index, count

  async def async_save(self, directory: epath.Path, args: "IteratorSave") -> list[Any]:
    header, arrays = snapshot(args.item)
    index, count = self._process()

    async def write() -> None:
      write_files(directory, header, arrays, process_index=index, process_count=count)

    return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="ckpt_iter_save")]

  def save(self, directory: epath.Path, args: "IteratorSave") -> None:
    header, arrays = snapshot(args.item)
    index, count = self._process()
    write_files(directory, header, arrays, process_index=index, process_count=count)

  def restore(self, directory: epath.Path, args: "IteratorRestore | None" = None) -> Any:
    if args is None or args.item is None:
      raise errors.InvalidArgumentError(
          "restoring a ckpt_iter item needs the iterator to restore into: "
          "IteratorRestore(iterator)."
      )
    index, count = self._process()
    origin = os.fspath(directory)
    if args.elastic:
      from ckpt_iter import elastic  # pylint: disable=g-import-not-at-top

      value = elastic.read_for_process(directory, index, count)
      # With the saved process count an elastic restore is an exact one: each
      # process gets its own file, so per-process fields are checked as usual
      # (and a per-process filter, refused only when the count changes, works).
      resized = elastic.saved_process_count(directory) != count
    else:
      value = read_state(directory, index, count)
      origin = os.path.join(origin, process_file_stem(index, count) + ".json")
      resized = False
    _restore_into(args.item, value, allow_drift=args.allow_drift, elastic=resized, origin=origin)
    return args.item

  def metadata(self, directory: epath.Path) -> Any:
    """A summary for Orbax's item_metadata: never raises on a bad item."""
    try:
      files = list_process_files(directory)
      return {"processes": [process_file_stem(i, n) for i, n in files]}
    except OSError:
      return None

  def finalize(self, directory: epath.Path) -> None:
    pass

  def close(self) -> None:
    pass


def _restore_into(item: Any, value: state_lib.IteratorState, *, allow_drift, elastic: bool, origin: str) -> None:
  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top

  allowed = set(allow_drift) | (set(dataset_lib.ELASTIC_FIELDS) if elastic else set())
  if hasattr(item, "restore_state"):
    item.restore_state(value, allow_drift=allowed, origin=origin)
  elif allowed:
    raise errors.InvalidArgumentError(
        f"allow_drift/elastic need a ckpt_iter iterator; {type(item).__qualname__} "
        "has only set_state."
    )
  else:
    item.set_state(value.to_dict())


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Orbax args that save a DataIterator, RepeatIterator or Tunix data state.

  Attributes:
    item: the iterator; its state is taken when `save` is called.
  """

  item: Any


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Orbax args that restore into an existing iterator, in place.

  Attributes:
    item: the iterator to restore into, built from the same pipeline.
    allow_drift: fingerprint fields that may differ from the checkpoint's.
    elastic: resume a make_dataset pipeline with another process count (see
      docs/multihost.md); the global batch size must be the same.
  """

  item: Any
  allow_drift: Collection[str] = ()
  elastic: bool = False
