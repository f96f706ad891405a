"""JSONL restart cost: the line index built by a scan vs read from its cache.

Writes one JSONL file (--megabytes, default 1024: 1 GiB), then times building
a `JsonlSource`:

- first_start: no cache yet (scan the file, write the cache);
- second_start: the cache is valid (read it, spot-check a few bytes);
- no_cache: the cache disabled (the scan alone, what every start cost before).

Repetitions are interleaved and reported as medians. The file is in the page
cache for every scan, the best case for scanning: on cold or network storage
the scan is slower and the ratio larger.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import _common

from ckpt_iter import _line_index
from ckpt_iter import sources as sources_lib

TARGET_RATIO = 20.0


def write_jsonl(path: str, megabytes: int) -> int:
  """Writes ~`megabytes` MB of records of ~200 bytes; returns the line count."""
  target = megabytes * 2**20
  lines = 0
  with open(path, "w") as f:
    while f.tell() < target:
      block = "".join(
          json.dumps({"id": lines + i, "prompts": f"question {lines + i} " + "word " * 30})
          + "\n" for i in range(10_000))
      f.write(block)
      lines += 10_000
  return lines


def main() -> None:
  args = _common.parse_args(__doc__, lambda p: p.add_argument("--megabytes", type=int, default=1024))
  megabytes = 16 if args.quick else args.megabytes
  repetitions = 2 if args.quick else 3
  reporter = _common.Reporter("jsonl_index", args.quick)
  work = tempfile.mkdtemp(prefix="ckpt_iter_jsonl_bench_")
  try:
    path = os.path.join(work, "train.jsonl")
    lines = write_jsonl(path, megabytes)
    size = os.path.getsize(path)
    cache_dir = os.path.join(work, "cache")
    cache_file = _line_index.index_cache_path(path, cache_dir)
    times = {"first_start": [], "second_start": [], "no_cache": []}
    for _ in range(repetitions):
      if os.path.exists(cache_file):
        os.remove(cache_file)
      ms, _ = _common.timed_ms(lambda: sources_lib.JsonlSource([path], index_cache_dir=cache_dir))
      times["first_start"].append(ms)
      for _ in range(2):
        ms, source = _common.timed_ms(lambda: sources_lib.JsonlSource([path], index_cache_dir=cache_dir))
        assert len(source) == lines
        times["second_start"].append(ms)
      ms, _ = _common.timed_ms(lambda: sources_lib.JsonlSource([path], index_cache_dir=""))
      times["no_cache"].append(ms)
    medians = {name: _common.median(values) for name, values in times.items()}
    for name, values in times.items():
      reporter.measurement(
          case=name, file_bytes=size, lines=lines, median_ms=_common.rounded(medians[name]),
          repetitions=len(values))
    reporter.measurement(case="cache_file", bytes=os.path.getsize(cache_file))
    ratio = medians["first_start"] / medians["second_start"]
    scan_ratio = medians["no_cache"] / medians["second_start"]
    reporter.summary([
        _common.check(
            f"{size / 2**20:.0f} MiB JSONL: first start / second start (cached index)",
            _common.rounded(ratio, 3), f">= {TARGET_RATIO:g}x", ratio >= TARGET_RATIO,
            no_cache_over_second_start=_common.rounded(scan_ratio, 3)),
    ], load_average_end=_common.load_average())
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
