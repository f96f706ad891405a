"""A pod's restart at scale: the store requests one process makes to restore its data state, by process count.

A GCS bucket serves about 5,000 object reads a second to start with, for
everything: a restart of 10,000 hosts that each read a few objects waits on
it. Here the data item of a `make_dataset` pipeline saved by N processes
(N = 1 .. 16,384; --quick: 1 .. 256) is written to the tests' GCS emulator as
those processes write it (a header each, the pod part once in the count
file, and the verdicts of the processes' agreement exchanged through a
key-value store as JAX's job store carries them: `_pod_exchange.share_arrays`; the
tests' store, tests/support.py), and one process restores it in a fresh
process, the last (farthest from process 0):

  same count        process N-1 of N (`_item.read_item`, as every restore)
  same, elastic     the same with elastic=True (as a launch script that always passes it)
  half the count    process N/2-1 of N/2 (elastic: it takes two saved processes' rows)
  twice the count   process 2N-1 of 2N (elastic)
  one process       process 0 of 1 (elastic), where N > 1

And, for N <= 256, the same pipeline mid-repeat (a RepeatIterator holding a
pending item: every process's own rows, which a restore with another count
reads from the files that hold them): `pending, half` and `pending, twice`.

Reported: the emulator's requests by kind for that one restore. The build's
own requests (a new host over an indexed JSONL corpus: 1 with
`files_from_index=True`) are in section 24.
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

import numpy as np

import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position
import support  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _item  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _pod_exchange  # pylint: disable=g-import-not-at-top,wrong-import-position

STEP = 7
COUNTS = (1, 16, 256, 4096, 16384)
QUICK_COUNTS = (1, 16, 256)
PENDING_COUNTS_UP_TO = 256  # every process writes its own npz: 2N objects a save
TARGET_READS = 3
WRITERS = 32


def _state(index: int, count: int, pending: bool) -> tuple[dict, dict]:
  """Process `index`'s header and arrays after 3 global batches (two records a process a batch)."""
  source = ckpt_iter.DataIterator(
      ckpt_iter.make_dataset([{"id": i} for i in range(16 * count)], batch_size=2, seed=0, shard_index=index,
                             shard_count=count), check_content=False)
  if not pending:
    for _ in range(3):
      next(source)
    return _item.snapshot(source, STEP)
  repeat = ckpt_iter.RepeatIterator(source, produce=lambda batch: {"id": np.asarray(batch["id"])}, num_repeats=2)
  for _ in range(3):
    next(repeat)  # mid-group: the second repeat of the second item is pending
  return _item.snapshot(repeat, STEP)


def saved_item(root: str, count: int, *, pending: bool = False) -> str:
  """The data item of step STEP as `count` processes write it, all at once, through one key-value store."""
  directory = f"{root}/{'pending' if pending else 'plain'}/{count}/{STEP}/data"
  store = support.KeyValueStore()
  header, arrays = _state(0, count, pending) if not pending else (None, None)

  def write(index: int) -> None:
    if pending:  # its own rows
      own_header, own_arrays = _state(index, count, True)
    else:  # the same state but for its shard index (built once: 16,384 pipelines would take minutes)
      own_header, own_arrays = copy.deepcopy(header), arrays
      own_header["fingerprint"]["shard_index"] = index
    _item.write(directory, own_header, own_arrays, index, count)

  original = _pod_exchange._distributed_client, _pod_exchange.SHARE_WAIT_SECONDS  # pylint: disable=protected-access
  _pod_exchange._distributed_client = lambda n: store if n == count else None  # pylint: disable=protected-access
  # A pod's processes report at once; here WRITERS threads write them in turn (16,384 take minutes), so
  # process 0 waits for the last report as long as that takes, not the 120 s a real pod's skew is given.
  _pod_exchange.SHARE_WAIT_SECONDS = 3600
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as leader, concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
      first = leader.submit(write, 0)  # process 0 waits for the others' verdicts before its count file
      list(pool.map(write, range(1, count)))
      first.result()
  finally:
    _pod_exchange._distributed_client, _pod_exchange.SHARE_WAIT_SECONDS = original  # pylint: disable=protected-access
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
      cases = {"same count": (directory, count - 1, count, False),
               "same, elastic": (directory, count - 1, count, True)}
      if count > 1:
        cases["half the count"] = (directory, count // 2 - 1, count // 2, True)
        cases["one process"] = (directory, 0, 1, True)
      cases["twice the count"] = (directory, 2 * count - 1, 2 * count, True)
      if 1 < count <= PENDING_COUNTS_UP_TO:
        pending = saved_item(root, count, pending=True)
        cases["pending, half"] = (pending, count // 2 - 1, count // 2, True)
        cases["pending, twice"] = (pending, 2 * count - 1, 2 * count, True)
      for name, (item, index, restored_count, elastic) in cases.items():
        figures = restore_requests(emulator, item, index, restored_count, elastic=elastic)
        report.measurement(name=name, saved_processes=count, restoring=f"{index} of {restored_count}",
                           value=figures["requests"], unit="requests", **figures)
        # The target counts restore and build together: a build over an indexed corpus reads 1 (the index).
        with_index = figures["reads"] + 1
        checks.append(_common.check(f"{name}, {count} saved", with_index,
                                    f"<= {TARGET_READS} reads with the build's index", with_index <= TARGET_READS))
  report.summary(checks)


if __name__ == "__main__":
  main()
