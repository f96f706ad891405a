"""Training process for tests/integration/test_crash.py: trains, checkpoints every step, dies.

One *segment* is one training process: it restores the latest step its
`ocp.CheckpointManager` reports (model params + a RepeatIterator data item),
then trains one RepeatIterator element per step and saves every step with an
async save in flight, until it is killed. It records what it did in its own
log, one line per event, each appended and fsynced before the next action:

  R <restored_step> <params.count> <params.checksum>   after the restore
  S <step> <ids,...> <noise hex,...>                   element trained at <step>
  W <step> <item directory>                            about to SIGKILL itself
  D <last_step>                                        finished normally

Two ways to run segments:

  python crash_worker.py segment CONFIG.json INDEX
      One segment in a fresh interpreter (the test kills it from outside).
  python crash_worker.py zygote CONFIG.json
      Imports jax/orbax/ckpt_iter once and forks one child per planned segment,
      killing each with SIGKILL at its planned moment. The zygote initialises
      no JAX backend and starts no thread before forking, so every child starts
      from a clean state and pays only for its own work (~0.2 s, not ~2 s).
      Prints a JSON summary of how each segment ended.

CONFIG holds the pipeline (records, batch_size, data_seed, group_size,
num_repeats, shuffle_seed), the checkpoint and log directories, and the plan:
a list of segments, each {"kind": "time", "delay_s": float, "after": "start"
or "restore"} (killed from outside delay_s after it started or after it logged
its restore), {"kind": "in_write", "after_steps": int} (kills itself
in the background write of the data item of step restored + after_steps,
after its files are written and before Orbax commits the step) or
{"kind": "finish", "steps": int}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _files

# Steps a killed segment would run if nobody killed it: far more than fit in
# its kill delay, so a "time" segment always ends by SIGKILL.
_UNBOUNDED_STEPS = 100_000


def build_iterator(config: dict, produce) -> ckpt_iter.RepeatIterator:
  records = [{"x": i} for i in range(config["records"])]
  dataset = ckpt_iter.make_dataset(
      records, batch_size=config["batch_size"], seed=config["data_seed"],
      num_epochs=None, shard_index=0, shard_count=1,
  )
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(dataset), produce=produce,
      num_repeats=config["num_repeats"], group_size=config["group_size"],
      shuffle_seed=config["shuffle_seed"],
  )


def rollout(batch: dict) -> dict:
  """A stand-in for a rollout: the ids plus noise no other process can redo.

  Fresh OS entropy per call: if a restore regenerated a pending item instead
  of loading it, its repeats would carry different noise.
  """
  ids = np.asarray(batch["x"])
  return {"ids": ids, "noise": np.random.default_rng().random(ids.shape)}


class _Log:
  """Appends lines to the segment log, each fsynced before returning."""

  def __init__(self, path: str):
    self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

  def line(self, text: str) -> None:
    os.write(self._fd, (text + "\n").encode())
    os.fsync(self._fd)


def _kill_in_write(log: _Log, target_step: int) -> None:
  """Makes the data item's background write of `target_step` end in SIGKILL."""
  original = _files.write_files

  def write_files(directory, header, arrays, **kwargs):
    original(directory, header, arrays, **kwargs)
    # directory is <root>/<step-dir>/data; the step comes from the step dir,
    # not from the training loop, which has already moved on.
    step_dir = os.path.basename(os.path.dirname(os.fspath(directory)))
    step = int(step_dir.split(".")[0])
    if step == target_step:
      log.line(f"W {step} {os.fspath(directory)}")
      os.kill(os.getpid(), signal.SIGKILL)

  _files.write_files = write_files


