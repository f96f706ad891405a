"""Tests for ckpt_iter.skips and the batch plan over a stream with skipped records (`_records.BatchPlan`)."""

import hypothesis
from hypothesis import strategies as st
import pytest

from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import skips as skips_lib


@st.composite
def _skip_values(draw, stream, every_epoch=True):
  records = draw(st.lists(st.tuples(st.integers(0, stream), st.integers(1, 6)), max_size=4))
  ranges = [(a, a + n) for a, n in records]
  every = []
  if every_epoch:
    for a, n, since in draw(st.lists(st.tuples(st.integers(0, 8), st.integers(1, 4), st.integers(0, stream)),
                                     max_size=2)):
      every.append((a, a + n, since))
  return skips_lib.Skips.of(ranges, every)


def _kept_epoch(skips, epoch, length):
  return [epoch * length + p for p in range(length) if not skips.skipped(epoch * length + p, length)]


def _oracle(length, epochs, batch, drop, skips, phase_epoch, phase):
  """Every batch of the plan, by enumeration: each epoch's kept records cut from its phase."""
  batches = []
  for epoch in range(epochs):
    kept = _kept_epoch(skips, epoch, length)
    for start in range(phase if epoch == phase_epoch else 0, len(kept), batch):
      chunk = kept[start:start + batch]
      if len(chunk) == batch or not drop:
        batches.append(chunk)
  return batches


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(data=st.data(), length=st.integers(1, 12), epochs=st.integers(1, 4), batch=st.integers(1, 6),
                  drop=st.booleans())
def test_a_single_source_plan_cuts_the_kept_records_of_each_epoch(data, length, epochs, batch, drop):
  stream = length * epochs
  skips = data.draw(_skip_values(stream), label="skips")
  every = [(a, min(b, length), s) for a, b, s in skips.every_epoch if a < length]
  skips = skips_lib.Skips.of(skips.records, every)
  restored = data.draw(st.integers(0, stream), label="restored at")
  plan = _records.BatchPlan.at(restored, batch_size=batch, drop_remainder=drop, epoch_length=length,
                               stream_length=stream, skips=skips)
  expected = _oracle(length, epochs, batch, drop, skips, plan.phase_epoch, plan.phase)
  assert len(plan) == len(expected)
  for index, chunk in enumerate(expected):
    assert list(plan.records(index)) == chunk
    assert plan.span(index) == (chunk[0], chunk[-1] + 1)
    assert plan.index_of(plan.next_record(index + 1)) in (index + 1, None)
    # The batch that ends here is found by its end, whatever the phase (unless it may be a short last one).
    epoch = chunk[0] // length
    epoch_end = chunk[-1] == _kept_epoch(skips, epoch, length)[-1]
    found = plan.full_batch_before(chunk[-1] + 1)
    if len(chunk) == batch and (drop or not epoch_end):
      assert found == chunk[0]
    elif len(chunk) < batch:
      assert found is None
  # The restored record starts a batch of its plan, and the batches from it read every kept record on.
  first = plan.index_of(restored)
  assert first is not None
  read = [r for index in range(first, len(plan)) for r in plan.records(index)]
  later = [r for epoch in range(epochs) for r in _kept_epoch(skips, epoch, length) if r >= restored]
  if drop:
    assert set(read) <= set(later)
  else:
    assert read == later


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(data=st.data(), stream=st.integers(1, 40), batch=st.integers(1, 6), drop=st.booleans())
def test_a_mixture_plan_cuts_the_kept_stream(data, stream, batch, drop):
  skips = data.draw(_skip_values(stream, every_epoch=False), label="skips")
  restored = data.draw(st.integers(0, stream), label="restored at")
  plan = _records.BatchPlan.at(restored, batch_size=batch, drop_remainder=drop, epoch_length=None,
                               stream_length=stream, skips=skips)
  kept = [g for g in range(stream) if not skips.skipped(g, None)]
  expected = [kept[k:k + batch] for k in range(plan.phase, len(kept), batch)]
  expected = [chunk for chunk in expected if len(chunk) == batch or not drop]
  assert len(plan) == len(expected)
  for index, chunk in enumerate(expected):
    assert list(plan.records(index)) == chunk
    assert plan.span(index) == (chunk[0], chunk[-1] + 1)
  first = plan.index_of(restored)
  assert first is not None
  assert [r for i in range(first, len(plan)) for r in plan.records(i)] == [
      r for chunk in expected[first:] for r in chunk]
  assert all(r >= restored for i in range(first, len(plan)) for r in plan.records(i))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(data=st.data(), length=st.integers(1, 24), epochs=st.integers(1, 3),
                  per_process=st.integers(1, 4), process_count=st.integers(1, 4), drop=st.booleans(),
                  mixture=st.booleans())
