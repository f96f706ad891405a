"""One JAX process of a multi-process save or restore run (tests/integration/test_multihost.py).

    python tests/workers/multihost_worker.py CONFIG.json

CONFIG holds port, num_processes, process_id, ckpt_dir, mode ("save" or
"restore"), elastic and out. The process joins a `jax.distributed` job on
127.0.0.1 (CPU backend), builds three make_dataset pipelines with the
default sharding (jax.process_index() / jax.process_count()) and a global
batch of GLOBAL_BATCH_SIZE rows:

  data      DataIterator over 2 shuffled epochs;
  repeat    RepeatIterator (group_size 2, num_repeats 2, shuffled repeats)
            whose `produce` returns batch-major arrays tagged with the run;
  filtered  DataIterator over make_dataset(...).filter(...): a per-process,
            non-elementwise step that cannot be resumed elastically;
  lanes     DataIterator over make_dataset(filter=..., pack=..., num_lanes=4):
            filtered and packed the same for every process count, and
            restored with another global batch too (LANES_RESTORE_BATCH).

mode "save": reads each iterator up to its checkpoint point, saves ONE
CheckpointManager step holding sharded params and the three iterators, then
reads everything to the end (the uninterrupted run).
mode "restore": restores params and iterators (elastic or not) in a fresh
job, possibly with another process count, and reads everything to the end.
Errors expected from a restore are recorded, not raised. The observations go
to `out` as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import process_group  # tests/workers/process_group.py: this script runs from tests/workers/

os.environ.setdefault("JAX_PLATFORMS", "cpu")

NUM_RECORDS = 24
GLOBAL_BATCH_SIZE = 4
NUM_EPOCHS = 2
SAVE_AFTER = {"data": 4, "repeat": 5, "filtered": 2, "lanes": 3}
LANES_AFTER = 6  # lanes batches read after the save or restore (its stream has no end)
NUM_LANES = 4
LANES_CHUNK = 3
LANES_RESTORE_BATCH = 8  # the restored runs double the lanes pipeline's global batch
GROUP_SIZE = 2
NUM_REPEATS = 2
SAVE_TAG, RESTORE_TAG = 1, 2
STEP = 1


def records() -> list[dict[str, int]]:
  return [{"id": i} for i in range(NUM_RECORDS)]


def keep(record) -> bool:
  return record["id"] % 4 != 1


def pack_pairs(dataset) -> list:
  """Two records per row, the last one padded with -1."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ids = [int(r["id"]) for r in dataset]
  return [{"ids": np.array((ids[i:i + 2] + [-1])[:2], dtype=np.int32)} for i in range(0, len(ids), 2)]


def lanes_dataset(global_batch: int, shard_index: int | None = None, shard_count: int | None = None):
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  count = shard_count or __import__("jax").process_count()
  return ckpt_iter.make_dataset(
      records(), batch_size=global_batch // count, seed=13, num_epochs=None, filter=keep, pack=pack_pairs,
      chunk_size=LANES_CHUNK, num_lanes=NUM_LANES, shard_index=shard_index, shard_count=shard_count)


def build(process_count: int, tag: int):
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  batch_size = GLOBAL_BATCH_SIZE // process_count

  def produce(batch):
    # A rollout stand-in: row-wise in the batch ("batch-major"), and tagged
    # with the run, so items restored from the checkpoint are told apart from
    # items produced again.
    ids = np.asarray(batch["id"])
    return {
        "id": ids,
        "tokens": (ids[:, None] * 10 + np.arange(3)).astype(np.int32),
        "logp": np.sin(ids.astype(np.float32) * np.float32(0.7)),
        "tag": np.full(ids.shape, tag, dtype=np.int32),
    }

  data = ckpt_iter.DataIterator(
      ckpt_iter.make_dataset(records(), batch_size=batch_size, seed=7, num_epochs=NUM_EPOCHS)
  )
  repeat = ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(ckpt_iter.make_dataset(records(), batch_size=batch_size, seed=11)),
      produce=produce, num_repeats=NUM_REPEATS, group_size=GROUP_SIZE, shuffle_seed=5,
  )
  filtered = ckpt_iter.DataIterator(
      ckpt_iter.make_dataset(records(), batch_size=batch_size, seed=3)
      .filter(lambda batch: int(batch["id"].sum()) % 3 != 0)
  )
  lanes = ckpt_iter.DataIterator(lanes_dataset(GLOBAL_BATCH_SIZE if tag == SAVE_TAG else LANES_RESTORE_BATCH))
  return {"data": data, "repeat": repeat, "filtered": filtered, "lanes": lanes}


