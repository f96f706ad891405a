"""`ckpt-iter audit` and the lineage it reads, on real Orbax roots written in this process.

Each "segment" stands for one training process: a fresh iterator, restored
from the latest step (or not), training and saving a few steps. Real kills in
separate processes are in tests/integration (test_crash.py, test_tunix_audit.py).
"""

import json
import os
import shutil

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from etils import epath

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import _files
from ckpt_iter import _item as item_lib
from ckpt_iter import cli
import support


def _dataset():
  return grain.MapDataset.range(40).map(lambda x: {"x": np.int64(x)})


def _segment(root, steps, *, restore_step="latest", repeat=False):
  """One process: restore `restore_step` (None: a fresh start), then train and save `steps`."""
  source = ckpt_iter.DataIterator(_dataset())
  iterator = (ckpt_iter.RepeatIterator(source, produce=lambda b: {"y": b["x"] * 2}, num_repeats=3, group_size=2)
              if repeat else source)
  with ocp.CheckpointManager(str(root), item_names=("data",)) as manager:
    step = manager.latest_step() if restore_step == "latest" else restore_step
    if step is not None:
      manager.restore(step, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
    for step in steps:
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  return iterator


def _audit(capsys, root, *extra):
  code = cli.main(["audit", str(root), "--json", *extra])
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, (json.loads(out) if out else None), err


def _header(root, step):
  return os.path.join(str(root), str(step), "data", "process_0-of-1.json")


def _edit_header(root, step, change):
  _edit_file(_header(root, step), change)


def _edit_file(path, change):
  """Rewrites a process's header file after `change(header)`, whole (as a process whose pod part
  differs writes it: the fingerprint and lineage in the header itself, no reference to the count file)."""
  header = json.loads(json.dumps(_files.read_header(path)))
  change(header)
  with open(path, "w") as f:
    json.dump(header, f)


@pytest.mark.parametrize("repeat", [False, True], ids=["data", "repeat"])
def test_an_unbroken_chain_is_proven_resume_by_resume(tmp_path, capsys, repeat):
  _segment(tmp_path, [1, 2, 3], repeat=repeat)
  _segment(tmp_path, [4, 5], repeat=repeat)
  last = _segment(tmp_path, [6, 7, 8], repeat=repeat)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  assert [(f["resumed_from"], f["step"], f["verdict"]) for f in report["findings"]] == [(3, 4, "ok"), (5, 6, "ok")]
  assert last.state().lineage["resumes"] == 2
  assert [p["resumes"] for p in report["points"]] == [0, 0, 0, 1, 1, 2, 2, 2]
  assert {p["run"] for p in report["points"]} == {1}  # named by its first save, carried through resumes
  if repeat:  # three repeats of each produced item, pending ones included
    assert [p["pending"] for p in report["points"]][:3] == [5, 4, 3]


def test_a_run_restarted_from_scratch_into_the_same_root_is_a_break(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5], restore_step=None)  # forgot to restore: trains elements 0, 1 again
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  # One break, where the second run started; its next state continues it.
  assert [(f["step"], f["verdict"]) for f in report["findings"]] == [(4, "broken")]
  assert report["findings"][0]["message"] == (
      "another run than step 3's (this state's run first saved at step 4, step 3's run first saved at "
      "step 1) with no resume between them; its position 1 is behind step 3's 3: a second job started "
      "into this root?")


def test_a_resume_from_an_older_step_than_the_latest_saved_is_a_break(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5], restore_step=2)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert any("restored step 2 though step 3 was already saved" in f["message"] for f in report["findings"])


def test_a_resume_whose_step_is_no_longer_kept_is_not_proven(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5])
  shutil.rmtree(tmp_path / "3")
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 3 and report["verdict"] == "unproven"
  assert report["findings"][0]["message"] == "step 3 is not kept: its saved state cannot be compared"


