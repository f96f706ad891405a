"""`ckpt-iter train grpo CONFIG.yaml`: Tunix's own YAML pipeline with the Resumable learner.

Each run is a fresh process (tests/workers/tunix_cli_worker.py) that calls the
`ckpt-iter` entry point with a complete GRPO config naming
`data_module: ckpt_iter.tunix.data`. The pipeline is Tunix's (config loading
and overrides, meshes, rollout and training configs, the data_module dataset
filtered and batched by Tunix, reward functions from the config, the learner
it builds, Orbax checkpoints); the worker only makes its model and tokenizer
loaders return Tunix's toy ones and, since CPU devices have no coordinates,
gives Tunix's mesh allocator a flat device list.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy
import yaml

from ckpt_iter import _item as item_lib
from ckpt_iter import testing
import ckpt_iter.tunix  # noqa: F401  (registers the TrainExample types read_item decodes)
from demo import toyrun
import tunix_cli_worker

_WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "workers", "tunix_cli_worker.py")
_WORKERS_DIR = os.path.dirname(os.path.abspath(_WORKER))
_RESUMABLE = "ckpt_iter.tunix.ResumableGRPOLearner"
_MAX_STEPS = 6  # grad accumulation 2 (mini batch 2, micro 1): 12 trainer inputs


def _env(jax_cache):
  return dict(
      os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax_cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      # The config names its reward module `tunix_cli_rewards` (in workers/).
      PYTHONPATH=os.pathsep.join([_WORKERS_DIR, os.environ.get("PYTHONPATH", "")]),
  )


def _write_config(path, root, **changes):
  config = tunix_cli_worker.grpo_config(str(root), toyrun.PROMPTS_FILE, **changes)
  path.write_text(yaml.safe_dump(config))
  return str(path)


def _train(config, out, jax_cache, *overrides, preempt_after=None, expect_rc=0, stock=False):
  command = [sys.executable, _WORKER, "--out", str(out)] + (["--stock"] if stock else [])
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  command += ["--", "grpo", config, *overrides]
  process = subprocess.run(command, env=_env(jax_cache), capture_output=True, text=True, timeout=900)
  assert process.returncode == expect_rc, (
      f"worker exited {process.returncode}, expected {expect_rc}:\n{process.stderr[-4000:]}"
  )
  with np.load(out) as record:
    meta = json.loads(bytes(record["meta"]).decode())
    inputs = [
        {k.split("_", 1)[1]: record[k] for k in record.files if k.startswith(f"input{i}_")}
        for i in range(meta["num_inputs"])
    ]
  return inputs, meta


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, jax_cache):
  """One run of the pipeline to max_steps, with a Tunix override on the command line."""
  work = tmp_path_factory.mktemp("cli_uninterrupted")
  root = work / "ckpt"
  config = _write_config(work / "grpo.yaml", root)
  inputs, meta = _train(config, work / "run.npz", jax_cache, "data_config.seed=1")
  return root, inputs, meta


def test_the_pipeline_builds_the_resumable_learner_and_checkpoints_the_data(uninterrupted):
  root, inputs, meta = uninterrupted
  assert meta["exit_code"] == 0
  assert meta["learners"] == [_RESUMABLE]  # the class Tunix's pipeline built and trained
  assert meta["restored"]  # grpo_learner.GrpoLearner etc. are Tunix's classes again
  assert len(inputs) == 2 * _MAX_STEPS
  steps = sorted(int(name) for name in os.listdir(root / "actor") if name.isdigit())
  assert steps == list(range(1, _MAX_STEPS + 1))
  for step in steps:
    item = root / "actor" / str(step) / "data"
    value = item_lib.read_item(str(item), 0, 1).value
    assert value.kind == "tunix" and value.counters["train_steps"] == step
    # The input's state (nested whole: value.part) is the data_module's dataset
    # (make_dataset over the JSONL file, with the seed given on the command
    # line) behind Tunix's batching.
    assert value.part.kind == "data"
    input_fingerprint = value.part.fingerprint
    assert input_fingerprint["source"].startswith("jsonl[prompts.jsonl:")
    assert input_fingerprint["seed"] == 1 and input_fingerprint["num_epochs"] == 2
    assert "source" not in value.fingerprint and value.fingerprint["learner"] == "GRPOLearner"
  verify = subprocess.run(
      [sys.executable, "-m", "ckpt_iter", "verify", str(root)], capture_output=True, text=True, timeout=300
  )
  assert verify.returncode == 0 and verify.stdout.startswith("ok: "), verify.stdout + verify.stderr


@pytest.mark.slow
@pytest.mark.parametrize("killed_after", [3, 4])
def test_a_killed_run_resumes_exactly_through_the_entry_point(tmp_path, jax_cache, uninterrupted, killed_after):
  # After 3 updates the kill falls between the two updates (num_iterations=2)
  # of one rollout: the resumed run must train the pending repeat from the
  # checkpoint. After 4 it falls at a rollout boundary.
  _, expected, _ = uninterrupted
  root = tmp_path / "ckpt"
  config = _write_config(tmp_path / "grpo.yaml", root)
  killed, meta = _train(config, tmp_path / "killed.npz", jax_cache, "data_config.seed=1",
                        preempt_after=killed_after, expect_rc=tunix_cli_worker.PREEMPT_EXIT_CODE)
  assert meta["preempted"] and meta["learners"] == [_RESUMABLE]
  resumed, meta = _train(config, tmp_path / "resumed.npz", jax_cache, "data_config.seed=1")
  assert meta["learners"] == [_RESUMABLE] and meta["restored_steps"] == [killed_after]
  consumed = 2 * killed_after
  assert len(killed) == consumed and len(resumed) == len(expected) - consumed
  testing.assert_trees_equal(killed, expected[:consumed], path="before the kill")
  testing.assert_trees_equal(resumed, expected[consumed:], path="after the resume")


def test_a_run_started_with_tunixs_own_command_continues_with_ckpt_iter_train(tmp_path, jax_cache, uninterrupted):
  """Issue 31, case 3: `python -m tunix.cli.grpo_main` killed after step 2 (a global-step
  boundary), restarted with `ckpt-iter train`: it continues at the prompts stock left off
  at (the default legacy policy), bit for bit, and writes data states from then on; with
  the policy set to raise it refuses, naming the command-line way through."""
  _, expected, _ = uninterrupted
  root = tmp_path / "ckpt"
  config = _write_config(tmp_path / "grpo.yaml", root)
  _, meta = _train(config, tmp_path / "stock.npz", jax_cache, "data_config.seed=1", stock=True,
                   preempt_after=2, expect_rc=tunix_cli_worker.PREEMPT_EXIT_CODE)
  assert meta["learners"] == ["tunix.rl.grpo.grpo_learner.GRPOLearner"]
  assert not (root / "actor" / "2" / "data").exists()  # a stock checkpoint
  # The policy from a `ckpt_iter:` section of the file (Tunix's loader takes the file as it is).
  strict = _write_config(tmp_path / "strict.yaml", root, ckpt_iter={"on_legacy_checkpoint": "raise"})
  refused = subprocess.run(
      [sys.executable, _WORKER, "--out", str(tmp_path / "refused.npz"), "--", "grpo", strict,
       "data_config.seed=1"],
      env=_env(jax_cache), capture_output=True, text=True, timeout=900)
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert "On this command line: ckpt_iter.on_legacy_checkpoint=fast_forward" in refused.stderr, refused.stderr[-2000:]
  resumed, meta = _train(config, tmp_path / "resumed.npz", jax_cache, "data_config.seed=1")
  assert meta["learners"] == [_RESUMABLE] and meta["restored_steps"] == [2]
  testing.assert_trees_equal(resumed, expected[2 * 2:], path="after switching to ckpt-iter train")
  assert (root / "actor" / str(_MAX_STEPS) / "data").is_dir()


def test_a_smaller_micro_batch_continues_at_the_same_prompt(tmp_path, jax_cache, uninterrupted):
  """Issue 31, case 4: a run with micro-batches of 2 (mini-batch 2) killed after step 2,
  restarted with train_micro_batch_size 1 (after an out-of-memory crash, say): the same
  mini-batches are cut into more pieces, so it trains the prompts the uninterrupted run
  with micro-batches of 1 trains from there (as stock does), no allow_drift needed."""
  _, expected, _ = uninterrupted  # micro-batches of 1 throughout
  root = tmp_path / "ckpt"
  training = tunix_cli_worker.grpo_config(str(root), "")["rl_training_config"]
  wide = _write_config(tmp_path / "wide.yaml", root, rl_training_config={**training, "train_micro_batch_size": 2})
  killed, _ = _train(wide, tmp_path / "killed.npz", jax_cache, "data_config.seed=1",
                     preempt_after=2, expect_rc=tunix_cli_worker.PREEMPT_EXIT_CODE)
  assert len(killed) == 2  # one trainer input per update
  narrow = _write_config(tmp_path / "narrow.yaml", root)
  resumed, meta = _train(narrow, tmp_path / "resumed.npz", jax_cache, "data_config.seed=1")
  assert meta["restored_steps"] == [2]
  assert len(resumed) == len(expected) - 4
  for index, (got, want) in enumerate(zip(resumed, expected[4:])):
    np.testing.assert_array_equal(got["prompt_ids"], want["prompt_ids"], err_msg=f"trainer input {index}")


def test_a_resume_into_another_dataset_seed_is_refused_naming_it(tmp_path, jax_cache, uninterrupted):
  root, _, _ = uninterrupted
  copy = tmp_path / "ckpt"
  subprocess.run(["cp", "-r", str(root), str(copy)], check=True)
  config = _write_config(tmp_path / "grpo.yaml", copy, rl_training_config={
      **tunix_cli_worker.grpo_config(str(copy), "")["rl_training_config"], "max_steps": _MAX_STEPS + 2})
  command = [sys.executable, _WORKER, "--out", str(tmp_path / "r.npz"), "--", "grpo", config, "data_config.seed=2"]
  process = subprocess.run(command, env=_env(jax_cache), capture_output=True, text=True, timeout=900)
  assert process.returncode == 1, process.stderr[-3000:]
  message = process.stderr.strip().splitlines()[-1]
  assert message.startswith("ckpt-iter train: ") and "seed=1 there" in message and "seed=2 here" in message, message


def test_tunix_config_errors_come_from_tunix(tmp_path):
  # Overrides go to Tunix's own config loader: a key the file lacks is its error.
  config = _write_config(tmp_path / "grpo.yaml", tmp_path / "ckpt")
  process = subprocess.run(
      [sys.executable, "-m", "ckpt_iter.tunix.cli", "grpo", config, "no_such_key=1"],
      env=_env(str(tmp_path / "cache")), capture_output=True, text=True, timeout=300,
  )
  assert process.returncode != 0
  assert "Key no_such_key was passed at the command line but isn't in config" in process.stderr
