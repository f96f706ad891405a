"""Writing into a shard cache's directory (`_cache_disk`): files held while written, and a full disk's words."""

from __future__ import annotations

import errno
import io

import pytest

from ckpt_iter import _cache_disk


def test_a_file_being_written_is_held_and_one_left_behind_is_not(tmp_path):
  target = str(tmp_path / "copy.tmp-1-2")
  with _cache_disk.locked_file(target, "wb") as f:
    f.write(b"x")
    assert _cache_disk.is_held(target)  # a sweep leaves it alone
  assert not _cache_disk.is_held(target) and not _cache_disk.is_held(str(tmp_path / "absent"))


def test_a_writer_measures_a_decompressed_copy_past_a_full_disk():
  class Full(io.BytesIO):
    def write(self, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  writer = _cache_disk.CacheWriter(Full(), measure_after_failure=True)
  for _ in range(3):
    writer.write(b"abcd")  # held back, counted
  with pytest.raises(_cache_disk.CacheWriteFailed) as caught:
    writer.finish()
  assert (caught.value.needed, caught.value.decompressed) == (12, True)
  plain = _cache_disk.CacheWriter(Full())
  with pytest.raises(_cache_disk.CacheWriteFailed):
    plain.write(b"abcd")  # a plain copy's size is the object's: raised at once


def test_the_errors_name_the_directory_the_bytes_and_the_fix(tmp_path):
  full = OSError(errno.ENOSPC, "No space left on device")
  text = str(_cache_disk.cache_error(str(tmp_path), 10**6, "gs://b/x.jsonl.zst", 5_000, full, decompressed_from=300))
  assert "decompressed text of gs://b/x.jsonl.zst: it is 5,000 bytes (300 compressed" in text
  assert "lower its max_bytes" not in text
  plain = _cache_disk.cache_error(str(tmp_path), 10**6, "gs://b/x.jsonl", 5_000, full)
  assert plain.cause == "no_space" and "5,000 bytes needed" in str(plain) and "lower its max_bytes" in str(plain)
  other = _cache_disk.cache_error(str(tmp_path), 10**6, "x", 0, OSError(errno.EROFS, "Read-only file system"))
  assert other.cause == "cache" and "cannot write x there" in str(other)
