"""The data item through Orbax v1: save_checkpointables / load_checkpointables, training.Checkpointer."""

import json
import os

import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1
from orbax.checkpoint.experimental.v1 import training
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import testing

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = [{"id": i} for i in range(40)]


def _pipeline(seed=1):
  return ckpt_iter.make_dataset(RECORDS, batch_size=4, seed=seed, num_epochs=2)


def _produce(batch):
  ids = np.asarray(batch["id"])
  return {"ids": ids * 3, "logps": np.sin(ids).astype(np.float32)}


def _repeat(seed=1):
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(_pipeline(seed)), produce=_produce, num_repeats=3, group_size=2, shuffle_seed=4)


def test_save_and_load_checkpointables_resume_both_iterators_exactly(tmp_path):
  data, repeat = ckpt_iter.DataIterator(_pipeline()), _repeat()
  for _ in range(3):  # the repeat iterator stops mid-group: pending arrays are saved
    next(data), next(repeat)
  path = str(tmp_path / "step_3")
  ocp1.save_checkpointables(path, {
      "params": {"w": np.arange(3.0)},
      "data": ckpt_iter.IteratorCheckpointable(data),
      "repeat": ckpt_iter.IteratorCheckpointable(repeat),
  })
  expected_data, expected_repeat = [next(data) for _ in range(4)], [next(repeat) for _ in range(6)]
  resumed_data, resumed_repeat = ckpt_iter.DataIterator(_pipeline()), _repeat()
  ocp1.load_checkpointables(path, {
      "data": ckpt_iter.IteratorCheckpointable(resumed_data),
      "repeat": ckpt_iter.IteratorCheckpointable(resumed_repeat),
  })
  testing.assert_trees_equal([next(resumed_data) for _ in range(4)], expected_data)
  testing.assert_trees_equal([next(resumed_repeat) for _ in range(6)], expected_repeat)
  # The files are the v0 handler's: one reader serves both APIs.
  assert _files.list_process_files(os.path.join(path, "repeat")) == [(0, 1)]


def test_training_checkpointer_saves_and_restores_the_data_item(tmp_path):
  iterator = ckpt_iter.DataIterator(_pipeline())
  checkpointer = training.Checkpointer(str(tmp_path / "run"))
  for step in range(1, 4):
    next(iterator)
    checkpointer.save_checkpointables(step, {"data": ckpt_iter.IteratorCheckpointable(iterator)})
  checkpointer.close()
  expected = [next(iterator) for _ in range(3)]
  resumed = ckpt_iter.DataIterator(_pipeline())
  checkpointer = training.Checkpointer(str(tmp_path / "run"))
  assert checkpointer.latest.step == 3
  checkpointer.load_checkpointables(3, {"data": ckpt_iter.IteratorCheckpointable(resumed)})
  checkpointer.close()
  testing.assert_trees_equal([next(resumed) for _ in range(3)], expected)
  # The resume is recorded with its step, as through the v0 handler (ckpt-iter audit reads it).
  (entry,) = resumed.state().lineage["recent"]
  assert entry["step"] == 3 and resumed.state().lineage["resumes"] == 1
  # The run is named by its first save (step 1) and carried through the resume, also when the
  # iterator itself is the checkpointable.
  checkpointer = training.Checkpointer(str(tmp_path / "run"))
  checkpointer.save_checkpointables(4, {"data": resumed})
  checkpointer.close()
  runs = []
  for step in range(1, 5):
    runs.append(_files.read_header(os.path.join(str(tmp_path / "run"), str(step), "data", "process_0-of-1.json"))
                ["lineage"]["run"])
  assert runs == [1, 1, 1, 1]


