"""Grain's mp_prefetch workers (`_workers`): a state saved with k workers resumes with k', and the workers' lives.

`resume_workers` translates a per-worker position to the global one or refuses
it naming the reason; `exit_workers_with_parent` wraps each worker's init
function. A fresh process resuming with another count:
tests/integration/test_mp_prefetch_process.py.
"""

import importlib.metadata
import os
import pickle

import absl.flags
import cloudpickle
import grain
import numpy as np
import pytest

import ckpt_iter
import support
from ckpt_iter import _graph
from ckpt_iter import _workers
from ckpt_iter import _global_batch
from ckpt_iter import testing

# jax >= 0.10 makes mp_prefetch read absl flags (google/grain#1355): a test here that starts workers ran only
# after another module had parsed them.
absl.flags.FLAGS.mark_as_parsed()

_RECORDS = [{"id": i} for i in range(40)]




def _mp(workers, seed=3):
  return ckpt_iter.make_dataset(_RECORDS, batch_size=2, seed=seed).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=workers))


def _unstarted_state(dataset):
  iterator = ckpt_iter.DataIterator(dataset)
  try:
    return iterator.get_state()
  finally:
    iterator.close()


def test_mp_prefetch_records_the_worker_count_and_sees_through_to_the_pipeline():
  fields = _global_batch.describe_pipeline(_mp(2))
  assert fields["pipeline"] == "WithOptionsIterDataset<InterleaveIterDataset"  # unchanged meaning
  assert fields["graph"] == "WithOptionsIterDataset<mp_prefetch<PrefetchIterDataset<GlobalBatchDataset"
  assert fields["node[1].mp_prefetch.num_workers"] == 2
  assert fields["node[3].GlobalBatchDataset.seed"] == 3


def _mp_filtered(workers, sequential_slice=False):
  return (ckpt_iter.make_dataset(_RECORDS, batch_size=2, seed=3).filter(_first_id_odd).to_iter_dataset()
          .mp_prefetch(grain.MultiprocessingOptions(num_workers=workers), sequential_slice=sequential_slice))


def _first_id_odd(batch):
  return bool(batch["id"][0] % 2)


def _mp_sequential(workers):
  return ckpt_iter.make_dataset(_RECORDS, batch_size=2, seed=3).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=workers), sequential_slice=True)


@pytest.mark.parametrize("build, workers, reason", [
    (_mp_filtered, 1, "['FilterMapDataset'] before mp_prefetch"),
    (_mp_filtered, 3, "which elements each worker yields depends on the worker count"),
    (_mp_sequential, 3, "sequential_slice=True"),
    (_mp_sequential, 4, "the order of the stream depends on the worker count"),
])
def test_another_worker_count_is_refused_naming_both_counts_and_the_reason(build, workers, reason):
  state = _unstarted_state(build(2))
  iterator = ckpt_iter.DataIterator(build(workers), allow_drift={"node[1].mp_prefetch.num_workers"})
  try:
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      iterator.set_state(state)
  finally:
    iterator.close()
  message = str(info.value)
  assert "num_workers=2" in message and f"num_workers={workers}" in message
  assert reason in message
  assert "grain.MultiprocessingOptions(num_workers=2)" in message
  assert info.value.differences == {"node[1].mp_prefetch.num_workers": (2, workers)}


def test_a_hand_built_pipeline_without_make_dataset_is_refused_another_worker_count():
  def build(workers):
    return grain.MapDataset.source(_RECORDS).batch(2).to_iter_dataset().mp_prefetch(
        grain.MultiprocessingOptions(num_workers=workers))
  state = _unstarted_state(build(2))
  iterator = ckpt_iter.DataIterator(build(3))
  try:
    with pytest.raises(ckpt_iter.ConfigDriftError, match="not built by ckpt_iter.make_dataset"):
      iterator.set_state(state)
  finally:
    iterator.close()


def _interleave_position(counts):
  return {"next_index_in_cycle": 0, "next_index_in_datasets": len(counts),
          "iterators_in_use_indices": list(range(len(counts))),
          "iterators_in_use_states": [{"next_index": c} for c in counts],
          "exhausted": [0] * len(counts), "future_states": {}}


@pytest.mark.parametrize("counts, workers, expected", [
    ([4, 3], 3, [3, 2, 2]),   # element 7 = worker 1's third: 7 % 3 == 1
    ([4, 3], 1, [7]),
    ([0, 0], 4, [0, 0, 0, 0]),
    ([10, 10], 3, [7, 7, 6]),  # the end: all 20 batches
    ([3, 3, 2], 2, [4, 4]),
])
def test_the_worker_translation_keeps_the_global_position(counts, workers, expected):
  saved = _global_batch.describe_pipeline(_mp(len(counts)))
  current = _global_batch.describe_pipeline(_mp(workers))
  resume = _workers.resume_workers(saved, current, _interleave_position(counts), _mp(workers), origin="s")
  position = resume.position
  assert [s["next_index"] for s in position["iterators_in_use_states"]] == expected
  assert position["next_index_in_cycle"] == sum(counts) % workers
  assert position["iterators_in_use_indices"] == list(range(workers))
  assert resume.accepted == {"node[1].mp_prefetch.num_workers"}
  assert f"resumes at element {sum(counts)}" in resume.changes[0]


