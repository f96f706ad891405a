"""Changing the run between restarts: every record trained exactly once per epoch (docs/changing_the_run.md).

One property draws a run of chained restarts. Each segment of the run has
its own process count (1, 2, 4 or 8), global batch (G, 2G or G/2) and
length; a mixture's segments also their weights and sources. The
"processes" of a segment are iterators built with shard_index/shard_count,
saved into and restored from real item files by the Orbax handler
(`elastic=True`, with the saved and any other count). What the run trained,
global batch after global batch (the processes' rows in process order), is
compared with an oracle built independently of the restarts:

  * plain, shards (Grain's shuffle, the shard-aware one): the stream of one
    uninterrupted single-process run, cut by the documented rule (batches keep to their epoch; a rest shorter than the
    batch in effect at the epoch's end is dropped);
  * filter, pack: the rows each lane gives in an uninterrupted single-process
    run; a global batch takes G/num_lanes rows from each lane in order;
  * a mixture whose weights and sources change (Grain's shuffle or the
    shard-aware one): each source's own stream, read in order from its first record.

It then counts, per source record and epoch, how often it was trained:
duplicates and skips (beyond the documented epoch rests and the stream's
end) must both be 0. `make test` draws a few runs per pipeline; `make
test-full` draws many (`test_..._long`).
"""

import collections
import os
import tempfile

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import dataset as dataset_lib

import support

BASE_BATCH = 16  # G; a segment uses G/2, G or 2G
LANES = 8
SEED = 3
_RECORDS = [{"id": i, "size": 1 + (i * 7) % 3} for i in range(40)]
_SOURCES = {"a": [{"id": 1000 + i, "size": 1} for i in range(40)],
            "b": [{"id": 2000 + i, "size": 1} for i in range(28)],
            "c": [{"id": 3000 + i, "size": 1} for i in range(24)]}


def keep(record):
  return record["id"] % 3 != 0


pack_by_size = support.pack_ids_by_size


def grain_pack(dataset):
  return pack_by_size(list(dataset))


# ---------------------------------------------------------------------------
# One segment of a run: its pipeline for process `index` of `count`.


