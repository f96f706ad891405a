"""`make demo` (`python -m demo`): a Tunix RL run preempted between two num_iterations updates.

Four real processes on CPU (toy model, the prompt set in demo/prompts.jsonl,
real Tunix learners, Orbax checkpoints on disk):
  1. the uninterrupted reference run;
  2. the same run, killed right after checkpoint K;
  3. stock Tunix resuming from a copy of that checkpoint (fast-forward);
  4. ckpt_iter resuming from another copy.
Then a side-by-side table of what each trained after the resume (one row per
trainer input; the letters are the prompts it trains on), with a verdict per
row, the updates each prompt got over the whole run, and whether the final
weights equal the uninterrupted run's. `--show-state` also prints the
checkpoint's data state as `ckpt-iter inspect` shows it.

`--learner grpo` (the default) runs `tunix.rl.grpo`'s GRPOLearner against
ResumableGRPOLearner (demo.toyrun); `--learner agentic` runs
`tunix.rl.agentic`'s GRPOLearner against ResumableAgenticGRPOLearner
(demo.agentic_toyrun).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Callable

from ckpt_iter import cli
from demo import agentic_toyrun
from demo import toyrun

_TIMEOUT_SECONDS = 600
# Per learner: --preempt-after, --num-iterations, --max-steps when not given.
_DEFAULTS = {
    "grpo": {"preempt_after": 3, "num_iterations": 2, "max_steps": 8},
    "agentic": {"preempt_after": 1, "num_iterations": 2, "max_steps": 2},
}
# The agentic scenario: full batches of 2 prompts (2 generations each), one
# prompt's group per optimizer update, so a global step holds several
# checkpoints (Tunix checkpoints every update here).
_AGENTIC_BATCH = 2
_AGENTIC_MINI_BATCH = 1
_AGENTIC_MICRO_BATCH = 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m demo",
      description="Preempt a toy GRPO run between two num_iterations updates and "
      "resume it with stock Tunix and with ckpt_iter, side by side.",
  )
  parser.add_argument("--learner", choices=sorted(_DEFAULTS), default="grpo",
                      help="grpo: tunix.rl.grpo's GRPOLearner, one prompt per batch (default); "
                      "agentic: tunix.rl.agentic's GRPOLearner, batches of 2 prompts")
  parser.add_argument("--dir", default="ckpt_iter_demo",
                      help="where checkpoints and records go (default: ./ckpt_iter_demo)")
  parser.add_argument("--preempt-after", type=int, default=None,
                      help="kill the run right after this checkpoint step (default: 3; agentic: 1)")
  parser.add_argument("--num-iterations", type=int, default=None,
                      help="GRPO num_iterations, updates per rollout (default: 2)")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="optimizer steps (default: 8); agentic: global steps, batches (default: 2)")
  parser.add_argument("--data-shuffle-seed", type=int, default=None,
                      help="shuffle the repeats (Tunix data_shuffle_seed; grpo only)")
  parser.add_argument("--show-state", action="store_true",
                      help="also print the data state saved in the checkpoint (`ckpt-iter inspect`)")
  args = parser.parse_args(argv)
  if args.learner == "agentic" and args.data_shuffle_seed is not None:
    parser.error("--data-shuffle-seed: the agentic learner has no data_shuffle_seed")
  for name, value in _DEFAULTS[args.learner].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  return args


@dataclasses.dataclass
class _Record:
  """What one process trained: its trainer inputs in order, and its final params if recorded."""

  inputs: list[dict]
  preempted: bool
  weights: str | None = None  # a digest of the final actor weights (a finished run)


@dataclasses.dataclass
class _Workload:
  """How to run and read one learner's toy run."""

  module: str  # run as `python -m module`
  arguments: Callable[[bool], list[str]]  # stock? -> the run's options
  preempt_exit_code: int
  read: Callable[[str, int], _Record]  # (record path, exit code) -> _Record
  label: Callable[[dict], str]  # a trainer input -> its prompts, "A", "B", ...


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  workdir = os.path.abspath(args.dir)
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  os.makedirs(workdir)
  step = args.preempt_after
  mu = args.num_iterations
  if args.learner == "agentic":
    workload = _agentic_workload(args)
    print(f"ckpt_iter demo: agentic GRPO (tunix.rl.agentic), num_iterations={mu}, "
          f"{_AGENTIC_BATCH} prompts per batch, one prompt's group per update, "
          f"{args.max_steps} global steps; preempted after checkpoint {step}.")
    print(f"  this Tunix {_agentic_order()}")
  else:
    workload = _grpo_workload(args)
    print(f"ckpt_iter demo: GRPO, num_iterations={mu}, one prompt per batch, "
          f"{args.max_steps} optimizer steps; preempted after checkpoint {step}.")
  print(f"  working in {workdir}\n")
  started = time.perf_counter()
  reference = _phase("1/4 uninterrupted reference run", workdir, workload, False, "reference")
  before = _phase(f"2/4 same run, killed right after checkpoint {step}", workdir, workload, False,
                  "preempted", preempt_after=step)
  preempted_root = os.path.join(workdir, "preempted")
  for name in ("resumed_stock", "resumed_ckpt_iter"):
    shutil.copytree(preempted_root, os.path.join(workdir, name))
  stock = _phase("3/4 stock Tunix resumes (fast-forward)", workdir, workload, True, "resumed_stock")
  ours = _phase("4/4 ckpt_iter resumes (restored data state)", workdir, workload, False, "resumed_ckpt_iter")
  print(f"\nall phases done in {time.perf_counter() - started:.0f} s\n")
  expected = reference.inputs[len(before.inputs):]
  if args.learner == "agentic":
    where = (f"after {len(before.inputs)} of the uninterrupted run's "
             f"{len(reference.inputs)} trainer inputs, one per update")
  else:
    where = f"a checkpoint {'between two updates of one rollout' if step % mu else 'at a rollout boundary'}"
  print(f"Trainer inputs after the resume from checkpoint {step} ({where}); each row is one "
        "update's input, the letters the prompts it trains on:\n")
  _print_table(expected, stock.inputs, ours.inputs, workload.label)
  _print_updates(reference.inputs, before.inputs, stock.inputs, ours.inputs, workload.label)
  _print_weights(reference.weights, stock.weights, ours.weights)
  if args.show_state:
    _print_inspect(preempted_root, step)
  command = ckpt_iter_command()
  print(f"Checkpoints are in {workdir}: `{command} inspect {preempted_root} --step {step}` shows the "
        f"data state ckpt_iter resumed from; `{command} audit {os.path.join(workdir, 'resumed_ckpt_iter')}` "
        "proves its resume.")
  return 0


