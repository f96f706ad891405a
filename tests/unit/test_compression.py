"""Compressed shards: which files are, and their bytes decompressed as they arrive, in any pieces."""

from __future__ import annotations

import gzip
import io
import json
import zlib

import hypothesis
from hypothesis import strategies as st
import pytest
import zstandard

import ckpt_iter
from ckpt_iter import _compression


def test_a_file_says_its_compression_by_its_name():
  assert _compression.compression_of("gs://b/part-0.jsonl.gz") == "gzip"
  assert _compression.compression_of("/d/part-0.jsonl.zst") == "zstd"
  assert _compression.compression_of("/d/part-0.jsonl") is None
  assert [_compression.plain_suffix(p) for p in ("a.jsonl.gz", "a.jsonl.zst", "a.jsonl", "a.parquet")] == [
      ".jsonl", ".jsonl", ".jsonl", ".parquet"]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(data=st.binary(max_size=20_000), members=st.integers(1, 3), kind=st.sampled_from(["gzip", "zstd"]),
                  piece=st.integers(1, 5000))
def test_what_arrives_in_any_pieces_decompresses_to_the_text(data, members, kind, piece):
  parts = [data[i * len(data) // members:(i + 1) * len(data) // members] for i in range(members)]
  if kind == "gzip":  # a multi-member file, as `cat a.gz b.gz` makes
    blob = b"".join(gzip.compress(p) for p in parts)
  else:
    blob = b"".join(zstandard.ZstdCompressor().compress(p) for p in parts)
  out = io.BytesIO()
  writer = _compression.DecompressingWriter(out, kind)
  for start in range(0, len(blob), piece):
    writer.write(memoryview(blob)[start:start + piece])
  writer.finish()
  assert out.getvalue() == data


def test_a_truncated_gzip_file_is_refused():
  writer = _compression.DecompressingWriter(io.BytesIO(), "gzip")
  writer.write(gzip.compress(b"x" * 10_000)[:40])
  with pytest.raises(ValueError, match="truncated"):
    writer.finish()


def test_compressed_jsonl_reads_and_resumes_exactly_as_jsonl(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache of compressed files
  monkeypatch.delenv("CKPT_ITER_SHARD_CACHE_DIR", raising=False)
  plain, compressed = [], []
  for part in range(3):
    text = "".join(json.dumps({"id": part * 50 + i}) + "\n" for i in range(50)).encode()
    plain.append(str(tmp_path / f"p-{part}.jsonl"))
    open(plain[-1], "wb").write(text)
    compressed.append(plain[-1] + (".gz" if part % 2 else ".zst"))
    open(compressed[-1], "wb").write(gzip.compress(text) if part % 2 else zstandard.ZstdCompressor().compress(text))
  expected = [b["id"].tolist() for b in ckpt_iter.make_dataset(plain, batch_size=4, seed=7)]
  for files in (compressed, plain[:1] + compressed[1:]):  # all compressed, or some: all JSONL
    iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(files, batch_size=4, seed=7))
    first = [next(iterator)["id"].tolist() for _ in range(5)]
    resumed = ckpt_iter.DataIterator(ckpt_iter.make_dataset(files, batch_size=4, seed=7))
    resumed.restore_state(iterator.state())
    assert first + [b["id"].tolist() for b in resumed] == expected
  cached = sorted(p.name for p in (tmp_path / "xdg" / "ckpt_iter" / "decompressed").iterdir() if p.suffix != ".lock")
  assert any(name.endswith("p-1.jsonl.gz") for name in cached)  # kept decompressed in the default cache


def test_a_file_named_gz_that_is_not_gzip_is_refused_naming_it(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.delenv("CKPT_ITER_SHARD_CACHE_DIR", raising=False)
  path = tmp_path / "p.jsonl.gz"
  path.write_bytes(b'{"id": 0}\n' * 50)  # plain text under a .gz name
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"p.jsonl.gz: not a whole gzip file \(not gzip data"):
    ckpt_iter.make_dataset([str(path)], batch_size=2, seed=None)


def test_a_highly_compressed_files_index_is_bound_to_its_copy_not_rebuilt_at_each_open(tmp_path, caplog):
  # The index of a copy can outgrow 16 x the compressed object's size: it is read by the copy's size.
  from ckpt_iter import sources  # pylint: disable=g-import-not-at-top

  path = tmp_path / "many.jsonl.gz"
  path.write_bytes(gzip.compress(b"{}\n" * 20_000))  # 60 KB of text in a few hundred bytes
  cache = sources.ShardCache(tmp_path / "cache", 10**8)
  assert len(sources.JsonlSource([str(path)], cache=cache)) == 20_000
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    again = sources.JsonlSource([str(path)], cache=sources.ShardCache(tmp_path / "cache", 10**8))
    assert again[19_999] == {}
  assert "rebuilding" not in caplog.text


# --- nothing lost, and bounded, on the compressed path (issue 64 items 1, 5, 7) ---


def _records_text(count, first=0):
  return "".join(json.dumps({"id": first + i, "text": "t" * (i % 17)}) + "\n" for i in range(count)).encode()


def _zstd_cuts():
  """(name, bytes) of the cuts a writer killed mid-file leaves: each a whole object, its checksum its bytes'."""
  text = _records_text(300)
  whole = zstandard.ZstdCompressor(write_checksum=True).compress(text)
  frames = b"".join(zstandard.ZstdCompressor().compress(_records_text(100, 100 * i)) for i in range(3))
  third = len(frames) - len(zstandard.ZstdCompressor().compress(_records_text(100, 200)))
  streamed = zstandard.ZstdCompressor(write_checksum=False, write_content_size=False).compressobj()
  bare = streamed.compress(text) + streamed.flush()
  return [("one frame cut at 2/3", whole[:len(whole) * 2 // 3]),
          ("the third of three frames cut after 10 bytes", frames[:third + 10]),
          ("a frame without checksum or content size cut in half", bare[:len(bare) // 2])]


@pytest.mark.parametrize("name, data", _zstd_cuts(), ids=[c[0] for c in _zstd_cuts()])
def test_a_truncated_zstd_file_is_refused_as_a_truncated_gzip_file_is(tmp_path, name, data):
  # It was read as fewer records with no error (0, 200 and 0 of 300), and `ckpt-iter index` wrote that count.
  from ckpt_iter import sources  # pylint: disable=g-import-not-at-top
  import support  # pylint: disable=g-import-not-at-top

  writer = _compression.DecompressingWriter(io.BytesIO(), "zstd")
  writer.write(data)
  with pytest.raises(ValueError, match=r"the zstd stream ends inside a frame \(a truncated file\)"):
    writer.finish()
  path = tmp_path / "cut.jsonl.zst"
  path.write_bytes(data)
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"cut.jsonl.zst: not a whole zstd file \(the zstd stream "
                     r"ends inside a frame"):
    sources.JsonlSource([str(path)], cache=sources.ShardCache(tmp_path / "cache", 10**8))
  code, out = support.cli_output("index", str(path))
  assert code == 1 and "ends inside a frame" in out and not (tmp_path / "ckpt_iter_index.json").exists(), out


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_data_not_of_its_kind_is_refused_at_the_end_not_midway(kind):
  # So that a download's checksum, compared when its last byte arrives, speaks first (item 7).
  out = io.BytesIO()
  writer = _compression.DecompressingWriter(out, kind)
  good = gzip.compress(b"x" * 1000) if kind == "gzip" else zstandard.ZstdCompressor().compress(b"x" * 1000)
  writer.write(b"garbage that is no compressed data at all" * 10)
  writer.write(good)  # taken and dropped
  with pytest.raises(ValueError, match=f"not {kind} data"):
    writer.finish()


class _Counting:
  def __init__(self):
    self.size = 0

  def write(self, data):
    self.size += len(data)
    return len(data)


@pytest.mark.parametrize("kind, text_bytes", [("gzip", 160 * 2**20), ("zstd", 320 * 2**20)])
def test_decompression_memory_does_not_follow_the_compression_ratio(kind, text_bytes):
  # A 3 MB .gz and a 0.4 MB .zst each raised peak memory by 4 GiB: the whole text was held.
  import tracemalloc  # pylint: disable=g-import-not-at-top

  if kind == "gzip":
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * 2**20
    blob = b"".join(compressor.compress(block) for _ in range(text_bytes // len(block))) + compressor.flush()
  else:
    blob = zstandard.ZstdCompressor(level=19).compress(b"\0" * text_bytes)
  sink = _Counting()
  tracemalloc.start()
  try:
    writer = _compression.DecompressingWriter(sink, kind)
    writer.write(blob)  # in one piece, as a download chunk arrives
    writer.finish()
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert sink.size == text_bytes
  assert peak < 48 * 2**20 + 2 * len(blob), (peak, len(blob))  # the whole text, as before, is over 160 MiB
