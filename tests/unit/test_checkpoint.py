"""Tests for the Orbax item: IteratorSave / IteratorRestore, files and codec."""

import json
import os

import grain
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp1
import pytest

import ckpt_iter
from ckpt_iter import testing
from ckpt_iter import _files
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
import support

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
  support.orbax_save(directory, 1, data=ckpt_iter.IteratorSave(iterator))

  fresh = ckpt_iter.DataIterator(_interleave())
  support.orbax_restore(directory, 1, data=ckpt_iter.IteratorRestore(fresh))
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
  support.orbax_save(directory, 2, data=grain.checkpoint.CheckpointSave(grain_iterator))
  written = json.loads((directory / "2" / "data" / "process_0-of-1.json").read_text())
  assert "format_version" not in written  # a bare, version-0 Grain state

  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  support.orbax_restore(directory, 2, data=ckpt_iter.IteratorRestore(iterator))
  assert iterator.get_state()["position"] == {"next_record": 15}  # batch 5 of 3 records
  testing.assert_trees_equal(list(iterator), list(grain_iterator))


def test_restoring_into_another_pipeline_names_the_file_and_field(ckpt_dir):
  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  next(iterator)
  directory = ckpt_dir
  support.orbax_save(directory, 4, data=ckpt_iter.IteratorSave(iterator))
  other = ckpt_iter.make_dataset(
      [{"id": i} for i in range(20)], batch_size=3, seed=9, num_epochs=2,
      shard_index=0, shard_count=1,
  )

  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    support.orbax_restore(directory, 4, data=ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(other)))
  assert os.path.join(str(directory), "4", "data", "process_0-of-1.json") in str(info.value)
  assert "seed=8 there, seed=9 here" in str(info.value)

  allowed = ckpt_iter.DataIterator(other)
  support.orbax_restore(directory, 4, data=ckpt_iter.IteratorRestore(allowed, allow_drift={"seed"}))
  assert allowed.get_state()["position"] == {"next_record": 3}


def test_a_corrupt_state_file_is_refused_naming_the_file(ckpt_dir):
  iterator = ckpt_iter.DataIterator(_grain_pipeline())
  directory = ckpt_dir
  support.orbax_save(directory, 1, data=ckpt_iter.IteratorSave(iterator))
  path = directory / "1" / "data" / "process_0-of-1.json"
  path.write_text(path.read_text()[:40])  # truncated
  fresh = ckpt_iter.DataIterator(_grain_pipeline())
  next(fresh)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    support.orbax_restore(directory, 1, data=ckpt_iter.IteratorRestore(fresh))
  assert str(path) in str(info.value) and "not valid JSON" in str(info.value)
  assert fresh.get_state()["position"] == {"next_record": 3}


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


def test_every_restore_logs_one_info_line_saying_what_it_restored(tmp_path, caplog):
  def pipeline(check_content=True):
    return ckpt_iter.DataIterator(
        ckpt_iter.make_dataset([{"x": i} for i in range(20)], batch_size=2, seed=1, num_epochs=2),
        check_content=check_content)

  saving = pipeline()
  next(saving), next(saving), next(saving)
  with ocp.CheckpointManager(str(tmp_path)) as manager:
    manager.save(7, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(saving)))
    manager.wait_until_finished()
    for check_content, result in ((True, "same element at index 2 (its last row)"), (False, "off (check_content=False)")):
      caplog.clear()
      with caplog.at_level("INFO", logger="ckpt_iter"):
        manager.restore(7, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(pipeline(check_content))))
      (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("ckpt_iter")]
      assert line == (
          "ckpt_iter: restored the data state of step 7: epoch 0, 6 of 20 records read (next_record 6); "
          f"content check: {result} ({tmp_path / '7' / 'data' / 'process_0-of-1.json'})")


# ---------------------------------------------------------------------------
# The args refuse a bad argument when they are built, not inside Orbax's save.


def _receiver():
  return ckpt_iter.DataIterator(grain.MapDataset.source([1, 2, 3]))


