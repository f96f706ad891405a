"""MaxText: exact data for its Grain pretraining, saved and restored by MaxText's own checkpoint code.

The one change on MaxText's side is the train iterator's constructor: in
`maxtext/input_pipeline/input_pipeline_interface.py`,

    from ckpt_iter.maxtext import make_grain_train_iterator

in place of its import of the same name from `grain_data_processing` (or, from
a launcher, the same name assigned on that module). Everything else is
MaxText's: its config keys define the data (files and mixtures, file type,
tokenizer, packing, batch, shuffle, epochs), its per-record pipeline
(`pretrain_preprocessing_pipeline`) makes each row, and its `save_checkpoint`
and `load_state_if_possible` write and read the step's `iter` item, in which
ckpt_iter's state rides. What differs:

- The records are read as `ckpt_iter.make_dataset` reads them: one global
  order, cut into global batches, each host taking its rows. A restart at
  another host count continues at the next record, where MaxText's
  `grain_utility.for_restore` refuses a count it did not write (or pads with
  placeholder hosts, `expansion_factor_real_data`). `for_restore` counts the
  item's files to choose how to read them, so it defers to ckpt_iter for
  ckpt_iter's iterator (`defer_restore`, installed by the constructor; other
  iterators go to MaxText's own).
- Without packing, a mixture keeps how far each source has been read: a
  reweighted mixture, or a source added, continues every source where it
  stopped. A packed mixture cannot change at a restart (its lanes read chunks
  at different stream records): ckpt_iter refuses it naming the weights.
- MaxText's emergency (multi-tier) checkpoints save no data item; with this
  iterator they do (`keep_data_in_emergency_checkpoints`).
- With packing, or with chunking (`use_truncation: false`), rows are made
  per chunk of records in lanes (`make_dataset(pack=..., num_lanes=...)`), so
  a row never depends on the host count: a restart may use any host count
  dividing `num_lanes` and any global batch that is a multiple of it.

Only pretraining input is served (`use_sft`, `use_dpo`, multimodal and
offline distillation are refused by name); MaxText's RL and SFT go through
Tunix, served by `ckpt_iter.tunix`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from typing import Any, Collection, Mapping, Sequence

from ckpt_iter import errors

__all__ = [
    "make_grain_train_iterator", "train_dataset", "check_config", "sources", "source_name", "defer_restore",
    "keep_data_in_emergency_checkpoints", "emergency_data_root",
    "makes_rows_from_chunks", "TrainData", "MaxTextRows", "MaxTextRow", "FILE_TYPES", "MIXTURE_CHANGES",
    "PACKING_BINS",
]

_LOG = logging.getLogger("ckpt_iter")

FILE_TYPES = ("arrayrecord", "parquet", "jsonl")
"""MaxText `grain_file_type`s read (JSONL is ckpt_iter's addition: MaxText 0.2.5's Grain input has none)."""

MIXTURE_CHANGES = frozenset({"weights", "sources"})
"""What a restore accepts by default besides the host count: a mixture's weights and sources.

