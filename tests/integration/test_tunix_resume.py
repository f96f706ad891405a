"""End-to-end exact resume of real Tunix learners, preempted in real processes.

For each configuration: an uninterrupted ckpt_iter run (checked bit for bit
against stock Tunix's uninterrupted run), then a chain of processes each
killed right after checkpoint K and resumed in a fresh process. The trainer
inputs of the chain must equal the uninterrupted run's bit for bit: same
prompts in the same order, same completions, advantages and log-probs.

`make test-heavy` (CI) runs two representative chains (mu=2, shuffled
repeats, killed after every step; two mini-batches killed after steps 1 and
2) and the tests without a parameter; `make test` runs a killed PPO chain in
test_tunix_conformance.py; `make test-full` adds the other learners (PPO, DAPO),
configurations and features (evaluation, plain iterables, legacy and forced
close() checkpoints, the stock bug) and the sweep:
num_iterations 1-4 x (full batch 2 = one mini-batch, with gradient
accumulation 1 or 2, or two mini-batches) x (no shuffle seed, synchronous;
shuffle seed, async rollout), each killed after every optimizer update in
turn and resumed in a fresh process each time.
"""

import itertools
import json
import os

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness


REPRESENTATIVE = {
    # The default run's one Tunix chain (the others are in `make test-full`):
    # mu=2 with a shuffle seed (#2288), killed after every step in turn,
    # mid-repeat included, three resumes in a row, each in a fresh process.
    "mu2_shuffle": (dict(num_iterations=2, max_steps=4, data_shuffle_seed=3), [1, 2, 3]),
    # mu=2, one prompt per batch: every step, mid-repeat included, three resumes in a row.
    "mu2": (dict(num_iterations=2, max_steps=4), [1, 2, 3]),
    # gradient accumulation 2 (mini 2 / micro 1), shuffled repeats (#2288).
    "mu2_gradacc2_shuffle": (
        dict(num_iterations=2, batch_size=2, mini_batch_size=2, train_micro_batch_size=1,
             data_shuffle_seed=3, dataset_seed=11, max_steps=4),
        [1, 3],
    ),
    # async rollout on separate meshes, full batch 2 > mini batch 1: the
    # checkpoint after step 6 falls mid global step, so the next rollout
    # needs the weights of the last sync, not the restored actor's.
    "mu2_async_fullbatch": (
        dict(num_iterations=2, batch_size=2, mini_batch_size=1, data_shuffle_seed=5,
             async_rollout=True, max_steps=8),
        [3, 6],
    ),
    "mu4_mid_repeat": (dict(num_iterations=4, max_steps=4, data_shuffle_seed=1), [2]),
    # Found by the differential suite: full batch 2 in two mini-batches, killed
    # after 1 (mid-repeat) and 2 (the resumed process's first checkpoint, before
    # it read anything): the second resume trained prompt A again.
    "two_minis_consecutive_kills": (
        dict(num_iterations=2, batch_size=2, mini_batch_size=1, data_shuffle_seed=2, max_steps=3),
        [1, 2],
    ),
    "mu1": (dict(num_iterations=1, max_steps=3), [1]),
}


DEFAULT_RUN = ("mu2_shuffle", "two_minis_consecutive_kills")


@pytest.mark.parametrize("name", [
    name if name in DEFAULT_RUN else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(REPRESENTATIVE)
])
def test_chained_resume_equals_uninterrupted(name, tmp_path, jax_cache):
  config, steps = REPRESENTATIVE[name]
  reference = harness.check_chain(config, steps, str(tmp_path), jax_cache)
  # The comparison is only meaningful if the inputs carry real values.
  assert all(np.isfinite(x["advantages"]).all() for x in reference.inputs)


@pytest.mark.slow
def test_ppo_actor_and_critic_resume_together(tmp_path, jax_cache):
  # The critic update on an input comes after the actor's: the actor step is
  # written once the critic made the same update, with the critic's state.
  config = dict(algorithm="ppo", num_iterations=2, batch_size=2, max_steps=4)
  reference = harness.check_chain(config, [1, 2], str(tmp_path), jax_cache)
  assert np.isfinite(reference.inputs[-1]["advantages"]).all(), (
      "PPO advantages after the first updates depend on the critic; they must be "
      "finite for this test to tell a stale critic apart"
  )