def run_segment(config: dict, index: int) -> int:
  entry = config["plan"][index]
  log = _Log(log_path(config, index))
  iterator = build_iterator(config, rollout)
  manager = ocp.CheckpointManager(
      config["ckpt_dir"],
      options=ocp.CheckpointManagerOptions(
          max_to_keep=None, save_interval_steps=1, enable_async_checkpointing=True,
      ),
  )
  params = {"count": jnp.zeros((), jnp.int32), "checksum": jnp.zeros((), jnp.int32)}
  restored_step = manager.latest_step()
  if restored_step is not None:
    restored = manager.restore(restored_step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        data=ckpt_iter.IteratorRestore(iterator),
    ))
    params = restored["params"]
  else:
    restored_step = 0
  log.line(f"R {restored_step} {int(params['count'])} {int(params['checksum'])}")
  if entry["kind"] == "in_write":
    _kill_in_write(log, restored_step + entry["after_steps"])
  steps = entry["steps"] if entry["kind"] == "finish" else _UNBOUNDED_STEPS
  step = restored_step
  for step in range(restored_step + 1, restored_step + steps + 1):
    item = next(iterator)
    ids = ",".join(str(int(i)) for i in item["ids"])
    noise = ",".join(float(v).hex() for v in item["noise"])
    log.line(f"S {step} {ids} {noise}")
    params = {
        "count": params["count"] + 1,
        "checksum": params["checksum"] + int(item["ids"].sum()),
    }
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator),
    ))
  manager.wait_until_finished()
  manager.close()
  log.line(f"D {step}")
  return 0


def _child(config: dict, index: int) -> None:
  """Runs one segment in a forked child; never returns into the zygote."""
  code = 3
  try:
    code = run_segment(config, index)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def _wait(pid: int, deadline: float, until=lambda: False) -> int | None:
  """Waits for `pid` until `deadline` or `until()`; returns its wait status or None."""
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return status
    if time.monotonic() >= deadline or until():
      return None
    time.sleep(0.005)


def log_path(config: dict, index: int) -> str:
  return os.path.join(config["log_dir"], f"segment_{index:03d}.log")


def has_restored(config: dict, index: int) -> bool:
  """Whether segment `index` has logged its restore (and now trains)."""
  try:
    with open(log_path(config, index), "rb") as f:
      return f.read(2) == b"R "
  except FileNotFoundError:
    return False


def _describe(status: int | None) -> str:
  if status is None:
    return "timeout"
  if os.WIFSIGNALED(status):
    return f"signal:{os.WTERMSIG(status)}"
  return f"exit:{os.WEXITSTATUS(status)}"


def zygote(config: dict) -> dict:
  outcomes = []
  for index, entry in enumerate(config["plan"]):
    pid = os.fork()
    if pid == 0:
      _child(config, index)
    started = time.monotonic()
    timeout = config["segment_timeout_s"]
    if entry["kind"] == "time":
      status = None
      if entry.get("after") == "restore":
        status = _wait(pid, started + timeout, until=lambda: has_restored(config, index))
        started = time.monotonic()
      if status is None:
        status = _wait(pid, started + entry["delay_s"])
      if status is None:
        os.kill(pid, signal.SIGKILL)
        status = _wait(pid, time.monotonic() + timeout)
        # Only a death by this SIGKILL counts as the planned kill.
        killed = status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        outcome = "killed" if killed else _describe(status)
      else:
        outcome = _describe(status)  # died or finished before its kill: a failure
    else:
      status = _wait(pid, started + timeout)
      outcome = _describe(status)
    if status is None:  # hung: reap it, never leave it behind
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
    outcomes.append({"outcome": outcome, "tmp_dirs": tmp_dirs(config["ckpt_dir"])})
  return {"outcomes": outcomes}


def tmp_dirs(ckpt_dir: str) -> dict[str, dict[str, list[str]]]:
  """Orbax tmp step dirs left in `ckpt_dir`: item dir name -> its files.

  Taken right after a segment ends: the next segment that saves the same step
  replaces the tmp dir.
  """
  found = {}
  for name in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []:
    step_dir = os.path.join(ckpt_dir, name)
    if "orbax-checkpoint-tmp" in name and os.path.isdir(step_dir):
      found[name] = {
          item: sorted(os.listdir(os.path.join(step_dir, item)))
          for item in sorted(os.listdir(step_dir))
          if os.path.isdir(os.path.join(step_dir, item))
      }
  return found


def main(argv: list[str]) -> int:
  mode, config_path = argv[1], argv[2]
  with open(config_path) as f:
    config = json.load(f)
  if mode == "segment":
    return run_segment(config, int(argv[3]))
  if mode == "zygote":
    print(json.dumps(zygote(config)), flush=True)
    return 0
  raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  sys.exit(main(sys.argv))
