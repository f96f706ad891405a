"""docs/bucket.md's worked case at its shape: 20,480 objects read by one host of 256, against 48 files.

The worked case is a corpus of 20,480 JSONL files read by 256 hosts with
`shuffle="shards", shuffle_window=16, shard_lanes=256`. Here the same shape
with small objects, on the tests' GCS emulator (tests/gcs_emulator.py) behind
their proxy (tests/fault_proxy.py) adding 20 ms to every request after the
upload and the index (those without it): 204,800
records of ~100 bytes as 20,480 files of 10 records, and the same number of
records as 48 files (--quick: 2,048 files, 20,480 records). Both corpora are
indexed once (`ckpt-iter index`, timed). For each corpus:

  lane host        host 0 of 256 on an empty cache, `make_dataset(glob,
                   batch_size=4, shuffle="shards", shuffle_window=16,
                   shard_lanes=256, shard_index=0, shard_count=256)`: its
                   build (wall seconds, CPU seconds, requests), its first
                   batch (wall), then the rest of its share of one epoch: CPU
                   per record, requests, bytes downloaded against corpus / 256.
  warm restart     the same host building again on its cache: requests by
                   kind; then its share read again from the cache (CPU per
                   record once the files are there).
  paired rounds    the two corpora against each other, in turn: the lane
                   host's share from the warm cache (a pipeline built afresh
                   each round, not timed) and the global shuffle's cached
                   reads; the median of the rounds' ratios and their spread
                   are the checks' figures.
  list of paths    the same build given the files as a list, not a glob.
  files from index the same build naming the files from the corpus index
                   (`files_from_index=True`), on a new host and on the warm
                   one: requests, wall and CPU seconds.
  global shuffle   one process, default settings (`make_dataset(glob,
                   batch_size=32)`), on a cache the index's pass filled (every
                   file cached): build, first batch, the CPU per record of
                   its first epoch (every copy opened once) and then
                   against the same files on local disk read in place, the
                   two read in turn in paired rounds (the median of the
                   rounds' ratios, and their spread).

With --mosaic-python PATH (a Python that imports mosaicml-streaming 0.13.0,
which cannot share this venv: docs/bucket.md), Mosaic Streaming on the same
records as MDS shards of the same count (10 records each; for the 48-file
corpus, 48 shards), uploaded beside them, each measurement a process of that
Python (benchmarks/_bucket_mosaic.py `share`), paired in turn with ckpt_iter's
own in the same rounds:

  mosaic node      node 0 of 256 (`num_canonical_nodes=256`, its default
                   shuffle, batch 4) reading its part of one epoch from its
                   warm cache (its first run, cold, fills it), against the
                   lane host's warm share;
  mosaic process   one process, default settings (batch 32), its first
                   MOSAIC_RECORDS records of an epoch from a cache holding
                   every shard, against the global shuffle's cached reads.

CPU per record both sides, the dataset built first (not timed): the node and
the lane host from their epoch's start (its partition or plan included), the
process and the global shuffle past it (Mosaic's after its first batch). Mosaic's node is
run alone, without the torch.distributed group its other 255 nodes would
join (it needs one only for barriers across the ranks of a pod).

The store requests of one process restoring its data state at 1 .. 16,384
processes are `benchmarks/restart_requests.py`'s.
Hand-run: its lines go to benchmarks/results_worked_case.jsonl.
    python benchmarks/worked_case.py [--quick] [--mosaic-python PATH] | tee benchmarks/results_worked_case.jsonl
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import itertools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import _common
import pod_share

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import fault_proxy  # pylint: disable=g-import-not-at-top,wrong-import-position
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

DELAY_SECONDS = 0.020
HOSTS, WINDOW, HOST_BATCH, SHUFFLE_BATCH, SEED = 256, 16, 4, 32, 7
SMALL_FILES = 48
MOSAIC_RECORDS = 4_096
_MOSAIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bucket_mosaic.py")


def files_of(records: int, files: int) -> list[bytes]:
  """`records` records of ~100 bytes as `files` JSONL files, ids in order."""
  per_file = -(-records // files)
  return ["".join(json.dumps({"id": i, "text": f"{i:08d}" * 10}) + "\n"
                  for i in range(part * per_file, min(records, (part + 1) * per_file))).encode()
          for part in range(files)]


def upload_local(local: str, files: list[bytes]) -> tuple[str, list[str]]:
  """The files on local disk; (glob, paths)."""
  os.makedirs(local, exist_ok=True)
  paths = []
  for part, data in enumerate(files):
    path = os.path.join(local, f"part-{part:05d}.jsonl")
    with open(path, "wb") as f:
      f.write(data)
    paths.append(path)
  return os.path.join(local, "part-*.jsonl"), paths


def upload(prefix: str, local: str, files: list[bytes]) -> tuple[str, list[str]]:
  """The files on the bucket (16 uploads at once) and on local disk; (gs glob, local paths)."""
  _, paths = upload_local(local, files)
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda part: _storage.write_bytes(f"{prefix}/part-{part:05d}.jsonl", files[part]),
                  range(len(files))))
  return f"{prefix}/part-*.jsonl", paths


def _lane_dataset(source):
  return ckpt_iter.make_dataset(source, batch_size=HOST_BATCH, seed=SEED, num_epochs=1, shard_index=0,
                                shard_count=HOSTS, shuffle="shards", shuffle_window=WINDOW, shard_lanes=HOSTS)


def lane_host(glob: str, paths_on_bucket: list[str], cache_dir: str, emulator, proxy,
              corpus_bytes: int) -> tuple[dict, sources.JsonlSource]:
  """Host 0 of 256 on an empty cache: build, first batch, its share of one epoch; a warm restart; a list.
  Also the warm source, for the paired rounds."""
  found: dict = {}
  mark, count, cpu, started = emulator.mark(), proxy.count, time.process_time(), time.perf_counter()
  with pod_share.Downloads() as downloads:
    source = sources.JsonlSource(glob, cache=sources.ShardCache(cache_dir, 2**34))
    iterator = ckpt_iter.DataIterator(_lane_dataset(source))
    found["build_s"], found["build_cpu_s"] = time.perf_counter() - started, time.process_time() - cpu
    found["build_requests"] = proxy.count - count
    started = time.perf_counter()
    rows = len(next(iterator)["id"])
    found["first_batch_s"] = time.perf_counter() - started
    cpu = time.process_time()
    ids = []
    for batch in iterator:
      ids.extend(np.asarray(batch["id"]).tolist())
    found["cpu_us_per_record"] = (time.process_time() - cpu) / max(1, len(ids)) * 1e6
    source.cache.wait()
    found["rows"] = rows + len(ids)
    found["epoch_requests"] = proxy.count - count
    found["downloaded_vs_share"] = downloads.bytes / (corpus_bytes / HOSTS)
  found["requests_by_kind"] = gcs_emulator.count_by_kind(emulator.requests(mark))
  for name, given in (("warm, list of paths", paths_on_bucket), ("warm", glob)):
    mark, count, started = emulator.mark(), proxy.count, time.perf_counter()
    again = sources.JsonlSource(given, cache=sources.ShardCache(cache_dir, 2**34))
    warm = ckpt_iter.DataIterator(_lane_dataset(again))
    found[name] = {"seconds": time.perf_counter() - started, "requests": proxy.count - count,
                   **{k: n for k, n in gcs_emulator.count_by_kind(emulator.requests(mark)).items() if n}}
  # The same share again from the warm cache: what a record costs once its file is there.
  cpu, rows = time.process_time(), 0
  for batch in warm:
    rows += len(batch["id"])
  found["warm_cpu_us_per_record"] = (time.process_time() - cpu) / rows * 1e6
  found["warm_epoch_cpu_s"] = found["warm_cpu_us_per_record"] * rows / 1e6
  # Named by the corpus index instead of the listing (files_from_index): a new host, then this warm one.
  for name, directory in (("new host, files from index", cache_dir + "-named"), ("warm, files from index", cache_dir)):
    mark, count, cpu, started = emulator.mark(), proxy.count, time.process_time(), time.perf_counter()
    named = sources.JsonlSource(glob, cache=sources.ShardCache(directory, 2**34), files_from_index=True)
    ckpt_iter.DataIterator(_lane_dataset(named))
    found[name] = {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                   "requests": proxy.count - count,
                   **{k: n for k, n in gcs_emulator.count_by_kind(emulator.requests(mark)).items() if n}}
  return found, again


def _lane_share_us(source: sources.JsonlSource) -> float:
  """CPU per record of the lane host's share of an epoch, from the warm cache, on a pipeline built afresh
  (not timed): the epoch's plan is made again, as every epoch of every host makes it."""
  iterator = ckpt_iter.DataIterator(_lane_dataset(source))
  cpu, rows = time.process_time(), 0
  for batch in iterator:
    rows += len(batch["id"])
  return (time.process_time() - cpu) / rows * 1e6


