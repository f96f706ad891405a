"""Q5: toy GRPO step time — ResumableGRPOLearner vs stock GRPOLearner.

The toy run of `demo.toyrun` (Tunix's ToyTransformer on CPU, one prompt
per global step, num_iterations 2, num_generations 2), same config for both
learners, each run in a fresh process; runs alternate between the learners
(ABBA) in pairs. Process start-up, JIT and the final forced save are excluded:
each run records the wall time at every actor update (wrapping
`rl_cluster.update_actor`) and reports the duration of each global step
(one rollout + 2 optimizer updates + their saves) in a steady window (updates
4 .. max_steps-2). A learner's step time is half the median of its
global-step durations pooled over its runs (a median, so that bursts of load
from other jobs on the machine do not decide it); the ratio is ckpt_iter's
over stock's. The per-pair ratios (runs of a pair ran back to back) and their
median are reported too, as a measure of the spread. The checkpoint saves
(`actor_trainer.checkpoint_manager.save`) are timed for the save share, and
for ckpt_iter also `ckpt_iter._item.snapshot`, the data item's
synchronous part inside the save.

Two save settings: save_interval_steps=1 (a checkpoint every step, as the
tests do) and 1000 (no save inside the window: the loop's own overhead).

Cross-check: the same comparison with save_interval_steps=1 inside ONE process
(runs alternating S C C S ...), which removes process-to-process variation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import _common

WARMUP_UPDATES = 4  # global steps 0 and 1: JIT of the train step, first-use costs
LEARNERS = ("stock", "ckpt_iter")


def train_once(learner_kind: str, root: str, max_steps: int, save_interval_steps: int) -> dict:
  """Trains one toy run in this process and returns its timings in the window."""
  from ckpt_iter import _item as item_lib
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  config = toyrun.RunConfig(learner=learner_kind, max_steps=max_steps, save_interval_steps=save_interval_steps)
  learner = toyrun.build_learner(config, root)
  cluster = learner.rl_cluster
  stamps, cpu_stamps, saves, snapshots = [], [], [], []

  def timed(fn, log):
    def wrapper(*args, **kwargs):
      started = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        log.append((started, time.perf_counter() - started))
    return wrapper

  update_actor = cluster.update_actor

  def stamped_update_actor(*args, **kwargs):
    stamps.append(time.perf_counter())
    cpu_stamps.append(time.process_time())
    return update_actor(*args, **kwargs)

  cluster.update_actor = stamped_update_actor
  manager = cluster.actor_trainer.checkpoint_manager
  manager.save = timed(manager.save, saves)
  snapshot = item_lib.snapshot
  item_lib.snapshot = timed(snapshot, snapshots)
  try:
    kwargs = {} if learner_kind == "stock" else {"on_legacy_checkpoint": "raise"}
    learner.train(toyrun.make_train_dataset(config), None, **kwargs)
  finally:
    item_lib.snapshot = snapshot
  first, last = WARMUP_UPDATES, max_steps - 2  # whole global steps, final save excluded
  in_window = lambda t: stamps[first] <= t < stamps[last]  # pylint: disable=unnecessary-lambda-assignment
  return {
      # One global step = one rollout + num_iterations (2) optimizer steps.
      "global_step_ms": [(stamps[k + 2] - stamps[k]) * 1e3 for k in range(first, last, 2)],
      "global_step_cpu_ms": [(cpu_stamps[k + 2] - cpu_stamps[k]) * 1e3 for k in range(first, last, 2)],
      "save_ms": [d * 1e3 for s, d in saves if in_window(s)],
      "data_snapshot_ms": [d * 1e3 for s, d in snapshots if in_window(s)],
  }


def in_process_pairs(workdir: str, pairs: int, max_steps: int) -> list[dict]:
  results = []
  for pair in range(pairs):
    for learner_kind in (LEARNERS if pair % 2 == 0 else LEARNERS[::-1]):
      root = tempfile.mkdtemp(prefix=f"{learner_kind}_", dir=workdir)
      results.append({"learner": learner_kind, "pair": pair, **train_once(learner_kind, root, max_steps, 1)})
      shutil.rmtree(root, ignore_errors=True)
  return results


def run_worker(mode: str, workdir: str, cache_dir: str, **options) -> dict | list:
  command = [_common.python(), os.path.abspath(__file__), "--worker", mode, "--workdir", workdir]
  for name, value in options.items():
    command += [f"--{name.replace('_', '-')}", str(value)]
  env = _common.child_env(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
  if process.returncode != 0:
    raise RuntimeError(f"worker failed:\n{process.stderr[-3000:]}")
  return json.loads(process.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
  pooled = lambda key: [x for r in runs for x in r[key]]  # pylint: disable=unnecessary-lambda-assignment
  steps = pooled("global_step_ms")
  saves = pooled("save_ms")
  step_ms = _common.median(steps) / 2
  save_ms = _common.median(saves) if saves else 0.0
  saves_per_step = len(saves) / (2 * len(steps))
  return {
      "runs": len(runs),
      "global_steps_pooled": len(steps),
      "median_step_ms": step_ms,
      "median_cpu_step_ms": _common.median(pooled("global_step_cpu_ms")) / 2,
      "median_save_ms": save_ms,
      "save_share": save_ms * saves_per_step / step_ms,
      "per_run_median_step_ms": [_common.median(r["global_step_ms"]) / 2 for r in runs],
  }


def paired_ratios(ours: list[dict], stock: list[dict]) -> list[float]:
  return [_common.median(a["global_step_ms"]) / _common.median(b["global_step_ms"]) for a, b in zip(ours, stock)]


def main() -> None:
  def extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", choices=[*LEARNERS, "in_process"])
    parser.add_argument("--workdir")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--save-interval-steps", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=1)

  args = _common.parse_args(__doc__.splitlines()[0], extra)
  if args.worker == "in_process":
    print(json.dumps(in_process_pairs(args.workdir, args.pairs, args.max_steps)))
    return
  if args.worker:
    root = tempfile.mkdtemp(prefix=f"{args.worker}_", dir=args.workdir)
    result = train_once(args.worker, root, args.max_steps, args.save_interval_steps)
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return

  report = _common.Reporter("tunix_step_time", args.quick)
  pairs = 1 if args.quick else 4
  max_steps = 8 if args.quick else 30
  workdir = tempfile.mkdtemp(prefix="bench_step_time_")
  cache_dir = os.environ.get("BENCH_JAX_CACHE_DIR") or os.path.join(workdir, "jax_cache")
  results: dict[tuple[int, str], list[dict]] = {}
  for pair in range(pairs):
    for interval in (1, 1000):
      for learner_kind in (LEARNERS if pair % 2 == 0 else LEARNERS[::-1]):
        result = run_worker(learner_kind, workdir, cache_dir, max_steps=max_steps, save_interval_steps=interval)
        results.setdefault((interval, learner_kind), []).append(result)
        report.measurement(pair=pair, save_interval_steps=interval, learner=learner_kind, process="fresh",
                           median_global_step_ms=_common.rounded(_common.median(result["global_step_ms"])),
                           global_steps=len(result["global_step_ms"]))
  in_process = run_worker("in_process", workdir, cache_dir, max_steps=max_steps, pairs=pairs)
  shutil.rmtree(workdir, ignore_errors=True)
  in_process_by = {k: [r for r in in_process if r["learner"] == k] for k in LEARNERS}

  checks = []
  for interval in (1, 1000):
    summaries = {k: summarize(results[(interval, k)]) for k in LEARNERS}
    for learner_kind, summary in summaries.items():
      report.measurement(save_interval_steps=interval, learner=learner_kind, process="fresh",
                         **{k: _rounded(v) for k, v in summary.items()})
    ratio = summaries["ckpt_iter"]["median_step_ms"] / summaries["stock"]["median_step_ms"]
    per_pair = paired_ratios(results[(interval, "ckpt_iter")], results[(interval, "stock")])
    cpu_ratio = summaries["ckpt_iter"]["median_cpu_step_ms"] / summaries["stock"]["median_cpu_step_ms"]
    snapshot_ms = [x for r in results[(interval, "ckpt_iter")] for x in r["data_snapshot_ms"]]
    extra_fields = {}
    if interval == 1:
      same = {k: summarize(v) for k, v in in_process_by.items()}
      for learner_kind, summary in same.items():
        report.measurement(save_interval_steps=1, learner=learner_kind, process="one process, alternating",
                           **{k: _rounded(v) for k, v in summary.items()})
      extra_fields = {
          "one_process_ratio": _common.rounded(_common.median(
              paired_ratios(in_process_by["ckpt_iter"], in_process_by["stock"])), 3),
          "one_process_per_pair_ratios": [
              _common.rounded(x, 3) for x in paired_ratios(in_process_by["ckpt_iter"], in_process_by["stock"])
          ],
      }
    checks.append(_common.check(
        f"save_interval_steps={interval}: ckpt_iter / stock median step time - 1",
        f"{(ratio - 1) * 100:+.1f}%", "<= 2%", ratio <= 1.02,
        median_of_per_pair_ratios=f"{(_common.median(per_pair) - 1) * 100:+.1f}%",
        cpu_time=f"{(cpu_ratio - 1) * 100:+.1f}%",
        save_ms_delta=_common.rounded(
            summaries["ckpt_iter"]["median_save_ms"] - summaries["stock"]["median_save_ms"], 3
        ),
        pairs=pairs,
        per_pair_ratios=[_common.rounded(x, 3) for x in per_pair],
        data_snapshot_ms=_common.rounded(_common.median(snapshot_ms), 3) if snapshot_ms else None,
        **extra_fields,
    ))
  report.summary(checks)


def _rounded(value):
  if isinstance(value, float):
    return _common.rounded(value)
  if isinstance(value, list):
    return [_rounded(v) for v in value]
  return value


if __name__ == "__main__":
  main()
