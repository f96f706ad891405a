"""The corpus index object (`ckpt-iter index`): counts from one object, never trusted past the files.

Local files stand in for a bucket (a ShardCache copies any file); tests/integration/test_bucket_cache.py
counts the requests on a GCS emulator.
"""

from __future__ import annotations

import errno
import glob as glob_lib
import gzip
import json
import os
import threading
import zlib

from hypothesis import given, settings, strategies as st
import pytest

from ckpt_iter import _corpus_index
from ckpt_iter import _storage
from ckpt_iter import cli
from ckpt_iter import errors
from ckpt_iter import sources
import support


def _corpus(directory, lines_per_file, *, gzipped=False):
  """JSONL files with blank lines among the records; returns the glob."""
  os.makedirs(directory, exist_ok=True)
  for part, count in enumerate(lines_per_file):
    records = [{"id": part * 1000 + n} for n in range(count)]
    path = os.path.join(directory, f"part-{part}.jsonl")
    support.write_jsonl(path, records, blank_lines=True)
    if gzipped:
      with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as out:
        out.write(f.read())
      os.remove(path)
  return os.path.join(directory, "part-*.jsonl" + (".gz" if gzipped else ""))


def _downloads(monkeypatch):
  calls = []
  real = _storage.download
  monkeypatch.setattr(_storage, "download", lambda path, f, found: (calls.append(path), real(path, f, found))[1])
  return calls


def _index(glob):
  code, out = support.cli_output("index", glob)
  assert code == 0, out
  return out


@settings(max_examples=25, deadline=None)
@given(lines=st.lists(st.integers(0, 40), min_size=1, max_size=5), gzipped=st.booleans(),
       files_from_index=st.booleans())
def test_a_new_host_counts_from_the_index_and_reads_what_counting_by_download_reads(tmp_path_factory, lines,
                                                                                       gzipped, files_from_index):
  directory = str(tmp_path_factory.mktemp("corpus"))
  glob = _corpus(os.path.join(directory, "data"), lines, gzipped=gzipped)
  unindexed = sources.JsonlSource(glob, cache=sources.ShardCache(os.path.join(directory, "a"), 10**8))
  expected = [unindexed[i] for i in range(len(unindexed))]
  out = _index(glob)
  assert f"indexed {len(lines)} files, {sum(lines)} records" in out
  with pytest.MonkeyPatch.context() as monkeypatch:
    calls = _downloads(monkeypatch)
    source = sources.JsonlSource(glob, cache=sources.ShardCache(os.path.join(directory, "b"), 10**8),
                                 prefetch_files=0, files_from_index=files_from_index)
    assert source.paths == unindexed.paths and source.identities() == unindexed.identities()
    # Only a file counted 0 that has bytes (blank lines) is looked at when built: none is skipped unread.
    empty_with_bytes = sorted(p for p, count in zip(source.paths, lines) if not count and os.path.getsize(p))
    assert sorted(calls) == empty_with_bytes and source.file_offsets() == unindexed.file_offsets()
    assert [source[i] for i in range(len(source))] == expected
    # Each file with records read once, when read.
    assert len(calls) == sum(1 for count in lines if count) + len(empty_with_bytes)


def test_a_file_changed_since_it_was_indexed_is_refused_naming_it_and_the_ways_through(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  _index(glob)
  with open(tmp_path / "data" / "part-1.jsonl", "a") as f:
    f.write(json.dumps({"id": 7}) + "\n")
  with pytest.raises(errors.InvalidStateError,
                     match=r"part-1.jsonl: .*ckpt_iter_index.json counted it at size .*the file changed since it "
                           r"was indexed\. Index the corpus again \(ckpt-iter index .*\), or delete "
                           r"ckpt_iter_index.json"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  # Counted from the files, the source builds (and the index verb writes the new count).
  assert len(sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "c2", 10**8), corpus_index=False)) == 12


