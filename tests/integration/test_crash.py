"""Crash during save: SIGKILL at seeded random moments, resume, no data lost.

A training process (tests/workers/crash_worker.py) trains one RepeatIterator element
per step (mu=2 repeats, shuffled repeat order, pending rollout arrays) and
saves model params + data state in one Orbax step every step, with the async
save of the previous step in flight. It is killed with SIGKILL at seeded
random moments; the next process restores `CheckpointManager.latest_step()`
and carries on. From the per-process logs the test rebuilds what the run as a
whole trained: each process's elements, truncated at the step the next process
restored from (later elements were trained by a model state that was lost, so
training them again is correct). That stream must equal an uninterrupted
reference prefix: zero skipped, zero duplicated elements. Also checked:

- the restored params agree with the restored data position (same step);
- pending rollout arrays are restored, never regenerated (each rollout carries
  OS-entropy noise, so every repeat of an item must carry identical noise);
- a step killed inside its data write — item files complete, Orbax commit not
  done — stays an Orbax tmp directory and the next process restores the step
  before it.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "crash_worker.py")
_REPO = os.path.dirname(os.path.dirname(_HERE))
_spec = importlib.util.spec_from_file_location("crash_worker", _WORKER)
crash_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_worker)

_SEGMENT_TIMEOUT_S = 120


def _config(tmp_path, plan, *, seed: int) -> dict:
  rng = random.Random(seed)
  config = {
      "records": 37,
      "batch_size": 2,
      "data_seed": rng.randrange(2**32),
      "group_size": rng.choice([2, 3]),
      "num_repeats": 2,
      "shuffle_seed": rng.randrange(2**32),
      "ckpt_dir": str((tmp_path / "ckpt").absolute()),
      "log_dir": str((tmp_path / "logs").absolute()),
      "plan": plan,
      "segment_timeout_s": _SEGMENT_TIMEOUT_S,
  }
  os.makedirs(config["log_dir"])
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config))
  return config


def _plan(
    seed: int, kills: int, *, start_delay_s: tuple[float, float],
    train_delay_s: tuple[float, float], finish_steps: int = 6,
) -> list[dict]:
  """`kills` seeded kill points, in a repeating pattern of four.

  One timed from the process start (lands in startup or restore), two timed
  from the restore (land while training, an async save in flight) and one
  inside the data item's background write of a seeded step.
  """
  rng = random.Random(seed)
  plan = []
  for k in range(kills):
    if k % 4 == 0:
      plan.append({"kind": "time", "after": "start", "delay_s": round(rng.uniform(*start_delay_s), 3)})
    elif k % 4 == 3:
      plan.append({"kind": "in_write", "after_steps": rng.randint(2, 6)})
    else:
      plan.append({"kind": "time", "after": "restore", "delay_s": round(rng.uniform(*train_delay_s), 3)})
  plan.append({"kind": "finish", "steps": finish_steps})
  return plan


def _env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
  return env


def _run_zygote(tmp_path, config) -> list[dict]:
  budget = _SEGMENT_TIMEOUT_S * 2 + 60 * len(config["plan"])
  proc = subprocess.run(
      [sys.executable, _WORKER, "zygote", str(tmp_path / "config.json")],
      capture_output=True, text=True, timeout=budget, env=_env(), cwd=_REPO,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])["outcomes"]


def _run_fresh_processes(tmp_path, config) -> list[dict]:
  """One fresh interpreter per segment; timed kills come from this process."""
  outcomes = []
  for index, entry in enumerate(config["plan"]):
    proc = subprocess.Popen(
        [sys.executable, _WORKER, "segment", str(tmp_path / "config.json"), str(index)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), cwd=_REPO,
    )
    try:
      if entry["kind"] == "time":
        try:
          if entry["after"] == "restore":
            deadline = time.monotonic() + _SEGMENT_TIMEOUT_S
            while not crash_worker.has_restored(config, index):
              assert proc.poll() is None and time.monotonic() < deadline, "segment never restored"
              time.sleep(0.005)
          proc.wait(timeout=entry["delay_s"])
          outcome = f"exit:{proc.returncode}"  # ended before its kill: a failure
        except subprocess.TimeoutExpired:
          proc.send_signal(signal.SIGKILL)
          code = proc.wait(timeout=_SEGMENT_TIMEOUT_S)
          # Only a death by this SIGKILL counts as the planned kill.
          outcome = "killed" if code == -signal.SIGKILL else f"exit:{code}"
      else:
        proc.wait(timeout=_SEGMENT_TIMEOUT_S)
        code = proc.returncode
        outcome = f"signal:{-code}" if code < 0 else f"exit:{code}"
      if outcome not in ("killed", f"signal:{signal.SIGKILL}", "exit:0"):
        outcome += " " + proc.stderr.read().decode()[-2000:]
    finally:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
      proc.stderr.close()
    outcomes.append({"outcome": outcome, "tmp_dirs": crash_worker.tmp_dirs(config["ckpt_dir"])})
  return outcomes


def _reference(config: dict, length: int) -> tuple[list[tuple[int, ...]], list[int]]:
  """The uninterrupted run: element ids per step and which rollout each is."""
  produced = []

  def produce(batch):
    produced.append(None)
    return {"ids": batch["x"], "rollout": len(produced) - 1}

  iterator = crash_worker.build_iterator(config, produce)
  ids, rollouts = [], []
  for _ in range(length):
    item = next(iterator)
    ids.append(tuple(int(i) for i in item["ids"]))
    rollouts.append(item["rollout"])
  return ids, rollouts


def _read_log(path: str) -> list[list[str]]:
  with open(path) as f:
    text = f.read()
  lines = text.split("\n")
  # A line is complete only with its newline: drop a write cut by the kill.
  return [line.split(" ") for line in lines[:-1]]


def _died_by_sigkill(outcome: str) -> bool:
  return outcome in ("killed", f"signal:{signal.SIGKILL}")


def _planned(plan: list[dict], kind: str) -> int:
  return sum(1 for entry in plan if entry["kind"] == kind)


def _assert_kills_happened(summary: dict, plan: list[dict]) -> None:
  """Every planned kill happened, and some of them hit a process mid-training."""
  assert summary["kills"] == len(plan) - 1, summary  # all but the finishing segment
  assert summary["in_write_kills"] == _planned(plan, "in_write"), summary
  assert summary["kills_while_training"] >= _planned(plan, "in_write") > 0, summary


def _check_run(config: dict, outcomes: list[dict]) -> dict:
  """Stitches the segment logs and checks them against the reference."""
  plan = config["plan"]
  assert len(outcomes) == len(plan)
  for index, (entry, ended) in enumerate(zip(plan, outcomes)):
    expected = {"time": "killed", "in_write": f"signal:{signal.SIGKILL}", "finish": "exit:0"}[entry["kind"]]
    assert ended["outcome"] == expected, f"segment {index} ({entry}) ended {ended['outcome']!r}"

  stream: list[tuple[tuple[int, ...], tuple[str, ...]]] = []  # (ids, noise) per step
  restores: list[int] = []
  pending_kill: tuple[int, str] | None = None
  parsed = []
  for index in range(len(plan)):
    path = os.path.join(config["log_dir"], f"segment_{index:03d}.log")
    parsed.append(_read_log(path) if os.path.exists(path) else [])
  trained_total = sum(1 for lines in parsed for line in lines if line[0] == "S")
  reference_ids, reference_rollouts = _reference(config, trained_total + 1)

  for index, lines in enumerate(parsed):
    for line in lines:
      tag = line[0]
      if tag == "R":
        restored, count, checksum = (int(v) for v in line[1:])
        assert restored <= len(stream), (
            f"segment {index} restored step {restored}, but only {len(stream)} steps were trained"
        )
        assert not restores or restored >= restores[-1], (
            f"segment {index} restored step {restored}, older than {restores[-1]}"
        )
        if pending_kill is not None:
          killed_step, item_dir = pending_kill
          assert restored == killed_step - 1, (
              f"step {killed_step} was killed inside its write, but segment "
              f"{index} restored step {restored} instead of {killed_step - 1}"
          )
          # The killed step was left as an Orbax tmp dir holding complete
          # data files: tempting, and never restored.
          step_name = os.path.basename(os.path.dirname(item_dir))
          assert "orbax-checkpoint-tmp" in step_name, step_name
          left = outcomes[index - 1]["tmp_dirs"].get(step_name, {})
          # (the .npz exists only when items are pending)
          assert "process_0-of-1.json" in left.get(os.path.basename(item_dir), []), left
          pending_kill = None
        # Model and data state of a step agree: params trained exactly the
        # restored elements.
        expected = sum(sum(ids) for ids in reference_ids[:restored])
        assert (count, checksum) == (restored, expected), (
            f"segment {index} restored step {restored}: params trained {count} elements "
            f"with checksum {checksum}, the data position says {restored} with {expected}"
        )
        restores.append(restored)
        del stream[restored:]
      elif tag == "S":
        step = int(line[1])
        assert step == len(stream) + 1, f"segment {index} trained step {step} after {len(stream)}"
        stream.append((tuple(int(i) for i in line[2].split(",")), tuple(line[3].split(","))))
      elif tag == "W":
        pending_kill = (int(line[1]), line[2])
      elif tag == "D":
        assert index == len(plan) - 1
        assert int(line[1]) == len(stream)

  assert parsed[-1] and parsed[-1][-1][0] == "D", "the final segment did not finish"
  assert len(stream) == restores[-1] + plan[-1]["steps"]
  trained_ids = [ids for ids, _ in stream]
  assert trained_ids == reference_ids[: len(stream)]  # nothing skipped or repeated
  noise_by_rollout = collections.defaultdict(set)
  for (_, noise), rollout in zip(stream, reference_rollouts):
    noise_by_rollout[rollout].add(noise)
  regenerated = {r: n for r, n in noise_by_rollout.items() if len(n) > 1}
  assert not regenerated, f"rollouts produced twice (pending items regenerated): {regenerated}"
  return {
      # Counted from what happened, not from the plan: each process's wait
      # status, and the marker a process logs right before killing itself.
      "kills": sum(1 for ended in outcomes if _died_by_sigkill(ended["outcome"])),
      "in_write_kills": sum(
          1 for lines, ended in zip(parsed, outcomes)
          # The marker need not be the last line: the write that kills runs in
          # Orbax's background thread while training logs on.
          if _died_by_sigkill(ended["outcome"]) and any(line[0] == "W" for line in lines)
      ),
      "kills_while_training": sum(
          1 for lines, ended in zip(parsed, outcomes)
          if _died_by_sigkill(ended["outcome"]) and any(line[0] == "S" for line in lines)
      ),
      "steps_trained": trained_total,
      "final_step": len(stream),
      "distinct_restores": len(set(restores)),
      "kills_leaving_tmp_dir": sum(1 for ended in outcomes[:-1] if ended["tmp_dirs"]),
  }


def test_sigkill_at_random_moments_loses_and_repeats_nothing(tmp_path, record_property):
  """12 seeded kill points (9 timed, 3 inside a data write) in one run.

  `make test-full` adds 40 per seed for three seeds, and 24 in fresh interpreters.
  """
  plan = _plan(seed=20240601, kills=12, start_delay_s=(0.05, 1.0), train_delay_s=(0.0, 0.6))
  config = _config(tmp_path, plan, seed=7)
  outcomes = _run_zygote(tmp_path, config)
  summary = _check_run(config, outcomes)
  record_property("crash_summary", summary)
  print("crash summary:", json.dumps(summary))
  _assert_kills_happened(summary, plan)
  assert summary["kills"] == 12
  # Each in-write kill lands at least one step after its restore.
  assert summary["final_step"] > plan[-1]["steps"]


def test_fresh_interpreters_resume_exactly(tmp_path, record_property):
  """The same check with a fresh `python` per process (no fork), 2 kill points."""
  plan = [
      {"kind": "in_write", "after_steps": 3},
      {"kind": "time", "after": "restore", "delay_s": round(random.Random(11).uniform(0.0, 0.5), 3)},
      {"kind": "finish", "steps": 4},
  ]
  config = _config(tmp_path, plan, seed=11)
  summary = _check_run(config, _run_fresh_processes(tmp_path, config))
  record_property("crash_summary", summary)
  print("crash summary:", json.dumps(summary))
  _assert_kills_happened(summary, plan)
  assert summary["kills"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_many_seeds(tmp_path, seed, record_property):
  """Long variant: 40 kill points per seed, wider delay range."""
  plan = _plan(seed=seed, kills=40, start_delay_s=(0.02, 1.5), train_delay_s=(0.0, 2.0))
  config = _config(tmp_path, plan, seed=seed)
  summary = _check_run(config, _run_zygote(tmp_path, config))
  record_property("crash_summary", summary)
  print("crash summary:", json.dumps(summary))
  _assert_kills_happened(summary, plan)
  assert summary["kills"] >= 40


@pytest.mark.slow
def test_sigkill_fresh_interpreters_many(tmp_path, record_property):
  """Long variant: 24 kill points, each process a fresh interpreter."""
  plan = _plan(seed=99, kills=24, start_delay_s=(0.5, 3.0), train_delay_s=(0.0, 1.0))
  config = _config(tmp_path, plan, seed=99)
  summary = _check_run(config, _run_fresh_processes(tmp_path, config))
  record_property("crash_summary", summary)
  print("crash summary:", json.dumps(summary))
  _assert_kills_happened(summary, plan)
  assert summary["kills"] >= 20


def test_audit_proves_a_killed_chain_and_catches_a_copied_item(tmp_path, capsys):
  """`ckpt-iter audit` on a real chain of SIGKILLed processes, then on the same root sabotaged.

  Three processes die inside a data write (the step they were writing is
  never committed, the next one resumes from the step before) and a fourth
  finishes: every resume the kept steps record must be proven exact. Then
  one step's data item is replaced by an earlier step's, as a torn copy or
  a bad manual repair would leave it: the audit must name that step.
  """
  from ckpt_iter import cli

  plan = [{"kind": "in_write", "after_steps": k} for k in (3, 2, 4)] + [{"kind": "finish", "steps": 3}]
  config = _config(tmp_path, plan, seed=5)
  summary = _check_run(config, _run_zygote(tmp_path, config))
  assert summary["in_write_kills"] == 3
  plot = tmp_path / "timeline.png"
  code = cli.main(["audit", config["ckpt_dir"], "--json", "--plot", str(plot)])
  report = json.loads(capsys.readouterr().out)
  resumes = [f for f in report["findings"] if f["resumed_from"] is not None]
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  # Each in-write kill is followed by a resume from the step before the torn one.
  assert len(resumes) == 3 and all(f["verdict"] == "ok" for f in resumes), resumes
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  steps = report["steps"]
  victim, source = steps[-2], steps[-5]
  data = os.path.join(config["ckpt_dir"], str(victim), "data")
  shutil.rmtree(data)
  shutil.copytree(os.path.join(config["ckpt_dir"], str(source), "data"), data)
  code = cli.main(["audit", config["ckpt_dir"]])
  out = capsys.readouterr().out
  assert code == 1, out
  assert f"broken: process 0: step {victim}: " in out and "broken chain" in out, out
