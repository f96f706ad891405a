"""A new host's first build of a bucket corpus, and a warm restart: bytes, seconds and requests.

The bucket is the tests' GCS emulator (tests/gcs_emulator.py) behind their
proxy (tests/fault_proxy.py) adding 20 ms to every request, as a round trip
to a real bucket costs. Corpus: 60,000 records of ~1 KB in 48 JSONL files and
the same records in 48 Parquet files (row groups of 250) and 48 ArrayRecord files; --quick: 12 files.

Each case builds a source through a `ShardCache` on a host of its own (an
empty cache directory) and reports what the build cost: wall seconds, the
bytes it downloaded (the copies in the cache afterwards) as a share of the
corpus, the bytes the store served (every response body, footers and
listings included: the proxy's count) and the store's requests by kind (the
emulator's log):

  JSONL, no index     `JsonlSource(glob, cache=...)`: counts every file's
                      lines by downloading it.
  JSONL, index        the same after `ckpt-iter index glob` (its own time
                      reported): one GET of ckpt_iter_index.json.
  JSONL, index, list  the 48 paths as a list, not a glob: one listing of
                      their directory describes them (issue 65 item 4).
  JSONL, warm         the host of "JSONL, index" building again (a restart).
  JSONL, files from index  `JsonlSource(glob, cache=..., files_from_index=True)`
                      on a new host: the files and their versions named by the
                      index, no listing; ", again" the same host restarting.
  Parquet             `ParquetSource(glob, cache=...)`: the footers only.
  Parquet, index      the same after `ckpt-iter index` of the Parquet files: the
                      index holds each file's row groups (issue 65 item 3).
  Parquet, warm       the host of "Parquet, index" building again: the cache kept
                      what each footer said.
  Parquet, files from index  a new host naming the files from the index, and
                      ", again" that host restarting (issue 65 item 7).
  ArrayRecord         `ArrayRecordSource(glob, cache=...)`: the footers only, read by
                      array_record's own reader (its requests bypass the emulator's
                      log of gcsfs's: counted by the proxy). ", index", ", warm"
                      and ", files from index" (", again") as for Parquet.
  Mosaic Streaming    the same records as 48 MDS shards: `StreamingDataset(remote,
                      local)` built on an empty local directory (its index.json),
                      and again on the same directory (a restart), where
                      `streaming` imports (benchmarks/_bucket_mosaic.py); the
                      bytes are its local directory's.

Run against an older checkout (PYTHONPATH=that checkout) it measures the same
cases that exist there; the index cases are left out where `ckpt-iter index`
does not exist.
    python benchmarks/corpus_start.py [--quick]
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import _bucket_mosaic
import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import fault_proxy  # pylint: disable=g-import-not-at-top,wrong-import-position
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

DELAY_SECONDS = 0.020
RECORDS = 60_000
GROUP_ROWS = 250


def corpus(files: int) -> list[list[dict]]:
  per_file = RECORDS // files
  return [[{"id": part * per_file + i, "text": hashlib.sha256(str(part * per_file + i).encode()).hexdigest() * 15}
           for i in range(per_file)] for part in range(files)]


def upload(prefix: str, parts: list[list[dict]], work: str) -> dict[str, tuple[str, int]]:
  """Writes the JSONL, Parquet and ArrayRecord files; returns {format: (glob, bytes)}."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  sizes = {"jsonl": 0, "parquet": 0, "array_record": 0}
  for part, records in enumerate(parts):
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buffer, row_group_size=GROUP_ROWS)
    local = os.path.join(work, f"part-{part:03d}.array_record")
    writer = array_record_module.ArrayRecordWriter(local, "group_size:1")
    for record in records:
      writer.write(json.dumps(record).encode())
    writer.close()
    with open(local, "rb") as f:
      packed = f.read()
    for kind, data in (("jsonl", text), ("parquet", buffer.getvalue()), ("array_record", packed)):
      _storage.write_bytes(f"{prefix}/{kind}/part-{part:03d}.{kind}", data)
      sizes[kind] += len(data)
  return {kind: (f"{prefix}/{kind}/part-*.{kind}", size) for kind, size in sizes.items()}


