"""Pending items stored by structure (format version 3, ckpt_iter/_codec.py)."""

import copy
import json
import math
import struct

import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import ml_dtypes
import numpy as np
import pytest

from ckpt_iter import _codec as codec
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import testing

ORIGIN = "/ckpt/7/data/process_0-of-1.json"

_DTYPES = [np.bool_, np.int8, np.int32, np.uint64, np.float16, np.float32, np.complex64, ml_dtypes.bfloat16]


def _state(items, schedule=None):
  return state_lib.IteratorState(
      kind="repeat", fingerprint={"seed": 1}, position={"next_index": 5},
      pending=state_lib.Pending(items=tuple(items), schedule=tuple(range(len(items)) if schedule is None else schedule)))


def _decoded(header, arrays):
  """decode_state over the header as JSON text and the arrays, each checked against its spec."""
  def load_array(name, spec):
    array = arrays[name]
    assert (array.dtype.str, array.shape) == (spec.dtype, spec.shape)
    return array.copy()
  return codec.decode_state(json.loads(json.dumps(header, allow_nan=False)), load_array, origin=ORIGIN)


@st.composite
def _array_like(draw, like):
  if like.dtype == ml_dtypes.bfloat16:
    return draw(hnp.arrays(np.uint16, like.shape)).view(ml_dtypes.bfloat16)
  return draw(hnp.arrays(like.dtype, like.shape))


def _same_structure(draw, tree):
  """Another tree of `tree`'s structure, leaf dtypes and shapes, with new leaf values."""
  if isinstance(tree, dict):
    return {k: _same_structure(draw, v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_same_structure(draw, v) for v in tree)
  if isinstance(tree, np.generic):
    return draw(_array_like(np.asarray(tree))).reshape(())[()]
  if isinstance(tree, np.ndarray):
    return draw(_array_like(tree))
  if isinstance(tree, bool):
    return draw(st.booleans())
  if isinstance(tree, int):
    return draw(st.integers(-(2**40), 2**40))
  if isinstance(tree, float):
    return draw(st.floats(allow_nan=True, allow_infinity=True))  # non-finite: stored as their bits
  if isinstance(tree, str):
    return draw(st.text(max_size=3))
  assert tree is None
  return None


@st.composite
def _arrays(draw):
  dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
  shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
  return draw(_array_like(np.zeros(shape, dtype)))


_LEAVES = st.one_of(
    _arrays(), _arrays().map(lambda a: a.reshape(-1)[:1].reshape(())[()] if a.size else a),
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=3),
)
_TREES = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), children, max_size=3)),
    max_leaves=6,
)


def _array_leaves(tree) -> int:
  if isinstance(tree, dict):
    return sum(_array_leaves(v) for v in tree.values())
  if isinstance(tree, (list, tuple)):
    return sum(_array_leaves(v) for v in tree)
  return int(isinstance(tree, (np.ndarray, np.generic)))


@hypothesis.given(base=_TREES, data=st.data())
@hypothesis.settings(max_examples=60, deadline=None)
def test_items_of_one_structure_are_one_group_with_one_array_per_leaf_and_round_trip(base, data):
  items = [base] + [_same_structure(data.draw, base) for _ in range(data.draw(st.integers(1, 5)))]
  header, arrays = codec.encode_state(_state(items))
  assert header["format_version"] == state_lib.FORMAT_VERSION >= codec.BY_STRUCTURE_VERSION
  (group,) = header["pending"]["groups"]
  assert group["members"] == [[0, len(items)]]
  assert len(arrays) == _array_leaves(base)
  assert all(array.shape[0] == len(items) for array in arrays.values())
  restored = _decoded(header, arrays)
  testing.assert_trees_equal(list(restored.pending.items), items, path="pending.items")
  assert restored.pending.schedule == tuple(range(len(items)))


@hypothesis.given(pool=st.lists(_TREES, min_size=1, max_size=3), data=st.data())
@hypothesis.settings(max_examples=60, deadline=None)
def test_interleaved_structures_round_trip_in_order(pool, data):
  picks = data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=8))
  items = [_same_structure(data.draw, pool[i]) for i in picks]
  schedule = tuple(data.draw(st.lists(st.integers(0, len(items) - 1), max_size=10)))
  header, arrays = codec.encode_state(_state(items, schedule))
  members = sorted(index for group in header["pending"]["groups"]
                   for start, stop in group["members"] for index in range(start, stop))
  assert members == list(range(len(items)))
  restored = _decoded(header, arrays)
  testing.assert_trees_equal(list(restored.pending.items), items, path="pending.items")
  assert restored.pending.schedule == schedule
  # The header alone gives the count and the schedule (inspect, audit), arrays unread.
  shallow = codec.header_state(json.loads(json.dumps(header)), origin=ORIGIN)
  assert (len(shallow.pending.items), shallow.pending.schedule) == (len(items), schedule)


