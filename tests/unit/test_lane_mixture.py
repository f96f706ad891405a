"""A filtered or packed mixture's shares over the stream (`ckpt_iter/_lane_mixture.py`).

The run-level property (drawn pods, weights and sources changed at
restarts, every record once) is `tests/property/test_packed_mixture_changes.py`.
"""

import os

import hypothesis
from hypothesis import strategies as st
import pytest

import ckpt_iter
from ckpt_iter import _item
from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import state as state_lib

import support

SOURCES = {"a": [{"id": 1000 + i} for i in range(97)], "b": [{"id": 2000 + i} for i in range(89)],
           "c": [{"id": 3000 + i} for i in range(83)]}


def _pipeline(weights, index=0, count=1):
  return ckpt_iter.make_dataset({name: SOURCES[name] for name in weights}, weights=weights, batch_size=4 // count,
                                seed=5, num_epochs=None, filter=lambda record: True, chunk_size=3, num_lanes=4,
                                shard_index=index, shard_count=count)


def _save(directory, iterators):
  os.makedirs(directory)
  for index, iterator in enumerate(iterators):
    checkpoint_lib.IteratorCheckpointHandler(index, len(iterators)).save(directory, ckpt_iter.IteratorSave(iterator))


def _restored(directory, weights, index=0, count=1):
  iterator = ckpt_iter.DataIterator(_pipeline(weights, index, count))
  checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
      directory, ckpt_iter.IteratorRestore(iterator, elastic=True, allow_drift={"weights", "sources"}))
  return iterator


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(changes=st.lists(st.tuples(st.integers(0, 40), st.dictionaries(
    st.sampled_from("abc"), st.integers(1, 4), min_size=1)), max_size=5))
def test_every_source_continues_from_its_own_count_across_the_segments(changes):
  schedule = _lane_mixture.Schedule.initial({"a": 1, "b": 2})
  for reached, shares in changes:
    schedule = schedule.changed(reached, shares, origin="test")
  again = _lane_mixture.Schedule.from_json(schedule.to_json(), schedule.last.shares, origin="test")
  given = {}
  for record in range(schedule.last.since_record + 60):
    name, index = again.source_of(record)
    assert index == given.get(name, 0), f"record {record}: source {name} gave {index} after {given.get(name, 0)}"
    given[name] = index + 1
  starts = [s.since_record for s in again.segments]
  assert starts == sorted(set(starts)) and starts[0] == 0


def test_a_change_before_the_last_one_is_reached_replaces_it():
  # The lanes never reached record 30: the shares set there were never read and are replaced.
  schedule = _lane_mixture.Schedule.initial({"a": 1}).changed(30, {"a": 1, "b": 1}, origin="test")
  replaced = schedule.changed(12, {"a": 3, "b": 1}, origin="test")
  assert [s.since_record for s in replaced.segments] == [0, 30]
  assert dict(replaced.last.shares) == {"a": 3, "b": 1} and replaced.last.since == {"a": 30, "b": 0}


@pytest.mark.parametrize("value, fragment", [
    ("x", "must be 1-32 segments"),
    ([], "must be 1-32 segments"),
    ([{"since_record": 3, "shares": [["a", 1]], "since": {}}], "the first from record 0"),
    ([{"since_record": 0, "shares": [["a", 1]], "since": {}},
      {"since_record": 0, "shares": [["a", 1], ["b", 1]], "since": {"a": 0}}], "in increasing order"),
    ([{"since_record": 0, "shares": [["a", 2]], "since": {}}], "the last with the fingerprint's weights"),
    ([{"since_record": 0, "shares": [["a", 1], ["a", 1]], "since": {}}], "must be 1-32 segments"),
    ([{"since_record": 0, "shares": [["a", -1]], "since": {}}], "must be positive integers"),
])
def test_an_edited_schedule_is_refused_naming_the_field(value, fragment):
  with pytest.raises(ckpt_iter.InvalidStateError, match="mixture|weight") as refusal:
    _lane_mixture.Schedule.from_json(value, {"a": 1}, origin="the state")
  assert fragment in str(refusal.value)


def _changed_run(tmp_path):
  """A one-process run saved under a:1, b:1, restored under a:1, b:2, c:1 and saved again: (step, batches read,
  and the 3 batches read after)."""
  first = ckpt_iter.DataIterator(_pipeline({"a": 1, "b": 1}))
  read = [support.batch_ids(next(first)) for _ in range(5)]
  _save(os.path.join(tmp_path, "1"), [first])
  resumed = _restored(os.path.join(tmp_path, "1"), {"a": 1, "b": 2, "c": 1})
  read += [support.batch_ids(next(resumed)) for _ in range(7)]
  _save(os.path.join(tmp_path, "2"), [resumed])
  return os.path.join(tmp_path, "2"), read, [support.batch_ids(next(resumed)) for _ in range(3)]


def test_which_names_the_records_of_the_last_batch_under_the_shares_they_were_mixed_with(tmp_path):
  step, read, after = _changed_run(tmp_path)
  state = _item.read_item(step, 0, 1).value
  assert _lane_mixture.MIXTURE in state.position
  batch = ckpt_iter.which(_pipeline({"a": 1, "b": 2, "c": 1}), state)
  named = {SOURCES[r.source][r.index]["id"] for r in batch.records}
  # The records of the chunks the last batch's rows came from: its own, the rest read before or after.
  assert set(read[-1]) <= named <= {i for ids in read + after for i in ids}


def test_verify_refuses_an_edited_schedule_as_the_restore_does(tmp_path):
  step, _, _ = _changed_run(tmp_path)
  state = _item.read_item(step, 0, 1).value
  edited = state_lib.IteratorState.from_dict({
      **state.to_dict(), "position": {**state.position, _lane_mixture.MIXTURE: state.position["mixture"][:1]}})
  with pytest.raises(ckpt_iter.InvalidStateError, match="lanes position field 'mixture'"):
    state_lib.input_stream_skips(edited, origin="the state")
  iterator = ckpt_iter.DataIterator(_pipeline({"a": 1, "b": 2, "c": 1}))
  with pytest.raises(ckpt_iter.InvalidStateError, match="lanes position field 'mixture'"):
    _item.check_restore_into(iterator, edited, origin="the state")


def test_one_process_of_several_restored_without_its_checkpoint_is_told_where_the_lanes_are_read(tmp_path):
  iterators = [ckpt_iter.DataIterator(_pipeline({"a": 1, "b": 1}, i, 2)) for i in range(2)]
  for _ in range(3):
    for iterator in iterators:
      next(iterator)
  _save(os.path.join(tmp_path, "1"), iterators)
  state = _item.read_item(os.path.join(tmp_path, "1"), 0, 2).value
  with pytest.raises(ckpt_iter.ConfigDriftError, match="restore it from its checkpoint directory") as refusal:
    _item.check_restore_into(ckpt_iter.DataIterator(_pipeline({"a": 2, "b": 1}, 0, 2)), state,
                             allow_drift={"weights"}, origin="the state")
  assert "rebuild the pipeline with the saved weights and sources" in str(refusal.value)  # a way a learner can take
  # Through the checkpoint (every process's lanes read): each process resumes.
  resumed = [_restored(os.path.join(tmp_path, "1"), {"a": 2, "b": 1}, i, 2) for i in range(2)]
  assert all(_records.LANES in r.get_state()["position"] for r in resumed)
