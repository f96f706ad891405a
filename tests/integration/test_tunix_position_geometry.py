"""A learner's position is held to its batch geometry by the restore (issue 64 item 3), in real processes.

A GRPO run of full batches of 4 prompts, mini-batches of 2 and micro-batches of 1 is killed after its
first update: the checkpoint falls between the two mini-batches of a global step (two of the full
batch's prompts taken). A state edited to take 99 of them, or 3, was restored before: the rest of the
global step was never trained, or a prompt was dropped and every later mini-batch one row off. The
restore now refuses it by name, before anything is trained; the same state unedited resumes.
"""

import json
import os

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness

_CONFIG = dict(num_iterations=1, batch_size=4, mini_batch_size=2, train_micro_batch_size=1, max_steps=4,
               learner="ckpt_iter")


@pytest.fixture(scope="module")
def killed_between_mini_batches(tmp_path_factory, jax_cache):
  workdir = tmp_path_factory.mktemp("geometry")
  root = str(workdir / "ckpt")
  harness.run_toy(_CONFIG, root, str(workdir / "first.npz"), preempt_after=1, cache_dir=jax_cache)
  header = os.path.join(root, "actor", "1", "data", "process_0-of-1.json")
  with open(header) as f:
    saved = json.load(f)
  assert saved["position"]["micro_batches_taken"] == 2 and saved["counters"]["remaining_mini_batches"] == 1
  return workdir, root, header, saved


@pytest.mark.parametrize("edit, field", [
    ({"micro_batches_taken": 99}, "position.micro_batches_taken"),
    ({"micro_batches_taken": 3}, "position.micro_batches_taken"),
    ({"micro_batches_taken": 1}, "position.micro_batches_taken"),
], ids=["99", "3", "1"])
def test_a_position_the_geometry_does_not_allow_is_refused_before_anything_is_trained(
    killed_between_mini_batches, jax_cache, edit, field):
  workdir, root, header, saved = killed_between_mini_batches
  edited = json.loads(json.dumps(saved))
  edited["position"].update(edit)
  with open(header, "w") as f:
    json.dump(edited, f)
  try:
    run = harness.run_toy(_CONFIG, root, str(workdir / "refused.npz"), cache_dir=jax_cache, expect_failure=True)
  finally:
    with open(header, "w") as f:
      json.dump(saved, f)
  assert f"field '{field}'" in run.stderr and "full_batch_size=4, mini_batch_size=2" in run.stderr, run.stderr[-3000:]


def test_the_same_state_unedited_resumes_with_the_rest_of_the_global_step(killed_between_mini_batches, jax_cache,
                                                                        tmp_path):
  workdir, root, _, _ = killed_between_mini_batches
  reference = harness.run_toy(_CONFIG, str(tmp_path / "reference"), str(tmp_path / "reference.npz"),
                              cache_dir=jax_cache)
  resumed = harness.run_toy(_CONFIG, root, str(workdir / "resumed.npz"), cache_dir=jax_cache)
  assert resumed.meta["restored_step"] == 1
  harness.assert_same_inputs(resumed.inputs, reference.inputs[2:], "the resumed run")
