"""Q12: a Tunix step's data item at RL scale — rollout-weight copies and the producer's per-step work.

Two questions of issue 27, each measured in one run:

1. Rollout weights per global step. Real toy GRPO runs (`demo.toyrun`,
   `ResumableGRPOLearner`) with a separate rollout model (async rollout, two CPU
   devices), a checkpoint after every update. For each saved step the data
   state's counters say whether it falls inside a global step (where every such
   step used to carry `rollout_params`, a full copy of the rollout weights) and
   whether it now does (only where a rollout reads them before the next weight
   sync). Reported: copies per global step before and after, and their bytes.

2. The producer's per-micro-batch work against prompt length. A MapDataset of
   full batches of 512 prompts of L characters read through the learner's input
   (`_input.MicroBatchInput`, as the producer thread reads it). Each repetition
   times a bare Grain `next()` of the same dataset (what any reader pays), one
   `next_micro_batch()` (now: no digest), the digest of its prompts
   that every micro-batch used to pay (0.2.0's, `_drift.legacy_prompts_digest`), and the digests a save
   now pays once (`settled`: the prompts' and the content check's record of the
   full batch before the position). Medians over interleaved repetitions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import _common

PROMPTS_PER_BATCH = 512
PROMPT_LENGTHS = (1_000, 8_000)
RUNS = {
    # name: RunConfig fields (one prompt per global step unless said otherwise)
    "one_mini_batch_mu2": dict(num_iterations=2, max_steps=6),
    "one_mini_batch_mu4": dict(num_iterations=4, max_steps=8),
    "two_mini_batches_mu2": dict(num_iterations=2, batch_size=2, mini_batch_size=1, max_steps=8),
}


def _directory_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _toy_run(name: str, fields: dict, workdir: str) -> dict:
  root = os.path.join(workdir, name)
  env = _common.child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
  if os.environ.get("BENCH_JAX_CACHE_DIR"):
    env.update(JAX_COMPILATION_CACHE_DIR=os.environ["BENCH_JAX_CACHE_DIR"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  config = dict(fields, async_rollout=True)
  subprocess.run(
      [_common.python(), "-m", "demo.toyrun", "--root", root,
       "--out", os.path.join(workdir, f"{name}.npz"), "--config", json.dumps(config)],
      env=env, check=True, capture_output=True, text=True, timeout=900, cwd=_common.REPO_DIR,
  )
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top

  actor = os.path.join(root, "actor")
  mid_steps, weight_steps, weight_bytes = [], [], 0
  for step in sorted(int(s) for s in os.listdir(actor) if s.isdigit()):
    step_dir = os.path.join(actor, str(step))
    counters = _files.read_header(_files.header_path(os.path.join(step_dir, "data"), 0, 1))["counters"]
    # The counter exists exactly in the steps inside a global step of a separate rollout model.
    if "rollout_weights" in counters:
      mid_steps.append(step)
    if os.path.isdir(os.path.join(step_dir, "rollout_params")):
      weight_steps.append(step)
      weight_bytes = _directory_bytes(os.path.join(step_dir, "rollout_params"))
  mini_batches = config.get("batch_size", 1) // (config.get("mini_batch_size") or config.get("batch_size", 1))
  global_steps = config["max_steps"] // (config["num_iterations"] * mini_batches)
  return {
      "run": name, "num_iterations": config["num_iterations"], "mini_batches_per_global_step": mini_batches,
      "global_steps": global_steps, "mid_global_step_checkpoints": mid_steps,
      "checkpoints_with_rollout_weights": weight_steps,
      "copies_per_global_step_before": round(len(mid_steps) / global_steps, 3),
      "copies_per_global_step_after": round(len(weight_steps) / global_steps, 3),
      "rollout_weights_bytes": weight_bytes,
  }


def _producer(length: int, repetitions: int) -> dict:
  import grain  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _drift  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _input  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(length)
  letters = np.array(list("abcdefghij "))
  prompts = np.array(["".join(rng.choice(letters, length)) for _ in range(PROMPTS_PER_BATCH)])
  batches = grain.MapDataset.source([{"prompts": prompts}] * (repetitions + 1))
  source = _input.MicroBatchInput(_input.make_source(batches), None, rebatch=None)
  bare = iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  source.next_micro_batch()  # first-use costs out of the measurement
  next(bare)
  read_ms, grain_ms, old_digest_ms, save_digest_ms = [], [], [], []
  for _ in range(repetitions):
    grain_ms.append(_common.timed_ms(lambda: next(bare))[0])
    elapsed, batch = _common.timed_ms(source.next_micro_batch)
    read_ms.append(elapsed)
    old_digest_ms.append(_common.timed_ms(lambda: _drift.legacy_prompts_digest(batch["prompts"]))[0])
    unsettled = source.unsettled_position()
    save_digest_ms.append(_common.timed_ms(lambda: _input.settled(unsettled))[0])
  return {
      "prompt_chars": length, "prompts": PROMPTS_PER_BATCH, "repetitions": repetitions,
      "read_ms": _common.rounded(_common.median(read_ms)),
      "grain_ms": _common.rounded(_common.median(grain_ms)),
      "before_ms": _common.rounded(_common.median(read_ms) + _common.median(old_digest_ms)),
      "digest_removed_ms": _common.rounded(_common.median(old_digest_ms)),
      "digest_at_save_ms": _common.rounded(_common.median(save_digest_ms)),
  }


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("rl_scale", args.quick)
  workdir = tempfile.mkdtemp(prefix="bench_rl_scale_")
  checks = []
  try:
    runs = [_toy_run(name, fields, workdir) for name, fields in RUNS.items()]
    for row in runs:
      reporter.measurement(part="rollout_weights", **row)
    one_mini_batch = [r for r in runs if r["mini_batches_per_global_step"] == 1]
    checks.append(_common.check(
        "rollout-weight copies per global step, one mini-batch per global step",
        max(r["copies_per_global_step_after"] for r in one_mini_batch), "0",
        all(r["copies_per_global_step_after"] == 0 for r in one_mini_batch)))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  repetitions = 5 if args.quick else 101
  producer = [_producer(length, repetitions) for length in PROMPT_LENGTHS]
  for row in producer:
    reporter.measurement(part="producer", **row)
  short, long = producer[0], producer[-1]
  # What 8x longer prompts add to a micro-batch's producer work, now over before.
  share = (long["read_ms"] - short["read_ms"]) / (long["before_ms"] - short["before_ms"])
  checks.append(_common.check(
      f"producer work per micro-batch that grows with prompt length ({short['prompt_chars']} -> "
      f"{long['prompt_chars']} chars), now / before", round(share, 3), "<= 0.05", share <= 0.05))
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  sys.path.insert(0, _common.REPO_DIR)
  main()
