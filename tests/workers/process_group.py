"""Runs a group of worker processes that form one `jax.distributed` job.

Shared by the multi-process tests: every process gets a JSON config (with the
coordinator port on 127.0.0.1 and its process id), writes its log to a file
and its result to a JSON file; the group is bounded in time, and every
process is killed if needed and always reaped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_group(
    worker: Path,
    directory: Path,
    name: str,
    configs: list[dict[str, Any]],
    *,
    timeout_seconds: float,
    extra_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
  """Runs len(configs) workers as one job to completion; returns their outputs."""
  port = free_port()
  count = len(configs)
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(extra_env or {}))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  processes, logs = [], []
  try:
    for index, config in enumerate(configs):
      config = dict(config, port=port, num_processes=count, process_id=index,
                    out=str(directory / f"{name}_{index}.json"))
      config_path = directory / f"{name}_{index}.config.json"
      config_path.write_text(json.dumps(config))
      log = open(directory / f"{name}_{index}.log", "wb")  # pylint: disable=consider-using-with
      logs.append(log)
      processes.append(subprocess.Popen(
          [sys.executable, str(worker), str(config_path)],
          cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT,
      ))
    deadline = time.monotonic() + timeout_seconds
    for process in processes:
      process.wait(timeout=max(0.1, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    pytest.fail(f"{name}: workers still running after {timeout_seconds}s\n{tails(directory, name, count)}")
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
    for process in processes:
      process.wait()
    for log in logs:
      log.close()
  codes = [p.returncode for p in processes]
  if any(codes):
    pytest.fail(f"{name}: worker exit codes {codes}\n{tails(directory, name, count)}")
  return [json.loads((directory / f"{name}_{i}.json").read_text()) for i in range(count)]


def tails(directory: Path, name: str, count: int) -> str:
  parts = []
  for index in range(count):
    path = directory / f"{name}_{index}.log"
    text = path.read_text(errors="replace") if path.exists() else "<no log>"
    parts.append(f"--- process {index} ---\n{text[-3000:]}")
  return "\n".join(parts)


def initialize_distributed(config: dict[str, Any]) -> None:
  """Joins the job from a worker: the coordinator binds to 127.0.0.1 only."""
  import jax  # pylint: disable=g-import-not-at-top

  address = f"127.0.0.1:{config['port']}"
  jax.distributed.initialize(
      coordinator_address=address,
      coordinator_bind_address=address,
      num_processes=config["num_processes"],
      process_id=config["process_id"],
      initialization_timeout=60,
      heartbeat_timeout_seconds=30,
      shutdown_timeout_seconds=30,
  )
