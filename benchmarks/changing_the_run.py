"""Q15: what a run that may change between restarts costs (docs/changing_the_run.md).

Three questions:

1. Throughput of the process-count-independent plan for filtering and
   packing (`make_dataset(filter=..., pack=..., num_lanes=8)`: fixed chunks of
   the stream, each filtered and packed as a unit, dealt to lanes) against the
   per-process pipeline it replaces (the same shuffled records through
   Grain's `filter` and the same Grain packer, `FirstFitPackIterDataset`, over
   the process's whole stream, then `batch`). Both on one process, global
   batch 16 rows of 64 tokens; blocks of batches alternate between the two
   (ABBA), and the ratio over the whole runs is reported in packed tokens per second
   (padding excluded: chunk boundaries flush the packer, so a row may hold
   fewer tokens) and in rows per second. Target: within 5%.
2. Restore time against the position, for a plain make_dataset pipeline
   (`next_record`) and a filtered and packed one (lane positions), at 10^2
   to 10^6 batches read: O(1), no replay.
3. State bytes per process (no pending items): plain, a mixture of three
   weighted sources after a reweight (its ledger), lanes on 1 and on 8
   processes. Target: under 1 KB.
4. Lanes after the pod shrank: a 256-host run's position (256 lanes, each one
   row into its chunk) restored on one process, its first batch (one row of
   each lane): CPU time and peak traced memory, with rows computed as a batch
   takes them against each chunk computed whole (what 0.2.x did; the same
   code asked for the whole list), in the same run; and the state's bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import tracemalloc

import _common

import grain
import numpy as np

import ckpt_iter
from ckpt_iter import _lanes
from ckpt_iter import checkpoint as checkpoint_lib

NUM_RECORDS = 4096
SEQ_LEN = 64
GLOBAL_BATCH = 16
NUM_LANES = 8
CHUNK = 256
NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def records() -> list[dict]:
  rng = np.random.default_rng(0)
  return [{"tokens": (np.arange(int(n)) + i).astype(np.int32)} for i, n in enumerate(rng.integers(4, 33, NUM_RECORDS))]


def keep(record) -> bool:
  return len(record["tokens"]) % 5 != 0


def packer(dataset):
  return grain.experimental.FirstFitPackIterDataset(
      dataset, length_struct={"tokens": SEQ_LEN}, num_packing_bins=4, shuffle_bins=False)


def padded(record) -> dict:
  """A record as a plain (unpacked) batch row: its tokens padded to 32."""
  tokens = np.zeros(32, np.int32)
  tokens[:len(record["tokens"])] = record["tokens"]
  return {"tokens": tokens}


def lanes_pipeline(data, *, shard_index=0, shard_count=1, global_batch=GLOBAL_BATCH):
  return ckpt_iter.make_dataset(
      data, batch_size=global_batch // shard_count, seed=1, num_epochs=None, filter=keep, pack=packer,
      chunk_size=CHUNK, num_lanes=NUM_LANES, shard_index=shard_index, shard_count=shard_count)


def per_process_pipeline(data):
  """What a user writes per process: shuffle, repeat, then Grain's filter, packer and batch on its stream."""
  dataset = grain.MapDataset.source(data).shuffle(seed=1).repeat(None).to_iter_dataset(NO_THREADS)
  return packer(dataset.filter(keep)).batch(GLOBAL_BATCH)


def tokens(batch) -> int:
  return int(np.count_nonzero(np.asarray(batch["tokens_segment_ids"])))


def block(iterator, batches: int) -> tuple[float, int]:
  started, count = time.perf_counter(), 0
  for _ in range(batches):
    count += tokens(next(iterator))
  return (time.perf_counter() - started) * 1e3, count


