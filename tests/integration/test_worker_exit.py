"""mp_prefetch worker processes exit when the process that started them is SIGKILLed (issue 42, 9b).

Grain's workers block on their queues and outlived a killed training
process (20 minutes at 220 MB each were seen), and with them Python's
resource tracker. Where ckpt_iter owns the iterator (DataIterator over an
mp_prefetch pipeline, DataLoaderIterator over a DataLoader with workers),
each worker watches its parent and exits once it is gone. A child process
builds the iterator, reads a few elements and is SIGKILLed; every process it
started must be gone within 30 s (a bound, not a timing claim: they go within
about a second).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

_CHILD = r'''
import functools
import os
import sys
import absl.flags
import grain
import ckpt_iter

def mark(directory, index, count):  # the user's worker_init_fn: it must still run
  open(os.path.join(directory, f"worker_{index}_of_{count}"), "w").close()

def build(kind):
  if kind == "dataset":
    dataset = ckpt_iter.make_dataset([{"id": i} for i in range(1000)], batch_size=2, seed=7, num_epochs=None)
    return ckpt_iter.DataIterator(dataset.to_iter_dataset().mp_prefetch(
        grain.MultiprocessingOptions(num_workers=2), worker_init_fn=functools.partial(mark, os.getcwd())))
  loader = grain.DataLoader(
      data_source=[{"id": i} for i in range(1000)],
      sampler=grain.samplers.IndexSampler(1000, shuffle=True, seed=7, num_epochs=1),
      operations=[grain.transforms.Batch(batch_size=2)], worker_count=2)
  return ckpt_iter.DataLoaderIterator(loader)

if __name__ == "__main__":  # workers are spawned: they import this file without running it
  absl.flags.FLAGS.mark_as_parsed()  # jax >= 0.10 makes mp_prefetch read absl flags (google/grain#1355)
  iterator = build(sys.argv[1])
  for _ in range(3):
    next(iterator)
  print("read", flush=True)
  sys.stdin.read()  # until killed
'''

_BOUND_S = 30.0


def _children(pid: int) -> dict[int, str]:
  """pid -> command line of the live processes whose parent is `pid`."""
  found = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
      with open(f"/proc/{name}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
      continue
    if int(fields.get("PPid", "0")) == pid and not fields.get("State", "").startswith("Z"):
      found[int(name)] = command
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return "\nState:\tZ" not in f.read()  # a zombie has exited (its new parent may be slow to reap)
  except OSError:
    return False


@pytest.mark.parametrize("kind", ["dataset", "loader"])
def test_workers_exit_when_their_process_is_killed(tmp_path, kind):
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  child = subprocess.Popen([sys.executable, str(script), kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=env, cwd=str(tmp_path))
  started: dict[int, str] = {}
  try:
    assert child.stdout.readline().strip() == "read", "the child did not read its elements"
    started = _children(child.pid)
    workers = [pid for pid, command in started.items() if "multiprocessing.spawn" in command]
    assert len(workers) == 2, started  # the control: the child runs its two workers
    if kind == "dataset":
      assert sorted(p.name for p in tmp_path.glob("worker_*")) == ["worker_0_of_2", "worker_1_of_2"]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + _BOUND_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in started):
      time.sleep(0.2)
    left = {pid: command for pid, command in started.items() if _alive(pid)}
    assert not left, f"still running {_BOUND_S} s after their process was killed: {left}"
  finally:
    if child.poll() is None:
      child.kill()
      child.wait()
    for pid in started:  # never leave a worker behind on the shared machine
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
