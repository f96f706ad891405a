"""The streamed npz (`_npz`): written in one pass, bound to its header, read in place, damage named.

Real files in a temporary directory, written by `_files.write_files` and read
back by the one reader (`_files.read_state`).
"""

from __future__ import annotations

import io
import json
import zipfile

from hypothesis import given, settings, strategies as st
import ml_dtypes
import numpy as np
import pytest

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _npz
from ckpt_iter import errors
from ckpt_iter import state as state_lib
import support


def test_a_large_npz_is_streamed_and_bound_to_its_header(tmp_path):
  # Larger than the tail the writer keeps: the zip directory's digest comes
  # from the tail, with the whole file's offsets.
  rows = np.arange(3 * 2**20, dtype=np.int32).reshape(1024, -1)
  value = support.pending_state({"ids": rows, "mask": rows % 3 == 0})
  support.write_process_files(tmp_path, value, 0, 1)
  stream_digest = json.loads((tmp_path / "process_0-of-1.json").read_text())[_npz.ARRAYS_DIGEST]
  data = (tmp_path / "process_0-of-1.npz").read_bytes()
  assert stream_digest == _npz.directory_digest(data)
  with np.load(tmp_path / "process_0-of-1.npz") as npz:  # numpy reads it as its own
    assert sorted(npz.files) == ["a0", "a1"] and npz["a0"].tobytes() == rows.tobytes()
  support.assert_arrays_identical(_files.read_state(str(tmp_path), 0, 1).pending.items[0], value.pending.items[0])
  # The npz of another save is refused: the header names its own.
  other = tmp_path / "other"
  other.mkdir()
  support.write_process_files(other, support.pending_state({"ids": rows + 1, "mask": rows % 3 == 0}), 0, 1)
  (tmp_path / "process_0-of-1.npz").write_bytes((other / "process_0-of-1.npz").read_bytes())
  with pytest.raises(errors.InvalidStateError, match="belongs to another save than its header"):
    _files.read_state(str(tmp_path), 0, 1)


_DTYPES = st.sampled_from([np.int32, np.bool_, np.float32, np.dtype(">i4"), np.uint8, np.float64,
                           ml_dtypes.bfloat16, np.complex64])


