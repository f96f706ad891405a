"""A data item's files: the streamed npz, and arrays one process writes for the pod.

Real files in a temporary directory, read back by the one reader
(`_files.read_state`, `elastic.read_replicated`). The 2-process Tunix runs of
tests/integration/test_tunix_multihost.py check the same layout as real
processes write it.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

from hypothesis import given, settings, strategies as st
import ml_dtypes
import numpy as np
import pytest

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _npz
from ckpt_iter import _item as item_lib
from ckpt_iter import _storage
from ckpt_iter import elastic
from ckpt_iter import errors
from ckpt_iter import state as state_lib


def _state(arrays: dict, **fingerprint) -> state_lib.IteratorState:
  return state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "GRPOLearner", **fingerprint}, position={"next_index": 3},
      pending=state_lib.Pending(items=(arrays,), schedule=(0,)), counters={"train_steps": 3})


def _write(directory, value, index: int, count: int, *, shared_from: int | None = None) -> None:
  """Writes process `index`'s files as `item_lib.share_arrays` leaves them."""
  header, arrays = codec.encode_state(value)
  if count > 1:
    header[_npz.ARRAYS_SHA256] = _npz.arrays_sha256(arrays)
  if shared_from is not None:
    header[_files.ARRAYS_FROM] = shared_from
    arrays = {}
  _files.write_files(str(directory), header, arrays, process_index=index, process_count=count, count_file=True)


def _arrays_equal(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def test_a_large_npz_is_streamed_and_bound_to_its_header(tmp_path):
  # Larger than the tail the writer keeps: the zip directory's digest comes
  # from the tail, with the whole file's offsets.
  rows = np.arange(3 * 2**20, dtype=np.int32).reshape(1024, -1)
  value = _state({"ids": rows, "mask": rows % 3 == 0})
  _write(tmp_path, value, 0, 1)
  stream_digest = json.loads((tmp_path / "process_0-of-1.json").read_text())[_npz.ARRAYS_DIGEST]
  data = (tmp_path / "process_0-of-1.npz").read_bytes()
  assert stream_digest == _npz.directory_digest(data)
  with np.load(tmp_path / "process_0-of-1.npz") as npz:  # numpy reads it as its own
    assert sorted(npz.files) == ["a0", "a1"] and npz["a0"].tobytes() == rows.tobytes()
  _arrays_equal(_files.read_state(str(tmp_path), 0, 1).pending.items[0], value.pending.items[0])
  # The npz of another save is refused: the header names its own.
  other = tmp_path / "other"
  other.mkdir()
  _write(other, _state({"ids": rows + 1, "mask": rows % 3 == 0}), 0, 1)
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
  value = _state({"x": array, "scalar": np.float32(1.5)})
  _write(directory, value, 0, 1)
  _arrays_equal(_files.read_state(str(directory), 0, 1).pending.items[0], value.pending.items[0])


def test_a_process_sharing_process_0s_arrays_reads_them_and_checks_their_digest(tmp_path):
  arrays = {"ids": np.arange(12, dtype=np.int32).reshape(3, 4), "logps": np.linspace(0, 1, 3, dtype=np.float32)}
  value = _state(arrays)
  _write(tmp_path, value, 0, 2)
  _write(tmp_path, value, 1, 2, shared_from=0)
  assert sorted(os.listdir(tmp_path)) == ["ckpt_iter.json", "process_0-of-2.json", "process_0-of-2.npz",
                                          "process_1-of-2.json"]
  _arrays_equal(_files.read_state(str(tmp_path), 1, 2).pending.items[0], arrays)
  # Process 0's npz replaced by a sound one of other arrays (its header with it):
  # process 1's digest no longer matches what it would load.
  _write(tmp_path, _state({"ids": arrays["ids"] + 1, "logps": arrays["logps"]}), 0, 2)
  with pytest.raises(errors.InvalidStateError, match=r"process_1-of-2.json: shares the arrays of .*process_0-of-2.npz"):
    _files.read_state(str(tmp_path), 1, 2)


@pytest.mark.parametrize("field, value, says", [
    (_files.ARRAYS_FROM, 1, "must name another process"),
    (_files.ARRAYS_FROM, 7, "must name another process"),
    (_files.ARRAYS_FROM, "0", "must name another process"),
    (_npz.ARRAYS_SHA256, "abc", "not a SHA-256"),
])
def test_a_garbled_sharing_field_is_refused_naming_it(tmp_path, field, value, says):
  value_state = _state({"ids": np.arange(4, dtype=np.int32)})
  _write(tmp_path, value_state, 0, 2)
  _write(tmp_path, value_state, 1, 2, shared_from=0)
  path = tmp_path / "process_1-of-2.json"
  header = json.loads(path.read_text())
  header[field] = value
  path.write_text(json.dumps(header))
  with pytest.raises(errors.InvalidStateError, match=f"field '{field}'.*{says}"):
    _files.read_state(str(tmp_path), 1, 2)


def test_another_count_reads_every_header_and_one_npz(tmp_path, monkeypatch):
  arrays = {"ids": np.arange(4096, dtype=np.int32)}
  value = _state(arrays)
  for index in range(4):
    _write(tmp_path, value, index, 4, shared_from=None if index == 0 else 0)
  read = []
  original = _storage.read_bytes
  monkeypatch.setattr(_storage, "read_bytes", lambda path, **kw: read.append(os.path.basename(path)) or original(path, **kw))
  restored = elastic.read_replicated(str(tmp_path), 4)
  _arrays_equal(restored.pending.items[0], arrays)
  assert sorted(read) == sorted(["process_0-of-4.json", "process_1-of-4.json", "process_2-of-4.json",
                                 "process_3-of-4.json", "process_0-of-4.json", "process_0-of-4.npz"])


def test_another_count_is_refused_when_a_process_saved_other_arrays(tmp_path):
  _write(tmp_path, _state({"ids": np.arange(4, dtype=np.int32)}), 0, 2)
  _write(tmp_path, _state({"ids": np.arange(4, dtype=np.int32) + 1}), 1, 2)
  with pytest.raises(errors.UnsupportedConfigError, match=r"process 1 of 2 saved another data state .*differ in arrays"):
    elastic.read_replicated(str(tmp_path), 2)


def test_sharing_changes_nothing_outside_a_jax_job_of_that_count():
  header, arrays = {"kind": "tunix"}, {"a0": np.arange(3)}
  # One process, and a process index given by hand (this process is not in a 4-process job).
  # One process refers to its own count file's pod part; a process index given by hand writes its header whole.
  assert item_lib.share_arrays("/d", header, arrays, 0, 1, pod_digest="p") == (header, arrays, "p")
  assert item_lib.share_arrays("/d", header, arrays, 2, 4, pod_digest="p") == (header, arrays, None)


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
  value = _state({"ids": np.arange(24, dtype=np.int32).reshape(4, 6)})

  def member_bytes(array):
    buffer = io.BytesIO()
    if layout == "fortran_order":
      np.lib.format.write_array(buffer, np.asfortranarray(array))
    else:
      np.lib.format.write_array(buffer, array, version=(2, 0))
    return buffer.getvalue()

  _write_members(tmp_path, value, member_bytes)
  _arrays_equal(_files.read_state(str(tmp_path), 0, 1).pending.items[0], value.pending.items[0])


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
  _write(tmp_path, _state({"ids": rows}), 0, 1)
  path = tmp_path / "process_0-of-1.npz"
  data = bytearray(path.read_bytes())
  damage(data, rows)
  path.write_bytes(bytes(data))
  with pytest.raises(errors.InvalidStateError) as raised:
    _files.read_state(str(tmp_path), 0, 1)
  assert f"process_0-of-1.npz: array 'a0' is unreadable ({says})" in str(raised.value)


def test_an_npy_format_the_reader_does_not_know_is_refused(tmp_path):
  value = _state({"ids": np.arange(4, dtype=np.int32)})

  def version_3(array):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=(2, 0))
    return buffer.getvalue()[:6] + b"\x03" + buffer.getvalue()[7:]

  _write_members(tmp_path, value, version_3)
  with pytest.raises(errors.InvalidStateError, match=r"array 'a0' has npy format \(3, 0\); expected 1.0 or 2.0"):
    _files.read_state(str(tmp_path), 0, 1)


