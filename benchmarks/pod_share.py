"""What each host of a pod downloads an epoch, at 1, 2, 4 and 8 simulated hosts: shard lanes against none.

The bucket is the tests' GCS emulator (tests/gcs_emulator.py) behind their
proxy (tests/fault_proxy.py) adding 20 ms to every request. Corpus: 12,000
records of ~1 KB in 48 JSONL files, indexed once (`ckpt-iter index`, so no
host downloads it to count lines). A host is simulated by a cache directory
of its own (half the corpus's bytes: no host holds it all) and a source of
its own; the hosts of a pod read one after the other in this process, each
its processes' rows of every global batch of one epoch (global batch 64,
`shuffle="shards"`, window 2), one process per host. Cases:

  shard lanes   make_dataset(..., shard_lanes=hosts): each host reads its
                lanes' share of the epoch.
  no lanes      the same without shard_lanes (0.3.0's order): every host
                reads rows of every window.
  Mosaic        Mosaic Streaming on the same records as 48 MDS shards, each
                simulated node a process of its own (RANK / WORLD_SIZE set,
                num_canonical_nodes = nodes) with its own local cache and
                its own /dev/shm (`unshare -m`, as root),
                iterating its part of one epoch (benchmarks/_bucket_mosaic.py);
                run where a Python that imports `streaming` is given
                (--mosaic-python or CKPT_ITER_MOSAIC_PYTHON), noted as not
                measured elsewhere.

Figures per host count: the bytes each host downloaded (its copies' sizes,
as the store sent them) against the corpus / hosts (1.0: exactly its share),
the largest and the mean; the pod's total against the corpus; each host's
requests to the store; seconds per host. Target (issue 59): at 4 hosts the
largest host downloads at most 1.25 x corpus / 4.
    python benchmarks/pod_share.py [--quick] [--mosaic-python PATH]
Its Mosaic nodes iterate an epoch each against the same proxy (20 ms a request).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import fault_proxy  # pylint: disable=g-import-not-at-top,wrong-import-position
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

DELAY_SECONDS = 0.020
FILES, PER_FILE, GLOBAL_BATCH, WINDOW, SEED = 48, 250, 64, 2, 7
HOSTS = (1, 2, 4, 8)
_MOSAIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bucket_mosaic.py")


def corpus(files: int) -> list[bytes]:
  """The JSONL files' bytes: ~1 KB records, ids in order."""
  return ["".join(json.dumps({"id": part * PER_FILE + i,
                              "text": hashlib.sha256(str(part * PER_FILE + i).encode()).hexdigest() * 15}) + "\n"
                  for i in range(PER_FILE)).encode() for part in range(files)]


class Downloads:
  """Counts the bytes the shard caches of this process download (the object's size, as the store sends it)."""

  def __init__(self):
    self.bytes = 0

  def __enter__(self):
    real = self._real = _shard_cache.ShardCache._download  # pylint: disable=protected-access

    def counted(cache, path, found, entry):
      self.bytes += found.size
      return real(cache, path, found, entry)

    _shard_cache.ShardCache._download = counted  # pylint: disable=protected-access
    return self

  def __exit__(self, *exc):
    _shard_cache.ShardCache._download = self._real  # pylint: disable=protected-access


def read_host(glob: str, cache_dir: str, max_bytes: int, hosts: int, host: int, lanes: int | None,
              proxy: fault_proxy.FaultProxy) -> dict:
  """One simulated host: builds its source and dataset on an empty cache, reads its rows of one epoch."""
  requests = proxy.count
  started = time.perf_counter()
  with Downloads() as downloads:
    source = sources.JsonlSource(glob, cache=sources.ShardCache(cache_dir, max_bytes))
    dataset = ckpt_iter.make_dataset(source, batch_size=GLOBAL_BATCH // hosts, seed=SEED, num_epochs=1,
                                     shard_index=host, shard_count=hosts, shuffle="shards", shuffle_window=WINDOW,
                                     shard_lanes=lanes)
    rows = sum(len(batch["id"]) for batch in ckpt_iter.DataIterator(dataset))
    source.cache.wait()
  return {"bytes": downloads.bytes, "requests": proxy.count - requests, "rows": rows,
          "seconds": time.perf_counter() - started}