def test_resumes_before_the_earliest_kept_step_are_counted_not_judged(tmp_path, capsys):
  _segment(tmp_path, [1, 2])
  _segment(tmp_path, [3, 4])
  _segment(tmp_path, [5, 6])
  for step in (1, 2, 3, 4):
    shutil.rmtree(tmp_path / str(step))
  code, report, _ = _audit(capsys, tmp_path)
  # Nothing failed, but the two resumes are not proven: not an "unbroken chain".
  assert (code, report["verdict"], report["resumes_before_kept_steps"]) == (3, "unproven", {"0": 2})
  assert cli.main(["audit", str(tmp_path)]) == 3
  assert capsys.readouterr().out.splitlines()[-1] == (
      "not proven: 2 state(s), 0 resume(s) (2 before the earliest kept step), 0 proven exact")


def test_a_tampered_lineage_or_a_state_other_than_the_one_saved_is_a_break(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5])
  backup = tmp_path.parent / "backup"
  shutil.copytree(tmp_path, backup)

  def retarget(header):
    header["lineage"]["recent"][0]["state"] = "0123456789abcdef"
  _edit_header(tmp_path, 4, retarget)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and "does not continue step 3's" in report["findings"][0]["message"]

  # Step 3's state changed after step 4 resumed from it: not the state restored.
  shutil.rmtree(tmp_path)
  shutil.copytree(backup, tmp_path)
  _edit_header(tmp_path, 3, lambda header: header["position"].update(next_index=2))
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert "not the one step 3 holds" in report["findings"][0]["message"]


def test_a_repeat_state_that_lost_pending_repeats_is_a_break(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3], repeat=True)
  _edit_header(tmp_path, 2, lambda header: header["counters"].update(yielded=1))
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert "1 items yielded, but 2 produced x num_repeats=3 - 4 pending = 2" in report["findings"][0]["message"]


def test_a_root_without_data_states_has_nothing_to_prove_and_usage_errors_exit_2(tmp_path, capsys):
  with ocp.CheckpointManager(str(tmp_path / "model"), item_names=("params",)) as manager:
    manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(2)})))
  code, report, _ = _audit(capsys, tmp_path / "model")
  assert code == 4 and report["verdict"] == "nothing"
  assert report["findings"][0]["message"].startswith("no data state in item 'data'")
  assert _audit(capsys, tmp_path / "missing")[0] == 2


def test_the_text_report_and_picture(tmp_path, capsys):
  _segment(tmp_path, [1, 2])
  _segment(tmp_path, [3])
  code = cli.main(["audit", str(tmp_path), "--plot", str(tmp_path / "t.png")])
  out = capsys.readouterr().out.splitlines()
  assert code == 0
  assert out[1] == "  ok: process 0: resume from step 2 (the first step kept after it: 3): resumed exactly at step 2's saved state, position 2"
  assert out[2] == "unbroken chain: 3 state(s), 1 resume(s), 1 proven exact"
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_lineage_stays_bounded_and_its_running_digest_covers_every_resume():
  state = ckpt_iter.IteratorState(kind="data", fingerprint={}, position={"next_index": 0})
  for step in range(70):
    state = item_lib.resumed(state, step)
  assert state.lineage["resumes"] == 70 and len(state.lineage["recent"]) == item_lib.MAX_RECENT
  assert state.lineage["recent"][0]["step"] == 70 - item_lib.MAX_RECENT
  digest = item_lib.empty()["digest"]
  for step in range(70):
    digest = item_lib.fold(digest, item_lib.resume_entry(ckpt_iter.IteratorState(
        kind="data", fingerprint={}, position={"next_index": 0}), step))
  assert digest == state.lineage["digest"]
  # Grain's dict form keeps one structure: no lineage or content in it.
  assert item_lib.step_of_item_directory("gs://b/run/12/data") == 12
  assert item_lib.step_of_item_directory("/x/ckpt/data") is None


