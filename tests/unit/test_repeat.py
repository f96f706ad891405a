"""Tests for ckpt_iter.RepeatIterator: the mu-repeat queue, resumed exactly."""

import itertools

import hypothesis
from hypothesis import strategies as st
import jax
import ml_dtypes
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import testing


def _records(count):
  return [{"id": i} for i in range(count)]


def _source(config):
  return ckpt_iter.DataIterator(
      ckpt_iter.make_dataset(
          _records(config["count"]),
          batch_size=config["batch_size"],
          seed=config["seed"],
          num_epochs=config["num_epochs"],
          shard_index=0,
          shard_count=1,
      )
  )


class _Producer:
  """A deterministic rollout stand-in that counts its calls.

  Its output mixes dtypes (bfloat16 included) and a numpy scalar, as RL
  rollouts do (completion ids, log-probs, advantages).
  """

  def __init__(self):
    self.calls = 0

  def __call__(self, element):
    self.calls += 1
    ids = element["id"]
    return {
        "prompt_ids": ids.astype(np.int32),
        "completion_ids": (ids[:, None] * 7 + np.arange(3)).astype(np.int32),
        "logps": np.sin(ids * 1.7 + 0.1).astype(np.float32),
        "ref_logps": (ids / 3).astype(ml_dtypes.bfloat16),
        "advantage": np.float64(ids.sum()) / 3,
    }


def _repeat(config, produce=None, **overrides):
  """A fresh RepeatIterator over a fresh source: what a new process builds."""
  options = {
      "num_repeats": config["num_repeats"],
      "group_size": config["group_size"],
      "shuffle_seed": config["shuffle_seed"],
      **overrides,
  }
  return ckpt_iter.RepeatIterator(
      _source(config), produce=produce or _Producer(), **options
  )


@st.composite
def _configs(draw):
  batch_size = draw(st.integers(1, 2))
  return {
      "count": draw(st.integers(batch_size, 16)),
      "batch_size": batch_size,
      "seed": draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
      "num_epochs": draw(st.integers(1, 2)),
      "group_size": draw(st.integers(1, 3)),
      "num_repeats": draw(st.integers(1, 8)),
      "shuffle_seed": draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
  }


def _checkpointed(iterator):
  """The state as a checkpoint holds it: JSON header + npz, read back unpickled."""
  return ckpt_iter.IteratorState.from_dict(testing.stored_round_trip(iterator.get_state()))


def _pending_length(value):
  return 0 if value.pending is None else len(value.pending.schedule)


@hypothesis.given(config=_configs(), data=st.data())
@hypothesis.settings(max_examples=50)
def test_restore_into_fresh_iterator_yields_the_uninterrupted_suffix(config, data):
  length = len(list(_repeat(config)))
  points = sorted(set(data.draw(st.lists(st.integers(0, length), min_size=1, max_size=3))))
  producers = []

  def make():
    producers.append(_Producer())
    return _repeat(config, produce=producers[-1])

  testing.assert_exact_resume(make, checkpoint_at=points)

  # Pending items come from the checkpoint: produce runs only for new groups.
  group_length = config["group_size"] * config["num_repeats"]
  for point, producer in zip(points, producers[1:], strict=True):
    pending = -point % group_length
    assert producer.calls * config["num_repeats"] == length - point - pending


@hypothesis.given(
    config=_configs(), chunks=st.lists(st.integers(0, 7), min_size=5, max_size=8),
)
@hypothesis.settings(max_examples=30)
def test_chained_resumes_skip_duplicate_and_reproduce_nothing(config, chunks):
  uninterrupted = _Producer()
  full = list(_repeat(config, produce=uninterrupted))
  produced, saved, calls = [], None, 0
  for chunk in chunks + [len(full)]:
    producer = _Producer()
    iterator = _repeat(config, produce=producer)
    if saved is not None:
      iterator.restore_state(saved)
    produced.extend(itertools.islice(iterator, chunk))
    saved = _checkpointed(iterator)
    calls += producer.calls
  testing.assert_trees_equal(produced, full)
  # Across all the runs, every group was produced exactly once.
  assert calls == uninterrupted.calls


