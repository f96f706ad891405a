"""gs:// JSONL through the local shard cache, against a real GCS emulator.

The cache must be invisible in what is read (the same batches as the same
files on local disk, the same source identity as without it), survive a
SIGKILL in the middle of a file (a fresh process resumes exactly, from the
cache), and cut the requests to about one per file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ckpt_iter
import gcs_emulator as gcs_emulator_lib
from ckpt_iter import _corpus_index
from ckpt_iter import _storage
from ckpt_iter import sources

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "bucket_cache_worker.py")
_FILES, _PER_FILE, _BATCH = 4, 500, 8


@pytest.fixture
def corpus(gcs_root, tmp_path):
  """4 JSONL files of 500 records each, on gs:// and on local disk; returns (gs glob, local paths)."""
  local = []
  for part in range(_FILES):
    data = "".join(json.dumps({"id": part * _PER_FILE + i, "text": "y" * (i % 37)}) + "\n"
                   for i in range(_PER_FILE)).encode()
    _storage.write_bytes(f"{gcs_root}/data/part-{part}.jsonl", data)
    path = tmp_path / "local" / f"part-{part}.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    local.append(str(path))
  return f"{gcs_root}/data/part-*.jsonl", local


def _ids(dataset) -> list[list[int]]:
  return [np.asarray(batch["id"]).tolist() for batch in dataset]


@pytest.mark.parametrize("seed", [None, 5])
def test_the_cache_reads_what_local_disk_reads_at_one_request_per_file(
    corpus, gcs_emulator, tmp_path, monkeypatch, seed):
  remote, local = corpus
  expected = _ids(ckpt_iter.make_dataset(local, batch_size=_BATCH, seed=seed))
  monkeypatch.setenv("CKPT_ITER_SHARD_CACHE_DIR", str(tmp_path / "cache"))
  mark = gcs_emulator.mark()
  dataset = ckpt_iter.make_dataset(remote, batch_size=_BATCH, seed=seed)
  assert _ids(dataset) == expected
  requests = gcs_emulator.requests(mark)
  reads = [r for r in requests if r.kind == "read"]
  # Each file once, and one look for the corpus index beside them (there is none: 404).
  assert sum(not r.name.endswith("ckpt_iter_index.json") for r in reads) == _FILES, reads[:8]
  assert [r.status for r in reads if r.name.endswith("ckpt_iter_index.json")] == [404], reads
  # Setup and reading together: the glob's listing describes every file (no metadata request per file).
  assert gcs_emulator_lib.count_by_kind(requests)["metadata"] == 0, requests
  assert len(requests) <= _FILES + 3, requests
  # A second pipeline on this host: metadata only, no read.
  mark = gcs_emulator.mark()
  assert _ids(ckpt_iter.make_dataset(remote, batch_size=_BATCH, seed=seed)) == expected
  assert sum(r.kind == "read" for r in gcs_emulator.requests(mark)) == 0


def test_the_identity_is_from_metadata_and_the_same_with_or_without_the_cache(corpus, tmp_path, gcs_emulator):
  remote, _ = corpus
  mark = gcs_emulator.mark()
  plain, identity = sources.resolve_source(remote)
  # Each file read once, to index its lines (under 1 MiB: not in the index cache); none of
  # the 65 record reads a sampled digest made.
  assert sum(r.kind == "read" for r in gcs_emulator.requests(mark)) == _FILES
  cached = sources.JsonlSource(remote, cache=sources.ShardCache(tmp_path / "cache", 2**30))
  assert sources.resolve_source(cached)[1] == identity
  assert [cached[i] for i in (0, 999, 1999)] == [plain[i] for i in (0, 999, 1999)]
  # A rewritten object changes the identity.
  first = plain.paths[0]
  _storage.write_bytes(first, _storage.read_bytes(first, max_bytes=10**7))
  assert sources.resolve_source(remote)[1].digest != identity.digest


