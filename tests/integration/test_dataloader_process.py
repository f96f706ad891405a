"""A grain.DataLoader restored in a fresh process from an Orbax checkpoint written here."""

import json
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp

import ckpt_iter

# Built the same way here and in the child process.
_BUILD = '''
import grain
def build_loader():
  source = [{"id": i, "text": "x" * (i % 5)} for i in range(50)]
  sampler = grain.samplers.IndexSampler(
      len(source), shard_options=grain.sharding.NoSharding(), shuffle=True, seed=5, num_epochs=2)
  return grain.DataLoader(data_source=source, sampler=sampler,
                          operations=[grain.transforms.Batch(3, drop_remainder=True)], worker_count=0)
'''

_CHILD = _BUILD + '''
import json, sys
import numpy as np
import orbax.checkpoint as ocp
import ckpt_iter
directory, step, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
iterator = ckpt_iter.DataLoaderIterator(build_loader())
with ocp.CheckpointManager(directory, item_names=("data",)) as manager:
  manager.restore(step, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
print(json.dumps([np.asarray(next(iterator)["id"]).tolist() for _ in range(count)]))
'''

_namespace = {}
exec(_BUILD, _namespace)  # pylint: disable=exec-used
build_loader = _namespace["build_loader"]


def _child(directory, step, count):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, "-c", _CHILD, str(directory), str(step), str(count)],
      capture_output=True, text=True, timeout=300, env=env, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_fresh_process_resumes_the_loader_exactly_across_two_saves(tmp_path):
  directory = (tmp_path / "ckpt").absolute()
  iterator = ckpt_iter.DataLoaderIterator(build_loader())
  # The uninterrupted stream, from Grain's own iterator.
  uninterrupted = [np.asarray(batch["id"]).tolist() for batch in build_loader()]
  consumed, expected = 0, {}
  with ocp.CheckpointManager(directory, item_names=("data",)) as manager:
    for step, batches in ((1, 4), (2, 15)):  # the second one past the epoch boundary
      for _ in range(batches):
        next(iterator)
      consumed += batches
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
      expected[step] = uninterrupted[consumed:consumed + 5]
  for step in (1, 2):
    assert _child(directory, step, 5) == expected[step]
