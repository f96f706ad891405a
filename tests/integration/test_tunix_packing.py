"""Sequence packing (max_seq_token_per_tpu), in real processes killed after a checkpoint.

Tunix packs each mini-batch's queue of TrainExamples into packed trainer
inputs (segment_ids / segment_positions). google-tunix 0.1.7 packs greedily,
one packed row per trainer input and an update per row, so a checkpoint can
fall between two rows of one queue item ("inside a packed group"). Upstream
main packs chunks and updates once per mini-batch pass (`is_update_step`), so
a checkpoint falls between passes, mid mini-batch. Either way the resumed
trainer inputs must equal the uninterrupted run's bit for bit, and the
drop-in must train what stock Tunix trains.

Runs on whichever Tunix is installed (0.1.7 in .venv, upstream main in
.venv-tunix-main via `make test-tunix-main`).
"""

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness

# 2 prompts x 2 generations = 4 sequences per queue item, each 6 to 12
# tokens: a budget of 20 tokens packs 1 to 3 sequences per row, so rows
# straddle queue items (and the two passes of num_iterations=2).
CONFIG = dict(num_iterations=2, batch_size=2, max_seq_token_per_tpu=20, max_steps=8)
SEQUENCES_PER_ITEM = 4


def _updates_per_pass():
  from ckpt_iter.tunix import _api  # pylint: disable=g-import-not-at-top

  return _api.packing_updates_per_pass()


# 0.1.7: steps 5 and 6 fall after 11 and 13 packed sequences: inside queue
# items (the row after 5 spans two items). Main: after the first pass of a
# mini-batch (of 2 prompts), twice.
PREEMPT = [1, 3] if _updates_per_pass() else [5, 6]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jax_cache):
  path = tmp_path_factory.mktemp("packing_reference")
  return harness.run_toy(dict(CONFIG, learner="ckpt_iter"), str(path / "ckpt"),
                         str(path / "ref.npz"), cache_dir=jax_cache)


def _sequences_before(run, step):
  """Packed sequences the uninterrupted run trained before checkpoint `step`."""
  return sum(int(np.max(x["segment_ids"])) for x, s in zip(run.inputs, run.meta["train_steps"]) if s < step)


def test_packed_inputs_are_stock_tunix_own(reference, tmp_path, jax_cache):
  stock = harness.run_toy(dict(CONFIG, learner="stock"), str(tmp_path / "stock"),
                          str(tmp_path / "stock.npz"), cache_dir=jax_cache)
  assert all("segment_ids" in x for x in reference.inputs), "the run did not pack"
  harness.assert_same_inputs(reference.inputs, stock.inputs, "packed, uninterrupted vs stock")
  assert reference.meta["train_steps"] == stock.meta["train_steps"]


@pytest.mark.parametrize("step", [PREEMPT[0], pytest.param(PREEMPT[1], marks=pytest.mark.slow)])
def test_packed_resume_inside_a_packed_group_is_exact(step, reference, tmp_path, jax_cache):
  before = _sequences_before(reference, step)
  if _updates_per_pass():
    per_pass = SEQUENCES_PER_ITEM  # a mini-batch of 2 prompts, one pass
    assert before % per_pass == 0 and before % (2 * per_pass), (step, before)  # mid mini-batch
  else:
    assert before % SEQUENCES_PER_ITEM, (step, before)  # inside a queue item
  segments, resumed = harness.chain(dict(CONFIG, learner="ckpt_iter"), str(tmp_path), [step], jax_cache)
  assert segments[1].meta["restored_step"] == step
  assert len(segments[1].inputs) > 0
  harness.assert_same_inputs(resumed, reference.inputs, f"packed, resumed after {step}")


# --- the packer replay, against Tunix's own packer (in process, no training) ----


def _random_queue(seed, items=5, rows=4, prompt_len=8, completion_len=4):
  from tunix.rl import common  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  queue = []
  for _ in range(items):
    p_len = rng.integers(1, prompt_len + 1, size=rows)
    c_len = rng.integers(1, completion_len + 1, size=rows)
    p_mask = (np.arange(prompt_len)[None, :] >= prompt_len - p_len[:, None]).astype(np.int32)
    c_mask = (np.arange(completion_len)[None, :] < c_len[:, None]).astype(np.int32)
    queue.append(common.TrainExample(
        prompt_ids=rng.integers(3, 50, size=(rows, prompt_len)).astype(np.int32) * p_mask,
        prompt_mask=p_mask,
        completion_ids=rng.integers(3, 50, size=(rows, completion_len)).astype(np.int32) * c_mask,
        completion_mask=c_mask,
        advantages=rng.normal(size=rows).astype(np.float32),
        ref_per_token_logps=rng.normal(size=(rows, completion_len)).astype(np.float32),
        old_per_token_logps=None,
    ))
  # A repeat (num_iterations=2): the same objects again, as Tunix queues them.
  return queue + queue


def _as_numpy(packed):
  return [{k: np.asarray(v) for k, v in vars(x[0]).items() if v is not None} for x in packed]


@pytest.mark.tunix_0_1_7  # google-tunix 0.1.7's greedy one-row packer
@pytest.mark.parametrize("budget", [10, 12, 17, 20, 31])
def test_pending_after_any_packed_row_repacks_to_the_rest(budget):
  from ckpt_iter.testing import assert_trees_equal  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _session  # pylint: disable=g-import-not-at-top
  from tunix.rl import utils as rl_utils  # pylint: disable=g-import-not-at-top

  queue = _random_queue(budget)
  whole = _as_numpy(list(rl_utils.pack_sequences(iter([x] for x in queue), budget)))
  session = type("Session", (), {"packing": budget})()
  cut_inside_an_item = 0
  for consumed in range(len(whole) + 1):
    pending = _session.DataSession._unconsumed_packed_rows(session, queue, 0, consumed)  # pylint: disable=protected-access
    cut_inside_an_item += bool(pending) and not any(pending[0] is x for x in queue)
    rest = _as_numpy(list(rl_utils.pack_sequences(iter([x] for x in pending), budget)))
    assert len(rest) == len(whole) - consumed, (budget, consumed)
    assert_trees_equal(rest, whole[consumed:], path=f"budget {budget}, after {consumed} rows")
  assert cut_inside_an_item, "no packed row ended inside a queue item"


@pytest.mark.tunix_main  # upstream main's chunk packer
@pytest.mark.parametrize("budget", [12, 17, 20, 31])
def test_pending_after_a_packed_pass_repacks_to_the_rest(budget):
  from ckpt_iter.testing import assert_trees_equal  # pylint: disable=g-import-not-at-top
  from tunix.rl import utils as rl_utils  # pylint: disable=g-import-not-at-top

  queue = _random_queue(budget, items=2)  # one mini-batch of 2 items, 2 passes
  per_update = 2 * 4

  def pack(items):
    return _as_numpy(list(rl_utils.pack_sequences(iter([x] for x in items), budget, per_update)))

  whole = pack(queue)
  first_pass = next(i for i, x in enumerate(whole) if bool(x["is_update_step"][0])) + 1
  assert first_pass < len(whole)
  assert_trees_equal(pack(queue[2:]), whole[first_pass:], path=f"budget {budget}, after pass 1")