def pod(glob: str, work: str, corpus_bytes: int, hosts: int, lanes: int | None,
        proxy: fault_proxy.FaultProxy) -> dict:
  """Every host of a pod of `hosts`, one after the other; the figures of the epoch."""
  per_host = []
  for host in range(hosts):
    cache_dir = os.path.join(work, f"cache-{hosts}-{lanes}-{host}")
    per_host.append(read_host(glob, cache_dir, corpus_bytes // 2, hosts, host, lanes, proxy))
    shutil.rmtree(cache_dir, ignore_errors=True)
  return summarize(per_host, corpus_bytes, hosts)


def summarize(per_host: list[dict], corpus_bytes: int, hosts: int) -> dict:
  share = corpus_bytes / hosts
  taken = [h["bytes"] for h in per_host]
  return {"largest_vs_share": _common.rounded(max(taken) / share, 3),
          "mean_vs_share": _common.rounded(sum(taken) / len(taken) / share, 3),
          "pod_vs_corpus": _common.rounded(sum(taken) / corpus_bytes, 3),
          "requests_per_host": max(h.get("requests", 0) for h in per_host),
          "seconds_per_host": _common.rounded(max(h.get("seconds", 0.0) for h in per_host), 2),
          "rows": sum(h.get("rows", 0) for h in per_host)}


def mosaic_shards(python: str, work: str, files: list[bytes], prefix: str) -> tuple[str, int] | str:
  """The records as MDS shards written by `python` (which imports streaming) and uploaded under `prefix`:
  (remote, the shards' bytes); or why not."""
  lines = os.path.join(work, "lines.jsonl")
  with open(lines, "wb") as f:
    f.write(b"".join(files))
  local = os.path.join(work, "mds")
  out = subprocess.run([python, _MOSAIC, "write", local, lines], capture_output=True, text=True, check=False)
  if out.returncode != 0:
    return f"Mosaic Streaming not measured: {out.stderr.strip().splitlines()[-1:]}"
  remote, total = f"{prefix}/mds", 0
  for name in json.loads(out.stdout.strip().splitlines()[-1]):
    with open(os.path.join(local, name), "rb") as f:
      data = f.read()
    _storage.write_bytes(f"{remote}/{name}", data)
    total += len(data) if name.endswith(".mds") else 0
  return remote, total


def mosaic_pod(python: str, work: str, remote: str, corpus_bytes: int, hosts: int, emulator_url: str) -> dict | str:
  """Mosaic Streaming's nodes, each a process of `python` (which imports streaming), all at once (its nodes
  join one torch.distributed group); or why not measured."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  started, running = time.perf_counter(), []
  for node in range(hosts):
    local = os.path.join(work, f"mds-cache-{hosts}-{node}")
    env = _common.child_env(STORAGE_EMULATOR_HOST=emulator_url, RANK=str(node), WORLD_SIZE=str(hosts),
                            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
    # Each node with a /dev/shm of its own, as on a host of its own (streaming names its shared memory per
    # node: simulated nodes sharing one would take each other's).
    private_shm = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']
    running.append((subprocess.Popen(private_shm + [python, _MOSAIC, "node", remote, local, str(hosts),
                                                    str(GLOBAL_BATCH // hosts)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), local))
  per_host, failed = [], None
  for process, local in running:
    out, err = process.communicate(timeout=900)
    if process.returncode != 0:
      failed = failed or f"Mosaic Streaming node failed: {err.strip()[-800:]}"
      continue
    figures = json.loads(out.strip().splitlines()[-1])
    figures["seconds"] = time.perf_counter() - started
    per_host.append(figures)
    shutil.rmtree(local, ignore_errors=True)
  return failed or summarize(per_host, corpus_bytes, hosts)


def main() -> None:
  def extra(parser):
    parser.add_argument("--mosaic-python", default=os.environ.get("CKPT_ITER_MOSAIC_PYTHON"),
                        help="a Python that imports streaming (Mosaic); default $CKPT_ITER_MOSAIC_PYTHON")

  args = _common.parse_args(__doc__.splitlines()[0], extra)
  report = _common.Reporter("pod_share", args.quick)
  files = corpus(12 if args.quick else FILES)
  corpus_bytes = sum(len(f) for f in files)
  work = tempfile.mkdtemp(prefix="ckpt_iter_pod_share_")
  results: dict[tuple[str, int], dict] = {}
  try:
    with gcs_emulator.GcsEmulator() as emulator:
      proxy = fault_proxy.FaultProxy(emulator.url, delay_seconds=DELAY_SECONDS).start()
      os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
      prefix = f"gs://{gcs_emulator.BUCKET}/pod-{os.getpid()}"
      for part, data in enumerate(files):
        _storage.write_bytes(f"{prefix}/part-{part:03d}.jsonl", data)
      glob = f"{prefix}/part-*.jsonl"
      with contextlib.redirect_stdout(io.StringIO()) as said:
        if cli.main(["index", glob, "--cache", os.path.join(work, "indexing")]) != 0:
          raise RuntimeError(f"ckpt-iter index failed: {said.getvalue()}")
      report.note(f"{len(files)} files, {corpus_bytes:,} bytes; {DELAY_SECONDS * 1e3:.0f} ms a request; "
                  f"global batch {GLOBAL_BATCH}, window {WINDOW}, caches of half the corpus")
      for hosts in HOSTS:
        for name, lanes in (("shard lanes", hosts), ("no lanes", None)):
          results[(name, hosts)] = pod(glob, work, corpus_bytes, hosts, lanes, proxy)
      if args.mosaic_python:
        shards = mosaic_shards(args.mosaic_python, work, files, prefix)
        for hosts in HOSTS if not isinstance(shards, str) else ():
          found = mosaic_pod(args.mosaic_python, work, shards[0], shards[1], hosts, proxy.url)
          if isinstance(found, str):
            report.note(found)
            break
          results[("Mosaic", hosts)] = found
        if isinstance(shards, str):
          report.note(shards)
      else:
        report.note("Mosaic Streaming not measured: pass --mosaic-python (it cannot share this venv)")
      proxy.stop()
  finally:
    shutil.rmtree(work, ignore_errors=True)
  for (name, hosts), figures in results.items():
    report.measurement(name=f"{name}, {hosts} hosts", value=figures["largest_vs_share"], unit="x share",
                       hosts=hosts, **figures)
  largest = results[("shard lanes", 4)]["largest_vs_share"]
  report.summary([_common.check("4 hosts, shard lanes: largest host's bytes / (corpus / 4)", largest, "<= 1.25",
                                largest <= 1.25)])


if __name__ == "__main__":
  main()
