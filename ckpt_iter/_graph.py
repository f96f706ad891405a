"""The fingerprint of a Grain dataset graph: every node's kind and parameters.

`describe_graph` walks a dataset from its outermost node down its `.parents`
(depth first, parents in order) and records, per node, the parameters that
decide which element comes next: shuffle seeds, batch size and
drop_remainder, slice bounds, repeat counts, map/filter function identity, the
source's length and sampled digest, and the worker count of `mp_prefetch`
(what a state of its workers resumes with, and their exit with their parent,
is `_workers`'s).
Fields are flat, so a mismatch names the node and the parameter:

    graph                             "BatchMapDataset<ShuffleMapDataset<SourceMapDataset"
    node[1].ShuffleMapDataset.seed    7
    node[2].SourceMapDataset.length   40

Unknown node kinds are recorded by class name only (in `graph`). This is the
only module that reads private attributes of Grain nodes: when a Grain release
renames one, the parameter is recorded as unavailable instead of failing.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import types
from typing import Any, Callable, Iterator, Mapping

from ckpt_iter import sources as sources_lib
from ckpt_iter import state as state_lib

GRAPH_FIELD = state_lib.GRAPH_FIELD
MP_PREFETCH = "mp_prefetch"
WORKERS_PARAM = "num_workers"
# Generous: a pipeline has tens of nodes; this bounds a cyclic or absurd graph.
MAX_NODES = 512
_UNAVAILABLE = "<unavailable>"
# Wrappers mp_prefetch puts around each worker's copy of the pipeline.
_WORKER_WRAPPERS = frozenset({
    "ProcessPrefetchIterDataset", "_MpContextIterDataset", "_LazyWorkerSliceIterDataset",
})


def node_field(index: int, kind: str, param: str) -> str:
  """The fingerprint field of one node parameter: `node[2].ShuffleMapDataset.seed`."""
  return f"node[{index}].{kind}.{param}"


def describe_graph(dataset: Any, *, described_spec_node: Any = None) -> dict[str, Any]:
  """The graph fields of a dataset's fingerprint.

  Args:
    dataset: a `grain.MapDataset` or `grain.IterDataset`.
    described_spec_node: the make_dataset node whose spec fields are already
      top-level fingerprint fields (`_global_batch.find_spec`), so they are not
      repeated under its node. Any other make_dataset node (e.g. behind
      `mp_prefetch`) records its spec fields as node parameters.

  Returns:
    `{"graph": kinds joined by "<", outermost first, "node[i].Kind.param": value}`
    with JSON scalar values.
  """
  fields: dict[str, Any] = {}
  kinds: list[str] = []
  for index, (_, kind, params) in enumerate(walk(dataset, described_spec_node)):
    kinds.append(kind)
    for param, value in params.items():
      fields[node_field(index, kind, param)] = value
  return {GRAPH_FIELD: "<".join(kinds), **fields}


def has_workers(fingerprint: Mapping[str, Any]) -> bool:
  """Whether a pipeline's fingerprint has an `mp_prefetch` node (worker processes)."""
  return any(is_workers_field(name) for name in fingerprint)


def is_workers_field(name: str) -> bool:
  """A `node[i].mp_prefetch.num_workers` field."""
  return name.startswith("node[") and name.endswith(f".{MP_PREFETCH}.{WORKERS_PARAM}")


# ---------------------------------------------------------------------------
# The walk.


def walk_nodes(dataset: Any) -> list[Any]:
  """The node objects of `dataset`, in the order of the `node[i]` fields."""
  return [node for node, _, _ in walk(dataset, None)]


def walk(root: Any, described_spec_node: Any) -> Iterator[tuple[Any, str, dict[str, Any]]]:
  """Yields (node, kind, params) per node, depth first, at most MAX_NODES nodes."""
  stack = [root]
  count = 0
  while stack:
    node = stack.pop()
    count += 1
    if count > MAX_NODES:
      yield None, f"<more than {MAX_NODES} nodes>", {}
      return
    kind, params, children = _describe_node(node, described_spec_node)
    yield node, kind, params
    stack.extend(reversed(children))


