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
import json
import random
import tempfile
from typing import Any, Iterator

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
from ckpt_iter import testing


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


def _take(iterator: Iterator[Any], count: int) -> tuple[list[Any], bool]:
  """Up to `count` elements, and whether the iterator ended."""
  taken = []
  for _ in range(count):
    try:
      taken.append(next(iterator))
    except StopIteration:
      return taken, True
  return taken, False


def _round_trip(iterator: ckpt_iter.RepeatIterator, fresh: ckpt_iter.RepeatIterator, how: str) -> str:
  """Saves `iterator` to files and restores them into `fresh`.

  Returns:
    The header of the state `fresh` holds after the restore (which must be
    the saved one), as text: what distinguishes one restore from another.
  """
  with tempfile.TemporaryDirectory() as directory:
    if how == "files":
      header, arrays = codec.encode_state(iterator.state())
      _files.write_files(directory, header, arrays, process_index=0, process_count=1)
      fresh.restore_state(_files.read_state(directory, 0, 1))
    else:
      handler = ckpt_iter.IteratorCheckpointHandler(process_index=0, process_count=1)
      handler.save(directory, ckpt_iter.IteratorSave(iterator))
      handler.restore(directory, ckpt_iter.IteratorRestore(fresh))
  restored, saved = fresh.get_state(), iterator.get_state()
  del restored["lineage"], saved["lineage"]  # a restore through the handler records itself there
  testing.assert_trees_equal(restored, saved, path="restored state")
  return json.dumps(codec.encode_state(fresh.state())[0], sort_keys=True)


def check_stream(stream: list[Any], ended: bool, reference: list[Any], reference_ended: bool, where: str) -> None:
  """THE soak check: the interrupted stream is the uninterrupted one, bit for bit.

  Raises:
    AssertionError: naming the first differing element, or the lengths.
  """
  for index, (got, want) in enumerate(zip(stream, reference)):
    testing.assert_trees_equal(got, want, path=f"{where}: element {index}")
  assert len(stream) == len(reference), (
      f"{where}: {len(stream)} elements after restores, {len(reference)} uninterrupted"
  )
  assert ended == reference_ended, f"{where}: ended={ended}, uninterrupted ended={reference_ended}"


def _soak(seed: int, cycles: int, cycles_per_run: int) -> dict[str, int]:
  rng = random.Random(seed)
  stats = {"runs": 0, "elements_checked": 0, "restores_with_pending": 0, "finite_runs_ended": 0}
  restored_states: list[str] = []
  while len(restored_states) < cycles:
    config = RunConfig.draw(rng)
    length_cap = 400  # for num_epochs=None
    reference, ended = _take(_make(config, _Producer()), length_cap)

    producer = _Producer()  # one per interrupted run, shared by its iterators
    iterator = _make(config, producer)
    stream: list[Any] = []
    run_cycles = min(cycles_per_run, cycles - len(restored_states))
    mean_step = max(1, len(reference) // (run_cycles + 1))
    for _ in range(run_cycles):
      taken, _ = _take(iterator, rng.choice([0, rng.randint(1, 2 * mean_step)]))
      stream.extend(taken)
      if iterator.state().pending is not None:
        stats["restores_with_pending"] += 1
      fresh = _make(config, producer)
      restored_states.append(_round_trip(iterator, fresh, rng.choice(["files", "handler"])))
      iterator = fresh
    rest, fresh_ended = _take(iterator, length_cap - len(stream))
    stream.extend(rest)

    check_stream(stream, fresh_ended, reference, ended, f"seed {seed}, {config}")
    stats["runs"] += 1
    stats["elements_checked"] += len(stream)
    stats["finite_runs_ended"] += int(ended)
  stats["distinct_restores"] = len(set(restored_states))
  return stats


def test_soak_100_cycles():
  stats = _soak(seed=1234, cycles=100, cycles_per_run=10)
  print("soak:", stats)
  # What the run did, not its loop bound: distinct states restored, streams
  # checked, mid-group saves and finite ends.
  assert stats["distinct_restores"] >= 40  # about half the cycles advance 0 elements
  assert stats["elements_checked"] >= 500
  assert stats["restores_with_pending"] > 20
  assert 0 < stats["finite_runs_ended"] < stats["runs"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_soak_1000_cycles(seed):
  stats = _soak(seed=seed, cycles=1000, cycles_per_run=20)
  print("soak:", stats)
  assert stats["distinct_restores"] >= 40  # about half the cycles advance 0 elements0
  assert stats["restores_with_pending"] > 200
  assert 0 < stats["finite_runs_ended"] < stats["runs"]


def test_soak_check_reports_a_lost_pending_item():
  """Control: drop one pending item at a restore; the soak's own check fails."""
  config = RunConfig(records=12, batch_size=1, data_seed=3, num_epochs=1,
                     num_repeats=2, group_size=3, shuffle_seed=9)
  reference, reference_ended = _take(_make(config, _Producer()), 100)
  producer = _Producer()
  iterator = _make(config, producer)
  stream, _ = _take(iterator, 4)
  value = iterator.state()
  assert value.pending is not None and len(value.pending.schedule) > 1
  damaged = dataclasses.replace(value, pending=state_lib.Pending(
      items=value.pending.items, schedule=value.pending.schedule[1:]))
  fresh = _make(config, producer)
  fresh.restore_state(damaged)
  rest, ended = _take(fresh, 100)

  with pytest.raises(AssertionError, match=r"element 4"):
    check_stream(stream + rest, ended, reference, reference_ended, "control")
