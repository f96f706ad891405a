"""The bugs of issue 10, each in real processes killed at the point that matters.

- checkpointing_options=None keeps Tunix's own default policy: the steps on
  disk are stock Tunix's;
- a restart after the final checkpoint trains nothing more, however often;
- uneven batches (a shorter last batch, batches that do not split evenly
  into micro-batches) train as stock Tunix trains them, and resume exactly.

Runs on whichever Tunix is installed (0.1.7 in .venv, upstream main in
.venv-tunix-main via `make test-tunix-main`).
"""

import os

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness


def _steps_on_disk(root):
  actor = os.path.join(root, "actor")
  return sorted(int(name) for name in os.listdir(actor) if name.isdigit())


@pytest.mark.parametrize("checkpointing", ["default", pytest.param("explicit", marks=pytest.mark.slow)])
def test_checkpoint_policy_is_tunix_own(checkpointing, tmp_path, jax_cache):
  # "default": checkpointing_options=None, Tunix's policy (at most every 180 s,
  # keep 3): on this short run only what stock Tunix writes (the first and the
  # forced last step). "explicit": every step, as the options say.
  config = dict(num_iterations=2, max_steps=4, checkpointing=checkpointing)
  runs = {}
  for learner in ("stock", "ckpt_iter"):
    root = str(tmp_path / learner)
    harness.run_toy(dict(config, learner=learner), root, str(tmp_path / f"{learner}.npz"),
                    cache_dir=jax_cache)
    runs[learner] = _steps_on_disk(root)
  assert runs["ckpt_iter"] == runs["stock"], runs
  if checkpointing == "explicit":
    assert runs["stock"] == [1, 2, 3, 4]
  else:
    assert len(runs["stock"]) < 4, runs  # the default does not save every step


def test_restart_after_the_final_checkpoint_trains_nothing(tmp_path, jax_cache):
  config = dict(num_iterations=2, max_steps=4, learner="ckpt_iter")
  root = str(tmp_path / "ckpt")
  first = harness.run_toy(config, root, str(tmp_path / "0.npz"), preempt_after=4, cache_dir=jax_cache)
  assert len(first.inputs) == 4
  for attempt in (1, 2):  # a requeue, then another one
    again = harness.run_toy(config, root, str(tmp_path / f"{attempt}.npz"), cache_dir=jax_cache)
    assert again.meta["restored_step"] == 4
    assert again.inputs == [], f"restart {attempt} trained {again.labels}"
    assert _steps_on_disk(root)[-1] == 4


def test_restart_inside_the_last_global_step_finishes_it(tmp_path, jax_cache):
  # Full batch of 2 prompts = two mini-batches per global step: max_steps=6 is
  # reached mid global step (update 6 of 8 in the second global step). The
  # uninterrupted run finishes that global step; so does a restart after 6.
  config = dict(num_iterations=2, batch_size=2, mini_batch_size=1, max_steps=6)
  reference = harness.run_toy(dict(config, learner="ckpt_iter"), str(tmp_path / "ref"),
                              str(tmp_path / "ref.npz"), cache_dir=jax_cache)
  stock = harness.run_toy(dict(config, learner="stock"), str(tmp_path / "stock"),
                          str(tmp_path / "stock.npz"), cache_dir=jax_cache)
  harness.assert_same_inputs(reference.inputs, stock.inputs, "uninterrupted vs stock")
  _, resumed = harness.chain(dict(config, learner="ckpt_iter"), str(tmp_path), [5], jax_cache)
  harness.assert_same_inputs(resumed, reference.inputs, "resumed after 5")


UNEVEN = {
    # A plain list of batches of 2 and 1 prompts: full batches pass through
    # as they are (micro batch = first batch's size), the short ones included.
    "shorter_batches": dict(num_iterations=2, batch_sizes=[2, 1], max_steps=6),
    # Full batches of 4 then 3 prompts cut into micro-batches of 2: a
    # micro-batch spans two full batches (rows carry over, as in stock).
    "carry_over": dict(num_iterations=2, batch_sizes=[4, 3], mini_batch_size=4,
                       train_micro_batch_size=2, max_steps=6),
}