def test_the_same_worker_count_keeps_the_position_as_it_is():
  fields = _global_batch.describe_pipeline(_mp(2))
  position = _interleave_position([4, 3])
  resume = _workers.resume_workers(fields, fields, position, _mp(2), origin="s")
  assert resume.position == position and not resume.accepted and not resume.changes


@pytest.mark.parametrize("counts", [[4, 1], [2, 3], [1, 1, 1]])
def test_worker_positions_that_are_not_a_round_robin_prefix_are_refused(counts):
  saved = _global_batch.describe_pipeline(_mp(2))
  current = _global_batch.describe_pipeline(_mp(3))
  with pytest.raises(ckpt_iter.InvalidStateError, match="Restore it with the worker count"):
    _workers.resume_workers(saved, current, _interleave_position(counts), _mp(3), origin="s")


@pytest.mark.heavy  # make test resumes another worker count in a fresh process (test_mp_prefetch_process)
def test_another_worker_count_resumes_a_make_dataset_pipeline_at_the_next_element():
  saved = ckpt_iter.DataIterator(_mp(2))
  try:
    for _ in range(3):
      next(saved)
    state = saved.get_state()
    expected = _ids_of(saved)
  finally:
    saved.close()
  iterator = ckpt_iter.DataIterator(_mp(3))
  try:
    iterator.set_state(state)
    assert _ids_of(iterator) == expected
  finally:
    iterator.close()


def _ids_of(iterator):
  return [np.asarray(batch["id"]).tolist() for batch in iterator]


def test_a_seed_change_behind_mp_prefetch_is_refused():
  state = _unstarted_state(_mp(2))
  iterator = ckpt_iter.DataIterator(_mp(2, seed=4))
  try:
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      iterator.set_state(state)
  finally:
    iterator.close()
  assert info.value.differences == {"node[3].GlobalBatchDataset.seed": (3, 4)}


@pytest.mark.slow  # real workers; tests/integration/test_mp_prefetch_process.py covers 2 -> 2 by default
def test_mp_prefetch_resumes_exactly_with_the_same_worker_count():
  testing.assert_exact_resume(lambda: ckpt_iter.DataIterator(_mp(2)), checkpoint_at=[3])


def test_a_restore_with_workers_starts_prefetch_at_once_and_resumes_exactly():
  """google/grain#1211: the workers start at the restore, not at the first next()."""
  saved = ckpt_iter.DataIterator(_mp(2))
  try:
    for _ in range(3):
      next(saved)
    state = saved.get_state()
    expected = [next(saved) for _ in range(3)]
  finally:
    saved.close()
  iterator = ckpt_iter.DataIterator(_mp(2))
  try:
    iterator.set_state(state)
    in_use = [it for it in iterator._inner._iterators_in_use if it is not None]  # pylint: disable=protected-access
    started = bool(in_use) and all(it._prefetch_thread is not None for it in in_use)  # pylint: disable=protected-access
    testing.assert_trees_equal([next(iterator) for _ in range(3)], expected)
  finally:
    iterator.close()
  # Grain 0.2.17's mp_prefetch starts its workers' prefetch threads only at the
  # first next(), whatever start_prefetch asks (the optimisation is Grain's to
  # give); the resume above is exact either way.
  if tuple(int(p) for p in importlib.metadata.version("grain").split(".")[:3]) >= (0, 2, 18):
    assert started


def test_mp_prefetch_workers_are_watched_once_around_their_own_init_function():
  """`exit_workers_with_parent` wraps each worker's init function once (it is still called, in the
  worker: tests/integration/test_worker_exit.py); a copy unpickled, as in a worker, knows the pid
  that pickled it, its parent."""
  dataset = grain.MapDataset.range(8).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=2), worker_init_fn=lambda i, n: None)
  shards = [s for node in _graph.walk_nodes(dataset) for s in _graph.worker_shards(node)]  # pylint: disable=protected-access
  originals = [shard._worker_init_fn for shard in shards]  # pylint: disable=protected-access
  assert len(shards) == 2 and all(callable(init) for init in originals)
  assert _workers.exit_workers_with_parent(dataset) and _workers.exit_workers_with_parent(dataset)
  wrapped = [shard._worker_init_fn for shard in shards]  # pylint: disable=protected-access
  assert all(type(w) is _workers._ExitWithParent for w in wrapped)  # pylint: disable=protected-access
  assert all(w._init is init for w, init in zip(wrapped, originals))  # pylint: disable=protected-access
  assert wrapped[0]._parent_pid is None  # pylint: disable=protected-access
  assert pickle.loads(cloudpickle.dumps(wrapped[0]))._parent_pid == os.getpid()  # pylint: disable=protected-access


def test_a_restore_without_worker_processes_never_enters_the_worker_count_rule():
  # issue 58 item 12: every restore went through _workers; only a pipeline that has or saved workers needs it.
  data = ckpt_iter.DataIterator(ckpt_iter.make_dataset(list(range(40)), batch_size=4, seed=1))
  next(data)
  state = data.get_state()
  again = ckpt_iter.DataIterator(ckpt_iter.make_dataset(list(range(40)), batch_size=4, seed=1))
  entered = support.modules_entered(lambda: again.set_state(state))
  assert "iterator.py" in entered and "_workers.py" not in entered, entered
  assert next(again).tolist() == next(data).tolist()
