"""A packed mixture reweighted and given sources at restarts: every record of every source trained once.

Lanes read chunks at different stream records, so new weights take effect
after the furthest chunk any lane reached (`ckpt_iter/_lane_mixture.py`). A
drawn run of segments, each with its own process count, global batch, batches,
weights and sources (a source may join; each save is followed by up to two
batches read and lost, as a preemption loses them), restored by the Orbax
handler from real item files. Checked against oracles built apart from the
restarts:

  * no record id trained twice (the sources are long enough not to wrap);
  * every lane's rows are the rows an uninterrupted one-process run gives under
    the shares the run's last state records, lane after lane, G/8 rows a batch:
    rows read before a restart were mixed as the later state says, so no
    segment took effect where a lane had read;
  * under those shares every source gives its records in its own order, each
    index once, none passed over (0 skips).
"""

import collections
import os
import tempfile

import hypothesis
from hypothesis import strategies as st
import numpy as np

import ckpt_iter
from ckpt_iter import _item
from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import checkpoint as checkpoint_lib

import support

LANES, CHUNK, SEED = 8, 6, 3
_SOURCES = {name: [{"id": base + i, "size": 1 + (i * 7) % 3} for i in range(1500)]
            for name, base in (("a", 10_000), ("b", 20_000), ("c", 30_000))}


pack_by_size = support.pack_ids_by_size


def _pipeline(weights, index, count, global_batch):
  return ckpt_iter.make_dataset({name: _SOURCES[name] for name in weights}, weights=weights, num_epochs=None,
                                batch_size=global_batch // count, seed=SEED, shard_index=index, shard_count=count,
                                pack=pack_by_size, chunk_size=CHUNK, num_lanes=LANES)


def _rows(batch):
  return [tuple(int(v) for v in row if v >= 0) for row in np.asarray(batch["ids"])]


@st.composite
def _runs(draw):
  names = list(draw(st.sampled_from([("a",), ("a", "b"), ("b", "a")])))
  segments = []
  for _ in range(draw(st.integers(2, 4), label="segments")):
    if draw(st.booleans()) and len(names) < 3:
      names.append(next(n for n in "abc" if n not in names))
    weights = {name: draw(st.integers(1, 3)) for name in names}
    global_batch = draw(st.sampled_from([LANES, 2 * LANES]))
    count = draw(st.sampled_from([1, 2, 4, 8]))
    segments.append((weights, count, global_batch, draw(st.integers(0, 5)), draw(st.integers(0, 2))))
  return segments


def _run(segments, directory):
  """The global batches trained (the processes' rows in process order) and the last saved data state."""
  trained, last = [], None
  for number, (weights, count, global_batch, batches, lost) in enumerate(segments):
    iterators = [ckpt_iter.DataIterator(_pipeline(weights, i, count, global_batch)) for i in range(count)]
    if number:
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
            os.path.join(directory, str(number - 1)),
            ckpt_iter.IteratorRestore(iterator, elastic=True, allow_drift={"weights", "sources"}))
    for _ in range(batches):
      trained.append([row for iterator in iterators for row in _rows(next(iterator))])
    step = os.path.join(directory, str(number))
    os.makedirs(step)
    for index, iterator in enumerate(iterators):
      checkpoint_lib.IteratorCheckpointHandler(index, count).save(step, ckpt_iter.IteratorSave(iterator))
    last = _item.read_item(step, 0, count).value
    for _ in range(lost):  # read after the save, lost with the process
      for iterator in iterators:
        next(iterator)
  return trained, last


def _lane_rows(weights, schedule, rows_per_lane):
  """Each lane's first rows in an uninterrupted one-process run under `schedule`."""
  lanes = iter(_pipeline(weights, 0, 1, LANES))
  position = {_records.FIRST_LANE: 0, _records.LANES: [[0, 0]] * LANES}
  if not schedule.is_initial:
    position[_lane_mixture.MIXTURE] = schedule.to_json()
  lanes.set_state(position)
  per_lane = [[] for _ in range(LANES)]
  for _ in range(rows_per_lane):
    for lane, row in enumerate(_rows(next(lanes))):
      per_lane[lane].append(row)
  return per_lane


def _check(segments):
  with tempfile.TemporaryDirectory() as directory:
    trained, last = _run(segments, directory)
  ids = collections.Counter(i for batch in trained for row in batch for i in row)
  assert [i for i, n in ids.items() if n > 1] == []

  weights = segments[-1][0]
  schedule = _lane_mixture.of(_records.shares_of(last.fingerprint), last.position, origin="the last state")
  expected = _lane_rows(weights, schedule, sum(b * g // LANES for _, _, g, b, _ in segments))
  taken = [0] * LANES
  for batch, (_, _, global_batch, _, _) in zip(trained, (s for s in segments for _ in range(s[3]))):
    per = global_batch // LANES
    assert batch == [row for lane in range(LANES) for row in expected[lane][taken[lane]:taken[lane] + per]]
    taken = [t + per for t in taken]

  # Under those shares each source gives its own records in order, every index once, from its first.
  given = collections.defaultdict(list)
  for record in range(max(s.since_record for s in schedule.segments) + 50 * CHUNK):
    name, index = schedule.source_of(record)
    given[name].append(index)
  assert all(indices == list(range(len(indices))) for indices in given.values())
  assert all(s.since_record % CHUNK == 0 for s in schedule.segments)  # a change starts at a chunk's first record


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(data=st.data())
def test_a_packed_mixture_reweighted_or_grown_at_restarts_trains_every_record_once(data):
  _check(data.draw(_runs(), label="segments"))


@hypothesis.example(segments=[({"a": 1, "b": 1}, 2, 16, 3, 2), ({"a": 1, "b": 3}, 4, 16, 2, 1),
                              ({"a": 1, "b": 3, "c": 2}, 1, 8, 3, 0), ({"a": 2, "b": 1, "c": 2}, 8, 16, 2, 0)])
@hypothesis.settings(max_examples=1, deadline=None)
@hypothesis.given(segments=_runs())
def test_the_documented_chain_of_a_packed_mixture(segments):
  _check(segments)
