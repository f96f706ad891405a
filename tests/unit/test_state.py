"""Tests for ckpt_iter.state: validation, migration, fingerprints and codecs."""

import copy
import dataclasses
import io
import json
import math
import re
import struct

import grain
import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ckpt_iter import errors
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
from ckpt_iter import testing

ORIGIN = "/ckpt/7/data/process_0-of-1.json"


def _valid_dict():
  return {
      "format_version": state_lib.FORMAT_VERSION,
      "kind": "repeat",
      "fingerprint": {"seed": 0, "source": "records"},
      "position": {"next_index": 3},
      "shuffle_key": [0, 42],
      "pending": {"items": [{"a": np.arange(3)}], "schedule": [0, 0]},
      "counters": {"steps": 4},
  }


def _with(**changes):
  value = _valid_dict()
  for name, new in changes.items():
    if new is _MISSING:
      del value[name]
    else:
      value[name] = new
  return value


_MISSING = object()

# (case id, state value, exception class, substrings the message must hold).
# Every message must also start from the origin, so the user knows the file.
_BAD_STATES = [
    ("not_a_dict", [1, 2], errors.InvalidStateError, ["must be a dict", "list"]),
    ("version_str", _with(format_version="1"), errors.InvalidStateError, ["format_version", "'1'"]),
    ("version_bool", _with(format_version=True), errors.InvalidStateError, ["format_version", "True"]),
    ("version_float", _with(format_version=1.0), errors.InvalidStateError, ["format_version", "1.0"]),
    ("version_newer", _with(format_version=state_lib.FORMAT_VERSION + 1), errors.StateVersionError,
     [f"format_version {state_lib.FORMAT_VERSION + 1}", "Upgrade"]),
    ("version_zero", _with(format_version=0), errors.StateVersionError, ["format_version 0"]),
    ("version_negative", _with(format_version=-3), errors.StateVersionError, ["format_version -3"]),
    ("version_missing", _with(format_version=_MISSING), errors.InvalidStateError, ["'format_version'"]),
    ("kind_unknown", _with(kind="bogus"), errors.InvalidStateError, ["'kind'", "'bogus'"]),
    ("kind_missing", _with(kind=_MISSING), errors.InvalidStateError, ["'kind'", "None"]),
    ("fingerprint_missing", _with(fingerprint=_MISSING), errors.InvalidStateError, ["'fingerprint'"]),
    ("fingerprint_list", _with(fingerprint=["seed"]), errors.InvalidStateError, ["'fingerprint'", "['seed']"]),
    ("fingerprint_value", _with(fingerprint={"seed": [0]}), errors.InvalidStateError, ["fingerprint field 'seed'", "[0]"]),
    ("fingerprint_key", _with(fingerprint={3: 0}), errors.InvalidStateError, ["fingerprint field names", "3"]),
    ("position_missing", _with(position=_MISSING), errors.InvalidStateError, ["'position'"]),
    ("position_list", _with(position=[3]), errors.InvalidStateError, ["'position'", "[3]"]),
    ("shuffle_key_str", _with(shuffle_key="abc"), errors.InvalidStateError, ["'shuffle_key'", "'abc'"]),
    ("shuffle_key_empty", _with(shuffle_key=[]), errors.InvalidStateError, ["'shuffle_key'", "[]"]),
    ("shuffle_key_negative", _with(shuffle_key=[-1, 0]), errors.InvalidStateError, ["'shuffle_key'", "[-1, 0]"]),
    ("shuffle_key_too_big", _with(shuffle_key=[2**32, 0]), errors.InvalidStateError, ["'shuffle_key'", str(2**32)]),
    ("shuffle_key_float", _with(shuffle_key=[1.5, 0]), errors.InvalidStateError, ["'shuffle_key'", "1.5"]),
    ("shuffle_key_bool", _with(shuffle_key=[True, 0]), errors.InvalidStateError, ["'shuffle_key'", "True"]),
    ("pending_str", _with(pending="x"), errors.InvalidStateError, ["'pending'", "'x'"]),
    ("pending_items", _with(pending={"items": "x", "schedule": []}), errors.InvalidStateError, ["'pending.items'", "'x'"]),
    ("pending_items_missing", _with(pending={"schedule": []}), errors.InvalidStateError, ["'pending.items'"]),
    ("pending_schedule", _with(pending={"items": [], "schedule": "x"}), errors.InvalidStateError, ["'pending.schedule'", "'x'"]),
    ("pending_schedule_float", _with(pending={"items": [{}], "schedule": [0.0]}), errors.InvalidStateError, ["'pending.schedule'", "0.0"]),
    ("pending_schedule_range", _with(pending={"items": [{}], "schedule": [0, 1]}), errors.InvalidStateError, ["pending.schedule[1] is 1", "1 pending items"]),
    ("pending_schedule_negative", _with(pending={"items": [{}], "schedule": [-1]}), errors.InvalidStateError, ["pending.schedule[0] is -1"]),
    ("counters_list", _with(counters=[1]), errors.InvalidStateError, ["'counters'", "[1]"]),
    ("counters_str_value", _with(counters={"steps": "4"}), errors.InvalidStateError, ["'counters'", "'4'"]),
    ("counters_float_value", _with(counters={"steps": 1.5}), errors.InvalidStateError, ["'counters'", "1.5"]),
    ("counters_int_key", _with(counters={1: 1}), errors.InvalidStateError, ["'counters'", "{1: 1}"]),
]


