"""The shard cache's own bookkeeping against the number of files it holds (issue 65, items 1 and 2).

A cache holding N local JSONL files (10, 1,000 and 20,000; one record of ~100 bytes each, so the data is
no cost): the CPU of one `make_room` call (what every download, every window released and every copy
closed past max_open_files calls), against one listing and stat of the directory (what it did at each
call before: `ShardCache.entries`); and the CPU per record of a global shuffle read through the cache once
every file is cached, against the same records read from local disk without a cache, at 10 and 1,000 files
(the default, which keeps every file open when the cache holds them all, and 16 open, 0.3.0's default),
the three read in turn in rounds. And per file format (JSONL, Parquet, ArrayRecord; 100 files of 100
records, Parquet in row groups of 10), the CPU per record of a global shuffle from local disk and through a
warm cache, paired in rounds (issue 65 item 5): Parquet both with its decoded row groups kept (the default)
and with none kept, so that every record reads its row group again (the read path itself).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import _common

import ckpt_iter
from ckpt_iter import sources

FILES = (10, 1_000, 20_000)
SHUFFLE_FILES = (10, 1_000)
RECORDS_PER_FILE = 100  # for the shuffle: 1,000 or 100,000 records


def _corpus(directory: str, files: int, records: int) -> list[str]:
  os.makedirs(directory, exist_ok=True)
  paths = []
  for number in range(files):
    path = os.path.join(directory, f"part-{number:05d}.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps({"id": number * records + i, "text": "t" * 80}) + "\n" for i in range(records))
    paths.append(path)
  return paths


def _cpu_us(call, repeats: int) -> float:
  started = time.process_time()
  for _ in range(repeats):
    call()
  return (time.process_time() - started) / repeats * 1e6


def make_room_cost(workdir: str, files: int, rounds: int) -> dict:
  paths = _corpus(os.path.join(workdir, f"store-{files}"), files, 1)
  directory = os.path.join(workdir, f"cache-{files}")
  started = time.process_time()
  source = sources.JsonlSource(paths, cache=sources.ShardCache(directory, 10**12), prefetch_files=0)
  cold_build = time.process_time() - started
  cache = source.cache
  assert len(cache.entries()) == files
  now, listing = [], []
  for _ in range(rounds):
    now.append(_cpu_us(lambda: cache.make_room(0), 200))
    listing.append(_cpu_us(lambda: sorted(cache.entries(), key=lambda e: e[2]), max(1, 2_000 // files)))
  return {"files": files, "make_room_us": _common.rounded(statistics.median(now)),
          "listing_us": _common.rounded(statistics.median(listing)),
          "cold_build_s": _common.rounded(cold_build),
          "cold_build_ms_per_file": _common.rounded(cold_build / files * 1e3)}


def shuffle_cost(workdir: str, files: int, rounds: int, reads: int) -> dict:
  paths = _corpus(os.path.join(workdir, f"shuffle-{files}"), files, RECORDS_PER_FILE)
  cache_dir = os.path.join(workdir, f"shuffle-cache-{files}")
  sources.JsonlSource(paths, cache=sources.ShardCache(cache_dir, 10**12))  # every file cached: a warm cache
  datasets = {
      "local": ckpt_iter.make_dataset(sources.JsonlSource(paths, index_cache_dir=""), batch_size=1, seed=0),
      # The default: every file kept open, as the cache holds them all.
      "cached": ckpt_iter.make_dataset(
          sources.JsonlSource(paths, cache=sources.ShardCache(cache_dir, 10**12)), batch_size=1, seed=0),
      # 16 copies open (0.3.0's default, and a cache that cannot hold every file): re-opens.
      "cached_16_open": ckpt_iter.make_dataset(
          sources.JsonlSource(paths, cache=sources.ShardCache(cache_dir, 10**12), max_open_files=16),
          batch_size=1, seed=0),
  }
  length = len(datasets["local"])
  for dataset in datasets.values():  # each copy opened once (its seal checked, its index read): the steady state
    for index in range(length):
      dataset[index]
  times: dict[str, list[float]] = {kind: [] for kind in datasets}
  for number in range(rounds):
    for kind, dataset in (datasets.items() if number % 2 else reversed(datasets.items())):
      start = (number * reads) % length
      times[kind].append(_read_us(dataset, start, reads, length))
  local = statistics.median(times["local"])
  ratios = {kind: statistics.median([cached / local for cached, local in zip(times[kind], times["local"])])
            for kind in ("cached", "cached_16_open")}
  return {"files": files, "records": length, "local_us": _common.rounded(local),
          "cached_us": _common.rounded(statistics.median(times["cached"])),
          "cached_16_open_us": _common.rounded(statistics.median(times["cached_16_open"])),
          "local_over_cached": _common.rounded(1 / ratios["cached"], 3),
          "local_over_cached_16_open": _common.rounded(1 / ratios["cached_16_open"], 3)}


FORMAT_FILES, FORMAT_RECORDS, FORMAT_GROUP_ROWS = 100, 100, 10


def _format_corpus(directory: str, kind: str) -> list[str]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  os.makedirs(directory, exist_ok=True)
  paths = []
  for number in range(FORMAT_FILES):
    records = [{"id": number * FORMAT_RECORDS + i, "text": "t" * 80} for i in range(FORMAT_RECORDS)]
    path = os.path.join(directory, f"part-{number:05d}.{kind}")
    if kind == "jsonl":
      with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    elif kind == "parquet":
      pq.write_table(pa.Table.from_pylist(records), path, row_group_size=FORMAT_GROUP_ROWS)
    else:
      writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
      for record in records:
        writer.write(json.dumps(record).encode())
      writer.close()
    paths.append(path)
  return paths


def formats_cost(workdir: str, rounds: int, reads: int) -> list[dict]:
  """CPU per record of a global shuffle, local disk against a warm cache, per format, paired in rounds."""
  cases = {
      "JSONL": ("jsonl", lambda p, c: sources.JsonlSource(p, cache=c, index_cache_dir="")),
      "Parquet": ("parquet", lambda p, c: sources.ParquetSource(p, cache=c, max_open_files=FORMAT_FILES)),
      "Parquet, no decoded group kept": ("parquet", lambda p, c: sources.ParquetSource(
          p, cache=c, decoded_bytes=0, max_open_files=FORMAT_FILES)),
      "ArrayRecord": ("array_record", lambda p, c: sources.ArrayRecordSource(p, cache=c, max_open_files=FORMAT_FILES)),
  }
  rows = []
  for name, (kind, make) in cases.items():
    paths = _format_corpus(os.path.join(workdir, f"formats-{kind}"), kind)
    cache_dir = os.path.join(workdir, f"formats-cache-{name}")
    datasets = {"local": ckpt_iter.make_dataset(make(paths, None), batch_size=1, seed=0),
                "cached": ckpt_iter.make_dataset(make(paths, sources.ShardCache(cache_dir, 10**12)), batch_size=1,
                                                 seed=0)}
    length = len(datasets["local"])
    for dataset in datasets.values():  # every copy downloaded and opened once: the steady state
      for index in range(length):
        dataset[index]
    times: dict[str, list[float]] = {kind: [] for kind in datasets}
    for number in range(rounds):
      for which, dataset in (datasets.items() if number % 2 else reversed(datasets.items())):
        times[which].append(_read_us(dataset, (number * reads) % length, reads, length))
    ratios = [cached / local for cached, local in zip(times["cached"], times["local"])]
    rows.append({"format": name, "local_us": _common.rounded(statistics.median(times["local"])),
                 "cached_us": _common.rounded(statistics.median(times["cached"])),
                 "cached_over_local": _common.rounded(statistics.median(ratios), 3),
                 "spread": _common.rounded(max(ratios) - min(ratios), 3)})
  return rows


def _read_us(dataset, start: int, reads: int, length: int) -> float:
  started = time.process_time()
  for index in range(start, start + reads):
    dataset[index % length]
  return (time.process_time() - started) / reads * 1e6


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("cache_bookkeeping", args.quick)
  rounds = 3 if args.quick else 7
  checks = []
  with tempfile.TemporaryDirectory() as workdir:
    costs = []
    for files in (FILES[:2] if args.quick else FILES):
      row = make_room_cost(workdir, files, rounds)
      reporter.measurement(part="make_room", **row)
      costs.append(row)
    checks.append(_common.check(
        f"make_room at {costs[-1]['files']:,} cached files / at 10, CPU per call", _common.rounded(
            costs[-1]["make_room_us"] / costs[0]["make_room_us"], 3), "<= 1.5 (flat in files)",
        costs[-1]["make_room_us"] <= 1.5 * costs[0]["make_room_us"],
        listing_ms_then=_common.rounded(costs[-1]["listing_us"] / 1e3)))
    shuffles = []
    for files in SHUFFLE_FILES:
      row = shuffle_cost(workdir, files, rounds, 1_000 if args.quick else 4_000)
      reporter.measurement(part="global_shuffle", **row)
      shuffles.append(row)
    checks.append(_common.check(
        "a warm cache under a global shuffle, 1,000 files, default settings: local disk's CPU per record / the "
        "cache's", shuffles[-1]["local_over_cached"], ">= 0.9", shuffles[-1]["local_over_cached"] >= 0.9,
        with_16_open=shuffles[-1]["local_over_cached_16_open"]))
    checks.append(_common.check(
        "CPU per record through the cache, 1,000 files / 10 files (default settings)", _common.rounded(
            shuffles[-1]["cached_us"] / shuffles[0]["cached_us"], 3), "<= 1.5",
        shuffles[-1]["cached_us"] <= 1.5 * shuffles[0]["cached_us"]))
    for row in formats_cost(workdir, rounds, 1_000 if args.quick else FORMAT_FILES * FORMAT_RECORDS):
      reporter.measurement(part="formats", **row)
      checks.append(_common.check(
          f"a warm cache under a global shuffle, {row['format']}: CPU per record through the cache / from local "
          "disk", row["cached_over_local"], "<= 1.1", row["cached_over_local"] <= 1.1, spread=row["spread"]))
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
