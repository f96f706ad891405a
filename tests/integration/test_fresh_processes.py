"""What only a fresh Python process shows: restores there, the installed command, imports.

Each test starts a new interpreter (`subprocess`), so nothing this process
imported or built can stand in for what a restarted job has: an Orbax v0 or
v1 restore of a checkpoint written here, the `ckpt-iter` console script and
`python -m ckpt_iter` (what they load, a closed pipe, no Tunix installed),
and which modules `import ckpt_iter` pulls in.
"""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile

import jax
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp1
import pytest

import conftest
import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import state as state_lib
from ckpt_iter import testing
import support

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
SCRIPT = os.path.join(os.path.dirname(sys.executable), "ckpt-iter")
_NEEDS_TUNIX = pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason=conftest.NEEDS_TUNIX)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------
# Orbax v0: a DataIterator and a RepeatIterator mid-repeat restored in a new process.

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_iter.__file__)))

# The pipelines, built by the same code in this process and in the restoring
# process (the fingerprint includes the transform's qualified name, so both
# execute this text under the same module name).
_PIPELINES = '''
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import ckpt_iter

RECORDS = [{"id": i, "prompt": "p" * (i % 4 + 1)} for i in range(23)]


def tokenize(record):
  return {"id": np.int64(record["id"]),
          "tokens": np.array([record["id"], len(record["prompt"])], np.int32)}


class Producer:
  """A rollout stand-in: arrays of several dtypes; counts its calls."""

  def __init__(self):
    self.calls = 0

  def __call__(self, element):
    self.calls += 1
    ids = element["id"]
    return {
        "completion_ids": (ids[:, None] * 3 + np.arange(4)).astype(np.int32),
        "old_logps": np.cos(ids * 0.3).astype(np.float32),
        "ref_logps": np.cos(ids * 0.7).astype(ml_dtypes.bfloat16),
        "advantages": (ids - ids.mean()).astype(np.float64),
    }


def data_iterator():
  return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=3, num_epochs=2, shard_index=0, shard_count=1,
      transform=tokenize))


def repeat_iterator(producer):
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=5, num_epochs=1, shard_index=0, shard_count=1))
  return ckpt_iter.RepeatIterator(
      source, produce=producer, num_repeats=3, group_size=2, shuffle_seed=11)


def params():
  key = jax.random.PRNGKey(0)
  return {
      "dense": {"w": jax.random.normal(key, (4, 3), jnp.float32),
                "b": jnp.linspace(-1, 1, 3).astype(jnp.bfloat16)},
      "count": np.arange(5, dtype=np.int32),
  }
'''

_RESTORE_SCRIPT = '''
import pickle
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter

pipelines_path, directory, step, kind, report_path = sys.argv[1:]
pipelines = {"__name__": "ckpt_test_pipelines"}
exec(open(pipelines_path).read(), pipelines)
producer = pipelines["Producer"]()
if kind == "data":
  iterator = pipelines["data_iterator"]()
else:
  iterator = pipelines["repeat_iterator"](producer)
abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), pipelines["params"]())
manager = ocp.CheckpointManager(directory)
restored = manager.restore(int(step), args=ocp.args.Composite(
    params=ocp.args.StandardRestore(abstract),
    data=ckpt_iter.IteratorRestore(iterator)))
assert restored["data"] is iterator
calls_before = producer.calls
elements = [{k: np.asarray(v) for k, v in e.items()} for e in iterator]
manager.close()
# The test's own report channel (not a checkpoint), so pickle is fine here.
with open(report_path, "wb") as f:
  pickle.dump({
      "params": jax.tree.map(np.asarray, restored["params"]),
      "elements": elements,
      "calls_at_restore": calls_before,
      "calls": producer.calls,
  }, f)
'''


@pytest.fixture
def pipelines(tmp_path):
  path = tmp_path / "pipelines.py"
  path.write_text(_PIPELINES)
  namespace = {"__name__": "ckpt_test_pipelines"}
  exec(_PIPELINES, namespace)  # pylint: disable=exec-used
  namespace["__file__"] = str(path)
  return namespace