@pytest.mark.parametrize(
    "value, error, fragments", [case[1:] for case in _BAD_STATES],
    ids=[case[0] for case in _BAD_STATES],
)
def test_from_dict_rejects_malformed_state_naming_the_field(value, error, fragments):
  with pytest.raises(error) as info:
    state_lib.IteratorState.from_dict(value, origin=ORIGIN)
  message = str(info.value)
  assert message.startswith(ORIGIN), message
  for fragment in fragments:
    assert fragment in message, (fragment, message)
  assert isinstance(info.value, errors.CkptIterError)


def test_from_dict_accepts_the_valid_base_case():
  # Guards the table above: each bad case differs from this one in one field.
  value = state_lib.IteratorState.from_dict(_valid_dict())
  assert value.kind == "repeat"
  assert value.shuffle_key == (0, 42)
  assert value.pending.schedule == (0, 0)
  assert value.counters == {"steps": 4}


def test_to_dict_round_trips_and_starts_with_format_version():
  value = state_lib.IteratorState.from_dict(_valid_dict())
  as_dict = value.to_dict()
  assert next(iter(as_dict)) == "format_version"
  again = state_lib.IteratorState.from_dict(as_dict)
  assert again.to_dict().keys() == as_dict.keys()
  assert again.fingerprint == value.fingerprint
  assert again.position == value.position
  assert again.shuffle_key == value.shuffle_key
  np.testing.assert_array_equal(again.pending.items[0]["a"], np.arange(3))


def test_an_iterator_state_is_validated_copied_immutable_and_hashable():
  with pytest.raises(errors.InvalidStateError, match="field 'kind' is 'bogus'"):
    state_lib.IteratorState(kind="bogus", fingerprint={}, position={})
  with pytest.raises(errors.InvalidStateError, match="fingerprint field 'lr'.*finite float"):
    state_lib.IteratorState(kind="data", fingerprint={"lr": math.nan}, position={})
  fingerprint, position = {"seed": 1}, {"next_index": 2, "nested": {"a": [1]}}
  value = state_lib.IteratorState(kind="data", fingerprint=fingerprint, position=position)
  fingerprint["seed"], position["nested"]["a"][0] = 9, 9  # the caller's dicts, not the state's
  assert value.fingerprint == {"seed": 1} and value.position == {"next_index": 2, "nested": {"a": [1]}}
  with pytest.raises(TypeError, match="immutable"):
    value.fingerprint["seed"] = 3
  with pytest.raises(TypeError, match="immutable"):
    value.counters.update(x=1)
  same = state_lib.IteratorState(kind="data", fingerprint={"seed": 1}, position={"next_index": 2, "nested": {"a": [1]}})
  assert value == same and hash(value) == hash(same) and len({value, same}) == 1
  round_trip = state_lib.IteratorState.from_dict(json.loads(json.dumps(value.to_dict())))
  assert round_trip == value and type(value.to_dict()["position"]) is dict


