"""The bucket path, drawn: hosts of 1-4 processes sharing a shard cache, killed and restarted, bytes corrupted.

Hypothesis draws the shuffle (a shard shuffle or a global one), the cache's size (below one window, two
windows, the whole corpus), how many processes share it, a chain of restarts (each host trains some
batches, saves, reads on and is killed with SIGKILL; or is killed in the middle of a download), and a
corruption (one bit flipped in transit by a proxy, or one byte of a cached copy altered on disk between two
hosts), whether the hosts name the files from the corpus index (`files_from_index`: their versions and
checksums then come from the index, not a listing), and whether small copies are read whole into memory (the
default) or every copy is read by ranges through a descriptor held open. Each host is a real process group (tests/workers/bucket_pod_worker.py) over gs:// JSONL on the GCS
emulator. It counts, over what was trained (every host's batches up to its save, and the last host's to
the end): duplicates and skips (none), records whose bytes are not the store's (none: each worker compares
every record it reads), downloads per file, and the bytes of copies no reader holds against `max_bytes`.
`make test` runs five chosen examples and one drawn one, `make test-heavy` two more chosen ones, `make test-full`
twelve drawn.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

import hypothesis
from hypothesis import strategies as st
import pytest

from ckpt_iter import _storage

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "bucket_pod_worker.py")
sys.path.insert(0, os.path.dirname(_WORKER))
import bucket_pod_worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import cache_probe  # pylint: disable=g-import-not-at-top,wrong-import-position

_FILES, _PER_FILE = 12, 24
_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_HOST_SECONDS = 240


@pytest.fixture(scope="module")
def corpus(gcs_emulator):
  """12 JSONL files of 24 records on gs://, as `.jsonl`, `.jsonl.gz` and `.jsonl.zst` (shared by the examples:
  a host never writes them): {suffix: urls}, the text's sizes, and {suffix: urls} of the same files in a
  directory `ckpt-iter index` indexed."""
  import gzip  # pylint: disable=g-import-not-at-top

  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top
  import zstandard  # pylint: disable=g-import-not-at-top

  del gcs_emulator
  import support  # pylint: disable=g-import-not-at-top

  urls, sizes = {suffix: [] for suffix in _SUFFIXES}, []
  indexed = {suffix: [] for suffix in _SUFFIXES}
  for part in range(_FILES):
    data = "".join(json.dumps({"id": part * _PER_FILE + i, "text": bucket_pod_worker.expected_text(part * _PER_FILE + i)})
                   + "\n" for i in range(_PER_FILE)).encode()
    sizes.append(len(data))
    for suffix, pack in ((".jsonl", bytes), (".jsonl.gz", gzip.compress),
                         (".jsonl.zst", zstandard.ZstdCompressor(write_checksum=True).compress)):
      for found, directory in ((urls, "bucket-property"), (indexed, "bucket-property-indexed")):
        found[suffix].append(f"gs://{emulator_lib.BUCKET}/{directory}/part-{part:02d}{suffix}")
        _storage.write_bytes(found[suffix][-1], pack(data))
  code, out = support.cli_output("index", f"gs://{emulator_lib.BUCKET}/bucket-property-indexed")
  assert code == 0, out
  return urls, sizes, indexed


class _Sampler:
  """Samples the cache: the most bytes of copies (with their indexes) no reader holds."""

  def __init__(self, directory: str, built: str, processes: int):
    self.directory, self.idle_peak = directory, 0
    # Measured from when every process built its source to when the first is done reading.
    self._built, self._processes = built, processes
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join(10)

  def _run(self):
    while not self._stop.is_set():
      if sum(n.startswith("built-") for n in os.listdir(self._built)) < self._processes:
        time.sleep(0.01)
        continue
      _, idle = cache_probe.cache_bytes(self.directory)
      if any(n.startswith(("done-", "ready-")) for n in os.listdir(self._built)):
        return  # a process is done reading: what it held is idle until the host's next process opens the cache
      self.idle_peak = max(self.idle_peak, idle)
      time.sleep(0.01)


def _flip_cached_bytes(cache_dir: str) -> int:
  """Alters one byte of every complete copy in place (a digit of a record's text for another, same size,
  valid JSON): whatever the next host reads from the cache, it must not be these bytes. How many."""
  altered = 0
  for name in sorted(os.listdir(cache_dir)):
    if not name.endswith(_SUFFIXES) or ".tmp-" in name:  # a compressed file's copy is its text
      continue
    path = os.path.join(cache_dir, name)
    with open(path, "r+b") as f:
      data = f.read()
      at = data.find(b'"text": "r') + len(b'"text": "r')
      if at < len(b'"text": "r'):
        continue
      f.seek(at)
      f.write(b"9" if data[at:at + 1] != b"9" else b"8")
    altered += 1
  return altered


def _run_host(config: dict, workdir: str, name: str, env: dict, proxy, kill: bool) -> int:
  path = os.path.join(workdir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(config, f)
  host = subprocess.Popen([sys.executable, _WORKER, path], env=env, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, f"{name}.err"), "w"))
  deadline = time.monotonic() + _HOST_SECONDS
  try:
    while time.monotonic() < deadline:
      if host.poll() is not None:
        return host.returncode
      ready = sum(n.startswith("ready-") for n in os.listdir(config["out"]))
      stalled = any(action == "stall" for action, _, _ in proxy.hits)
      if kill and (ready == config["processes"] or stalled):
        os.killpg(host.pid, signal.SIGKILL)
        host.wait(60)
        return -signal.SIGKILL
      time.sleep(0.05)
    raise AssertionError(f"host {name} did not finish in {_HOST_SECONDS} s")
  finally:
    if host.poll() is None:
      os.killpg(host.pid, signal.SIGKILL)
      host.wait(60)


_SEGMENT = st.tuples(st.integers(1, 6), st.sampled_from(["save_then_kill", "kill_mid_download"]))
_CASES = dict(
    shuffle=st.sampled_from(["shards", "global"]),
    cache=st.sampled_from(["below_window", "two_windows", "corpus"]),
    processes=st.sampled_from([1, 2, 4]),
    segments=st.lists(_SEGMENT, min_size=0, max_size=2),
    corruption=st.sampled_from([None, "transit", "disk"]),
    suffix=st.sampled_from(_SUFFIXES),
    named=st.booleans(),
    in_memory=st.booleans(),
)


def _check_one_chain(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes, segments, corruption,
                     suffix=".jsonl", named=False, in_memory=True):
  import fault_proxy  # pylint: disable=g-import-not-at-top

  urls, sizes = corpus[2 if named else 0][suffix], corpus[1]
  workdir = str(tmp_path_factory.mktemp("pod"))
  cache_dir, root = os.path.join(workdir, "cache"), os.path.join(workdir, "ckpt")
  os.makedirs(root)
  window = 2
  entry = max(sizes) + 16 * _PER_FILE + 128  # a copy with its line index
  max_bytes = {"below_window": entry, "two_windows": 2 * window * entry, "corpus": _FILES * entry + 1}[cache]
  proxy = fault_proxy.FaultProxy(gcs_emulator.url).start()
  env = dict(os.environ, STORAGE_EMULATOR_HOST=proxy.url, JAX_PLATFORMS="cpu",
             CKPT_ITER_OBJECT_STORE_BOUNDS="request=20,operation=60")
  trained: list[list[int]] = []
  corrupted = None
  try:
    plan = list(segments) + [(None, "to_the_end")]
    for number, (steps, end) in enumerate(plan):
      out = os.path.join(workdir, f"out-{number}")
      os.makedirs(out)
      proxy.clear()
      if corruption == "transit" and number == 0:
        proxy.add("flip", f"part-03{suffix}?alt=media", method="GET", times=1)
      if corruption == "disk" and number > 0 and os.path.isdir(cache_dir):
        corrupted = (corrupted or 0) + _flip_cached_bytes(cache_dir)
      if end == "kill_mid_download":
        proxy.add("stall", "alt=media", method="GET", times=1)
      config = {"source": urls, "cache_dir": cache_dir, "max_bytes": max_bytes, "root": root,
                "processes": processes, "shuffle": shuffle, "window": window, "steps": steps,
                "extra": None if end == "to_the_end" else 2, "out": out, "files_from_index": named,
                "small_copies_in_memory": in_memory}
      with _Sampler(cache_dir, out, processes) as sampler:
        code = _run_host(config, workdir, f"host-{number}", env, proxy, kill=end != "to_the_end")
      proxy.release()  # a stalled handler closes its connection: nothing waits on the proxy
      errors_text = open(os.path.join(workdir, f"host-{number}.err")).read()
      assert code in (0, -signal.SIGKILL), errors_text[-3000:]
      assert "records the store does not hold" not in errors_text, errors_text[-3000:]
      if end == "to_the_end":
        assert code == 0, errors_text[-3000:]
      results = [os.path.join(out, f"trained-{i}.json") for i in range(processes)]
      if all(os.path.exists(p) for p in results):
        parts = [json.load(open(p))["batches"] for p in results]
        assert len({len(p) for p in parts}) == 1, [len(p) for p in parts]
        trained.extend(batch for step in zip(*parts) for batch in step)
      # The copies no reader holds stay within max_bytes (a copy's worth of slack: a release and the
      # eviction it triggers are two steps, and the sampler may look between them).
      assert sampler.idle_peak <= max_bytes + 2 * entry, (sampler.idle_peak, max_bytes)
      proxy = _renewed(proxy, gcs_emulator, env)
  finally:
    proxy.stop()
  ids = [i for batch in trained for i in batch]
  counts = collections.Counter(ids)
  duplicates = sum(c - 1 for c in counts.values() if c > 1)
  skipped = _FILES * _PER_FILE - len(counts)
  downloads = collections.Counter(
      line for number in range(len(segments) + 1) for i in range(processes)
      for line in _lines(os.path.join(workdir, f"out-{number}", f"downloads-{i}.txt")))
  hypothesis.note(f"trained {len(ids)}, duplicates {duplicates}, skipped {skipped}, downloads per file "
                  f"{dict(downloads)}, copies altered on disk {corrupted}")
  assert duplicates == 0 and skipped == 0, (duplicates, skipped)
  if shuffle == "shards" and cache != "below_window" and corruption is None:
    # Each file once per host that reads it (a restart on the same host reads its cached copy), give or
    # take the next epoch's first window, prefetched at the end, and one copy more: on a loaded machine a
    # cache of exactly two windows shared by four processes was measured to evict a copy a slower process
    # still read and download it again (a known cost, not a loss: the counts above are exact).
    assert max(downloads.values(), default=0) <= len(segments) + 2, dict(downloads)


def _renewed(proxy, gcs_emulator, env):
  """A fresh proxy for the next host (a released one no longer stalls)."""
  import fault_proxy  # pylint: disable=g-import-not-at-top

  proxy.stop()
  fresh = fault_proxy.FaultProxy(gcs_emulator.url).start()
  env["STORAGE_EMULATOR_HOST"] = fresh.url
  return fresh


def _lines(path: str) -> list[str]:
  try:
    return open(path).read().split()
  except FileNotFoundError:
    return []


@hypothesis.settings(max_examples=1, deadline=None, suppress_health_check=list(hypothesis.HealthCheck),
                     derandomize=True)
@hypothesis.given(**_CASES)
@hypothesis.example(shuffle="shards", cache="two_windows", processes=4,
                    segments=[(3, "save_then_kill"), (2, "kill_mid_download")], corruption=None, suffix=".jsonl", named=False,
                    in_memory=True)
@hypothesis.example(shuffle="shards", cache="corpus", processes=2, segments=[(4, "save_then_kill")],
                    corruption="disk", suffix=".jsonl", named=False, in_memory=False)
@hypothesis.example(shuffle="global", cache="below_window", processes=2, segments=[(4, "save_then_kill")],
                    corruption=None, suffix=".jsonl", named=False, in_memory=False)
# Compressed shards (issue 64; `.jsonl.gz` among the drawn cases): decompressed into the cache as they arrive, checked against the compressed
# object's checksum (a bit flipped in transit: downloaded again), their copies sealed over the text.
@hypothesis.example(shuffle="shards", cache="two_windows", processes=2, segments=[(3, "kill_mid_download")],
                    corruption="transit", suffix=".jsonl.zst", named=False, in_memory=True)
# Files named by the corpus index (issue 65): each download checked against the checksum the index recorded, so a
# bit flipped in transit is still downloaded again, never trained.
@hypothesis.example(shuffle="shards", cache="corpus", processes=2, segments=[(3, "save_then_kill")],
                    corruption="transit", suffix=".jsonl.gz", named=True, in_memory=True)
def test_the_bucket_path_trains_every_record_once_and_only_the_store_s_bytes(
    corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes, segments, corruption, suffix, named,
    in_memory):
  _check_one_chain(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes, segments, corruption, suffix,
                   named, in_memory)


# Further chosen examples, kept out of make test's time (CI runs them in make test-heavy): a bit flipped in
# transit under plain JSONL, and a global shuffle over a cache altered on disk.
@pytest.mark.heavy
@hypothesis.settings(phases=[hypothesis.Phase.explicit], deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(**_CASES)
@hypothesis.example(shuffle="shards", cache="corpus", processes=2, segments=[(3, "save_then_kill")],
                    corruption="transit", suffix=".jsonl", named=False, in_memory=True)
@hypothesis.example(shuffle="global", cache="corpus", processes=2, segments=[(4, "save_then_kill")],
                    corruption="disk", suffix=".jsonl", named=False, in_memory=True)
def test_the_bucket_path_further_examples(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes,
                                          segments, corruption, suffix, named, in_memory):
  _check_one_chain(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes, segments, corruption, suffix,
                   named, in_memory)


@pytest.mark.slow
@hypothesis.settings(max_examples=12, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(**_CASES)
def test_the_bucket_path_property_long(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes,
                                       segments, corruption, suffix, named, in_memory):
  _check_one_chain(corpus, gcs_emulator, tmp_path_factory, shuffle, cache, processes, segments, corruption, suffix,
                   named, in_memory)