def _run(config: dict, tmp_path, name: str) -> subprocess.CompletedProcess:
  path = tmp_path / f"{name}.json"
  path.write_text(json.dumps(config))
  return subprocess.run([sys.executable, _WORKER, str(path)], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.parametrize("named", [False, True], ids=["listed", "restored_named_by_the_index"])
def test_a_process_killed_mid_file_resumes_exactly_from_the_cache(corpus, gcs_emulator, tmp_path, named):
  import support  # pylint: disable=g-import-not-at-top

  remote, local = corpus
  expected = _ids(ckpt_iter.make_dataset(local, batch_size=_BATCH, seed=None))
  if named:  # the killed run listed its files; the restored one names them from the index (issue 65 item 7)
    assert support.cli_output("index", remote, "--cache", str(tmp_path / "indexing"))[0] == 0
  config = {"source": remote, "cache_dir": str(tmp_path / "cache"), "root": str(tmp_path / "ckpt"),
            "seed": None, "save_step": 70, "kill_after": 5}  # record 560-600: inside file 1
  saved = _run(dict(config, mode="save", out=str(tmp_path / "save.jsonl")), tmp_path, "save")
  assert saved.returncode == -signal.SIGKILL, saved.stderr[-3000:]
  lines = [json.loads(line) for line in open(tmp_path / "save.jsonl")]
  assert lines == expected[70:75]
  mark = gcs_emulator.mark()
  restored = _run(dict(config, mode="restore", files_from_index=named, out=str(tmp_path / "restore.jsonl")),
                  tmp_path, "restore")
  assert restored.returncode == 0, restored.stderr[-3000:]
  lines = [json.loads(line) for line in open(tmp_path / "restore.jsonl")]
  assert lines[0] == {"restored": 70} and lines[1:] == expected[70:]
  # The files the killed process had read come from the cache.
  requests = gcs_emulator.requests(mark)
  reads = [r.name for r in requests if r.kind == "read"]
  assert not any(name.endswith(("part-0.jsonl", "part-1.jsonl")) for name in reads), reads
  assert gcs_emulator_lib.count_by_kind(requests)["list"] == (0 if named else 1), requests


_FETCH = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from ckpt_iter import _storage, sources
calls = []
real = _storage.download
def slow(*args):
  calls.append(1)
  time.sleep(0.3)
  return real(*args)
_storage.download = slow
open(os.path.join({ready!r}, str(os.getpid())), "w").close()
while not os.path.exists({go!r}):
  time.sleep(0.005)
entry = sources.ShardCache({cache!r}, 10**7).fetch({path!r})
print(json.dumps([len(calls), open(entry, "rb").read() == open({path!r}, "rb").read()]))
"""


def test_two_processes_download_a_file_once(tmp_path):
  path = tmp_path / "part-0.jsonl"
  path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(100)))
  (tmp_path / "ready").mkdir()
  code = _FETCH.format(repo=os.path.dirname(os.path.dirname(_HERE)), go=str(tmp_path / "go"),
                       ready=str(tmp_path / "ready"), cache=str(tmp_path / "cache"), path=str(path))
  workers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
  deadline = time.monotonic() + 120
  while len(os.listdir(tmp_path / "ready")) < 2 and time.monotonic() < deadline:  # both waiting to fetch
    time.sleep(0.01)
  (tmp_path / "go").touch()  # both fetch at once; a download takes 0.3 s: the second waits on the lock
  results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
  assert sorted(calls for calls, _ in results) == [0, 1] and all(same for _, same in results)


def test_a_new_host_builds_from_the_corpus_index_without_reading_a_file(corpus, gcs_emulator, tmp_path):
  # issue 59 item 1: a new host's first build downloaded every file to count its lines.
  import support  # pylint: disable=g-import-not-at-top

  remote, local = corpus
  code, out = support.cli_output("index", remote, "--cache", str(tmp_path / "indexing"))
  assert code == 0 and f"indexed {_FILES} files, {_FILES * _PER_FILE:,} records" in out, out
  mark = gcs_emulator.mark()
  source = sources.JsonlSource(remote, cache=sources.ShardCache(tmp_path / "new_host", 10**8), prefetch_files=0)
  reads = [r.name for r in gcs_emulator.requests(mark) if r.kind == "read"]
  assert reads == [remote.split("/", 3)[3].rsplit("/", 1)[0] + "/ckpt_iter_index.json"], reads
  assert len(source) == _FILES * _PER_FILE
  expected = [record for path in local for record in map(json.loads, open(path))]
  assert [source[i] for i in range(len(source))] == expected
  # Written again under the index: the build is refused, naming the object, not trained from its old count.
  _storage.write_bytes(remote.replace("*", "2"), b'{"id": 1}\n')
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"part-2.jsonl: .*counted it at size .*changed since"):
    sources.JsonlSource(remote, cache=sources.ShardCache(tmp_path / "third_host", 10**8))


def test_a_list_of_paths_asks_one_listing_not_each_objects_metadata(corpus, gcs_emulator, tmp_path, monkeypatch):
  # issue 65 item 4: a list of paths cost about 4 requests a file at every start (gcsfs's stat lists the name as
  # a prefix too): 193 requests for 48 files. One listing of their directory says every one.
  remote, local = corpus
  paths = [remote.replace("part-*.jsonl", f"part-{part}.jsonl") for part in range(_FILES)]
  expected = _ids(ckpt_iter.make_dataset(local, batch_size=_BATCH, seed=3))
  monkeypatch.setenv("CKPT_ITER_SHARD_CACHE_DIR", str(tmp_path / "cache"))
  assert _ids(ckpt_iter.make_dataset(paths, batch_size=_BATCH, seed=3)) == expected  # the copies cached
  mark = gcs_emulator.mark()
  source = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "cache", 10**8))
  assert [found.size for found in source.identities()] == [os.path.getsize(p) for p in local]
  requests = gcs_emulator.requests(mark)
  assert gcs_emulator_lib.count_by_kind(requests)["metadata"] == 0 and len(requests) <= 2, requests
  # The listing asks for the names the paths share, not the whole directory: a store lists a directory's
  # subdirectories whole, a page a thousand objects (41 pages where the glob asked 21 in
  # benchmarks/worked_case.py, with 20,481 MDS objects in a subdirectory beside 20,480 files).
  prefix = remote.split("/", 3)[3].replace("part-*.jsonl", "part-")
  assert {r.name for r in requests if r.kind == "list"} == {prefix}, requests
  # A path the listing does not hold is still refused by name.
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="part-9.jsonl"):
    sources.JsonlSource(paths + [paths[0].replace("part-0", "part-9")], cache=sources.ShardCache(tmp_path / "c", 10**8))


@pytest.mark.parametrize("kind", ["parquet", "array_record"])
def test_a_new_host_over_indexed_footers_reads_the_index_and_a_warm_restart_reads_nothing(gcs_root, gcs_emulator,
                                                                                           tmp_path, kind):
  # issue 65 item 3: every start read every Parquet and ArrayRecord footer again, warm restarts included (about
  # 64 KiB and 1 MiB a file). Now a new host over an indexed corpus reads the index, and a warm restart reads no
  # object at all: its listing says the files are unchanged, the cache what their footers said.
  import support  # pylint: disable=g-import-not-at-top

  source_of = {"parquet": sources.ParquetSource, "array_record": sources.ArrayRecordSource}[kind]
  records = []
  for part in range(3):
    local = tmp_path / "local" / f"part-{part}.{kind}"
    local.parent.mkdir(exist_ok=True)
    part_records = [{"id": part * 100 + i} for i in range(10)]
    support.FILE_WRITERS[kind](local, part_records)
    _storage.write_bytes(f"{gcs_root}/data/part-{part}.{kind}", local.read_bytes())
    records += part_records
  remote = f"{gcs_root}/data/part-*.{kind}"
  code, out = support.cli_output("index", remote, "--cache", str(tmp_path / "indexing"))
  assert code == 0 and "indexed 3 files, 30 records" in out, out
  index_name = gcs_emulator_lib.object_name(f"{gcs_root}/data/{_corpus_index.INDEX_NAME}")
  mark = gcs_emulator.mark()
  new_host = source_of(remote, cache=sources.ShardCache(tmp_path / "host", 10**8), prefetch_files=0)
  requests = gcs_emulator.requests(mark)
  assert [r.name for r in requests if r.kind == "read"] == [index_name], requests
  assert len(requests) == 2 and len(new_host) == 30  # the glob's listing and the index
  mark = gcs_emulator.mark()
  warm = source_of(remote, cache=sources.ShardCache(tmp_path / "host", 10**8), prefetch_files=0)
  requests = gcs_emulator.requests(mark)
  assert gcs_emulator_lib.count_by_kind(requests) == {**dict.fromkeys(("read", "metadata", "write", "delete",
                                                                       "other"), 0), "list": 1}, requests
  assert [warm[i] for i in range(len(warm))] == records
