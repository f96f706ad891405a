"""Tests for the Orbax item: IteratorSave / IteratorRestore, files and codec."""

import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import testing
from ckpt_iter import _files
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_iter.__file__)))

# The pipelines, built by the same code in this process and in the restoring
# process (the fingerprint includes the transform's qualified name, so both
# execute this text under the same module name).
_PIPELINES = '''
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import ckpt_iter

RECORDS = [{"id": i, "prompt": "p" * (i % 4 + 1)} for i in range(23)]


def tokenize(record):
  return {"id": np.int64(record["id"]),
          "tokens": np.array([record["id"], len(record["prompt"])], np.int32)}


class Producer:
  """A rollout stand-in: arrays of several dtypes; counts its calls."""

  def __init__(self):
    self.calls = 0

  def __call__(self, element):
    self.calls += 1
    ids = element["id"]
    return {
        "completion_ids": (ids[:, None] * 3 + np.arange(4)).astype(np.int32),
        "old_logps": np.cos(ids * 0.3).astype(np.float32),
        "ref_logps": np.cos(ids * 0.7).astype(ml_dtypes.bfloat16),
        "advantages": (ids - ids.mean()).astype(np.float64),
    }


def data_iterator():
  return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=3, num_epochs=2, shard_index=0, shard_count=1,
      transform=tokenize))


def repeat_iterator(producer):
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=5, num_epochs=1, shard_index=0, shard_count=1))
  return ckpt_iter.RepeatIterator(
      source, produce=producer, num_repeats=3, group_size=2, shuffle_seed=11)


def params():
  key = jax.random.PRNGKey(0)
  return {
      "dense": {"w": jax.random.normal(key, (4, 3), jnp.float32),
                "b": jnp.linspace(-1, 1, 3).astype(jnp.bfloat16)},
      "count": np.arange(5, dtype=np.int32),
  }
'''

_RESTORE_SCRIPT = '''
import pickle
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter

pipelines_path, directory, step, kind, report_path = sys.argv[1:]
pipelines = {"__name__": "ckpt_test_pipelines"}
exec(open(pipelines_path).read(), pipelines)
producer = pipelines["Producer"]()
if kind == "data":
  iterator = pipelines["data_iterator"]()
else:
  iterator = pipelines["repeat_iterator"](producer)
abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), pipelines["params"]())
manager = ocp.CheckpointManager(directory)
restored = manager.restore(int(step), args=ocp.args.Composite(
    params=ocp.args.StandardRestore(abstract),
    data=ckpt_iter.IteratorRestore(iterator)))
assert restored["data"] is iterator
calls_before = producer.calls
elements = [{k: np.asarray(v) for k, v in e.items()} for e in iterator]
manager.close()
# The test's own report channel (not a checkpoint), so pickle is fine here.
with open(report_path, "wb") as f:
  pickle.dump({
      "params": jax.tree.map(np.asarray, restored["params"]),
      "elements": elements,
      "calls_at_restore": calls_before,
      "calls": producer.calls,
  }, f)
'''


@pytest.fixture
def pipelines(tmp_path):
  path = tmp_path / "pipelines.py"
  path.write_text(_PIPELINES)
  namespace = {"__name__": "ckpt_test_pipelines"}
  exec(_PIPELINES, namespace)  # pylint: disable=exec-used
  namespace["__file__"] = str(path)
  return namespace


def _restore_in_fresh_process(pipelines, directory, step, kind, tmp_path):
  script = tmp_path / "restore.py"
  script.write_text(_RESTORE_SCRIPT)
  report = tmp_path / f"report_{kind}.pkl"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
  result = subprocess.run(
      [sys.executable, str(script), pipelines["__file__"], str(directory), str(step), kind, str(report)],
      env=env, capture_output=True, text=True, timeout=300, check=False,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  with open(report, "rb") as f:
    return pickle.load(f)


def _save(directory, step, **items):
  manager = ocp.CheckpointManager(directory)
  manager.save(step, args=ocp.args.Composite(**items))
  manager.wait_until_finished()
  manager.close()


def _restore(directory, step, **items):
  manager = ocp.CheckpointManager(directory)
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  finally:
    manager.close()


def test_data_iterator_resumes_exactly_in_a_fresh_process(pipelines, tmp_path, ckpt_dir):
  full = list(pipelines["data_iterator"]())
  iterator = pipelines["data_iterator"]()
  for _ in range(7):  # crosses no boundary on purpose: 11 batches per epoch
    next(iterator)
  params = pipelines["params"]()
  directory = ckpt_dir
  _save(directory, 3, params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator))

  # No pending arrays: the JSON header only.
  names = sorted(n for n in os.listdir(directory / "3" / "data") if n.startswith("process_"))
  assert names == ["process_0-of-1.json"]
  header = json.loads((directory / "3" / "data" / "process_0-of-1.json").read_text())
  assert list(header)[0] == "format_version"
  assert header["position"] == {"next_index": 7}

  report = _restore_in_fresh_process(pipelines, directory, 3, "data", tmp_path)
  testing.assert_trees_equal(report["params"], jax.tree.map(np.asarray, params))
  testing.assert_trees_equal(report["elements"], full[7:])