def test_files_named_by_the_index_are_still_checked_against_it(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [5, 6, 7])
  _index(glob)
  support.write_jsonl(str(tmp_path / "data" / "part-9.jsonl"), [{"id": 9}])  # after the index: not the corpus
  named = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), files_from_index=True)
  assert len(named) == 18 and [os.path.basename(p) for p in named.paths] == [f"part-{n}.jsonl" for n in range(3)]
  paths = [glob.replace("*", "2"), glob.replace("*", "0")]  # a list keeps its order
  assert sources.JsonlSource(paths, files_from_index=True).paths == [os.path.abspath(p) for p in paths]
  # A local file's identity is its stat: one changed since the index is refused at the build, as when listed.
  with open(tmp_path / "data" / "part-1.jsonl", "a") as f:
    f.write(json.dumps({"id": 7}) + "\n")
  with pytest.raises(errors.InvalidStateError, match=r"part-1.jsonl: .*counted it at size .*changed since"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "c2", 10**8), files_from_index=True)
  with pytest.raises(errors.InvalidArgumentError, match=r"holds no ckpt_iter_index.json\. Index its files"):
    sources.JsonlSource(str(tmp_path / "*.jsonl"), files_from_index=True)
  with pytest.raises(ValueError, match="a local file's identity is its stat"):
    _storage.identities_as_recorded([glob.replace("*", "0")], [(1, "ino=1")])


def _rewrite(tmp_path, change):
  path = tmp_path / "data" / _corpus_index.INDEX_NAME
  value = json.loads(path.read_text())
  change(value)
  body = json.dumps(value["files"], sort_keys=True, separators=(",", ":"))
  value["crc32"] = zlib.crc32(body.encode())  # a consistent edit: only the read of the copy can catch it
  path.write_text(json.dumps(value))


