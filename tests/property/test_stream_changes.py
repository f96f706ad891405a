"""Stream-preserving changes (docs/guarantees.md, "Same stream"): one property per kind.

Each test saves a state at a random point of an old pipeline, restores it into
a changed one and checks, element by element, that the resumed stream is the
new pipeline's uninterrupted stream from the element where the old one
stopped (nothing skipped, nothing repeated, the consumed part agreeing with
the new stream's prefix), or that the restore is refused naming the field.
"""

import logging
import os

import grain
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import ckpt_iter

# 25 per property in `make test`; 300 with HYPOTHESIS_PROFILE=long.
_EXAMPLES = hypothesis.settings(
    max_examples=300 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 25)


def _records(count):
  return [{"id": i} for i in range(count)]


def _ids(batch):
  return [int(i) for i in np.asarray(batch["id"] if isinstance(batch, dict) else batch).reshape(-1)]


def _take(iterator, count):
  out = []
  for _ in range(count):
    try:
      out.append(_ids(next(iterator)))
    except StopIteration:
      break
  return out


def _elements(dataset, count):
  """The first `count` elements of a dataset's uninterrupted stream (or all, if fewer)."""
  iterator, out = ckpt_iter.DataIterator(dataset), []
  while len(out) < count:
    batch = _take(iterator, 1)
    if not batch:
      break
    out.extend(batch[0])
  return out


def _flat(batches):
  return [x for batch in batches for x in batch]


def _saved(dataset, batches):
  """(state after `batches` batches, the batches consumed)."""
  iterator = ckpt_iter.DataIterator(dataset)
  consumed = _take(iterator, batches)
  return iterator.get_state(), consumed


def _resumed(dataset, state, count=6):
  iterator = ckpt_iter.DataIterator(dataset)
  iterator.set_state(state)
  return _take(iterator, count)


def _assert_continues(consumed, resumed, new_dataset):
  """Resumed == the new uninterrupted element stream right after the consumed elements."""
  done, got = len(_flat(consumed)), _flat(resumed)
  new_stream = _elements(new_dataset, done + len(got) + 1)
  assert _flat(consumed) == new_stream[:done], "the consumed part is not a prefix of the new stream"
  assert got == new_stream[done:done + len(got)]
  if len(got) < len(new_stream) - done:
    assert len(resumed) == 6  # stopped by the count, not early


def _changes_logged(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "ckpt_iter" and "accepted stream change" in r.getMessage()]


# ---------------------------------------------------------------------------
# make_dataset


def _md(count, batch_size, num_epochs, seed, drop_remainder=True):
  return ckpt_iter.make_dataset(
      _records(count), batch_size=batch_size, seed=seed, num_epochs=num_epochs,
      drop_remainder=drop_remainder, shard_index=0, shard_count=1)


@_EXAMPLES
@hypothesis.given(
    count=st.integers(4, 24), batch_size=st.integers(1, 4), seed=st.none() | st.integers(0, 9),
    old_epochs=st.integers(1, 3), new_epochs=st.none() | st.integers(1, 4), data=st.data())
def test_make_dataset_num_epochs_change_continues_the_stream(count, batch_size, seed, old_epochs, new_epochs, data):
  hypothesis.assume(count >= batch_size)
  old = _md(count, batch_size, old_epochs, seed)
  new = _md(count, batch_size, new_epochs, seed)
  position = data.draw(st.integers(0, len(old)), label="position")
  state, consumed = _saved(old, position)
  if new_epochs is not None and position > len(new):
    with pytest.raises(ckpt_iter.ConfigDriftError, match="num_epochs") as info:
      _resumed(new, state)
    assert "past the end" in str(info.value)
    return
  _assert_continues(consumed, _resumed(new, state), new)


@_EXAMPLES
@hypothesis.given(
    count=st.integers(6, 24), old_batch=st.integers(1, 6), new_batch=st.integers(1, 6),
    seed=st.none() | st.integers(0, 9), drop_remainder=st.booleans(), data=st.data())