def test_non_finite_floats_in_pending_items_round_trip_bit_for_bit():
  """A NaN reward must not make a step unsavable: JSON has no NaN, so its 8 bytes are stored."""
  payload_nan = struct.unpack("<d", bytes.fromhex("010000000000f87f"))[0]
  item = {"reward": math.nan, "up": math.inf, "down": -math.inf, "payload": payload_nan, "zero": -0.0,
          "ids": np.arange(3)}
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 1},
      pending=state_lib.Pending(items=(item,), schedule=(0,)))
  header, arrays = codec.encode_state(value)
  text = json.dumps(header, allow_nan=False)  # what the item's writer does
  decoded = codec.decode_state(json.loads(text), lambda name, spec: arrays[name]).pending.items[0]
  for name in ("reward", "up", "down", "payload", "zero"):
    assert type(decoded[name]) is float
    assert struct.pack("<d", decoded[name]) == struct.pack("<d", item[name]), name


def test_from_dict_does_not_mutate_its_input():
  value = _valid_dict()
  before = copy.deepcopy(value)
  state_lib.IteratorState.from_dict(value)
  assert json.dumps(value, default=repr) == json.dumps(before, default=repr)


def test_bare_grain_state_migrates_from_version_0():
  # What grain.checkpoint.CheckpointSave writes for a MapDataset iterator.
  grain_iterator = grain.MapDataset.range(10).to_iter_dataset().__iter__()
  for _ in range(4):
    next(grain_iterator)
  bare = json.loads(json.dumps(grain_iterator.get_state()))
  assert "format_version" not in bare

  value = state_lib.IteratorState.from_dict(bare)

  assert value.format_version == state_lib.FORMAT_VERSION
  assert value.kind == "data"
  assert value.fingerprint == {}
  assert value.position == {"next_index": 4}
  assert value.shuffle_key is None and value.pending is None
  # An empty fingerprint means "unknown": it is never reported as drift.
  state_lib.check_fingerprint(value.fingerprint, {"seed": 1, "batch_size": 8})


def test_newer_format_version_is_refused_with_upgrade_hint():
  with pytest.raises(errors.StateVersionError) as info:
    state_lib.IteratorState.from_dict(_with(format_version=state_lib.FORMAT_VERSION + 5))
  assert f"format_version {state_lib.FORMAT_VERSION + 5}" in str(info.value)
  assert f"0..{state_lib.FORMAT_VERSION}" in str(info.value)


# ---------------------------------------------------------------------------
# check_fingerprint

_FIELD_NAMES = ["seed", "source", "batch_size", "num_epochs", "shard_index", "drop_remainder"]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["a", "b", ""]),
    st.sampled_from([0.5, 1.0, -2.25]),
)
_FINGERPRINTS = st.dictionaries(st.sampled_from(_FIELD_NAMES), _SCALARS, max_size=len(_FIELD_NAMES))


def _differs(a, b):
  # Independent oracle: a JSON value differs when its type or value does
  # (so 1, 1.0 and True are three different seeds).
  return type(a) is not type(b) or a != b


@hypothesis.given(saved=_FINGERPRINTS, current=_FINGERPRINTS, data=st.data())
@hypothesis.settings(max_examples=60)
def test_check_fingerprint_names_every_differing_field(saved, current, data):
  absent = object()
  expected = {
      name: (saved.get(name, absent), current.get(name, absent))
      for name in set(saved) | set(current)
      if _differs(saved.get(name, absent), current.get(name, absent))
  }
  known = sorted(set(saved) | set(current))
  allowed = data.draw(st.sets(st.sampled_from(known)) if known else st.just(set()))
  expected = {k: v for k, v in expected.items() if k not in allowed}
  if not saved or not expected:
    state_lib.check_fingerprint(saved, current, allow_drift=allowed)
    return
  with pytest.raises(errors.ConfigDriftError) as info:
    state_lib.check_fingerprint(saved, current, allow_drift=allowed, origin="step 12")
  error = info.value
  assert set(error.differences) == set(expected)
  message = str(error)
  assert message.startswith("step 12")
  for name, (before, after) in expected.items():
    for value in (before, after):
      shown = "<absent>" if value is absent else value
      assert f"{name}={shown!r}" in message, (name, shown, message)
    assert error.differences[name] == tuple(
        "<absent>" if v is absent else v for v in (before, after)
    )
  assert "allow_drift=" in message


_MAP_FN, _MAP_CODE = "node[2].MapMapDataset.fn", "node[2].MapMapDataset.fn_code"
_SPEC_CODE = "node[0].GlobalBatchDataset.transform_code"

