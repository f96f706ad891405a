"""Kill-and-resume of Tunix's agentic GRPO learner in real processes (toy model, CPU).

Scenario (tests/workers/tunix_agentic_worker.py): full batches of 4 prompts,
2 generations, num_iterations=3, mini-batch 2 of micro-batches of 1 (gradient
accumulation 2), max_steps=2, a checkpoint at every optimizer update. The
uninterrupted run trains 8 queue items in 4 updates: groups 0,0 | 0,1 | 1,1 |
2,2. Checkpoint 1 falls inside a global step and between the repeats of
group 0; checkpoint 2 at a global-step boundary. The same scenario is run with
stock Tunix (killed after update 1) and with a separate rollout model and one
prompt still in flight at the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures

import numpy as np
import pytest

from ckpt_iter import testing

_WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "workers", "tunix_agentic_worker.py")
_PREEMPT_EXIT_CODE = 42
_FLAGS = ["--batch", "4", "--mini", "2", "--micro", "1", "--mu", "3", "--max-steps", "2"]
_FIELDS = ("prompt_ids", "completion_ids", "advantages", "old_per_token_logps", "ref_per_token_logps")
# Each toy prompt's last two token ids (tunix_agentic_worker.prompt_text).
_BATCH_0 = [(5, 6), (6, 8), (3, 12), (4, 5)]
_BATCH_1 = [(8, 4), (10, 11), (11, 17), (12, 3)]
_BATCH_0_TEXT = ["hello world", "world there", "input is", "string hello"]
_BATCH_1_TEXT = {"there string", "My name", "name library", "is input"}


def _run(root, out, cache_dir, *, learner="resumable", preempt_after=None, extra=()):
  env = dict(
      os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  if "--async-rollout" in extra:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  command = [
      sys.executable, _WORKER, "--root", str(root), "--out", str(out), "--learner", learner, *_FLAGS, *extra,
  ]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  expected_rc = 0 if preempt_after is None else _PREEMPT_EXIT_CODE
  assert process.returncode == expected_rc, process.stderr[-4000:]
  data = np.load(out)
  meta = json.loads(str(data["meta"]))
  inputs = [
      {f: data[f"{i}/{f}"] for f in _FIELDS if f"{i}/{f}" in data.files} for i in range(meta["num_inputs"])
  ]
  params = [data[f"param_{i}"] for i in range(sum(k.startswith("param_") for k in data.files))]
  return {"inputs": inputs, "meta": meta, "params": params}


def _prompts(inputs):
  return [tuple(x["prompt_ids"][0, -2:].tolist()) for x in inputs]


def _rolled(run):
  return [text.strip() for text in run["meta"]["rolled"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every process of the module, two at a time (the machine has 2 cores)."""
  work = tmp_path_factory.mktemp("agentic")
  cache = work / "jax_cache"

  def chain(name, steps, **kwargs):
    """Runs in one directory, killed after each of `steps`, resumed each time."""
    return [
        _run(work / name, work / f"{name}{index}.npz", cache, preempt_after=step, **kwargs)
        for index, step in enumerate([*steps, None])
    ]

  with futures.ThreadPoolExecutor(2) as pool:
    reference = pool.submit(_run, work / "ref", work / "ref.npz", cache)
    segments = pool.submit(chain, "resumable", [1, 2])
    stock = pool.submit(chain, "stock", [1], learner="stock")
    # Separate rollout model; prompt 2's rollouts are slowed down in the first
    # process only, so they are in flight when checkpoint 1 is written.
    async_first = pool.submit(
        _run, work / "async", work / "async0.npz", cache, preempt_after=1,
        extra=("--async-rollout", "--slow-prompt", _BATCH_0_TEXT[2]),
    )
    async_first.result()
    async_resumed = _run(work / "async", work / "async1.npz", cache, extra=("--async-rollout",))
    return {
        "reference": reference.result(), "segments": segments.result(), "stock": stock.result(),
        "async": [async_first.result(), async_resumed],
    }