Each source continues at its own next record.
"""

PACKING_BINS = 16
"""The rows a lane packs into at once: a constant, so that a row never depends on the host count."""

# MaxText settings this input cannot honour, each with what to set instead.
_REFUSED = (
    ("use_sft", True, "SFT goes through Tunix's PeftTrainer: use ckpt_iter.tunix's trainer"),
    ("use_dpo", True, "DPO goes through Tunix: use ckpt_iter.tunix's DPO trainer"),
    ("use_multimodal", True, "only text pretraining input is served; set use_multimodal=false"),
    ("is_offline_distillation", True, "only text pretraining input is served"),
    ("colocated_python_data_input", True,
     "the input runs on each host here; set colocated_python_data_input=false"),
)


# A mixture config larger than this is refused unread (MaxText's is a few lines of JSON).
MIXTURE_CONFIG_BYTES = 1 << 20


def make_grain_train_iterator(
    config: Any,
    global_mesh: Any,
    process_indices: Sequence[int],
    *,
    num_lanes: int | None = None,
    packing_bins: int = PACKING_BINS,
    chunk_size: int = 256,
    allow_drift: Collection[str] = MIXTURE_CHANGES,
) -> Any:
  """MaxText's `make_grain_train_iterator`, reading with ckpt_iter: exact at any host count.

  Args:
    config: MaxText's config (`pyconfig.HyperParameters`).
    global_mesh: the mesh MaxText shards each global batch over.
    process_indices: the processes loading data (every process: ckpt_iter
      needs no placeholder hosts).
    num_lanes: with packing or chunking, the lanes rows are made in; a
      restart may use any host count dividing it and any global batch that is
      a multiple of it. Defaults to the global batch; keep the first run's
      value when the global batch changes (the restore names it otherwise).
    packing_bins: the rows a lane packs into at once (MaxText packs into its
      local batch, which changes with the host count); fixed for the run.
    chunk_size: the records a lane packs as one unit.
    allow_drift: what a restore accepts as changed (besides the host count):
      by default a mixture's weights and sources.

  Returns:
    MaxText's `MultiHostDataLoadIterator` over `TrainData`, which MaxText's
    `save_checkpoint` / `load_state_if_possible` save and restore in the
    step's `iter` item.
  """
  import jax  # pylint: disable=g-import-not-at-top
  multihost_dataloading = _maxtext("maxtext.input_pipeline.multihost_dataloading")
  check_config(config)
  if jax.process_index() not in process_indices:
    raise errors.UnsupportedConfigError(
        f"process {jax.process_index()} loads no data (process_indices={list(process_indices)}): ckpt_iter "
        "reads on every host; unset expansion_factor_real_data")
  dataset = train_dataset(
      config, shard_index=list(process_indices).index(jax.process_index()), shard_count=len(process_indices),
      num_lanes=num_lanes, packing_bins=packing_bins, chunk_size=chunk_size)
  defer_restore()
  keep_data_in_emergency_checkpoints()
  return multihost_dataloading.MultiHostDataLoadIterator(
      TrainData(dataset, allow_drift=allow_drift), global_mesh, config.generate_padding_batch_train)


def check_config(config: Any) -> None:
  """Refuses, naming the key, a MaxText setting this input cannot honour exactly."""
  for key, refused, instead in _REFUSED:
    if getattr(config, key, None) == refused:
      raise errors.UnsupportedConfigError(f"MaxText config {key}={refused!r}: {instead}")
  if len(config.train_data_columns) != 1:
    raise errors.UnsupportedConfigError(
        f"MaxText config train_data_columns={list(config.train_data_columns)!r}: pretraining reads one text "
        "column; name one")
  if config.grain_file_type not in FILE_TYPES:
    raise errors.UnsupportedConfigError(
        f"MaxText config grain_file_type={config.grain_file_type!r}: ckpt_iter reads {', '.join(FILE_TYPES)}")
  expansion = float(config.expansion_factor_real_data)
  if expansion not in (-1.0, 1.0):
    raise errors.UnsupportedConfigError(
        f"MaxText config expansion_factor_real_data={config.expansion_factor_real_data}: not needed, "
        "ckpt_iter restores at another host count by itself; unset it (-1)")
  if not isinstance(config.num_epoch, int) or config.num_epoch < 1:
    raise errors.UnsupportedConfigError(
        f"MaxText config num_epoch={config.num_epoch!r}: set a number of passes (1 or more)")


def train_dataset(
    config: Any, *, shard_index: int, shard_count: int, num_lanes: int | None = None,
    packing_bins: int = PACKING_BINS, chunk_size: int = 256,
) -> Any:
  """The `make_dataset` pipeline of a MaxText config: this host's rows of each global batch."""
  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top

  global_batch = int(config.global_batch_size_to_load)
  if global_batch % shard_count:
    raise errors.UnsupportedConfigError(
        f"MaxText global_batch_size_to_load={global_batch} does not divide among {shard_count} hosts: "
        "set per_device_batch_size so that it does")
  source, weights = sources(config)
  common = dict(weights=weights, batch_size=global_batch // shard_count, shard_index=shard_index,
                shard_count=shard_count, seed=config.data_shuffle_seed if config.enable_data_shuffling else None)
  if not makes_rows_from_chunks(config):
    # One row per record: read as any make_dataset, so the run ends after num_epoch passes, as MaxText's.
    dataset = dataset_lib.make_dataset(source, transform=MaxTextRow(config), num_epochs=config.num_epoch, **common)
  else:
    # Rows made per lane have no end every host sees at the same step (make_dataset's lanes): MaxText's
    # `steps` ends the run; a source read to its end starts its next pass, each record once per pass.
    _LOG.warning(
        "ckpt_iter.maxtext: num_epoch=%s is not an end with packing or chunking: rows continue into the "
        "source's next pass (a new permutation, each record once per pass) until MaxText's steps=%s, where "
        "MaxText's own iterator would stop training at the end of pass %s", config.num_epoch,
        getattr(config, "steps", None), config.num_epoch)
    dataset = dataset_lib.make_dataset(
        source, num_epochs=None, pack=MaxTextRows(config, packing_bins), num_lanes=num_lanes or global_batch,
        chunk_size=chunk_size, **common)
  workers = int(config.grain_worker_count)
  if workers == 0:
    return dataset
  import grain  # pylint: disable=g-import-not-at-top
  if isinstance(dataset, grain.MapDataset):  # one row per record: worker processes read an IterDataset
    dataset = dataset.to_iter_dataset()
  if workers < 0:
    options = grain.experimental.pick_performance_config(
        ds=dataset, ram_budget_mb=config.grain_ram_budget_mb, max_workers=None, max_buffer_size=None,
    ).multiprocessing_options
  else:
    options = grain.MultiprocessingOptions(
        num_workers=workers, per_worker_buffer_size=config.grain_per_worker_buffer_size)
  return dataset.mp_prefetch(options)