def _read_us(dataset, start: int, batches: int) -> float:
  cpu = time.process_time()
  for number in range(start, start + batches):
    dataset[number % len(dataset)]
  return (time.process_time() - cpu) / (batches * SHUFFLE_BATCH) * 1e6


def global_shuffle(glob: str, local_paths: list[str], cache_dir: str, proxy, rounds: int,
                   batches: int) -> tuple[dict, Any]:
  """Default settings over a warm cache, against the same files on local disk; paired rounds. Also the
  cached dataset, for the rounds that pair the two corpora."""
  count, started = proxy.count, time.perf_counter()
  cached = ckpt_iter.make_dataset(sources.JsonlSource(glob, cache=sources.ShardCache(cache_dir, 2**34)),
                                  batch_size=SHUFFLE_BATCH, seed=SEED)
  found = {"build_s": time.perf_counter() - started, "build_requests": proxy.count - count}
  started = time.perf_counter()
  cached[0]
  found["first_batch_s"] = time.perf_counter() - started
  local = ckpt_iter.make_dataset(sources.JsonlSource(local_paths, index_cache_dir=""), batch_size=SHUFFLE_BATCH,
                                 seed=SEED)
  # The first pass opens every copy once (its seal checked, its line index read): then the steady state.
  for name, dataset in (("cached", cached), ("local", local)):
    found[f"first_pass_{name}_us"] = _read_us(dataset, 1, len(dataset) - 1)
  times: dict[str, list[float]] = {"cached": [], "local": []}
  for number in range(rounds):
    pair = (("cached", cached), ("local", local)) if number % 2 else (("local", local), ("cached", cached))
    for name, dataset in pair:
      times[name].append(_read_us(dataset, 1 + number * batches, batches))
  ratios = [local_us / cached_us for local_us, cached_us in zip(times["local"], times["cached"])]
  found.update(cached_us=statistics.median(times["cached"]), local_us=statistics.median(times["local"]),
               local_over_cached=statistics.median(ratios), spread=max(ratios) - min(ratios))
  return found, cached


