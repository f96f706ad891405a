"""A Hugging Face stream restored in fresh processes through a real Orbax CheckpointManager.

This process reads a streaming JSONL dataset for a while and saves; a new
interpreter restores that step, reads on and saves again; a third restores
and reads to the end. Every record is trained once, in the uninterrupted
order, bit for bit, and no restore reads the stream before its position.
"""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
import conftest
from ckpt_iter import testing

datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_iter.__file__)))
NUM_RECORDS = 50
BATCH_SIZE = 3

_RUN = '''
import json, pickle, sys
import numpy as np
import orbax.checkpoint as ocp
import datasets
import ckpt_iter

files, directory, restore_step, read, save_step, report = sys.argv[1:]
source = datasets.load_dataset("json", data_files=json.loads(files), split="train", streaming=True)
loaded = []
original = source.load_state_dict
source.load_state_dict = lambda state: (loaded.append(1), original(state))[1]
iterator = ckpt_iter.StreamingIterator(source, batch_size=%d)
manager = ocp.CheckpointManager(directory)
manager.restore(int(restore_step), args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
examples_read_at_restore = iterator.position()["records_read"]
count = int(read)
elements = [next(iterator) for _ in range(count)] if count >= 0 else list(iterator)
if int(save_step) >= 0:
  manager.save(int(save_step), args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  manager.wait_until_finished()
manager.close()
with open(report, "wb") as f:  # the test's own channel, not a checkpoint
  pickle.dump({"elements": [{k: np.asarray(v) for k, v in e.items()} for e in elements],
               "loads": len(loaded), "records_at_restore": examples_read_at_restore}, f)
''' % BATCH_SIZE


def _stream(files):
  return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def _run_fresh(tmp_path, files, directory, restore_step, read, save_step):
  script = tmp_path / "run.py"
  script.write_text(_RUN)
  report = tmp_path / f"report_{restore_step}.pkl"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1",
         "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
  result = subprocess.run(
      [sys.executable, str(script), json.dumps(files), str(directory), str(restore_step), str(read),
       str(save_step), str(report)],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  with open(report, "rb") as f:
    return pickle.load(f)


def test_a_stream_resumes_exactly_across_chained_fresh_processes(tmp_path, ckpt_dir):
  files = []
  for part, (start, stop) in enumerate([(0, 20), (20, 35), (35, NUM_RECORDS)]):
    path = tmp_path / f"part-{part}.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": f"record {i}", "tokens": [i, -i]}) + "\n"
                            for i in range(start, stop)))
    files.append(str(path))
  uninterrupted = list(ckpt_iter.StreamingIterator(_stream(files), batch_size=BATCH_SIZE))

  iterator = ckpt_iter.StreamingIterator(_stream(files), batch_size=BATCH_SIZE)
  trained = [next(iterator) for _ in range(4)]
  manager = ocp.CheckpointManager(ckpt_dir)
  manager.save(4, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  manager.wait_until_finished()
  manager.close()

  second = _run_fresh(tmp_path, files, ckpt_dir, restore_step=4, read=5, save_step=9)
  third = _run_fresh(tmp_path, files, ckpt_dir, restore_step=9, read=-1, save_step=-1)
  assert (second["loads"], second["records_at_restore"]) == (1, 12)
  assert (third["loads"], third["records_at_restore"]) == (1, 27)
  trained += second["elements"] + third["elements"]

  ids = np.concatenate([e["id"] for e in trained]).tolist()
  assert len(ids) == len(set(ids)) and ids == list(range(NUM_RECORDS // BATCH_SIZE * BATCH_SIZE))
  testing.assert_trees_equal(trained, [{k: np.asarray(v) for k, v in e.items()} for e in uninterrupted])