def as_json(name: str, element) -> dict:
  if name == "repeat":
    return {k: v.tolist() for k, v in element.items()}
  if name == "lanes":
    return {"ids": element["ids"].tolist()}
  return {"id": element["id"].tolist()}


def take(name: str, iterator, count: int | None) -> list[dict]:
  out = []
  while count is None or len(out) < count:
    try:
      element = next(iterator)
    except StopIteration:
      break
    out.append(as_json(name, element))
  return out


def params_target(mesh):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  values = np.arange(GLOBAL_BATCH_SIZE, dtype=np.float32) * 1.5 + 0.25
  return values, sharding


def main(config_path: str) -> int:
  with open(config_path) as f:
    config = json.load(f)
  started = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top

  process_group.initialize_distributed(config)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top

  index, count = jax.process_index(), jax.process_count()
  assert (index, count) == (config["process_id"], config["num_processes"]), (index, count)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  values, sharding = params_target(mesh)
  result = {"process_index": index, "process_count": count, "mode": config["mode"]}
  tag = SAVE_TAG if config["mode"] == "save" else RESTORE_TAG
  iterators = build(count, tag)
  result["batch_size"] = iterators["data"].spec.batch_size
  manager = ocp.CheckpointManager(
      config["ckpt_dir"], options=ocp.CheckpointManagerOptions(max_to_keep=2)
  )
  try:
    if config["mode"] == "save":
      params = jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])
      for name, iterator in iterators.items():
        result[f"{name}_before"] = take(name, iterator, SAVE_AFTER[name])
      result["pending_at_save"] = len(iterators["repeat"].state().pending or ())
      manager.save(STEP, args=ocp.args.Composite(
          params=ocp.args.StandardSave({"w": params}),
          **{name: ckpt_iter.IteratorSave(it) for name, it in iterators.items()},
      ))
    else:
      restore(config, manager, iterators, values, sharding, result)
    for name, iterator in iterators.items():
      result[f"{name}_after"] = take(name, iterator, LANES_AFTER if name == "lanes" else None)
    manager.wait_until_finished()
  finally:
    manager.close()
  result["seconds"] = time.perf_counter() - started
  with open(config["out"], "w") as f:
    json.dump(result, f)
  return 0


def restore(config, manager, iterators, values, sharding, result) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top

  elastic = config["elastic"]
  abstract = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding)}
  restored = manager.restore(STEP, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  result["params_ok"] = all(
      np.array_equal(np.asarray(shard.data), values[shard.index])
      for shard in restored["params"]["w"].addressable_shards
  )

  # The restore being measured: the data and repeat items of the step.
  handler_seconds = []
  original = ckpt_iter.IteratorCheckpointHandler.restore

  def timed(self, directory, args=None):
    begin = time.perf_counter()
    try:
      return original(self, directory, args)
    finally:
      handler_seconds.append(time.perf_counter() - begin)

  ckpt_iter.IteratorCheckpointHandler.restore = timed
  begin = time.perf_counter()
  try:
    manager.restore(STEP, args=ocp.args.Composite(
        data=ckpt_iter.IteratorRestore(iterators["data"], elastic=elastic),
        repeat=ckpt_iter.IteratorRestore(iterators["repeat"], elastic=elastic),
        lanes=ckpt_iter.IteratorRestore(iterators["lanes"], elastic=True),
    ))
  finally:
    ckpt_iter.IteratorCheckpointHandler.restore = original
  result["restore_seconds"] = time.perf_counter() - begin
  result["handler_seconds"] = handler_seconds

  result["errors"] = {}
  attempts = {"filtered": (iterators["filtered"], elastic)}
  if elastic:
    # A plain restore of the same step must refuse the other process count.
    fresh = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        records(), batch_size=iterators["data"].spec.batch_size, seed=7, num_epochs=NUM_EPOCHS))
    attempts["data_plain"] = (fresh, False)
  for name, (iterator, as_elastic) in attempts.items():
    item = "filtered" if name == "filtered" else "data"
    try:
      manager.restore(STEP, args=ocp.args.Composite(
          **{item: ckpt_iter.IteratorRestore(iterator, elastic=as_elastic)}))
    except ckpt_iter.CkptIterError as e:
      result["errors"][name] = {"type": type(e).__name__, "message": str(e)}
      if name == "filtered":
        # The refused iterator must be untouched: still at its first element.
        result["filtered_position_after_error"] = iterator.get_state()["position"]


if __name__ == "__main__":
  try:
    code = main(sys.argv[1])
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    # Do not wait for the other processes in jax.distributed's shutdown.
    os._exit(1)  # pylint: disable=protected-access
  sys.exit(code)
