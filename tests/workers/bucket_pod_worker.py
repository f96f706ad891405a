"""One host of tests/integration/test_bucket_property.py: P processes in step sharing one shard cache.

    python bucket_pod_worker.py CONFIG.json

CONFIG: {"source": gs:// JSONL URLs, "cache_dir", "max_bytes", "root" (local checkpoint root),
"processes": P, "shuffle": "shards" or "global", "window", "steps": batches to train before the save,
"extra": batches read after the save before the host is killed (null: read to the end, no save; 0: exit
after the save), "out": a directory for what each process read}; for a host of a pod (one cache per host),
optionally "shard_offset" (its first process's index in the pod), "shard_count" (the pod's processes),
"lanes" (make_dataset's shard_lanes) and "global_batch"; and "files_from_index" (the source names its
files from the corpus index). A pod's step is marked committed by the test, once every host saved.

Each process builds make_dataset(JsonlSource(source, cache=ShardCache(cache_dir, max_bytes)),
shard_index=i, shard_count=P), restores the latest committed step (a step whose every process saved:
process 0 marks it, as Orbax's commit does), and reads in step with the others (a barrier per batch,
as a training step's collective). Every record read is compared with what the store holds (its text is
a function of its id): a corrupted byte trained shows there. Each process writes
`trained-<i>.json` (the batches up to the save, or to the end), `discarded-<i>.json` (read after the
save: the next host repeats them from the checkpoint) and `downloads-<i>.txt` (one line per completed download).
With `extra` set, the host then waits to be killed (SIGKILL from the test).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

BATCH_SIZE = 2
SEED = 3


def expected_text(record_id: int) -> str:
  """The text of record `record_id`, as the test wrote it."""
  return f"r{record_id}-" + "abcdefghij"[record_id % 10] * (record_id % 23)


def _latest_committed(root: str) -> int | None:
  steps = [int(n) for n in os.listdir(root) if n.isdigit() and os.path.exists(os.path.join(root, n, "commit"))]
  return max(steps) if steps else None


def _process(index: int, config: dict, barrier) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter import sources  # pylint: disable=g-import-not-at-top

  out = config["out"]
  real = _shard_cache.ShardCache._download

  def counted(self, path, found, entry):
    # Logged once the copy is whole: a download a kill cuts short is not one the next host could have used.
    done = real(self, path, found, entry)
    with open(os.path.join(out, f"downloads-{index}.txt"), "a") as f:
      f.write(os.path.basename(path) + "\n")
    return done

  _shard_cache.ShardCache._download = counted
  if not config.get("small_copies_in_memory", True):  # every copy read by its own ranges, descriptor held
    from ckpt_iter import _jsonl  # pylint: disable=g-import-not-at-top

    _jsonl._SMALL_COPY_BYTES = -1  # pylint: disable=protected-access
  count = config.get("shard_count", config["processes"])
  shard = config.get("shard_offset", 0) + index
  source = sources.JsonlSource(config["source"], cache=sources.ShardCache(config["cache_dir"], config["max_bytes"]),
                               files_from_index=config.get("files_from_index", False))
  options = {"shuffle": "shards", "shuffle_window": config["window"]} if config["shuffle"] == "shards" else {}
  if config.get("lanes"):
    options["shard_lanes"] = config["lanes"]
  batch_size = config.get("global_batch", BATCH_SIZE * count) // count
  dataset = ckpt_iter.make_dataset(source, batch_size=batch_size, seed=SEED, num_epochs=1, shard_index=shard,
                                   shard_count=count, **options)
  iterator = ckpt_iter.DataIterator(dataset)
  open(os.path.join(out, f"built-{index}"), "w").close()
  handler = checkpoint_lib.IteratorCheckpointHandler(shard, count)
  root = config["root"]
  latest = _latest_committed(root)
  if latest is not None:
    handler.restore(os.path.join(root, str(latest), "data"),
                    ckpt_iter.IteratorRestore(iterator, elastic="shard_count" in config))
  barrier.wait(300)

  def read(limit):
    batches = []
    while limit is None or len(batches) < limit:
      try:
        batch = next(iterator)
      except StopIteration:
        break
      ids = np.asarray(batch["id"]).tolist()
      texts = [str(t) for t in np.asarray(batch["text"]).tolist()]
      bad = [(i, t) for i, t in zip(ids, texts) if t != expected_text(i)]
      if bad:
        raise AssertionError(f"process {index} read records the store does not hold: {bad[:3]}")
      batches.append(ids)
      barrier.wait(300)
    return batches

  if config["extra"] is None:
    trained = read(None)
    open(os.path.join(out, f"done-{index}"), "w").close()
    _write(out, f"trained-{index}.json", {"from": latest, "batches": trained})
    return
  trained = read(config["steps"])
  step = (latest or 0) + len(trained)
  item = os.path.join(root, str(step), "data")
  os.makedirs(item, exist_ok=True)
  handler.save(item, ckpt_iter.IteratorSave(iterator))
  barrier.wait(300)
  if index == 0 and "shard_count" not in config:  # a pod's step is committed by the test, once every host saved
    open(os.path.join(root, str(step), "commit"), "w").close()
  _write(out, f"trained-{index}.json", {"from": latest, "step": step, "batches": trained})
  if config["extra"] == 0:
    return
  barrier.wait(300)
  discarded = read(config["extra"])
  _write(out, f"discarded-{index}.json", discarded)
  open(os.path.join(out, f"ready-{index}"), "w").close()
  time.sleep(600)  # the test kills the host


def _write(directory: str, name: str, value) -> None:
  path = os.path.join(directory, name)
  with open(path + ".tmp", "w") as f:
    json.dump(value, f)
  os.replace(path + ".tmp", path)


def main(config_path: str) -> int:
  with open(config_path) as f:
    config = json.load(f)
  context = multiprocessing.get_context("spawn")
  barrier = context.Barrier(config["processes"])
  processes = [context.Process(target=_process, args=(i, config, barrier)) for i in range(config["processes"])]
  for process in processes:
    process.start()
  while any(p.is_alive() for p in processes):
    if any(p.exitcode for p in processes):  # one failed: the others would wait at the barrier
      for p in processes:
        p.kill()
      break
    time.sleep(0.05)
  for process in processes:
    process.join()
  return 1 if any(p.exitcode for p in processes) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
