"""`ckpt-iter which`, `order` and `diff` beside a writer whose max_to_keep deletes steps (issue 48, item 8).

The rule (as verify and audit follow it, tests/robustness/test_live_root.py):
a step deleted while a verb reads it is no problem of the checkpoint.
  * A verb that reads the run from its latest step (`order`, `which --batch`)
    lists the root again and answers from the steps kept now (a retry, at
    most a few times, that succeeds);
  * a verb asked about a named step (`which --step S`, `diff A B`) says that
    step was deleted while being read (by the writer's retention) and exits
    4, "nothing to answer": never exit 1 ("unreadable"), never a traceback.
A step that stays but loses its state file is still an error (exit 1).

Deterministic hooks delete a step between listing and reading (whole, or
files first as Orbax does); then a real CheckpointManager with max_to_keep=2
saves a state with skips and a mixture ledger as fast as it can while the
three verbs run in a loop, bounded in count and time.
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
import time

import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import cli
from ckpt_iter.cli import _inspect as inspection
import support

import ledger_writer

PIPELINE = {"mixture": {"a": 2, "b": 1}, "skip": [[5, 9], [20, 22]]}
_WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "ledger_writer.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
  """Steps 1-2 of a run, a resume from step 2, then steps 3-5: the run's order needs steps 2 and 5."""
  root = str(tmp_path_factory.mktemp("readers") / "pristine")
  iterator = ledger_writer.build_iterator(PIPELINE)
  with ocp.CheckpointManager(root) as manager:
    for step in (1, 2):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  iterator = ledger_writer.build_iterator(PIPELINE)
  with ocp.CheckpointManager(root) as manager:
    manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
    for step in (3, 4, 5):
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


def _gone_message(root: str, step: int) -> str:
  return (f"ckpt-iter: step {step} of {root} was deleted while being read (by the writer's retention, e.g. "
          "Orbax's max_to_keep); ask about a step kept now (steps: ")


@pytest.mark.parametrize("files_first", [False, True], ids=["whole", "files_first"])
@pytest.mark.parametrize("verb", ["which", "diff"])
def test_a_named_step_deleted_while_read_is_named_as_deleted(root, monkeypatch, verb, files_first):
  gone = 5 if verb == "which" else 3
  deleter = support.StepDeleter(monkeypatch, os.path.join(root, str(gone)), files_first=files_first)
  argv = ["which", root, "--step", "5"] if verb == "which" else ["diff", root, "3", "5"]
  code, out, err = _run(*argv)
  deleter.join()
  assert deleter.fired
  assert (code, out) == (cli.EXIT_NOTHING, ""), (code, out, err)
  kept = "1-4" if gone == 5 else "1-2, 4-5"
  assert err == _gone_message(root, gone) + f"{kept}).\n", err


@pytest.mark.parametrize("files_first", [False, True], ids=["whole", "files_first"])
@pytest.mark.parametrize("gone", [5, 2], ids=["latest", "resumed_from"])
def test_order_retries_over_the_steps_kept_now(root, monkeypatch, tmp_path, gone, files_first):
  """The latest step goes: the order of the run up to step 4. The step it resumed from goes: the
  resume record in the latest state places that segment, so the whole run is numbered."""
  out = str(tmp_path / "order.jsonl")
  deleter = support.StepDeleter(monkeypatch, os.path.join(root, str(gone)), files_first=files_first)
  code, printed, err = _run("order", root, "--out", out)
  deleter.join()
  assert deleter.fired
  if gone == 5:
    assert code == 0, (code, printed, err)
    with open(out) as f:
      rows = [json.loads(line) for line in f]
    assert printed == f"{out}: 4 global batches from batch 0\n" and len(rows) == 4, (printed, rows)
  else:
    assert code == 0, (code, printed, err)
    with open(out) as f:
      rows = [json.loads(line) for line in f]
    assert printed == f"{out}: 5 global batches from batch 0\n" and len(rows) == 5, (printed, rows)
    assert "Traceback" not in err


