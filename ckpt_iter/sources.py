"""Random-access record sources: in-memory, JSONL, Parquet, ArrayRecord, Hugging Face; what make_dataset reads.

Every source here has `__len__` and `__getitem__` (Grain's RandomAccessDataSource
protocol), returns one record (a dict) per index, and reads files lazily: a
JSONL file by the byte ranges of its lines (`_jsonl`, its own module: the line
index and its cache); Parquet one row group at a time; ArrayRecord files hold
one UTF-8 JSON object per record; a Hugging Face `datasets.Dataset` is Arrow
memory-mapped from its cache. All are picklable, so Grain worker processes can
use them. `resolve_source` turns make_dataset's `source` argument into one of
them and its `SourceIdentity` (description, length, digest).

File paths may be local or URLs (gs://...): JSONL and Parquet files are read
through `_storage` (fsspec), ArrayRecord files by array_record's own reader,
which opens gs:// itself; the paths a file source takes are `_source_files`'.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import threading
from typing import Any

import numpy as np

from ckpt_iter import _cached_files
from ckpt_iter import _compression
from ckpt_iter import _hf
from ckpt_iter import _shard_cache
from ckpt_iter import _source_files
from ckpt_iter import _storage
from ckpt_iter._jsonl import JsonlSource
from ckpt_iter._shard_cache import ShardCache
from ckpt_iter import errors

__all__ = [
    "ArrayRecordSource",
    "HuggingFaceSource",
    "JsonlSource",
    "ParquetSource",
    "ShardCache",
    "SourceIdentity",
    "resolve_source",
]

_log = logging.getLogger(__name__)
_DIGEST_SAMPLES = 64
_LISTED_FILES = 4


@dataclasses.dataclass(frozen=True)
class SourceIdentity:
  """What identifies a source in a fingerprint.

  Attributes:
    description: kind and file names with byte sizes (not absolute paths, so
      a checkpoint survives moving the data to another mount point).
    length: number of records.
    digest: sha256 prefix over up to 64 evenly spaced records; for files
      on an object store, over each file's name, size and version
      (generation and crc32c) instead, from metadata fetched in parallel
      (`sample_digest`): a rewritten object changes it either way.
  """

  description: str
  length: int
  digest: str
  # The files and their identities when built (a file source): what a refused restore names as changed. Not
  # compared, not saved.
  files: tuple[tuple[str, _storage.Identity], ...] = dataclasses.field(default=(), compare=False, repr=False)


# A shuffled read returns to a row group once for each of its rows, and decoding it is the cost: the groups a
# process read last are kept, up to this many bytes (their Arrow size) by default.
_DECODED_GROUP_BYTES = 256 * 2**20


class _DecodedGroups:
  """A process's decoded Parquet row groups, least recently read first, up to `max_bytes` (and at least one).

  Shared by the process's threads; a forked or unpickled copy starts empty.
  """

  def __init__(self, max_bytes: int):
    self.max_bytes = max(0, int(max_bytes))
    self._init_local()

  def _init_local(self) -> None:
    self._tables: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._bytes = 0
    self._lock = threading.Lock()
    self._pid = os.getpid()

  def __getstate__(self) -> dict[str, Any]:
    return {"max_bytes": self.max_bytes}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._init_local()

  def get(self, group: int) -> Any:
    if self._pid != os.getpid():
      self._init_local()
    with self._lock:
      table = self._tables.get(group)
      if table is not None:
        self._tables.move_to_end(group)
      return table

  def put(self, group: int, table: Any) -> Any:
    with self._lock:
      if group not in self._tables:
        self._tables[group] = table
        self._bytes += table.nbytes
      while self._bytes > self.max_bytes and len(self._tables) > 1:
        _, dropped = self._tables.popitem(last=False)
        self._bytes -= dropped.nbytes
    return table


class ParquetSource(_cached_files.FilesThroughCache):
  """Records of one or more Parquet files, decoded one row group at a time.

  A row group is decoded whole; the decoded groups a process read last are
  kept up to `decoded_bytes` (shared by its threads), so a shuffle whose
  reads stay within that many bytes of groups decodes each group once (a
  global shuffle of a larger corpus decodes a group per record it misses:
  write small row groups, e.g. 1k rows, or read it with shuffle="shards").
  On gs:// each file is read at the generation it had when the source was
  built: a file replaced later is refused, not read half old, half new.

  Args:
    paths: the Parquet files (local or gs://), in order: one path, a glob,
      or a list of them (a glob's matches sorted).
    cache: a `ShardCache`: each file is downloaded whole into it on its first
      read and read there; the build reads only the files' footers (their
      row groups), so a corpus larger than the cache reads through it a
      window at a time with make_dataset(shuffle="shards"), as JSONL does;
      what a footer says is kept in the cache, so a restart reads none.
      None reads the files in place.
    prefetch_files: with `cache`, how many files after the one a reader
      enters to download ahead (0: none, neither by index nor by a plan).
    decoded_bytes: the decoded row groups kept per process (their Arrow
      size), least recently read dropped first; at least the last group read
      is kept.
    max_open_files: with `cache`, how many copies a process keeps open (in
      use, so never evicted; each read by pyarrow's own file, its footer
      parsed once) at most.
    corpus_index: with `cache`, take each file's row groups from the index
      object `ckpt-iter index` wrote beside the files, when it indexes the
      file as it is now: a new host reads one small object per directory,
      not every footer (as for JSONL).
    files_from_index: name the files, and on an object store take their
      versions, from the index objects of their directories instead of
      listing the store (as for JSONL; with `cache`, one read per directory
      at a start, in place one footer read a file besides; the index is
      then the corpus).
  """

  suffixes = (".parquet",)

  def __init__(self, paths: _source_files.PathsArg, *, cache: _shard_cache.ShardCache | None = None,
               prefetch_files: int = 2, decoded_bytes: int = _DECODED_GROUP_BYTES, max_open_files: int = 16,
               corpus_index: bool = True, files_from_index: bool = False):
    """Reads the footers of `paths` (pinned to their current generation on gs://); see the class docstring."""
    _source_files.check_index_options("ParquetSource", corpus_index, files_from_index)
    pq = _import_pyarrow_parquet()
    expanded = _source_files.expand_paths(paths, "ParquetSource", files_from_index=files_from_index)
    self._paths = [_storage.absolute(p) for p in expanded]
    self._cache = cache
    self._prefetch_files = max(0, int(prefetch_files))
    self._planned = False
    self._indexed: set[str] = set()  # the files whose row groups came from a corpus index object
    if cache is not None:
      self._identities = _storage.identities(self._paths, listed=getattr(expanded, "listed", None))
      # Each footer read where the file is, at the generation the identity pins: a few small reads a file.
      self._generations: list[str | None] = [found.generation for found in self._identities]
      self._copies = _cached_files.OpenReaders(cache, self._paths, self._identities, max(1, int(max_open_files)),
                                               kind="parquet")
      group_rows, self._indexed = _cached_files.known_footers(
          cache, self._paths, self._identities, use_index=corpus_index, row_groups=True,
          indexes=getattr(expanded, "indexes", None),
          read=lambda indices: _cached_files.footers(pq, [self._paths[i] for i in indices],
                                                     [self._generations[i] for i in indices],
                                                     [self._identities[i] for i in indices]))
    else:
      # Each file's identity as its glob's listing or the corpus index described it, else asked (a listing per
      # directory; a local file's stat): on an object store its generation is what every later read pins, and
      # its footer is read by ranged GETs of its tail, with no metadata request to open it.
      self._identities = _storage.identities(self._paths, listed=getattr(expanded, "listed", None))
      self._generations = [found.generation for found in self._identities]
      group_rows = _cached_files.footers(pq, self._paths, self._generations, self._identities)
    # (file, group) pairs in order, with the global index of each group's first row.
    self._groups = [(f, g) for f, rows in enumerate(group_rows) for g in range(len(rows))]
    self._group_rows = group_rows
    counts = [n for rows in group_rows for n in rows]
    self._group_offsets = np.cumsum([0] + counts).tolist()
    self._local = threading.local()
    self._decoded = _DecodedGroups(decoded_bytes)

  def __len__(self) -> int:
    return self._group_offsets[-1]

  def __getitem__(self, index: int) -> Any:
    group, row = _source_files.locate(self._group_offsets, index, len(self))
    table = self._decoded.get(group)
    if table is None:
      table = self._decoded.put(group, self._read_group(*self._groups[group]))
    return table.slice(row, 1).to_pylist()[0]

  def _read_group(self, file_index: int, group_index: int) -> Any:
    pq = _import_pyarrow_parquet()
    if self._cache is None:
      with _cached_files.parquet_file(pq, self._paths[file_index], self._generations[file_index]) as parquet:
        return parquet.read_row_group(group_index)
    self._entering(file_index)
    # Read by pyarrow's own file of the copy, kept open (in use: never evicted under a read) for the next group.
    return self._copies.read(file_index, lambda parquet: parquet.read_row_group(group_index),
                             self._group_rows[file_index], self._paths[file_index] in self._indexed)

  def row_groups(self) -> list[list[int]]:
    """Each file's row groups' sizes, as its footer says (what `ckpt-iter index` keeps for a new host)."""
    return [list(rows) for rows in self._group_rows]

  def file_offsets(self) -> list[int]:
    """The index of each file's first record, and the total (a file without rows starts where the next does)."""
    return np.cumsum([0] + [sum(rows) for rows in self._group_rows]).tolist()

  def file_position(self, index: int) -> tuple[str, str]:
    """(file, "row N") of record `index` (rows of the file, from 0)."""
    group, row = _source_files.locate(self._group_offsets, index, len(self))
    file_index, _ = self._groups[group]
    first_group = next(g for g, (f, _) in enumerate(self._groups) if f == file_index)
    return self._paths[file_index], f"row {row + self._group_offsets[group] - self._group_offsets[first_group]}"


class ArrayRecordSource(_cached_files.FilesThroughCache):
  """Records of ArrayRecord files whose records are UTF-8 JSON objects.

  Args:
    paths: the ArrayRecord files (local or gs://, read by array_record's own
      reader), in order: one path, a glob, or a list of them (a glob's
      matches sorted).
    cache: a `ShardCache`: each file is downloaded whole into it on its first
      read and read there; the build reads only each file's footer (its
      record count), so a corpus larger than the cache reads through it a
      window at a time with make_dataset(shuffle="shards"), as JSONL does;
      what a footer says is kept in the cache, so a restart reads none.
      None reads the files in place.
    prefetch_files: with `cache`, how many files after the one a reader
      enters to download ahead (0: none, neither by index nor by a plan).
    max_open_files: with `cache`, how many copies a process keeps open (in
      use, so never evicted) at most.
    corpus_index: with `cache`, take each file's record count from the
      index object `ckpt-iter index` wrote beside the files, when it indexes
      the file as it is now: a new host reads one small object per
      directory, not every footer (about 1 MiB a file).
    files_from_index: name the files, and on an object store take their
      versions, from the index objects of their directories instead of
      listing the store (as for JSONL; with `cache`, one read per directory
      at a start: in place, array_record's reader opens every file; the
      index is then the corpus).
  """

  suffixes = (".array_record",)

  def __init__(self, paths: _source_files.PathsArg, *, cache: _shard_cache.ShardCache | None = None,
               prefetch_files: int = 2, max_open_files: int = 16, corpus_index: bool = True,
               files_from_index: bool = False):
    """Opens `paths` with array_record's reader (their footers only, through a cache); see the class docstring."""
    import grain  # pylint: disable=g-import-not-at-top

    _source_files.check_index_options("ArrayRecordSource", corpus_index, files_from_index)
    paths = _source_files.expand_paths(paths, "ArrayRecordSource", files_from_index=files_from_index)
    self._cache = cache
    self._indexed: set[str] = set()  # the files whose record count came from a corpus index object
    self._paths = [_storage.absolute(p) for p in paths]
    self._prefetch_files = max(0, int(prefetch_files))
    self._planned = False
    try:
      if cache is not None:
        self._identities = _storage.identities(self._paths, listed=getattr(paths, "listed", None))
        self._copies = _cached_files.OpenReaders(cache, self._paths, self._identities, max(1, int(max_open_files)))
        footers, self._indexed = _cached_files.known_footers(
            cache, self._paths, self._identities, use_index=corpus_index, row_groups=False,
            indexes=getattr(paths, "indexes", None),
            read=lambda indices: [[n] for n in self._copies.counts(indices)])
        self._offsets = np.cumsum([0] + [footer[0] for footer in footers]).tolist()
        self._source = None
      else:
        self._identities = _storage.identities(self._paths, listed=getattr(paths, "listed", None))
        self._source = grain.sources.ArrayRecordDataSource(list(paths))
        self._offsets = None
    except ImportError as e:
      raise errors.InvalidArgumentError(
          f"reading .array_record files needs the array_record package ({e}). "
          "Install it with: pip install 'ckpt_iter[files]' (or 'array-record>=0.8')"
      ) from None
    self._read_paths = list(paths)
    self._local = threading.local()

  def __len__(self) -> int:
    return self._offsets[-1] if self._source is None else len(self._source)

  def __getitem__(self, index: int) -> Any:
    if self._source is not None:
      return json.loads(self._source[index])
    file_index, position = _source_files.locate(self._offsets, index, len(self))
    self._entering(file_index)
    expected = self._offsets[file_index + 1] - self._offsets[file_index]
    return json.loads(self._copies.read(file_index, lambda reader: reader.read([position])[0], [expected],
                                        self._paths[file_index] in self._indexed))

  def file_position(self, index: int) -> tuple[str, str]:
    """(file, "record N") of record `index` (records of the file, from 0)."""
    file_index, record = _source_files.locate(self.file_offsets(), index, len(self))
    return self.paths[file_index], f"record {record}"

  def file_offsets(self) -> list[int]:
    """The global index of each file's first record, and the total (each file's length read once)."""
    if self._offsets is None:
      self._offsets = np.cumsum([0] + _cached_files.record_counts(self._read_paths)).tolist()
    return list(self._offsets)


class HuggingFaceSource:
  """Records of a Hugging Face `datasets.Dataset` (Arrow-backed, random access).

  Loads by name or path and split: a directory written by
  `Dataset.save_to_disk` / `DatasetDict.save_to_disk` is read with
  `datasets.load_from_disk`, anything else with `datasets.load_dataset`
  (a Hub name, a local dataset script or folder, or a builder such as
  "json" / "parquet" with `data_files`). Or wrap a loaded Dataset:
  `HuggingFaceSource(dataset=ds)`.

  Args:
    path: the dataset's name or path.
    split: the split; needed when the dataset has several.
    name: the dataset's configuration (load_dataset's `name`).
    data_files: passed to load_dataset.
    cache_dir: load_dataset's cache directory (default: Hugging Face's).
    dataset: an already loaded `datasets.Dataset` instead of `path`.
  """

  def __init__(
      self, path: str | None = None, *, split: str | None = None, name: str | None = None,
      data_files: Any = None, cache_dir: str | None = None, dataset: Any = None,
  ):
    """Loads (or wraps) one split of a Hugging Face dataset; see the class docstring for the arguments."""
    if (path is None) == (dataset is None):
      raise errors.InvalidArgumentError("HuggingFaceSource needs exactly one of path= and dataset=.")
    datasets = _import_datasets()
    if dataset is None:
      path = os.fspath(path)
      dataset = _load_hf(datasets, path, split, name, data_files, cache_dir)
      label = path
      if _storage.is_dir(path):
        label = os.path.basename(path.rstrip("/") if _storage.is_url(path) else os.path.normpath(path))
    else:
      label = "dataset"
    if isinstance(dataset, datasets.DatasetDict):
      dataset = _one_split(dataset, split, label)
    if not isinstance(dataset, datasets.Dataset):
      if _hf.is_hf_iterable(dataset):
        raise errors.InvalidArgumentError(_hf.hf_streaming_refusal(dataset, f"HuggingFaceSource({label!r})"))
      raise errors.InvalidArgumentError(
          f"Hugging Face source {label!r} is a {type(dataset).__qualname__}, not a datasets.Dataset; "
          "pass one split of a dataset loaded without streaming."
      )
    self._dataset = dataset
    parts = [label] + ([name] if name else []) + ([split] if split else [])
    # Name, configuration and split, no absolute path (as for files); the
    # content is checked by the length and the sampled digest.
    self.description = f"hf[{':'.join(str(p) for p in parts)}]"

  @property
  def dataset(self) -> Any:
    """The `datasets.Dataset` records are read from."""
    return self._dataset

  def __len__(self) -> int:
    return len(self._dataset)

  def __getitem__(self, index: int) -> Any:
    if not isinstance(index, (int, np.integer)):
      raise TypeError(f"record index must be an integer, got {type(index).__name__}")
    return self._dataset[int(index)]

  def __repr__(self) -> str:
    return f"HuggingFaceSource({self.description}, {len(self)} records)"


def _import_datasets():
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidArgumentError(
        "reading Hugging Face datasets needs the datasets package. Install it with: "
        "pip install 'ckpt_iter[hf]' (or pip install datasets)"
    ) from None
  return datasets


def _is_saved_to_disk(path: str) -> bool:
  """A directory written by save_to_disk (a Dataset's or a DatasetDict's)."""
  return _storage.is_dir(path) and any(
      _storage.is_file(os.path.join(path, marker)) for marker in ("state.json", "dataset_dict.json")
  )


def _load_hf(datasets: Any, path: str, split: str | None, name: str | None, data_files: Any,
             cache_dir: str | None) -> Any:
  if _is_saved_to_disk(path):
    if name is not None or data_files is not None:
      raise errors.InvalidArgumentError(
          f"{path!r} was written by save_to_disk: name= and data_files= do not apply to it."
      )
    return datasets.load_from_disk(path)
  try:
    return datasets.load_dataset(path, name, data_files=data_files, split=split, cache_dir=cache_dir)
  except ValueError as e:  # an unknown split or configuration: HF's message names the choices
    raise errors.InvalidArgumentError(f"Hugging Face dataset {path!r}: {e}") from None


def _one_split(dataset_dict: Any, split: str | None, label: str) -> Any:
  splits = sorted(dataset_dict)
  if split is None:
    if len(splits) == 1:
      return dataset_dict[splits[0]]
    raise errors.InvalidArgumentError(
        f"Hugging Face dataset {label!r} has splits {splits}; choose one with split=."
    )
  if split not in dataset_dict:
    raise errors.InvalidArgumentError(
        f"Hugging Face dataset {label!r} has no split {split!r}; it has {splits}."
    )
  return dataset_dict[split]


def _is_hf_dataset(source: Any) -> bool:
  """A datasets.Dataset or DatasetDict, recognised without importing datasets."""
  module = type(source).__module__ or ""
  return module.split(".")[0] == "datasets" and type(source).__name__ in ("Dataset", "DatasetDict")


def _is_iterable_only(source: Any) -> bool:
  """An iterable with no random access (a generator, a stream), which make_dataset cannot place records in."""
  if isinstance(source, (str, bytes, dict)) or (type(source).__module__ or "").startswith("grain"):
    return False
  return hasattr(source, "__iter__") or type(source).__name__ == "IterableDatasetDict"


# The file source of each kind of file by its plain suffix, each class registered by its own `suffixes`.
SOURCE_BY_SUFFIX = _source_files.SOURCE_BY_SUFFIX


def resolve_source(source: Any) -> tuple[Any, SourceIdentity]:
  """Turns the `source` argument of make_dataset into a random-access source.

  Raises:
    InvalidArgumentError: naming the value and what is accepted.
  """
  paths = _as_paths(source)
  if paths is not None:
    return _described_by_files(_file_source(paths), paths)
  if isinstance(source, _source_files.FileSource) and source.cache is not None:
    # Described by its files, as the same paths given to make_dataset are: a run may turn
    # its cache on or off.
    return _described_by_files(source, source.paths)
  if isinstance(source, HuggingFaceSource) or _is_hf_dataset(source):
    resolved = source if isinstance(source, HuggingFaceSource) else HuggingFaceSource(dataset=source)
    description = resolved.description
  elif _is_random_access(source):
    resolved = source
    if isinstance(source, (list, tuple)):
      description = "records"
    else:
      description = f"{type(source).__module__}.{type(source).__qualname__}"
  elif _is_iterable_only(source):
    raise errors.InvalidArgumentError(_hf.make_dataset_refusal(source, "make_dataset(source=...)"))
  else:
    raise errors.InvalidArgumentError(
        f"source={_source_files.short_repr(source)} is not supported. Pass a list of records "
        f"(dicts), a path, glob or list of paths to {', '.join(_source_files.file_suffixes())} "
        "files, a Hugging Face datasets.Dataset (or HuggingFaceSource), or a "
        "random-access data source (with __len__ and __getitem__)."
    )
  length = _length(resolved, description)
  return resolved, SourceIdentity(description, length, sample_digest(resolved, length))


def _file_source(paths: list[str]) -> _source_files.FileSource:
  """The file source of make_dataset's paths, by their suffix (one kind of file), through the shard cache the
  environment names when they are on an object store (ShardCache.from_env), if any."""
  kinds = {_compression.plain_suffix(p) for p in paths}  # a .jsonl.gz is JSONL
  if len(kinds) != 1:
    raise errors.InvalidArgumentError(
        f"source mixes file types {sorted(kinds)}; pass files of one type "
        f"({', '.join(_source_files.file_suffixes())})."
    )
  cache = _shard_cache.ShardCache.from_env() if any(_storage.is_url(p) for p in paths) else None
  return SOURCE_BY_SUFFIX[kinds.pop()](paths, cache=cache)


def _described_by_files(source: _source_files.FileSource, paths: list[str]) -> tuple[Any, SourceIdentity]:
  """A file source and its identity from its files (`paths`, as given) and the identities the source took of
  them when built (each file's asked once); the digest of files on an object store is their metadata's
  (`sample_digest`), from the same identities."""
  identities = source.identities()
  description = _describe_files(source.suffixes[0][1:], paths, identities)  # its kind: "jsonl", "parquet", ...
  length = _length(source, description)
  remote = any(_storage.is_url(p) for p in paths)
  digest = metadata_digest(paths, identities) if remote else sample_digest(source, length)
  source.release(())  # the copies its build and the digest's reads opened: idle now, so the cache may evict them
  return source, SourceIdentity(description, length, digest, tuple(zip(paths, identities)))


def _length(source: Any, description: str) -> int:
  length = len(source)
  if length == 0:
    raise errors.InvalidArgumentError(
        f"source {description} holds no records; a dataset needs at least one."
    )
  return length


def _describe_files(kind: str, paths: list[str], identities: list[_storage.Identity]) -> str:
  """Names and byte sizes of the files, not their directory; short for many files.

  Beyond a few files the list is summarized by count, first and last name
  and a digest of all names and sizes, so a state stays well under 1 KB.
  """
  entries = [f"{os.path.basename(p)}:{found.size}" for p, found in zip(paths, identities)]
  if len(entries) <= _LISTED_FILES:
    return f"{kind}[{','.join(entries)}]"
  digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]
  return f"{kind}[{len(entries)} files {entries[0]}..{entries[-1]} sha256:{digest}]"


def _as_paths(source: Any) -> list[str] | None:
  """Expands make_dataset's path, glob or list of paths; None when `source` is not paths."""
  candidates = _source_files.path_strings(source)
  if candidates is None:
    return None
  suffixes = _source_files.file_suffixes()
  for candidate in candidates:
    if not candidate.endswith(suffixes):
      raise errors.InvalidArgumentError(
          f"source path {candidate!r} does not end in one of {', '.join(suffixes)}. "
          "Pass JSONL, Parquet or ArrayRecord files, or a list of record dicts."
      )
  return _source_files.expanded(candidates, "source")


def _is_random_access(source: Any) -> bool:
  return hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(
      source, (str, bytes, dict)
  )


def _remote_files(source: Any) -> list[str] | None:
  """The files of a file source when any is on an object store; None otherwise."""
  if isinstance(source, _source_files.FileSource):
    paths = source.paths
    if any(_storage.is_url(p) for p in paths):
      return paths
  return None


def metadata_digest(paths: list[str], identities: list[_storage.Identity]) -> str:
  """sha256 prefix over each file's name, size and version (generation, crc32c): no content read."""
  digest = hashlib.sha256(b"files-by-metadata\n")
  for path, found in zip(paths, identities):
    digest.update(f"{os.path.basename(path)}:{found.size}:{found.version}\n".encode())
  return digest.hexdigest()[:16]


def sample_digest(source: Any, length: int) -> str:
  """sha256 prefix over up to 64 evenly spaced records and the last one.

  The one source digest: make_dataset's `source_digest` and the graph
  fingerprint's `SourceMapDataset.digest` are both this. For a file source
  with files on an object store, `metadata_digest` of its files instead, from
  the identities it took when built (no request): a read of 65 records there
  is 65 sequential round trips.
  """
  remote = _remote_files(source)
  if remote is not None:
    return metadata_digest(remote, source.identities())
  count = min(length, _DIGEST_SAMPLES)
  indices = sorted({(i * length) // count for i in range(count)} | {length - 1})
  digest = hashlib.sha256()
  for index in indices:
    digest.update(json.dumps(source[index], sort_keys=True, default=repr).encode())
  return digest.hexdigest()[:16]


def _import_pyarrow_parquet():
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidArgumentError(
        "reading .parquet files needs pyarrow. Install it with: pip install 'ckpt_iter[files]' (or 'pyarrow>=15')"
    ) from None
  return pq


def file_position(source: Any, index: int) -> tuple[str, str] | None:
  """(file, "line N" / "row N" / "record N") of record `index` of a file source; None for another source.

  For `ckpt-iter which --source`: where a record the data map names is, in the files the run read.
  """
  return source.file_position(index) if isinstance(source, _source_files.FileSource) else None


def file_offsets(source: Any) -> list[int] | None:
  """The global index of each file's first record and the total, for a file source; None for another source.

  The shards of make_dataset(shuffle="shards") when no shard_size is given.
  """
  return source.file_offsets() if isinstance(source, _source_files.FileSource) else None


