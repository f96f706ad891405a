"""The order a make_dataset stream reads its source in (`_permutation`), without Grain's pipeline.

`shuffled` is Grain's per-epoch shuffle (`MapDataset.source(...).shuffle(seed)`)
computed from the index alone; `ShardShuffle` is shuffle="shards": each epoch a
permutation of the source's shards, cut into windows of `shuffle_window` shards
whose records are permuted among themselves. The properties below hold it a
bijection per epoch with the locality it promises. The dataset and the data map
over it: tests/unit/test_shard_shuffle.py.
"""

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
      window = plan.window(number)
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

