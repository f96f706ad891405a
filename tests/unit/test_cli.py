"""Tests for the ckpt-iter command line: inspect, verify, diff, demo, --help.

Checkpoints are real: Orbax CheckpointManager saves of DataIterator and
RepeatIterator items and multi-process item directories written by the handler
with explicit process indices (a real Tunix root: tests/integration/
test_cli_tunix_root.py). Each verb runs in-process through `cli.main`; the
command itself, in fresh processes (`python -m ckpt_iter`, the `ckpt-iter`
script), is tested in tests/integration/test_fresh_processes.py.
"""

import importlib.util
import json
import os
import re
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import conftest
import ckpt_iter
from ckpt_iter import cli

RECORDS = [{"prompts": f"prompt {i}", "answer": i} for i in range(12)]
BATCHES_PER_EPOCH = 6  # 12 records, batch size 2, one process
_NEEDS_TUNIX = pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason=conftest.NEEDS_TUNIX)


# ---------------------------------------------------------------------------
# Building checkpoints.


def _dataset(seed=0, shard_index=0, shard_count=1):
  return ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=seed, num_epochs=2,
      shard_index=shard_index, shard_count=shard_count,
  )


def _produce(batch):
  """A stand-in rollout: arrays that depend on the input batch."""
  first = int(batch["answer"][0])
  return {
      "ids": np.arange(6, dtype=np.int32).reshape(2, 3) + first,
      "logps": np.linspace(0.0, 1.0, 4, dtype=np.float32) * first,
  }


def _repeat_iterator(seed=0, shard_index=0, shard_count=1):
  source = ckpt_iter.DataIterator(_dataset(seed, shard_index, shard_count))
  return ckpt_iter.RepeatIterator(
      source, produce=_produce, num_repeats=2, group_size=2, shuffle_seed=7
  )


def _advance(iterator, count):
  for _ in range(count):
    next(iterator)
  return iterator


def _orbax_save(root, iterator, advance_then_save, with_params=False):
  """Advances `iterator` and saves it at steps, with a real CheckpointManager.

  Args:
    advance_then_save: (step, number of elements to take before saving) pairs.
  """
  options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False)
  with ocp.CheckpointManager(str(root), options=options) as manager:
    for step, count in advance_then_save:
      _advance(iterator, count)
      items = {"data": ckpt_iter.IteratorSave(iterator)}
      if with_params:
        items["params"] = ocp.args.StandardSave({"w": np.arange(4, dtype=np.float32)})
      manager.save(step, args=ocp.args.Composite(**items))
    manager.wait_until_finished()


def _save_processes(item_dir, iterators):
  """Writes one item directory as len(iterators) processes would."""
  os.makedirs(item_dir, exist_ok=True)
  for index, iterator in enumerate(iterators):
    handler = ckpt_iter.IteratorCheckpointHandler(process_index=index, process_count=len(iterators))
    handler.save(item_dir, ckpt_iter.IteratorSave(iterator))


def _two_process_step(root, step, seeds=(0, 0)):
  """Two RepeatIterator processes, mid-group (pending arrays), at `step`."""
  iterators = [_advance(_repeat_iterator(seed, i, 2), 1) for i, seed in enumerate(seeds)]
  _save_processes(os.path.join(root, str(step), "data"), iterators)
  return iterators


@pytest.fixture(scope="module")
def data_ckpt(tmp_path_factory):
  """Orbax root, steps 0, 3, 5 of a DataIterator, with a model item too."""
  root = tmp_path_factory.mktemp("data") / "ckpt"
  _orbax_save(root, ckpt_iter.DataIterator(_dataset()), [(0, 0), (3, 3), (5, 2)], with_params=True)
  return str(root)


@pytest.fixture(scope="module")
def repeat_ckpt(tmp_path_factory):
  """Orbax root, step 1 of a RepeatIterator mid-group: returns (root, state)."""
  root = tmp_path_factory.mktemp("repeat") / "ckpt"
  iterator = _repeat_iterator()
  _orbax_save(root, iterator, [(1, 1)])
  return str(root), iterator.state()


