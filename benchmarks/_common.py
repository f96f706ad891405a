"""Shared helpers of the benchmark scripts: JSON-line output and timing.

Every script prints one JSON object per measurement and one summary line
({"kind": "summary", "checks": [...], "met": bool}). Comparisons are measured
side by side in one run (interleaved repetitions) and reported as ratios of
medians, because the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
# The demo's toy runs (demo/) are the benchmarks' workload; they are not installed.
if REPO_DIR not in sys.path:
  sys.path.append(REPO_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), REPO_DIR) if p)


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="fast smoke pass (fewer, smaller repetitions)")
  if extra is not None:
    extra(parser)
  return parser.parse_args()


class Reporter:
  """Prints JSON lines tagged with the benchmark name."""

  def __init__(self, benchmark: str, quick: bool):
    self.benchmark = benchmark
    self.quick = quick
    self._started = time.perf_counter()

  def measurement(self, **fields: Any) -> None:
    self._emit({"kind": "measurement", **fields})

  def note(self, text: str) -> None:
    self._emit({"kind": "note", "text": text})

  def summary(self, checks: list[dict[str, Any]], **fields: Any) -> None:
    """checks: [{"name", "value", "target", "met"}, ...]."""
    self._emit({
        "kind": "summary",
        "checks": checks,
        "met": all(c["met"] for c in checks),
        "quick": self.quick,
        "seconds": round(time.perf_counter() - self._started, 1),
        **fields,
    })

  def _emit(self, record: dict[str, Any]) -> None:
    print(json.dumps({"benchmark": self.benchmark, **record}), flush=True)


def check(name: str, value: Any, target: str, met: bool, **extra: Any) -> dict[str, Any]:
  return {"name": name, "value": value, "target": target, "met": bool(met), **extra}


def median(values: list[float]) -> float:
  return statistics.median(values)


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
  """Wall time of one call in milliseconds, and its result."""
  started = time.perf_counter()
  result = fn()
  return (time.perf_counter() - started) * 1e3, result


def rounded(value: float, digits: int = 4) -> float:
  """Rounds to `digits` significant digits (readable JSON, no false precision)."""
  if value == 0 or value != value:
    return value
  return float(f"{value:.{digits}g}")


def load_average() -> list[float]:
  with open("/proc/loadavg") as f:
    return [float(x) for x in f.read().split()[:3]]


def child_env(**extra: str) -> dict[str, str]:
  """Environment of a benchmark's worker process (CPU JAX, quiet logs)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  env.update(extra)
  return env


def python() -> str:
  return sys.executable


def exported(commit: str, prefix: str) -> str | None:
  """A directory holding `commit`'s ckpt_iter package (git archive), or None without git or the commit.

  What a benchmark measures as *before*, in a process of its own beside this tree's.
  """
  directory = tempfile.mkdtemp(prefix=prefix)
  try:
    archive = subprocess.run(["git", "-C", REPO_DIR, "archive", commit, "ckpt_iter"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
  except (OSError, subprocess.CalledProcessError):
    shutil.rmtree(directory, ignore_errors=True)
    return None
  return directory
