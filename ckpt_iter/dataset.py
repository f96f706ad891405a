"""make_dataset: the Grain dataset that training configs build.

The pipeline reads one global stream of records (`_records`: one source's
epochs, or a weighted mixture of named sources) and cuts it into *global*
batches, of which each process takes its rows:

  global batch k = stream records [s_k, s_k + G), process i holds rows [i*B, (i+1)*B)

where B is the per-process batch size and G = B * shard_count the global one.
Element k of the dataset is this process's part of global batch k. A
checkpoint's position counts stream records (`next_record`), not batches, so
it means the same for every batch size and every process count: a restart
with another batch size or process count continues at the very next record
(docs/changing_the_run.md).

With `filter` or `pack` the records are filtered and packed in fixed chunks
dealt to a fixed number of lanes (`_lanes`), so that the filtered and packed
stream is also the same for every process count.

This module builds the pipeline from make_dataset's arguments: each checked
(the message names the argument and the fix), the sources resolved and
identified, the order of shuffle="shards", the skips declared. The node it
builds, the position a state holds, its restore and the pipeline's
fingerprint are `_global_batch`'s.
"""

from __future__ import annotations

import fractions
import functools
import logging
import math
import numbers
from typing import Any, Callable, Mapping

import grain
import jax

from ckpt_iter import _global_batch
from ckpt_iter._global_batch import DatasetSpec
from ckpt_iter._global_batch import GlobalBatchDataset
from ckpt_iter import _lanes
from ckpt_iter import _permutation
from ckpt_iter import _plan_prefetch
from ckpt_iter import _records
from ckpt_iter import _source_files
from ckpt_iter import _stacking
from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter import sources as sources_lib
from ckpt_iter import state as state_lib
from ckpt_iter import skips as skips_lib

_log = logging.getLogger(__name__)

