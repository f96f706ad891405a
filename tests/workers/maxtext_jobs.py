"""Runs jobs of maxtext_worker.py (one `jax.distributed` job each) and reads back the rows they trained.

Shared by tests/maxtext: a job's workers write their outcome, then (with
`kill`) wait, unsaved, to be SIGKILLed together; every row each process held
is logged, decoded back to its records.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import process_group

WORKER = Path(__file__).resolve().parent / "maxtext_worker.py"
JOB_SECONDS = 240
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def write_parquet(path: Path, ids) -> None:
  """A Parquet file whose `text` column says each record's id first ("record 7 alpha beta")."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  rows = [{"text": f"record {i} " + " ".join(WORDS[: (i * 7 + i // 100) % 10 + 1])} for i in ids]
  pq.write_table(pa.Table.from_pylist(rows), path)


def run(directory: Path, name: str, processes: int, *, kill: bool, **settings) -> list[dict]:
  """One job of `processes` workers; with `kill`, SIGKILLed once every worker trained its unsaved step.

  `settings` go to every worker (maxtext_worker.py reads them): files, global_batch, side, ckpt_dir, steps...
  """
  port = process_group.free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(process_group.REPO), env.get("PYTHONPATH")]))
  workers, logs, outs = [], [], []
  try:
    for index in range(processes):
      out = directory / f"{name}_{index}.json"
      outs.append(out)
      config = dict(settings, port=port, num_processes=processes, process_id=index, out=str(out), kill=kill,
                    out_dir=str(directory / "out"), log=str(directory / f"{name}_rows_{index}.jsonl"))
      path = directory / f"{name}_{index}.config.json"
      path.write_text(json.dumps(config))
      log = open(directory / f"{name}_{index}.log", "wb")  # pylint: disable=consider-using-with
      logs.append(log)
      workers.append(subprocess.Popen([sys.executable, str(WORKER), str(path)], cwd=str(process_group.REPO),
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOB_SECONDS
    while not all(o.exists() for o in outs):
      if any(w.poll() not in (None, 0) for w in workers) or time.monotonic() > deadline:
        pytest.fail(f"{name}: {[w.poll() for w in workers]}\n{process_group.tails(directory, name, processes)}")
      time.sleep(0.2)
    results = [json.loads(o.read_text()) for o in outs]
    if kill and not any("refused" in r for r in results):
      for w in workers:
        w.send_signal(signal.SIGKILL)
      assert [w.wait() for w in workers] == [-signal.SIGKILL] * processes
    else:
      assert [w.wait(timeout=JOB_SECONDS) for w in workers] == [0] * processes, \
          process_group.tails(directory, name, processes)
    return results
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
      w.wait()
    for log in logs:
      log.close()


def batches(directory: Path, name: str, processes: int) -> dict[int, list[list[int]]]:
  """step -> the job's global batch: every row, in order, as the records packed in it."""
  rows: dict[int, dict[int, list[int]]] = collections.defaultdict(dict)
  for index in range(processes):
    path = directory / f"{name}_rows_{index}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else ():
      entry = json.loads(line)
      rows[entry["step"]].update({int(k): v for k, v in entry["rows"].items()})
  return {step: [held[j] for j in sorted(held)] for step, held in rows.items()}


def trained(directory: Path, name: str, processes: int, *, killed: bool) -> list[list[list[int]]]:
  """The global batches a job trained into the run: all but its last, unsaved one where it was killed."""
  by_step = batches(directory, name, processes)
  kept = sorted(by_step)[:-1] if killed else sorted(by_step)
  return [by_step[s] for s in kept]


def lanes(batches: list[list], num_lanes: int) -> list[list]:
  """Each lane's rows in order: a global batch of G rows takes G / num_lanes from every lane, in lane order."""
  by_lane: list[list] = [[] for _ in range(num_lanes)]
  for batch in batches:
    per_lane = len(batch) // num_lanes
    for lane in range(num_lanes):
      by_lane[lane].extend(batch[lane * per_lane:(lane + 1) * per_lane])
  return by_lane


def row_bytes(directory: Path, name: str) -> list[str]:
  """A one-process job's rows (with `dump_rows`), each as the SHA-256 of all its fields' bytes."""
  path = directory / f"{name}_rows_0.jsonl"
  return [d for line in path.read_text().splitlines() for d in json.loads(line)["digests"]]
