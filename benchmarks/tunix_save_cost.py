"""Q22: what the drop-in's data item adds to a Tunix checkpoint save, against stock Tunix in the same process.

The toy GRPO run of `demo.toyrun` (Tunix's ToyTransformer on CPU). One
process builds a stock `GRPOLearner` and a `ResumableGRPOLearner` (the
drop-in), each with its own checkpoint directory (save_interval_steps=1,
max_to_keep=2). The drop-in trains until its actor's save of step
`HOOK_STEP`, so its data feed holds a real mid-run state (a mini-batch
produced, its rollout queued); there, before that save, the benchmark saves
through the actor trainers' own Tunix `CheckpointManager`s, the call
training makes (`save(step, model, optimizer, save_only_lora_params=...,
custom_metadata=...)`), each save a new step, the models unchanged:

  stock     the stock learner's manager: model_params, optimizer_state,
            custom_metadata;
  drop_in   the drop-in's manager: the same plus the data item (its
            snapshot of the feed, the item's write);
  stock+1   a stock Tunix manager whose Orbax manager also writes a
            one-element JSON item (`{"x": 0}`): Orbax's own cost of one
            more item, whatever the item holds.

The three alternate (A B C, then C B A, ...), `PAIRS` rounds. Per save:
`blocking_ms`, the wall time `save()` blocks the loop; `durable_ms`, the wall
time until the step is on disk (`save()` then `wait_until_finished()`);
`cpu_ms`, the process's CPU (`time.process_time`, every thread) over the
same. A ratio is the median of the per-round ratios drop_in / stock (the
saves of a round ran back to back), with a 95% distribution-free interval of
that median (binomial order statistics). Inside the drop-in's saves the parts
are timed where they run: `add_items` (the feed's snapshot in the learner,
while save() blocks), `_item.snapshot` (the handler's, while it blocks),
`_item.write` (the data item's files) and `os.fsync` (ckpt_iter's; Orbax
and TensorStore sync in C++, not counted here), each with the thread it ran on.

Measured on this tree (`after`) and on commit 6b5079a^ (`before`: the data
item's write in a thread and event loop of its own started inside save(),
exported with `git archive`), each in a process of its own with stock Tunix
beside it: the ratios are what compare across the two.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time

import _common

BEFORE_COMMIT = "6b5079a^"
HOOK_STEP = 4
KINDS = ("stock", "drop_in", "stock+1")


class _Done(Exception):
  """Ends the drop-in's training once the saves are measured."""


class _Parts:
  """Wall time of the drop-in's save parts, per save, and the threads they ran on."""

  def __init__(self):
    self.current: dict[str, float] = {}
    self.threads: dict[str, set[str]] = {}
    self.lock = threading.Lock()

  def wrap(self, owner, name: str, label: str) -> None:
    original = getattr(owner, name)
    parts = self

    def timed(*args, **kwargs):
      started = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        elapsed = (time.perf_counter() - started) * 1e3
        thread = "main" if threading.current_thread() is threading.main_thread() else "background"
        with parts.lock:
          parts.current[label] = parts.current.get(label, 0.0) + elapsed
          parts.current[label + "_count"] = parts.current.get(label + "_count", 0) + 1
          parts.threads.setdefault(label, set()).add(thread)

    setattr(owner, name, timed)

  def take(self) -> dict[str, float]:
    with self.lock:
      taken, self.current = self.current, {}
    return taken


