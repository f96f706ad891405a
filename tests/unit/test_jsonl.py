"""Tests for ckpt_iter._jsonl: JsonlSource (public as ckpt_iter.sources.JsonlSource) and its line index.

Records read by line (blank lines, CRLF, no final newline, a bad line named by
file and line), a large file indexed rather than loaded, and the index cache:
used when valid, never trusted blindly (stale, rewritten, corrupt, replaced).
"""

import builtins
import gc
import json
import os
import subprocess
import threading
import tracemalloc

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _jsonl as jsonl_lib
from ckpt_iter import _line_index
from ckpt_iter import _storage as storage_lib
from ckpt_iter import sources as sources_lib
import support


class _ByteCounter:
  """Wraps `open` in ckpt_iter._jsonl, _line_index and _storage: counts the bytes read from data files."""

  def __init__(self):
    self.bytes_read = 0

  def open(self, path, mode="r", *args, **kwargs):
    handle = builtins.open(path, mode, *args, **kwargs)
    counter = self
    read = handle.read

    def counted_read(*read_args):
      data = read(*read_args)
      counter.bytes_read += len(data)
      return data

    handle.read = counted_read
    return handle


@pytest.fixture(autouse=True)
def cache_small_files(monkeypatch):
  """These tests' files are small; the cache skips files under 1 MiB otherwise."""
  monkeypatch.setattr(_line_index, "INDEX_CACHE_MIN_BYTES", 0)


@pytest.fixture
def counter(monkeypatch):
  counter = _ByteCounter()
  monkeypatch.setattr(jsonl_lib, "open", counter.open, raising=False)
  monkeypatch.setattr(_line_index, "open", counter.open, raising=False)
  monkeypatch.setattr(storage_lib, "open", counter.open, raising=False)
  return counter


def _write(path, first, count, *, mode="w"):
  with open(path, mode) as f:
    for i in range(first, first + count):
      f.write(json.dumps({"id": i, "text": "x" * (i % 17)}) + "\n")


@pytest.fixture
def jsonl(tmp_path):
  path = tmp_path / "data" / "train.jsonl"
  path.parent.mkdir()
  _write(path, 0, 2000)
  return str(path)


@pytest.fixture
def cache_dir(tmp_path):
  return str(tmp_path / "cache")


def _source(path, cache_dir):
  return sources_lib.JsonlSource([path], index_cache_dir=cache_dir)


def _cache_file(path, cache_dir):
  return _line_index.index_cache_path(path, cache_dir)


def test_jsonl_blank_lines_and_crlf_are_ignored(tmp_path):
  records = support.sample_records(13)
  path = tmp_path / "blank.jsonl"
  support.write_jsonl(path, records, blank_lines=True)
  assert b"\n\n" in path.read_bytes() and b"\r\n" in path.read_bytes()
  source = sources_lib.JsonlSource([str(path)])
  assert len(source) == 13
  assert [source[i] for i in range(13)] == records
  assert source[-1] == records[-1]
  with pytest.raises(IndexError):
    source[13]


