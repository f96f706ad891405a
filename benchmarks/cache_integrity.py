"""Q23: what vouching for the shard cache's bytes costs, and a host's processes sharing a small cache.

Part 1, the checks (issue 57 items 1-3): JSONL files of 4 and 64 MB, copied into a `ShardCache`.
In the same run, per file (medians of interleaved rounds, the file in the page cache):

  seal        the CRC-32 a process compares a copy with when it first opens it (`_checksums.seal_of`);
  crc32c      the store's checksum over the same bytes, as a download computes it (google-crc32c);
  md5         the fallback where a store gives no crc32c;
  first open  `ShardCache.open` by a process that has not checked the copy (the seal check included);
  next open   the same process again (the copy unchanged since: no check);
  read        reading every record of the file through a cached `JsonlSource` (the work vouched for).

Part 2, sharing (items 4-5): P processes of one host in step (a barrier per batch, as a training
step's collective) read 48 JSONL files through one cache of a quarter of the corpus,
make_dataset(shuffle="shards", shuffle_window=4), 3 epochs: downloads per file and epoch, and the
most bytes of copies no process held (against max_bytes) and in all.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time

import _common
import google_crc32c

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import cache_probe  # pylint: disable=g-import-not-at-top,wrong-import-position

from ckpt_iter import _checksums
from ckpt_iter import sources

SIZES_MB = (4, 64)
ROUNDS = 5


def write_jsonl(path: str, megabytes: int) -> None:
  line_number = 0
  with open(path, "w") as f:
    written = 0
    while written < megabytes * 2**20:
      line = json.dumps({"id": line_number, "text": "lorem ipsum dolor " * (2 + line_number % 9)}) + "\n"
      f.write(line)
      written += len(line)
      line_number += 1


def _timed(fn) -> float:
  started = time.perf_counter()
  fn()
  return time.perf_counter() - started


def checks_part(reporter, directory: str, quick: bool) -> list[dict]:
  checks = []
  for megabytes in (SIZES_MB[:1] if quick else SIZES_MB):
    path = os.path.join(directory, f"corpus-{megabytes}.jsonl")
    write_jsonl(path, megabytes)
    cache_dir = os.path.join(directory, f"cache-{megabytes}")
    source = sources.JsonlSource([path], cache=sources.ShardCache(cache_dir, 2**34))
    entry = source.cache.entry_path(path, source.identities()[0])
    data = open(entry, "rb").read()
    size = len(data)
    times: dict[str, list[float]] = {k: [] for k in ("seal", "crc32c", "md5", "first_open", "next_open", "read")}
    for _ in range(1 if quick else ROUNDS):
      fd = os.open(entry, os.O_RDONLY)
      times["seal"].append(_timed(lambda: _checksums.seal_of(fd, size)))
      os.close(fd)
      times["crc32c"].append(_timed(lambda: google_crc32c.value(data)))
      times["md5"].append(_timed(lambda: hashlib.md5(data).digest()))
      fresh = sources.ShardCache(cache_dir, 2**34)  # another process, as it were: nothing checked yet
      times["first_open"].append(_timed(lambda: os.close(fresh.open(path))))
      times["next_open"].append(_timed(lambda: os.close(fresh.open(path))))
      reader = sources.JsonlSource([path], cache=fresh)
      times["read"].append(_timed(lambda: [reader[i] for i in range(len(reader))]))
    median = {k: _common.median(v) for k, v in times.items()}
    reporter.measurement(part="checks", megabytes=round(size / 2**20, 1), records=len(source),
                         **{f"{k}_ms": _common.rounded(v * 1000) for k, v in median.items()},
                         seal_over_read=_common.rounded(median["seal"] / median["read"], 4),
                         first_open_over_read=_common.rounded(median["first_open"] / median["read"], 4))
    checks.append(_common.check(
        f"{megabytes} MB file: the first open's check, over reading its records",
        _common.rounded(median["first_open"] / median["read"], 4), "<= 0.05",
        median["first_open"] / median["read"] <= 0.05, seal_gb_per_s=_common.rounded(size / median["seal"] / 1e9, 3)))
  return checks


def _host_process(index, config, barrier, queue):
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top

  downloads = []
  real = _shard_cache.ShardCache._download

  def counted(self, path, found, entry):
    downloads.append(os.path.basename(path))
    return real(self, path, found, entry)

  _shard_cache.ShardCache._download = counted
  source = sources.JsonlSource(config["paths"], cache=sources.ShardCache(config["cache"], config["max_bytes"]))
  dataset = ckpt_iter.make_dataset(source, batch_size=8, seed=0, shuffle="shards", shuffle_window=config["window"],
                                   shard_index=index, shard_count=config["processes"], num_epochs=config["epochs"])
  downloads.clear()  # the build's own: the counts are warm (a restart, or the corpus's second epoch on)
  open(os.path.join(config["flags"], f"built-{index}"), "w").close()
  barrier.wait(600)
  records = 0
  for batch in dataset:
    records += len(batch["id"])
    barrier.wait(600)
  open(os.path.join(config["flags"], f"done-{index}"), "w").close()
  queue.put((records, downloads))


def sharing_part(reporter, directory: str, quick: bool) -> list[dict]:
  files, per_file, window, epochs = (16, 400, 2, 2) if quick else (48, 1250, 4, 3)
  data = os.path.join(directory, "shared")
  os.makedirs(data)
  paths = []
  for f in range(files):
    paths.append(os.path.join(data, f"part-{f:03d}.jsonl"))
    with open(paths[-1], "w") as out:
      out.writelines(json.dumps({"id": f * per_file + i, "text": "t" * (i % 50)}) + "\n" for i in range(per_file))
  corpus = sum(os.path.getsize(p) for p in paths)
  checks = []
  for processes in ((1, 4) if not quick else (2,)):
    cache = os.path.join(directory, f"shared-cache-{processes}")
    flags = os.path.join(directory, f"flags-{processes}")
    os.makedirs(flags)
    max_bytes = corpus // 4
    sources.JsonlSource(paths, cache=sources.ShardCache(cache, max_bytes))  # the line counts, warm
    config = {"paths": paths, "cache": cache, "max_bytes": max_bytes, "window": window, "processes": processes,
              "epochs": epochs, "flags": flags}
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(processes), context.Queue()
    peak = {"idle": 0, "all": 0}
    stop = threading.Event()

    def sample():
      while not stop.is_set():
        names = os.listdir(flags)
        if sum(n.startswith("built-") for n in names) < processes or any(n.startswith("done-") for n in names):
          time.sleep(0.005)
          continue
        total, idle = cache_probe.cache_bytes(cache)
        peak["idle"], peak["all"] = max(peak["idle"], idle), max(peak["all"], total)
        time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    workers = [context.Process(target=_host_process, args=(i, config, barrier, queue)) for i in range(processes)]
    for worker in workers:
      worker.start()
    results = [queue.get(timeout=1200) for _ in workers]
    for worker in workers:
      worker.join()
    stop.set()
    sampler.join()
    seconds = time.perf_counter() - started
    downloads = [d for _, ds in results for d in ds]
    records = sum(r for r, _ in results)
    per_file_epoch = len(downloads) / (files * epochs)
    reporter.measurement(part="sharing", processes=processes, files=files, epochs=epochs, window=window,
                         max_bytes=max_bytes, corpus_bytes=corpus, records=records, downloads=len(downloads),
                         downloads_per_file_epoch=_common.rounded(per_file_epoch, 3),
                         most_per_file=max(downloads.count(n) for n in set(downloads)),
                         idle_peak_over_limit=_common.rounded(peak["idle"] / max_bytes, 3),
                         all_peak_over_limit=_common.rounded(peak["all"] / max_bytes, 3),
                         seconds=_common.rounded(seconds, 3))
    checks.append(_common.check(
        f"{processes} process(es) sharing a quarter-corpus cache: downloads per file and epoch",
        _common.rounded(per_file_epoch, 3), "<= 1.05", per_file_epoch <= 1.05,
        idle_peak_over_limit=_common.rounded(peak["idle"] / max_bytes, 3)))
    shutil.rmtree(cache)
  return checks


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("cache_integrity", args.quick)
  with tempfile.TemporaryDirectory() as directory:
    checks = checks_part(reporter, directory, args.quick) + sharing_part(reporter, directory, args.quick)
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
