"""ckpt_iter/_storage.py on local paths (object stores: tests/integration/test_object_store.py)."""

import os
import pickle
import subprocess

import pytest

from ckpt_iter import _storage


def test_urls_are_told_from_local_paths():
  assert _storage.is_url("gs://bucket/a") and _storage.is_url("s3://b/k") and _storage.is_url("file:///tmp/x")
  assert not _storage.is_url("/tmp/gs://x") and not _storage.is_url("relative/path")
  assert _storage.absolute("gs://bucket/a//b") == "gs://bucket/a//b"  # os.path.abspath would give "…/gs:/bucket"
  assert _storage.absolute("rel") == os.path.abspath("rel")


def test_read_bytes_reads_a_file_whole_and_refuses_more_than_its_limit(tmp_path):
  path = str(tmp_path / "f")
  _storage.write_bytes(path, b"0123456789")
  assert _storage.read_bytes(path, max_bytes=10) == b"0123456789"
  with pytest.raises(_storage.TooLargeError) as raised:
    _storage.read_bytes(path, max_bytes=9)
  assert raised.value.size == 10 and raised.value.filename == path
  with pytest.raises(FileNotFoundError):
    _storage.read_bytes(str(tmp_path / "missing"), max_bytes=10)


def test_read_bytes_refuses_a_fifo_instead_of_blocking(tmp_path):
  fifo = str(tmp_path / "fifo")
  os.mkfifo(fifo)
  with pytest.raises(OSError) as raised:
    _storage.read_bytes(fifo, max_bytes=10)
  assert "not a regular file" in str(raised.value)


def test_a_failed_write_names_the_file_and_leaves_nothing_half_written(tmp_path):
  # /dev/full accepts the open and fails the write with ENOSPC, as a full disk does.
  path = str(tmp_path / "process_0-of-1.npz")
  os.symlink("/dev/full", path)
  with pytest.raises(OSError) as raised:
    _storage.write_bytes(path, b"x" * 4096)
  assert raised.value.errno == 28 and raised.value.filename == path
  assert os.path.exists("/dev/full")  # a device is never removed, only a partial file

  # A partial regular file is removed: here the write fails at its fsync (EIO).
  partial = str(tmp_path / "process_0-of-1.json")
  original_fsync = os.fsync

  def failing_fsync(fd):
    raise OSError(5, "Input/output error")

  os.fsync = failing_fsync
  try:
    with pytest.raises(OSError) as raised:
      _storage.write_bytes(partial, b"{}")
  finally:
    os.fsync = original_fsync
  assert raised.value.errno == 5 and raised.value.filename == partial and not os.path.exists(partial)
  regular = str(tmp_path / "directory_not_file")
  os.mkdir(regular)
  with pytest.raises(OSError) as raised:
    _storage.write_bytes(regular, b"x")
  assert raised.value.filename == regular and os.path.isdir(regular)


def test_listing_says_which_entries_are_directories(tmp_path):
  (tmp_path / "1").mkdir()
  (tmp_path / "a.json").write_text("{}")
  assert sorted(_storage.list_entries(str(tmp_path))) == [("1", True), ("a.json", False)]
  assert sorted(_storage.list_names(str(tmp_path))) == ["1", "a.json"]
  with pytest.raises(FileNotFoundError):
    _storage.list_entries(str(tmp_path / "absent"))
  assert _storage.glob(str(tmp_path / "*.json")) == [str(tmp_path / "a.json")]


def test_identity_changes_when_an_edit_keeps_size_and_mtime(tmp_path):
  """cp -p, rsync -t and touch -r restore the mtime of an edited file; not its ctime."""
  path = tmp_path / "data.jsonl"
  path.write_text('{"id": 1}\n')
  before = _storage.identity(str(path))
  assert before.size == path.stat().st_size and before.version
  reference = tmp_path / "reference"
  reference.write_text("")
  subprocess.run(["touch", "-r", str(path), str(reference)], check=True)
  path.write_text('{"id": 2}\n')  # same size
  subprocess.run(["touch", "-r", str(reference), str(path)], check=True)  # mtime put back
  after = _storage.identity(str(path))
  assert after.size == before.size and path.stat().st_mtime_ns == os.stat(reference).st_mtime_ns
  assert after.version != before.version
  assert _storage.version_digest(after.version) != _storage.version_digest(before.version)


def test_a_range_reader_reads_ranges_and_survives_pickling(tmp_path):
  path = str(tmp_path / "f")
  _storage.write_bytes(path, b"abcdefghij")
  reader = _storage.RangeReader(path)
  assert reader.read(2, 5) == b"cde"
  clone = pickle.loads(pickle.dumps(reader))  # into a Grain worker: no descriptor carried over
  assert clone.read(0, 3) == b"abc" and clone.path == path


def test_a_whole_file_is_one_open_write_fsync_and_close_of_its_descriptor(tmp_path, monkeypatch):
  """Each small file of a save (a state header, the count file) costs the calls it needs, no buffered file."""
  calls = []
  for name in ("open", "fstat", "write", "fsync", "close"):
    original = getattr(os, name)
    monkeypatch.setattr(os, name, lambda *a, _name=name, _original=original, **k: (
        calls.append(_name), _original(*a, **k))[1])

  def no_buffered_open(*args, **kwargs):
    raise AssertionError("a buffered file object was opened")

  monkeypatch.setattr(_storage, "open", no_buffered_open, raising=False)
  path = str(tmp_path / "process_0-of-1.json")
  _storage.write_bytes(path, b'{"format_version":4}')
  assert calls == ["open", "fstat", "write", "fsync", "close"]
  with open(path, "rb") as f:
    assert f.read() == b'{"format_version":4}'


def test_remove_tree_deletes_a_directory_and_everything_under_it(tmp_path):
  (tmp_path / "keep").mkdir()
  (tmp_path / "7" / "iter").mkdir(parents=True)
  (tmp_path / "7" / "iter" / "process_0-of-1.json").write_text("{}")
  _storage.remove_tree(str(tmp_path / "7"))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