def make_dataset(
    source: Any,
    *,
    batch_size: int,
    seed: int | None = None,
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    shard_index: int | None = None,
    shard_count: int | None = None,
    transform: Callable[[Any], Any] | None = None,
    weights: Mapping[str, float] | None = None,
    filter: Callable[[Any], bool] | None = None,  # pylint: disable=redefined-builtin
    pack: Callable[[Any], Any] | None = None,
    chunk_size: int = 256,
    num_lanes: int | None = None,
    skip: Any = None,
    shuffle: str = _permutation.GLOBAL,
    shuffle_window: int | None = None,
    shard_size: int | None = None,
    shard_lanes: int | None = None,
) -> grain.MapDataset | grain.IterDataset:
  """Builds the batched Grain dataset of a training config.

  Args:
    source: a list of records (dicts); a path, glob or list of paths to
      `.jsonl`, `.parquet` or `.array_record` files (read lazily, never loaded
      whole); any random-access data source (`__len__`, `__getitem__`); or,
      with `weights`, a dict of such sources by name (a mixture).
    batch_size: records (rows) per batch on this process.
    seed: shuffle seed; every epoch is a different permutation (each source
      of a mixture has its own, derived from the seed and its name). None: no
      shuffle.
    num_epochs: passes over the source; None repeats forever. A mixture ends
      when its first source would start epoch num_epochs + 1.
    drop_remainder: drop a batch shorter than the global batch (a single
      source's last batch of each epoch; a mixture's last batch). Must be True
      when shard_count > 1, so that every process takes the same number of steps.
    shard_index: this process's shard; defaults to `jax.process_index()`.
    shard_count: number of shards; defaults to `jax.process_count()`.
    transform: a per-record function (e.g. tokenization), applied lazily.
    weights: name -> relative weight of each source in `source` (a dict):
      records are interleaved in these proportions, and the state keeps how
      far each source has been read, so a restart may reweight, add or remove
      sources (declared with allow_drift={"weights"} / {"sources"};
      https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/changing_the_run.md).
    filter: a per-record predicate (after `transform`); False drops the record.
    pack: a function from a `grain.IterDataset` of one chunk's records (after
      `filter`) to an iterable of rows, e.g. one of Grain's packing
      transforms (`lambda ds: grain.experimental.FirstFitPackIterDataset(ds, ...)`).
    chunk_size: with `filter` or `pack`, the stream records filtered and
      packed as one unit.
    num_lanes: with `filter` or `pack`, how many lanes share the chunks
      (chunk c goes to lane c % num_lanes); each global batch takes
      global_batch_size / num_lanes rows from every lane. A restart may use
      any process count dividing num_lanes. Defaults to shard_count.
    skip: records to pass over (`ckpt_iter.Skip`, or a list of (start, stop)
      stream-record ranges): declared here, they are added to a restored
      state's skips from its position on (records already read are not), and
      every later restore keeps them
      (https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/data_map.md).
      Batches are cut from the stream without them.
    shuffle: "global" (Grain's full shuffle of each epoch) or "shards": each
      epoch reads the source's shards in an order of its own, `shuffle_window`
      shards at a time, the records of those shards shuffled among themselves,
      so a reader reads each shard whole before it moves on (for corpora in a
      bucket; what it gives up:
      https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/datasets.md). Needs `seed`.
    shuffle_window: with shuffle="shards", the shards whose records are
      shuffled together (default 8).
    shard_size: with shuffle="shards", the shards are blocks of this many
      records (the last may be shorter); default: the source's files (a source
      of one file, or in memory, needs shard_size). Each source of a mixture
      has its own shards and its own order (from its own seed).
    shard_lanes: with shuffle="shards", cut each epoch's shards into this
      many lanes, consecutive shares of the epoch's reading order; each
      global batch takes global_batch_size / shard_lanes rows from every
      lane, and process i of N reads lanes [i*V/N, (i+1)*V/N) only, so a
      host downloads its processes' share of the corpus, not all of it. Use
      the first run's process count; a restart with another process count is
      exact (one dividing shard_lanes keeps the shares). Default: no lanes
      (every process reads rows of every window)
      (https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/bucket.md).

  Returns:
    A `grain.MapDataset` of dict batches of numpy arrays with a leading batch
    dimension (`{"prompts": array([...]), ...}`), the input format of a Tunix
    RL learner; with `filter` or `pack`, a `grain.IterDataset` of such batches.
    Iterate it with `ckpt_iter.DataIterator` to checkpoint it.

  Raises:
    InvalidArgumentError: an argument is invalid; the message names it.
  """
  _check_positive_int("batch_size", batch_size)
  if seed is not None:
    _check_int_range("seed", seed, 0, 2**32 - 1, "a shuffle seed is a uint32; pass None for no shuffle")
  if num_epochs is not None:
    _check_positive_int("num_epochs", num_epochs, "pass None to repeat forever")
  if not isinstance(drop_remainder, bool):
    raise errors.InvalidArgumentError(
        f"drop_remainder={drop_remainder!r} must be True or False."
    )
  shard_index, shard_count = _resolve_sharding(shard_index, shard_count)
  if shard_count > 1 and not drop_remainder:
    raise errors.InvalidArgumentError(
        f"drop_remainder=False with shard_count={shard_count}: the last short "
        "batch would give processes different step counts. Pass drop_remainder=True."
    )
  for name, fn in (("transform", transform), ("filter", filter), ("pack", pack)):
    if fn is not None and not callable(fn):
      raise errors.InvalidArgumentError(
          f"{name}={fn!r} is not callable; pass a function (see make_dataset's docstring)."
      )
  _check_shuffle(shuffle, shuffle_window, shard_size, seed)
  lanes = _check_shard_lanes(shard_lanes, shuffle, batch_size * shard_count, shard_count, weights=weights,
                             filtered=filter is not None or pack is not None)
  named = _resolve_sources(source, weights)
  lanes_read = 1 if lanes == 1 else _lanes_per_process(lanes, batch_size * shard_count // lanes, batch_size,
                                                       shard_count)
  _warn_if_the_cache_is_too_small(named, shuffle, seed, shuffle_window, shard_size, lanes_read)
  if weights is None:
    (_, (records, identity)), = named.items()
    order = _shard_order(shuffle, records, identity, shard_size, shuffle_window, seed,
                         lanes=lanes, lane_rows=batch_size * shard_count // lanes)
    spec = DatasetSpec(
        source=identity, batch_size=batch_size, seed=seed, num_epochs=num_epochs,
        drop_remainder=drop_remainder, shard_index=shard_index, shard_count=shard_count,
        transform=None if transform is None else _qualified_name(transform),
        shuffle_window=None if order is None else order.window,
        shuffle_shards=None if order is None else _permutation.layout_text(order.offsets),
        shuffle_lanes=lanes,
    )
    parents = [_record_dataset(records, seed, transform, order, num_epochs)]
  else:
    shares = proportions(weights)
    seeds = {name: None if seed is None else source_seed(seed, name) for name in named}
    orders = {name: _shard_order(shuffle, records, identity, shard_size, shuffle_window, seeds[name], name)
              for name, (records, identity) in named.items()}
    spec = DatasetSpec(
        source=None, batch_size=batch_size, seed=seed, num_epochs=num_epochs,
        drop_remainder=drop_remainder, shard_index=shard_index, shard_count=shard_count,
        transform=None if transform is None else _qualified_name(transform),
        sources=tuple((name, identity) for name, (_, identity) in named.items()),
        shares=tuple(shares.items()),
        shuffle_window=None if shuffle == _permutation.GLOBAL else orders[next(iter(orders))].window,
        source_shards=tuple((name, _permutation.layout_text(order.offsets))
                            for name, order in orders.items() if order is not None),
    )
    parents = [_record_dataset(records, seeds[name], transform, orders[name], num_epochs)
               for name, (records, _) in named.items()]
  declared = skips_lib.Skip.of(skip) if not isinstance(skip, skips_lib.Skip) else skip
  if filter is not None or pack is not None:
    lanes = _lanes.LaneSpec.of(spec, filter=filter, pack=pack, chunk_size=chunk_size, num_lanes=num_lanes)
    lane_dataset = _lanes.LaneDataset(parents, spec, lanes, _stacking.stack_records)
    with_skip(lane_dataset, declared)
    return lane_dataset
  if drop_remainder and not spec.is_mixture and spec.source.length < spec.global_batch_size:
    # Batches keep to their epoch: with the remainder dropped, no epoch would yield a batch, however many.
    raise errors.InvalidArgumentError(
        f"a global batch of {spec.global_batch_size} records (batch_size={batch_size} x "
        f"shard_count={shard_count}) is more than one epoch of the source ({spec.source.length} records): "
        "batches keep to their epoch, so with drop_remainder=True every epoch's records would be dropped. "
        f"Use a global batch of at most {spec.source.length} records, or drop_remainder=False (one short "
        "batch per epoch).")
  if lanes > 1 and lanes % shard_count:
    _log.warning(
        "make_dataset: shard_lanes=%d with %d processes (not a divisor of it): a process reads rows of up to "
        "%d lanes, so its host downloads up to %d/%d of the corpus an epoch, not 1/%d; the order is the same "
        "(exact). A process count dividing %d keeps each host to its share.",
        lanes, shard_count, lanes_read, lanes_read, lanes, shard_count, lanes)
  if len(spec.initial_plan()) == 0:
    raise errors.InvalidArgumentError(
        f"source has {_describe_length(spec)} records, fewer than one global batch of "
        f"{spec.global_batch_size} (batch_size={batch_size} x shard_count={shard_count}); "
        "the dataset would be empty. Use a smaller batch_size or drop_remainder=False."
    )
  node = GlobalBatchDataset(parents, spec)
  prefetches = [_plan_prefetch.of_chain(parent) for parent in parents]
  if any(prefetch is not None for prefetch in prefetches):
    node.restore_prefetch = functools.partial(_plan_prefetch.start_restore, prefetches, [n for n, _ in spec.sources])
  with_skip(node, declared)
  return node


_short = state_lib.short_repr


def _warn_if_the_cache_is_too_small(named: Mapping[str, tuple[Any, Any]], shuffle: str, seed: int | None,
                                    shuffle_window: int | None, shard_size: int | None, lanes_read: int = 1) -> None:
  """Warns at build when a shard cache cannot hold what the reading order needs at once.

  A global shuffle (seed set) hops between every file, so it needs them all;
  shuffle="shards" over files needs two windows of each lane the process reads
  (the one read and the one prefetched: the largest 2 x shuffle_window x
  lanes_read files bound it). Exact either
  way, but below that files are evicted and downloaded again over and over
  (measured: 1.5 downloads a record under a global shuffle, slower than
  reading in place). The warning names the size that holds what is needed.
  """
  if seed is None or (shuffle == _permutation.SHARDS and shard_size is not None):
    return  # in file order, or blocks of records: a file at a time
  window = _permutation.DEFAULT_WINDOW if shuffle_window is None else int(shuffle_window)
  needed: dict[int, list[Any]] = {}
  for records, _ in named.values():
    cache = records.cache if isinstance(records, _source_files.FileSource) else None
    if cache is None:
      continue  # read in place, or a source of its own that cannot say what it holds
    sizes = sorted(records.cached_bytes(), reverse=True)
    entry = needed.setdefault(id(cache), [cache, 0])
    entry[1] += sum(sizes) if shuffle == _permutation.GLOBAL else sum(sizes[:2 * window * lanes_read])
  if shuffle == _permutation.GLOBAL:
    _warn_if_copies_reopen(named)
  for cache, total in needed.values():
    if total <= cache.max_bytes:
      continue
    if shuffle == _permutation.GLOBAL:
      _log.warning(
          "make_dataset: a global shuffle (seed set, shuffle=\"global\") reads records from every file in "
          "turn, and %r holds %s of the %s bytes those files take: files will be evicted and downloaded "
          "again over and over (exact, but slower than reading in place). Give the cache max_bytes=%d "
          "or more, or pass shuffle=\"shards\" (a window of files at a time: %s).",
          cache, f"{cache.max_bytes:,}", f"{total:,}", total, _urls.doc_url("bucket.md"))
    else:
      _log.warning(
          "make_dataset: shuffle=\"shards\" with shuffle_window=%d reads a window of files while it "
          "prefetches the next, in each of the %d lane(s) this process reads: up to %s bytes with their line "
          "indexes, more than %r holds. Files will be evicted before they are read and downloaded again "
          "(exact, but slower). Give the cache max_bytes=%d or more, or a smaller shuffle_window (%s).",
          window, lanes_read, f"{total:,}", cache, total, _urls.doc_url("bucket.md"))


def _warn_if_copies_reopen(named: Mapping[str, tuple[Any, Any]]) -> None:
  """Warns at build when a global shuffle reads more files through a cache than a process keeps open (of
  a JSONL source, more of those it does not hold in memory: `files_kept_open`).

  Its reads hop between every file: past `max_open_files` most of them close
  one copy and open another (measured: 1,000 files, 16 open, 0.27 of local
  disk's CPU per record, where a copy kept open reads at about local disk's).
  """
  for name, (records, _) in named.items():
    cached = isinstance(records, _source_files.FileSource) and records.cache is not None
    limit = records.max_open_files if cached else None
    if limit is None:
      continue
    files = records.files_kept_open()  # (a JSONL source holds small copies whole)
    if files > limit:
      _log.warning(
          "make_dataset: a global shuffle reads %s%d files in turn through the shard cache, and the source "
          "keeps %d of them open (max_open_files): most reads will close one copy and open another, at several "
          "times the CPU of a copy kept open. Pass max_open_files=%d to the source (a process then holds %d "
          "open files: mind its limit, `ulimit -n`) if the cache holds them all, or shuffle=\"shards\" (a "
          "window of files at a time: %s).", f"{name}'s " if name else "", files, limit, files, files,
          _urls.doc_url("bucket.md"))


def with_skip(dataset: Any, skip: Any) -> Any:
  """Declares records to skip on the make_dataset node of `dataset`; returns `dataset`.

  A fresh run skips them from its first record; a restore adds them to the
  restored state's skips from the restored position on (`DataIterator`).
  Declare before the pipeline is iterated (before its `DataIterator` is
  built): e.g. around a Tunix learner's `train(train_ds)`, or on a dataset a
  config built (`ckpt-iter train ... ckpt_iter.skip=...` does this).

  Args:
    dataset: a pipeline built on make_dataset.
    skip: a `ckpt_iter.Skip`, or a list of (start, stop) stream-record ranges.

  Raises:
    UnsupportedConfigError: `dataset` has no make_dataset node on its chain
      of single parents.
    InvalidArgumentError: `skip` is malformed, or names source records of a
      shuffled source or a mixture.
  """
  declared = skips_lib.Skip.of(skip)
  node = _global_batch.spec_node(dataset)
  if node is None:
    raise errors.UnsupportedConfigError(
        f"cannot skip records of {type(dataset).__name__}: only a pipeline built with ckpt_iter.make_dataset "
        "(its node on a chain of single parents) knows its records. Build it with make_dataset(...).")
  node.declare(declared)
  return dataset


# Weights are read to three significant decimals of their ratio.
_WEIGHT_DENOMINATOR = 1000


def proportions(weights: Mapping[str, Any]) -> dict[str, int]:
  """make_dataset's `weights` as integer proportions (a mixture's shares), in lowest terms, same order.

  0.7 and 0.3 give 7 and 3; weights are read to three significant decimals
  of their ratio (1/3 and 2/3 give 1 and 2).

  Raises:
    InvalidArgumentError: a weight is not a positive finite number, or the
      proportions need more than _records.MAX_PROPORTION_TOTAL in total.
  """
  if not weights:
    raise errors.InvalidArgumentError("weights is empty; a mixture needs at least one source.")
  if len(weights) > _records.MAX_SOURCES:
    raise errors.InvalidArgumentError(
        f"a mixture has {len(weights)} sources; at most {_records.MAX_SOURCES} are supported.")
  for name, weight in weights.items():
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight <= 0:
      raise errors.InvalidArgumentError(
          f"weights[{name!r}]={weight!r} must be a positive finite number (a relative weight).")
  smallest = min(float(w) for w in weights.values())
  ratios = {name: fractions.Fraction(float(w) / smallest).limit_denominator(_WEIGHT_DENOMINATOR)
            for name, w in weights.items()}
  denominator = math.lcm(*(r.denominator for r in ratios.values()))
  ints = {name: int(r * denominator) for name, r in ratios.items()}
  divisor = math.gcd(*ints.values())
  ints = {name: value // divisor for name, value in ints.items()}
  if sum(ints.values()) > _records.MAX_PROPORTION_TOTAL:
    raise errors.InvalidArgumentError(
        f"weights {dict(weights)} need integer proportions {ints}, more than {_records.MAX_PROPORTION_TOTAL} "
        "in total; round them (e.g. to two decimals).")
  return ints


def _describe_length(spec: DatasetSpec) -> str:
  if not spec.is_mixture:
    return str(spec.source.length)
  return " + ".join(f"{identity.length} ({name})" for name, identity in spec.sources)


source_seed = _records.source_seed


def _resolve_sources(source: Any, weights: Any) -> dict[str, tuple[Any, sources_lib.SourceIdentity]]:
  """name -> (records, identity); the one source of a single-source dataset is named ""."""
  if weights is None:
    if isinstance(source, Mapping) and source and all(isinstance(k, str) for k in source) and not any(
        isinstance(v, (str, int, float, bool)) or v is None for v in source.values()):
      raise errors.InvalidArgumentError(
          f"source={_short(source)} is a dict of sources: a mixture needs weights={{name: weight, ...}} "
          f"(e.g. weights={{{', '.join(repr(k) + ': 1.0' for k in list(source)[:3])}}}).")
    return {"": sources_lib.resolve_source(source)}
  if not isinstance(weights, Mapping):
    raise errors.InvalidArgumentError(
        f"weights={_short(weights)} must be a dict {{source name: weight}} matching source's names.")
  if not isinstance(source, Mapping):
    raise errors.InvalidArgumentError(
        f"weights={_short(weights)} is given, so source must be a dict {{name: source}}; got {_short(source)}.")
  bad = [k for k in source if not isinstance(k, str) or not k or not k.isidentifier()]
  if bad:
    raise errors.InvalidArgumentError(
        f"source names {bad!r} must be non-empty identifiers (they name fingerprint fields and ledger entries).")
  if set(source) != set(weights):
    raise errors.InvalidArgumentError(
        f"source names {sorted(source)} and weights names {sorted(weights)} differ; give every source a weight.")
  return {name: sources_lib.resolve_source(source[name]) for name in weights}


def _record_dataset(records: Any, seed: int | None, transform: Callable[[Any], Any] | None,
                    order: _permutation.ShardShuffle | None = None, num_epochs: int | None = None) -> grain.MapDataset:
  # Index e*L + p is record perm_e(p): Grain's shuffle gives each epoch its
  # own permutation for indices past the first epoch (a source wraps around).
  dataset = grain.MapDataset.source(records)
  if order is not None:
    dataset = ShardShuffleDataset(dataset, order, _plan_prefetch.PlanPrefetch.for_source(order, records, num_epochs))
  elif seed is not None:
    dataset = dataset.shuffle(seed=seed)
  if transform is not None:
    dataset = dataset.map(transform)
  return dataset


def _check_shuffle(shuffle: Any, shuffle_window: Any, shard_size: Any, seed: int | None) -> None:
  if shuffle not in _permutation.KINDS:
    raise errors.InvalidArgumentError(
        f"shuffle={_short(shuffle)} must be one of {list(_permutation.KINDS)} (\"global\": Grain's full shuffle, "
        "\"shards\": whole shards, a window of them at a time).")
  if shuffle == _permutation.GLOBAL:
    for name, value in (("shuffle_window", shuffle_window), ("shard_size", shard_size)):
      if value is not None:
        raise errors.InvalidArgumentError(
            f"{name}={_short(value)} applies to shuffle=\"shards\" only; pass shuffle=\"shards\" or drop {name}.")
    return
  if seed is None:
    raise errors.InvalidArgumentError(
        "shuffle=\"shards\" with seed=None: the shard shuffle needs a seed (pass seed=<uint32>), or drop shuffle "
        "to read the source in order.")
  if shuffle_window is not None:
    _check_positive_int("shuffle_window", shuffle_window, "shards shuffled together")
  if shard_size is not None:
    _check_positive_int("shard_size", shard_size, "records per shard; pass None to use the source's files")


def _check_shard_lanes(shard_lanes: Any, shuffle: str, global_batch: int, shard_count: int, *, weights: Any,
                       filtered: bool) -> int:
  """The lanes of shuffle="shards" (1: none), or a refusal naming what stands in the way."""
  if shard_lanes is None:
    return 1
  if shuffle != _permutation.SHARDS:
    raise errors.InvalidArgumentError(
        f"shard_lanes={_short(shard_lanes)} applies to shuffle=\"shards\" only; pass shuffle=\"shards\" or "
        "drop shard_lanes.")
  _check_int_range("shard_lanes", shard_lanes, 1, _permutation.MAX_LANES, "lanes of shards")
  if weights is not None:
    raise errors.InvalidArgumentError(
        f"shard_lanes={shard_lanes} with weights: a mixture's global batch takes each source's records where "
        "its weights fall, not a fixed run of rows per lane, so lanes would not follow processes. Drop "
        "shard_lanes (each process then reads rows of every window).")
  if filtered:
    raise errors.InvalidArgumentError(
        f"shard_lanes={shard_lanes} with filter or pack: their lanes (num_lanes) read the stream in chunks, "
        "not in the shard lanes' rows. Drop shard_lanes.")
  if global_batch % shard_lanes:
    raise errors.InvalidArgumentError(
        f"shard_lanes={shard_lanes} does not divide the global batch of {global_batch} rows (batch_size x "
        f"shard_count={shard_count}): every lane gives each global batch the same number of rows. Use "
        f"shard_lanes={shard_count} (the process count) or another divisor of {global_batch}.")
  return int(shard_lanes)


def _lanes_per_process(lanes: int, lane_rows: int, batch_size: int, shard_count: int) -> int:
  """The most lanes whose rows one process reads of a global batch (rows [i*B, (i+1)*B), lane = row // lane_rows)."""
  return max((i * batch_size + batch_size - 1) // lane_rows - (i * batch_size) // lane_rows + 1
             for i in range(shard_count))


def _shard_order(shuffle: str, records: Any, identity: sources_lib.SourceIdentity, shard_size: int | None,
                 shuffle_window: int | None, seed: int | None, name: str = "", *, lanes: int = 1,
                 lane_rows: int | None = None) -> _permutation.ShardShuffle | None:
  """The order of shuffle="shards" over one source (a mixture's source `name`: its own seed); None otherwise."""
  if shuffle != _permutation.SHARDS:
    return None
  window = _permutation.DEFAULT_WINDOW if shuffle_window is None else int(shuffle_window)
  offsets = _shard_offsets(records, identity, shard_size, name)
  if len(offsets) - 1 > _permutation.MAX_SHARDS:
    raise errors.InvalidArgumentError(
        f"shuffle=\"shards\" over {len(offsets) - 1:,} shards{f' (source {name!r})' if name else ''}: at most "
        f"{_permutation.MAX_SHARDS:,}. Pass a larger shard_size.")
  return _permutation.ShardShuffle(offsets, window, seed, lanes, lane_rows if lanes > 1 else None)


def _shard_offsets(records: Any, identity: sources_lib.SourceIdentity, shard_size: int | None,
                   name: str = "") -> list[int]:
  """The shards of shuffle="shards": blocks of `shard_size` records, or the source's non-empty files."""
  if shard_size is not None:
    return _permutation.block_offsets(identity.length, int(shard_size))
  offsets = sources_lib.file_offsets(records)
  files = None if offsets is None else sorted(set(offsets))  # an empty file is no shard
  if files is None or len(files) < 3:
    what = "is not read from files" if offsets is None else "has one file (with records)"
    example = -(-identity.length // 64)
    which = f"source {name!r}" if name else "the source"
    raise errors.InvalidArgumentError(
        f"shuffle=\"shards\" without shard_size: {which} ({identity.description}) {what}, so it has no "
        f"shards of its own. Pass shard_size=<records per shard> (e.g. shard_size={example}: "
        f"{-(-identity.length // example)} shards of its {identity.length} records), or split the source into "
        "several files.")
  return files


class ShardShuffleDataset(grain.MapDataset):
  """Its parent's records in make_dataset(shuffle="shards")'s order: element i is record order.source(i).

  Past the length it continues into later epochs (each with its own order), as Grain's shuffle does.
  With `prefetch` (a cached source), entering a window prefetches the files the plan reads next.
  """

  def __init__(self, parent: grain.MapDataset, order: _permutation.ShardShuffle,
               prefetch: _plan_prefetch.PlanPrefetch | None = None):
    super().__init__(parent)
    self.order, self.plan_prefetch = order, prefetch

  def __len__(self) -> int:
    return self.order.length

  def __str__(self) -> str:
    return f"ShardShuffleDataset(shards={self.order.shard_count}, window={self.order.window})"

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    if self.plan_prefetch is not None:
      self.plan_prefetch.at(index)
    return self._parent[self.order.source(index)]


def _resolve_sharding(shard_index: Any, shard_count: Any) -> tuple[int, int]:
  if (shard_index is None) != (shard_count is None):
    raise errors.InvalidArgumentError(
        f"shard_index={shard_index!r} and shard_count={shard_count!r}: pass both or "
        "neither (neither means jax.process_index() / jax.process_count())."
    )
  if shard_index is None:
    return jax.process_index(), jax.process_count()
  _check_positive_int("shard_count", shard_count)
  _check_int_range("shard_index", shard_index, 0, shard_count - 1, f"shard_count is {shard_count}")
  return int(shard_index), int(shard_count)


def _check_positive_int(name: str, value: Any, hint: str = "") -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    suffix = f"; {hint}" if hint else ""
    raise errors.InvalidArgumentError(
        f"{name}={value!r} must be a positive integer{suffix}."
    )


def _check_int_range(name: str, value: Any, low: int, high: int, hint: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
    raise errors.InvalidArgumentError(
        f"{name}={value!r} must be an integer in [{low}, {high}] ({hint})."
    )


def _qualified_name(fn: Callable[..., Any]) -> str:
  module = getattr(fn, "__module__", None) or type(fn).__module__
  name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
  return f"{module}.{name}"
