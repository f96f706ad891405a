"""A cached copy's companions (`_cache_companions`): its seal, the count that binds its index to it, the index's
bytes read back."""

from __future__ import annotations

import io

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ckpt_iter import _cache_companions


def test_a_seal_reads_back_and_anything_else_is_none(tmp_path):
  seal = tmp_path / "copy.seal"
  seal.write_text(_cache_companions.seal_text(1234, 0xABCDEF))
  assert _cache_companions.read_seal(str(seal)) == (1234, 0xABCDEF)
  for text in ("crc32 zz size 3\n", "garbage", ""):
    seal.write_text(text)
    assert _cache_companions.read_seal(str(seal)) is None
  assert _cache_companions.read_seal(str(tmp_path / "absent")) is None


def test_a_count_record_is_bound_to_its_copys_name_and_its_own_check():
  record = _cache_companions.CompanionRecord(50, 0x1234, 0x5678)
  text = record.format("key-version-part-0.jsonl")
  assert _cache_companions.CompanionRecord.parse(text, "key-version-part-0.jsonl") == record
  assert _cache_companions.CompanionRecord.parse(text, "key-version-part-1.jsonl") is None  # another copy's
  assert _cache_companions.CompanionRecord.parse(text.replace("records 50", "records 40"),
                                                 "key-version-part-0.jsonl") is None  # edited


@settings(max_examples=60, deadline=None)
@given(shape=st.one_of(st.tuples(st.integers(0, 50)), st.tuples(st.integers(0, 3), st.integers(0, 50))),
       dtype=st.sampled_from(["<i8", "<i4", ">i8", "<f8"]), fortran=st.booleans(), cut=st.integers(0, 16))
def test_an_index_file_reads_as_numpy_reads_it_whatever_its_header(shape, dtype, fortran, cut):
  # The int64 arrays the cache keeps are read without numpy's header parse (a Python literal evaluation: most
  # of a copy's first open); every other array, and a file cut short, goes to np.load and reads (or fails) as
  # it does.
  array = np.asfortranarray(np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)) if fortran else (
      np.arange(int(np.prod(shape))).reshape(shape).astype(dtype))
  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  data = buffer.getvalue()
  data = data[:len(data) - cut] if cut and len(data) - cut > 0 else data
  try:
    expected = np.load(io.BytesIO(data), allow_pickle=False)
  except ValueError:
    with pytest.raises(ValueError):
      _cache_companions.load_index_bytes(data)
    return
  found = _cache_companions.load_index_bytes(data)
  assert found.dtype == expected.dtype and found.shape == expected.shape and np.array_equal(found, expected)
