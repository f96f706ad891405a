"""Tests for ckpt_iter.testing: the checker passes exact pipelines and fails broken ones."""

import copy
import dataclasses

import grain
import ml_dtypes
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import testing


def _produce(batch):
  ids = np.asarray(batch["id"])
  return {"ids": ids.astype(np.int32), "logps": np.sin(ids * 1.7).astype(np.float32),
          "ref_logps": (ids / 3).astype(ml_dtypes.bfloat16), "advantage": np.float64(ids.sum())}


@pytest.fixture
def make_data(make_pipeline):
  return lambda: ckpt_iter.DataIterator(make_pipeline())


@pytest.fixture
def make_repeat(make_pipeline):
  return lambda: ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(make_pipeline()), produce=_produce,
      num_repeats=3, group_size=2, shuffle_seed=11)


def _grain_iterator():
  return iter(grain.MapDataset.range(12).shuffle(seed=1).batch(5).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


# ---------------------------------------------------------------------------
# assert_exact_resume passes what resumes exactly.


def test_passes_a_data_iterator_at_every_point_including_the_end(make_data):
  testing.assert_exact_resume(make_data, checkpoint_at=range(21))  # 20 batches


def test_passes_a_repeat_iterator_mid_group_and_at_group_boundaries(make_repeat):
  testing.assert_exact_resume(make_repeat, checkpoint_at=[0, 1, 5, 6, 7, 31], num_elements=32)


def test_passes_a_plain_grain_iterator():
  testing.assert_exact_resume(_grain_iterator, checkpoint_at=range(4))  # 3 batches


# ---------------------------------------------------------------------------
# ... and fails what does not, naming checkpoint, element and leaf.


class _Wrapper:
  """A Grain-protocol iterator around another, to break one thing in it."""

  def __init__(self, inner):
    self.inner = inner

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.inner)

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


class _OffByOne(_Wrapper):
  """Restores one element too far (an off-by-one in the position)."""

  def set_state(self, state):
    state = copy.deepcopy(state)
    state["position"]["next_record"] += 4  # one batch of 4 records further
    self.inner.set_state(state)


class _FlipsOnePendingBit(_Wrapper):
  """Restores the pending arrays with one bit of one log-prob flipped."""

  def set_state(self, state):
    state = copy.deepcopy(state)
    logps = state["pending"]["items"][0]["logps"]
    logps.view(np.uint32)[0] ^= 1
    self.inner.set_state(state)


class _ForgetsTheEnd(_Wrapper):
  """Yields one extra element after a restore at the end."""

  def set_state(self, state):
    self.inner.set_state(state)
    self.extra = [{"id": np.zeros(4, np.int64), "text": np.array(["x"] * 4)}]

  def __next__(self):
    try:
      return next(self.inner)
    except StopIteration:
      if getattr(self, "extra", None):
        return self.extra.pop()
      raise


class _StaleState(_Wrapper):
  """Resumes right, but after a restore reports the state of a fresh iterator."""

  restored = False

  def set_state(self, state):
    self.inner.set_state(state)
    self.restored = True

  def get_state(self):
    state = self.inner.get_state()
    return {**state, "position": {"next_record": 0}} if self.restored else state


def test_fails_an_off_by_one_restore_naming_checkpoint_and_element(make_data):
  with pytest.raises(AssertionError) as info:
    testing.assert_exact_resume(lambda: _OffByOne(make_data()), checkpoint_at=[0, 3])
  message = str(info.value)
  assert message.startswith("checkpoint at element 0, element 0: element[")
  assert "bytes differ" in message


def test_fails_one_flipped_bit_in_a_restored_pending_array(make_repeat):
  with pytest.raises(AssertionError) as info:
    testing.assert_exact_resume(lambda: _FlipsOnePendingBit(make_repeat()), checkpoint_at=[2])
  message = str(info.value)
  assert "checkpoint at element 2, element 2" in message
  assert "element['logps']: bytes differ" in message


def test_fails_a_stream_that_goes_on_past_the_end(make_data):
  testing.assert_exact_resume(make_data, checkpoint_at=[20])  # the honest one passes
  with pytest.raises(AssertionError) as info:
    testing.assert_exact_resume(lambda: _ForgetsTheEnd(make_data()), checkpoint_at=[20])
  assert "checkpoint at element 20, element 20: the resumed stream goes on" in str(info.value)


def test_fails_a_restored_iterator_that_reports_another_state(make_data):
  with pytest.raises(AssertionError) as info:
    testing.assert_exact_resume(lambda: _StaleState(make_data()), checkpoint_at=[4])
  assert "checkpoint at element 4: right after set_state" in str(info.value)
  assert "state['position']['next_record']: 0 != expected 16" in str(info.value)


