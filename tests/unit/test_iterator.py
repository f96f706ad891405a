"""Tests for ckpt_iter.DataIterator: exact, O(1), validated resume."""

import itertools
import json

import grain
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest


import ckpt_iter
from ckpt_iter import testing
import support


def _records(count, offset=0):
  return [{"id": i + offset, "text": f"t{i + offset}"} for i in range(count)]


def _pipeline(config, **overrides):
  """A make_dataset pipeline from a config dict; every call builds a new one."""
  config = {**config, **overrides}
  return ckpt_iter.make_dataset(
      config.get("records") or _records(config["count"]),
      batch_size=config["batch_size"],
      seed=config["seed"],
      num_epochs=config["num_epochs"],
      drop_remainder=config["drop_remainder"],
      shard_index=config["shard_index"],
      shard_count=config["shard_count"],
      transform=config.get("transform"),
  )


@st.composite
def _configs(draw):
  shard_count = draw(st.integers(1, 3))
  batch_size = draw(st.integers(1, 4))
  return {
      "count": draw(st.integers(batch_size * shard_count, 24)),
      "batch_size": batch_size,
      "seed": draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
      "num_epochs": draw(st.integers(1, 3)),
      "shard_index": draw(st.integers(0, shard_count - 1)),
      "shard_count": shard_count,
      "drop_remainder": draw(st.booleans()) if shard_count == 1 else True,
  }


def _saved(iterator):
  # What a checkpoint holds: the state must survive JSON unchanged.
  state = iterator.get_state()
  assert json.loads(json.dumps(state)) == state
  return json.loads(json.dumps(state))


