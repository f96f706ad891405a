"""Q19: a process's cost per batch of make_dataset's global plan, with and without a skip range.

make_dataset cuts one global stream into global batches and each process
reads its rows of each (`GlobalBatchDataset`). Without skips a process's rows
are a range of stream records: O(per-process batch) whatever the process
count. With a skip range the kept records of the batch have to be found
around it; this measures that it stays O(per-process batch).

Per process count N (1, 64, 256, 1,024; 8 rows per process, process N // 2):

  plain      what a user writes per process without ckpt_iter:
             `MapDataset.source(records).shuffle(seed)[i::N].repeat().batch(8)`
             (no `[i::N]` on one process)
  plan       make_dataset(records, batch_size=8, seed, num_epochs=None, shard_index=i, shard_count=N)
  plan_skip  the same with one declared stream range, Skip(records=[(1000, 1064)])

over 131,072 in-memory records ({"id": i}: small, so the plan's own work is the
largest share). cpu_us_per_batch: process CPU of `dataset[k]` for 200 batches
in a row (1,600 of 1 row), divided by their number; the three cases alternate, medians of the
repetitions; ratios are to `plain` in the same process. peak_kib: tracemalloc
peak of one `dataset[k]` (apart from the timing: tracing slows what it traces).

Batch size 1 (issue 49 item 2: the plan's fixed cost per batch shows most there): the
same three cases on 1 process with 1 row per batch (`per_process: 1`).

The same measurement runs twice in one invocation, in two child processes:
on this tree's ckpt_iter (`after`) and on commit e9f37c0's (`before`, exported
with `git archive`; its skips made each process build the whole global batch
as a list and slice its rows). Target: `after` within 5% of plain Grain at
every process count, with and without the skip, and at batch size 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import tracemalloc

import _common

NUM_RECORDS = 2**17
PER_PROCESS = 8
PROCESS_COUNTS = [1, 64, 256, 1024]
SKIP = [(1000, 1064)]
SEED = 1
BEFORE_COMMIT = "e9f37c0"
CASES = ["plain", "plan", "plan_skip"]
TARGET = 1.05


def datasets(process_count: int, per_process: int = PER_PROCESS) -> dict:
  import grain  # pylint: disable=g-import-not-at-top
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  records = [{"id": i} for i in range(NUM_RECORDS)]
  index = process_count // 2
  shuffled = grain.MapDataset.source(records).shuffle(seed=SEED)
  if process_count > 1:  # one process reads it all: no slice (it would add a node to plain's path)
    shuffled = shuffled[index::process_count]
  plain = shuffled.repeat().batch(per_process)
  plan = lambda skip: ckpt_iter.make_dataset(
      records, batch_size=per_process, seed=SEED, num_epochs=None, shard_index=index,
      shard_count=process_count, skip=skip)
  return {"plain": plain, "plan": plan(None), "plan_skip": plan(SKIP)}


def cpu_us_per_batch(dataset, first: int, count: int) -> float:
  started = time.process_time()
  for k in range(first, first + count):
    dataset[k]  # pylint: disable=pointless-statement
  return (time.process_time() - started) / count * 1e6


def peak_kib(dataset, index: int) -> float:
  tracemalloc.start()
  try:
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    batch = dataset[index]
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
  del batch
  return peak / 1024


def worker(label: str, quick: bool) -> None:
  """Measures every case at every process count on the ckpt_iter this process imports."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  reps, count = (3, 50) if quick else (9, 200)
  for process_count, per_process in [(n, PER_PROCESS) for n in PROCESS_COUNTS] + [(1, 1)]:
    cases = datasets(process_count, per_process)
    for dataset in cases.values():
      cpu_us_per_batch(dataset, 0, 20)  # warm-up: first calls, caches
    times = {name: [] for name in cases}
    batches = count if per_process > 1 else 8 * count  # a batch of 1 is quick: as long a measurement
    for rep in range(reps):
      for name in (CASES if rep % 2 == 0 else CASES[::-1]):
        times[name].append(cpu_us_per_batch(cases[name], 20, batches))
    peaks = {name: peak_kib(dataset, 500) for name, dataset in cases.items()}
    medians = {name: _common.median(values) for name, values in times.items()}
    for name in CASES:
      print(json.dumps({
          "code": label, "ckpt_iter": os.path.dirname(ckpt_iter.__file__), "process_count": process_count,
          "per_process": per_process, "case": name, "cpu_us_per_batch": _common.rounded(medians[name]),
          "ratio_to_plain": _common.rounded(medians[name] / medians["plain"], 3),
          "peak_kib": _common.rounded(peaks[name], 3), "reps": reps, "batches_per_rep": batches}), flush=True)



