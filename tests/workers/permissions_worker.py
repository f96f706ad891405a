"""Reads and writes a checkpoint root as whichever user runs it (tests/integration/test_permissions.py).

    python permissions_worker.py MODE ROOT SOURCE [STEP]

SOURCE: a JSONL file (large enough that its line index would be cached);
the pipeline: make_dataset(SOURCE, batch_size=4, seed=5, num_epochs=None,
skip=[(5, 9), (20, 22)]). Modes (one JSON line on stdout):
  save N     a fresh run: saves steps 1..N (Orbax, async) -> {"batches": [...]}
  restore    restores the latest step, reads 6 batches -> {"step", "batches"}
  save_more  restores the latest step, reads one batch and saves the next step
             -> {"error": type, "message"} (or {"saved": step})
"""

from __future__ import annotations

import json
import os
import sys

import orbax.checkpoint as ocp

import ckpt_iter


def _iterator(source: str) -> ckpt_iter.DataIterator:
  return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      source, batch_size=4, seed=5, num_epochs=None, shard_index=0, shard_count=1, skip=[(5, 9), (20, 22)]))


def _ids(batch) -> list[int]:
  return [int(v) for v in batch["id"]]


def _restore(root: str, iterator) -> int:
  with ocp.CheckpointManager(root) as manager:  # as a trainer opens it: not read_only
    step = manager.latest_step()
    manager.restore(step, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
  return step


def main() -> None:
  mode, root, source = sys.argv[1:4]
  iterator = _iterator(source)
  if mode == "save":
    batches = []
    with ocp.CheckpointManager(root) as manager:
      for step in range(1, int(sys.argv[4]) + 1):
        batches.append(_ids(next(iterator)))
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
    print(json.dumps({"batches": batches}))
  elif mode == "restore":
    step = _restore(root, iterator)
    print(json.dumps({"step": step, "batches": [_ids(next(iterator)) for _ in range(6)]}))
  elif mode == "save_more":
    step = _restore(root, iterator)
    next(iterator)
    try:
      with ocp.CheckpointManager(root) as manager:
        manager.save(step + 1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
        manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
      # Orbax's own threads of the failed save wait for the signal of the step directory it could
      # not create, 300 s, holding the interpreter's exit (a save of params alone does the same):
      # a job ends here, now.
      os._exit(0)  # pylint: disable=protected-access
    print(json.dumps({"saved": step + 1}))
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main()
