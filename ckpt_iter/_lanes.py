"""Filtered and packed make_dataset streams that are the same for every process count.

Filtering and packing turn records into a number of rows that only running
them tells: a position in rows cannot be computed from a position in records.
So the work is cut into units fixed by the run, not by its processes:

  * chunk c is stream records [c*C, (c+1)*C) (C = chunk_size), filtered and
    packed as one unit, always the same rows whoever computes it;
  * lane v (of V = num_lanes) takes chunks v, v+V, v+2V, ... and emits their
    rows in order;
  * every global batch takes G/V rows from each lane, lane after lane; process
    i of N holds lanes [i*V/N, (i+1)*V/N), so its local batch is its lanes' rows.

The global stream of rows and batches depends on C, V and the source, never
on N: a restart with another process count M (dividing V) or another global
batch (a multiple of V) continues every lane at its own next row. A lane's
position is (chunk number in the lane, rows taken from it): O(1) to restore
(one chunk per lane is filtered and packed again), V/N pairs per process.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import grain

from ckpt_iter import _graph
from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib

LANES = _records.LANES  # the position field: [[chunk in lane, rows taken], ...] of this process's lanes
FIRST_LANE = _records.FIRST_LANE
# A filter that drops every record of this many chunks in a row is taken for a
# mistake (it would read the whole stream for nothing), not waited out.
MAX_EMPTY_CHUNKS = 10_000
_NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
_END = object()


@dataclasses.dataclass(frozen=True)
class LaneSpec:
  """How records become rows: the filter, the packer, and the fixed units of work."""

  filter: Callable[[Any], bool] | None
  pack: Callable[[Any], Any] | None
  chunk_size: int
  num_lanes: int

  @classmethod
  def of(cls, spec: Any, *, filter: Any, pack: Any, chunk_size: Any,  # pylint: disable=redefined-builtin
         num_lanes: Any) -> "LaneSpec":
    """Validates the lane arguments of make_dataset against its spec (a `_global_batch.DatasetSpec`)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
      raise errors.InvalidArgumentError(f"chunk_size={chunk_size!r} must be a positive integer (records).")
    if num_lanes is None:
      num_lanes = spec.shard_count
    if isinstance(num_lanes, bool) or not isinstance(num_lanes, int) or num_lanes < 1:
      raise errors.InvalidArgumentError(f"num_lanes={num_lanes!r} must be a positive integer.")
    if num_lanes % spec.shard_count:
      raise errors.InvalidArgumentError(
          f"num_lanes={num_lanes} is not a multiple of shard_count={spec.shard_count}: each process holds "
          f"num_lanes / shard_count lanes. Use a process count dividing {num_lanes}.")
    if spec.global_batch_size % num_lanes:
      raise errors.InvalidArgumentError(
          f"the global batch of {spec.global_batch_size} rows (batch_size={spec.batch_size} x "
          f"shard_count={spec.shard_count}) is not a multiple of num_lanes={num_lanes}: every global batch "
          "takes the same number of rows from each lane. Use a global batch that is a multiple of it.")
    if spec.num_epochs is not None:
      raise errors.InvalidArgumentError(
          f"num_epochs={spec.num_epochs} with filter or pack: a filtered or packed stream has no end every "
          "process can see (each knows only its own lanes' rows), so processes would stop at different "
          "steps. Pass num_epochs=None and stop at the trainer's step count; every epoch of the source "
          "is still read exactly once per pass.")
    if not spec.drop_remainder:
      raise errors.InvalidArgumentError(
          "drop_remainder=False with filter or pack: lanes end at different points, so the last batch "
          "cannot be short on every process alike. Pass drop_remainder=True.")
    return cls(filter=filter, pack=pack, chunk_size=chunk_size, num_lanes=num_lanes)

  def fingerprint(self) -> dict[str, Any]:
    fields: dict[str, Any] = {"chunk_size": self.chunk_size, "num_lanes": self.num_lanes}
    for name, fn in (("filter", self.filter), ("pack", self.pack)):
      fields[name] = None if fn is None else _graph.qualified_name(fn)
      fields[f"{name}_code"] = None if fn is None else _graph.code_digest(fn)
    fields["position_scope"] = LANES
    return fields