@settings(max_examples=40, deadline=None)
@given(dtype=_DTYPES, shape=st.lists(st.integers(0, 5), max_size=3), fortran=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_array_round_trips_bit_for_bit(tmp_path_factory, dtype, shape, fortran, seed):
  directory = tmp_path_factory.mktemp("round_trip")
  raw = np.random.default_rng(seed).integers(0, 256, (*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
  array = raw.view(dtype).reshape(shape)
  if fortran:
    array = np.asfortranarray(array)
  value = support.pending_state({"x": array, "scalar": np.float32(1.5)})
  support.write_process_files(directory, value, 0, 1)
  support.assert_arrays_identical(_files.read_state(str(directory), 0, 1).pending.items[0], value.pending.items[0])


def test_arrays_are_read_in_place_from_the_aligned_npz_and_copied_from_an_unaligned_one(tmp_path):
  """ckpt_iter's npz puts every array's bytes at a 64-byte offset: the read arrays are views of
  the reader's one buffer (no second copy), writable; numpy's own npz (unaligned) reads the same."""
  items = tuple({"ids": np.arange(7, dtype=np.int64) + i, "half": np.arange(3, dtype=np.float16)} for i in range(3))
  value = state_lib.IteratorState(kind="repeat", fingerprint={}, position={"next_index": 1},
                                  pending=state_lib.Pending(items=items, schedule=(2, 0, 1)))
  header, arrays = codec.encode_state(value)
  _files.write_files(str(tmp_path), header, arrays, process_index=0, process_count=1)
  npz = tmp_path / "process_0-of-1.npz"
  data = npz.read_bytes()
  for name, array in arrays.items():
    offset = data.index(array.tobytes())
    assert offset % 64 == 0, (name, offset)
  read = _files.read_state(str(tmp_path), 0, 1)
  ids = [item["ids"] for item in read.pending.items]
  assert all(a.flags.aligned and a.flags.writeable and not a.flags.owndata for a in ids)
  assert ids[0].base is not None and ids[0].base.base is ids[2].base.base  # one buffer
  with np.load(npz) as stored:  # the same arrays, rewritten by numpy: its offsets, not aligned
    rewritten = {name: stored[name] for name in stored.files}
  with open(npz, "wb") as f:
    np.savez(f, **rewritten)
  header = json.loads((tmp_path / "process_0-of-1.json").read_text())
  header.pop(_npz.ARRAYS_DIGEST)  # numpy's directory is not the one this header was written with
  (tmp_path / "process_0-of-1.json").write_text(json.dumps(header))
  reread = _files.read_state(str(tmp_path), 0, 1)
  for before, after in zip(read.pending.items, reread.pending.items):
    for key in before:
      np.testing.assert_array_equal(before[key], after[key])
      assert after[key].flags.aligned and after[key].flags.writeable


def _write_members(directory, value: state_lib.IteratorState, member_bytes) -> None:
  """The state's header, and an npz of its arrays as `member_bytes(array)` writes each (zipfile's layout)."""
  header, arrays = codec.encode_state(value)
  (directory / "process_0-of-1.json").write_text(json.dumps(header))
  with zipfile.ZipFile(directory / "process_0-of-1.npz", "w") as archive:
    for name, array in arrays.items():
      archive.writestr(name + ".npy", member_bytes(array))


@pytest.mark.parametrize("layout", ["npy_version_2", "fortran_order"])
def test_members_another_writer_laid_out_read_exactly(tmp_path, layout):
  """Not the .npy header ckpt_iter writes for the spec: numpy parses it, and the array is the same."""
  value = support.pending_state({"ids": np.arange(24, dtype=np.int32).reshape(4, 6)})

  def member_bytes(array):
    buffer = io.BytesIO()
    if layout == "fortran_order":
      np.lib.format.write_array(buffer, np.asfortranarray(array))
    else:
      np.lib.format.write_array(buffer, array, version=(2, 0))
    return buffer.getvalue()

  _write_members(tmp_path, value, member_bytes)
  support.assert_arrays_identical(_files.read_state(str(tmp_path), 0, 1).pending.items[0], value.pending.items[0])


def _flip_an_array_byte(data: bytearray, rows: np.ndarray) -> None:
  data[data.index(rows.tobytes()) + 5] ^= 1  # the zip directory (and so the header's digest) unchanged


def _overrun_the_local_extra_field(data: bytearray, rows: np.ndarray) -> None:
  del rows
  data[28:30] = b"\xff\xff"  # the first member's local header (at offset 0): its extra field's length


def _move_the_local_header(data: bytearray, rows: np.ndarray) -> None:
  del rows
  data[:4] = b"PK\x07\x08"


def _cut_the_first_byte(data: bytearray, rows: np.ndarray) -> None:
  del rows
  del data[:1]  # every offset the directory records is now one past its member


@pytest.mark.parametrize("damage, says", [
    (_flip_an_array_byte, "bad CRC-32 for 'a0.npy'"),
    (_cut_the_first_byte, "no zip local header at offset -1"),
    (_overrun_the_local_extra_field, "it runs past the end of the file"),
    (_move_the_local_header, "no zip local header at offset 0"),
])
def test_a_damaged_member_is_refused_naming_the_array(tmp_path, damage, says):
  rows = np.arange(64, dtype=np.int32)
  support.write_process_files(tmp_path, support.pending_state({"ids": rows}), 0, 1)
  path = tmp_path / "process_0-of-1.npz"
  data = bytearray(path.read_bytes())
  damage(data, rows)
  path.write_bytes(bytes(data))
  with pytest.raises(errors.InvalidStateError) as raised:
    _files.read_state(str(tmp_path), 0, 1)
  assert f"process_0-of-1.npz: array 'a0' is unreadable ({says})" in str(raised.value)


def test_an_npy_format_the_reader_does_not_know_is_refused(tmp_path):
  value = support.pending_state({"ids": np.arange(4, dtype=np.int32)})

  def version_3(array):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=(2, 0))
    return buffer.getvalue()[:6] + b"\x03" + buffer.getvalue()[7:]

  _write_members(tmp_path, value, version_3)
  with pytest.raises(errors.InvalidStateError, match=r"array 'a0' has npy format \(3, 0\); expected 1.0 or 2.0"):
    _files.read_state(str(tmp_path), 0, 1)
