"""Corrupt checkpoints: each fault gets its own error, and nothing else changes.

Table-driven: every case damages one file of a real Orbax step (a RepeatIterator
item with pending arrays, or a DataIterator item), then restores it through
`ocp.CheckpointManager.restore` and through the library (`_files.read_state`
+ `restore_state`). Each must raise exactly the expected `CkptIterError`
subclass, name the file and the field in its message, leave the iterator it
restored into exactly as it was (same state, same next elements) and leave the
checkpoint byte-for-byte unchanged. `ckpt-iter verify` reports each on-disk
fault with exit 1 and one line per problem, never a traceback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from typing import Any, Callable

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import cli
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import testing

STEP = 4
ITEM = "data"
STEM = "process_0-of-1"
_RECORDS = [{"x": i} for i in range(40)]


def _produce(batch: dict) -> dict:
  return {"x": batch["x"], "y": batch["x"] * 2.5}


def make_repeat(seed: int = 3, num_repeats: int = 2) -> ckpt_iter.RepeatIterator:
  dataset = ckpt_iter.make_dataset(
      _RECORDS, batch_size=2, seed=seed, num_epochs=None, shard_index=0, shard_count=1
  )
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(dataset), produce=_produce,
      num_repeats=num_repeats, group_size=3, shuffle_seed=7,
  )


def make_data(seed: int = 3) -> ckpt_iter.DataIterator:
  return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      _RECORDS, batch_size=2, seed=seed, num_epochs=1, shard_index=0, shard_count=1
  ))


def _save(root: str, iterator: Any, advance: int) -> None:
  for _ in range(advance):
    next(iterator)
  manager = ocp.CheckpointManager(root)
  manager.save(STEP, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  manager.wait_until_finished()
  manager.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, str]:
  """Checkpoint roots, written once: a repeat item with 2 pending arrays (one per leaf, stacked), a data item."""
  base = tmp_path_factory.mktemp("pristine")
  roots = {"repeat": str(base / "repeat"), "data": str(base / "data")}
  _save(roots["repeat"], make_repeat(), advance=4)
  _save(roots["data"], make_data(), advance=3)
  with open(os.path.join(roots["repeat"], str(STEP), ITEM, STEM + ".json")) as f:
    assert len(json.load(f)["arrays"]) == 2  # the cases below rely on a0 and a1
  return roots


# ---------------------------------------------------------------------------
# Damage, one function per kind of fault. Each gets the item directory.


def _path(item_dir: str, suffix: str) -> str:
  return os.path.join(item_dir, STEM + suffix)


def _edit_header(edit: Callable[[dict], None]) -> Callable[[str], None]:
  def damage(item_dir: str) -> None:
    path = _path(item_dir, ".json")
    with open(path) as f:
      header = json.load(f)
    edit(header)
    with open(path, "w") as f:
      json.dump(header, f)
  return damage


def _replace_text(old: str, new: str) -> Callable[[str], None]:
  """Edits the header's JSON text (for numbers json.dump cannot write, such as 1e400)."""
  def damage(item_dir: str) -> None:
    path = _path(item_dir, ".json")
    with open(path) as f:
      text = f.read()
    assert old in text
    with open(path, "w") as f:
      f.write(text.replace(old, new, 1))
  return damage


def _truncate(suffix: str, keep: float) -> Callable[[str], None]:
  def damage(item_dir: str) -> None:
    path = _path(item_dir, suffix)
    with open(path, "rb") as f:
      data = f.read()
    with open(path, "wb") as f:
      f.write(data[: int(len(data) * keep)])
  return damage


def _garble_json(item_dir: str) -> None:
  path = _path(item_dir, ".json")
  with open(path, "rb") as f:
    data = bytearray(f.read())
  middle = len(data) // 2
  data[middle: middle + 8] = b"\x00\xff}{\x80\"]["
  with open(path, "wb") as f:
    f.write(bytes(data))