def _describe_node(node: Any, described_spec_node: Any) -> tuple[str, dict[str, Any], list[Any]]:
  """(kind, params, children to walk) of one node."""
  kind = type(node).__name__
  shards = worker_shards(node) if kind == "InterleaveIterDataset" else []
  if shards:
    return MP_PREFETCH, _mp_prefetch_params(shards), [unwrap_worker(shards[0])]
  if kind == "ElasticIterator":
    # Grain's ElasticIterator keeps its input as `_ds`, not as a parent. Its
    # sharding is in the top-level fields (`_global_batch.describe_pipeline`).
    return kind, _elastic_params(node), [node._ds]  # pylint: disable=protected-access
  if kind in ("GlobalBatchDataset", "LaneDataset"):
    # make_dataset's node: its spec defines everything below it.
    return kind, _spec_params(node, described_spec_node), []
  describe = _DESCRIBERS.get(kind)
  params = {}
  if describe is not None:
    try:
      params = describe(node)
    except AttributeError:  # another Grain release renamed a private attribute
      params = {"params": _UNAVAILABLE}
  return kind, params, _children(node)


def _children(node: Any) -> list[Any]:
  if type(node).__name__ == "InterleaveIterDataset":
    datasets = getattr(node, "_datasets", None)
    return list(datasets) if isinstance(datasets, (list, tuple)) else []
  return list(getattr(node, "parents", ()) or ())


def worker_shards(node: Any) -> list[Any]:
  """The per-worker datasets of an mp_prefetch interleave, or [] if it is not one."""
  datasets = getattr(node, "_datasets", None)
  if not isinstance(datasets, (list, tuple)) or not datasets:
    return []
  if all(type(d).__name__ == "ProcessPrefetchIterDataset" for d in datasets):
    return list(datasets)
  return []




def unwrap_worker(shard: Any) -> Any:
  """The user's pipeline inside one worker's wrappers (they are the same for all)."""
  node = shard
  while type(node).__name__ in _WORKER_WRAPPERS and len(node.parents) == 1:
    node = node.parents[0]
  return node


def _mp_prefetch_params(shards: list[Any]) -> dict[str, Any]:
  node = shards[0]
  sequential = False
  while type(node).__name__ in _WORKER_WRAPPERS:
    if type(node).__name__ == "_LazyWorkerSliceIterDataset":
      sequential = bool(getattr(node, "_sequential_slice", False))
    if len(node.parents) != 1:
      break
    node = node.parents[0]
  return {WORKERS_PARAM: len(shards), "sequential_slice": sequential}


def elastic_fields(node: Any) -> dict[str, Any]:
  """The sharding of a Grain ElasticIterator, as top-level fingerprint fields."""
  options = node._shard_options  # pylint: disable=protected-access
  global_batch_size = int(node._global_batch_size)  # pylint: disable=protected-access
  return {
      "shard_index": int(options.shard_index),
      "shard_count": int(options.shard_count),
      "batch_size": global_batch_size // max(int(options.shard_count), 1),
      "global_batch_size": global_batch_size,
  }


def _elastic_params(node: Any) -> dict[str, Any]:
  try:
    return {"global_batch_size": int(node._global_batch_size)}  # pylint: disable=protected-access
  except AttributeError:
    return {"params": _UNAVAILABLE}


def _spec_params(node: Any, described_spec_node: Any) -> dict[str, Any]:
  params: dict[str, Any] = {}
  if node is not described_spec_node:
    params.update(node.spec.fingerprint())
    if hasattr(node, "lanes"):
      params.update(node.lanes.fingerprint())
  parents = getattr(node, "parents", ())
  if node.spec.transform is not None and parents and type(parents[0]).__name__ == "MapMapDataset":
    params["transform_code"] = code_digest(parents[0]._map_fn)  # pylint: disable=protected-access
  return params


# ---------------------------------------------------------------------------
# Per-kind parameters. Each reads the private attributes Grain 0.2.x uses.


def _shuffle(node: Any) -> dict[str, Any]:
  return {"seed": int(node._seed)}  # pylint: disable=protected-access


def _window_shuffle(node: Any) -> dict[str, Any]:
  return {"seed": _scalar(node._seed), "window_size": int(node._window_size)}  # pylint: disable=protected-access


def _batch(node: Any) -> dict[str, Any]:
  return {
      "batch_size": int(node._batch_size),  # pylint: disable=protected-access
      "drop_remainder": bool(node._drop_remainder),  # pylint: disable=protected-access
  }


