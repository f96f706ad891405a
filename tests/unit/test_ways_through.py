"""Every way through a refusal is followed (issue 47, case 7): what it recommends trains each record once.

For each refusal of a changed make_dataset pipeline that names an
`allow_drift`, the test restores with exactly what the message recommends
and counts, per source, the records trained twice and the records passed
over: both must be 0. A refusal with no exact way through must not
recommend one, and no field-level name may open it.
"""

import ast
import collections
import os
import re

import pytest

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib

import support

SOURCES = {"a": [{"id": 1000 + i} for i in range(17)], "b": [{"id": 2000 + i} for i in range(11)],
           "c": [{"id": 3000 + i} for i in range(13)]}


def _mixture(weights, **extra):
  return ckpt_iter.make_dataset({name: SOURCES[name] for name in weights}, weights=weights, batch_size=2, seed=5,
                                num_epochs=None, **extra)


def _saved(tmp_path, pipeline, batches=4):
  iterator = ckpt_iter.DataIterator(pipeline)
  read = [x for _ in range(batches) for x in support.batch_ids(next(iterator))]
  item = os.path.join(tmp_path, "1", "data")
  os.makedirs(item)
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))
  return item, read


def _restore(item, pipeline, allow_drift=()):
  iterator = ckpt_iter.DataIterator(pipeline)
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(
      item, ckpt_iter.IteratorRestore(iterator, allow_drift=set(allow_drift)))
  return iterator


def _recommended(error):
  """The allow_drift set a refusal recommends, or None."""
  match = re.search(r"allow_drift=(\{[^}]*\})", str(error))
  return None if match is None else ast.literal_eval(match.group(1))


