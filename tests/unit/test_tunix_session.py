"""Rules of the RL learner's data session (ckpt_iter.tunix._session), without a Tunix run."""

import types

import hypothesis
from hypothesis import strategies as st
import re

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter.tunix import _session


def _tunix_rolls_out_before_sync(
    *, remaining_mini_batches, pending_inputs, has_eval_input, evaluates, eval_every_n_steps,
    train_steps, gradient_accumulation_steps):
  """Tunix's loop after the checkpoint, step by step, up to the next weight sync.

  Each pending trainer input of the current mini-batch checks for an evaluation
  (`eval_ds and not curr_eval_ds and train_steps % eval_every_n_steps == 0`),
  is trained, and every gradient_accumulation_steps inputs make an update.
  Then each remaining mini-batch of the global step is rolled out.
  """
  for index in range(pending_inputs):
    if evaluates and not has_eval_input and train_steps % eval_every_n_steps == 0:
      return True  # an evaluation rollout
    if (index + 1) % gradient_accumulation_steps == 0:
      train_steps += 1
  return remaining_mini_batches > 0


@hypothesis.given(
    remaining_mini_batches=st.integers(0, 3),
    pending_inputs=st.integers(0, 12),
    has_eval_input=st.booleans(),
    evaluates=st.booleans(),
    eval_every_n_steps=st.integers(1, 7),
    train_steps=st.integers(0, 40),
    gradient_accumulation_steps=st.integers(1, 4),
)
def test_rollout_weights_are_needed_exactly_where_tunix_rolls_out_before_the_sync(**case):
  hypothesis.assume(case["pending_inputs"] % case["gradient_accumulation_steps"] == 0)
  expected = _tunix_rolls_out_before_sync(**case)
  assert _session.rollout_reads_before_sync(**case, packed=False) == expected


@pytest.mark.parametrize("case, needed", [
    # One mini-batch per global step, no evaluation: the rest trains on pending inputs.
    (dict(remaining_mini_batches=0, pending_inputs=1, evaluates=False), False),
    # A later mini-batch of this global step rolls out with these weights.
    (dict(remaining_mini_batches=1, pending_inputs=0, evaluates=False), True),
    # The next update (train step 4) evaluates, and the mini-batch has no eval input yet.
    (dict(remaining_mini_batches=0, pending_inputs=2, evaluates=True, train_steps=3), True),
    # ...but it has one already: evaluations reuse it.
    (dict(remaining_mini_batches=0, pending_inputs=2, evaluates=True, train_steps=3, has_eval_input=True), False),
    # No remaining update lands on a multiple of eval_every_n_steps.
    (dict(remaining_mini_batches=0, pending_inputs=1, evaluates=True, train_steps=3), False),
    # Packed trainer inputs: their train steps are unknown, so the weights are kept.
    (dict(remaining_mini_batches=0, pending_inputs=1, evaluates=True, train_steps=3, packed=True), True),
])
def test_rollout_weight_cases(case, needed):
  defaults = dict(has_eval_input=False, eval_every_n_steps=2, train_steps=1,
                  gradient_accumulation_steps=1, packed=False)
  assert _session.rollout_reads_before_sync(**{**defaults, **case}) is needed


@pytest.mark.parametrize("position, saved_micro, micro, expected", [
    # At a mini-batch boundary nothing moves.
    ({"micro_batches_taken": 0, "stream_rows": 6}, 2, 1, {"micro_batches_taken": 0, "stream_rows": 6}),
    # Two micro-batches of 2 taken: 4 rows, four micro-batches of 1.
    ({"micro_batches_taken": 2}, 2, 1, {"micro_batches_taken": 4}),
    # Three rows taken (uneven) with a micro-batch of 2: one whole and a row over.
    ({"micro_batches_taken": 1, "rows_taken": 3}, 1, 2, {"micro_batches_taken": 1, "rows_taken": 3}),
    # The same size, or a position the learner's check must refuse: unchanged.
    ({"micro_batches_taken": 2}, 2, 2, {"micro_batches_taken": 2}),
    ({"micro_batches_taken": "2"}, 2, 1, {"micro_batches_taken": "2"}),
])
def test_a_saved_position_is_recounted_in_micro_batches_of_the_new_size(position, saved_micro, micro, expected):
  assert _session._position_in_micro_batches(position, saved_micro, micro) == expected  # pylint: disable=protected-access


