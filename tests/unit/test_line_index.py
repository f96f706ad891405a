"""Tests for ckpt_iter._line_index: a JSONL file's line index, from the file or from its bytes in memory.

The index cache kept for files read in place is tested through `JsonlSource` in test_jsonl.py.
"""

import os

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ckpt_iter import _line_index
from ckpt_iter import errors

# Lines of a JSONL file as written by hand and by tools: records, blank lines of every kind, CRLF endings,
# a record of one character (a number), and no final newline sometimes.
_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters='"\\'), max_size=40)
_LINE = st.one_of(st.sampled_from(["", "\r", " ", "\t", "7", '{"a": 1}', '{"text": "x\\ny"}']),
                  _TEXT.map(lambda text: f'{{"t": "{text}"}}'))


def _expected(data: bytes) -> list[tuple[int, int]]:
  """The non-blank lines' (start, end), from the bytes by splitting: what an index must say."""
  found, start = [], 0
  for line in data.split(b"\n"):
    end = start + len(line)
    if line.strip(b"\r \t") or len(line) > 1:
      found.append((start, end))
    start = end + 1
  return [(s, e) for s, e in found if s < len(data)]


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(_LINE, max_size=30), final_newline=st.booleans(), crlf=st.booleans(),
       few_lines=st.sampled_from([0, 64]))
def test_the_index_of_bytes_in_memory_is_the_index_of_the_file(tmp_path_factory, lines, final_newline, crlf,
                                                              few_lines):
  text = ("\r\n" if crlf else "\n").join(lines) + ("\n" if final_newline and lines else "")
  data = text.encode("utf-8")
  path = os.path.join(tmp_path_factory.mktemp("lines"), "part.jsonl")
  with open(path, "wb") as f:
    f.write(data)
  starts, ends = _line_index.index_lines(path)
  default = _line_index._FEW_LINES  # pylint: disable=protected-access
  _line_index._FEW_LINES = few_lines  # pylint: disable=protected-access  # line by line (64), or numpy's scan (0)
  try:
    in_memory = _line_index.index_lines_of(data)
  finally:
    _line_index._FEW_LINES = default  # pylint: disable=protected-access
  assert np.array_equal(in_memory[0], starts) and np.array_equal(in_memory[1], ends)
  assert starts.dtype == ends.dtype == np.int64
  assert list(zip(starts.tolist(), ends.tolist())) == _expected(data)
  array = _line_index.line_index_array(path)
  assert array.shape == (2, len(starts)) and np.array_equal(array[0], starts)


def test_a_file_read_in_chunks_is_indexed_as_one(tmp_path, monkeypatch):
  monkeypatch.setattr(_line_index, "_INDEX_CHUNK_BYTES", 7)  # lines cross every chunk boundary
  data = b'{"id": 1}\n\n{"id": 22}\r\n \n{"id": 333}'
  path = tmp_path / "part.jsonl"
  path.write_bytes(data)
  starts, ends = _line_index.index_lines(str(path))
  assert [data[s:e] for s, e in zip(starts, ends)] == [b'{"id": 1}', b'{"id": 22}\r', b'{"id": 333}']
  assert [a.tolist() for a in _line_index.index_lines_of(data)] == [starts.tolist(), ends.tolist()]


def test_the_index_cache_location_is_local_and_chosen_by_argument_then_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(_line_index.INDEX_CACHE_ENV, str(tmp_path / "env"))
  assert _line_index.index_cache_location(str(tmp_path / "given")) == str(tmp_path / "given")
  assert _line_index.index_cache_location() == str(tmp_path / "env")
  assert _line_index.index_cache_location("") is None
  with pytest.raises(errors.InvalidArgumentError, match="must be a local directory"):
    _line_index.index_cache_location("gs://bucket/index")