def test_pending_items_are_restored_not_regenerated():
  # Rollouts are not reproducible in general: each call returns new values.
  counter = itertools.count()

  def rollout(element):
    return {"ids": element["id"] * 100 + next(counter), "noise": np.random.default_rng().random(4)}

  def fresh_rollout(element):
    return {"ids": element["id"] * 0 - 1, "noise": np.zeros(4)}

  config = {"count": 12, "batch_size": 1, "seed": 3, "num_epochs": 1,
            "group_size": 3, "num_repeats": 4, "shuffle_seed": 9}
  writer = _repeat(config, produce=rollout)
  for _ in range(5):  # mid-way through the second repeat of the first group
    next(writer)
  saved = _checkpointed(writer)
  assert _pending_length(saved) == 3 * 4 - 5
  expected_pending = [next(writer) for _ in range(_pending_length(saved))]

  reader = _repeat(config, produce=fresh_rollout)
  reader.restore_state(saved)
  testing.assert_trees_equal([next(reader) for _ in range(len(expected_pending))], expected_pending)
  assert next(reader)["ids"].tolist() == [-1]  # the next group is a new rollout


def test_set_state_accepts_the_in_memory_dict():
  config = {"count": 9, "batch_size": 1, "seed": None, "num_epochs": 1,
            "group_size": 2, "num_repeats": 3, "shuffle_seed": 4}
  full = list(_repeat(config))
  writer = _repeat(config)
  for _ in range(4):
    next(writer)
  state = writer.get_state()
  assert state["kind"] == "repeat" and state["pending"]["schedule"]
  reader = _repeat(config)
  reader.set_state(state)
  testing.assert_trees_equal(list(reader), full[4:])


def _tunix_order(groups, num_repeats, seed):
  """Tunix's enqueue_examples rule, computed here independently."""
  key = jax.random.PRNGKey(seed)
  order, keys = [], []
  for group in groups:
    keys.append(np.asarray(key).tolist())
    for _ in range(num_repeats):
      sub, key = jax.random.split(key)
      permutation = np.asarray(jax.random.permutation(sub, len(group)))
      order.extend(group[i] for i in permutation)
  return order, keys


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_shuffled_order_is_tunix_rule(seed):
  group_size, num_repeats = 5, 3
  config = {"count": 15, "batch_size": 1, "seed": None, "num_epochs": 1,
            "group_size": group_size, "num_repeats": num_repeats, "shuffle_seed": seed}
  iterator = _repeat(config)
  ids, keys = [], []
  while True:
    if iterator.state().pending is None:
      keys.append(list(iterator.state().shuffle_key))  # at a group boundary
    try:
      ids.append(int(next(iterator)["prompt_ids"][0]))
    except StopIteration:
      break
  groups = [list(range(g, g + group_size)) for g in range(0, 15, group_size)]
  expected, expected_keys = _tunix_order(groups, num_repeats, seed)
  assert ids == expected
  assert keys[:-1] == expected_keys  # the last boundary is the end
  assert ids != [i for g in groups for _ in range(num_repeats) for i in g]


def test_without_shuffle_seed_each_repeat_is_in_production_order():
  config = {"count": 6, "batch_size": 1, "seed": None, "num_epochs": 1,
            "group_size": 3, "num_repeats": 2, "shuffle_seed": None}
  ids = [int(item["prompt_ids"][0]) for item in _repeat(config)]
  assert ids == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]


def test_a_partial_last_group_is_dropped_without_producing_it():
  config = {"count": 7, "batch_size": 1, "seed": None, "num_epochs": 1,
            "group_size": 3, "num_repeats": 2, "shuffle_seed": None}
  producer = _Producer()
  ids = [int(item["prompt_ids"][0]) for item in _repeat(config, produce=producer)]
  assert ids == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
  assert producer.calls == 6  # record 6 is read but never rolled out


def test_state_has_pending_only_mid_group():
  config = {"count": 4, "batch_size": 2, "seed": None, "num_epochs": 1,
            "group_size": 1, "num_repeats": 2, "shuffle_seed": 1}
  iterator = _repeat(config)
  assert iterator.state().pending is None
  next(iterator)
  value = iterator.state()
  # Its source's whole state nested, at the group read (one batch of 2 records).
  assert set(value.position) == {"parent"} and value.part.position == {"next_record": 2}
  assert value.part.kind == "data" and value.part.fingerprint["batch_size"] == 2
  assert value.fingerprint == {"num_repeats": 2, "group_size": 1, "shuffle_seed": 1}
  assert len(value.pending.items) == 1 and value.pending.schedule == (0,)
  next(iterator)
  assert iterator.state().pending is None


# ---------------------------------------------------------------------------
# Drift, invalid states, arguments

