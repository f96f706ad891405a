"""The files a file source reads: the paths it is given, and where a record is among them.

A file source (JSONL, Parquet, ArrayRecord) takes one path, a glob or a list
of them, local or on an object store: `expand_paths` expands each glob (its
matches sorted) and checks every file exists, in the words errors name the
source by; a glob on a bucket whose listing takes more pages than a restart
should ask is told, once a process, how to list nothing (an index naming its
files). Its records are numbered across its files in order (`locate`), and
its per-thread reading state stays out of a pickle (`FileReader`), so Grain's
worker processes open their own. What every file source answers is declared
once (`FileSource`): a new format is one subclass naming its suffixes, which
registers it for make_dataset's paths and `ckpt-iter index`
(`SOURCE_BY_SUFFIX`).
"""

from __future__ import annotations

import abc
import bisect
import logging
import os
import threading
from typing import Any, ClassVar, Sequence, Union

import numpy as np

from ckpt_iter import _compression
from ckpt_iter import _corpus_index
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib


_log = logging.getLogger(__name__)

# A store's listing describes at most this many objects a page (GCS's cap, and S3's), a request each.
LISTING_PAGE_OBJECTS = 1000
# A glob listing more pages than a restart's whole bound of requests is told how to list nothing.
LISTING_PAGES_TOLD = 4
_told_listings: set[str] = set()

# What the file sources take: one path, a glob, or a list of them.
PathsArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


class ExpandedPaths(list):
  """Paths already expanded: not globbed again (a file's name may hold `[` or `*`). `listed`: the
  identities a URL glob's listing gave (path -> `_storage.Identity`), which no metadata request repeats."""

  def __init__(self, *paths: Any):
    super().__init__(*paths)
    self.listed: dict[str, Any] = {}
    self.indexes: dict[str, Any] = {}  # the corpus index objects read to name them, by directory


def expand_paths(paths: PathsArg, owner: str, *, files_from_index: bool = False) -> list[str]:
  """The files a file source reads, in order: each glob's matches sorted.

  One path (str or os.PathLike, local or gs://), a glob, or a list of them,
  as make_dataset takes them. A single string is one path, never a sequence
  of characters. `files_from_index`: named by their directories' corpus
  index objects, not by a listing (`_corpus_index.listing`).

  Raises:
    InvalidArgumentError: `paths` is not paths, names no file, or a file
      or glob match is missing; the message names `owner`.
  """
  if isinstance(paths, ExpandedPaths):
    again = ExpandedPaths(paths)
    again.listed, again.indexes = dict(paths.listed), dict(paths.indexes)
    return again
  candidates = path_strings(paths)
  if candidates is None:
    shown = "[]" if isinstance(paths, (list, tuple)) and not paths else short_repr(paths)
    raise errors.InvalidArgumentError(
        f"{owner}: paths={shown} ({type(paths).__name__}) names no file. Pass a path "
        "(str or os.PathLike, local or gs://), a glob such as 'data/part-*.jsonl', "
        "or a non-empty list of them."
    )
  if files_from_index:
    from_index = ExpandedPaths()
    found, from_index.listed, from_index.indexes = _corpus_index.listing(candidates, owner)
    from_index.extend(found)
    return from_index
  return expanded(candidates, owner)


def check_index_options(owner: str, corpus_index: bool, files_from_index: bool) -> None:
  """Refuses a source's `files_from_index` without `corpus_index` (it reads the index the other ignores)."""
  if files_from_index and not corpus_index:
    raise errors.InvalidArgumentError(
        f"{owner}: files_from_index=True names the files from the corpus index, which corpus_index=False "
        "ignores. Pass corpus_index=True (the default), or files_from_index=False to list the files.")


def path_strings(source: Any) -> list[str] | None:
  """The path strings of a path or non-empty list of paths; None for anything else."""
  if isinstance(source, os.PathLike):
    source = os.fspath(source)
  if isinstance(source, str):
    return [source]
  if isinstance(source, (list, tuple)) and source and all(
      isinstance(s, (str, os.PathLike)) for s in source
  ):
    strings = [os.fspath(s) for s in source]
    return strings if all(isinstance(s, str) for s in strings) else None
  return None


def expanded(candidates: list[str], owner: str) -> ExpandedPaths:
  """Globs expanded (sorted), every file checked to exist; errors name `owner`."""
  paths = ExpandedPaths()
  # Objects named one by one: their directory's listing says they exist, with their identities.
  paths.listed.update(_storage.directory_identities([c for c in candidates if not _storage.has_magic(c)]))
  for candidate in candidates:
    magic = _storage.has_magic(candidate)
    if magic and _storage.is_url(candidate):  # the listing describes each object: no metadata request per file
      listed = _storage.glob_identities(candidate)
      _tell_of_a_long_listing(owner, candidate, len(listed))
      paths.listed.update(listed)
      matches = sorted(listed)
    else:
      matches = _storage.glob(candidate) if magic else [candidate]
    if not matches:
      raise errors.InvalidArgumentError(f"{owner} glob {candidate!r} matches no file.")
    for match in matches:
      # An object a listing found exists: no metadata request per match (the source's
      # identities, fetched in parallel, fail on one that went away).
      if match not in paths.listed and not _storage.is_file(match):
        where = "" if _storage.is_url(match) else f" (working directory {os.getcwd()!r})"
        raise errors.InvalidArgumentError(f"{owner} file {match!r} does not exist{where}.")
    paths.extend(matches)
  return paths



