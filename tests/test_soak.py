"""Soak: many seeded save/restore cycles on RepeatIterator, exact at the end.

Each run draws a pipeline (records, batch size, data seed, epochs) and a repeat
queue (num_repeats, group size, shuffle seed), then alternates: advance a
random number of elements (zero included), save the state to bytes, restore it
into a *fresh* iterator, and carry on with that one, discarding the old. Bytes
go through either `encode_state`/`write_files`/`read_state` or the Orbax
handler's `save`/`restore`, in a temporary directory. The whole interrupted
stream must equal the uninterrupted one bit for bit — including a counter that
`produce` stamps on every rollout, so a restore that regenerated a pending
item (or skipped one) would show — and a finite run must end at the same
element.

The default run does 100 cycles; the slow variant does 1,000.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from typing import Any, Iterator

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import checkpoint
from ckpt_iter import state as state_lib


@dataclasses.dataclass(frozen=True)
class RunConfig:
  records: int
  batch_size: int
  data_seed: int | None
  num_epochs: int | None
  num_repeats: int
  group_size: int
  shuffle_seed: int | None

  @classmethod
  def draw(cls, rng: random.Random) -> "RunConfig":
    return cls(
        records=rng.randint(6, 30),
        batch_size=rng.randint(1, 3),
        data_seed=rng.choice([None, rng.randrange(2**32)]),
        num_epochs=rng.choice([1, 2, 3, None]),
        num_repeats=rng.randint(1, 4),
        group_size=rng.randint(1, 4),
        shuffle_seed=rng.choice([None, rng.randrange(2**32)]),
    )


class _Producer:
  """A rollout stand-in: arrays from the batch plus a per-run call counter."""

  def __init__(self):
    self.calls = 0

  def __call__(self, batch: dict) -> dict:
    self.calls += 1
    ids = batch["x"]
    return {
        "ids": ids,
        "logp": (ids.astype(np.float32) / 7.0 - self.calls),
        "call": np.int64(self.calls),
        "nested": [ids[:1], (np.asarray(self.calls, np.int32),)],
    }


def _make(config: RunConfig, producer: _Producer) -> ckpt_iter.RepeatIterator:
  dataset = ckpt_iter.make_dataset(
      [{"x": i} for i in range(config.records)], batch_size=config.batch_size,
      seed=config.data_seed, num_epochs=config.num_epochs, shard_index=0, shard_count=1,
  )
  return ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(dataset), produce=producer, num_repeats=config.num_repeats,
      group_size=config.group_size, shuffle_seed=config.shuffle_seed,
  )


def _canonical(node: Any) -> Any:
  """A comparable form of an element: every array as (dtype, shape, bytes)."""
  if isinstance(node, dict):
    return {k: _canonical(v) for k, v in node.items()}
  if isinstance(node, (list, tuple)):
    return (type(node).__name__, [_canonical(v) for v in node])
  array = np.asarray(node)
  return (array.dtype.str, array.shape, array.tobytes())


def _take(iterator: Iterator[Any], count: int) -> tuple[list[Any], bool]:
  """Up to `count` elements, and whether the iterator ended."""
  taken = []
  for _ in range(count):
    try:
      taken.append(_canonical(next(iterator)))
    except StopIteration:
      return taken, True
  return taken, False


def _round_trip(iterator: ckpt_iter.RepeatIterator, fresh: ckpt_iter.RepeatIterator, how: str) -> None:
  """Saves `iterator` to files and restores them into `fresh`."""
  with tempfile.TemporaryDirectory() as directory:
    if how == "files":
      header, arrays = state_lib.encode_state(iterator.state())
      checkpoint.write_files(directory, header, arrays, process_index=0, process_count=1)
      fresh.restore_state(checkpoint.read_state(directory, 0, 1))
    else:
      handler = ckpt_iter.IteratorCheckpointHandler(process_index=0, process_count=1)
      handler.save(directory, ckpt_iter.IteratorSave(iterator))
      handler.restore(directory, ckpt_iter.IteratorRestore(fresh))


def _soak(seed: int, cycles: int, cycles_per_run: int) -> dict[str, int]:
  rng = random.Random(seed)
  stats = {"cycles": 0, "runs": 0, "elements": 0, "restores_with_pending": 0, "finite_runs_ended": 0}
  while stats["cycles"] < cycles:
    config = RunConfig.draw(rng)
    length_cap = 400  # for num_epochs=None
    reference, ended = _take(_make(config, _Producer()), length_cap)

    producer = _Producer()  # one per interrupted run, shared by its iterators
    iterator = _make(config, producer)
    stream: list[Any] = []
    run_cycles = min(cycles_per_run, cycles - stats["cycles"])
    mean_step = max(1, len(reference) // (run_cycles + 1))
    for _ in range(run_cycles):
      taken, _ = _take(iterator, rng.choice([0, rng.randint(1, 2 * mean_step)]))
      stream.extend(taken)
      if iterator.state().pending is not None:
        stats["restores_with_pending"] += 1
      fresh = _make(config, producer)
      _round_trip(iterator, fresh, rng.choice(["files", "handler"]))
      iterator = fresh
      stats["cycles"] += 1
    rest, fresh_ended = _take(iterator, length_cap - len(stream))
    stream.extend(rest)

    assert len(stream) == len(reference), (
        f"seed {seed}, {config}: {len(stream)} elements after restores, {len(reference)} uninterrupted"
    )
    for index, (got, want) in enumerate(zip(stream, reference)):
      assert got == want, f"seed {seed}, {config}: element {index} differs after restores"
    assert fresh_ended == ended, f"seed {seed}, {config}: ended={fresh_ended}, uninterrupted ended={ended}"
    stats["runs"] += 1
    stats["elements"] += len(stream)
    stats["finite_runs_ended"] += int(ended)
  return stats


def test_soak_100_cycles():
  stats = _soak(seed=1234, cycles=100, cycles_per_run=10)
  print("soak:", stats)
  assert stats["cycles"] == 100
  # The draws exercised what they should: mid-group saves and finite ends.
  assert stats["restores_with_pending"] > 20
  assert 0 < stats["finite_runs_ended"] < stats["runs"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_soak_1000_cycles(seed):
  stats = _soak(seed=seed, cycles=1000, cycles_per_run=20)
  print("soak:", stats)
  assert stats["cycles"] == 1000
  assert stats["restores_with_pending"] > 200
  assert 0 < stats["finite_runs_ended"] < stats["runs"]


def test_soak_detects_a_lost_pending_item():
  """Control: drop one pending item at a restore and the check fails."""
  config = RunConfig(records=12, batch_size=1, data_seed=3, num_epochs=1,
                     num_repeats=2, group_size=3, shuffle_seed=9)
  reference, _ = _take(_make(config, _Producer()), 100)
  producer = _Producer()
  iterator = _make(config, producer)
  stream, _ = _take(iterator, 4)
  value = iterator.state()
  assert value.pending is not None and len(value.pending.schedule) > 1
  damaged = dataclasses.replace(value, pending=state_lib.Pending(
      items=value.pending.items, schedule=value.pending.schedule[1:]))
  fresh = _make(config, producer)
  fresh.restore_state(damaged)
  rest, _ = _take(fresh, 100)
  assert stream + rest != reference