def test_an_index_that_lies_about_a_count_stops_the_read_of_that_file_naming_the_index(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  _index(glob)
  _rewrite(tmp_path, lambda value: value["files"]["part-1.jsonl"].update(records=4))
  source = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
  assert len(source) == 9 and source[0] == {"id": 0}
  with pytest.raises(errors.InvalidStateError, match=r"part-1.jsonl: its copy .* holds 6 records, this source "
                     r"was built counting 4 \(the count of .*ckpt_iter_index.json, which is wrong for it"):
    source[5]


@pytest.mark.parametrize("text, says", [
    (b"not json", "Expecting value"),
    (b'{"kind": "ckpt_iter.jsonl_index", "format": 1, "crc32": 1, "files": {}}', "CRC-32"),
    (b'{"kind": "other", "format": 1, "crc32": 0, "files": {}}', "kind, format"),
])
def test_a_garbled_index_is_refused_by_name(tmp_path, text, says):
  glob = _corpus(str(tmp_path / "data"), [3])
  (tmp_path / "data" / _corpus_index.INDEX_NAME).write_bytes(text)
  with pytest.raises(errors.InvalidStateError, match=rf"ckpt_iter_index.json: not a ckpt_iter corpus index .*{says}"
                     r".*Index the corpus again"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


@pytest.mark.parametrize("entry", [{"size": -1, "version": "v", "records": 1}, {"size": 1, "version": 3, "records": 1},
                                   {"size": 1, "version": "v"}, {"size": 1, "version": "v", "records": 2**60}])
def test_an_index_entry_of_the_wrong_shape_is_refused_even_with_its_crc(tmp_path, entry):
  glob = _corpus(str(tmp_path / "data"), [3])
  _index(glob)
  _rewrite(tmp_path, lambda value: value["files"].update({"part-0.jsonl": entry}))
  with pytest.raises(errors.InvalidStateError, match=r"entry 'part-0.jsonl' is not \{size, version, records\}"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


def test_an_index_larger_than_any_index_is_refused_unread(tmp_path, monkeypatch):
  glob = _corpus(str(tmp_path / "data"), [3])
  _index(glob)
  monkeypatch.setattr(_corpus_index, "MAX_BYTES", 16)
  with pytest.raises(errors.InvalidStateError, match=r"more than 16 bytes.*not an index ckpt-iter wrote"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


def test_the_index_verb_counts_the_files_not_an_index_already_there(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  _index(glob)
  _rewrite(tmp_path, lambda value: value["files"]["part-1.jsonl"].update(records=4))
  _index(glob)  # written again from the files
  assert _corpus_index.read(str(tmp_path / "data"))["part-1.jsonl"]["records"] == 6


def test_without_an_index_a_file_is_counted_by_its_download_as_before(tmp_path, monkeypatch):
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  calls = _downloads(monkeypatch)
  assert len(sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))) == 11
  assert sorted(os.path.basename(c) for c in calls) == ["part-0.jsonl", "part-1.jsonl"]


def test_a_store_without_versions_cannot_be_indexed(tmp_path):
  with pytest.raises(errors.InvalidArgumentError, match=r"gives no version for it"):
    _corpus_index.write(["gs://b/x.jsonl"], [_storage.Identity(3, None)], [1])


def test_the_index_verb_is_a_verb_of_the_command_line():
  assert "index" in cli.build_parser().format_help()


# --- nothing lost on the index's path (issue 64 items 2, 8, 9) ---


@pytest.mark.parametrize("shuffle", ["global", "shards"])
def test_an_index_counting_zero_for_a_file_that_has_records_is_refused_at_build(tmp_path, shuffle):
  # A file counted 0 is never opened, so no read checked it: 200 of 300 records were trained, the epoch
  # ending normally. A count of 0 for a file with bytes is now looked at when the source is built.
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  glob = _corpus(str(tmp_path / "data"), [100, 100, 100])
  _index(glob)
  _rewrite(tmp_path, lambda value: value["files"]["part-1.jsonl"].update(records=0))
  cache = sources.ShardCache(tmp_path / "cache", 10**8)
  with pytest.raises(errors.InvalidStateError, match=r"part-1.jsonl: its copy .* holds 100 records, this source "
                     r"was built counting 0 \(the count of .*ckpt_iter_index.json, which is wrong for it: index the "
                     r"corpus again with ckpt-iter index .*data\)"):
    ckpt_iter.make_dataset(sources.JsonlSource(glob, cache=cache), batch_size=10, seed=1, shuffle=shuffle)


@pytest.mark.parametrize("shuffle", ["global", "shards"])
def test_a_cached_count_of_zero_is_counted_again_from_the_copy(tmp_path, shuffle, caplog):
  # The cache's own .count rewritten to 0 with its check recomputed: the source counts the copy.
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _cache_companions  # pylint: disable=g-import-not-at-top

  glob = _corpus(str(tmp_path / "data"), [100, 100, 100])
  directory = tmp_path / "cache"
  sources.JsonlSource(glob, cache=sources.ShardCache(directory, 10**8), corpus_index=False)
  cache = sources.ShardCache(directory, 10**8)
  path = sorted(glob_lib.glob(glob))[1]
  entry = cache.entry_path(path, _storage.identity(path))
  record = cache.read_companion_record(path, _storage.identity(path))
  zero = _cache_companions.CompanionRecord(0, record.copy_crc, record.index_crc).format(os.path.basename(entry))
  open(entry + ".count", "w").write(zero)
  assert cache.read_count(path, _storage.identity(path)) == 0  # a consistent edit: its own check passes
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    source = sources.JsonlSource(glob, cache=cache, corpus_index=False)
    dataset = ckpt_iter.make_dataset(source, batch_size=10, seed=1, shuffle=shuffle)
    ids = sorted(i for batch in dataset for i in batch["id"].tolist())
  assert len(source) == 300 and ids == sorted(part * 1000 + n for part in range(3) for n in range(100))
  assert "not bound to it" in caplog.text and cache.read_count(path, _storage.identity(path)) == 100


def test_a_file_of_blank_lines_counted_zero_reads_as_zero(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [4, 0, 5])  # the middle file: blank lines only
  _index(glob)
  source = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  assert source.file_offsets() == [0, 4, 4, 9]


def test_an_index_written_again_is_replaced_whole_for_a_reader_meanwhile(tmp_path, monkeypatch):
  # It was written in place (truncate, then write): 16 of 153 builds during a re-index were refused as
  # garbled, and an index killed mid-write refused every later build.
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  _index(glob)
  directory = str(tmp_path / "data")
  before = _corpus_index.read(directory)
  stop, seen = threading.Event(), []

  def read_meanwhile():
    while not stop.is_set():
      try:
        seen.append(_corpus_index.read(directory))
      except errors.InvalidStateError as e:
        seen.append(e)

  reader = threading.Thread(target=read_meanwhile)
  reader.start()
  try:
    for _ in range(30):
      _index(glob)
  finally:
    stop.set()
    reader.join()
  assert seen and all(entry == before for entry in seen), [s for s in seen if s != before][:1]
  # A write that fails midway leaves the index as it was.
  real_write = os.write
  monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:10])) if len(data) > 10 else
                      (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
  with pytest.raises(OSError):
    _corpus_index.write([p for p in sorted(glob_lib.glob(glob))], [_storage.identity(p) for p in
                                                                  sorted(glob_lib.glob(glob))], [5, 6])
  monkeypatch.undo()
  assert _corpus_index.read(directory) == before
  assert not [n for n in os.listdir(directory) if ".tmp-" in n]


def test_an_index_nested_past_the_parser_is_the_documented_refusal(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [3])
  (tmp_path / "data" / _corpus_index.INDEX_NAME).write_bytes(b"[" * 200_000 + b"]" * 200_000)
  with pytest.raises(errors.InvalidStateError, match=r"ckpt_iter_index.json: not a ckpt_iter corpus index \(nested "
                     r"deeper .*Index the corpus again \(ckpt-iter index .*data\)"):
    sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))


