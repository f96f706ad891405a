"""A pod's restart at scale: the store requests one process makes to restore its data state, by process count.

A GCS bucket serves about 5,000 object reads a second to start with, for
everything: a restart of 10,000 hosts that each read a few objects waits on
it. Here the data item of a `make_dataset` pipeline saved by N processes
(N = 1 .. 16,384; --quick: 1 .. 256) is written to the tests' GCS emulator as
those processes write it (a header each, the pod part once in the count
file), and one process restores it in a fresh process, the last (farthest
from process 0):

  same count        process N-1 of N (`_item.read_item`, as every restore)
  half the count    process N/2-1 of N/2 (elastic: it takes two saved processes' rows)
  twice the count   process 2N-1 of 2N (elastic)
  one process       process 0 of 1 (elastic), where N > 1

Reported: the emulator's requests by kind for that one restore. The build's
own requests (a new host over an indexed JSONL corpus: 2) are in section 24.
    python benchmarks/restart_requests.py [--quick]
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import logging
import os
import subprocess
import sys

import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _item  # pylint: disable=g-import-not-at-top,wrong-import-position

STEP = 7
COUNTS = (1, 16, 256, 4096, 16384)
QUICK_COUNTS = (1, 16, 256)
TARGET_READS = 3


def saved_item(root: str, count: int) -> str:
  """The data item of step STEP as `count` processes write it (one record a process a batch, 3 batches read)."""
  directory = f"{root}/{count}/{STEP}/data"
  iterator = ckpt_iter.DataIterator(
      ckpt_iter.make_dataset([{"id": i} for i in range(4 * count)], batch_size=1, seed=0, shard_index=0,
                             shard_count=count), check_content=False)
  for _ in range(3):
    next(iterator)
  header, arrays = _item.snapshot(iterator, STEP)

  def write(index: int) -> None:
    own = copy.deepcopy(header)
    own["fingerprint"]["shard_index"] = index
    _item.write(directory, own, arrays, index, count)

  # As in a pod: process 0 publishes its pod part's digest (JAX's key-value store, absent here) and every
  # process holding the same pod part writes only a reference to process 0's count file.
  share_arrays = _item.share_arrays
  _item.share_arrays = lambda d, h, a, i, n, *, pod_digest=None: (h, a, pod_digest)
  try:
    write(0)  # process 0 first: its count file holds the pod part the others refer to
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
      list(pool.map(write, range(1, count)))
  finally:
    _item.share_arrays = share_arrays
  return directory


def restore_requests(emulator, directory: str, index: int, count: int, *, elastic: bool) -> dict:
  """The requests of one restore, in a fresh process (nothing of the item read or cached before)."""
  mark = emulator.mark()
  code = ("import json, sys; from ckpt_iter import _item; "
          f"saved = _item.read_item({directory!r}, {index}, {count}, elastic={elastic}); "
          "print(json.dumps(saved.resized))")
  out = subprocess.run([_common.python(), "-c", code], check=True, capture_output=True, text=True,
                       env=_common.child_env(STORAGE_EMULATOR_HOST=emulator.url))
  resized = json.loads(out.stdout.strip().splitlines()[-1])
  requests = emulator.requests(mark)
  reads = [r for r in requests if r.kind != "list"]
  return {"requests": len(requests), "reads": len(reads), "resized": resized,
          **{f"{kind}_requests": n for kind, n in gcs_emulator.count_by_kind(requests).items() if n}}


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("restart_requests", args.quick)
  counts = QUICK_COUNTS if args.quick else COUNTS
  checks = []
  with gcs_emulator.GcsEmulator() as emulator:
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
    root = f"gs://{gcs_emulator.BUCKET}/restart-{os.getpid()}"
    for count in counts:
      directory = saved_item(root, count)
      cases = {"same count": (count - 1, count, False)}
      if count > 1:
        cases["half the count"] = (count // 2 - 1, count // 2, True)
        cases["one process"] = (0, 1, True)
      cases["twice the count"] = (2 * count - 1, 2 * count, True)
      for name, (index, restored_count, elastic) in cases.items():
        figures = restore_requests(emulator, directory, index, restored_count, elastic=elastic)
        report.measurement(name=name, saved_processes=count, restoring=f"{index} of {restored_count}",
                           value=figures["requests"], unit="requests", **figures)
        if name != "one process":
          checks.append(_common.check(f"{name}, {count} saved", figures["reads"], f"<= {TARGET_READS} reads",
                                      figures["reads"] <= TARGET_READS))
  report.summary(checks)


if __name__ == "__main__":
  main()
