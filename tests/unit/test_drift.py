"""The content check: a restore produces the element before the saved position again and compares.

The record and its comparison are `_drift`'s (`content_digest`, `first_difference`).

Each case saves a real Orbax step, changes what the pipeline produces while
its definition (and so its fingerprint) stays the same, and restores into a
fresh iterator over the same pipeline.
"""

import dataclasses
import json
import sys

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _drift
from ckpt_iter import testing
from ckpt_iter import errors


def _save(root, iterator, step=1):
  with ocp.CheckpointManager(str(root), item_names=("data",)) as manager:
    manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()


def _restore(root, iterator, step=1):
  with ocp.CheckpointManager(str(root), item_names=("data",)) as manager:
    manager.restore(step, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
  return iterator


def _vocabulary_pipeline(vocabulary_file):
  def tokenize(record):
    with open(vocabulary_file) as f:
      vocabulary = json.load(f)
    return {"tokens": np.array([vocabulary[w] for w in record["text"].split()], np.int32),
            "id": record["id"]}

  records = [{"id": i, "text": "a b" if i % 2 else "b a"} for i in range(12)]
  return ckpt_iter.make_dataset(records, batch_size=2, seed=0, num_epochs=1,
                                shard_index=0, shard_count=1, transform=tokenize)


def _saved_vocabulary_run(tmp_path, batches=3):
  """A vocabulary file and an iterator saved at step 1 after `batches` batches tokenized with it."""
  vocabulary = tmp_path / "vocab.json"
  vocabulary.write_text(json.dumps({"a": 1, "b": 2}))
  iterator = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)))
  for _ in range(batches):
    next(iterator)
  _save(tmp_path / "ckpt", iterator)
  return vocabulary, iterator


def test_a_changed_vocabulary_file_behind_the_same_pipeline_is_refused_naming_the_field(tmp_path):
  vocabulary, iterator = _saved_vocabulary_run(tmp_path)
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  fresh = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)))
  assert fresh.fingerprint == iterator.fingerprint  # the definition did not change
  with pytest.raises(errors.ContentDriftError) as raised:
    _restore(tmp_path / "ckpt", fresh)
  message = str(raised.value)
  assert "content: the element before the saved position (index 2)" in message
  assert "field 'tokens'" in message and "check_content=False" in message
  assert list(raised.value.differences) == ["content.tokens"]
  assert isinstance(raised.value, errors.ConfigDriftError)
  # Refused before anything was applied: the iterator is still at the start.
  assert fresh.state().position == {"next_record": 0}


def test_nothing_changed_restores_silently_and_continues_exactly(tmp_path):
  vocabulary, iterator = _saved_vocabulary_run(tmp_path)
  fresh = _restore(tmp_path / "ckpt", ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary))))
  testing.assert_trees_equal(next(fresh), next(iterator))
  assert fresh.state() == iterator.state()


def test_check_content_false_continues_with_the_new_output_and_says_so_in_the_state(tmp_path):
  vocabulary, _ = _saved_vocabulary_run(tmp_path, batches=1)
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  fresh = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)), check_content=False)
  _restore(tmp_path / "ckpt", fresh)
  assert next(fresh)["tokens"].tolist() == [[7, 1], [1, 7]]
  assert fresh.state().content == {"check": "off: check_content=False"}


def test_allow_drift_naming_the_content_continues_with_the_new_output_as_the_refusal_says(tmp_path):
  vocabulary, _ = _saved_vocabulary_run(tmp_path, batches=1)
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  with pytest.raises(errors.ContentDriftError, match=r"allow_drift=\{'content.tokens'\}"):
    _restore(tmp_path / "ckpt", ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary))))
  for allowed in ({"content.tokens"}, {"content"}):
    fresh = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)), allow_drift=allowed)
    _restore(tmp_path / "ckpt", fresh)
    assert fresh.restored_content_check == "not checked (allow_drift names the content)"
    assert next(fresh)["tokens"].tolist() == [[7, 1], [1, 7]]
    assert fresh.state().content["check"] == _drift.BY_ROW  # still recorded from here on


def test_a_changed_record_outside_the_sampled_source_digest_is_refused(tmp_path):
  path = tmp_path / "prompts.jsonl"
  records = [{"id": i, "text": f"prompt {i:04d}"} for i in range(400)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records))

  def pipeline():
    return ckpt_iter.make_dataset(str(path), batch_size=4, seed=1, num_epochs=1,
                                  shard_index=0, shard_count=1)

  iterator = ckpt_iter.DataIterator(pipeline())
  for _ in range(5):
    batch = next(iterator)
  _save(tmp_path / "ckpt", iterator)
  # Edit the last row of the last batch read (the one its record holds), keeping its length, such that
  # the fingerprint (whose source_digest samples 64 records) is unchanged.
  record_id = int(batch["id"][-1])
  edited = list(records)
  edited[record_id] = {"id": record_id, "text": f"prompt {record_id:04d}".replace("prompt", "PROMPT")}
  path.write_text("".join(json.dumps(r) + "\n" for r in edited))
  assert ckpt_iter.DataIterator(pipeline()).fingerprint == iterator.fingerprint, "a sampled record: another seed"
  with pytest.raises(errors.ContentDriftError, match=r"field 'text'"):
    _restore(tmp_path / "ckpt", ckpt_iter.DataIterator(pipeline()))


