"""Shared pytest setup: CPU JAX, the --run-slow switch, Hypothesis profiles,
and fixtures several test files use (records, pipelines, a CheckpointManager)."""

import importlib.util
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A worker that dies of a signal (a native crash in XLA or Tunix's threads)
# prints every thread's Python stack: the test's stderr tail then says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# One persistent JAX compilation cache for the whole session and every process
# it starts, kept between runs on this machine: a toy Tunix process spends more
# than half its CPU compiling, and a warm cache gives bit-identical results.
# No size bound: JAX's LRU eviction takes a file lock whose timeout fails a
# compilation under load; `make clean-cache` empties it.
JAX_CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                 "ckpt_iter", "test_jax_compilation_cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# `make test JAX_CACHE_STATS=DIR`: every process counts its cache lookups and
# hits into DIR (tests/cache_stats), for the suite's hit rate.
if os.environ.get("CKPT_ITER_JAX_CACHE_STATS"):
  _STATS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache_stats")
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (_STATS_PATH, os.environ.get("PYTHONPATH")) if p)
  _spec = importlib.util.spec_from_file_location("_cache_stats", os.path.join(_STATS_PATH, "sitecustomize.py"))
  _cache_stats = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(_cache_stats)  # this process too (xdist workers import conftest)
# JSONL line-index caches go to a throwaway directory, never to ~/.cache.
os.environ.setdefault("CKPT_ITER_INDEX_CACHE_DIR", tempfile.mkdtemp(prefix="ckpt_iter_index_"))
# Test modules import the shared helpers (support.py) and the worker scripts
# (workers/, also run as subprocesses) by name, from any subdirectory.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.join(_HERE, "workers")):
  if _path not in sys.path:
    sys.path.insert(0, _path)
# The demo (demo/, the toy Tunix runs the tests' toy builds on) is not installed:
# this process and every process it starts import it from the repository.
_REPO = os.path.dirname(_HERE)
if _REPO not in sys.path:
  sys.path.append(_REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _REPO) if p)

import hypothesis  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

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
      help="also run the long variants marked @pytest.mark.slow (and the heavy tests)",
  )
  parser.addoption(
      "--run-heavy", action="store_true", default=False,
      help="also run the long runs marked @pytest.mark.heavy (real Tunix trainings, further bucket-path examples)",
  )


def pytest_collection_modifyitems(config, items):
  # Deselected, not skipped: `make test` runs the representative subset and
  # `make test-full` the long variants (see README); tests of one Tunix
  # version's API run where it is installed (`make test-tunix-main` for main).
  out = set()
  if not config.getoption("--run-slow"):
    out |= {id(item) for item in items if "slow" in item.keywords}
    if not config.getoption("--run-heavy"):
      out |= {id(item) for item in items if "heavy" in item.keywords}
  # Version-specific tests: those of the other Tunix than the installed one.
  versioned = [item for item in items if {"tunix_main", "tunix_0_1_7"} & set(item.keywords)]
  if versioned and importlib.util.find_spec("tunix") is not None:
    other = "tunix_0_1_7" if _tunix_has_rl_engine() else "tunix_main"
    out |= {id(item) for item in versioned if other in item.keywords}
  if out:
    config.hook.pytest_deselected(items=[item for item in items if id(item) in out])
    items[:] = [item for item in items if id(item) not in out]


def _tunix_has_rl_engine() -> bool:
  from tunix.rl import rl_cluster  # pylint: disable=g-import-not-at-top

  return hasattr(rl_cluster, "RLEngine")


# ---------------------------------------------------------------------------
# Shared fixtures.


@pytest.fixture(scope="session")
def jax_cache() -> str:
  """The session's persistent JAX compilation cache (also in every child's environment)."""
  return JAX_CACHE_DIR

RECORD_COUNT = 40


@pytest.fixture
def records() -> list[dict]:
  """40 small records `{"id": i, "text": f"r{i}"}` (the legacy fixture's data)."""
  return [{"id": i, "text": f"r{i}"} for i in range(RECORD_COUNT)]


@pytest.fixture
def make_pipeline(records):
  """Builds a NEW make_dataset pipeline over `records` on every call.

  Defaults: batch_size=4, seed=7, num_epochs=2 (10 batches per epoch);
  keyword arguments override them (and `records=` the records).
  """
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  def build(**overrides):
    options = {"batch_size": 4, "seed": 7, "num_epochs": 2, **overrides}
    return ckpt_iter.make_dataset(options.pop("records", records), **options)

  return build


@pytest.fixture
def ckpt_dir(tmp_path):
  """An absolute checkpoint root (Orbax fails on relative ones in its thread)."""
  return (tmp_path / "ckpt").absolute()


@pytest.fixture
def ckpt_manager(ckpt_dir):
  """An Orbax CheckpointManager on `ckpt_dir`, closed after the test."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(ckpt_dir)
  yield manager
  manager.close()


# Tests of the optional integrations skip, with this reason, where the extra is
# not installed (`make test` installs both: nothing is skipped there).
NEEDS_TUNIX = "google-tunix is not installed (pip install 'ckpt_iter[tunix]')"
NEEDS_DATASETS = "datasets is not installed (pip install 'ckpt_iter[hf]')"


@pytest.fixture(scope="session")
def gcs_emulator():
  """A real local GCS emulator (fake-gcs-server) for the whole session.

  Exports the emulator's environment variables to this process (so gs://
  paths reach it through gcsfs, tensorstore and array_record) and to every
  subprocess started while it runs. Never skipped: its package is in the
  test extra, and a failure to start fails the tests that need it.
  """
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top

  emulator = emulator_lib.GcsEmulator().start()
  yield emulator
  emulator.stop()


@pytest.fixture
def proxy(gcs_emulator, monkeypatch, request):
  """A fault-injecting proxy (tests/fault_proxy.py) between gcsfs and the emulator, for one test.

  Every gs:// call of this process goes through it, with ckpt_iter's store bounds set to the test
  module's REQUEST_SECONDS, OPERATION_SECONDS and RETRIES (1 s, 4 s and no retry unless it names its
  own; a retry after 0.1 s), and put back after.
  """
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  import fault_proxy  # pylint: disable=g-import-not-at-top
  from ckpt_iter import store_bounds  # pylint: disable=g-import-not-at-top

  running = fault_proxy.FaultProxy(gcs_emulator.url).start()
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", running.url)
  before = store_bounds.object_store_bounds()
  ckpt_iter.set_object_store_bounds(request_seconds=getattr(request.module, "REQUEST_SECONDS", 1.0),
                                    operation_seconds=getattr(request.module, "OPERATION_SECONDS", 4.0),
                                    retries=getattr(request.module, "RETRIES", 0), backoff_seconds=0.1)
  try:
    yield running
  finally:
    running.stop()
    ckpt_iter.set_object_store_bounds(request_seconds=before.request_seconds, operation_seconds=before.operation_seconds,
                                      retries=before.retries, backoff_seconds=before.backoff_seconds)


@pytest.fixture
def gcs_root(gcs_emulator, request):
  """A fresh gs:// prefix of the emulator's bucket for one test (no trailing slash)."""
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top
  import uuid  # pylint: disable=g-import-not-at-top

  del gcs_emulator
  name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
  return f"gs://{emulator_lib.BUCKET}/{name}-{uuid.uuid4().hex[:8]}"
