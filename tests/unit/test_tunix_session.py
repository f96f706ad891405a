"""Rules of the RL learner's data session (ckpt_iter.tunix._session), without a Tunix run."""

import types

import hypothesis
from hypothesis import strategies as st
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
    ({"full_batch": {"next_index": 3}, "micro_batches_taken": 0}, 2, 1,
     {"full_batch": {"next_index": 3}, "micro_batches_taken": 0}),
    # Two micro-batches of 2 taken: 4 rows, four micro-batches of 1.
    ({"full_batch": {"next_index": 3}, "micro_batches_taken": 2}, 2, 1,
     {"full_batch": {"next_index": 3}, "micro_batches_taken": 4}),
    # Three rows taken (uneven) with a micro-batch of 2: one whole and a row over.
    ({"full_batch": {}, "micro_batches_taken": 1, "rows_taken": 3}, 1, 2,
     {"full_batch": {}, "micro_batches_taken": 1, "rows_taken": 3}),
    # The same size, or a position the input's check must refuse: unchanged.
    ({"full_batch": {}, "micro_batches_taken": 2}, 2, 2, {"full_batch": {}, "micro_batches_taken": 2}),
    ({"full_batch": {}, "micro_batches_taken": "2"}, 2, 1, {"full_batch": {}, "micro_batches_taken": "2"}),
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