def _manager_with_extra_item(root: str, options):
  """A stock Tunix CheckpointManager whose Orbax manager also writes a one-element JSON item."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from tunix.sft import checkpoint_manager  # pylint: disable=g-import-not-at-top

  tunix_manager = checkpoint_manager.CheckpointManager(root_directory=root, options=options)
  tunix_manager._checkpoint_manager.close()  # pylint: disable=protected-access
  real = ocp.CheckpointManager(root, options=options, item_handlers={
      "model_params": ocp.PyTreeCheckpointHandler(), "optimizer_state": ocp.PyTreeCheckpointHandler(),
      "custom_metadata": ocp.JsonCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()})

  class WithExtra:
    def save(self, step, args=None, **kwargs):
      return real.save(step, args=ocp.args.Composite(**dict(args.items()), extra=ocp.args.JsonSave({"x": 0})),
                       **kwargs)

    def __getattr__(self, name):
      return getattr(real, name)

  tunix_manager._checkpoint_manager = WithExtra()  # pylint: disable=protected-access
  return tunix_manager


def _median_interval(values: list[float]) -> tuple[float, float]:
  """A 95% distribution-free confidence interval of the median (binomial order statistics)."""
  ordered, n = sorted(values), len(values)
  k, cumulative = 0, 0.0
  while True:
    p = math.comb(n, k) / 2**n
    if cumulative + p > 0.025:
      break
    cumulative += p
    k += 1
  k = max(k, 1)
  return ordered[k - 1], ordered[n - k]


def worker(label: str, quick: bool) -> None:
  """Measures in this process (the ckpt_iter on sys.path) and prints one JSON line."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _item as item_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _items as items_lib  # pylint: disable=g-import-not-at-top
  from demo import toyrun  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top

  pairs = 10 if quick else 60
  warmup = 3
  root = tempfile.mkdtemp(prefix="bench_tunix_save_cost_")
  options = toyrun.explicit_checkpointing(1, max_to_keep=2)
  training = {"max_steps": 2 * HOOK_STEP, "checkpointing_options": options}
  algo = grpo_learner.GRPOConfig(num_generations=2, num_iterations=2, beta=0.04)

  def learner(kind: str):
    cluster = toyrun.toy_cluster(os.path.join(root, kind), with_drop_ins=kind == "drop_in",
                                 training_options=training)
    cls = grpo_learner.GRPOLearner if kind == "stock" else ckpt_iter.tunix.ResumableGRPOLearner
    return cls(rl_cluster=cluster, reward_fns=toyrun.reward_fn, algo_config=algo)

  stock = learner("stock")
  drop_in = learner("drop_in")
  stock_trainer = stock.rl_cluster.actor_trainer
  extra_manager = _manager_with_extra_item(os.path.join(root, "stock+1"), options)
  parts = _Parts()
  parts.wrap(items_lib.RlStepItems, "add_items", "add_items")
  parts.wrap(item_lib, "snapshot", "item_snapshot")
  parts.wrap(item_lib, "write", "item_write")
  parts.wrap(os, "fsync", "fsync")
  samples: dict[str, list[dict]] = {kind: [] for kind in KINDS}

  def measure(drop_in_save, drop_in_trainer):
    savers = {
        "stock": (stock_trainer.checkpoint_manager.save, stock_trainer.checkpoint_manager, stock_trainer),
        "drop_in": (drop_in_save, drop_in_trainer.checkpoint_manager, drop_in_trainer),
        "stock+1": (extra_manager.save, extra_manager, stock_trainer),
    }
    step, last = 1000, {}
    for round_index in range(warmup + pairs):
      for kind in (KINDS if round_index % 2 == 0 else KINDS[::-1]):
        save, manager, trainer = savers[kind]
        step += 1
        gc.collect()  # outside the timing: a collection the last save left due falls on neither
        parts.take()
        cpu, started = time.process_time(), time.perf_counter()
        saved = save(step, trainer.model, trainer.optimizer, save_only_lora_params=False,
                     custom_metadata=trainer.custom_checkpoint_metadata())
        blocked = time.perf_counter()
        manager._checkpoint_manager.wait_until_finished()  # pylint: disable=protected-access  (Orbax's)
        done, cpu_done = time.perf_counter(), time.process_time()
        assert saved, (kind, step)
        if round_index >= warmup:
          samples[kind].append({"blocking_ms": (blocked - started) * 1e3, "durable_ms": (done - started) * 1e3,
                                "cpu_ms": (cpu_done - cpu) * 1e3, **parts.take()})
        last[kind] = step
    directory = drop_in_trainer.checkpoint_manager._checkpoint_manager.directory  # pylint: disable=protected-access
    return sorted(os.listdir(os.path.join(str(directory), str(last["drop_in"]))))

  drop_in_manager = drop_in.rl_cluster.actor_trainer.checkpoint_manager
  original_save = drop_in_manager.save
  found: dict[str, list[str]] = {}

  def hooked_save(step, *args, **kwargs):
    if step == HOOK_STEP:
      found["step_items"] = measure(original_save, drop_in.rl_cluster.actor_trainer)
      raise _Done
    return original_save(step, *args, **kwargs)

  drop_in_manager.save = hooked_save
  try:
    drop_in.train(toyrun.make_train_dataset(toyrun.RunConfig(max_steps=2 * HOOK_STEP)), None)
  except _Done:
    pass
  for manager in (stock_trainer.checkpoint_manager, extra_manager):
    manager.close()
  shutil.rmtree(root, ignore_errors=True)
  print(json.dumps({"code": label, "ckpt_iter": os.path.dirname(ckpt_iter.__file__), "pairs": pairs,
                    "step_items": found.get("step_items"), "threads": {k: sorted(v) for k, v in parts.threads.items()},
                    "samples": samples}), flush=True)