@pytest.mark.slow
def test_dapo_through_the_mixin(tmp_path, jax_cache):
  # class ResumableDAPOLearner(Resumable, DAPOLearner), built in tunix_toy.
  config = dict(algorithm="dapo", num_iterations=2, max_steps=4, data_shuffle_seed=6)
  harness.check_chain(config, [1], str(tmp_path), jax_cache)


@pytest.mark.slow
def test_plain_iterable_input_is_replayed_with_a_warning(tmp_path, jax_cache):
  # A one-shot generator: its position can only be reached by replaying it.
  config = dict(num_iterations=2, max_steps=4, input_kind="iterable")
  reference = harness.run_toy(
      dict(config, learner="ckpt_iter", input_kind="grain"), str(tmp_path / "ref"),
      str(tmp_path / "ref.npz"), cache_dir=jax_cache,
  )
  segments, resumed = harness.chain(dict(config, learner="ckpt_iter"), str(tmp_path), [3], jax_cache)
  harness.assert_same_inputs(resumed, reference.inputs, "iterable input resumed after step 3")
  assert "restored by replaying 2 elements" in segments[1].stderr


def test_another_plain_iterable_is_refused_naming_the_field_of_the_last_batch(tmp_path, jax_cache):
  # An iterable's fingerprint is its type name: the same generator type over
  # another order of prompts is caught by the content record of the last batch
  # replayed, which names the first field that differs.
  config = dict(num_iterations=1, batch_size=2, input_kind="iterable")
  root = str(tmp_path / "ckpt")
  harness.run_toy(dict(config, max_steps=2), root, str(tmp_path / "0.npz"), cache_dir=jax_cache)
  refused = harness.run_toy(dict(config, max_steps=4, dataset_seed=5), root, str(tmp_path / "1.npz"),
                            cache_dir=jax_cache, expect_failure=True)
  assert "ConfigDriftError" in refused.stderr and "field 'last_batch." in refused.stderr, refused.stderr[-2000:]
  resumed = harness.run_toy(dict(config, max_steps=4), root, str(tmp_path / "2.npz"), cache_dir=jax_cache)
  assert resumed.meta["restored_step"] == 2 and resumed.labels == ["EF", "GH"]


@pytest.mark.slow
def test_resume_with_evaluation(tmp_path, jax_cache):
  config = dict(num_iterations=2, max_steps=4, with_eval=True, eval_every_n_steps=1,
                data_shuffle_seed=2)
  harness.check_chain(config, [1], str(tmp_path), jax_cache, compare_stock=False)


def _rollout_weight_steps(root):
  """The saved actor steps that hold the rollout model's weights."""
  actor = os.path.join(root, "actor")
  return sorted(int(step) for step in os.listdir(actor)
                if step.isdigit() and "rollout_params" in os.listdir(os.path.join(actor, step)))


