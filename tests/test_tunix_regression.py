"""The bug report's reproducer (Tunix #2290), kept as a regression test.

`test_stock_fast_forward_*` is the reporter's scenario against the stock
RLLearner, as filed (seeds/000_6ed061ff10e12344.txt): it fails on
google-tunix 0.1.7 and is a strict xfail, so a Tunix release that fixes the
bug turns it into an XPASS failure and tells us. The Resumable tests run the
same scenario (num_iterations=2, one prompt per micro-batch, checkpoint after
A's two updates) through a real toy GRPO learner and Orbax on CPU.
"""

from unittest import mock

import numpy as np
import pytest
from tunix.rl import algorithm_config
from tunix.rl import rl_learner
from tunix.rl.queue import data_queue

from ckpt_iter import toyrun

NUM_ITERATIONS = 2
# What a trainer restored after training on A reports:
# iter_steps = train_steps * gradient_accumulation_steps = 2 * 1.
RESTORED_ITER_STEPS = 2


class _StockLearner(rl_learner.RLLearner):
  _generate_and_compute_advantage = lambda self, x, mode: x
  _compute_trajectory_ids = lambda self, x, steps: [""] * len(x["prompts"])
  _num_iterations = lambda self: NUM_ITERATIONS
  _num_generations = lambda self: 1


def _make_stock_learner(iter_steps=0):
  engine = mock.MagicMock()
  engine.cluster_config.training_config.max_seq_token_per_tpu = None
  engine.actor_trainer.model = None
  engine.actor_trainer.iter_steps = iter_steps
  return _StockLearner(engine, algorithm_config.AlgorithmConfig(), reward_fns=lambda **kw: [])


def _prepare(learner, iterator):
  queue = data_queue.SimpleDataQueue(maxsize=0)
  learner._prepare_data(  # pylint: disable=protected-access
      iterator, proceed_num_steps=1, sample_repeat=1, batch_repeat=NUM_ITERATIONS,
      service_target_batch_size=1, data_queue=queue,
  )
  return [str(x[0]["prompts"][0]) for x in iter(queue.get, None)]


@pytest.mark.xfail(strict=True, reason="Tunix #2290: resume fast-forwards iter_steps, which counts num_iterations times too much")
def test_stock_fast_forward_continues_from_next_micro_batch():
  batches = lambda: iter([{"prompts": np.array([x])} for x in "ABC"])
  continuous = _make_stock_learner()
  iterator = batches()
  assert _prepare(continuous, iterator) == ["A", "A"]
  expected = _prepare(continuous, iterator)
  actual = _prepare(_make_stock_learner(iter_steps=RESTORED_ITER_STEPS), batches())
  assert actual == expected  # stock gives ['C', 'C'] instead of ['B', 'B']


def _train(learner_kind, root, max_steps, recorder_out):
  config = toyrun.RunConfig(learner=learner_kind, num_iterations=NUM_ITERATIONS, max_steps=max_steps)
  learner = toyrun.build_learner(config, root)
  recorder = toyrun.TrainerInputRecorder(learner)
  learner.train(toyrun.make_train_dataset(config))
  return ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in recorder.inputs], recorder.inputs


@pytest.fixture(scope="module")
def trained_on_a(tmp_path_factory):
  """A checkpoint written right after A's two updates (train_steps == 2)."""
  root = str(tmp_path_factory.mktemp("seed") / "ckpt")
  labels, _ = _train("ckpt_iter", root, 2, None)
  assert labels == ["A", "A"]
  return root


def test_resumable_continues_from_next_micro_batch(trained_on_a, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  root = str(tmp_path / "ckpt")
  shutil.copytree(trained_on_a, root)
  labels, _ = _train("ckpt_iter", root, 4, None)
  assert labels == ["B", "B"]


def test_resumable_refuses_to_resume_a_stock_checkpoint(tmp_path):
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top

  root = str(tmp_path / "ckpt")
  labels, _ = _train("stock", root, 2, None)
  assert labels == ["A", "A"]
  with pytest.raises(errors.LegacyCheckpointError, match="has no 'data' item"):
    _train("ckpt_iter", root, 4, None)
