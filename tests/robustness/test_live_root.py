"""`ckpt-iter verify` and `audit` on a root a live writer prunes (issue 42, item 2).

Orbax's `max_to_keep` deletes a step while the CLI reads it. Such a step is
no problem of the checkpoint: verify and audit say it was removed while
reading and judge the rest (they exited 1, "cannot read it", or aborted
with a FileNotFoundError). A step that is present but unreadable is still
an error. Deterministic hooks delete a step between listing and reading,
at once or as Orbax does (files first, the directories later); then a real
CheckpointManager with max_to_keep=2 saves as fast as it can while both
commands run in a loop, and no run may raise a false alarm.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import cli
from ckpt_iter.cli import _inspect as inspection
import support

STEPS = (1, 2, 3, 4)
GONE = 2  # the step the hooks delete
_WORKERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers")


def _produce(batch: dict) -> dict:
  return {"x": batch["x"], "y": np.ones(4, np.float32)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
  """An Orbax root of one run: a RepeatIterator's data item (pending arrays included) at steps 1-4."""
  root = str(tmp_path_factory.mktemp("live") / "pristine")
  dataset = ckpt_iter.make_dataset([{"x": i} for i in range(40)], batch_size=2, seed=3, num_epochs=None,
                                   shard_index=0, shard_count=1)
  iterator = ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset), produce=_produce, num_repeats=2,
                                      group_size=3, shuffle_seed=7)
  with ocp.CheckpointManager(root) as manager:
    for step in STEPS:
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  return root


@pytest.fixture
def root(pristine, tmp_path) -> str:
  copy = str(tmp_path / "root")
  shutil.copytree(pristine, copy)
  return copy


def _run(*argv: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("files_first", [False, True], ids=["whole", "files_first"])
@pytest.mark.parametrize("verb", ["verify", "audit"])
def test_a_step_deleted_between_listing_and_reading_is_reported_as_removed(root, monkeypatch, verb, files_first):
  deleter = support.StepDeleter(monkeypatch, os.path.join(root, str(GONE)), files_first=files_first)
  code, out, err = _run(verb, root, "--json")
  deleter.join()
  assert deleter.fired
  assert code == 0, (code, out, err)
  report = json.loads(out)
  assert report["removed_while_reading"] == [GONE], report
  assert report["steps"] == [s for s in STEPS if s != GONE], report
  if verb == "verify":
    assert report["ok"] and report["problems"] == [] and report["state_files"] == len(STEPS) - 1, report
  else:
    assert report["verdict"] == "ok" and report["findings"] == [], report
    assert [p["step"] for p in report["points"]] == [s for s in STEPS if s != GONE], report


@pytest.mark.parametrize("verb", ["verify", "audit"])
def test_the_text_report_says_which_step_was_removed_and_judges_the_rest(root, monkeypatch, verb):
  support.StepDeleter(monkeypatch, os.path.join(root, str(GONE)))
  code, out, err = _run(verb, root)
  assert code == 0, (code, out, err)
  if verb == "verify":
    assert out.startswith(f"ok: {root}: 3 steps (1, 3-4), item 'data', 3 state files"), out
    assert out.rstrip().endswith(
        f"; 1 step ({GONE}) removed while reading (deleted by the writer's retention, e.g. Orbax's "
        "max_to_keep), not checked"), out
  else:
    assert f"  step(s) {GONE}: removed while reading (deleted by the writer's retention" in out, out
    assert out.rstrip().endswith("unbroken chain: 3 state(s), 0 resume(s), 0 proven exact"), out


def test_verify_of_a_named_step_that_vanishes_says_nothing_was_checked(root, monkeypatch):
  support.StepDeleter(monkeypatch, os.path.join(root, str(GONE)))
  code, out, err = _run("verify", root, "--step", str(GONE))
  assert code == cli.EXIT_NOTHING == 4, (code, out, err)
  assert out == ""
  assert err == (f"ckpt-iter: nothing checked in {root}: 1 step ({GONE}) removed while reading (deleted by "
                 "the writer's retention, e.g. Orbax's max_to_keep); verify the steps kept now\n"), err


@pytest.mark.parametrize("verb", ["verify", "audit"])
def test_a_step_that_stays_but_loses_its_state_file_is_still_an_error(root, monkeypatch, verb):
  """Not retention: the header goes and the step stays. The reader waits for the step to go
  (shortened here), then reports the file."""
  monkeypatch.setattr(inspection, "REMOVAL_WAIT_SECONDS", 0.3)
  header = os.path.join(root, str(GONE), "data", "process_0-of-1.json")
  support.lose_header_on_read(monkeypatch, header)
  code, out, err = _run(verb, root)
  assert code == 1, (out, err)
  if verb == "verify":
    assert out.startswith(f"step {GONE}: {header}: cannot read it (No such file or directory)"), out
  else:
    assert f"broken: process 0: step {GONE}: unreadable state: {header}: cannot read it" in out, out


# ---------------------------------------------------------------------------
# A real writer.


def test_no_false_alarm_beside_a_real_orbax_writer_with_max_to_keep(tmp_path):
  """verify and audit in a loop (in this process, so hundreds of runs) while a CheckpointManager
  with max_to_keep=2 saves 120 steps, one every few ms (at most 20 s): each run is sound (0) or,
  when every step it listed was deleted under it, has nothing to check (4). Before the fix about
  8% of the runs of each command raised a false alarm (verify 1; audit 3, or 1)."""
  root = str(tmp_path / "root")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  writer = subprocess.Popen([sys.executable, os.path.join(_WORKERS, "retention_writer.py"), root, "120", "20", "2"],
                            stdout=subprocess.PIPE, text=True, env=env)
  try:
    assert writer.stdout.readline().strip() == "ready"
    outcomes: collections.Counter = collections.Counter()
    alarms = []
    while writer.poll() is None:
      for verb in ("verify", "audit"):
        code, out, err = _run(verb, root)
        outcomes[(verb, code)] += 1
        if code not in (0, cli.EXIT_NOTHING):
          alarms.append((verb, code, (out + err)[-500:]))
    steps = int(writer.stdout.read().split()[-1])
  finally:
    writer.kill()
    writer.wait()
  assert writer.returncode == 0
  assert steps > 20, steps  # retention deleted a step at nearly every save
  assert sum(outcomes.values()) > 50, outcomes
  assert alarms == [], (outcomes, alarms[:5])
