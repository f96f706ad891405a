"""Q14: a huge pending queue — restore time and memory against its bytes.

A repeat state with 100,000 pending items (each a dict of 32 int32 token ids
and one float32 log-prob, as a per-prompt rollout queue holds them) is
written as the handler writes it, then read back by `_files.read_state`
(the one read path of every restore) in a fresh process per measurement:
wall time, and peak resident memory over the process's baseline (VmHWM,
which counts what tracemalloc cannot: numpy's and zipfile's C buffers),
against the bytes of the item's files. Three repetitions, medians.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _common

ITEMS = 100_000
QUICK_ITEMS = 5_000


def _write(directory: str, items: int) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  pending = tuple({"ids": np.arange(32, dtype=np.int32) + i, "logp": np.float32(i)} for i in range(items))
  value = state_lib.IteratorState(kind="repeat", fingerprint={}, position={"next_index": 1},
                                  pending=state_lib.Pending(items=pending, schedule=tuple(range(items))))
  header, arrays = codec.encode_state(value)
  _files.write_files(directory, header, arrays, process_index=0, process_count=1)


def _read_in_this_process(directory: str) -> dict:
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top

  before = _peak_rss_bytes()
  started = time.perf_counter()
  value = _files.read_state(directory, 0, 1)
  seconds = time.perf_counter() - started
  return {"seconds": seconds, "extra_rss_bytes": _peak_rss_bytes() - before, "items": len(value.pending)}


def _peak_rss_bytes() -> int:
  """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across exec)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("pending_queue", args.quick)
  items = QUICK_ITEMS if args.quick else ITEMS
  directory = tempfile.mkdtemp(prefix="bench_pending_queue_")
  try:
    started = time.perf_counter()
    _write(directory, items)
    write_seconds = time.perf_counter() - started
    file_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    runs = []
    for _ in range(3):
      out = subprocess.run([_common.python(), __file__, "--read", directory], check=True, capture_output=True,
                           text=True, env=_common.child_env(), cwd=_common.REPO_DIR, timeout=600)
      runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  seconds = _common.median([r["seconds"] for r in runs])
  extra = _common.median([r["extra_rss_bytes"] for r in runs])
  reporter.measurement(items=items, file_bytes=file_bytes, write_seconds=_common.rounded(write_seconds),
                       read_seconds=_common.rounded(seconds), extra_rss_bytes=int(extra),
                       extra_over_file_bytes=_common.rounded(extra / file_bytes))
  checks = [
      _common.check(f"restore of {items:,} pending items, s", _common.rounded(seconds), "<= 3", seconds <= 3),
      _common.check("its extra memory / the item's bytes", _common.rounded(extra / file_bytes), "<= 2",
                    extra / file_bytes <= 2),
  ]
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  sys.path.insert(0, _common.REPO_DIR)
  if len(sys.argv) == 3 and sys.argv[1] == "--read":
    print(json.dumps(_read_in_this_process(sys.argv[2])))
  else:
    main()
