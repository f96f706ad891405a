"""Kill-and-resume of Tunix's agentic GRPO learner in real processes (toy model, CPU).

Scenario (tests/workers/tunix_agentic_worker.py): full batches of 4 prompts,
2 generations, num_iterations=3, mini-batch 2 of micro-batches of 1 (gradient
accumulation 2), max_steps=2, a checkpoint at every optimizer update (2
trainer inputs each). The drop-in follows the installed Tunix's order of
num_iterations:

* 0.1.7 repeats each group in a row, a global step is 4 queue items: the
  uninterrupted run trains groups 0,0 | 0,1 | 1,1 | 2,2 (4 updates);
  checkpoint 1 falls between the repeats of group 0, checkpoint 2 at a
  global-step boundary;
* main trains each group of the batch once, then replays the whole batch
  twice: groups 0,1 | 2,3 | 0,1 | 2,3 | 0,1 | 2,3 per step (12 updates in
  all); checkpoint 1 falls inside the first pass, checkpoint 2 at its end,
  before the replays.

The same scenario is run with stock Tunix (killed after update 1) and with a
separate rollout model and one prompt still in flight at the checkpoint. On
main, a second scenario (num_iterations=2) is killed inside the replay of a
full batch and compared with stock main's order of `update_actor` calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness  # noqa: E402
from demo import agentic_toyrun  # noqa: E402

from ckpt_iter import _item as item_lib
from ckpt_iter import testing
from ckpt_iter.tunix import _api

_WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "workers", "tunix_agentic_worker.py")
_PREEMPT_EXIT_CODE = 42
_FLAGS = ["--batch", "4", "--mini", "2", "--micro", "1", "--mu", "3", "--max-steps", "2"]
_FIELDS = ("prompt_ids", "completion_ids", "advantages", "old_per_token_logps", "ref_per_token_logps")
# Each toy prompt's last two token ids (tunix_agentic_worker.prompt_text).
_BATCH_0 = [(5, 6), (6, 8), (3, 12), (4, 5)]
_BATCH_1 = [(8, 4), (10, 11), (11, 17), (12, 3)]
_BATCH_0_TEXT = ["hello world", "world there", "input is", "string hello"]
_BATCH_1_TEXT = {"there string", "My name", "name library", "is input"}
# Whether the installed Tunix replays the full batch for num_iterations (main).
_REPLAYS = _api.agentic_iteration_order() == _api.AGENTIC_REPLAY_FULL_BATCH


def _expected_prompts(mu, steps=2, batches=(_BATCH_0, _BATCH_1)):
  """The groups an uninterrupted run trains, one entry per trainer input."""
  if _REPLAYS:  # each step: its batch once, then the whole batch mu - 1 more times
    return [group for batch in batches[:steps] for group in list(batch) * mu]
  # 0.1.7: each group mu times in a row; a step takes len(batch) queue items
  stream = [group for batch in batches for group in batch for _ in range(mu)]
  return stream[:steps * len(batches[0])]


def _run(root, out, cache_dir, *, learner="resumable", preempt_after=None, extra=(), flags=_FLAGS):
  return harness.run_agentic(root, out, cache_dir, learner=learner, preempt_after=preempt_after,
                             flags=[*flags, *extra])


def _prompts(inputs):
  return [tuple(x["prompt_ids"][0, -2:].tolist()) for x in inputs]


def _rolled(run):
  return [text.strip() for text in run["meta"]["rolled"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jax_cache):
  """Every process of the module, two at a time (the machine has 2 cores), once per session."""

  def build(work):
    def chain(name, steps, **kwargs):
      """Runs in one directory, killed after each of `steps`, resumed each time."""
      for index, step in enumerate([*steps, None]):
        _run(work / name, work / f"{name}{index}.npz", jax_cache, preempt_after=step, **kwargs)

    with futures.ThreadPoolExecutor(2) as pool:
      started = [
          pool.submit(_run, work / "ref", work / "reference.npz", jax_cache),
          pool.submit(chain, "segment", [1, 2]),
          pool.submit(chain, "stock", [1], learner="stock"),
          # Separate rollout model; in the first process prompt 2's rollouts wait
          # until checkpoint 1's save begins, so they are in flight at it.
          pool.submit(_run, work / "async_ref", work / "async_reference.npz", jax_cache,
                      extra=("--async-rollout",)),
          pool.submit(_run, work / "async", work / "async0.npz", jax_cache, preempt_after=1,
                      extra=("--async-rollout", "--slow-prompt", _BATCH_0_TEXT[2])),
      ]
      started[-1].result()
      _run(work / "async", work / "async1.npz", jax_cache, extra=("--async-rollout",))
      for future in started:
        future.result()

  work = harness.built_once(tmp_path_factory, "agentic", build)

  def load(*names):
    return [agentic_toyrun.load_record(str(work / f"{name}.npz")) for name in names]

  return {
      "reference": load("reference")[0], "segments": load("segment0", "segment1", "segment2"),
      "stock": load("stock0", "stock1"), "async": load("async0", "async1"),
      "async_reference": load("async_reference")[0],
  }


def test_uninterrupted_trains_groups_in_prompt_order(runs):
  reference = runs["reference"]
  expected = _expected_prompts(3)
  assert reference["meta"]["train_steps"] == len(expected) // 2
  assert _prompts(reference["inputs"]) == expected
  # The toy run learns (so a rollout with other weights would differ).
  assert any(np.any(x["advantages"] != 0) for x in reference["inputs"])


def test_killed_mid_repeat_then_at_a_boundary_resumes_bit_for_bit(runs):
  reference = runs["reference"]
  seg0, seg1, seg2 = runs["segments"]
  assert [s["meta"]["restored"]["train_steps"] for s in runs["segments"]] == [0, 1, 2]
  expected = reference["inputs"]
  total = len(_expected_prompts(3))
  for name, segment, (start, stop) in (("seg0", seg0, (0, 2)), ("seg1", seg1, (2, 4)), ("seg2", seg2, (4, total))):
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
  # seg2 restored checkpoint 2 (0.1.7: a global-step boundary; main: before
  # the replays of batch 0, which come from the checkpoint): it feeds batch 1
  # as the uninterrupted run does at the step's end, and rolls each prompt once.
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


def test_a_prompt_in_flight_at_the_save_is_waited_for_and_never_rolled_out_again(runs):
  first, resumed = runs["async"]
  # Killed after update 1 while prompt 2 was being rolled out: the save waited
  # for it (the rollout weights of the last sync are in no checkpoint), so its
  # group is in the checkpoint and the resumed process rolls out nothing of
  # batch 0.
  assert _rolled(first).count(_BATCH_0_TEXT[2]) == 2
  assert not set(_BATCH_0_TEXT) & set(_rolled(resumed)), _rolled(resumed)
  # The chain equals the uninterrupted run with the separate rollout model,
  # bit for bit: every trainer input and the final weights.
  reference = runs["async_reference"]
  testing.assert_trees_equal(first["inputs"] + resumed["inputs"], reference["inputs"], path="async chain")
  testing.assert_trees_equal(resumed["params"], reference["params"], path="async final params")
  assert _prompts(reference["inputs"]) == _expected_prompts(3)


# --- main's full-batch replay, killed inside it (num_iterations=2) ---------------------
#
# A step: 4 first-pass calls of 1 input (updates 1, 2), then one call replaying
# the 4 inputs (updates 3, 4). Killed after update 3 (inside that replay call,
# 2 of its 4 chunks trained), after update 4 (the replay's end, a global-step
# boundary), then after update 6 (step 1's first pass done, its replay
# pending), resumed each time.

_MU2_FLAGS = ["--batch", "4", "--mini", "2", "--micro", "1", "--mu", "2", "--max-steps", "2"]


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory, jax_cache):
  # Deselected on 0.1.7 (tunix_main marker), which repeats each group in a row.
  assert _REPLAYS, "this Tunix is main (it has rl_engine) but does not replay full batches"

  def build(work):
    def chain(steps):
      for index, step in enumerate([*steps, None]):
        _run(work / "chain", work / f"chain{index}.npz", jax_cache, preempt_after=step, flags=_MU2_FLAGS)

    with futures.ThreadPoolExecutor(2) as pool:
      started = [pool.submit(_run, work / "ref", work / "reference.npz", jax_cache, flags=_MU2_FLAGS),
                 pool.submit(chain, [3, 4, 6]),
                 pool.submit(_run, work / "stock", work / "stock.npz", jax_cache, learner="stock",
                             flags=_MU2_FLAGS)]
      for future in started:
        future.result()

  work = harness.built_once(tmp_path_factory, "agentic_replay", build)

  def load(name):
    return agentic_toyrun.load_record(str(work / f"{name}.npz"))

  return {"reference": load("reference"), "stock": load("stock"),
          "segments": [load(f"chain{index}") for index in range(4)], "chain_root": work / "chain"}


@pytest.mark.tunix_main
def test_replay_order_is_stock_mains(replay_runs):
  reference, stock = replay_runs["reference"], replay_runs["stock"]
  # Stock main: one call per micro-batch, then one call with the whole batch.
  assert stock["meta"]["calls"] == [1, 1, 1, 1, 4] * 2
  assert reference["meta"]["calls"] == stock["meta"]["calls"]
  assert reference["meta"]["train_steps"] == stock["meta"]["train_steps"] == 8
  assert _prompts(reference["inputs"]) == _expected_prompts(2)
  # Stock trains a step's groups in completion order: the same groups, per step.
  for step in range(2):
    window = slice(8 * step, 8 * step + 8)
    assert sorted(_prompts(stock["inputs"][window])) == sorted(_prompts(reference["inputs"][window]))


@pytest.mark.tunix_main
def test_checkpoint_inside_the_replay_records_where_it_is(replay_runs):
  data_dir = replay_runs["chain_root"] / "actor" / "3" / "data"
  value = item_lib.read_item(str(data_dir), 0, 1).value
  # The 4 inputs of step 0 (arrays), 2 chunks of its one replay pass done.
  assert value.position["replay"] == {"inputs": 4, "pass": 0, "chunks_done": 2}
  assert len(value.pending.schedule) == 4 and value.counters["micro_batches_in_step"] == 4


@pytest.mark.tunix_main
def test_killed_inside_the_replay_resumes_bit_for_bit(replay_runs):
  reference = replay_runs["reference"]
  segments = replay_runs["segments"]
  assert [s["meta"]["restored"]["train_steps"] for s in segments] == [0, 3, 4, 6]
  # seg1 finishes the interrupted replay call (its last 2 chunks); seg2 ends
  # step 0 and runs step 1's first pass; seg3 replays step 1 from the checkpoint.
  assert [s["meta"]["calls"] for s in segments] == [[1, 1, 1, 1, 4], [2], [1, 1, 1, 1], [4]]
  expected = reference["inputs"]
  bounds = [0, 6, 8, 12, 16]
  for number, segment in enumerate(segments):
    start, stop = bounds[number], bounds[number + 1]
    assert len(segment["inputs"]) == stop - start, f"seg{number}"
    for index, (got, want) in enumerate(zip(segment["inputs"], expected[start:stop])):
      testing.assert_trees_equal(got, want, path=f"seg{number}: input {start + index}")
  for got, want in zip(segments[-1]["params"], reference["params"]):
    np.testing.assert_array_equal(got, want)
  # Each batch rolled out once: batch 0 by seg0, batch 1 by seg2 (fed at the
  # step boundary it resumed from); the rest came from the checkpoints.
  assert [len(s["meta"]["rolled"]) for s in segments] == [8, 0, 8, 0]
  assert sorted(set(_rolled(segments[2]))) == sorted(_BATCH_1_TEXT)


@pytest.mark.parametrize("flag, setting", [
    (("--max-seq-token-per-tpu", "64"), "max_seq_token_per_tpu=64"),
    (("--critic",), "critic_trainer"),
])
def test_what_the_loop_does_not_reproduce_is_refused_before_training(flag, setting, tmp_path):
  """Stock packs sequences / updates a critic; the drop-in would not, so `train()` refuses by name.

  (Building the learner stays allowed: its other methods are stock's, and
  Tunix's own tests build packed learners to call them.)"""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  command = [sys.executable, _WORKER, "--root", str(tmp_path / "root"), "--out", str(tmp_path / "out.npz"),
             "--learner", "resumable", *_FLAGS, *flag]
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert process.returncode != 0
  assert "UnsupportedConfigError" in process.stderr and setting in process.stderr, process.stderr[-3000:]
  assert not (tmp_path / "out.npz").exists()  # refused before anything trained
