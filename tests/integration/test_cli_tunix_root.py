"""`ckpt-iter inspect`, `verify` and `diff` on a real Tunix checkpoint root.

The root is made by a toy GRPO run (mu=2) in a fresh process, killed after
step 2; the verbs run in-process through `cli.main`, and once in a fresh
process to show they load neither Tunix nor flax.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import conftest
import tunix_toy
from ckpt_iter import cli

pytestmark = pytest.mark.heavy  # a real toy Tunix run (the tunix_ckpt fixture)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def tunix_ckpt(tmp_path_factory):
  """A real Tunix checkpoint root: toy GRPO, mu=2, preempted after step 2."""
  pytest.importorskip("tunix", reason=conftest.NEEDS_TUNIX)
  root = tmp_path_factory.mktemp("tunix")
  config = json.dumps({"learner": "ckpt_iter", "max_steps": 4})
  result = subprocess.run(
      [sys.executable, tunix_toy.WORKER, "--root", str(root / "run"),
       "--out", str(root / "inputs.npz"), "--preempt-after", "2", "--config", config],
      env=ENV, capture_output=True, text=True, timeout=600, check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(root / "run" / "actor")) == ["1", "2"]
  return str(root / "run")


def _run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, out, err


def _command(*argv):
  result = subprocess.run(list(argv), env=ENV, capture_output=True, text=True, timeout=300, check=False)
  assert "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]
  return result


def _row(key, value):
  """A regex for an aligned `key  value` line."""
  return re.compile(rf"^\s*{re.escape(key)}\s+{re.escape(value)}$", re.M)


def test_inspect_tunix_checkpoint_root_and_actor_dir(capsys, tunix_ckpt):
  code, out, _ = _run(capsys, "inspect", tunix_ckpt, "--step", "1")
  assert code == 0
  assert _row("checkpoint", os.path.join(tunix_ckpt, "actor")).search(out)
  assert _row("kind", "tunix").search(out)
  assert _row("position", "input: epoch 0, 1 of 64 records read (next_record 1)").search(out)
  assert _row("micro_batches_taken", "0").search(out)
  # Step 1 falls between the two updates on the first rollout (mu=2).
  assert _row("pending types", "tunix.rl.grpo.TrainExample").search(out)
  assert _row("counter train_steps", "1").search(out)
  assert _row("num_iterations", "2").search(out)
  code, from_actor, _ = _run(capsys, "inspect", os.path.join(tunix_ckpt, "actor"), "--step", "1")
  assert (code, from_actor) == (0, out)


def test_inspect_does_not_import_tunix_or_restore_a_model(tunix_ckpt):
  # Nor Orbax, JAX or Grain: the item's reader (`_item`) imports none of them, so the
  # read-only command starts in a third of a second, not the 2.6 s of importing Orbax.
  program = (
      "import json, sys\n"
      "from ckpt_iter import cli\n"
      f"code = cli.main(['inspect', {tunix_ckpt!r}, '--json'])\n"
      "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tunix', 'flax', 'orbax', 'jax', 'grain'))\n"
      "print(json.dumps({'code': code, 'loaded': loaded}))\n"
  )
  result = subprocess.run([sys.executable, "-c", program], env=ENV, capture_output=True,
                          text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert json.loads(result.stdout.splitlines()[-1]) == {"code": 0, "loaded": []}


def test_verify_tunix_checkpoint(capsys, tunix_ckpt):
  code, out, _ = _run(capsys, "verify", tunix_ckpt)
  assert code == 0
  assert out == f"ok: {tunix_ckpt}/actor: 2 steps (1-2), item 'data', 2 state files, 7 pending arrays checked\n"


def test_diff_tunix_steps_shows_counters_and_pending(capsys, tunix_ckpt):
  code, out, _ = _run(capsys, "diff", tunix_ckpt, "--step", "1", "--step", "2")
  assert code == 0
  assert _row("counter train_steps", "1 -> 2 (+1)").search(out)
  assert re.search(r"^\s*pending\s+1 item, 1 still to yield; 7 arrays, \d+ B -> none$", out, re.M)
  assert re.search(r"^\s*fingerprint\s+same \(\d+ fields\)$", out, re.M)


def test_python_m_ckpt_iter_inspect_and_verify(tmp_path, tunix_ckpt):
  result = _command(sys.executable, "-m", "ckpt_iter", "inspect", tunix_ckpt, "--json")
  assert result.returncode == 0
  report = json.loads(result.stdout)
  assert report["step"] == 2 and report["processes"][0]["kind"] == "tunix"
  corrupt = tmp_path / "run"
  shutil.copytree(tunix_ckpt, corrupt)
  os.remove(corrupt / "actor" / "1" / "data" / "process_0-of-1.npz")
  result = _command(sys.executable, "-m", "ckpt_iter", "verify", str(corrupt))
  assert result.returncode == 1
  (line,) = result.stdout.splitlines()
  assert line.startswith(f"step 1: {corrupt}/actor/1/data/process_0-of-1.npz: missing")