def _slice(node: Any) -> dict[str, Any]:
  return {"start": int(node._start), "stop": int(node._stop), "step": int(node._step)}  # pylint: disable=protected-access


def _repeat(node: Any) -> dict[str, Any]:
  params = {"num_epochs": _scalar(node._num_epochs)}  # pylint: disable=protected-access
  if hasattr(node, "_reseed_each_epoch"):
    params["reseed_each_epoch"] = bool(node._reseed_each_epoch)  # pylint: disable=protected-access
  return params


def _map(node: Any) -> dict[str, Any]:
  return function_params(node._map_fn)  # pylint: disable=protected-access


def _random_map_map(node: Any) -> dict[str, Any]:
  return {**function_params(node._map_fn), "seed": int(node._rng_pool._seed)}  # pylint: disable=protected-access


def _random_map_iter(node: Any) -> dict[str, Any]:
  return {**function_params(node._map_fn), "seed": _scalar(node._seed)}  # pylint: disable=protected-access


def _filter(node: Any) -> dict[str, Any]:
  return function_params(node._filter_fn)  # pylint: disable=protected-access


def _range(node: Any) -> dict[str, Any]:
  return {"start": int(node.start), "stop": int(node.stop), "step": int(node.step)}


def _mix_weights(shares: Any) -> str:
  """Integer proportions as "a:b:...", in lowest terms (Grain scales them; the ratio is what mixes)."""
  ints = [int(p) for p in shares]
  divisor = math.gcd(*ints) or 1
  return ":".join(str(p // divisor) for p in ints)


def _mixed_map(node: Any) -> dict[str, Any]:
  shares = getattr(node._selection_map, "_proportions", None)  # pylint: disable=protected-access
  if shares is None:  # a custom selection map (select_from_datasets): its class names it
    return {"selection": qualified_name(type(node._selection_map))}  # pylint: disable=protected-access
  return {"weights": _mix_weights(shares)}


def _mixed_iter(node: Any) -> dict[str, Any]:
  params = {"weights": _mix_weights(node._proportions)}  # pylint: disable=protected-access
  structure = node._parents_structure  # pylint: disable=protected-access
  if isinstance(structure, Mapping):
    params["names"] = ",".join(sorted(structure))
  return params


def _source(node: Any) -> dict[str, Any]:
  return _source_params(node._source, prefix="")  # pylint: disable=protected-access


_DESCRIBERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "ShuffleMapDataset": _shuffle,
    "WindowShuffleMapDataset": _window_shuffle,
    "WindowShuffleIterDataset": _window_shuffle,
    "BatchMapDataset": _batch,
    "BatchIterDataset": _batch,
    "SliceMapDataset": _slice,
    "RepeatMapDataset": _repeat,
    "RepeatIterDataset": _repeat,
    "MapMapDataset": _map,
    "MapIterDataset": _map,
    "MapWithIndexMapDataset": _map,
    "MapWithIndexIterDataset": _map,
    "RandomMapMapDataset": _random_map_map,
    "RandomMapIterDataset": _random_map_iter,
    "FilterMapDataset": _filter,
    "FilterIterDataset": _filter,
    "RangeMapDataset": _range,
    "SourceMapDataset": _source,
    "MixedMapDataset": _mixed_map,
    "MixedIterDataset": _mixed_iter,
}


# ---------------------------------------------------------------------------
# Function identity.


def function_params(fn: Any) -> dict[str, Any]:
  """`{"fn": qualified name, "fn_code": code digest or None}` of a callable."""
  return {"fn": qualified_name(fn), "fn_code": code_digest(fn)}


def qualified_name(fn: Any) -> str:
  """`module.qualname` of a function, bound method, partial or callable object."""
  if isinstance(fn, functools.partial):
    return f"functools.partial({qualified_name(fn.func)})"
  module = getattr(fn, "__module__", None) or type(fn).__module__
  name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
  return f"{module}.{name}"


def code_digest(fn: Any) -> str | None:
  """sha256 prefix of a callable's bytecode, constants and scalar parameters.

  Scalar parameters: closure values, partial arguments and the instance
  attributes of a callable object or of a bound method's object; other
  values count by type only (their repr may hold an address).

  None when there is no Python code to hash (a builtin, a C extension). The
  bytecode changes with the Python version: after an interpreter upgrade pass
  the `fn_code` fields in `allow_drift`.
  """
  digest = hashlib.sha256()
  if not _hash_callable(fn, digest, depth=0):
    return None
  return digest.hexdigest()[:16]


def _hash_callable(fn: Any, digest: Any, depth: int) -> bool:
  if depth > 4:
    return False
  if isinstance(fn, functools.partial):
    digest.update(repr(tuple(_scalar_or_type(a) for a in fn.args)).encode())
    digest.update(repr(sorted((k, _scalar_or_type(v)) for k, v in fn.keywords.items())).encode())
    return _hash_callable(fn.func, digest, depth + 1)
  function = getattr(fn, "__func__", fn)  # a bound method's function
  code = getattr(function, "__code__", None)
  if not isinstance(code, types.CodeType):
    call = type(fn).__call__ if callable(fn) else None  # a callable object
    if call is None or isinstance(fn, type) or not hasattr(call, "__code__"):
      return False
    _hash_attributes(fn, digest)
    return _hash_callable(call, digest, depth + 1)
  if function is not fn:  # a bound method: its object's parameters count too
    _hash_attributes(getattr(fn, "__self__", None), digest)
  _hash_code(code, digest)
  for cell in getattr(function, "__closure__", None) or ():
    try:
      digest.update(repr(_scalar_or_type(cell.cell_contents)).encode())
    except ValueError:  # an empty cell
      digest.update(b"<empty>")
  return True


def _hash_attributes(obj: Any, digest: Any) -> None:
  """Scalar instance attributes (e.g. `Tokenize(max_len=128)`), sorted by name."""
  attributes = getattr(obj, "__dict__", None)
  if isinstance(attributes, dict):
    items = sorted((str(k), _scalar_or_type(v)) for k, v in attributes.items())
    digest.update(repr(items).encode())


def _hash_code(code: types.CodeType, digest: Any) -> None:
  digest.update(code.co_code)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):  # a nested function or comprehension
      _hash_code(const, digest)
    else:
      digest.update(repr(_scalar_or_type(const)).encode())


