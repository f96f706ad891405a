"""What the data item adds to an async Orbax save, as counts: threads, where its write runs, its order.

Issue 49 item 4: the data item's write used to run in a thread (and event
loop) of its own, started inside `save()` while it blocks the training loop.
It now runs in Orbax's background save thread when Orbax awaits it. No
timing is asserted: only what runs where, and how often.
"""

import concurrent.futures
import os
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _item
from ckpt_iter import checkpoint as checkpoint_lib


def _iterator():
  dataset = ckpt_iter.make_dataset([{"id": i} for i in range(32)], batch_size=2, seed=1, num_epochs=None)
  iterator = ckpt_iter.DataIterator(dataset)
  next(iterator)
  return iterator


def _params(step):
  return {"w": np.full((4, 4), step, np.float32), "b": np.arange(4, dtype=np.float32) + step}


class _ThreadStarts:
  """Counts threads started from the main thread, and all threads by name, while active."""

  def __init__(self):
    self.from_main = 0
    self.names = []
    self.active = False

  def __enter__(self):
    original = threading.Thread.start
    counter = self

    def start(thread, *args, **kwargs):
      if counter.active:
        counter.names.append(thread.name)
        if threading.current_thread() is threading.main_thread():
          counter.from_main += 1
      return original(thread, *args, **kwargs)

    self._original = original
    threading.Thread.start = start
    return self

  def __exit__(self, *exc):
    threading.Thread.start = self._original


def _threads_started_by_save(manager, step, args):
  with _ThreadStarts() as starts:
    starts.active = True
    manager.save(step, args=args)
    starts.active = False
    manager.wait_until_finished()
  return starts


def test_the_data_item_starts_no_thread_while_save_blocks(ckpt_dir):
  """`save()` starts as many threads with the data item as without it: the item adds none of its own."""
  iterator = _iterator()
  with ocp.CheckpointManager(ckpt_dir) as manager:
    plain = lambda step: ocp.args.Composite(params=ocp.args.StandardSave(_params(step)))  # noqa: E731
    with_data = lambda step: ocp.args.Composite(  # noqa: E731
        params=ocp.args.StandardSave(_params(step)), data=ckpt_iter.IteratorSave(iterator))
    for step in (1, 2):  # first-use costs of both forms
      _threads_started_by_save(manager, step, plain(step) if step == 1 else with_data(step))
    without = _threads_started_by_save(manager, 3, plain(3))
    ours = _threads_started_by_save(manager, 4, with_data(4))
    assert manager.all_steps() == [1, 2, 3, 4]
  assert ours.from_main == without.from_main
  assert "ckpt_iter_save" not in ours.names


def test_the_write_runs_in_orbax_s_background_save_thread(ckpt_dir, monkeypatch):
  """The files are written by the thread that awaits the items' writes, once per save, after save() returned."""
  writers = []
  write = _item.write

  def recording_write(*args, **kwargs):
    writers.append(threading.current_thread())
    return write(*args, **kwargs)

  monkeypatch.setattr(_item, "write", recording_write)
  iterator = _iterator()
  with ocp.CheckpointManager(ckpt_dir) as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(_params(step)), data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
  assert len(writers) == 2
  assert all(thread is not threading.main_thread() for thread in writers)
  assert [thread.name for thread in writers] == ["async_save", "async_save"]
  # Orbax's own commit_success.txt is there on the releases that write one per item (not 0.11.40).
  assert set(os.listdir(ckpt_dir / "2" / "data")) - {"commit_success.txt"} == {"ckpt_iter.json", "process_0-of-1.json"}


def test_a_failed_write_fails_the_save_and_keeps_the_step_before(ckpt_dir, monkeypatch):
  iterator = _iterator()
  with ocp.CheckpointManager(ckpt_dir) as manager:
    manager.save(1, args=ocp.args.Composite(
        params=ocp.args.StandardSave(_params(1)), data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
    before = sorted(os.listdir(ckpt_dir / "1" / "data"))

    def failing_write(*args, **kwargs):
      raise OSError(28, "No space left on device")

    monkeypatch.setattr(_item, "write", failing_write)
    manager.save(2, args=ocp.args.Composite(
        params=ocp.args.StandardSave(_params(2)), data=ckpt_iter.IteratorSave(iterator)))
    with pytest.raises(OSError, match="No space left"):
      manager.wait_until_finished()
    assert manager.all_steps() == [1]
  assert sorted(os.listdir(ckpt_dir / "1" / "data")) == before
  assert not (ckpt_dir / "2").exists()


def test_the_write_runs_once_and_its_error_is_raised_on_every_wait():
  calls = []

  def write():
    calls.append(1)
    raise OSError(5, "Input/output error")

  future = checkpoint_lib._WriteWhenAwaited(write)  # pylint: disable=protected-access
  for _ in range(2):
    with pytest.raises(OSError, match="Input/output"):
      future.result()
  assert len(calls) == 1


def test_a_cancelled_write_writes_nothing():
  calls = []
  future = checkpoint_lib._WriteWhenAwaited(lambda: calls.append(1))  # pylint: disable=protected-access
  assert future.cancel()
  with pytest.raises(concurrent.futures.CancelledError):
    future.result()
  assert not calls
