"""Two jobs saving into one root (issue 48, item 9).

Orbax's baseline, measured: it has no lock and no owner of a root, and a
manager knows only the steps it listed when it was opened and those it saved.
  * Two managers opened on one root before either saved (two jobs started
    together), saving the same step numbers one after the other: every save
    succeeds, with no error or warning. Each step is whole from one job (a
    step is written in a tmp directory and renamed); which job's depends on
    timing (here: the later save of each step). The root holds a mix of two
    runs, step by step. This test runs that, in one process, deterministically.
  * Two processes saving the same step at the same moment: one gets
    FileExistsError on `<step>.orbax-checkpoint-tmp` from Orbax's background
    thread and then cannot finish for Orbax's 300 s signal timeout (with or
    without ckpt_iter's item), so that race is not run here.
  * A job started later restores the other job's latest step: ckpt_iter
    refuses it (ConfigDriftError naming the field), below too.

What ckpt_iter makes of the mix (no silent mix):
  * `ckpt-iter audit` exits 1 and names the first step whose pipeline
    differs from the step before with no resume between them ("another job
    writing into this root?");
  * a restore of a step the other job wrote fails with ConfigDriftError
    naming the field (seed=5 there, seed=6 here), and a restore of one's own
    step continues one's own stream exactly;
  * within a step, the data item and the params are the same job's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import cli
from ckpt_iter import errors

import ledger_writer
import support

_WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "ledger_writer.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TIMEOUT_S = 240
STEPS = 8
PIPELINES = {seed: {"mixture": {"a": 2, "b": 1}, "skip": [[5, 9]], "seed": seed} for seed in (5, 6)}


def _saved_by(root: str, step: int) -> tuple[int, int]:
  """(the data state's seed, the params' job) of one step."""
  state = _files.read_state(os.path.join(root, str(step), "data"), 0, 1)
  with ocp.CheckpointManager(root) as manager:
    params = manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore()))["model"]
  return state.fingerprint["seed"], int(params["job"])


def test_two_jobs_in_one_root_are_told_apart_never_mixed(tmp_path, capsys):
  root = str(tmp_path / "root")
  # Job 6 saves each step after job 5 except steps 3 and 6, where job 5 saves last.
  order = {step: (5, 6) if step not in (3, 6) else (6, 5) for step in range(1, STEPS + 1)}
  jobs = {seed: (ledger_writer.build_iterator(pipeline), ocp.CheckpointManager(root))
          for seed, pipeline in PIPELINES.items()}
  try:
    for step in range(1, STEPS + 1):
      for seed in order[step]:
        iterator, manager = jobs[seed]
        next(iterator)
        assert manager.save(step, args=ocp.args.Composite(
            data=ckpt_iter.IteratorSave(iterator),
            model=ocp.args.StandardSave({"w": np.full((4,), step, np.float32), "job": np.int32(seed)})))
        manager.wait_until_finished()  # Orbax's baseline: saved, no error, no warning
  finally:
    for _, manager in jobs.values():
      manager.close()

  owners = {step: _saved_by(root, step) for step in range(1, STEPS + 1)}
  assert all(data == params for data, params in owners.values()), owners  # each step is one job's, whole
  seeds = [owners[step][0] for step in range(1, STEPS + 1)]
  assert seeds == [order[step][1] for step in range(1, STEPS + 1)], seeds  # the later save won each step

  code = cli.main(["audit", root])
  out = capsys.readouterr().out
  changes = [step for step in range(2, STEPS + 1) if seeds[step - 1] != seeds[step - 2]]
  assert changes == [3, 4, 6, 7], changes  # the order above mixes them
  first = changes[0]
  assert code == cli.EXIT_PROBLEMS, out
  assert (f"broken: process 0: step {first}: its pipeline differs from step {first - 1}'s "
          f"(seed: {seeds[first - 2]} -> {seeds[first - 1]}) with no resume between them: another job "
          "writing into this root?") in out, out

  latest, owner = STEPS, seeds[-1]
  for seed, pipeline in PIPELINES.items():
    iterator = ledger_writer.build_iterator(pipeline)
    restore = ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator))
    with ocp.CheckpointManager(root) as manager:
      if seed != owner:
        with pytest.raises(errors.ConfigDriftError, match=f"seed={owner} there, seed={seed} here"):
          manager.restore(latest, args=restore)
        continue
      manager.restore(latest, args=restore)
    reference = ledger_writer.build_iterator(pipeline)
    expected = [support.batch_ids(next(reference)) for _ in range(latest + 4)][latest:]
    assert [support.batch_ids(next(iterator)) for _ in range(4)] == expected


def test_a_second_job_started_on_a_root_another_job_writes_is_refused_naming_the_field(tmp_path):
  """Real processes: job 5 saves 3 steps; job 6, started on the same root as a trainer starts (restore
  the latest step), stops before it saves anything: ConfigDriftError naming the seed and the step's file."""
  root = str(tmp_path / "root")
  done = {}
  for seed in (5, 6):
    config = tmp_path / f"job_{seed}.json"
    config.write_text(json.dumps({"root": root, "log": str(tmp_path / f"job_{seed}.log"), "steps": 3,
                                  "seconds": 60, "async": True, "model": True, "pipeline": PIPELINES[seed]}))
    done[seed] = subprocess.run([sys.executable, _WORKER, str(config)], capture_output=True, text=True,
                                cwd=_REPO, timeout=_TIMEOUT_S)
  assert done[5].returncode == 0, done[5].stderr[-3000:]
  assert done[6].returncode != 0 and done[6].stdout == ""
  assert (f"ConfigDriftError: {root}/3/data/process_0-of-1.json was written by a different pipeline: seed=5 "
          "there, seed=6 here.") in done[6].stderr, done[6].stderr[-3000:]
  with ocp.CheckpointManager(root) as manager:
    assert manager.all_steps() == [1, 2, 3]  # job 5's steps, untouched
  assert cli.main(["audit", root]) == cli.EXIT_OK