def makes_rows_from_chunks(config: Any) -> bool:
  """Whether rows are made from several records (packing) or several rows from one (chunking a long text).

  Then they are made per chunk of records in lanes; otherwise one row per record, by the record.
  """
  return bool(config.packing) or (bool(config.tokenize_train_data) and not config.use_truncation)


def sources(config: Any) -> tuple[Any, dict[str, float] | None]:
  """The files of `grain_train_files` (or the mixture of `grain_train_mixture_config_path`), by name."""
  if config.grain_train_mixture_config_path:
    from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
    mixture = json.loads(_storage.read_bytes(config.grain_train_mixture_config_path, max_bytes=MIXTURE_CONFIG_BYTES))
    parts = [(name, entry["path"], float(entry["weight"])) for name, entry in mixture.items()]
  elif ";" in config.grain_train_files:
    parts = []
    for part in config.grain_train_files.split(";"):
      pattern, _, weight = part.rpartition(",")
      if not pattern:
        raise errors.InvalidArgumentError(
            f"MaxText config grain_train_files: {part!r} is not 'pattern,weight' (a mixture is "
            "'pattern,weight;pattern,weight')")
      parts.append((pattern, pattern, float(weight)))
  else:
    return _source(config, config.grain_train_files), None
  named = {}
  for name, pattern, weight in parts:
    key = source_name(name)
    if key in named:
      raise errors.InvalidArgumentError(
          f"MaxText mixture: sources {name!r} and {named[key][0]!r} both take the name {key!r}")
    named[key] = (name, _source(config, pattern), weight)
  return {k: v[1] for k, v in named.items()}, {k: v[2] for k, v in named.items()}


def source_name(name: str) -> str:
  """A mixture source's name in ckpt_iter's state: the pattern (or config key) as an identifier."""
  key = re.sub(r"\W+", "_", name).strip("_") or "source"
  return key if key[0].isalpha() else f"s_{key}"


def _source(config: Any, pattern: str) -> Any:
  """The files of `pattern` as ckpt_iter reads them: sorted (MaxText's local glob is in directory order,
  which another host may list otherwise), and on gs:// each object pinned at its generation."""
  if pattern.startswith("hf://"):
    raise errors.UnsupportedConfigError(
        f"MaxText config grain_train_files={pattern!r}: hf:// files are not read here; download them, or "
        "read the dataset with ckpt_iter.sources.HuggingFaceSource")
  if config.grain_file_type == "arrayrecord":
    import grain  # pylint: disable=g-import-not-at-top
    from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
    files = _storage.glob(pattern) if _storage.has_magic(pattern) else [pattern]
    if not files:
      raise errors.InvalidArgumentError(f"MaxText config grain_train_files: no file matches {pattern!r}")
    # MaxText's records are serialized tf.Example protos, parsed by its own pipeline.
    return grain.sources.ArrayRecordDataSource(files)
  return pattern


