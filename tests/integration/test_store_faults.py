"""Object-store faults end in a bounded, typed error, never a hang (gs:// through a fault proxy).

A real GCS emulator (fake-gcs-server) behind a local proxy that stalls,
fails, resets or truncates chosen requests (tests/fault_proxy.py). ckpt_iter's
own gs:// calls go through the proxy (STORAGE_EMULATOR_HOST), with short
bounds (1 s a request, 4 s an operation); Orbax's array writes go to the
emulator directly. Each case says what the user gets and how soon.
"""

from __future__ import annotations

import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _object_store
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib

REQUEST_SECONDS, OPERATION_SECONDS = 1.0, 4.0
# A typed error comes within the operation bound plus the client's last
# request and its cancellation: far below this, however loaded the machine.
WITHIN_SECONDS = 30


class _Holder:
  def __init__(self, value):
    self.value = value

  def state(self):
    return self.value


def _value(seed: int = 0) -> state_lib.IteratorState:
  rows = np.random.default_rng(seed).integers(0, 1000, (64, 32), dtype=np.int32)
  return state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "GRPOLearner"}, position={"next_index": 3},
      pending=state_lib.Pending(items=({"ids": rows},), schedule=(0,)), counters={"train_steps": 3})


def _write_item(directory: str, value: state_lib.IteratorState) -> None:
  header, arrays = codec.encode_state(value)
  _files.write_files(directory, header, arrays, process_index=0, process_count=1, count_file=True)


def _timed(call):
  started = time.monotonic()
  try:
    call()
  except Exception as e:  # pylint: disable=broad-except
    return e, time.monotonic() - started
  raise AssertionError("the call succeeded; the fault was not injected")


def test_a_stalled_read_ends_in_a_typed_timeout_naming_the_object(proxy, gcs_root):
  directory = f"{gcs_root}/3/data"
  _write_item(directory, _value())
  proxy.add("stall", ".npz", method="GET")
  error, seconds = _timed(lambda: _files.read_state(directory, 0, 1))
  assert isinstance(error, errors.StorageTimeoutError) and isinstance(error, OSError), repr(error)
  assert seconds < WITHIN_SECONDS
  assert f"{directory}/process_0-of-1.npz: read did not finish within its bound" in str(error)
  assert "set_object_store_bounds" in str(error)
  assert proxy.hits, "the stall was injected"


def test_a_stalled_upload_fails_the_save_and_commits_no_step(proxy, gcs_root, monkeypatch):
  # Every npz as a streamed (resumable) upload, whose requests name the object: a small one
  # is otherwise one multipart upload, named only in its body, which the proxy does not read.
  monkeypatch.setattr(_object_store, "SMALL_UPLOAD_BYTES", 0)
  manager = ocp.CheckpointManager(
      gcs_root, item_handlers={"data": ckpt_iter.IteratorCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
  manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(_Holder(_value(1)))))
  manager.wait_until_finished()
  proxy.add("stall", ".npz", method="POST")
  proxy.add("stall", ".npz", method="PUT")

  def save_and_wait():
    manager.save(2, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(_Holder(_value(2)))))
    manager.wait_until_finished()

  error, seconds = _timed(save_and_wait)
  assert seconds < WITHIN_SECONDS
  chain, cause = [], error
  while cause is not None:
    chain.append(cause)
    cause = cause.__cause__ or cause.__context__
  assert any(isinstance(e, errors.StorageTimeoutError) for e in chain), [repr(e)[:200] for e in chain]
  proxy.clear()
  fresh = ocp.CheckpointManager(gcs_root, item_handlers={"data": ckpt_iter.IteratorCheckpointHandler()})
  assert fresh.all_steps() == [1]  # the failed step was never committed
  restored = _files.read_state(f"{gcs_root}/1/data", 0, 1)
  assert restored.pending.items[0]["ids"].tobytes() == _value(1).pending.items[0]["ids"].tobytes()


@pytest.mark.parametrize("status, cause, says", [
    (403, "permission", "the credentials in use may not read it"),
    (400, "request", "the store refused the request"),
])
def test_a_store_error_is_typed_with_the_hint_for_its_cause(proxy, gcs_root, status, cause, says):
  directory = f"{gcs_root}/5/data"
  _write_item(directory, _value())
  proxy.add("status", ".npz", method="GET", status=status)
  error, seconds = _timed(lambda: _files.read_state(directory, 0, 1))
  assert isinstance(error, errors.StorageError) and error.cause == cause, repr(error)
  assert error.path == f"{directory}/process_0-of-1.npz" and error.operation == "read"
  assert says in str(error) and "truncated or garbled" not in str(error)
  assert seconds < WITHIN_SECONDS


def test_a_server_error_that_never_clears_ends_at_the_bound(proxy, gcs_root):
  directory = f"{gcs_root}/6/data"
  _write_item(directory, _value())
  proxy.add("status", ".json", method="GET", status=503)
  error, seconds = _timed(lambda: _files.read_state(directory, 0, 1))
  assert isinstance(error, errors.StorageError), repr(error)  # typed: a timeout at the bound
  assert f"{directory}/process_0-of-1.json" in str(error)
  assert seconds < WITHIN_SECONDS


@pytest.mark.parametrize("action", ["reset", "truncate"])
def test_a_transient_fault_is_retried_and_reads_the_exact_state(proxy, gcs_root, action):
  directory = f"{gcs_root}/7/data"
  value = _value(7)
  _write_item(directory, value)
  proxy.add(action, ".npz", method="GET", times=1)
  restored = _files.read_state(directory, 0, 1)
  assert proxy.hits and proxy.hits[0][0] == action
  assert restored.pending.items[0]["ids"].tobytes() == value.pending.items[0]["ids"].tobytes()


def test_a_transient_failure_is_tried_again_as_the_store_bounds_say(proxy, gcs_root):
  # issue 59 item 5: retries a user can set. Each attempt has its own operation bound, here shorter than
  # gcsfs's first backoff: an attempt meets one stalled request, so three stalls take three attempts.
  url = f"{gcs_root}/retried.bin"
  _storage.write_bytes(url, b"x" * 1000)
  proxy.add("stall", "retried.bin?alt=media", method="GET", times=3)
  ckpt_iter.set_object_store_bounds(request_seconds=0.5, operation_seconds=0.8, retries=3, backoff_seconds=0.1)
  assert _storage.read_bytes(url, max_bytes=10_000) == b"x" * 1000
  assert sum(action == "stall" for action, _, _ in proxy.hits) == 3
  proxy.add("stall", "retried.bin?alt=media", method="GET", times=1)
  ckpt_iter.set_object_store_bounds(retries=0)
  with pytest.raises(errors.StorageTimeoutError) as caught:
    _storage.read_bytes(url, max_bytes=10_000)
  assert "retried.bin: read did not finish within its bound" in str(caught.value)