def test_make_dataset_batch_size_change_resumes_at_the_next_record(
    count, old_batch, new_batch, seed, drop_remainder, data):
  """Any batch size at any position: the next batch starts at the first record not read.

  The records read, in order, are the uninterrupted stream's (every epoch's
  permutation) less only what the documented rule drops: with drop_remainder,
  the rest of an epoch shorter than the batch size in effect at its end.
  """
  hypothesis.assume(old_batch != new_batch)
  old = _md(count, old_batch, 2, seed, drop_remainder)
  new = _md(count, new_batch, 2, seed, drop_remainder)
  position = data.draw(st.integers(0, len(old)), label="position")
  state, consumed = _saved(old, position)
  stream = _flat(_take(ckpt_iter.DataIterator(_md(count, 1, 2, seed)), 2 * count))
  resumed = _resumed(new, state, count=2 * count)
  expected = _epoch_batches(stream, count, [(old_batch, position), (new_batch, None)], drop_remainder)
  assert consumed + resumed == expected


def _epoch_batches(stream, epoch_length, segments, drop_remainder):
  """The batches the documented rule cuts from `stream`: (batch size, batches read) per run segment.

  Batches keep to their epoch; an epoch's last batch holds what is left of it,
  dropped when shorter than the batch size with drop_remainder.
  """
  batches, record = [], 0
  for batch_size, count in segments:
    taken = 0
    while record < len(stream) and (count is None or taken < count):
      epoch_end = (record // epoch_length + 1) * epoch_length
      stop = min(record + batch_size, epoch_end)
      if stop - record < batch_size and drop_remainder:
        record = epoch_end
        continue
      batches.append(stream[record:stop])
      record, taken = stop, taken + 1
  return batches


def test_accepted_changes_log_one_line_each(caplog):
  state, _ = _saved(_md(20, 2, 2, seed=3), 4)
  with caplog.at_level(logging.INFO, logger="ckpt_iter"):
    _resumed(_md(20, 4, 3, seed=3), state)
  lines = _changes_logged(caplog)
  assert len(lines) == 2, lines
  assert any("batch_size 2 -> 4" in line and "resuming at stream record 8" in line for line in lines)
  assert any("num_epochs 2 -> 3" in line for line in lines)


def test_a_seed_change_with_a_stream_change_is_still_refused_naming_the_seed():
  state, _ = _saved(_md(20, 2, 2, seed=3), 4)
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    _resumed(_md(20, 2, 3, seed=4), state)
  assert "seed" in info.value.differences


# ---------------------------------------------------------------------------
# Hand-built graphs


def _double(x):
  return x * 2


_NO_REPEAT = "no repeat"


def _hand(count, *, cut=None, seed=1, batch_size=2, epochs=_NO_REPEAT, drop_remainder=False, tail_map=False):
  ds = grain.MapDataset.range(count).shuffle(seed=seed)
  if epochs is not _NO_REPEAT:
    ds = ds.repeat(epochs)  # None: forever
  if cut is not None:
    ds = ds[0:cut]
  ds = ds.map(_double).batch(batch_size, drop_remainder=drop_remainder)
  if tail_map:
    ds = ds.map(np.negative)
  return ds


@_EXAMPLES
@hypothesis.given(
    count=st.integers(4, 30), old_cut=st.integers(1, 30), new_cut=st.none() | st.integers(1, 30),
    batch_size=st.integers(1, 4), drop_remainder=st.booleans(), data=st.data())
def test_slice_end_change_or_removal_continues_the_stream(count, old_cut, new_cut, batch_size, drop_remainder, data):
  old = _hand(count, cut=old_cut, batch_size=batch_size, drop_remainder=drop_remainder)
  new = _hand(count, cut=new_cut, batch_size=batch_size, drop_remainder=drop_remainder)
  position = data.draw(st.integers(0, len(old)), label="position")
  state, consumed = _saved(old, position)
  try:
    resumed = _resumed(new, state)
  except ckpt_iter.ConfigDriftError as e:
    # Refused only when continuing would skip or repeat: past the new end, or a
    # short last batch read to the end of the old stream.
    assert "SliceMapDataset.stop" in str(e) or "dataset_length" in str(e)
    assert position > len(new) or (position == len(old) and not drop_remainder)
    return
  _assert_continues(consumed, resumed, new)


@_EXAMPLES
@hypothesis.given(
    count=st.integers(2, 8), old_epochs=st.integers(1, 3), new_epochs=st.none() | st.integers(1, 4),
    batch_size=st.integers(1, 3), data=st.data())
def test_repeat_num_epochs_change_continues_the_stream(count, old_epochs, new_epochs, batch_size, data):
  old = _hand(count, epochs=old_epochs, batch_size=batch_size, drop_remainder=True)
  new = _hand(count, epochs=new_epochs, batch_size=batch_size, drop_remainder=True)
  position = data.draw(st.integers(0, len(old)), label="position")
  state, consumed = _saved(old, position)
  if new_epochs is not None and position > len(new):
    with pytest.raises(ckpt_iter.ConfigDriftError, match="num_epochs"):
      _resumed(new, state)
    return
  resumed = _resumed(new, state)
  # For a stream without end: a finite one long enough for the 6 resumed batches.
  long_enough = (position + 6) * batch_size // count + 2
  reference = new if new_epochs is not None else _hand(count, epochs=long_enough, batch_size=batch_size, drop_remainder=True)
  _assert_continues(consumed, resumed, reference)


@_EXAMPLES
@hypothesis.given(
    count=st.integers(4, 30), old_batch=st.integers(1, 5), new_batch=st.integers(1, 5),
    grow=st.booleans(), tail_map=st.booleans(), data=st.data())
def test_batch_size_change_followed_by_maps_resumes_at_the_same_element(
    count, old_batch, new_batch, grow, tail_map, data):
  hypothesis.assume(old_batch != new_batch)
  old = _hand(count, cut=count // 2 if grow else None, batch_size=old_batch, tail_map=tail_map, drop_remainder=True)
  new = _hand(count, batch_size=new_batch, tail_map=tail_map, drop_remainder=True)
  position = data.draw(st.integers(0, len(old)), label="position")
  state, consumed = _saved(old, position)
  element = position * old_batch
  if element == count and not grow:
    # The whole input was read: the new pipeline resumes at its end too.
    assert _resumed(new, state) == []
    return
  if element % new_batch:
    with pytest.raises(ckpt_iter.ConfigDriftError, match="BatchMapDataset.batch_size") as info:
      _resumed(new, state)
    assert "cannot start a batch there" in str(info.value)
    return
  _assert_continues(consumed, _resumed(new, state), new)


# Changes that alter which element comes next: refused, naming the field.
_REFUSED = [
    ("shuffle_seed", lambda: _hand(20, seed=1), lambda: _hand(20, seed=2), "ShuffleMapDataset.seed"),
    ("slice_below_shuffle",
     lambda: grain.MapDataset.range(20)[0:10].shuffle(seed=1).batch(2),
     lambda: grain.MapDataset.range(20).shuffle(seed=1).batch(2), "SliceMapDataset.stop"),
    ("length_below_a_repeat",
     lambda: grain.MapDataset.range(20)[0:10].repeat(3).batch(2),
     lambda: grain.MapDataset.range(20).repeat(3).batch(2), "SliceMapDataset.stop"),
    ("batch_then_shuffle",
     lambda: grain.MapDataset.range(20).batch(2).shuffle(seed=0),
     lambda: grain.MapDataset.range(20).batch(4).shuffle(seed=0), "BatchMapDataset.batch_size"),
    ("map_function", lambda: _hand(20), lambda: _hand(20, tail_map=True), "graph"),
]


@pytest.mark.parametrize("old, new, field", [c[1:] for c in _REFUSED], ids=[c[0] for c in _REFUSED])
def test_other_changes_are_refused_naming_the_field(old, new, field):
  state, _ = _saved(old(), 2)
  iterator = ckpt_iter.DataIterator(new())
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.set_state(state)
  assert any(field in name for name in info.value.differences), info.value.differences
  assert iterator.get_state()["position"] == {"next_index": 0}
