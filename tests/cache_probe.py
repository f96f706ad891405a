"""What a shard cache holds, seen from outside its processes, for tests and benchmarks.

A copy a process has open holds a shared flock (`ShardCache.open`); `/proc/locks` lists every flock
by inode, so a probe tells held copies from idle ones without taking a lock itself (an exclusive
probe would make a reader take the copy for one being evicted).
"""

from __future__ import annotations

import os

_SIDECARS = (".lock", ".count", ".seal", ".index.npy")


def flocked_inodes() -> set[int]:
  """The inodes someone holds an flock on (Linux's /proc/locks)."""
  inodes = set()
  with open("/proc/locks") as f:
    for line in f:
      fields = line.split()
      if len(fields) > 5 and fields[1] == "FLOCK":
        inodes.add(int(fields[5].rsplit(":", 1)[1]))
  return inodes


def cache_bytes(directory: str) -> tuple[int, int]:
  """(bytes of the complete copies with their line indexes, of those no process holds open)."""
  held = flocked_inodes()
  total = idle = 0
  try:
    names = os.listdir(directory)
  except OSError:
    return 0, 0
  for name in names:
    if ".tmp-" in name or name.endswith(_SIDECARS):
      continue
    path = os.path.join(directory, name)
    try:
      size = os.stat(path)
      index_bytes = os.path.getsize(path + ".index.npy") if os.path.exists(path + ".index.npy") else 0
    except OSError:
      continue
    total += size.st_size + index_bytes
    if size.st_ino not in held:
      idle += size.st_size + index_bytes
  return total, idle