def _run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, out, err


def _row(key, value):
  """A regex for an aligned `key  value` line."""
  return re.compile(rf"^\s*{re.escape(key)}\s+{re.escape(value)}$", re.M)


def _files(directory):
  found = {}
  for parent, _, names in os.walk(directory):
    for name in names:
      with open(os.path.join(parent, name), "rb") as f:
        found[os.path.join(parent, name)] = f.read()
  return found


# ---------------------------------------------------------------------------
# inspect


def test_inspect_shows_latest_step_position_as_epoch_and_batch(capsys, data_ckpt):
  code, out, err = _run(capsys, "inspect", data_ckpt)
  assert (code, err) == (0, "")
  assert _row("step", "5 (latest); steps: 0, 3, 5").search(out)
  assert _row("item", "data, 1 process").search(out)
  assert _row("kind", "data").search(out)
  assert _row("position", "epoch 0, 10 of 12 records read (next_record 10)").search(out)
  assert _row("pending", "none").search(out)
  assert _row("seed", "0").search(out)
  assert _row("batches_per_epoch", str(BATCHES_PER_EPOCH)).search(out)


def test_inspect_step_and_json(capsys, data_ckpt):
  code, out, _ = _run(capsys, "inspect", data_ckpt, "--step", "3", "--json")
  assert code == 0
  report = json.loads(out)
  assert (report["step"], report["steps"], report["item"]) == (3, [0, 3, 5], "data")
  (process,) = report["processes"]
  assert process["format_version"] == ckpt_iter.FORMAT_VERSION
  assert (process["kind"], process["next_record"], process["epoch"]) == ("data", 6, 0)
  assert process["fingerprint"] == ckpt_iter.DataIterator(_dataset()).fingerprint
  assert process["pending"] is None and process["shuffle_key"] is None


def test_inspect_repeat_state_reports_pending_from_the_header(capsys, repeat_ckpt):
  root, state = repeat_ckpt
  code, out, _ = _run(capsys, "inspect", root, "--json")
  assert code == 0
  (process,) = json.loads(out)["processes"]
  pending = process["pending"]
  assert pending["items"] == len(state.pending.items) == 2
  assert pending["schedule"] == list(state.pending.schedule)
  assert pending["remaining"] == len(state.pending.schedule) == 3
  expected_bytes = sum(a.nbytes for item in state.pending.items for a in item.values())
  assert (pending["arrays"], pending["array_bytes"]) == (2, expected_bytes)  # one stacked array per leaf
  assert process["shuffle_key"] == list(state.shuffle_key)
  assert process["fingerprint"]["num_repeats"] == 2
  code, text, _ = _run(capsys, "inspect", root)
  assert _row("pending", f"2 items, 3 still to yield; 2 arrays, {expected_bytes} B").search(text)
  assert _row("pending schedule", "[" + " ".join(map(str, state.pending.schedule)) + "]").search(text)


def test_inspect_multi_process_step_separates_per_process_fields(capsys, tmp_path):
  _two_process_step(str(tmp_path), 4)
  code, out, _ = _run(capsys, "inspect", str(tmp_path))
  assert code == 0
  assert _row("item", "data, 2 processes").search(out)
  assert "process 0 of 2" in out and "process 1 of 2" in out
  assert _row("fingerprint shard_index", "0").search(out)
  assert _row("fingerprint shard_index", "1").search(out)
  assert "fingerprint (same in every process)" in out
  assert _row("shard_count", "2").search(out)


def test_inspect_reads_a_bare_grain_state_as_version_0(capsys, tmp_path):
  item_dir = tmp_path / "2" / "data"
  item_dir.mkdir(parents=True)
  (item_dir / "process_0-of-1.json").write_text('{"next_index": 3}')
  code, out, _ = _run(capsys, "inspect", str(tmp_path), "--json")
  (process,) = json.loads(out)["processes"]
  assert code == 0
  assert (process["format_version"], process["kind"], process["next_index"]) == (0, "data", 3)
  assert "epoch" not in process  # no fingerprint: epochs unknown
  assert _run(capsys, "verify", str(tmp_path))[0] == 0