# (case id, saved, current, the fields that differ).
_FUNCTION_CASES = [
    ("moved", {_MAP_FN: "__main__.tokenize", _MAP_CODE: "ab12"},
     {_MAP_FN: "train.tokenize", _MAP_CODE: "ab12"}, set()),
    ("moved_into_a_package_and_a_function", {_MAP_FN: "__main__.tokenize", _MAP_CODE: "ab12"},
     {_MAP_FN: "pkg.data.build.<locals>.tokenize", _MAP_CODE: "ab12"}, set()),
    ("renamed", {_MAP_FN: "train.upper_case", _MAP_CODE: "ab12"},
     {_MAP_FN: "train.lower_case", _MAP_CODE: "ab12"}, {_MAP_FN}),
    ("other_code", {_MAP_FN: "__main__.tokenize", _MAP_CODE: "ab12"},
     {_MAP_FN: "train.tokenize", _MAP_CODE: "cd34"}, {_MAP_FN, _MAP_CODE}),
    ("builtin", {_MAP_FN: "builtins.len", _MAP_CODE: None},
     {_MAP_FN: "mylib.len", _MAP_CODE: None}, {_MAP_FN}),
    ("code_field_absent", {_MAP_FN: "__main__.tokenize"}, {_MAP_FN: "train.tokenize"}, {_MAP_FN}),
    ("transform_moved", {"transform": "__main__.tokenize", _SPEC_CODE: "ab12"},
     {"transform": "train.tokenize", _SPEC_CODE: "ab12"}, set()),
    ("transform_other_code", {"transform": "__main__.tokenize", _SPEC_CODE: "ab12"},
     {"transform": "train.tokenize", _SPEC_CODE: "cd34"}, {"transform", _SPEC_CODE}),
    ("transform_before_graph_fields", {"transform": "__main__.tokenize"}, {"transform": "train.tokenize"},
     {"transform"}),
    ("spec_node_transform_moved",
     {"node[3].GlobalBatchDataset.transform": "__main__.f", "node[3].GlobalBatchDataset.transform_code": "ab"},
     {"node[3].GlobalBatchDataset.transform": "train.f", "node[3].GlobalBatchDataset.transform_code": "ab"}, set()),
    ("loader_operation_moved", {"loader.op[1]": "__main__.Tokenize", "loader.op[1].code": "ab12"},
     {"loader.op[1]": "train.Tokenize", "loader.op[1].code": "ab12"}, set()),
    ("not_a_function_field", {"source": "__main__.tokenize", "source.code": "ab"},
     {"source": "train.tokenize", "source.code": "ab"}, {"source"}),
]


@pytest.mark.parametrize("saved, current, differing", [c[1:] for c in _FUNCTION_CASES],
                         ids=[c[0] for c in _FUNCTION_CASES])
def test_a_function_with_the_same_code_and_own_name_is_the_same_wherever_it_is_defined(saved, current, differing):
  saved, current = {"graph": "g", **saved}, {"graph": "g", **current}
  assert set(state_lib.differing_fields(saved, current)) == differing
  if differing:
    with pytest.raises(errors.ConfigDriftError) as info:
      state_lib.check_fingerprint(saved, current)
    assert set(info.value.differences) == differing
  else:
    state_lib.check_fingerprint(saved, current)


def test_check_fingerprint_message_tells_how_to_fix():
  with pytest.raises(errors.ConfigDriftError) as info:
    state_lib.check_fingerprint({"seed": 0, "batch_size": 4}, {"seed": 1, "batch_size": 4})
  message = str(info.value)
  assert "seed=0 there, seed=1 here" in message
  assert "Rebuild the pipeline with seed=0" in message
  assert "allow_drift={'seed'}" in message
  assert "batch_size" not in message


def test_check_fingerprint_treats_numpy_ints_as_ints_and_nan_as_equal():
  state_lib.check_fingerprint({"seed": 3, "x": math.nan}, {"seed": np.int64(3), "x": math.nan})
  with pytest.raises(errors.ConfigDriftError):
    state_lib.check_fingerprint({"seed": 1}, {"seed": True})