def ckpt_iter_command() -> str:
  """How to run `ckpt-iter` from here, as a command that works when pasted into this shell.

  `make demo` runs `.venv/bin/python`, whose `ckpt-iter` script is in
  `.venv/bin`, rarely on PATH: the script's path then (relative to the
  working directory when under it), `ckpt-iter` only when PATH finds that
  very script, and `python -m ckpt_iter` where the environment has none.
  """
  script = os.path.join(os.path.dirname(sys.executable), "ckpt-iter")
  if not os.access(script, os.X_OK):
    return f"{_shown_path(sys.executable)} -m ckpt_iter"
  found = shutil.which("ckpt-iter")
  if found and os.path.realpath(found) == os.path.realpath(script):
    return "ckpt-iter"
  return _shown_path(script)


def _shown_path(path: str) -> str:
  """`path` relative to the working directory when it is under it (`.venv/bin/x`), else absolute."""
  relative = os.path.relpath(path)
  return relative if not relative.startswith("..") and os.sep in relative else os.path.abspath(path)


def _grpo_workload(args: argparse.Namespace) -> _Workload:
  config = {
      "num_iterations": args.num_iterations,
      "max_steps": args.max_steps,
      "data_shuffle_seed": args.data_shuffle_seed,
  }

  def arguments(stock: bool) -> list[str]:
    return ["--config", json.dumps(dict(config, learner="stock" if stock else "ckpt_iter"))]

  def read(path: str, returncode: int) -> _Record:
    del returncode  # the record says whether the run was killed
    inputs, meta = toyrun.load_record(path)
    return _Record(inputs, bool(meta.get("preempted")), meta.get("actor_digest"))

  return _Workload("demo.toyrun", arguments, 0, read,
                   lambda x: "".join(toyrun.prompt_labels(x["prompt_ids"])))


def _agentic_workload(args: argparse.Namespace) -> _Workload:
  options = ["--batch", str(_AGENTIC_BATCH), "--mini", str(_AGENTIC_MINI_BATCH),
             "--micro", str(_AGENTIC_MICRO_BATCH), "--mu", str(args.num_iterations),
             "--max-steps", str(args.max_steps)]

  def arguments(stock: bool) -> list[str]:
    return ["--learner", "stock" if stock else "resumable", *options]

  def read(path: str, returncode: int) -> _Record:
    record = agentic_toyrun.load_record(path)
    preempted = returncode == agentic_toyrun.PREEMPT_EXIT_CODE
    return _Record(record["inputs"], preempted, None if preempted else _weights_digest(record["params"]))

  return _Workload("demo.agentic_toyrun", arguments, agentic_toyrun.PREEMPT_EXIT_CODE, read,
                   lambda x: "".join(agentic_toyrun.input_labels(x["prompt_ids"])))