def _tell_of_a_long_listing(owner: str, pattern: str, objects: int) -> None:
  """Warns, once a process, where a glob's listing costs a restart more requests than reading its index would.

  Every process lists at every start: at the worked case's 20,480 objects that is 21 pages a host, 5,376
  requests for a 256-host pod, where a corpus index names the same files in one read a host.
  """
  pages = -(-objects // LISTING_PAGE_OBJECTS)
  if pages <= LISTING_PAGES_TOLD or pattern in _told_listings:
    return
  _told_listings.add(pattern)
  directory = pattern.rsplit("/", 1)[0]
  way = ("With each directory indexed once and named by a glob of its own" if _storage.has_magic(directory)
         else f"Indexed once ({errors.index_command(directory)})")
  # make_dataset's path names no class (owner "source"): the one its suffix picks, with the cache it picks.
  reader = SOURCE_BY_SUFFIX.get(_compression.plain_suffix(pattern))
  call = f"{owner}(..., files_from_index=True)"
  if reader is not None and owner not in {source.__name__ for source in SOURCE_BY_SUFFIX.values()}:
    call = (f"make_dataset(ckpt_iter.sources.{reader.__name__}({pattern!r}, files_from_index=True, "
            "cache=ckpt_iter.sources.ShardCache.from_env()), ...)")
  _log.warning(
      "%s: the glob %r lists %s objects: at least %d requests (a page per %s objects) in every process at "
      "every start. %s, %s names them from the index, one read a directory, and lists nothing.",
      owner, pattern, f"{objects:,}", pages, f"{LISTING_PAGE_OBJECTS:,}", way, call)


def locate(offsets: list[int], index: int, length: int) -> tuple[int, int]:
  """(block, offset in it) of record `index` of `length`, the blocks (files, row groups) starting at `offsets`.

  A negative index counts from the end, as a list's does.
  """
  if not isinstance(index, (int, np.integer)):
    raise TypeError(f"record index must be an integer, got {type(index).__name__}")
  index = int(index)
  if not -length <= index < length:
    raise IndexError(f"record index {index} out of range for {length} records")
  index %= length
  block = bisect.bisect_right(offsets, index) - 1
  return block, index - offsets[block]


class FileReader:
  """Per-thread reading state that survives pickling (for Grain workers)."""

  _paths: list[str]

  def __getstate__(self):
    state = self.__dict__.copy()
    state.pop("_local", None)
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._local = threading.local()

  @property
  def paths(self) -> list[str]:
    """The files, in the order their records are numbered."""
    return list(self._paths)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({len(self._paths)} files, {len(self)} records)"


# The file source of each kind of file, by its plain suffix (a `.jsonl.gz` or `.jsonl.zst` is JSONL's `.jsonl`):
# what make_dataset's paths and `ckpt-iter index` pick a source from. Each FileSource subclass adds itself.
SOURCE_BY_SUFFIX: dict[str, type["FileSource"]] = {}


def file_suffixes() -> tuple[str, ...]:
  """Every file ending a registered file source reads (a compressed JSONL's included)."""
  return tuple(suffix for reader in SOURCE_BY_SUFFIX.values() for suffix in reader.suffixes)


class FileSource(FileReader, abc.ABC):
  """A source of records read from files (JSONL, Parquet, ArrayRecord): what make_dataset's build and plan,
  `ckpt-iter index` and `which --source` ask of one, declared once.

  A subclass naming `suffixes` (the plain one first) is registered under its
  first (`SOURCE_BY_SUFFIX`): a new format is one class.
  """

  suffixes: ClassVar[tuple[str, ...]] = ()  # the endings of its files, the plain suffix first

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    if cls.__dict__.get("suffixes"):
      SOURCE_BY_SUFFIX[cls.suffixes[0]] = cls

  @property
  @abc.abstractmethod
  def cache(self) -> Any:
    """The `ShardCache` the files are read through, or None (read where they are)."""

  @abc.abstractmethod
  def identities(self) -> list[Any]:
    """Each file's size and version as read when built: what describes the files in a fingerprint, names
    them when a restore is refused, and pins every later read on an object store."""

  @abc.abstractmethod
  def file_offsets(self) -> list[int]:
    """The global index of each file's first record, and the total."""

  @abc.abstractmethod
  def file_position(self, index: int) -> tuple[str, str]:
    """(file, where in it) of record `index`, as `which --source` names it."""

  @property
  @abc.abstractmethod
  def prefetch_files(self) -> int:
    """How many files ahead a cached source downloads (0: no prefetch)."""

  @abc.abstractmethod
  def prefetch(self, file_indices: Sequence[int]) -> None:
    """Downloads these files into the cache in the background (with no cache, nothing)."""

  @abc.abstractmethod
  def follow_plan(self) -> None:
    """From now on a plan names the files to prefetch (make_dataset(shuffle="shards")), not the file index."""

  @abc.abstractmethod
  def cached_bytes(self) -> list[int]:
    """What each file takes in the cache."""

  @abc.abstractmethod
  def release(self, keep: Sequence[int]) -> None:
    """Closes this process's idle copies of the files not in `keep`: a plan is done with them."""

  @property
  def max_open_files(self) -> int | None:
    """How many copies a process keeps open, where a global shuffle's build should warn past it; None: it
    does not say."""
    return None

  def files_kept_open(self) -> int:
    """How many of its files a process must keep open to read them all without opening one again."""
    return len(self.file_offsets()) - 1


def short_repr(value: Any) -> str:
  """A value as a source's errors show it: its repr, cut to 60 characters."""
  return state_lib.short_repr(value, limit=60)
