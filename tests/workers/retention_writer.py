"""A training root's writer for tests/robustness/test_live_root.py: saves fast, keeps few.

    python retention_writer.py ROOT STEPS MAX_SECONDS MAX_TO_KEEP

Saves a RepeatIterator data item (pending arrays included) at every step
through an Orbax CheckpointManager with `max_to_keep`, until STEPS steps are
saved or MAX_SECONDS have passed, so Orbax's retention deletes a step about
as often as one is saved while a reader lists and reads the root. Prints
`ready` once the first step is committed and `steps <n>` at the end.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter


def _produce(batch: dict) -> dict:
  return {"x": batch["x"], "y": np.ones(64, np.float32)}


def main() -> None:
  root, steps, seconds, max_to_keep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
  dataset = ckpt_iter.make_dataset([{"x": i} for i in range(1000)], batch_size=2, seed=3, num_epochs=None,
                                   shard_index=0, shard_count=1)
  iterator = ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset), produce=_produce, num_repeats=2,
                                      group_size=3, shuffle_seed=7)
  manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))
  step = 0
  end = None
  while end is None or (step < steps and time.monotonic() < end):
    next(iterator)
    manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    if end is None:
      manager.wait_until_finished()
      print("ready", flush=True)
      end = time.monotonic() + seconds
    step += 1
  manager.wait_until_finished()
  manager.close()
  print(f"steps {step}", flush=True)


if __name__ == "__main__":
  main()
