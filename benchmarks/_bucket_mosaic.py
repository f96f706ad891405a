"""bucket.py's Mosaic Streaming cases: the same records as MDS shards, from the same emulator and proxy.

`streaming.StreamingDataset` (mosaicml-streaming) with its own local cache,
shuffled (shuffle_seed 7, its default algorithm), batch 32 through its
`StreamingDataLoader` in the main process (num_workers=0, as DataIterator
reads with no threads). Cases: from gs:// with an empty local cache (its
shards downloaded as it reads), again with the cache filled, and from local
disk (remote=None); the first batch after resuming at the same deep
position (its `state_dict(DEEP_RECORD, from_beginning=True)` loaded into a
new dataset), cache warm and cold.

Streaming's GCS downloader asks for Application Default Credentials; against
the emulator it is given the storage client the emulator's environment
variable makes (anonymous), its download otherwise unchanged.

Not installable beside ckpt_iter's own extras: mosaicml-streaming 0.13.0
requires google-cloud-storage<3.3 and numpy<2.2, the gcs extra's
gcsfs>=2026.10.1 google-cloud-storage>=3.14.1 (docs/bucket.md).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from typing import Any, Callable


def available() -> str | None:
  """None if streaming imports here, else why not."""
  try:
    importlib.import_module("streaming")
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


def _anonymous_client(self) -> None:
  from google.cloud import storage  # pylint: disable=g-import-not-at-top

  self._gcs_client = storage.Client()  # pylint: disable=protected-access  # the emulator's, anonymous


def write_shards(lines: list[bytes], directory: str, shard_bytes: int) -> list[str]:
  """The records as MDS shards (columns id, text; no compression); the files written."""
  from streaming import MDSWriter  # pylint: disable=g-import-not-at-top

  with MDSWriter(out=directory, columns={"id": "int64", "text": "str"}, size_limit=shard_bytes) as writer:
    for line in lines:
      record = json.loads(line)
      writer.write({"id": record["id"], "text": record["text"]})
  return sorted(os.listdir(directory))


def cases(proxy: Any, work: str, lines: list[bytes], remote: str, upload: Callable[[str, bytes], None],
          settle: Callable[[Any], None], *, batch: int, records: int, deep_record: int,
          shard_bytes: int) -> tuple[dict, dict]:
  """Records/s and the first batch after a resume at `deep_record`, Mosaic Streaming's way."""
  import streaming  # pylint: disable=g-import-not-at-top
  from streaming.base import util  # pylint: disable=g-import-not-at-top
  from streaming.base.storage import download  # pylint: disable=g-import-not-at-top

  download.GCSDownloader._create_gcs_client = _anonymous_client  # pylint: disable=protected-access
  local = os.path.join(work, "mds_local")
  names = write_shards(lines, local, shard_bytes)
  for name in names:
    with open(os.path.join(local, name), "rb") as f:
      upload(f"{remote}/{name}", f.read())
  cache = os.path.join(work, "mds_cache")

  def make(from_bucket: bool, directory: str = cache):
    util.clean_stale_shared_memory()
    if from_bucket:
      dataset = streaming.StreamingDataset(remote=remote, local=directory, shuffle=True, shuffle_seed=7,
                                           batch_size=batch)
    else:
      dataset = streaming.StreamingDataset(local=local, shuffle=True, shuffle_seed=7, batch_size=batch)
    return dataset

  def read(from_bucket: bool) -> dict:
    before = proxy.count
    started = time.perf_counter()
    dataset = make(from_bucket)
    loader = streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=0)
    batches = iter(loader)
    setup = time.perf_counter() - started
    read_started, count = time.perf_counter(), 0
    while count < records:
      count += len(next(batches)["id"])
    reading = time.perf_counter() - read_started
    requests = proxy.count - before
    del batches, loader, dataset
    settle(proxy)
    return {"records": count, "setup_s": round(setup, 3), "records_per_s": round(count / reading, 1),
            "requests_per_record": round(requests / count, 5), "requests": requests}

  def restore(from_bucket: bool, state: dict, directory: str = cache) -> dict:
    before = proxy.count
    started = time.perf_counter()
    dataset = make(from_bucket, directory)
    dataset.load_state_dict(state)
    loader = streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=0)
    first = next(iter(loader))
    seconds = time.perf_counter() - started
    requests = proxy.count - before
    del loader, dataset
    settle(proxy)
    return {"first_batch_s": round(seconds, 3), "requests": requests, "first_id": int(first["id"][0])}

  figures, restores = {}, {}
  shutil.rmtree(cache, ignore_errors=True)
  figures["mosaic gs:// cache cold"] = read(True)
  figures["mosaic gs:// cache warm"] = read(True)
  figures["mosaic local disk"] = read(False)
  # The state of a run that read `deep_record` samples of epoch 0 (the same for every case).
  state = make(False).state_dict(deep_record, from_beginning=True)
  restores["mosaic gs:// cache warm"] = restore(True, state)
  # Cold: a directory of its own (streaming keeps what a directory holds in shared memory per process).
  restores["mosaic gs:// cache cold"] = restore(True, state, os.path.join(work, "mds_cache_cold"))
  restores["mosaic local disk"] = restore(False, state)
  util.clean_stale_shared_memory()
  return figures, restores