def run_worker(label: str, code_dir: str, quick: bool, cache_dir: str) -> dict:
  env = _common.child_env(PYTHONPATH=os.pathsep.join([code_dir, _common.REPO_DIR]),
                          JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  command = [_common.python(), os.path.abspath(__file__), "--worker", label] + (["--quick"] if quick else [])
  process = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=1200)
  if process.returncode != 0:
    raise RuntimeError(f"{label} worker failed:\n{process.stderr[-3000:]}")
  result = json.loads([line for line in process.stdout.splitlines() if line.startswith("{")][-1])
  assert result.pop("ckpt_iter").startswith(code_dir), (label, code_dir)
  return result


def summarize(result: dict) -> dict:
  """Medians per kind, the per-round ratios' medians and intervals, the drop-in's parts."""
  samples = result["samples"]
  out: dict = {"code": result["code"], "pairs": result["pairs"]}
  for kind in KINDS:
    for metric in ("blocking_ms", "durable_ms", "cpu_ms"):
      out[f"{kind}_{metric}"] = _common.rounded(_common.median([s[metric] for s in samples[kind]]), 4)
  for other in ("drop_in", "stock+1"):
    for metric in ("blocking_ms", "durable_ms", "cpu_ms"):
      ratios = [a[metric] / b[metric] for a, b in zip(samples[other], samples["stock"])]
      deltas = [a[metric] - b[metric] for a, b in zip(samples[other], samples["stock"])]
      low, high = _median_interval(ratios)
      dlow, dhigh = _median_interval(deltas)
      name = "drop_in" if other == "drop_in" else "extra_item"
      out[f"{name}_{metric}_ratio"] = _common.rounded(_common.median(ratios), 4)
      out[f"{name}_{metric}_ratio_ci"] = [_common.rounded(low, 4), _common.rounded(high, 4)]
      out[f"{name}_{metric}_delta"] = _common.rounded(_common.median(deltas), 3)
      out[f"{name}_{metric}_delta_ci"] = [_common.rounded(dlow, 3), _common.rounded(dhigh, 3)]
  drop = samples["drop_in"]
  for label in ("add_items", "item_snapshot", "item_write", "fsync"):
    out[f"part_{label}_ms"] = _common.rounded(_common.median([s.get(label, 0.0) for s in drop]), 3)
    out[f"part_{label}_per_save"] = _common.rounded(_common.median([s.get(label + "_count", 0) for s in drop]), 3)
  out["fsync_per_stock_save"] = _common.rounded(_common.median([s.get("fsync_count", 0) for s in samples["stock"]]), 3)
  out["part_threads"] = result["threads"]
  out["step_items"] = result["step_items"]
  return out


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0], lambda p: (
      p.add_argument("--worker", help="internal: measure in this process, labelling the lines so"),
      p.add_argument("--before", default=BEFORE_COMMIT, help="the commit measured as `before`")))
  if args.worker:
    worker(args.worker, args.quick)
    return
  report = _common.Reporter("tunix_save_cost", args.quick)
  cache_dir = os.environ.get("BENCH_JAX_CACHE_DIR") or tempfile.mkdtemp(prefix="bench_jax_cache_")
  before_dir = _common.exported(args.before, "tunix_save_cost_before_")
  if before_dir is None:
    report.note(f"commit {args.before} could not be exported (no git, or a shallow clone): no `before` figures")
  rows = {}
  try:
    rows["after"] = summarize(run_worker("after", _common.REPO_DIR, args.quick, cache_dir))
    if before_dir is not None:
      try:
        rows["before"] = summarize(run_worker("before", before_dir, args.quick, cache_dir))
      except RuntimeError as e:
        report.note(f"commit {args.before} could not run the worker: {str(e)[-500:]}")
  finally:
    if before_dir is not None:
      shutil.rmtree(before_dir, ignore_errors=True)
  for code, row in rows.items():
    report.measurement(**row, commit=args.before if code == "before" else "this tree")
  after, before = rows["after"], rows.get("before", {})
  checks = []
  for metric, name in (("blocking_ms", "the wall time save() blocks"),
                       ("durable_ms", "the wall time until the step is durable (save + wait_until_finished)"),
                       ("cpu_ms", "process CPU over save + wait")):
    ratio = after[f"drop_in_{metric}_ratio"]
    checks.append(_common.check(
        f"{name}: drop-in / stock Tunix per save, median of {after['pairs']} paired ratios",
        ratio, "<= 1.01", ratio <= 1.01, interval=after[f"drop_in_{metric}_ratio_ci"],
        delta_ms=after[f"drop_in_{metric}_delta"], before=before.get(f"drop_in_{metric}_ratio"),
        before_delta_ms=before.get(f"drop_in_{metric}_delta")))
  report.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