def test_a_process_rows_are_its_slice_of_the_global_batch(data, length, epochs, per_process, process_count, drop,
                                                           mixture):
  """`BatchPlan.rows` (one process's rows, O(per-process batch)) is the slice of the whole global batch."""
  stream = length * epochs
  skips = data.draw(_skip_values(stream, every_epoch=not mixture), label="skips")
  skips = skips_lib.Skips.of(skips.records, [(a, min(b, length), s) for a, b, s in skips.every_epoch if a < length])
  restored = data.draw(st.integers(0, stream), label="restored at")
  batch = per_process * process_count
  plan = _records.BatchPlan.at(restored, batch_size=batch, drop_remainder=drop,
                               epoch_length=None if mixture else length, stream_length=stream, skips=skips)
  if mixture:
    kept = [g for g in range(stream) if not skips.skipped(g, None)]
    expected = [kept[k:k + batch] for k in range(plan.phase, len(kept), batch)]
    expected = [chunk for chunk in expected if len(chunk) == batch or not drop]
  else:
    # One epoch more than the stream: batches past the plan's length go on as if the stream did.
    expected = _oracle(length, epochs + 1, batch, drop, skips, plan.phase_epoch, plan.phase)
  for index, chunk in enumerate(expected[:len(plan) + (0 if mixture else 3)]):
    for process in range(process_count):
      first = process * per_process
      assert list(plan.rows(index, first, per_process)) == chunk[first:first + per_process], (index, process)
    assert list(plan.records(index)) == chunk
  # Kept records in a stream without epochs: the walk from the first agrees with counting them.
  kept = [g for g in range(stream + 8) if not skips.skipped(g, None)]
  start = data.draw(st.integers(0, len(kept)), label="kept start")
  stop = data.draw(st.integers(0, len(kept)), label="kept stop")
  assert list(skips.kept_records(start, stop)) == kept[start:stop]
  assert [skips.stream_record_of_kept(k) for k in range(len(kept))] == kept


def test_an_infinite_stream_with_skips_far_ahead_costs_no_walk():
  skips = skips_lib.Skips.of([(10**12, 10**12 + 5)], [(3, 5, 0)])
  plan = _records.BatchPlan.at(10**12 - 4, batch_size=4, drop_remainder=True, epoch_length=100,
                               stream_length=_records.INFINITE, skips=skips)
  index = plan.index_of(10**12 - 4)
  assert list(plan.records(index)) == [10**12 - 4 + i for i in range(4)]  # offsets 96-99 of its epoch
  # The next epoch skips the stream range (offsets 0-4) and every epoch's offsets 3-4.
  assert list(plan.records(index + 1)) == [10**12 + 5 + i for i in range(4)]
  assert plan.index_of(plan.next_record(index + 2)) == index + 2


@pytest.mark.parametrize("records, expected", [
    ([(5, 9), (1, 3), (2, 6)], ((1, 9),)),
    ([(1, 2), (2, 3)], ((1, 3),)),
    ([(4, 4), (7, 8)], ((7, 8),)),
])
def test_ranges_are_merged(records, expected):
  assert skips_lib.Skips.of(records).records == expected


def test_the_fingerprint_text_round_trips_and_bad_text_is_refused_naming_the_field():
  skips = skips_lib.Skips.of([(100, 200), (300, 340)], [(5, 9, 120)])
  assert skips_lib.Skips.from_text(skips.to_text(), origin="s") == skips
  assert skips_lib.Skips.from_text(None, origin="s") == skips_lib.NO_SKIPS
  for bad in ('{"records": [[5, 2]]}', "[1, 2]", '{"records": [[1, 2, 3]]}', "nope", 7, '{"other": []}'):
    with pytest.raises(errors.InvalidStateError) as info:
      skips_lib.Skips.from_text(bad, origin="step 3")
    assert "fingerprint field 'skips'" in str(info.value) and "step 3" in str(info.value)


def test_covers_and_added_to():
  before = skips_lib.Skips.of([(10, 20)])
  after = skips_lib.Skips.of([(10, 20), (30, 40)], [(1, 2, 50)])
  assert after.covers(before) and not before.covers(after)
  assert after.added_to(before) == skips_lib.Skips(records=((30, 40),), every_epoch=((1, 2, 50),))


def _pairwise_subtract(ranges, minus):
  """The reference: every range against every range of `minus` (what `subtract` was, O(n * m))."""
  result = []
  for start, stop in ranges:
    cursor = start
    for a, b in minus:
      if b <= cursor or a >= stop:
        continue
      if a > cursor:
        result.append((cursor, a))
      cursor = max(cursor, b)
    if cursor < stop:
      result.append((cursor, stop))
  return tuple(result)


def _pairwise_covers(entry, by):
  start, stop, since = entry
  return any(s <= since and a <= start and stop <= b for a, b, s in by)


