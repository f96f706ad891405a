"""Q20: one process's restore CPU against Grain's own handler, fresh and after 64 restarts; the state's bytes.

The same pipeline both ways: `make_dataset` (what ckpt_iter restores) and
its plain Grain equivalent `MapDataset.source(records).shuffle(seed).repeat()
.batch(8)` read with `ReadOptions(num_threads=0)` (what Grain's
`CheckpointHandler` restores). Each restore reads the step's file and moves a
fresh iterator there, through the handler's `restore` (no Orbax manager
around either, so the ratio is the handlers' own). CPU time
(`time.process_time`) per restore, the median of interleaved rounds of
`ROUNDS` restores each: the machines are shared, so only same-run ratios count.

Also the restore a training job runs (`manager`): `CheckpointManager.restore` of a toy model (a
pytree of 4 layers of 16x16 float32, about 4 KiB) with ckpt_iter's data item, against the same
model with Grain's item, wall time of each whole restore, the default content check on. MANAGER_RUNS
runs of MANAGER_PAIRS interleaved pairs; each run's ratio of medians must stay within 1.1, every
run, not on average (a toy model is mostly Orbax's fixed costs, so the data item's share is largest).

States (ckpt_iter's), the pipeline restored into unchanged:

  fresh       a run never resumed, 5 batches read;
  restarts64  the same run after 64 restores from its last step (a resume
              record each, the lineage at its cap), 5 batches read;
  mixture8    restarts64 over a mixture of 8 sources with 10 skip ranges.

Restores without the content check (Grain checks none) and, separately, with
it (the default: one batch produced again). `state_bytes` is what each process
writes (its JSON header, `process_<i>-of-<n>.json`; no pending arrays here) and
`pod_bytes` what is written once per pod (the count file `ckpt_iter.json`,
from format 5 holding the fingerprint and lineage every process shares; 0.2.0
wrote `{"process_count": n}` there and each header whole). Measured on this tree
(`after`) and on commit e9f37c0's package (`before`, 0.2.0, exported with `git
archive`), each in a process of its own with Grain's handler beside it: the
ratios are what compare across the two.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import _common
import grain
from etils import epath
from grain import checkpoint as grain_checkpoint
import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib

RECORDS = [{"id": i, "text": f"record {i}"} for i in range(1000)]
SOURCES = {f"s{k}": [{"id": 1000 * k + i, "text": f"record {i}"} for i in range(200)] for k in range(8)}
RESTARTS = 64
ROUNDS = 100


def pipeline(kind: str):
  if kind == "mixture8":
    return ckpt_iter.make_dataset(SOURCES, weights={name: 1 + k % 3 for k, name in enumerate(SOURCES)},
                                  batch_size=8, seed=0, num_epochs=None,
                                  skip=[(500 + 40 * k, 500 + 40 * k + 3) for k in range(10)])
  return ckpt_iter.make_dataset(RECORDS, batch_size=8, seed=0, num_epochs=None)


def write_state(kind: str, root: str) -> str:
  """The step a run of `kind` saved last: 5 batches read, after its restarts."""
  handler = checkpoint_lib.IteratorCheckpointHandler(0, 1)
  restarts = 0 if kind == "fresh" else RESTARTS
  step = 0
  iterator = ckpt_iter.DataIterator(pipeline(kind))
  for _ in range(restarts + 1):
    if step:
      iterator = ckpt_iter.DataIterator(pipeline(kind))
      handler.restore(os.path.join(root, str(step), "data"), ckpt_iter.IteratorRestore(iterator))
    next(iterator)
    step += 1
    item = os.path.join(root, str(step), "data")
    os.makedirs(item)
    handler.save(item, ckpt_iter.IteratorSave(iterator))
  for _ in range(4):
    next(iterator)
  step += 1
  item = os.path.join(root, str(step), "data")
  os.makedirs(item)
  handler.save(item, ckpt_iter.IteratorSave(iterator))
  return item


def grain_item(root: str) -> epath.Path:
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  iterator = iter(grain.MapDataset.source(RECORDS).shuffle(seed=0).repeat().batch(8).to_iter_dataset(options))
  for _ in range(5):
    next(iterator)
  path = epath.Path(root) / "grain"
  path.mkdir()
  grain_checkpoint.CheckpointHandler().save(path, args=grain_checkpoint.CheckpointSave(iterator))
  return path


def ours_cpu_us(kind: str, item: str, check_content: bool, *, first_read: bool = False) -> float:
  """CPU per restore; `first_read`: each as a process's first read of the step's pod part (its lineage
  checked), as a fresh process restores; otherwise the pod part's check is reused from the last read."""
  handler = checkpoint_lib.IteratorCheckpointHandler(0, 1)
  target = ckpt_iter.DataIterator(pipeline(kind), check_content=check_content)
  checked_pods = getattr(_files, "_CHECKED_PODS", {}) if first_read else {}
  started = time.process_time()
  for _ in range(ROUNDS):
    checked_pods.clear()  # (a dict's clear: ~0.05 us)
    handler.restore(item, ckpt_iter.IteratorRestore(target))
  return (time.process_time() - started) / ROUNDS * 1e6


