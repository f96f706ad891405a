"""The learners' input positions (ckpt_iter/tunix/_input.py), without a Tunix run."""

import grain
import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import ckpt_iter
from ckpt_iter.tunix import _input

RECORDS = [{"prompts": f"prompt {i}", "answer": str(i)} for i in range(8)]


def _rebatch(full_batches, size):
  """Rows of full batches re-cut into micro-batches of `size` (Tunix carries rows over too)."""
  for batch in full_batches:
    rows = len(batch["prompts"])
    for start in range(0, rows, size):
      yield {k: v[start:start + size] for k, v in batch.items()}


def _input_at(position=None):
  dataset = ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=1)
  micro = _input.MicroBatchInput(_input.make_source(dataset), 1, _rebatch)
  if position is not None:
    fingerprint = micro.source.fingerprint
    micro.apply(micro.check(fingerprint, position, allow_drift=frozenset(), origin="test"), position)
  return micro


def test_a_position_inside_a_full_batch_survives_a_save_before_the_next_read():
  """A resumed run whose first checkpoint comes before it reads (the restored repeats
  fill the step) must save the position it was restored at, offset included.

  Found by the differential suite: full batch 2, mini batch 1, num_iterations 2,
  killed after steps 1 and 2; the second resume trained prompt A again."""
  uninterrupted = _input_at()
  first = uninterrupted.next_micro_batch()
  saved = uninterrupted.position()
  assert saved["micro_batches_taken"] == 1
  resumed = _input_at(saved)
  assert resumed.position() == saved  # nothing read yet: still one row into the batch
  again = _input_at(resumed.position())
  following = uninterrupted.next_micro_batch()
  np.testing.assert_array_equal(again.next_micro_batch()["prompts"], following["prompts"])
  assert following["prompts"][0] != first["prompts"][0]


def test_the_learner_rule_leaves_more_epochs_to_the_input():
  """Learner fields are compared strictly; the input's own rule accepts one more epoch."""
  one = ckpt_iter.DataIterator(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=1))
  for _ in one:
    pass
  saved, position = {"num_iterations": 2}, one.position()
  two = _input.make_source(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=2))
  checked = _input.check_learner_state(
      saved, {"num_iterations": 2}, two, one.fingerprint, dict(position), allow_drift=frozenset(), origin="test")
  two.apply(checked, position)
  assert two.position() == {"next_index": 4}
  with pytest.raises(ckpt_iter.ConfigDriftError, match="num_iterations"):
    _input.check_learner_state(
        saved, {"num_iterations": 3}, two, one.fingerprint, dict(position), allow_drift=frozenset(), origin="test")


def _write_state(directory, value):
  from ckpt_iter import _item as item_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _saving  # pylint: disable=g-import-not-at-top

  directory.mkdir()
  header, arrays = item_lib.snapshot(_saving.Snapshot(value))
  item_lib.write(str(directory), header, arrays, 0, 1)


def test_one_reader_checks_kind_family_and_step_for_every_learner(tmp_path):
  from ckpt_iter import errors, state as state_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _items  # pylint: disable=g-import-not-at-top

  def state(kind="tunix", fingerprint=None, train_steps=3):
    return state_lib.IteratorState(kind=kind, fingerprint=fingerprint or {"trainer": "PeftTrainer"},
                                   position={"next_index": 4}, counters={"train_steps": train_steps})

  assert _items.read_step_state(str(tmp_path / "absent"), 3, learner_field="trainer", writer="w") is None
  sound = tmp_path / "sound"
  _write_state(sound, state())
  value = _items.read_step_state(str(sound), 3, learner_field="trainer", writer="w")
  assert value.position == {"next_index": 4} and value.lineage["resumes"] == 1  # the resume is recorded
  with pytest.raises(errors.InvalidStateError, match="'learner' field, not by a Resumable RL learner"):
    _items.read_step_state(str(sound), 3, learner_field="learner", writer="a Resumable RL learner")
  with pytest.raises(errors.InvalidStateError, match="taken at train step 3, but the model was restored at step 5"):
    _items.read_step_state(str(sound), 5, learner_field="trainer", writer="w")
  other = tmp_path / "other"
  _write_state(other, state(kind="data"))
  with pytest.raises(errors.InvalidStateError, match="written by a 'data' iterator"):
    _items.read_step_state(str(other), 3, learner_field="trainer", writer="w")


def _row(index):
  return {"prompts": f"P{index:02d}", "answer": str(index)}


@pytest.mark.parametrize("form", ["map_batched", "iter_batched", "iter_filtered", "list"])
def test_a_legacy_skip_lands_where_stocks_next_loop_lands(form):
  """A stock checkpoint resumes by skipping whole elements of the input, in the unit the
  input yields: after `to_iter_dataset().batch(2)` Grain's `next_index` counts rows, so an
  O(1) seek there would land mid-batch (issue 31, cases 1 and 2: R02 R03 trained twice)."""
  source = grain.MapDataset.range(12).map(_row)
  forms = {
      "map_batched": lambda: source.batch(2),
      "iter_batched": lambda: source.repeat(1).to_iter_dataset().batch(2),
      # Tunix's CLI form filters before batching: only a replay knows where batch k starts.
      "iter_filtered": lambda: source.filter(lambda r: r["answer"] != "3").to_iter_dataset().batch(2),
      "list": lambda: [{"prompts": [f"P{2 * i:02d}", f"P{2 * i + 1:02d}"]} for i in range(6)],
  }
  stock = iter(forms[form]())
  for _ in range(2):
    next(stock)  # what stock Tunix does: next() as many times as it trained
  skipped = _input.make_source(forms[form]())
  skipped.skip_full_batches(2)
  assert list(next(skipped)["prompts"]) == list(next(stock)["prompts"])


def test_a_legacy_skip_of_a_map_dataset_reads_nothing():
  produced = []

  def counted(index):
    produced.append(index)
    return _row(index)

  source = _input.make_source(grain.MapDataset.range(12).map(counted).batch(2))
  source.skip_full_batches(3)
  assert list(next(source)["prompts"]) == ["P06", "P07"]
  assert produced == [6, 7]


def test_a_pending_example_of_another_tunix_is_refused_naming_both_versions(tmp_path):
  """Issue 31, case 5: when a field only the writing Tunix has holds a value, the refusal names
  the Tunix that wrote the step (recorded in its settings) and this one, not corruption."""
  import json  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _files, errors, state as state_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _api, _items  # pylint: disable=g-import-not-at-top
  from tunix.rl import common  # pylint: disable=g-import-not-at-top

  example = common.TrainExample(*[np.zeros((1, 2), np.float32)] * 7)
  item = tmp_path / "data"
  _write_state(item, state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "GRPOLearner", "settings": "beta=0.04,tunix_version='9.9.9'"},
      position={"next_index": 1}, pending=state_lib.Pending(items=(example,), schedule=(0,)),
      counters={"train_steps": 3}))
  header_path = _files.header_path(str(item), 0, 1)
  with open(header_path) as f:
    header = json.load(f)
  header["pending"]["groups"][0]["structure"]["fields"]["future_field"] = {"list": []}  # set on the writer's side
  with open(header_path, "w") as f:
    json.dump(header, f)
  with pytest.raises(errors.PendingTypeError) as refused:
    _items.read_step_state(str(item), 3, learner_field="learner", writer="w")
  message = str(refused.value)
  assert "holds ['future_field']" in message and "google-tunix 9.9.9" in message
  assert f"runs google-tunix {_api.tunix_version()}" in message and "global-step boundary" in message
