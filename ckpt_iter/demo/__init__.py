"""`ckpt-iter demo`: a GRPO run preempted between two num_iterations updates.

Four real processes on CPU (toy model, a prompt set shipped in the package,
real Tunix GRPOLearner, Orbax checkpoints on disk):
  1. the uninterrupted reference run;
  2. the same run, killed right after checkpoint K;
  3. stock Tunix resuming from a copy of that checkpoint (fast-forward);
  4. ckpt_iter resuming from another copy.
Then a side-by-side table of what each trained after the resume, with a
verdict per row, and the checkpoint's data state as `ckpt-iter inspect` shows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from ckpt_iter import cli
from ckpt_iter.demo import toyrun

_TIMEOUT_SECONDS = 600


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="ckpt-iter demo",
      description="Preempt a toy GRPO run between two num_iterations updates and "
      "resume it with stock Tunix and with ckpt_iter, side by side.",
  )
  parser.add_argument("--dir", default="ckpt_iter_demo",
                      help="where checkpoints and records go (default: ./ckpt_iter_demo)")
  parser.add_argument("--preempt-after", type=int, default=3,
                      help="kill the run right after this checkpoint step (default: 3)")
  parser.add_argument("--num-iterations", type=int, default=2,
                      help="GRPO num_iterations, updates per rollout (default: 2)")
  parser.add_argument("--max-steps", type=int, default=8, help="optimizer steps (default: 8)")
  parser.add_argument("--data-shuffle-seed", type=int, default=None,
                      help="shuffle the repeats (Tunix data_shuffle_seed)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  workdir = os.path.abspath(args.dir)
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  os.makedirs(workdir)
  config = {
      "num_iterations": args.num_iterations,
      "max_steps": args.max_steps,
      "data_shuffle_seed": args.data_shuffle_seed,
  }
  step = args.preempt_after
  mu = args.num_iterations
  print(f"ckpt_iter demo: GRPO, num_iterations={mu}, one prompt per batch, "
        f"{args.max_steps} optimizer steps; preempted after checkpoint {step}.")
  print(f"  working in {workdir}\n")
  started = time.perf_counter()
  reference = _phase("1/4 uninterrupted reference run", workdir, config, "ckpt_iter", "reference")
  _phase(f"2/4 same run, killed right after checkpoint {step}", workdir, config, "ckpt_iter",
         "preempted", preempt_after=step)
  preempted_root = os.path.join(workdir, "preempted")
  for name in ("resumed_stock", "resumed_ckpt_iter"):
    shutil.copytree(preempted_root, os.path.join(workdir, name))
  stock = _phase("3/4 stock Tunix resumes (fast-forward)", workdir, config, "stock", "resumed_stock")
  ours = _phase("4/4 ckpt_iter resumes (restored data state)", workdir, config, "ckpt_iter",
                "resumed_ckpt_iter")
  print(f"\nall phases done in {time.perf_counter() - started:.0f} s\n")
  before = _load(workdir, "preempted")
  expected = reference[0][len(before[0]):]
  _print_table(step, mu, expected, stock[0], ours[0])
  _print_updates(reference[0], before[0], stock[0], ours[0])
  _print_inspect(preempted_root, step)
  print(f"\nCheckpoints are in {workdir}: try `ckpt-iter inspect {preempted_root}` "
        f"or `ckpt-iter verify {os.path.join(workdir, 'resumed_ckpt_iter')}`.")
  return 0


def _phase(title: str, workdir: str, config: dict[str, Any], learner: str, name: str,
           preempt_after: int | None = None) -> tuple[list[dict], dict]:
  print(f"[{title}] ...", end="", flush=True)
  started = time.perf_counter()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  command = [sys.executable, "-m", "ckpt_iter.demo.toyrun",
             "--root", os.path.join(workdir, name),
             "--out", os.path.join(workdir, f"{name}.npz"),
             "--config", json.dumps(dict(config, learner=learner))]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(command, env=env, capture_output=True, text=True,
                           timeout=_TIMEOUT_SECONDS)
  if process.returncode != 0:
    print(" failed")
    sys.stderr.write(process.stderr[-4000:])
    raise SystemExit(1)
  inputs, meta = _load(workdir, name)
  print(f" {time.perf_counter() - started:.0f} s, trained {_labels(inputs) or 'nothing'}"
        + (" (then killed)" if meta.get("preempted") else ""))
  return inputs, meta


def _load(workdir: str, name: str) -> tuple[list[dict], dict]:
  return toyrun.load_record(os.path.join(workdir, f"{name}.npz"))


def _label(trainer_input: dict) -> str:
  return "".join(toyrun.prompt_labels(trainer_input["prompt_ids"]))


def _labels(inputs: list[dict]) -> str:
  return " ".join(_label(x) for x in inputs)


def _same(a: dict, b: dict) -> bool:
  return set(a) == set(b) and all(
      a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
      for k in a
  )


def _verdict(expected: dict | None, got: dict | None) -> str:
  if expected is None and got is None:
    return ""
  if expected is None:
    return "extra (beyond the reference)"
  if got is None:
    return "missing"
  if _label(got) != _label(expected):
    return f"wrong input: {_label(expected)} expected"
  return "exact (bit for bit)" if _same(got, expected) else "same prompt, other values"


def _print_table(step: int, mu: int, expected: list, stock: list, ours: list) -> None:
  print(f"Trainer inputs after the resume from checkpoint {step} "
        f"(a checkpoint {'between two updates of one rollout' if step % mu else 'at a rollout boundary'}):\n")
  header = f"  {'#':>2}  {'uninterrupted':13}  {'stock Tunix':40}  {'ckpt_iter':30}"
  print(header)
  print("  " + "-" * (len(header) - 2))
  for row in range(max(len(expected), len(stock), len(ours))):
    want = expected[row] if row < len(expected) else None
    got_stock = stock[row] if row < len(stock) else None
    got_ours = ours[row] if row < len(ours) else None
    cell = lambda x: "-" if x is None else _label(x)  # pylint: disable=unnecessary-lambda-assignment
    print(f"  {row + 1:>2}  {cell(want):13}  "
          f"{cell(got_stock) + '  ' + _verdict(want, got_stock):40}  "
          f"{cell(got_ours) + '  ' + _verdict(want, got_ours):30}")
  print()


def _print_updates(reference: list, before: list, stock: list, ours: list) -> None:
  wanted = collections.Counter(_label(x) for x in reference)
  print("Updates per prompt over the whole run (before + after the preemption):")
  for name, after in (("stock Tunix", stock), ("ckpt_iter", ours)):
    got = collections.Counter(_label(x) for x in before + after)
    notes = []
    for prompt in sorted(set(wanted) | set(got)):
      if got[prompt] < wanted[prompt]:
        what = "skipped" if got[prompt] == 0 else f"lost {wanted[prompt] - got[prompt]} update(s)"
        notes.append(f"{prompt} {what}")
      elif got[prompt] > wanted[prompt] and prompt in wanted:
        notes.append(f"{prompt} trained {got[prompt] - wanted[prompt]} extra time(s)")
    beyond = sorted(set(got) - set(wanted))
    if beyond:
      notes.append(f"then went on to {', '.join(beyond)} (the data it skipped made room)")
    print(f"  {name:12} {'; '.join(notes) if notes else 'every prompt exactly as uninterrupted'}")
  print()


def _print_inspect(root: str, step: int) -> None:
  print(f"The data state saved in checkpoint {step} (`ckpt-iter inspect {root} --step {step}`):\n")
  cli.main(["inspect", root, "--step", str(step)])


if __name__ == "__main__":
  sys.exit(main())