def _fingerprint(micro, mini=2):
  return {"full_batch_size": 2, "mini_batch_size": mini, "train_micro_batch_size": micro,
          "rollout_micro_batch_size": micro, "compute_logps_micro_batch_size": micro}


def _resplit(saved, current, pending=None, allow_drift=frozenset()):
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  value = state_lib.IteratorState(kind="tunix", fingerprint=saved, position={}, pending=pending)
  session = types.SimpleNamespace(fingerprint=current)
  return _session.DataSession._resplit_micro_batches(session, value, saved, allow_drift, "step 2")  # pylint: disable=protected-access


def test_a_smaller_micro_batch_is_accepted_only_where_the_mini_batches_stay_and_no_repeat_is_pending():
  from ckpt_iter import errors, state as state_lib  # pylint: disable=g-import-not-at-top

  micro_fields = {"train_micro_batch_size", "rollout_micro_batch_size", "compute_logps_micro_batch_size"}
  assert _resplit(_fingerprint(2), _fingerprint(1)) == micro_fields
  assert _resplit(_fingerprint(2), _fingerprint(2)) == frozenset()
  # Another mini-batch moves the stream: left to the continuation rule (not accepted here).
  assert _resplit(_fingerprint(2, mini=2), _fingerprint(1, mini=1)) == frozenset()
  pending = state_lib.Pending(items=({"a": None},), schedule=(0,))
  with pytest.raises(errors.ConfigDriftError, match="a repeat is in progress.*train_micro_batch_size=2"):
    _resplit(_fingerprint(2), _fingerprint(1), pending=pending)
  assert _resplit(_fingerprint(2), _fingerprint(1), pending=pending, allow_drift=frozenset(micro_fields)) == micro_fields


# --- where a changed input continues (`DataSession._continuation`, the one rule for RL learners) ---

_PROMPTS = [{"prompts": f"P{i:02d}", "answer": str(i)} for i in range(24)]


def _rebatch(full_batches, size):
  for batch in full_batches:
    for start in range(0, len(batch["prompts"]), size):
      yield {k: v[start:start + size] for k, v in batch.items()}


def _record_input(batch_size):
  """make_dataset's pipeline: its position counts stream records."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  return ckpt_iter.make_dataset(_PROMPTS, batch_size=batch_size, seed=None, num_epochs=1)


def _batch_index_input(batch_size, prompts=None):
  """A hand-built MapDataset of batches: its position is Grain's batch index."""
  import grain  # pylint: disable=g-import-not-at-top

  return grain.MapDataset.source(_PROMPTS if prompts is None else prompts).batch(batch_size)


def _session_over(dataset, full_batch_size):
  """A DataSession's data side over `dataset` (full batches of `full_batch_size`, one mini-batch each)."""
  from ckpt_iter.tunix import _input  # pylint: disable=g-import-not-at-top

  session = object.__new__(_session.DataSession)
  session.micro_batch_size = full_batch_size
  session.input = _input.MicroBatchInput(_input.make_source(dataset), None, _rebatch)
  session.fingerprint = {"learner": "GRPOLearner", "num_iterations": 1, **{
      name: full_batch_size for name in _session._CONTINUABLE_LEARNER_FIELDS}}  # pylint: disable=protected-access
  return session


def _saved_after(session, full_batches, pending=None, remaining_mini_batches=0):
  """The learner state a run of `session` saves after `full_batches` global steps."""
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  for _ in range(full_batches):
    session.input.next_micro_batch()
  return state_lib.IteratorState(
      kind="tunix", fingerprint=session.fingerprint, position=session.input.position(), pending=pending,
      counters={"remaining_mini_batches": remaining_mini_batches, "global_steps": full_batches,
                "train_steps": full_batches})


