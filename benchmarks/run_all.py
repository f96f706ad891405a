"""Runs every benchmark, collects their JSON lines, regenerates docs/benchmarks.md.

    python benchmarks/run_all.py            # full run (make bench), ~20 minutes on 2 cores
    python benchmarks/run_all.py --quick    # smoke pass; results and page go to a temp dir
    python benchmarks/run_all.py --docs-only  # re-render docs from benchmarks/results.jsonl
    python benchmarks/run_all.py --only NAME  # re-run one script, replace its lines, re-render

Results go to benchmarks/results.jsonl (one JSON object a line, the first one
describing the machine) and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import _common

SCRIPTS = [
    "restore_latency", "state_size", "throughput", "save_blocking", "tunix_step_time", "resume_wall_time",
    "pod_scale", "jsonl_index", "object_store", "cli_cost", "content_check", "rl_scale", "pod_bytes",
    "pending_queue", "changing_the_run", "data_map", "restore_walk", "skip_ranges",
    "plan_skips", "restore_cost", "streaming_restore", "tunix_save_cost", "cache_integrity", "corpus_start",
    "pod_share", "cache_bookkeeping",
]
RESULTS_PATH = os.path.join(_common.BENCH_DIR, "results.jsonl")
DOCS_PATH = os.path.join(_common.REPO_DIR, "docs", "benchmarks.md")


def machine() -> dict:
  cpu_model = "unknown"
  with open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("model name"):
        cpu_model = line.split(":", 1)[1].strip()
        break
  versions = {name: importlib.metadata.version(name) for name in
              ("jax", "grain", "orbax-checkpoint", "google-tunix", "numpy")}
  with open("/proc/meminfo") as f:
    mem_kib = int(f.readline().split()[1])
  return {
      "kind": "machine",
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "nproc": os.cpu_count(),
      "cpu_model": cpu_model,
      "memory_gib": round(mem_kib / 2**20, 1),
      "python": platform.python_version(),
      **versions,
  }


def run_script(name: str, quick: bool, env: dict) -> list[dict]:
  command = [sys.executable, os.path.join(_common.BENCH_DIR, f"{name}.py")] + (["--quick"] if quick else [])
  print(f"[{name}] running ...", flush=True)
  started = time.perf_counter()
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
  records = []
  for line in process.stdout.splitlines():
    if line.startswith("{"):
      records.append(json.loads(line))
  if process.returncode != 0:
    records.append({"benchmark": name, "kind": "error", "returncode": process.returncode,
                    "stderr_tail": process.stderr[-2000:]})
    print(process.stderr[-2000:], file=sys.stderr)
  summary = next((r for r in records if r.get("kind") == "summary"), None)
  verdict = "error" if summary is None else ("all targets met" if summary["met"] else "target(s) missed")
  print(f"[{name}] {time.perf_counter() - started:.0f} s: {verdict}", flush=True)
  return records


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--docs-only", action="store_true")
  parser.add_argument("--only", choices=SCRIPTS, help="re-run one script and keep the others' figures")
  args = parser.parse_args()
  if args.docs_only or args.only:
    with open(RESULTS_PATH) as f:
      records = [json.loads(line) for line in f if line.strip()]
    if args.only:
      cache_dir = tempfile.mkdtemp(prefix="bench_jax_cache_")
      try:
        fresh = run_script(args.only, args.quick, _common.child_env(BENCH_JAX_CACHE_DIR=cache_dir))
      finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
      records = [r for r in records if r.get("benchmark") != args.only] + fresh
      if not args.quick:
        with open(RESULTS_PATH, "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in records)
    write_docs(records, DOCS_PATH if not args.quick else os.path.join(tempfile.mkdtemp(), "benchmarks.md"))
    return
  started = time.perf_counter()
  header = machine()
  header["load_average_start"] = _common.load_average()
  # One JAX compilation cache for all toy Tunix processes: JIT is excluded
  # from every measurement anyway; the cache only shortens the run.
  cache_dir = tempfile.mkdtemp(prefix="bench_jax_cache_")
  env = _common.child_env(BENCH_JAX_CACHE_DIR=cache_dir)
  records = [header]
  try:
    for name in SCRIPTS:
      records.extend(run_script(name, args.quick, env))
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  header["load_average_end"] = _common.load_average()
  header["total_seconds"] = round(time.perf_counter() - started, 1)
  header["quick"] = args.quick
  print(f"all done in {header['total_seconds']:.0f} s; load average {header['load_average_start']} -> "
        f"{header['load_average_end']}")
  # A smoke pass renders too, but away from the real figures.
  out_dir = tempfile.mkdtemp(prefix="bench_quick_") if args.quick else None
  results_path = os.path.join(out_dir, "results.jsonl") if out_dir else RESULTS_PATH
  docs_path = os.path.join(out_dir, "benchmarks.md") if out_dir else DOCS_PATH
  with open(results_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  write_docs(records, docs_path)
  print(f"wrote {results_path} and {docs_path}")


def write_docs(records: list[dict], path: str = DOCS_PATH) -> None:
  from render import render  # pylint: disable=g-import-not-at-top

  with open(path, "w") as f:
    f.write(render(records))


if __name__ == "__main__":
  main()