# Every variant runs in `make test-full` and on Tunix main; `make test` keeps the one
# where rows carry over between full batches (the harder case).
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name == "carry_over" else pytest.mark.slow) for name in sorted(UNEVEN)
])
def test_uneven_batches_train_as_stock_and_resume_exactly(name, tmp_path, jax_cache):
  config = UNEVEN[name]
  reference = harness.run_toy(dict(config, learner="ckpt_iter"), str(tmp_path / "ref"),
                              str(tmp_path / "ref.npz"), cache_dir=jax_cache)
  stock = harness.run_toy(dict(config, learner="stock"), str(tmp_path / "stock"),
                          str(tmp_path / "stock.npz"), cache_dir=jax_cache)
  harness.assert_same_inputs(reference.inputs, stock.inputs, f"{name}: uninterrupted vs stock")
  _, resumed = harness.chain(dict(config, learner="ckpt_iter"), str(tmp_path), [2, 3], jax_cache)
  harness.assert_same_inputs(resumed, reference.inputs, f"{name}: resumed after 2 and 3")


def test_larger_batch_and_max_steps_continue_at_the_same_prompt(tmp_path, jax_cache):
  # As Tunix's test_checkpoint_with_mini_batch: continue a finished run with a
  # larger max_steps and a doubled batch size. Nothing skipped, nothing twice.
  root = str(tmp_path / "ckpt")
  first = harness.run_toy(dict(num_iterations=1, batch_size=2, max_steps=2), root,
                          str(tmp_path / "0.npz"), cache_dir=jax_cache)
  assert first.labels == ["AB", "CD"]
  second = harness.run_toy(dict(num_iterations=1, batch_size=4, max_steps=3), root,
                           str(tmp_path / "1.npz"), cache_dir=jax_cache)
  assert second.meta["restored_step"] == 2
  assert second.labels == ["EFGH"]
  assert "continuing at prompt 4" in second.stderr


def test_a_batch_size_that_does_not_divide_the_prompts_consumed_continues_at_the_next_record(tmp_path, jax_cache):
  # make_dataset's position counts stream records: the input's own restore cuts
  # batches of 3 from record 4, where the run of batches of 2 stopped.
  root = str(tmp_path / "ckpt")
  harness.run_toy(dict(num_iterations=1, batch_size=2, max_steps=2), root, str(tmp_path / "0.npz"),
                  cache_dir=jax_cache)
  second = harness.run_toy(dict(num_iterations=1, batch_size=3, max_steps=4), root, str(tmp_path / "1.npz"),
                           cache_dir=jax_cache)
  assert second.meta["restored_step"] == 2
  assert second.labels == ["EFG", "HIJ"]


def test_a_hand_built_input_continues_only_where_a_batch_starts_at_the_prompts_consumed(tmp_path, jax_cache):
  # A hand-built MapDataset of batches cannot count records: its position is a
  # batch index, so the prompt count decides. 4 prompts consumed: no batch of 3
  # starts there; one of 4 does.
  root = str(tmp_path / "ckpt")
  first = harness.run_toy(dict(num_iterations=1, batch_size=2, max_steps=2, input_kind="map"), root,
                          str(tmp_path / "0.npz"), cache_dir=jax_cache)
  assert first.labels == ["AB", "CD"]
  refused = harness.run_toy(dict(num_iterations=1, batch_size=3, max_steps=4, input_kind="map"), root,
                            str(tmp_path / "1.npz"), cache_dir=jax_cache, expect_failure=True)
  assert "ConfigDriftError" in refused.stderr and "full_batch_size" in refused.stderr, refused.stderr[-2000:]
  assert "not a whole number of this input's batches of 3" in refused.stderr
  second = harness.run_toy(dict(num_iterations=1, batch_size=4, max_steps=3, input_kind="map"), root,
                           str(tmp_path / "2.npz"), cache_dir=jax_cache)
  assert second.labels == ["EFGH"]
  assert "continuing at prompt 4" in second.stderr