def test_allow_drift_accepts_named_fields_only():
  saved, current = {"seed": 0, "batch_size": 4}, {"seed": 1, "batch_size": 8}
  state_lib.check_fingerprint(saved, current, allow_drift={"seed", "batch_size"})
  with pytest.raises(errors.ConfigDriftError) as info:
    state_lib.check_fingerprint(saved, current, allow_drift={"seed"})
  assert set(info.value.differences) == {"batch_size"}
  with pytest.raises(errors.InvalidArgumentError) as info:
    state_lib.check_fingerprint(saved, current, allow_drift={"sed"})
  assert "'sed'" in str(info.value) and "seed" in str(info.value)


# ---------------------------------------------------------------------------
# position_to_json / position_from_json

_RESERVED = ["__ckpt_iter_items__", "__ckpt_iter_tuple__"]
_NUMPY_SCALARS = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(allow_nan=False, allow_infinity=False, width=32).map(np.float32),
    st.floats(allow_nan=False, allow_infinity=False).map(np.float64),
    st.booleans().map(np.bool_),
    st.integers(0, 100).map(lambda i: np.array(i, dtype=np.int64)),  # 0-d array
)
_PLAIN_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
)
_KEYS = st.one_of(st.integers(-5, 1000), st.text(max_size=4), st.sampled_from(_RESERVED))
_POSITIONS = st.recursive(
    st.one_of(_PLAIN_SCALARS, _NUMPY_SCALARS),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_KEYS, children, max_size=4),
    ),
    max_leaves=20,
)


def _normalized(value):
  """What the round trip must return: numpy scalars become Python scalars."""
  if isinstance(value, dict):
    return {_normalized(k): _normalized(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(_normalized(v) for v in value)
  if isinstance(value, (np.generic, np.ndarray)):
    return np.asarray(value)[()].item()
  return value


def _assert_same_json_value(actual, expected, path="position"):
  # `==` alone would accept 1 == 1.0 == True and "1" keys for 1 keys.
  assert type(actual) is type(expected), (path, actual, expected)
  if isinstance(expected, dict):
    assert list(actual) == list(expected), (path, list(actual), list(expected))
    assert [type(k) for k in actual] == [type(k) for k in expected], path
    for key in expected:
      _assert_same_json_value(actual[key], expected[key], f"{path}[{key!r}]")
  elif isinstance(expected, (list, tuple)):
    assert len(actual) == len(expected), path
    for i, (a, e) in enumerate(zip(actual, expected)):
      _assert_same_json_value(a, e, f"{path}[{i}]")
  else:
    assert actual == expected, (path, actual, expected)


@hypothesis.given(position=st.dictionaries(_KEYS, _POSITIONS, max_size=4))
@hypothesis.settings(max_examples=60)
def test_position_json_round_trip_keeps_int_keys_tuples_and_values(position):
  text = json.dumps(codec.position_to_json(position), allow_nan=False)
  restored = codec.position_from_json(json.loads(text))
  _assert_same_json_value(restored, _normalized(position))


def test_position_json_keeps_interleave_style_int_keys():
  # Grain's InterleaveDatasetIterator keeps `future_states` keyed by int shard.
  position = {"future_states": {2: {"next_index": np.int64(7)}}, "exhausted": [0, 1]}
  text = json.dumps(codec.position_to_json(position))
  restored = codec.position_from_json(json.loads(text))
  assert restored == {"future_states": {2: {"next_index": 7}}, "exhausted": [0, 1]}
  assert list(restored["future_states"]) == [2]
  assert type(restored["future_states"][2]["next_index"]) is int


@pytest.mark.parametrize(
    "position, fragment",
    [({"a": b"xy"}, "bytes"), ({"a": object()}, "object"), ({"a": {1, 2}}, "set")],
    ids=["bytes", "object", "set"],
)
def test_position_to_json_refuses_non_json_data(position, fragment):
  with pytest.raises(errors.InvalidStateError) as info:
    codec.position_to_json(position)
  assert fragment in str(info.value)


# ---------------------------------------------------------------------------
# encode_state / decode_state

_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128, ml_dtypes.bfloat16,
]


@st.composite
def _arrays(draw):
  dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
  shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
  if dtype.type is ml_dtypes.bfloat16:
    # Any 16-bit pattern, NaNs included: the round trip must keep the bits.
    bits = draw(hnp.arrays(np.uint16, shape))
    return bits.view(ml_dtypes.bfloat16)
  array = draw(hnp.arrays(dtype, shape))
  if draw(st.booleans()) and array.ndim == 2:
    array = np.asfortranarray(array)
  return array


_PYTREE_LEAVES = st.one_of(
    _arrays(),
    _arrays().map(lambda a: a.reshape(-1)[:1].reshape(()) if a.size else a),
    st.integers(-5, 5).map(np.int64), st.floats(width=32).map(np.float32),
    st.none(), st.integers(-(2**40), 2**40), st.text(max_size=3),
)
_PYTREES = st.recursive(
    _PYTREE_LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=8,
)


def _round_trip(value):
  """Encodes, writes JSON + npz to memory, reads back (no pickle) and decodes."""
  header, arrays = codec.encode_state(value)
  text = json.dumps(header, allow_nan=False)
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  buffer.seek(0)
  with np.load(buffer, allow_pickle=False) as npz:
    stored = {name: npz[name] for name in npz.files}

  def load_array(name, spec):
    array = stored[name]
    assert (array.dtype.str, array.shape) == (spec.dtype, spec.shape)
    return array

  return codec.decode_state(json.loads(text), load_array, origin=ORIGIN), arrays


@hypothesis.given(
    items=st.lists(_PYTREES, min_size=1, max_size=4),
    data=st.data(),
)
@hypothesis.settings(max_examples=60)
def test_encode_decode_state_round_trips_pending_pytrees_bit_exact(items, data):
  schedule = data.draw(st.lists(st.integers(0, len(items) - 1), max_size=10))
  value = state_lib.IteratorState(
      kind="repeat",
      fingerprint={"seed": 1, "num_repeats": 2},
      position={"next_index": 5, "shards": {3: (1, 2)}},
      shuffle_key=(0, 2**32 - 1),
      pending=state_lib.Pending(items=tuple(items), schedule=tuple(schedule)),
      counters={"steps": 9},
  )
  restored, _ = _round_trip(value)
  assert restored.kind == "repeat"
  assert restored.fingerprint == value.fingerprint
  assert restored.position == {"next_index": 5, "shards": {3: (1, 2)}}
  assert restored.shuffle_key == value.shuffle_key
  assert restored.counters == value.counters
  assert restored.pending.schedule == tuple(schedule)
  testing.assert_trees_equal(list(restored.pending.items), list(items), path="pending.items")


def test_encode_state_copies_arrays_so_later_writes_do_not_leak():
  array = np.arange(4, dtype=np.float32)
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 0},
      pending=state_lib.Pending(items=({"a": array},), schedule=(0,)),
  )
  header, arrays = codec.encode_state(value)
  array[:] = -1  # e.g. a rollout buffer reused after the checkpoint
  np.testing.assert_array_equal(arrays["a0"], np.arange(4, dtype=np.float32)[np.newaxis])
  assert header["arrays"] == {"a0": {"dtype": "<f4", "shape": [1, 4]}}  # the leaf of a group of one item


