"""One process of tests/integration/test_object_store.py: save or restore at a gs:// root.

    python object_store_worker.py CONFIG.json

CONFIG: {"pipeline": "jsonl" | "parquet" | "repeat" | "loader", "source": a
gs:// glob (jsonl, parquet), "root": the gs:// checkpoint root, "api": "v0"
(CheckpointManager) or "v1" (save_/load_checkpointables), "mode": "save" or
"restore", "save_steps": K, "total": T, "restore_step": s, "index_cache_dir",
"out": a local JSON file}.

A save run takes T batches and checkpoints after each of the first K (params
and the data item in one Orbax step), so it is also the uninterrupted run. A
restore run restores step s in this fresh process and takes the T - s batches
that follow. The output holds the batches (ids, and for the repeat pipeline
each element's rollout noise, drawn from OS entropy, so a regenerated pending
item cannot pass for a restored one) and how many JSONL line indexes this
process built (0 when the index cache served it).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

import grain  # pylint: disable=g-import-not-at-top,wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _line_index  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH_SIZE = 4


def _counting_index_builds() -> list[str]:
  built: list[str] = []
  original = _line_index.index_lines

  def index_lines(path):
    built.append(path)
    return original(path)

  _line_index.index_lines = index_lines
  return built


def rollout(batch: dict) -> dict:
  ids = np.asarray(batch["id"])
  return {"ids": ids, "noise": np.random.default_rng().random(ids.shape)}


def build(config: dict):
  kind = config["pipeline"]
  if kind in ("jsonl", "parquet"):
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        config["source"], batch_size=BATCH_SIZE, seed=3, num_epochs=2))
  if kind == "repeat":
    records = [{"id": i} for i in range(40)]
    return ckpt_iter.RepeatIterator(
        ckpt_iter.DataIterator(ckpt_iter.make_dataset(records, batch_size=BATCH_SIZE, seed=3, num_epochs=None)),
        produce=rollout, num_repeats=2, group_size=2, shuffle_seed=11)
  if kind == "loader":
    records = [{"id": i} for i in range(60)]
    sampler = grain.samplers.IndexSampler(
        len(records), shard_options=grain.sharding.NoSharding(), shuffle=True, seed=5, num_epochs=1)
    return ckpt_iter.DataLoaderIterator(grain.DataLoader(
        data_source=records, sampler=sampler, operations=[grain.transforms.Batch(BATCH_SIZE)]))
  raise ValueError(kind)


def as_json(batch: dict) -> dict:
  ids = batch["ids"] if "ids" in batch else batch["id"]
  out = {"ids": np.asarray(ids).tolist()}
  if "noise" in batch:
    out["noise"] = [float(v).hex() for v in np.asarray(batch["noise"])]
  return out


class _V0:
  def __init__(self, root: str):
    self._manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=None))

  def save(self, step, params, iterator):
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), data=ckpt_iter.IteratorSave(iterator)))

  def restore(self, step, params, iterator):
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params), data=ckpt_iter.IteratorRestore(iterator)))
    return restored["params"]

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()


class _V1:
  def __init__(self, root: str):
    self._root = root

  def save(self, step, params, iterator):
    import orbax.checkpoint.experimental.v1 as ocp1  # pylint: disable=g-import-not-at-top

    ocp1.save_checkpointables(f"{self._root}/{step}", {
        "params": params, "data": ckpt_iter.IteratorCheckpointable(iterator)})

  def restore(self, step, params, iterator):
    import orbax.checkpoint.experimental.v1 as ocp1  # pylint: disable=g-import-not-at-top

    loaded = ocp1.load_checkpointables(f"{self._root}/{step}", {
        "params": params, "data": ckpt_iter.IteratorCheckpointable(iterator)})
    return loaded["params"]

  def close(self):
    pass


def main(config_path: str) -> int:
  with open(config_path) as f:
    config = json.load(f)
  if config.get("index_cache_dir"):
    os.environ[_line_index.INDEX_CACHE_ENV] = config["index_cache_dir"]
  built = _counting_index_builds()
  iterator = build(config)
  store = (_V0 if config["api"] == "v0" else _V1)(config["root"])
  params = {"w": np.arange(4.0)}
  batches, restored_params = [], None
  if config["mode"] == "save":
    for step in range(1, config["total"] + 1):
      batches.append(as_json(next(iterator)))
      if step <= config["save_steps"]:
        store.save(step, {"w": params["w"] + step}, iterator)
  else:
    step = config["restore_step"]
    restored_params = store.restore(step, params, iterator)
    restored_params = np.asarray(restored_params["w"]).tolist()
    for _ in range(config["total"] - step):
      batches.append(as_json(next(iterator)))
  store.close()
  with open(config["out"], "w") as f:
    json.dump({"batches": batches, "index_builds": len(built), "params": restored_params}, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