def test_inspect_unreadable_process_exits_1_and_shows_the_others(capsys, tmp_path):
  _two_process_step(str(tmp_path), 4)
  (tmp_path / "4" / "data" / "process_1-of-2.json").write_text('{"format_version": 1, "kind"')
  code, out, err = _run(capsys, "inspect", str(tmp_path))
  assert code == 1
  assert "process 0 of 2" in out and _row("kind", "repeat").search(out)
  assert re.search(r"^  error: .*process_1-of-2\.json: not valid JSON", out, re.M)
  assert err.startswith("ckpt-iter: ") and "process_1-of-2.json" in err


# ---------------------------------------------------------------------------
# verify: sound checkpoints


def test_verify_sound_checkpoints_exit_0_with_one_summary_line(capsys, data_ckpt, repeat_ckpt):
  code, out, err = _run(capsys, "verify", data_ckpt)
  assert (code, err) == (0, "")
  assert out.splitlines() == [
      f"ok: {data_ckpt}: 3 steps (0, 3, 5), item 'data', 3 state files, 0 pending arrays checked"
  ]
  code, out, _ = _run(capsys, "verify", repeat_ckpt[0], "--step", "1")
  assert code == 0 and out.startswith("ok: ") and "2 pending arrays checked" in out


def test_verify_ignores_orbax_tmp_dirs_and_chooses_the_data_item(capsys, tmp_path):
  _two_process_step(str(tmp_path), 4)
  _save_processes(str(tmp_path / "4" / "other"), [_repeat_iterator()])
  tmp_step = tmp_path / "6.orbax-checkpoint-tmp-1700000000" / "data"
  tmp_step.mkdir(parents=True)
  (tmp_step / "process_0-of-2.json").write_text("{half written")
  code, out, _ = _run(capsys, "verify", str(tmp_path))
  assert code == 0 and "1 step (4), item 'data', 2 state files" in out
  code, out, _ = _run(capsys, "verify", str(tmp_path), "--item", "other")
  assert code == 0 and "item 'other', 1 state file" in out


# ---------------------------------------------------------------------------
# verify: one line per problem


def _rewrite_npz(path, change):
  with np.load(path, allow_pickle=False) as npz:
    arrays = {name: npz[name] for name in npz.files}
  arrays["a0"] = change(arrays["a0"])
  os.remove(path)
  np.savez(path, **arrays)


def _edit_json(path, change):
  with open(path) as f:
    header = json.load(f)
  change(header)
  with open(path, "w") as f:
    json.dump(header, f)


def _truncate(path):
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])


def _garble(path):
  with open(path, "rb") as f:
    data = bytearray(f.read())
  data[10:20] = b"\xff\x00garbage!"
  with open(path, "wb") as f:
    f.write(bytes(data))