def _remove(suffix: str) -> Callable[[str], None]:
  return lambda item_dir: os.remove(_path(item_dir, suffix))


def _rewrite_arrays(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[str], None]:
  """Writes a valid npz (stored members, as ckpt_iter writes) with changed arrays."""
  def damage(item_dir: str) -> None:
    path = _path(item_dir, ".npz")
    with np.load(path, allow_pickle=False) as npz:
      arrays = {name: npz[name] for name in npz.files}
    change(arrays)
    with open(path, "wb") as f:
      np.savez(f, **arrays)
  return damage


def _set(name: str, value: np.ndarray) -> Callable[[dict[str, np.ndarray]], None]:
  def change(arrays: dict[str, np.ndarray]) -> None:
    arrays[name] = value
  return change


def _truncate_member(item_dir: str) -> None:
  """A readable zip whose a1 member lost its last 8 data bytes."""
  import zipfile  # pylint: disable=g-import-not-at-top

  path = _path(item_dir, ".npz")
  with np.load(path, allow_pickle=False) as npz:
    arrays = {name: npz[name] for name in npz.files}
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
    for name, array in arrays.items():
      buffer = io.BytesIO()
      np.lib.format.write_array(buffer, array, allow_pickle=False)
      data = buffer.getvalue()
      z.writestr(name + ".npy", data[:-8] if name == "a1" else data)


def _rename_process_files(count: int) -> Callable[[str], None]:
  def damage(item_dir: str) -> None:
    for suffix in (".json", ".npz"):
      if os.path.exists(_path(item_dir, suffix)):
        os.rename(_path(item_dir, suffix), os.path.join(item_dir, f"process_0-of-{count}{suffix}"))
  return damage


def _bare_grain_state(next_index: int) -> Callable[[str], None]:
  def damage(item_dir: str) -> None:
    with open(_path(item_dir, ".json"), "w") as f:
      json.dump({"next_index": next_index}, f)  # what grain.checkpoint writes
  return damage


# ---------------------------------------------------------------------------
# The table.


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  root: str  # which pristine checkpoint: "repeat" or "data"
  damage: Callable[[str], None] | None
  error: type[errors.CkptIterError]
  # Substrings the message must hold: the file (relative to the item dir) and the field.
  file: str
  field: str
  make: Callable[[], Any] | None = None  # the iterator restored into
  on_disk: bool = True  # a fault `ckpt-iter verify` must report
  # What verify's line names, when it differs from (file, field): verify checks
  # the files as a set, without a pipeline to restore into.
  verify_says: tuple[str, str] | None = None
  # Further lines verify prints for the same fault (each a true consequence of it), after the first.
  verify_also: tuple[str, ...] = ()


def _make_for(case: Case) -> Any:
  if case.make is not None:
    return case.make()
  return make_repeat() if case.root == "repeat" else make_data()


def _del(*keys: str) -> Callable[[dict], None]:
  def edit(header: dict) -> None:
    node = header
    for key in keys[:-1]:
      node = node[key]
    del node[keys[-1]]
  return edit


def _assign(value: Any, *keys: str | int) -> Callable[[dict], None]:
  def edit(header: dict) -> None:
    node = header
    for key in keys[:-1]:
      node = node[key]
    node[keys[-1]] = value
  return edit


