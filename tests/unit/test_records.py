"""Tests for ckpt_iter._records: the record stream's arithmetic (mixtures, batch plans)."""

import hypothesis
from hypothesis import strategies as st
import pytest

from ckpt_iter import _records
from ckpt_iter import errors


# ---------------------------------------------------------------------------
# Mixture interleave


@hypothesis.given(shares=st.lists(st.integers(1, 9), min_size=1, max_size=5), records=st.integers(0, 400))
def test_counts_sum_to_the_records_and_pick_walks_them(shares, records):
  counts = _records.counts(records, shares)
  assert sum(counts) == records
  seen = [0] * len(shares)
  for record in range(records):
    number, before = _records.pick(record, shares)
    assert before == seen[number]
    seen[number] += 1
  assert seen == counts


@hypothesis.given(shares=st.lists(st.integers(1, 9), min_size=1, max_size=5), records=st.integers(0, 2000))
def test_every_prefix_holds_each_share_up_to_rounding(shares, records):
  total = sum(shares)
  for count, share in zip(_records.counts(records, shares), shares):
    assert abs(count - records * share / total) <= len(shares)


@hypothesis.given(shares=st.lists(st.integers(1, 30), min_size=1, max_size=8), records=st.integers(0, 2000))
def test_each_source_is_within_the_documented_bound_of_its_share(shares, records):
  """docs/changing_the_run.md: never a record ahead; source j trails by less than j*s_j/W_j; exact every period."""
  from fractions import Fraction
  total = sum(shares)
  for j, (count, share) in enumerate(zip(_records.counts(records, shares), shares)):
    due = Fraction(records * share, total)
    assert count == due or due - j * Fraction(share, sum(shares[j:])) < count < due + 1, (j, count, due)
  assert _records.counts(records - records % total, shares) == [s * (records // total) for s in shares]


@pytest.mark.parametrize("shares, records, source, count", [
    ([1, 1, 3], 2, 2, 0),         # the example: 0 of 1.2 due
    ([6, 3, 1], 9, 2, 0),         # 0 of 0.9
    ([1, 2, 4, 8], 3, 3, 0),      # 0 of 1.6
    ([1] * 7 + [93], 7, 7, 0),    # 0 of 6.51
])
def test_the_measured_deviations_the_docs_quote(shares, records, source, count):
  assert _records.counts(records, shares)[source] == count


_NAMES = "abcd"


@st.composite
def _mixture_runs(draw):
  """Segments of (shares, records read) of one run whose mixture changes at each restart."""
  segments = []
  for _ in range(draw(st.integers(1, 5))):
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4, unique=True))
    shares = {name: draw(st.integers(1, 6)) for name in names}
    segments.append((shares, draw(st.integers(0, 40))))
  limits = {name: draw(st.integers(1, 60)) for name in _NAMES}
  return segments, limits


@hypothesis.given(_mixture_runs())
def test_a_changed_mixture_continues_every_source_at_its_own_next_record(run):
  segments, limits = run
  mixture, record = _records.Mixture(segments[0][0]), 0
  read = {name: [] for name in _NAMES}
  for number, (shares, count) in enumerate(segments):
    if number:
      mixture = mixture.restarted(record, shares)
    end = mixture.length(limits)
    for _ in range(count):
      if record >= end:
        break
      name, index = mixture.source_of(record)
      assert index < limits[name]
      read[name].append(index)
      record += 1
    assert mixture.read(record) == {**mixture.since, **{n: len(read[n]) for n in shares}}
  for indices in read.values():
    assert indices == list(range(len(indices)))  # nothing skipped, nothing twice, in order


@hypothesis.given(_mixture_runs())
def test_a_mixture_ends_where_its_first_source_would_pass_its_limit(run):
  segments, limits = run
  mixture = _records.Mixture(segments[0][0], since_record=3, since={n: 1 for n in segments[0][0]})
  end = mixture.length(limits)
  for record in range(3, end):
    name, index = mixture.source_of(record)
    assert index < limits[name]
  if end >= 3:
    name, index = mixture.source_of(end)
    assert index >= limits[name]


def test_mixture_from_json_refuses_malformed_ledgers():
  for value in [None, {}, {"since_record": -1, "since": {}}, {"since_record": 9, "since": {}},
                {"since_record": 0, "since": {"a": -2}}, {"since_record": 0, "since": {"a": 1}, "x": 1},
                {"since_record": True, "since": {}}]:
    with pytest.raises(errors.InvalidStateError, match="position field 'mixture'"):
      _records.Mixture.from_json(value, {"a": 1}, 5, origin="s")


# ---------------------------------------------------------------------------
# Batch plans over one source's epochs


@st.composite
def _runs(draw):
  """One source's stream and the global batch sizes of a run's segments, with batches read in each."""
  length, epochs = draw(st.integers(1, 30)), draw(st.integers(1, 4))
  drop = draw(st.booleans())
  segments = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=6))
  return length, epochs, drop, segments


