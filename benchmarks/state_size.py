"""Q2: bytes per process of the state files, with no pending items.

For make_dataset pipelines (batch_size 8, seed 0, num_epochs None, a per-record
transform) over in-memory, JSONL (1 file and 16 shards) and Parquet sources,
the state header `process_0-of-1.json` that IteratorCheckpointHandler writes,
for a DataIterator and a RepeatIterator (num_repeats 2, shuffle_seed 0) at a
group boundary. In a full run also the data item of a toy Tunix GRPO
checkpoint at a global-step boundary (ResumableGRPOLearner).

Reports the size of what the process writes (its header file), of what is
written once per pod (the count file `ckpt_iter.json`: from format 5 it holds
the fingerprints and the lineage every process shares, which the header refers
to), of the whole header as readers see it (compact JSON), and the bytes of
each top-level field and of the largest fingerprint fields of the whole header.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import _common

import numpy as np

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib

TARGET_BYTES = 1024
NUM_RECORDS = 256


def tokenize(record):
  return {**record, "length": len(record["prompts"].split())}


def write_sources(directory: str) -> dict[str, object]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  records = [{"prompts": f"what is {i} plus {i}", "answer": str(2 * i)} for i in range(NUM_RECORDS)]
  jsonl = os.path.join(directory, "train.jsonl")
  with open(jsonl, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  shards = []
  for shard in range(16):
    path = os.path.join(directory, f"train-{shard:05d}-of-00016.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records[shard::16])
    shards.append(path)
  parquet = os.path.join(directory, "train.parquet")
  pq.write_table(pa.Table.from_pylist(records), parquet)
  return {"in_memory": records, "jsonl": jsonl, "jsonl_16_shards": shards, "parquet": parquet}


def data_iterator(source) -> ckpt_iter.DataIterator:
  dataset = ckpt_iter.make_dataset(
      source, batch_size=8, seed=0, num_epochs=None, shard_index=0, shard_count=1,
      transform=tokenize,
  )
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(3):
    next(iterator)
  return iterator


def repeat_iterator(source) -> ckpt_iter.RepeatIterator:
  produce = lambda batch: {"completion_ids": np.zeros((8, 16), np.int32)}  # pylint: disable=unnecessary-lambda-assignment
  iterator = ckpt_iter.RepeatIterator(
      data_iterator(source), produce=produce, num_repeats=2, group_size=1, shuffle_seed=0
  )
  for _ in range(2 * 3):  # three whole groups: at a boundary, nothing pending
    next(iterator)
  return iterator


def measure_file(directory: str) -> dict[str, object]:
  names = sorted(os.listdir(directory))
  path = os.path.join(directory, "process_0-of-1.json")
  header = _files.read_header(path)  # whole: with the pod part it refers to put back
  compact = lambda v: len(json.dumps(v, separators=(",", ":")).encode())  # pylint: disable=unnecessary-lambda-assignment
  fingerprint = header.get("fingerprint", {})
  largest = sorted(fingerprint.items(), key=lambda kv: -compact({kv[0]: kv[1]}))[:3]
  return {
      "state_bytes": os.path.getsize(path),
      "pod_bytes": os.path.getsize(os.path.join(directory, _files.COUNT_FILE)),
      "compact_json_bytes": compact(header),
      "files": names,
      "field_bytes": {k: compact({k: v}) - 2 for k, v in header.items()},
      "largest_fingerprint_fields": {k: compact({k: v}) - 2 for k, v in largest},
  }


def tunix_state(workdir: str) -> dict[str, object] | None:
  """The data item of a 2-step toy GRPO run (step 2: a global-step boundary)."""
  root = os.path.join(workdir, "tunix")
  config = {"learner": "ckpt_iter", "max_steps": 2, "num_iterations": 2}
  process = subprocess.run(
      [_common.python(), "-m", "demo.toyrun", "--root", root,
       "--out", os.path.join(workdir, "tunix.npz"), "--config", json.dumps(config)],
      env=_common.child_env(), capture_output=True, text=True, timeout=600,
  )
  if process.returncode != 0:
    raise RuntimeError(process.stderr[-2000:])
  return measure_file(os.path.join(root, "actor", "2", "data"))


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("state_size", args.quick)
  workdir = tempfile.mkdtemp(prefix="bench_state_size_")
  sources = write_sources(workdir)
  handler = checkpoint_lib.IteratorCheckpointHandler(process_index=0, process_count=1)
  rows = []
  for source_name, source in sources.items():
    for iterator_name, build in (("DataIterator", data_iterator), ("RepeatIterator", repeat_iterator)):
      directory = os.path.join(workdir, f"{source_name}_{iterator_name}")
      os.makedirs(directory)
      handler.save(directory, ckpt_iter.IteratorSave(build(source)))
      row = {"source": source_name, "iterator": iterator_name, **measure_file(directory)}
      rows.append(row)
      report.measurement(**row)
  if not args.quick:
    row = {"source": "in_memory (toy prompts)", "iterator": "ResumableGRPOLearner data item",
           **tunix_state(workdir)}
    rows.append(row)
    report.measurement(**row)
  shutil.rmtree(workdir, ignore_errors=True)
  checks = [
      _common.check(f"{r['source']} / {r['iterator']} state_bytes", r["state_bytes"],
                    f"<= {TARGET_BYTES} bytes", r["state_bytes"] <= TARGET_BYTES)
      for r in rows
  ]
  by_name = {(r["source"], r["iterator"]): r for r in rows}
  one_file = by_name[("jsonl", "DataIterator")]["field_bytes"]["fingerprint"]
  sixteen = by_name[("jsonl_16_shards", "DataIterator")]["field_bytes"]["fingerprint"]
  report.summary(
      checks,
      max_state_bytes=max(r["state_bytes"] for r in rows),
      fingerprint_bytes_per_extra_source_file=_common.rounded((sixteen - one_file) / 15, 3),
  )


if __name__ == "__main__":
  main()
