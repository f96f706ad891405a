"""Runs toy Tunix trainings in fresh processes and compares their trainer inputs.

Every run is a real process (`python tunix_toy.py`): real RLCluster,
GRPO/PPO learner, Orbax checkpoints on disk, killed with os._exit right after
checkpoint K when asked. Processes share the persistent JAX compilation cache
of the test session (tests/conftest.py), so only the first of each
configuration compiles, once per machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Callable

import filelock
import numpy as np

from ckpt_iter import testing
from demo import agentic_toyrun
from demo import toyrun
import tunix_toy

_TIMEOUT_SECONDS = 900
_AGENTIC_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_agentic_worker.py")
_SFT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_sft_worker.py")
SFT_PREEMPT_EXIT_CODE = 42  # tunix_sft_worker.PREEMPT_EXIT_CODE


@dataclasses.dataclass
class Run:
  inputs: list[dict[str, np.ndarray]]
  meta: dict[str, Any]
  stderr: str

  @property
  def labels(self) -> list[str]:
    return ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in self.inputs]


def built_once(tmp_path_factory: Any, name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """The directory `build` filled, built once per test session whichever pytest-xdist worker asks first.

  A module fixture runs on every worker that picks one of its tests; for the
  agentic runs (nine Tunix processes) that built them twice at once on a
  2-core machine. The other workers wait for the first and read its files.
  """
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # the session's directory, shared by its workers (each has its own below it)
  directory = base / name
  with filelock.FileLock(str(base / f"{name}.lock")):
    done = directory / ".built"
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)  # a build that failed on another worker
      directory.mkdir()
      build(directory)
      done.touch()
  return directory


def run_toy(
    config: dict[str, Any],
    root: str,
    out: str,
    *,
    preempt_after: int | None = None,
    cache_dir: str | None = None,
    expect_failure: bool = False,
    python: str = sys.executable,
) -> Run:
  """Runs one toy training process (with the interpreter `python`); returns what it trained."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if config.get("async_rollout"):
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  if cache_dir:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  command = [
      python, tunix_toy.WORKER, "--root", root, "--out", out,
      "--config", json.dumps(config),
  ]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(
      command, env=env, capture_output=True, text=True, timeout=_TIMEOUT_SECONDS
  )
  if expect_failure:
    assert process.returncode != 0, "the run was expected to fail but exited 0"
    return Run([], {}, process.stderr)
  assert process.returncode == 0, f"toy run failed:\n{process.stderr[-4000:]}"
  inputs, meta = toyrun.load_record(out)
  return Run(inputs, meta, process.stderr)