JSON = STEM + ".json"
NPZ = STEM + ".npz"
CASES = [
    Case("json_truncated", "repeat", _truncate(".json", 0.5), errors.InvalidStateError, JSON, "not valid JSON"),
    Case("json_empty", "repeat", _truncate(".json", 0.0), errors.InvalidStateError, JSON, "not valid JSON"),
    Case("json_garbled", "repeat", _garble_json, errors.InvalidStateError, JSON, "not valid JSON"),
    Case("json_not_a_dict", "repeat", lambda d: open(_path(d, ".json"), "w").write("[1, 2]"),
         errors.InvalidStateError, JSON, "must be a dict"),
    Case("field_missing_position", "repeat", _edit_header(_del("position")),
         errors.InvalidStateError, JSON, "'position'"),
    Case("field_missing_format_version", "repeat", _edit_header(_del("format_version")),
         errors.InvalidStateError, JSON, "'format_version'"),
    Case("field_wrong_type_schedule", "repeat", _edit_header(_assign("0,1", "pending", "schedule")),
         errors.InvalidStateError, JSON, "pending.schedule"),
    Case("schedule_index_out_of_range", "repeat", _edit_header(_assign([0, 7], "pending", "schedule")),
         errors.InvalidStateError, JSON, "pending.schedule[1]"),
    Case("shuffle_key_not_uint32", "repeat", _edit_header(_assign([-1, 2**40], "shuffle_key")),
         errors.InvalidStateError, JSON, "'shuffle_key'"),
    Case("array_manifest_dtype_changed", "repeat", _edit_header(_assign("<f4", "arrays", "a0", "dtype")),
         errors.InvalidStateError, NPZ, "'a0'"),
    Case("npz_missing", "repeat", _remove(".npz"), errors.InvalidStateError, NPZ, "'a0'"),
    Case("npz_truncated", "repeat", _truncate(".npz", 0.6), errors.InvalidStateError, NPZ, "'a0'"),
    Case("npz_empty", "repeat", _truncate(".npz", 0.0), errors.InvalidStateError, NPZ, "'a0'"),
    Case("npz_member_truncated", "repeat", _truncate_member, errors.InvalidStateError, NPZ, "'a1'"),
    Case("npz_member_missing", "repeat", _rewrite_arrays(lambda a: a.pop("a1")),
         errors.InvalidStateError, NPZ, "'a1'"),
    Case("npz_wrong_dtype", "repeat", _rewrite_arrays(_set("a0", np.array([1, 2], np.int32))),
         errors.InvalidStateError, NPZ, "'a0'"),
    Case("npz_wrong_shape", "repeat", _rewrite_arrays(_set("a1", np.zeros((3,), np.float64))),
         errors.InvalidStateError, NPZ, "'a1'"),
    Case("npz_wrong_rank", "repeat", _rewrite_arrays(_set("a1", np.zeros((2, 2, 1), np.float64))),
         errors.InvalidStateError, NPZ, "'a1'"),
    # A torn pair: a sound npz of the same dtypes and shapes, from another save.
    Case("npz_of_another_save", "repeat", _rewrite_arrays(lambda a: a.update(a1=a["a1"] + 1)),
         errors.InvalidStateError, NPZ, "belongs to another save than its header"),
    Case("process_file_missing", "repeat", _remove(".json"), errors.InvalidStateError, JSON, "missing",
         verify_says=(f"{STEP}/{ITEM}: ", "holds no process_<i>-of-<n>.json")),
    # Valid JSON digits that overflow to infinity, which no state holds.
    Case("number_overflows_to_infinity", "repeat", _replace_text('"fingerprint":{', '"fingerprint":{"lr":1e400,'),
         errors.InvalidStateError, JSON, "1e400 is out of the float range"),
    Case("format_version_newer", "repeat", _edit_header(_assign(state_lib.FORMAT_VERSION + 1, "format_version")),
         errors.StateVersionError, JSON, "format_version"),
    Case("format_version_zero", "repeat", _edit_header(_assign(0, "format_version")),
         errors.StateVersionError, JSON, "format_version"),
    Case("format_version_not_int", "repeat", _edit_header(_assign("1", "format_version")),
         errors.InvalidStateError, JSON, "'format_version'"),
    Case("fingerprint_edited_in_file", "repeat", _edit_header(_assign(3, "fingerprint", "num_repeats")),
         errors.ConfigDriftError, JSON, "num_repeats=3", on_disk=False),
    Case("fingerprint_other_pipeline_seed", "repeat", None, errors.ConfigDriftError, JSON, "seed=3 there",
         make=lambda: make_repeat(seed=4), on_disk=False),
    Case("fingerprint_other_num_repeats", "repeat", None, errors.ConfigDriftError, JSON, "num_repeats=2 there",
         make=lambda: make_repeat(num_repeats=3), on_disk=False),
    Case("fingerprint_data_seed", "data", None, errors.ConfigDriftError, JSON, "seed=3 there",
         make=lambda: make_data(seed=5), on_disk=False),
    Case("wrong_process_count", "repeat", _rename_process_files(2), errors.ProcessCountError,
         "process_0-of-2.json", "2 process(es)",
         verify_says=("process_1-of-2.json", "missing: process 1 of 2"),
         # The one file renamed is read, and its count file (1 process) disagrees with its name.
         verify_also=("says 1 processes, but process_0-of-2.json is one of 2",)),
    Case("data_state_into_repeat_iterator", "data", None, errors.InvalidStateError, JSON, "'data' iterator",
         make=make_repeat, on_disk=False),
    Case("bare_grain_state_into_repeat_iterator", "repeat", _bare_grain_state(2), errors.InvalidStateError,
         JSON, "'data' iterator", on_disk=False),
    Case("position_out_of_range", "data", _edit_header(_assign({"next_index": 10**12}, "position")),
         errors.InvalidStateError, JSON, "'position'", on_disk=False),
]


