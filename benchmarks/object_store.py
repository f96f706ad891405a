"""Object operations per process for a data item on gs://, against Grain's handler.

On a real bucket every object operation is a round trip of tens of
milliseconds, so the figure that matters is how many a save and a restore
make. Counted from the request log of a real local GCS emulator
(fake-gcs-server; tests/gcs_emulator.py), one HTTP request at a time,
classified as object reads, writes (upload requests), listings, metadata
requests and deletes:

  item level   one handler's save or restore of one process's item, called
               directly on its directory (exactly the item's own requests):
               ckpt_iter's handler for a DataIterator (no arrays) and a
               RepeatIterator with pending arrays; Grain's own handler
               (grain.checkpoint) for the same DataIterator's Grain iterator;
               an elastic restore, 4 saved processes read by 2;
  step level   a CheckpointManager step holding only that item (Orbax's own
               step requests included: the same for both handlers).

  cli          `ckpt-iter inspect ROOT --step N` and `verify ROOT --step N` on a
               root of 8 kept steps and on one of 1,000: the same count
               whatever the number of kept steps.

Targets (per process): a same-count restore at most 3 object reads and 0
listings; a save at most 3 object writes; `--step` costs equal for 8 and
1,000 kept steps (no more for 1,000).

It also measures the choice for pending arrays: the same pending pytree as
the item's npz (one object) or as an Orbax PyTree item (tensorstore OCDBT),
requests and wall time per save and restore, medians of interleaved runs.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time

import _common

sys.path.insert(0, os.path.join(_common.REPO_DIR, "tests"))
import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

logging.disable(logging.WARNING)

from etils import epath  # pylint: disable=g-import-not-at-top,wrong-import-position
import grain  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top,wrong-import-position

import ckpt_iter  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import testing  # pylint: disable=g-import-not-at-top,wrong-import-position

RECORDS = [{"id": i} for i in range(400)]
KINDS = ("read", "write", "list", "metadata", "delete")


def pipeline(shard_index: int = 0, shard_count: int = 1, batch_size: int = 8):
  return ckpt_iter.make_dataset(RECORDS, batch_size=batch_size, seed=1, num_epochs=None,
                                shard_index=shard_index, shard_count=shard_count)


def rollout_of(generations: int, tokens: int):
  """A stand-in rollout: `generations` completions of `tokens` tokens per prompt."""

  def rollout(batch):
    ids = np.asarray(batch["id"])
    rows = len(ids) * generations
    rng = np.random.default_rng(int(ids[0]))
    return {"ids": np.repeat(ids, generations),
            "completion_ids": rng.integers(0, 32_000, (rows, tokens), dtype=np.int32),
            "old_logps": rng.standard_normal((rows, tokens), dtype=np.float32),
            "advantages": rng.standard_normal(rows, dtype=np.float32)}

  return rollout


def repeat_iterator(shard_index: int = 0, shard_count: int = 1, *, generations: int = 1, tokens: int = 256):
  # Global batch 8 split over the processes, as an elastic restore requires.
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(pipeline(shard_index, shard_count, batch_size=8 // shard_count)),
      produce=rollout_of(generations, tokens), num_repeats=2, group_size=2)


def advanced(iterator, count: int):
  for _ in range(count):
    next(iterator)
  return iterator


def _stream(iterator) -> dict:
  """An iterator's state without its lineage, which a restore extends (a Grain iterator's: as is)."""
  state = iterator.get_state()
  if isinstance(state, dict):
    state.pop("lineage", None)
  return state


class Counter:
  def __init__(self, emulator: gcs_emulator.GcsEmulator):
    self.emulator = emulator

  def count(self, fn, *, under: str | None = None) -> dict[str, int]:
    mark = self.emulator.mark()
    fn()
    counts = gcs_emulator.count_by_kind(self.emulator.requests(mark, under=under))
    return {kind: counts[kind] for kind in KINDS}


def item_level(counter: Counter, base: str, report: _common.Reporter) -> dict[str, dict[str, int]]:
  figures = {}

  def ours(name, make, advance, process_index=0, process_count=1):
    directory = epath.Path(f"{base}/item/{name}")
    handler = checkpoint_lib.IteratorCheckpointHandler(process_index, process_count)
    iterator = advanced(make(), advance)
    figures[f"ckpt_iter {name} save"] = counter.count(
        lambda: handler.save(directory, ckpt_iter.IteratorSave(iterator)))
    fresh = make()
    figures[f"ckpt_iter {name} restore"] = counter.count(
        lambda: handler.restore(directory, ckpt_iter.IteratorRestore(fresh)))
    testing.assert_trees_equal(_stream(fresh), _stream(iterator), path=name)

  ours("data_iterator", lambda: ckpt_iter.DataIterator(pipeline()), 3)
  ours("repeat_pending", repeat_iterator, 3)  # inside a group: pending arrays

  # Grain's own handler, on the same pipeline's plain Grain iterator.
  directory = epath.Path(f"{base}/item/grain")
  handler = grain.checkpoint.CheckpointHandler()
  iterator = advanced(iter(pipeline()), 3)
  figures["grain data_iterator save"] = counter.count(
      lambda: handler.save(directory, args=grain.checkpoint.CheckpointSave(iterator)))
  fresh = iter(pipeline())
  figures["grain data_iterator restore"] = counter.count(
      lambda: handler.restore(directory, args=grain.checkpoint.CheckpointRestore(fresh)))
  assert fresh.get_state() == iterator.get_state()

  # Elastic: 4 processes' files (each its own shard, mid-repeat), read by 2.
  directory = epath.Path(f"{base}/item/elastic")
  for index in range(4):
    saver = advanced(repeat_iterator(index, 4), 3)
    checkpoint_lib.IteratorCheckpointHandler(index, 4).save(directory, ckpt_iter.IteratorSave(saver))
  for index in range(2):
    fresh = repeat_iterator(index, 2)
    figures[f"ckpt_iter elastic 4->2 restore (process {index})"] = counter.count(
        lambda: checkpoint_lib.IteratorCheckpointHandler(index, 2).restore(
            directory, ckpt_iter.IteratorRestore(fresh, elastic=True)))
  for name, counts in figures.items():
    report.measurement(level="item", case=name, **counts)
  return figures


def step_level(counter: Counter, base: str, report: _common.Reporter) -> dict[str, dict[str, int]]:
  figures = {}
  cases = {
      "ckpt_iter": (lambda: ckpt_iter.DataIterator(pipeline()), ckpt_iter.IteratorSave, ckpt_iter.IteratorRestore),
      "grain": (lambda: iter(pipeline()), grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore),
  }
  for name, (make, save_args, restore_args) in cases.items():
    root = f"{base}/step/{name}"
    iterator = advanced(make(), 3)
    with ocp.CheckpointManager(root) as manager:
      def save():
        manager.save(1, args=ocp.args.Composite(data=save_args(iterator)))
        manager.wait_until_finished()
      figures[f"{name} step save"] = counter.count(save)
    fresh = make()
    with ocp.CheckpointManager(root) as manager:
      figures[f"{name} step restore"] = counter.count(
          lambda: manager.restore(1, args=ocp.args.Composite(data=restore_args(fresh))))
    assert _stream(fresh) == _stream(iterator)
  for name, counts in figures.items():
    report.measurement(level="step", case=name, **counts)
  return figures


def pending_storage(counter: Counter, base: str, report: _common.Reporter, repetitions: int) -> dict:
  """The pending pytree of one process as the item's npz or as an Orbax PyTree item.

  A realistic size: 8 prompts x 64 generations x 1,024 tokens per rollout.
  """
  make = lambda: repeat_iterator(generations=64, tokens=1024)
  iterator = advanced(make(), 3)
  pending = iterator.state().pending.items
  nbytes = sum(a.nbytes for item in pending for a in item.values())
  times: dict[str, list[float]] = {}
  counts: dict[str, dict[str, int]] = {}
  for repetition in range(repetitions):
    for variant in ("npz item", "orbax pytree"):
      root = f"{base}/pending/{variant.replace(' ', '_')}/{repetition}"
      with ocp.CheckpointManager(root) as manager:
        if variant == "npz item":
          save_args = ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator))
        else:
          save_args = ocp.args.Composite(pending=ocp.args.PyTreeSave(pending))

        def save():
          manager.save(1, args=save_args)
          manager.wait_until_finished()

        started = time.perf_counter()
        save_counts = counter.count(save)
        times.setdefault(f"{variant} save", []).append((time.perf_counter() - started) * 1e3)
        if variant == "npz item":
          fresh = make()
          restore_args = ocp.args.Composite(data=ckpt_iter.IteratorRestore(fresh))
        else:
          restore_args = ocp.args.Composite(pending=ocp.args.PyTreeRestore())
        started = time.perf_counter()
        restore_counts = counter.count(lambda: manager.restore(1, args=restore_args))
        times.setdefault(f"{variant} restore", []).append((time.perf_counter() - started) * 1e3)
      if repetition == 0:
        counts[f"{variant} save"] = save_counts
        counts[f"{variant} restore"] = restore_counts
  result = {}
  for name, values in times.items():
    result[name] = {"median_ms": _common.rounded(statistics.median(values)), **counts[name]}
    report.measurement(level="pending", case=name, pending_bytes=nbytes, **result[name])
  return result


def cli_step(counter: Counter, base: str, report: _common.Reporter, kept: tuple[int, ...]) -> dict[str, dict]:
  """Object operations of `inspect --step 3` and `verify --step 3` against the number of kept steps."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top

  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  def run(verb: str, root: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
      assert cli.main([verb, root, "--step", "3"]) == cli.EXIT_OK

  figures = {}
  gcs_emulator.write_repeat_steps(f"{base}/cli/warm", 3)
  run("verify", f"{base}/cli/warm")  # the client's one-time bucket lookup, not a command's cost
  for count in kept:
    root = f"{base}/cli/kept{count}"
    gcs_emulator.write_repeat_steps(root, count)
    for verb in ("inspect", "verify"):
      # gcsfs sometimes adds one metadata request (its caches): the fewest of 3 runs is the
      # command's cost, the most is reported beside it.
      runs = [counter.count(lambda: run(verb, root), under=root) for _ in range(3)]
      figures[f"{verb} --step 3, {count:,} kept steps"] = counts = min(runs, key=lambda c: sum(c.values()))
      report.measurement(level="cli", case=f"{verb} --step 3", kept_steps=count,
                         most=max(sum(c.values()) for c in runs), **counts)
  return figures


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("object_store", args.quick)
  with gcs_emulator.GcsEmulator() as emulator:
    counter = Counter(emulator)
    base = f"gs://{gcs_emulator.BUCKET}/bench-{os.getpid()}"
    items = item_level(counter, base, report)
    steps = step_level(counter, base, report)
    pending = pending_storage(counter, base, report, 3 if args.quick else 7)
    kept = (8, 64) if args.quick else (8, 1000)
    per_step = cli_step(counter, base, report, kept)
  restore = [items["ckpt_iter data_iterator restore"], items["ckpt_iter repeat_pending restore"]]
  save = [items["ckpt_iter data_iterator save"], items["ckpt_iter repeat_pending save"]]
  checks = [
      _common.check("same-count restore: object reads per process", max(c["read"] for c in restore), "<= 3",
                    max(c["read"] for c in restore) <= 3),
      _common.check("same-count restore: listings per process", max(c["list"] for c in restore), "== 0",
                    max(c["list"] for c in restore) == 0),
      _common.check("save: object writes per process", max(c["write"] for c in save), "<= 3",
                    max(c["write"] for c in save) <= 3),
  ]
  for verb in ("inspect", "verify"):
    few, many = (sum(per_step[f"{verb} --step 3, {count:,} kept steps"].values()) for count in kept)
    checks.append(_common.check(f"`{verb} --step 3`: object operations, {kept[1]:,} kept steps / {kept[0]}",
                                _common.rounded(many / few), "<= 1", many <= few, also=f"{few} and {many}"))
  report.summary(checks, steps=steps, pending=pending)


if __name__ == "__main__":
  main()
