"""Randomly generated hand-built MapDataset graphs resume exactly or are refused.

A graph is a source followed by up to six steps (shuffle, map, filter, batch,
slice, repeat). For each generated graph:

- a restore into the same graph at a random point continues the stream
  exactly (`ckpt_iter.testing.assert_exact_resume`);
- a restore into the graph with one parameter changed is refused with
  ConfigDriftError naming that node's field, or, when the change leaves the
  fingerprint and the stream the same (a slice end past the data), continues
  the saved stream exactly: never a silently different stream;
- read by `mp_prefetch` with 1-4 worker processes (over the hand-built graph,
  or over `make_dataset` followed by the graph's steps), a restore at a random
  point with the same worker count is exact; with another count it is exact
  for a `make_dataset` pipeline without a filter (`_workers.resume_workers`) and
  refused naming the worker-count field otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any

import absl.flags
import grain
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _graph
from ckpt_iter import _global_batch
from ckpt_iter import testing

# jax >= 0.10 makes mp_prefetch read absl flags (google/grain#1355); the
# spawned workers import this module too, so they get it as well.
absl.flags.FLAGS.mark_as_parsed()

_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
# Per property in `make test`; with HYPOTHESIS_PROFILE=long, enough to reach
# the rarer shapes (nested ragged batches first showed up after ~500).
_EXAMPLES = 1000 if _LONG else 60
# Each example starts two sets of worker processes (~2 s per worker here).
_MP_EXAMPLES = 60 if _LONG else 5


def double(element):
  return {"id": element["id"] * 2, "value": element["value"]}


def add_one(element):
  return {"id": element["id"] + 1, "value": element["value"]}


def negate(element):
  return {"id": -element["id"], "value": element["value"]}


def even_sum(element):
  return int(np.sum(element["id"])) % 2 == 0


def not_div3(element):
  return int(np.sum(element["id"])) % 3 != 0


_MAP_FNS = (double, add_one, negate)
_FILTER_FNS = (even_sum, not_div3)


@dataclasses.dataclass(frozen=True)
class Step:
  """One node above the source: its kind and its parameters."""

  kind: str  # shuffle | map | filter | batch | slice | repeat
  params: tuple[tuple[str, Any], ...]

  def get(self, name: str) -> Any:
    return dict(self.params)[name]


@dataclasses.dataclass(frozen=True)
class Graph:
  records: tuple[tuple[int, int], ...]  # (id, value)
  steps: tuple[Step, ...]


# Grain's class of each step kind (the `Kind` in `node[i].Kind.param`).
_KINDS = {"shuffle": "ShuffleMapDataset", "map": "MapMapDataset", "filter": "FilterMapDataset",
          "batch": "BatchMapDataset", "slice": "SliceMapDataset", "repeat": "RepeatMapDataset"}


def build(graph: Graph, base: grain.MapDataset | None = None) -> grain.MapDataset:
  """The graph's steps over its records, or over `base` when given."""
  ds = base if base is not None else grain.MapDataset.source(_records(graph))
  for step in graph.steps:
    p = dict(step.params)
    if step.kind == "shuffle":
      ds = ds.shuffle(seed=p["seed"])
    elif step.kind == "map":
      ds = ds.map(p["fn"])
    elif step.kind == "filter":
      ds = ds.filter(p["fn"])
    elif step.kind == "batch":
      ds = ds.batch(p["batch_size"], drop_remainder=p["drop_remainder"])
    elif step.kind == "slice":
      ds = ds[p["start"]:p["stop"]]
    elif step.kind == "repeat":
      ds = ds.repeat(p["num_epochs"])
  return ds


def _step(kind: str, **params: Any) -> Step:
  return Step(kind, tuple(sorted(params.items())))


_STEPS = {
    "shuffle": lambda draw: _step("shuffle", seed=draw(st.integers(0, 2**32 - 1))),
    "map": lambda draw: _step("map", fn=draw(st.sampled_from(_MAP_FNS))),
    "filter": lambda draw: _step("filter", fn=draw(st.sampled_from(_FILTER_FNS))),
    "batch": lambda draw: _step(
        "batch", batch_size=draw(st.integers(1, 4)), drop_remainder=draw(st.booleans())),
    "slice": lambda draw: _step(
        "slice", start=draw(st.integers(0, 6)), stop=draw(st.integers(4, 40))),
    "repeat": lambda draw: _step("repeat", num_epochs=draw(st.integers(1, 3))),
}


def _records(graph: Graph) -> list[dict[str, int]]:
  return [{"id": i, "value": v} for i, v in graph.records]


