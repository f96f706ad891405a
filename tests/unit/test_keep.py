"""ckpt_iter.KeepResumedSteps: Orbax keeps the steps a run resumed from, so `ckpt-iter audit` proves it.

A run of four processes (each restores the latest step and saves four more,
as a preempted job does) through a real CheckpointManager: with
`max_to_keep` alone the steps it resumed from are deleted and the audit is
"not proven" (exit 3); with the policy they are kept and the chain is proven
(exit 0).
"""

import contextlib
import io
import logging
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import cli

_SEGMENTS, _STEPS_EACH = 4, 4


def _options(root, policy, max_to_keep):
  if policy:
    return ocp.CheckpointManagerOptions(preservation_policy=ckpt_iter.KeepResumedSteps(root, max_to_keep=max_to_keep))
  return ocp.CheckpointManagerOptions(max_to_keep=max_to_keep)


def _run(root, *, policy, max_to_keep, repeat):
  """Four processes' worth of training: each restores the latest step (but the first) and saves four."""
  for segment in range(_SEGMENTS):
    dataset = ckpt_iter.make_dataset([{"x": i} for i in range(64)], batch_size=2, seed=1, num_epochs=None,
                                     shard_index=0, shard_count=1)
    iterator = ckpt_iter.DataIterator(dataset)
    if repeat:
      iterator = ckpt_iter.RepeatIterator(iterator, produce=lambda b: {"y": b["x"] * np.int64(2)}, num_repeats=3,
                                          group_size=2, shuffle_seed=5)
    with ocp.CheckpointManager(root, options=_options(root, policy, max_to_keep)) as manager:
      if segment:
        manager.restore(manager.latest_step(), args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
      for step in range(segment * _STEPS_EACH + 1, (segment + 1) * _STEPS_EACH + 1):
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
      kept = manager.all_steps()
  return sorted(kept)


def _audit(root):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = cli.main(["audit", root])
  return code, out.getvalue()


@pytest.mark.parametrize("repeat", [False, True], ids=["data", "repeat"])
@pytest.mark.parametrize("max_to_keep", [1, 2])
def test_the_policy_keeps_the_resumed_steps_and_the_audit_proves_the_run(tmp_path, max_to_keep, repeat):
  root = str(tmp_path / "with_policy")
  kept = _run(root, policy=True, max_to_keep=max_to_keep, repeat=repeat)
  last = _SEGMENTS * _STEPS_EACH
  resumed_from = [s * _STEPS_EACH for s in range(1, _SEGMENTS)]  # 4, 8, 12
  assert kept == resumed_from + list(range(last - max_to_keep + 1, last + 1)), kept
  code, out = _audit(root)
  assert code == cli.EXIT_OK, out
  assert out.rstrip().endswith(f"unbroken chain: {len(kept)} state(s), 3 resume(s), 3 proven exact"), out


@pytest.mark.parametrize("max_to_keep", [1, 2])
def test_without_the_policy_the_audit_is_not_proven_and_names_the_policy(tmp_path, max_to_keep):
  root = str(tmp_path / "max_to_keep_only")
  last = _SEGMENTS * _STEPS_EACH
  assert _run(root, policy=False, max_to_keep=max_to_keep, repeat=False) == list(range(last - max_to_keep + 1, last + 1))
  code, out = _audit(root)
  assert code == cli.EXIT_UNPROVEN, out
  assert "preservation_policy=ckpt_iter.KeepResumedSteps(ROOT, max_to_keep=N)" in out, out


def test_a_run_never_resumed_keeps_only_the_latest(tmp_path):
  root = str(tmp_path / "fresh")
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(list(range(20)), batch_size=2, seed=1, num_epochs=None,
                                                           shard_index=0, shard_count=1))
  with ocp.CheckpointManager(root, options=_options(root, True, 2)) as manager:
    for step in range(1, 7):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
    assert manager.all_steps() == [5, 6]


def test_a_state_that_cannot_be_read_keeps_nothing_and_says_so(tmp_path, caplog):
  root = str(tmp_path / "garbled")
  policy = ckpt_iter.KeepResumedSteps(root, max_to_keep=1)
  item_dir = os.path.join(root, "3", "data")
  os.makedirs(item_dir)
  with open(os.path.join(item_dir, "process_0-of-1.json"), "w") as f:
    f.write("{not json")
  with caplog.at_level(logging.WARNING, logger="ckpt_iter"):
    assert policy.resumed_from(saving=4) == set()
  assert f"{os.path.join(item_dir, 'process_0-of-1.json')}: cannot read the steps it resumed from" in caplog.text


@pytest.mark.parametrize("bad, fragment", [
    ({"max_to_keep": 0}, "max_to_keep must be a positive int or None"),
    ({"max_to_keep": 2.0}, "max_to_keep must be a positive int or None"),
    ({"max_to_keep": 2, "item": ""}, "item must be the name of the step's item"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, bad, fragment):
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=fragment):
    ckpt_iter.KeepResumedSteps(tmp_path, **bad)


def _cli(*argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


def test_the_policy_keeps_what_the_data_map_needs_and_every_verb_names_it_alike(tmp_path):
  """`which --batch` and `order` read the step each segment resumed from: the policy keeps them; without
  it, `order` and `audit` name the same way to keep them (issue 47, item 9's end)."""
  from ckpt_iter import datamap  # pylint: disable=g-import-not-at-top

  kept = str(tmp_path / "with_policy")
  _run(kept, policy=True, max_to_keep=1, repeat=False)
  code, out, err = _cli("order", kept, "--out", str(tmp_path / "kept.jsonl"))
  assert code == 0, err
  with open(tmp_path / "kept.jsonl") as f:
    assert len(f.readlines()) == _SEGMENTS * _STEPS_EACH  # every batch of the run numbered
  assert _cli("which", kept, "--batch", "0")[0] == 0

  gone = str(tmp_path / "max_to_keep_only")
  _run(gone, policy=False, max_to_keep=1, repeat=False)
  # A single source's segments are in the resume records (their start, batch size, processes): `order`
  # numbers the run from the latest step alone; a mixture's ledger needs the steps (test_cli_which).
  code, _, err = _cli("order", gone, "--out", str(tmp_path / "gone.jsonl"))
  assert code == 0, err
  with open(tmp_path / "gone.jsonl") as f, open(tmp_path / "kept.jsonl") as g:
    assert f.read() == g.read()
  code, out, _ = _cli("audit", gone)
  assert code == cli.EXIT_UNPROVEN and datamap.KEEP_RESUMED_STEPS in out, out
  assert "ckpt_iter.KeepResumedSteps(" in datamap.KEEP_RESUMED_STEPS and "keep_period" not in out
