"""A shard cache's bookkeeping (`_cache_usage`): the total its processes share, and the eviction order."""

from __future__ import annotations

import os
import threading
import time

from ckpt_iter import _cache_usage


def _add_many(directory: str, times: int) -> None:
  ledger = _cache_usage.Ledger(directory)
  for _ in range(times):
    with ledger.held() as held:
      held.add(3)


def test_the_total_is_shared_and_no_addition_is_lost_between_writers(tmp_path):
  # Each writer opens the ledger itself, as a process does (an flock is per open file, so threads exclude
  # one another as processes do; the unit tier starts no process).
  ledger = _cache_usage.Ledger(str(tmp_path))
  assert ledger.total() is None  # no ledger yet: a listing sets it
  with ledger.held() as held:
    held.add(5)  # unknown stays unknown
    assert held.total is None
    held.set(10)
  workers = [threading.Thread(target=_add_many, args=(str(tmp_path), 200)) for _ in range(3)]
  for worker in workers:
    worker.start()
  _add_many(str(tmp_path), 200)
  for worker in workers:
    worker.join(60)
  assert ledger.total() == 10 + 4 * 200 * 3


def test_a_garbled_or_negative_total_is_not_a_total(tmp_path):
  ledger = _cache_usage.Ledger(str(tmp_path))
  for text in (b"x", b"-4\n", b"\xff\xfe"):
    with open(ledger.path, "wb") as f:
      f.write(text)
    assert ledger.total() is None


def test_the_order_gives_the_least_recently_used_copy_first_as_it_is_now(tmp_path):
  paths = []
  for number in range(4):
    path = tmp_path / f"copy-{number}"
    path.write_bytes(b"x")
    os.utime(path, (1000 + number, 1000 + number))
    paths.append(str(path))
  order = _cache_usage.EvictionOrder()
  order.reset([(p, os.stat(p).st_mtime) for p in paths])
  os.utime(paths[0], (time.time(), time.time()))  # used since it was noted: goes back in order
  os.unlink(paths[1])  # evicted by another process: dropped
  oldest = order.oldest()
  assert next(oldest) == paths[2]
  order.keep([paths[2]])  # in use: kept
  assert [next(oldest), next(oldest), next(oldest)] == [paths[2], paths[3], paths[0]]
  assert _cache_usage.bytes_on_disk(paths[1], paths[2], paths[3]) == 2
