"""The algorithm settings a resume may change, as the data state records them.

The data state's fingerprint refuses any change to what the pending examples
mean (num_generations, num_iterations, batch geometry, the input); the numeric
settings of the algorithm and the sampler (the KL weight, the clipping
epsilons, the temperature, the learning rate, ...) only change how the run goes
on, so a resume accepts new values and logs one warning listing every
old -> new pair (`warn_settings_changes`). They travel in the fingerprint as one
compact field, `settings` ("beta=0.04,epsilon=0.2,..."), taken out before the
fingerprint is compared (`split_settings`): a state written before it existed
has none. The values are read from the learner by `_api.algorithm_settings`
(Tunix's private attributes are read there only).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

SETTINGS_FIELD = "settings"
# Also recorded there: the Tunix that wrote the state, named when a pending
# example of another Tunix version cannot be restored, warned about otherwise.
TUNIX_VERSION = "tunix_version"
_LOG = logging.getLogger("ckpt_iter")


def encode_settings(settings: Mapping[str, int | float | str]) -> str:
  """The settings field's text: name=value pairs, sorted, comma-separated."""
  return ",".join(f"{name}={value!r}" for name, value in sorted(settings.items()))


def split_settings(fingerprint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
  """(the fingerprint without the settings field, the settings as name -> value text)."""
  rest = {name: value for name, value in fingerprint.items() if name != SETTINGS_FIELD}
  text = fingerprint.get(SETTINGS_FIELD)
  if not isinstance(text, str) or not text:
    return rest, {}
  return rest, dict(pair.split("=", 1) for pair in text.split(",") if "=" in pair)


def saved_tunix_version(fingerprint: Mapping[str, Any]) -> str | None:
  """The Tunix version a state's settings record, or None (written before it was recorded)."""
  value = split_settings(fingerprint)[1].get(TUNIX_VERSION)
  return None if value is None else value.strip("'\"")


def settings_changes(saved: Mapping[str, str], current: Mapping[str, str]) -> dict[str, tuple[str, str]]:
  """Settings recorded on both sides whose values differ, name -> (saved, current)."""
  return {name: (saved[name], current[name])
          for name in sorted(set(saved) & set(current)) if saved[name] != current[name]}


def warn_settings_changes(changed: Mapping[str, tuple[str, str]], origin: str) -> None:
  """One warning naming every changed setting, old -> new (nothing when none changed)."""
  if changed:
    _LOG.warning(
        "ckpt_iter: %s was written with other algorithm settings; resuming with the new ones: %s.",
        origin, ", ".join(f"{name}: {old} -> {new}" for name, (old, new) in changed.items()),
    )