def test_jsonl_without_trailing_newline(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"a": 1}\n{"a": 2}')
  source = sources_lib.JsonlSource([str(path)])
  assert [source[0], source[1]] == [{"a": 1}, {"a": 2}]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"a": 1}\n{"a": \n')
  source = sources_lib.JsonlSource([str(path)])
  with pytest.raises(ckpt_iter.CkptIterError) as info:
    source[1]
  assert str(path) in str(info.value) and "line 2" in str(info.value)


def test_large_jsonl_is_indexed_not_loaded(tmp_path):
  # ~96 MB of JSONL: building the dataset and reading a few random records
  # must allocate a bounded amount (index + read chunk), not the file.
  path = tmp_path / "large.jsonl"
  padding = "x" * 950
  count = 100_000
  try:
    with open(path, "w") as f:
      for i in range(count):
        f.write(f'{{"id": {i}, "text": "{padding}"}}\n')
    file_bytes = os.path.getsize(path)
    assert file_bytes > 90 * 2**20
    gc.collect()
    tracemalloc.start()
    try:
      dataset = support.make_dataset(str(path), batch_size=4, seed=7)
      iterator = ckpt_iter.DataIterator(dataset)
      iterator.set_state({"next_index": 20_000})
      batch = next(iterator)
      _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
      tracemalloc.stop()
    assert len(dataset.spec.source.description) < 100
    assert dataset.spec.source.length == count
    assert all(record_id < count for record_id in batch["id"])
    assert batch["text"][0] == padding
    # Loading the file would need >= file_bytes; the index is 16 bytes a line
    # (1.6 MB) and the indexer reads 16 MiB chunks: measured peak 35 MB.
    assert peak_bytes < file_bytes / 2, (peak_bytes, file_bytes)
  finally:
    path.unlink(missing_ok=True)


def test_a_second_start_reads_a_few_bytes_not_the_file(jsonl, cache_dir, counter):
  size = os.path.getsize(jsonl)
  first = _source(jsonl, cache_dir)
  assert counter.bytes_read >= size
  assert os.path.exists(_cache_file(jsonl, cache_dir))

  counter.bytes_read = 0
  second = _source(jsonl, cache_dir)

  assert counter.bytes_read < 100, counter.bytes_read  # spot checks: 1 byte each
  assert len(second) == len(first) == 2000
  assert [second[i] for i in (0, 999, 1999)] == [first[i] for i in (0, 999, 1999)]


def test_a_stale_cache_is_rebuilt_after_an_append(jsonl, cache_dir, counter):
  _source(jsonl, cache_dir)
  _write(jsonl, 2000, 5, mode="a")
  counter.bytes_read = 0

  appended = _source(jsonl, cache_dir)

  assert counter.bytes_read >= os.path.getsize(jsonl)
  assert len(appended) == 2005 and appended[2004]["id"] == 2004
  counter.bytes_read = 0
  assert len(_source(jsonl, cache_dir)) == 2005 and counter.bytes_read < 100  # re-cached


def test_a_rewrite_with_the_same_size_is_rebuilt(jsonl, cache_dir, counter):
  _source(jsonl, cache_dir)
  with open(jsonl, "r+") as f:  # the first line, rewritten in place, same length
    f.write(json.dumps({"id": 7, "text": ""}))
  stat = os.stat(jsonl)
  os.utime(jsonl, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  counter.bytes_read = 0

  source = _source(jsonl, cache_dir)

  assert counter.bytes_read >= os.path.getsize(jsonl)
  assert source[0] == {"id": 7, "text": ""} and source[1]["id"] == 1


def _corrupt_truncated(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _corrupt_garbage(path):
  with open(path, "wb") as f:
    f.write(b"not an npy file at all")


def _corrupt_pickled(path):
  np.save(path, np.array([{"evil": 1}], dtype=object), allow_pickle=True)


def _corrupt_shifted_offsets(path):
  """Right header (size, mtime_ns), offsets that do not fall on line breaks."""
  array = np.load(path)
  count = int(array[4])
  array[5:5 + count] += 1
  np.save(path, array)


def _corrupt_header_count(path):
  array = np.load(path)
  array[4] += 1
  np.save(path, array)


def _corrupt_wrong_magic(path):
  array = np.load(path)
  array[0] = 12345
  np.save(path, array)


def _corrupt_missing_last_line(path):
  """A consistent-looking index that drops the file's last record."""
  array = np.load(path)
  count = int(array[4])
  starts, ends = array[5:5 + count - 1], array[5 + count:5 + 2 * count - 1]
  np.save(path, np.concatenate([array[:4], [count - 1], starts, ends]))


@pytest.mark.parametrize("corrupt", [
    _corrupt_truncated, _corrupt_garbage, _corrupt_pickled, _corrupt_shifted_offsets,
    _corrupt_header_count, _corrupt_wrong_magic, _corrupt_missing_last_line,
])
def test_a_corrupt_cache_is_ignored_and_rebuilt(jsonl, cache_dir, counter, corrupt):
  expected = [sources_lib.JsonlSource([jsonl], index_cache_dir="")[i] for i in (0, 1, 1999)]
  _source(jsonl, cache_dir)
  corrupt(_cache_file(jsonl, cache_dir))
  counter.bytes_read = 0

  source = _source(jsonl, cache_dir)

  assert counter.bytes_read >= os.path.getsize(jsonl)  # rebuilt from the file
  assert len(source) == 2000
  assert [source[i] for i in (0, 1, 1999)] == expected
  counter.bytes_read = 0
  _source(jsonl, cache_dir)
  assert counter.bytes_read < 100  # and the rebuilt index was cached again


def test_small_files_are_not_cached(jsonl, cache_dir, monkeypatch):
  monkeypatch.setattr(_line_index, "INDEX_CACHE_MIN_BYTES", os.path.getsize(jsonl) + 1)
  _source(jsonl, cache_dir)
  assert not os.path.exists(cache_dir)


def test_an_unwritable_cache_location_falls_back_to_no_cache(jsonl, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  source = _source(jsonl, str(blocker / "cache"))  # a directory under a file
  assert len(source) == 2000 and source[5]["id"] == 5


def test_an_empty_cache_dir_disables_the_cache_and_the_env_var_chooses_it(jsonl, tmp_path, monkeypatch):
  _source(jsonl, "")
  assert not list(tmp_path.glob("**/*.ckpt_iter-index.npy"))
  monkeypatch.setenv(_line_index.INDEX_CACHE_ENV, str(tmp_path / "from_env"))
  ckpt_iter.make_dataset(jsonl, batch_size=4)
  assert os.path.exists(_cache_file(jsonl, str(tmp_path / "from_env")))


def test_blank_lines_and_a_missing_final_newline_survive_the_cache(tmp_path, cache_dir):
  path = str(tmp_path / "blank.jsonl")
  with open(path, "w") as f:
    f.write('{"id": 0}\n\n{"id": 1}\r\n \n{"id": 2}')
  first = _source(path, cache_dir)
  second = _source(path, cache_dir)
  assert [second[i] for i in range(len(second))] == [first[i] for i in range(3)] == [
      {"id": 0}, {"id": 1}, {"id": 2}]


@pytest.mark.parametrize("how", ["touch -r", "os.utime"])
def test_an_edit_that_puts_the_old_size_and_mtime_back_is_rebuilt(jsonl, cache_dir, tmp_path, how):
  """rsync -t, cp -p, tar and touch -r keep size and mtime; the ctime they cannot keep."""
  _source(jsonl, cache_dir)
  before = os.stat(jsonl)
  reference = tmp_path / "times"
  reference.write_text("")
  os.utime(reference, ns=(before.st_atime_ns, before.st_mtime_ns))
  # One character moves from line 101 to line 100: same size, and the line
  # break between them (not one the spot checks look at) moves by one byte.
  with open(jsonl) as f:
    lines = f.readlines()
  records = [json.loads(line) for line in lines]
  records[100]["text"] += "x"
  records[101]["text"] = records[101]["text"][1:]
  lines[100:102] = [json.dumps(records[i]) + "\n" for i in (100, 101)]
  with open(jsonl, "w") as f:
    f.writelines(lines)
  if how == "touch -r":
    subprocess.run(["touch", "-r", str(reference), jsonl], check=True)
  else:
    os.utime(jsonl, ns=(before.st_atime_ns, before.st_mtime_ns))
  after = os.stat(jsonl)
  assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)

  source = _source(jsonl, cache_dir)
  assert [source[i] for i in range(len(source))] == [json.loads(line) for line in lines]


def test_a_file_replaced_under_a_live_source_is_read_as_indexed_or_refused(jsonl, cache_dir, monkeypatch):
  """A descriptor open before the replacement reads the indexed file (every thread of the process shares it);
  one opened after it (a new process, or the descriptor closed past the open-file limit) would read the new file
  through the old index, and is refused."""
  source = _source(jsonl, cache_dir)
  first = source[5]
  replacement = jsonl + ".new"
  _write(replacement, 100, 2000)  # other records, a file of another size
  os.replace(replacement, jsonl)
  assert source[5] == first  # the indexed file, still open
  seen = []
  thread = threading.Thread(target=lambda: seen.append(source[5]))
  thread.start()
  thread.join()
  assert seen == [first]  # another thread: the same descriptor, the same file
  monkeypatch.setattr(storage_lib, "_RANGE_FILES", storage_lib._RangeFiles())  # pylint: disable=protected-access
  with pytest.raises(ckpt_iter.InvalidStateError, match="replaced or rewritten since this source indexed it") as e:
    source[5]
  assert jsonl in str(e.value)


def test_a_jsonl_source_keeps_its_public_name_in_a_graphs_fingerprint_and_in_a_pickle(jsonl, cache_dir):
  """Its code lives in _jsonl; a state saved over `MapDataset.source(JsonlSource(...))` names ckpt_iter.sources."""
  import pickle  # pylint: disable=g-import-not-at-top
  import grain  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _global_batch  # pylint: disable=g-import-not-at-top

  source = _source(jsonl, cache_dir)
  fields = _global_batch.describe_pipeline(grain.MapDataset.source(source))
  assert fields["node[0].SourceMapDataset.source"] == "ckpt_iter.sources.JsonlSource"
  assert b"ckpt_iter.sources" in pickle.dumps(source) and pickle.loads(pickle.dumps(source))[7] == source[7]


def test_file_sources_answer_where_a_record_is_themselves(tmp_path):
  # issue 58 item 14: sources.py reached into each file source's privates (seven accesses) for this.
  import pathlib  # pylint: disable=g-import-not-at-top
  import re as re_lib  # pylint: disable=g-import-not-at-top

  from ckpt_iter import sources as sources_lib  # pylint: disable=g-import-not-at-top

  paths = []
  for part, count in enumerate((3, 0, 4)):
    paths.append(str(tmp_path / f"p-{part}.jsonl"))
    with open(paths[-1], "w") as f:
      f.writelines(f'{{"id": {part * 10 + i}}}\n' for i in range(count))
  source = sources_lib.JsonlSource(paths, index_cache_dir="")
  assert sources_lib.file_offsets(source) == source.file_offsets() == [0, 3, 3, 7]
  assert sources_lib.file_position(source, 4) == source.file_position(4) == (paths[2], "line 2")
  assert sources_lib.file_position([{"id": 1}], 0) is None
  text = pathlib.Path(sources_lib.__file__).read_text()
  assert not re_lib.search(r"\bsource\._\w+", text), "sources.py reaches into a source's privates"