# (case id, how the args are built, substrings the message must hold).
_BAD_ARGS = [
    ("save_a_list", lambda: ckpt_iter.IteratorSave([1, 2, 3]),
     ["IteratorSave(item=[1, 2, 3])", "type list", "no state to save", "ckpt_iter.DataIterator(dataset)",
      "ReplayIterator(iterable)"]),
    ("save_none", lambda: ckpt_iter.IteratorSave(None), ["IteratorSave(item=None)", "NoneType"]),
    ("save_a_dataset", lambda: ckpt_iter.IteratorSave(grain.MapDataset.source([1])),
     ["IteratorSave(item=", "SourceMapDataset", "wrap it, ckpt_iter.DataIterator(dataset)"]),
    ("save_the_class", lambda: ckpt_iter.IteratorSave(ckpt_iter.DataIterator),
     ["class DataIterator", "no state to save"]),
    ("restore_a_dataset", lambda: ckpt_iter.IteratorRestore(grain.MapDataset.source([1]).to_iter_dataset()),
     ["IteratorRestore(item=", "no state to restore into", "ckpt_iter.DataIterator(dataset)"]),
    ("restore_a_dict", lambda: ckpt_iter.IteratorRestore({"next_index": 3}),
     ["IteratorRestore(item={'next_index': 3})", "type dict"]),
    ("restore_allow_drift_str", lambda: ckpt_iter.IteratorRestore(_receiver(), allow_drift="seed"),
     ["allow_drift='seed'", "type str", "allow_drift={'seed'}"]),
    ("restore_allow_drift_ints", lambda: ckpt_iter.IteratorRestore(_receiver(), allow_drift=[1]),
     ["allow_drift=[1]", "field names"]),
    ("restore_elastic_int", lambda: ckpt_iter.IteratorRestore(_receiver(), elastic=1),
     ["elastic=1", "type int", "True or False"]),
    ("v1_a_list", lambda: ckpt_iter.IteratorCheckpointable([1, 2, 3]),
     ["IteratorCheckpointable(item=[1, 2, 3])", "no state to save or restore"]),
    ("v1_allow_drift_str", lambda: ckpt_iter.IteratorCheckpointable(_receiver(), allow_drift="seed"),
     ["IteratorCheckpointable(allow_drift='seed')"]),
    ("v1_elastic_str", lambda: ckpt_iter.IteratorCheckpointable(_receiver(), elastic="yes"),
     ["IteratorCheckpointable(elastic='yes')"]),
]


@pytest.mark.parametrize("build, fragments", [case[1:] for case in _BAD_ARGS], ids=[case[0] for case in _BAD_ARGS])
def test_bad_args_are_refused_when_built_naming_the_argument(build, fragments):
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    build()
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_args_take_every_kind_of_iterator_they_save_and_restore():
  grain_iterator = iter(grain.MapDataset.source([1, 2, 3]).to_iter_dataset())
  for item in (_receiver(), grain_iterator):
    assert ckpt_iter.IteratorSave(item).item is item
    assert ckpt_iter.IteratorRestore(item, allow_drift=("seed",), elastic=False).item is item
    assert ckpt_iter.IteratorCheckpointable(item, allow_drift=frozenset()).item is item


# ---------------------------------------------------------------------------
# A ckpt_iter state restored into a plain Grain iterator: every route is loud
# (docs/guarantees.md, "A ckpt_iter state and a plain Grain iterator").

_RECORDS = list(range(40))


def _saved_data_iterator():
  """A DataIterator over a seed-1 shuffle, 5 elements read."""
  iterator = ckpt_iter.DataIterator(grain.MapDataset.source(_RECORDS).shuffle(seed=1))
  for _ in range(5):
    next(iterator)
  return iterator


def _plain(seed=2):
  """A plain Grain iterator over another pipeline (another seed)."""
  return iter(grain.MapDataset.source(_RECORDS).shuffle(seed=seed).to_iter_dataset())


def test_iterator_restore_into_a_plain_grain_iterator_is_refused_saying_to_wrap_it(ckpt_dir):
  support.orbax_save(ckpt_dir, 1, data=ckpt_iter.IteratorSave(_saved_data_iterator()))
  plain = _plain()
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    support.orbax_restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(plain))
  message = str(info.value)
  assert "process_0-of-1.json" in message and "PrefetchDatasetIterator" in message
  assert "ckpt_iter.DataIterator(dataset)" in message
  assert plain.get_state() == {"next_index": 0}


def test_a_v1_load_into_a_plain_grain_iterator_is_refused_saying_to_wrap_it(tmp_path):
  path = str(tmp_path / "step_1")
  ocp1.save_checkpointables(path, {"data": _saved_data_iterator()})
  plain = _plain()
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"ckpt_iter\.DataIterator\(dataset\)"):
    ocp1.load_checkpointables(path, {"data": ckpt_iter.IteratorCheckpointable(plain)})
  assert plain.get_state() == {"next_index": 0}


