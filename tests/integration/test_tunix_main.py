"""ckpt_iter.tunix on whichever Tunix is installed: google-tunix 0.1.7 or upstream main.

Run with the project venv (0.1.7) by `make test`, and against upstream main
(0.1.8: `rl_engine=`, PPO's `algo_config=`, an Orbax v1 Checkpointer inside
Tunix's CheckpointManager, DrGRPOLearner) by `make test-tunix-main`. Tests
marked `tunix_main` need main's `rl_engine=`: against 0.1.7 they are
deselected (see conftest.py), never skipped.
"""

import inspect
import json
import os
import sys

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.ppo import ppo_learner

from ckpt_iter import _item as item_lib
from ckpt_iter import errors
from ckpt_iter import tunix as ckpt_tunix
from demo import toyrun
from ckpt_iter.tunix import _api as api
import tunix_harness as harness
import tunix_toy

HAS_RL_ENGINE = hasattr(rl_cluster_lib, "RLEngine")


def _grpo_kwargs():
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top

  return dict(
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=2, beta=0.04),
      reward_fns=toyrun.reward_fn,
  )


@pytest.mark.tunix_main
def test_grpo_is_built_with_rl_engine_or_rl_cluster(tmp_path):
  config = tunix_toy.RunConfig()
  by_engine = ckpt_tunix.ResumableGRPOLearner(
      rl_engine=tunix_toy.build_cluster(config, str(tmp_path / "a")), **_grpo_kwargs())
  by_cluster = ckpt_tunix.ResumableGRPOLearner(
      rl_cluster=tunix_toy.build_cluster(config, str(tmp_path / "b")), **_grpo_kwargs())
  assert by_engine.rl_cluster is by_engine.rl_engine
  assert by_cluster.rl_cluster is by_cluster.rl_engine


def test_grpo_is_built_positionally_and_by_keyword(tmp_path):
  config = tunix_toy.RunConfig()
  kwargs = _grpo_kwargs()
  positional = ckpt_tunix.ResumableGRPOLearner(
      tunix_toy.build_cluster(config, str(tmp_path / "a")), kwargs["algo_config"], kwargs["reward_fns"])
  assert positional.rl_cluster.actor_trainer is not None


def test_ppo_takes_the_config_name_this_tunix_takes(tmp_path):
  config = tunix_toy.RunConfig(algorithm="ppo")
  accepted = set(inspect.signature(ppo_learner.PPOLearner.__init__).parameters)
  name = "algo_config" if "algo_config" in accepted else "ppo_config"
  other = "ppo_config" if name == "algo_config" else "algo_config"
  ppo_config = ppo_learner.PPOConfig(num_iterations=2, beta=0.04)
  learner = ckpt_tunix.ResumablePPOLearner(
      rl_cluster=tunix_toy.build_cluster(config, str(tmp_path / "a")),
      reward_fns=toyrun.reward_fn, **{name: ppo_config})
  assert isinstance(learner, ppo_learner.PPOLearner)
  # The name this Tunix does not take fails as stock Tunix fails (TypeError).
  with pytest.raises(TypeError):
    ckpt_tunix.ResumablePPOLearner(
        rl_cluster=tunix_toy.build_cluster(config, str(tmp_path / "b")),
        reward_fns=toyrun.reward_fn, **{other: ppo_config})


def test_drgrpo_name_exists_exactly_when_tunix_has_the_class():
  try:
    from tunix.rl.grpo import drgrpo_learner  # pylint: disable=g-import-not-at-top
    has_class = hasattr(drgrpo_learner, "DrGRPOLearner")
  except ImportError:
    has_class = False
  assert hasattr(ckpt_tunix, "ResumableDrGRPOLearner") == has_class
  assert ("ResumableDrGRPOLearner" in ckpt_tunix.__all__) == has_class
  assert hasattr(ckpt_tunix, "ResumableDAPOLearner")


def test_a_checkpoint_manager_of_neither_shape_is_named(tmp_path, monkeypatch):
  cluster = tunix_toy.build_cluster(tunix_toy.RunConfig(), str(tmp_path / "ckpt"))

  class Opaque:  # a Tunix CheckpointManager with neither internal
    def latest_step(self):
      return None

  cluster.actor_trainer.checkpoint_manager = Opaque()
  with pytest.raises(errors.UnsupportedConfigError, match="neither _checkpoint_manager .*_checkpointer"):
    ckpt_tunix.ResumableGRPOLearner(rl_cluster=cluster, **_grpo_kwargs())


def test_installed_tunix_has_one_known_checkpoint_shape(tmp_path):
  cluster = tunix_toy.build_cluster(tunix_toy.RunConfig(), str(tmp_path / "ckpt"))
  backend = api.checkpoint_backend(cluster.actor_trainer.checkpoint_manager)
  assert backend == (api.ORBAX_V1 if HAS_RL_ENGINE else api.ORBAX_V0)