def test_resume_entries_leave_out_per_process_fields_and_format_4_s_still_prove():
  """A pod's processes record the same entry (format 5); the whole-fingerprint digest formats 1-4
  recorded is still one a restore of such a header may have recorded."""
  from ckpt_iter import _codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  def state(index, kind):
    data = {"kind": "data", "fingerprint": {"seed": 0, "shard_index": index, "shard_count": 2},
            "position": {"next_record": 16}}
    if kind == "data":
      return state_lib.IteratorState(**data)
    return state_lib.IteratorState(kind="repeat", fingerprint={"num_repeats": 2, "group_size": 1, "shuffle_seed": 0},
                                   position={"parent": state_lib.IteratorState(**data)})

  for kind in ("data", "repeat"):
    first, second = state(0, kind), state(1, kind)
    assert item_lib.resume_digest(first) == item_lib.resume_digest(second), kind
    header = _codec.encode_state(first)[0]
    assert item_lib.header_resume_digests(header, origin="now") == (item_lib.resume_digest(first),)
    old = {**header, "format_version": 4}
    digests = item_lib.header_resume_digests(old, origin="format 4")
    assert len(digests) == 2 and digests[0] == item_lib.resume_digest(first), kind
    assert item_lib.header_resume_digests(_codec.encode_state(second)[0] | {"format_version": 4},
                                          origin="format 4")[1] != digests[1]  # shard_index was in it


def test_grain_form_carries_content_and_lineage_as_text_in_one_structure(tmp_path):
  fresh = ckpt_iter.DataIterator(_dataset())
  first = fresh.get_state()  # before any element: the same keys, "null" text
  assert (first["content"], first["lineage"]) == ("null", "null")
  iterator = _segment(tmp_path, [1])
  restored = _segment(tmp_path, [2])
  assert restored.state().lineage["resumes"] == 1
  state = restored.get_state()
  assert set(state) == set(iterator.get_state()) == set(first)
  assert all(isinstance(state[name], str) for name in ("content", "lineage"))
  assert json.loads(state["lineage"]) == dict(restored.state().lineage)
  # Through Grain's protocol the lineage is carried on: its resumes stay provable.
  twin = ckpt_iter.DataIterator(_dataset())
  twin.set_state(json.loads(json.dumps(state)))
  assert twin.state().lineage == restored.state().lineage and twin.get_state() == state


def test_a_process_missing_from_a_step_is_a_break(tmp_path, capsys):
  for index in range(2):  # two processes' files, as each process's handler writes its own
    iterator = ckpt_iter.DataIterator(_dataset())
    next(iterator)
    for step in (1, 2):
      directory = tmp_path / str(step) / "data"
      directory.mkdir(parents=True, exist_ok=True)
      checkpoint_lib.IteratorCheckpointHandler(index, 2).save(epath.Path(directory), ckpt_iter.IteratorSave(iterator))
  os.remove(tmp_path / "2" / "data" / "process_1-of-2.json")
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert [(f["step"], f["process_index"], f["verdict"]) for f in report["findings"]] == [(2, 1, "broken")]


def test_a_data_item_copied_from_the_step_before_is_a_break(tmp_path, capsys):
  """Steps 1-9, resumed at 3 and 5; step 7's item replaced by step 6's (issue 29's sabotage)."""
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5])
  _segment(tmp_path, [6, 7, 8, 9])
  with open(_header(tmp_path, 4)) as f:
    assert json.load(f)["saved_step"] == 4  # every header says where it was saved
  shutil.rmtree(tmp_path / "7" / "data")
  shutil.copytree(tmp_path / "6" / "data", tmp_path / "7" / "data")
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  broken = [f for f in report["findings"] if f["verdict"] == "broken"]
  assert [(f["step"], f["message"]) for f in broken] == [
      (7, "the data state was saved in step 6 but is stored in step 7 (a data item copied from another step?)")]
  assert sum(f["verdict"] == "ok" for f in report["findings"]) == 2  # both resumes still proven