def _pairwise_every_epoch(every):
  kept = []
  for entry in sorted(every):
    if entry[1] > entry[0] and not _pairwise_covers(entry, kept):
      kept.append(entry)
  return tuple(kept)


_RANGES = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)).map(lambda r: (r[0], r[0] + r[1])),
                   max_size=12)
_EVERY = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6), st.integers(0, 40)).map(
    lambda r: (r[0], r[0] + r[1], r[2])), max_size=12)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(ranges=_RANGES, minus=_RANGES, every=_EVERY, every_before=_EVERY)
def test_the_sweeps_answer_what_comparing_every_pair_answers(ranges, minus, every, every_before):
  ranges, minus = skips_lib.merged(ranges), skips_lib.merged(minus)
  assert skips_lib.subtract(ranges, minus) == _pairwise_subtract(ranges, minus)
  after, before = skips_lib.Skips.of(ranges, every), skips_lib.Skips.of(minus, every_before)
  assert after.every_epoch == _pairwise_every_epoch(every)
  assert after.added_to(before) == skips_lib.Skips(
      records=_pairwise_subtract(ranges, minus),
      every_epoch=tuple(e for e in after.every_epoch if not _pairwise_covers(e, before.every_epoch)))
  assert after.covers(before) == (not _pairwise_subtract(minus, ranges) and all(
      _pairwise_covers(e, after.every_epoch) for e in before.every_epoch))
  assert skips_lib.covered(every, every_before) == [_pairwise_covers(e, every_before) for e in every]


@pytest.mark.parametrize("text, records, source", [
    ("records:1200-1263", ((1200, 1264),), ()),
    ("records:5,7-8;source:0-3", ((5, 6), (7, 9)), ((0, 4),)),
    (" source:2 ", (), ((2, 3),)),
])
def test_parse(text, records, source):
  skip = skips_lib.Skip.parse(text)
  assert (skip.records, skip.source_records) == (records, source)


@pytest.mark.parametrize("text, fragment", [
    ("rows:1-2", "'rows:1-2' is not"),
    ("records:9-3", "'9-3' is not a record"),
    ("records:a", "'a' is not a record"),
    ("records:", "is not `records:"),
])
def test_parse_refuses_naming_the_part(text, fragment):
  with pytest.raises(errors.InvalidArgumentError) as info:
    skips_lib.Skip.parse(text)
  assert fragment in str(info.value)


@pytest.mark.parametrize("value", [[(5, 5)], [(-1, 3)], [(1,)], "1-3", [(1.5, 3)]])
def test_a_bad_declaration_is_refused(value):
  with pytest.raises(errors.InvalidArgumentError) as info:
    skips_lib.Skip(records=value)
  assert "Skip(records=" in str(info.value)


def test_resolve_clips_what_was_read_and_refuses_source_records_of_a_shuffled_source():
  skips, already = skips_lib.resolve(skips_lib.Skip(records=[(90, 120)], source_records=[(3, 5)]), from_record=100,
                                  epoch_length=50, shuffled=False, mixture=False, origin="o")
  assert skips == skips_lib.Skips.of([(100, 120)], [(3, 5, 100)])
  assert already == ((90, 100),)
  with pytest.raises(errors.UnsupportedConfigError) as info:
    skips_lib.resolve(skips_lib.Skip(source_records=[(3, 5)]), from_record=0, epoch_length=50, shuffled=True,
                   mixture=False, origin="o")
  assert "shuffled" in str(info.value) and "stream_records" in str(info.value)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(data=st.data(), length=st.integers(1, 30))
def test_of_epoch_answers_every_epoch_as_the_direct_walk_and_keeps_memory_bounded(data, length):
  # issue 57 item 15: one answer per class of epochs, a few classes kept, whatever epochs are asked.
  stream = data.draw(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), max_size=6))
  every = data.draw(st.lists(st.tuples(st.integers(0, length - 1), st.integers(1, 5), st.integers(0, 300)),
                             max_size=4))
  value = skips_lib.Skips(records=skips_lib.merged([(a, a + n) for a, n in stream]),
                          every_epoch=tuple((a, min(a + n, length), since) for a, n, since in every))
  epochs = data.draw(st.lists(st.integers(0, 400), min_size=1, max_size=40))
  for epoch in epochs:
    assert value.of_epoch(epoch, length).records == skips_lib._in_epoch(value, epoch, length), epoch
  assert len(value.__dict__["_epochs"]) <= skips_lib._KEPT_EPOCH_CLASSES


def test_of_epoch_over_thousands_of_epochs_keeps_a_few_answers():
  value = skips_lib.Skips(every_epoch=((2, 5, 0),))
  for epoch in range(5_000):
    assert value.of_epoch(epoch, 10).records == ((2, 5),)
  assert len(value.__dict__["_epochs"]) <= skips_lib._KEPT_EPOCH_CLASSES