class LaneDataset(grain.IterDataset):
  """make_dataset with `filter` or `pack`: this process's lanes, a batch of their rows at a time.

  Carries the DatasetSpec (`spec`) and the LaneSpec (`lanes`) that
  fingerprint it.
  """

  def __init__(self, parents: Sequence[grain.MapDataset], spec: Any, lanes: LaneSpec,
               stack: Callable[[list[Any]], Any]):
    super().__init__(list(parents))
    self.spec = spec
    self.lanes = lanes
    self.stack = stack  # rows -> one batch (`_stacking.stack_records`)
    self._names = [name for name, _ in spec.sources]
    # The shares over the stream of a run that never changed them (a restore may give its iterator others).
    self.initial_mixture = _lane_mixture.Schedule.initial(spec.shares) if spec.is_mixture else None
    self.declared = skips_lib.Skip()  # what `declare` was given
    self.skips = skips_lib.NO_SKIPS  # stream records no chunk yields (filtered before `filter`)

  def declare(self, skip: skips_lib.Skip) -> None:
    """Records to skip, for a fresh run from its first record on (`dataset.with_skip`)."""
    self.declared = skip
    self.skips, _ = skips_lib.resolve(
        skip, from_record=0, epoch_length=None if self.spec.is_mixture else self.spec.source.length,
        shuffled=self.spec.seed is not None, mixture=self.spec.is_mixture, origin="make_dataset(skip=...)")

  def set_skips(self, skips: skips_lib.Skips) -> None:
    self.skips = skips

  def __str__(self) -> str:
    return (f"LaneDataset(batch_size={self.spec.batch_size}, lanes={self.lanes.num_lanes}, "
            f"chunk_size={self.lanes.chunk_size}, shard={self.spec.shard_index}/{self.spec.shard_count})")

  @property
  def own_lanes(self) -> range:
    per_process = self.lanes.num_lanes // self.spec.shard_count
    return range(self.spec.shard_index * per_process, (self.spec.shard_index + 1) * per_process)

  @property
  def rows_per_lane(self) -> int:
    return self.spec.global_batch_size // self.lanes.num_lanes

  def record(self, stream_record: int, mixture: _lane_mixture.Schedule | None = None) -> Any:
    """Stream record `stream_record` under the shares of `mixture` (the initial ones by default)."""
    mixture = mixture or self.initial_mixture
    if mixture is None:
      return self.parents[0][stream_record]
    name, index = mixture.source_of(stream_record)
    return self.parents[self._names.index(name)][index]

  def chunk_records(self, chunk: int) -> range:
    """The stream records of chunk `chunk` (the stream has no end: num_epochs is None); skipped ones not yielded."""
    return range(chunk * self.lanes.chunk_size, (chunk + 1) * self.lanes.chunk_size)

  def chunk_rows(self, chunk: int, mixture: _lane_mixture.Schedule | None = None) -> list[Any]:
    """Chunk `chunk` filtered and packed, whole: the same rows whoever computes them, whenever."""
    return list(self.chunk_row_iter(chunk, mixture))

  def chunk_row_iter(self, chunk: int, mixture: _lane_mixture.Schedule | None = None) -> Iterator[Any]:
    """Chunk `chunk`'s rows, computed as they are asked for: a record is read, filtered and packed only
    when a row needs it (a lane restored inside a chunk, or the first batch after 256 lanes land on one
    host, computes the rows it takes, not every chunk whole)."""
    length = None if self.spec.is_mixture else self.spec.source.length
    kept = [g for g in self.chunk_records(chunk) if not (self.skips and self.skips.skipped(g, length))]
    records: grain.MapDataset = _ChunkRecords(self, kept, mixture)
    if self.lanes.filter is not None:
      records = records.filter(self.lanes.filter)
    rows = records.to_iter_dataset(_NO_THREADS)
    return iter(rows if self.lanes.pack is None else self.lanes.pack(rows))

  def __iter__(self) -> "LaneIterator":
    return LaneIterator(self)


class _ChunkRecords(grain.MapDataset):
  """A chunk's kept stream records, read on demand. A MapDataset of its own, not a `MapDataset.source`: a
  record is already read through the make_dataset source's node, and a second source node measured every
  record again (Grain's per-read metrics: 15% of a packed lane's CPU)."""

  def __init__(self, dataset: LaneDataset, stream_records: list[int], mixture: _lane_mixture.Schedule | None):
    super().__init__()
    self._dataset, self._stream_records, self._mixture = dataset, stream_records, mixture

  def __len__(self) -> int:
    return len(self._stream_records)

  def __getitem__(self, index: Any) -> Any:
    if isinstance(index, slice):
      return self.slice(index)
    return self._dataset.record(self._stream_records[index], self._mixture)

  def __str__(self) -> str:
    return f"_ChunkRecords({len(self._stream_records)} records)"