@pytest.mark.parametrize("change, named", [
    pytest.param(dict(dataset_seed=5), "seed", marks=pytest.mark.slow),  # another prompt comes next
    pytest.param(dict(num_iterations=2), "num_iterations", marks=pytest.mark.slow),  # what a step means
    pytest.param(dict(num_generations=3), "num_generations", marks=pytest.mark.slow),  # what a group holds
])
def test_a_change_of_the_next_prompt_is_refused_naming_the_field(change, named, tmp_path, jax_cache):
  root = str(tmp_path / "ckpt")
  harness.run_toy(dict(num_iterations=1, batch_size=2, max_steps=2), root,
                  str(tmp_path / "0.npz"), cache_dir=jax_cache)
  refused = harness.run_toy(dict(dict(num_iterations=1, batch_size=2, max_steps=4), **change), root,
                            str(tmp_path / "1.npz"), cache_dir=jax_cache, expect_failure=True)
  assert "ConfigDriftError" in refused.stderr and named in refused.stderr, refused.stderr[-2000:]


def test_changed_algorithm_settings_continue_with_one_warning(tmp_path, jax_cache):
  # beta, the sampling temperature and the learning rate change how training
  # goes on, not which prompt comes next: the resume takes the new values,
  # says so once, and continues at the next prompt.
  before = dict(num_iterations=1, batch_size=2, learning_rate=0.01)
  root = str(tmp_path / "ckpt")
  first = harness.run_toy(dict(before, max_steps=2), root, str(tmp_path / "0.npz"), cache_dir=jax_cache)
  after = dict(before, beta=0.1, temperature=0.7, learning_rate=0.02)
  second = harness.run_toy(dict(after, max_steps=4), root, str(tmp_path / "1.npz"), cache_dir=jax_cache)
  assert second.meta["restored_step"] == 2
  assert first.labels + second.labels == ["AB", "CD", "EF", "GH"]
  warnings = [line for line in second.stderr.splitlines() if "other algorithm settings" in line]
  assert len(warnings) == 1, second.stderr[-3000:]
  for change in ("beta: 0.04 -> 0.1", "temperature: 0.9 -> 0.7", "learning_rate: 0.01 -> 0.02"):
    assert change in warnings[0], warnings[0]
  again = harness.run_toy(dict(after, max_steps=6), root, str(tmp_path / "2.npz"), cache_dir=jax_cache)
  assert again.labels == ["IJ", "KL"]
  assert "other algorithm settings" not in again.stderr  # the same settings as the last checkpoint


def test_a_skip_declared_once_holds_through_three_more_restarts(tmp_path, jax_cache):
  # Issue 47 (3): a skip declared at one restart only. Each later restart builds
  # the pipeline without it; the learner's saved input state must keep carrying
  # it. Before the fix the state saved after the next restart had no skips, and
  # the restart after that trained the skipped prompts (num_iterations updates each).
  config = dict(num_iterations=2, batch_size=1, max_steps=14, learner="ckpt_iter")
  skip = [[6, 8]]  # prompts G and H, reached after update 12
  reference = harness.run_toy(dict(config, skip=skip), str(tmp_path / "ref"), str(tmp_path / "ref.npz"),
                              cache_dir=jax_cache)
  assert "".join(reference.labels) == "AABBCCDDEEFFII", reference.labels
  root = str(tmp_path / "chain")
  trained = []
  for segment, (preempt, declared) in enumerate([(2, None), (4, skip), (6, None), (8, None), (None, None)]):
    run = harness.run_toy(dict(config, skip=declared), root, str(tmp_path / f"{segment}.npz"),
                          preempt_after=preempt, cache_dir=jax_cache)
    trained += run.inputs
  harness.assert_same_inputs(trained, reference.inputs, "a skip declared at restart 1 of 4")