@st.composite
def graphs(draw, *, ragged: bool = False) -> Graph:
  """A random graph; `ragged`: its input may end in a short batch, so no batch step follows."""
  count = draw(st.integers(1, 24))
  records = tuple((i, draw(st.integers(0, 99))) for i in range(count))
  steps, no_batch, repeats = [], ragged, 0
  for _ in range(draw(st.integers(0, 6))):
    kinds = [k for k in _STEPS if not (k == "batch" and no_batch) and not (k == "repeat" and repeats >= 2)]
    kind = draw(st.sampled_from(kinds))
    step = _STEPS[kind](draw)
    # Grain cannot batch after a MapDataset filter (it yields None holes), nor
    # stack a short remainder batch with full ones: such a graph fails without
    # any checkpoint, so it is not generated.
    no_batch |= kind == "filter" or (kind == "batch" and not step.get("drop_remainder"))
    repeats += kind == "repeat"
    steps.append(step)
  return Graph(records, tuple(steps))


def _changed(draw, graph: Graph) -> tuple[Graph, str | None]:
  """The graph with one parameter changed, and the field that must name it."""
  choices = [("source", None)] + [
      (i, name) for i, step in enumerate(graph.steps) for name, _ in step.params]
  where, name = draw(st.sampled_from(choices))
  if where == "source":
    index = draw(st.integers(0, len(graph.records) - 1))
    records = list(graph.records)
    records[index] = (records[index][0], records[index][1] + 100)
    last = len(graph.steps)  # the source is the innermost node
    return dataclasses.replace(graph, records=tuple(records)), f"node[{last}].SourceMapDataset.digest"
  step = graph.steps[where]
  value = step.get(name)
  if name == "fn":
    pool = _MAP_FNS if step.kind == "map" else _FILTER_FNS
    new = draw(st.sampled_from([f for f in pool if f is not value]))
  elif isinstance(value, bool):
    new = not value
  elif name == "seed":
    new = (value + 1) % 2**32
  elif name == "stop":
    new = value + draw(st.sampled_from([-3, -1, 1, 5]))
  else:
    new = value + 1
  params = tuple((n, new if n == name else v) for n, v in step.params)
  steps = list(graph.steps)
  steps[where] = Step(step.kind, params)
  node = len(graph.steps) - 1 - where  # node[0] is the outermost step
  field = "fn" if name == "fn" else name
  return dataclasses.replace(graph, steps=tuple(steps)), f"node[{node}].{_KINDS[step.kind]}.{field}"


def _stream(graph: Graph) -> list[Any]:
  return list(ckpt_iter.DataIterator(build(graph)))


def _state_at(graph: Graph, index: int) -> dict[str, Any]:
  iterator = ckpt_iter.DataIterator(build(graph))
  for _ in itertools.islice(iterator, index):
    pass
  return json.loads(json.dumps(iterator.get_state()))


@hypothesis.settings(max_examples=_EXAMPLES, deadline=None)
@hypothesis.given(graph=graphs(), data=st.data())
def test_a_restore_into_the_same_graph_is_exact(graph, data):
  length = len(_stream(graph))
  point = data.draw(st.integers(0, length), label="checkpoint_at")
  testing.assert_exact_resume(lambda: ckpt_iter.DataIterator(build(graph)), checkpoint_at=[point])


@hypothesis.settings(max_examples=_EXAMPLES, deadline=None)
@hypothesis.given(graph=graphs(), data=st.data())
def test_a_restore_into_a_changed_graph_is_refused_naming_the_field(graph, data):
  saved_stream = _stream(graph)
  point = data.draw(st.integers(0, len(saved_stream)), label="checkpoint_at")
  state = _state_at(graph, point)
  changed, field = _changed(data.draw, graph)
  fingerprint_changed = (
      _global_batch.describe_pipeline(build(changed)).get(field)
      != _global_batch.describe_pipeline(build(graph)).get(field)
  )
  iterator = ckpt_iter.DataIterator(build(changed))
  try:
    iterator.set_state(state)
  except ckpt_iter.ConfigDriftError as e:
    assert field in e.differences, (field, sorted(e.differences))
    saved, here = e.differences[field]
    assert f"{field}={saved!r} there, {field}={here!r} here" in str(e)
    return
  except ckpt_iter.InvalidStateError:
    raise AssertionError(f"{field} changed: expected ConfigDriftError naming it") from None
  # Accepted: when the field's value is the same after Grain normalized it (a
  # slice end past the data), the stream must be the saved one; otherwise only
  # a same-stream change (docs/guarantees.md, "Same stream"; one property per
  # kind in test_stream_changes.py): the changed pipeline's stream, from the
  # saved element on, whose prefix is what the saved run consumed.
  if not fingerprint_changed:
    testing.assert_trees_equal(list(iterator), saved_stream[point:])
    return
  # Positions are indices (a filter's dropped elements included), so streams
  # are compared through slices of the changed dataset, not by count.
  saved_index = state["position"]["next_index"]
  new_index = iterator.get_state()["position"]["next_index"]
  testing.assert_trees_equal(list(iterator), _stream_of(build(changed)[new_index:]))
  if field.endswith(".batch_size"):
    old_size = _global_batch.describe_pipeline(build(graph))[field]
    new_size = _global_batch.describe_pipeline(build(changed))[field]
    # Elements of the batch's input consumed before and after: the same. A
    # stream read to its end may have had a short last batch (drop_remainder=False).
    where = len(graph.steps) - 1 - int(field[len("node["):field.index("]")])
    inputs = len(build(dataclasses.replace(graph, steps=graph.steps[:where])))
    assert min(new_index * new_size, inputs) == min(saved_index * old_size, inputs), (
        field, saved_index, new_index, inputs)
  else:
    assert field.endswith((".num_epochs", ".stop")), f"{field} changed and the restore was accepted"
    assert new_index == saved_index
    testing.assert_trees_equal(_stream_of(build(changed)[:new_index]), saved_stream[:point])


