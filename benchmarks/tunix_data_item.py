"""The Tunix data item's own cost: how long a save blocks on it, and its restore.

Runs against whichever Tunix the interpreter has (0.1.7 in .venv, upstream main
in .venv-tunix-main), so the two versions are measured by running it twice:

  .venv/bin/python benchmarks/tunix_data_item.py
  .venv-tunix-main/bin/python benchmarks/tunix_data_item.py

Scenario: the toy GRPO run of `demo.toyrun` with num_iterations=2,
2 prompts per global step and mini-batches of 1 prompt, a checkpoint at every
optimizer update (so half the checkpoints hold pending repeats).

- Save: one process trains max_steps updates. Per save, the data item's
  synchronous work (`DataSession.snapshot`, which picks the consumed position and
  pending examples, plus `_item.snapshot`, which encodes them and copies the
  arrays once) is timed against the whole blocking `checkpoint_manager.save`
  call (model, optimizer and data; the writes themselves finish in Orbax's
  background thread).
- Restore: fresh processes restart from a copy of the run's checkpoint at a
  step inside a global step (pending repeats present). `DataSession.restore`
  (read, validate and apply the data state) is timed against Tunix's own model
  and optimizer restore (`CheckpointManager.maybe_restore`) in the same process.

Prints one JSON line with the figures and a markdown row per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _common

MAX_STEPS = 12
RESTORE_STEP = 11  # inside a global step of 4 updates: one pending repeat
WARMUP_SAVES = 2  # the first saves pay Orbax's first-use costs


def _timed(log: list[float], fn):
  def wrapper(*args, **kwargs):
    started = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      log.append((time.perf_counter() - started) * 1e3)
  return wrapper


def _config(max_steps: int):
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  return toyrun.RunConfig(num_iterations=2, batch_size=2, mini_batch_size=1, max_steps=max_steps)


def save_worker(root: str) -> dict:
  from ckpt_iter import _item as item_lib
  from demo import toyrun  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _session  # pylint: disable=g-import-not-at-top

  picks, encodes, saves = [], [], []
  _session.DataSession.snapshot = _timed(picks, _session.DataSession.snapshot)
  item_lib.snapshot = _timed(encodes, item_lib.snapshot)
  config = _config(MAX_STEPS)
  learner = toyrun.build_learner(config, root)
  manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  manager.save = _timed(saves, manager.save)
  learner.train(toyrun.make_train_dataset(config), None)
  manager.close()
  if not len(picks) == len(encodes):
    raise RuntimeError(f"{len(picks)} data snapshots but {len(encodes)} encodings: cannot pair them per save")
  data = [a + b for a, b in zip(picks, encodes)]
  return {"data_ms": data[WARMUP_SAVES:], "save_ms": saves[WARMUP_SAVES:len(data)], "saves": len(data)}


def restore_worker(root: str) -> dict:
  from tunix.sft import checkpoint_manager as tunix_checkpoint  # pylint: disable=g-import-not-at-top
  from demo import toyrun  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _api as api  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _items as items  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _session  # pylint: disable=g-import-not-at-top

  data, model, pending = [], [], []
  restore = _session.DataSession.restore

  def timed_restore(self, *args, **kwargs):
    started = time.perf_counter()
    restore(self, *args, **kwargs)
    data.append((time.perf_counter() - started) * 1e3)
    pending.append(len(self._restored_pending or ()))  # pylint: disable=protected-access

  _session.DataSession.restore = timed_restore
  cls = tunix_checkpoint.CheckpointManager
  cls.maybe_restore = _timed(model, cls.maybe_restore)
  config = _config(RESTORE_STEP + 1)
  learner = toyrun.build_learner(config, root)
  restored = int(learner.rl_cluster.actor_trainer.train_steps)
  if restored != RESTORE_STEP:
    raise RuntimeError(f"restored step {restored}, expected {RESTORE_STEP}")
  learner.train(toyrun.make_train_dataset(config), None)
  manager = learner.rl_cluster.actor_trainer.checkpoint_manager
  data_dir = api.item_directory(manager, RESTORE_STEP, items.DATA_ITEM)
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(data_dir) for f in fs)
  return {"data_restore_ms": data[0], "model_restore_ms": model[0], "pending_inputs": pending[0],
          "data_item_bytes": size}


def run_worker(mode: str, root: str, cache_dir: str) -> dict:
  command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--root", root]
  env = _common.child_env(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
  if process.returncode != 0:
    raise RuntimeError(f"{mode} worker failed:\n{process.stderr[-3000:]}")
  return json.loads(process.stdout.strip().splitlines()[-1])


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", choices=("save", "restore"))
  parser.add_argument("--root")
  parser.add_argument("--restores", type=int, default=5, help="fresh restore processes")
  args = parser.parse_args()
  if args.worker:
    result = save_worker(args.root) if args.worker == "save" else restore_worker(args.root)
    print(json.dumps(result))
    return 0

  import tunix  # pylint: disable=g-import-not-at-top

  version = getattr(tunix, "__version__", "unknown")
  workdir = tempfile.mkdtemp(prefix="tunix_data_item_")
  cache_dir = os.path.join(workdir, "jax_cache")
  try:
    root = os.path.join(workdir, "run")
    saved = run_worker("save", root, cache_dir)
    restores = []
    for index in range(args.restores):
      copy = os.path.join(workdir, f"restore{index}")
      shutil.copytree(root, copy)
      for name in os.listdir(os.path.join(copy, "actor")):
        if name.isdigit() and int(name) > RESTORE_STEP:
          shutil.rmtree(os.path.join(copy, "actor", name))
      restores.append(run_worker("restore", copy, cache_dir))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  data_ms, save_ms = _common.median(saved["data_ms"]), _common.median(saved["save_ms"])
  data_restore = _common.median([r["data_restore_ms"] for r in restores])
  model_restore = _common.median([r["model_restore_ms"] for r in restores])
  summary = {
      "tunix": version, "load_average": _common.load_average(),
      "saves_timed": len(saved["data_ms"]), "data_item_save_ms": data_ms, "whole_save_ms": save_ms,
      "data_share_of_save": data_ms / save_ms,
      "restores": len(restores), "data_restore_ms": data_restore, "model_restore_ms": model_restore,
      "data_over_model_restore": data_restore / model_restore,
      "pending_inputs": restores[0]["pending_inputs"], "data_item_bytes": restores[0]["data_item_bytes"],
  }
  print(json.dumps({k: (_common.rounded(v) if isinstance(v, float) else v) for k, v in summary.items()}))
  print(f"| {version} | {data_ms:.3g} ms | {save_ms:.3g} ms | {data_ms / save_ms:.1%} "
        f"| {data_restore:.3g} ms | {model_restore:.3g} ms | {data_restore / model_restore:.2f} "
        f"| {summary['pending_inputs']} | {summary['data_item_bytes']:,} B |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
