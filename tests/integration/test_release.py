"""The release: the wheel built from this tree, installed in a fresh venv, is the version the docs describe.

Built with the project's own backend (setuptools, from the test venv: no index needed), installed with
`--no-deps` into a new venv; the dependencies come from the test venv's site-packages on PYTHONPATH, so
what is imported as `ckpt_iter` and run as `ckpt-iter` is the installed wheel, not this tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import ckpt_iter

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_wheel_installs_in_a_fresh_venv_as_the_version_the_docs_and_changelog_name(tmp_path):
  project = tmp_path / "project"
  shutil.copytree(_REPO, project, ignore=shutil.ignore_patterns(
      ".git", ".venv*", "__pycache__", "build", "site", "*.egg-info", "benchmarks", "tests"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                  str(tmp_path / "dist"), str(project)], check=True, timeout=300)
  wheel, = [p for p in os.listdir(tmp_path / "dist") if p.endswith(".whl")]
  assert wheel.startswith(f"ckpt_iter-{ckpt_iter.__version__}-"), wheel
  venv = tmp_path / "fresh"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)  # its pip from ensurepip
  python = str(venv / "bin" / "python")
  clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
  subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(tmp_path / "dist" / wheel)],
                 check=True, timeout=300, env=clean)
  env = dict(clean, PYTHONPATH=sysconfig.get_paths()["purelib"], JAX_PLATFORMS="cpu")
  where = subprocess.run([python, "-c", "import ckpt_iter, sys; print(ckpt_iter.__version__, ckpt_iter.__file__)"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
  assert where.returncode == 0, where.stderr[-3000:]
  version, path = where.stdout.split()
  assert version == ckpt_iter.__version__ and path.startswith(str(venv)), where.stdout
  printed = subprocess.run([str(venv / "bin" / "ckpt-iter"), "--version"], capture_output=True, text=True, env=env,
                           cwd=str(tmp_path), timeout=300)
  assert printed.returncode == 0, printed.stderr[-3000:]
  assert printed.stdout.strip() == f"ckpt-iter {ckpt_iter.__version__}", printed.stdout
  # The docs say which release they describe; the changelog has its section.
  docs = open(os.path.join(_REPO, "docs", "README.md")).read()
  assert f"These pages describe ckpt_iter {ckpt_iter.__version__}" in docs
  changelog = open(os.path.join(_REPO, "CHANGELOG.md")).read()
  assert re.search(rf"^## \[{re.escape(ckpt_iter.__version__)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M)