@dataclasses.dataclass
class _Rollout:
  ids: object
  logps: object


codec.register_pytree_dataclass("test_state.Rollout", _Rollout)


def test_encode_state_accepts_jax_arrays_and_registered_dataclasses():
  item = _Rollout(ids=jnp.arange(3, dtype=jnp.int32), logps=jnp.ones((2,), jnp.bfloat16))
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 0},
      pending=state_lib.Pending(items=(item,), schedule=(0, 0)),
  )
  restored, _ = _round_trip(value)
  (out,) = restored.pending.items
  assert isinstance(out, _Rollout)
  assert out.ids.dtype == np.int32 and out.ids.tolist() == [0, 1, 2]
  assert out.logps.dtype == ml_dtypes.bfloat16 and out.logps.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "item, fragment",
    [
        ({"a": np.array([object()], dtype=object)}, "object arrays"),
        ({1: np.arange(2)}, "string keys"),
        ({"a": {1, 2}}, "set"),
        ({"a": type("Unregistered", (), {})()}, "Unregistered"),
    ],
    ids=["object_array", "int_key", "set", "unregistered"],
)
def test_encode_state_refuses_what_would_need_pickling(item, fragment):
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 0},
      pending=state_lib.Pending(items=(item,), schedule=(0,)),
  )
  with pytest.raises(errors.InvalidStateError) as info:
    codec.encode_state(value)
  assert fragment in str(info.value)