class _Lane:
  """One lane's place: the chunk (numbered within the lane) it takes rows from, and how many it took."""

  def __init__(self, dataset: LaneDataset, lane: int, chunk_in_lane: int = 0, rows_taken: int = 0,
               mixture: _lane_mixture.Schedule | None = None):
    self._dataset, self.lane, self._mixture = dataset, lane, mixture
    self.chunk_in_lane, self.rows_taken = chunk_in_lane, rows_taken
    # The current chunk's rows computed so far, from its row iterator (None: the chunk is not started here).
    self._rows: list[Any] = []
    self._source: Iterator[Any] | None = None

  @property
  def chunk(self) -> int:
    return self.chunk_in_lane * self._dataset.lanes.num_lanes + self.lane

  def _computed(self, count: int) -> bool:
    """Computes the current chunk's rows up to `count`; whether it has that many."""
    if self._source is None:
      self._source, self._rows = self._dataset.chunk_row_iter(self.chunk, self._mixture), []
    while len(self._rows) < count:
      row = next(self._source, _END)
      if row is _END:
        return False
      self._rows.append(row)
    return True

  def take(self, count: int) -> list[Any]:
    """The lane's next `count` rows. A chunk is left once its last row is taken (a saved position is
    then the next chunk's [m + 1, 0], whether its rows were computed whole or as needed)."""
    rows: list[Any] = []
    empty = 0
    while len(rows) < count:
      if self._source is None and not self._computed(self.rows_taken):
        raise errors.InvalidStateError(
            f"lane {self.lane}: the position takes {self.rows_taken} rows of chunk {self.chunk}, which "
            f"has {len(self._rows)}: the filter or packer gives other rows than when it was saved.")
      self._computed(self.rows_taken + count - len(rows))
      available = self._rows[self.rows_taken:self.rows_taken + count - len(rows)]
      rows.extend(available)
      self.rows_taken += len(available)
      if not self._computed(self.rows_taken + 1):  # its last row taken: on to the lane's next chunk
        empty = empty + 1 if not self._rows else 0
        if empty > MAX_EMPTY_CHUNKS:
          raise errors.InvalidArgumentError(
              f"filter dropped every record of {MAX_EMPTY_CHUNKS} chunks in a row (lane {self.lane}, up to "
              f"chunk {self.chunk}); check the filter.")
        self.chunk_in_lane, self.rows_taken, self._rows, self._source = self.chunk_in_lane + 1, 0, [], None
    return rows

  def position(self) -> list[int]:
    return [self.chunk_in_lane, self.rows_taken]


class LaneIterator(grain.DatasetIterator):
  """Batches of this process's lanes; its state is each lane's (chunk in lane, rows taken), and a mixture's
  shares over the stream once a restart changed them."""

  def __init__(self, dataset: LaneDataset):
    super().__init__()
    self._dataset = dataset
    self._mixture = dataset.initial_mixture
    self._lanes = [_Lane(dataset, lane) for lane in dataset.own_lanes]

  def __next__(self) -> Any:
    count = self._dataset.rows_per_lane
    return self._dataset.stack([row for lane in self._lanes for row in lane.take(count)])

  def get_state(self) -> dict[str, Any]:
    state: dict[str, Any] = {FIRST_LANE: self._lanes[0].lane, LANES: [lane.position() for lane in self._lanes]}
    if self._mixture is not None and not self._mixture.is_initial:
      state[_lane_mixture.MIXTURE] = self._mixture.to_json()
    return state

  def set_state(self, state: Mapping[str, Any]) -> None:
    own = self._dataset.own_lanes
    lanes = state.get(LANES) if isinstance(state, Mapping) else None
    mixture = self._dataset.initial_mixture
    if isinstance(state, Mapping) and _lane_mixture.MIXTURE in state and mixture is not None:
      mixture = _lane_mixture.of(dict(self._dataset.spec.shares), state, origin="the lane position")
      state = {k: v for k, v in state.items() if k != _lane_mixture.MIXTURE}
    if (
        not isinstance(state, Mapping) or set(state) != {FIRST_LANE, LANES}
        or state[FIRST_LANE] != own.start or not isinstance(lanes, list) or len(lanes) != len(own)
        or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_count(v) for v in p) for p in lanes)
    ):
      raise errors.InvalidStateError(
          f"position {state_lib.short_repr(state)} does not fit this process's lanes {own.start}..{own.stop - 1}: "
          f"expected {{'{FIRST_LANE}': {own.start}, '{LANES}': [[chunk in lane, rows taken] x {len(own)}]}}.")
    self._mixture = mixture
    self._lanes = [_Lane(self._dataset, lane, int(m), int(o), mixture) for lane, (m, o) in zip(own, lanes)]


def _is_count(value: Any) -> bool:
  return state_lib.is_int(value) and value >= 0


def check_added_skips(dataset: LaneDataset, position: Any, added: skips_lib.Skips, *, origin: str) -> None:
  """Refuses skips added at a restore that touch a chunk one of this process's lanes is inside.

  A chunk's rows are computed from all its records at once: a lane that took
  some rows of a chunk would find other rows there once records of it are
  skipped. Chunks a lane has passed are never computed again (what they held
  was trained); chunks it has not started skip the records.

  Raises:
    UnsupportedConfigError: naming the lane, the chunk and the stream records to skip from instead.
  """
  lanes = position.get(LANES) if isinstance(position, Mapping) else None
  first = position.get(FIRST_LANE, 0) if isinstance(position, Mapping) else 0
  if not isinstance(lanes, list):
    return  # a malformed position: refused when it is set
  length = None if dataset.spec.is_mixture else dataset.spec.source.length
  for offset, entry in enumerate(lanes):
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(_is_count(v) for v in entry)):
      return
    chunk_in_lane, rows_taken = entry
    if rows_taken == 0:
      continue
    chunk = chunk_in_lane * dataset.lanes.num_lanes + first + offset
    records = dataset.chunk_records(chunk)
    touched = [g for g in records if added.skipped(g, length)]
    if touched:
      raise errors.UnsupportedConfigError(
          f"{origin}: the skip {added.describe()} touches stream record {touched[0]} of chunk {chunk}, of which "
          f"lane {first + offset} has already taken {rows_taken} rows: its rows would change. Skip from stream "
          f"record {records.stop} on (the chunk's end), or restore an earlier step.")