def throughput(report, quick: bool) -> list[dict]:
  data = records()
  iterators = {"lanes": ckpt_iter.DataIterator(lanes_pipeline(data)),
               "per_process": per_process_pipeline(data).__iter__()}
  batches, blocks = (20, 6) if quick else (60, 40)
  for iterator in iterators.values():
    block(iterator, batches)  # warm-up
  wall = {name: [] for name in iterators}
  tokens_per_block = {name: [] for name in iterators}
  for rep in range(blocks):
    for name in (["lanes", "per_process"] if rep % 2 == 0 else ["per_process", "lanes"]):
      ms, count = block(iterators[name], batches)
      wall[name].append(ms)
      tokens_per_block[name].append(count)
  # Over whole runs, not medians of blocks: a lane computes a chunk every few blocks (bursty).
  rows_ratio = sum(wall["per_process"]) / sum(wall["lanes"])
  token_rate = {name: sum(tokens_per_block[name]) / sum(wall[name]) * 1e3 for name in iterators}
  tokens_ratio = token_rate["lanes"] / token_rate["per_process"]
  for name in iterators:
    report.measurement(question="throughput", pipeline=name, block_batches=batches, blocks=blocks,
                       rows_per_second=_common.rounded(blocks * batches * GLOBAL_BATCH / sum(wall[name]) * 1e3),
                       tokens_per_second=_common.rounded(token_rate[name]),
                       fill=_common.rounded(sum(tokens_per_block[name]) / (blocks * batches * GLOBAL_BATCH * SEQ_LEN)))
  report.measurement(question="throughput", measure="ratio", rows_ratio=_common.rounded(rows_ratio),
                     tokens_ratio=_common.rounded(tokens_ratio))
  return [_common.check("lanes / per-process pipeline, packed tokens per second", f"{tokens_ratio:.3f}",
                        ">= 0.95", tokens_ratio >= 0.95, rows_ratio=f"{rows_ratio:.3f}")]


