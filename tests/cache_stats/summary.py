"""Adds up the JAX persistent-cache counts sitecustomize.py wrote: lookups, hits, hit rate.

    python tests/cache_stats/summary.py DIR
"""

import collections
import os
import sys


def main(directory: str) -> None:
  counts = collections.Counter()
  processes = 0
  for name in os.listdir(directory):
    if name.endswith(".log"):
      with open(os.path.join(directory, name), encoding="ascii") as f:
        lines = f.read().split()
      processes += bool(lines)
      counts.update(lines)
  lookups, hits = counts["lookup"], counts["hit"]
  rate = f"{hits / lookups:.1%}" if lookups else "n/a"
  print(f"JAX persistent compilation cache: {lookups} lookups, {hits} hits ({rate}) in {processes} processes")


if __name__ == "__main__":
  main(sys.argv[1])