def _tree_digest(root: str) -> dict[str, str]:
  """Every path under root -> sha256 of its bytes ("dir" for directories)."""
  digest = {}
  for directory, subdirs, files in os.walk(root):
    for name in subdirs:
      digest[os.path.relpath(os.path.join(directory, name), root)] = "dir"
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        digest[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return digest


def _fingerprint_of(iterator: Any) -> Any:
  """The full state of an iterator, arrays copied (compare with assert_trees_equal)."""
  return testing.stored_round_trip(iterator.get_state())


def _next_elements(iterator: Any, count: int) -> list[Any]:
  return [next(iterator) for _ in range(count)]


def _restore(how: str, root: str, iterator: Any) -> None:
  if how == "orbax":
    manager = ocp.CheckpointManager(root)
    try:
      manager.restore(STEP, args=ocp.args.Composite(**{ITEM: ckpt_iter.IteratorRestore(iterator)}))
    finally:
      manager.close()
  else:
    item_dir = os.path.join(root, str(STEP), ITEM)
    value = _files.read_state(item_dir, 0, 1)
    iterator.restore_state(value, origin=os.path.join(item_dir, JSON))


def _copy(pristine: dict[str, str], case: Case, tmp_path) -> tuple[str, str]:
  root = str(tmp_path / case.root)
  shutil.copytree(pristine[case.root], root)
  item_dir = os.path.join(root, str(STEP), ITEM)
  if case.damage is not None:
    case.damage(item_dir)
  return root, item_dir


@pytest.mark.parametrize("how", ["orbax", "library"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_corruption_raises_named_error_and_changes_nothing(pristine, tmp_path, case, how):
  root, item_dir = _copy(pristine, case, tmp_path)
  before_disk = _tree_digest(root)
  target, twin = _make_for(case), _make_for(case)
  for iterator in (target, twin):  # mid-group, with pending items of its own
    for _ in range(5):
      next(iterator)
  before_state = _fingerprint_of(target)

  with pytest.raises(errors.CkptIterError) as raised:
    _restore(how, root, target)

  assert type(raised.value) is case.error, f"{type(raised.value).__name__}: {raised.value}"
  message = str(raised.value)
  assert os.path.join(item_dir, case.file) in message or (
      case.file in message and item_dir in message
  ), message
  assert case.field in message, message
  assert "\n" not in message
  testing.assert_trees_equal(_fingerprint_of(target), before_state, path="state after the refusal")
  testing.assert_trees_equal(_next_elements(target, 8), _next_elements(twin, 8))
  assert _tree_digest(root) == before_disk


@pytest.mark.parametrize("case", [c for c in CASES if c.on_disk], ids=lambda c: c.name)
def test_verify_reports_each_fault_on_one_line(pristine, tmp_path, case, capsys):
  root, _ = _copy(pristine, case, tmp_path)
  # A sound earlier step as well, as in a real run (verify finds the data item
  # by the steps that hold state files).
  shutil.copytree(os.path.join(pristine[case.root], str(STEP)), os.path.join(root, str(STEP - 1)))
  before_disk = _tree_digest(root)
  assert cli.main(["verify", root]) == 1
  out, err = capsys.readouterr()
  lines = out.splitlines()
  assert len(lines) == 1 + len(case.verify_also), out
  assert all(line.startswith(f"step {STEP}: ") for line in lines), lines
  file, field = case.verify_says or (case.file, case.field)
  assert file in lines[0] and field in lines[0], lines[0]
  assert all(text in line for text, line in zip(case.verify_also, lines[1:])), lines
  assert "Traceback" not in out + err
  assert _tree_digest(root) == before_disk


def test_verify_one_line_per_problem_across_steps(pristine, tmp_path, capsys):
  """Three faults in three steps: three lines, each naming its step and file."""
  root = str(tmp_path / "multi")
  os.makedirs(root)
  faults = {4: _truncate(".json", 0.5), 5: _remove(".npz"), 6: _rewrite_arrays(_set("a0", np.zeros(2, np.int32)))}
  for step, damage in faults.items():
    shutil.copytree(os.path.join(pristine["repeat"], str(STEP)), os.path.join(root, str(step)))
    damage(os.path.join(root, str(step), ITEM))
  shutil.copytree(os.path.join(pristine["repeat"], str(STEP)), os.path.join(root, "7"))  # sound
  assert cli.main(["verify", root]) == 1
  out, err = capsys.readouterr()
  lines = out.splitlines()
  assert [line.split(":")[0] for line in lines] == ["step 4", "step 5", "step 6"], out
  assert "Traceback" not in out + err
  assert cli.main(["verify", root, "--step", "7"]) == 0


def test_verify_passes_the_pristine_checkpoints(pristine, capsys):
  """The control for the table: undamaged, verify says ok (so exit 1 means the fault)."""
  for root in pristine.values():
    assert cli.main(["verify", root]) == 0
  out, _ = capsys.readouterr()
  assert out.count("ok: ") == 2


@pytest.mark.parametrize("how", ["orbax", "library"])
def test_pristine_restore_succeeds(pristine, tmp_path, how):
  """The control for the table: the undamaged step restores into both iterators."""
  for kind, make, advance in (("repeat", make_repeat, 4), ("data", make_data, 3)):
    root = str(tmp_path / kind)
    shutil.copytree(pristine[kind], root)
    restored, reference = make(), make()
    for _ in range(advance):
      next(reference)
    _restore(how, root, restored)
    testing.assert_trees_equal(_next_elements(restored, 10), _next_elements(reference, 10))


@pytest.mark.parametrize("how", ["orbax", "library"])
def test_bare_grain_state_migrates(pristine, tmp_path, how):
  """Format version 0 (a bare Grain state, as grain.checkpoint writes it) restores."""
  case = Case("bare", "data", _bare_grain_state(7), errors.CkptIterError, JSON, "")
  root, _ = _copy(pristine, case, tmp_path)
  before_disk = _tree_digest(root)
  restored, reference = make_data(), make_data()
  for _ in range(7):
    next(reference)
  _restore(how, root, restored)
  assert restored.state().fingerprint == reference.state().fingerprint
  assert restored.state().position == reference.state().position  # batch 7, as the stream record it starts
  testing.assert_trees_equal(_next_elements(restored, 5), _next_elements(reference, 5))
  assert _tree_digest(root) == before_disk