@pytest.mark.parametrize("seed", [1, 0], ids=["another_seed", "same_config"])
def test_a_second_job_started_into_the_same_root_is_a_break(tmp_path, capsys, seed):
  def job(seed, steps):
    iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        [{"x": np.int64(i)} for i in range(40)], batch_size=1, seed=seed))
    with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
      for step in steps:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()

  job(0, [1, 2, 3])
  job(seed, [1, 2, 3, 4, 5, 6])  # from scratch: Orbax keeps job A's 1-3 and writes 4-6
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  # One break, where job B's states start; its later states continue job B's.
  assert [(f["step"], f["verdict"]) for f in report["findings"]] == [(4, "broken")]
  message = report["findings"][0]["message"]
  if seed:
    assert "its pipeline differs from step 3's (seed: 0 -> 1)" in message
    assert "another job writing into this root?" in message
  else:  # the same pipeline at a later position: only the run identity tells the jobs apart
    assert message == (
        "another run than step 3's (this state's run first saved at step 4, step 3's run first saved "
        "at step 1) with no resume between them: a second job started into this root?")


def test_a_resumed_state_carrying_another_run_is_a_break(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5])
  _edit_header(tmp_path, 4, lambda header: header["lineage"].update(run=4))  # as if step 3's were another run's
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  # Step 5 continues step 3, the last sound state: step 4 was a bad item between them, one break;
  # the resume from step 3 is judged once, at step 4.
  assert [(f["step"], f["verdict"], f["resumed_from"]) for f in report["findings"]] == [(4, "broken", 3)]
  assert report["findings"][0]["message"] == (
      "restored step 3's state, but its run first saved at step 4 is not step 3's (run first saved at step 1)")


def test_inspect_shows_the_step_the_run_first_saved_at(tmp_path, capsys):
  _segment(tmp_path, [2, 3])
  assert cli.main(["inspect", str(tmp_path)]) == 0
  assert "none; the run first saved at step 2" in capsys.readouterr().out


def test_the_same_state_saved_twice_through_grains_handler_is_a_break(tmp_path, capsys):
  """Grain's handler writes no saved step: a copied item shows as a state that did not move."""
  iterator = ckpt_iter.DataIterator(_dataset())
  with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
    for step in (1, 2, 3, 4):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
  assert _audit(capsys, tmp_path)[0] == 0
  shutil.rmtree(tmp_path / "3" / "data")
  shutil.copytree(tmp_path / "2" / "data", tmp_path / "3" / "data")
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert [(f["step"], f["message"]) for f in report["findings"]] == [(3, (
      "the same state as step 2 (position 2) with no resume between: step 2's data item copied here, "
      "or a save with nothing consumed since"))]


def test_a_garbled_step_is_broken_once_not_also_without_a_data_state(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  with open(_header(tmp_path, 2), "w") as f:
    f.write('{"format_version": 1, "kind"')
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  assert [(f["step"], f["verdict"]) for f in report["findings"]] == [(2, "broken")]
  assert "unreadable state" in report["findings"][0]["message"]


@pytest.mark.parametrize("value", ["3", -1, [3], {"step": 3}, 2**70 + 0.5])
def test_a_hostile_saved_step_is_refused_naming_the_field(tmp_path, capsys, value):
  _segment(tmp_path, [1, 2])
  _edit_header(tmp_path, 2, lambda header: header.update(saved_step=value))
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1
  (finding,) = report["findings"]
  assert finding["step"] == 2 and "field 'saved_step' is" in finding["message"]
  # Restores ignore the field (it is the audit's): step 2 still restores.
  restored = ckpt_iter.DataIterator(_dataset())
  with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
    manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(restored)))
  assert int(next(restored)["x"]) == 2


# ---------------------------------------------------------------------------
# Skips: a resume may add them (accounted for), no state may lose them.


