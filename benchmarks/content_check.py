"""What the content check costs: at save, a digest of the batch in memory; at restore, one batch produced again.

Pipelines (make_dataset, batch 32, a tokenizing transform that maps words
through a vocabulary and pads to a fixed length):
  * `jsonl_tok128`: a JSONL file, 128 tokens per row (16 KiB of int32 a batch);
  * `jsonl_tok2048`: the same with 2048 tokens per row (256 KiB a batch);
  * `memory_ids`: in-memory records whose transform only builds an id array,
    the cheapest batch to produce (the worst case for the ratio).
For each, interleaved repetitions of: producing one batch (`next`), the
digest a state taken now computes (`DataIterator.content()` on a fresh last
batch), and a restore at the same position with the check on and with
`check_content=False`, each alone and followed by the first batch (a fresh pipeline's first
batch is cold: with the check off the resume pays that there). Reported as ratios of medians
within one run.

Targets: the save adds at most 2% of one batch's production (tokenizing
pipelines); a resume (restore and first batch) adds at most one batch's
production (ratio <= 1.2, for noise).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import _common

import numpy as np

import ckpt_iter

BATCH = 32
WORDS = [f"w{i}" for i in range(5000)]
VOCABULARY = {w: i for i, w in enumerate(WORDS)}


def make_tokenize(length):
  def tokenize(record):
    ids = [VOCABULARY[w] for w in record["text"].split()][:length]
    tokens = np.zeros(length, np.int32)
    tokens[: len(ids)] = ids
    return {"tokens": tokens, "mask": tokens != 0, "id": record["id"]}
  return tokenize


def ids_only(record):
  return {"id": np.int64(record["id"])}


def write_jsonl(directory, length, rows=4096):
  path = os.path.join(directory, f"prompts_{length}.jsonl")
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(rows):
      f.write(json.dumps({"id": i, "text": " ".join(rng.choice(WORDS, length))}) + "\n")
  return path


def pipelines(directory):
  result = {}
  for length in (128, 2048):
    path = write_jsonl(directory, length, rows=2048 if length == 2048 else 4096)
    result[f"jsonl_tok{length}"] = lambda path=path, length=length: ckpt_iter.make_dataset(
        path, batch_size=BATCH, seed=0, num_epochs=None, shard_index=0, shard_count=1,
        transform=make_tokenize(length))
  records = [{"id": i} for i in range(4096)]
  result["memory_ids"] = lambda: ckpt_iter.make_dataset(
      records, batch_size=BATCH, seed=0, num_epochs=None, shard_index=0, shard_count=1, transform=ids_only)
  return result


def measure(name, build, repetitions):
  iterator = ckpt_iter.DataIterator(build())
  for _ in range(3):  # warm: the JSONL index, the first batches
    next(iterator)
  saved = iterator.state()
  produce, digest, restore_on, restore_off, resume_on, resume_off = [], [], [], [], [], []
  for _ in range(repetitions):
    started = time.perf_counter()
    next(iterator)
    produce.append(time.perf_counter() - started)
    started = time.perf_counter()
    iterator.content()  # the digest of the batch just produced (what a save computes)
    digest.append(time.perf_counter() - started)
    for check, samples, with_first in ((True, restore_on, resume_on), (False, restore_off, resume_off)):
      fresh = ckpt_iter.DataIterator(build(), check_content=check)
      started = time.perf_counter()
      fresh.restore_state(saved)
      samples.append(time.perf_counter() - started)
      next(fresh)  # a fresh pipeline's first batch is cold with the check off: the resume pays it there
      with_first.append(time.perf_counter() - started)
      fresh.close()
  med = {k: _common.median(v) * 1e3 for k, v in
         (("produce", produce), ("digest", digest), ("on", restore_on), ("off", restore_off),
          ("resume_on", resume_on), ("resume_off", resume_off))}
  return {
      "pipeline": name,
      "repetitions": repetitions,
      "batch_bytes": int(sum(np.asarray(v).nbytes for v in next(iterator).values())),
      "produce_ms": _common.rounded(med["produce"]),
      "digest_ms": _common.rounded(med["digest"]),
      "save_ratio": _common.rounded(med["digest"] / med["produce"]),
      "restore_on_ms": _common.rounded(med["on"]),
      "restore_off_ms": _common.rounded(med["off"]),
      "restore_extra_ms": _common.rounded(med["on"] - med["off"]),
      "restore_ratio": _common.rounded((med["on"] - med["off"]) / med["produce"]),
      "resume_on_ms": _common.rounded(med["resume_on"]),
      "resume_off_ms": _common.rounded(med["resume_off"]),
      "resume_ratio": _common.rounded((med["resume_on"] - med["resume_off"]) / med["produce"]),
  }


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("content_check", args.quick)
  repetitions = 15 if args.quick else 61
  rows = []
  with tempfile.TemporaryDirectory(prefix="content_check_") as directory:
    for name, build in pipelines(directory).items():
      row = measure(name, build, repetitions)
      report.measurement(**row)
      rows.append(row)
  realistic = [r for r in rows if r["pipeline"].startswith("jsonl")]
  checks = [
      _common.check("save: digest / one batch's production, tokenizing pipelines (max)",
                    max(r["save_ratio"] for r in realistic), "<= 0.02",
                    all(r["save_ratio"] <= 0.02 for r in realistic)),
      _common.check("resume (restore + first batch): extra time / one batch's production (max)",
                    max(r["resume_ratio"] for r in rows), "<= 1.2",
                    all(r["resume_ratio"] <= 1.2 for r in rows)),
  ]
  report.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
