"""A corpus's index object: every file's record count in one small object beside the files.

A cached file source must know each file's record count before it reads
(the plan places records by it). Without an index a new host downloads every
JSONL file to count its lines, and reads every Parquet and ArrayRecord
file's footer (about 64 KiB and 1 MiB a file). `ckpt-iter index PATHS`
counts them once, with each source's own count (the same code that builds
it), and writes `INDEX_NAME` into each directory holding the files: per file
its size, its version (generation and crc32c on GCS, as `_storage.Identity`
gives it), its records and, for Parquet, its row groups' sizes. A host then
reads one object per directory instead of the files or their footers.

What is trusted, and why it is safe: a count is taken from the index only for
a file whose size and version now are the ones indexed; a file indexed with
another version is refused by name (the corpus changed since). The count is
checked again when the file's copy is indexed at its first read (a copy
holding another number of records is refused), so an index edited to lie
about a count stops the read before a record of that file is trained (a
Parquet copy whose row groups are not the index's is refused the same way).
"""

from __future__ import annotations

import fnmatch
import json
import os
import zlib
from typing import Any, Sequence

from ckpt_iter import _storage
from ckpt_iter import errors

INDEX_NAME = "ckpt_iter_index.json"
KIND = "ckpt_iter.jsonl_index"  # the kind since format 1, when only JSONL was indexed
FORMAT = 1  # what an index of JSONL and ArrayRecord files is written as: 0.4's readers read it
FORMAT_GROUPS = 2  # an index with a Parquet file's row groups: older readers refuse it by its format
# A Parquet file of more row groups than this is indexed by its count only (its footer read at a build).
_MAX_GROUPS = 100_000
# An entry is ~150 bytes: 64 MiB indexes ~400,000 files, past which the object is refused unread.
MAX_BYTES = 64 * 2**20
_MAX_RECORDS = 2**48


def location(directory: str) -> str:
  """The index object of the files in `directory`."""
  return directory.rstrip("/") + "/" + INDEX_NAME


def write(paths: Sequence[str], identities: Sequence[_storage.Identity], counts: Sequence[int],
          row_groups: Sequence[Sequence[int] | None] | None = None) -> list[str]:
  """Writes one index object per directory of `paths`; returns their paths (sorted).

  `row_groups`: each Parquet file's row groups' sizes (None for another file).
  """
  by_directory: dict[str, dict[str, Any]] = {}
  row_groups = row_groups or [None] * len(paths)
  for path, found, count, groups in zip(paths, identities, counts, row_groups):
    if found.version is None:
      raise errors.InvalidArgumentError(
          f"{path}: the store gives no version for it (no generation, ETag or checksum), so an index "
          "cannot tell a changed file from the one it counted. Index a store or disk that versions its files.")
    directory, name = _split(path)
    entry = {"size": found.size, "version": found.version, "records": int(count)}
    if groups is not None and len(groups) <= _MAX_GROUPS:
      entry["row_groups"] = [int(n) for n in groups]
    by_directory.setdefault(directory, {})[name] = entry
  written = []
  for directory, files in sorted(by_directory.items()):
    body = json.dumps(files, sort_keys=True, separators=(",", ":"))
    form = FORMAT_GROUPS if any("row_groups" in e for e in files.values()) else FORMAT
    text = json.dumps({"kind": KIND, "format": form, "crc32": zlib.crc32(body.encode()), "files": files},
                      sort_keys=True, separators=(",", ":"))
    _storage.replace_bytes(location(directory), text.encode())  # a build reading it meanwhile sees one whole
    written.append(location(directory))
  return written


def counts(paths: Sequence[str], identities: Sequence[_storage.Identity],
           indexes: dict[str, dict[str, Any] | None] | None = None) -> list[int | None]:
  """Each file's record count from its directory's index object, None where there is none for it.

  One read per directory (none holds an index: one failed GET each).

  Raises:
    InvalidStateError: an index is garbled, or indexes a file with another size or version than it
      has now (the message names the file, both versions and the two ways through).
  """
  return [None if entry is None else entry["records"] for entry in entries(paths, identities, indexes)]


def entries(paths: Sequence[str], identities: Sequence[_storage.Identity],
            indexes: dict[str, dict[str, Any] | None] | None = None) -> list[dict[str, Any] | None]:
  """Each file's entry in its directory's index object ({size, version, records} and a Parquet file's
  `row_groups`), None where there is none for it; raises as `counts`. `indexes`: those already read, by
  directory (as `listing` gives them), which are not read again."""
  found: list[dict[str, Any] | None] = []
  indexes = dict(indexes or {})
  for path, identity in zip(paths, identities):
    directory, name = _split(path)
    if directory not in indexes:
      indexes[directory] = read(directory)
    entry = (indexes[directory] or {}).get(name)
    if entry is None:
      found.append(None)
      continue
    if (entry["size"], entry["version"]) != (identity.size, identity.version):
      raise errors.InvalidStateError(
          f"{path}: {location(directory)} counted it at size {entry['size']:,}, version {entry['version']}; "
          f"it is now size {identity.size:,}, version {identity.version}: the file changed since it was "
          f"indexed. Index the corpus again ({errors.index_command(directory)}), or delete {INDEX_NAME} to count "
          "each file by downloading it.")
    found.append(entry)
  return found


