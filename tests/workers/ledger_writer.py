"""A training process whose data state carries skips and a mixture ledger, saved by a real Orbax manager.

    python ledger_writer.py CONFIG.json

CONFIG: {"root": local path or gs://..., "log": file, "steps": N, "seconds": S,
"max_to_keep": K or null, "async": bool, "sleep_s": pause after each save,
"pipeline": {"mixture": {...} or null, "skip": [[a, b], ...], "seed": int (default 5)},
"kill_in_write": step or null, "restore": false to start afresh whatever the root holds,
"model": bool (a params item beside the data item, as a trainer saves: {"w": step, "job": seed})}.

Restores the latest step of the root when there is one (the same pipeline),
then reads one global batch per step and saves it as step `restored + k`
(k = 1, 2, ...) with the previous async save possibly in flight, until N
steps are saved or S seconds have passed. The log gets a line per event,
each written whole before the event it announces:
    R <step>                the step it restored (0: none)
    S <step> <id,id,...>    the batch read before saving <step>
    W <step>                about to SIGKILL itself inside <step>'s data write
    D <steps saved>         finished
`kill_in_write`: the process kills itself with SIGKILL in the data item's
write of that step, once its files are written and before Orbax commits.
Prints `ready` once the first step it saves is committed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import skips as skips_lib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import support  # pylint: disable=g-import-not-at-top,wrong-import-position


def build_iterator(pipeline: dict) -> ckpt_iter.DataIterator:
  """The run's input: process 0 of 1, global batch 4, over support.CHAIN_* (a mixture or 4 epochs)."""
  skip = skips_lib.Skip(records=tuple(tuple(r) for r in pipeline.get("skip") or ()))
  return ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 4, seed=pipeline.get("seed", 5), skip=skip or None,
                                                      mixture=pipeline.get("mixture")))


class _Log:
  def __init__(self, path: str):
    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

  def line(self, text: str) -> None:
    os.write(self._fd, (text + "\n").encode())  # one write: whole, or cut by the kill and dropped


def _kill_in_write(log: _Log, root: str, step: int) -> None:
  original = _files.write_files

  def write_files(directory, header, arrays, **kwargs):
    original(directory, header, arrays, **kwargs)
    if os.fspath(directory).rstrip("/").split("/")[-2].split(".")[0] == str(step):
      log.line(f"W {step}")
      os.kill(os.getpid(), signal.SIGKILL)

  _files.write_files = write_files


def main() -> None:
  with open(sys.argv[1]) as f:
    config = json.load(f)
  root, log = config["root"], _Log(config["log"])
  iterator = build_iterator(config["pipeline"])
  options = ocp.CheckpointManagerOptions(max_to_keep=config.get("max_to_keep"),
                                         enable_async_checkpointing=config.get("async", True))
  manager = ocp.CheckpointManager(root, options=options)
  restored = (manager.latest_step() or 0) if config.get("restore", True) else 0
  if restored:
    items = {"data": ckpt_iter.IteratorRestore(iterator)}
    if config.get("model"):
      items["model"] = ocp.args.StandardRestore()
    manager.restore(restored, args=ocp.args.Composite(**items))
  log.line(f"R {restored}")
  if config.get("kill_in_write") is not None:
    _kill_in_write(log, root, config["kill_in_write"])
  end = time.monotonic() + config.get("seconds", 60)
  step = restored
  while step - restored < config["steps"] and time.monotonic() < end:
    ids = support.batch_ids(next(iterator))
    step += 1
    log.line(f"S {step} {','.join(map(str, ids))}")
    items = {"data": ckpt_iter.IteratorSave(iterator)}
    if config.get("model"):
      items["model"] = ocp.args.StandardSave({"w": np.full((4,), step, np.float32),
                                              "job": np.int32(config["pipeline"].get("seed", 5))})
    manager.save(step, args=ocp.args.Composite(**items))
    if step == restored + 1:
      manager.wait_until_finished()
      print("ready", flush=True)
    if config.get("sleep_s"):
      time.sleep(config["sleep_s"])
  manager.wait_until_finished()
  manager.close()
  log.line(f"D {step - restored}")
  print(f"steps {step - restored}", flush=True)


if __name__ == "__main__":
  main()
