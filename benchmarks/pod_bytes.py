"""Q13: a mid-repeat data item across a pod — bytes written, save blocking, peak memory, restore reads.

Real JAX jobs of 1 and 2 processes on the CPU backend (`jax.distributed` on
127.0.0.1), each saving one Orbax step whose data item holds a pending GRPO
repeat at RL scale: 512 prompts x 8 generations = 4,096 rows of 512 prompt
tokens and 2,048 completion tokens (prompt ids int32 + mask bool, completion
ids int32 + mask bool + old and reference log-probs float32, advantages
float32: 5·P + 13·T + 4 bytes a row, 114 MiB). Every process holds the same
rows (Tunix's default: every process feeds the same batches); a second
2-process job holds different rows per process (a mesh that feeds each
process its own rows).

Per process, measured in the process that saves:
  * bytes it wrote into the item directory (its own files);
  * how long `CheckpointManager.save()` blocks (the writes finish in Orbax's
    background thread), and the item's own part of it (the handler's
    `async_save` until it hands Orbax the write), against one host copy of
    the same arrays: SAVES saves, each after a copy. A copy into freshly
    mapped pages costs ~15x one into pages already mapped, and which call
    gets fresh pages varies, so the ratio is of the fastest of each (both on
    mapped pages), with the medians beside it;
  * peak extra host memory from `save()` to `wait_until_finished()`
    (tracemalloc, which numpy reports its buffers to), against one copy; and,
    for comparison, the peak of the write as the item did it before (one host
    copy plus `np.savez` into memory, then written);
  * bytes read by a restore with the same count (N -> N) and by one process
    restoring the 2-process item (N -> M), counted by wrapping the storage
    layer's whole-file read.
Bytes per checkpoint for 64 and 1,024 processes are computed from the
measured per-process layout: one npz for the pod plus one header per
process now, one npz and one header per process before.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import _common

ROWS, PROMPT_TOKENS, COMPLETION_TOKENS = 4096, 512, 2048
QUICK_ROWS = 256
SAVES = 9  # timed saves per process, each after a timed host copy
COMPUTED_COUNTS = (64, 1024)


def _pending_item(rows: int, seed: int) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  p, t = PROMPT_TOKENS, COMPLETION_TOKENS
  return {
      "prompt_ids": rng.integers(0, 32_000, (rows, p), dtype=np.int32),
      "prompt_mask": rng.random((rows, p)) < 0.9,
      "completion_ids": rng.integers(0, 32_000, (rows, t), dtype=np.int32),
      "completion_mask": rng.random((rows, t)) < 0.9,
      "old_per_token_logps": rng.standard_normal((rows, t), dtype=np.float32),
      "ref_per_token_logps": rng.standard_normal((rows, t), dtype=np.float32),
      "advantages": rng.standard_normal((rows,), dtype=np.float32),
  }


class _Holder:
  """What IteratorSave takes: anything with .state()."""

  def __init__(self, value):
    self.value = value

  def state(self):
    return self.value


def _worker(config: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  count, index = config["num_processes"], config["process_id"]
  if count > 1:
    address = f"127.0.0.1:{config['port']}"
    jax.distributed.initialize(coordinator_address=address, coordinator_bind_address=address,
                               num_processes=count, process_id=index, initialization_timeout=60)
  from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top

  read = {"bytes": 0, "files": 0}
  original_read = _storage.read_bytes

  def counted_read(path, **kwargs):  # whatever _storage.read_bytes takes (max_bytes, writable)
    data = original_read(path, **kwargs)
    read["bytes"] += len(data)
    read["files"] += 1
    return data

  _storage.read_bytes = counted_read
  if config["phase"] == "save":
    return _save(config, index, count)
  return _restore(config, index, count, read)


def _save(config: dict, index: int, count: int) -> dict:
  import io  # pylint: disable=g-import-not-at-top
  import tracemalloc  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  item = _pending_item(config["rows"], 0 if config["same_data"] else index)
  one_copy = sum(a.nbytes for a in item.values())
  value = state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "bench"}, position={"next_index": 1},
      pending=state_lib.Pending(items=(item,), schedule=(0,)), counters={"train_steps": 1})
  # The item's write before this change: a host copy, then np.savez into memory.
  tracemalloc.start()
  base = tracemalloc.get_traced_memory()[0]
  copy = {k: np.array(v, copy=True) for k, v in item.items()}
  buffer = io.BytesIO()
  np.savez(buffer, **copy)
  before_peak = tracemalloc.get_traced_memory()[1] - base
  del copy, buffer
  tracemalloc.stop()

  handler_ms = []

  handler = ckpt_iter.IteratorCheckpointHandler()
  untimed = handler.async_save

  async def timed_async_save(directory, args):
    """The item's own part of save(): until it hands Orbax the write."""
    started = time.perf_counter()
    try:
      return await untimed(directory, args)
    finally:
      handler_ms.append((time.perf_counter() - started) * 1e3)

  handler.async_save = timed_async_save
  manager = ocp.CheckpointManager(
      config["root"], item_handlers={"data": handler},
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2))
  copies, blocking, item_blocking = [], [], []
  for step in range(1, SAVES + 1):  # interleaved: a host copy, then a save
    started = time.perf_counter()
    copy = {k: np.array(v, copy=True) for k, v in item.items()}
    copies.append((time.perf_counter() - started) * 1e3)
    del copy
    started = time.perf_counter()
    manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(_Holder(value))))
    blocking.append((time.perf_counter() - started) * 1e3)
    manager.wait_until_finished()
    item_blocking.append(handler_ms[-1])
  # Peak memory on a save of its own (tracemalloc slows what it traces).
  tracemalloc.start()
  base = tracemalloc.get_traced_memory()[0]
  manager.save(SAVES + 1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(_Holder(value))))
  manager.wait_until_finished()
  peak = tracemalloc.get_traced_memory()[1] - base
  tracemalloc.stop()
  manager.close()
  data_dir = os.path.join(config["root"], str(SAVES + 1), "data")  # the last step
  stem = f"process_{index}-of-{count}"
  written = {ext: os.path.getsize(os.path.join(data_dir, stem + ext))
             for ext in (".json", ".npz") if os.path.exists(os.path.join(data_dir, stem + ext))}
  return {
      "process_index": index, "process_count": count, "one_copy_bytes": one_copy,
      "header_bytes": written.get(".json", 0), "npz_bytes": written.get(".npz", 0),
      "blocking_ms": _common.median(blocking), "item_blocking_ms": _common.median(item_blocking),
      "host_copy_ms": _common.median(copies),
      # Fastest of each: both on host memory already mapped (a copy into fresh
      # pages costs ~15x more here, and which call gets them varies).
      "item_blocking_min_ms": min(item_blocking), "host_copy_min_ms": min(copies),
      "peak_extra_bytes": peak, "before_peak_extra_bytes": before_peak,
  }


