"""The bug report's reproducer (Tunix #2290), kept as a regression test.

`test_stock_fast_forward_*` is the reporter's scenario against the stock
RLLearner, as filed (seeds/000_6ed061ff10e12344.txt): it fails on
google-tunix 0.1.7 and is a strict xfail, so a Tunix release that fixes the
bug turns it into an XPASS failure and tells us. The Resumable tests run the
same scenario (num_iterations=2, one prompt per micro-batch, checkpoint after
A's two updates) through a real toy GRPO learner and Orbax on CPU.
"""

import json
import os
import shutil
from unittest import mock

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
from tunix.rl import algorithm_config
from tunix.rl import rl_learner
from tunix.rl.queue import data_queue

from ckpt_iter import _files
from ckpt_iter import errors
from ckpt_iter import make_dataset
from demo import toyrun
import tunix_toy

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


RECORDS_READ: list[str] = []


def record_read(record):
  """make_dataset transform that logs which prompt the input pipeline read."""
  RECORDS_READ.append(record["id"])
  return record


def _train(learner_kind, root, max_steps, num_iterations=NUM_ITERATIONS):
  config = tunix_toy.RunConfig(learner=learner_kind, num_iterations=num_iterations, max_steps=max_steps)
  learner = tunix_toy.build_learner(config, root)
  recorder = toyrun.TrainerInputRecorder(learner)
  dataset = make_dataset(
      toyrun.load_prompts(), batch_size=1, num_epochs=None, shard_index=0, shard_count=1,
      transform=record_read,
  )
  RECORDS_READ.clear()
  learner.train(dataset)
  return ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in recorder.inputs], list(RECORDS_READ)


@pytest.fixture(scope="module")
def trained_on_a(tmp_path_factory):
  """A checkpoint written right after A's two updates (train_steps == 2)."""
  root = str(tmp_path_factory.mktemp("seed") / "ckpt")
  labels, _ = _train("ckpt_iter", root, 2)
  assert labels == ["A", "A"]
  return root


@pytest.fixture
def resumable_copy(trained_on_a, tmp_path):
  root = str(tmp_path / "ckpt")
  shutil.copytree(trained_on_a, root)
  return root


def test_resumable_continues_from_next_micro_batch_without_replay(resumable_copy):
  labels, read = _train("ckpt_iter", resumable_copy, 4)
  assert labels == ["B", "B"]
  # A is read to size the batches as Tunix does (the first batch), then once
  # more by the content check (the element before the saved position), and
  # the position is set directly: no next() over the consumed input.
  assert read == ["A", "A", "B"]
  # Every step names the run after its first save, the resumed ones too (`ckpt-iter audit`).
  data = os.path.join(resumable_copy, "actor", "{}", "data", "process_0-of-1.json")
  runs = {}
  for step in sorted(int(s) for s in os.listdir(os.path.join(resumable_copy, "actor")) if s.isdigit()):
    runs[step] = _files.read_header(data.format(step))["lineage"]["run"]  # whole: the pod part put back
  assert runs == {step: 1 for step in (1, 2, 3, 4)}


def test_data_state_of_another_step_is_refused(resumable_copy):
  step_1, step_2 = (os.path.join(resumable_copy, "actor", str(s), "data") for s in (1, 2))
  shutil.rmtree(step_2)
  shutil.copytree(step_1, step_2)
  with pytest.raises(errors.InvalidStateError, match="taken at train step 1, but the model was restored at step 2"):
    _train("ckpt_iter", resumable_copy, 4)


def test_resuming_with_another_num_iterations_names_the_field(resumable_copy):
  with pytest.raises(errors.ConfigDriftError, match="num_iterations=2 there, num_iterations=3 here"):
    _train("ckpt_iter", resumable_copy, 6, num_iterations=3)


@pytest.mark.heavy
def test_resumable_refuses_to_resume_a_stock_checkpoint(tmp_path):
  root = str(tmp_path / "ckpt")
  labels, _ = _train("stock", root, 2)
  assert labels == ["A", "A"]
  with pytest.raises(errors.LegacyCheckpointError, match="has no 'data' item"):
    _train("ckpt_iter", root, 4)


def _train_with_answer_key(root, max_steps, answer_key_file, allow_drift=()):
  """The toy GRPO run whose answers go through an answer-key file (a transform reads it)."""

  def answer_from_key(record):
    with open(answer_key_file) as f:
      key = json.load(f)
    return {**record, "answer": key.get(record["answer"], record["answer"])}

  config = tunix_toy.RunConfig(learner="ckpt_iter", num_iterations=NUM_ITERATIONS, max_steps=max_steps)
  learner = tunix_toy.build_learner(config, root)
  recorder = toyrun.TrainerInputRecorder(learner)
  learner.train(make_dataset(toyrun.load_prompts(), batch_size=1, num_epochs=None, shard_index=0,
                             shard_count=1, transform=answer_from_key), allow_drift=allow_drift)
  return ["".join(toyrun.prompt_labels(x["prompt_ids"])) for x in recorder.inputs]


def test_a_changed_answer_key_behind_an_unchanged_pipeline_is_refused_for_a_grpo_resume(tmp_path, caplog):
  """The content check of an RL learner: the checkpoint records the digest of the batch
  before its input position (A), and the resume produces A again and compares."""
  import logging  # pylint: disable=g-import-not-at-top

  root, answer_key = str(tmp_path / "ckpt"), tmp_path / "answers.json"
  first_answer = toyrun.load_prompts()[0]["answer"]
  answer_key.write_text(json.dumps({}))
  assert _train_with_answer_key(root, 2, str(answer_key)) == ["A", "A"]
  with caplog.at_level(logging.INFO, logger="ckpt_iter"):
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    assert _train_with_answer_key(copy, 4, str(answer_key)) == ["B", "B"]
  assert "content check: same element at index 0" in caplog.text
  answer_key.write_text(json.dumps({first_answer: f"{first_answer}-edited"}))
  with pytest.raises(errors.ContentDriftError, match="field 'answer'"):
    _train_with_answer_key(root, 4, str(answer_key))
  # The way through the refusal names: continue with the new answers.
  assert _train_with_answer_key(root, 4, str(answer_key), allow_drift={"content.answer"}) == ["B", "B"]
