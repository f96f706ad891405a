"""ReplayIterator: a plain iterable's position, restored by replaying it (any Python, no Tunix).

A Tunix learner given a list or a generator of batches reads it through one;
a restore reads the saved count again and refuses a stream whose last
replayed element differs from the one the saved run read last, naming the
first leaf that differs (the content record, `_drift.content_digest`); a
state of ckpt_iter 0.2.0 is checked with the digest it holds.
"""

import json
import os

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _drift
from ckpt_iter import _item as item_lib
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
  assert position == {"full_batches_read": 3, replay.LAST_FIELD: _drift.content_digest(_batches(6)[2])}
  restored = _replay_source(make(_batches(6)))
  restored.peek()  # as a learner does when it is built
  _restore(restored, json.loads(json.dumps(position)))
  assert restored.position() == position
  testing.assert_trees_equal(_read(restored, 3), _batches(6)[3:])


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_another_iterable_of_the_same_type_is_refused_naming_the_leaf_and_a_list_is_unchanged(one_shot):
  make = _maker(one_shot)
  position = _position_after_three(make)
  other = _batches(6, changed_at=2)  # differs in the last batch the saving run read
  restored = _replay_source(make(other))
  # The type name alone cannot tell.
  assert restored.fingerprint == _replay_source(make(_batches(6))).fingerprint
  restored.peek()
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _restore(restored, position)
  # Batch 2's ids differ (and its prompts): the first leaf in the record's order is named.
  saved, here = position["last_batch"]["fields"]["ids"], _drift.content_digest(other[2])["fields"]["ids"]
  assert info.value.differences == {"last_batch.ids": (saved, here)}
  assert f"gives another batch 2: field 'last_batch.ids' has digest {saved} there, {here} here" in str(info.value)
  assert "the same batches in the same order" in str(info.value)
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


def test_what_the_last_batch_record_does_not_see():
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
  # Nor a batch holding an object whose bytes do not define it: the record says so.
  opaque = [{**batch, "meta": object()} for batch in _batches(3)]
  saving = _replay_source(opaque)
  _read(saving, 2)
  assert saving.position()["last_batch"] == {"check": "unavailable: the element holds a object"}
  _restore(_replay_source([{**batch, "meta": object()} for batch in _batches(3, changed_at=1)]), saving.position())


def test_an_object_array_of_strings_is_digested_item_by_item():
  def batch(text):
    return {"prompts": np.array(["a", text], dtype=object)}
  saving = _replay_source([batch("b")] * 2)
  _read(saving, 1)
  assert saving.position()["last_batch"]["check"] == "index"
  _restore(_replay_source([batch("b")] * 2), saving.position())
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _restore(_replay_source([batch("c")] * 2), saving.position())
  assert list(info.value.differences) == ["last_batch.prompts"]


# A ReplayIterator's header as ckpt_iter 0.2.0 wrote it after reading 3 of `_batches(6)`: its
# `last_batch_digest` is that release's digest of batch 2 (blake2b), kept as it computed it.
_HEADER_0_2_0 = ('{"format_version":4,"kind":"data","fingerprint":{"source":"iterable:list"},'
                 '"position":{"full_batches_read":3,"last_batch_digest":"20943f25958feb10"},'
                 '"shuffle_key":null,"pending":null,"counters":{},"arrays":{}}')


def _item_of_0_2_0(tmp_path):
  directory = tmp_path / "3" / "data"
  directory.mkdir(parents=True)
  (directory / "process_0-of-1.json").write_text(_HEADER_0_2_0)
  return item_lib.read_item(str(directory), 0, 1)


def test_a_state_of_0_2_0_restores_checked_with_its_digest_and_saves_the_content_record(tmp_path):
  saved = _item_of_0_2_0(tmp_path)
  restored = _replay_source(_batches(6))
  item_lib.check_restore_saved(restored, saved)()
  assert restored.position() == {"full_batches_read": 3, "last_batch": _drift.content_digest(_batches(6)[2])}
  testing.assert_trees_equal(_read(restored, 3), _batches(6)[3:])
  other = _batches(6, changed_at=2)
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    item_lib.check_restore_saved(_replay_source(other), saved)
  here = _drift.legacy_batch_digest(other[2])
  assert info.value.differences == {"last_batch_digest": ("20943f25958feb10", here)}
  assert f"field 'last_batch_digest' has digest 20943f25958feb10 there, {here} here" in str(info.value)
  assert os.path.join("3", "data", "process_0-of-1.json") in str(info.value)
  # A difference before the last batch is not seen, as 0.2.0 did not see it.
  item_lib.check_restore_saved(_replay_source(_batches(6, changed_at=1)), saved)()


def test_a_malformed_replay_position_is_refused():
  source = _replay_source(_batches(2))
  for position in ({"full_batches_read": 1, "last_batch_digest": 7}, {"full_batches_read": 1, "x": 1},
                   {"full_batches_read": 1, "last_batch": "20943f25958feb10"}, {"last_batch": {"check": "x"}}):
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
    with pytest.raises(ckpt_iter.ConfigDriftError, match=r"field 'last_batch\.ids'"):
      manager.restore(2, args=ocp.args.Composite(
          data=ckpt_iter.IteratorRestore(_replay_source(_batches(6, changed_at=1)))))
