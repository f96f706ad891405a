"""Q3: iterator throughput — ckpt_iter.DataIterator vs Grain's own iterator.

Same pipeline, same read options (ckpt_iter's default: read in the calling
thread) for both: `DataIterator(ds)` vs `ds.to_iter_dataset(options).__iter__()`.
Two pipelines, batch_size 1 so per-element overhead is as visible as it gets:
small in-memory records, and the same records with a cheap per-record
transform. One long-lived iterator per variant; blocks of 1,000 next() calls
alternate between them (ABBA) and the overhead is the median of the paired
block-time ratios (wall time; process CPU time is reported as a cross-check,
being less disturbed by other jobs on a shared machine).

For information (not the target): Grain's default ReadOptions (16 threads),
which is what `iter(map_dataset)` — and so stock Tunix — uses.
"""

from __future__ import annotations

import statistics
import time

import _common

import grain

import ckpt_iter
from ckpt_iter.iterator import DEFAULT_READ_OPTIONS

NUM_RECORDS = 4096


def cheap_transform(record):
  return {**record, "num_words": len(record["text"].split())}


def pipelines() -> dict[str, grain.MapDataset]:
  records = [{"prompt_id": i, "text": f"what is {i} plus {i}"} for i in range(NUM_RECORDS)]
  common = dict(batch_size=1, num_epochs=None, shard_index=0, shard_count=1)
  return {
      "small_records": ckpt_iter.make_dataset(records, **common),
      "cheap_transform": ckpt_iter.make_dataset(records, transform=cheap_transform, **common),
  }


def iterate(iterator, num_elements: int) -> tuple[float, float]:
  """(wall ms, process CPU ms) of `num_elements` next() calls."""
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(num_elements):
    next(iterator)
  return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def variants(dataset):
  return {
      "ckpt_iter": lambda: ckpt_iter.DataIterator(dataset),
      "grain": lambda: dataset.to_iter_dataset(DEFAULT_READ_OPTIONS).__iter__(),
  }


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("throughput", args.quick)
  block = 1_000
  blocks = 10 if args.quick else 120
  checks = []
  for name, dataset in pipelines().items():
    iterators = {variant: build() for variant, build in variants(dataset).items()}
    for iterator in iterators.values():  # warm-up
      iterate(iterator, block)
    wall = {variant: [] for variant in iterators}
    cpu = {variant: [] for variant in iterators}
    for rep in range(blocks):
      order = ["ckpt_iter", "grain"] if rep % 2 == 0 else ["grain", "ckpt_iter"]
      for variant in order:
        wall_ms, cpu_ms = iterate(iterators[variant], block)
        wall[variant].append(wall_ms)
        cpu[variant].append(cpu_ms)
    for iterator in iterators.values():
      iterator.close()
    default_iterator = dataset.to_iter_dataset(grain.ReadOptions()).__iter__()
    iterate(default_iterator, 100)
    default_ms = _common.median([iterate(default_iterator, block // 10)[0] for _ in range(3 if args.quick else 10)])
    default_iterator.close()
    for variant in iterators:
      ms = _common.median(wall[variant])
      report.measurement(pipeline=name, iterator=variant, block_elements=block, blocks=blocks,
                         elements_per_second=_common.rounded(block / ms * 1e3),
                         us_per_element=_common.rounded(ms / block * 1e3),
                         cpu_us_per_element=_common.rounded(_common.median(cpu[variant]) / block * 1e3))
    report.measurement(pipeline=name, iterator="grain, default ReadOptions (informational)",
                       block_elements=block // 10, elements_per_second=_common.rounded(block / 10 / default_ms * 1e3),
                       us_per_element=_common.rounded(default_ms / (block / 10) * 1e3))
    wall_ratios = [a / b for a, b in zip(wall["ckpt_iter"], wall["grain"])]
    cpu_ratios = [a / b for a, b in zip(cpu["ckpt_iter"], cpu["grain"])]
    overhead = _common.median(wall_ratios) - 1
    cpu_overhead = _common.median(cpu_ratios) - 1
    report.measurement(pipeline=name, measure="overhead",
                       overhead_percent=_common.rounded(overhead * 100, 3),
                       cpu_overhead_percent=_common.rounded(cpu_overhead * 100, 3),
                       wall_ratio_quartiles=[_common.rounded(q, 4) for q in statistics.quantiles(wall_ratios, n=4)])
    checks.append(_common.check(f"{name}: DataIterator / Grain iterator wall time - 1 (median of paired blocks)",
                                f"{overhead * 100:+.2f}%", "<= 3%", overhead <= 0.03,
                                cpu_time=f"{cpu_overhead * 100:+.2f}%"))
  report.summary(checks)


if __name__ == "__main__":
  main()