class _ConfigView:
  """A MaxText config with a few values replaced (picklable, for worker processes)."""

  def __init__(self, config: Any, **overrides: Any):
    self.__dict__["_config"] = config
    self.__dict__["_overrides"] = overrides

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__"):
      raise AttributeError(name)
    overrides = self.__dict__["_overrides"]
    return overrides[name] if name in overrides else getattr(self.__dict__["_config"], name)

  def __getstate__(self) -> dict[str, Any]:
    return dict(self.__dict__)

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)


class MaxTextRows:
  """The rows of a chunk of records, made by the stages of MaxText's own `pretrain_preprocessing_pipeline`.

  Run as MaxText runs them for its elastic iterator: per row, before batching
  (parse, tokenize, pack or pad, shift: `format_and_batch`), with
  `packing_bins` bins, a number fixed for the run where MaxText packs into its
  local batch (which changes with the host count). The tokenizer is built
  once per process, not per chunk.
  """

  def __init__(self, config: Any, packing_bins: int):
    self._config = config
    self.packing_bins = packing_bins
    self._tokenizer: tuple[Any, int] | None = None

  def __getstate__(self) -> dict[str, Any]:
    return {"_config": self._config, "packing_bins": self.packing_bins}  # a worker builds its own tokenizer

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["_config"], state["packing_bins"])

  def __call__(self, records: Any) -> Any:
    utils = _maxtext("maxtext.input_pipeline.data_processing_utils")
    grain_tokenizer = _maxtext("maxtext.input_pipeline.grain_tokenizer")
    input_pipeline_utils = _maxtext("maxtext.input_pipeline.input_pipeline_utils")
    config = _ConfigView(self._config, grain_use_elastic_iterator=True, elastic_enabled=False,
                         expansion_factor_real_data=-1)
    if self._tokenizer is None:
      self._tokenizer = utils.get_tokenizer_and_pad_id(config)
    tokenizer_model, pad_id = self._tokenizer
    (column,) = columns = list(self._config.train_data_columns)
    tokenize, length = self._config.tokenize_train_data, self._config.max_target_length
    rows = utils.parse_and_keep_features(records, config, columns, tokenize)
    if tokenize and config.use_truncation:
      rows = rows.map(grain_tokenizer.TokenizeAndTrim(column, length, tokenizer_model))
    elif tokenize:
      rows = rows.apply(grain_tokenizer.TokenizeAndChunk(column, length, tokenizer_model))
    rows = rows.map(input_pipeline_utils.Rekey({"inputs": column, "targets": column}))
    return utils.format_and_batch(rows, config, self.packing_bins, pad_id, ("inputs", "targets"), tokenizer_model)


class _OneRecord:
  """A one-record source whose record each thread sets before reading it (MaxTextRow's pipeline input)."""

  def __init__(self):
    self.local = threading.local()

  def __len__(self) -> int:
    return 1

  def __getitem__(self, index: int) -> Any:
    return self.local.record


class MaxTextRow:
  """The row of one record, made by MaxText's own `pretrain_preprocessing_pipeline` (without packing).

  The pipeline is built once per process, over a one-record source, as
  MaxText's elastic iterator runs it (per row: parse, tokenize and trim, pad,
  shift); each call reads the record through it.
  """

  def __init__(self, config: Any):
    self._config = config
    self._built: tuple[_OneRecord, Any] | None = None
    self._lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    return {"_config": self._config}  # a worker process builds its own pipeline

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["_config"])

  def __call__(self, record: Any) -> Any:
    if self._built is None:
      with self._lock:
        if self._built is None:
          self._built = self._build()
    slot, rows = self._built
    slot.local.record = record
    return rows[0]

  def _build(self) -> tuple[_OneRecord, Any]:
    import grain  # pylint: disable=g-import-not-at-top
    grain_data_processing = _maxtext("maxtext.input_pipeline.grain_data_processing")
    slot = _OneRecord()
    config = _ConfigView(self._config, grain_use_elastic_iterator=True, elastic_enabled=False,
                         expansion_factor_real_data=-1)
    rows = grain_data_processing.pretrain_preprocessing_pipeline(
        grain.MapDataset.source(slot), config, data_columns=list(self._config.train_data_columns),
        tokenize=self._config.tokenize_train_data, grain_worker_count=0, grain_per_worker_buffer_size=1)
    return slot, rows


