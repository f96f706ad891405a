"""The graph fingerprint (ckpt_iter/_graph.py) of hand-built Grain pipelines."""

import functools
import importlib.metadata
import json
import os
import pickle

import absl.flags
import cloudpickle
import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _graph
from ckpt_iter import _workers
from ckpt_iter import _global_batch
from ckpt_iter import state as state_lib
from ckpt_iter import testing

# jax >= 0.10 makes mp_prefetch read absl flags (google/grain#1355).
absl.flags.FLAGS.mark_as_parsed()

_RECORDS = [{"id": i} for i in range(40)]


def double(record):
  return {"id": record["id"] * 2}


def triple(record):
  return {"id": record["id"] * 3}


def keep_even(record):
  return record["id"] % 2 == 0


def keep_odd(record):
  return record["id"] % 2 == 1


def jitter(record, rng):
  return {"id": record["id"], "noise": int(rng.integers(0, 1000))}


def _hand_built(records=_RECORDS, *, seed=1, fn=double, start=2, stop=36, epochs=2,
                batch_size=3, drop_remainder=False, keep=keep_even, noise_seed=5):
  """source > shuffle > map > random_map > slice > repeat > filter > batch."""
  ds = grain.MapDataset.source(records).shuffle(seed=seed).map(fn)
  ds = ds.random_map(jitter, seed=noise_seed)[start:stop].repeat(epochs).filter(keep)
  return ds.to_iter_dataset().batch(batch_size, drop_remainder=drop_remainder)


def _map_built(epochs=2):
  """A MapDataset all the way (its length is part of the old fingerprint)."""
  return grain.MapDataset.source(_RECORDS).shuffle(seed=1).map(double)[2:36].repeat(epochs).batch(3)


def _state_of(dataset, next_count=3):
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(next_count):
    next(iterator)
  return json.loads(json.dumps(iterator.get_state()))


# (change, field named in the error, saved value, value here)
_CHANGES = [
    ({"seed": 2}, "node[7].ShuffleMapDataset.seed", 1, 2),
    ({"batch_size": 4}, "node[0].BatchIterDataset.batch_size", 3, 4),
    ({"drop_remainder": True}, "node[0].BatchIterDataset.drop_remainder", False, True),
    ({"start": 3}, "node[4].SliceMapDataset.start", 2, 3),
    ({"stop": 30}, "node[4].SliceMapDataset.stop", 36, 30),
    ({"epochs": 3}, "node[3].RepeatMapDataset.num_epochs", 2, 3),
    ({"fn": triple}, "node[6].MapMapDataset.fn", f"{__name__}.double", f"{__name__}.triple"),
    ({"keep": keep_odd}, "node[2].FilterMapDataset.fn", f"{__name__}.keep_even", f"{__name__}.keep_odd"),
    ({"noise_seed": 6}, "node[5].RandomMapMapDataset.seed", 5, 6),
    ({"records": [{"id": i + 100} for i in range(40)]}, "node[8].SourceMapDataset.digest", None, None),
    ({"records": _RECORDS[:39]}, "node[8].SourceMapDataset.length", 40, 39),
]


@pytest.mark.parametrize("change, field, saved, here", _CHANGES, ids=[c[1] for c in _CHANGES])
def test_a_changed_parameter_is_refused_naming_node_field_values_and_fix(change, field, saved, here):
  state = _state_of(_hand_built())
  iterator = ckpt_iter.DataIterator(_hand_built(**change))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.set_state(state)
  assert field in info.value.differences
  before, after = info.value.differences[field]
  if saved is not None:
    assert (before, after) == (saved, here)
  message = str(info.value)
  assert f"{field}={before!r} there, {field}={after!r} here" in message
  if field.endswith(".digest"):  # a digest is restored with the data, never passed back
    assert "Restore the records or code the run was saved with" in message and "Rebuild" not in message
  else:
    assert "Rebuild the pipeline with" in message and field in message.split("Rebuild")[1]
  assert iterator.get_state()["position"] == ckpt_iter.DataIterator(_hand_built(**change)).get_state()["position"]


def test_the_same_graph_resumes_exactly_at_every_point():
  testing.assert_exact_resume(
      lambda: ckpt_iter.DataIterator(_hand_built()), checkpoint_at=range(0, 9))