def _checkpoint_points(draw, length, per_epoch):
  boundaries = [e * per_epoch for e in range(length // per_epoch + 1)]
  point = st.one_of(st.integers(0, length), st.sampled_from(boundaries))
  return draw(st.lists(point, min_size=1, max_size=3))


@hypothesis.given(config=_configs(), data=st.data())
@hypothesis.settings(max_examples=50)
def test_restore_into_fresh_iterator_yields_the_uninterrupted_suffix(config, data):
  per_epoch = _pipeline(config).spec.batches_per_epoch
  length = len(_pipeline(config))
  assert length == per_epoch * config["num_epochs"]
  testing.assert_exact_resume(
      lambda: ckpt_iter.DataIterator(_pipeline(config)),
      checkpoint_at=_checkpoint_points(data.draw, length, per_epoch),
  )


@hypothesis.given(
    config=_configs(),
    chunks=st.lists(st.integers(0, 5), min_size=5, max_size=8),
)
@hypothesis.settings(max_examples=30)
def test_chained_resumes_skip_and_duplicate_nothing(config, chunks):
  full = list(ckpt_iter.DataIterator(_pipeline(config)))
  produced, state = [], None
  for chunk in chunks + [len(full)]:  # the last run drains the rest
    iterator = ckpt_iter.DataIterator(_pipeline(config))  # a new process each time
    if state is not None:
      iterator.set_state(state)
    produced.extend(itertools.islice(iterator, chunk))
    state = _saved(iterator)
  testing.assert_trees_equal(produced, full)


class _Restartable:
  """What Grain's checkpoint helper needs: each __iter__ is a fresh iterator."""

  def __init__(self, build):
    self._build = build

  def __iter__(self):
    return ckpt_iter.DataIterator(self._build())


@pytest.mark.parametrize(
    "build",
    [
        lambda: ckpt_iter.make_dataset(
            _records(11), batch_size=3, seed=4, num_epochs=2, drop_remainder=False,
            shard_index=0, shard_count=1,
        ),
        lambda: ckpt_iter.make_dataset(
            _records(12), batch_size=2, seed=9, num_epochs=2, shard_index=1, shard_count=2,
        ).map(lambda b: {"id": b["id"] * 10}),
        lambda: grain.MapDataset.source(_records(10)).shuffle(seed=3).repeat(2)
        .to_iter_dataset(support.NO_THREADS).batch(3),
    ],
    ids=["make_dataset", "make_dataset_map", "iter_dataset"],
)
def test_grain_checkpoint_helper_and_ours_pass(build):
  grain.experimental.assert_equal_output_after_checkpoint(_Restartable(build))
  length = len(list(ckpt_iter.DataIterator(build())))
  testing.assert_exact_resume(
      lambda: ckpt_iter.DataIterator(build()), checkpoint_at=range(length + 1))


class _CountingSource:
  """An in-memory random-access source that counts reads."""

  def __init__(self, count):
    self.records = _records(count)
    self.reads = 0

  def __len__(self):
    return len(self.records)

  def __getitem__(self, index):
    self.reads += 1
    return self.records[index]


class _CountingTransform:

  def __init__(self):
    self.calls = 0

  def __call__(self, record):
    self.calls += 1
    return {"id": np.int64(record["id"]) * 2}


@pytest.mark.parametrize("checkpoint", [1, 17, 59])
def test_set_state_replays_nothing(checkpoint):
  def build():
    source, transform = _CountingSource(40), _CountingTransform()
    dataset = ckpt_iter.make_dataset(
        source, batch_size=2, seed=5, num_epochs=3, shard_index=0, shard_count=1,
        transform=transform,
    )
    source.reads = 0  # the fingerprint samples records once, at build time
    return dataset, source, transform

  dataset, _, _ = build()
  full = list(ckpt_iter.DataIterator(dataset))
  writer = ckpt_iter.DataIterator(build()[0])
  for _ in range(checkpoint):
    next(writer)
  state = _saved(writer)

  dataset, source, transform = build()
  reader = ckpt_iter.DataIterator(dataset)
  reader.set_state(state)
  # Replaying `checkpoint` batches would read and transform 2 * checkpoint
  # records; the content check produces the last row of the batch before the position.
  assert (source.reads, transform.calls) == (1, 1)
  testing.assert_trees_equal([next(reader)], [full[checkpoint]])
  assert (source.reads, transform.calls) == (3, 3)


# ---------------------------------------------------------------------------
# Drift and invalid states

_BASE = {
    "count": 20, "batch_size": 2, "seed": 0, "num_epochs": 2, "shard_index": 0,
    "shard_count": 1, "drop_remainder": True,
}


def _double(record):
  return {"id": record["id"] * 2}


# (case id, saved config overrides, current config overrides, field named).
_DRIFTS = [
    ("seed", {}, {"seed": 1}, "seed"),
    ("seed_to_none", {}, {"seed": None}, "seed"),
    ("source_records", {}, {"records": _records(20, offset=100)}, "source_digest"),
    ("source_length", {}, {"count": 21}, "source_length"),
    # Fewer epochs than the position needs (more epochs continue the stream:
    # tests/property/test_stream_changes.py).
    ("num_epochs_before_position", {"count": 4}, {"count": 4, "num_epochs": 1}, "num_epochs"),
    ("shard_index", {"shard_count": 2}, {"shard_count": 2, "shard_index": 1}, "shard_index"),
    ("shard_count", {"shard_count": 2}, {"shard_count": 3}, "shard_count"),
    ("drop_remainder", {"count": 21}, {"count": 21, "drop_remainder": False}, "drop_remainder"),
    ("transform", {}, {"transform": _double}, "transform"),
]


def _state_of(config, steps):
  iterator = ckpt_iter.DataIterator(_pipeline(config))
  for _ in range(steps):
    next(iterator)
  return _saved(iterator)


def _assert_untouched(iterator, config, steps):
  """The iterator is still `steps` elements into the pipeline of `config`."""
  assert iterator.get_state() == _state_of(config, steps)
  twin = ckpt_iter.DataIterator(_pipeline(config))
  for _ in range(steps):
    next(twin)
  testing.assert_trees_equal([next(iterator)], [next(twin)])


@pytest.mark.parametrize(
    "saved, current, field", [case[1:] for case in _DRIFTS], ids=[case[0] for case in _DRIFTS],
)
def test_every_drift_field_raises_naming_it_and_leaves_the_iterator(saved, current, field):
  saved_config, current_config = {**_BASE, **saved}, {**_BASE, **current}
  state = _state_of(saved_config, 3)
  iterator = ckpt_iter.DataIterator(_pipeline(current_config))
  next(iterator)

  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.set_state(state)

  assert field in info.value.differences
  saved_value, current_value = info.value.differences[field]
  assert saved_value != current_value
  assert f"{field}={saved_value!r} there, {field}={current_value!r} here" in str(info.value)
  if "past the end" in str(info.value):
    # No allow_drift moves a position past the stream's end: none is recommended (issue 47, case 7).
    assert "no allow_drift" in str(info.value) and "allow_drift={" not in str(info.value)
  else:
    assert "allow_drift=" in str(info.value)
  _assert_untouched(iterator, current_config, 1)


def test_allow_drift_accepts_a_named_field_and_keeps_the_position():
  state = _state_of(_BASE, 3)
  reseeded = {**_BASE, "seed": 1}
  iterator = ckpt_iter.DataIterator(_pipeline(reseeded), allow_drift={"seed"})
  iterator.set_state(state)
  # The position is kept; the data is the new pipeline's (a new shuffle).
  testing.assert_trees_equal([next(iterator)], [_pipeline(reseeded)[3]])

  # Per call, through restore_state, as IteratorRestore(allow_drift=...) does.
  iterator = ckpt_iter.DataIterator(_pipeline(reseeded))
  iterator.restore_state(ckpt_iter.IteratorState.from_dict(state), allow_drift={"seed"})
  assert iterator.get_state()["position"] == {"next_record": 6}  # 3 batches of 2 records


def test_allow_drift_still_names_the_fields_it_does_not_allow():
  state = _state_of(_BASE, 3)
  changed = {**_BASE, "seed": 1, "count": 21}
  iterator = ckpt_iter.DataIterator(_pipeline(changed), allow_drift={"seed"})
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.set_state(state)
  assert set(info.value.differences) == {"source_length", "source_digest"}
  assert "seed" not in str(info.value).replace("allow_drift", "")
  _assert_untouched(iterator, changed, 0)


def _bad(state, **changes):
  """A copy of `state` with top-level fields replaced."""
  return {**json.loads(json.dumps(state)), **changes}


_GOOD = _state_of(_BASE, 3)
_RECORDS = 40  # 20 records x 2 epochs

# (case id, state, exception, message fragments).
_INVALID = [
    ("past_the_end", _bad(_GOOD, position={"next_record": _RECORDS + 1}), ckpt_iter.InvalidStateError,
     ["stream record 41", f"stream ({_RECORDS} records)"]),
    ("negative", _bad(_GOOD, position={"next_record": -1}), ckpt_iter.InvalidStateError, ["-1"]),
    ("str_index", _bad(_GOOD, position={"next_record": "3"}), ckpt_iter.InvalidStateError, ["'3'"]),
    ("bool_index", _bad(_GOOD, position={"next_record": True}), ckpt_iter.InvalidStateError, ["True"]),
    ("extra_key", _bad(_GOOD, position={"next_record": 6, "epoch": 0}), ckpt_iter.InvalidStateError, ["'epoch'"]),
    ("batch_index", _bad(_GOOD, position={"next_index": 3}), ckpt_iter.InvalidStateError,
     ["{'next_index': 3}", "'next_record'"]),
    ("other_kind", _bad(_GOOD, kind="repeat"), ckpt_iter.InvalidStateError, ["'repeat'", "DataIterator"]),
    ("newer_version", _bad(_GOOD, format_version=99), ckpt_iter.StateVersionError, ["99"]),
    ("bad_fingerprint", _bad(_GOOD, fingerprint={"seed": [0]}), ckpt_iter.InvalidStateError, ["'seed'"]),
    ("not_a_dict", "next_index=3", ckpt_iter.InvalidStateError, ["'next_index=3'"]),
]


@pytest.mark.parametrize(
    "state, error, fragments", [case[1:] for case in _INVALID], ids=[case[0] for case in _INVALID],
)
def test_invalid_state_raises_and_leaves_the_iterator(state, error, fragments):
  iterator = ckpt_iter.DataIterator(_pipeline(_BASE))
  for _ in range(2):
    next(iterator)
  with pytest.raises(error) as info:
    iterator.set_state(state)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
  _assert_untouched(iterator, _BASE, 2)


def test_position_at_the_end_is_valid_and_exhausted():
  iterator = ckpt_iter.DataIterator(_pipeline(_BASE))
  # A position edited by hand: the content record (of another position) goes too.
  iterator.set_state(_bad(_GOOD, position={"next_record": _RECORDS}, content="null"))
  assert list(iterator) == []


def test_another_batch_size_continues_at_the_next_record():
  # 3 batches of 2 read (records 0-5); batches of 3 from record 6 on, then of 2 again.
  full = [int(i) for b in ckpt_iter.DataIterator(_pipeline(_BASE, batch_size=1)) for i in b["id"]]
  iterator = ckpt_iter.DataIterator(_pipeline(_BASE, batch_size=3))
  iterator.set_state(_GOOD)
  read = [int(i) for _ in range(4) for i in next(iterator)["id"]]
  assert read == full[6:18]
  again = ckpt_iter.DataIterator(_pipeline(_BASE))
  again.set_state(_saved(iterator))
  # Epoch 0 ends at record 20 (records 18-19: one batch of 2), epoch 1 is 10 batches of 2.
  assert [int(i) for b in again for i in b["id"]] == full[18:40]


def test_bare_grain_state_restores_without_fingerprint_check():
  # A version-0 state (Grain's own checkpoint) has no fingerprint to compare.
  iterator = ckpt_iter.DataIterator(_pipeline(_BASE))
  iterator.set_state({"next_index": 7})
  testing.assert_trees_equal([next(iterator)], [_pipeline(_BASE)[7]])


def test_constructor_rejects_what_it_cannot_iterate():
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.DataIterator([1, 2, 3])
  assert "list" in str(info.value) and "make_dataset" in str(info.value)
  iter_ds = grain.MapDataset.range(3).to_iter_dataset()
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.DataIterator(iter_ds, read_options=support.NO_THREADS)
  assert "read_options" in str(info.value)


# ---------------------------------------------------------------------------
# IterDataset pipelines


def _iter_pipeline(seed):
  return (
      grain.MapDataset.source(_records(14)).shuffle(seed=seed).repeat(2)
      .map(lambda r: {"id": np.int64(r["id"]) + 1000})
      .to_iter_dataset(support.NO_THREADS)
      .batch(3, drop_remainder=False)
  )


@hypothesis.given(checkpoints=st.lists(st.integers(0, 4), min_size=5, max_size=7))
@hypothesis.settings(max_examples=15)
def test_iter_dataset_pipelines_resume_exactly_across_chains(checkpoints):
  full = list(ckpt_iter.DataIterator(_iter_pipeline(seed=2)))
  assert len(full) == 10  # 28 elements in batches of 3
  produced, state = [], None
  for chunk in checkpoints + [len(full)]:
    iterator = ckpt_iter.DataIterator(_iter_pipeline(seed=2))
    if state is not None:
      iterator.set_state(state)
    produced.extend(itertools.islice(iterator, chunk))
    state = _saved(iterator)
  testing.assert_trees_equal(produced, full)


def test_iter_dataset_fingerprint_names_the_pipeline_and_bad_positions_fail_cleanly():
  iterator = ckpt_iter.DataIterator(_iter_pipeline(seed=2))
  assert iterator.fingerprint["pipeline"].startswith("BatchIterDataset")
  next(iterator)
  before = iterator.get_state()
  bad = _bad(before, position={"parent": "garbage"})
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    iterator.set_state(bad)
  assert "'position'" in str(info.value)
  assert iterator.get_state() == before
  reference = ckpt_iter.DataIterator(_iter_pipeline(seed=2))
  next(reference)
  testing.assert_trees_equal([next(iterator)], [next(reference)])


def test_a_repeat_after_make_dataset_reads_every_epoch_and_resumes_exactly():
  # Grain's RepeatMapDataset reads its input past its length (a MapDataset's
  # index space is unbounded); make_dataset's batches continue into later
  # epochs there, as make_dataset(num_epochs=2) would.
  once = ckpt_iter.make_dataset(_records(6), batch_size=2, seed=3, num_epochs=1)
  repeated = list(ckpt_iter.DataIterator(once.repeat(2)))
  twice = list(ckpt_iter.DataIterator(ckpt_iter.make_dataset(_records(6), batch_size=2, seed=3, num_epochs=2)))
  testing.assert_trees_equal(repeated, twice)
  testing.assert_exact_resume(
      lambda: ckpt_iter.DataIterator(once.repeat(2)), checkpoint_at=[0, 2, 3, 5, 6], num_elements=6)
  with pytest.raises(IndexError):
    once[-1]  # pylint: disable=pointless-statement


# ---------------------------------------------------------------------------
# Grain's own mixtures: a reweight never continues silently at the wrong records


def _grain_mix(weights):
  a, b = grain.MapDataset.range(0, 40), grain.MapDataset.range(1000, 1040)
  return grain.MapDataset.mix([a, b], weights=weights).batch(4)


def test_a_reweighted_grain_map_mix_is_refused_even_with_allow_drift():
  # Measured before: with allow_drift={'dataset_length'} (what the refusal then
  # recommended) it continued at the old global index and never trained
  # records 10-15 of the first source.
  saved = ckpt_iter.DataIterator(_grain_mix([0.5, 0.5]))
  for _ in range(5):
    next(saved)
  state = saved.get_state()
  field = next(name for name in saved.fingerprint if name.endswith("MixedMapDataset.weights"))
  for allow in ((), {"dataset_length"}, {"dataset_length", field}):
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      ckpt_iter.DataIterator(_grain_mix([0.8, 0.2]), allow_drift=allow).set_state(state)
    assert f"{field}: 1:1 -> 4:1" in str(info.value)
    assert "ckpt_iter.make_dataset({name: source, ...}, weights=" in str(info.value)


def _grain_iter_mix(weights):
  a = grain.MapDataset.range(0, 40).to_iter_dataset(support.NO_THREADS)
  b = grain.MapDataset.range(1000, 1040).to_iter_dataset(support.NO_THREADS)
  return grain.IterDataset.mix({"a": a, "b": b}, weights=weights).batch(4)


def test_a_reweighted_grain_iter_mix_continues_each_source_when_declared():
  saved = ckpt_iter.DataIterator(_grain_iter_mix({"a": 1, "b": 1}))
  first = [int(i) for _ in range(5) for i in next(saved)]
  state = saved.get_state()
  with pytest.raises(ckpt_iter.ConfigDriftError, match="MixedIterDataset.weights"):
    ckpt_iter.DataIterator(_grain_iter_mix({"a": 3, "b": 1})).set_state(state)
  resumed = ckpt_iter.DataIterator(_grain_iter_mix({"a": 3, "b": 1}), allow_drift={"weights"})
  resumed.set_state(state)
  later = [int(i) for _ in range(4) for i in next(resumed)]
  for low in (0, 1000):  # each source on from its own next element, nothing twice or skipped
    got = [i for i in first + later if low <= i < low + 1000]
    assert got == list(range(low, low + len(got)))
  assert sum(i < 1000 for i in later) > sum(i >= 1000 for i in later)


# ---------------------------------------------------------------------------
# Skips (ckpt_iter.skips) in a pipeline without a GlobalBatchDataset: a hand-built one, lanes
# (a GlobalBatchDataset's restore of them: tests/unit/test_global_batch.py).


def test_a_state_with_skips_needs_a_make_dataset_pipeline():
  saved = ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 4, skip=[(1, 2)]))
  next(saved)
  state = saved.state().to_dict()
  state["fingerprint"] = {**state["fingerprint"], "graph": "SourceMapDataset"}
  with pytest.raises(ckpt_iter.CkptIterError) as info:
    ckpt_iter.DataIterator(grain.MapDataset.range(10)).set_state(state)
  assert "skips stream records [1, 2)" in str(info.value)


