"""StreamingIterator: a stream restored through its own state_dict, in O(1); what cannot resume, refused.

The sources are Hugging Face streaming datasets read from local files (no
network) and a small class of our own with `state_dict`/`load_state_dict`.
"""

import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import ckpt_iter
import conftest
from ckpt_iter import _files
from ckpt_iter import elastic
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import streaming
from ckpt_iter import testing
import support

datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)

NUM_RECORDS = 37  # split over 3 files: 13, 12, 12 (3 shards)


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory):
  directory = tmp_path_factory.mktemp("stream")
  paths, bounds = [], [0, 13, 25, NUM_RECORDS]
  for i in range(3):
    path = directory / f"part-{i}.jsonl"
    path.write_text("".join(json.dumps({"id": n, "tokens": [n, n * 2]}) + "\n"
                            for n in range(bounds[i], bounds[i + 1])))
    paths.append(str(path))
  return paths


_hf = support.hf_stream


def _ids(element):
  return np.atleast_1d(np.asarray(element["id"])).tolist()


def _round_trip(state):
  return ckpt_iter.IteratorState.from_dict(testing.stored_round_trip(state.to_dict()))


class CountingStream:
  """A stream of our own: its state is the next index (and a nested dict, as real ones have)."""

  def __init__(self, count, state_value=None):
    self._count = count
    self._next = 0
    self._state_value = state_value

  def __iter__(self):
    while self._next < self._count:
      self._next += 1
      yield {"id": self._next - 1}

  def state_dict(self):
    if self._state_value is not None:
      return {"next": self._next, "extra": self._state_value}
    return {"next": self._next, "inner": {"kind": "counting", "seen": [self._next]}}

  def load_state_dict(self, state):
    self._next = state["next"]


# ---------------------------------------------------------------------------
# Exact resume, counted over drawn batch sizes, stop points and chained restarts.


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 6), drop_remainder=st.booleans(), mapped=st.booleans(),
       stops=st.lists(st.integers(0, 8), min_size=1, max_size=4))
def test_chained_restarts_train_every_record_once_bit_for_bit(jsonl_files, batch_size, drop_remainder, mapped, stops):
  def make():
    source = _hf(jsonl_files)
    if mapped:
      source = source.map(lambda r: {"square": r["id"] ** 2})
    return streaming.StreamingIterator(source, batch_size=batch_size, drop_remainder=drop_remainder)

  uninterrupted = list(make())
  trained, state = [], None
  for stop in stops:  # each run reads `stop` elements, saves, and the next run starts in a fresh iterator
    run = make()
    if state is not None:
      run.restore_state(_round_trip(state))
    for _ in range(stop):
      try:
        trained.append(next(run))
      except StopIteration:
        break
    state = run.state()
  last = make()
  last.restore_state(_round_trip(state))
  trained.extend(last)
  ids = [i for element in trained for i in _ids(element)]
  assert len(ids) == len(set(ids))  # no record twice
  expected = NUM_RECORDS - (NUM_RECORDS % batch_size if drop_remainder else 0)
  assert sorted(ids) == list(range(expected))  # none skipped
  testing.assert_trees_equal(trained, uninterrupted)  # the same stream, bit for bit
  assert state.position[streaming.RECORDS_READ] <= expected


def test_the_public_checker_passes_at_every_element_of_a_stream(jsonl_files):
  testing.assert_exact_resume(lambda: streaming.StreamingIterator(_hf(jsonl_files), batch_size=5),
                              checkpoint_at=range(8))
  testing.assert_exact_resume(lambda: ckpt_iter.StreamingIterator(CountingStream(9)), checkpoint_at=range(10))


def test_the_state_is_taken_at_the_boundary_of_the_element_yielded_not_a_peek(jsonl_files):
  iterator = streaming.StreamingIterator(_hf(jsonl_files), batch_size=4)
  next(iterator)
  before = iterator.state()
  peeked = iterator.peek()
  assert iterator.state() == before
  assert before.position[streaming.ELEMENTS_READ] == 1 and before.position[streaming.RECORDS_READ] == 4
  resumed = streaming.StreamingIterator(_hf(jsonl_files), batch_size=4)
  resumed.restore_state(_round_trip(before))
  testing.assert_trees_equal(next(resumed), peeked)
  testing.assert_trees_equal(next(iterator), peeked)
  assert iterator.state() == resumed.state()


def test_a_restore_loads_the_state_and_replays_nothing(jsonl_files):
  saving = streaming.StreamingIterator(_hf(jsonl_files), batch_size=2)
  for _ in range(15):
    next(saving)
  source = _hf(jsonl_files)
  reads = []
  original = source.load_state_dict
  source.load_state_dict = lambda state: (reads.append(state), original(state))[1]
  resumed = streaming.StreamingIterator(source, batch_size=2)
  resumed.restore_state(_round_trip(saving.state()))
  assert len(reads) == 1 and resumed.state() == saving.state()
  assert _ids(next(resumed)) == [30, 31]