@hypothesis.given(_runs())
@hypothesis.settings(max_examples=300)
def test_a_run_restarted_with_any_batch_sizes_reads_each_record_once_per_epoch(run):
  """Chained restarts with drawn global batch sizes: every record once, but each epoch's dropped rest.

  The documented rule: an epoch's batches keep to the epoch; its last batch
  holds what is left of it and, with drop_remainder, is dropped when shorter
  than the batch size in effect then.
  """
  length, epochs, drop, segments = run
  stream = length * epochs
  read, next_record = [], 0
  for batch_size, batches in segments:
    plan = _records.BatchPlan.at(next_record, batch_size=batch_size, drop_remainder=drop,
                                 epoch_length=length, stream_length=stream)
    index = plan.index_of(next_record)
    assert index is not None
    for _ in range(batches):
      if index >= len(plan):
        break
      start, stop = plan.span(index)
      assert stop - start == batch_size or not drop
      assert start // length == (stop - 1) // length  # within one epoch
      read.extend(range(start, stop))
      index += 1
      next_record = stop
  assert read == sorted(set(read))  # each stream record at most once, in order
  for epoch in range(epochs):
    missing = sorted(set(range(epoch * length, (epoch + 1) * length)) - set(read))
    if not missing or not read or read[-1] < (epoch + 1) * length:
      continue  # complete, or the run did not read past this epoch
    # What an epoch misses is a rest at its end, shorter than some batch size of the run.
    assert drop and missing == list(range(missing[0], (epoch + 1) * length))
    assert len(missing) < max(size for size, _ in segments)


def test_the_index_of_a_record_in_a_dropped_rest_is_the_next_epochs_first_batch():
  plan = _records.BatchPlan.at(18, batch_size=3, drop_remainder=True, epoch_length=20, stream_length=40)
  assert plan.index_of(18) == 6 and plan.span(6) == (20, 23)
  assert _records.BatchPlan.at(18, batch_size=2, drop_remainder=True, epoch_length=20,
                               stream_length=40).span(9) == (18, 20)


def test_a_plan_restarted_mid_epoch_starts_its_batches_at_the_record():
  plan = _records.BatchPlan.at(27, batch_size=5, drop_remainder=True, epoch_length=24, stream_length=96)
  index = plan.index_of(27)
  assert plan.span(index) == (27, 32) and plan.span(index + 4) == (48, 53)  # epoch 2 from its start
  assert len(plan) == 4 + 4 + 4 + 4  # epoch 1 from its record 3 on (27 - 24) holds four batches of 5


@hypothesis.given(phase=st.integers(0, 8), batch_size=st.integers(1, 9), stream=st.integers(0, 60),
                  drop=st.booleans())
def test_a_mixtures_batches_run_on_across_epochs(phase, batch_size, stream, drop):
  plan = _records.BatchPlan(batch_size, drop, None, stream, 0, phase % batch_size)
  covered = [r for index in range(len(plan)) for r in range(*plan.span(index))]
  assert covered == list(range(phase % batch_size, len(covered) + phase % batch_size))
  assert len(covered) <= max(stream - phase % batch_size, 0)
  rest = max(stream - phase % batch_size, 0) - len(covered)
  assert rest == 0 or (drop and rest < batch_size)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(length=st.integers(1, 30), epochs=st.integers(1, 3), batch_size=st.integers(1, 9),
                  drop=st.booleans(), data=st.data())
def test_a_single_source_plans_spans_are_each_epochs_batches_from_its_phase(length, epochs, batch_size, drop, data):
  """Without skips `span` takes a closed form; it cuts what the epochs hold, past the plan's length too."""
  stream = length * epochs
  plan = _records.BatchPlan.at(data.draw(st.integers(0, stream), label="restored at"), batch_size=batch_size,
                               drop_remainder=drop, epoch_length=length, stream_length=stream)
  expected = []
  for epoch in range(epochs + 3):
    for offset in range(plan.phase if epoch == plan.phase_epoch else 0, length, batch_size):
      stop = min(offset + batch_size, length)
      if stop - offset == batch_size or not drop:
        expected.append((epoch * length + offset, epoch * length + stop))
  assert [plan.span(index) for index in range(len(expected))] == expected
  first = data.draw(st.integers(0, batch_size), label="first row")
  count = data.draw(st.integers(0, batch_size), label="rows")
  assert all(list(plan.rows(index, first, count)) == list(range(*span))[first:first + count]
             for index, span in enumerate(expected))


def test_a_cursor_holds_its_restart_record_until_a_batch_is_read_then_the_plans_next_start():
  """Restarted inside an epoch's dropped rest (record 9 of 10, batches of 4): batch 2 starts epoch 1."""
  plan = _records.BatchPlan.at(9, batch_size=4, drop_remainder=True, epoch_length=10, stream_length=20)
  next_index = plan.index_of(9)
  cursor = _records.Cursor(plan, None, (next_index, 9))
  assert cursor.position(next_index) == {_records.NEXT_RECORD: 9}
  assert cursor.position(next_index + 1) == {_records.NEXT_RECORD: plan.next_record(next_index + 1)}
  mixed = _records.Cursor(plan, _records.Mixture(shares={"a": 1}))
  assert set(mixed.position(0)) == {_records.NEXT_RECORD, _records.MIXTURE}