def run_worker(label: str, code_dir: str, quick: bool) -> list[dict]:
  env = _common.child_env(PYTHONPATH=os.pathsep.join([code_dir, _common.REPO_DIR]))
  command = [_common.python(), os.path.abspath(__file__), "--worker", label] + (["--quick"] if quick else [])
  process = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
  if process.returncode != 0:
    raise RuntimeError(f"{label} worker failed:\n{process.stderr[-3000:]}")
  return [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0], lambda p: (
      p.add_argument("--worker", help="internal: measure in this process, labelling the lines so"),
      p.add_argument("--before", default=BEFORE_COMMIT, help="the commit measured as `before`")))
  if args.worker:
    worker(args.worker, args.quick)
    return
  report = _common.Reporter("plan_skips", args.quick)
  before_dir = _common.exported(args.before, f"plan_skips_{args.before}_")
  if before_dir is None:
    report.note(f"commit {args.before} could not be exported (no git, or a shallow clone): no `before` figures")
  try:
    # Each child compares with plain Grain in its own process: the ratios are what compare across them.
    rows = run_worker("after", _common.REPO_DIR, args.quick)
    if before_dir is not None:
      rows += run_worker("before", before_dir, args.quick)
  finally:
    if before_dir is not None:
      shutil.rmtree(before_dir, ignore_errors=True)
  for row in rows:
    imported = row.pop("ckpt_iter")
    expected = before_dir if row["code"] == "before" else _common.REPO_DIR
    assert imported.startswith(expected), (row["code"], imported, expected)
    report.measurement(**row, commit=args.before if row["code"] == "before" else "this tree")
  found = {(r["code"], r["process_count"], r["per_process"], r["case"]): r for r in rows}
  ratio = lambda code, n, per, case: found.get((code, n, per, case), {}).get("ratio_to_plain")
  checks = []
  for name in ("plan", "plan_skip"):
    worst = max(PROCESS_COUNTS, key=lambda n: ratio("after", n, PER_PROCESS, name))
    value = ratio("after", worst, PER_PROCESS, name)
    before = [ratio("before", n, PER_PROCESS, name) for n in PROCESS_COUNTS]
    checks.append(_common.check(
        f"{'with one skip range' if name == 'plan_skip' else 'without skips'}: per-batch CPU / plain Grain's, "
        "worst of 1-1,024 processes", value, f"<= {TARGET}", value <= TARGET, at_processes=worst,
        before=None if None in before else max(before),
        peak_kib_at_1024=found["after", 1024, PER_PROCESS, name]["peak_kib"],
        peak_kib_at_1024_before=found.get(("before", 1024, PER_PROCESS, name), {}).get("peak_kib")))
  value = max(ratio("after", 1, 1, "plan"), ratio("after", 1, 1, "plan_skip"))
  before = [ratio("before", 1, 1, "plan"), ratio("before", 1, 1, "plan_skip")]
  checks.append(_common.check(
      "batch size 1, one process: per-batch CPU / plain Grain's (worst of without and with a skip)", value,
      "<= 1.03 (issue 49)", value <= 1.03, before=None if None in before else max(before),
      extra_us=_extra_us(found, "after"), extra_us_before=_extra_us(found, "before")))
  report.summary(checks, load_average_end=_common.load_average())


def _extra_us(found: dict, code: str) -> float | None:
  """The plan's CPU per batch beyond plain Grain's at batch size 1, microseconds."""
  plan, plain = found.get((code, 1, 1, "plan")), found.get((code, 1, 1, "plain"))
  if plan is None or plain is None:
    return None
  return _common.rounded(plan["cpu_us_per_batch"] - plain["cpu_us_per_batch"], 3)


if __name__ == "__main__":
  main()