def test_a_state_of_a_later_epoch_restores_into_that_epoch(jsonl_files):
  source = _hf(jsonl_files)
  source.set_epoch(2)  # Hugging Face reorders its shards each epoch
  saving = streaming.StreamingIterator(source, batch_size=3)
  next(saving)
  state = _round_trip(saving.state())
  expected = list(saving)
  resumed = streaming.StreamingIterator(_hf(jsonl_files), batch_size=3)  # epoch 0 here
  resumed.restore_state(state)
  testing.assert_trees_equal(list(resumed), expected)


def test_a_split_by_node_stream_resumes_per_rank_and_refuses_another_world_size(jsonl_files):
  from datasets.distributed import split_dataset_by_node

  def make(rank, world_size):
    return streaming.StreamingIterator(split_dataset_by_node(_hf(jsonl_files), rank=rank, world_size=world_size),
                                       batch_size=2)

  for rank in range(3):
    testing.assert_exact_resume(lambda rank=rank: make(rank, 3), checkpoint_at=[0, 1, 3])
  saving = make(1, 3)
  next(saving)
  assert saving.fingerprint["shard_index"] == 1 and saving.fingerprint["shard_count"] == 3
  with pytest.raises(errors.ConfigDriftError, match="shard_count=3 there, shard_count=2 here"):
    make(1, 2).restore_state(_round_trip(saving.state()))
  why = elastic.resize_refusal("data", saving.fingerprint)
  assert "streaming source" in why and "saved process count" in why


def test_another_batch_size_is_refused_by_name_and_allowed_continues_at_the_next_record(jsonl_files):
  saving = streaming.StreamingIterator(_hf(jsonl_files), batch_size=4)
  next(saving)
  next(saving)
  resumed = streaming.StreamingIterator(_hf(jsonl_files), batch_size=3)
  with pytest.raises(errors.ConfigDriftError, match=r"batch_size=4 there, batch_size=3 here.*allow_drift"):
    resumed.restore_state(_round_trip(saving.state()))
  resumed.restore_state(_round_trip(saving.state()), allow_drift={"batch_size"})
  assert _ids(next(resumed)) == [8, 9, 10]


def test_another_source_layout_is_refused_naming_the_field(jsonl_files):
  saving = streaming.StreamingIterator(_hf(jsonl_files))
  next(saving)
  state = _round_trip(saving.state())
  with pytest.raises(errors.ConfigDriftError, match="source_shards"):
    streaming.StreamingIterator(_hf(jsonl_files[:2])).restore_state(state)
  with pytest.raises(errors.ConfigDriftError, match="source_pipeline"):
    streaming.StreamingIterator(_hf(jsonl_files).map(lambda r: r)).restore_state(state)


def test_the_state_goes_through_orbax_and_inspect_says_where(jsonl_files, ckpt_dir):
  import support

  saving = streaming.StreamingIterator(_hf(jsonl_files), batch_size=4)
  for _ in range(3):
    next(saving)
  support.orbax_save(ckpt_dir, 3, data=ckpt_iter.IteratorSave(saving))
  header = _files.read_header(str(ckpt_dir / "3" / "data" / "process_0-of-1.json"))  # whole
  assert header["position"][streaming.RECORDS_READ] == 12
  assert header["fingerprint"]["source"] == "stream:hf[json:default:train]"
  resumed = streaming.StreamingIterator(_hf(jsonl_files), batch_size=4)
  support.orbax_restore(ckpt_dir, 3, data=ckpt_iter.IteratorRestore(resumed))
  testing.assert_trees_equal(list(resumed), list(saving))
  assert state_lib.summary_line(ckpt_iter.IteratorState.from_dict(header)) == (
      "3 elements, 12 records read (the stream's own state; restored without replay)")


# ---------------------------------------------------------------------------
# What cannot resume exactly is refused where it is built, saying why and what to do.


@pytest.mark.parametrize("value, field, what", [
    ((1, 2), "source_state.extra", "is a tuple"),
    ({1: 2}, "source_state.extra", "has the key 1 (int)"),
    (np.int64(3), "source_state.extra", "of type int64"),
    (float("nan"), "source_state.extra", "of type float"),
], ids=["tuple", "int-key", "numpy", "nan"])
def test_a_source_state_json_would_change_is_refused_at_save_naming_the_field(value, field, what):
  iterator = streaming.StreamingIterator(CountingStream(3, state_value=value))
  next(iterator)
  with pytest.raises(errors.InvalidArgumentError) as refused:
    iterator.state()
  message = str(refused.value)
  assert f"field {field!r} " in message and what in message and "ReplayIterator" in message


@pytest.mark.parametrize("kwargs, pattern", [
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"batch_size": 2.0}, "batch_size must be a positive integer"),
    ({"drop_remainder": "yes"}, r"drop_remainder='yes'"),
    ({"name": ""}, "name must be a non-empty string"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, pattern):
  with pytest.raises(errors.InvalidArgumentError, match=pattern):
    streaming.StreamingIterator(CountingStream(3), **kwargs)