def test_a_state_taken_past_the_end_of_the_stream_is_a_usage_error(make_data):
  with pytest.raises(ValueError, match=r"checkpoint_at holds \[21\].*0\.\.20"):
    testing.assert_exact_resume(make_data, checkpoint_at=[3, 21])
  with pytest.raises(ValueError, match="past num_elements=5"):
    testing.assert_exact_resume(make_data, checkpoint_at=[6], num_elements=5)
  with pytest.raises(ValueError, match="empty"):
    testing.assert_exact_resume(make_data, checkpoint_at=[])
  with pytest.raises(ValueError, match="-1"):
    testing.assert_exact_resume(make_data, checkpoint_at=[-1])


# ---------------------------------------------------------------------------
# assert_trees_equal / trees_equal.


@dataclasses.dataclass
class _Example:
  ids: np.ndarray
  mask: np.ndarray | None


_EQUAL = [
    ("nested", {"a": [np.arange(3), (np.float32(1.5), None)], "b": "x"},
     {"a": [np.arange(3), (np.float32(1.5), None)], "b": "x"}),
    ("same_nan", np.array([np.nan], np.float32), np.array([np.nan], np.float32)),
    ("bfloat16", np.arange(4).astype(ml_dtypes.bfloat16), np.arange(4).astype(ml_dtypes.bfloat16)),
    ("dataclass", _Example(np.ones(2), None), _Example(np.ones(2), None)),
    ("key_order", {"a": 1, "b": 2}, {"b": 2, "a": 1}),
]

# (case id, actual, expected, message fragment).
_DIFFERENT = [
    ("dtype", {"x": np.arange(3, dtype=np.int32)}, {"x": np.arange(3, dtype=np.int64)},
     "tree['x']: dtype int32 != expected int64"),
    ("shape", np.zeros((2, 3)), np.zeros((3, 2)), "tree: shape (2, 3) != expected (3, 2)"),
    ("one_bit", np.array([1.0], np.float32), np.array([1.0000001], np.float32), "bytes differ"),
    ("negative_zero", np.array([-0.0]), np.array([0.0]), "bytes differ"),
    ("nan_payload", np.array([0x7FC00000], np.uint32).view(np.float32),
     np.array([0x7FC00001], np.uint32).view(np.float32), "bytes differ"),
    ("scalar_vs_0d", np.float64(1.0), np.array(1.0), "numpy scalar vs array"),
    ("array_vs_list", np.arange(2), [0, 1], "one is an array"),
    ("list_vs_tuple", [1, 2], (1, 2), "type list != expected tuple"),
    ("missing_key", {"a": 1}, {"a": 1, "b": 2}, "keys ['a'] != expected ['a', 'b']"),
    ("length", [1], [1, 2], "length 1 != expected 2"),
    ("int_vs_float", 1, 1.0, "type int != expected float"),
    ("bool_vs_int", True, 1, "type bool != expected int"),
    ("string", "a", "b", "'a' != expected 'b'"),
    ("dataclass_field", _Example(np.ones(2), None), _Example(np.ones(2), np.ones(2, bool)),
     "tree.mask"),
    ("deep_path", {"a": [{"b": (np.int8(1), np.int8(2))}]}, {"a": [{"b": (np.int8(1), np.int8(3))}]},
     "tree['a'][0]['b'][1]: bytes differ"),
]


@pytest.mark.parametrize("actual, expected", [c[1:] for c in _EQUAL], ids=[c[0] for c in _EQUAL])
def test_equal_trees_pass(actual, expected):
  testing.assert_trees_equal(actual, expected)
  assert testing.trees_equal(actual, expected)


@pytest.mark.parametrize(
    "actual, expected, fragment", [c[1:] for c in _DIFFERENT], ids=[c[0] for c in _DIFFERENT])
def test_different_trees_fail_naming_the_leaf(actual, expected, fragment):
  assert not testing.trees_equal(actual, expected)
  with pytest.raises(AssertionError) as info:
    testing.assert_trees_equal(actual, expected)
  assert fragment in str(info.value), str(info.value)


def test_path_names_the_root():
  with pytest.raises(AssertionError, match=r"^batch 3\['id'\]: dtype"):
    testing.assert_trees_equal({"id": np.int32(1)}, {"id": np.int64(1)}, path="batch 3")


# ---------------------------------------------------------------------------
# stored_round_trip and the module's footprint.


def test_stored_round_trip_copies_arrays_and_keeps_their_bits(make_repeat):
  iterator = make_repeat()
  next(iterator)
  state = iterator.get_state()
  stored = testing.stored_round_trip(state)
  testing.assert_trees_equal(stored, state)
  for before, after in zip(state["pending"]["items"], stored["pending"]["items"]):
    assert not np.shares_memory(before["logps"], after["logps"])
  assert stored["pending"]["items"][0]["ref_logps"].dtype == ml_dtypes.bfloat16


