"""Hostile checkpoints: nothing is unpickled, no name escapes, no size is trusted.

A data checkpoint is read after a crash, possibly from shared storage: its
files are untrusted input. Reading one must never run code (no unpickling:
the payloads below would create a marker file if unpickled, and a control
proves they do), never follow a name out of the step directory, and never
allocate for a size the file only claims (checked with tracemalloc). Every
refusal is an InvalidStateError that names the file and the offending field.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tracemalloc
import zipfile
from typing import Any, Callable

import grain
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import _npz
from ckpt_iter import errors
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

STEM = "process_0-of-1"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Reading a refused file may cost a little bookkeeping, never the claimed size.
_SMALL_BYTES = 8 * 2**20


class _MarkerBomb:
  """Unpickling this creates `path`: the proof that something was unpickled."""

  def __init__(self, path: str):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def _header(arrays: dict[str, dict[str, Any]], items: list[Any] | None = None) -> dict[str, Any]:
  """A repeat-state header whose pending items refer to `arrays`."""
  if items is None:
    items = [{"array": name} for name in arrays]
  return {
      "format_version": 1, "kind": "repeat", "fingerprint": {},
      "position": {"next_index": 0}, "shuffle_key": None,
      "pending": {"items": items, "schedule": list(range(len(items)))},
      "counters": {}, "arrays": arrays,
  }


def _write(item_dir: str, header: dict[str, Any], members: dict[str, bytes] | None = None) -> None:
  os.makedirs(item_dir, exist_ok=True)
  with open(os.path.join(item_dir, STEM + ".json"), "w") as f:
    json.dump(header, f)
  if members is not None:
    with zipfile.ZipFile(os.path.join(item_dir, STEM + ".npz"), "w", zipfile.ZIP_STORED) as z:
      for name, data in members.items():
        z.writestr(name, data)


def _npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
  buffer = io.BytesIO()
  np.lib.format.write_array(buffer, array, allow_pickle=allow_pickle)
  return buffer.getvalue()


def _npy_header_only(descr: str, shape: tuple[int, ...], data: bytes = b"") -> bytes:
  buffer = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      buffer, {"descr": descr, "fortran_order": False, "shape": shape}
  )
  return buffer.getvalue() + data


def _read_refused(item_dir: str) -> tuple[errors.CkptIterError, int]:
  """read_state must refuse: returns (the error, tracemalloc peak in bytes)."""
  tracemalloc.start()
  try:
    tracemalloc.reset_peak()
    with pytest.raises(errors.CkptIterError) as raised:
      _files.read_state(item_dir, 0, 1)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  return raised.value, peak


@pytest.fixture
def marker(tmp_path) -> str:
  return str(tmp_path / "UNPICKLED_MARKER")


# ---------------------------------------------------------------------------
# Never unpickles.


def test_the_pickle_payloads_work(tmp_path, marker):
  """Control: the payloads below do create the marker when unpickled."""
  pickle.loads(pickle.dumps(_MarkerBomb(marker)))
  assert os.path.exists(marker)
  os.remove(marker)
  path = str(tmp_path / "bomb.npz")
  np.savez(path, a0=np.array([_MarkerBomb(marker)], dtype=object))
  with np.load(path, allow_pickle=True) as npz:
    npz["a0"]
  assert os.path.exists(marker)


def _pickle_cases(marker: str) -> dict[str, tuple[dict, dict | None, str]]:
  """name -> (header, npz members, expected message fragment)."""
  bomb_array = np.array([_MarkerBomb(marker)], dtype=object)
  bomb = pickle.dumps(_MarkerBomb(marker))
  return {
      # The manifest tells the truth: an object array.
      "manifest_object_dtype": (
          _header({"a0": {"dtype": "|O", "shape": [1]}}),
          {"a0.npy": _npy(bomb_array, allow_pickle=True)},
          "object and void dtypes need pickling",
      ),
      # The manifest lies (int64), the member is a pickled object array.
      "member_object_array": (
          _header({"a0": {"dtype": "<i8", "shape": [1]}}),
          {"a0.npy": _npy(bomb_array, allow_pickle=True)},
          "object dtype",
      ),
      # The member is a bare pickle stream, not an npy file.
      "member_raw_pickle": (
          _header({"a0": {"dtype": "<i8", "shape": [1]}}),
          {"a0.npy": bomb},
          "'a0'",
      ),
      # A structured (void) dtype could hold objects: refused by name.
      "manifest_structured_dtype": (
          _header({"a0": {"dtype": [["f", "|O"]], "shape": [1]}}),
          {"a0.npy": _npy(bomb_array, allow_pickle=True)},
          "is not a numpy dtype",
      ),
      # A pending node naming a Python type to construct.
      "dataclass_node_names_a_callable": (
          _header({}, items=[{"dataclass": "builtins.open", "fields": {"file": {"value": marker}}}]),
          None,
          "is not registered",
      ),
  }


@pytest.mark.parametrize("how", ["library", "orbax"])
@pytest.mark.parametrize("name", [
    "manifest_object_dtype", "member_object_array", "member_raw_pickle",
    "manifest_structured_dtype", "dataclass_node_names_a_callable",
])
def test_loading_never_unpickles(tmp_path, marker, name, how):
  header, members, fragment = _pickle_cases(marker)[name]
  root = str(tmp_path / "ckpt")
  item_dir = os.path.join(root, "1", "data")
  _write(item_dir, header, members)
  with pytest.raises(errors.InvalidStateError) as raised:
    if how == "library":
      _files.read_state(item_dir, 0, 1)
    else:  # the handler reads before it looks at the iterator
      handler = ckpt_iter.IteratorCheckpointHandler(process_index=0, process_count=1)
      receiver = ckpt_iter.DataIterator(grain.MapDataset.source([1, 2]))
      handler.restore(item_dir, ckpt_iter.IteratorRestore(item=receiver))
  assert fragment in str(raised.value)
  assert STEM in str(raised.value)
  assert not os.path.exists(marker), "a checkpoint file was unpickled"


def test_state_file_that_is_a_pickle_is_refused(tmp_path, marker):
  item_dir = str(tmp_path / "data")
  os.makedirs(item_dir)
  with open(os.path.join(item_dir, STEM + ".json"), "wb") as f:
    f.write(pickle.dumps({"format_version": 1, "bomb": _MarkerBomb(marker)}))
  with pytest.raises(errors.InvalidStateError, match="not valid JSON"):
    _files.read_state(item_dir, 0, 1)
  assert not os.path.exists(marker)


# ---------------------------------------------------------------------------
# Names cannot point outside the step directory.

_TRAVERSAL_NAMES = [
    "../x", "../../x", "..", "/tmp/x", "a/b", "a\\b", "x.npy", "", "a0\x00", " a0", "a-0",
]


@pytest.mark.parametrize("name", _TRAVERSAL_NAMES)
def test_array_names_cannot_be_paths(tmp_path, name):
  step_dir = tmp_path / "ckpt" / "1"
  item_dir = str(step_dir / "data")
  # Valid arrays where a traversal would land, so following one would "work".
  os.makedirs(item_dir)
  for path in (step_dir / "x.npy", tmp_path / "ckpt" / "x.npy", step_dir / "data" / "x.npy"):
    np.save(str(path), np.arange(2))
  _write(item_dir, _header({name: {"dtype": "<i8", "shape": [2]}}), {"a0.npy": _npy(np.arange(2))})
  error, _ = _read_refused(item_dir)
  assert type(error) is errors.InvalidStateError
  assert "is not a plain identifier (names may not be paths)" in str(error)
  assert STEM + ".json" in str(error)


def test_pending_cannot_name_an_array_outside_the_manifest(tmp_path):
  item_dir = str(tmp_path / "data")
  header = _header({"a0": {"dtype": "<i8", "shape": [2]}}, items=[{"array": "../a0"}])
  _write(item_dir, header, {"a0.npy": _npy(np.arange(2)), "../a0.npy": _npy(np.arange(2))})
  error, _ = _read_refused(item_dir)
  assert type(error) is errors.InvalidStateError
  assert "refers to array '../a0', which is not in the manifest" in str(error)


@pytest.mark.parametrize("members, fragment", [
    (["../a0.npy"], "has no array 'a0'"),
    # More members than the header lists: refused before the zip directory is parsed.
    (["../a0.npy", "../../evil.npy"], "2 members, its header lists 1"),
])
def test_zip_member_names_are_never_extracted(tmp_path, members, fragment):
  """A member named '../a0.npy' is not the array 'a0', and nothing is written."""
  item_dir = str(tmp_path / "ckpt" / "1" / "data")
  header = _header({"a0": {"dtype": "<i8", "shape": [2]}})
  _write(item_dir, header, {name: _npy(np.arange(2)) for name in members})
  before = sorted(os.walk(str(tmp_path)))
  error, _ = _read_refused(item_dir)
  assert fragment in str(error)
  assert sorted(os.walk(str(tmp_path))) == before


def test_an_npz_padded_with_unlisted_members_is_refused_before_its_directory_is_parsed(tmp_path):
  """50,000 empty members the manifest does not list, within the size bound.

  The manifest claims a 64 MiB array, so the padded file (a few MB) passes
  the size bound; the member count in the zip's end record refuses it
  before zipfile reads one directory entry.
  """
  item_dir = str(tmp_path / "data")
  _write(item_dir, _header({"a0": {"dtype": "|u1", "shape": [2**26]}}))
  with zipfile.ZipFile(os.path.join(item_dir, STEM + ".npz"), "w", zipfile.ZIP_STORED) as z:
    z.writestr("a0.npy", _npy(np.zeros(2, np.uint8)))
    for i in range(50_000):
      z.writestr(f"p{i}", b"")
  assert os.path.getsize(os.path.join(item_dir, STEM + ".npz")) < _npz.npz_size_bound(
      {"a0": codec.ArraySpec("|u1", (2**26,))})
  original = zipfile.ZipFile.__init__
  parsed = []

  def counting_init(self, *args, **kwargs):
    parsed.append(args)
    return original(self, *args, **kwargs)

  zipfile.ZipFile.__init__ = counting_init
  try:
    error, _ = _read_refused(item_dir)
  finally:
    zipfile.ZipFile.__init__ = original
  assert type(error) is errors.InvalidStateError
  assert "50001 members, its header lists 1" in str(error) and STEM + ".npz" in str(error)
  assert parsed == []  # refused from the end record alone


# ---------------------------------------------------------------------------
# Absurd sizes fail fast, without allocating.


def _claimed_member(item_dir: str, claimed_bytes: int, descr: str, shape: tuple[int, ...]) -> None:
  """An npz whose central directory says member a0.npy holds `claimed_bytes`.

  The member really holds a valid npy header for `shape` and 64 data bytes.
  """
  path = os.path.join(item_dir, STEM + ".npz")
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
    z.writestr("a0.npy", _npy_header_only(descr, shape, b"\0" * 64))
    info = z.filelist[0]
    info.file_size = info.compress_size = claimed_bytes  # written into the central directory


def test_size_cases_are_built_as_claimed(tmp_path):
  """Control: zipfile believes the forged member sizes."""
  item_dir = str(tmp_path)
  _claimed_member(item_dir, 10 * 2**30, "|u1", (10 * 2**30 - 128,))
  with zipfile.ZipFile(os.path.join(item_dir, STEM + ".npz")) as z:
    assert z.getinfo("a0.npy").file_size == 10 * 2**30
  assert os.path.getsize(os.path.join(item_dir, STEM + ".npz")) < 4096


def _size_cases() -> dict[str, tuple[Callable[[str], None], str]]:
  ten_gb = 10 * 2**30
  npy_header = len(_npy_header_only("|u1", (ten_gb,)))

  def manifest_shape(shape, dtype="<i8"):
    return lambda d: _write(d, _header({"a0": {"dtype": dtype, "shape": shape}}), {"a0.npy": _npy(np.arange(2))})

  def member_claims(claimed, array_bytes):
    def build(d):
      _write(d, _header({"a0": {"dtype": "|u1", "shape": [array_bytes]}}))
      _claimed_member(d, claimed, "|u1", (array_bytes,))
    return build

  def schedule(index):
    def build(d):
      header = _header({"a0": {"dtype": "<i8", "shape": [2]}})
      header["pending"]["schedule"] = [index]
      _write(d, header, {"a0.npy": _npy(np.arange(2))})
    return build

  def too_many_items(d):
    header = _header({}, items=[None] * (state_lib.MAX_PENDING_ITEMS + 1))
    header["pending"]["schedule"] = [0]
    _write(d, header)

  def sparse_header(d):
    os.makedirs(d)
    with open(os.path.join(d, STEM + ".json"), "wb") as f:
      f.truncate(_files.MAX_HEADER_BYTES + 1)  # sparse: costs no disk

  return {
      # 10^12 int64 elements: 8 TB, over MAX_ARRAY_BYTES.
      "manifest_10e12_elements": (manifest_shape([10**12]), "claims 8000000000000 bytes"),
      "manifest_shape_dims_overflow": (manifest_shape([2**39] * 32), "the limit is"),
      "manifest_dimension_negative": (manifest_shape([-1]), "is not a valid shape"),
      # 10 GB claimed by the manifest (within the limit), a small real member.
      "manifest_10gb_member_small": (manifest_shape([ten_gb], "|u1"), "but the state header says |u1[10737418240]"),
      # 10 GB claimed by the manifest, the npy header and the zip member alike.
      "member_claims_10gb": (member_claims(npy_header + ten_gb, ten_gb), "but the file holds only"),
      # 3 GB: needs no zip64 record, same refusal.
      "member_claims_3gb": (member_claims(npy_header + 3 * 2**30, 3 * 2**30), "but the file holds only"),
      # A member (really) bigger than its spec allows.
      "member_larger_than_spec": (
          lambda d: _write(d, _header({"a0": {"dtype": "|u1", "shape": [16]}}),
                           {"a0.npy": _npy(np.zeros(2**16, np.uint8))}),
          # Refused by the file's size before its zip directory is read.
          "array(s) allow; the file is garbled or padded",
      ),
      # A member claiming 1 TB, more than the whole file.
      "member_claims_1tb": (member_claims(2**40, 16), "but the file holds only"),
      # A pending index of 10^12 into 1 item.
      "schedule_index_10e12": (schedule(10**12), "pending.schedule[0] is 1000000000000"),
      "pending_items_over_limit": (too_many_items, f"the limits are {state_lib.MAX_PENDING_ITEMS}"),
      "header_over_64mb": (sparse_header, f"over the {_files.MAX_HEADER_BYTES} limit"),
  }


@pytest.mark.parametrize("name", list(_size_cases()))
def test_absurd_sizes_fail_fast_without_allocating(tmp_path, name):
  build, fragment = _size_cases()[name]
  item_dir = str(tmp_path / "data")
  build(item_dir)
  error, peak = _read_refused(item_dir)
  assert type(error) is errors.InvalidStateError, error
  assert fragment in str(error), str(error)
  assert STEM in str(error)
  budget = _SMALL_BYTES
  if name == "pending_items_over_limit":  # the header itself is ~6 MB of JSON
    budget += 4 * os.path.getsize(os.path.join(item_dir, STEM + ".json"))
  assert peak < budget, f"read_state allocated {peak} bytes for a refused file"


def test_in_memory_absurd_sizes_are_refused():
  """set_state on a dict: the same limits, before anything is built."""
  iterator = _small_repeat_iterator()
  state = iterator.get_state()
  for pending, fragment in (
      ({"items": [None] * (state_lib.MAX_PENDING_ITEMS + 1), "schedule": [0]}, "the limits are"),
      ({"items": [None], "schedule": [10**12]}, "pending.schedule[0] is 1000000000000"),
  ):
    with pytest.raises(errors.InvalidStateError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
      iterator.set_state({**state, "pending": pending})
  with pytest.raises(errors.InvalidStateError, match="'position'"):
    iterator.set_state({**state, "position": {"next_index": 10**12}})


# ---------------------------------------------------------------------------
# Files that would hang or exhaust a naive reader.


# Run in a child process capped at 2 GiB of address space and a timeout: if a
# regression made read_state follow /dev/zero or block on a FIFO, the child
# fails alone (MemoryError, or killed) instead of exhausting the shared machine.
_READER = r"""
import json, resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
from ckpt_iter import _files
results = {}
for directory in sys.argv[1:]:
  tracemalloc.start()
  try:
    _files.read_state(directory, 0, 1)
    results[directory] = ["no error", "", 0]
  except BaseException as e:
    results[directory] = [type(e).__name__, str(e), tracemalloc.get_traced_memory()[1]]
  tracemalloc.stop()