# ---------------------------------------------------------------------------
# A step's directory that is a link out of its root (`_files.check_item_directory`).


def _two_steps(root: str) -> None:
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(_ten_records())
  for step in (1, 2):
    next(iterator)
    item = os.path.join(root, str(step), "data")
    os.makedirs(item)
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))


def _ten_records():
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  return ckpt_iter.make_dataset([{"id": i} for i in range(10)], batch_size=2, seed=None, num_epochs=None,
                                shard_index=0, shard_count=1)


def _restore(item: str):
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(_ten_records())
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(item, ckpt_iter.IteratorRestore(iterator))
  return iterator


@pytest.mark.parametrize("linked", ["item", "step"])
def test_a_step_linked_out_of_its_root_is_refused_by_restore_and_every_verb(tmp_path, capsys, linked):
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  root = str(tmp_path / "run")
  _two_steps(root)
  moved = os.path.join(root, "2", "data") if linked == "item" else os.path.join(root, "2")
  outside = str(tmp_path / "elsewhere")
  os.rename(moved, outside)
  os.symlink(outside, moved)
  refusal = f"resolves to {os.path.realpath(os.path.join(root, '2', 'data'))}, outside the checkpoint root {root}"
  with pytest.raises(errors.InvalidStateError, match="outside the checkpoint root") as info:
    _restore(os.path.join(root, "2", "data"))
  assert refusal in str(info.value) and "Move or copy the directory into the root" in str(info.value)
  for argv in (["inspect", root, "--step", "2"], ["verify", root], ["audit", root], ["which", root, "--step", "2"],
               ["diff", root, "--step", "1", "--step", "2"], ["order", root, "--out", str(tmp_path / "o.jsonl")]):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == cli.EXIT_PROBLEMS and refusal in out + err and "Traceback" not in out + err, (argv, out, err)
  assert cli.main(["inspect", root, "--step", "1"]) == 0  # the other steps read as before


def test_a_link_inside_the_root_and_a_linked_root_are_followed(tmp_path):
  real_root = str(tmp_path / "run")
  _two_steps(real_root)
  os.rename(os.path.join(real_root, "2", "data"), os.path.join(real_root, "2", "data.moved"))
  os.symlink(os.path.join(real_root, "2", "data.moved"), os.path.join(real_root, "2", "data"))
  linked_root = str(tmp_path / "link_to_run")
  os.symlink(real_root, linked_root)
  for root in (real_root, linked_root):
    assert [int(x) for x in next(_restore(os.path.join(root, "2", "data")))["id"]] == [4, 5]
