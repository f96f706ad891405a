"""Q5: toy GRPO step time — ResumableGRPOLearner vs stock GRPOLearner.

The toy run of `ckpt_iter.toyrun` (Tunix's ToyTransformer on CPU, one prompt
per global step, num_iterations 2, num_generations 2), same config for both
learners, each run in a fresh process; runs alternate between the learners
(ABBA) in pairs. Process start-up, JIT and the final forced save are excluded:
each worker records the wall time at every actor update (wrapping
`rl_cluster.update_actor`) and reports the duration of each global step
(one rollout + 2 optimizer updates) in a steady window (updates
4 .. max_steps-2). The step time of a learner is half the median of its
global-step durations pooled over its runs (a median, so that bursts of load
from other jobs on the machine do not decide it). The window
includes data loading, rollout, reference log-probs, the updates and the
checkpoint saves (`actor_trainer.checkpoint_manager.save`, timed separately
for the save share).

Two save settings: save_interval_steps=1 (a checkpoint every step, as the
tests do) and 1000 (no save inside the window: the loop's own overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common

WARMUP_UPDATES = 4  # global steps 0 and 1: JIT of the train step, first-use costs


def worker(learner_kind: str, root: str, max_steps: int, save_interval_steps: int) -> dict:
  from ckpt_iter import toyrun  # pylint: disable=g-import-not-at-top

  config = toyrun.RunConfig(learner=learner_kind, max_steps=max_steps, save_interval_steps=save_interval_steps)
  learner = toyrun.build_learner(config, root)
  cluster = learner.rl_cluster
  stamps, cpu_stamps, saves = [], [], []
  update_actor = cluster.update_actor

  def timed_update_actor(*args, **kwargs):
    stamps.append(time.perf_counter())
    cpu_stamps.append(time.process_time())
    return update_actor(*args, **kwargs)

  cluster.update_actor = timed_update_actor
  manager = cluster.actor_trainer.checkpoint_manager
  save = manager.save

  def timed_save(*args, **kwargs):
    started = time.perf_counter()
    try:
      return save(*args, **kwargs)
    finally:
      saves.append((started, time.perf_counter() - started))

  manager.save = timed_save
  kwargs = {} if learner_kind == "stock" else {"on_legacy_checkpoint": "raise"}
  learner.train(toyrun.make_train_dataset(config), None, **kwargs)
  first, last = WARMUP_UPDATES, max_steps - 2  # whole global steps, final save excluded
  in_window = lambda t: stamps[first] <= t < stamps[last]  # pylint: disable=unnecessary-lambda-assignment
  return {
      # One global step = one rollout + num_iterations (2) optimizer steps.
      "global_step_ms": [(stamps[k + 2] - stamps[k]) * 1e3 for k in range(first, last, 2)],
      "global_step_cpu_ms": [(cpu_stamps[k + 2] - cpu_stamps[k]) * 1e3 for k in range(first, last, 2)],
      "save_ms": [d * 1e3 for s, d in saves if in_window(s)],
  }


def run_worker(learner_kind: str, max_steps: int, save_interval_steps: int, workdir: str, cache_dir: str) -> dict:
  root = tempfile.mkdtemp(prefix=f"{learner_kind}_", dir=workdir)
  command = [_common.python(), os.path.abspath(__file__), "--worker", learner_kind, "--root", root,
             "--max-steps", str(max_steps), "--save-interval-steps", str(save_interval_steps)]
  env = _common.child_env(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  if process.returncode != 0:
    raise RuntimeError(f"worker failed:\n{process.stderr[-3000:]}")
  return json.loads(process.stdout.strip().splitlines()[-1])


def main() -> None:
  def extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", choices=["stock", "ckpt_iter"])
    parser.add_argument("--root")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--save-interval-steps", type=int)

  args = _common.parse_args(__doc__.splitlines()[0], extra)
  if args.worker:
    print(json.dumps(worker(args.worker, args.root, args.max_steps, args.save_interval_steps)))
    return
  report = _common.Reporter("tunix_step_time", args.quick)
  pairs = 1 if args.quick else 5
  max_steps = 8 if args.quick else 30
  workdir = tempfile.mkdtemp(prefix="bench_step_time_")
  cache_dir = os.environ.get("BENCH_JAX_CACHE_DIR") or os.path.join(workdir, "jax_cache")
  results: dict[tuple[int, str], list[dict]] = {}
  for pair in range(pairs):
    for interval in (1, 1000):
      order = ("stock", "ckpt_iter") if pair % 2 == 0 else ("ckpt_iter", "stock")
      for learner_kind in order:
        result = run_worker(learner_kind, max_steps, interval, workdir, cache_dir)
        results.setdefault((interval, learner_kind), []).append(result)
        report.measurement(pair=pair, save_interval_steps=interval, learner=learner_kind,
                           median_global_step_ms=_common.rounded(_common.median(result["global_step_ms"])),
                           global_steps=len(result["global_step_ms"]),
                           median_save_ms=_common.rounded(_common.median(result["save_ms"])) if result["save_ms"] else None)
  checks = []
  for interval in (1, 1000):
    medians = {}
    for learner_kind in ("stock", "ckpt_iter"):
      runs = results[(interval, learner_kind)]
      pooled = lambda key: [x for r in runs for x in r[key]]  # pylint: disable=unnecessary-lambda-assignment,cell-var-from-loop
      step_ms = _common.median(pooled("global_step_ms")) / 2
      cpu_step_ms = _common.median(pooled("global_step_cpu_ms")) / 2
      save_ms = _common.median(pooled("save_ms")) if pooled("save_ms") else 0.0
      per_run = [_common.median(r["global_step_ms"]) / 2 for r in runs]
      medians[learner_kind] = {"step_ms": step_ms, "cpu_step_ms": cpu_step_ms, "save_ms": save_ms}
      report.measurement(save_interval_steps=interval, learner=learner_kind, runs=len(runs),
                         global_steps_pooled=len(pooled("global_step_ms")),
                         median_step_ms=_common.rounded(step_ms), median_cpu_step_ms=_common.rounded(cpu_step_ms),
                         median_save_ms=_common.rounded(save_ms), saves_per_step=len(pooled("save_ms")) / (2 * len(pooled("global_step_ms"))),
                         save_share=_common.rounded(save_ms * len(pooled("save_ms")) / (2 * len(pooled("global_step_ms"))) / step_ms, 3),
                         per_run_median_step_ms=[_common.rounded(x) for x in per_run])
    ratio = medians["ckpt_iter"]["step_ms"] / medians["stock"]["step_ms"]
    paired = [_common.median(a["global_step_ms"]) / _common.median(b["global_step_ms"])
              for a, b in zip(results[(interval, "ckpt_iter")], results[(interval, "stock")])]
    cpu_ratio = medians["ckpt_iter"]["cpu_step_ms"] / medians["stock"]["cpu_step_ms"]
    checks.append(_common.check(
        f"save_interval_steps={interval}: ckpt_iter / stock median step time - 1",
        f"{(ratio - 1) * 100:+.1f}%", "<= 2%", ratio <= 1.02,
        cpu_time=f"{(cpu_ratio - 1) * 100:+.1f}%",
        save_ms_delta=_common.rounded(medians["ckpt_iter"]["save_ms"] - medians["stock"]["save_ms"], 3),
        pairs=pairs, per_pair_ratios=[_common.rounded(x, 3) for x in paired],
    ))
  report.summary(checks)


if __name__ == "__main__":
  main()
