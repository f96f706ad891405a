"""mp_prefetch states restored in fresh processes, with the same and other worker counts.

The state is written here with 2 worker processes through Orbax; each child
process builds the pipeline with 2, 3 or 1 workers, restores it and prints
the rest of the stream. Grain's non-sequential worker slicing makes the
uninterrupted output the same for every worker count (docs/guarantees.md,
"Worker processes"), so every resumed stream must equal the uninterrupted
one from the first unread element: nothing skipped, nothing repeated.
"""

import collections
import json
import os
import subprocess
import sys

import absl.flags
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter

# jax >= 0.10 makes mp_prefetch read absl flags (google/grain#1355).
absl.flags.FLAGS.mark_as_parsed()

# Built the same way here and in the child process.
_BUILD = '''
import grain
import ckpt_iter
def build(num_workers, filtered=False):
  ds = ckpt_iter.make_dataset([{"id": i} for i in range(46)], batch_size=2, seed=7, num_epochs=2)
  if filtered:
    ds = ds.filter(lambda batch: int(batch["id"][0]) % 3 != 0)
  return ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
'''

# Workers are spawned: the child needs a __main__ guard and parsed absl flags.
_CHILD = _BUILD + '''
if __name__ == "__main__":
  import json, sys
  import absl.flags
  import numpy as np
  import orbax.checkpoint as ocp
  absl.flags.FLAGS.mark_as_parsed()
  directory, num_workers = sys.argv[1], int(sys.argv[2])
  iterator = ckpt_iter.DataIterator(build(num_workers))
  try:
    with ocp.CheckpointManager(directory, item_names=("data",)) as manager:
      manager.restore(1, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
    print(json.dumps([np.asarray(batch["id"]).tolist() for batch in iterator]))
  finally:
    iterator.close()
'''

_namespace = {}
exec(_BUILD, _namespace)  # pylint: disable=exec-used
build = _namespace["build"]

_CONSUMED = 7  # not a multiple of 2 or 3: the workers are at different local positions


def _ids(batches):
  return [np.asarray(batch["id"]).tolist() for batch in batches]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(checkpoint directory, child script, batches read before the save, uninterrupted stream)."""
  root = tmp_path_factory.mktemp("mp_prefetch")
  uninterrupted = _ids(ckpt_iter.DataIterator(build(0)))  # no workers: the reference order
  iterator = ckpt_iter.DataIterator(build(2))
  try:
    consumed = _ids(next(iterator) for _ in range(_CONSUMED))
    with ocp.CheckpointManager(str(root / "ckpt"), item_names=("data",)) as manager:
      manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
  finally:
    iterator.close()
  script = root / "child.py"
  script.write_text(_CHILD)
  return str(root / "ckpt"), str(script), consumed, uninterrupted


def _child(directory, script, num_workers):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, script, directory, str(num_workers)],
      capture_output=True, text=True, timeout=300, env=env, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


# Another worker count than the saved one in make test; the others in make test-heavy.
@pytest.mark.parametrize("num_workers", [
    pytest.param(2, marks=pytest.mark.heavy), 3, pytest.param(1, marks=pytest.mark.heavy),
])
def test_a_fresh_process_resumes_with_any_worker_count_exactly(saved, num_workers):
  directory, script, consumed, uninterrupted = saved
  rest = _child(directory, script, num_workers)
  # With 2 workers before the save: the same stream as without workers.
  assert consumed == uninterrupted[:_CONSUMED]
  # Exact: the resumed stream is the uninterrupted one from the first unread batch.
  assert rest == uninterrupted[_CONSUMED:]
  # And so, over the whole run, every record appears once per epoch.
  counts = collections.Counter(i for batch in consumed + rest for i in batch)
  assert set(counts.values()) == {2} and len(counts) == 46


def test_a_filter_before_mp_prefetch_is_refused_with_the_reason():
  iterator = ckpt_iter.DataIterator(build(2, filtered=True))
  try:
    next(iterator)
    state = iterator.get_state()
  finally:
    iterator.close()
  restored = ckpt_iter.DataIterator(build(3, filtered=True))
  try:
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      restored.set_state(state)
  finally:
    restored.close()
  message = str(info.value)
  assert "num_workers=2" in message and "num_workers=3" in message
  assert "FilterMapDataset" in message and "depends on the worker count" in message
  assert "grain.MultiprocessingOptions(num_workers=2)" in message