def test_restored_items_are_writable_views_of_one_array_each_leaf():
  items = [{"ids": np.arange(4, dtype=np.int32) + i, "logp": np.float32(i), "step": i} for i in range(3)]
  header, arrays = codec.encode_state(_state(items))
  assert header["pending"]["groups"][0]["columns"] == [[0, 1, 2]]
  restored = _decoded(header, arrays).pending.items
  assert type(restored[1]["logp"]) is np.float32 and restored[1]["step"] == 1
  assert restored[0]["ids"].flags.writeable and restored[0]["ids"].base is restored[2]["ids"].base
  restored[0]["ids"][:] = -1  # rows are distinct: the others keep their values
  np.testing.assert_array_equal(restored[1]["ids"], np.arange(4) + 1)


def test_encode_copies_each_leaf_once_so_later_writes_do_not_leak():
  buffer = np.arange(4, dtype=np.float32)
  header, arrays = codec.encode_state(_state([{"a": buffer}, {"a": buffer * 2}]))
  buffer[:] = -1  # a rollout buffer reused after the checkpoint
  np.testing.assert_array_equal(arrays["a0"], [[0, 1, 2, 3], [0, 2, 4, 6]])
  assert header["arrays"] == {"a0": {"dtype": "<f4", "shape": [2, 4]}}


def _three_items():
  """A header and arrays of three items: two of one structure, one of another."""
  items = [{"x": np.arange(2.0), "n": 1}, {"x": np.arange(3.0)}, {"x": np.arange(2.0) + 1, "n": 2}]
  return codec.encode_state(_state(items))


def _edited(edit):
  header, arrays = _three_items()
  header = copy.deepcopy(header)
  edit(header["pending"], header, arrays)
  return header, arrays


def _resized_a0(header, arrays):
  """a0 with 3 rows (its group has 2 members), in the manifest and the npz alike."""
  arrays["a0"] = np.zeros((3, 2))
  header["arrays"]["a0"]["shape"] = [3, 2]


