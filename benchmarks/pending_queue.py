"""Q14: a huge pending queue — restore time and memory against its bytes.

A repeat state with 100,000 pending items (each a dict of 32 int32 token ids
and one float32 log-prob, as a per-prompt rollout queue holds them) is
written as the handler writes it, then read back by `_files.read_state`
(the one read path of every restore) in a fresh process per measurement:
wall time, and peak resident memory over the process's baseline (VmHWM,
which counts what tracemalloc cannot: numpy's and zipfile's C buffers),
against the bytes of the item's files. Three repetitions, medians.

Cases, all in this one run:
  * `by_structure`: as written now (format 3: one stacked array per leaf);
  * `per_item`: the same queue as formats 1-2 stored it (one npz member per
    leaf, one JSON tree per item), which ckpt_iter still reads: the before;
  * `large_items`: 10,000 items of 2,048 tokens, where the bytes dominate.
And the floor no layout avoids: the restored queue's own Python objects (a
dict, an array view and a numpy scalar per item), built in a fresh process
from arrays already in memory.
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
LARGE_ITEMS, LARGE_TOKENS = 10_000, 2_048


def _items(count: int, tokens: int) -> tuple:
  import numpy as np  # pylint: disable=g-import-not-at-top

  return tuple({"ids": np.arange(tokens, dtype=np.int32) + i, "logp": np.float32(i)} for i in range(count))


def _write(directory: str, count: int, tokens: int, layout: str) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  items = _items(count, tokens)
  value = state_lib.IteratorState(kind="repeat", fingerprint={}, position={"next_index": 1},
                                  pending=state_lib.Pending(items=items, schedule=tuple(range(count))))
  header, arrays = codec.encode_state(value)
  if layout == "per_item":  # formats 1-2: one tree per item, one array per leaf
    arrays = {}
    header["format_version"] = 2  # the last format that stored pending items this way
    nodes = []
    for item in items:  # this queue's items as formats 1-2 stored them: a tree and an array per leaf
      arrays[f"a{len(arrays)}"] = item["ids"]
      arrays[f"a{len(arrays)}"] = np.asarray(item["logp"])
      nodes.append({"dict": {"ids": {"array": f"a{len(arrays) - 2}"},
                             "logp": {"array": f"a{len(arrays) - 1}", "scalar": True}}})
    header["pending"] = {"items": nodes, "schedule": list(range(count))}
    header["arrays"] = {name: {"dtype": a.dtype.str, "shape": list(a.shape)} for name, a in arrays.items()}
  _files.write_files(directory, header, arrays, process_index=0, process_count=1)


def _read_in_this_process(directory: str) -> dict:
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top

  before = _peak_rss_bytes()
  started = time.perf_counter()
  value = _files.read_state(directory, 0, 1)
  seconds = time.perf_counter() - started
  return {"seconds": seconds, "extra_rss_bytes": _peak_rss_bytes() - before, "items": len(value.pending.items)}


def _objects_in_this_process(count: int) -> dict:
  """The peak memory of the queue's Python objects alone, over arrays already in memory."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  ids = np.arange(count * 32, dtype=np.int32).reshape(count, 32)
  logps = np.arange(count, dtype=np.float32)
  before = _peak_rss_bytes()
  items = [{"ids": row, "logp": logp} for row, logp in zip(ids, logps)]
  schedule = tuple(range(count))
  extra = _peak_rss_bytes() - before
  return {"extra_rss_bytes": extra, "items": len(items), "schedule": len(schedule)}


def _peak_rss_bytes() -> int:
  """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across exec)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmHWM in /proc/self/status")


def _child(*args: str) -> dict:
  out = subprocess.run([_common.python(), __file__, *args], check=True, capture_output=True,
                       text=True, env=_common.child_env(), cwd=_common.REPO_DIR, timeout=600)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _case(reporter: _common.Reporter, name: str, count: int, tokens: int, layout: str) -> dict:
  directory = tempfile.mkdtemp(prefix="bench_pending_queue_")
  try:
    started = time.perf_counter()
    _write(directory, count, tokens, layout)
    write_seconds = time.perf_counter() - started
    file_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    runs = [_child("--read", directory) for _ in range(3)]
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  assert all(r["items"] == count for r in runs)
  result = {"case": name, "items": count, "tokens": tokens, "file_bytes": file_bytes,
            "write_seconds": _common.rounded(write_seconds),
            "read_seconds": _common.rounded(_common.median([r["seconds"] for r in runs])),
            "extra_rss_bytes": int(_common.median([r["extra_rss_bytes"] for r in runs]))}
  result["extra_over_file_bytes"] = _common.rounded(result["extra_rss_bytes"] / file_bytes)
  reporter.measurement(**result)
  return result


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("pending_queue", args.quick)
  items = QUICK_ITEMS if args.quick else ITEMS
  large = LARGE_ITEMS // 10 if args.quick else LARGE_ITEMS
  now = _case(reporter, "by_structure", items, 32, "by_structure")
  before = _case(reporter, "per_item", items, 32, "per_item")
  big = _case(reporter, "large_items", large, LARGE_TOKENS, "by_structure")
  floor = int(_common.median([_child("--objects", str(items))["extra_rss_bytes"] for _ in range(3)]))
  reporter.measurement(case="objects_floor", items=items, extra_rss_bytes=floor)
  beyond = (now["extra_rss_bytes"] - floor) / now["file_bytes"]
  checks = [
      _common.check(f"restore of {items:,} pending items, s", now["read_seconds"], "<= 3", now["read_seconds"] <= 3,
                    also=f"{before['read_seconds']} s as formats 1-2 stored them"),
      _common.check("restore time, formats 1-2 / format 3",
                    _common.rounded(before["read_seconds"] / now["read_seconds"]),
                    ">= 1", before["read_seconds"] >= now["read_seconds"]),
      _common.check("its extra memory beyond the queue's own objects / the item's bytes",
                    _common.rounded(beyond), "<= 2", beyond <= 2,
                    also=f"{now['extra_over_file_bytes']} with them"),
      _common.check(f"{large:,} items of {LARGE_TOKENS:,} tokens: extra memory / the item's bytes",
                    big["extra_over_file_bytes"], "<= 2", big["extra_over_file_bytes"] <= 2),
  ]
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  sys.path.insert(0, _common.REPO_DIR)
  if len(sys.argv) == 3 and sys.argv[1] == "--read":
    print(json.dumps(_read_in_this_process(sys.argv[2])))
  elif len(sys.argv) == 3 and sys.argv[1] == "--objects":
    print(json.dumps(_objects_in_this_process(int(sys.argv[2]))))
  else:
    main()