def grain_cpu_us(path: epath.Path) -> float:
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  target = iter(grain.MapDataset.source(RECORDS).shuffle(seed=0).repeat().batch(8).to_iter_dataset(options))
  handler = grain_checkpoint.CheckpointHandler()
  started = time.process_time()
  for _ in range(ROUNDS):
    handler.restore(path, args=grain_checkpoint.CheckpointRestore(target))
  return (time.process_time() - started) / ROUNDS * 1e6


MANAGER_RUNS, MANAGER_PAIRS = 5, 40
TOY_MODEL = {f"layer{i}": {"w": np.full((16, 16), i, np.float32), "b": np.zeros(16, np.float32)} for i in range(4)}


def manager_ratios(root: str, quick: bool) -> dict:
  """Per run, the median whole restore (model + data item) of ckpt_iter's item over Grain's, ms, and the ratio."""
  ours = ocp.CheckpointManager(os.path.join(root, "manager_ours"), item_names=("model", "data"))
  theirs = ocp.CheckpointManager(os.path.join(root, "manager_grain"), item_names=("model", "data"))
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

  def grain_iterator():
    return iter(grain.MapDataset.source(RECORDS).shuffle(seed=0).repeat().batch(8).to_iter_dataset(options))

  writer, grain_writer = ckpt_iter.DataIterator(pipeline("fresh")), grain_iterator()
  for _ in range(5):
    next(writer), next(grain_writer)
  model = ocp.args.StandardSave(TOY_MODEL)
  ours.save(1, args=ocp.args.Composite(model=model, data=ckpt_iter.IteratorSave(writer)))
  theirs.save(1, args=ocp.args.Composite(model=model, data=grain_checkpoint.CheckpointSave(grain_writer)))
  ours.wait_until_finished(), theirs.wait_until_finished()

  def ours_ms() -> float:
    target = ckpt_iter.DataIterator(pipeline("fresh"))
    started = time.perf_counter()
    ours.restore(1, args=ocp.args.Composite(model=ocp.args.StandardRestore(TOY_MODEL),
                                             data=ckpt_iter.IteratorRestore(target)))
    return (time.perf_counter() - started) * 1e3

  def grain_ms() -> float:
    target = grain_iterator()
    started = time.perf_counter()
    theirs.restore(1, args=ocp.args.Composite(model=ocp.args.StandardRestore(TOY_MODEL),
                                               data=grain_checkpoint.CheckpointRestore(target)))
    return (time.perf_counter() - started) * 1e3

  for _ in range(5):  # Orbax's first-use costs, both sides
    ours_ms(), grain_ms()
  runs = []
  for _ in range(2 if quick else MANAGER_RUNS):
    pairs = [(ours_ms(), grain_ms()) for _ in range(10 if quick else MANAGER_PAIRS)]
    mine, grains = _common.median([a for a, _ in pairs]), _common.median([b for _, b in pairs])
    runs.append({"ours_ms": _common.rounded(mine, 3), "grain_ms": _common.rounded(grains, 3),
                 "ratio": _common.rounded(mine / grains, 3)})
  ours.close(), theirs.close()
  return {"code": "after", "case": "manager", "ckpt_iter": os.path.dirname(ckpt_iter.__file__), "runs": runs}


KINDS = ["fresh", "restarts64", "mixture8"]
BEFORE_COMMIT = "e9f37c0"