def test_a_load_into_another_pipeline_is_refused_naming_the_field_and_changes_nothing(tmp_path):
  iterator = ckpt_iter.DataIterator(_pipeline(seed=1))
  next(iterator)
  path = str(tmp_path / "step_1")
  ocp1.save_checkpointables(path, {"data": ckpt_iter.IteratorCheckpointable(iterator)})
  other = ckpt_iter.DataIterator(_pipeline(seed=2))
  before = other.get_state()
  with pytest.raises(ckpt_iter.ConfigDriftError, match=r"seed=1 there, seed=2 here"):
    ocp1.load_checkpointables(path, {"data": ckpt_iter.IteratorCheckpointable(other)})
  assert other.get_state() == before
  ocp1.load_checkpointables(path, {"data": ckpt_iter.IteratorCheckpointable(other, allow_drift={"seed"})})
  assert other.get_state()["position"] == iterator.get_state()["position"]


# ---------------------------------------------------------------------------
# The iterators themselves are v1 checkpointables, as Grain's iterators are,
# and write ckpt_iter's files (fingerprint, count file), checked on load.


def _loader(seed=5):
  import grain  # pylint: disable=g-import-not-at-top

  sampler = grain.samplers.IndexSampler(
      len(RECORDS), shard_options=grain.sharding.NoSharding(), shuffle=True, seed=seed, num_epochs=1)
  return ckpt_iter.DataLoaderIterator(grain.DataLoader(
      data_source=RECORDS, sampler=sampler, operations=[grain.transforms.Batch(4)]))


_ITERATORS = {
    "data_iterator": (lambda seed=1: ckpt_iter.DataIterator(_pipeline(seed)), "seed"),
    "repeat_iterator": (_repeat, "seed"),
    "data_loader_iterator": (_loader, "loader.sampler"),
}


@pytest.mark.parametrize("name", sorted(_ITERATORS))
def test_an_iterator_is_itself_a_v1_checkpointable_in_ckpt_iters_format(tmp_path, name):
  make, seed_field = _ITERATORS[name]
  iterator = make()
  for _ in range(3):  # the repeat iterator stops mid-group: pending arrays are saved
    next(iterator)
  path = str(tmp_path / "step_3")
  ocp1.save_checkpointables(path, {"params": {"w": np.arange(3.0)}, "data": iterator})
  item = os.path.join(path, "data")
  header = _files.read_header(os.path.join(item, "process_0-of-1.json"))
  assert header["format_version"] == ckpt_iter.FORMAT_VERSION and header["fingerprint"]
  count_file = json.load(open(os.path.join(item, _files.COUNT_FILE)))
  assert count_file["process_count"] == 1 and count_file["pod"]["fingerprints"][0]  # the pod part, once
  expected = [next(iterator) for _ in range(4)]

  resumed = make()
  ocp1.load_checkpointables(path, {"data": resumed})
  testing.assert_trees_equal([next(resumed) for _ in range(4)], expected)

  other = make(seed=9)
  before = other.get_state()
  with pytest.raises(ckpt_iter.ConfigDriftError, match=seed_field):  # not Orbax's NoEntryError
    ocp1.load_checkpointables(path, {"data": other})
  assert other.get_state() == before


def test_an_item_in_grains_own_format_restores_with_a_warning_that_says_so(tmp_path, caplog):
  grain_iterator = iter(_pipeline())  # a plain Grain iterator: Grain's own v1 save
  for _ in range(2):
    next(grain_iterator)
  path = str(tmp_path / "step_2")
  ocp1.save_checkpointables(path, {"data": grain_iterator})
  expected = [next(grain_iterator) for _ in range(2)]
  resumed = ckpt_iter.DataIterator(_pipeline())
  with caplog.at_level("WARNING", logger="ckpt_iter._item"):
    ocp1.load_checkpointables(path, {"data": resumed})
  testing.assert_trees_equal([next(resumed) for _ in range(2)], expected)
  (record,) = [r for r in caplog.records if r.name == "ckpt_iter._item"]
  assert "written in Grain's own format" in record.getMessage() and "process_0-of-1.json" in record.getMessage()
