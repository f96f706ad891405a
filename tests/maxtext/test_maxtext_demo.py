"""The runnable example (demo/maxtext_pretrain.py, `make demo-maxtext`): killed, resumed, the same batch again.

Runs only in `make test-maxtext` (Python 3.12, MaxText installed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")

import process_group  # pylint: disable=g-import-not-at-top,wrong-import-position


def _run(workdir, *flags) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "demo.maxtext_pretrain", "--workdir", str(workdir), "--steps", "3",
                         *flags], cwd=str(process_group.REPO), env=env, capture_output=True, text=True, timeout=240)


def test_the_example_resumes_at_the_step_it_was_killed_in_with_the_same_batch(tmp_path):
  killed = _run(tmp_path, "--kill")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = _run(tmp_path)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  steps = lambda out: dict(re.findall(r"^step (\d+): records (.*)$", out, re.MULTILINE))  # noqa: E731
  before, after = steps(killed.stdout), steps(resumed.stdout)
  assert sorted(before) == ["0", "1", "2", "3"] and sorted(after) == ["3", "4", "5"]
  assert "resumed after step 2" in resumed.stdout
  assert after["3"] == before["3"]  # the step trained and never saved, read again