def test_a_lanes_pipeline_drops_skipped_records_and_refuses_a_skip_into_a_chunk_in_progress():
  def pipeline(skip=None):
    return ckpt_iter.make_dataset(support.CHAIN_RECORDS, batch_size=2, seed=None, num_epochs=None, shard_index=0,
                                  shard_count=1, chunk_size=4, num_lanes=2, filter=lambda r: True, skip=skip)
  saved = ckpt_iter.DataIterator(pipeline())
  assert support.batch_ids(next(saved)) == [0, 4]  # lane 0 takes chunk 0, lane 1 chunk 1
  state = saved.get_state()
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as info:
    ckpt_iter.DataIterator(pipeline(skip=[(2, 3)])).set_state(state)
  assert "chunk 0, of which lane 0 has already taken 1 rows" in str(info.value)
  resumed = ckpt_iter.DataIterator(pipeline(skip=[(9, 11)]))  # chunk 2: lane 0's next
  resumed.set_state(state)
  read = [support.batch_ids(next(resumed)) for _ in range(5)]
  assert [b[0] for b in read] == [1, 2, 3, 8, 11]


def test_renamed_public_names_keep_their_old_name_for_a_release_with_a_warning():
  # issue 58 item 9: `Stream` beside `StreamingIterator`, `DataIterator.skip(count)` beside `Skip`.
  import warnings  # pylint: disable=g-import-not-at-top

  with pytest.warns(DeprecationWarning, match="renamed ckpt_iter.RecordStream"):
    assert ckpt_iter.Stream is ckpt_iter.RecordStream
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset([{"x": i} for i in range(10)], batch_size=1, seed=None))
  with pytest.warns(DeprecationWarning, match=r"renamed advance\(count\)"):
    iterator.skip(2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    iterator.advance(3)
  assert int(next(iterator)["x"][0]) == 5
  assert "Stream" not in ckpt_iter.__all__ and "RecordStream" in ckpt_iter.__all__


@pytest.mark.parametrize("moved", [4, -4, 12])
def test_an_edited_position_is_named_not_blamed_on_the_data(moved):
  # issue 66 item 6: next_record edited (still valid JSON) was refused as a content change, with
  # allow_drift={'content.id'} as the way through: the data was fine, the position was not.
  import dataclasses  # pylint: disable=g-import-not-at-top

  make = lambda: ckpt_iter.make_dataset([{"id": i} for i in range(40)], batch_size=4, seed=0)
  iterator = ckpt_iter.DataIterator(make())
  for _ in range(3):
    next(iterator)
  saved = iterator.state()
  edited = dataclasses.replace(saved, position={"next_record": saved.position["next_record"] + moved})
  with pytest.raises(ckpt_iter.ContentDriftError, match=r"The one it saw is element \d+, \d+ (after|before) it: "
                     r"field 'position' may be what disagrees \(edited or damaged\)") as caught:
    ckpt_iter.DataIterator(make()).restore_state(edited)
  # The position first, and the way through for the data only if the data changed.
  assert str(caught.value).index("restore an earlier checkpoint") < str(caught.value).index("allow_drift=")
  assert caught.value.recorded_at == caught.value.index - moved // 4
  restored = ckpt_iter.DataIterator(make())
  restored.restore_state(saved)  # the state as saved resumes


def test_a_restore_of_many_skip_ranges_runs_at_most_one_collection():
  # issue 65 item 8: a restore's cost grew faster than its skip ranges (10^3 -> 10^4: 13.6-21.7x), the excess
  # in collections walking the many small objects the decode makes; the collector is off while it restores.
  import gc  # pylint: disable=g-import-not-at-top

  records = [{"id": i} for i in range(50_000)]
  skip = ckpt_iter.Skip(records=[(1000 + 10 * i, 1005 + 10 * i) for i in range(5_000)])
  make = lambda: ckpt_iter.make_dataset(records, batch_size=4, num_epochs=None, skip=skip)
  iterator = ckpt_iter.DataIterator(make())
  next(iterator)
  state = iterator.get_state()
  collections = []
  callback = lambda phase, info: collections.append(info["generation"]) if phase == "start" else None
  fresh = ckpt_iter.DataIterator(make())
  # Counted from an empty youngest generation, so none starts before the pause; the allocations made while
  # paused start at most one when the collector comes back on, at the pause's end (not one per 700).
  gc.collect()
  gc.callbacks.append(callback)
  try:
    fresh.set_state(state)
  finally:
    gc.callbacks.remove(callback)
  assert collections in ([], [0]) and gc.isenabled()
  assert [int(x) for x in next(fresh)["id"]] == [4, 5, 6, 7]
