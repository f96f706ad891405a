"""Q18: restore CPU vs the number of skip ranges a state carries.

A state's fingerprint field `skips` holds up to 10,000 ranges
(`skips_lib.MAX_RANGES`). A restore parses them, merges them with the ones the
pipeline declares and computes what it adds (`Skips.of`, `Skips.union`,
`Skips.added_to`, `skips_lib.subtract`), then cuts the plan around them. Both
range lists are sorted, so all of it can be O(k log k) in k ranges.

Pipeline: `make_dataset` over 100,000 in-memory records, batch_size 4,
num_epochs=None, no shuffle; a state saved after one batch with k ranges of 5
records each, 10 records apart:

  stream        Skip(records=...): stream ranges from record 1,000 on
  every_epoch   Skip(source_records=...): source records of every epoch

The restoring pipeline declares the same ranges (what a user who keeps the
declaration in their config does). restore_cpu_ms is the process CPU time of
`set_state` and the first `next()` on a fresh `DataIterator` (median).
"""

from __future__ import annotations

import math
import time

import _common

import ckpt_iter

NUM_RECORDS = 100_000
RANGE_COUNTS = [10**2, 10**3, 10**4]
FORMS = ["stream", "every_epoch"]


def declared(form: str, num_ranges: int) -> ckpt_iter.Skip:
  ranges = [(10 * i, 10 * i + 5) for i in range(num_ranges)]
  if form == "stream":
    return ckpt_iter.Skip(records=[(1000 + a, 1000 + b) for a, b in ranges])
  return ckpt_iter.Skip(source_records=ranges)


def pipeline(records: list, skip: ckpt_iter.Skip):
  return ckpt_iter.make_dataset(records, batch_size=4, num_epochs=None, shard_index=0, shard_count=1,
                                skip=skip)


def saved_state(records: list, skip: ckpt_iter.Skip) -> dict:
  iterator = ckpt_iter.DataIterator(pipeline(records, skip))
  next(iterator)
  state = iterator.get_state()
  iterator.close()
  return state


def restore_cpu_ms(records: list, skip: ckpt_iter.Skip, state: dict, expected_first: int) -> float:
  iterator = ckpt_iter.DataIterator(pipeline(records, skip))
  started = time.process_time()
  iterator.set_state(state)
  batch = next(iterator)
  elapsed = (time.process_time() - started) * 1e3
  assert int(batch["id"][0]) == expected_first, (int(batch["id"][0]), expected_first)
  iterator.close()
  return elapsed


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("skip_ranges", args.quick)
  reps = {10**2: 3 if args.quick else 9, 10**3: 3 if args.quick else 7, 10**4: 1 if args.quick else 3}
  records = [{"id": i} for i in range(NUM_RECORDS)]
  cases = {}
  for form in FORMS:
    for num_ranges in RANGE_COUNTS:
      skip = declared(form, num_ranges)
      state = saved_state(records, skip)
      # The first record after one batch: 4 (stream ranges start at 1,000) or the 5th kept one.
      expected = 4 if form == "stream" else 10 + 4 - 5
      cases[form, num_ranges] = (skip, state, expected)
  restore_cpu_ms(records, *cases["stream", 10**2])  # warm-up: first thread pool, imports
  times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
  for rep in range(max(reps.values())):
    for (form, num_ranges), case in cases.items():
      if rep < reps[num_ranges]:
        times[form, num_ranges].append(restore_cpu_ms(records, *case))
  checks = []
  for form in FORMS:
    medians = [_common.median(times[form, n]) for n in RANGE_COUNTS]
    for num_ranges, value in zip(RANGE_COUNTS, medians):
      report.measurement(form=form, num_ranges=num_ranges, restore_cpu_ms=_common.rounded(value),
                         reps=len(times[form, num_ranges]))
    slope = _log_log_slope(RANGE_COUNTS, medians)
    report.measurement(form=form, measure="slope", restore_cpu_log_log_slope=_common.rounded(slope, 3))
    checks.append(_common.check(
        f"{form} ranges: restore CPU growth with ranges (log-log slope, 1e2..1e4)", _common.rounded(slope, 3),
        "<= 1.1 (O(k log k); a pairwise comparison is 2)", slope <= 1.1,
        restore_cpu_ms_at_1e4=_common.rounded(medians[-1])))
  report.summary(checks, load_average_end=_common.load_average())


def _log_log_slope(xs: list[int], ys: list[float]) -> float:
  """Least-squares slope of log(y) on log(x): 1 for O(k), 2 for O(k^2)."""
  lx = [math.log(x) for x in xs]
  ly = [math.log(y) for y in ys]
  mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
  return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


if __name__ == "__main__":
  main()