class Mosaic:
  """Mosaic Streaming on one corpus as MDS shards on the bucket, run by a Python that imports streaming."""

  def __init__(self, python: str, work: str, files: list[bytes], prefix: str, emulator_url: str):
    self.python, self.work, self.emulator_url = python, work, emulator_url
    lines = os.path.join(work, "lines.jsonl")
    with open(lines, "wb") as f:
      f.write(b"".join(files))
    per_shard = -(-sum(data.count(b"\n") for data in files) // len(files))
    local = os.path.join(work, "mds")
    out = subprocess.run([python, _MOSAIC, "write", local, lines, str(per_shard)], capture_output=True, text=True,
                         check=True)
    names = json.loads(out.stdout.strip().splitlines()[-1])
    self.shards, self.remote = len(names) - 1, f"{prefix}/mds"  # less index.json

    def put(name: str) -> None:
      with open(os.path.join(local, name), "rb") as f:
        _storage.write_bytes(f"{self.remote}/{name}", f.read())

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      list(pool.map(put, names))
    # One process's cache holding every shard, as the global shuffle's holds every file.
    shutil.copytree(local, os.path.join(work, "cache-all"))
    os.remove(lines)

  def node_us(self) -> float:
    return self.share("cache-node", nodes=HOSTS, batch=HOST_BATCH, limit=0)["cpu_us_per_record"]

  def process_us(self) -> float:
    return self.share("cache-all", nodes=0, batch=SHUFFLE_BATCH, limit=MOSAIC_RECORDS)["steady_cpu_us_per_record"]

  def share(self, cache: str, *, nodes: int, batch: int, limit: int) -> dict:
    """Rank 0 of `nodes` (0: one process, its default canonical nodes) reads its part of an epoch."""
    env = _common.child_env(STORAGE_EMULATOR_HOST=self.emulator_url, RANK="0", WORLD_SIZE=str(max(1, nodes)),
                            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK="0")
    out = subprocess.run([self.python, _MOSAIC, "share", self.remote, os.path.join(self.work, cache), str(nodes),
                          str(batch), str(limit)], capture_output=True, text=True, env=env, check=False, timeout=900)
    if out.returncode != 0:
      raise RuntimeError(f"Mosaic Streaming failed: {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _paired(rounds: int, measure: Callable[[str], float], names: tuple[str, str]) -> dict:
  """`measure(name)` of the two corpora in turn (the order alternating), `rounds` times: each corpus's
  median, and the median of the rounds' ratios first / second with their spread."""
  times: dict[str, list[float]] = {name: [] for name in names}
  for number in range(rounds):
    for name in (names if number % 2 else names[::-1]):
      times[name].append(measure(name))
  ratios = [a / b for a, b in zip(times[names[0]], times[names[1]])]
  return {"us": {name: statistics.median(t) for name, t in times.items()}, "ratio": statistics.median(ratios),
          "spread": max(ratios) - min(ratios)}


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0], lambda parser: parser.add_argument(
      "--mosaic-python", default=os.environ.get("CKPT_ITER_MOSAIC_PYTHON"),
      help="a Python that imports mosaicml-streaming 0.13.0: Mosaic Streaming measured beside (module docstring)"))
  report = _common.Reporter("worked_case", args.quick)
  big_files, records = (2_048, 20_480) if args.quick else (20_480, 204_800)
  rounds, batches = (3, 10) if args.quick else (7, 40)
  work = tempfile.mkdtemp(prefix="ckpt_iter_worked_case_")
  # Every import and first call paid before anything is measured (they would count against the first corpus).
  warm_up = os.path.join(work, "warm-up")
  _, paths = upload_local(warm_up, files_of(4_096, 4))
  for batch in ckpt_iter.DataIterator(_lane_dataset(sources.JsonlSource(paths, cache=sources.ShardCache(
      os.path.join(warm_up, "cache"), 2**30)))):
    del batch
  results: dict[str, dict] = {}
  warm_sources: dict[str, sources.JsonlSource] = {}
  cached_sets: dict[str, Any] = {}
  mosaics: dict[str, Mosaic] = {}
  try:
    with gcs_emulator.GcsEmulator() as emulator:
      proxy = fault_proxy.FaultProxy(emulator.url).start()
      os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
      for name, count in ((f"{big_files:,} files", big_files), (f"{SMALL_FILES} files", SMALL_FILES)):
        files = files_of(records, count)
        corpus_bytes = sum(len(f) for f in files)
        prefix = f"gs://{gcs_emulator.BUCKET}/worked-{count}-{os.getpid()}"
        proxy.delay_seconds = 0.0  # the upload is not measured
        started = time.perf_counter()
        glob, local_paths = upload(prefix, os.path.join(work, f"local-{count}"), files)
        uploaded = time.perf_counter() - started
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as said:
          # Through the cache the global shuffle then reads: the index's pass leaves every file in it.
          if cli.main(["index", glob, "--cache", os.path.join(work, f"shuffle-{count}")]) != 0:
            raise RuntimeError(f"ckpt-iter index failed: {said.getvalue()}")
        indexed = time.perf_counter() - started
        mosaic = None
        if args.mosaic_python:  # its shards uploaded as the files were, then its node's first run (cold)
          os.makedirs(os.path.join(work, f"mosaic-{count}"))
          mosaic = mosaics[name] = Mosaic(args.mosaic_python, os.path.join(work, f"mosaic-{count}"), files, prefix,
                                          proxy.url)
        proxy.delay_seconds = DELAY_SECONDS
        print(f"[worked_case] {name}: uploaded in {uploaded:.0f} s, indexed in {indexed:.0f} s", file=sys.stderr)
        if mosaic is not None:
          before = proxy.count
          cold = mosaic.share("cache-node", nodes=HOSTS, batch=HOST_BATCH, limit=0)
          mosaic_cold = {"shards": mosaic.shards, **cold, "requests": proxy.count - before}
        on_bucket = [f"{prefix}/part-{part:05d}.jsonl" for part in range(count)]
        lane, warm_sources[name] = lane_host(glob, on_bucket, os.path.join(work, f"lane-{count}"), emulator, proxy,
                                             corpus_bytes)
        shuffle, cached_sets[name] = global_shuffle(glob, local_paths, os.path.join(work, f"shuffle-{count}"), proxy,
                                                    rounds, batches)
        results[name] = {"files": count, "records": records, "corpus_bytes": corpus_bytes,
                         "upload_s": uploaded, "index_s": indexed, "lane": lane, "global_shuffle": shuffle}
        if mosaic is not None:
          results[name]["mosaic_node_cold"] = mosaic_cold
        report.measurement(name=name, **json.loads(json.dumps(results[name], default=float)))
        shutil.rmtree(os.path.join(work, f"local-{count}"), ignore_errors=True)
      # The two corpora against each other in paired rounds (one figure each is at the mercy of the machine).
      names = (f"{big_files:,} files", f"{SMALL_FILES} files")
      turns = {name: itertools.count(rounds) for name in names}  # batches the rounds above did not read
      paired = {"lane": _paired(rounds, lambda name: _lane_share_us(warm_sources[name]), names),
                "global_shuffle": _paired(rounds, lambda name: _read_us(cached_sets[name],
                                                                        1 + next(turns[name]) * batches, batches),
                                          names)}
      for name, mosaic in mosaics.items():  # Mosaic's CPU per record over ckpt_iter's, in the same rounds
        node = {"mosaic": mosaic.node_us, "ckpt_iter": lambda name=name: _lane_share_us(warm_sources[name])}
        process = {"mosaic": mosaic.process_us, "ckpt_iter": lambda name=name: _read_us(
            cached_sets[name], 1 + next(turns[name]) * batches, batches)}
        for label, sides in ((f"mosaic node / lane host, {name}", node),
                             (f"mosaic process / global shuffle, {name}", process)):
          paired[label] = _paired(rounds, lambda side, sides=sides: sides[side](), ("mosaic", "ckpt_iter"))
      report.measurement(name="paired", **paired)
      proxy.stop()
  finally:
    shutil.rmtree(work, ignore_errors=True)
  big, small = results[f"{big_files:,} files"], results[f"{SMALL_FILES} files"]
  lane_ratio, shuffle_ratio = paired["lane"]["ratio"], paired["global_shuffle"]["ratio"]
  warm, named = big["lane"]["warm"], big["lane"]["warm, files from index"]
  # Mosaic's CPU per record over ckpt_iter's (>= 1: ckpt_iter costs no more), where it was measured.
  against_mosaic = [_common.check(f"{label}: Mosaic Streaming's CPU per record / ckpt_iter's",
                                  _common.rounded(found["ratio"], 3), ">= 1", found["ratio"] >= 1,
                                  spread=_common.rounded(found["spread"], 3),
                                  **{f"{side}_us": _common.rounded(us, 3) for side, us in found["us"].items()})
                    for label, found in paired.items() if label.startswith("mosaic")]
  report.summary([
      _common.check(f"lane host, its share from a warm cache, CPU per record: {big_files:,} files / {SMALL_FILES}",
                    _common.rounded(lane_ratio, 3), "<= 1.5", lane_ratio <= 1.5,
                    spread=_common.rounded(paired["lane"]["spread"], 3),
                    cold_ratio=_common.rounded(big["lane"]["cpu_us_per_record"] / small["lane"]["cpu_us_per_record"],
                                               3)),
      _common.check(f"global shuffle (default settings, warm cache), CPU per record: {big_files:,} files / "
                    f"{SMALL_FILES}", _common.rounded(shuffle_ratio, 3), "<= 1.5", shuffle_ratio <= 1.5,
                    spread=_common.rounded(paired["global_shuffle"]["spread"], 3)),
      _common.check(f"global shuffle, {big_files:,} files: local disk's CPU per record / the warm cache's",
                    _common.rounded(big["global_shuffle"]["local_over_cached"], 3), ">= 0.9",
                    big["global_shuffle"]["local_over_cached"] >= 0.9,
                    spread=_common.rounded(big["global_shuffle"]["spread"], 3)),
      _common.check(f"lane host's warm restart, {big_files:,} files: requests", warm["requests"], "<= 4",
                    warm["requests"] <= 4, **{k: v for k, v in warm.items() if k not in ("requests", "seconds")}),
      _common.check(f"lane host's warm restart, {big_files:,} files named by the index: requests",
                    named["requests"], "<= 4", named["requests"] <= 4,
                    **{k: v for k, v in named.items() if k != "requests"},
                    new_host_requests=big["lane"]["new host, files from index"]["requests"]),
      _common.check(f"lane host, {big_files:,} files: bytes downloaded / (corpus / {HOSTS})",
                    _common.rounded(big["lane"]["downloaded_vs_share"], 3), "<= 1.25",
                    big["lane"]["downloaded_vs_share"] <= 1.25),
      *against_mosaic,
  ], load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