@pytest.mark.parametrize("position", [
    {"elements_read": 1, "records_read": 1},
    {"elements_read": -1, "records_read": 1, "source_state": {"next": 1}},
    {"elements_read": 2, "records_read": 1, "source_state": {"next": 1}},
    {"elements_read": 1, "records_read": 1, "source_state": [1]},
], ids=["no-source-state", "negative", "fewer-records", "not-a-dict"])
def test_a_bad_position_is_refused_and_changes_nothing(position):
  iterator = streaming.StreamingIterator(CountingStream(5))
  next(iterator)
  before = iterator.state()
  state = ckpt_iter.IteratorState(kind="data", fingerprint=iterator.fingerprint, position=position)
  with pytest.raises(errors.InvalidStateError, match="a streaming source's position is"):
    iterator.restore_state(state)
  assert iterator.state() == before and next(iterator) == {"id": 1}


def test_a_named_stream_is_fingerprinted_by_its_name():
  assert streaming.StreamingIterator(CountingStream(2), name="corpus-v3").fingerprint["source"] == "stream:corpus-v3"
  assert streaming.StreamingIterator(CountingStream(2)).fingerprint["source"].endswith(".CountingStream")


# ---------------------------------------------------------------------------
# A Hugging Face stream's state is checked at restore (issue 57, items 9-11).


def _hf_state_after(files, elements, batch_size=2):
  iterator = streaming.StreamingIterator(_hf(files), batch_size=batch_size)
  for _ in range(elements):
    next(iterator)
  return iterator.state()


def _with_source_state(state, source_state):
  position = dict(state.position, source_state=source_state)
  return ckpt_iter.IteratorState(kind="data", fingerprint=state.fingerprint, position=position)


def _edits(saved):
  inner = saved["examples_iterable"]
  return {
      "empty": {},
      "epoch-text": {**saved, "epoch": "0"},
      "epoch-negative": {**saved, "epoch": -1},
      "epoch-missing": {"examples_iterable": inner},
      "unknown-key": {**saved, "seed": 3},
      "start-again": _hf_state_after.fresh,
      "negative-count": json.loads(json.dumps(saved).replace('"shard_example_idx": ', '"shard_example_idx": -')),
      "other-layer": {**saved, "examples_iterable": {**inner, "type": "MappedExamplesIterable"}},
  }


@pytest.mark.parametrize("edit", ["empty", "epoch-text", "epoch-negative", "epoch-missing", "unknown-key",
                                  "start-again", "negative-count", "other-layer"])
def test_an_edited_hugging_face_source_state_is_refused_and_changes_nothing(jsonl_files, edit):
  _hf_state_after.fresh = streaming.StreamingIterator(_hf(jsonl_files), batch_size=2).position()["source_state"]
  saved = _hf_state_after(jsonl_files, 6)  # 12 records read
  edited = _with_source_state(saved, _edits(dict(saved.position["source_state"]))[edit])
  iterator = streaming.StreamingIterator(_hf(jsonl_files), batch_size=2)
  iterator.restore_state(saved)
  before = iterator.state()
  with pytest.raises(errors.InvalidStateError, match="position.source_state"):
    iterator.restore_state(edited)
  assert iterator.state() == before and _ids(next(iterator)) == [12, 13]
  # verify is the restore's validator: the same field refused from the state alone.
  with pytest.raises(errors.InvalidStateError, match="position.source_state"):
    state_lib.input_stream_skips(_round_trip(edited), origin="step 6")


def test_a_stream_over_files_whose_records_changed_is_refused_with_a_safe_way(jsonl_files, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  copies = []
  for path in jsonl_files:
    copies.append(str(tmp_path / os.path.basename(path)))
    shutil.copy(path, copies[-1])
  saved = _hf_state_after(copies, 4)
  assert saved.fingerprint["source_files_digest"]
  # Same names, same sizes: one record's digits changed.
  text = open(copies[1]).read()
  open(copies[1], "w").write(text.replace('"id": 13,', '"id": 93,', 1))
  iterator = streaming.StreamingIterator(datasets.load_dataset("json", data_files=copies, split="train",
                                                               streaming=True), batch_size=2)
  with pytest.raises(errors.ConfigDriftError) as caught:
    iterator.restore_state(saved)
  message = str(caught.value)
  assert "source_files_digest" in message and "Restore the files the run was saved with" in message
  assert "allow_drift" not in message
  # A state written before streams recorded their files is restored as before.
  old = ckpt_iter.IteratorState(kind="data", position=saved.position, fingerprint={
      k: v for k, v in saved.fingerprint.items() if k != "source_files_digest"})
  iterator.restore_state(old)


def test_a_streaming_iterator_has_state_dict_and_load_state_dict(jsonl_files):
  iterator = streaming.StreamingIterator(_hf(jsonl_files), batch_size=3)
  next(iterator)
  saved = json.loads(json.dumps(iterator.state_dict()))
  expected = _ids(next(iterator))
  again = streaming.StreamingIterator(_hf(jsonl_files), batch_size=3)
  again.load_state_dict(saved)
  assert _ids(next(again)) == expected
