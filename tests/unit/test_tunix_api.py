"""The private Tunix API ckpt_iter relies on, and what happens when it is gone."""

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
from tunix.rl import rl_learner

from ckpt_iter.tunix import _api as api
from ckpt_iter import errors


def test_every_private_name_exists_in_this_tunix():
  assert api.check_private_api() == []


def test_a_missing_private_method_is_reported_by_name(monkeypatch):
  monkeypatch.delattr(rl_learner.RLLearner, "_create_micro_batch_iterator")
  assert api.check_private_api() == [
      "tunix.rl.rl_learner.RLLearner._create_micro_batch_iterator is missing"
  ]


def test_a_changed_signature_is_reported(monkeypatch):
  def _prepare_data(self, iterator, data_queue):  # an imagined new signature
    del self, iterator, data_queue

  monkeypatch.setattr(rl_learner.RLLearner, "_prepare_data", _prepare_data)
  problems = api.check_private_api()
  assert len(problems) == 1
  assert "_prepare_data no longer takes" in problems[0]
  assert "proceed_num_steps" in problems[0]


def test_building_a_learner_fails_loudly_when_api_is_gone(monkeypatch, tmp_path):
  import tunix_toy  # pylint: disable=g-import-not-at-top

  monkeypatch.delattr(rl_learner.RLLearner, "_process_accumulated_batches")
  with pytest.raises(errors.UnsupportedConfigError, match="_process_accumulated_batches is missing"):
    tunix_toy.build_learner(tunix_toy.RunConfig(learner="ckpt_iter"), str(tmp_path / "ckpt"))


def test_sequence_packing_is_accepted_at_construction(tmp_path):
  # Packed runs resume exactly (tests/integration/test_tunix_packing.py).
  import tunix_toy  # pylint: disable=g-import-not-at-top

  learner = tunix_toy.build_learner(
      tunix_toy.RunConfig(learner="ckpt_iter", max_seq_token_per_tpu=64), str(tmp_path / "ckpt"))
  assert api.training_config(learner).max_seq_token_per_tpu == 64


def test_every_agentic_private_name_exists_in_this_tunix():
  assert api.check_private_api(api.AGENTIC_LEARNER_PRIVATE_API) == []


def test_a_missing_agentic_private_method_is_reported_by_name(monkeypatch):
  from tunix.rl.agentic import agentic_rl_learner  # pylint: disable=g-import-not-at-top

  monkeypatch.delattr(agentic_rl_learner.AgenticRLLearner, "_batch_to_train_example")
  assert api.check_private_api(api.AGENTIC_LEARNER_PRIVATE_API) == [
      "tunix.rl.agentic.agentic_rl_learner.AgenticRLLearner._batch_to_train_example is missing"
  ]