@pytest.mark.parametrize("config, kills, weight_steps", [
    # One mini-batch per global step (mu=2): checkpoints 1 and 3 fall between the two
    # updates of one rollout; the rest of the global step trains on pending inputs.
    pytest.param(dict(num_iterations=2, max_steps=4, data_shuffle_seed=5), [1, 3], [], id="one-mini-batch"),
    # Two mini-batches (steps 1-2, 3-4): after 1 and 2 the second one still rolls out
    # with these weights; after 3 (inside the last one) nothing rolls out before the sync.
    pytest.param(dict(num_iterations=2, batch_size=2, mini_batch_size=1, max_steps=4), [1, 3], [1, 2],
                 id="two-mini-batches"),
    # Evaluation every 2 updates, mu=3 (global steps 1-3, 4-6): the update at train step 4
    # evaluates with a rollout, so checkpoint 4 needs the weights; at 1, 2 and 5 the
    # mini-batch already has its evaluation input.
    pytest.param(dict(num_iterations=3, max_steps=6, with_eval=True, eval_every_n_steps=2), [4, 5], [4],
                 id="evaluation"),
])
def test_rollout_weights_are_saved_only_where_a_rollout_reads_them(tmp_path, jax_cache, config, kills, weight_steps):
  """Issue 27: with a separate rollout model, a checkpoint inside a global step holds the
  rollout weights only when a rollout (training or evaluation) runs on them before the next
  weight sync, and the chain still trains and evaluates on the same rollouts, bit for bit."""
  config = dict(config, learner="ckpt_iter", async_rollout=True)
  reference = harness.run_toy(config, str(tmp_path / "reference"), str(tmp_path / "reference.npz"),
                              cache_dir=jax_cache)
  segments, resumed = harness.chain(config, str(tmp_path), kills, jax_cache)
  harness.assert_same_inputs(resumed, reference.inputs, f"resumed after {kills}")
  assert _rollout_weight_steps(str(tmp_path / "chain")) == weight_steps
  assert _rollout_weight_steps(str(tmp_path / "reference")) == weight_steps
  # The evaluation input each update carried (rolled out on the rollout model).
  chained_evals = [digest for run in segments for digest in run.meta["eval_digests"]]
  assert chained_evals == reference.meta["eval_digests"]
  assert any(chained_evals) == bool(config.get("with_eval"))


@pytest.mark.slow
def test_stock_tunix_skips_data_after_resume(tmp_path, jax_cache):
  """Documents the upstream bug (#2290): stock resumes after step 2 with C, not B."""
  config = dict(learner="stock", num_iterations=2, max_steps=4)
  reference = harness.run_toy(config, str(tmp_path / "ref"), str(tmp_path / "ref.npz"), cache_dir=jax_cache)
  harness.run_toy(config, str(tmp_path / "c"), str(tmp_path / "a.npz"), preempt_after=2, cache_dir=jax_cache)
  resumed = harness.run_toy(config, str(tmp_path / "c"), str(tmp_path / "b.npz"), cache_dir=jax_cache)
  assert reference.labels == ["A", "A", "B", "B"]
  assert resumed.labels == ["C", "C"], resumed.labels


@pytest.mark.slow
def test_legacy_checkpoint_is_refused_then_fast_forwarded(tmp_path, jax_cache):
  root = str(tmp_path / "ckpt")
  stock = dict(learner="stock", num_iterations=2, max_steps=4)
  harness.run_toy(stock, root, str(tmp_path / "a.npz"), preempt_after=1, cache_dir=jax_cache)
  refused = harness.run_toy(
      dict(stock, learner="ckpt_iter"), root, str(tmp_path / "b.npz"),
      cache_dir=jax_cache, expect_failure=True,
  )
  assert "LegacyCheckpointError" in refused.stderr
  assert "on_legacy_checkpoint='fast_forward'" in refused.stderr
  resumed = harness.run_toy(
      dict(stock, learner="ckpt_iter", on_legacy_checkpoint="fast_forward"), root,
      str(tmp_path / "c.npz"), cache_dir=jax_cache,
  )
  # ceil(1 / 2) = 1 mini-batch consumed: A's second update is lost, B is not.
  assert resumed.labels == ["B", "B", "C", "C"]
  assert "has no data state (legacy)" in resumed.stderr
  assert "cannot be recovered and are skipped" in resumed.stderr


def test_fast_forward_of_tunixs_cli_form_skips_whole_batches(tmp_path, jax_cache):
  """Issue 31, case 2: stock GRPO, num_iterations=2, on prompts batched after
  `to_iter_dataset()` (Tunix's CLI form), preempted after step 2 (a global-step
  boundary); the drop-in's fast-forward trains the second batch next, bit for bit as the
  uninterrupted run does (an O(1) seek once moved Grain's row index: "BC" instead of "CD")."""
  config = dict(learner="stock", num_iterations=2, max_steps=4, input_kind="iter_batched",
                batch_size=2, num_prompts=8)
  reference = harness.run_toy(config, str(tmp_path / "ref"), str(tmp_path / "ref.npz"), cache_dir=jax_cache)
  assert reference.labels == ["AB", "AB", "CD", "CD"], reference.labels
  root = str(tmp_path / "ckpt")
  harness.run_toy(config, root, str(tmp_path / "a.npz"), preempt_after=2, cache_dir=jax_cache)
  resumed = harness.run_toy(
      dict(config, learner="ckpt_iter", on_legacy_checkpoint="fast_forward"), root,
      str(tmp_path / "b.npz"), cache_dir=jax_cache)
  harness.assert_same_inputs(resumed.inputs, reference.inputs[2:], "fast-forward of the CLI form")


