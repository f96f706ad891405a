"""Q6: resume wall time of the demo scenario — ckpt_iter vs stock Tunix.

The demo's run (toy GRPO, num_iterations 2, one prompt per step) is killed
right after checkpoint 3, between the two updates of prompt B. From fresh
copies of that checkpoint, a new process resumes with stock GRPOLearner or
with ResumableGRPOLearner, alternating (ABBA). Measured: wall time from
spawning the process until its first trainer input is ready (the first call
of `rl_cluster.update_actor`), and inside the worker the split into start-up
(imports + building the learner, restoring the model) and train() until that
first input (data restore or fast-forward, rollout). A shared JAX compilation
cache, warmed by the preempted run, keeps JIT out of most of it.

At a larger position: the same checkpoint relabelled as step S (directory
renamed, and for ckpt_iter the data state's counters and position set to
what step S would hold: dataset position (S+1)/2, mid-repeat). The weights and
pending arrays are step 3's, which changes neither side's restore cost. Stock
Tunix then replays S input micro-batches (its count is num_iterations too
large, upstream #2290) through `iter(dataset)` with Grain's default
ReadOptions; ckpt_iter sets the position. S is kept small enough for
`make bench` (2e4+1); the stock wait at dataset position 1e5 is extrapolated
linearly from it and labelled so.
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

DEMO_STEP = 3


def worker(learner_kind: str, root: str, max_steps: int, spawned_at: float) -> None:
  started = time.time()
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  config = toyrun.RunConfig(learner=learner_kind, max_steps=max_steps)
  learner = toyrun.build_learner(config, root)
  built = time.time()
  cluster = learner.rl_cluster

  def first_update(train_ds, *unused_args, **unused_kwargs):
    ready = time.time()
    print(json.dumps({
        "restored_step": int(cluster.actor_trainer.train_steps),
        "first_input_ready_s": ready - spawned_at,
        "python_start_s": started - spawned_at,
        "build_and_model_restore_s": built - started,
        "train_until_first_input_s": ready - built,
        "first_input_prompt": toyrun.prompt_labels(train_ds[0].prompt_ids),
    }), flush=True)
    os._exit(0)  # pylint: disable=protected-access

  cluster.update_actor = first_update
  kwargs = {} if learner_kind == "stock" else {"on_legacy_checkpoint": "raise"}
  learner.train(toyrun.make_train_dataset(config), None, **kwargs)
  raise SystemExit("training ended before any trainer input")


def run_worker(learner_kind: str, root: str, max_steps: int, env: dict) -> dict:
  command = [_common.python(), os.path.abspath(__file__), "--worker", learner_kind, "--root", root,
             "--max-steps", str(max_steps), "--spawned-at", repr(time.time())]
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  if process.returncode != 0 or not process.stdout.strip():
    raise RuntimeError(f"worker failed:\n{process.stderr[-3000:]}")
  return json.loads(process.stdout.strip().splitlines()[-1])


def relabel(source_root: str, target_root: str, step: int) -> None:
  """Copies the step-3 checkpoint and relabels it as step `step` (odd: mid-repeat)."""
  assert step % 2 == 1
  shutil.copytree(source_root, target_root)
  actor = os.path.join(target_root, "actor")
  for name in os.listdir(actor):
    if name.isdigit() and int(name) != DEMO_STEP:
      shutil.rmtree(os.path.join(actor, name))
  step_dir = os.path.join(actor, str(step))
  os.rename(os.path.join(actor, str(DEMO_STEP)), step_dir)
  global_steps = (step - 1) // 2
  metadata_path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
  with open(metadata_path) as f:
    metadata = json.load(f)
  metadata["custom_metadata"]["global_step"] = global_steps + 1
  with open(metadata_path, "w") as f:
    json.dump(metadata, f)
  data_path = os.path.join(step_dir, "data", "process_0-of-1.json")
  with open(data_path) as f:
    header = json.load(f)
  header["position"]["input"]["position"]["next_record"] = global_steps + 1  # format 4: records, 1 prompt per batch
  header["position"]["input"].pop("content", None)  # it describes the demo step's batch, not this forged position's
  header["counters"].update(train_steps=step, actor_iter_steps=step, global_steps=global_steps)
  with open(data_path, "w") as f:
    json.dump(header, f, indent=1)


def main() -> None:
  def extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", choices=["stock", "ckpt_iter"])
    parser.add_argument("--root")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--spawned-at", type=float)

  args = _common.parse_args(__doc__.splitlines()[0], extra)
  if args.worker:
    worker(args.worker, args.root, args.max_steps, args.spawned_at)
    return
  report = _common.Reporter("resume_wall_time", args.quick)
  workdir = tempfile.mkdtemp(prefix="bench_resume_")
  cache_dir = os.environ.get("BENCH_JAX_CACHE_DIR") or os.path.join(workdir, "jax_cache")
  env = _common.child_env(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  preempted = os.path.join(workdir, "preempted")
  process = subprocess.run(
      [_common.python(), "-m", "demo.toyrun", "--root", preempted, "--out", preempted + ".npz",
       "--config", json.dumps({"learner": "ckpt_iter", "max_steps": 8, "num_iterations": 2}),
       "--preempt-after", str(DEMO_STEP)],
      env=env, capture_output=True, text=True, timeout=900,
  )
  if process.returncode != 0:
    raise RuntimeError(process.stderr[-3000:])

  large_step = 2 * 2_000 + 1 if args.quick else 2 * 10_000 + 1
  scenarios = [
      ("demo", DEMO_STEP, 8, 1 if args.quick else 3),
      ("large", large_step, large_step + 8, 1 if args.quick else 2),
  ]
  checks = []
  demo_stock_wait_s = 0.0
  for scenario, step, max_steps, pairs in scenarios:
    times = {"stock": [], "ckpt_iter": []}
    for pair in range(pairs):
      for learner_kind in (("stock", "ckpt_iter") if pair % 2 == 0 else ("ckpt_iter", "stock")):
        root = os.path.join(workdir, f"{scenario}_{pair}_{learner_kind}")
        if scenario == "demo":
          shutil.copytree(preempted, root)
        else:
          relabel(preempted, root, step)
        result = run_worker(learner_kind, root, max_steps, env)
        shutil.rmtree(root, ignore_errors=True)
        times[learner_kind].append(result)
        report.measurement(scenario=scenario, checkpoint_step=step, dataset_position=(step + 1) // 2,
                           stock_replays_elements=step if learner_kind == "stock" else None,
                           pair=pair, learner=learner_kind,
                           **{k: _common.rounded(v) if isinstance(v, float) else v for k, v in result.items()})
    medians = {k: {key: _common.median([r[key] for r in v]) for key in
                   ("first_input_ready_s", "train_until_first_input_s")} for k, v in times.items()}
    ratio = medians["stock"]["first_input_ready_s"] / medians["ckpt_iter"]["first_input_ready_s"]
    train_ratio = medians["stock"]["train_until_first_input_s"] / medians["ckpt_iter"]["train_until_first_input_s"]
    for learner_kind, values in medians.items():
      report.measurement(scenario=scenario, checkpoint_step=step, learner=learner_kind, runs=len(times[learner_kind]),
                         median_first_input_ready_s=_common.rounded(values["first_input_ready_s"]),
                         median_train_until_first_input_s=_common.rounded(values["train_until_first_input_s"]))
    extra = {}
    if scenario == "large":
      # Stock's extra wait over the demo position is its replay: linear in S.
      per_micro_batch_s = (medians["stock"]["train_until_first_input_s"] - demo_stock_wait_s) / (step - DEMO_STEP)
      extra = {"stock_replay_us_per_micro_batch": _common.rounded(per_micro_batch_s * 1e6),
               "stock_wait_s_at_dataset_position_1e5_extrapolated": _common.rounded(
                   demo_stock_wait_s + per_micro_batch_s * (2 * 10**5 + 1 - DEMO_STEP), 3)}
    else:
      demo_stock_wait_s = medians["stock"]["train_until_first_input_s"]
    checks.append(_common.check(
        f"{scenario} (checkpoint step {step}): stock / ckpt_iter time to first trainer input",
        _common.rounded(ratio, 3), "> 1 (ckpt_iter resumes faster; no fixed target)", ratio > 1.0,
        train_until_first_input_ratio=_common.rounded(train_ratio, 3), pairs=pairs, **extra,
    ))
  shutil.rmtree(workdir, ignore_errors=True)
  report.summary(checks)


if __name__ == "__main__":
  main()
