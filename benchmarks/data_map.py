"""Q16: what the data map costs: `ckpt-iter which` and `ckpt-iter order` on a run of 10^6 global batches.

The run: make_dataset over 100,000 records (shuffled, epochs without end),
global batch 8, three segments: 400,000 batches, a restart under a global
batch of 16 for 200,000 more, a restart under 8 again with a skip range
declared for 400,000 more (10^6 batches in all). Its states are real item
files (the Orbax handler's), written at the resume points and the end; the
iterators are moved along with `DataIterator.skip` (O(1)), since the map reads
the states only. Each command runs in a fresh process, as an operator runs it
(import and header reads included); its wall time and peak RSS are measured:

1. `which --step S` (the last step: its batch, numbered across the resumes),
   `which --batch K` for the first batch, one in the middle segment, the last;
2. `order --out FILE.jsonl` over the first 10^4, 10^5 and all 10^6 batches
   (memory must not grow with the batches written), and `order --out
   FILE.parquet` over all of them.
Targets: `which` under 2 s; `order`'s peak RSS at 10^6 batches within 1.5x of
its RSS at 10^4 (O(1) in the run's length).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import _common

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib

NUM_RECORDS = 100_000
SEGMENTS = [(8, 400_000, None), (16, 200_000, None), (8, 400_000, [(9_000_000, 9_000_500)])]


def _pipeline(global_batch, skip):
  return ckpt_iter.make_dataset([{"id": i} for i in range(NUM_RECORDS)], batch_size=global_batch, seed=7,
                                num_epochs=None, shard_index=0, shard_count=1, skip=skip, transform=None)


def write_run(root: str, quick: bool) -> int:
  """The run's states at its resume points and end; returns the last step (= global batches)."""
  step = 0
  for number, (global_batch, batches, skip) in enumerate(SEGMENTS):
    batches = batches // 100 if quick else batches
    iterator = ckpt_iter.DataIterator(_pipeline(global_batch, skip))
    if number:
      checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(os.path.join(root, str(step), "data"),
                                                             ckpt_iter.IteratorRestore(iterator))
    iterator.skip(batches - 1)
    next(iterator)  # the last batch read: its content is what the state records
    step += batches
    item = os.path.join(root, str(step), "data")
    os.makedirs(item)
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))
  return step


def run_command(*argv: str) -> tuple[float, float, str]:
  """(wall seconds, peak RSS MiB, stdout) of `python -m ckpt_iter ARGV` in a fresh process."""
  program = ("import resource, subprocess, sys, json\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "print(json.dumps({'rss_kib': rss, 'code': p.returncode, 'out': p.stdout[-2000:],\n"
             "                  'err': p.stderr[-2000:]}))\n")
  started = time.perf_counter()
  result = subprocess.run([_common.python(), "-c", program, _common.python(), "-m", "ckpt_iter", *argv],
                          capture_output=True, text=True, env=_common.child_env(), check=True)
  seconds = time.perf_counter() - started
  value = json.loads(result.stdout)
  if value["code"] != 0:
    raise RuntimeError(f"ckpt-iter {' '.join(argv)} failed: {value['err']}")
  return seconds, value["rss_kib"] / 1024, value["out"]


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("data_map", args.quick)
  checks = []
  with tempfile.TemporaryDirectory() as directory:
    root = os.path.join(directory, "run")
    last = write_run(root, args.quick)
    report.measurement(question="run", global_batches=last, segments=len(SEGMENTS), kept_steps=len(SEGMENTS))
    cases = [("which --step (the last)", ["which", root, "--step", str(last), "--json"]),
             ("which --batch 0", ["which", root, "--batch", "0", "--json"]),
             (f"which --batch {last // 2}", ["which", root, "--batch", str(last // 2), "--json"]),
             (f"which --batch {last - 1}", ["which", root, "--batch", str(last - 1), "--json"])]
    for name, argv in cases:
      seconds, rss, _ = run_command(*argv)
      report.measurement(question="which", command=name, seconds=_common.rounded(seconds), peak_rss_mib=round(rss, 1))
      checks.append(_common.check(f"{name}: seconds", _common.rounded(seconds), "< 2", seconds < 2))
    rss_by_count = {}
    for count in ([last // 100, last // 10, last]):
      out = os.path.join(directory, f"order_{count}.jsonl")
      seconds, rss, _ = run_command("order", root, "--out", out, "--limit", str(count))
      rss_by_count[count] = rss
      report.measurement(question="order", format="jsonl", batches=count, seconds=_common.rounded(seconds),
                         peak_rss_mib=round(rss, 1), batches_per_second=_common.rounded(count / seconds),
                         file_mib=round(os.path.getsize(out) / 2**20, 1))
      os.remove(out)
    out = os.path.join(directory, "order.parquet")
    seconds, rss, _ = run_command("order", root, "--out", out)
    report.measurement(question="order", format="parquet", batches=last, seconds=_common.rounded(seconds),
                       peak_rss_mib=round(rss, 1), batches_per_second=_common.rounded(last / seconds),
                       file_mib=round(os.path.getsize(out) / 2**20, 1))
    ratio = rss_by_count[last] / rss_by_count[last // 100]
    checks.append(_common.check("order: peak RSS at all batches / at 1% of them", f"{ratio:.2f}",
                                "<= 1.5 (O(1) in the run's length)", ratio <= 1.5))
  report.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