def _stream_of(dataset: Any) -> list[Any]:
  return list(ckpt_iter.DataIterator(dataset))


# ---------------------------------------------------------------------------
# mp_prefetch: the same graphs read by worker processes.


@dataclasses.dataclass(frozen=True)
class MpCase:
  graph: Graph
  made: tuple[tuple[str, Any], ...] | None  # make_dataset arguments, or None: hand-built
  workers: int  # at the save
  restore_workers: int

  @property
  def filtered(self) -> bool:
    return any(step.kind == "filter" for step in self.graph.steps)

  def map_dataset(self) -> grain.MapDataset:
    base = None
    if self.made is not None:
      base = ckpt_iter.make_dataset(_records(self.graph), **dict(self.made))
    return build(self.graph, base)

  def pipeline(self, num_workers: int) -> grain.IterDataset:
    options = grain.MultiprocessingOptions(num_workers=num_workers)
    return self.map_dataset().to_iter_dataset().mp_prefetch(options)


@st.composite
def mp_cases(draw) -> MpCase:
  made = None
  if draw(st.booleans(), label="make_dataset"):
    made = (("batch_size", draw(st.integers(1, 3))), ("drop_remainder", draw(st.booleans())),
            ("num_epochs", draw(st.integers(1, 2))), ("seed", draw(st.integers(0, 2**32 - 1))))
  ragged = made is not None and not dict(made)["drop_remainder"]
  graph = draw(graphs(ragged=ragged))
  if made is not None and len(graph.records) < dict(made)["batch_size"]:
    made = (("batch_size", 1),) + made[1:]  # make_dataset refuses an empty epoch
  return MpCase(graph, made, draw(st.integers(1, 4)), draw(st.integers(1, 4)))


def _workers_field(fingerprint: dict[str, Any]) -> str:
  (field,) = [name for name in fingerprint if _graph.is_workers_field(name)]
  return field


@pytest.mark.heavy  # worker processes for every example: make test keeps the fixed cases
@hypothesis.settings(max_examples=_MP_EXAMPLES, deadline=None)
@hypothesis.given(case=mp_cases(), data=st.data())
def test_an_mp_prefetch_restore_is_exact_or_refused_naming_the_worker_count(case, data):
  # Workers together yield every element the MapDataset yields, so the length
  # is known without starting them; without a filter also the order.
  in_order = _stream_of(case.map_dataset())
  point = data.draw(st.integers(0, len(in_order)), label="checkpoint_at")
  saving = ckpt_iter.DataIterator(case.pipeline(case.workers))
  try:
    consumed = list(itertools.islice(saving, point))
    state = json.loads(json.dumps(saving.get_state()))  # as a checkpoint holds it
    uninterrupted = consumed + list(saving)
  finally:
    saving.close()
  assert len(uninterrupted) == len(in_order)
  if not case.filtered:
    testing.assert_trees_equal(uninterrupted, in_order)

  restored = ckpt_iter.DataIterator(case.pipeline(case.restore_workers))
  try:
    before = restored.get_state()
    translatable = case.made is not None and not case.filtered
    kind = "make_dataset" if case.made is not None else "hand-built"
    if case.restore_workers == case.workers or translatable:
      same = case.restore_workers == case.workers
      hypothesis.event(f"{kind}: {'same worker count' if same else 'another worker count, translated'}")
      restored.set_state(state)
      testing.assert_trees_equal(list(restored), uninterrupted[point:])
      return
    hypothesis.event(f"{kind}{' with a filter' if case.filtered else ''}: another worker count, refused")
    with pytest.raises(ckpt_iter.ConfigDriftError) as info:
      restored.set_state(state)
    field = _workers_field(restored.fingerprint)
    assert info.value.differences == {field: (case.workers, case.restore_workers)}
    assert f"grain.MultiprocessingOptions(num_workers={case.workers})" in str(info.value)
    assert restored.get_state() == before  # a refused restore changes nothing
  finally:
    restored.close()