def _restore_in_fresh_process(pipelines, directory, step, kind, tmp_path):
  script = tmp_path / "restore.py"
  script.write_text(_RESTORE_SCRIPT)
  report = tmp_path / f"report_{kind}.pkl"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
  result = subprocess.run(
      [sys.executable, str(script), pipelines["__file__"], str(directory), str(step), kind, str(report)],
      env=env, capture_output=True, text=True, timeout=300, check=False,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  with open(report, "rb") as f:
    return pickle.load(f)


def test_data_iterator_resumes_exactly_in_a_fresh_process(pipelines, tmp_path, ckpt_dir):
  full = list(pipelines["data_iterator"]())
  iterator = pipelines["data_iterator"]()
  for _ in range(7):  # crosses no boundary on purpose: 11 batches per epoch
    next(iterator)
  params = pipelines["params"]()
  directory = ckpt_dir
  support.orbax_save(directory, 3, params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator))

  # No pending arrays: the JSON header only.
  names = sorted(n for n in os.listdir(directory / "3" / "data") if n.startswith("process_"))
  assert names == ["process_0-of-1.json"]
  header = json.loads((directory / "3" / "data" / "process_0-of-1.json").read_text())
  assert list(header)[0] == "format_version"
  assert header["position"] == {"next_record": 7 * iterator.spec.global_batch_size}

  report = _restore_in_fresh_process(pipelines, directory, 3, "data", tmp_path)
  testing.assert_trees_equal(report["params"], jax.tree.map(np.asarray, params))
  testing.assert_trees_equal(report["elements"], full[7:])


def test_repeat_iterator_resumes_mid_repeat_in_a_fresh_process(pipelines, tmp_path, ckpt_dir):
  full = list(pipelines["repeat_iterator"](pipelines["Producer"]()))
  assert len(full) == 11 // 2 * 2 * 3  # 11 batches, groups of 2, 3 repeats
  iterator = pipelines["repeat_iterator"](pipelines["Producer"]())
  checkpoint = 8  # the second group, 2 of its 6 items yielded
  for _ in range(checkpoint):
    next(iterator)
  pending = len(iterator.state().pending.schedule)
  assert pending == 4
  params = pipelines["params"]()
  directory = ckpt_dir
  support.orbax_save(directory, 5, params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator))

  data_dir = directory / "5" / "data"
  names = sorted(n for n in os.listdir(data_dir) if n.startswith("process_"))
  assert names == ["process_0-of-1.json", "process_0-of-1.npz"]
  header = json.loads((data_dir / "process_0-of-1.json").read_text())
  with np.load(data_dir / "process_0-of-1.npz", allow_pickle=False) as npz:
    assert sorted(npz.files) == sorted(header["arrays"])
    for name, spec in header["arrays"].items():
      assert npz[name].dtype.str == spec["dtype"] and list(npz[name].shape) == spec["shape"]
  with zipfile.ZipFile(data_dir / "process_0-of-1.npz") as archive:
    assert all(info.filename.endswith(".npy") for info in archive.infolist())

  report = _restore_in_fresh_process(pipelines, directory, 5, "repeat", tmp_path)
  testing.assert_trees_equal(report["params"], jax.tree.map(np.asarray, params))
  testing.assert_trees_equal(report["elements"], full[checkpoint:])
  assert report["calls_at_restore"] == 0
  # Only the groups after the pending ones were rolled out again.
  assert report["calls"] * 3 == len(full) - checkpoint - pending


def test_state_is_snapshotted_when_save_is_called(pipelines, monkeypatch, ckpt_dir, ckpt_manager):
  # Hold the background write until the iterator has moved on and its
  # pending arrays were overwritten in place (as a reused rollout buffer is).
  gate, write_began, released = threading.Event(), threading.Event(), []
  original = _files.write_files

  def held_write(*args, **kwargs):
    write_began.set()
    released.append(gate.wait(timeout=30))
    return original(*args, **kwargs)

  monkeypatch.setattr(_files, "write_files", held_write)
  full = list(pipelines["repeat_iterator"](pipelines["Producer"]()))
  iterator = pipelines["repeat_iterator"](pipelines["Producer"]())
  for _ in range(4):
    next(iterator)
  ckpt_manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  try:
    for item in iterator.state().pending.items:
      item["old_logps"][...] = -7.0
    for _ in range(5):
      next(iterator)
  finally:
    gate.set()
  ckpt_manager.wait_until_finished()
  assert released == [True], "the write was not in the background"
  assert write_began.is_set()

  fresh = pipelines["repeat_iterator"](pipelines["Producer"]())
  support.orbax_restore(ckpt_dir, 1, data=ckpt_iter.IteratorRestore(fresh))
  testing.assert_trees_equal(list(fresh), full[4:])



# ---------------------------------------------------------------------------
# Orbax v1

