"""The npz of a process's pending arrays: written aligned, read as slices of one buffer.

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

A header binds its npz (`ARRAYS_DIGEST`, the digest of the zip directory) or,
sharing another process's, the arrays themselves (`ARRAYS_SHA256`). `_files`
names, writes and reads the item's files; this module is the npz's format.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import struct
import time
import zipfile
import zlib
from typing import Any, Callable, Mapping

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib

# Header field binding a header to its npz: a digest of the npz's zip
# directory, which holds every member's name, size and CRC-32 (zipfile checks
# each member's CRC as it reads it). Headers written before it have none.
ARRAYS_DIGEST = "arrays_digest"
# Header field of a process that shares another's arrays (`_files.ARRAYS_FROM`):
# the SHA-256 of the arrays (`arrays_sha256`), which the reader checks what it
# loads against.
ARRAYS_SHA256 = "arrays_sha256"

# What an npz may hold beyond its arrays' data: per member, the .npy header
# (numpy pads it to at most 4096 bytes) and the zip local and central entries
# with their zip64 extras; per archive, the end records.
_NPY_HEADER_BYTES = 4096
_ZIP_MEMBER_BYTES = 384  # a member's local and central entries, zip64 fields and alignment padding
_ZIP_ARCHIVE_BYTES = 1024


def write_npz(out: Any, arrays: Mapping[str, np.ndarray]) -> None:
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


def directory_bytes_bound(arrays: Mapping[str, np.ndarray]) -> int:
  """The most bytes an npz's zip directory and end records take (what `TailKeeper` keeps)."""
  return _ZIP_ARCHIVE_BYTES + sum(_ZIP_MEMBER_BYTES + 2 * len(name) for name in arrays)


class TailKeeper:
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
    """`directory_digest` of the whole file written, from its kept tail."""
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


def npz_size_bound(specs: Mapping[str, codec.ArraySpec]) -> int:
  """The most bytes an npz of these arrays takes, as np.savez writes it."""
  return _ZIP_ARCHIVE_BYTES + sum(
      spec.nbytes + _NPY_HEADER_BYTES + _ZIP_MEMBER_BYTES + 2 * len(name) for name, spec in specs.items()
  )


class ArrayReader:
  """Loads named arrays from an npz read whole, checking its size and members first.

  The npz is read at the first `load`, once decode_state has validated the
  header whose manifest bounds it; zipfile parses its directory, and each
  array is then sliced from the file's bytes (`_member_bytes`, `_npy_array`).
  `check_directory` is the item directory's rule (`_files.check_item_directory`),
  asked again right before the read.
  """

  def __init__(self, path: str, header: Mapping[str, Any], *, origin: str,
               check_directory: Callable[[str], None]):
    self._path = path
    self._check_directory = check_directory
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
    self._check_directory(os.path.dirname(path))  # again: the link may have been put there since the header
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
    self._digest = directory_digest(self._data, end)
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
  # In place when the file put it at an aligned offset, as `write_npz` does:
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


def directory_digest(data: bytes | memoryview, end: tuple[int, int, int] | None = None) -> str:
  """sha256 (32 hex digits) of an npz's zip directory: names, sizes and CRC-32s of every member."""
  end = _end_record(data) if end is None else end
  if end is None:
    return "none"
  _, size, offset = end
  return hashlib.sha256(memoryview(data)[offset:offset + size]).hexdigest()[:32]