def _skip_chain(root):
  return support.run_chain(str(root), [(1, 4, 2, 0, None), (1, 4, 2, 0, [(10, 12)]), (1, 2, 2, 0, None)])


def test_skips_added_at_a_resume_are_accounted_for_and_kept(tmp_path, capsys):
  _skip_chain(tmp_path)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  added = [f for f in report["findings"] if "skips added" in f["message"]]
  assert [(f["step"], f["verdict"]) for f in added] == [(3, "ok")]
  assert "stream records [10, 12) (2 records), all at or after the restored position 8" in added[0]["message"]
  assert [p["skips"] for p in report["points"]] == [0, 0, 2, 2, 2, 2]


def _drop_skips(header):
  header["fingerprint"].pop("skips")


def _skip_before(header):
  header["fingerprint"]["skips"] = '{"records":[[2,3],[10,12]]}'


@pytest.mark.parametrize("step, edit, fragment", [
    (5, _drop_skips, "lost skips across the resume since step 4"),
    (4, _drop_skips, "lost skips with no resume between it and step 3"),
    (3, _skip_before, "skips stream records [2, 3), before the restored position 8"),
], ids=["lost at a resume", "lost without a resume", "before the position"])
def test_a_state_that_loses_skips_or_skips_what_was_read_is_a_break(tmp_path, capsys, step, edit, fragment):
  _skip_chain(tmp_path)
  for name in os.listdir(os.path.join(tmp_path, str(step), "data")):
    if name.endswith(".json") and name.startswith("process_"):
      _edit_file(os.path.join(tmp_path, str(step), "data", name), edit)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  assert any(fragment in f["message"] for f in report["findings"] if f["verdict"] == "broken"), report["findings"]


def _full_batches_of_two(header):
  """The fixture's learner as one whose full batch holds two prompts (a micro-batch of one), over the same input."""
  header["fingerprint"].update(full_batch_size=2)


def _one_micro_batch_into_a_full_batch_of_two(header):
  _full_batches_of_two(header)
  header["position"].update(micro_batches_taken=1)


def test_skips_inside_the_full_batch_a_learner_had_started_are_a_break(tmp_path, capsys):
  fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1_tunix_roots", "grpo", "root")
  root = tmp_path / "root"
  shutil.copytree(fixture, root)
  path3 = os.path.join(root, "actor", "3", "data", "process_0-of-1.json")
  path4 = os.path.join(root, "actor", "4", "data", "process_0-of-1.json")
  for path, change in ((path3, _one_micro_batch_into_a_full_batch_of_two),
                       (path4, lambda h: (_full_batches_of_two(h), h["fingerprint"].update(skips='{"records":[[2,3]]}')))):
    _edit_file(path, change)
  code, report, _ = _audit(capsys, root)
  assert code == 1
  assert any("inside the full batch [2, 3) the learner had started" in f["message"] for f in report["findings"]
             if f["verdict"] == "broken"), report["findings"]


# ---------------------------------------------------------------------------
# One bad item is one break, each resume is counted once (issue 47, item 4).


def _resume_lines(report):
  return [(f["step"], f["process_index"], f["resumed_from"], f["verdict"]) for f in report["findings"]
          if f["resumed_from"] is not None]


def test_a_rollback_is_one_break_and_each_resume_is_counted_once(tmp_path, capsys):
  _segment(tmp_path, [1, 2, 3])
  _segment(tmp_path, [4, 5])
  _segment(tmp_path, [6, 7], restore_step=2)  # the latest step lost: steps 3-5's elements trained again
  _segment(tmp_path, [8, 9])
  _segment(tmp_path, [10, 11])
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  broken = [(f["step"], f["message"]) for f in report["findings"] if f["verdict"] == "broken"]
  assert broken == [(6, "restored step 2 though step 5 was already saved: what was trained after step 2 was "
                        "trained again")]
  assert _resume_lines(report) == [(4, 0, 3, "ok"), (6, 0, 2, "broken"), (8, 0, 7, "ok"), (10, 0, 9, "ok")]
  assert (report["resumes"], report["proven_exact"]) == (4, 3)
  assert cli.main(["audit", str(tmp_path)]) == 1
  assert capsys.readouterr().out.splitlines()[-1] == "broken chain: 11 state(s), 4 resume(s), 3 proven exact"