_RESTORER = r"""
import json, sys
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1
import ckpt_iter
records = [{"id": i} for i in range(40)]
iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(records, batch_size=4, seed=1, num_epochs=2))
ocp1.load_checkpointables(sys.argv[1], {"data": ckpt_iter.IteratorCheckpointable(iterator)})
print(json.dumps([np.asarray(next(iterator)["id"]).tolist() for _ in range(5)]))
"""


def _v1_pipeline(seed=1):
  return ckpt_iter.make_dataset([{"id": i} for i in range(40)], batch_size=4, seed=seed, num_epochs=2)


def test_a_fresh_process_resumes_from_a_v1_checkpoint(tmp_path):
  iterator = ckpt_iter.DataIterator(_v1_pipeline())
  for _ in range(7):
    next(iterator)
  path = str(tmp_path / "step_7")
  ocp1.save_checkpointables(path, {"data": ckpt_iter.IteratorCheckpointable(iterator)})
  expected = [np.asarray(next(iterator)["id"]).tolist() for _ in range(5)]  # crosses the epoch end
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO)
  proc = subprocess.run([sys.executable, "-c", _RESTORER, path], capture_output=True, text=True,
                        timeout=300, env=env, cwd=_REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected



# ---------------------------------------------------------------------------
# A save that fails inside ckpt_iter's handler ends the process, with the error.

_FAILING_SAVE = r"""
import asyncio, sys
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path import async_path
import ckpt_iter

# A slow store: Orbax's background creation of the step's directories has not
# run when the failed save returns and the program ends.
_exists = async_path.exists
async def slow_exists(path):
  await asyncio.sleep(1.0)
  return await _exists(path)
async_path.exists = slow_exists

class Failing:
  def state(self):
    raise RuntimeError("the data state could not be taken")

api, path = sys.argv[1], sys.argv[2]
params = {"w": np.arange(3.0)}
if api == "v0":
  ocp.CheckpointManager(path).save(1, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), data=ckpt_iter.IteratorSave(Failing())))
else:
  import orbax.checkpoint.experimental.v1 as ocp1
  ocp1.save_checkpointables(path, {"params": params, "data": ckpt_iter.IteratorCheckpointable(Failing())})
"""


@pytest.mark.parametrize("api", ["v0", "v1"])
def test_an_error_inside_a_save_ends_the_process_with_the_error(tmp_path, api):
  # Without waiting for Orbax's directory creation before raising, the other
  # item's write threads held the process for Orbax's 300 s signal timeout.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO)
  proc = subprocess.run([sys.executable, "-c", _FAILING_SAVE, api, str(tmp_path / "ckpt")],
                        capture_output=True, text=True, timeout=60, env=env, cwd=_REPO)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "RuntimeError: the data state could not be taken" in proc.stderr


# ---------------------------------------------------------------------------
# The installed command


@pytest.fixture(scope="module")
def data_ckpt(tmp_path_factory):
  """An Orbax root with steps 0, 3 and 5 of a DataIterator, and a params item."""
  root = tmp_path_factory.mktemp("data") / "ckpt"
  records = [{"prompts": f"prompt {i}", "answer": i} for i in range(12)]
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(records, batch_size=2, seed=0, num_epochs=2))
  options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False)
  with ocp.CheckpointManager(str(root), options=options) as manager:
    for step, count in ((0, 0), (3, 3), (5, 2)):
      for _ in range(count):
        next(iterator)
      manager.save(step, args=ocp.args.Composite(
          data=ckpt_iter.IteratorSave(iterator),
          params=ocp.args.StandardSave({"w": np.arange(4, dtype=np.float32)})))
    manager.wait_until_finished()
  return str(root)



def _command(*argv):
  result = subprocess.run(list(argv), env=ENV, capture_output=True, text=True, timeout=300, check=False)
  assert "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]
  return result


def test_console_script(data_ckpt):
  assert os.path.exists(SCRIPT), f"{SCRIPT} is missing: run `pip install -e .`"
  result = _command(SCRIPT, "verify", str(data_ckpt), "--step", "3")
  assert result.returncode == 0 and result.stdout.startswith(f"ok: {data_ckpt}: 1 step (3)")
  result = _command(SCRIPT, "inspect", "/nonexistent/ckpt")
  assert (result.returncode, result.stderr) == (2, "ckpt-iter: /nonexistent/ckpt: no such directory.\n")