def _duplicates_and_skips(trained):
  """Per source, against its own stream (its own shuffled epochs, the same whatever the mixture): the
  records trained more often than in the stream's prefix of that length, and those trained less."""
  duplicates = skips = 0
  for number, name in enumerate(SOURCES, start=1):
    mine = [x for x in trained if x // 1000 == number]
    iterator = ckpt_iter.DataIterator(_mixture({name: 1}))
    own = [x for _ in range(len(mine) // 2 + 1) for x in support.batch_ids(next(iterator))][:len(mine)]
    duplicates += sum((collections.Counter(mine) - collections.Counter(own)).values())
    skips += sum((collections.Counter(own) - collections.Counter(mine)).values())
  return duplicates, skips


_MIXTURE_CHANGES = [
    ({"a": 1, "b": 1}, {"a": 4, "b": 1}),  # reweighted (50/50 -> 80/20)
    ({"a": 1, "b": 1}, {"a": 1}),  # a source removed
    ({"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 2}),  # a source added
    ({"a": 1, "b": 1, "c": 1}, {"c": 1, "a": 2}),  # all three at once
]


@pytest.mark.parametrize("before, after", _MIXTURE_CHANGES)
def test_each_recommended_way_through_a_mixture_change_trains_every_record_once(before, after, tmp_path):
  item, read = _saved(tmp_path, _mixture(before))
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, _mixture(after))
  way = _recommended(refusal.value)
  assert way, f"the refusal recommends no allow_drift: {refusal.value}"
  resumed = _restore(item, _mixture(after), allow_drift=way)
  trained = read + [x for _ in range(10) for x in support.batch_ids(next(resumed))]
  assert _duplicates_and_skips(trained) == (0, 0)


@pytest.mark.parametrize("before, after", _MIXTURE_CHANGES)
def test_the_names_a_refusal_gives_a_program_are_what_its_allow_drift_accepts(before, after, tmp_path):
  # issue 66 item 17: a 50/50 -> 80/20 reweight's `differences` was {'weight[a]': (1, 4)}, its message asked
  # for allow_drift={'weights'}, and allow_drift=set(error.differences) was refused again.
  item, read = _saved(tmp_path, _mixture(before))
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, _mixture(after))
  assert _recommended(refusal.value) <= set(refusal.value.differences)
  resumed = _restore(item, _mixture(after), allow_drift=set(refusal.value.differences))
  trained = read + [x for _ in range(10) for x in support.batch_ids(next(resumed))]
  assert _duplicates_and_skips(trained) == (0, 0)


def test_the_order_of_a_mixtures_keys_is_not_a_change_of_the_data(tmp_path):
  # A config loaded another way gives the same mapping in another key order: accepted, each
  # source continues from its own next record (it was refused even with allow_drift={"sources"},
  # and the refusal's allow_drift={'source'} continued the old ledger under the new interleave).
  item, read = _saved(tmp_path, _mixture({"a": 1, "b": 1, "c": 1}))
  resumed = _restore(item, _mixture({"c": 1, "b": 1, "a": 1}))
  trained = read + [x for _ in range(10) for x in support.batch_ids(next(resumed))]
  assert _duplicates_and_skips(trained) == (0, 0)


_LANES = dict(filter=lambda record: True, chunk_size=4, num_lanes=2)


@pytest.mark.parametrize("before, after", [({"a": 1, "b": 1}, {"a": 4, "b": 1}), ({"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 2})])
def test_a_filtered_mixture_reweighted_or_grown_follows_its_way_through_exactly(before, after, tmp_path):
  # Lanes read chunks at different stream records: the new weights take effect after the furthest chunk any
  # lane reached. Refused at first, it once had no way through; stock MaxText continued with "minor skipping".
  item, read = _saved(tmp_path, _mixture(before, **_LANES))
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, _mixture(after, **_LANES))
  way = _recommended(refusal.value)
  assert way and "after the furthest chunk any lane reached" in str(refusal.value)
  resumed = _restore(item, _mixture(after, **_LANES), allow_drift=way)
  # 12 batches: both lanes end at a chunk's end, so what was read is each source's prefix.
  trained = read + [x for _ in range(12) for x in support.batch_ids(next(resumed))]
  assert _duplicates_and_skips(trained) == (0, 0)


@pytest.mark.parametrize("allow_drift", [(), ("sources",), ("weights", "sources", "source")])
def test_a_source_removed_from_a_filtered_mixture_has_no_way_through_and_recommends_none(allow_drift, tmp_path):
  # Lanes behind still read chunks mixed with the removed source: no allow_drift continues it.
  item, _ = _saved(tmp_path, _mixture({"a": 1, "b": 1}, **_LANES))
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, _mixture({"a": 1}, **_LANES), allow_drift=allow_drift)
  assert _recommended(refusal.value) is None
  assert "cannot be removed at a restart" in str(refusal.value) and "chunks mixed with b" in str(refusal.value)


def test_a_position_past_the_end_recommends_no_allow_drift(tmp_path):
  item, _ = _saved(tmp_path, ckpt_iter.make_dataset(support.CHAIN_RECORDS, batch_size=4, seed=5, num_epochs=2),
                   batches=8)
  fewer = ckpt_iter.make_dataset(support.CHAIN_RECORDS, batch_size=4, seed=5, num_epochs=1)
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, fewer)
  assert _recommended(refusal.value) is None, refusal.value
  assert "past the end" in str(refusal.value) and "restore an earlier step" in str(refusal.value)
  with pytest.raises(ckpt_iter.ConfigDriftError):
    _restore(item, fewer, allow_drift={"num_epochs", "dataset_length"})


@pytest.mark.parametrize("before, after", [
    ({"a": 1, "b": 2}, {"b": 2}),  # the shares' gcd moves: b's integer share 2 -> 1
    ({"b": 2}, {"a": 1, "b": 2}),
    ({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1}),  # the gcd stays
    ({"a": 2, "b": 4}, {"a": 2, "b": 4, "c": 3}),
])
def test_a_change_of_sources_alone_needs_sources_whatever_the_shares_gcd(before, after, tmp_path):
  # issue 60 item 2: adding or removing a source was refused as a weights change whenever the gcd of
  # the integer shares moved ({a: 1, b: 2} -> {b: 2}), though b's part among the sources kept is the same.
  item, read = _saved(tmp_path, _mixture(before))
  with pytest.raises(ckpt_iter.ConfigDriftError) as refusal:
    _restore(item, _mixture(after))
  assert _recommended(refusal.value) == {"sources"}, refusal.value
  resumed = _restore(item, _mixture(after), allow_drift={"sources"})
  trained = read + [x for _ in range(10) for x in support.batch_ids(next(resumed))]
  assert _duplicates_and_skips(trained) == (0, 0)
