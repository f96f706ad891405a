"""make_dataset(shuffle="shards", shard_lanes=V), drawn: chained restarts under other process counts.

Hypothesis draws the source (its length and shard size), the window, the lanes V and the rows each lane
gives a global batch, and a chain of segments, each with a process count (any divisor of the global batch,
dividing V or not) and a number of batches; every restart goes through the real checkpoint handler with
`elastic=True`. Over what every segment trained it counts duplicates and skips per epoch (none), holds the
stream to the order's own function, holds `which` and the data map of the last state to what was yielded,
and, where the process count divides V, holds every process's records to its lanes' share of the epoch
(what its host downloads); where it does not, the run is still exact (and the lanes were only a hint).
"""

import collections
import os

import hypothesis
from hypothesis import strategies as st
import numpy as np

import ckpt_iter
from ckpt_iter import _permutation
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import datamap
import support

# 25 examples in `make test`; 200 with HYPOTHESIS_PROFILE=long.
_EXAMPLES = hypothesis.settings(
    max_examples=200 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 25, deadline=None)
_SEED = 11


def _ids(batch):
  return [int(v) for v in np.asarray(batch["id"]).reshape(-1)]


@st.composite
def _runs(draw):
  lanes = draw(st.integers(2, 6), label="shard_lanes")
  lane_rows = draw(st.integers(1, 3), label="rows per lane")
  global_batch = lanes * lane_rows
  length = draw(st.integers(global_batch, 90), label="source length")
  shard_size = draw(st.integers(1, max(1, length // 3)), label="shard_size")
  window = draw(st.integers(1, 3), label="shuffle_window")
  divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
  segment = st.tuples(st.sampled_from(divisors), st.integers(1, 12))
  segments = draw(st.lists(segment, min_size=1, max_size=4), label="segments (processes, batches)")
  return lanes, lane_rows, length, shard_size, window, segments


def _pipeline(records, lanes, global_batch, shard_size, window, index, count):
  return ckpt_iter.make_dataset(records, batch_size=global_batch // count, seed=_SEED, num_epochs=None,
                                shard_index=index, shard_count=count, shuffle="shards", shard_size=shard_size,
                                shuffle_window=window, shard_lanes=lanes)


@_EXAMPLES
@hypothesis.given(run=_runs())
def test_chained_restarts_under_other_process_counts_train_each_record_once_an_epoch(tmp_path_factory, run):
  lanes, lane_rows, length, shard_size, window, segments = run
  global_batch = lanes * lane_rows
  records = [{"id": i} for i in range(length)]
  order = _permutation.ShardShuffle(_permutation.block_offsets(length, shard_size), window, _SEED, lanes, lane_rows)
  root = tmp_path_factory.mktemp("lanes")
  trained, per_process, step = [], [], None
  for number, (count, batches) in enumerate(segments):
    pipelines = [_pipeline(records, lanes, global_batch, shard_size, window, i, count) for i in range(count)]
    iterators = support.pod_iterators(pipelines, step)
    for _ in range(batches):
      rows = [_ids(next(iterator)) for iterator in iterators]
      trained.append([i for part in rows for i in part])
      per_process.append((len(trained) - 1, count, rows))
    answer = ckpt_iter.which(pipelines[0], iterators[0].state())
    assert [r.index for r in answer.records] == trained[-1]
    step = str(root / str(number))
    os.makedirs(step)
    for index, iterator in enumerate(iterators):
      checkpoint_lib.IteratorCheckpointHandler(index, count).save(step, ckpt_iter.IteratorSave(iterator))
  flat = [i for batch in trained for i in batch]
  # One stream, the order's, whoever read it at whatever process count: each epoch's batches, its last
  # short one dropped (drop_remainder=True: the epoch's last length % global_batch records).
  kept = length // global_batch * global_batch
  stream_records = [e * length + o for e in range(len(flat) // kept + 1) for o in range(kept)][:len(flat)]
  assert flat == [order.source(g) for g in stream_records]
  epochs = [collections.Counter(flat[e * kept:(e + 1) * kept]) for e in range(len(flat) // kept + 1)]
  duplicates = sum(c - 1 for counts in epochs for c in counts.values() if c > 1)
  dropped = [{order.source(e * length + o) for o in range(kept, length)} for e in range(len(flat) // kept)]
  skipped = sum(len(set(range(length)) - set(counts) - drop) for counts, drop in zip(epochs, dropped))
  hypothesis.note(f"trained {len(flat)} records, duplicates {duplicates}, skipped {skipped}")
  assert duplicates == 0 and skipped == 0
  # The state alone says the same.
  value = iterators[0].state()
  stream = datamap.RecordStream(value.fingerprint, value.position)
  assert stream.source_indices(stream_records)[0] == flat
  # A process of a count dividing the lanes reads its lanes' share of each epoch only.
  for number, count, rows in per_process:
    if lanes % count:
      continue
    for index, part in enumerate(rows):
      first_lane, last_lane = index * lanes // count, (index + 1) * lanes // count
      for row, record in enumerate(part):
        epoch = stream_records[number * global_batch + index * len(part) + row] // length
        reading = [r for s in order.plan(epoch).order for r in range(order.offsets[s], order.offsets[s + 1])]
        assert record in reading[order.lane_starts[first_lane]:order.lane_starts[last_lane]]