@pytest.mark.slow  # on 0.1.7 test_tunix_resume.py runs this chain by default; on main, all run
def test_grpo_killed_mid_repeat_resumes_exactly_with_data_item_in_the_step(tmp_path, jax_cache):
  config = dict(num_iterations=2, max_steps=4, data_shuffle_seed=3)
  harness.check_chain(config, [1, 3], str(tmp_path), jax_cache)
  # The data item is in the model's step, in the files ckpt_iter's reader reads.
  step_dir = os.path.join(str(tmp_path), "chain", "actor", "3")
  assert {"model_params", "optimizer_state", "data"} <= set(os.listdir(step_dir))
  saved = item_lib.read_item(os.path.join(step_dir, "data"), 0, 1).value
  assert saved.kind == "tunix" and saved.counters["train_steps"] == 3
  assert saved.pending is not None  # step 3 falls between B's two updates
  metadata = json.load(open(os.path.join(step_dir, "_CHECKPOINT_METADATA")))
  if HAS_RL_ENGINE:  # Orbax v1 records which handler wrote each checkpointable
    assert metadata["item_handlers"]["data"].endswith("_IteratorCheckpointableHandler")


@pytest.mark.slow  # every variant runs in `make test-tunix-main` and `make test-full`
def test_ppo_actor_and_critic_resume_together(tmp_path, jax_cache):
  config = dict(algorithm="ppo", num_iterations=2, batch_size=2, max_steps=4)
  harness.check_chain(config, [1, 2], str(tmp_path), jax_cache)


@pytest.mark.slow  # every variant runs in `make test-tunix-main` and `make test-full`
def test_dapo_resumes_exactly(tmp_path, jax_cache):
  config = dict(algorithm="dapo", num_iterations=2, max_steps=4, data_shuffle_seed=6)
  harness.check_chain(config, [1], str(tmp_path), jax_cache)


@pytest.mark.slow  # every variant runs in `make test-tunix-main` and `make test-full`
def test_drgrpo_resumes_exactly(tmp_path, jax_cache):
  config = dict(algorithm="drgrpo", num_iterations=2, max_steps=4)
  harness.check_chain(config, [3], str(tmp_path), jax_cache)


@pytest.mark.slow  # every variant runs in `make test-tunix-main` and `make test-full`
def test_async_rollout_mid_global_step_resumes_exactly(tmp_path, jax_cache):
  # Separate rollout mesh: a step inside a global step holds the rollout weights where a
  # rollout reads them before the next sync (after 1 and 2 the second mini-batch rolls out;
  # after 3, inside the last mini-batch, nothing does).
  config = dict(num_iterations=2, batch_size=2, mini_batch_size=1, data_shuffle_seed=5,
                async_rollout=True, max_steps=6)
  harness.check_chain(config, [3], str(tmp_path), jax_cache)
  actor = os.path.join(str(tmp_path), "chain", "actor")
  holding = [step for step in (1, 2, 3, 4) if "rollout_params" in os.listdir(os.path.join(actor, str(step)))]
  assert holding == [1, 2], holding


# The project venv: google-tunix 0.1.7 as pinned (make test builds it; the
# test-tunix-main targets depend on it).
RELEASED_TUNIX_PYTHON = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, ".venv", "bin", "python")


@pytest.mark.tunix_main
@pytest.mark.parametrize("written_on", ["0.1.7", "main"])
def test_a_pending_repeat_crosses_a_tunix_upgrade_in_either_direction(tmp_path, jax_cache, written_on):
  """Issue 31, case 5: a checkpoint between the two updates of one rollout (mu=2, after
  step 3), written on one Tunix and resumed on the other: the pending repeat is restored bit
  for bit (TrainExample only gained optional fields, unset here), then training goes on."""
  assert os.path.exists(RELEASED_TUNIX_PYTHON), f"{RELEASED_TUNIX_PYTHON}: run `make test` first"
  released, upstream = os.path.abspath(RELEASED_TUNIX_PYTHON), sys.executable
  first, then = (released, upstream) if written_on == "0.1.7" else (upstream, released)
  config = dict(num_iterations=2, max_steps=4, learner="ckpt_iter")
  reference = harness.run_toy(config, str(tmp_path / "ref"), str(tmp_path / "ref.npz"),
                              cache_dir=jax_cache, python=first)
  root = str(tmp_path / "ckpt")
  harness.run_toy(config, root, str(tmp_path / "a.npz"), preempt_after=3, cache_dir=jax_cache, python=first)
  resumed = harness.run_toy(dict(config, max_steps=6), root, str(tmp_path / "b.npz"),
                            cache_dir=jax_cache, python=then)
  assert resumed.meta["restored_step"] == 3
  harness.assert_same_inputs(resumed.inputs[:1], reference.inputs[3:], "the restored pending repeat")
  assert resumed.labels == ["B", "C", "C"], resumed.labels
  assert "tunix_version" in resumed.stderr  # the settings warning names the upgrade
