"""`make demo`'s closing hint names a `ckpt-iter` command that runs in the shell it was started from.

`make demo` runs `.venv/bin/python -m demo`; the `ckpt-iter` script is in
`.venv/bin`, which is rarely on PATH, so a bare `ckpt-iter ...` failed with
"command not found" (issue 50, item 8).
"""

import os
import subprocess
import sys

import pytest

from demo import __main__ as demo_main


def _runs(command: str, env_path: str) -> bool:
  process = subprocess.run(["bash", "-c", f"{command} --version"], capture_output=True, text=True, timeout=60,
                           env={"PATH": env_path, **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}})
  return process.returncode == 0 and process.stdout.startswith("ckpt-iter ")


def test_without_the_environment_on_path_the_hint_is_the_scripts_path(monkeypatch):
  monkeypatch.setenv("PATH", "/usr/bin:/bin")
  command = demo_main.ckpt_iter_command()
  assert command != "ckpt-iter" and command.split()[0] != "python", command
  assert _runs(command, "/usr/bin:/bin"), command


def test_under_the_working_directory_the_hint_is_relative(monkeypatch):
  bin_dir = os.path.dirname(sys.executable)
  if not os.access(os.path.join(bin_dir, "ckpt-iter"), os.X_OK):
    pytest.skip("this environment has no ckpt-iter script")
  monkeypatch.setenv("PATH", "/usr/bin:/bin")
  monkeypatch.chdir(os.path.dirname(os.path.dirname(bin_dir)))  # the directory holding .venv
  command = demo_main.ckpt_iter_command()
  assert command == os.path.join(os.path.basename(os.path.dirname(bin_dir)), "bin", "ckpt-iter"), command
  assert _runs(command, "/usr/bin:/bin"), command


def test_with_the_environment_on_path_the_hint_is_the_plain_command(monkeypatch):
  bin_dir = os.path.dirname(sys.executable)
  if not os.access(os.path.join(bin_dir, "ckpt-iter"), os.X_OK):
    pytest.skip("this environment has no ckpt-iter script")
  monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
  assert demo_main.ckpt_iter_command() == "ckpt-iter"
  assert _runs("ckpt-iter", f"{bin_dir}:/usr/bin:/bin")