def _continued(value, session):
  """The prompts `session` reads next after restoring `value` (the first three)."""
  apply = session._continuation(value, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access
  apply()
  prompts = []
  while len(prompts) < 3:
    prompts.extend(session.input.next_micro_batch()["prompts"])
  return list(prompts[:3])


@pytest.mark.parametrize("new_size", [2, 3, 4, 5])
def test_another_batch_size_of_a_record_counting_input_continues_at_the_saved_record(new_size):
  """The learner hands the input its saved state; the input's own restore cuts the batches anew."""
  value = _saved_after(_session_over(_record_input(2), 2), full_batches=2)
  assert value.part.position == {"next_record": 4}
  assert _continued(value, _session_over(_record_input(new_size), new_size)) == ["P04", "P05", "P06"]


def test_a_batch_size_that_does_not_divide_the_prompts_consumed_is_refused_for_a_batch_index_input():
  """A hand-built pipeline cannot count records: only the prompt count decides, and 4 prompts are no
  whole number of batches of 3."""
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top

  value = _saved_after(_session_over(_batch_index_input(2), 2), full_batches=2)
  assert value.part.position == {"next_index": 2}
  with pytest.raises(errors.ConfigDriftError, match="not a whole number of this input's batches of 3"):
    _session_over(_batch_index_input(3), 3)._continuation(value, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access
  assert _continued(value, _session_over(_batch_index_input(4), 4)) == ["P04", "P05", "P06"]


# The prompts with prompt 3 edited: the last the saved run (full batches of 2, two of them) trained.
_EDITED = [dict(p, prompts="X03") if i == 3 else p for i, p in enumerate(_PROMPTS)]


def _with_last_rows_of_0_2_0(value):
  """`value` as ckpt_iter 0.2.0 wrote it: its last prompts ("P02", "P03") as a count and that release's digest."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  position = {k: v for k, v in value.position.items() if k != "last_prompts"}
  position["last_rows"] = {"count": 2, "digest": "54a857c2fc97704e"}
  return dataclasses.replace(value, position=position)


@pytest.mark.parametrize("written_by", ["this release", "0.2.0"])
def test_a_hand_built_input_continues_only_where_it_holds_the_prompts_trained_last(written_by):
  """The prompt count continuation compares the prompts before that point with the checkpoint's record
  of them: its content record, or the digest 0.2.0 wrote."""
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top

  value = _saved_after(_session_over(_batch_index_input(2), 2), full_batches=2)
  assert value.position["last_prompts"]["count"] == 2
  assert list(value.position["last_prompts"]["content"]["fields"]) == ["[0]", "[1]"]
  if written_by == "0.2.0":
    value = _with_last_rows_of_0_2_0(value)
  with pytest.raises(errors.ConfigDriftError, match="prompts before row 4 differ from those the checkpoint's run"):
    _session_over(_batch_index_input(4, _EDITED), 4)._continuation(value, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access
  session = _session_over(_batch_index_input(4), 4)
  assert _continued(value, session) == ["P04", "P05", "P06"]
  # The next save records the prompts trained last in this release's form.
  assert set(session.input.position()) == {"input", "micro_batches_taken", "stream_rows", "last_prompts"}


def test_a_malformed_record_of_the_last_prompts_is_refused_naming_the_field():
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  for field, record in [("last_prompts", {"count": 2, "digest": "54a857c2fc97704e"}),
                        ("last_prompts.content", {"count": 2, "content": {"check": 1}}),
                        ("last_rows", {"count": -1, "digest": "54a857c2fc97704e"})]:
    with pytest.raises(errors.InvalidStateError, match=f"field 'position.{field}'"):
      state_lib.check_micro_batch_position(
          {"micro_batches_taken": 0, field.split(".")[0]: record}, "checkpoint step 2")


@pytest.mark.parametrize("make_input", [_record_input, _batch_index_input])
def test_the_batch_geometry_cannot_change_inside_a_global_step(make_input):
  from ckpt_iter import errors, state as state_lib  # pylint: disable=g-import-not-at-top

  pending = state_lib.Pending(items=({"a": None},), schedule=(0,))
  for inside in (dict(pending=pending), dict(remaining_mini_batches=1)):
    value = _saved_after(_session_over(make_input(2), 2), full_batches=2, **inside)
    with pytest.raises(errors.ConfigDriftError, match="falls inside a global step.*full_batch_size"):
      _session_over(make_input(4), 4)._continuation(value, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access


def test_a_changed_learner_field_is_refused_whatever_the_input():
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top

  for make_input in (_record_input, _batch_index_input):
    value = _saved_after(_session_over(make_input(2), 2), full_batches=2)
    session = _session_over(make_input(4), 4)
    session.fingerprint = {**session.fingerprint, "num_iterations": 2}
    with pytest.raises(errors.ConfigDriftError, match="num_iterations"):
      session._continuation(value, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access


_LEARNER_EDITS = [
    ("micro_batches_taken", -1, "field 'position' holds"),
    ("rows_taken", "x", "field 'position.rows_taken' is 'x'"),
    ("stream_rows", "x", "field 'position.stream_rows' is 'x'"),
    ("last_prompts", {"count": -3, "content": None}, "field 'position.last_prompts'"),
    ("extra", 1, "field 'position' holds"),
]


@pytest.mark.parametrize("field, value, words", _LEARNER_EDITS, ids=[e[0] for e in _LEARNER_EDITS])
def test_an_edited_learner_field_is_refused_by_the_restore_and_by_verify_alike(field, value, words, tmp_path,
                                                                              capsys):
  # issue 60 items 4 and 8: verify passed edits the restore refused, and a `stream_rows` of "x" was taken
  # by both (the run then blocked in its data producer). One check now: `state.check_learner_position`.
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib, cli, errors  # pylint: disable=g-import-not-at-top

  saved = _saved_after(_session_over(_record_input(2), 2), full_batches=2)
  edited = dict(saved.position)
  if field == "last_prompts":
    edited[field] = dict(saved.position[field], count=-3)
  else:
    edited[field] = value
  bad = dataclasses.replace(saved, position=edited)
  session = _session_over(_record_input(2), 2)
  with pytest.raises(errors.InvalidStateError, match=re.escape(words)):
    session._continuation(bad, frozenset(), "checkpoint step 2")  # pylint: disable=protected-access

  class Holder:
    def state(self):
      return saved

  item = os.path.join(str(tmp_path), "2", "data")
  os.makedirs(item)
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(Holder()))
  assert cli.main(["verify", str(tmp_path)]) == 0
  capsys.readouterr()
  header_path = os.path.join(item, "process_0-of-1.json")
  header = json.load(open(header_path))
  header["position"][field] = (dict(header["position"][field], count=-3) if field == "last_prompts" else value)
  json.dump(header, open(header_path, "w"))
  assert cli.main(["verify", str(tmp_path)]) == 1
  out, err = capsys.readouterr()
  assert words in out + err and "Traceback" not in out + err, out + err


def test_a_producer_that_fails_is_reported_by_the_next_save_with_its_cause(monkeypatch):
  # issue 60 item 8: the producer's closing bookkeeping raised (a `stream_rows` of "x"), its mini-batch was
  # never marked done, and the first save waited 600 s for it, then said only "did not finish".
  import queue  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  from ckpt_iter import errors, tunix as resumable  # pylint: disable=g-import-not-at-top

  session = _session_over(_record_input(2), 2)
  trainer = types.SimpleNamespace(iter_steps=0, train_steps=0)
  session.learner = types.SimpleNamespace(rl_cluster=types.SimpleNamespace(actor_trainer=trainer, global_steps=0))
  session.index_in_global_step, session.current, session._lock = 0, None, threading.Lock()  # pylint: disable=protected-access
  session._restored_pending, session._restored_eval = None, None  # pylint: disable=protected-access
  session.lineage = None
  session.input._stream_rows_base = "x"  # pylint: disable=protected-access  (as a state the restore took)
  learner = object.__new__(resumable.ResumableGRPOLearner)
  learner._ci_session = session  # pylint: disable=protected-access
  learner._ci_produce = lambda *args: None  # pylint: disable=protected-access  (the rollout: nothing to do here)
  data_queue = queue.Queue()
  with pytest.raises(TypeError):
    resumable.Resumable._prepare_data(learner, None, 1, 1, 1, 2, data_queue)  # pylint: disable=protected-access
  assert data_queue.get_nowait() is None  # the trainer is told the mini-batch ended
  # A short bound, so that a producer left unmarked fails this test ("did not finish") instead of hanging it.
  monkeypatch.setattr(_session, "_PRODUCER_TIMEOUT_SECONDS", 5.0)
  with pytest.raises(errors.CkptIterError, match=r"data producer failed on its mini-batch \(TypeError: "):
    session.snapshot(3)


# --- a learner's position and counters, held by the restore's one check and by verify (issue 64 items 3, 10) ---


def _between_two_mini_batches(step=10):
  """An RL learner's state (full batches of 4, mini-batches of 2, micro-batches of 1) saved after the first
  mini-batch of a global step: two prompts of the full batch taken, one mini-batch remaining."""
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _input  # pylint: disable=g-import-not-at-top

  micro_batches = _input.MicroBatchInput(_input.make_source(_record_input(4)), 1, _rebatch)
  for _ in range(2):
    micro_batches.next_micro_batch()
  fingerprint = {"learner": "GRPOLearner", "num_iterations": 1, "full_batch_size": 4, "mini_batch_size": 2,
                 "train_micro_batch_size": 1, "rollout_micro_batch_size": 1, "compute_logps_micro_batch_size": 1}
  return state_lib.IteratorState(
      kind="tunix", fingerprint=fingerprint, position=micro_batches.position(),
      counters={"train_steps": step, "actor_iter_steps": 2 * step, "global_steps": 5, "remaining_mini_batches": 1,
                "mini_batches_per_global_step": 2})


def _verify_edited(tmp_path, value, edit, step=10):
  """`ckpt-iter verify`'s exit code and output on `value` saved at `step`, its header edited by `edit`."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib, cli  # pylint: disable=g-import-not-at-top

  class Holder:
    def state(self):
      return value

  item = os.path.join(str(tmp_path), str(step), "data")
  os.makedirs(item)
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(Holder()))
  header_path = os.path.join(item, "process_0-of-1.json")
  header = json.load(open(header_path))
  edit(header)
  json.dump(header, open(header_path, "w"))
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    code = cli.main(["verify", str(tmp_path)])
  return code, out.getvalue()


def test_a_state_between_two_mini_batches_is_one_the_geometry_allows(tmp_path):
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  value = _between_two_mini_batches()
  assert value.position["micro_batches_taken"] == 2
  state_lib.check_learner_position(value, "checkpoint step 10", step=10)
  code, out = _verify_edited(tmp_path, value, lambda header: None)
  assert code == 0, out


_GEOMETRY_EDITS = [
    # The rest of the global step never trained (the position past the full batch).
    ("micro_batches_taken 99", lambda h: h["position"].update(micro_batches_taken=99),
     "field 'position.micro_batches_taken' is 99 where full_batch_size=4, mini_batch_size=2"),
    ("rows_taken 999", lambda h: h["position"].update(rows_taken=999),
     "field 'position.rows_taken' is 999"),
    # A prompt dropped, or one trained twice, and every later mini-batch one row off.
    ("micro_batches_taken 3", lambda h: h["position"].update(micro_batches_taken=3),
     "with 1 of the global step's 2 mini-batches remaining, 2 rows of the full batch are taken"),
    ("micro_batches_taken 1", lambda h: h["position"].update(micro_batches_taken=1),
     "with 1 of the global step's 2 mini-batches remaining, 2 rows of the full batch are taken"),
    ("remaining_mini_batches 2", lambda h: h["counters"].update(remaining_mini_batches=2),
     "a global step is 2 mini-batches, fewer of them remaining"),
    # The learner's own counters (issue 64 item 10): verify refuses what the restore refuses.
    ("eval_items 5", lambda h: h["counters"].update(eval_items=5), "counter 'eval_items' is 5"),
    ("eval_items -1", lambda h: h["counters"].update(eval_items=-1), "counter 'eval_items' is -1"),
    ("global_steps removed", lambda h: h["counters"].pop("global_steps"), "counter 'global_steps' is missing"),
    ("remaining_mini_batches removed", lambda h: h["counters"].pop("remaining_mini_batches"),
     "counter 'remaining_mini_batches' is missing"),
    ("train_steps 9 in step 10", lambda h: h["counters"].update(train_steps=9),
     "the data state was taken at train step 9, but the model was restored at step 10"),
]


@pytest.mark.parametrize("name, edit, words", _GEOMETRY_EDITS, ids=[e[0] for e in _GEOMETRY_EDITS])
def test_an_edit_the_restore_refuses_is_refused_by_verify_by_name(tmp_path, name, edit, words):
  import json  # pylint: disable=g-import-not-at-top

  from ckpt_iter import errors, state as state_lib  # pylint: disable=g-import-not-at-top

  value = _between_two_mini_batches()
  code, out = _verify_edited(tmp_path, value, edit)
  assert code == 1 and words in out and "Traceback" not in out, (name, out)
  # The restore's own check (DataSession.restore calls it first) refuses the same edit with the same words.
  header = json.loads(json.dumps(value.to_dict()))
  edit(header)
  with pytest.raises(errors.InvalidStateError, match=re.escape(words)):
    state_lib.check_learner_position(state_lib.IteratorState.from_dict(header, origin="checkpoint step 10"),
                                     "checkpoint step 10", step=10)
