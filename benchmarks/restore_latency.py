"""Q1: restore latency vs position — ckpt_iter restore vs next() replay.

Same pipeline for both: `make_dataset` over 1,000 in-memory records,
batch_size 1, num_epochs=None, read in the calling thread (ckpt_iter's
default ReadOptions). For a position of N input elements:

  restore_ms            fresh DataIterator; set_state(state at N) + first next()
  restore_from_file_ms  the same, reading and validating the state file first
                        (what IteratorRestore does inside an Orbax restore)
  replay_ms             fresh DataIterator; N next() calls + first next() —
                        Tunix's fast-forward on the same iterator

Replay is O(N) (~30 us per element here), so it is measured only up to a bound
(1e6 in a full run, time-boxed) and extrapolated linearly beyond it; such rows
say `"extrapolated": true`. Stock Tunix actually replays `iter(MapDataset)`,
i.e. with Grain's default ReadOptions (16 threads): measured separately at
small N as `replay_grain_default_ms`.

Also: the first next() after a restore with Grain's default ReadOptions vs
ckpt_iter's default (num_threads=0).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import _common

import grain

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

POSITIONS = [10**k for k in range(2, 8)]
NUM_RECORDS = 1000
REPLAY_TIME_BOX_SECONDS = 120.0


def make_pipeline():
  records = [{"prompt_id": i, "text": f"prompt {i}"} for i in range(NUM_RECORDS)]
  return ckpt_iter.make_dataset(
      records, batch_size=1, num_epochs=None, shard_index=0, shard_count=1
  )


def state_at(dataset, num_elements: int) -> dict:
  """The state a DataIterator saves after yielding `num_elements` elements."""
  iterator = ckpt_iter.DataIterator(dataset)
  value = iterator.state()
  return state_lib.IteratorState(
      kind=value.kind, fingerprint=value.fingerprint, position={"next_record": num_elements}  # batch 1: a record each
  ).to_dict()


def restore_ms(dataset, state: dict, expected_id: int) -> float:
  iterator = ckpt_iter.DataIterator(dataset)
  elapsed, element = _common.timed_ms(lambda: (iterator.set_state(state), next(iterator))[1])
  assert int(element["prompt_id"][0]) == expected_id
  iterator.close()
  return elapsed


def restore_from_file_ms(dataset, directory: str, expected_id: int) -> float:
  iterator = ckpt_iter.DataIterator(dataset)

  def restore():
    value = _files.read_state(directory, 0, 1)
    iterator.restore_state(value)
    return next(iterator)

  elapsed, element = _common.timed_ms(restore)
  assert int(element["prompt_id"][0]) == expected_id
  iterator.close()
  return elapsed


def replay_ms(dataset, num_elements: int, expected_id: int, read_options=None) -> float:
  iterator = ckpt_iter.DataIterator(dataset, read_options=read_options)

  def replay():
    for _ in range(num_elements):
      next(iterator)
    return next(iterator)

  elapsed, element = _common.timed_ms(replay)
  assert int(element["prompt_id"][0]) == expected_id
  iterator.close()
  return elapsed


def first_next_ms(dataset, state: dict, read_options) -> float:
  iterator = ckpt_iter.DataIterator(dataset, read_options=read_options)
  iterator.set_state(state)
  elapsed, _ = _common.timed_ms(lambda: next(iterator))
  iterator.close()
  return elapsed


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("restore_latency", args.quick)
  restore_reps = 5 if args.quick else 15
  replay_bound = 10**4 if args.quick else 10**6
  replay_reps = {10**2: 5, 10**3: 5, 10**4: 3, 10**5: 3, 10**6: 1}
  grain_default_bound = 10**3 if args.quick else 10**4
  dataset = make_pipeline()
  states = {n: state_at(dataset, n) for n in POSITIONS}
  workdir = tempfile.mkdtemp(prefix="bench_restore_")
  directories = {}
  for n in POSITIONS:
    directories[n] = os.path.join(workdir, str(n))
    os.makedirs(directories[n])
    header, arrays = codec.encode_state(state_lib.IteratorState.from_dict(states[n]))
    _files.write_files(directories[n], header, arrays, process_index=0, process_count=1)

  times = {n: {"restore": [], "restore_from_file": [], "replay": [], "replay_grain_default": []} for n in POSITIONS}
  restore_ms(dataset, states[100], 100)  # warm-up: imports, first thread pool
  for rep in range(restore_reps):
    for n in POSITIONS:
      expected = n % NUM_RECORDS
      times[n]["restore"].append(restore_ms(dataset, states[n], expected))
      times[n]["restore_from_file"].append(restore_from_file_ms(dataset, directories[n], expected))
      if n <= replay_bound and rep < replay_reps[n]:
        if n == 10**6 and not _replay_fits(times[10**5]["replay"], n):
          continue
        times[n]["replay"].append(replay_ms(dataset, n, expected))
      if n <= grain_default_bound and rep < 3:
        times[n]["replay_grain_default"].append(
            replay_ms(dataset, n, expected, read_options=grain.ReadOptions())
        )

  shutil.rmtree(workdir, ignore_errors=True)
  measured = [n for n in POSITIONS if times[n]["replay"]]
  largest = max(measured)
  per_element_ms = _common.median(times[largest]["replay"]) / largest
  rows = {}
  for n in POSITIONS:
    row = {
        "num_elements": n,
        "restore_ms": _common.median(times[n]["restore"]),
        "restore_from_file_ms": _common.median(times[n]["restore_from_file"]),
        "restore_reps": len(times[n]["restore"]),
    }
    if times[n]["replay"]:
      row.update(replay_ms=_common.median(times[n]["replay"]), replay_reps=len(times[n]["replay"]),
                 extrapolated=False)
    else:
      row.update(replay_ms=per_element_ms * n, replay_reps=0, extrapolated=True,
                 extrapolated_from=f"{largest:,} elements, {per_element_ms * 1e3:.1f} us/element")
    if times[n]["replay_grain_default"]:
      row["replay_grain_default_ms"] = _common.median(times[n]["replay_grain_default"])
    row["speedup"] = row["replay_ms"] / row["restore_ms"]
    rows[n] = row
    report.measurement(**{k: _common.rounded(v) if isinstance(v, float) else v for k, v in row.items()})
  report.measurement(measure="replay_slope", replay_log_log_slope=_common.rounded(
      _log_log_slope(measured, [rows[n]["replay_ms"] for n in measured]), 3))

  # First next() after a restore: Grain's default ReadOptions vs ckpt_iter's.
  far_state = states[10**6]
  first = {"grain_default": [], "ckpt_iter_default": []}
  for _ in range(restore_reps):
    first["grain_default"].append(first_next_ms(dataset, far_state, grain.ReadOptions()))
    first["ckpt_iter_default"].append(first_next_ms(dataset, far_state, None))
  first_ratio = _common.median(first["grain_default"]) / _common.median(first["ckpt_iter_default"])
  for name, values in first.items():
    report.measurement(measure="first_next_after_restore", read_options=name,
                       first_next_ms=_common.rounded(_common.median(values)), reps=len(values))

  slope = _log_log_slope(POSITIONS, [rows[n]["restore_ms"] for n in POSITIONS])
  growth = rows[10**7]["restore_ms"] / rows[10**2]["restore_ms"]
  speedup_at_1e6 = rows[10**6]["speedup"]
  checks = [
      _common.check("restore_ms growth with position (log-log slope, 1e2..1e7)",
                    _common.rounded(slope, 2), "< 0.1 (O(1); O(N) replay is ~1)", slope < 0.1,
                    restore_ms_1e7_over_1e2=_common.rounded(growth, 3)),
      _common.check("restore_ms at 1e7", _common.rounded(rows[10**7]["restore_ms"]),
                    "<= 50 ms", rows[10**7]["restore_ms"] <= 50.0),
      _common.check("replay_ms / restore_ms at 1e6", _common.rounded(speedup_at_1e6, 3),
                    ">= 10000", speedup_at_1e6 >= 10_000,
                    replay_extrapolated=rows[10**6]["extrapolated"]),
  ]
  report.summary(
      checks,
      first_next_ratio_grain_default_vs_ckpt_iter=_common.rounded(first_ratio, 3),
      replay_us_per_element=_common.rounded(per_element_ms * 1e3),
  )


def _log_log_slope(xs: list[int], ys: list[float]) -> float:
  """Least-squares slope of log(y) on log(x): 0 for O(1), 1 for O(N)."""
  lx = [math.log(x) for x in xs]
  ly = [math.log(y) for y in ys]
  mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
  return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _replay_fits(previous_ms: list[float], n: int) -> bool:
  if not previous_ms:
    return False
  projected_seconds = _common.median(previous_ms) / 10**5 * n / 1e3
  return projected_seconds <= REPLAY_TIME_BOX_SECONDS


if __name__ == "__main__":
  main()