def run_in_one_process(
    runs: list[tuple[dict[str, Any], str, str]], cache_dir: str | None = None
) -> list[Run]:
  """Runs (config, root, out) one after another in one fresh process; returns each run."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if any(config.get("async_rollout") for config, _, _ in runs):
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  if cache_dir:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  spec = os.path.join(os.path.dirname(runs[0][2]), "runs.json")
  with open(spec, "w", encoding="utf-8") as f:
    json.dump([{"config": c, "root": r, "out": o} for c, r, o in runs], f)
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_conformance_worker.py")
  process = subprocess.run(
      [sys.executable, worker, spec], env=env, capture_output=True, text=True,
      timeout=_TIMEOUT_SECONDS * len(runs),
  )
  assert process.returncode == 0, f"toy runs failed:\n{process.stderr[-4000:]}"
  return [Run(*toyrun.load_record(out), process.stderr) for _, _, out in runs]


def assert_same_inputs(actual: list[dict], expected: list[dict], what: str) -> None:
  """Trainer inputs equal bit for bit: prompts, completions, advantages, log-probs."""
  actual_labels = ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in actual]
  expected_labels = ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in expected]
  assert actual_labels == expected_labels, (
      f"{what}: trained prompts {actual_labels}, expected {expected_labels}"
  )
  assert len(actual) == len(expected)
  for index, (got, want) in enumerate(zip(actual, expected)):
    assert set(got) == set(want), f"{what}: input {index} has fields {sorted(got)}, expected {sorted(want)}"
    testing.assert_trees_equal(got, want, path=f"{what}: input {index} ({expected_labels[index]})")


def chain(
    config: dict[str, Any],
    workdir: str,
    preempt_steps: list[int],
    cache_dir: str | None,
    first_config: dict[str, Any] | None = None,
) -> tuple[list[Run], list[dict]]:
  """Preempts after each step in turn, resuming in a fresh process each time.

  `first_config`, when given, runs the first segment (e.g. stock Tunix, for a
  job switched to the drop-in after its first preemption).
  Returns the segment runs and the concatenation of their trainer inputs.
  """
  root = os.path.join(workdir, "chain")
  segments = []
  for index, step in enumerate(list(preempt_steps) + [None]):
    run = run_toy(
        first_config if index == 0 and first_config is not None else config, root,
        os.path.join(workdir, f"segment{index}.npz"),
        preempt_after=step, cache_dir=cache_dir,
    )
    expected_restored = 0 if index == 0 else preempt_steps[index - 1]
    assert run.meta["restored_step"] == expected_restored, run.meta
    segments.append(run)
  return segments, [x for run in segments for x in run.inputs]


def check_chain(config, preempt_steps, workdir, cache_dir, compare_stock=True):
  """Runs `config` uninterrupted (and stock, to compare), then as a chain of
  processes killed after each of `preempt_steps`; asserts the chain's trainer
  inputs equal the uninterrupted run's bit for bit. Returns the reference run."""
  reference = run_toy(
      dict(config, learner="ckpt_iter"), os.path.join(workdir, "reference"),
      os.path.join(workdir, "reference.npz"), cache_dir=cache_dir,
  )
  if compare_stock:
    stock = run_toy(
        dict(config, learner="stock"), os.path.join(workdir, "stock"),
        os.path.join(workdir, "stock.npz"), cache_dir=cache_dir,
    )
    assert_same_inputs(reference.inputs, stock.inputs, "ckpt_iter vs stock, uninterrupted")
  _, resumed = chain(dict(config, learner="ckpt_iter"), workdir, preempt_steps, cache_dir)
  assert_same_inputs(resumed, reference.inputs, f"resumed after {preempt_steps}")
  return reference


def run_agentic(root, out, cache_dir, *, learner="resumable", preempt_after=None, flags=()) -> dict:
  """Runs tests/workers/tunix_agentic_worker.py once; returns its record (`agentic_toyrun.load_record`).

  With `preempt_after` the process must die right after that checkpoint.
  """
  env = dict(
      os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  if "--async-rollout" in flags:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  command = [
      sys.executable, _AGENTIC_WORKER, "--root", str(root), "--out", str(out), "--learner", learner, *flags,
  ]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=_TIMEOUT_SECONDS)
  expected_rc = 0 if preempt_after is None else agentic_toyrun.PREEMPT_EXIT_CODE
  assert process.returncode == expected_rc, process.stderr[-12000:]  # a crash: every thread's stack
  return agentic_toyrun.load_record(str(out))


def run_sft(root, out, cache_dir, *, trainer="resumable", preempt_after=None, expect_rc=0, **flags):
  """Runs tests/workers/tunix_sft_worker.py once; returns its record (or stderr on failure)."""
  env = dict(
      os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  command = [sys.executable, _SFT_WORKER, "--root", str(root), "--out", str(out), "--trainer", trainer]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  for name, value in flags.items():
    command += [f"--{name.replace('_', '-')}", str(value)]
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  assert process.returncode == expect_rc, (
      f"worker exited {process.returncode}, expected {expect_rc}:\n{process.stderr[-4000:]}"
  )
  if expect_rc != 0:
    return process.stderr
  with np.load(out) as record:
    params = [record[k] for k in sorted((k for k in record.files if k.startswith("param_")),
                                        key=lambda k: int(k.split("_")[1]))]
    return {"fed": record["fed"], "params": params, "meta": json.loads(str(record["meta"]))}
