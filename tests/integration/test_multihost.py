"""Several JAX processes: exact and elastic resume through one Orbax step.

Each run launches real processes (tests/workers/multihost_worker.py) that join a
`jax.distributed` job on 127.0.0.1 with the CPU backend, iterate their shard
of make_dataset pipelines, and save or restore ONE CheckpointManager step
holding sharded params and the iterators. A save run reads to the end after
saving, so it is also the uninterrupted run the restores are compared with.
Runs are shared across tests (module-scoped cache) to keep the file fast.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import multihost_worker as worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import process_group  # pylint: disable=g-import-not-at-top,wrong-import-position

WORKER = Path(__file__).resolve().parent.parent / "workers" / "multihost_worker.py"
RUN_TIMEOUT_SECONDS = 150
BATCHES_PER_EPOCH = worker.NUM_RECORDS // worker.GLOBAL_BATCH_SIZE

# Jobs of 4 processes are the long variants (`make test-full`); the default
# run keeps an exact 2 -> 2 and an elastic 1 -> 2 and 2 -> 1 resume.
_SLOW = pytest.mark.slow


def _params(cases, ids):
  return [
      pytest.param(*case, id=case_id, marks=_SLOW if 4 in case else ())
      for case, case_id in zip(cases, ids)
  ]


EXACT = _params([(2,), (4,)], ["2", "4"])
ELASTIC_CASES = ((1, 2), (2, 1), (2, 4), (4, 2), (4, 1))
ELASTIC = _params(ELASTIC_CASES, [f"{n}to{m}" for n, m in ELASTIC_CASES])


def _launch(directory: Path, name: str, num_processes: int, *, mode: str,
            ckpt_dir: Path, elastic: bool = False) -> list[dict]:
  """Runs one job of `num_processes` workers to completion; returns their outputs."""
  config = {"ckpt_dir": str(ckpt_dir), "mode": mode, "elastic": elastic}
  return process_group.run_group(
      WORKER, directory, name, [config] * num_processes, timeout_seconds=RUN_TIMEOUT_SECONDS
  )


class Runs:
  """Save and restore jobs, each run once per module."""

  def __init__(self, directory: Path):
    self._directory = directory
    self._saves: dict[int, list[dict]] = {}
    self._restores: dict[tuple[int, int], list[dict]] = {}

  def save(self, n: int) -> list[dict]:
    if n not in self._saves:
      self._saves[n] = _launch(self._directory, f"save{n}", n, mode="save", ckpt_dir=self.ckpt_dir(n))
    return self._saves[n]

  def ckpt_dir(self, n: int) -> Path:
    return self._directory / f"ckpt_from_{n}"

  def restore(self, n: int, m: int) -> list[dict]:
    """Restores the step saved by n processes with m. Elastic unless n == 2 == m;
    n == m == 4 is an elastic restore with the saved count (an exact one)."""
    if (n, m) not in self._restores:
      self.save(n)
      self._restores[(n, m)] = _launch(
          self._directory, f"restore{n}to{m}", m, mode="restore",
          ckpt_dir=self.ckpt_dir(n), elastic=not n == m == 2,
      )
    return self._restores[(n, m)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
  return Runs(tmp_path_factory.mktemp("multihost"))


def _global(results: list[dict], field: str) -> list[dict]:
  """Step t's global item: the processes' rows concatenated in process order."""
  lengths = {len(r[field]) for r in results}
  assert len(lengths) == 1, f"processes took different step counts for {field}: {lengths}"
  steps = []
  for t in range(lengths.pop()):
    merged = collections.defaultdict(list)
    for r in results:
      for key, rows in r[field][t].items():
        merged[key].extend(rows)
    steps.append(dict(merged))
  return steps


def _without_tag(items: list[dict]) -> list[dict]:
  return [{k: v for k, v in item.items() if k != "tag"} for item in items]


# ---------------------------------------------------------------------------
# The save runs themselves: default sharding reads this process's rows.


@pytest.mark.parametrize("n", _params([(1,), (2,), (4,)], ["1", "2", "4"]))
def test_each_process_reads_its_rows_of_each_global_batch(runs, n):
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  results = runs.save(n)
  for index, result in enumerate(results):
    assert result["process_index"] == index and result["process_count"] == n
    assert result["batch_size"] == worker.GLOBAL_BATCH_SIZE // n
    expected = [
        {"id": batch["id"].tolist()}
        for batch in ckpt_iter.DataIterator(ckpt_iter.make_dataset(
            worker.records(), batch_size=worker.GLOBAL_BATCH_SIZE // n, seed=7,
            num_epochs=worker.NUM_EPOCHS, shard_index=index, shard_count=n))
    ]
    assert result["data_before"] + result["data_after"] == expected
  batches = _global(results, "data_before") + _global(results, "data_after")
  _assert_exactly_once_per_epoch(batches)


def _assert_exactly_once_per_epoch(global_batches: list[dict]) -> None:
  assert len(global_batches) == BATCHES_PER_EPOCH * worker.NUM_EPOCHS
  for epoch in range(worker.NUM_EPOCHS):
    ids = [
        i for batch in global_batches[epoch * BATCHES_PER_EPOCH:(epoch + 1) * BATCHES_PER_EPOCH]
        for i in batch["id"]
    ]
    duplicated = sorted(i for i, c in collections.Counter(ids).items() if c > 1)
    missing = sorted(set(range(worker.NUM_RECORDS)) - set(ids))
    assert not duplicated and not missing, f"epoch {epoch}: duplicated {duplicated}, missing {missing}"


# ---------------------------------------------------------------------------
# Same process count: every process continues exactly.


@pytest.mark.parametrize("n", EXACT)
def test_same_process_count_resumes_exactly_on_every_process(runs, n):
  saved, restored = runs.save(n), runs.restore(n, n)
  for index, (before, after) in enumerate(zip(saved, restored)):
    assert after["process_index"] == index
    assert after["params_ok"], f"process {index}: params differ after restore"
    assert after["errors"] == {}
    assert after["data_after"] == before["data_after"], f"process {index}: data"
    assert after["filtered_after"] == before["filtered_after"], f"process {index}: filtered"
    # Pending repeats bit for bit from the checkpoint (tag of the save run),
    # then new groups produced by the resumed run.
    assert _without_tag(after["repeat_after"]) == _without_tag(before["repeat_after"])
    pending = before["pending_at_save"]
    assert pending > 0
    tags = [item["tag"][0] for item in after["repeat_after"]]
    assert tags == [worker.SAVE_TAG] * pending + [worker.RESTORE_TAG] * (len(tags) - pending)


@pytest.mark.parametrize("n", EXACT)
def test_a_pods_save_records_that_its_processes_agreed_through_the_jobs_store(runs, n):
  """The job's own key-value store carried each process's verdict to process 0 (`_pod_exchange.share_arrays`): the
  items of make_dataset states record agreement in process 0's header; the per-process filter's, which cannot
  be resized, do not."""
  import json  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top

  runs.save(n)
  recorded = {path.parent.name: _files.agreed_in(json.loads(path.read_text()), str(path))
              for path in runs.ckpt_dir(n).rglob(f"process_0-of-{n}.json")}
  assert {"data", "repeat", "lanes", "filtered"} <= set(recorded)
  assert all(recorded[name] is not None for name in ("data", "repeat", "lanes")), recorded
  assert recorded["filtered"] is None


# ---------------------------------------------------------------------------
# Another process count: the global batches and pending repeats stay the same.


@pytest.mark.parametrize("n,m", ELASTIC)
def test_elastic_resume_keeps_every_global_batch(runs, n, m):
  saved, restored = runs.save(n), runs.restore(n, m)
  assert [r["batch_size"] for r in restored] == [worker.GLOBAL_BATCH_SIZE // m] * m
  assert all(r["params_ok"] for r in restored)
  # Same rows in the same order, whichever process now holds them.
  assert _global(restored, "data_after") == _global(saved, "data_after")
  _assert_exactly_once_per_epoch(_global(saved, "data_before") + _global(restored, "data_after"))


@pytest.mark.parametrize("n,m", ELASTIC)
def test_elastic_resume_mid_repeat_trains_the_same_pending_items(runs, n, m):
  saved, restored = runs.save(n), runs.restore(n, m)
  pending = saved[0]["pending_at_save"]
  assert pending > 0 and {r["pending_at_save"] for r in saved} == {pending}
  expected = _global(saved, "repeat_after")
  got = _global(restored, "repeat_after")
  assert _without_tag(got) == _without_tag(expected)
  # The pending items come from the checkpoint, produced by the N-process run;
  # only the groups after them are produced by the M processes.
  for t, item in enumerate(got):
    want = worker.SAVE_TAG if t < pending else worker.RESTORE_TAG
    assert set(item["tag"]) == {want}, f"global item {t}: tags {item['tag']}"
  # Every element of a group is trained num_repeats times, across the resume.
  before = _global(saved, "repeat_before")
  counts = collections.Counter(i for item in before + got for i in item["id"])
  assert set(counts.values()) == {worker.NUM_REPEATS}
  assert sorted(counts) == list(range(worker.NUM_RECORDS))


@pytest.mark.parametrize("n,m", ELASTIC)
def test_elastic_resume_refuses_a_per_process_filter(runs, n, m):
  for result in runs.restore(n, m):
    error = result["errors"]["filtered"]
    assert error["type"] == "UnsupportedConfigError"
    assert "FilterMapDataset" in error["message"]
    assert f"Restore with {n} processes" in error["message"]
    # Refused before anything moved: no silent restart, no partial restore.
    assert result["filtered_position_after_error"] == {"next_record": 0}


@pytest.mark.parametrize("n,m", ELASTIC)
def test_plain_restore_with_another_process_count_raises(runs, n, m):
  for result in runs.restore(n, m):
    error = result["errors"]["data_plain"]
    assert error["type"] == "ProcessCountError"
    assert f"written by {n} process(es)" in error["message"]
    assert f"this run has {m}" in error["message"]
    assert "elastic=True" in error["message"]


def _lane_oracle(segments):
  """The global batches of the lanes pipeline: each lane's rows from an uninterrupted
  single-process run (one row per lane and batch), G / num_lanes rows per lane and batch."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  lanes = [[] for _ in range(worker.NUM_LANES)]
  iterator = ckpt_iter.DataIterator(worker.lanes_dataset(worker.NUM_LANES, 0, 1))
  for _ in range(sum(g // worker.NUM_LANES * count for g, count in segments)):
    for lane, row in enumerate(next(iterator)["ids"].tolist()):
      lanes[lane].append(row)
  batches, taken = [], 0
  for global_batch, count in segments:
    rows = global_batch // worker.NUM_LANES
    for _ in range(count):
      batches.append([row for lane in lanes for row in lane[taken:taken + rows]])
      taken += rows
  return batches


@pytest.mark.parametrize("n,m", ELASTIC)
def test_filtered_and_packed_lanes_resume_with_another_process_count_and_global_batch(runs, n, m):
  saved, restored = runs.save(n), runs.restore(n, m)
  before = [step["ids"] for step in _global(saved, "lanes_before")]
  uninterrupted = before + [step["ids"] for step in _global(saved, "lanes_after")]
  assert uninterrupted == _lane_oracle([(worker.GLOBAL_BATCH_SIZE, len(uninterrupted))])
  after = [step["ids"] for step in _global(restored, "lanes_after")]
  assert before + after == _lane_oracle(
      [(worker.GLOBAL_BATCH_SIZE, worker.SAVE_AFTER["lanes"]), (worker.LANES_RESTORE_BATCH, worker.LANES_AFTER)])