def restore_times(report, quick: bool) -> list[dict]:
  data = records()
  plain = lambda: ckpt_iter.make_dataset(data, batch_size=GLOBAL_BATCH, seed=1, num_epochs=None,
                                         shard_index=0, shard_count=1, transform=padded)
  cases = {"plain": (plain, lambda batches: {"next_record": batches * GLOBAL_BATCH}),
           "lanes": (lambda: lanes_pipeline(data), lambda batches: {
               "first_lane": 0, "lanes": [[batches * 2 // NUM_LANES, 1] for _ in range(NUM_LANES)]})}
  template = ckpt_iter.DataIterator(plain()).get_state()
  lanes_template = ckpt_iter.DataIterator(lanes_pipeline(data)).get_state()
  checks = []
  for name, (build, position) in cases.items():
    base = template if name == "plain" else lanes_template
    medians = {}
    for batches in (10**2, 10**4, 10**6):
      state = {**base, "position": position(batches), "content": "null"}
      times = []
      for _ in range(3 if quick else 7):
        iterator = ckpt_iter.DataIterator(build())
        started = time.perf_counter()
        iterator.set_state(state)
        next(iterator)  # the first batch after it: a lane recomputes its chunk here
        times.append((time.perf_counter() - started) * 1e3)
      medians[batches] = _common.median(times)
      report.measurement(question="restore", pipeline=name, batches_read=batches,
                         restore_and_first_batch_ms=_common.rounded(medians[batches]))
    ratio = medians[10**6] / medians[10**2]
    checks.append(_common.check(f"{name}: restore at 10^6 batches / at 10^2 (restore and first batch)",
                                f"{ratio:.2f}", "<= 2 (O(1): no replay)", ratio <= 2))
  return checks


def state_sizes(report) -> list[dict]:
  data = records()
  sources = {"web": data[:2048], "code": data[2048:3072], "math": data[3072:]}
  mixture = lambda weights: ckpt_iter.make_dataset(
      sources, weights=weights, batch_size=GLOBAL_BATCH, seed=1, num_epochs=None, shard_index=0, shard_count=1,
      transform=padded)
  saved = ckpt_iter.DataIterator(mixture({"web": 0.6, "code": 0.3, "math": 0.1}))
  for _ in range(50):
    next(saved)
  reweighted = ckpt_iter.DataIterator(mixture({"web": 0.5, "code": 0.25, "math": 0.25}), allow_drift={"weights"})
  reweighted.set_state(saved.get_state())
  for _ in range(50):
    next(reweighted)
  cases = {
      "plain": [ckpt_iter.DataIterator(ckpt_iter.make_dataset(data, batch_size=GLOBAL_BATCH, seed=1, num_epochs=None,
                                                              shard_index=0, shard_count=1, transform=padded))],
      "mixture of 3, reweighted": [reweighted],
      "lanes, 1 process (8 lanes)": [ckpt_iter.DataIterator(lanes_pipeline(data))],
      "lanes, 8 processes (1 lane each)": [ckpt_iter.DataIterator(lanes_pipeline(data, shard_index=i, shard_count=8,
                                                                                  global_batch=GLOBAL_BATCH))
                                           for i in range(8)],
  }
  checks = []
  with tempfile.TemporaryDirectory() as directory:
    for name, iterators in cases.items():
      for iterator in iterators:
        if name != "mixture of 3, reweighted":
          for _ in range(20):
            next(iterator)
      step = os.path.join(directory, name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
      os.makedirs(step)
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, len(iterators)).save(step, ckpt_iter.IteratorSave(iterator))
      count = len(iterators)
      sizes = [os.path.getsize(os.path.join(step, f"process_{i}-of-{count}.json")) for i in range(count)]
      with open(os.path.join(step, f"process_0-of-{len(iterators)}.json")) as f:
        position = json.load(f)["position"]
      report.measurement(question="state_size", pipeline=name, max_bytes_per_process=max(sizes),
                         position_bytes=len(json.dumps(position, separators=(",", ":"))))
      checks.append(_common.check(f"{name}: state bytes per process", max(sizes), "< 1024", max(sizes) < 1024))
  return checks


SHRUNK_LANES = 256


@contextlib.contextmanager
def whole_chunks():
  """Each chunk computed whole when a lane starts it, as 0.2.x did (the same rows, all at once)."""
  as_needed = _lanes.LaneDataset.chunk_row_iter
  _lanes.LaneDataset.chunk_row_iter = lambda self, chunk, mixture=None: iter(list(as_needed(self, chunk, mixture)))
  try:
    yield
  finally:
    _lanes.LaneDataset.chunk_row_iter = as_needed


def shrunk_pod(report, quick: bool) -> list[dict]:
  data = records()
  build = lambda: ckpt_iter.make_dataset(
      data, batch_size=SHRUNK_LANES, seed=1, num_epochs=None, filter=keep, pack=packer, chunk_size=CHUNK,
      num_lanes=SHRUNK_LANES, shard_index=0, shard_count=1)
  state = ckpt_iter.DataIterator(build()).get_state()
  state["position"] = {"first_lane": 0, "lanes": [[3, 1] for _ in range(SHRUNK_LANES)]}
  results: dict[str, list[tuple[float, float]]] = {"as_needed": [], "whole_chunks": []}
  first_batches = {}
  for rep in range(2 if quick else 5):
    for name in (["as_needed", "whole_chunks"] if rep % 2 == 0 else ["whole_chunks", "as_needed"]):
      with whole_chunks() if name == "whole_chunks" else contextlib.nullcontext():
        iterator = ckpt_iter.DataIterator(build())
        tracemalloc.start()
        started = time.process_time()
        iterator.set_state(state)
        first = next(iterator)
        cpu_ms = (time.process_time() - started) * 1e3
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
      first_batches[name] = first
      results[name].append((cpu_ms, peak / 2**20))
  np.testing.assert_array_equal(first_batches["as_needed"]["tokens"], first_batches["whole_chunks"]["tokens"])
  medians = {name: (_common.median([cpu for cpu, _ in runs]), _common.median([mib for _, mib in runs]))
             for name, runs in results.items()}
  with tempfile.TemporaryDirectory() as step:
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(step, ckpt_iter.IteratorSave(iterator))
    state_bytes = os.path.getsize(os.path.join(step, "process_0-of-1.json"))
  for name, (cpu_ms, mib) in medians.items():
    report.measurement(question="shrunk_pod", rows=name, lanes=SHRUNK_LANES, chunk_size=CHUNK,
                       first_batch_cpu_ms=_common.rounded(cpu_ms), peak_mib=_common.rounded(mib),
                       state_bytes=state_bytes)
  ratio = medians["as_needed"][0] / medians["whole_chunks"][0]
  return [_common.check("256 lanes on one process: first batch CPU, rows as needed / chunks whole", f"{ratio:.3f}",
                        "<= 0.25 (what the rows taken need, not the chunks)", ratio <= 0.25,
                        as_needed_ms=_common.rounded(medians["as_needed"][0]),
                        whole_chunks_ms=_common.rounded(medians["whole_chunks"][0]), state_bytes=state_bytes)]


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("changing_the_run", args.quick)
  checks = (throughput(report, args.quick) + restore_times(report, args.quick) + state_sizes(report)
            + shrunk_pod(report, args.quick))
  report.summary(checks)


if __name__ == "__main__":
  main()
