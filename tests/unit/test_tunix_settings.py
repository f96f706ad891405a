"""The algorithm settings a Tunix resume may change (ckpt_iter.tunix._settings)."""

import logging
import types

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
import optax

from ckpt_iter.tunix import _api
from ckpt_iter.tunix import _settings as settings_lib


def _learner_with(optimizer):
  training = types.SimpleNamespace(actor_optimizer=optimizer)
  return types.SimpleNamespace(rl_cluster=types.SimpleNamespace(
      cluster_config=types.SimpleNamespace(training_config=training)))


def test_the_learning_rate_is_read_where_optax_exposes_it():
  injected = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4)
  chained = optax.chain(optax.clip_by_global_norm(1.0), injected)
  assert _api._initial_learning_rate(_learner_with(injected)) == 3e-4
  assert _api._initial_learning_rate(_learner_with(chained)) == 3e-4
  # A plain optax.sgd keeps its rate in a closure: not recorded, not guessed.
  assert _api._initial_learning_rate(_learner_with(optax.sgd(1e-2))) is None


def test_settings_travel_as_one_field_and_are_compared_where_both_sides_have_them():
  saved = {"num_iterations": 2, "settings": settings_lib.encode_settings({"beta": 0.04, "temperature": 0.9})}
  current = {"num_iterations": 2, "settings": settings_lib.encode_settings({"beta": 0.1, "learning_rate": 0.01})}
  assert saved["settings"] == "beta=0.04,temperature=0.9"
  rest, saved_settings = settings_lib.split_settings(saved)
  assert rest == {"num_iterations": 2}
  _, current_settings = settings_lib.split_settings(current)
  # temperature (saved only) and learning_rate (current only) were not recorded
  # on both sides: nothing to compare.
  assert settings_lib.settings_changes(saved_settings, current_settings) == {"beta": ("0.04", "0.1")}
  # A state written before the field existed compares nothing.
  assert settings_lib.split_settings({"num_iterations": 2}) == ({"num_iterations": 2}, {})


def test_one_warning_lists_every_change(caplog):
  with caplog.at_level(logging.WARNING, logger="ckpt_iter"):
    settings_lib.warn_settings_changes({"beta": ("0.04", "0.1"), "temperature": ("0.9", "0.7")}, "checkpoint step 2")
    settings_lib.warn_settings_changes({}, "checkpoint step 3")
  assert len(caplog.records) == 1
  assert "beta: 0.04 -> 0.1, temperature: 0.9 -> 0.7" in caplog.records[0].getMessage()