def test_which_batch_retries_when_the_latest_step_goes(root, monkeypatch):
  deleter = support.StepDeleter(monkeypatch, os.path.join(root, str(5)))
  code, out, err = _run("which", root, "--batch", "3", "--json")
  assert deleter.fired
  assert code == 0, (code, out, err)
  assert json.loads(out)["note"] == "the run up to step 4: 4 global batches"


def test_which_of_a_step_whose_resumed_from_step_goes_answers_from_the_resume_record(root, monkeypatch):
  deleter = support.StepDeleter(monkeypatch, os.path.join(root, str(2)))
  code, out, err = _run("which", root, "--step", "5", "--json")
  assert deleter.fired
  assert code == 0, (code, out, err)
  answer = json.loads(out)
  assert answer["number"] == 4 and "note" not in answer, out


def test_a_step_that_stays_but_loses_its_state_file_is_still_an_error(root, monkeypatch):
  monkeypatch.setattr(inspection, "REMOVAL_WAIT_SECONDS", 0.3)
  header = os.path.join(root, "5", "data", "process_0-of-1.json")
  support.lose_header_on_read(monkeypatch, header)
  code, out, err = _run("which", root, "--step", "5")
  assert code == 1, (code, out, err)
  assert header in err and "No such file" in err and "deleted while being read" not in err, err


# ---------------------------------------------------------------------------
# A real writer.


def test_no_false_alarm_beside_a_real_orbax_writer_with_max_to_keep(tmp_path):
  """which --step, which --batch, order and diff in a loop (in this process) while a CheckpointManager
  with max_to_keep=2 saves up to 2,000 steps, one every ~20 ms (at most 15 s): each run answers (0)
  or says the step it was asked about was deleted while being read (4, or 2 when it was gone before
  the verb listed the root); never 1, never a traceback."""
  root = str(tmp_path / "root")
  config = tmp_path / "writer.json"
  config.write_text(json.dumps({"root": root, "log": str(tmp_path / "writer.log"), "steps": 2000, "seconds": 15,
                                "async": True, "max_to_keep": 2, "sleep_s": 0.05, "pipeline": PIPELINE}))
  with open(tmp_path / "writer.err", "w") as err:
    writer = subprocess.Popen([sys.executable, _WORKER, str(config)], stdout=subprocess.PIPE, stderr=err,
                              text=True, cwd=_REPO)
  outcomes: collections.Counter = collections.Counter()
  alarms = []
  try:
    assert writer.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while writer.poll() is None and time.monotonic() < deadline and sum(outcomes.values()) < 2000:
      steps = sorted(inspection.step_directories(root)) or [1]
      for verb, argv in (("which --step", ["which", root, "--step", str(steps[0])]),
                         ("which --batch", ["which", root, "--batch", "0"]),
                         ("order", ["order", root, "--out", str(tmp_path / "order.jsonl")]),
                         ("diff", ["diff", root, str(steps[0]), str(steps[-1])])):
        try:
          code, out, err = _run(*argv)
        except Exception as e:  # pylint: disable=broad-except
          code, out, err = "raised", "", repr(e)
        outcomes[(verb, code)] += 1
        said_gone = code == cli.EXIT_NOTHING and "was deleted while being read" in err or (
            code == cli.EXIT_USAGE and err.startswith("ckpt-iter: no step "))
        if code != 0 and not said_gone:
          alarms.append((verb, code, (out + err)[-500:]))
    writer.wait(timeout=120)
    steps_saved = int(writer.stdout.read().split()[-1])
  finally:
    writer.kill()
    writer.wait()
  assert writer.returncode == 0
  assert steps_saved > 20, steps_saved  # retention deleted a step at nearly every save
  assert sum(outcomes.values()) > 20, outcomes
  print("outcomes:", dict(outcomes))
  assert alarms == [], (outcomes, alarms[:5])