_BASE = {"count": 12, "batch_size": 1, "seed": 1, "num_epochs": 1,
         "group_size": 2, "num_repeats": 3, "shuffle_seed": 5}

# (case id, current config overrides, field named).
_DRIFTS = [
    ("num_repeats", {"num_repeats": 2}, "num_repeats"),
    ("group_size", {"group_size": 3}, "group_size"),
    ("shuffle_seed", {"shuffle_seed": 6}, "shuffle_seed"),
    ("shuffle_seed_none", {"shuffle_seed": None}, "shuffle_seed"),
    ("data_seed", {"seed": 2}, "seed"),
    ("data_length", {"count": 13}, "source_length"),
]


def _assert_untouched(iterator, config, steps):
  twin = _repeat(config)
  for _ in range(steps):
    next(twin)
  assert iterator.get_state()["position"] == twin.get_state()["position"]
  assert iterator.get_state()["shuffle_key"] == twin.get_state()["shuffle_key"]
  testing.assert_trees_equal(list(iterator), list(twin))


@pytest.mark.parametrize(
    "current, field", [case[1:] for case in _DRIFTS], ids=[case[0] for case in _DRIFTS],
)
def test_drift_raises_naming_the_field_and_leaves_the_iterator(current, field):
  writer = _repeat(_BASE)
  for _ in range(4):
    next(writer)
  saved = _checkpointed(writer)
  assert saved.pending is not None
  current_config = {**_BASE, **current}
  iterator = _repeat(current_config)
  next(iterator)

  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.restore_state(saved)

  saved_value, current_value = info.value.differences[field]
  assert f"{field}={saved_value!r} there, {field}={current_value!r} here" in str(info.value)
  _assert_untouched(iterator, current_config, 1)


def test_allow_drift_accepts_a_named_field():
  writer = _repeat(_BASE)
  for _ in range(4):
    next(writer)
  saved = _checkpointed(writer)
  expected = list(writer)
  # Another shuffle seed only changes groups that start after the restore;
  # the saved key chain continues, so nothing changes here.
  iterator = _repeat({**_BASE, "shuffle_seed": 6}, allow_drift={"shuffle_seed"})
  iterator.restore_state(saved)
  testing.assert_trees_equal(list(iterator), expected)


def test_repeat_state_is_refused_by_a_data_iterator_and_vice_versa():
  writer = _repeat(_BASE)
  next(writer)
  data_iterator = _source(_BASE)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    data_iterator.set_state(writer.get_state())
  assert "'repeat'" in str(info.value)
  iterator = _repeat(_BASE)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    iterator.set_state(_source(_BASE).get_state())
  assert "'data'" in str(info.value)


def test_bad_pending_schedule_is_refused_and_leaves_the_iterator():
  writer = _repeat(_BASE)
  next(writer)
  state = writer.get_state()
  state["pending"]["schedule"] = [0, 5]
  iterator = _repeat(_BASE)
  next(iterator)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    iterator.set_state(state)
  assert "pending.schedule[1] is 5" in str(info.value)
  _assert_untouched(iterator, _BASE, 1)


def test_bad_data_position_is_refused_before_anything_changes():
  writer = _repeat(_BASE)
  next(writer)
  state = writer.get_state()
  state["position"] = {"next_index": 99}
  iterator = _repeat(_BASE)
  next(iterator)
  with pytest.raises(ckpt_iter.InvalidStateError) as info:
    iterator.set_state(state)
  assert "99" in str(info.value)
  _assert_untouched(iterator, _BASE, 1)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"num_repeats": 0}, "num_repeats=0"),
        ({"num_repeats": 1.0}, "num_repeats=1.0"),
        ({"group_size": 0}, "group_size=0"),
        ({"group_size": True}, "group_size=True"),
        ({"shuffle_seed": -1}, "shuffle_seed=-1"),
        ({"shuffle_seed": 2**32}, f"shuffle_seed={2**32}"),
        ({"produce": 3}, "produce=3"),
        ({"source": [1, 2]}, "DataIterator"),
    ],
    ids=["repeats_zero", "repeats_float", "group_zero", "group_bool", "seed_negative",
         "seed_too_big", "produce", "source"],
)
def test_constructor_rejects_bad_arguments(overrides, fragment):
  kwargs = {"source": _source(_BASE), "produce": _Producer(), "num_repeats": 2,
            "group_size": 1, "shuffle_seed": None, **overrides}
  source = kwargs.pop("source")
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.RepeatIterator(source, **kwargs)
  assert fragment in str(info.value)
