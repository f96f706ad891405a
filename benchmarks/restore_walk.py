"""The files of the package a Tunix GRPO resume runs, from learner.train() to the first trainer input.

A toy GRPO run (num_iterations=2) is killed in a process of its own right
after checkpoint 3 (inside a repeat: one more update of that rollout is
pending). This process then builds the drop-in learner on the same root and
calls train() under `sys.setprofile`, noting every file of `ckpt_iter/`
whose functions run, in the order each is first entered, and how many calls
cross from one file into another, until the actor's first update is called
(the first trainer input), where it stops the run.

It is a measure of the code a reader follows (docs/architecture.md, "A
Tunix RL restore, file by file"), not of time: the figure does not depend on
the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from _common import REPO_DIR, Reporter, parse_args

PACKAGE_DIR = os.path.join(REPO_DIR, "ckpt_iter") + os.sep
PREEMPT_STEP = 3


class _FirstTrainerInput(Exception):
  """Raised by the actor's update: the walk ends where training would begin."""


def _walk(root: str) -> tuple[list[str], int]:
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  config = toyrun.RunConfig()
  learner = toyrun.build_learner(config, root)
  train_ds = toyrun.make_train_dataset(config)
  cluster = learner.rl_cluster

  def first_update(*unused_args, **unused_kwargs):
    raise _FirstTrainerInput

  cluster.update_actor = first_update
  files: list[str] = []
  crossings = [0]
  last = [None]

  def profile(frame, event, unused_arg):
    if event != "call":
      return
    path = frame.f_code.co_filename
    if not path.startswith(PACKAGE_DIR):
      return
    name = os.path.relpath(path, PACKAGE_DIR)
    if name not in files:
      files.append(name)
    if name != last[0]:  # a call from one file of the package into another: the back and forth a reader follows
      crossings[0] += 1
      last[0] = name

  sys.setprofile(profile)
  try:
    learner.train(train_ds, None)
  except _FirstTrainerInput:
    pass
  finally:
    sys.setprofile(None)
  return files, crossings[0]


def main() -> None:
  args = parse_args(__doc__.splitlines()[0])
  report = Reporter("restore_walk", args.quick)
  with tempfile.TemporaryDirectory() as workdir:
    root = os.path.join(workdir, "root")
    subprocess.run(
        [sys.executable, "-m", "demo.toyrun", "--root", root, "--out", os.path.join(workdir, "first.npz"),
         "--preempt-after", str(PREEMPT_STEP)],
        check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL)
    files, crossings = _walk(root)
  report.measurement(name="files_run_by_a_grpo_resume", value=len(files), files=files)
  report.measurement(name="calls_crossing_files", value=crossings)
  print(json.dumps({"files": files}), file=sys.stderr)
  report.summary([{"name": "files a GRPO resume runs", "value": len(files), "target": "<= 12",
                   "met": len(files) <= 12}])


if __name__ == "__main__":
  main()