def _agentic_order() -> str:
  from ckpt_iter.tunix import _api  # pylint: disable=g-import-not-at-top

  order = _api.agentic_iteration_order()
  if order == _api.AGENTIC_REPEAT_EACH:
    return "trains each group num_iterations times in a row (0.1.7's order)."
  if order == _api.AGENTIC_REPLAY_FULL_BATCH:
    return "trains each batch once, then replays it num_iterations - 1 times (main's order)."
  return "has an agentic num_iterations order ckpt_iter does not recognise."


def _phase(title: str, workdir: str, workload: _Workload, stock: bool, name: str,
           preempt_after: int | None = None) -> _Record:
  print(f"[{title}] ...", end="", flush=True)
  started = time.perf_counter()
  # The demo is not installed: its runs import it from the repository.
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
             JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  out = os.path.join(workdir, f"{name}.npz")
  command = [sys.executable, "-m", workload.module, "--root", os.path.join(workdir, name), "--out", out,
             *workload.arguments(stock)]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(command, env=env, capture_output=True, text=True,
                           timeout=_TIMEOUT_SECONDS)
  expected_code = 0 if preempt_after is None else workload.preempt_exit_code
  if process.returncode != expected_code or not os.path.exists(out):
    print(" failed")
    sys.stderr.write(process.stderr[-4000:])
    raise SystemExit(1)
  record = workload.read(out, process.returncode)
  if preempt_after is not None and not record.preempted:
    print(f" failed: the run ended before checkpoint {preempt_after}")
    raise SystemExit(1)
  labels = " ".join(workload.label(x) for x in record.inputs)
  print(f" {time.perf_counter() - started:.0f} s, trained {labels or 'nothing'}"
        + (" (then killed)" if record.preempted else ""))
  return record


def _same(a: dict, b: dict) -> bool:
  return set(a) == set(b) and all(
      a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
      for k in a
  )


def _weights_digest(params: list) -> str:
  digest = hashlib.sha256()
  for leaf in params:
    digest.update(f"{leaf.dtype}:{leaf.shape}".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


# What each verdict word of the table means (printed under it).
_LEGEND = (
    "exact (bit for bit): the uninterrupted run's input, every array identical; "
    "same prompt, other values: the right prompt, other completions or log-probs; "
    "wrong input: another prompt than the uninterrupted run trained there; "
    "missing: the run ended before this input; "
    "extra: the uninterrupted run trained nothing more here"
)


def _verdict(expected: dict | None, got: dict | None, label: Callable[[dict], str]) -> str:
  if expected is None and got is None:
    return ""
  if expected is None:
    return "extra"
  if got is None:
    return "missing"
  if label(got) != label(expected):
    return f"wrong input: {label(expected)} expected"
  return "exact (bit for bit)" if _same(got, expected) else "same prompt, other values"


def _print_table(expected: list, stock: list, ours: list, label: Callable[[dict], str]) -> None:
  header = f"  {'#':>2}  {'uninterrupted':13}  {'stock Tunix':40}  {'ckpt_iter':30}"
  print(header)
  print("  " + "-" * (len(header) - 2))
  for row in range(max(len(expected), len(stock), len(ours))):
    want = expected[row] if row < len(expected) else None
    got_stock = stock[row] if row < len(stock) else None
    got_ours = ours[row] if row < len(ours) else None
    cell = lambda x: "-" if x is None else label(x)  # pylint: disable=unnecessary-lambda-assignment
    print(f"  {row + 1:>2}  {cell(want):13}  "
          f"{cell(got_stock) + '  ' + _verdict(want, got_stock, label):40}  "
          f"{cell(got_ours) + '  ' + _verdict(want, got_ours, label):30}")
  print()
  print("\n".join(textwrap.wrap(_LEGEND, width=100, initial_indent="  ", subsequent_indent="  ")))
  print()


def _print_updates(reference: list, before: list, stock: list, ours: list, label: Callable[[dict], str]) -> None:
  wanted = collections.Counter(label(x) for x in reference)
  print("Updates per prompt over the whole run (before + after the preemption):")
  for name, after in (("stock Tunix", stock), ("ckpt_iter", ours)):
    got = collections.Counter(label(x) for x in before + after)
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


def _print_weights(reference: str | None, stock: str | None, ours: str | None) -> None:
  print("Final actor weights, compared with the uninterrupted run's:")
  for name, weights in (("stock Tunix", stock), ("ckpt_iter", ours)):
    same = reference is not None and weights == reference
    print(f"  {name:12} {'bit for bit the same' if same else 'different'}")
  print()


def _print_inspect(root: str, step: int) -> None:
  print(f"The data state saved in checkpoint {step} (`{ckpt_iter_command()} inspect {root} --step {step}`):\n")
  cli.main(["inspect", root, "--step", str(step)])


if __name__ == "__main__":
  sys.exit(main())
