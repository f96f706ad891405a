"""The learners' input positions (ckpt_iter/tunix/_input.py), without a Tunix run."""

import ast
import json
import re

import grain
import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import ckpt_iter
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _input

RECORDS = [{"prompts": f"prompt {i}", "answer": str(i)} for i in range(8)]


def _rebatch(full_batches, size):
  """Rows of full batches re-cut into micro-batches of `size` (Tunix carries rows over too)."""
  for batch in full_batches:
    rows = len(batch["prompts"])
    for start in range(0, rows, size):
      yield {k: v[start:start + size] for k, v in batch.items()}


def _restore(micro, position, origin="test"):
  """What a learner's restore does with its saved position: the input's state to the input, unchanged."""
  own = {k: v for k, v in position.items() if k != _input.INPUT}
  state_lib.check_micro_batch_position(own, origin)
  micro.apply(micro.source.check(position[_input.INPUT], allow_drift=frozenset(), origin=origin), own)


def _input_at(position=None):
  dataset = ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=1)
  micro = _input.MicroBatchInput(_input.make_source(dataset), 1, _rebatch)
  if position is not None:
    _restore(micro, position)
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
  saved, saved_input = {"num_iterations": 2}, one.state_part()
  two = _input.make_source(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=2))
  checked = _input.check_learner_state(
      saved, {"num_iterations": 2}, two, saved_input, allow_drift=frozenset(), origin="test")
  two.apply(checked)
  assert two.position() == {"next_record": 8}
  assert list(next(two)["prompts"]) != [] and two.position() == {"next_record": 10}
  with pytest.raises(ckpt_iter.ConfigDriftError, match="num_iterations"):
    _input.check_learner_state(
        saved, {"num_iterations": 3}, two, saved_input, allow_drift=frozenset(), origin="test")


def test_a_learner_hands_its_input_the_saved_state_unchanged():
  """The nested state read from disk is what the input's own restore receives: no re-wrap."""
  received = []

  class Spy(ckpt_iter.DataIterator):
    def check_restore(self, state, **kwargs):
      received.append(state)
      return super().check_restore(state, **kwargs)

  dataset = ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=3, num_epochs=1)
  micro = _input.MicroBatchInput(_input.make_source(Spy(dataset)), 1, _rebatch)
  for _ in range(3):
    micro.next_micro_batch()
  saved_input, _ = _saved_learner_state(micro, micro.position())
  _restore(_input.MicroBatchInput(_input.make_source(Spy(dataset)), 1, _rebatch),
           {_input.INPUT: saved_input, "micro_batches_taken": 1})
  assert received[-1] is saved_input


def test_a_learners_working_position_is_its_saved_form():
  """In memory the position nests the input's IteratorState, as the checkpoint holds it:
  a round trip through the file form gives back an equal position, the content record included."""
  micro = _input_at()
  for _ in range(3):
    micro.next_micro_batch()
  position = micro.position()
  assert isinstance(position[_input.INPUT], state_lib.IteratorState)
  assert position[_input.INPUT].kind == "data" and position[_input.INPUT].position == {"next_record": 2}
  value = state_lib.IteratorState(kind="tunix", fingerprint={"learner": "GRPOLearner"}, position=position)
  read = state_lib.IteratorState.from_dict(json.loads(json.dumps(value.to_dict())), origin="test")
  assert read.position == value.position and read.part.content == position[_input.INPUT].content


def _write_state(directory, value):
  from ckpt_iter import _item as item_lib
  from ckpt_iter.tunix import _items

  directory.mkdir()
  header, arrays = item_lib.snapshot(_items.Snapshot(value))
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