def test_a_changed_function_body_with_the_same_name_is_refused():
  def make(factor):
    def scale(record):
      return {"id": record["id"] * factor}
    return scale

  def rebuilt(k):  # the same qualified name (an edited file), other code
    def scale(record):
      return {"id": record["id"] + k}
    scale.__qualname__ = make(k).__qualname__
    return scale

  first = grain.MapDataset.source(_RECORDS).map(make(2))
  state = _state_of(first)
  for other, field in ((make(3), "fn_code"), (rebuilt(2), "fn_code")):
    iterator = ckpt_iter.DataIterator(grain.MapDataset.source(_RECORDS).map(other))
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      iterator.set_state(state)
    assert set(info.value.differences) == {f"node[0].MapMapDataset.{field}"}


_TOKENIZE = """
import numpy as np


def tokenize(record):
  return {"id": record["id"], "tokens": np.array([record["id"], {factor}], np.int32)}
"""


def _module_function(tmp_path, module_name, factor=2, function_name="tokenize"):
  """`tokenize` (or `function_name`) of a module `module_name` written into tmp_path."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  path = tmp_path / f"{module_name}.py"
  path.write_text(_TOKENIZE.replace("{factor}", str(factor)).replace("def tokenize", f"def {function_name}"))
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return getattr(module, function_name)


_MOVED_PIPELINES = {
    "map": lambda fn: grain.MapDataset.source(_RECORDS).shuffle(seed=1).map(fn).batch(2),
    "filter": lambda fn: grain.MapDataset.source(_RECORDS).filter(fn)[1:],  # a dict is truthy: keeps all
    "make_dataset": lambda fn: ckpt_iter.make_dataset(
        _RECORDS, batch_size=2, seed=1, transform=fn, shard_index=0, shard_count=1),
}


@pytest.mark.parametrize("kind", sorted(_MOVED_PIPELINES))
def test_a_function_moved_to_another_module_with_the_same_code_restores(tmp_path, kind):
  # `python train.py` (__main__.tokenize), then `python -m`, a notebook or an
  # import (train.tokenize): the same code is the same pipeline.
  build = _MOVED_PIPELINES[kind]
  saved = _module_function(tmp_path, f"ci_script_{kind}")
  moved = _module_function(tmp_path, f"ci_package_{kind}")
  state = _state_of(build(saved))
  differing = {name for name in state["fingerprint"] if state["fingerprint"][name] != ckpt_iter.DataIterator(
      build(moved)).fingerprint.get(name)}
  assert differing and all(name.endswith((".fn", "transform")) for name in differing)  # only the names
  expected = ckpt_iter.DataIterator(build(saved))
  expected.set_state(state)
  resumed = ckpt_iter.DataIterator(build(moved))
  resumed.set_state(state)
  testing.assert_trees_equal(list(resumed), list(expected))


@pytest.mark.parametrize("kind", sorted(_MOVED_PIPELINES))
def test_a_moved_function_with_another_body_or_name_is_refused_naming_the_field(tmp_path, kind):
  build = _MOVED_PIPELINES[kind]
  state = _state_of(build(_module_function(tmp_path, f"ci_script_{kind}")))
  code_field, name_field = {
      "map": ("node[1].MapMapDataset.fn_code", "node[1].MapMapDataset.fn"),
      "filter": ("node[1].FilterMapDataset.fn_code", "node[1].FilterMapDataset.fn"),
      "make_dataset": ("node[0].GlobalBatchDataset.transform_code", "transform"),
  }[kind]
  edited = ckpt_iter.DataIterator(build(_module_function(tmp_path, f"ci_edited_{kind}", factor=3)))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    edited.set_state(state)
  assert {code_field, name_field} <= set(info.value.differences)
  assert f"{code_field}=" in str(info.value)
  # Renamed: the digest does not cover the names code calls (r.upper() and
  # r.lower() digest alike), so a function's own name still counts.
  renamed = ckpt_iter.DataIterator(build(_module_function(tmp_path, f"ci_renamed_{kind}", function_name="encode")))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    renamed.set_state(state)
  assert set(info.value.differences) == {name_field}


@pytest.mark.parametrize(
    "fn, has_code",
    [(double, True), (lambda r: r, True), (functools.partial(jitter, rng=None), True),
     (len, False), (str.upper, False), (np.asarray, False)],
    ids=["function", "lambda", "partial", "builtin", "method-descriptor", "numpy"],
)
def test_code_digest_is_stable_and_none_without_python_code(fn, has_code):
  digest = _graph.code_digest(fn)
  assert (digest is not None) == has_code
  assert _graph.code_digest(fn) == digest


def test_code_digest_of_callable_objects_and_bound_methods():
  class Scale:
    def __init__(self, factor):
      self.factor = factor

    def __call__(self, record):
      return record

    def map(self, record):
      return record

  assert _graph.code_digest(Scale(2)) == _graph.code_digest(Scale(2)) is not None
  assert _graph.code_digest(Scale(2).map) == _graph.code_digest(Scale(2).map) is not None
  # The object's scalar parameters count (an address never does).
  assert _graph.code_digest(Scale(2)) != _graph.code_digest(Scale(3))
  assert _graph.code_digest(Scale(2).map) != _graph.code_digest(Scale(3).map)
  assert _graph.code_digest(Scale(object())) == _graph.code_digest(Scale(object()))
  assert _graph.qualified_name(Scale(2).map).endswith("Scale.map")
  assert _graph.qualified_name(functools.partial(double)) == f"functools.partial({__name__}.double)"


def test_unknown_node_kinds_are_recorded_by_class_name_only():
  left = grain.MapDataset.range(5)
  mixed = grain.MapDataset.concatenate([left, grain.MapDataset.range(3)])
  fields = _global_batch.describe_pipeline(mixed)
  assert fields["graph"] == "ConcatenateMapDataset<RangeMapDataset<RangeMapDataset"
  assert not [k for k in fields if k.startswith("node[0].")]
  assert fields["node[2].RangeMapDataset.stop"] == 3


def test_make_dataset_spec_fields_are_not_repeated_under_its_node(make_pipeline):
  fields = _global_batch.describe_pipeline(make_pipeline().map(double))
  assert fields["pipeline"] == "MapMapDataset"  # the meaning elastic.resize_refusal parses
  assert fields["graph"] == "MapMapDataset<GlobalBatchDataset"
  assert not [k for k in fields if k.startswith("node[1].")]
  assert fields["seed"] == 7


def test_a_state_without_graph_fields_restores_and_keeps_its_old_checks(make_pipeline):
  """States written before the graph fingerprint: the new fields are not compared."""
  def legacy(state):
    fingerprint = {k: v for k, v in state["fingerprint"].items() if not state_lib.is_graph_field(k)}
    return {**state, "fingerprint": fingerprint}

  hand_built = legacy(_state_of(_map_built()))
  assert set(hand_built["fingerprint"]) == {"pipeline", "dataset_length"}
  iterator = ckpt_iter.DataIterator(_map_built())
  iterator.set_state(hand_built)
  testing.assert_trees_equal([next(iterator)], [next(_resumed(_map_built(), 3))])
  # What the old fingerprint recorded is still checked.
  iterator = ckpt_iter.DataIterator(_map_built(epochs=3))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    iterator.set_state(hand_built)
  assert set(info.value.differences) == {"dataset_length"}
  # make_dataset: the same, with its spec fields.
  spec_state = legacy(_state_of(make_pipeline().map(double)))
  ckpt_iter.DataIterator(make_pipeline().map(double)).set_state(spec_state)
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    ckpt_iter.DataIterator(make_pipeline(seed=8).map(double)).set_state(spec_state)
  assert set(info.value.differences) == {"seed"}


def _resumed(dataset, next_count):
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(next_count):
    next(iterator)
  return iterator


def test_a_new_state_compares_graph_fields_present_only_here():
  saved = {"graph": "A", "pipeline": "A"}
  current = {"graph": "A<B", "pipeline": "A", "node[1].B.x": 1}
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    state_lib.check_fingerprint(saved, current)
  assert set(info.value.differences) == {"graph", "node[1].B.x"}
  state_lib.check_fingerprint({"pipeline": "A"}, current)  # predates the graph fields


# ---------------------------------------------------------------------------
# mp_prefetch: the worker count, and the pipeline behind it.


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


# ---------------------------------------------------------------------------
# A plain Grain iterator through IteratorSave / IteratorRestore.


def test_a_plain_grain_iterator_saves_and_restores_through_a_checkpoint_manager(ckpt_manager):
  def plain():
    return grain.MapDataset.range(10).to_iter_dataset().__iter__()

  iterator = plain()
  first = [next(iterator) for _ in range(4)]
  ckpt_manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  ckpt_manager.wait_until_finished()
  rest = list(iterator)

  restored = plain()
  ckpt_manager.restore(1, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(restored)))

  assert first == [0, 1, 2, 3]
  assert list(restored) == rest == list(range(4, 10))


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