def _restore(config: dict, index: int, count: int, read: dict) -> dict:
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _item as item_lib

  data_dir = os.path.join(config["root"], str(SAVES + 1), "data")  # the last step
  saved_count = _files.saved_process_count(data_dir)
  started = time.perf_counter()
  # What a Tunix learner reads (with another count: the state all saved processes share).
  saved = item_lib.read_item(data_dir, index, count, replicated=True)
  seconds = time.perf_counter() - started
  assert len(saved.value.pending) == 1
  return {"process_index": index, "process_count": count, "saved_count": saved_count,
          "read_bytes": read["bytes"], "read_files": read["files"], "restore_ms": seconds * 1e3}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _job(workdir: str, name: str, count: int, **config) -> list[dict]:
  """Runs `count` worker processes as one JAX job; returns each one's record."""
  port = _free_port()
  procs, outs = [], []
  for index in range(count):
    out = os.path.join(workdir, f"{name}_{index}.json")
    cfg = dict(config, port=port, num_processes=count, process_id=index, out=out)
    path = os.path.join(workdir, f"{name}_{index}.config.json")
    with open(path, "w") as f:
      json.dump(cfg, f)
    log = open(os.path.join(workdir, f"{name}_{index}.log"), "wb")  # pylint: disable=consider-using-with
    procs.append((subprocess.Popen([_common.python(), __file__, "--worker", path], env=_common.child_env(),
                                   cwd=_common.REPO_DIR, stdout=log, stderr=subprocess.STDOUT), log))
    outs.append(out)
  try:
    for index, (proc, _) in enumerate(procs):
      if proc.wait(timeout=600) != 0:
        with open(os.path.join(workdir, f"{name}_{index}.log"), errors="replace") as f:
          raise RuntimeError(f"{name}: worker {index} failed:\n{f.read()[-3000:]}")
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()
  results = []
  for out in outs:
    with open(out) as f:
      results.append(json.load(f))
  return results


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("pod_bytes", args.quick)
  rows = QUICK_ROWS if args.quick else ROWS
  workdir = tempfile.mkdtemp(prefix="bench_pod_bytes_")
  checks = []
  try:
    layouts = {}
    for name, count, same in (("one_process", 1, True), ("two_same_rows", 2, True), ("two_own_rows", 2, False)):
      root = os.path.join(workdir, name)
      saved = _job(workdir, f"{name}_save", count, phase="save", root=root, rows=rows, same_data=same)
      again = _job(workdir, f"{name}_restore", count, phase="restore", root=root)
      layouts[name] = saved
      one_copy = saved[0]["one_copy_bytes"]
      pending_written = sum(r["npz_bytes"] for r in saved)
      row = {
          "job": name, "processes": count, "same_rows": same, "rows": rows,
          "one_copy_bytes": one_copy, "pending_bytes_written": pending_written,
          "headers_bytes_written": sum(r["header_bytes"] for r in saved),
          "pending_written_over_one_copy": _common.rounded(pending_written / one_copy),
          "item_blocking_over_host_copy": _common.rounded(
              max(r["item_blocking_min_ms"] / r["host_copy_min_ms"] for r in saved)),
          "item_blocking_min_ms": _common.rounded(max(r["item_blocking_min_ms"] for r in saved)),
          "host_copy_min_ms": _common.rounded(max(r["host_copy_min_ms"] for r in saved)),
          "item_blocking_ms": _common.rounded(max(r["item_blocking_ms"] for r in saved)),
          "save_blocking_ms": _common.rounded(max(r["blocking_ms"] for r in saved)),
          "host_copy_ms": _common.rounded(max(r["host_copy_ms"] for r in saved)),
          "peak_over_one_copy": _common.rounded(max(r["peak_extra_bytes"] for r in saved) / one_copy),
          "before_peak_over_one_copy": _common.rounded(
              max(r["before_peak_extra_bytes"] for r in saved) / one_copy),
          "same_count_read_bytes_per_process": max(r["read_bytes"] for r in again),
      }
      if count > 1:
        (one,) = _job(workdir, f"{name}_to_one", 1, phase="restore", root=root) if same else (None,)
        row["to_one_process_read_bytes"] = one["read_bytes"] if one else None
      reporter.measurement(part="job", **row)
    same = layouts["two_same_rows"]
    npz, header = same[0]["npz_bytes"], max(r["header_bytes"] for r in same)
    for count in COMPUTED_COUNTS:
      reporter.measurement(part="computed", processes=count, bytes_now=npz + count * header,
                           bytes_before=count * (npz + header), one_copy_bytes=same[0]["one_copy_bytes"])
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  two = layouts["two_same_rows"]
  pending_ratio = sum(r["npz_bytes"] for r in two) / two[0]["one_copy_bytes"]
  checks.append(_common.check(
      "pending bytes per checkpoint across the pod (2 processes, same rows) / one copy",
      _common.rounded(pending_ratio), "<= 1.05", pending_ratio <= 1.05))
  every = [r for saved in layouts.values() for r in saved]
  blocking = max(r["item_blocking_min_ms"] / r["host_copy_min_ms"] for r in every)
  checks.append(_common.check("the item's part of save() blocking / one host copy of the pending rows",
                              _common.rounded(blocking), "<= 1.1", blocking <= 1.1))
  peak = max(r["peak_extra_bytes"] / r["one_copy_bytes"] for r in every)
  checks.append(_common.check("peak extra host memory during a save / one copy", _common.rounded(peak),
                              "<= 1.1", peak <= 1.1))
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  sys.path.insert(0, _common.REPO_DIR)
  if len(sys.argv) == 3 and sys.argv[1] == "--worker":
    with open(sys.argv[2]) as config_file:
      worker_config = json.load(config_file)
    result = _worker(worker_config)
    with open(worker_config["out"], "w") as out_file:
      json.dump(result, out_file)
    sys.stdout.flush()
    if worker_config["num_processes"] > 1:
      # Every record is written before any process exits (the first to go
      # takes the job's coordination service with it).
      from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
      multihost.get_jax_distributed_client().wait_at_barrier("pod_bytes_done", 120_000)
    os._exit(0)  # pylint: disable=protected-access
  main()