def _scalar_or_type(value: Any) -> Any:
  """Scalars and tuples of them as they are; anything else by type (no addresses)."""
  if value is None or isinstance(value, (bool, int, float, str, bytes)):
    return value
  if isinstance(value, tuple):
    return tuple(_scalar_or_type(v) for v in value)
  if isinstance(value, frozenset):  # set order varies with the hash seed
    return tuple(sorted(repr(_scalar_or_type(v)) for v in value))
  return f"<{type(value).__qualname__}>"


def _scalar(value: Any) -> Any:
  """A JSON scalar: numpy integers become int; None and bools stay."""
  if value is None or isinstance(value, bool):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  return state_lib.short_repr(value)


# ---------------------------------------------------------------------------
# grain.DataLoader: the same identity, read from the loader's parts.

_OPERATION_METHODS = ("map", "filter", "random_map", "map_with_index", "flat_map", "np_random_map")


def describe_loader(loader: Any) -> dict[str, Any]:
  """The fingerprint fields of a `grain.DataLoader`.

  The source (type, length, sampled digest), the sampler (its repr, which
  Grain itself compares and which holds the seed, shuffle, epochs and
  sharding), each operation (class, batch parameters, code digest of its
  method), the worker count and the sharding.
  """
  source = loader._data_source  # pylint: disable=protected-access
  sampler = loader._sampler  # pylint: disable=protected-access
  shard = loader._shard_options  # pylint: disable=protected-access
  fields: dict[str, Any] = {"loader": "grain.DataLoader"}
  fields.update({f"loader.{k}": v for k, v in _source_params(source).items()})
  fields["loader.sampler"] = repr(sampler)
  operations = list(loader._operations)  # pylint: disable=protected-access
  fields["loader.operations"] = len(operations)
  for index, operation in enumerate(operations):
    prefix = f"loader.op[{index}]"
    kind = type(operation)
    fields[prefix] = f"{kind.__module__}.{kind.__qualname__}"
    for param in ("batch_size", "drop_remainder"):
      if hasattr(operation, param):
        fields[f"{prefix}.{param}"] = _scalar(getattr(operation, param))
    method = next((getattr(operation, m) for m in _OPERATION_METHODS if hasattr(operation, m)), None)
    fields[f"{prefix}.code"] = None if method is None else code_digest(method)
  fields["loader.worker_count"] = int(loader.multiprocessing_options.num_workers)
  fields["shard_index"] = int(shard.shard_index)
  fields["shard_count"] = int(shard.shard_count)
  try:
    fields["dataset_length"] = int(len(sampler))
  except TypeError:
    fields["dataset_length"] = None
  return fields


