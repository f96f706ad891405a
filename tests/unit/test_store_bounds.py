"""`store_bounds`: how long ckpt_iter waits on an object store, set in code or by the environment.

The bounds' effect on real calls (a stalled store raising StorageTimeoutError
in time) needs a store: tests/integration/test_store_faults.py. Here, what
the bounds accept and refuse.
"""

import pytest

import ckpt_iter
from ckpt_iter import errors
from ckpt_iter import store_bounds


@pytest.fixture(autouse=True)
def _restore_bounds():
  before = store_bounds.object_store_bounds()
  yield
  ckpt_iter.set_object_store_bounds(request_seconds=before.request_seconds,
                                    operation_seconds=before.operation_seconds)


def test_bounds_refuse_a_value_that_is_not_a_positive_number():
  with pytest.raises(errors.InvalidArgumentError, match="request_seconds is 0; it must be a positive number"):
    ckpt_iter.set_object_store_bounds(request_seconds=0)
  with pytest.raises(errors.InvalidArgumentError, match="operation_seconds is 'soon'"):
    ckpt_iter.set_object_store_bounds(operation_seconds="soon")


def test_setting_one_bound_keeps_the_other_and_returns_both():
  before = store_bounds.object_store_bounds()
  now = ckpt_iter.set_object_store_bounds(request_seconds=7)
  assert now == ckpt_iter.StoreBounds(request_seconds=7.0, operation_seconds=before.operation_seconds)
  assert store_bounds.object_store_bounds() == now


@pytest.mark.parametrize("text, expected", [
    ("", ckpt_iter.StoreBounds()),
    ("request=5", ckpt_iter.StoreBounds(request_seconds=5.0)),
    (" operation=90 , request=2.5 ", ckpt_iter.StoreBounds(request_seconds=2.5, operation_seconds=90.0)),
])
def test_the_environment_sets_the_default_bounds(monkeypatch, text, expected):
  monkeypatch.setenv(store_bounds.BOUNDS_ENV, text)
  assert store_bounds._bounds_from_env() == expected  # pylint: disable=protected-access


@pytest.mark.parametrize("text, named", [
    ("timeout=5", "got part 'timeout=5'"),
    ("request=-1", "request_seconds is '-1'"),
    ("operation=inf", "operation_seconds is 'inf'"),
])
def test_a_bad_environment_value_is_named(monkeypatch, text, named):
  monkeypatch.setenv(store_bounds.BOUNDS_ENV, text)
  with pytest.raises(errors.InvalidArgumentError, match=named.replace("(", r"\(")):
    store_bounds._bounds_from_env()  # pylint: disable=protected-access


@pytest.mark.parametrize("text, expected", [
    ("retries=5,backoff=0.5", {"retries": 5, "backoff_seconds": 0.5}),
    ("retries=0", {"retries": 0}),
])
def test_retries_and_backoff_come_from_the_environment_too(monkeypatch, text, expected):
  monkeypatch.setenv(store_bounds.BOUNDS_ENV, text)
  assert store_bounds._bounds_from_env() == ckpt_iter.StoreBounds(**expected)  # pylint: disable=protected-access


@pytest.mark.parametrize("retries", [-1, 101, 1.5, "x", True])
def test_a_bad_retry_count_is_refused_naming_it(retries):
  with pytest.raises(errors.InvalidArgumentError, match="retries is"):
    ckpt_iter.set_object_store_bounds(retries=retries)