print(json.dumps(results))
"""

_SPECIAL_KINDS = ["fifo_json", "dev_zero_json", "fifo_npz", "dev_zero_npz", "deep_json"]


def test_special_files_and_deep_json_are_refused(tmp_path):
  directories, targets = {}, {}
  for kind in _SPECIAL_KINDS:
    item_dir = str(tmp_path / kind)
    json_path = os.path.join(item_dir, STEM + ".json")
    _write(item_dir, _header({"a0": {"dtype": "<i8", "shape": [2]}}))
    target = json_path if kind.endswith("_json") else os.path.join(item_dir, STEM + ".npz")
    if kind.endswith("_json"):
      os.remove(json_path)
    if kind.startswith("fifo"):
      os.mkfifo(target)  # opening it for reading would block forever
    elif kind.startswith("dev_zero"):
      os.symlink("/dev/zero", target)  # reading it never ends
    else:
      with open(json_path, "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)
    directories[kind], targets[kind] = item_dir, target
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
      [sys.executable, "-c", _READER, *directories.values()],
      capture_output=True, text=True, timeout=120, env=env, cwd=_REPO,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  for kind in _SPECIAL_KINDS:
    error_class, message, peak = results[directories[kind]]
    assert error_class == "InvalidStateError", (kind, error_class, message)
    assert os.path.basename(targets[kind]) in message, (kind, message)
    if kind == "deep_json":
      fragment = "not valid JSON (RecursionError"
    elif kind.startswith("dev_zero"):
      fragment = "is a symbolic link"  # refused at the open, before what it points to
    elif kind.endswith("_npz"):
      fragment = "not a readable npz"
    else:
      fragment = "not a regular file"
    assert fragment in message, (kind, message)
    assert peak < _SMALL_BYTES + 2 * 400_000, (kind, peak)


def test_zip_member_flagged_encrypted_is_refused(tmp_path):
  item_dir = str(tmp_path / "data")
  _write(item_dir, _header({"a0": {"dtype": "<i8", "shape": [2]}}), {"a0.npy": _npy(np.arange(2))})
  path = os.path.join(item_dir, STEM + ".npz")
  with open(path, "rb") as f:
    data = bytearray(f.read())
  for signature, flag_offset in ((b"PK\x01\x02", 8), (b"PK\x03\x04", 6)):
    start = data.find(signature)
    data[start + flag_offset] |= 1  # "encrypted"
  with open(path, "wb") as f:
    f.write(bytes(data))
  error, _ = _read_refused(item_dir)
  assert type(error) is errors.InvalidStateError
  assert "array 'a0' is unreadable" in str(error) and "encrypted" in str(error)


def _small_repeat_iterator() -> ckpt_iter.RepeatIterator:
  dataset = ckpt_iter.make_dataset(
      [{"x": i} for i in range(12)], batch_size=2, num_epochs=1, shard_index=0, shard_count=1
  )
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(dataset), produce=lambda b: {"x": b["x"]}, num_repeats=2, shuffle_seed=1
  )


def test_shuffle_key_of_wrong_length_is_refused_at_restore():
  """Not at the next group, inside jax.random, with a TypeError."""
  iterator = _small_repeat_iterator()
  state = iterator.get_state()
  before = iterator.state()
  for key in ([1], [1, 2, 3]):
    with pytest.raises(errors.InvalidStateError, match=f"field 'shuffle_key' has {len(key)} integers"):
      iterator.set_state({**state, "shuffle_key": key})
  assert iterator.state() == before


def test_unhashable_position_key_is_refused():
  position = {"__ckpt_iter_items__": [[{"__ckpt_iter_tuple__": [[1]]}, 0]]}
  with pytest.raises(errors.InvalidStateError, match="unhashable key"):
    codec.position_from_json(position)


def test_deeply_nested_values_are_refused_not_recursed():
  deep: Any = []
  for _ in range(100_000):
    deep = [deep]
  iterator = _small_repeat_iterator()
  state = iterator.get_state()
  for field in ("kind", "fingerprint", "position", "counters", "pending", "shuffle_key"):
    with pytest.raises(errors.InvalidStateError, match=field):
      iterator.set_state({**state, field: deep})
  with pytest.raises(errors.InvalidStateError):
    iterator.set_state(deep)


@pytest.mark.parametrize("field", ["kind", "counters", "fingerprint", "position", "shuffle_key", "pending", "format_version"])
def test_array_valued_fields_are_refused(field):
  """numpy arrays where scalars or dicts belong: refused, not compared elementwise."""
  iterator = _small_repeat_iterator()
  before = iterator.state()
  with pytest.raises(errors.InvalidStateError, match=field):
    iterator.set_state({**iterator.get_state(), field: np.array([1, 2])})
  assert iterator.state() == before


# ---------------------------------------------------------------------------
# Bounded costs of refusals: messages and hints do not grow with the input.


def test_a_huge_fingerprint_field_gives_a_short_error_that_states_its_length():
  huge = "x" * (60 * 2**20)  # a 60 MB field, as a garbled or hostile header can hold
  with pytest.raises(errors.ConfigDriftError) as raised:
    state_lib.check_fingerprint({"source": huge, "seed": 1}, {"source": "records", "seed": 1})
  message = str(raised.value)
  assert len(message) < 2_000, len(message)
  assert f"({len(huge) + 2:,} chars)" in message or f"({len(huge):,} chars)" in message
  assert "source=" in message and "allow_drift={'source'}" in message


def test_the_batch_size_hint_does_not_scan_the_position():
  """The hint lists divisors up to a few batch sizes, never every number up to the position.

  Saved after 3 * 10**12 elements: a scan up to the position, as before,
  would not end in any test's lifetime.
  """
  old = ckpt_iter.DataIterator(grain.MapDataset.range(10**13).batch(3))
  saved = dict(old.get_state(), position={"next_index": 10**12})
  with pytest.raises(errors.ConfigDriftError) as raised:
    ckpt_iter.DataIterator(grain.MapDataset.range(10**13).batch(7)).set_state(saved)
  message = str(raised.value)
  assert "cannot start a batch there" in message and "after 3000000000000 elements" in message
  assert "e.g. [" in message
