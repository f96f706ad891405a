"""One process of tests/integration/test_bucket_cache.py: read gs:// JSONL through a shard cache.

    python bucket_cache_worker.py CONFIG.json

CONFIG: {"source": a gs:// glob, "cache_dir": the shard cache, "root": a local
checkpoint root, "mode": "save" or "restore", "save_step": K, "kill_after": k,
"seed": the shuffle seed or null, "out": a local JSON-lines file, optionally
"files_from_index": the source's files named by the corpus index}.

A save run takes K batches, checkpoints the data iterator at K, takes k more
(each written to "out" as it comes) and kills itself with SIGKILL, in the
middle of a file. A restore run restores the latest step in this fresh
process and reads to the end, writing each batch.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH_SIZE = 8


def main(config_path: str) -> int:
  with open(config_path) as f:
    config = json.load(f)
  source = sources.JsonlSource(config["source"], cache=sources.ShardCache(config["cache_dir"], 2**30),
                               files_from_index=config.get("files_from_index", False))
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      source, batch_size=BATCH_SIZE, seed=config["seed"], num_epochs=1))
  manager = ocp.CheckpointManager(config["root"])
  with open(config["out"], "a") as out:
    def write(batch):
      out.write(json.dumps(np.asarray(batch["id"]).tolist()) + "\n")
      out.flush()

    if config["mode"] == "save":
      for _ in range(config["save_step"]):
        next(iterator)
      manager.save(config["save_step"], args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
      for _ in range(config["kill_after"]):
        write(next(iterator))
      os.kill(os.getpid(), signal.SIGKILL)
    step = manager.latest_step()
    manager.restore(step, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
    out.write(json.dumps({"restored": step}) + "\n")
    for batch in iterator:
      write(batch)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