def test_repeat_iterator_resumes_mid_repeat_in_a_fresh_process(pipelines, tmp_path, ckpt_dir):
  full = list(pipelines["repeat_iterator"](pipelines["Producer"]()))
  assert len(full) == 11 // 2 * 2 * 3  # 11 batches, groups of 2, 3 repeats
  iterator = pipelines["repeat_iterator"](pipelines["Producer"]())
  checkpoint = 8  # the second group, 2 of its 6 items yielded
  for _ in range(checkpoint):
    next(iterator)
  pending = len(iterator.state().pending.schedule)
  assert pending == 4
  params = pipelines["params"]()
  directory = ckpt_dir
  _save(directory, 5, params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator))

  data_dir = directory / "5" / "data"
  names = sorted(n for n in os.listdir(data_dir) if n.startswith("process_"))
  assert names == ["process_0-of-1.json", "process_0-of-1.npz"]
  header = json.loads((data_dir / "process_0-of-1.json").read_text())
  with np.load(data_dir / "process_0-of-1.npz", allow_pickle=False) as npz:
    assert sorted(npz.files) == sorted(header["arrays"])
    for name, spec in header["arrays"].items():
      assert npz[name].dtype.str == spec["dtype"] and list(npz[name].shape) == spec["shape"]
  with zipfile.ZipFile(data_dir / "process_0-of-1.npz") as archive:
    assert all(info.filename.endswith(".npy") for info in archive.infolist())

  report = _restore_in_fresh_process(pipelines, directory, 5, "repeat", tmp_path)
  testing.assert_trees_equal(report["params"], jax.tree.map(np.asarray, params))
  testing.assert_trees_equal(report["elements"], full[checkpoint:])
  assert report["calls_at_restore"] == 0
  # Only the groups after the pending ones were rolled out again.
  assert report["calls"] * 3 == len(full) - checkpoint - pending


def test_state_is_snapshotted_when_save_is_called(pipelines, monkeypatch, ckpt_dir, ckpt_manager):
  # Hold the background write until the iterator has moved on and its
  # pending arrays were overwritten in place (as a reused rollout buffer is).
  gate, write_began, released = threading.Event(), threading.Event(), []
  original = _files.write_files

  def held_write(*args, **kwargs):
    write_began.set()
    released.append(gate.wait(timeout=30))
    return original(*args, **kwargs)

  monkeypatch.setattr(_files, "write_files", held_write)
  full = list(pipelines["repeat_iterator"](pipelines["Producer"]()))
  iterator = pipelines["repeat_iterator"](pipelines["Producer"]())
  for _ in range(4):
    next(iterator)
  ckpt_manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  try:
    for item in iterator.state().pending.items:
      item["old_logps"][...] = -7.0
    for _ in range(5):
      next(iterator)
  finally:
    gate.set()
  ckpt_manager.wait_until_finished()
  assert released == [True], "the write was not in the background"
  assert write_began.is_set()

  fresh = pipelines["repeat_iterator"](pipelines["Producer"]())
  _restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(fresh))
  testing.assert_trees_equal(list(fresh), full[4:])


def _interleave():
  shards = [grain.MapDataset.range(100 * s, 100 * s + 6) for s in range(4)]
  return grain.experimental.InterleaveIterDataset(shards, cycle_length=2)


def _interleave_with_future_states():
  # Grain's elastic resharding keeps shards beyond the cycle in
  # `future_states`, a dict keyed by int shard index.
  iterator = _interleave().__iter__()
  iterator.set_shard_states([
      {"exhausted": 0, "state": {"next_index": n}} for n in (1, 3, 4, 2)
  ])
  return iterator


@pytest.mark.skipif(
    not hasattr(grain.experimental.InterleaveIterDataset([grain.MapDataset.range(1)], cycle_length=1).__iter__(),
                "set_shard_states"),
    reason="this grain has no InterleaveDatasetIterator.set_shard_states (added in 0.2.18), which the "
           "test uses to build a state with int keys")
def test_int_keys_in_a_grain_state_survive_the_checkpoint(ckpt_dir):
  grain_iterator = _interleave_with_future_states()
  position = grain_iterator.get_state()
  assert set(position["future_states"]) == {2, 3}  # ints: what plain JSON breaks
  expected = list(_interleave_with_future_states())
  assert 104 in expected and 100 not in expected  # shard 2 resumes at 4, not 0

  iterator = ckpt_iter.DataIterator(_interleave())
  iterator.restore_state(
      state_lib.IteratorState(kind="data", fingerprint=iterator.fingerprint, position=position)
  )
  directory = ckpt_dir
  _save(directory, 1, data=ckpt_iter.IteratorSave(iterator))

  fresh = ckpt_iter.DataIterator(_interleave())
  _restore(directory, 1, data=ckpt_iter.IteratorRestore(fresh))
  assert set(fresh.get_state()["position"]["future_states"]) == {2, 3}
  assert [int(x) for x in fresh] == [int(x) for x in expected]