CORRUPTIONS = {
    "missing process file": (
        lambda d: os.remove(d / "process_1-of-2.json"),
        "process_1-of-2.json", "missing: process 1 of 2 wrote no state"),
    "truncated json": (
        lambda d: _truncate(d / "process_0-of-2.json"),
        "process_0-of-2.json", "not valid JSON"),
    "garbled json": (
        lambda d: _garble(d / "process_1-of-2.json"),
        "process_1-of-2.json", "not valid JSON"),
    "missing npz": (
        lambda d: os.remove(d / "process_0-of-2.npz"),
        "process_0-of-2.npz", "missing; the state refers to array 'a0'"),
    "truncated npz": (
        lambda d: _truncate(d / "process_1-of-2.npz"),
        "process_1-of-2.npz", "not a readable npz"),
    "wrong dtype": (
        lambda d: _rewrite_npz(d / "process_0-of-2.npz", lambda a: a.astype(np.int64)),
        "process_0-of-2.npz", "array 'a0' is <i8[2, 2, 3], but the state header says <i4[2, 2, 3]"),
    "wrong shape": (
        lambda d: _rewrite_npz(d / "process_1-of-2.npz", lambda a: a.reshape(2, 3, 2)),
        "process_1-of-2.npz", "array 'a0' is <i4[2, 3, 2], but the state header says <i4[2, 2, 3]"),
    "newer format_version": (
        lambda d: _edit_json(d / "process_0-of-2.json", lambda h: h.update(format_version=ckpt_iter.FORMAT_VERSION + 1)),
        "process_0-of-2.json", f"has format_version {ckpt_iter.FORMAT_VERSION + 1}"),
    "inconsistent fingerprints": (
        lambda d: _save_processes(d, [_advance(_repeat_iterator(0, 0, 2), 1),
                                      _advance(_repeat_iterator(1, 1, 2), 1)]),
        "process_1-of-2.json", "fingerprint differs from process_0-of-2.json: seed=1 here, 0 there"),
    "different kinds": (
        lambda d: _save_processes(d, [_advance(_repeat_iterator(0, 0, 2), 1),
                                      ckpt_iter.DataIterator(_dataset(0, 1, 2))]),
        "process_1-of-2.json", "kind='data' here, 'repeat' there"),
    "garbled count file": (
        lambda d: (d / "ckpt_iter.json").write_text('{"process_count": "two"}'),
        "ckpt_iter.json", "field 'process_count' is 'two'"),
    "stale count file": (
        lambda d: (d / "ckpt_iter.json").write_text('{"process_count": 3}'),
        "ckpt_iter.json", "says 3 processes, but the state files are the set of 2"),
    "mixed process counts": (
        lambda d: _save_processes(d, [_repeat_iterator()]),
        "", "state files of different process counts (1, 2)"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_verify_reports_each_corruption_on_one_line(capsys, tmp_path, name):
  corrupt, file_name, what = CORRUPTIONS[name]
  _two_process_step(str(tmp_path), 3)
  _two_process_step(str(tmp_path), 4)
  item_dir = tmp_path / "4" / "data"
  corrupt(item_dir)
  before = _files(tmp_path)
  code, out, err = _run(capsys, "verify", str(tmp_path))
  assert code == 1
  (line,) = out.splitlines()
  assert line.startswith(f"step 4: {item_dir / file_name}: "), line
  assert line.count(str(item_dir / file_name)) == 1, line
  assert what in line
  assert err == f"ckpt-iter: 1 problem in {tmp_path}\n"
  assert _files(tmp_path) == before  # verify changes nothing on disk


def test_verify_one_line_per_problem_across_files_and_steps(capsys, tmp_path):
  for step in (3, 4, 5):
    _two_process_step(str(tmp_path), step)
  os.remove(tmp_path / "3" / "data" / "process_1-of-2.json")
  _garble(tmp_path / "3" / "data" / "process_0-of-2.json")
  os.remove(tmp_path / "5" / "data" / "process_1-of-2.npz")
  code, out, _ = _run(capsys, "verify", str(tmp_path))
  assert code == 1
  lines = out.splitlines()
  assert [line.split(":")[0] for line in lines] == ["step 3", "step 3", "step 5"]
  assert "process_1-of-2.json: missing" in lines[0]
  assert "process_0-of-2.json: not valid JSON" in lines[1]
  assert "process_1-of-2.npz: missing" in lines[2]
  code, out, _ = _run(capsys, "verify", str(tmp_path), "--step", "4")
  assert code == 0 and out.startswith("ok: ")


def test_verify_reports_a_step_without_the_data_item(capsys, tmp_path):
  _two_process_step(str(tmp_path), 3)
  _two_process_step(str(tmp_path), 4)
  shutil.rmtree(tmp_path / "4" / "data")
  (tmp_path / "4" / "model_params").mkdir()
  code, out, _ = _run(capsys, "verify", str(tmp_path))
  assert code == 1
  assert out.splitlines() == [
      f"step 4: {tmp_path / '4' / 'data'}: missing: the step holds no 'data' item "
      "(it holds: model_params)."
  ]


# ---------------------------------------------------------------------------
# diff


def test_diff_two_steps_of_one_checkpoint(capsys, data_ckpt):
  code, out, _ = _run(capsys, "diff", data_ckpt, "--step", "0", "--step", "5")
  assert code == 0
  fields = len(ckpt_iter.DataIterator(_dataset()).fingerprint)
  assert _row("fingerprint", f"same ({fields} fields)").search(out)
  assert _row("position", "epoch 0, 0 of 12 records read (next_record 0) -> epoch 0, 10 of 12 records read (next_record 10)").search(out)
  code, out, _ = _run(capsys, "diff", data_ckpt, "--step", "5", "--step", "5")
  assert code == 0 and _row("state", "identical").search(out)


def test_diff_takes_the_steps_after_the_directories(capsys, tmp_path, data_ckpt):
  expected = _run(capsys, "diff", data_ckpt, "--step", "0", "--step", "5", "--json")
  assert _run(capsys, "diff", data_ckpt, "0", "5", "--json") == expected
  assert _run(capsys, "diff", data_ckpt, "00000000", "5", "--json") == expected
  text = _run(capsys, "diff", data_ckpt, "0", "5")
  assert text[0] == 0 and _row("position", "epoch 0, 0 of 12 records read (next_record 0) -> epoch 0, 10 of 12 "
                               "records read (next_record 10)").search(text[1])
  other = tmp_path / "other"
  shutil.copytree(data_ckpt, other)
  two = _run(capsys, "diff", data_ckpt, str(other), "3", "5", "--json")
  assert two == _run(capsys, "diff", data_ckpt, str(other), "--step", "3", "--step", "5", "--json")
  assert (json.loads(two[1])["a"]["step"], json.loads(two[1])["b"]["step"]) == (3, 5)
  # Two arguments are two directories, also when named like steps.
  os.makedirs(tmp_path / "8")
  shutil.copytree(data_ckpt, tmp_path / "12")
  code, _, err = _run(capsys, "diff", str(tmp_path / "8"), str(tmp_path / "12"))
  assert code == 2 and "not a checkpoint" in err and str(tmp_path / "8") in err


def test_diff_two_checkpoints_names_fingerprint_fields(capsys, tmp_path, data_ckpt):
  other = tmp_path / "other"
  _save_processes(str(other / "9" / "data"), [_advance(ckpt_iter.DataIterator(_dataset(seed=1)), 8)])
  code, out, _ = _run(capsys, "diff", data_ckpt, str(other), "--json")
  assert code == 0
  report = json.loads(out)
  assert (report["a"]["step"], report["b"]["step"]) == (5, 9)
  (process,) = report["processes"]
  assert process["fingerprint"] == {"seed": [0, 1]}
  assert process["position"]["next_record"] == [10, 16]
  assert process["position"]["epoch"] == [0, 1]
  code, text, _ = _run(capsys, "diff", data_ckpt, str(other))
  assert _row("fingerprint seed", "0 -> 1").search(text)
  assert _row("position", "epoch 0, 10 of 12 records read (next_record 10) -> epoch 1, 4 of 12 records read (next_record 16)").search(text)


def _tokenize_in_module(tmp_path, module_name):
  """A `tokenize` defined in a module `module_name` (the same code in every module)."""
  path = tmp_path / f"{module_name}.py"
  path.write_text("def tokenize(record):\n  return {**record, 'length': len(str(record))}\n")
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.tokenize


def test_diff_shows_a_function_moved_to_another_module_as_no_pipeline_change(capsys, tmp_path):
  roots = {}
  for module_name in ("ci_cli_script", "ci_cli_package"):
    dataset = ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=0, num_epochs=2, shard_index=0, shard_count=1,
                                     transform=_tokenize_in_module(tmp_path, module_name))
    roots[module_name] = tmp_path / module_name
    _save_processes(str(roots[module_name] / "2" / "data"), [_advance(ckpt_iter.DataIterator(dataset), 2)])
  a, b = (str(roots[name]) for name in ("ci_cli_script", "ci_cli_package"))
  code, out, _ = _run(capsys, "diff", a, b, "--json")
  assert code == 0
  (process,) = json.loads(out)["processes"]
  assert process == {"process_index": 0, "fingerprint_same_function": {
      "transform": ["ci_cli_script.tokenize", "ci_cli_package.tokenize"]}}
  code, text, _ = _run(capsys, "diff", a, b)
  assert _row("fingerprint", f"same ({len(ckpt_iter.DataIterator(dataset).fingerprint)} fields)").search(text)
  assert _row("fingerprint transform", "ci_cli_script.tokenize -> ci_cli_package.tokenize (the same code: "
              "the same function, no pipeline change)").search(text)


# ---------------------------------------------------------------------------
# usage errors: exit 2, one `ckpt-iter: ` message, no traceback


def test_usage_errors_exit_2(capsys, tmp_path, data_ckpt):
  (tmp_path / "empty").mkdir()
  (tmp_path / "stock" / "4" / "model_params").mkdir(parents=True)
  cases = [
      (["inspect", str(tmp_path / "absent")], "no such directory"),
      (["verify", str(tmp_path / "empty")], "not a checkpoint: no step directories"),
      (["verify", str(tmp_path / "stock")], "not a ckpt_iter checkpoint"),
      (["inspect", data_ckpt, "--step", "4"], "no step 4 in"),
      (["verify", data_ckpt, "--step", "4"], "no step 4 in"),
      (["inspect", data_ckpt, "--item", "params"], "no step holds ckpt_iter state in an item named 'params'"),
      (["inspect", data_ckpt, "--step", "x"], "step must be a non-negative integer"),
      (["diff", data_ckpt, "--step", "3"], "diff compares two states"),
      (["diff", data_ckpt, data_ckpt, "--step", "3"], "diff compares two states"),
      (["diff", data_ckpt, "3", "5", "--step", "3", "--step", "5"], "give the two steps one way"),
      (["diff", data_ckpt, "3", "5", "0", "1"], "diff compares two states"),
      (["diff", data_ckpt, "3", "4"], "no step 4 in"),
      (["frobnicate"], "invalid choice"),
  ]
  for argv, message in cases:
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, ""), argv
    assert "ckpt-iter: " in err and message in err, (argv, err)
  code, _, err = _run(capsys)
  assert code == 2 and "inspect" in err


