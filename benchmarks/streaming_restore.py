"""Q21: a Hugging Face stream's restore at a deep position: its own state (StreamingIterator) vs replay.

A local JSONL corpus (4 files, `RECORDS` records of ~120 bytes) loaded with
`datasets.load_dataset("json", ..., streaming=True)`, no network, read in
batches of 8. At each depth a run reads that many records and saves; a fresh
iterator over a freshly loaded stream is restored and reads one batch:

  stream   ckpt_iter.StreamingIterator: `load_state_dict` of the saved state,
           then Hugging Face seeks inside the file it was in;
  replay   ckpt_iter.ReplayIterator over the same batches: the restore reads
           every batch up to the position again.

Wall time of restore + first batch (the time to the first batch a resumed
job trains), medians of interleaved rounds; the ratio replay / stream in the
same run. Both states pass through their stored JSON form.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from typing import Any, Callable

import _common
import datasets

import ckpt_iter
from ckpt_iter import streaming
from ckpt_iter import testing

RECORDS = 200_000
FILES = 4
BATCH = 8
DEPTHS = (1_000, 20_000, 100_000, 190_000)


def write_corpus(directory: str, records: int) -> list[str]:
  paths, per_file = [], records // FILES
  for part in range(FILES):
    path = os.path.join(directory, f"corpus-{part:02d}.jsonl")
    with open(path, "w") as f:
      for i in range(part * per_file, (part + 1) * per_file):
        f.write(json.dumps({"id": i, "text": f"prompt number {i} " + "x" * 80}) + "\n")
    paths.append(path)
  return paths


def load(paths: list[str]):
  return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


def _stream_state(paths: list[str], depth: int) -> dict:
  iterator = streaming.StreamingIterator(load(paths), batch_size=BATCH)
  for _ in range(depth // BATCH):
    next(iterator)
  return testing.stored_round_trip(iterator.state().to_dict())


def _replay_state(paths: list[str], depth: int) -> dict:
  iterator = ckpt_iter.ReplayIterator(_generator(paths))
  for _ in range(depth // BATCH):
    next(iterator)
  return testing.stored_round_trip(iterator.state().to_dict())


def _generator(paths: list[str]):
  yield from streaming.StreamingIterator(load(paths), batch_size=BATCH)


def restore_seconds(kind: str, paths: list[str], state: dict) -> tuple[float, list[int]]:
  source = load(paths)  # built before the clock starts: a resumed job builds its pipeline either way
  iterator = (streaming.StreamingIterator(source, batch_size=BATCH) if kind == "stream"
              else ckpt_iter.ReplayIterator(_generator_from(source)))
  started = time.perf_counter()
  iterator.set_state(state)
  first = next(iterator)
  return time.perf_counter() - started, first["id"].tolist()


def _generator_from(source):
  yield from streaming.StreamingIterator(source, batch_size=BATCH)


class _PerElementState(streaming.StreamingIterator):
  """The iterator as it was before 0.3.0: the source's state_dict() taken at every element."""

  def __next__(self):
    element = super().__next__()
    self._source_state = self._source.state_dict()  # pylint: disable=protected-access
    return element


def _reader(paths: list[str], batch: int, kind: str) -> Callable[[], Any]:
  """One element's read (`kind`): the stream's own next() at batch 1, else its records cut and stacked as the
  iterator does ("hf"); the iterator ("now"); the iterator as before 0.3.0 ("before")."""
  source = load(paths)
  if kind == "hf":
    from ckpt_iter import _stacking  # pylint: disable=g-import-not-at-top

    stream = iter(source)
    if batch == 1:
      return lambda: next(stream)
    counter = itertools.count()
    return lambda: _stacking.stack_records([next(stream) for _ in range(batch)], batch_index=next(counter))
  make = streaming.StreamingIterator if kind == "now" else _PerElementState
  iterator = make(source, batch_size=None if batch == 1 else batch)
  return lambda: next(iterator)


def per_element_ratios(paths: list[str], batch: int, blocks: int, per_block: int) -> dict[str, list[float]]:
  """Per kind, each block's CPU per element over the stream's own, the kinds read block by block in turn
  (their order alternating): the machine's drift falls on all of them alike."""
  kinds = ("hf", "now", "before")
  readers = {kind: _reader(paths, batch, kind) for kind in kinds}
  for read in readers.values():
    read()  # each stream started outside the timing
  ratios: dict[str, list[float]] = {"now": [], "before": []}
  for block in range(blocks):
    seconds = {}
    for kind in (kinds if block % 2 else kinds[::-1]):
      read, started = readers[kind], time.process_time()
      for _ in range(per_block):
        read()
      seconds[kind] = time.process_time() - started
    for kind in ratios:
      ratios[kind].append(seconds[kind] / seconds["hf"])
  return {kind: sorted(values) for kind, values in ratios.items()}


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  reporter = _common.Reporter("streaming_restore", args.quick)
  records = 20_000 if args.quick else RECORDS
  depths = [d for d in DEPTHS if d < records] if not args.quick else [1_000, 10_000]
  rounds = 1 if args.quick else 3
  checks = []
  with tempfile.TemporaryDirectory() as directory:
    paths = write_corpus(directory, records)
    load(paths)  # the builder's module resolved once, outside every timing
    for depth in depths:
      states = {"stream": _stream_state(paths, depth), "replay": _replay_state(paths, depth)}
      times: dict[str, list[float]] = {"stream": [], "replay": []}
      for _ in range(rounds):
        for kind in ("stream", "replay"):
          seconds, ids = restore_seconds(kind, paths, states[kind])
          expected = list(range(depth // BATCH * BATCH, depth // BATCH * BATCH + BATCH))
          if ids != expected:
            raise AssertionError(f"{kind} at {depth}: first batch {ids}, expected {expected}")
          times[kind].append(seconds)
      stream_s, replay_s = _common.median(times["stream"]), _common.median(times["replay"])
      state_bytes = len(json.dumps(states["stream"]))
      reporter.measurement(depth_records=depth, stream_restore_s=_common.rounded(stream_s),
                           replay_restore_s=_common.rounded(replay_s),
                           ratio=_common.rounded(replay_s / stream_s, 3), stream_state_bytes=state_bytes)
      checks.append(_common.check(f"{depth:,} records: restore through the stream's state, s",
                                  _common.rounded(stream_s, 3), "<= 0.2", stream_s <= 0.2,
                                  replay=_common.rounded(replay_s, 3)))
    # Per element: the iterator's bookkeeping against the stream itself.
    # Paired: the three reads interleaved in blocks of elements; a ratio is the median of the blocks' own,
    # its spread their quartiles.
    for batch in (1, 8):
      per_block = 1000 if batch == 1 else 125
      ratios = per_element_ratios(paths, batch, 30 if args.quick else 150, per_block)
      now, before = (_common.median(ratios[k]) for k in ("now", "before"))
      quartiles = [_common.rounded(ratios["now"][len(ratios["now"]) * q // 4], 4) for q in (1, 3)]
      reporter.measurement(part="per_element", batch=batch, now_over_hf=_common.rounded(now, 4),
                           before_over_hf=_common.rounded(before, 4), now_over_hf_quartiles=quartiles)
      checks.append(_common.check(f"batch {batch}: StreamingIterator per element, over the stream's own next() "
                                  "(CPU, interleaved blocks)", _common.rounded(now, 4), "<= 1.03", now <= 1.03,
                                  before_0_2=_common.rounded(before, 4), quartiles=quartiles))
  reporter.note("Each first batch after a restore was the uninterrupted run's (checked).")
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
