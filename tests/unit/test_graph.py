"""The graph fingerprint (ckpt_iter/_graph.py) of hand-built Grain pipelines."""

import functools
import json

import absl.flags
import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _graph
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
