"""Tests for ckpt_iter._lanes: make_dataset's filtered and packed streams, cut into lanes of chunks.

Bad lane arguments are refused naming them; a filter that drops every record
is named, not waited out; lanes restarted on one host compute only the rows
their first batch takes; a lane state's position is small and per process.
"""

import json

import pytest

import ckpt_iter
from ckpt_iter import _lanes
import support


_BAD_LANES = [
    ("lanes_not_multiple_of_shards", dict(shard_count=4, shard_index=0, num_lanes=6), ["num_lanes=6", "shard_count=4"]),
    ("batch_not_multiple_of_lanes", dict(batch_size=3, num_lanes=2), ["global batch of 3", "num_lanes=2"]),
    ("short_batches", dict(drop_remainder=False, num_epochs=None), ["drop_remainder=False with filter or pack"]),
    ("finite", dict(num_epochs=2), ["num_epochs=2 with filter or pack", "num_epochs=None"]),
    ("chunk_zero", dict(chunk_size=0), ["chunk_size=0"]),
    ("lanes_zero", dict(num_lanes=0), ["num_lanes=0"]),
    ("filter_not_callable", dict(filter=3), ["filter=3", "not callable"]),
]


@pytest.mark.parametrize("arguments, fragments", [c[1:] for c in _BAD_LANES], ids=[c[0] for c in _BAD_LANES])
def test_bad_lane_arguments_are_refused_naming_them(arguments, fragments):
  kwargs = {"batch_size": 4, "filter": lambda r: True, "num_lanes": 2, **arguments}
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    support.make_dataset(support.sample_records(20), **kwargs)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_a_filter_that_drops_everything_is_named_not_waited_out(monkeypatch):
  monkeypatch.setattr(_lanes, "MAX_EMPTY_CHUNKS", 5)
  dataset = support.make_dataset(support.sample_records(200), batch_size=2, num_epochs=None, filter=lambda r: False,
                                 chunk_size=2, num_lanes=1)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="filter dropped every record of 5 chunks"):
    next(ckpt_iter.DataIterator(dataset))


class _CountingRecords:
  """Records that count how many were read (a bucket's cost is per record read)."""

  def __init__(self, count):
    self.records, self.reads = support.sample_records(count), 0

  def __len__(self):
    return len(self.records)

  def __getitem__(self, index):
    self.reads += 1
    return self.records[index]


def test_lanes_landing_on_one_host_compute_only_the_rows_their_first_batch_takes():
  """256 lanes of a 256-host run restarted on one host: the first batch takes one row of each lane, and
  reads a record and the next of each lane's chunk (the next tells whether the chunk goes on), not every
  chunk whole (issue 49 item 5: 28 s of CPU before the first batch)."""
  source = _CountingRecords(256 * 64)
  lanes = dict(batch_size=256, num_epochs=None, filter=lambda r: True, chunk_size=64, num_lanes=256)
  iterator = ckpt_iter.DataIterator(support.make_dataset(source, **lanes))
  built = source.reads  # the source's sampled digest
  first = next(iterator)
  assert source.reads - built == 2 * 256  # before: 256 * 64 = 16,384
  # The same rows, and later the same positions, as a lane computing its chunk whole.
  whole = iterator.dataset
  assert list(first["id"]) == [whole.chunk_rows(lane)[0]["id"] for lane in range(256)]
  for _ in range(63):
    next(iterator)
  assert iterator.get_state()["position"]["lanes"][:2] == [[1, 0], [1, 0]]  # each chunk left once taken


def test_a_lane_states_position_is_small_and_per_process():
  dataset = support.make_dataset(support.sample_records(400), batch_size=8, num_epochs=None,
                                 filter=lambda r: r["id"] % 2 == 0, chunk_size=16, num_lanes=8, shard_index=1,
                                 shard_count=2)
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(50):
    next(iterator)
  state = iterator.get_state()
  assert state["position"]["first_lane"] == 4 and len(state["position"]["lanes"]) == 4
  assert len(json.dumps(state["position"])) < 100