@pytest.mark.parametrize("segments", [
    [(2, 4, 2, 1, None), (2, 4, 2, 0, None), (2, 4, 2, 1, None), (2, 4, 2, 0, None)],
    [(2, 4, 2, 1, None), (2, 4, 2, 0, None), (1, 4, 2, 1, None), (2, 4, 2, 0, None)],
    [(1, 4, 2, 0, None), (2, 4, 2, 1, None), (2, 4, 2, 0, None), (4, 8, 2, 0, None)],
], ids=["two processes", "2-1-2 processes", "1-2-2-4 processes"])
def test_a_resume_of_several_processes_is_one_resume_proven_on_each(tmp_path, capsys, segments):
  support.run_chain(str(tmp_path), segments)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  assert (report["resumes"], report["proven_exact"]) == (3, 3)
  # Each process that saved after a resume proves it on its own line.
  for step, count in ((3, segments[1][0]), (5, segments[2][0]), (7, segments[3][0])):
    assert sorted(p for s, p, _, _ in _resume_lines(report) if s == step) == list(range(count))


def _tunix_chain_with_a_skip_inside_a_started_batch(root):
  """The Tunix fixture (steps 3, 4; resumed at 3) where step 3 had started its full batch and the
  resume added a skip inside it (a documented break), and a step 5 the run saved after it."""
  fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1_tunix_roots", "grpo", "root")
  shutil.copytree(fixture, root)
  path = lambda step: os.path.join(root, "actor", str(step), "data", "process_0-of-1.json")
  _edit_file(path(3), _one_micro_batch_into_a_full_batch_of_two)
  _edit_file(path(4), _full_batches_of_two)
  with open(path(3)) as f:
    step3 = json.load(f)

  def resumed_with_a_skip(header):
    entry = {"step": 3, "state": item_lib.header_resume_digests(step3, origin="step 3")[-1]}
    header["lineage"]["recent"] = [entry]
    header["lineage"]["digest"] = item_lib.fold(item_lib.empty()["digest"], entry)
    header["fingerprint"]["skips"] = '{"records":[[2,3]]}'
  _edit_file(path(4), resumed_with_a_skip)
  shutil.copytree(os.path.join(root, "actor", "4"), os.path.join(root, "actor", "5"))

  def one_step_later(header):
    header["counters"].update(train_steps=5, actor_iter_steps=5)
    header["position"].update(stream_rows=3)
  _edit_file(path(5), one_step_later)


def test_a_documented_break_is_reported_once(tmp_path, capsys):
  root = tmp_path / "root"
  _tunix_chain_with_a_skip_inside_a_started_batch(str(root))
  code, report, _ = _audit(capsys, root)
  assert code == 1
  assert [(f["step"], f["verdict"], f["resumed_from"]) for f in report["findings"]] == [
      (4, "ok", 3), (4, "broken", None)], report["findings"]
  assert "inside the full batch [2, 3) the learner had started" in report["findings"][1]["message"]
  assert (report["resumes"], report["proven_exact"]) == (1, 1)


# ---------------------------------------------------------------------------
# A resume record that does not match the chain is a break (issue 47, item 5).