def test_the_index_verb_takes_a_directory_as_its_refusals_say(tmp_path):
  # The stale-index refusal suggests `ckpt-iter index <directory>`: it runs, indexing every JSONL file there.
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  out = _index(str(tmp_path / "data"))
  assert "indexed 2 files, 11 records" in out
  assert sorted(_corpus_index.read(str(tmp_path / "data"))) == ["part-0.jsonl", "part-1.jsonl"]
  assert len(sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8))) == 11
  (tmp_path / "empty").mkdir()
  code, out = support.cli_output("index", str(tmp_path / "empty"))
  assert code == 1 and "a directory holding no file an index covers" in out


def test_a_warm_restart_keeps_the_index_counts_and_reads_no_index(tmp_path, monkeypatch):
  # issue 65 item 7: a restart's build read the index object again (1 of the 4 requests of restore + build);
  # the counts it gave are kept in the host's cache, bound to each file's version, as a footer is.
  glob = _corpus(str(tmp_path / "data"), [5, 6, 0])
  _index(glob)
  first = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
  with monkeypatch.context() as patched:
    patched.setattr(_corpus_index, "read", lambda directory: 1 / 0)
    again = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
    assert again.file_offsets() == first.file_offsets() == [0, 5, 11, 11]
    assert [again[i] for i in range(11)] == [first[i] for i in range(11)]


def test_a_kept_index_count_that_lies_is_replaced_by_the_copys_after_the_refusal(tmp_path):
  glob = _corpus(str(tmp_path / "data"), [5, 6])
  _index(glob)
  _rewrite(tmp_path, lambda value: value["files"]["part-1.jsonl"].update(records=4))
  source = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
  with pytest.raises(errors.InvalidStateError, match=r"holds 6 records, this source was built counting 4 \(the count "
                     r"of .*ckpt_iter_index.json, which is wrong for it"):
    source[5]
  _rewrite(tmp_path, lambda value: value["files"]["part-1.jsonl"].update(records=4))  # the index still lies
  rebuilt = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8), prefetch_files=0)
  assert len(rebuilt) == 11 and rebuilt[10] == {"id": 1005}  # the copy's count, kept after the refusal