def test_uninterrupted_trains_groups_in_prompt_order(runs):
  reference = runs["reference"]
  assert reference["meta"]["train_steps"] == 4
  assert _prompts(reference["inputs"]) == [_BATCH_0[0]] * 3 + [_BATCH_0[1]] * 3 + [_BATCH_0[2]] * 2
  # The toy run learns (so a rollout with other weights would differ).
  assert any(np.any(x["advantages"] != 0) for x in reference["inputs"])


def test_killed_mid_repeat_then_at_a_boundary_resumes_bit_for_bit(runs):
  reference = runs["reference"]
  seg0, seg1, seg2 = runs["segments"]
  assert [s["meta"]["restored"]["train_steps"] for s in runs["segments"]] == [0, 1, 2]
  expected = reference["inputs"]
  for name, segment, (start, stop) in (("seg0", seg0, (0, 2)), ("seg1", seg1, (2, 4)), ("seg2", seg2, (4, 8))):
    assert len(segment["inputs"]) == stop - start, name
    for index, (got, want) in enumerate(zip(segment["inputs"], expected[start:stop])):
      assert set(got) == set(_FIELDS)
      testing.assert_trees_equal(got, want, path=f"{name}: input {start + index}")
  for got, want in zip(seg2["params"], reference["params"]):
    np.testing.assert_array_equal(got, want)


def test_pending_groups_come_from_the_checkpoint_not_a_new_rollout(runs):
  seg0, seg1, seg2 = runs["segments"]
  # seg0 rolled out batch 0 (4 prompts x 2 generations); everything seg1
  # trains was produced by seg0 and restored from checkpoint 1.
  assert len(seg0["meta"]["rolled"]) == 8
  assert seg1["meta"]["rolled"] == []
  # seg2 restored checkpoint 2 (a global-step boundary): it feeds batch 1, as
  # the uninterrupted run does right after update 2, and rolls each prompt once.
  rolled = _rolled(seg2)
  assert sorted(set(rolled)) == sorted(_BATCH_1_TEXT) and len(rolled) == 8


def test_stock_skips_the_rest_of_the_batch(runs):
  killed, resumed = runs["stock"]
  assert resumed["meta"]["restored"] == {"train_steps": 1, "global_steps": 1}
  assert len(killed["inputs"]) == 2
  # Stock drops `global_steps` = 1 full batch: of batch 0 only the 2 repeats
  # trained before the kill survive; the resumed run trains batch 1 instead of
  # the 6 remaining inputs from batch 0 (the uninterrupted run's). How much of
  # batch 1 one global step trains is Tunix's own accounting: 0.1.7 takes 4
  # queue items (groups repeated num_iterations times in a row), main trains
  # each of the 4 groups once, then the whole batch twice more (12 inputs).
  assert len(resumed["inputs"]) in (4, 12)
  assert set(_prompts(resumed["inputs"])) <= set(_BATCH_1)


def test_in_flight_prompt_is_rolled_out_again_exactly_once(runs):
  first, resumed = runs["async"]
  # Killed after update 1 while prompt 2 was still being rolled out: groups
  # 0 and 1 came from the checkpoint, prompt 2 was re-read from its saved
  # position and rolled out once (2 generations) in the resumed process.
  assert _rolled(first).count(_BATCH_0_TEXT[2]) == 2
  assert _rolled(resumed).count(_BATCH_0_TEXT[2]) == 2
  assert _BATCH_0_TEXT[0] not in _rolled(resumed) and _BATCH_0_TEXT[1] not in _rolled(resumed)
  # Nothing skipped or trained twice: the uninterrupted order.
  trained = _prompts(first["inputs"]) + _prompts(resumed["inputs"])
  assert trained == [_BATCH_0[0]] * 3 + [_BATCH_0[1]] * 3 + [_BATCH_0[2]] * 2
