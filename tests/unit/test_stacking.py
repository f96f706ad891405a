"""Tests for ckpt_iter._stacking: records stacked into a batch, or refused in the records' terms.

A batch whose records do not stack (ragged fields, nested or inside a row,
missing or extra keys) is refused naming the batch, the field, the rows and
their shapes or keys; a batch of one record is what np.stack makes of it.
"""

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _stacking
import support


# (case id, records of one batch of 4, substrings the message must hold).
_UNSTACKABLE = [
    ("ragged_tokens", [{"id": i, "tokens": list(range(3 if i != 2 else 2))} for i in range(4)],
     ["batch 1", "field 'tokens'", "rows [0, 1, 3] have shape (3,)", "row 2 has shape (2,)", "`transform`", "pad"]),
    ("ragged_nested_field", [{"id": i, "meta": {"ids": [i] * (1 + i % 2)}} for i in range(4)],
     ["batch 1", "field 'meta.ids'", "rows [0, 2] have shape (1,)", "rows [1, 3] have shape (2,)"]),
    ("ragged_inside_a_row", [{"t": [[1, 2], [3]] if i == 3 else [[1], [2]]} for i in range(4)],
     ["field 't'", "row 3 is ragged", "rows [0, 1, 2] have shape (2, 1)"]),
    ("missing_key", [{"id": i, **({"tokens": [1]} if i != 1 else {})} for i in range(4)],
     ["batch 1", "different fields", "row 1 lacks ['tokens']", "row 0's keys ['id', 'tokens']"]),
    ("extra_key", [{"id": i, **({"extra": 1} if i == 3 else {})} for i in range(4)],
     ["row 3 has ['extra'] too"]),
]


@pytest.mark.parametrize("records, fragments", [c[1:] for c in _UNSTACKABLE], ids=[c[0] for c in _UNSTACKABLE])
def test_records_that_do_not_stack_are_refused_naming_the_field_rows_and_shapes(records, fragments):
  # Batch 0 stacks; batch 1 holds the four records given.
  uniform = [{**records[0]} for _ in range(4)]
  dataset = support.make_dataset(uniform + records, batch_size=4)
  dataset[0]
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    dataset[1]
  assert isinstance(info.value, ValueError)  # what numpy raised before
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="batch 1"):
    list(ckpt_iter.DataIterator(dataset))


def test_a_batch_of_one_record_is_what_np_stack_makes_of_it():
  """One row takes a shortcut past np.stack (`_stacked`): the same arrays, copies of the record's."""
  record = {"i": 5, "f": 2.5, "b": True, "s": "abc", "y": b"xy", "l": [[1, 2], [3, 4]],
            "c": np.arange(12).reshape(3, 4), "fortran": np.asfortranarray(np.arange(12).reshape(3, 4)),
            "strided": np.arange(20)[::3], "scalar": np.float32(3), "empty": np.zeros((0, 3))}
  batch = _stacking.stack_records([record])
  for name, value in record.items():
    expected = np.stack([np.asarray(value)])
    got = batch[name]
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    assert np.array_equal(got, expected), name
    assert got.flags.c_contiguous == expected.flags.c_contiguous and got.flags.f_contiguous == expected.flags.f_contiguous
    assert not np.shares_memory(got, np.asarray(value)), name
