"""make_dataset: the Grain MapDataset that training configs build.

The pipeline is defined over *global* batches so that its position means the
same thing on every process and for every process count:

  epoch e, global batch t, process i, row j  ->  record perm_e(t*G + i*B + j)

where B is the per-process batch size, G = B * shard_count the global batch
size and perm_e the epoch's permutation (the identity without a seed). Element
k of the dataset is the k-th local batch of this process; all processes agree
on k, so a checkpoint's `next_index` is a global position and a run can resume
with another process count as long as G is the same (see docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from typing import Any, Callable

import grain
import jax
import numpy as np

from ckpt_iter import _graph
from ckpt_iter import _stacking
from ckpt_iter import errors
from ckpt_iter import sources as sources_lib

# A fingerprint field saying the position means the same on every process
# (set for Grain's ElasticIterator; make_dataset says it by global_batch_size).
POSITION_SCOPE_FIELD = "position_scope"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """The defining fields of a make_dataset pipeline."""

  source: sources_lib.SourceIdentity
  batch_size: int
  seed: int | None
  num_epochs: int | None
  drop_remainder: bool
  shard_index: int
  shard_count: int
  transform: str | None

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.shard_count

  @property
  def batches_per_epoch(self) -> int:
    full, rest = divmod(self.source.length, self.global_batch_size)
    return full + (1 if rest and not self.drop_remainder else 0)

  def fingerprint(self) -> dict[str, Any]:
    return {
        "source": self.source.description,
        "source_length": self.source.length,
        "source_digest": self.source.digest,
        "seed": self.seed,
        "num_epochs": self.num_epochs,
        "drop_remainder": self.drop_remainder,
        "batch_size": self.batch_size,
        "global_batch_size": self.global_batch_size,
        "batches_per_epoch": self.batches_per_epoch,
        "shard_index": self.shard_index,
        "shard_count": self.shard_count,
        "transform": self.transform,
    }


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
) -> grain.MapDataset:
  """Builds the batched Grain dataset of a training config.

  Args:
    source: a list of records (dicts); a path, glob or list of paths to
      `.jsonl`, `.parquet` or `.array_record` files (read lazily, never loaded
      whole); or any random-access data source (`__len__`, `__getitem__`).
    batch_size: records per batch on this process.
    seed: shuffle seed; every epoch is a different permutation. None: no shuffle.
    num_epochs: passes over the source; None repeats forever.
    drop_remainder: drop the last short batch of each epoch. Must be True when
      shard_count > 1, so that every process takes the same number of steps.
    shard_index: this process's shard; defaults to `jax.process_index()`.
    shard_count: number of shards; defaults to `jax.process_count()`.
    transform: a per-record function (e.g. tokenization), applied lazily.

  Returns:
    A `grain.MapDataset` of dict batches of numpy arrays with a leading batch
    dimension (`{"prompts": array([...]), ...}`), the input format of a Tunix
    RL learner. Iterate it with `ckpt_iter.DataIterator` to checkpoint it.

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
  if transform is not None and not callable(transform):
    raise errors.InvalidArgumentError(
        f"transform={transform!r} is not callable; pass a function record -> record."
    )
  records, identity = sources_lib.resolve_source(source)
  spec = DatasetSpec(
      source=identity,
      batch_size=batch_size,
      seed=seed,
      num_epochs=num_epochs,
      drop_remainder=drop_remainder,
      shard_index=shard_index,
      shard_count=shard_count,
      transform=None if transform is None else _qualified_name(transform),
  )
  if spec.batches_per_epoch == 0:
    raise errors.InvalidArgumentError(
        f"source has {identity.length} records, fewer than one global batch of "
        f"{spec.global_batch_size} (batch_size={batch_size} x shard_count={shard_count}); "
        "the dataset would be empty. Use a smaller batch_size or drop_remainder=False."
    )
  # Index e*L + p of `records_ds` is record perm_e(p): Grain's shuffle gives
  # each epoch its own permutation for indices past the first epoch.
  records_ds = grain.MapDataset.source(records)
  if seed is not None:
    records_ds = records_ds.shuffle(seed=seed)
  if transform is not None:
    records_ds = records_ds.map(transform)
  return GlobalBatchDataset(records_ds, spec)


