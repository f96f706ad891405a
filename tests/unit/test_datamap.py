"""Tests for ckpt_iter.datamap: which records a run read, from its states.

Runs are trained in this process: "processes" are iterators built with
shard_index/shard_count, saved into and restored from real item files
(`<root>/<step>/data`) by the Orbax handler. What the data map says a batch
held is compared with what the iterators actually yielded.
"""

import json
import os

import pytest

import ckpt_iter
from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import datamap
from ckpt_iter import errors
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter.cli import _which
import support

RECORDS = support.CHAIN_RECORDS
_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1_tunix_roots", "grpo", "root")
_pipeline = support.chain_pipeline
_ids = support.batch_ids
run_chain = support.run_chain


def _run_map(root, process=0):
  layout = inspection.find_layout(str(root))
  return datamap.RunMap.from_states(_which.States(layout, process), layout.steps[-1])


# ---------------------------------------------------------------------------
# Runs: the map says what the iterators yielded.


@pytest.mark.parametrize("segments", [
    [(1, 4, 5, 0, None)],
    [(1, 4, 3, 2, None), (2, 6, 4, 1, None), (1, 3, 6, 0, None)],
    [(2, 4, 2, 0, None), (1, 5, 3, 0, [(20, 27)]), (4, 8, 3, 0, None), (1, 2, 4, 0, [(64, 65), (70, 75)])],
], ids=["one segment", "batch sizes and process counts", "skips added at two resumes"])
def test_the_run_map_names_every_batch_the_chain_kept(tmp_path, segments):
  kept = run_chain(str(tmp_path), segments)
  run = _run_map(tmp_path)
  assert run.total == len(kept)
  assert [[r.index for r in batch.records] for batch in run.batches()] == kept
  assert [run.batch(k).number for k in range(len(kept))] == list(range(len(kept)))
  # Each step's last batch, from its own state and its lineage.
  layout = inspection.find_layout(str(tmp_path))
  for step in layout.steps:
    answer = _which.which_step(layout, step)
    assert [r.index for r in answer.batch.records] == kept[step - 1]
    assert answer.batch.number == step - 1


def test_rows_are_named_by_the_process_that_held_them(tmp_path):
  run_chain(str(tmp_path), [(4, 8, 2, 0, None)])
  batch = _run_map(tmp_path).batch(1)
  assert [r.process_index for r in batch.records] == [0, 0, 1, 1, 2, 2, 3, 3]
  process_two = ckpt_iter.DataIterator(_pipeline(4, 2, 8))
  next(process_two)
  assert [r.index for r in batch.records if r.process_index == 2] == _ids(next(process_two))


def test_a_reweighted_mixture_is_mapped_segment_by_segment(tmp_path):
  kept = []
  kept += run_chain(str(tmp_path / "x"), [(1, 4, 3, 0, None)], mixture={"a": 2, "b": 1})
  # The same root, continued under new weights and a new source set.
  root = str(tmp_path / "x")
  iterator = ckpt_iter.DataIterator(_pipeline(1, 0, 4, mixture={"a": 1, "b": 3}))
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(
      os.path.join(root, "3", "data"), ckpt_iter.IteratorRestore(iterator, allow_drift={"weights"}))
  for step in (4, 5, 6):
    kept.append(_ids(next(iterator)))
    os.makedirs(os.path.join(root, str(step), "data"))
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(os.path.join(root, str(step), "data"),
                                                        ckpt_iter.IteratorSave(iterator))
  batches = list(_run_map(root).batches())
  assert [[(1000 if r.source == "a" else 2000) + r.index for r in b.records] for b in batches] == kept
  # The step it resumed from deleted: the resume record carries that segment's shares and ledger.
  os.rename(os.path.join(root, "3"), os.path.join(root, "3.orbax-checkpoint-tmp-1"))  # not a step
  batches = list(_run_map(root).batches())
  assert [[(1000 if r.source == "a" else 2000) + r.index for r in b.records] for b in batches] == kept


def test_an_epochs_short_last_batch_is_placed_by_the_restored_record(tmp_path):
  # 23 records, batches of 4 without drop: epoch 0 holds 0-3 ... 20-22 (short). Restarted at record 8 with
  # batches of 5: 8-12, 13-17, 18-22 (full): no short batch. Restarted at 12 with 5: 12-16, 17-21, 22 (short).
  kept = run_chain(str(tmp_path), [(1, 4, 3, 0, None), (1, 5, 4, 0, None)], drop=False)
  run = _run_map(tmp_path)
  assert [[r.index for r in b.records] for b in run.batches()] == kept
  short = [b for b in run.batches() if len(b.records) < b.batch_size]
  assert short and all("short last batch" in b.how and "restored stream record 12" in b.how for b in short)


