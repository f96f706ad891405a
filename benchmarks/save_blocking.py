"""Q4: how long `mngr.save(...)` blocks the training loop because of the data item.

Orbax's CheckpointManager saves asynchronously: `save()` returns once each
item has taken its snapshot, and the files are written in a background thread.
Measured here is the wall time of the `save()` call itself (then, untimed,
`wait_until_finished()` and `delete(step)`), for:

  data_*          only the data item (a RepeatIterator)
  params_only     only model params (4 x 1024 x 1024 float32 JAX arrays, 16 MiB)
  tiny_params_only  a one-element params item: Orbax's fixed cost of any save
  params_data_*   params + the data item, in one Composite save

with no pending repeats (at a group boundary) and with one pending group of
realistic size: 64 prompts x 8 generations x 1k completion tokens — int32
completion ids and mask, float32 old and reference log-probs, int32 prompt ids
and mask (256 tokens), float32 advantages: 9.0 MiB — held as numpy arrays or
as JAX arrays. Variants are interleaved in a shuffled order each repetition,
each with its own manager, with the garbage collector off inside the timed call.

The data item's cost is paired per repetition, blocked_ms(params_data_X) -
blocked_ms(params_only) (a training loop always saves the model too), and
blocked_ms(data_X), which includes Orbax's fixed cost of a save. Target: <= 5 ms plus one
memory copy of the pending arrays (copy_ms: np.copy of all of them).
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import tempfile

import _common

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import _item as item_lib

NUM_ROWS = 64 * 8
COMPLETION_TOKENS = 1024
PROMPT_TOKENS = 256
TARGET_MS = 5.0


def rollout_arrays() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  shape = (NUM_ROWS, COMPLETION_TOKENS)
  return {
      "prompt_ids": rng.integers(0, 32_000, (NUM_ROWS, PROMPT_TOKENS), dtype=np.int32),
      "prompt_mask": np.ones((NUM_ROWS, PROMPT_TOKENS), np.int32),
      "completion_ids": rng.integers(0, 32_000, shape, dtype=np.int32),
      "completion_mask": np.ones(shape, np.int32),
      "old_per_token_logps": rng.standard_normal(shape, dtype=np.float32),
      "ref_per_token_logps": rng.standard_normal(shape, dtype=np.float32),
      "advantages": rng.standard_normal(NUM_ROWS, dtype=np.float32),
  }


def repeat_iterator(produced: dict | None) -> ckpt_iter.RepeatIterator:
  """A RepeatIterator (num_repeats 2); mid-group (1 pending) when `produced` is given."""
  records = [{"prompts": f"prompt {i}"} for i in range(4 * 64)]
  dataset = ckpt_iter.make_dataset(records, batch_size=64, num_epochs=None, shard_index=0, shard_count=1)
  item = produced if produced is not None else {"completion_ids": np.zeros((1, 1), np.int32)}
  iterator = ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset), produce=lambda _: item, num_repeats=2)
  next(iterator)
  if produced is None:
    next(iterator)  # the group is used up: nothing pending
  return iterator


def copy_ms(arrays: dict[str, np.ndarray]) -> float:
  elapsed, _ = _common.timed_ms(lambda: [np.copy(a) for a in arrays.values()])
  return elapsed


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("save_blocking", args.quick)
  reps = 5 if args.quick else 60
  arrays = rollout_arrays()
  jax_arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
  pending_bytes = sum(a.nbytes for a in arrays.values())
  params = {f"w{i}": jnp.full((1024, 1024), float(i), jnp.float32) for i in range(4)}
  data = {
      "no_pending": repeat_iterator(None),
      "pending_numpy": repeat_iterator(arrays),
      "pending_jax": repeat_iterator(jax_arrays),
  }
  variants = {f"data_{k}": {"data": v} for k, v in data.items()}
  variants["params_only"] = {}
  variants["tiny_params_only"] = {}
  variants.update({f"params_data_{k}": {"data": v} for k, v in data.items()})

  def composite(name: str):
    items = {"data": ckpt_iter.IteratorSave(variants[name]["data"])} if "data" in variants[name] else {}
    if name.startswith("params"):
      items["params"] = ocp.args.StandardSave(params)
    elif name == "tiny_params_only":  # Orbax's fixed cost of a save
      items["params"] = ocp.args.StandardSave({"w": jnp.zeros((1,), jnp.float32)})
    return ocp.args.Composite(**items)

  workdir = tempfile.mkdtemp(prefix="bench_save_")
  managers = {
      name: ocp.CheckpointManager(
          os.path.join(workdir, name),
          options=ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None),
          item_handlers={"data": checkpoint_lib.IteratorCheckpointHandler(), "params": ocp.StandardCheckpointHandler()},
      )
      for name in variants
  }
  blocked = {name: [] for name in variants}
  complete = {name: [] for name in variants}  # save() + wait_until_finished()
  copies, snapshots = [], {k: [] for k in data}
  # The handler's snapshot as it runs inside a save, next to Orbax's threads.
  in_save = {name: [] for name in variants}
  snapshot = item_lib.snapshot
  current = {"log": None}

  def timed_snapshot(*args, **kwargs):  # whatever _item.snapshot takes
    elapsed, result = _common.timed_ms(lambda: snapshot(*args, **kwargs))
    if current["log"] is not None:
      current["log"].append(elapsed)
    return result

  item_lib.snapshot = timed_snapshot
  order = list(managers)
  shuffler = random.Random(0)
  try:
    for step in range(reps + 2):  # the first two saves are warm-up
      shuffler.shuffle(order)  # no variant always runs first or after another
      for name in order:
        manager = managers[name]
        current["log"] = in_save[name] if step >= 2 else None
        gc.collect()
        gc.disable()  # a collection inside one timed save would only add noise
        try:
          elapsed, _ = _common.timed_ms(lambda: manager.save(step, args=composite(name)))  # pylint: disable=cell-var-from-loop
        finally:
          gc.enable()
        waited, _ = _common.timed_ms(manager.wait_until_finished)
        manager.delete(step)
        current["log"] = None
        if step >= 2:
          blocked[name].append(elapsed)
          complete[name].append(elapsed + waited)
      if step >= 2:
        for k, iterator in data.items():
          copies.append(copy_ms(arrays))
          paired_copy = copies[-1] if k != "no_pending" else 0.0
          snapshots[k].append(_common.timed_ms(lambda: snapshot(iterator))[0] - paired_copy)  # pylint: disable=cell-var-from-loop
  finally:
    item_lib.snapshot = snapshot
    for manager in managers.values():
      manager.close()
    shutil.rmtree(workdir, ignore_errors=True)

  copy_median = _common.median(copies)
  report.measurement(measure="copy", pending_bytes=pending_bytes, copy_ms=_common.rounded(copy_median),
                     copy_gib_per_second=_common.rounded(pending_bytes / copy_median / 1e6 / 1.073741824, 3))
  for name, values in blocked.items():
    report.measurement(variant=name, blocked_ms=_common.rounded(_common.median(values)),
                       complete_save_ms=_common.rounded(_common.median(complete[name])), reps=len(values))
  for k, values in snapshots.items():
    report.measurement(
        measure="snapshot (IteratorCheckpointHandler's synchronous part), minus a paired copy when pending",
                       pending=k, snapshot_minus_copy_ms=_common.rounded(_common.median(values)))
  orbax_fixed_ms = _common.median(blocked["tiny_params_only"])
  for name, values in in_save.items():
    if values:
      report.measurement(measure="snapshot inside the save", variant=name,
                         in_save_snapshot_ms=_common.rounded(_common.median(values)))

  checks = []
  for k in data:
    allowance = TARGET_MS + (copy_median if k != "no_pending" else 0.0)
    alone = _common.median(blocked[f"data_{k}"])
    differences = [a - b for a, b in zip(blocked[f"params_data_{k}"], blocked["params_only"])]
    marginal = _common.median(differences)
    quartiles = statistics.quantiles(differences, n=4)
    for label, value in (("params+data minus params only", marginal), ("data item alone", alone)):
      excess = value - (copy_median if k != "no_pending" else 0.0)
      report.measurement(pending=k, measure=label, blocked_ms=_common.rounded(value),
                         blocked_minus_copy_ms=_common.rounded(excess))
      checks.append(_common.check(
          f"{k}: {label}, blocked_ms", _common.rounded(value),
          f"<= {TARGET_MS:g} ms" + (f" + copy {copy_median:.2f} ms" if k != "no_pending" else ""),
          value <= allowance, blocked_minus_copy_ms=_common.rounded(excess),
          handler_snapshot_minus_copy_ms=_common.rounded(_common.median(snapshots[k])),
          in_save_snapshot_ms=_common.rounded(
              _common.median(in_save[f"params_data_{k}" if label.startswith("params") else f"data_{k}"])
          ),
          **({"orbax_fixed_ms_tiny_item": _common.rounded(orbax_fixed_ms)} if label == "data item alone"
             else {"paired_difference_quartiles_ms": [_common.rounded(q, 3) for q in quartiles]}),
      ))
  # Not a target: what the data item adds to a whole save, background write
  # included — what a loop that saves every short step ends up waiting for.
  complete_delta = {
      k: _common.rounded(_common.median([a - b for a, b in zip(complete[f"params_data_{k}"], complete["params_only"])]))
      for k in data
  }
  report.summary(checks, copy_ms=_common.rounded(copy_median), pending_mib=_common.rounded(pending_bytes / 2**20, 3),
                 orbax_fixed_ms_tiny_item=_common.rounded(orbax_fixed_ms),
                 complete_save_ms_added_by_data_item=complete_delta,
                 complete_save_ms_params_only=_common.rounded(_common.median(complete["params_only"])))


if __name__ == "__main__":
  main()