def test_several_items_without_data_need_item(capsys, tmp_path):
  _save_processes(str(tmp_path / "1" / "left"), [_repeat_iterator()])
  _save_processes(str(tmp_path / "1" / "right"), [_repeat_iterator()])
  code, _, err = _run(capsys, "inspect", str(tmp_path))
  assert code == 2 and "several items hold ckpt_iter state (left, right)" in err
  assert _run(capsys, "inspect", str(tmp_path), "--item", "right")[0] == 0


# ---------------------------------------------------------------------------
# help and demo


def test_help_lists_verbs_and_every_verb_has_help(capsys):
  code, out, _ = _run(capsys, "--help")
  assert code == 0
  for verb in ("inspect", "verify", "diff"):
    assert re.search(rf"^\s+{verb}\s+\S", out, re.M), verb
  assert "`ckpt-iter train" in out and "`make demo`" in out  # dispatched by ckpt_iter.__main__, named in the help
  for verb in ("inspect", "verify", "diff"):
    code, out, _ = _run(capsys, verb, "--help")
    assert code == 0 and out.startswith(f"usage: ckpt-iter {verb}") and "--step" in out


def test_entry_point_points_demo_at_the_repository_and_sends_the_rest_to_the_cli(capsys):
  from ckpt_iter import __main__ as entry  # pylint: disable=g-import-not-at-top

  assert entry.main(["demo", "--learner", "agentic"]) == 2
  assert "make demo" in capsys.readouterr().err  # the wheel holds the library, not the demo
  assert entry.main(["verify", "--help"]) == 0
  assert capsys.readouterr().out.startswith("usage: ckpt-iter verify")