def build(emulator, proxy, make, cache_dir: str, corpus_bytes: int) -> dict:
  """Builds one source on the host whose cache is `cache_dir`; what it cost."""
  held = lambda cache: sum(size for _, size, _ in cache.entries())  # pylint: disable=unnecessary-lambda-assignment
  cache = sources.ShardCache(cache_dir, 2**34)
  before = held(cache)
  mark, count, served = emulator.mark(), proxy.count, proxy.served_bytes
  started = time.perf_counter()
  source = make(cache)
  seconds = time.perf_counter() - started
  cache.wait()
  served = proxy.served_bytes - served
  downloaded = held(cache) - before  # the copies this build added (with a JSONL copy's line index)
  kinds = gcs_emulator.count_by_kind(emulator.requests(mark))
  return {"records": len(source), "seconds": _common.rounded(seconds), "bytes": downloaded,
          "share_of_corpus": _common.rounded(downloaded / corpus_bytes), "requests": proxy.count - count,
          "served_bytes": served,
          **{f"{kind}_requests": n for kind, n in kinds.items() if n}}


def parts_lines(parts: list[list[dict]]) -> list[bytes]:
  return [json.dumps(r).encode() for records in parts for r in records]


def mosaic_cases(proxy, lines: list[bytes], prefix: str, work: str, jsonl_bytes: int, files: int,
                 report: _common.Reporter) -> dict[str, dict]:
  """Mosaic Streaming's first build and restart on the same records as `files` MDS shards; {} where it does
  not import."""
  missing = _bucket_mosaic.available()
  if missing is not None:
    report.note(f"Mosaic Streaming not measured: {missing}")
    return {}
  import streaming  # pylint: disable=g-import-not-at-top
  from streaming.base import util  # pylint: disable=g-import-not-at-top
  from streaming.base.storage import download  # pylint: disable=g-import-not-at-top

  download.GCSDownloader._create_gcs_client = _bucket_mosaic._anonymous_client  # pylint: disable=protected-access
  written = os.path.join(work, "mds")
  remote = f"{prefix}/mds"
  for name in _bucket_mosaic.write_shards(lines, written, max(1, jsonl_bytes // files)):
    with open(os.path.join(written, name), "rb") as f:
      _storage.write_bytes(f"{remote}/{name}", f.read())
  local = os.path.join(work, "mds_host")
  found = {}
  for name in ("Mosaic Streaming, new host", "Mosaic Streaming, warm"):
    util.clean_stale_shared_memory()
    count = proxy.count
    started = time.perf_counter()
    dataset = streaming.StreamingDataset(remote=remote, local=local, shuffle=True, shuffle_seed=7, batch_size=32)
    seconds = time.perf_counter() - started
    held = sum(os.path.getsize(os.path.join(local, n)) for n in os.listdir(local))
    found[name] = {"records": len(dataset), "seconds": _common.rounded(seconds), "bytes": held,
                   "share_of_corpus": _common.rounded(held / jsonl_bytes), "requests": proxy.count - count}
    del dataset
  return found


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("corpus_start", args.quick)
  files = 12 if args.quick else 48
  work = tempfile.mkdtemp(prefix="ckpt_iter_corpus_start_")
  has_index = os.path.exists(os.path.join(os.path.dirname(sources.__file__), "_corpus_index.py"))
  from_index = "files_from_index" in inspect.signature(sources.JsonlSource).parameters
  try:
    with gcs_emulator.GcsEmulator() as emulator:
      proxy = fault_proxy.FaultProxy(emulator.url, delay_seconds=DELAY_SECONDS).start()
      os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
      os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = proxy.url  # array_record's own reader
      parts = corpus(files)
      prefix = f"gs://{gcs_emulator.BUCKET}/start-{os.getpid()}"
      written = upload(prefix, parts, work)
      (jsonl, jsonl_bytes), (parquet, parquet_bytes) = written["jsonl"], written["parquet"]
      array_record, array_record_bytes = written["array_record"]
      paths = sorted(_storage.glob(jsonl))
      report.note(f"{files} files; JSONL {jsonl_bytes:,} bytes, Parquet {parquet_bytes:,} bytes, ArrayRecord "
                  f"{array_record_bytes:,} bytes; {DELAY_SECONDS * 1e3:.0f} ms a request")
      host = lambda name: os.path.join(work, name)  # pylint: disable=unnecessary-lambda-assignment
      cases: dict[str, dict] = {}
      cases["JSONL, no index"] = build(emulator, proxy, lambda c: sources.JsonlSource(jsonl, cache=c),
                                       host("no_index"), jsonl_bytes)
      if has_index:
        from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as said:
          code = cli.main(["index", jsonl, "--cache", host("indexing")])
        if code != 0:
          raise RuntimeError(f"ckpt-iter index failed: {said.getvalue()}")
        report.measurement(name="index", value=_common.rounded(time.perf_counter() - started), unit="s",
                           files=files)
        cases["JSONL, index"] = build(emulator, proxy, lambda c: sources.JsonlSource(jsonl, cache=c),
                                      host("index"), jsonl_bytes)
        cases["JSONL, index, list"] = build(emulator, proxy, lambda c: sources.JsonlSource(paths, cache=c),
                                            host("index_list"), jsonl_bytes)
        cases["JSONL, warm"] = build(emulator, proxy, lambda c: sources.JsonlSource(jsonl, cache=c),
                                     host("index"), jsonl_bytes)
        for case in ("", ", again") if from_index else ():
          cases[f"JSONL, files from index{case}"] = build(
              emulator, proxy, lambda c: sources.JsonlSource(jsonl, cache=c, files_from_index=True),
              host("from_index"), jsonl_bytes)
      else:
        cases["JSONL, warm"] = build(emulator, proxy, lambda c: sources.JsonlSource(jsonl, cache=c),
                                     host("no_index"), jsonl_bytes)
      for kind, glob, size, make in (("Parquet", parquet, parquet_bytes, sources.ParquetSource),
                                     ("ArrayRecord", array_record, array_record_bytes, sources.ArrayRecordSource)):
        cases[kind] = build(emulator, proxy, lambda c, m=make, g=glob: m(g, cache=c), host(kind), size)
        if has_index:
          with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["index", glob, "--cache", host(f"indexing {kind}")])
          if code != 0:
            raise RuntimeError(f"ckpt-iter index {glob} failed")
          for case in ("index", "warm"):  # a new host over the index; the same host again
            cases[f"{kind}, {case}"] = build(emulator, proxy, lambda c, m=make, g=glob: m(g, cache=c),
                                             host(f"{kind} index"), size)
          for case in ("", ", again") if from_index else ():
            cases[f"{kind}, files from index{case}"] = build(
                emulator, proxy, lambda c, m=make, g=glob: m(g, cache=c, files_from_index=True),
                host(f"{kind} from index"), size)
      cases.update(mosaic_cases(proxy, parts_lines(parts), prefix, work, jsonl_bytes, files, report))
      for name, figures in cases.items():
        report.measurement(name=name, value=figures["seconds"], unit="s", **figures)
      proxy.stop()
  finally:
    shutil.rmtree(work, ignore_errors=True)
  checks = []
  if "JSONL, index" in cases:
    checks.append(_common.check("new host, JSONL with its index: share of the corpus downloaded",
                                cases["JSONL, index"]["share_of_corpus"], "<= 0.05",
                                cases["JSONL, index"]["share_of_corpus"] <= 0.05))
  checks.append(_common.check("new host, Parquet: share of the corpus downloaded", cases["Parquet"]["share_of_corpus"],
                              "<= 0.05", cases["Parquet"]["share_of_corpus"] <= 0.05))
  checks.append(_common.check("new host, ArrayRecord: share of the corpus downloaded",
                              cases["ArrayRecord"]["share_of_corpus"], "<= 0.05",
                              cases["ArrayRecord"]["share_of_corpus"] <= 0.05))
  for kind in ("JSONL", "Parquet", "ArrayRecord"):
    warm = cases.get(f"{kind}, warm")
    if warm is not None:
      checks.append(_common.check(f"warm restart, {kind}: requests", warm["requests"], "<= 4",
                                  warm["requests"] <= 4, served_bytes=warm["served_bytes"]))
  for kind in ("JSONL", "Parquet", "ArrayRecord"):
    for case in (", files from index", ", files from index, again"):
      named = cases.get(kind + case)
      if named is not None:
        what = "new host" if case.endswith("index") else "warm restart"
        checks.append(_common.check(f"{what}, {kind}, files named by the index: requests (0 listings)",
                                    named["requests"], "<= 1",
                                    named["requests"] <= 1 and not named.get("list_requests"),
                                    reads=named.get("read_requests", 0), served_bytes=named["served_bytes"]))
  for kind in ("Parquet", "ArrayRecord"):
    if f"{kind}, index" in cases:
      cold, indexed = cases[kind], cases[f"{kind}, index"]
      checks.append(_common.check(f"new host, {kind}: bytes served with the index / with the footers",
                                  _common.rounded(indexed["served_bytes"] / cold["served_bytes"]), "<= 0.5",
                                  indexed["served_bytes"] <= 0.5 * cold["served_bytes"],
                                  requests=f"{indexed['requests']} against {cold['requests']}"))
  report.summary(checks)


if __name__ == "__main__":
  main()