@pytest.mark.parametrize("step_3_kept", [True, False], ids=["step 3 kept", "step 3 not kept"])
def test_an_edited_resume_record_is_a_break(tmp_path, capsys, step_3_kept):
  """Step 8's record of the resume from step 4 edited to name step 3, which `which` and `order` then follow."""
  _segment(tmp_path, [1, 2, 3, 4])
  _segment(tmp_path, [5, 6, 7, 8])
  if not step_3_kept:
    shutil.rmtree(tmp_path / "3")
  assert _audit(capsys, tmp_path)[0] == 0

  def retarget(header):
    assert header["lineage"]["recent"][0]["step"] == 4
    header["lineage"]["recent"][0]["step"] = 3
  _edit_header(tmp_path, 8, retarget)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 1 and report["verdict"] == "broken"
  (broken,) = [f for f in report["findings"] if f["verdict"] == "broken"]
  assert broken["step"] == 8
  if step_3_kept:
    assert "resume record 1 names step 3" in broken["message"]
    assert "not the one step 3 holds" in broken["message"]
  else:
    assert "its resume records differ from step 7's" in broken["message"]
  assert (report["resumes"], report["proven_exact"]) == (1, 1)  # the resume itself, proven at step 5


def test_resume_entries_with_more_fields_are_judged_as_ever(tmp_path, capsys):
  """An entry may carry more than step and state digest (a later ckpt_iter's: the restored record)."""
  _segment(tmp_path, [1, 2])
  _segment(tmp_path, [3, 4])

  def with_record(header):
    entry = header["lineage"]["recent"][0]
    entry["record"] = 2
    header["lineage"]["digest"] = item_lib.fold(item_lib.empty()["digest"], entry)
  for step in (3, 4):
    _edit_header(tmp_path, step, with_record)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  assert (report["resumes"], report["proven_exact"]) == (1, 1)


class _Counting:
  """A stream of our own with state_dict()/load_state_dict(): its state is the next record."""

  def __init__(self):
    self.next = 0

  def __iter__(self):
    while self.next < 100:
      self.next += 1
      yield {"x": self.next - 1}

  def state_dict(self):
    return {"next": self.next}

  def load_state_dict(self, state):
    self.next = state["next"]


def test_a_stream_whose_position_moves_back_with_no_resume_is_a_broken_chain(tmp_path, capsys):
  # issue 57 item 11: a stream's records read is its progress, as make_dataset's next record is.
  iterator = ckpt_iter.StreamingIterator(_Counting(), batch_size=2)
  with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
    for step in (1, 2, 3):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
      if step == 1:
        first = iterator.state()
    iterator.restore_state(first)  # back to step 1's place, no checkpoint restore recorded
    next(iterator)
    manager.save(4, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  code, report, _ = _audit(capsys, tmp_path)
  assert report["verdict"] == "broken", report
  assert any(f["step"] == 4 and "position 4, behind step 3's 6" in json.dumps(f) for f in report["findings"]), report


def test_a_resume_into_another_pipeline_is_named_not_proven_exact(tmp_path, capsys):
  # issue 60 item 5: a second job into the same root with allow_drift={"seed"} was certified "proven exact".
  def segment(seed, steps, restore):
    iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset([{"x": i} for i in range(40)], batch_size=2,
                                                             seed=seed, num_epochs=None))
    with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
      if restore:
        manager.restore(manager.latest_step(), args=ocp.args.Composite(
            data=ckpt_iter.IteratorRestore(iterator, allow_drift={"seed"})))
      for step in steps:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()

  segment(0, [1, 2, 3], restore=False)
  segment(1, [4, 5], restore=True)
  code, report, _ = _audit(capsys, tmp_path)
  assert report["resumes"] == 1 and report["proven_exact"] == 0 and report["into_another_pipeline"] == 1, report
  resume = next(f for f in report["findings"] if f["resumed_from"] == 3)
  assert resume["accepted"] == ["seed"] and "accepted changes seed 0 -> 1" in resume["message"], resume
  assert cli.main(["audit", str(tmp_path)]) == code
  out, _ = capsys.readouterr()
  assert "0 proven exact, 1 into another pipeline" in out and "(the first step kept after it: 4)" in out, out


