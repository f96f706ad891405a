"""Pod scale: what one process reads and waits for to restore, for N up to 1,024.

N processes are simulated in one process: each process's data item is written
as `IteratorCheckpointHandler(process_index=i, process_count=N)` writes it,
from its own `make_dataset` shard (global batch 8 rows per process, so the
per-process share stays fixed as N grows). Then ONE process restores:

  same     N -> N    plain IteratorRestore (its own file)
  half     N -> N/2  IteratorRestore(elastic=True)
  double   N -> 2N   IteratorRestore(elastic=True)

with and without pending arrays (a RepeatIterator mid-repeat holding
8 rows x 1,024 tokens of int32 completion ids and float32 log-probs per
process, 64 KiB; a DataIterator has none). Every state file the restore opens
(the count file `ckpt_iter.json` included), every byte it reads, every stat
call on a state file or fstat of an open file, and every directory listing are
counted by wrapping `builtins.open`/`io.open`, `os.stat`, `os.fstat` and
`os.listdir`/`os.scandir` (real counts, not computed).
`--baseline PATH` also times the elastic read of another `elastic.py` (e.g. a
copy of the one before the count file), interleaved with the current one; it
is given the saved count from a directory listing, as restores learnt it then.

Also measured:
  * save blocking for a 256 MiB pending set (numpy and JAX arrays): the
    handler's `async_save` until it hands Orbax the write future, against one
    `np.copy` of the same arrays (paired, interleaved);
  * Grain's own handler (`grain.checkpoint.CheckpointSave/CheckpointRestore`)
    on the same `make_dataset` pipeline (a Grain iterator; Grain saves no
    pending items), same count at N = 1 and the simulated N: save blocking,
    restore time, bytes on disk.

Targets: per-process restore time and bytes read within 2x from the smallest
to the largest N; save blocking at most 1.2x one copy; ckpt_iter within 1.2x of
Grain's handler (like for like: without the content check, which Grain does
not make; with it, as `restore_checked_ms`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import gc
import importlib.util
import io
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Callable

import _common

import grain
from grain._src.core import sharding as grain_sharding
import grain.checkpoint as grain_checkpoint
from etils import epath
import numpy as np

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import elastic

ROWS_PER_PROCESS = 8
TOKENS = 1024
LARGE_PENDING_MIB = 256
FLAT_TARGET = 2.0
SAVE_TARGET = 1.2
GRAIN_TARGET = 1.2
# Each restore is a fraction of a millisecond on a shared machine: many
# interleaved pairs make the median ratio stable.
GRAIN_REPS = 61
_STATE_FILE = re.compile(r"(process_\d+-of-\d+\.(json|npz)|/ckpt_iter\.json)$")
PLOT_PATH = os.path.join(_common.REPO_DIR, "docs", "pod_scale.png")
# One event loop for every async_save, as Orbax keeps one: creating a loop per
# save would add its own cost to what is timed.
_LOOP = asyncio.new_event_loop()


# --- simulated processes --------------------------------------------------------


def produce(batch: dict) -> dict:
  ids = np.asarray(batch["id"])
  return {
      "completion_ids": (ids[:, None] * 7 + np.arange(TOKENS)).astype(np.int32),
      "old_logps": np.cos(ids[:, None] * 0.01 + np.arange(TOKENS) * 0.001).astype(np.float32),
  }


def dataset(shard_index: int, shard_count: int, global_rows: int):
  records = [{"id": i} for i in range(global_rows * 2)]
  return ckpt_iter.make_dataset(records, batch_size=global_rows // shard_count, seed=0, num_epochs=None,
                                shard_index=shard_index, shard_count=shard_count)


def iterator(shard_index: int, shard_count: int, global_rows: int, pending: bool, check_content: bool = True):
  source = ckpt_iter.DataIterator(dataset(shard_index, shard_count, global_rows), check_content=check_content)
  if not pending:
    next(source)
    return source
  it = ckpt_iter.RepeatIterator(source, produce=produce, num_repeats=2, shuffle_seed=1)
  next(it)  # mid-repeat: one item pending on every process
  return it


def write_item(directory: str, count: int, pending: bool) -> None:
  global_rows = ROWS_PER_PROCESS * count
  for index in range(count):
    checkpoint_lib.IteratorCheckpointHandler(index, count).save(
        directory, ckpt_iter.IteratorSave(iterator(index, count, global_rows, pending)))


# --- counting ------------------------------------------------------------------


class _CountedFile:
  """A file object that adds the bytes it reads to a counter."""

  def __init__(self, f: Any, counter: "IoCounter"):
    self._f = f
    self._counter = counter

  def read(self, *args):
    data = self._f.read(*args)
    self._counter.bytes_read += len(data)
    return data

  def readinto(self, buffer):
    n = self._f.readinto(buffer)
    self._counter.bytes_read += n or 0
    return n

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self._f.close()

  def __getattr__(self, name):
    return getattr(self._f, name)


class IoCounter:
  """Counts opens, bytes read, stat calls and listings of state files (json/npz)."""

  def __init__(self):
    self.opened: list[str] = []
    self.bytes_read = 0
    self.stat_calls = 0
    self.listings = 0

  @contextlib.contextmanager
  def active(self):
    real = builtins.open, io.open, os.stat, os.fstat, os.listdir, os.scandir
    real_open, _, real_stat, real_fstat, real_listdir, real_scandir = real

    def counting_open(file, mode="r", *args, **kwargs):
      f = real_open(file, mode, *args, **kwargs)
      if isinstance(file, (str, os.PathLike)) and _STATE_FILE.search(os.fspath(file)) and "r" in mode:
        self.opened.append(os.path.basename(os.fspath(file)))
        return _CountedFile(f, self)
      return f

    def counting_stat(path, *args, **kwargs):
      if isinstance(path, (str, os.PathLike)) and _STATE_FILE.search(os.fspath(path)):
        self.stat_calls += 1
      return real_stat(path, *args, **kwargs)

    def counting_fstat(fd):
      self.stat_calls += 1  # only the readers call it while counting: a state file
      return real_fstat(fd)

    def counting_listdir(*args):
      self.listings += 1
      return real_listdir(*args)

    def counting_scandir(*args):
      self.listings += 1
      return real_scandir(*args)

    builtins.open = io.open = counting_open
    os.stat, os.fstat, os.listdir, os.scandir = counting_stat, counting_fstat, counting_listdir, counting_scandir
    try:
      yield self
    finally:
      builtins.open, io.open, os.stat, os.fstat, os.listdir, os.scandir = real

  def summary(self) -> dict[str, Any]:
    return {
        "files_opened": len(self.opened),
        "headers_opened": sum(name.endswith(".json") for name in self.opened),  # the count file included
        "npz_opened": sum(name.endswith(".npz") for name in self.opened),
        "count_files_opened": sum(name == "ckpt_iter.json" for name in self.opened),
        "bytes_read": self.bytes_read,
        "stat_calls": self.stat_calls,
        "listings": self.listings,
    }


def counted(fn: Callable[[], Any]) -> dict[str, Any]:
  counter = IoCounter()
  with counter.active():
    fn()
  return counter.summary()


def timed(fn: Callable[[], Any]) -> float:
  gc.collect()
  gc.disable()
  try:
    return _common.timed_ms(fn)[0]
  finally:
    gc.enable()


def listed_count(directory: str) -> int:
  """The saved process count from a listing, checked complete: what restores did before the count file."""
  present = _files.list_process_files(directory)
  problems = _files.process_set_problems(directory, present)
  if problems:
    raise ckpt_iter.InvalidStateError(str(problems[0]))
  return present[0][1]


def load_baseline(path: str):
  spec = importlib.util.spec_from_file_location("ckpt_iter_elastic_baseline", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


# --- restore per process ----------------------------------------------------------


def restore_cases(n: int) -> list[tuple[str, int]]:
  cases = [("same", n)]
  if n >= 2:
    cases.append(("half", n // 2))
  cases.append(("double", 2 * n))
  return cases


def measure_restores(report, directory: str, n: int, pending: bool, reps: int, baseline) -> list[dict]:
  rows = []
  global_rows = ROWS_PER_PROCESS * n
  item_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
  for case, m in restore_cases(n):
    index = m // 2  # a process in the middle
    is_elastic = case != "same"

    def handler_restore():
      # Without the content check: these tables follow the I/O as N grows (the
      # check produces one batch, whose cost depends on the pipeline: section 11).
      fresh = iterator(index, m, global_rows, pending=False, check_content=False) if not pending else \
          ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset(index, m, global_rows), check_content=False),
                                   produce=produce, num_repeats=2, shuffle_seed=1)
      return lambda: checkpoint_lib.IteratorCheckpointHandler(index, m).restore(
          directory, ckpt_iter.IteratorRestore(fresh, elastic=is_elastic))

    impls = {"after": lambda: elastic.read_for_process(directory, index, m)}
    if baseline is not None:
      # An older read_for_process learnt the saved count by listing the item:
      # it gets the count the same way here, whatever today's _files does.
      impls["before"] = lambda: baseline.read_for_process(directory, index, m, saved_count=listed_count(directory))
    counts = {name: counted(fn) for name, fn in impls.items()}
    restore_counts = counted(handler_restore())
    times = {name: [] for name in impls}
    restore_times, listing_times = [], []
    for rep in range(reps + 1):  # the first round is warm-up
      for name, fn in impls.items():
        elapsed = timed(fn)
        if rep:
          times[name].append(elapsed)
      # For reference: listing the item (2N names), which a restore no longer does.
      elapsed = timed(lambda: listed_count(directory))
      if rep:
        listing_times.append(elapsed)
      run = handler_restore()
      elapsed = timed(run)
      if rep:
        restore_times.append(elapsed)
    for name in impls:
      row = dict(
          measure="restore", n_saved=n, n_restored=m, case=case, pending=pending, impl=name,
          process_index=index, read_ms=_common.rounded(_common.median(times[name])),
          reps=len(times[name]), item_bytes_on_disk=item_bytes, **counts[name],
      )
      if name == "after":
        row["handler_restore_ms"] = _common.rounded(_common.median(restore_times))
        row["listing_ms"] = _common.rounded(_common.median(listing_times))
        row["handler_restore_counts"] = restore_counts
      report.measurement(**row)
      rows.append(row)
  return rows


# --- save blocking, 256 MiB --------------------------------------------------------


def large_arrays() -> dict[str, np.ndarray]:
  rows = 512
  columns = LARGE_PENDING_MIB * 2**20 // 4 // rows // 4  # four float32/int32 arrays
  rng = np.random.default_rng(0)
  return {
      "completion_ids": rng.integers(0, 32_000, (rows, columns), dtype=np.int32),
      "completion_mask": np.ones((rows, columns), np.int32),
      "old_logps": rng.standard_normal((rows, columns), dtype=np.float32),
      "ref_logps": rng.standard_normal((rows, columns), dtype=np.float32),
  }


def measure_save_blocking(report, reps: int) -> list[dict]:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  arrays = large_arrays()
  pending_bytes = sum(a.nbytes for a in arrays.values())
  variants = {"numpy": arrays, "jax": {k: jnp.asarray(v) for k, v in arrays.items()}}
  items = {}
  for name, produced in variants.items():
    source = ckpt_iter.DataIterator(dataset(0, 1, 8))
    it = ckpt_iter.RepeatIterator(source, produce=lambda _, p=produced: p, num_repeats=2)
    next(it)
    items[name] = it
  workdir = tempfile.mkdtemp(prefix="bench_pod_save_")
  copies, blocked = [], {name: [] for name in variants}
  handler = checkpoint_lib.IteratorCheckpointHandler(0, 1)

  def start(directory, item):
    return _LOOP.run_until_complete(handler.async_save(directory, ckpt_iter.IteratorSave(item)))

  try:
    for rep in range(reps + 1):
      copies_this = timed(lambda: [np.copy(a) for a in arrays.values()])
      for name, item in items.items():
        directory = os.path.join(workdir, f"{name}_{rep}")
        os.makedirs(directory)
        futures = []
        elapsed = timed(lambda: futures.extend(start(directory, item)))  # pylint: disable=cell-var-from-loop
        for f in futures:  # the background write, not timed
          f.result()
        shutil.rmtree(directory)
        if rep:
          blocked[name].append(elapsed)
      if rep:
        copies.append(copies_this)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  copy_ms = _common.median(copies)
  rows = []
  for name, values in blocked.items():
    ratios = [b / c for b, c in zip(values, copies)]
    row = dict(measure="save_blocking_large", variant=name, pending_mib=round(pending_bytes / 2**20, 1),
               copy_ms=_common.rounded(copy_ms), blocked_ms=_common.rounded(_common.median(values)),
               blocked_over_copy=_common.rounded(_common.median(ratios), 3),
               # The least disturbed repetitions: other jobs share the 2 cores.
               min_blocked_over_min_copy=_common.rounded(min(values) / min(copies), 3), reps=len(values))
    report.measurement(**row)
    rows.append(row)
  return rows


# --- Grain's handler, side by side ---------------------------------------------------


def grain_iterator(shard_index: int, shard_count: int, global_rows: int):
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return iter(dataset(shard_index, shard_count, global_rows).to_iter_dataset(options))


@contextlib.contextmanager
def grain_process(index: int, count: int):
  """Grain's handler asks jax for the process; simulate process `index` of `count`."""
  real = grain_sharding.get_process_index_and_count
  grain_sharding.get_process_index_and_count = lambda: (index, count)
  try:
    yield
  finally:
    grain_sharding.get_process_index_and_count = real


