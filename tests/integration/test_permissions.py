"""A read-only root and unwritable temporary and cache directories, as a user permission bits apply to
(issue 48, item 9).

Root writes three steps of a run (make_dataset over a JSONL file large
enough that its line index is cached, with two skip ranges); the root's
files stay root's (0644, directories 0755). Then, as `nobody` (setpriv
drops the privileges; permission bits do not apply to root), with HOME,
TMPDIR and the JSONL index cache directory all unwritable:
  * a restore from the read-only root works and continues the stream
    exactly (reading needs no write);
  * `ckpt-iter verify`, `audit`, `which` and `order` (to a writable file) work;
  * a save into it fails at once with an error naming the path (Orbax's
    PermissionError on `<root>/<step>.orbax-checkpoint-tmp`), and the steps
    before stay intact (byte for byte, and verified afterwards).
Orbax's baseline, measured with a save of params alone: the same error at
once, then the process cannot exit for 300 s (Orbax's threads wait for the
signal of the directory it failed to create); ckpt_iter's item adds no wait
of its own beyond that, and the worker ends with os._exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from ckpt_iter import cli

_WORKERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers")
_WORKER = os.path.join(_WORKERS, "permissions_worker.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NOBODY = 65534
_TIMEOUT_S = 240


def _as_user(base_env: dict) -> tuple[list[str], dict] | str:
  """(argv prefix running Python as an unprivileged user, its environment), or why there is none.

  As root: setpriv to nobody. The venv's interpreter may sit under /root
  (not traversable by nobody); then the system Python of the same version
  runs with the venv's site-packages on PYTHONPATH.
  """
  if os.geteuid() != 0:
    return [sys.executable], base_env
  setpriv = shutil.which("setpriv")
  if setpriv is None:
    return "running as root and setpriv (util-linux) is not installed: cannot drop privileges"
  drop = [setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"]
  site = sysconfig.get_paths()["purelib"]
  version = f"python{sys.version_info.major}.{sys.version_info.minor}"
  for python, extra in ((sys.executable, []), (shutil.which(version) or f"/usr/bin/{version}", [site])):
    env = dict(base_env, PYTHONPATH=os.pathsep.join([_REPO, *extra, base_env.get("PYTHONPATH", "")]))
    probe = subprocess.run([*drop, python, "-c", "import os, orbax.checkpoint, ckpt_iter; print(os.geteuid())"],
                           capture_output=True, text=True, env=env, cwd="/", timeout=_TIMEOUT_S)
    if probe.returncode == 0 and probe.stdout.split()[-1:] == [str(_NOBODY)]:
      return [*drop, python], env
  return f"no Python this test's packages import in runs as uid {_NOBODY} (tried {sys.executable}, {version})"


@pytest.fixture(scope="module")
def world():
  """The read-only root (steps 1-3), its JSONL source, unwritable HOME/TMPDIR/cache, a writable out dir."""
  base = tempfile.mkdtemp(prefix="ckpt_iter_permissions_", dir="/tmp")  # not under pytest's 0700 tmp
  os.chmod(base, 0o755)
  try:
    source = os.path.join(base, "records.jsonl")
    with open(source, "w") as f:  # 1.3 MB: above INDEX_CACHE_MIN_BYTES, so the index would be cached
      for i in range(3000):
        f.write(json.dumps({"id": i, "text": "x" * 420}) + "\n")
    for name in ("home", "tmp", "cache"):
      os.mkdir(os.path.join(base, name), 0o755)  # root's: not writable by the user
    out = os.path.join(base, "out")
    os.mkdir(out)
    os.chmod(out, 0o777)
    root = os.path.join(base, "root")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "CKPT_ITER_INDEX"))}
    env.update(JAX_PLATFORMS="cpu", HOME=os.path.join(base, "home"), TMPDIR=os.path.join(base, "tmp"),
               CKPT_ITER_INDEX_CACHE_DIR=os.path.join(base, "cache"))
    env.pop("XDG_CACHE_HOME", None)
    saved = subprocess.run([sys.executable, _WORKER, "save", root, source, "3"], capture_output=True, text=True,
                           env=dict(env, PYTHONPATH=os.pathsep.join([_REPO, env.get("PYTHONPATH", "")])),
                           cwd=_REPO, timeout=_TIMEOUT_S)
    assert saved.returncode == 0, saved.stderr[-3000:]
    for name in os.listdir(env["CKPT_ITER_INDEX_CACHE_DIR"]):  # root's run cached the index: start without it
      os.remove(os.path.join(env["CKPT_ITER_INDEX_CACHE_DIR"], name))
    for directory, _, names in os.walk(root):
      os.chmod(directory, 0o755)
      for name in names:
        os.chmod(os.path.join(directory, name), 0o644)
    yield {"base": base, "root": root, "source": source, "out": out, "env": env,
           "batches": json.loads(saved.stdout.strip().splitlines()[-1])["batches"]}
  finally:
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def user(world):
  found = _as_user(world["env"])
  if isinstance(found, str):
    pytest.skip(found)
  return found


def _run(user, *argv: str) -> subprocess.CompletedProcess:
  prefix, env = user
  return subprocess.run([*prefix, *argv], capture_output=True, text=True, env=env, cwd="/", timeout=_TIMEOUT_S)


def _tree(root: str) -> dict[str, bytes]:
  files = {}
  for directory, _, names in os.walk(root):
    for name in names:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, root)] = f.read()
  return files


def _reference(world, length: int) -> list[list[int]]:
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      world["source"], batch_size=4, seed=5, num_epochs=None, shard_index=0, shard_count=1,
      skip=[(5, 9), (20, 22)]))
  return [[int(v) for v in next(iterator)["id"]] for _ in range(length)]


def test_the_user_cannot_write_where_the_test_says(world, user):
  probe = _run(user, "-c", "import os, sys; print([os.access(p, os.W_OK) for p in sys.argv[1:]])",
               world["root"], os.path.join(world["root"], "3"), world["env"]["TMPDIR"], world["env"]["HOME"],
               world["env"]["CKPT_ITER_INDEX_CACHE_DIR"], world["out"])
  assert probe.returncode == 0, probe.stderr[-2000:]
  assert probe.stdout.strip() == str([False] * 5 + [True])


def test_a_restore_from_a_read_only_root_continues_the_stream_exactly(world, user):
  before = _tree(world["root"])
  restored = _run(user, _WORKER, "restore", world["root"], world["source"])
  assert restored.returncode == 0, restored.stderr[-3000:]
  answer = json.loads(restored.stdout.strip().splitlines()[-1])
  assert answer["step"] == 3
  assert world["batches"] + answer["batches"] == _reference(world, 9)
  assert _tree(world["root"]) == before
  assert os.listdir(world["env"]["CKPT_ITER_INDEX_CACHE_DIR"]) == []  # nothing cached, nothing failed


@pytest.mark.parametrize("verb", ["verify", "audit", "which", "order"])
def test_the_command_reads_a_read_only_root(world, user, verb):
  argv = {"verify": [], "audit": [], "which": ["--step", "2", "--json"],
          "order": ["--out", os.path.join(world["out"], "order.jsonl")]}[verb]
  done = _run(user, "-m", "ckpt_iter", verb, world["root"], *argv)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
  assert "Traceback" not in done.stderr
  if verb == "which":
    assert json.loads(done.stdout)["records"] == world["batches"][1]


def test_a_save_into_an_unwritable_root_fails_naming_the_path_and_keeps_the_steps(world, user):
  before = _tree(world["root"])
  done = _run(user, _WORKER, "save_more", world["root"], world["source"])
  assert done.returncode == 0, done.stderr[-3000:]
  outcome = json.loads(done.stdout.strip().splitlines()[-1])
  assert "error" in outcome, outcome
  assert world["root"] in outcome["message"] and "ermission denied" in outcome["message"], outcome
  assert _tree(world["root"]) == before  # steps 1-3 untouched
  assert cli.main(["verify", world["root"]]) == cli.EXIT_OK
