"""gs:// faults and SIGKILL during async saves of states that carry skips and a mixture ledger (issue 48, item 7).

The run: process 0 of 1 of a weighted mixture of two sources (a ledger per
source) with two declared skip ranges (the fingerprint's `skips`), global
batch 4 (tests/workers/ledger_writer.py builds it). Each step saves the data
item and a params item with a real Orbax CheckpointManager, asynchronously,
into the GCS emulator. Whatever fails — a connection reset, a 503, a stalled
upload, a SIGKILL mid-save — the latest committed step restores exactly: the
resumed stream continues the uninterrupted one, with 0 duplicated and 0
skipped batches (counted against the reference run), and an uncommitted step
is never restored.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import errors

import ledger_writer
import support

PIPELINE = {"mixture": {"a": 2, "b": 1}, "skip": [[5, 9], [20, 22]]}
REQUEST_SECONDS, OPERATION_SECONDS = 1.0, 4.0
WITHIN_SECONDS = 30  # a stalled save fails within its bound plus cancellation, however loaded the machine
_WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "ledger_writer.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROCESS_TIMEOUT_S = 180


def _reference(length: int) -> list[list[int]]:
  iterator = ledger_writer.build_iterator(PIPELINE)
  return [support.batch_ids(next(iterator)) for _ in range(length)]


def _items(iterator, step: int) -> ocp.args.Composite:
  return ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator),
                            model=ocp.args.StandardSave({"w": np.full((4,), step, np.float32)}))


def _restore_latest(root: str) -> tuple[int, ckpt_iter.DataIterator]:
  """A fresh iterator restored from the latest committed step, as a restarted job does."""
  iterator = ledger_writer.build_iterator(PIPELINE)
  with ocp.CheckpointManager(root) as manager:
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(
        data=ckpt_iter.IteratorRestore(iterator), model=ocp.args.StandardRestore()))
  # Model and data state of one step: the params say which step they are.
  assert np.asarray(restored["model"]["w"]).tolist() == [step] * 4, (step, restored["model"])
  return step, iterator


def _error_chain(error: BaseException) -> list[BaseException]:
  chain = []
  while error is not None and len(chain) < 20:
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


# One fault per save, on one upload request (a simple upload names its object
# in its body): the data item's state file, Orbax's commit marker, the first
# upload of the save (Orbax's own metadata). The last, a stall of the data
# item's upload, is never answered: that save must fail.
_HEADER, _COMMIT = b"data/process_0-of-1.json", b"commit_success.txt"
FAULTS = [
    ("reset the state file", dict(action="reset", contains="/upload/", method="POST", body=_HEADER, times=1)),
    ("503 the state file", dict(action="status", contains="/upload/", method="POST", body=_HEADER, times=1)),
    ("reset the commit", dict(action="reset", contains="/upload/", method="POST", body=_COMMIT, times=1)),
    ("503 the first upload", dict(action="status", contains="/upload/", method="POST", times=1)),
    ("stall the state file", dict(action="stall", contains="/upload/", method="POST", body=_HEADER)),
]
RETRIED = [name for name, _ in FAULTS[:-1]]


def test_faults_during_async_saves_leave_the_last_committed_step_exact(proxy, gcs_root):
  """Steps 1-2 clean, then one save per fault; a fault the client retries commits its step, the
  stall fails the save within the bound (a typed timeout) and commits nothing; the latest committed step,
  read back through faults too (a reset and a 503 on reads), continues the reference stream."""
  reference = _reference(12)
  iterator = ledger_writer.build_iterator(PIPELINE)
  manager = ocp.CheckpointManager(gcs_root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
  trained, outcomes = [], {}
  for step in (1, 2):
    trained.append(support.batch_ids(next(iterator)))
    manager.save(step, args=_items(iterator, step))
  manager.wait_until_finished()
  step = 2
  for name, rule in FAULTS:
    step += 1
    trained.append(support.batch_ids(next(iterator)))
    proxy.add(**rule)
    started = time.monotonic()
    try:
      manager.save(step, args=_items(iterator, step))
      manager.wait_until_finished()
      outcomes[name] = "committed"
    except Exception as e:  # pylint: disable=broad-except
      outcomes[name] = e
    seconds = time.monotonic() - started
    proxy.clear()
    assert seconds < WITHIN_SECONDS, (name, seconds)
    assert any(hit[0] == rule["action"] for hit in proxy.hits), (name, proxy.hits)
    proxy.hits.clear()
    if not isinstance(outcomes[name], str):
      break  # a failed async save: the job ends here, as a trainer's does
  assert [outcomes[name] for name in RETRIED] == ["committed"] * len(RETRIED), outcomes
  stalled = outcomes[FAULTS[-1][0]]
  assert not isinstance(stalled, str), outcomes
  assert any(isinstance(e, errors.StorageTimeoutError) for e in _error_chain(stalled)), [
      repr(e)[:300] for e in _error_chain(stalled)]
  # Orbax's own writes of the failed step are not bounded by ckpt_iter: released here, they end.
  proxy.release()
  try:
    manager.close()
  except Exception:  # pylint: disable=broad-except
    pass  # the failed save's error again

  with ocp.CheckpointManager(gcs_root) as fresh:
    last = 2 + len(RETRIED)
    assert fresh.all_steps() == list(range(1, last + 1)), fresh.all_steps()  # the stalled step: never committed
  proxy.add("reset", ".json", method="GET", times=1)
  proxy.add("status", "process_0-of-1", method="GET", status=503, times=1)
  restored_step, resumed = _restore_latest(gcs_root)
  assert restored_step == last
  assert {hit[0] for hit in proxy.hits} == {"reset", "status"}, proxy.hits
  stream = trained[:restored_step] + [support.batch_ids(next(resumed)) for _ in range(len(reference) - restored_step)]
  assert trained == reference[:len(trained)]
  assert stream == reference  # 0 duplicates, 0 skips


# ---------------------------------------------------------------------------
# SIGKILL during async saves (real processes, the emulator directly).


def _start(tmp_path, root: str, index: int, **config) -> tuple[subprocess.Popen, str]:
  log = str(tmp_path / f"segment_{index}.log")
  path = tmp_path / f"segment_{index}.json"
  path.write_text(json.dumps({"root": root, "log": log, "steps": 40, "seconds": 60, "async": True, "model": True,
                              "sleep_s": 0.02, "pipeline": PIPELINE, **config}))
  # stderr to a file: the store client's warnings would fill a pipe nobody reads, and block the writer.
  with open(tmp_path / f"segment_{index}.err", "w") as err:
    process = subprocess.Popen([sys.executable, _WORKER, str(path)], stdout=subprocess.PIPE, stderr=err,
                               text=True, cwd=_REPO)
  return process, log


def _stderr(log: str) -> str:
  with open(log[:-len(".log")] + ".err") as f:
    return f.read()[-3000:]


def _lines(log: str) -> list[list[str]]:
  if not os.path.exists(log):
    return []
  with open(log) as f:
    return [line.split(" ") for line in f.read().split("\n")[:-1]]  # a line cut by the kill is dropped


def _wait_for_saves(process: subprocess.Popen, log: str, count: int) -> None:
  deadline = time.monotonic() + _PROCESS_TIMEOUT_S
  while sum(1 for line in _lines(log) if line[0] == "S") < count:
    assert process.poll() is None, _stderr(log)
    assert time.monotonic() < deadline, "the writer never saved"
    time.sleep(0.01)


def _stitch(stream: list[list[int]], lines: list[list[str]]) -> dict:
  """Adds one segment's log to the run's stream (a restore drops the batches after its step)."""
  seen: dict = {"restored": None, "killed_in_write": None}
  for line in lines:
    if line[0] == "R":
      seen["restored"] = restored = int(line[1])
      assert restored <= len(stream), (restored, len(stream))
      del stream[restored:]
    elif line[0] == "S":
      assert int(line[1]) == len(stream) + 1, (line, len(stream))
      stream.append([int(v) for v in line[2].split(",")])
    elif line[0] == "W":
      seen["killed_in_write"] = int(line[1])
  return seen


# In make test-full only: it failed once in five runs of the integration tier on a loaded machine
# (passing alone and in the other runs); not yet explained, so kept out of CI's tiers.
@pytest.mark.slow
def test_sigkill_during_async_gs_saves_restores_the_last_committed_step_exactly(gcs_root, tmp_path):
  """One process SIGKILLed at a seeded moment while its async saves run (one in flight), one that kills
  itself inside a step's data write (files written, the Orbax commit not), then a restore here: each
  restore is of the last committed step (never the torn one), and the stitched stream equals the
  uninterrupted run's: 0 duplicated, 0 skipped batches."""
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top
  from ckpt_iter.cli import _inspect as inspection  # pylint: disable=g-import-not-at-top

  stream: list[list[int]] = []
  first, log = _start(tmp_path, gcs_root, 0)
  try:
    assert first.stdout.readline().strip() == "ready", _stderr(log)
    _wait_for_saves(first, log, 3 + random.Random(48).randrange(4))
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=_PROCESS_TIMEOUT_S) == -signal.SIGKILL
  finally:
    first.kill()
    first.communicate()
  seen = _stitch(stream, _lines(log))
  assert seen["restored"] == 0 and len(stream) >= 3

  # The second process restores what the kill left committed and dies inside its 3rd step's write.
  # Listed as the CLI lists (an Orbax manager here would cache the listing in this process's gcsfs).
  committed = max(inspection.step_directories(gcs_root), default=None)
  assert committed is not None and committed <= len(stream)
  second, log = _start(tmp_path, gcs_root, 1, kill_in_write=committed + 3)
  try:
    code = second.wait(timeout=_PROCESS_TIMEOUT_S)
    assert code == -signal.SIGKILL, (code, _stderr(log))
  finally:
    second.kill()
    second.communicate()
  seen = _stitch(stream, _lines(log))
  assert seen["restored"] == committed, seen
  assert seen["killed_in_write"] == committed + 3, seen

  restored, resumed = _restore_latest(gcs_root)
  assert restored == committed + 2, (restored, committed)  # the step killed in its write was never committed
  del stream[restored:]
  reference = _reference(restored + 8)
  stream += [support.batch_ids(next(resumed)) for _ in range(8)]
  trained, expected = collections.Counter(map(tuple, stream)), collections.Counter(map(tuple, reference))
  assert (sum((trained - expected).values()), sum((expected - trained).values())) == (0, 0)  # duplicated, skipped
  assert stream == reference, "the stitched stream differs from the uninterrupted run"
  # The chain the kept steps record is proven, at gs:// too.
  assert cli.main(["audit", gcs_root]) == cli.EXIT_OK