def worker(label: str, quick: bool) -> None:
  """Measures in this process (the ckpt_iter on sys.path) and prints one JSON line per case."""
  rounds = 3 if quick else 15
  root = tempfile.mkdtemp(prefix="bench_restore_cost_")
  try:
    items = {kind: write_state(kind, os.path.join(root, kind)) for kind in KINDS}
    theirs = grain_item(root)
    times: dict[str, list[float]] = {"grain": []}
    for kind in KINDS:
      times[kind], times[kind + "+content"], times[kind + "+first"] = [], [], []
    for _ in range(rounds):  # interleaved: a load spike hits every case alike
      times["grain"].append(grain_cpu_us(theirs))
      for kind in KINDS:
        times[kind].append(ours_cpu_us(kind, items[kind], check_content=False))
        times[kind + "+content"].append(ours_cpu_us(kind, items[kind], check_content=True))
        times[kind + "+first"].append(ours_cpu_us(kind, items[kind], check_content=False, first_read=True))
    grain_us = _common.median(times["grain"])
    for kind in KINDS:
      plain, checked = _common.median(times[kind]), _common.median(times[kind + "+content"])
      first = _common.median(times[kind + "+first"])
      print(json.dumps({
          "code": label, "ckpt_iter": os.path.dirname(ckpt_iter.__file__), "case": kind,
          "restore_cpu_us": _common.rounded(plain), "restore_checked_cpu_us": _common.rounded(checked),
          "restore_first_read_cpu_us": _common.rounded(first),
          "grain_handler_cpu_us": _common.rounded(grain_us), "ratio_to_grain": _common.rounded(plain / grain_us, 3),
          "checked_ratio_to_grain": _common.rounded(checked / grain_us, 3),
          "state_bytes": os.path.getsize(os.path.join(items[kind], "process_0-of-1.json")),
          "pod_bytes": os.path.getsize(os.path.join(items[kind], "ckpt_iter.json"))}), flush=True)
    if label == "after":
      print(json.dumps(manager_ratios(root, quick)), flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)



def run_worker(label: str, code_dir: str, quick: bool) -> list[dict]:
  env = _common.child_env(PYTHONPATH=os.pathsep.join([code_dir, _common.REPO_DIR]))
  command = [_common.python(), os.path.abspath(__file__), "--worker", label] + (["--quick"] if quick else [])
  process = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=1200)
  if process.returncode != 0:
    raise RuntimeError(f"{label} worker failed:\n{process.stderr[-3000:]}")
  rows = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
  for row in rows:
    assert row.pop("ckpt_iter").startswith(code_dir), (label, code_dir)
  return rows


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0], lambda p: (
      p.add_argument("--worker", help="internal: measure in this process, labelling the lines so"),
      p.add_argument("--before", default=BEFORE_COMMIT, help="the commit measured as `before`")))
  if args.worker:
    worker(args.worker, args.quick)
    return
  report = _common.Reporter("restore_cost", args.quick)
  before_dir = _common.exported(args.before, f"restore_cost_{args.before}_")
  if before_dir is None:
    report.note(f"commit {args.before} could not be exported (no git, or a shallow clone): no `before` figures")
  try:
    rows = run_worker("after", _common.REPO_DIR, args.quick)
    if before_dir is not None:
      rows += run_worker("before", before_dir, args.quick)
  finally:
    if before_dir is not None:
      shutil.rmtree(before_dir, ignore_errors=True)
  for row in rows:
    report.measurement(**row, commit=args.before if row["code"] == "before" else "this tree")
  found = {(r["code"], r["case"]): r for r in rows}
  checks = []
  for kind in KINDS:
    row, before = found["after", kind], found.get(("before", kind), {})
    checks.append(_common.check(f"{kind}: restore CPU / Grain's handler (no content check)", row["ratio_to_grain"],
                                "<= 1.2", row["ratio_to_grain"] <= 1.2, before=before.get("ratio_to_grain")))
    checks.append(_common.check(
        f"{kind}: bytes each process writes (its header; the pod part once per pod: {row['pod_bytes']:,} B)",
        row["state_bytes"], "<= 1024", row["state_bytes"] <= 1024, before=before.get("state_bytes")))
  manager = found["after", "manager"]["runs"]
  worst = max(run["ratio"] for run in manager)
  checks.append(_common.check(
      "CheckpointManager.restore, toy model + data item / toy model + Grain's item (the worst run's median)",
      worst, "<= 1.1 in every run", worst <= 1.1, runs=[run["ratio"] for run in manager]))
  for field, name in (("restore_cpu_us", "restore CPU after 64 restarts / fresh"),
                      ("restore_first_read_cpu_us",
                       "the same, each restore a process's first read of the pod part (its lineage checked)")):
    growth = found["after", "restarts64"][field] / found["after", "fresh"][field]
    before_growth = (found["before", "restarts64"][field] / found["before", "fresh"][field]
                     if ("before", "fresh") in found else None)
    checks.append(_common.check(
        name, _common.rounded(growth, 3), "<= 1.1", growth <= 1.1,
        before=None if before_growth is None else _common.rounded(before_growth, 3)))
  report.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