def _header_with(**manifest_changes):
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 0},
      pending=state_lib.Pending(items=({"a": np.arange(3)},), schedule=(0,)),
  )
  header, _ = codec.encode_state(value)
  header = json.loads(json.dumps(header))
  header["arrays"].update(manifest_changes)
  return header


@pytest.mark.parametrize(
    "header, fragment",
    [
        (_header_with(**{"../x": {"dtype": "<i8", "shape": [1]}}), "'../x'"),
        (_header_with(a0={"dtype": "|O", "shape": [3]}), "not allowed"),
        (_header_with(a0={"dtype": "|V8", "shape": [3]}), "not allowed"),
        (_header_with(a0={"dtype": "nonsense", "shape": [3]}), "'nonsense'"),
        (_header_with(a0={"dtype": "<i8", "shape": [-1]}), "shape [-1]"),
        (_header_with(a0={"dtype": "<i8", "shape": [2**39, 2**10]}), "the limit"),
        (_header_with(a0={"dtype": "<i8"}), "{dtype, shape}"),
        ({**_header_with(), "arrays": {}}, "not in the manifest"),
    ],
    ids=["path_name", "object", "void", "bad_dtype", "bad_shape", "huge", "no_shape", "missing"],
)
def test_decode_state_validates_the_array_manifest_before_reading(header, fragment):
  def load_array(name, spec):
    raise AssertionError("no array may be read from an invalid manifest")

  with pytest.raises(errors.InvalidStateError) as info:
    codec.decode_state(header, load_array, origin=ORIGIN)
  assert fragment in str(info.value)
  assert str(info.value).startswith(ORIGIN)


@dataclasses.dataclass
class _Versioned:
  ids: object
  logps: object
  segment_ids: object = None


codec.register_pytree_dataclass("test_state.Versioned", _Versioned)


def _versioned(**fields):
  return {"dataclass": "test_state.Versioned", "fields": fields}


def test_a_pending_type_of_another_library_version_restores_when_the_difference_is_unset():
  """Another Tunix may add optional fields to TrainExample (issue 31, case 5): a saved item
  without one gets its default, and a saved field this version lacks is dropped when unset."""
  one, two = {"list": [None]}, {"tuple": []}
  older = codec.decode_pytree(_versioned(ids=one, logps=two), lambda name: None, origin="test")
  assert older == _Versioned(ids=[None], logps=(), segment_ids=None)
  newer = codec.decode_pytree(_versioned(ids=one, logps=two, segment_ids=one, is_update_step=None),
                              lambda name: None, origin="test")
  assert newer == _Versioned(ids=[None], logps=(), segment_ids=[None])


@pytest.mark.parametrize("fields, named", [
    (dict(ids=None, logps=None, is_update_step={"list": []}), "holds ['is_update_step']"),
    (dict(ids=None), "lacks ['logps']"),
])
def test_a_pending_type_that_would_change_meaning_is_refused_as_another_version(fields, named):
  with pytest.raises(errors.PendingTypeError, match=re.escape(named)) as refused:
    codec.decode_pytree(_versioned(**fields), lambda name: None, origin="test")
  assert "another version of the library" in str(refused.value)
  assert isinstance(refused.value, errors.InvalidStateError)


_GEOMETRY_ENTRY = st.fixed_dictionaries(
    {"step": st.integers(0, 100), "state": st.just("0" * 16)},
    optional={"batch_size": st.integers(1, 64), "process_count": st.integers(1, 8),
              "mixture": st.sampled_from(["0;a=1/10/0", "5;a=1/10/3,b=2/4/1"])})


@hypothesis.given(recent=st.lists(_GEOMETRY_ENTRY, max_size=20), with_mixture=st.booleans())
def test_the_latest_geometry_read_back_is_the_last_carried_one(recent, with_mixture):
  # A resume reads only as far back as it needs (its cost does not grow with the restarts before it);
  # the answer is the whole walk's.
  names = ["batch_size", "process_count"] + (["mixture"] if with_mixture else [])
  carried = state_lib.carried_geometry(recent)[-1] if recent else {}
  assert state_lib.latest_geometry(recent, names) == {k: v for k, v in carried.items() if k in names}


