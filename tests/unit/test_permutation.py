"""The order a make_dataset stream reads its source in (`_permutation`), without Grain's pipeline.

`shuffled` is Grain's per-epoch shuffle (`MapDataset.source(...).shuffle(seed)`)
computed from the index alone; `ShardShuffle` is shuffle="shards": each epoch a
permutation of the source's shards, cut into windows of `shuffle_window` shards
whose records are permuted among themselves. The properties below hold it a
bijection per epoch with the locality it promises. The dataset and the data map
over it: tests/unit/test_shard_shuffle.py.
"""

import pickle

import grain
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from ckpt_iter import _permutation

SEEDS = st.integers(0, 2**32 - 1)


def _epoch(order, epoch):
  return [order.source(epoch * order.length + p) for p in range(order.length)]


# ---------------------------------------------------------------------------
# Grain's shuffle, without Grain.



@pytest.mark.parametrize("length, seed", [(1, 0), (7, 3), (1000, 2**32 - 1), (23, 5)])
def test_the_permutation_is_grains_shuffle_in_every_epoch(length, seed):
  shuffled = grain.MapDataset.range(length).shuffle(seed=seed)
  for index in list(range(min(length, 50))) + [length, length + 1, 3 * length + length // 2]:
    # A range wraps: its value at index e*L + p is epoch e's record at p.
    assert _permutation.shuffled(index, length, seed) == shuffled[index]
    assert _permutation.epoch_function(index // length, length, seed)(index % length) == shuffled[index]


def test_the_public_path_gives_the_same(monkeypatch):
  monkeypatch.setattr(_permutation, "_compiled", lambda: None)
  shuffled = grain.MapDataset.range(9).shuffle(seed=4)
  assert [_permutation.shuffled(i, 9, 4) for i in range(30)] == [shuffled[i] for i in range(30)]
  assert [_permutation.epoch_function(2, 9, 4)(p) for p in range(9)] == [shuffled[18 + p] for p in range(9)]


def test_no_seed_is_the_source_order():
  assert [_permutation.shuffled(i, 5, None) for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]


# ---------------------------------------------------------------------------
# shuffle="shards".


@st.composite
def _layouts(draw):
  """Shard offsets: fixed blocks with a shorter last one, or files of uneven sizes."""
  if draw(st.booleans(), label="blocks"):
    length = draw(st.integers(1, 200), label="length")
    return _permutation.block_offsets(length, draw(st.integers(1, length), label="shard_size"))
  sizes = draw(st.lists(st.integers(1, 17), min_size=1, max_size=25), label="file sizes")
  return np.cumsum([0] + sizes).tolist()



@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(offsets=_layouts(), window=st.integers(1, 9), seed=SEEDS)
def test_every_epoch_is_a_permutation_and_epochs_differ(offsets, window, seed):
  order = _permutation.ShardShuffle(offsets, window, seed)
  epochs = [_epoch(order, e) for e in range(4)]
  for records in epochs:
    assert sorted(records) == list(range(order.length))
  # The epoch function and the index function are one function.
  assert [order.epoch_function(2)(p) for p in range(order.length)] == epochs[2]
  if order.length >= 10:
    assert any(records != epochs[0] for records in epochs[1:])


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(offsets=_layouts(), window=st.integers(1, 9), seed=SEEDS, epoch=st.integers(0, 5))
def test_a_window_reads_exactly_its_shards_and_each_shard_in_one_window(offsets, window, seed, epoch):
  order = _permutation.ShardShuffle(offsets, window, seed)
  windows = order.windows(epoch)
  assert sorted(s for shards in windows for s in shards) == list(range(order.shard_count))
  assert all(len(shards) == window for shards in windows[:-1]) and 1 <= len(windows[-1]) <= window
  records, position = _epoch(order, epoch), 0
  for shards in windows:
    span = sum(offsets[s + 1] - offsets[s] for s in shards)
    read = records[position:position + span]
    assert sorted(read) == sorted(r for s in shards for r in range(offsets[s], offsets[s + 1]))
    assert {order.shard_of(r) for r in read} == set(shards)
    position += span
  assert position == order.length


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(offsets=_layouts())
def test_the_layout_text_names_the_offsets(offsets):
  text = _permutation.layout_text(offsets)
  assert _permutation.layout_offsets(text) == offsets


def test_blocks_of_a_source_are_short_text():
  assert _permutation.layout_text(_permutation.block_offsets(60_000, 1_000)) == "1000x60"
  assert _permutation.layout_text(_permutation.block_offsets(60_617, 1_000)) == "1000x60,617"


def test_a_window_past_the_ranked_size_is_grains_index_shuffle_itself(monkeypatch):
  # Windows of more than RANKED_MAX records call index_shuffle per position (no list is built).
  monkeypatch.setattr(_permutation, "RANKED_MAX", 40)
  offsets = np.cumsum([0, 30, 25, 40, 9, 33, 27]).tolist()
  order = _permutation.ShardShuffle(offsets, 2, 5)
  for epoch in (0, 1):
    records = _epoch(order, epoch)
    assert sorted(records) == list(range(order.length))
    plan, position = order.plan(epoch), 0
    for number, shards in enumerate(order.windows(epoch)):
      window = plan.lane(0).window(number)
      assert window.ranked is None  # every window holds more than 40 records
      seed = _permutation._derived_seed(5, epoch, number)  # pylint: disable=protected-access
      for q in range(window.starts[-1]):
        record = _permutation._index_shuffle(q, window.starts[-1], seed)  # pylint: disable=protected-access
        k = int(np.searchsorted(window.starts, record, side="right")) - 1
        assert records[position + q] == offsets[shards[k]] + record - window.starts[k]
      position += window.starts[-1]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(offsets=_layouts(), window=st.integers(1, 5), seed=SEEDS, data=st.data())
def test_the_shards_ahead_are_the_readers_window_and_the_next(offsets, window, seed, data):
  order = _permutation.ShardShuffle(offsets, window, seed)
  index = data.draw(st.integers(0, 2 * order.length - 1), label="index")
  epoch, offset = divmod(index, order.length)
  windows = order.windows(epoch)
  ends = np.cumsum([sum(offsets[s + 1] - offsets[s] for s in shards) for shards in windows])
  number = int(np.searchsorted(ends, offset, side="right"))  # the window whose records hold position `offset`
  shards = windows[number]
  following = windows[number + 1] if number + 1 < len(windows) else order.windows(epoch + 1)[0]
  assert order.shards_ahead(index, windows=2) == shards + following
  assert order.shard_of(order.source(index)) in shards


def test_grains_public_shuffle_answers_the_same_where_the_compiled_one_is_not_found(monkeypatch):
  offsets = _permutation.block_offsets(41, 6)
  compiled = _epoch(_permutation.ShardShuffle(offsets, 3, 11), 1)
  monkeypatch.setattr(_permutation, "_compiled", lambda: None)
  assert _epoch(_permutation.ShardShuffle(offsets, 3, 11), 1) == compiled


@pytest.mark.parametrize("text, length, words", [
    ("1x100000000000", 60_000, "runs past the source's 60,000 records"),
    ("1x100000000000", None, "more than 16,777,216 shards"),
    ("1000x59", 60_000, "the shards hold 59,000 records, the source 60,000"),
    ("0x5", None, "not positive"),
])
def test_a_layout_is_decoded_within_bounds_or_refused(text, length, words):
  with pytest.raises(ValueError, match=words):
    _permutation.layout_offsets(text, length)



# ---------------------------------------------------------------------------
# Shard lanes (make_dataset(shard_lanes=V)): each lane reads a consecutive share of the epoch's reading order.


def test_an_order_without_lanes_is_the_order_0_3_0_read():
  # States written before lanes existed name no lane field: they must keep the order they were read in
  # (these are 0.3.0's records, computed by that release's module).
  assert _epoch(_permutation.ShardShuffle(_permutation.block_offsets(41, 6), 3, 11), 1) == [
      7, 6, 11, 1, 9, 10, 0, 8, 3, 2, 17, 16, 14, 15, 12, 13, 5, 4, 26, 28, 27, 25, 24, 40, 21, 23, 37, 20, 36,
      22, 39, 19, 38, 18, 29, 34, 35, 30, 32, 33, 31]
  assert _epoch(_permutation.ShardShuffle(np.cumsum([0, 7, 3, 9, 5, 1]).tolist(), 2, 3), 0) == [
      11, 12, 10, 24, 14, 13, 15, 16, 18, 17, 19, 20, 23, 1, 21, 0, 2, 22, 3, 4, 5, 6, 8, 7, 9]


def _reading_order(order, epoch):
  """The epoch's records in reading order (its shards in order, each shard's records in turn)."""
  return [r for s in order.plan(epoch).order for r in range(order.offsets[s], order.offsets[s + 1])]


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(offsets=_layouts(), window=st.integers(1, 5), seed=SEEDS, lanes=st.integers(1, 6),
                  lane_rows=st.integers(1, 7), epoch=st.integers(0, 3), data=st.data())
def test_each_lane_reads_its_share_of_the_reading_order_and_each_global_batch_takes_its_rows(
    offsets, window, seed, lanes, lane_rows, epoch, data):
  order = _permutation.ShardShuffle(offsets, window, seed, lanes, lane_rows)
  records = _epoch(order, epoch)
  assert sorted(records) == list(range(order.length))
  reading = _reading_order(order, epoch)
  starts = order.lane_starts
  assert starts[0] == 0 and starts[-1] == order.length and all(a <= b for a, b in zip(starts, starts[1:]))
  # Offset o is row o % G of its batch: the row's lane is (o % G) // lane_rows, whatever the batch.
  rows = lanes * lane_rows if lanes > 1 else order.length
  for offset, record in enumerate(records):
    lane = (offset % rows) // (lane_rows if lanes > 1 else rows)
    share = reading[starts[lane]:starts[lane + 1]]
    assert record in share
  # The rows a process of N (N dividing the lanes) reads of any batch come from its lanes' shards only.
  count = data.draw(st.sampled_from([n for n in range(1, lanes + 1) if lanes % n == 0]), label="processes")
  per_process = rows // count
  for offset in range(order.length):
    process = (offset % rows) // per_process
    mine = reading[starts[process * lanes // count]:starts[(process + 1) * lanes // count]]
    assert records[offset] in mine
  # A lane's windows: its pieces of shards, `window` at a time, each read whole before the next.
  for lane in range(lanes):
    position, shards_read = 0, []
    lane_records = [records[o] for o in range(order.length) if (o % rows) // (lane_rows if lanes > 1 else rows)
                    == lane]
    for shards in order.windows(epoch, lane):
      span = sum(n for first, n in order.plan(epoch).lane(lane).pieces if order.shard_of(first) in shards)
      assert {order.shard_of(r) for r in lane_records[position:position + span]} == set(shards)
      position += span
      shards_read += shards
    assert position == len(lane_records) == starts[lane + 1] - starts[lane]


def test_lanes_pickle_and_are_refused_without_their_rows_or_past_the_bound():
  # (One lane is the order without lanes: test_an_order_without_lanes_is_the_order_0_3_0_read pins it.)
  offsets = _permutation.block_offsets(41, 6)
  order = _permutation.ShardShuffle(offsets, 3, 11, 4, 2)
  copy = pickle.loads(pickle.dumps(order))
  assert (copy.lanes, copy.lane_rows) == (4, 2) and _epoch(copy, 1) == _epoch(order, 1)
  with pytest.raises(ValueError, match="lane_rows"):
    _permutation.ShardShuffle(offsets, 3, 11, 4)
  with pytest.raises(ValueError, match="lanes="):
    _permutation.ShardShuffle(offsets, 3, 11, _permutation.MAX_LANES + 1, 1)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(offsets=_layouts(), window=st.integers(1, 4), seed=SEEDS, lanes=st.integers(2, 5),
                  lane_rows=st.integers(1, 5), data=st.data())
def test_the_shards_ahead_of_a_lane_are_its_window_and_its_next(offsets, window, seed, lanes, lane_rows, data):
  order = _permutation.ShardShuffle(offsets, window, seed, lanes, lane_rows)
  index = data.draw(st.integers(0, 2 * order.length - 1), label="index")
  epoch, lane, number = order.window_key(index)
  windows = order.windows(epoch, lane)
  following = windows[number + 1] if number + 1 < len(windows) else order.windows(epoch + 1, lane)[0]
  assert order.shards_ahead(index, windows=2) == windows[number] + following
  assert order.shard_of(order.source(index)) in windows[number]
  first_use = order.window_shards_by_first_use(index, 10**6)
  assert first_use[0] == order.shard_of(order.source(index)) and set(first_use) <= set(windows[number])
