"""`ckpt_iter.which(pipeline, state)`: the records of the last batch read, with the user's pipeline.

Where a state alone says which records a batch held (a make_dataset whose
position counts stream records), `datamap` answers without any code. Where
user code decides what a row is, the pipeline that wrote the state answers:

  * a filtered or packed make_dataset (lanes): each lane's last rows come
    from chunks of the stream; the chunk's records the filter keeps are
    computed (the packer decides which row holds which of them);
  * make_dataset under other Grain steps (a hand-built `.batch`, `.filter`,
    `.shuffle`, `.slice`, `.repeat`, or `to_iter_dataset().batch(n)` as
    Tunix's CLI builds it): the element before the position is traced back
    through the steps to make_dataset's elements (`_graph.parent_indices`),
    hence to stream records and source records.

Elements are produced only to skip what a filter dropped (at most
`MAX_LOOKBACK` of them); the rest is index arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grain

from ckpt_iter import _graph
from ckpt_iter import _lane_mixture
from ckpt_iter import _lanes
from ckpt_iter import _permutation
from ckpt_iter import _records
from ckpt_iter import _global_batch
from ckpt_iter import datamap
from ckpt_iter import errors
from ckpt_iter import state as state_lib

MAX_LOOKBACK = 1024  # elements a filter may have dropped before the one read last
_IDENTITY_FIELDS = ("source", "source_length", "source_digest", "seed")
# Set only for shuffle="shards": a state without them read Grain's shuffle, so they are compared either way.
_SHUFFLE_FIELDS = (_permutation.SHUFFLE_FIELD, _permutation.WINDOW_FIELD, _permutation.SHARDS_FIELD,
                   _permutation.LANES_FIELD, _permutation.LANE_ROWS_FIELD)


def which(pipeline: Any, state: Any) -> datamap.Batch:
  """The source records of the last batch `pipeline` read before `state` was taken.

  Right after a restore (nothing read since), that is the last batch of the run restored, which the
  state's lineage describes.

  Args:
    pipeline: the pipeline that wrote the state (built as it was: same
      source, seed, filter, packer and steps).
    state: its state (an `IteratorState` or its dict form): a data state, a
      RepeatIterator's or a Tunix learner's (its input's is used).

  Returns:
    The batch: its records (source index, stream record, row, process) and
    how its place was decided. For a filtered or packed pipeline, the records
    of the chunks its rows came from that the filter kept.

  Raises:
    UnsupportedConfigError: the pipeline has no make_dataset node, or a step
      whose indices cannot be traced (the message names it).
    ConfigDriftError: the pipeline reads another source or seed than the state's.
    InvalidStateError: the state holds no batch read (position 0), does not fit the pipeline, or was
      taken right after a restore that reweighted a mixture (its last batch is then the restored step's,
      which the message names: ask it with `ckpt-iter which --step`).
  """
  value = state if isinstance(state, state_lib.IteratorState) else state_lib.IteratorState.from_dict(state)
  inner = value.innermost
  fingerprint, position = inner.fingerprint, inner.position
  node = _global_batch.spec_node(pipeline)
  if node is None:
    raise errors.UnsupportedConfigError(
        f"which() traces records to a ckpt_iter.make_dataset node; {type(pipeline).__name__} has none on its "
        "chain of single parents. Build the pipeline with make_dataset.")
  _check_same_source(node, fingerprint)
  try:
    stream = datamap.RecordStream(fingerprint, position)
  except errors.UnsupportedConfigError:
    stream = None
  if stream is not None:
    return datamap.last_batch_of(value)
  if isinstance(node, _lanes.LaneDataset):
    return _lanes_batch(node, fingerprint, position)
  return _traced_batch(pipeline, node, fingerprint, position)


def _check_same_source(node: Any, fingerprint: Mapping[str, Any]) -> None:
  here = node.spec.fingerprint()
  layouts = tuple(sorted({n for n in (*fingerprint, *here) if n.startswith(_permutation.SHARDS_FIELD + "[")}))
  differences = {name: (fingerprint.get(name, state_lib.ABSENT), here.get(name, state_lib.ABSENT))
                 for name in _IDENTITY_FIELDS + _SHUFFLE_FIELDS + layouts
                 if (name in fingerprint or (name in _SHUFFLE_FIELDS or name in layouts) and name in here)
                 and not state_lib.same_field_value(fingerprint.get(name), here.get(name))}
  if differences:
    raise errors.ConfigDriftError(differences, origin="which(): the state")


def _stream_of(node: Any, fingerprint: Mapping[str, Any]) -> datamap.RecordStream:
  """The node's stream as a record position would describe it (for the records' sources)."""
  position: dict[str, Any] = {_records.NEXT_RECORD: 0}
  mixture = getattr(node, "mixture", None) if not isinstance(node, _lanes.LaneDataset) else None
  if node.spec.is_mixture:
    position[_records.MIXTURE] = (mixture or node.spec.initial_mixture()).to_json()
  fields = {k: v for k, v in fingerprint.items() if k not in ("position_scope",)}
  return datamap.RecordStream(fields, position, origin="which()")


# ---------------------------------------------------------------------------
# make_dataset under other Grain steps.


def _traced_batch(pipeline: Any, node: Any, fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> Any:
  next_index = position.get("next_index")
  if set(position) != {"next_index"} or not state_lib.is_int(next_index):
    raise errors.UnsupportedConfigError(
        f"which(): the state's position {state_lib.short_repr(dict(position), 60)} is no Grain index of "
        f"{type(pipeline).__name__}: only a MapDataset, or `to_iter_dataset().batch(n)` over one, is traced.")
  if isinstance(pipeline, grain.MapDataset):
    indices = [_last_element(pipeline, next_index)]
    outer, how = pipeline, f"element {indices[0]} of the pipeline, traced to make_dataset's elements"
  else:
    outer, size = _iter_source(pipeline)
    indices = _last_elements(outer, next_index, size)
    how = f"the last {len(indices)} elements of {type(outer).__name__} before index {next_index}, traced"
  elements = [k for index in indices for k in _trace(outer, index, node)]
  per_process = node.spec.batch_size
  first = node.spec.shard_index * per_process
  records = [g for k in elements for g in node.plan.rows(k, first, per_process)]
  return _stream_of(node, fingerprint).batch(records, how=how, process_index=node.spec.shard_index)


def _last_element(dataset: Any, next_index: int) -> int:
  for index in range(next_index - 1, max(next_index - 1 - MAX_LOOKBACK, -1), -1):
    if dataset[index] is not None:
      return index
  raise errors.InvalidStateError(
      f"which(): no element before index {next_index} within {MAX_LOOKBACK} (a filter dropped them all, or "
      "nothing was read).")


def _last_elements(dataset: Any, next_index: int, count: int) -> list[int]:
  found: list[int] = []
  for index in range(next_index - 1, max(next_index - 1 - MAX_LOOKBACK * count, -1), -1):
    if len(found) == count:
      break
    if dataset[index] is not None:
      found.append(index)
  if not found:
    raise errors.InvalidStateError(f"which(): no element before index {next_index}: nothing was read.")
  return found[::-1]


def _iter_source(pipeline: Any) -> tuple[Any, int]:
  """(the MapDataset under `to_iter_dataset()`, the batch size above it) of an IterDataset pipeline."""
  node, size = pipeline, 1
  while not isinstance(node, grain.MapDataset):
    batch = _graph.iter_batch_size(node)
    if batch is not None:
      size *= batch
    elif type(node).__name__ not in ("MapIterDataset", "PrefetchIterDataset"):
      raise errors.UnsupportedConfigError(
          f"which(): cannot trace records through {type(node).__name__}; traced IterDataset steps are "
          "to_iter_dataset(), batch and map.")
    parents = getattr(node, "parents", ())
    if len(parents) != 1:
      raise errors.UnsupportedConfigError(f"which(): {type(node).__name__} has {len(parents)} inputs.")
    node = parents[0]
  return node, size


def _trace(dataset: Any, index: int, node: Any) -> list[int]:
  """make_dataset's element indices that `dataset`'s element `index` is made of."""
  if dataset is node:
    return [index]
  below = _graph.parent_indices(dataset, index)
  if below is None:
    raise errors.UnsupportedConfigError(
        f"which(): cannot trace records through {type(dataset).__name__} (traced: map, filter, slice, repeat, "
        "shuffle, batch).")
  return [k for i in below for k in _trace(dataset.parents[0], i, node)]


# ---------------------------------------------------------------------------
# Lanes.


def _lanes_batch(node: _lanes.LaneDataset, fingerprint: Mapping[str, Any], position: Mapping[str, Any]) -> Any:
  lanes, first = position.get(_lanes.LANES), position.get(_lanes.FIRST_LANE, 0)
  if not isinstance(lanes, list) or not lanes:
    raise errors.InvalidStateError(f"which(): lane position {state_lib.short_repr(dict(position), 60)} holds no lanes.")
  per_lane = node.rows_per_lane
  shares = _records.shares_of(fingerprint)
  mixture = None if shares is None else _lane_mixture.of(shares, position, origin="which(): the state")
  records, parts = [], []
  for offset, (chunk_in_lane, rows_taken) in enumerate(lanes):
    lane = first + offset
    for chunk, rows in _last_rows(node, lane, int(chunk_in_lane), int(rows_taken), per_lane, mixture):
      kept = _kept_records(node, chunk, mixture)
      records.extend(kept)
      shown = f"row {rows[0]}" if rows[1] - rows[0] == 1 else f"rows {rows[0]}-{rows[1] - 1}"
      parts.append(f"lane {lane}: {shown} of chunk {chunk} ({len(kept)} records kept)")
  how = ("filtered/packed make_dataset: " + "; ".join(parts) + ". The records are those of the chunks the "
         "filter kept; which row holds which is the packer's")
  stream = _stream_of(node, fingerprint)
  if mixture is not None:
    stream.mixture = mixture  # the shares each record was mixed under (`_lane_mixture.Schedule.source_of`)
  return stream.batch(records, how=how, process_index=node.spec.shard_index)


def _last_rows(node: _lanes.LaneDataset, lane: int, chunk_in_lane: int, rows_taken: int,
               count: int, mixture: Any) -> list[tuple[int, tuple[int, int]]]:
  """(chunk, (first row, stop row)) of a lane's last `count` rows before its position, oldest first."""
  parts = []
  while count > 0 and (chunk_in_lane > 0 or rows_taken > 0):
    if rows_taken == 0:
      chunk_in_lane -= 1
      rows_taken = len(node.chunk_rows(chunk_in_lane * node.lanes.num_lanes + lane, mixture))
      continue
    take = min(count, rows_taken)
    parts.append((chunk_in_lane * node.lanes.num_lanes + lane, (rows_taken - take, rows_taken)))
    count, rows_taken = count - take, rows_taken - take
  return parts[::-1]


def _kept_records(node: _lanes.LaneDataset, chunk: int, mixture: Any) -> list[int]:
  length = None if node.spec.is_mixture else node.spec.source.length
  kept = [g for g in node.chunk_records(chunk) if not (node.skips and node.skips.skipped(g, length))]
  if node.lanes.filter is not None:
    kept = [g for g in kept if node.lanes.filter(node.record(g, mixture))]
  return kept