def test_demo_learner_option_picks_the_scenario_and_its_defaults(capsys):
  demo = pytest.importorskip("demo.__main__", reason="the demo needs Tunix")

  grpo = demo._parse([])  # pylint: disable=protected-access
  assert (grpo.learner, grpo.preempt_after, grpo.num_iterations, grpo.max_steps) == ("grpo", 3, 2, 8)
  agentic = demo._parse(["--learner", "agentic"])  # pylint: disable=protected-access
  assert (agentic.preempt_after, agentic.num_iterations, agentic.max_steps) == (1, 2, 2)
  assert demo._parse(["--learner", "agentic", "--preempt-after", "3"]).preempt_after == 3  # pylint: disable=protected-access
  with pytest.raises(SystemExit):  # the agentic learner has no data_shuffle_seed
    demo._parse(["--learner", "agentic", "--data-shuffle-seed", "1"])  # pylint: disable=protected-access
  assert "--data-shuffle-seed" in capsys.readouterr().err


def test_verify_reports_processes_at_different_positions(capsys, tmp_path):
  # A make_dataset position is global: every process of a step must agree.
  iterators = [_advance(_repeat_iterator(0, i, 2), 1) for i in range(2)]
  _advance(iterators[1], 3)  # process 1 saved later than process 0
  item_dir = tmp_path / "4" / "data"
  _save_processes(str(item_dir), iterators)
  code, out, _ = _run(capsys, "verify", str(tmp_path))
  assert code == 1
  (line,) = out.splitlines()
  assert line.startswith(f"step 4: {item_dir}: process_1-of-2.json has "), line
  assert "must agree" in line