SCALE = 2  # stands for a library default that an upgrade changes


def _scaled(x):
  return {"x": np.int64(x) * SCALE}


def test_a_map_function_whose_output_changed_is_refused(tmp_path, monkeypatch):
  dataset = grain.MapDataset.range(10).map(_scaled)
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(4):
    next(iterator)
  _save(tmp_path / "ckpt", iterator)
  monkeypatch.setattr(sys.modules[__name__], "SCALE", 3)
  fresh = ckpt_iter.DataIterator(grain.MapDataset.range(10).map(_scaled))
  assert fresh.fingerprint == iterator.fingerprint
  with pytest.raises(errors.ContentDriftError, match=r"index 3\).*field 'x'"):
    _restore(tmp_path / "ckpt", fresh)


def test_filtered_elements_are_skipped_back_to_the_one_produced(tmp_path):
  def dataset():
    return grain.MapDataset.range(20).filter(lambda x: x % 5 == 0).map(lambda x: {"x": np.int64(x)})

  iterator = ckpt_iter.DataIterator(dataset())
  assert [int(next(iterator)["x"]) for _ in range(2)] == [0, 5]
  _save(tmp_path / "ckpt", iterator)
  fresh = _restore(tmp_path / "ckpt", ckpt_iter.DataIterator(dataset()))
  assert int(next(fresh)["x"]) == 10


def test_a_consumer_adding_keys_to_the_batch_does_not_change_the_record(tmp_path):
  iterator = ckpt_iter.DataIterator(grain.MapDataset.range(6).map(lambda x: {"x": np.int64(x)}))
  batch = next(iterator)
  batch["added_by_the_trainer"] = np.zeros(3)
  _save(tmp_path / "ckpt", iterator)
  _restore(tmp_path / "ckpt", ckpt_iter.DataIterator(grain.MapDataset.range(6).map(lambda x: {"x": np.int64(x)})))


def test_repeat_iterator_checks_its_source_element(tmp_path):
  vocabulary = tmp_path / "vocab.json"
  vocabulary.write_text(json.dumps({"a": 1, "b": 2}))

  def repeat():
    return ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary))),
                                    produce=lambda b: {"y": b["tokens"] * 10}, num_repeats=2)

  iterator = repeat()
  for _ in range(3):
    next(iterator)
  _save(tmp_path / "ckpt", iterator)
  assert iterator.state().part.content["check"] == _drift.BY_ROW
  vocabulary.write_text(json.dumps({"a": 5, "b": 2}))
  with pytest.raises(errors.ContentDriftError, match="field 'tokens'"):
    _restore(tmp_path / "ckpt", repeat())


def test_pipelines_that_cannot_produce_an_element_again_say_so():
  iterator = ckpt_iter.DataIterator(grain.MapDataset.range(5).to_iter_dataset())
  next(iterator)
  assert iterator.state().content == {"check": _drift.ITER_DATASET}
  assert "cannot" in _drift.ITER_DATASET


def test_a_state_without_a_content_record_restores_without_a_check(monkeypatch):
  iterator = ckpt_iter.DataIterator(grain.MapDataset.range(8).map(_scaled))
  for _ in range(3):
    next(iterator)
  old = dataclasses.replace(iterator.state(), content=None)  # as an older ckpt_iter wrote it
  monkeypatch.setattr(sys.modules[__name__], "SCALE", 3)
  fresh = ckpt_iter.DataIterator(grain.MapDataset.range(8).map(_scaled))
  fresh.restore_state(old)
  assert int(next(fresh)["x"]) == 9


def test_digest_names_the_first_differing_leaf_and_refuses_objects():
  a = _drift.content_digest({"b": np.arange(3), "a": {"c": "x", "d": [1, 2.5]}})
  b = _drift.content_digest({"b": np.arange(3), "a": {"c": "x", "d": [1, 2.75]}})
  assert list(a["fields"]) == ["a.c", "a.d[0]", "a.d[1]", "b"]
  assert _drift.first_difference(a, b)[0] == "a.d[1]"
  assert _drift.first_difference(a, a) is None
  # dtype and shape are part of a leaf, not only its bytes
  assert _drift.content_digest(np.zeros(4, np.int32))["digest"] != _drift.content_digest(np.zeros(2, np.int64))["digest"]
  assert _drift.content_digest({"o": object()})["check"].startswith("unavailable: the element holds a object")