_HOSTILE = {
    "items_in_a_v3_header": (lambda p, h, a: p.update(items=[]), "'groups' and 'schedule'"),
    "groups_not_a_list": (lambda p, h, a: p.update(groups={"a": 1}), "must be a list of groups"),
    "group_with_extra_field": (lambda p, h, a: p["groups"][0].update(extra=1), "{members, structure, arrays, columns}"),
    "member_run_reversed": (lambda p, h, a: p["groups"][0].update(members=[[2, 0]]), "[start, stop] index runs"),
    "member_run_not_ints": (lambda p, h, a: p["groups"][0].update(members=[["0", 1]]), "[start, stop] index runs"),
    "member_twice": (lambda p, h, a: p["groups"][1].update(members=[[0, 1]]), "pending item 0 is twice"),
    "member_in_no_group": (lambda p, h, a: p["groups"][1].update(members=[[2, 3]]), "pending item 1 is in no group"),
    "member_beyond_the_limit": (lambda p, h, a: p["groups"][1].update(members=[[1, 2], [10**7, 10**7 + 1]]),
                                "0 <= start < stop"),
    "rows_not_members": (lambda p, h, a: _resized_a0(h, a), "must be [2, ...]"),
    "column_too_short": (lambda p, h, a: p["groups"][0]["columns"][0].pop(), "lists of 2 values"),
    "column_holding_a_dict": (lambda p, h, a: p["groups"][0]["columns"][0].__setitem__(0, {"dict": {}}),
                              "a column holds JSON scalars"),
    "column_float_not_hex": (lambda p, h, a: p["groups"][0]["columns"][0].__setitem__(0, {"float": "nan"}),
                             "a column holds JSON scalars"),
    "array_named_by_no_leaf": (lambda p, h, a: p["groups"][0]["structure"]["dict"].pop("x"),
                               "arrays[0] is named by no leaf"),
    "leaf_index_out_of_range": (lambda p, h, a: p["groups"][0]["structure"]["dict"]["x"].update(array=5),
                                "array 5 must index one of the group's 1 arrays"),
    "leaf_named_twice": (lambda p, h, a: p["groups"][0]["structure"]["dict"].update(y={"array": 0}), "each named once"),
    "array_shared_by_two_groups": (lambda p, h, a: p["groups"][1].update(arrays=["a0"]), "another leaf already uses"),
    "array_not_in_manifest": (lambda p, h, a: p["groups"][1].update(arrays=["a9"]), "'a9', which is not in the manifest"),
    "malformed_node": (lambda p, h, a: p["groups"][0]["structure"]["dict"].update(z={"value": 1}), "malformed node"),
    "scalar_flag_not_true": (lambda p, h, a: p["groups"][0]["structure"]["dict"]["x"].update(scalar=0), "malformed node"),
    "scalar_leaf_of_rank_two": (lambda p, h, a: p["groups"][0]["structure"]["dict"]["x"].update(scalar=True),
                                "must be [2]"),
    "unregistered_dataclass": (lambda p, h, a: p["groups"][1].update(
        structure={"dataclass": "os.system", "fields": {"x": {"array": 0}}}), "'os.system' is not registered"),
    "nested_too_deep": (lambda p, h, a: p["groups"][1].update(
        structure=json.loads('{"list": [' * 70 + '{"array": 0}' + "]}" * 70)), "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_malformed_group_is_refused_naming_what_is_wrong(case):
  edit, fragment = _HOSTILE[case]
  header, arrays = _edited(edit)
  with pytest.raises(errors.InvalidStateError) as refused:
    _decoded(header, arrays)
  message = str(refused.value)
  assert message.startswith(ORIGIN) and fragment in message, message


def test_the_unedited_three_items_decode():
  """The hostile table's base case is sound (each case above breaks one thing)."""
  header, arrays = _three_items()
  assert [g["members"] for g in header["pending"]["groups"]] == [[[0, 1], [2, 3]], [[1, 2]]]
  items = _decoded(header, arrays).pending.items
  assert [item.get("n") for item in items] == [1, None, 2]
  np.testing.assert_array_equal(items[2]["x"], [1.0, 2.0])


def test_a_non_finite_python_float_keeps_its_bits():
  payload_nan = struct.unpack("<d", bytes.fromhex("010000000000f8ff"))[0]  # a negative NaN with a payload
  values = [-3.0, math.inf, -math.inf, payload_nan]
  header, arrays = codec.encode_state(_state([{"r": v} for v in values]))
  restored = [item["r"] for item in _decoded(header, arrays).pending.items]
  assert [struct.pack("<d", v) for v in restored] == [struct.pack("<d", v) for v in values]


# ---------------------------------------------------------------------------
# The decode budget: a header cannot ask for more nodes than its data pays for.

_MEMBERS, _ROW_BYTES = 16, 1_000
# (the leaf paying for each item, the values its group holds, the one leaf's row)
_PAYERS = {
    "array_row": ({"array": 0}, ["a0"], [], _MEMBERS * _ROW_BYTES),
    "column_value": ({"column": 0}, [], [[7] * _MEMBERS], _MEMBERS),
}


def _budget_group(payer: str, nulls: int) -> dict:
  """One group of _MEMBERS items, each a list of `nulls` Nones and one leaf that holds data."""
  leaf, names, columns, _ = _PAYERS[payer]
  return {"groups": [{"members": [[0, _MEMBERS]], "structure": {"list": [None] * nulls + [leaf]},
                      "arrays": names, "columns": columns}], "schedule": []}


@pytest.mark.parametrize("payer", sorted(_PAYERS))
def test_a_decode_builds_the_free_nodes_plus_one_per_value_held_and_not_one_more(payer):
  held = _PAYERS[payer][3]
  nulls = (codec.FREE_DECODED_NODES + held) // _MEMBERS - 2  # an item: its list, its nulls, its leaf
  assert _MEMBERS * (nulls + 2) == codec.FREE_DECODED_NODES + held
  load = {"a0": np.zeros((_MEMBERS, _ROW_BYTES), np.uint8)}.__getitem__
  items = codec.decode_items(_budget_group(payer, nulls), load, origin=ORIGIN)
  assert len(items) == _MEMBERS and len(items[-1]) == nulls + 1
  with pytest.raises(errors.InvalidStateError) as refused:
    codec.decode_items(_budget_group(payer, nulls + 1), load, origin=ORIGIN)
  assert str(refused.value).startswith(
      f"{ORIGIN}: pending.groups[0] would build {_MEMBERS} items of {nulls + 3:,} nodes each "
      f"({_MEMBERS * (nulls + 3):,} nodes in all groups), but the pending arrays and columns hold "
      f"{held:,} bytes and values: a state may build at most {codec.FREE_DECODED_NODES:,} nodes"), refused.value


def test_an_array_that_holds_no_data_pays_for_nothing():
  """A stand-in (`_files.read_saved_header`: the shape claimed, no bytes read) holds one value, and an
  array with a zero dimension none, whatever their shapes say."""
  nulls = (codec.FREE_DECODED_NODES + _MEMBERS * _ROW_BYTES) // _MEMBERS - 2
  for array in (np.broadcast_to(np.zeros((), np.uint8), (_MEMBERS, _ROW_BYTES)),
                np.zeros((_MEMBERS, _ROW_BYTES, 0), np.uint8)):
    with pytest.raises(errors.InvalidStateError, match=r"hold [01] bytes and values"):
      codec.decode_items(_budget_group("array_row", nulls), {"a0": array}.__getitem__, origin=ORIGIN)