def read(directory: str) -> dict[str, dict[str, Any]] | None:
  """The files entry of `directory`'s index object, checked; None when it has none."""
  path = location(directory)
  try:
    data = _storage.read_bytes(path, max_bytes=MAX_BYTES)
  except FileNotFoundError:
    return None
  except _storage.TooLargeError:
    raise errors.InvalidStateError(
        f"{path}: more than {MAX_BYTES:,} bytes, more than an index of this many files holds. It is not "
        f"an index ckpt-iter wrote: delete it, or index a directory of fewer files.") from None
  try:
    value = json.loads(data)
    files = value["files"]
    body = json.dumps(files, sort_keys=True, separators=(",", ":"))
    if (value.get("kind") != KIND or value.get("format") not in (FORMAT, FORMAT_GROUPS)
        or value.get("crc32") != zlib.crc32(body.encode())):
      raise ValueError("its kind, format or CRC-32 is not an index's")
    for name, entry in files.items():
      if (not isinstance(entry, dict) or set(entry) - {"row_groups"} != {"size", "version", "records"}
          or not all(type(entry[k]) is int and 0 <= entry[k] < _MAX_RECORDS for k in ("size", "records"))
          or not isinstance(entry["version"], str) or not name or "/" in name
          or ("row_groups" in entry and not _groups_sum_to(entry["row_groups"], entry["records"]))):
        raise ValueError(f"entry {name!r} is not {{size, version, records}} (with row groups that sum to its "
                         "records, for Parquet)")
  except RecursionError:
    raise errors.InvalidStateError(
        f"{path}: not a ckpt_iter corpus index (nested deeper than Python's parser goes): garbled or edited. "
        f"Index the corpus again ({errors.index_command(directory)}), or delete it to count each file by downloading "
        "it.") from None
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise errors.InvalidStateError(
        f"{path}: not a ckpt_iter corpus index ({e}): garbled or edited. Index the corpus again "
        f"({errors.index_command(directory)}), or delete it to count each file by downloading it.") from None
  return files


def listing(candidates: Sequence[str], owner: str) -> tuple[list[str], dict[str, _storage.Identity],
                                                             dict[str, dict[str, Any] | None]]:
  """The files `candidates` (paths and globs) name, as their directories' index objects list them, instead
  of a listing of the store (a source's `files_from_index`): one read per directory however many files it
  holds, where a listing takes a request per thousand objects, at every start of every process.

  Returns each candidate's files in order (a glob's sorted), the identities of those on an object store as
  the index recorded them (their reads pin the generation and check the checksum it names: an object
  rewritten since is refused when read), and the indexes read, by directory. A local file's identity is
  its stat, as without the index (compared with the index's at the build).

  Raises:
    InvalidArgumentError: a glob with a wildcard in its directory, a directory with no index, or a
      file or glob the index does not hold; the message names `owner`, the index and the command.
  """
  paths: list[str] = []
  indexes: dict[str, dict[str, Any] | None] = {}
  for candidate in candidates:
    directory, pattern = _split(candidate)
    if _storage.has_magic(directory):
      raise errors.InvalidArgumentError(
          f"{owner}(files_from_index=True): {candidate!r} has a wildcard in its directory; the files come from "
          f"one directory's {INDEX_NAME}. Name each directory's glob, or pass files_from_index=False to list them.")
    if directory not in indexes:
      indexes[directory] = read(directory)
    files = indexes[directory]
    if files is None:
      raise errors.InvalidArgumentError(
          f"{owner}(files_from_index=True): {directory} holds no {INDEX_NAME}. Index its files "
          f"({errors.index_command(directory)}), or pass files_from_index=False to list them.")
    matches = (sorted(name for name in files if fnmatch.fnmatchcase(name, pattern))
               if _storage.has_magic(pattern) else [pattern] if pattern in files else [])
    if not matches:
      raise errors.InvalidArgumentError(
          f"{owner}(files_from_index=True): {location(directory)} holds no file matching {candidate!r}. Index "
          f"the directory again if its files changed ({errors.index_command(directory)}), or pass "
          "files_from_index=False.")
    paths.extend(f"{directory}/{name}" for name in matches)
  urls = [path for path in paths if _storage.is_url(path)]
  recorded = []
  for url in urls:
    directory, name = _split(url)
    entry = indexes[directory][name]  # type: ignore[index]
    recorded.append((entry["size"], entry["version"]))
  return paths, dict(zip(urls, _storage.identities_as_recorded(urls, recorded))), indexes


def _groups_sum_to(groups: Any, records: int) -> bool:
  return (isinstance(groups, list) and len(groups) <= _MAX_GROUPS
          and all(type(n) is int and 0 <= n < _MAX_RECORDS for n in groups) and sum(groups) == records)


INDEXED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".array_record")


def files_in(path: str) -> list[str] | None:
  """The files of directory `path` an index covers, sorted (one listing); None when `path` is not a directory."""
  if _storage.has_magic(path) or not _storage.is_dir(path):
    return None
  return sorted(f"{path.rstrip('/')}/{name}" for name, is_directory in _storage.list_entries(path)
                if not is_directory and name.endswith(INDEXED_SUFFIXES))


def _split(path: str) -> tuple[str, str]:
  directory, name = path.rstrip("/").rsplit("/", 1) if "/" in path else (os.curdir, path)
  return directory, name