class GlobalBatchDataset(grain.MapDataset):
  """This process's rows of each global batch, stacked into one batch.

  Element k is local batch k: epoch k // batches_per_epoch, global batch
  k % batches_per_epoch within it. Carries the DatasetSpec that fingerprints it.
  """

  def __init__(self, parent: grain.MapDataset, spec: DatasetSpec):
    super().__init__(parent)
    self.spec = spec
    self._epoch_length = spec.source.length
    self._batches_per_epoch = spec.batches_per_epoch
    if spec.num_epochs is None:
      self._length = sys.maxsize
    else:
      self._length = spec.batches_per_epoch * spec.num_epochs

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    shard = f"{self.spec.shard_index}/{self.spec.shard_count}"
    return f"GlobalBatchDataset(batch_size={self.spec.batch_size}, shard={shard})"

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    # Past the length is allowed: Grain's MapDataset contract, on which a
    # `repeat` after make_dataset relies. It continues into later epochs,
    # each with its own permutation, as Grain's shuffle does.
    if index < 0:
      raise IndexError(f"batch index {index} is negative")
    epoch, batch = divmod(index, self._batches_per_epoch)
    first = batch * self.spec.global_batch_size + self.spec.shard_index * self.spec.batch_size
    last = min(first + self.spec.batch_size, self._epoch_length)
    base = epoch * self._epoch_length
    records = [self._parent[base + p] for p in range(first, last)]
    return stack_records(records, batch_index=index)


def stack_records(records: list[Any], *, batch_index: int | None = None) -> Any:
  """Stacks records into one batch: leaves gain a leading batch dimension.

  Raises:
    InvalidArgumentError: the records' fields differ in shape or keys; names
      the field, the rows and their shapes (`_stacking`).
  """
  if not records:
    raise ValueError("cannot stack an empty list of records")
  # A list in a record is data (a JSON array, a Parquet list), not structure:
  # it becomes one array with the batch dimension in front.
  try:
    return jax.tree.map(
        lambda *leaves: np.stack([np.asarray(x) for x in leaves]), *records,
        is_leaf=lambda x: isinstance(x, list),
    )
  except (ValueError, TypeError) as e:  # diagnosed only now: the happy path pays nothing
    raise _stacking.unstackable_error(records, batch_index, e) from None


def find_spec(dataset: Any) -> tuple[DatasetSpec | None, list[str]]:
  """Finds the make_dataset spec of a pipeline and the node types above it.

  Returns:
    (spec or None, class names of the nodes between `dataset` and the
    make_dataset node, outermost first; the whole chain when there is none).
  """
  node, above = _find_spec_node(dataset)
  return (None if node is None else node.spec), above


def _find_spec_node(dataset: Any) -> tuple["GlobalBatchDataset | None", list[str]]:
  # Follows single parents only: `pipeline` (elastic.resize_refusal parses
  # it) keeps the meaning it had when older states were written.
  above: list[str] = []
  node = dataset
  while node is not None:
    if isinstance(node, GlobalBatchDataset):
      return node, above
    above.append(type(node).__name__)
    parents = getattr(node, "parents", ())
    node = parents[0] if len(parents) == 1 else None
  return None, above


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


def describe_pipeline(dataset: Any) -> dict[str, Any]:
  """The fingerprint fields of any Grain dataset (make_dataset or hand-built).

  Returns:
    make_dataset's spec fields (when the pipeline has its node on a chain of
    single parents), `pipeline` (class names of the nodes above that node, or
    of the whole chain, joined by "<"), `dataset_length`, and the graph fields
    of `_graph.describe_graph` (`graph`, `node[i].Kind.param`): every node's
    kind and defining parameters, through mp_prefetch.
  """
  spec_node, above = _find_spec_node(dataset)
  fields: dict[str, Any] = {}
  if spec_node is not None:
    fields.update(spec_node.spec.fingerprint())
  if type(dataset).__name__ == "ElasticIterator":
    # Its state ({"global_next_index"}) is the same on every process and for
    # every process count: the position is global (elastic.resize_refusal).
    try:
      fields.update(_graph.elastic_fields(dataset))
      fields[POSITION_SCOPE_FIELD] = "global"
    except AttributeError:  # another Grain release: no elastic resume
      pass
  fields["pipeline"] = "<".join(above) if above else ""
  try:
    fields["dataset_length"] = len(dataset)
  except TypeError:
    fields["dataset_length"] = None
  fields.update(_graph.describe_graph(dataset, described_spec_node=spec_node))
  return fields
