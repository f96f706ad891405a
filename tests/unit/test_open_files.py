"""A process's open files (`_open_files.OpenFiles`): least recently used first, none in a read closed, one per key."""

from __future__ import annotations

import dataclasses
import pickle
import random
import threading
import time

from ckpt_iter import _open_files


@dataclasses.dataclass
class _Entry:
  name: str
  readers: int = 0
  closed: bool = False


def _adding(files, evicted):
  """`files.add`, its evictions appended to `evicted` (keys) as they are made."""
  def add(key, readers=1, limit=None):
    kept, count = files.add(key, _Entry(key), readers=readers, limit=limit,
                            evict=lambda other, entry: evicted.append(other))
    assert count == len(evicted)
    return kept
  return add


def test_past_the_limit_the_least_recently_used_idle_entries_are_evicted_never_one_in_a_read():
  files, evicted = _open_files.OpenFiles(), []
  add = _adding(files, evicted)
  in_read = add("a", readers=1, limit=3)  # the least recent, in a read
  for key in "bc":
    assert add(key, readers=0, limit=3).name == key and not evicted
  add("d", limit=3)
  assert evicted == ["b"]  # the least recent idle one
  evicted.clear()
  assert files.use("c").readers == 1  # now the most recent, and in a read
  files.done(in_read)
  add("e", limit=2)
  assert evicted == ["a"]  # "d" and "c" are in reads, "e" is the one added
  assert "a" not in files and len(files) == 3
  evicted.clear()
  add("f", limit=None)
  assert not evicted and len(files) == 4  # no limit: nothing evicted


def test_an_eviction_is_over_before_another_thread_finds_the_entry_gone():
  files = _open_files.OpenFiles()
  files.add("a", _Entry("a"), readers=0)
  inside, release, seen = threading.Event(), threading.Event(), []

  def slow_evict(key, entry):
    inside.set()
    release.wait(10)  # as a cache's touch of the copy would take
    entry.closed = True

  adder = threading.Thread(target=files.add, args=("b", _Entry("b")), kwargs={"limit": 1, "evict": slow_evict})
  adder.start()
  assert inside.wait(10)
  finder = threading.Thread(target=lambda: seen.append(files.use("a")))
  finder.start()
  finder.join(0.2)
  assert finder.is_alive()  # waits for the eviction
  release.set()
  finder.join(10), adder.join(10)
  assert seen == [None]


def test_a_key_opened_meanwhile_keeps_the_first_entry_and_counts_the_readers_on_it():
  files = _open_files.OpenFiles()
  first, _ = files.add("a", _Entry("first"), readers=1)
  second = _Entry("second")
  kept, evicted = files.add("a", second, readers=2, limit=1, evict=lambda key, entry: None)
  assert kept is first and kept.readers == 3 and second.readers == 0 and evicted == 0


def test_take_idle_hands_back_only_entries_no_read_holds_outside_keep():
  files = _open_files.OpenFiles()
  for key in "abcd":
    files.add(key, _Entry(key), readers=0)
  files.use("b")
  assert sorted(key for key, _ in files.take_idle({"c"})) == ["a", "d"]
  assert "b" in files and "c" in files and len(files) == 2
  assert files.use("a") is None


def test_pickled_or_forked_it_holds_nothing_of_the_process_before(monkeypatch):
  files = _open_files.OpenFiles()
  files.add("a", _Entry("a"), readers=0)
  copy = pickle.loads(pickle.dumps(files))
  assert len(copy) == 0 and "a" not in copy and copy.use("a") is None
  copy.add("b", _Entry("b"))
  assert "b" in copy
  real_pid = _open_files.os.getpid()
  monkeypatch.setattr(_open_files.os, "getpid", lambda: real_pid + 1)  # as in a forked worker
  assert "a" not in files and len(files) == 0 and files.use("a") is None and files.take_idle(()) == []
  kept, _ = files.add("a", _Entry("child"))
  assert kept.name == "child"


def test_threads_reading_and_opening_at_once_never_lose_an_entry_in_a_read():
  files = _open_files.OpenFiles()
  failures = []

  def evict(key, idle):
    del key
    if idle.readers:
      failures.append(f"evicted {idle.name} with {idle.readers} readers")
    idle.closed = True

  def reader(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
      key = rng.randrange(12)
      entry = files.use(key)
      if entry is None:
        opened = _Entry(str(key))
        entry, _ = files.add(key, opened, limit=4, evict=evict)
        if entry is not opened and opened.readers:
          failures.append(f"counted a read on {key}'s second opening, which is not kept")
      time.sleep(0)  # another thread's turn, in the middle of this read
      if entry.closed:
        failures.append(f"read {entry.name} after it was closed")
      files.done(entry)

  threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(120)
  assert not failures
  assert len(files) <= 4 + 4  # the limit, and at most one entry in a read per thread beyond it
  assert all(entry.readers == 0 for _, entry in files.take_idle(()))