def _source_params(source: Any, prefix: str = "source_") -> dict[str, Any]:
  """A source's type, length and sampled digest (`<prefix>length`, `<prefix>digest`)."""
  kind = type(source)
  params: dict[str, Any] = {"source": f"{kind.__module__}.{kind.__qualname__}"}
  try:
    length = len(source)
    params[f"{prefix}length"] = int(length)
    params[f"{prefix}digest"] = sources_lib.sample_digest(source, length) if length else None
  except Exception as e:  # pylint: disable=broad-except  (a user source may raise anything)
    params[f"{prefix}digest"] = f"<unreadable: {type(e).__name__}>"
  return params


# ---------------------------------------------------------------------------
# Index provenance: which input elements a MapDataset element is made of (`provenance`).

# Steps whose element i is made of element i of their input.
_SAME_INDEX = frozenset({"MapMapDataset", "MapWithIndexMapDataset", "RandomMapMapDataset", "FilterMapDataset"})


def parent_indices(node: Any, index: int) -> list[int] | None:
  """The indices of `node`'s input that its element `index` is made of, or None for a step not known here.

  Read from the Grain 0.2.x privates the describers above read; a Grain
  release that renames them answers None (the caller says it cannot tell).
  """
  kind = type(node).__name__
  try:
    if kind in _SAME_INDEX:
      return [index]
    if kind == "SliceMapDataset":
      return [int(node._start) + index * int(node._step)]  # pylint: disable=protected-access
    if kind == "RepeatMapDataset":
      # With reseed_each_epoch (the default) the index passes on: the input continues into its next epoch.
      return [index if node._reseed_each_epoch else index % len(node.parents[0])]  # pylint: disable=protected-access
    if kind == "ShuffleMapDataset":
      from ckpt_iter import _permutation  # pylint: disable=g-import-not-at-top

      length = len(node.parents[0])
      return [_permutation.shuffled(index, length, int(node._seed)) + index // length * length]  # pylint: disable=protected-access
    if kind == "BatchMapDataset":
      return _batch_indices(node, index)
  except AttributeError:
    return None
  return None


def _batch_indices(node: Any, index: int) -> list[int]:
  # As BatchMapDataset.__getitem__ reads them: each epoch of its input batched on its own.
  parent_length, size = len(node.parents[0]), int(node._batch_size)  # pylint: disable=protected-access
  epoch, in_epoch = divmod(index, len(node))
  start = in_epoch * size
  stop = min(parent_length, (in_epoch + 1) * size)
  return [epoch * parent_length + i for i in range(start, stop)]


def iter_batch_size(node: Any) -> int | None:
  """The batch size of a `BatchIterDataset` (None for another node or another Grain layout)."""
  if type(node).__name__ != "BatchIterDataset":
    return None
  try:
    return int(node._batch_size)  # pylint: disable=protected-access
  except AttributeError:
    return None


# ---------------------------------------------------------------------------
# A plain Grain iterator's dataset (`iter(dataset)`, what a Grain user saves).


def iterator_dataset(iterator: Any) -> tuple[Any, tuple[str, ...]] | None:
  """(the MapDataset a plain Grain iterator reads, the iterator classes above it), or None.

  `iter(map_dataset)` is a PrefetchDatasetIterator that keeps its dataset
  (`_map_parent`); an IterDataset's iterators chain down through `_parents`
  to one. None where the chain has no such iterator (a DataLoader's, an
  ElasticIterator) or has more than one parent (a mix).
  """
  above: list[str] = []
  node = iterator
  for _ in range(_MAX_ITERATOR_DEPTH):
    dataset = getattr(node, "_map_parent", None)
    if dataset is not None:
      return dataset, tuple(above)
    parents = getattr(node, "_parents", None)
    if not isinstance(parents, tuple) or len(parents) != 1:
      return None
    above.append(type(node).__name__)
    node = parents[0]
  return None


_MAX_ITERATOR_DEPTH = 64
