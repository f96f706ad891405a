"""Algorithm settings a resume may change: recorded with the data state, warned about.

The data state's fingerprint refuses any change to what the pending examples
mean (num_generations, num_iterations, batch geometry, the input). The numeric
settings of the algorithm and the sampler (the KL weight, the clipping
epsilons, the temperature, the learning rate, ...) only change how the run
goes on; a resume accepts new values and logs one warning listing every
old -> new pair, so a changed config is never silent.

They travel in the fingerprint as one compact field, `settings`
("beta=0.04,epsilon=0.2,..."; a data state header stays well under 1 KB),
which is taken out before the fingerprint is compared (`split`): a state
written before it existed has none, and nothing is compared for it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping


FIELD = "settings"
# Also recorded there: the Tunix that wrote the state, named when a pending
# example of another Tunix version cannot be restored, warned about otherwise.
TUNIX_VERSION = "tunix_version"
_LOG = logging.getLogger("ckpt_iter")
# Fingerprinted in their own right (a change is refused): not repeated here.
_REFUSED = frozenset({"num_generations", "num_iterations"})
# The rollout's sampling knobs in the training mode.
_ROLLOUT_FIELDS = ("temperature", "top_p", "top_k")


def algorithm_settings(learner: Any) -> dict[str, int | float]:
  """The learner's numeric changeable settings, name -> value."""
  settings: dict[str, int | float] = {}
  algo_config = getattr(learner, "algo_config", None)
  if dataclasses.is_dataclass(algo_config):
    for field in dataclasses.fields(algo_config):
      value = getattr(algo_config, field.name, None)
      # GRPO copies the rollout temperature into its config: recorded once, below.
      if field.name not in _REFUSED and field.name not in _ROLLOUT_FIELDS and _is_number(value):
        settings[field.name] = value
  rollout = _train_rollout_config(learner)
  for name in _ROLLOUT_FIELDS:
    value = getattr(rollout, name, None)
    if _is_number(value):
      settings[name] = value
  learning_rate = _initial_learning_rate(learner)
  if learning_rate is not None:
    settings["learning_rate"] = learning_rate
  return settings


def encode(settings: Mapping[str, int | float | str]) -> str:
  return ",".join(f"{name}={value!r}" for name, value in sorted(settings.items()))


def split(fingerprint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
  """(the fingerprint without the settings field, the settings as name -> value text)."""
  rest = {name: value for name, value in fingerprint.items() if name != FIELD}
  text = fingerprint.get(FIELD)
  if not isinstance(text, str) or not text:
    return rest, {}
  return rest, dict(pair.split("=", 1) for pair in text.split(",") if "=" in pair)


def saved_tunix_version(fingerprint: Mapping[str, Any]) -> str | None:
  """The Tunix version a state's settings record, or None (written before it was recorded)."""
  value = split(fingerprint)[1].get(TUNIX_VERSION)
  return None if value is None else value.strip("'\"")


def changes(saved: Mapping[str, str], current: Mapping[str, str]) -> dict[str, tuple[str, str]]:
  """Settings recorded on both sides whose values differ, name -> (saved, current)."""
  return {name: (saved[name], current[name])
          for name in sorted(set(saved) & set(current)) if saved[name] != current[name]}


def warn(changed: Mapping[str, tuple[str, str]], origin: str) -> None:
  if changed:
    _LOG.warning(
        "ckpt_iter: %s was written with other algorithm settings; resuming with the new ones: %s.",
        origin, ", ".join(f"{name}: {old} -> {new}" for name, (old, new) in changed.items()),
    )


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _train_rollout_config(learner: Any) -> Any:
  cluster = getattr(learner, "rl_cluster", None)
  try:
    from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

    return cluster.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN)
  except Exception:  # pylint: disable=broad-except
    # A cluster without a rollout config for training records no rollout settings.
    return None


def _initial_learning_rate(learner: Any) -> float | None:
  """The actor optimizer's learning rate at step 0, when it is visible.

  An optax transformation hides its constants in closures; only one built
  with `optax.inject_hyperparams` exposes them, in the state its `init`
  returns. `init({})` builds that state without touching the model. The live
  optimizer state cannot be used: Tunix restored it from the checkpoint.
  """
  try:
    optimizer = learner.rl_cluster.cluster_config.training_config.actor_optimizer
    found = _find_learning_rate(optimizer.init({}))
  except Exception:  # pylint: disable=broad-except
    return None  # an optimizer that cannot init without parameters: not recorded
  # float32 in the state: keep the digits it holds, not its binary tail.
  return None if found is None else float(f"{float(found):.7g}")


def _find_learning_rate(opt_state: Any) -> Any:
  hyperparams = getattr(opt_state, "hyperparams", None)
  if isinstance(hyperparams, Mapping) and "learning_rate" in hyperparams:
    return hyperparams["learning_rate"]
  if isinstance(opt_state, (tuple, list)):
    for part in opt_state:
      found = _find_learning_rate(part)
      if found is not None:
        return found
  return None