def test_read_only_verbs_load_no_jax_grain_orbax_or_tensorstore(data_ckpt):
  code = (
      "import sys\n"
      "from ckpt_iter import cli\n"
      f"for argv in (['inspect', {str(data_ckpt)!r}], ['verify', {str(data_ckpt)!r}],\n"
      f"             ['diff', {str(data_ckpt)!r}, '--step', '3', '--step', '5'], ['audit', {str(data_ckpt)!r}]):\n"
      "  assert cli.main(argv) == 0, argv\n"
      "print(sorted(m for m in ('jax', 'grain', 'orbax', 'tensorstore', 'tunix') if m in sys.modules))\n"
  )
  result = _command(sys.executable, "-c", code)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_closed_pipe_ends_the_output_quietly(tmp_path):
  """`inspect | head -1` of a step of 600 processes: far more than a pipe holds, so the
  writer meets the closed pipe."""
  from ckpt_iter import _codec as codec_lib  # pylint: disable=g-import-not-at-top

  value = state_lib.IteratorState(kind="data", fingerprint={"seed": 1}, position={"next_index": 3})
  header, arrays = codec_lib.encode_state(value)
  item = tmp_path / "ckpt" / "1" / "data"
  item.mkdir(parents=True)
  for index in range(600):
    _files.write_files(item, header, arrays, process_index=index, process_count=600)
  command = f"set -o pipefail; {sys.executable} -m ckpt_iter inspect {tmp_path / 'ckpt'} | head -1"
  result = subprocess.run(command, shell=True, env=ENV, capture_output=True, text=True, timeout=300,
                          executable="/bin/bash")
  assert result.stdout.startswith("checkpoint")
  assert (result.returncode, result.stderr) == (0, "")


def test_train_without_tunix_and_demo_from_a_wheel_say_so_in_one_line():
  code = ("import sys; sys.modules['tunix'] = None\n"
          "from ckpt_iter.__main__ import main\n"
          "print(main(['train', 'grpo', 'c.yaml']), main(['demo']))\n")
  result = _command(sys.executable, "-c", code)
  assert result.stdout.strip() == "2 2"
  train, demo = result.stderr.strip().splitlines()
  assert train == "ckpt-iter: `train` runs Tunix, which is not installed: pip install 'ckpt_iter[tunix]'"
  assert demo.startswith("ckpt-iter: the demo is not part of the installed package") and "make demo" in demo


@pytest.mark.heavy  # imports Tunix in a process of its own (make test stays under 7 minutes)
@_NEEDS_TUNIX
def test_train_sft_swaps_the_peft_trainer():
  # Its own process: Tunix's grpo_main and peft_main both define the absl
  # flag pathways_bns, so one process can import only one of them.
  script = (
      "from tunix.sft import peft_trainer\n"
      "from ckpt_iter.tunix import ResumablePeftTrainer, cli\n"
      "stock = peft_trainer.PeftTrainer\n"
      "with cli.resumable_learners('sft') as pipeline:\n"
      "  assert pipeline.__name__ == 'tunix.cli.peft_main'\n"
      "  assert peft_trainer.PeftTrainer is ResumablePeftTrainer\n"
      "assert peft_trainer.PeftTrainer is stock\n"
      "print('ok')\n"
  )
  result = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=300)
  assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr[-2000:]



# ---------------------------------------------------------------------------
# What importing loads


def test_module_is_not_exported_and_needs_no_tunix():
  assert "testing" not in ckpt_iter.__all__
  script = (
      "import sys\n"
      "sys.modules['tunix'] = None  # any import of Tunix now fails\n"
      "from ckpt_iter import testing\n"
      "assert callable(testing.assert_exact_resume)\n"
      "assert not any(m.startswith(('tunix', 'ckpt_iter.tunix')) for m in sys.modules if sys.modules[m])\n"
      "print('ok')\n"
  )
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_importing_ckpt_iter_tunix_without_tunix_says_what_to_install():
  script = (
      "import sys\n"
      "sys.modules['tunix'] = None  # any import of Tunix now fails\n"
      "for statement in ('import ckpt_iter.tunix', 'from ckpt_iter.tunix import ResumableGRPOLearner',\n"
      "                  'from ckpt_iter.tunix import cli'):\n"
      "  try:\n"
      "    exec(statement)\n"
      "  except ImportError as e:\n"
      "    print(type(e).__name__, e.name, '|', e)\n"
  )
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.strip().splitlines()
  assert len(lines) == 3, result.stdout
  for line in lines:
    assert line.startswith("ModuleNotFoundError tunix | ckpt_iter.tunix needs Tunix, which is not installed"), line
    assert line.endswith("Install it with: pip install 'ckpt_iter[tunix]'"), line


def test_importing_ckpt_iter_does_not_import_tunix():
  code = "import sys, ckpt_iter; print('tunix' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "False"