def _pipeline(kind, index, count, global_batch, mixture=None):
  common = dict(batch_size=global_batch // count, seed=SEED, shard_index=index, shard_count=count)
  if kind == "plain":
    return ckpt_iter.make_dataset(_RECORDS, num_epochs=2, **common)
  if kind == "shards":  # the shard-aware shuffle: 7 shards (the last of 4 records), 3 to a window
    return ckpt_iter.make_dataset(_RECORDS, num_epochs=2, shuffle="shards", shard_size=6, shuffle_window=3,
                                  **common)
  if kind == "filter":
    return ckpt_iter.make_dataset(_RECORDS, num_epochs=None, filter=keep, chunk_size=5, num_lanes=LANES, **common)
  if kind == "pack":
    return ckpt_iter.make_dataset(_RECORDS, num_epochs=None, pack=grain_pack, chunk_size=6, num_lanes=LANES,
                                  **common)
  sources = {name: _SOURCES[name] for name in mixture}
  return ckpt_iter.make_dataset(sources, weights=mixture, num_epochs=None, **common, **_MIX_SHUFFLE[kind])


def _rows(batch):
  """A batch's rows, each as the record ids it holds (a packed row holds several)."""
  if "ids" in batch:
    return [[int(v) for v in row if v >= 0] for row in np.asarray(batch["ids"])]
  return [[int(v)] for v in np.asarray(batch["id"]).reshape(-1)]


@st.composite
def _runs(draw, kind):
  segments = []
  for _ in range(draw(st.integers(1, 4), label="segments")):
    global_batch = draw(st.sampled_from([BASE_BATCH // 2, BASE_BATCH, 2 * BASE_BATCH]))
    count = draw(st.sampled_from([n for n in (1, 2, 4, 8) if global_batch % n == 0]))
    mixture = None
    if kind in _MIX_SHUFFLE:
      names = draw(st.sampled_from([("a", "b"), ("a", "b", "c"), ("b", "c"), ("a", "c")]))
      mixture = {name: draw(st.sampled_from([1, 2, 3])) for name in names}
    segments.append((count, global_batch, draw(st.integers(0, 5), label="batches"), mixture))
  return segments


def _run(kind, segments, directory):
  """Trains the segments with a save after each and a restore before the next; the global batches."""
  trained = []
  for number, (count, global_batch, batches, mixture) in enumerate(segments):
    iterators = [ckpt_iter.DataIterator(_pipeline(kind, i, count, global_batch, mixture)) for i in range(count)]
    if number:
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
            os.path.join(directory, str(number - 1)),
            ckpt_iter.IteratorRestore(iterator, elastic=True, allow_drift={"weights", "sources"}))
    for _ in range(batches):
      try:
        local = [next(iterator) for iterator in iterators]
      except StopIteration:
        break
      trained.append([row for batch in local for row in _rows(batch)])
    step = os.path.join(directory, str(number))
    os.makedirs(step)  # Orbax makes the item directory; the handler writes into it
    for index, iterator in enumerate(iterators):
      checkpoint_lib.IteratorCheckpointHandler(index, count).save(step, ckpt_iter.IteratorSave(iterator))
  return trained


# ---------------------------------------------------------------------------
# Oracles, built without restarts.


def _stream(kind):
  """The uninterrupted single-process stream: records as rows (plain), or each lane's rows (filter, pack)."""
  if kind in _RECORD_STREAMS:
    return [row for b in ckpt_iter.DataIterator(_pipeline(kind, 0, 1, 1)) for row in _rows(b)]
  lanes = [[] for _ in range(LANES)]
  iterator = ckpt_iter.DataIterator(_pipeline(kind, 0, 1, LANES))
  for _ in range(_MAX_LANE_ROWS):  # one row per lane and batch; the stream has no end
    for lane, row in enumerate(_rows(next(iterator))):
      lanes[lane].append(row)
  return lanes


_STREAMS = {}
# A mixture's sources under Grain's shuffle or the shard-aware one (each source its own shards and order).
_MIX_SHUFFLE = {"mix": {}, "mix_shards": dict(shuffle="shards", shard_size=5, shuffle_window=2)}
_RECORD_STREAMS = ("plain", "shards")  # one record per row, cut by the batch plan
_MAX_LANE_ROWS = 4 * 5 * 2 * BASE_BATCH // LANES  # rows per lane a run can take: 4 segments x 5 batches of 2G


def _lane_streams(kind):
  if kind not in _STREAMS:  # built once per session: it is the slow part of a check
    _STREAMS[kind] = _stream(kind)
  return _STREAMS[kind]


def _oracle(kind, segments):
  """What the run must train: the uninterrupted stream cut into the segments' global batches."""
  stream = _lane_streams(kind)
  if kind in _RECORD_STREAMS:
    return _epoch_batches(stream, len(_RECORDS), [(g, b) for _, g, b, _ in segments])
  batches, taken = [], [0] * LANES
  for _, global_batch, count, _ in segments:
    rows = global_batch // LANES
    for _ in range(count):
      batches.append([row for lane in range(LANES) for row in stream[lane][taken[lane]:taken[lane] + rows]])
      taken = [t + rows for t in taken]
  return batches


def _epoch_batches(stream, epoch_length, segments):
  """Batches of the documented rule: they keep to their epoch; a rest shorter than the batch is
  passed over when the next batch is read from the next epoch (at the stream's end nothing is
  read, and a restart with a smaller batch may still read it)."""
  batches, record = [], 0
  for batch_size, count in segments:
    for _ in range(count):
      start = record
      while start < len(stream) and (start // epoch_length + 1) * epoch_length - start < batch_size:
        start = (start // epoch_length + 1) * epoch_length
      if start >= len(stream):
        break
      batches.append(stream[start:start + batch_size])
      record = start + batch_size
  return batches


def _source_stream(kind, name, length):
  """A mixture source's own stream: its records, epoch after epoch, each epoch its own permutation."""
  seed = dataset_lib.source_seed(SEED, name)
  single = ckpt_iter.make_dataset(_SOURCES[name], batch_size=1, seed=seed, num_epochs=None, shard_index=0,
                                  shard_count=1, **_MIX_SHUFFLE[kind])
  iterator = ckpt_iter.DataIterator(single)
  return [_rows(next(iterator))[0] for _ in range(length)]


# ---------------------------------------------------------------------------
# Duplicates and skips, counted per source record and epoch.

COUNTS = collections.Counter()  # over the session, per pipeline: runs, rows trained, duplicates, skips


def _matched(trained, stream, pointer=0):
  """(duplicates, skips, pointer after) of `trained` rows against the `stream` they should follow.

  Walks the stream from `pointer`: a trained row found ahead of it skips the
  rows in between (each a skip); a row not found ahead of it was trained
  again (a duplicate).
  """
  duplicates = skips = 0
  for row in trained:
    ahead = next((i for i in range(pointer, len(stream)) if stream[i] == row), None)
    if ahead is None:
      duplicates += 1
      continue
    skips += ahead - pointer
    pointer = ahead + 1
  return duplicates, skips, pointer


def _duplicates_and_skips(kind, segments, trained):
  """Counted against the uninterrupted streams, each record of each epoch by itself."""
  if kind in _RECORD_STREAMS:
    return _plain_duplicates_and_skips(kind, segments, trained)
  if kind in _MIX_SHUFFLE:
    totals = [0, 0]
    for name in {n for _, _, _, mixture in segments for n in mixture}:
      rows = [row for batch in trained for row in batch if row[0] // 1000 == ord(name) - ord("a") + 1]
      for i, value in enumerate(_matched(rows, _source_stream(kind, name, len(rows) + 1))[:2]):
        totals[i] += value
    return tuple(totals)
  totals, offset = [0, 0], 0
  per_lane = [[] for _ in range(LANES)]
  for batch, (_, global_batch, _, _) in zip(trained, _segment_of_each(segments)):
    rows = global_batch // LANES
    for lane in range(LANES):
      per_lane[lane].extend(batch[lane * rows:(lane + 1) * rows])
  del offset
  for lane in range(LANES):
    for i, value in enumerate(_matched(per_lane[lane], _lane_streams(kind)[lane])[:2]):
      totals[i] += value
  return tuple(totals)


def _plain_duplicates_and_skips(kind, segments, trained):
  """(duplicates, skips) of a plain run against the uninterrupted stream of its epochs.

  The stream holds each record once per epoch, so a record alone does not say
  where it is: the walk goes batch by batch. A batch that does not start at
  the pointer may start at the next epoch's first record only where the
  epoch's rest is shorter than the batch (the documented rule: not a skip);
  anything else is matched row by row (`_matched`).
  """
  stream, epoch = _lane_streams(kind), len(_RECORDS)
  duplicates = skips = pointer = 0
  for batch, (_, global_batch, _, _) in zip(trained, _segment_of_each(segments)):
    next_epoch = (pointer // epoch + 1) * epoch
    if (stream[pointer:pointer + len(batch)] != batch and next_epoch - pointer < global_batch
        and stream[next_epoch:next_epoch + len(batch)] == batch):
      pointer = next_epoch  # the epoch's rest, passed over by the rule
    found_duplicates, found_skips, pointer = _matched(batch, stream, pointer)
    duplicates, skips = duplicates + found_duplicates, skips + found_skips
  return duplicates, skips


def _segment_of_each(segments):
  """The segment of every global batch the run trained, in order."""
  for segment in segments:
    for _ in range(segment[2]):
      yield segment


def _check(kind, segments):
  with tempfile.TemporaryDirectory() as directory:
    trained = _run(kind, segments, directory)
  if kind in _MIX_SHUFFLE:
    names = {n for _, _, _, mixture in segments for n in mixture}
    for name in names:
      got = [row for batch in trained for row in batch if row[0] // 1000 == ord(name) - ord("a") + 1]
      assert got == _source_stream(kind, name, len(got)), f"source {name} skipped or repeated a record"
  else:
    assert trained == _oracle(kind, segments)
  duplicates, skips = _duplicates_and_skips(kind, segments, trained)
  COUNTS.update({f"{kind} runs": 1, f"{kind} rows": sum(map(len, trained)),
                 f"{kind} duplicates": duplicates, f"{kind} skips": skips})
  assert (duplicates, skips) == (0, 0)


_PIPELINES = ["plain", "shards", "filter", "pack", "mix", "mix_shards"]


@pytest.mark.parametrize("kind", _PIPELINES)
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(data=st.data())
def test_any_process_count_and_global_batch_train_every_record_once(kind, data):
  _check(kind, data.draw(_runs(kind), label="segments"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", _PIPELINES)
@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(data=st.data())
def test_any_process_count_and_global_batch_train_every_record_once_long(kind, data):
  _check(kind, data.draw(_runs(kind), label="segments"))


def test_the_counts_are_reported():
  """Prints the session's duplicate and skip counts (run with -s to see them)."""
  for kind in _PIPELINES:
    _check(kind, [(1, BASE_BATCH, 2, {"a": 1, "b": 1} if kind in _MIX_SHUFFLE else None),
                  (2, BASE_BATCH // 2, 3, {"a": 3, "b": 1, "c": 1} if kind in _MIX_SHUFFLE else None)])
  print({k: v for k, v in sorted(COUNTS.items())})
  assert all(v == 0 for k, v in COUNTS.items() if k.endswith(("duplicates", "skips")))
