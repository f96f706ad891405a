"""Shared pytest setup: CPU JAX, the --run-slow switch, Hypothesis profiles."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # pylint: disable=g-import-not-at-top

hypothesis.settings.register_profile(
    "default", deadline=None, print_blob=True, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "long", deadline=None, print_blob=True, max_examples=1000,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="also run the long variants marked @pytest.mark.slow",
  )


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  # Deselected, not skipped: `make test` runs the representative subset and
  # `make test-full` the long variants (see README).
  slow = [item for item in items if "slow" in item.keywords]
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if "slow" not in item.keywords]
