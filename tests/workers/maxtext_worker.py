"""One process of a MaxText pretraining input job: MaxText's own config, iterator and checkpoint code.

Joins a `jax.distributed` job on CPU (one device per process), builds the
config with MaxText's `pyconfig`, the train iterator with MaxText's
`create_data_iterator` (ckpt_iter's constructor in place of
`make_grain_train_iterator` when `side` is "ckpt_iter", the one-line change a
user makes; MaxText's own otherwise), restores the latest step with
`load_state_if_possible` and saves each step with `save_checkpoint`. Each step
logs the records of the rows this process holds; after `steps` saved steps it
trains one more and, with `kill`, waits unsaved for the test to SIGKILL it.

A restore MaxText refuses is written as the outcome (`refused`), not raised.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import process_group  # pylint: disable=g-import-not-at-top,wrong-import-position

RECORD = re.compile(r"record (\d+)")


def maxtext_config(config: dict):
  import maxtext  # pylint: disable=g-import-not-at-top
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top

  package = Path(maxtext.__file__).parent
  return pyconfig.initialize([
      None, str(package / "configs" / "base.yml"), "run_name=t", f"base_output_directory={config['out_dir']}",
      "dataset_type=grain", f"grain_train_files={config['files']}",
      f"grain_file_type={config.get('file_type', 'parquet')}",
      f"per_device_batch_size={config['global_batch'] // config['num_processes']}",
      f"max_target_length={config.get('max_target_length', 32)}", f"packing={config.get('packing', True)}",
      f"grain_worker_count={config.get('workers', 0)}",
      f"tokenizer_path={package / 'assets' / 'tokenizers' / 'tokenizer.default'}",
      "data_shuffle_seed=7", "skip_jax_distributed_system=true", "enable_checkpointing=true",
      "async_checkpointing=false", "steps=1000",
  ])


def rows_of(batch, tokenizer) -> dict[int, list[int]]:
  """This process's rows of the global batch: global row index -> the records packed in it, in order."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rows = {}
  inputs = {s.index[0].start or 0: np.asarray(s.data) for s in batch["inputs"].addressable_shards}
  segments = {s.index[0].start or 0: np.asarray(s.data) for s in batch["inputs_segmentation"].addressable_shards}
  for start, block in inputs.items():
    for offset, (tokens, segment_ids) in enumerate(zip(block, segments[start])):
      records = []
      for segment in sorted(i for i in set(segment_ids.tolist()) if i > 0):  # pads: 0, or the pad id (-1)
        text = tokenizer.decode([int(t) for t in tokens[segment_ids == segment]])
        records.append(int(RECORD.search(text).group(1)))
      rows[start + offset] = records
  return rows


def row_digests(batch) -> list[str]:
  """Each row this process holds, every field's bytes, as one SHA-256 (fields in name order)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  fields = {k: np.concatenate([np.asarray(s.data) for s in v.addressable_shards]) for k, v in sorted(batch.items())}
  rows = len(next(iter(fields.values())))
  return [hashlib.sha256(b"".join(k.encode() + v[j].tobytes() for k, v in fields.items())).hexdigest()
          for j in range(rows)]


def main(config_path: str) -> None:
  config = json.loads(Path(config_path).read_text())
  import absl.flags  # pylint: disable=g-import-not-at-top
  absl.flags.FLAGS.mark_as_parsed()  # as MaxText's train.py, run by absl's app.run (Grain's workers read flags)
  process_group.initialize_distributed(config)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from maxtext.common import checkpointing  # pylint: disable=g-import-not-at-top
  from maxtext.input_pipeline import data_processing_utils  # pylint: disable=g-import-not-at-top
  from maxtext.input_pipeline import input_pipeline_interface  # pylint: disable=g-import-not-at-top
  from maxtext.utils import maxtext_utils  # pylint: disable=g-import-not-at-top

  if config["side"] == "ckpt_iter":
    from ckpt_iter import maxtext as ckpt_iter_maxtext  # pylint: disable=g-import-not-at-top
    options = {k: config[k] for k in ("num_lanes", "chunk_size") if k in config}
    input_pipeline_interface.make_grain_train_iterator = functools.partial(
        ckpt_iter_maxtext.make_grain_train_iterator, **options)
  mt_config = maxtext_config(config)
  mesh = maxtext_utils.get_mesh_from_config(mt_config)
  tokenizer, _ = data_processing_utils.get_tokenizer_and_pad_id(mt_config)
  data_iterator, _ = input_pipeline_interface.create_data_iterator(mt_config, mesh)
  emergency = config.get("manager") == "emergency"
  if emergency:  # Orbax's multi-tier manager, as MaxText builds it (one slice here: its persistent tier)
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
    replicated = NamedSharding(mesh, PartitionSpec())
    as_state = lambda step: {"step": jax.device_put(jnp.asarray(step, jnp.int32), replicated)}
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
    manager = checkpointing.create_orbax_emergency_checkpoint_manager(
        config["local_dir"], config["ckpt_dir"], mesh, abstract, 1, 1)
  else:
    as_state = lambda step: {"step": np.asarray(step, np.int64)}
    abstract = {"step": np.zeros((), np.int64)}
    manager = checkpointing.create_orbax_checkpoint_manager(
        config["ckpt_dir"], True, use_async=False, save_interval_steps=1)
  outcome = {"process": jax.process_index(), "resumed_from": None}
  try:
    restored, _ = checkpointing.load_state_if_possible(
        manager, data_iterator, "", "", 96, abstract, dataset_type="grain",
        expansion_factor_real_data=mt_config.expansion_factor_real_data)
  except (ValueError, AssertionError) as e:  # MaxText's own refusals
    outcome["refused"] = f"{type(e).__name__}: {e}"
    Path(config["out"]).write_text(json.dumps(outcome))
    return
  start = 0
  if restored is not None:
    outcome["resumed_from"] = int((restored if emergency else restored["items"])["step"])
    start = outcome["resumed_from"] + 1
  log = open(config["log"], "a", encoding="utf-8")  # pylint: disable=consider-using-with
  for step in range(start, start + config["steps"] + 1):
    batch = next(data_iterator)
    rows = rows_of(batch, tokenizer)
    entry = {"step": step, "processes": jax.process_count(), "rows": rows}
    if config.get("dump_rows"):
      entry["digests"] = row_digests(batch)
    log.write(json.dumps(entry) + "\n")
    log.flush()
    if step == start + config["steps"]:
      if config["kill"]:  # trained, not saved: the test SIGKILLs every process of the job now
        Path(config["out"]).write_text(json.dumps(dict(outcome, waiting_for_kill=True)))
        time.sleep(600)
      break
    checkpointing.save_checkpoint(manager, step, as_state(step), mt_config, data_iterator, force=True)
    checkpointing.wait_until_finished(manager)
  Path(config["out"]).write_text(json.dumps(outcome))


if __name__ == "__main__":
  main(sys.argv[1])