def test_a_bare_grain_state_still_restores_into_a_plain_grain_iterator(ckpt_dir):
  # No fingerprint to check (IteratorSave of a plain Grain iterator): its own round trip.
  saving = _plain(seed=1)
  for _ in range(5):
    next(saving)
  support.orbax_save(ckpt_dir, 1, data=ckpt_iter.IteratorSave(saving))
  plain = _plain(seed=1)
  support.orbax_restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(plain))
  assert list(plain) == list(saving)


_PLAIN_ITERATORS = {
    "MapDataset.to_iter_dataset": lambda: _plain(),
    "IterDataset.batch": lambda: iter(grain.MapDataset.source(_RECORDS).to_iter_dataset().batch(2)),
    "ElasticIterator": lambda: grain.experimental.ElasticIterator(
        grain.MapDataset.source(_RECORDS), 2, grain.sharding.ShardOptions(0, 1)),
    "IterDataset.mix": lambda: iter(grain.IterDataset.mix(
        [grain.MapDataset.source(_RECORDS).to_iter_dataset()] * 2, [0.5, 0.5])),
}


@pytest.mark.parametrize("name", sorted(_PLAIN_ITERATORS))
def test_grains_set_state_raises_on_a_ckpt_iter_state(name):
  # ckpt_iter's top-level fields are none of Grain's: set_state of a plain
  # iterator (MaxText's or Grain's handler restoring what a DataIterator's
  # get_state gave) raises KeyError naming the key Grain reads.
  plain = _PLAIN_ITERATORS[name]()
  before = plain.get_state()
  state = _saved_data_iterator().get_state()
  assert not set(state) & set(before)
  with pytest.raises(KeyError):
    plain.set_state(state)


def test_grains_handler_reading_an_iterator_save_step_raises(ckpt_dir):
  support.orbax_save(ckpt_dir, 1, data=ckpt_iter.IteratorSave(_saved_data_iterator()))
  with pytest.raises(KeyError, match="next_index"):
    support.orbax_restore(ckpt_dir, 1, data=grain.checkpoint.CheckpointRestore(_plain()))


def test_a_v1_load_of_a_ckpt_iter_step_into_a_bare_grain_iterator_raises(tmp_path):
  # Grain's own v1 load (the iterator as the checkpointable): Orbax refuses the
  # step's handler for it, or wraps Grain's KeyError (NoEntryError, a KeyError).
  path = str(tmp_path / "step_1")
  ocp1.save_checkpointables(path, {"data": _saved_data_iterator()})
  plain = _plain()
  with pytest.raises(KeyError):
    ocp1.load_checkpointables(path, {"data": plain})
  assert plain.get_state() == {"next_index": 0}


# ---------------------------------------------------------------------------
# The Grain habit (issue 47, case 8): IteratorSave(iter(dataset)) records the dataset it reads.

_GRAIN_HABITS = {
    "iter(MapDataset)": lambda seed: iter(grain.MapDataset.source(_RECORDS).shuffle(seed=seed).batch(2)),
    "iter(to_iter_dataset().batch)": lambda seed: iter(
        grain.MapDataset.source(_RECORDS).shuffle(seed=seed).to_iter_dataset().batch(2)),
}


@pytest.mark.parametrize("name", sorted(_GRAIN_HABITS))
def test_a_plain_grain_iterator_saves_its_datasets_fingerprint(name, ckpt_dir):
  make = _GRAIN_HABITS[name]
  saving = make(1)
  for _ in range(3):
    next(saving)
  support.orbax_save(ckpt_dir, 1, data=ckpt_iter.IteratorSave(saving))
  fingerprint = support.read_all(os.path.join(ckpt_dir, "1", "data"))[0].fingerprint
  assert any(key.endswith("ShuffleMapDataset.seed") and value == 1 for key, value in fingerprint.items())
  # The same pipeline resumes exactly; another seed is refused by name, the iterator untouched.
  resumed = make(1)
  support.orbax_restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(resumed))
  assert [list(b) for b in resumed] == [list(b) for b in saving]
  other = make(2)
  with pytest.raises(ckpt_iter.ConfigDriftError, match=r"ShuffleMapDataset\.seed"):
    support.orbax_restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(other))
  assert [list(b) for b in other] == [list(b) for b in make(2)]  # nothing was set