@pytest.mark.slow
def test_forced_save_in_close_resumes_exactly_with_metadata(tmp_path, jax_cache):
  """With save_interval_steps=3, step 4 is written only by Trainer.close()."""
  config = dict(num_iterations=2, save_interval_steps=3, data_shuffle_seed=4)
  reference = harness.run_toy(
      dict(config, max_steps=8), str(tmp_path / "ref"), str(tmp_path / "ref.npz"), cache_dir=jax_cache
  )
  root = str(tmp_path / "ckpt")
  first = harness.run_toy(dict(config, max_steps=4), root, str(tmp_path / "a.npz"), cache_dir=jax_cache)
  # Orbax saves the first step and every third; 4 only comes from close().
  assert sorted(os.listdir(os.path.join(root, "actor"))) == ["1", "3", "4"]
  with open(os.path.join(root, "actor", "4", "_CHECKPOINT_METADATA")) as f:
    custom = json.load(f)["custom_metadata"]
  assert custom["role"] == "actor" and "global_step" in custom, custom
  second = harness.run_toy(dict(config, max_steps=8), root, str(tmp_path / "b.npz"), cache_dir=jax_cache)
  assert second.meta["restored_step"] == 4
  harness.assert_same_inputs(first.inputs + second.inputs, reference.inputs, "forced save resume")


# --- the full sweep (make test-full) ------------------------------------------

def _sweep_configs():
  """num_iterations 1-4 x batch split, each shuffle seed and rollout mode covered."""
  splits = [(2, 2), (2, 1), (1, 1)]  # (mini_batch_size, train_micro_batch_size), full batch 2
  configs = []
  for mu, (mini, micro) in itertools.product([1, 2, 3, 4], splits):
    for seed, async_rollout in [(None, False), (7, True)]:
      configs.append(dict(
          num_iterations=mu, batch_size=2, mini_batch_size=mini, train_micro_batch_size=micro,
          data_shuffle_seed=seed, async_rollout=async_rollout, max_steps=2 * mu,
      ))
  return configs


