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

import json
import os
import tempfile
import time

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


def per_element_seconds(paths: list[str], batch: int, kind: str, records: int) -> float:
  """Seconds per element reading `records` records in elements of `batch` (`kind`: how)."""
  source = load(paths)
  started = time.perf_counter()
  if kind == "hf":  # the stream itself, cut and stacked as the iterator does, no bookkeeping
    from ckpt_iter import _stacking  # pylint: disable=g-import-not-at-top

    stream = iter(source)
    for index in range(records // batch):
      chunk = [next(stream) for _ in range(batch)]
      if batch > 1:
        _stacking.stack_records(chunk, batch_index=index)
  else:
    make = streaming.StreamingIterator if kind == "now" else _PerElementState
    iterator = make(source, batch_size=None if batch == 1 else batch)
    for _ in range(records // batch):
      next(iterator)
  return (time.perf_counter() - started) / (records // batch)


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
    # Per element: the iterator's bookkeeping against the stream itself, interleaved rounds.
    read = 4_000 if args.quick else 40_000
    for batch in (1, 8):
      times = {"hf": [], "now": [], "before": []}
      for _ in range(rounds + 2):
        for kind in times:
          times[kind].append(per_element_seconds(paths, batch, kind, read))
      hf, now, before = (_common.median(times[k]) for k in ("hf", "now", "before"))
      reporter.measurement(part="per_element", batch=batch, hf_us=_common.rounded(hf * 1e6),
                           now_us=_common.rounded(now * 1e6), before_us=_common.rounded(before * 1e6),
                           now_over_hf=_common.rounded(now / hf, 4), before_over_hf=_common.rounded(before / hf, 4))
      checks.append(_common.check(f"batch {batch}: StreamingIterator per element, over the stream itself",
                                  _common.rounded(now / hf, 4), "<= 1.03", now / hf <= 1.03,
                                  before_0_2=_common.rounded(before / hf, 4)))
  reporter.note("Each first batch after a restore was the uninterrupted run's (checked).")
  reporter.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
