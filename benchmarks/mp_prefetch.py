"""Q9: worker processes (mp_prefetch) — restore cost and iterator overhead.

Pipeline: `make_dataset` over 997 in-memory records, batch_size 1,
num_epochs=None, then `.to_iter_dataset().mp_prefetch(num_workers=k)`.

1. Time to first batch, k = 2 and 4 workers, from building the iterator to
   holding its first batch (the worker processes are spawned inside):

     fresh_ms     DataIterator(ds); next()
     restore_ms   DataIterator(ds); set_state(state at element 1e5); next()
     resize_ms    the same with a state written by 2 workers (translated to k;
                  informational, k = 4 only)

   Fresh and restore alternate within one run; the check is the median of the
   paired ratios restore / fresh - 1 (target <= 10%). The state at 1e5 is the
   one Grain's interleave holds after 1e5 elements (worker j at
   len(range(j, 1e5, k))); the first batch after the restore is checked to be
   record 1e5 mod 997.

2. Throughput with 2 workers: DataIterator(ds) vs Grain's own iterator
   `ds.__iter__()`, both alive at once; blocks of 1,000 next() calls
   alternate (ABBA); overhead = median of the paired block-time ratios - 1
   (target <= 3%). Process CPU time of the main process is the cross-check.

Run as a script: workers are spawned, so this module has a __main__ guard,
and absl's flags are marked parsed (jax >= 0.10, google/grain#1355).
"""

from __future__ import annotations

import statistics
import time

import _common

from absl import flags
import grain

import ckpt_iter

NUM_RECORDS = 997
POSITION = 10**5
WORKER_COUNTS = (2, 4)


def build(num_workers: int) -> grain.IterDataset:
  records = [{"prompt_id": i, "text": f"what is {i} plus {i}"} for i in range(NUM_RECORDS)]
  dataset = ckpt_iter.make_dataset(records, batch_size=1, num_epochs=None, shard_index=0, shard_count=1)
  return dataset.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))


def interleave_position(num_elements: int, num_workers: int) -> dict:
  """Grain's interleave state after `num_elements` elements from `num_workers` workers."""
  return {
      "next_index_in_cycle": num_elements % num_workers,
      "next_index_in_datasets": num_workers,
      "iterators_in_use_indices": list(range(num_workers)),
      "iterators_in_use_states": [
          {"next_index": len(range(j, num_elements, num_workers))} for j in range(num_workers)
      ],
      "exhausted": [0] * num_workers,
      "future_states": {},
  }


def state_at(num_elements: int, num_workers: int) -> dict:
  iterator = ckpt_iter.DataIterator(build(num_workers))
  try:
    state = iterator.get_state()
  finally:
    iterator.close()
  return {**state, "position": interleave_position(num_elements, num_workers)}


def first_batch_ms(num_workers: int, state: dict | None) -> float:
  started = time.perf_counter()
  iterator = ckpt_iter.DataIterator(build(num_workers))
  if state is not None:
    iterator.set_state(state)
  element = next(iterator)
  elapsed = (time.perf_counter() - started) * 1e3
  iterator.close()
  expected = 0 if state is None else POSITION % NUM_RECORDS
  assert int(element["prompt_id"][0]) == expected, (element, expected)
  return elapsed


def iterate(iterator, num_elements: int) -> tuple[float, float]:
  """(wall ms, process CPU ms) of `num_elements` next() calls."""
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(num_elements):
    next(iterator)
  return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def measure_first_batch(report: _common.Reporter, reps: int) -> list[dict]:
  checks = []
  resized_state = state_at(POSITION, 2)
  first_batch_ms(2, None)  # warm-up: imports in this process, page cache
  for num_workers in WORKER_COUNTS:
    state = state_at(POSITION, num_workers)
    times = {"fresh": [], "restore": [], "resize": []}
    for rep in range(reps):
      order = ["fresh", "restore"] if rep % 2 == 0 else ["restore", "fresh"]
      if num_workers != 2:
        order.append("resize")
      for variant in order:
        chosen = {"fresh": None, "restore": state, "resize": resized_state}[variant]
        times[variant].append(first_batch_ms(num_workers, chosen))
    for variant, values in times.items():
      if values:
        report.measurement(num_workers=num_workers, variant=variant, position=POSITION,
                           first_batch_ms=_common.rounded(_common.median(values)),
                           repetitions=len(values), all_ms=[_common.rounded(v) for v in values])
    ratios = [r / f for r, f in zip(times["restore"], times["fresh"])]
    added = _common.median(ratios) - 1
    of_medians = _common.median(times["restore"]) / _common.median(times["fresh"]) - 1
    report.measurement(num_workers=num_workers, measure="restore_added",
                       added_percent=_common.rounded(added * 100, 3),
                       ratio_of_medians_percent=_common.rounded(of_medians * 100, 3))
    checks.append(_common.check(
        f"mp_prefetch {num_workers} workers: first batch after a restore at 1e5 / fresh start - 1 "
        "(median of paired ratios)",
        f"{added * 100:+.1f}%", "<= 10%", added <= 0.10,
        ratio_of_medians=f"{of_medians * 100:+.1f}%"))
  return checks


def measure_throughput(report: _common.Reporter, blocks: int) -> dict:
  block = 1_000
  dataset = build(2)
  iterators = {"ckpt_iter": ckpt_iter.DataIterator(dataset), "grain": dataset.__iter__()}
  try:
    for iterator in iterators.values():  # warm-up: spawn the workers
      iterate(iterator, block)
    wall = {variant: [] for variant in iterators}
    cpu = {variant: [] for variant in iterators}
    for rep in range(blocks):
      order = ["ckpt_iter", "grain"] if rep % 2 == 0 else ["grain", "ckpt_iter"]
      for variant in order:
        wall_ms, cpu_ms = iterate(iterators[variant], block)
        wall[variant].append(wall_ms)
        cpu[variant].append(cpu_ms)
  finally:
    for iterator in iterators.values():
      iterator.close()
  for variant in iterators:
    ms = _common.median(wall[variant])
    report.measurement(num_workers=2, iterator=variant, block_elements=block, blocks=blocks,
                       elements_per_second=_common.rounded(block / ms * 1e3),
                       us_per_element=_common.rounded(ms / block * 1e3),
                       cpu_us_per_element=_common.rounded(_common.median(cpu[variant]) / block * 1e3))
  wall_ratios = [a / b for a, b in zip(wall["ckpt_iter"], wall["grain"])]
  cpu_ratios = [a / b for a, b in zip(cpu["ckpt_iter"], cpu["grain"])]
  overhead = _common.median(wall_ratios) - 1
  cpu_overhead = _common.median(cpu_ratios) - 1
  report.measurement(num_workers=2, measure="overhead",
                     overhead_percent=_common.rounded(overhead * 100, 3),
                     cpu_overhead_percent=_common.rounded(cpu_overhead * 100, 3),
                     wall_ratio_quartiles=[_common.rounded(q, 4) for q in statistics.quantiles(wall_ratios, n=4)])
  return _common.check(
      "mp_prefetch 2 workers: DataIterator / Grain iterator wall time - 1 (median of paired blocks)",
      f"{overhead * 100:+.2f}%", "<= 3%", overhead <= 0.03, cpu_time=f"{cpu_overhead * 100:+.2f}%")


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  flags.FLAGS.mark_as_parsed()
  report = _common.Reporter("mp_prefetch", args.quick)
  checks = measure_first_batch(report, reps=3 if args.quick else 9)
  checks.append(measure_throughput(report, blocks=10 if args.quick else 60))
  report.summary(checks, load_average=_common.load_average())


if __name__ == "__main__":
  main()