def measure_grain(report, workdir: str, n: int, reps: int) -> list[dict]:
  global_rows = ROWS_PER_PROCESS * n
  index = n // 2
  dirs = {tool: os.path.join(workdir, f"{tool}_{n}") for tool in ("ckpt_iter", "grain")}
  for d in dirs.values():
    os.makedirs(d)
  grain_handler = grain_checkpoint.CheckpointHandler()
  for i in range(n):  # every process's file, as a real N-process save leaves them
    it = grain_iterator(i, n, global_rows)
    next(it)
    with grain_process(i, n):
      grain_handler.save(epath.Path(dirs["grain"]),
                         args=grain_checkpoint.CheckpointSave(it))
  write_item(dirs["ckpt_iter"], n, pending=False)
  ours = iterator(index, n, global_rows, pending=False)
  theirs = grain_iterator(index, n, global_rows)
  next(theirs)
  handler = checkpoint_lib.IteratorCheckpointHandler(index, n)

  def ours_save():
    futures = _LOOP.run_until_complete(handler.async_save(epath.Path(dirs["ckpt_iter"]), ckpt_iter.IteratorSave(ours)))
    return futures

  def grain_save():
    with grain_process(index, n):
      grain_handler.save(epath.Path(dirs["grain"]), args=grain_checkpoint.CheckpointSave(theirs))

  def ours_restore(check_content=False):
    # Like for like, Grain's handler checks no content: the check's cost (one
    # element produced again) is the separate `restore_checked_ms` (and section 11).
    fresh = iterator(index, n, global_rows, pending=False, check_content=check_content)
    return lambda: handler.restore(epath.Path(dirs["ckpt_iter"]), ckpt_iter.IteratorRestore(fresh))

  def grain_restore():
    fresh = grain_iterator(index, n, global_rows)

    def run():
      with grain_process(index, n):
        grain_handler.restore(epath.Path(dirs["grain"]), args=grain_checkpoint.CheckpointRestore(fresh))
    return run

  results = {(tool, what): [] for tool in ("ckpt_iter", "grain") for what in ("save", "restore")}
  checked: list[float] = []
  for rep in range(reps + 1):
    futures = []
    elapsed = timed(lambda: futures.extend(ours_save()))
    for f in futures:
      f.result()
    grain_elapsed = timed(grain_save)
    ours_run, grain_run = ours_restore(), grain_restore()
    # Alternate which goes first: the second finds the code both share (json,
    # os, epath) already in the CPU caches, which a fixed order gives one side.
    if rep % 2:
      ours_restore_ms, grain_restore_ms = timed(ours_run), timed(grain_run)
    else:
      grain_restore_ms, ours_restore_ms = timed(grain_run), timed(ours_run)
    checked_ms = timed(ours_restore(check_content=True))
    if rep:
      checked.append(checked_ms)
      results[("ckpt_iter", "save")].append(elapsed)
      results[("grain", "save")].append(grain_elapsed)
      results[("ckpt_iter", "restore")].append(ours_restore_ms)
      results[("grain", "restore")].append(grain_restore_ms)
  restore_counts = {"ckpt_iter": counted(ours_restore()), "grain": counted(grain_restore())}
  # The spread of the restore ratio over the interleaved pairs: each pair ran
  # back to back, so its ratio is free of the machine's slower stretches.
  pair_ratios = sorted(a / b for a, b in zip(results[("ckpt_iter", "restore")], results[("grain", "restore")]))
  last = len(pair_ratios) - 1
  spread = {f"restore_ratio_p{q}": _common.rounded(pair_ratios[min(last, len(pair_ratios) * q // 100)], 3)
            for q in (10, 50, 90)}
  rows = []
  for tool in ("ckpt_iter", "grain"):
    stem = f"process_{index}-of-{n}"
    own_bytes = sum(os.path.getsize(os.path.join(dirs[tool], f))
                    for f in os.listdir(dirs[tool]) if f.startswith(stem + "."))
    row = dict(measure="grain_side_by_side", n=n, tool=tool,
               save_blocked_ms=_common.rounded(_common.median(results[(tool, "save")])),
               restore_ms=_common.rounded(_common.median(results[(tool, "restore")])),
               restore_min_ms=_common.rounded(min(results[(tool, "restore")])),
               bytes_on_disk_per_process=own_bytes, restore_counts=restore_counts[tool], reps=reps,
               **(spread if tool == "ckpt_iter" else {}))
    if tool == "ckpt_iter":
      row["restore_checked_ms"] = _common.rounded(_common.median(checked))
    report.measurement(**row)
    rows.append(row)
  return rows


# --- summary and plot ---------------------------------------------------------------


def flat_checks(rows: list[dict]) -> list[dict]:
  checks = []
  for pending in (True, False):
    for case in ("same", "half", "double"):
      series = sorted((r for r in rows if r["impl"] == "after" and r["case"] == case and r["pending"] == pending),
                      key=lambda r: r["n_saved"])
      if len(series) < 2:
        continue
      low, high = series[0], series[-1]
      label = (f"{'pending' if pending else 'no pending'}, {case} ({low['n_saved']}->{low['n_restored']} "
               f"vs {high['n_saved']}->{high['n_restored']})")
      for field, what in (("handler_restore_ms", "restore time"), ("bytes_read", "bytes read")):
        value = high[field] / low[field] if low[field] else float("inf")
        checks.append(_common.check(
            f"{label}: {what} per process, largest N / smallest N", _common.rounded(value, 3),
            f"<= {FLAT_TARGET:g}", value <= FLAT_TARGET,
            smallest=low[field], largest=high[field], files_opened=[low["files_opened"], high["files_opened"]],
            **({"listing_ms": [low["listing_ms"], high["listing_ms"]]}
               if case != "same" and field.endswith("ms") else {})))
  return checks


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
  panels = (("read_ms", "elastic.read_for_process, ms"), ("bytes_read", "bytes read"),
            ("files_opened", "state files opened"))
  styles = {"same": "o", "half": "s", "double": "^"}
  for impl, line in (("after", "-"), ("before", ":")):
    for case, marker in styles.items():
      series = sorted((r for r in rows if r["impl"] == impl and r["case"] == case and r["pending"]),
                      key=lambda r: r["n_saved"])
      if not series:
        continue
      xs = [r["n_saved"] for r in series]
      for ax, (field, _) in zip(axes, panels):
        ax.plot(xs, [r[field] for r in series], line, marker=marker, label=f"{case} ({impl})")
  for ax, (_, title) in zip(axes, panels):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("saved processes N (restored by N, N/2, 2N)")
    ax.set_title(f"one process: {title}")
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle("Per-process restore cost with pending arrays (64 KiB per process), simulated N")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0], extra=lambda p: (
      p.add_argument("--baseline", help="an older elastic.py whose read_for_process to time too"),
      p.add_argument("--plot", default=PLOT_PATH, help="where to write the log-log plot (PNG)"),
      p.add_argument("--counts", default=None, help="comma-separated N values"),
  ))
  report = _common.Reporter("pod_scale", args.quick)
  if args.counts:
    counts = [int(c) for c in args.counts.split(",")]
  else:
    counts = [1, 8, 64] if args.quick else [1, 8, 64, 256, 1024]
  baseline = load_baseline(args.baseline) if args.baseline else None
  workdir = tempfile.mkdtemp(prefix="bench_pod_")
  rows, grain_rows = [], []
  try:
    for n in counts:
      for pending in (True, False):
        directory = os.path.join(workdir, f"n{n}_{'pending' if pending else 'plain'}")
        os.makedirs(directory)
        write_item(directory, n, pending)
        reps = 3 if args.quick else 15  # interleaved, cheap next to writing the N files
        rows += measure_restores(report, directory, n, pending, reps, baseline)
        shutil.rmtree(directory)
      grain_rows += measure_grain(report, workdir, n, 3 if args.quick else GRAIN_REPS)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  save_rows = measure_save_blocking(report, 2 if args.quick else 15)

  checks = flat_checks(rows)
  for r in save_rows:
    checks.append(_common.check(
        f"save blocking, {r['pending_mib']:g} MiB pending ({r['variant']}): blocked / one np.copy",
        r["blocked_over_copy"], f"<= {SAVE_TARGET:g}", r["blocked_over_copy"] <= SAVE_TARGET,
        blocked_ms=r["blocked_ms"], copy_ms=r["copy_ms"], min_blocked_over_min_copy=r["min_blocked_over_min_copy"]))
  for n in counts:
    ours = next(r for r in grain_rows if r["n"] == n and r["tool"] == "ckpt_iter")
    theirs = next(r for r in grain_rows if r["n"] == n and r["tool"] == "grain")
    for field in ("save_blocked_ms", "restore_ms"):
      ratio = ours[field] / theirs[field]
      extra = {}
      if field == "restore_ms":  # the least disturbed repetitions, and the spread over pairs
        extra["fastest_over_fastest"] = _common.rounded(ours["restore_min_ms"] / theirs["restore_min_ms"], 3)
        extra.update({k: ours[k] for k in ("restore_ratio_p10", "restore_ratio_p50", "restore_ratio_p90")})
      checks.append(_common.check(f"N={n}: {field} ckpt_iter / Grain handler", _common.rounded(ratio, 3),
                                  f"<= {GRAIN_TARGET:g}", ratio <= GRAIN_TARGET,
                                  ckpt_iter=ours[field], grain=theirs[field], **extra))
  if args.plot and not args.quick:
    plot(rows, args.plot)
    report.note(f"plot written to {os.path.relpath(args.plot, _common.REPO_DIR)}")
  report.summary(checks, counts=counts, baseline=bool(baseline), rows_per_process=ROWS_PER_PROCESS,
                 pending_bytes_per_process=ROWS_PER_PROCESS * TOKENS * 8, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