def test_files_hold_numpy_scalars_and_int_keys_as_json(tmp_path):
  value = state_lib.IteratorState(
      kind="data",
      fingerprint={"seed": 1},
      position={"next_index": np.int64(4), "weights": [np.float32(0.25), np.float64(1.5)],
                "shards": {3: (np.int32(1), True), "3": None}},
  )
  header, arrays = codec.encode_state(value)
  _files.write_files(tmp_path, header, arrays, process_index=0, process_count=1)
  assert sorted(os.listdir(tmp_path)) == ["process_0-of-1.json"]
  json.loads((tmp_path / "process_0-of-1.json").read_text())  # plain JSON

  restored = _files.read_state(tmp_path, 0, 1)
  assert restored.position == {"next_index": 4, "weights": [0.25, 1.5],
                               "shards": {3: (1, True), "3": None}}
  assert type(restored.position["next_index"]) is int
  assert list(restored.position["shards"]) == [3, "3"]


def _grain_pipeline():
  return ckpt_iter.make_dataset(
      [{"id": i} for i in range(20)], batch_size=3, seed=8, num_epochs=2,
      shard_index=0, shard_count=1,
  )


def test_a_checkpoint_written_by_grain_restores_into_a_data_iterator(ckpt_dir):
  grain_iterator = _grain_pipeline().to_iter_dataset().__iter__()
  for _ in range(5):
    next(grain_iterator)
  directory = ckpt_dir
  _save(directory, 2, data=grain.checkpoint.CheckpointSave(grain_iterator))
  written = json.loads((directory / "2" / "data" / "process_0-of-1.json").read_text())
  assert "format_version" not in written  # a bare, version-0 Grain state

  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  _restore(directory, 2, data=ckpt_iter.IteratorRestore(iterator))
  assert iterator.get_state()["position"] == {"next_index": 5}
  testing.assert_trees_equal(list(iterator), list(grain_iterator))


def test_restoring_into_another_pipeline_names_the_file_and_field(ckpt_dir):
  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  next(iterator)
  directory = ckpt_dir
  _save(directory, 4, data=ckpt_iter.IteratorSave(iterator))
  other = ckpt_iter.make_dataset(
      [{"id": i} for i in range(20)], batch_size=3, seed=9, num_epochs=2,
      shard_index=0, shard_count=1,
  )

  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _restore(directory, 4, data=ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(other)))
  assert os.path.join(str(directory), "4", "data", "process_0-of-1.json") in str(info.value)
  assert "seed=8 there, seed=9 here" in str(info.value)

  allowed = ckpt_iter.DataIterator(other)
  _restore(directory, 4, data=ckpt_iter.IteratorRestore(allowed, allow_drift={"seed"}))
  assert allowed.get_state()["position"] == {"next_index": 1}


def test_a_corrupt_state_file_is_refused_naming_the_file(ckpt_dir):
  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  directory = ckpt_dir
  _save(directory, 1, data=ckpt_iter.IteratorSave(iterator))
  path = directory / "1" / "data" / "process_0-of-1.json"
  path.write_text(path.read_text()[:40])  # truncated
  fresh = ckpt_iter.DataIterator(_grain_pipeline())
  next(fresh)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    _restore(directory, 1, data=ckpt_iter.IteratorRestore(fresh))
  assert str(path) in str(info.value) and "not valid JSON" in str(info.value)
  assert fresh.get_state()["position"] == {"next_index": 1}


def test_an_async_save_of_a_nan_reward_commits_and_restores_bit_for_bit(ckpt_dir):
  """A pending rollout holding a NaN (and infinite) Python float reward is saved like any other."""
  records = [{"id": i} for i in range(12)]
  rewards = iter([float("nan"), float("inf"), -float("inf"), 1.5] * 10)

  def produce(batch):
    return {"ids": np.asarray(batch["id"]), "reward": next(rewards)}

  def make():
    dataset = ckpt_iter.make_dataset(records, batch_size=2, seed=1, num_epochs=None)
    return ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset), produce=produce, num_repeats=2, group_size=2)

  iterator = make()
  for _ in range(3):  # inside the first group: its two items (NaN, inf rewards) are pending
    next(iterator)
  with ocp.CheckpointManager(ckpt_dir) as manager:
    assert manager.save(3, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
    assert manager.all_steps() == [3]
    restored = make()
    manager.restore(3, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(restored)))
  got, want = next(restored), next(iterator)
  assert np.array_equal(got["ids"], want["ids"])
  assert np.float64(got["reward"]).tobytes() == np.float64(want["reward"]).tobytes()
