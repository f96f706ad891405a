"""ReplayIterator: a plain iterable's position, restored by replaying it (any Python, no Tunix).

A Tunix learner given a list or a generator of batches reads it through one;
a restore reads the saved count again and refuses a stream whose last
replayed element differs from the one the saved run read last.
"""

import json

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _drift
from ckpt_iter import replay
from ckpt_iter import testing


def _batch(ids):
  return {"ids": np.asarray(ids, np.int32), "prompts": [f"p{i}" for i in ids]}


def _replay_source(iterable):
  return replay.ReplayIterator(iterable)


def _read(source, count):
  return [next(source) for _ in range(count)]


def _batches(count, changed_at=None):
  return [_batch([i, i + 100] if i != changed_at else [i, -1]) for i in range(count)]


def _restore(source, position, origin="the input"):
  value = ckpt_iter.IteratorState(kind="data", fingerprint=source.fingerprint, position=position)
  source.check_restore(value, origin=origin)()


def _maker(one_shot):
  return (lambda b: (x for x in b)) if one_shot else list


def _position_after_three(make):
  saving = _replay_source(make(_batches(6)))
  _read(saving, 3)
  return saving.position()


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_a_replayed_iterable_resumes_after_the_batch_it_saved_last(one_shot):
  make = _maker(one_shot)
  position = _position_after_three(make)
  assert position == {"full_batches_read": 3, _drift.REPLAY_DIGEST_FIELD: _drift.batch_digest(_batches(6)[2])}
  restored = _replay_source(make(_batches(6)))
  restored.peek()  # as a learner does when it is built
  _restore(restored, json.loads(json.dumps(position)))
  assert restored.position() == position
  testing.assert_trees_equal(_read(restored, 3), _batches(6)[3:])


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_another_iterable_of_the_same_type_is_refused_and_a_list_is_unchanged(one_shot):
  make = _maker(one_shot)
  position = _position_after_three(make)
  other = _batches(6, changed_at=2)  # differs in the last batch the saving run read
  restored = _replay_source(make(other))
  # The type name alone cannot tell.
  assert restored.fingerprint == _replay_source(make(_batches(6))).fingerprint
  restored.peek()
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _restore(restored, position)
  field = _drift.REPLAY_DIGEST_FIELD
  saved, here = position[field], _drift.batch_digest(other[2])
  assert info.value.differences == {field: (saved, here)}
  assert f"{field}={saved!r}" in str(info.value) and f"{field}={here!r}" in str(info.value)
  assert restored.position() == {"full_batches_read": 0}
  if one_shot:
    # Read by the replay (not buffered): it refuses to yield from the wrong place.
    assert "pass a new one" in str(info.value)
    with pytest.raises(ckpt_iter.CkptIterError, match="read by a refused restore"):
      next(restored)
  else:
    # Nothing changed: the list is read from its first batch.
    testing.assert_trees_equal(_read(restored, 6), other)


def test_a_shorter_iterable_is_refused_naming_the_count():
  saving = _replay_source(_batches(6))
  _read(saving, 5)
  restored = _replay_source(_batches(3))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _restore(restored, saving.position())
  assert info.value.differences == {"full_batches_read": (5, 3)}
  testing.assert_trees_equal(_read(restored, 3), _batches(3))


def test_what_the_last_batch_digest_does_not_see():
  saving = _replay_source(_batches(6))
  _read(saving, 3)
  position = saving.position()
  # A state written before the field existed is not checked.
  old = _replay_source(_batches(6, changed_at=2))
  _restore(old, {"full_batches_read": 3})
  testing.assert_trees_equal(_read(old, 1), [_batches(6)[3]])
  # Nor is a difference before the last batch the saving run read.
  earlier = _replay_source(_batches(6, changed_at=1))
  _restore(earlier, position)
  testing.assert_trees_equal(_read(earlier, 1), [_batches(6)[3]])


def test_a_malformed_replay_position_is_refused():
  source = _replay_source(_batches(2))
  for position in ({"full_batches_read": 1, _drift.REPLAY_DIGEST_FIELD: 7}, {"full_batches_read": 1, "x": 1}):
    with pytest.raises(ckpt_iter.InvalidStateError):
      _restore(source, position)
  assert source.position() == {"full_batches_read": 0}


def test_its_state_round_trips_through_grains_dict_form_and_a_checkpoint_header():
  saving = _replay_source(_batches(5))
  _read(saving, 2)
  state = saving.get_state()
  assert state["kind"] == "data" and state["position"]["full_batches_read"] == 2
  restored = _replay_source(_batches(5))
  restored.set_state(json.loads(json.dumps(state)))
  testing.assert_trees_equal(_read(restored, 3), _batches(5)[2:])
  with pytest.raises(ckpt_iter.InvalidStateError, match="'repeat' iterator"):
    _replay_source(_batches(5)).restore_state(
        ckpt_iter.IteratorState(kind="repeat", fingerprint=saving.fingerprint, position=saving.position()))


def test_an_orbax_step_saves_and_restores_it(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  saving = _replay_source(_batches(6))
  _read(saving, 2)
  with ocp.CheckpointManager(str(tmp_path)) as manager:
    manager.save(2, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(saving)))
    manager.wait_until_finished()
    restored = _replay_source(_batches(6))
    manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(restored)))
  testing.assert_trees_equal(_read(restored, 4), _batches(6)[2:])
  with ocp.CheckpointManager(str(tmp_path)) as manager:
    with pytest.raises(ckpt_iter.ConfigDriftError, match="last_batch_digest"):
      manager.restore(2, args=ocp.args.Composite(
          data=ckpt_iter.IteratorRestore(_replay_source(_batches(6, changed_at=1)))))