def _state_with_resumes(count: int) -> state_lib.IteratorState:
  from ckpt_iter import _item as item_lib  # pylint: disable=import-outside-toplevel
  value = state_lib.IteratorState(kind="data", fingerprint={"seed": 0}, position={"next_record": 8})
  for step in range(count):
    value = item_lib.resumed(value, step)
  return value


def test_a_resumed_states_lineage_is_not_walked_again_by_a_replace(monkeypatch):
  # A restore replaces a field of the resumed state (its skips); the 64 entries checked when
  # read were walked again by that replace (a mixture's restore: 15% of its CPU).
  resumed = _state_with_resumes(70)
  walked = []
  original = state_lib._checked_entry  # pylint: disable=protected-access
  monkeypatch.setattr(state_lib, "_checked_entry", lambda entry: walked.append(entry) or original(entry))
  replaced = dataclasses.replace(resumed, fingerprint={"seed": 0, "skips": None})
  assert walked == []
  assert replaced.lineage == resumed.lineage
  assert len(replaced.lineage["recent"]) == state_lib.MAX_LINEAGE_RECENT
  assert replaced.lineage["resumes"] == 70


def test_a_lineage_extended_from_entries_not_its_own_is_checked_whole():
  from ckpt_iter import _item as item_lib  # pylint: disable=import-outside-toplevel
  value = _state_with_resumes(2)
  bad = {**item_lib.extended(value.lineage, {"step": 9, "state": "x"})}
  bad["recent"] = [{"step": "not a step", "state": "x"}, *bad["recent"]]  # an entry the state never held
  with pytest.raises(errors.InvalidStateError, match="lineage"):
    state_lib.extended_lineage(value, bad, {"step": 9, "state": "x"})
  good = state_lib.extended_lineage(value, item_lib.extended(value.lineage, {"step": 9, "state": "x"}),
                                    {"step": 9, "state": "x"})
  assert [entry["step"] for entry in good.lineage["recent"]] == [0, 1, 9]
  assert good.lineage["resumes"] == 3


_ENTRY_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(allow_nan=True),
                          st.text(max_size=4), st.sampled_from(["\udfff", "é", "0123abcd"]))


# Mostly entries as written (where the fast path answers), each field sometimes a little off.
_NEAR_COUNT = st.sampled_from([None, 0, 1, 7, -1, True, 2.0, "3"])
_NEAR_PLAIN_ENTRIES = st.fixed_dictionaries(
    {"state": st.sampled_from(["0123abcd", "é", "\udfff", 5, None])},
    optional={"step": _NEAR_COUNT, "record": _NEAR_COUNT, "batch_size": _NEAR_COUNT, "process_count": _NEAR_COUNT,
              "mixture": st.sampled_from(["0;a=1/2/0", "é", "\udfff", 3, None]),
              "resized": st.sampled_from([True, False, 1, None])})


@hypothesis.given(st.one_of(_NEAR_PLAIN_ENTRIES, st.dictionaries(
    st.sampled_from(["step", "state", "record", "mixture", "resized", "other", "\ud800"]), _ENTRY_VALUES,
    max_size=6)))
@hypothesis.settings(max_examples=400, deadline=None)
def test_the_plain_entry_fast_path_accepts_only_what_the_walk_accepts(entry):
  fast = state_lib._checked_entry(entry)  # pylint: disable=protected-access
  original = state_lib._is_plain_entry  # pylint: disable=protected-access
  state_lib._is_plain_entry = lambda _: False  # pylint: disable=protected-access
  try:
    walked = state_lib._checked_entry(entry)  # pylint: disable=protected-access
  finally:
    state_lib._is_plain_entry = original  # pylint: disable=protected-access
  assert fast == walked


def test_the_collector_stays_paused_until_the_last_restore_of_any_thread_ends():
  # A restore ending in another thread turned the collector back on under one still decoding (a collection
  # was seen inside a restore of 5,000 skip ranges when another test's thread restored at the same time).
  import gc  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  entered, leave = threading.Event(), threading.Event()

  def other_restore():
    with state_lib.collection_paused():
      entered.set()
      leave.wait(10)

  assert gc.isenabled()
  other = threading.Thread(target=other_restore)
  other.start()
  assert entered.wait(10)
  with state_lib.collection_paused():
    leave.set()
    other.join(10)
    assert not gc.isenabled()  # the other thread's pause ended; this one has not
  assert gc.isenabled()
