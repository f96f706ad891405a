"""Runs toy Tunix trainings one after another in this one process.

    python tunix_conformance_worker.py RUNS.json

RUNS.json is a list of {"config": RunConfig fields, "root": dir, "out": npz}.
The differential suite runs a configuration's stock and drop-in uninterrupted
runs here, stock first (before ckpt_iter.tunix is imported): the two share one
JAX start-up and compilation cache. Runs that are killed and resumed go
through tunix_toy.py in processes of their own.
"""

from __future__ import annotations

import json
import sys

import tunix_toy


def main(path: str) -> int:
  with open(path, encoding="utf-8") as f:
    runs = json.load(f)
  for run in runs:
    tunix_toy.run(tunix_toy.RunConfig(**run["config"]), run["root"], run["out"])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