# ---------------------------------------------------------------------------
# train: Tunix's YAML pipelines with the Resumable learners (ckpt_iter.tunix.cli;
# the real pipeline runs in tests/integration/test_tunix_cli.py)


def _train(capsys, *argv):
  from ckpt_iter import __main__ as entry  # pylint: disable=g-import-not-at-top

  code = entry.main(["train", *argv])
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, out, err


@_NEEDS_TUNIX
def test_train_help_and_usage_errors(capsys, tmp_path):
  code, out, _ = _train(capsys, "--help")
  assert code == 0 and out.startswith("usage: ckpt-iter train {grpo,ppo,sft} CONFIG.yaml")
  assert "`ckpt-iter train --help`" in _run(capsys, "--help")[1]  # named in the help
  config = tmp_path / "c.yaml"
  config.write_text("a: 1\n")
  for argv, message in [
      ((), "give a pipeline and a config file"),
      (("dpo", str(config)), "unknown pipeline 'dpo'; expected one of grpo, ppo, sft"),
      (("grpo",), "the argument after 'grpo' must be the config file"),
      (("grpo", "a=1"), "the argument after 'grpo' must be the config file"),
      (("grpo", str(tmp_path / "missing.yaml")), f"config file '{tmp_path / 'missing.yaml'}' does not exist"),
      # Tunix resolves this bare name inside its package; the wheels do not ship it.
      (("grpo", "base_config.yaml"), "'base_config.yaml' means Tunix's bundled base config"),
  ]:
    code, out, err = _train(capsys, *argv)
    assert (code, out) == (2, ""), argv
    assert err.startswith("usage: ckpt-iter train") and f"ckpt-iter train: {message}" in err, err


@pytest.mark.tunix_0_1_7
@_NEEDS_TUNIX
def test_train_ppo_needs_upstream_mains_pipeline(capsys, tmp_path):
  config = tmp_path / "c.yaml"
  config.write_text("a: 1\n")
  code, _, err = _train(capsys, "ppo", str(config))
  assert code == 1
  assert err == (
      "ckpt-iter train: this Tunix (0.1.7) has no tunix.cli.ppo_main (No module named "
      "'tunix.cli.ppo_main'), so `train ppo` cannot run here; upstream Tunix main has it.\n"
  )