class TrainData:
  """The iterator MaxText reads and checkpoints: ckpt_iter's, in MaxText's `iter` item.

  MaxText's `GrainCheckpointable` hands the save and load to an iterator's own
  `save(directory)` / `load(directory)` (Orbax v1's StatefulCheckpointable);
  these write ckpt_iter's files and restore at another host count
  (`elastic`), accepting `allow_drift`'s changes.
  """

  def __init__(self, dataset: Any, *, allow_drift: Collection[str] = MIXTURE_CHANGES):
    from ckpt_iter import iterator as iterator_lib  # pylint: disable=g-import-not-at-top
    self.iterator = iterator_lib.DataIterator(dataset)
    self.allow_drift = frozenset(allow_drift)

  def __iter__(self) -> "TrainData":
    # MaxText's reset() builds the local iterator again with iter(): the position stays.
    return self

  def __next__(self) -> Any:
    return next(self.iterator)

  def get_state(self) -> dict[str, Any]:
    """The iterator's state (Grain's protocol)."""
    return self.iterator.get_state()

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores a state from `get_state` (Grain's protocol)."""
    self.iterator.set_state(state)

  async def save(self, directory: Any) -> Any:
    """Orbax v1 calls this: takes the state now; returns the write of this process's files."""
    from ckpt_iter import _item  # pylint: disable=g-import-not-at-top
    return await _item.v1_save(self.iterator, directory)

  def save_to(self, root: str, step: int) -> None:
    """Writes this process's state as step `step`'s data item under `root` (`<root>/<step>/iter`), now."""
    from ckpt_iter import _item  # pylint: disable=g-import-not-at-top
    from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
    directory = f"{root}/{step}/iter"
    if not _storage.is_url(directory):  # an object store has no directories to make
      os.makedirs(directory, exist_ok=True)
    header, arrays = _item.snapshot(self.iterator, step)
    _item.write(directory, header, arrays, *_item.process())

  def load_from(self, root: str, step: int) -> None:
    """Restores step `step`'s data item under `root`, at any saved host count.

    A step without one (saved before ckpt_iter's iterator was installed)
    leaves the data at its first record, as MaxText's own emergency restore
    does, and logs a warning that says so.
    """
    from ckpt_iter import _item  # pylint: disable=g-import-not-at-top
    directory = f"{root}/{step}/iter"
    try:
      saved = _item.read_item(directory, *_item.process(), elastic=True)
    except (errors.ItemNotFoundError, FileNotFoundError):
      _LOG.warning(
          "ckpt_iter.maxtext: MaxText's emergency checkpoint of step %s has no data item (%s): the data starts "
          "again at its first record, as MaxText's own emergency restore starts it, so the records trained "
          "before step %s are trained again", step, directory, step)
      return
    _item.check_restore_saved(self.iterator, saved, allow_drift=self.allow_drift)()

  async def load(self, directory: Any) -> Any:
    """Orbax v1 calls this: reads this process's state at any saved host count; returns its apply."""
    from ckpt_iter import _item  # pylint: disable=g-import-not-at-top
    return await _item.v1_load(self.iterator, directory, allow_drift=self.allow_drift, elastic=True)


def defer_restore() -> None:
  """Makes MaxText's `grain_utility.for_restore` hand ckpt_iter's iterator its own load.

  MaxText chooses how to read a step's `iter` item by counting its
  `process_*-of-*.json` files: another host count than the files' is refused
  (or read as placeholder hosts' shards). ckpt_iter reads any count itself, so
  for a `TrainData` the files are not counted; any other iterator gets
  MaxText's own `for_restore`. Installed once; idempotent.
  """
  grain_utility = _maxtext("maxtext.common.grain_utility")
  if getattr(grain_utility.for_restore, "ckpt_iter_defers", False):
    return
  stock = grain_utility.for_restore

  @functools.wraps(stock)
  def for_restore(checkpoint_manager: Any, step: int, data_iterator: Any, expansion_factor_real_data: int) -> Any:
    local = getattr(data_iterator, "local_iterator", None)
    if isinstance(local, TrainData):
      return grain_utility.GrainCheckpointable(local)
    return stock(checkpoint_manager, step, data_iterator, expansion_factor_real_data)

  for_restore.ckpt_iter_defers = True  # type: ignore[attr-defined]
  grain_utility.for_restore = for_restore


def emergency_data_root(checkpoint_manager: Any) -> str:
  """Where the data items of an emergency manager's steps are: beside its (persistent) directory.

  `<directory>-ckpt_iter-data/<step>/iter`: outside the directories Orbax's
  emergency manager lists and deletes, on storage every host reads.
  """
  return str(checkpoint_manager.directory).rstrip("/") + "-ckpt_iter-data"


def keep_data_in_emergency_checkpoints() -> None:
  """Makes MaxText's emergency checkpoints carry the data item, and its emergency restore apply it.

  MaxText's emergency and replicator managers (Orbax's multi-tier
  checkpointing) save the train state alone: `save_checkpoint` hands them no
  data iterator and `load_state_if_possible` restores none, so a run resumed
  from one starts its data again at the first record. For a `TrainData`
  iterator, `save_checkpoint` here writes its state first, for every step
  the manager will save (`emergency_data_root`), and `load_state_if_possible`
  restores the step the manager restores, at any host count (a step saved
  without one: `TrainData.load_from`). Installed once,
  idempotent; other iterators and managers go to MaxText's own functions.
  """
  import inspect  # pylint: disable=g-import-not-at-top
  checkpointing = _maxtext("maxtext.common.checkpointing")
  if getattr(checkpointing.save_checkpoint, "ckpt_iter_keeps_data", False):
    return
  stock_save, stock_load = checkpointing.save_checkpoint, checkpointing.load_state_if_possible
  managers = (checkpointing.EmergencyCheckpointManager, checkpointing.EmergencyReplicatorCheckpointManager)
  load_signature = inspect.signature(stock_load)

  @functools.wraps(stock_save)
  def save_checkpoint(checkpoint_manager, step, state, config=None, data_iterator=None, force=False):
    data = getattr(data_iterator, "local_iterator", None)
    if (isinstance(checkpoint_manager, managers) and isinstance(data, TrainData)
        and (force or checkpoint_manager.should_save(step))):
      # Before the state: a step Orbax commits has its data item complete.
      data.save_to(emergency_data_root(checkpoint_manager), step)
      saved = stock_save(checkpoint_manager, step, state, config, data_iterator, force)
      _drop_data_items_before(emergency_data_root(checkpoint_manager), checkpoint_manager.all_steps())
      return saved
    return stock_save(checkpoint_manager, step, state, config, data_iterator, force)

  @functools.wraps(stock_load)
  def load_state_if_possible(*args: Any, **kwargs: Any) -> Any:
    bound = load_signature.bind(*args, **kwargs)
    bound.apply_defaults()
    checkpoint_manager, data_iterator = bound.arguments["checkpoint_manager"], bound.arguments["data_iterator"]
    data = getattr(data_iterator, "local_iterator", None)
    if not (isinstance(checkpoint_manager, managers) and isinstance(data, TrainData)):
      return stock_load(*args, **kwargs)
    step = bound.arguments["step"]
    step = checkpointing.latest_step(checkpoint_manager) if step < 0 else step
    restored = stock_load(*args, **kwargs)
    if step is not None and restored[0] is not None:
      data.load_from(emergency_data_root(checkpoint_manager), step)
    return restored

  save_checkpoint.ckpt_iter_keeps_data = True  # type: ignore[attr-defined]
  checkpointing.save_checkpoint = save_checkpoint
  checkpointing.load_state_if_possible = load_state_if_possible


def _drop_data_items_before(root: str, kept_steps: Collection[int]) -> None:
  """Process 0 deletes the data items of the steps the manager deleted (older than every step it keeps).

  Steps newer than its oldest are left, whether it lists them or not: an
  asynchronous save it has not committed yet is not listed.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0 or not kept_steps:
    return
  oldest = min(kept_steps)
  for name in _storage.list_names(root):
    if name.isdigit() and int(name) < oldest:
      _storage.remove_tree(f"{root}/{name}")


def _maxtext(module: str) -> Any:
  import importlib  # pylint: disable=g-import-not-at-top
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise errors.MissingPackageError(
        f"ckpt_iter.maxtext needs MaxText ({module} did not import: {e}); pip install maxtext") from e