def test_the_record_sees_every_value_dtype_shape_key_and_string_of_a_batch():
  """What a replayed iterable's last batch and a learner's last prompts are compared by, too."""
  def batch(ids, texts=None):
    return {"ids": np.asarray(ids, np.int32), "prompts": list(texts or [f"p{i}" for i in ids])}

  def digest(element):
    return _drift.content_digest(element)["digest"]

  base = digest(batch([1, 2]))
  assert digest({"prompts": ["p1", "p2"], "ids": np.array([1, 2], np.int32)}) == base  # rebuilt, keys reordered
  changed = [
      batch([1, 3]),                                               # a value
      {**batch([1, 2]), "ids": np.asarray([1, 2], np.int64)},      # a dtype
      {**batch([1, 2]), "ids": np.asarray([[1, 2]], np.int32)},    # a shape
      batch([1, 2], ["p1", "q2"]),                                 # a string
      {"id": np.asarray([1, 2], np.int32), "prompts": ["p1", "p2"]},  # a key
      {**batch([1, 2]), "extra": None},                            # one more leaf
  ]
  digests = [digest(element) for element in changed]
  assert base not in digests and len(set(digests)) == len(digests)
  # An object array of Python strings and scalars is one leaf, digested item by item (not by address).
  assert digest(np.array(["a", 1], dtype=object)) == digest(np.array(["a", 1], dtype=object))
  assert digest(np.array(["a", 1], dtype=object)) != digest(np.array(["a", 2], dtype=object))
  assert digest(np.array(["a", 1], dtype=object)) != digest(np.array(["a", "1"], dtype=object))
  assert _drift.content_digest(np.array([object()]))["check"] == (
      "unavailable: the element holds an object array holding a object")


def test_content_and_lineage_fields_are_validated():
  good = {"kind": "data", "fingerprint": {}, "position": {"next_index": 1}}
  for bad in ({"check": 3}, {"check": "index", "fields": {"a": 1}}, {"check": "index", "extra": ""}):
    with pytest.raises(errors.InvalidStateError, match="'content'"):
      ckpt_iter.IteratorState(**good, content=bad)
  for bad in ({"resumes": 1, "digest": "0", "recent": [{"step": "x", "state": "a"}]},
              {"resumes": 0, "digest": "0", "recent": [{"step": 1, "state": "a"}]},
              {"resumes": -1, "digest": "0", "recent": []},
              {"resumes": 0, "digest": "0", "recent": [], "run": "3"},
              {"resumes": 0, "digest": "0", "recent": [], "run": -1},
              {"resumes": 0, "digest": "0", "recent": [], "runs": 3},
              {"resumes": 1, "digest": "0", "recent": [{"step": 1, "state": "a", "record": -5}]},
              {"resumes": 1, "digest": "0", "recent": [{"step": 1, "state": "a", "record": "36"}]},
              {"resumes": 1, "digest": "0", "recent": [{"step": 1, "state": "a", "batch_size": 0}]},
              {"resumes": 1, "digest": "0", "recent": [{"step": 1, "state": "a", "process_count": True}]}):
    with pytest.raises(errors.InvalidStateError, match="'lineage'"):
      ckpt_iter.IteratorState(**good, lineage=bad)
  state = ckpt_iter.IteratorState(**good, content={"check": "index", "digest": "ab", "fields": {}})
  assert state == ckpt_iter.IteratorState(**good)  # how it came about is not where it continues
  assert "content" in state.to_dict() and "content" not in ckpt_iter.IteratorState(**good).to_dict()


def test_grains_own_handler_carries_the_content_record_so_a_changed_vocabulary_is_refused(tmp_path):
  """The path of grain.checkpoint and MaxText's PyGrainCheckpointSave/Restore: get_state / set_state."""
  vocabulary = tmp_path / "vocab.json"
  vocabulary.write_text(json.dumps({"a": 1, "b": 2}))
  iterator = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)))
  for _ in range(3):
    next(iterator)
  with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("data",)) as manager:
    manager.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()

  def restore_with_grains_handler(fresh):
    with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("data",)) as manager:
      manager.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    return fresh

  same = restore_with_grains_handler(ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary))))
  testing.assert_trees_equal([next(same)], [next(iterator)])
  vocabulary.write_text(json.dumps({"a": 1, "b": 7}))
  changed = ckpt_iter.DataIterator(_vocabulary_pipeline(str(vocabulary)))
  with pytest.raises(errors.ContentDriftError, match="field 'tokens'"):
    restore_with_grains_handler(changed)
  assert changed.state().position == {"next_record": 0}