def _learner_slots():
  from tunix.rl.agentic import agentic_grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.sft import peft_trainer  # pylint: disable=g-import-not-at-top

  return {
      "grpo": grpo_learner.GrpoLearner, "agentic": agentic_grpo_learner.GRPOLearner,
      "sft": peft_trainer.PeftTrainer,
  }


@_NEEDS_TUNIX
def test_train_swaps_the_learner_classes_for_the_run_only():
  from ckpt_iter import tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import cli as tunix_cli  # pylint: disable=g-import-not-at-top

  stock = _learner_slots()
  with tunix_cli.resumable_learners("grpo") as pipeline:
    assert pipeline.__name__ == "tunix.cli.grpo_main"
    assert _learner_slots() == {
        "grpo": ckpt_tunix.ResumableGRPOLearner, "agentic": ckpt_tunix.ResumableAgenticGRPOLearner,
        "sft": stock["sft"],  # only what this pipeline builds
    }
  assert _learner_slots() == stock
  with pytest.raises(RuntimeError, match="boom"):
    with tunix_cli.resumable_learners("grpo"):
      raise RuntimeError("boom")
  assert _learner_slots() == stock  # put back however the run ends


@_NEEDS_TUNIX
def test_train_names_a_missing_tunix_internal(monkeypatch):
  from ckpt_iter.tunix import _api  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import cli as tunix_cli  # pylint: disable=g-import-not-at-top

  # A Tunix that renamed the class, or bound it at import time (so the
  # pipeline's source no longer looks it up), fails before anything runs.
  monkeypatch.setitem(_api.CLI_PIPELINES, "grpo", ("tunix.cli.grpo_main", (
      ("tunix.rl.grpo.grpo_learner", "GrpoLearnerV2", "grpo_learner.GrpoLearnerV2("),
      ("tunix.rl.grpo.grpo_learner", "GRPOLearner", "grpo_learner.GRPOLearner("),
  )))
  stock = _learner_slots()
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as info:
    with tunix_cli.resumable_learners("grpo"):
      pass
  message = str(info.value)
  assert "tunix.rl.grpo.grpo_learner.GrpoLearnerV2 is missing" in message
  assert "tunix.cli.grpo_main no longer builds its learner through `grpo_learner.GRPOLearner(`" in message
  assert _learner_slots() == stock


# ---------------------------------------------------------------------------
# A light command: what it loads, its version, JSON from every read-only verb,
# exit codes in each verb's help, a closed pipe, a missing Tunix.


def test_version_and_exit_codes_in_every_verbs_help(capsys):
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  code, out, _ = _run(capsys, "--version")
  assert (code, out) == (0, f"ckpt-iter {ckpt_iter.__version__}\n")
  for verb, codes in (("inspect", "0 shown, 1 a state file is unreadable, 2 usage error"),
                      ("verify", "0 sound, 1 problems (one line each), 2 usage error"),
                      ("diff", "0 compared (whether or not they differ), 1 a state file is unreadable, 2 usage error"),
                      ("audit", "0 an unbroken chain (every resume the kept states record proven), 1 a break")):
    code, out, _ = _run(capsys, verb, "--help")
    assert code == 0 and f"exit codes: {codes}" in " ".join(out.split()), verb


def test_verify_json_reports_the_same_as_its_lines(capsys, data_ckpt, tmp_path):
  code, out, _ = _run(capsys, "verify", str(data_ckpt), "--json")
  report = json.loads(out)
  assert code == 0 and report["ok"] and report["problems"] == [] and report["steps"] == [0, 3, 5]
  broken = tmp_path / "broken"
  shutil.copytree(data_ckpt, broken)
  (broken / "3" / "data" / "process_0-of-1.json").write_text("{")
  code, out, _ = _run(capsys, "verify", str(broken), "--json")
  report = json.loads(out)
  assert code == 1 and not report["ok"]
  (problem,) = report["problems"]
  assert problem["step"] == 3 and problem["path"].endswith("3/data/process_0-of-1.json")
  assert "not valid JSON" in problem["message"]


