"""A pod of hosts over one bucket, each with its own cache: a host downloads its share, not the corpus.

make_dataset(shuffle="shards", shard_lanes=4) over gs:// JSONL on the GCS emulator, indexed once
(`ckpt-iter index`, so no host downloads the corpus to count its lines). Each host is a real
process (tests/workers/bucket_pod_worker.py) with a cache of its own, smaller than the corpus. Hypothesis
draws a chain of saved segments under host counts 1, 2 and 4 (each segment's hosts run at
once, save their states and exit; the test marks the step committed once every host saved, as Orbax's
commit does; the next segment restores it with `elastic=True`). Counted over the chain: duplicates and
skips (none), the files each host downloaded (only those holding its lanes' share of the epoch), and, for
a run without restarts, what the pod takes out of the bucket (every file by at most the two hosts whose
shares it straddles: the corpus and at most one file per host more). `make test` runs the explicit
examples and one drawn; `make test-full` draws eight.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

import hypothesis
from hypothesis import strategies as st
import pytest

from ckpt_iter import _permutation
from ckpt_iter import _storage

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "bucket_pod_worker.py")
sys.path.insert(0, os.path.dirname(_WORKER))
import bucket_pod_worker  # pylint: disable=g-import-not-at-top,wrong-import-position

# 16 files of uneven sizes (so lane shares cut files), 4 lanes of 3 rows: a global batch of 12.
_SIZES = [20, 28, 24, 17, 31, 22, 26, 19, 25, 23, 30, 18, 27, 21, 29, 24]
_LANES, _LANE_ROWS, _WINDOW = 4, 3, 2
_GLOBAL_BATCH = _LANES * _LANE_ROWS
_HOST_SECONDS = 240


@pytest.fixture(scope="module")
def corpus(gcs_emulator, tmp_path_factory):
  """The corpus's glob and its files' sizes, indexed once (`ckpt-iter index`): no host reads it to count."""
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top
  import support  # pylint: disable=g-import-not-at-top

  del gcs_emulator
  urls, sizes, first = [], [], 0
  for part, count in enumerate(_SIZES):
    data = "".join(json.dumps({"id": first + i, "text": bucket_pod_worker.expected_text(first + i)}) + "\n"
                   for i in range(count)).encode()
    urls.append(f"gs://{emulator_lib.BUCKET}/pod-share/part-{part:02d}.jsonl")
    _storage.write_bytes(urls[-1], data)
    sizes.append(len(data))
    first += count
  glob = f"gs://{emulator_lib.BUCKET}/pod-share/part-*.jsonl"
  code, out = support.cli_output("index", glob, "--cache", str(tmp_path_factory.mktemp("indexing")))
  assert code == 0, out
  return glob, sizes


def _order():
  offsets = [0]
  for count in _SIZES:
    offsets.append(offsets[-1] + count)
  return _permutation.ShardShuffle(offsets, _WINDOW, bucket_pod_worker.SEED, _LANES, _LANE_ROWS)


def _share_files(order, host, hosts):
  """The files holding host `host`'s lanes' share of epoch 0 (hosts dividing the lanes)."""
  first, last = host * _LANES // hosts, (host + 1) * _LANES // hosts
  return {order.shard_of(start) for lane in range(first, last) for start, _ in order.plan(0).lane(lane).pieces}


def _run_segment(corpus, workdir, number, hosts, steps, env):
  """Runs `hosts` hosts at once; each saves after `steps` batches (None: reads to the end). Their outs."""
  glob, sizes = corpus
  root = os.path.join(workdir, "ckpt")
  entry = max(sizes) + 16 * max(_SIZES) + 128  # a copy with its line index
  running, outs = [], []
  for host in range(hosts):
    out = os.path.join(workdir, f"out-{number}-{host}")
    os.makedirs(out)
    # Half the corpus: no host can hold it all, each holds its share's windows.
    config = {"source": glob, "cache_dir": os.path.join(workdir, f"cache-{host}"), "max_bytes": 8 * entry,
              "root": root, "processes": 1, "shard_offset": host, "shard_count": hosts, "lanes": _LANES,
              "global_batch": _GLOBAL_BATCH, "shuffle": "shards", "window": _WINDOW, "steps": steps,
              "extra": None if steps is None else 0, "out": out}
    path = os.path.join(workdir, f"host-{number}-{host}.json")
    with open(path, "w") as f:
      json.dump(config, f)
    err = open(os.path.join(workdir, f"host-{number}-{host}.err"), "w")
    running.append((subprocess.Popen([sys.executable, _WORKER, path], env=env, stdout=subprocess.DEVNULL,
                                     stderr=err), err))
    outs.append(out)
  deadline = time.monotonic() + _HOST_SECONDS
  for process, err in running:
    process.wait(max(1.0, deadline - time.monotonic()))
    err.close()
  for host, (process, _) in enumerate(running):
    assert process.returncode == 0, open(os.path.join(workdir, f"host-{number}-{host}.err")).read()[-3000:]
  return outs


def _check_chain(corpus, gcs_emulator, tmp_path_factory, saved, last_hosts):
  _, sizes = corpus
  workdir = str(tmp_path_factory.mktemp("pod-share"))
  os.makedirs(os.path.join(workdir, "ckpt"))
  env = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_emulator.url, JAX_PLATFORMS="cpu",
             CKPT_ITER_OBJECT_STORE_BOUNDS="request=20,operation=60")
  order = _order()
  segments = list(saved) + [(last_hosts, None)]
  trained, downloads, step = [], [], 0
  for number, (hosts, steps) in enumerate(segments):
    outs = _run_segment(corpus, workdir, number, hosts, steps, env)
    parts = [json.load(open(os.path.join(out, "trained-0.json")))["batches"] for out in outs]
    assert len({len(p) for p in parts}) == 1, [len(p) for p in parts]
    trained.extend([i for part in batch for i in part] for batch in zip(*parts))
    if steps is not None:
      step += steps
      open(os.path.join(workdir, "ckpt", str(step), "commit"), "w").close()  # every host saved
    for host, out in enumerate(outs):
      names = set(_lines(os.path.join(out, "downloads-0.txt")))
      files = {int(n.split("-")[1].split(".")[0]) for n in names}
      downloads.append((number, host, hosts, files))
  ids = [i for batch in trained for i in batch]
  counts = collections.Counter(ids)
  length = sum(_SIZES)
  kept = length // _GLOBAL_BATCH * _GLOBAL_BATCH  # drop_remainder: the epoch's last short batch
  dropped = {order.source(o) for o in range(kept, length)}
  duplicates = sum(c - 1 for c in counts.values() if c > 1)
  skipped = len(set(range(length)) - set(counts) - dropped)
  corpus_bytes = sum(sizes)
  per_host = [sum(sizes[f] for f in files) / (corpus_bytes / hosts) for _, _, hosts, files in downloads]
  hypothesis.note(f"segments {segments}: trained {len(ids)}, duplicates {duplicates}, skipped {skipped}, "
                  f"downloads per host / (corpus / hosts) {[round(r, 2) for r in per_host]}")
  assert duplicates == 0 and skipped == 0, (duplicates, skipped)
  assert ids == [order.source(g) for g in range(len(ids))]
  # Each host downloads only files of its lanes' share (the prefetch stops at the one epoch's end).
  for number, host, hosts, files in downloads:
    assert files <= _share_files(order, host, hosts), (number, host, hosts, sorted(files))
  if not saved:  # one run: the pod takes the corpus out of the bucket about once
    taken = collections.Counter(f for _, _, _, files in downloads for f in files)
    assert set(taken) == set(range(len(_SIZES))) and max(taken.values()) <= 2, dict(taken)
    assert sum(sizes[f] * n for f, n in taken.items()) <= corpus_bytes + (last_hosts - 1) * max(sizes)


_CASES = dict(
    saved=st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 8)), max_size=2),
    last_hosts=st.sampled_from([1, 2, 4]),
)


@hypothesis.settings(max_examples=1, deadline=None, suppress_health_check=list(hypothesis.HealthCheck),
                     database=None)
@hypothesis.example(saved=[], last_hosts=4)
@hypothesis.example(saved=[(4, 5), (2, 6)], last_hosts=4)
@hypothesis.given(**_CASES)
def test_each_host_downloads_its_share_and_the_pod_trains_every_record_once(
    corpus, gcs_emulator, tmp_path_factory, saved, last_hosts):
  _check_chain(corpus, gcs_emulator, tmp_path_factory, saved, last_hosts)


@pytest.mark.slow
@hypothesis.settings(max_examples=8, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(**_CASES)
def test_each_host_downloads_its_share_long(corpus, gcs_emulator, tmp_path_factory, saved, last_hosts):
  _check_chain(corpus, gcs_emulator, tmp_path_factory, saved, last_hosts)


def _lines(path: str) -> list[str]:
  try:
    return open(path).read().split()
  except FileNotFoundError:
    return []