def test_a_batch_size_change_at_a_resume_is_still_proven_exact(tmp_path, capsys):
  for batch_size, steps, restore in ((2, [1, 2], False), (4, [3, 4], True)):
    iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset([{"x": i} for i in range(40)], batch_size=batch_size,
                                                             seed=3, num_epochs=None))
    with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
      if restore:
        manager.restore(manager.latest_step(), args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
      for step in steps:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
  _, report, _ = _audit(capsys, tmp_path)
  assert report["proven_exact"] == 1 and report["into_another_pipeline"] == 0, report


# ---------------------------------------------------------------------------
# One rule for "the same stream", the restore's (issue 66 item 3).


def _grain_mix(weights):
  parts = [grain.MapDataset.range(start, start + 40).map(lambda x: {"x": np.int64(x)}).to_iter_dataset()
           for start in (0, 1000)]
  return grain.IterDataset.mix(parts, weights=weights)


def _chain_of(root, make_before, make_after, allow_drift):
  """Two steps under `make_before`, a restore of the latest into `make_after` with `allow_drift`, two more."""
  with ocp.CheckpointManager(str(root), item_names=("data",)) as manager:
    iterator = ckpt_iter.DataIterator(make_before())
    for step in (1, 2):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
    iterator = ckpt_iter.DataIterator(make_after())
    manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator, allow_drift=allow_drift)))
    for step in (3, 4):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()


_SOURCES = {"a": [{"x": i} for i in range(30)], "b": [{"x": 100 + i} for i in range(30)]}
_LANE_RECORDS = [{"x": i} for i in range(16)]


@pytest.mark.parametrize("before, after, allow_drift", [
    # grain.IterDataset.mix reweighted: each source continues from its own next element.
    (lambda: _grain_mix([1, 1]), lambda: _grain_mix([3, 1]), {"weights"}),
    # make_dataset's mixture: a source added, then (the other case) removed, under allow_drift={"sources"}.
    (lambda: ckpt_iter.make_dataset({"a": _SOURCES["a"]}, weights={"a": 1}, batch_size=2, seed=0, num_epochs=None),
     lambda: ckpt_iter.make_dataset(_SOURCES, weights={"a": 1, "b": 1}, batch_size=2, seed=0, num_epochs=None),
     {"sources"}),
    (lambda: ckpt_iter.make_dataset(_SOURCES, weights={"a": 1, "b": 1}, batch_size=2, seed=0, num_epochs=None),
     lambda: ckpt_iter.make_dataset({"a": _SOURCES["a"]}, weights={"a": 1}, batch_size=2, seed=0, num_epochs=None),
     {"sources"}),
    # Shard lanes' global batch changed at an epoch's first record (two batches of 8 are an epoch of 16).
    (lambda: ckpt_iter.make_dataset(_LANE_RECORDS, batch_size=8, seed=0, num_epochs=3, shuffle="shards",
                                    shard_size=4, shard_lanes=2),
     lambda: ckpt_iter.make_dataset(_LANE_RECORDS, batch_size=4, seed=0, num_epochs=3, shuffle="shards",
                                    shard_size=4, shard_lanes=2),
     {"shuffle_lane_rows"}),
], ids=["grain mix reweighted", "a source added", "a source removed", "lane rows at an epoch's start"])
def test_a_documented_same_stream_change_is_proven_exact(tmp_path, capsys, before, after, allow_drift):
  # They were counted "into another pipeline" (not proven): the audit kept its own list of same-stream
  # fields beside the restore's rule; both now ask `_drift.continues_the_stream`.
  _chain_of(tmp_path, before, after, allow_drift)
  code, report, _ = _audit(capsys, tmp_path)
  assert code == 0 and (report["resumes"], report["proven_exact"]) == (1, 1), report["findings"]
  assert not any("into another pipeline" in f["message"] for f in report["findings"]), report["findings"]
