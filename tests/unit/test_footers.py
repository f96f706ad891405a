"""What a Parquet or ArrayRecord file's footer says, kept: in the shard cache and in the corpus index (issue 65
item 3).

A build through a cache read every footer at every start (about 64 KiB a
Parquet file, 1 MiB an ArrayRecord file), warm restarts included. Now a warm
restart reads no footer (the cache keeps what each said), and a new host over
an indexed corpus reads the index, not the footers. What is kept is checked
against the copy at its first read, as a footer read from the store is.
Local files stand in for the store (a ShardCache copies any file);
tests/integration/test_bucket_cache.py counts the requests on a GCS emulator.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

from hypothesis import given, settings, strategies as st
import pytest

from ckpt_iter import _cache_companions
from ckpt_iter import _cached_files
from ckpt_iter import _corpus_index
from ckpt_iter import errors
from ckpt_iter import sources
import support

_SOURCES = {"parquet": sources.ParquetSource, "array_record": sources.ArrayRecordSource}


def _corpus(directory, kind, rows_per_file):
  os.makedirs(directory, exist_ok=True)
  for part, rows in enumerate(rows_per_file):
    support.FILE_WRITERS[kind](os.path.join(directory, f"part-{part}.{kind}"),
                               [{"id": part * 1000 + n} for n in range(rows)])
  return os.path.join(directory, f"part-*.{kind}")


def _no_footer_reads(monkeypatch):
  """Every way a build reads a footer from the files fails the test."""
  def read_footer(*args, **kwargs):
    raise AssertionError(f"a footer was read from the files: {args[:2]}")
  monkeypatch.setattr(_cached_files, "footers", read_footer)
  monkeypatch.setattr(_cached_files, "record_counts", read_footer)


def _records(source):
  return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_a_warm_restart_reads_no_footer(tmp_path, kind, monkeypatch):
  glob = _corpus(str(tmp_path / "data"), kind, [5, 0, 7])
  cache = sources.ShardCache(tmp_path / "cache", 10**8)
  first = _SOURCES[kind](glob, cache=cache, prefetch_files=0)
  expected = _records(first)
  with monkeypatch.context() as patched:
    _no_footer_reads(patched)
    again = _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
    assert again.file_offsets() == first.file_offsets() and _records(again) == expected
  # Kept as one small object for the source's files (a write a file was seconds at 20,480 files), outside the
  # cache's byte total and its copies, and kept after they are evicted.
  kept = [n for n in os.listdir(tmp_path / "cache") if n.startswith(_cache_companions.FOOTERS_PREFIX)]
  assert len(kept) == 1 and os.path.getsize(tmp_path / "cache" / kept[0]) < 200
  assert [path for path, _, _ in cache.entries() if _cache_companions.FOOTERS_PREFIX in path] == []


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_a_new_host_over_an_indexed_corpus_reads_the_index_not_the_footers(tmp_path, kind, monkeypatch):
  glob = _corpus(str(tmp_path / "data"), kind, [9, 3, 0, 6])
  expected = _records(_SOURCES[kind](glob))
  code, out = support.cli_output("index", str(tmp_path / "data"))
  assert code == 0 and "indexed 4 files, 18 records" in out, out
  entries = _corpus_index.read(str(tmp_path / "data"))
  if kind == "parquet":  # the row groups (support's writer: 4 rows a group) beside the count
    assert entries["part-0.parquet"]["row_groups"] == [4, 4, 1] and entries["part-2.parquet"]["row_groups"] == [0]
  else:
    assert "row_groups" not in entries["part-0.array_record"]
  with monkeypatch.context() as patched:
    _no_footer_reads(patched)
    source = _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "new_host", 10**8), prefetch_files=0)
    assert _records(source) == expected


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_an_index_that_lies_stops_the_read_of_that_file_and_a_build_again_reads_the_copys_footer(tmp_path, kind):
  glob = _corpus(str(tmp_path / "data"), kind, [5, 6])
  support.cli_output("index", str(tmp_path / "data"))
  path = tmp_path / "data" / _corpus_index.INDEX_NAME
  value = json.loads(path.read_text())
  entry = value["files"][f"part-1.{kind}"]
  entry["records"] = 4
  if kind == "parquet":
    entry["row_groups"] = [4]
  value["crc32"] = zlib.crc32(json.dumps(value["files"], sort_keys=True, separators=(",", ":")).encode())
  path.write_text(json.dumps(value))  # a consistent edit: only the read of the copy can catch it
  cache_dir = tmp_path / "cache"
  source = _SOURCES[kind](glob, cache=sources.ShardCache(cache_dir, 10**8), prefetch_files=0)
  assert len(source) == 9 and source[0] == {"id": 0}
  with pytest.raises(errors.InvalidStateError, match=rf"part-1.{kind}: its copy in the shard cache .* this source "
                     r"was built with .*\(from .*ckpt_iter_index.json, which is wrong for it: index the corpus again "
                     r"with ckpt-iter index .*\)\. Build the source again"):
    source[5]
  # The copy's footer replaced the wrong one kept in the cache: the build the error asks for reads 11 records.
  rebuilt = _SOURCES[kind](glob, cache=sources.ShardCache(cache_dir, 10**8), prefetch_files=0)
  assert _records(rebuilt) == [{"id": n} for n in range(5)] + [{"id": 1000 + n} for n in range(6)]


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_a_torn_footer_in_the_cache_is_read_again_from_the_file(tmp_path, kind, caplog):
  glob = _corpus(str(tmp_path / "data"), kind, [5, 6])
  _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  (kept,) = [n for n in os.listdir(tmp_path / "cache") if n.startswith(_cache_companions.FOOTERS_PREFIX)]
  text = (tmp_path / "cache" / kept).read_text()
  (tmp_path / "cache" / kept).write_text(text.replace('"files":[[', '"files":[[1', 1))  # an edit its CRC-32 catches
  with caplog.at_level(logging.WARNING):
    source = _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  assert len(source) == 11 and sum("not intact (edited or torn)" in r.getMessage() for r in caplog.records) == 1
  (tmp_path / "cache" / kept).write_text(text[:len(text) // 2])  # torn
  with caplog.at_level(logging.WARNING):
    assert len(_SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))) == 11


def test_a_parquet_file_changed_since_it_was_indexed_is_refused_naming_it(tmp_path):
  glob = _corpus(str(tmp_path / "data"), "parquet", [5, 6])
  support.cli_output("index", glob)
  support.write_parquet(tmp_path / "data" / "part-1.parquet", [{"id": n} for n in range(7)])
  with pytest.raises(errors.InvalidStateError, match=r"part-1.parquet: .*counted it at size .*changed since it was "
                     r"indexed\. Index the corpus again \(ckpt-iter index .*data\)"):
    sources.ParquetSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


@pytest.mark.parametrize("groups", [[4, 4], [-1, 6], "5"])
def test_an_index_entry_whose_row_groups_do_not_sum_to_its_records_is_refused(tmp_path, groups):
  glob = _corpus(str(tmp_path / "data"), "parquet", [5])
  support.cli_output("index", glob)
  path = tmp_path / "data" / _corpus_index.INDEX_NAME
  value = json.loads(path.read_text())
  value["files"]["part-0.parquet"]["row_groups"] = groups
  value["crc32"] = zlib.crc32(json.dumps(value["files"], sort_keys=True, separators=(",", ":")).encode())
  path.write_text(json.dumps(value))
  with pytest.raises(errors.InvalidStateError, match=r"entry 'part-0.parquet' is not .*row groups that sum"):
    sources.ParquetSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


def test_an_index_of_jsonl_only_keeps_the_format_older_readers_read(tmp_path):
  directory = tmp_path / "data"
  directory.mkdir()
  support.write_jsonl(directory / "a.jsonl", [{"id": 1}])
  support.write_parquet(directory / "b.parquet", [{"id": 2}])
  support.cli_output("index", str(directory / "a.jsonl"))
  assert json.loads((directory / _corpus_index.INDEX_NAME).read_text())["format"] == _corpus_index.FORMAT == 1
  support.cli_output("index", str(directory))
  written = json.loads((directory / _corpus_index.INDEX_NAME).read_text())
  assert written["format"] == _corpus_index.FORMAT_GROUPS and sorted(written["files"]) == ["a.jsonl", "b.parquet"]


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(sorted(_SOURCES)), rows=st.lists(st.integers(0, 11), min_size=1, max_size=4),
       indexed=st.booleans(), files_from_index=st.booleans(), restarts=st.integers(1, 3))
def test_whatever_the_footers_came_from_a_source_reads_what_it_reads_in_place(tmp_path_factory, kind, rows, indexed,
                                                                               files_from_index, restarts):
  # In place (no cache) every footer is read from the file: the reference. Through a cache, from the files, the
  # index or the cache's kept footers, over restarts: the same offsets and the same records, each once.
  directory = str(tmp_path_factory.mktemp("corpus"))
  glob = _corpus(os.path.join(directory, "data"), kind, rows)
  reference = _SOURCES[kind](glob)
  expected = _records(reference)
  if indexed:
    assert support.cli_output("index", os.path.join(directory, "data"))[0] == 0
  for restart in range(restarts):
    source = _SOURCES[kind](glob, cache=sources.ShardCache(os.path.join(directory, "cache"), 10**8), prefetch_files=0,
                            files_from_index=indexed and files_from_index)  # files named by the index, or listed
    assert source.file_offsets() == reference.file_offsets(), restart
    assert _records(source) == expected and len({r["id"] for r in expected}) == len(expected) == sum(rows)
