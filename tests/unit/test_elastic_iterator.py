"""Grain's ElasticIterator under DataIterator: process-count changes with elastic=True."""

from etils import epath
import grain
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import elastic

_GLOBAL_BATCH = 4


def _iterator(index, count, global_batch=_GLOBAL_BATCH):
  ds = grain.MapDataset.range(64).shuffle(seed=3).map(lambda x: x * 10)
  return ckpt_iter.DataIterator(grain.experimental.ElasticIterator(
      ds, global_batch_size=global_batch, shard_options=grain.sharding.ShardOptions(index, count)))


def _save(directory, count, steps):
  for index in range(count):
    iterator = _iterator(index, count)
    for _ in range(steps):
      next(iterator)
    checkpoint_lib.IteratorCheckpointHandler(index, count).save(
        epath.Path(directory), checkpoint_lib.IteratorSave(iterator))


def _global_stream(steps):
  reference = _iterator(0, 1)
  return [np.asarray(next(reference)).tolist() for _ in range(steps)]


@pytest.mark.parametrize("saved_count, new_count", [(2, 4), (4, 1), (2, 2)])
def test_process_count_change_resumes_the_global_stream(tmp_path, saved_count, new_count):
  _save(tmp_path, saved_count, steps=3)
  rows = []
  for index in range(new_count):
    iterator = _iterator(index, new_count)
    checkpoint_lib.IteratorCheckpointHandler(index, new_count).restore(
        epath.Path(tmp_path), checkpoint_lib.IteratorRestore(iterator, elastic=True))
    rows.append([np.asarray(next(iterator)).tolist() for _ in range(2)])
  # Global batch t = the processes' rows of step t, in shard order (Grain's ds[i::n]).
  for step in range(2):
    merged = sorted(x for process in rows for x in process[step])
    assert merged == sorted(_global_stream(5)[3 + step])


def test_the_resize_rule_accepts_a_bare_elastic_iterator_only():
  fingerprint = _iterator(0, 2).fingerprint
  assert fingerprint["position_scope"] == "global"
  assert elastic.resize_refusal("data", fingerprint) is None
  assert elastic.resize_refusal("tunix", fingerprint) is not None
  wrapped = ckpt_iter.DataIterator(grain.MapDataset.range(8).batch(2))
  assert "make_dataset" in elastic.resize_refusal("data", wrapped.fingerprint)


def test_without_elastic_another_count_is_refused_and_another_global_batch_always(tmp_path):
  _save(tmp_path, 2, steps=1)
  with pytest.raises(ckpt_iter.CkptIterError):
    checkpoint_lib.IteratorCheckpointHandler(0, 4).restore(
        epath.Path(tmp_path), checkpoint_lib.IteratorRestore(_iterator(0, 4)))
  with pytest.raises(ckpt_iter.ConfigDriftError, match="global_batch_size"):
    checkpoint_lib.IteratorCheckpointHandler(0, 4).restore(
        epath.Path(tmp_path), checkpoint_lib.IteratorRestore(_iterator(0, 4, global_batch=8), elastic=True))
