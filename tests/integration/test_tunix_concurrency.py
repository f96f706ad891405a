"""Saves while the producer thread is ahead of the trainer (async rollout).

With async rollout Tunix's producer queues trainer inputs while the trainer is
still busy with earlier ones. A checkpoint must hold what the *trainer*
consumed: the position after the mini-batch being trained, and exactly the
produced inputs the trainer has not reached yet. One run with a slowed trainer
and a checkpoint after every optimizer update; every checkpoint is checked
against the inputs the trainer actually used.
"""

import math
import os

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

from ckpt_iter import _files
from ckpt_iter import testing
import ckpt_iter.tunix  # noqa: F401  # registers the TrainExample types pending items hold
import tunix_harness as harness

GRAD_ACC = 2  # mini_batch_size 2 / train_micro_batch_size 1
NUM_ITERATIONS = 3
MICRO_PER_FULL = 4  # batch_size 4 / micro 1
CONFIG = dict(
    num_iterations=NUM_ITERATIONS, batch_size=4, mini_batch_size=2, train_micro_batch_size=1,
    data_shuffle_seed=9, async_rollout=True, max_steps=12, trainer_delay_seconds=0.05,
)


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("concurrency")
  run = harness.run_toy(CONFIG, str(workdir / "ckpt"), str(workdir / "run.npz"))
  return run, str(workdir / "ckpt" / "actor")


def test_every_checkpoint_holds_what_the_trainer_consumed(slowed_run):
  run, actor_root = slowed_run
  inputs = run.inputs
  per_mini_batch = GRAD_ACC * NUM_ITERATIONS
  steps = sorted(int(name) for name in os.listdir(actor_root) if name.isdigit())
  assert steps == list(range(1, 13)), steps
  pending_seen = 0
  for step in steps:
    state = _files.read_state(os.path.join(actor_root, str(step), "data"), 0, 1)
    consumed = step * GRAD_ACC
    mini_batches_started = math.ceil(consumed / per_mini_batch)
    expected_pending = inputs[consumed:mini_batches_started * per_mini_batch]
    pending = [state.pending.items[i] for i in state.pending.schedule] if state.pending else []
    assert len(pending) == len(expected_pending), f"step {step}"
    for index, (saved, used) in enumerate(zip(pending, expected_pending)):
      for field, array in used.items():
        testing.assert_trees_equal(
            getattr(saved, field), array, path=f"step {step}: pending item {index}.{field}")
    micro_batches_read = mini_batches_started * GRAD_ACC
    # The input's position is the start of the full batch being split, in records (1 prompt per micro-batch).
    full_batches_done = micro_batches_read // MICRO_PER_FULL
    assert (state.position["input"].position, state.position["micro_batches_taken"]) == (
        {"next_record": full_batches_done * MICRO_PER_FULL}, micro_batches_read % MICRO_PER_FULL,
    ), f"step {step}"
    assert state.position["stream_rows"] == micro_batches_read, f"step {step}"  # 1 prompt each
    assert state.counters["train_steps"] == step
    pending_seen += len(pending)
  assert pending_seen > 0  # the run did checkpoint mid-repeat