def test_a_step_not_kept_is_read_from_the_resume_record(tmp_path):
  kept = run_chain(str(tmp_path), [(1, 4, 2, 0, None), (2, 6, 2, 0, [(9, 11)])])
  full = [[r.index for r in b.records] for b in _run_map(tmp_path).batches()]
  os.rename(os.path.join(tmp_path, "2"), os.path.join(tmp_path, "2.orbax-checkpoint-tmp-1"))  # not a step
  assert [[r.index for r in b.records] for b in _run_map(tmp_path).batches()] == full == kept


def test_a_step_not_kept_is_named_with_the_keep_policy_where_the_resume_record_lacks_the_segment(tmp_path):
  # A state written before resume records carried the segment (0.2.0): the step it resumed from is needed.
  run_chain(str(tmp_path), [(1, 4, 2, 0, None), (1, 4, 2, 0, None)], mixture={"a": 1, "b": 1})
  os.rename(os.path.join(tmp_path, "2"), os.path.join(tmp_path, "2.orbax-checkpoint-tmp-1"))  # not a step
  last = os.path.join(tmp_path, "4", "data", "process_0-of-1.json")
  header = json.loads(json.dumps(_files.read_header(last)))  # whole, as 0.2.0 wrote it
  header["lineage"]["recent"] = [{"step": e["step"], "state": e["state"]} for e in header["lineage"]["recent"]]
  with open(last, "w") as f:
    json.dump(header, f)
  layout = inspection.find_layout(str(tmp_path))
  with pytest.raises(errors.ItemNotFoundError) as info:
    datamap.RunMap.from_states(_which.States(layout), 4, keep_policy=_which.KEEP_POLICY)
  assert "step 2, which is no longer kept" in str(info.value) and "max_to_keep" in str(info.value)
  # A step's own batch is still answered, unnumbered, from its state alone.
  answer = _which.which_step(layout, 4)
  assert answer.batch.number is None and "no longer kept" in answer.note


# ---------------------------------------------------------------------------
# A Tunix learner's global step (the format-1 GRPO root: num_iterations=2, killed inside a repeat after 3).


def _fixture_state(step):
  path = os.path.join(_FIXTURE, "actor", str(step), "data", "process_0-of-1.json")
  return codec.header_state(_files.read_header(path), origin=path)


def test_a_mid_repeat_checkpoint_names_its_global_steps_prompts_and_pending_repeat():
  step = datamap.learner_step(_fixture_state(3))
  assert (step.global_step, step.first_update, step.last_update, step.saved_after, step.mid_step) == (1, 3, 4, 3, True)
  assert [r.index for r in step.prompts.records] == [1]
  assert step.repeats[0] == "mini-batch 1 of 1 (source records 1): the checkpoint's mini-batch"
  assert "update 3: trained" in step.repeats[1] and "update 4: pending" in step.repeats[2]


def test_the_resumed_step_is_numbered_across_the_resume():
  layout = inspection.find_layout(_FIXTURE)
  answer = _which.which_step(layout, 4)
  assert answer.learner.global_step == 1 and not answer.learner.mid_step
  assert answer.batch.number == 1 and [r.index for r in answer.batch.records] == [1]
  assert all("trained before the checkpoint" in line for line in answer.learner.repeats)


def test_learner_step_refuses_a_data_state():
  iterator = ckpt_iter.DataIterator(_pipeline(1, 0, 4))
  next(iterator)
  with pytest.raises(errors.UnsupportedConfigError) as info:
    datamap.learner_step(iterator.state())
  assert "not a Tunix RL learner's state" in str(info.value)


def test_a_learners_first_save_after_a_resume_inside_a_repeat_names_its_global_step_from_the_state(tmp_path):
  # issue 60 item 1: at the first save after a resume inside a repeat, the learner's input has read
  # nothing since the restore; `learner_step` raised "no batch was read since the restore" (Tunix step
  # 16 of 26). The lineage's last resume says where the global step's full batch ended.
  from ckpt_iter import checkpoint as checkpoint_lib, state as state_lib  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(_pipeline(1, 0, 4))
  batches = [[int(x) for x in next(iterator)["id"]] for _ in range(3)]
  item = os.path.join(str(tmp_path), "3", "data")
  os.makedirs(item)
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))
  restored = ckpt_iter.DataIterator(_pipeline(1, 0, 4))
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(item, ckpt_iter.IteratorRestore(restored))
  inner = restored.state()  # nothing read since the restore
  value = state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "GRPOLearner", "num_iterations": 2, "mini_batch_size": 4,
                                 "train_micro_batch_size": 4},
      position={"input": {"kind": "data", "fingerprint": dict(inner.fingerprint), "position": dict(inner.position)},
                "micro_batches_taken": 0},
      counters={"train_steps": 6, "global_steps": 2, "remaining_mini_batches": 0, "mini_batches_per_global_step": 1},
      pending=state_lib.Pending(items=({"x": 1},), schedule=(0,)), lineage=inner.lineage)
  step = datamap.learner_step(value)
  assert [r.index for r in step.prompts.records] == [r for r in batches[-1]], step.prompts.records
  assert step.mid_step and "pending" in step.repeats[-1]