# ---------------------------------------------------------------------------
# The other benchmarks' Mosaic Streaming processes, each run by a Python that imports streaming (the caller
# uploads the shards and sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE):
#   _bucket_mosaic.py write MDS_DIR LINES.jsonl [PER_SHARD]   writes the shards (POD_SHARDS of them, or
#                                                             PER_SHARD records each); prints their names
#   _bucket_mosaic.py node REMOTE LOCAL NODES BATCH           pod_share.py: one node of a pod that runs
#                                                             whole (its nodes join one torch.distributed
#                                                             group) reads its part of an epoch; prints
#                                                             {"bytes", "rows"}
#   _bucket_mosaic.py share REMOTE LOCAL NODES BATCH LIMIT    worked_case.py: node RANK of NODES alone (no
#                                                             torch.distributed group: with one rank a node,
#                                                             streaming needs none but its barriers) reads
#                                                             its part of an epoch, at most LIMIT records (0:
#                                                             all); prints its build and its CPU per record,
#                                                             from the epoch's start and after its first batch

POD_SHARDS = 48


def _write_pod(directory: str, lines_path: str, per_shard: int | None) -> None:
  with open(lines_path, "rb") as f:
    lines = f.read().splitlines()
  if per_shard is None:
    print(json.dumps(write_shards(lines, directory, max(1, sum(len(line) for line in lines) // POD_SHARDS))))
    return
  from streaming import MDSWriter  # pylint: disable=g-import-not-at-top

  with MDSWriter(out=directory, columns={"id": "int64", "text": "str"}, size_limit=None) as writer:
    for number, line in enumerate(lines):
      record = json.loads(line)
      writer.write({"id": record["id"], "text": record["text"]})
      if (number + 1) % per_shard == 0 and number + 1 < len(lines):
        writer.flush_shard()  # what its own write() does at its size limit
        writer._reset_cache()  # pylint: disable=protected-access
  print(json.dumps(sorted(os.listdir(directory))))


def _dataset(remote: str, local: str, nodes: int, batch: int):
  import streaming  # pylint: disable=g-import-not-at-top
  from streaming.base import util  # pylint: disable=g-import-not-at-top
  from streaming.base.storage import download  # pylint: disable=g-import-not-at-top

  download.GCSDownloader._create_gcs_client = _anonymous_client  # pylint: disable=protected-access
  util.clean_stale_shared_memory()
  return streaming, streaming.StreamingDataset(remote=remote, local=local, shuffle=True, shuffle_seed=7,
                                               batch_size=batch, num_canonical_nodes=nodes or None)


def _read_node(remote: str, local: str, nodes: int, batch: int) -> None:
  streaming, dataset = _dataset(remote, local, nodes, batch)
  rows = sum(len(b["id"]) for b in streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=0))
  taken = sum(os.path.getsize(os.path.join(local, n)) for n in os.listdir(local)
              if n.endswith(".mds"))
  print(json.dumps({"bytes": taken, "rows": rows}))


def _read_share(remote: str, local: str, nodes: int, batch: int, limit: int) -> None:
  from streaming.base import dataset as dataset_module  # pylint: disable=g-import-not-at-top
  from streaming.base import util  # pylint: disable=g-import-not-at-top

  dataset_module.maybe_init_dist = util.maybe_init_dist = lambda: False
  cpu, started = time.process_time(), time.perf_counter()
  streaming, dataset = _dataset(remote, local, nodes, batch)
  built = {"build_s": time.perf_counter() - started, "build_cpu_s": time.process_time() - cpu}
  cpu, rows, steady = time.process_time(), 0, None
  for b in streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=0):
    rows += len(b["id"])
    if steady is None:  # past the epoch's start (its partition made, its threads started)
      steady = (time.process_time(), rows)
    if limit and rows >= limit:
      break
  ended = time.process_time()
  print(json.dumps({**built, "rows": rows, "cpu_us_per_record": (ended - cpu) / rows * 1e6,
                    "steady_cpu_us_per_record": (ended - steady[0]) / max(1, rows - steady[1]) * 1e6}))


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  if sys.argv[1] == "write":
    _write_pod(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
  elif sys.argv[1] == "share":
    _read_share(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
  else:
    _read_node(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
