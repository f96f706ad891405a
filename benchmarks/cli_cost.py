"""What a read-only `ckpt-iter` call costs: wall time, peak memory, modules loaded.

`inspect`, `verify` and `diff` read a few JSON headers (verify also the npz);
they should start like a small script, not like a JAX program. Each verb is
run as a fresh `python -m ckpt_iter` process on a real Orbax checkpoint (a
RepeatIterator item with pending arrays, 3 steps), repeated and interleaved;
reported are the median wall time, the median peak RSS (from wait4) and
whether jax, grain, orbax or tensorstore were imported (`-X importtime`).

Targets: `inspect` at most 1 s and 100 MB, none of those modules loaded.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import _common

import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter

HEAVY = ("jax", "grain", "orbax", "tensorstore")


def write_checkpoint(root: str) -> None:
  def produce(batch):
    return {"ids": np.asarray(batch["id"]), "logps": np.zeros((len(batch["id"]), 64), np.float32)}

  dataset = ckpt_iter.make_dataset([{"id": i} for i in range(64)], batch_size=4, seed=0, num_epochs=None)
  iterator = ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(dataset), produce=produce, num_repeats=2, group_size=2)
  with ocp.CheckpointManager(root) as manager:
    for step in range(1, 4):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()


def run_once(args: list[str]) -> tuple[float, float]:
  """(wall seconds, peak RSS in MiB) of one fresh `python -m ckpt_iter ARGS`.

  Through /usr/bin/time: a child forked from this (large) benchmark process
  would count the parent's pages it shared before exec in its own peak.
  """
  started = time.perf_counter()
  process = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "ckpt_iter", *args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_common.child_env())
  seconds = time.perf_counter() - started
  assert process.returncode == 0, (args, process.stderr[-1000:])
  return seconds, int(process.stderr.strip().splitlines()[-1]) / 1024  # %M is in KiB


def heavy_modules(args: list[str]) -> list[str]:
  process = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_iter", *args],
                           capture_output=True, text=True, env=_common.child_env())
  loaded = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in process.stderr.splitlines()
            if line.startswith("import time:")}
  return sorted(m for m in HEAVY if m in loaded)


def main() -> None:
  args = _common.parse_args(__doc__.splitlines()[0])
  report = _common.Reporter("cli_cost", args.quick)
  root = os.path.join(tempfile.mkdtemp(prefix="cli_cost_"), "ckpt")
  write_checkpoint(root)
  verbs = {"inspect": ["inspect", root], "verify": ["verify", root],
           "diff": ["diff", root, "--step", "1", "--step", "3"], "version": ["--version"]}
  repetitions = 3 if args.quick else 9
  samples: dict[str, list[tuple[float, int]]] = {name: [] for name in verbs}
  for _ in range(repetitions):
    for name, verb_args in verbs.items():
      samples[name].append(run_once(verb_args))
  results = {}
  for name, verb_args in verbs.items():
    results[name] = {
        "median_s": _common.rounded(statistics.median(s for s, _ in samples[name])),
        "median_peak_mib": _common.rounded(statistics.median(m for _, m in samples[name])),
        "heavy_modules": heavy_modules(verb_args),
    }
    report.measurement(verb=name, repetitions=repetitions, **results[name])
  inspect = results["inspect"]
  checks = [
      _common.check("inspect wall time (s)", inspect["median_s"], "<= 1", inspect["median_s"] <= 1.0),
      _common.check("inspect peak memory (MiB)", inspect["median_peak_mib"], "<= 100",
                    inspect["median_peak_mib"] <= 100),
      _common.check("read-only verbs that load jax/grain/orbax/tensorstore",
                    sum(bool(r["heavy_modules"]) for n, r in results.items() if n != "version"), "== 0",
                    all(not r["heavy_modules"] for r in results.values())),
  ]
  report.summary(checks, load_average_end=_common.load_average())


if __name__ == "__main__":
  main()