@pytest.mark.parametrize("form", ["make_dataset", "map_batched", "iter_batched", "iter_filtered", "list"])
def test_a_legacy_skip_lands_where_stocks_next_loop_lands(form):
  """A stock checkpoint resumes by skipping whole elements of the input, in the unit the
  input yields: after `to_iter_dataset().batch(2)` Grain's `next_index` counts rows, so an
  O(1) seek there would land mid-batch (issue 31, cases 1 and 2: R02 R03 trained twice)."""
  source = grain.MapDataset.range(12).map(_row)
  forms = {
      # Its position counts stream records; its iterator skips batches by index (DataIterator.skip).
      "make_dataset": lambda: ckpt_iter.make_dataset([_row(i) for i in range(12)], batch_size=2, seed=None,
                                                     num_epochs=1),
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


# --- the content check of a learner's input -------------------------------------


def _vocabulary_input(vocabulary_file, micro_batch_size=1):
  """Prompts tokenized with a vocabulary file, in full batches of 2, read as a learner reads them."""
  def tokenize(record):
    with open(vocabulary_file) as f:
      vocabulary = json.load(f)
    return {"prompts": record["prompts"],
            "tokens": np.array([vocabulary[w] for w in record["prompts"].split()], np.int32)}

  records = [{"prompts": "a b" if i % 2 else "b a"} for i in range(12)]
  dataset = ckpt_iter.make_dataset(records, batch_size=2, seed=0, num_epochs=1, transform=tokenize)
  return _input.MicroBatchInput(_input.make_source(dataset), micro_batch_size, _rebatch)


def _saved_learner_state(micro, position):
  """(the input's state, the learner's own fields) of a position saved by an RL learner and read back."""
  del micro
  value = state_lib.IteratorState(kind="tunix", fingerprint={"learner": "GRPOLearner"}, position=position)
  read = state_lib.IteratorState.from_dict(json.loads(json.dumps(value.to_dict())), origin="test")
  return _input.input_part(read, "test")


def test_a_learner_records_the_full_batch_before_a_position_it_saves_after_reading_ahead(tmp_path):
  """The producer reads ahead of what was trained: the record is of the full batch
  before the saved position, not of the batch read last (a wrong one would be refused
  below, by the same pipeline)."""
  vocabulary, micro = _read_micro_batches(tmp_path, 3)  # one micro-batch into full batch 1
  trained = micro.unsettled_position()
  for _ in range(3):  # the producer reads on, into full batch 3
    micro.next_micro_batch()
  position = _input.settled(trained)
  assert position[_input.INPUT].position == {"next_record": 2} and position["micro_batches_taken"] == 1
  assert position[_input.INPUT].content["check"] == "row"  # make_dataset's batch: its last row
  saved_input, working = _saved_learner_state(micro, position)
  assert saved_input.content == position[_input.INPUT].content
  assert _input.INPUT not in working and working["micro_batches_taken"] == 1

  resumed = _vocabulary_input(str(vocabulary))
  _restore(resumed, {_input.INPUT: saved_input, **working}, origin="t")
  assert resumed.source._iterator.restored_content_check == "same element at index 0 (its last row)"  # pylint: disable=protected-access
  expected = _vocabulary_input(str(vocabulary))
  for _ in range(3):
    expected.next_micro_batch()
  np.testing.assert_array_equal(resumed.next_micro_batch()["tokens"], expected.next_micro_batch()["tokens"])


def _read_micro_batches(tmp_path, count):
  """(the vocabulary file, an input that read `count` micro-batches tokenized with it)."""
  vocabulary = tmp_path / "vocab.json"
  vocabulary.write_text(json.dumps({"a": 1, "b": 2}))
  micro = _vocabulary_input(str(vocabulary))
  for _ in range(count):
    micro.next_micro_batch()
  return vocabulary, micro


def test_a_changed_vocabulary_behind_a_learners_unchanged_input_is_refused_naming_the_field(tmp_path):
  vocabulary, micro = _read_micro_batches(tmp_path, 5)
  position = micro.position()
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  changed = _vocabulary_input(str(vocabulary))
  assert changed.source.fingerprint == micro.source.fingerprint  # the definition did not change
  with pytest.raises(errors.ContentDriftError) as raised:
    _restore(changed, position, origin="checkpoint step 3")
  assert "field 'tokens'" in str(raised.value) and "checkpoint step 3" in str(raised.value)
  assert changed.position()[_input.INPUT].position == {"next_record": 0}  # refused before anything moved


def test_a_restored_learner_input_carries_its_record_to_the_next_save(tmp_path):
  """Saved again before reading anything (the restored repeats fill the step), the
  state holds the restored record, which a second restore still checks."""
  vocabulary, micro = _read_micro_batches(tmp_path, 4)
  position = micro.position()
  resumed = _vocabulary_input(str(vocabulary))
  _restore(resumed, position, origin="t")
  assert resumed.position() == position
  assert resumed.position()[_input.INPUT].content == position[_input.INPUT].content
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  with pytest.raises(errors.ContentDriftError):
    _restore(_vocabulary_input(str(vocabulary)), resumed.position(), origin="t")


def test_a_hostile_input_content_record_is_refused_naming_the_nested_field():
  fingerprint = {"source": "x"}
  for bad in (5, {"check": 3}, {"check": "index", "digest": "d", "fields": {"a": 1}}, {"extra": "x"}):
    header = {"format_version": 4, "kind": "tunix", "fingerprint": {"learner": "GRPOLearner"}, "position": {
        "input": {"kind": "data", "fingerprint": fingerprint, "position": {"next_index": 1}, "content": bad},
        "micro_batches_taken": 0}, "counters": {}}
    with pytest.raises(errors.InvalidStateError, match=r"checkpoint step 2 \(position\.input\): field 'content'"):
      state_lib.IteratorState.from_dict(header, origin="checkpoint step 2")


def test_a_position_that_nests_no_input_state_is_refused_naming_the_field():
  value = state_lib.IteratorState(kind="tunix", fingerprint={"learner": "GRPOLearner"},
                                  position={"full_batch": {"next_index": 1}, "micro_batches_taken": 0})
  with pytest.raises(errors.InvalidStateError, match=r"checkpoint step 2: field 'position' is .*'input'"):
    _input.input_part(value, "checkpoint step 2")
  sft = state_lib.IteratorState(kind="tunix", fingerprint={"trainer": "PeftTrainer"}, position={
      "input": {"kind": "data", "fingerprint": {}, "position": {"next_index": 1}}, "micro_batches_taken": 0})
  with pytest.raises(errors.InvalidStateError, match="field 'position'"):
    _input.input_part(sft, "checkpoint step 2", learner_fields=False)
  with pytest.raises(errors.InvalidStateError, match="'micro_batches_taken': N"):
    state_lib.check_micro_batch_position({"micro_batches_taken": -1}, "checkpoint step 2")


def test_an_sft_trainers_input_records_the_example_it_trained_last(tmp_path):
  """The SFT feed reads no further than the trainer: the record is of its last element."""
  vocabulary = tmp_path / "vocab.json"
  vocabulary.write_text(json.dumps({"a": 1, "b": 2}))
  source = _vocabulary_input(str(vocabulary)).source
  for _ in range(3):
    next(source)
  saved = _input.settled_state(source.state())
  assert saved == source._iterator.state_part()  # pylint: disable=protected-access  (nothing read ahead)
  assert saved.position == {"next_record": 6} and saved.content["check"] == "row"
  value = state_lib.IteratorState(kind="tunix", fingerprint={"trainer": "PeftTrainer"}, position={"input": saved})
  saved_input, own = _input.input_part(value, "t", learner_fields=False)
  assert own == {} and saved_input is saved
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  with pytest.raises(errors.ContentDriftError, match="index 2"):
    _vocabulary_input(str(vocabulary)).source.check(saved_input, allow_drift=(), origin="t")


def test_a_skip_declared_once_survives_every_later_restart():
  """Issue 47 (3): the skips a restore merges are in every later saved state.

  A skip declared at one restart and not declared again: the input's state
  saved after the next restart must still carry it, else the restart after
  that trains the skipped records. The input took its state's fingerprint
  from the iterator before the restore (without the merged skips)."""
  records = [{"prompts": f"prompt {i}", "answer": str(i)} for i in range(24)]

  def input_at(position=None, skip=None):
    dataset = ckpt_iter.make_dataset(records, batch_size=2, seed=3, num_epochs=1, skip=skip)
    micro = _input.MicroBatchInput(_input.make_source(dataset), 1, _rebatch)
    if position is not None:
      _restore(micro, position)
    return micro

  def read(micro, count):
    return [str(micro.next_micro_batch()["prompts"][0]) for _ in range(count)]

  uninterrupted = input_at(skip=[(8, 12)])
  expected = read(uninterrupted, 20)
  run = input_at()
  trained = read(run, 4)
  run = input_at(_settled(run.position()), skip=[(8, 12)])  # declared once, here
  trained += read(run, 4)
  for _ in range(3):  # later restarts with the pipeline as first built
    saved = _settled(run.position())
    assert saved[_input.INPUT].fingerprint.get("skips"), "the saved state lost the declared skip"
    run = input_at(saved)
    trained += read(run, 4)
  assert trained == expected


def _settled(position):
  return _input.settled(position)


class _CountingStream:
  """A stream with its own state (as a Hugging Face IterableDataset has): the next index."""

  def __init__(self, count):
    self._count, self._next, self.loads = count, 0, 0

  def __iter__(self):
    while self._next < self._count:
      self._next += 1
      yield {"prompts": f"prompt {self._next - 1}", "answer": str(self._next - 1)}

  def state_dict(self):
    return {"next": self._next}

  def load_state_dict(self, state):
    self.loads += 1
    self._next = state["next"]


def test_a_streaming_iterator_as_train_ds_resumes_through_its_own_state_with_no_replay():
  """A learner given ckpt_iter.StreamingIterator restores it in O(1): one load_state_dict, nothing re-read."""

  def make():
    stream = _CountingStream(12)
    return stream, _input.MicroBatchInput(
        _input.make_source(ckpt_iter.StreamingIterator(stream, batch_size=2)), 1, _rebatch)

  def drain(micro):
    rows = []
    while True:
      try:
        rows.append(str(micro.next_micro_batch()["prompts"][0]))
      except StopIteration:
        return rows

  _, whole = make()
  uninterrupted = drain(whole)
  assert len(uninterrupted) == 12
  stream, first = make()
  assert isinstance(first.source, _input.GrainSource)
  trained = [str(first.next_micro_batch()["prompts"][0]) for _ in range(5)]  # mid full batch
  position = first.position()
  stream, second = make()
  read_before = stream.state_dict()["next"]
  _restore(second, position)
  assert stream.loads == 1 and read_before == 0
  trained += drain(second)
  assert trained == uninterrupted  # each row once, in the uninterrupted order


class _PromptStream:
  """A stream with state_dict()/load_state_dict(): its state is the next prompt."""

  def __init__(self):
    self.next = 0

  def __iter__(self):
    while self.next < 40:
      self.next += 1
      yield {"prompts": f"prompt {self.next - 1}", "answer": str(self.next - 1)}

  def state_dict(self):
    return {"next": self.next}

  def load_state_dict(self, state):
    self.next = state["next"]


def test_one_refusal_names_every_field_a_learner_batch_change_over_a_stream_needs():
  # issue 60 item 7: the first refusal named the learner's geometry fields; following it met a second
  # refusal asking for the stream's batch_size.
  saved_stream = ckpt_iter.StreamingIterator(_PromptStream(), batch_size=4)
  for _ in range(3):
    next(saved_stream)
  learner = {"learner": "GRPOLearner", "full_batch_size": 4, "mini_batch_size": 4, "train_micro_batch_size": 4}
  changed = {"learner": "GRPOLearner", "full_batch_size": 8, "mini_batch_size": 8, "train_micro_batch_size": 8}
  source = _input.make_source(ckpt_iter.StreamingIterator(_PromptStream(), batch_size=8))
  with pytest.raises(errors.ConfigDriftError) as refusal:
    _input.check_learner_state(learner, changed, source, saved_stream.state(), allow_drift=frozenset(),
                               origin="checkpoint step 3")
  assert set(refusal.value.differences) == {"full_batch_size", "mini_batch_size", "train_micro_batch_size",
                                            "batch_size"}
  way = re.search(r"allow_drift=(\{[^}]*\})", str(refusal.value)).group(1)
  apply = _input.check_learner_state(learner, changed, source, saved_stream.state(), allow_drift=frozenset(
      ast.literal_eval(way)), origin="checkpoint step 3")
  apply()