@pytest.mark.slow
@pytest.mark.parametrize("config", _sweep_configs(), ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sweep_every_checkpoint_step(config, tmp_path, jax_cache):
  """Killed after every optimizer update in turn, each time resumed in a fresh process."""
  reference = harness.run_toy(
      dict(config, learner="ckpt_iter"), str(tmp_path / "ref"), str(tmp_path / "ref.npz"),
      cache_dir=jax_cache,
  )
  last_step = max(reference.meta["train_steps"]) + 1
  _, resumed = harness.chain(
      dict(config, learner="ckpt_iter"), str(tmp_path), list(range(1, last_step)), jax_cache
  )
  harness.assert_same_inputs(resumed, reference.inputs, f"resumed after each of steps 1..{last_step - 1}")


@pytest.mark.parametrize("input_kind", ["iter", "grain"])
def test_one_more_epoch_after_the_data_ran_out_continues(input_kind, tmp_path, jax_cache):
  """A run that ended by exhausting its one epoch, restarted with two, trains epoch 2.

  `.to_iter_dataset()` ("iter") included: the learner compares its own fields
  strictly and leaves the input's change to DataIterator's rule, which
  accepts more epochs of the same stream. The two runs together train what
  one uninterrupted two-epoch run trains, bit for bit.
  """
  config = dict(num_iterations=2, num_prompts=3, dataset_seed=4, data_shuffle_seed=1,
                max_steps=100, input_kind=input_kind)
  root = str(tmp_path / "chain")
  first = harness.run_toy(dict(config, num_epochs=1), root, str(tmp_path / "epoch1.npz"), cache_dir=jax_cache)
  assert first.meta["train_steps"][-1] == 5 and len(first.inputs) == 6  # 3 prompts x mu 2: data ran out
  second = harness.run_toy(dict(config, num_epochs=2), root, str(tmp_path / "epoch2.npz"), cache_dir=jax_cache)
  assert second.meta["restored_step"] == 6
  both = harness.run_toy(dict(config, num_epochs=2), str(tmp_path / "uninterrupted"),
                         str(tmp_path / "both.npz"), cache_dir=jax_cache)
  assert len(both.inputs) == 12
  harness.assert_same_inputs(first.inputs + second.inputs, both.inputs, "epoch 1, then epoch 2 resumed")
  assert second.meta["actor_digest"] == both.meta["actor_digest"]
  assert "replaying" not in second.stderr


def test_eval_does_not_change_the_repeat_order(tmp_path, jax_cache):
  """The one deliberate difference from stock (docs/tunix.md, "Deliberate differences").

  Stock Tunix splits the repeat-order key in its evaluation path too, from
  the main thread while its producer thread splits it for the repeats. The
  drop-in's key chain is the trainer's alone: with evaluation on, the same
  repeats in the same order as with it off.
  """
  config = dict(num_iterations=3, max_steps=6, data_shuffle_seed=2)
  plain, evaluated = harness.run_in_one_process([
      (config, str(tmp_path / "plain"), str(tmp_path / "plain.npz")),
      (dict(config, with_eval=True, eval_every_n_steps=1), str(tmp_path / "eval"), str(tmp_path / "eval.npz")),
  ], jax_cache)
  assert evaluated.meta["eval_steps"] and not plain.meta["eval_steps"]
  harness.assert_same_inputs(evaluated.inputs, plain.inputs, "with evaluation vs without")
  assert len(set(plain.labels)) > 1


def test_a_dataloader_input_is_restored_in_o1_not_replayed(tmp_path, jax_cache):
  """A grain.DataLoader passed to train() resumes from its exact Grain state (DataLoaderIterator)."""
  config = dict(num_iterations=2, max_steps=4, input_kind="dataloader", data_shuffle_seed=3, dataset_seed=2)
  reference = harness.run_toy(dict(config, learner="ckpt_iter"), str(tmp_path / "reference"),
                              str(tmp_path / "reference.npz"), cache_dir=jax_cache)
  segments, resumed = harness.chain(dict(config, learner="ckpt_iter"), str(tmp_path), [1, 3], jax_cache)
  harness.assert_same_inputs(resumed, reference.inputs, "DataLoader input, killed after 1 and 3")
  for segment in segments[1:]:
    assert "replaying" not in segment.stderr and "plain iterable" not in segment.stderr, segment.stderr[-2000:]
  assert len(set(reference.labels)) > 1


def test_a_hugging_face_stream_resumes_from_its_own_state_in_fresh_processes(tmp_path, jax_cache):
  """A streaming IterableDataset given as train_ds (ckpt_iter.StreamingIterator) resumes exactly, mid-repeat
  included, from the stream's own state_dict: no replay, each prompt once, in the uninterrupted order."""
  pytest.importorskip("datasets", reason="Hugging Face datasets is not installed (pip install 'ckpt_iter[hf]')")
  config = dict(num_iterations=2, max_steps=6, input_kind="hf_stream", num_epochs=1, learner="ckpt_iter")
  reference = harness.run_toy(config, str(tmp_path / "reference"), str(tmp_path / "reference.npz"),
                              cache_dir=jax_cache)
  segments, resumed = harness.chain(config, str(tmp_path), [1, 3], jax_cache)  # both inside a repeat
  harness.assert_same_inputs(resumed, reference.inputs, "Hugging Face stream, killed after 1 and 3")
  for segment in segments[1:]:
    assert "replaying" not in segment.stderr and "plain iterable" not in segment.stderr, segment.stderr[-2000:]
  assert reference.labels == ["A", "A", "B", "B", "C", "C"]  # the stream in order, each prompt mu=2 times
