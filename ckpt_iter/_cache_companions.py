"""The companion files of a shard cache's copies: a copy's seal, its record index and the count that binds them.

A copy is sealed when published (`<entry>.seal`: its size and a CRC-32,
`seal_text` / `read_seal`). A JSONL copy's line index is kept beside it
(`<entry>.index.npy`, evicted with it) and bound to it by the count file
(`<entry>.count`, a `CompanionRecord`: the record count, the copy's seal and
the index's CRC-32, under a CRC-32 of its own; kept after the copy's
eviction, so a restart counts without a download). What a build learned of
a source's files without their copies (a Parquet or ArrayRecord file's
footer: its row groups' sizes, or its record count; a JSONL file's count from
the corpus index) is kept as one object for those files at their versions
(`read_footers` / `write_footers`, under a CRC-32; kept after the copies'
eviction): a warm restart reads no footer and no index from the store. A
file whose copy said otherwise keeps the copy's as `<entry>.footer`
(`FooterRecord`), and the object is dropped.
`CompanionFiles` is what `ShardCache` does with them: one place for their
names, their bounds and their checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import zlib
from typing import Callable

import numpy as np

from ckpt_iter import _checksums
from ckpt_iter import _storage

INDEX_SUFFIX = ".index.npy"
COUNT_MAX_BYTES = 256  # a count file or a seal is a few dozen bytes: anything larger is not one
FOOTER_SUFFIX = ".footer"
# A source's footers kept as one object (`read_footers`): its name starts so, the rest a digest of the files.
FOOTERS_PREFIX = "ckpt_iter-footers-"
FOOTERS_MAX_BYTES = 64 * 2**20
# A footer record is ~8 bytes a row group: 1 MiB holds some 100,000 groups (a Parquet file of 100 M rows
# in groups of 1,000); a larger file is not one a footer record was written for.
FOOTER_MAX_BYTES = 2**20
_log = logging.getLogger("ckpt_iter._shard_cache")


class CompanionFiles:
  """A `ShardCache`'s companions of its copies (a mixin: it uses the cache's `entry_path`, `write_atomic`,
  `_download_lock` and `_ledger_held`)."""

  entry_path: Callable[..., str]
  write_atomic: Callable[..., None]
  directory: str

  def index_path(self, path: str, found: _storage.Identity) -> str:
    """Where the record index kept beside the copy of `path` is (evicted with the copy)."""
    return self.entry_path(path, found) + INDEX_SUFFIX

  def record_index(self, path: str, found: _storage.Identity, fd: int, *, build: Callable[[str], np.ndarray],
                   max_bytes: int) -> np.ndarray:
    """The record index of the copy of `path` (open as `fd`, checked): kept beside it, or built and kept.

    An index is an int64 array whose last axis has one entry per record. The
    one kept is used only when the count file binds it, by CRC-32, to this
    copy (its seal) and to these index bytes, and it is read by its own size
    (at most `max_bytes`, what an index of this copy can hold). One that is
    not bound is looked at again under the entry's lock, which its writer
    holds while it writes the index and then its count: a pair another
    process is writing is never taken for an edited or torn one. Still not
    bound (edited, torn, or of another copy), it is rebuilt from the copy
    (`build(copy path)`) with a warning, and kept with its count.

    Raises:
      StorageError: the cache directory cannot be written (as `write_atomic`).
    """
    copy_crc = self.seal(path, found)
    if copy_crc is None:
      copy_crc = _checksums.seal_of(fd, os.fstat(fd).st_size)
    kept = self._bound_index(path, found, copy_crc, max_bytes, warn=False)
    if kept is not None:
      return kept
    with self._download_lock(self.entry_path(path, found)):
      kept = self._bound_index(path, found, copy_crc, max_bytes, warn=True)
      if kept is not None:
        return kept
      array = build(self.entry_path(path, found))
      buffer = io.BytesIO()
      np.save(buffer, array, allow_pickle=False)
      data = buffer.getvalue()
      self.write_atomic(self.index_path(path, found), lambda f: f.write(data), counted=True)
      self.write_count(path, found, int(array.shape[-1]), index_crc=zlib.crc32(data), copy_crc=copy_crc)
    return array

  def _bound_index(self, path: str, found: _storage.Identity, copy_crc: int, max_bytes: int,
                   warn: bool) -> np.ndarray | None:
    """The index kept beside the copy when its count file binds it to the copy sealed `copy_crc`, else None."""
    index_path = self.index_path(path, found)
    try:
      with open(index_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(size) if size <= max_bytes else None  # by its own size, never more than an index holds
    except FileNotFoundError:
      return None
    except OSError as e:
      if warn:
        _log.warning("%s: unreadable (%s); rebuilding it", index_path, e)
      return None
    record = self.read_companion_record(path, found) if data is not None else None
    try:
      array = load_index_bytes(data) if record is not None else None
    except (OSError, ValueError, EOFError):
      array = None
    if (array is not None and record.copy_crc == copy_crc and record.index_crc == zlib.crc32(data)
        and array.dtype == np.int64 and array.ndim >= 1 and array.shape[-1] == record.records):
      return array
    if warn:
      _log.warning("%s: the index beside the copy of %s is not bound to it (edited, torn or stale); "
                   "rebuilding it", index_path, path)
    return None

  def read_count(self, path: str, found: _storage.Identity) -> int | None:
    """The record count stored for `path` (`write_count`), or None when absent or not intact."""
    record = self.read_companion_record(path, found)
    return None if record is None else record.records

  def read_companion_record(self, path: str, found: _storage.Identity) -> "CompanionRecord | None":
    """What `write_count` stored for `path`: None when absent, or when its own check fails (edited, torn)."""
    target = self.entry_path(path, found) + ".count"
    try:
      with open(target, "rb") as f:
        text = f.read(COUNT_MAX_BYTES).decode("ascii")
    except (OSError, UnicodeDecodeError):
      return None
    record = CompanionRecord.parse(text, os.path.basename(self.entry_path(path, found)))
    if record is None:
      _log.warning("%s: not intact (edited or torn); it is rebuilt from the copy", target)
    return record

  def read_footer(self, path: str, found: _storage.Identity) -> list[int] | None:
    """The footer kept for `path` at this identity (`write_footer`): its row groups' sizes (one entry for
    a file that has no groups, as ArrayRecord's count); None when absent or not intact."""
    target = self.entry_path(path, found) + FOOTER_SUFFIX
    try:
      with open(target, "rb") as f:
        text = f.read(FOOTER_MAX_BYTES + 1).decode("ascii")
    except FileNotFoundError:
      return None
    except (OSError, UnicodeDecodeError):
      text = ""
    groups = FooterRecord.parse(text, os.path.basename(self.entry_path(path, found)))
    if groups is None:
      _log.warning("%s: not intact (edited or torn); the file's footer is read again", target)
    return groups

  def write_footer(self, path: str, found: _storage.Identity, groups: list[int]) -> None:
    """Keeps what the copy of `path` says its footer is (`read_footer`), where it disagreed with the footer
    the source was built with; a few bytes a group, kept after eviction."""
    entry = self.entry_path(path, found)
    text = FooterRecord.format(groups, os.path.basename(entry))
    if len(text) <= FOOTER_MAX_BYTES:
      self.write_atomic(entry + FOOTER_SUFFIX, lambda f: f.write(text.encode()))

  def read_footers(self, paths: list[str], identities: list[_storage.Identity]) -> list[list[int]] | None:
    """What a build of exactly these files (these versions) kept of their footers (`write_footers`), or None.

    One small object for a source's files, where a record a file would be a
    write a file at a host's first build (20,480 of them: seconds).
    """
    target = self._footers_path(paths, identities)
    try:
      with open(target, "rb") as f:
        data = f.read(FOOTERS_MAX_BYTES + 1)
    except OSError:
      return None
    try:
      value = json.loads(data)
      body = json.dumps(value["files"], separators=(",", ":"))
      files = value["files"]
      if (value.get("crc32") != zlib.crc32(body.encode()) or len(files) != len(paths)
          or not all(isinstance(g, list) and all(type(n) is int and n >= 0 for n in g) for g in files)):
        raise ValueError("not intact")
    except (ValueError, KeyError, TypeError, RecursionError):
      _log.warning("%s: not intact (edited or torn); the files' footers are read again", target)
      return None
    return files

  def write_footers(self, paths: list[str], identities: list[_storage.Identity], footers: list[list[int]]) -> None:
    """Keeps what the footers of these files say, as one object (`read_footers`); a few bytes a file."""
    body = json.dumps([[int(n) for n in groups] for groups in footers], separators=(",", ":"))
    text = json.dumps({"crc32": zlib.crc32(body.encode()), "files": json.loads(body)}, separators=(",", ":"))
    if len(text) <= FOOTERS_MAX_BYTES:
      self.write_atomic(self._footers_path(paths, identities), lambda f: f.write(text.encode()))

  def forget_footers(self, paths: list[str], identities: list[_storage.Identity]) -> None:
    """Drops what `write_footers` kept for these files (a copy said otherwise): the next build asks again."""
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._footers_path(paths, identities))

  def _footers_path(self, paths: list[str], identities: list[_storage.Identity]) -> str:
    digest = hashlib.sha256()
    for path, found in zip(paths, identities):
      digest.update(f"{_storage.absolute(path)}\n{found.size}\n{found.version}\n".encode())
    return os.path.join(self.directory, f"{FOOTERS_PREFIX}{digest.hexdigest()[:32]}.json")

  def seal(self, path: str, found: _storage.Identity) -> int | None:
    """The CRC-32 the copy of `path` was sealed with when published, or None."""
    seal = read_seal(self.entry_path(path, found) + ".seal")
    return None if seal is None else seal[1]

  def write_count(self, path: str, found: _storage.Identity, count: int, *, index_crc: int,
                  copy_crc: int) -> None:
    """Stores the record count of `path`, bound to its copy's seal and its index's CRC-32.

    Kept after the copy is evicted (a few bytes a file), so a later build
    needs no download to count; checked by its own CRC-32 when read.
    """
    entry = self.entry_path(path, found)
    text = CompanionRecord(count, copy_crc, index_crc).format(os.path.basename(entry))
    self.write_atomic(entry + ".count", lambda f: f.write(text.encode()))


# The header np.save writes for what `record_index` keeps (a C-order int64 array of 1 or 2 axes), read without
# numpy's own parse (a Python literal evaluation: 0.1 ms, most of a first open of a copy under a global shuffle).
_NPY_INT64_HEADER = re.compile(rb"\{'descr': '<i8', 'fortran_order': False, 'shape': \((\d+),(?: (\d+))?\), \} *\n")


def load_index_bytes(data: bytes) -> np.ndarray:
  """The array of a `.npy` file's bytes; an int64 array of 1 or 2 axes without numpy's header parse."""
  if data[:8] == b"\x93NUMPY\x01\x00":
    end = 10 + int.from_bytes(data[8:10], "little")
    match = _NPY_INT64_HEADER.fullmatch(data[10:end])
    if match is not None:
      shape = tuple(int(n) for n in match.groups() if n is not None)
      if len(data) - end == 8 * math.prod(shape):
        return np.frombuffer(data, dtype="<i8", offset=end).reshape(shape)
  return np.load(io.BytesIO(data), allow_pickle=False)


def seal_text(size: int, crc: int) -> str:
  return f"crc32 {crc:08x} size {size}\n"


def read_seal(path: str) -> tuple[int, int] | None:
  """(size, crc) a seal file holds, or None when absent or not one."""
  try:
    with open(path, "rb") as f:
      words = f.read(COUNT_MAX_BYTES).decode("ascii").split()
    if len(words) == 4 and words[0] == "crc32" and words[2] == "size":
      return int(words[3]), int(words[1], 16)
  except (OSError, UnicodeDecodeError, ValueError):
    pass
  return None


@dataclasses.dataclass(frozen=True)
class CompanionRecord:
  """A copy's record count, bound to the copy (its seal) and to its index (the index's CRC-32).

  Written as one line that carries its own CRC-32 (over the fields and the
  copy's name): an edited or torn count file is told from an intact one.
  """

  records: int
  copy_crc: int
  index_crc: int

  def format(self, entry_name: str) -> str:
    body = f"records {self.records} copy {self.copy_crc:08x} index {self.index_crc:08x}"
    return f"{body} check {zlib.crc32(f'{body} {entry_name}'.encode()):08x}\n"

  @classmethod
  def parse(cls, text: str, entry_name: str) -> "CompanionRecord | None":
    words = text.split()
    if len(words) != 8 or words[0::2] != ["records", "copy", "index", "check"]:
      return None
    body = " ".join(words[:6])
    try:
      record = cls(int(words[1]), int(words[3], 16), int(words[5], 16))
      intact = int(words[7], 16) == zlib.crc32(f"{body} {entry_name}".encode()) and record.records >= 0
    except ValueError:
      return None
    return record if intact else None


class FooterRecord:
  """A file's footer as a build needs it, as one line carrying its own CRC-32 (over it and the copy's name)."""

  @staticmethod
  def format(groups: list[int], entry_name: str) -> str:
    body = f"footer {len(groups)} groups {','.join(str(int(n)) for n in groups) or '-'}"
    return f"{body} check {zlib.crc32(f'{body} {entry_name}'.encode()):08x}\n"

  @staticmethod
  def parse(text: str, entry_name: str) -> list[int] | None:
    words = text.split()
    if len(words) != 6 or words[0::2] != ["footer", "groups", "check"]:
      return None
    body = " ".join(words[:4])
    try:
      groups = [int(n) for n in words[3].split(",")] if words[3] != "-" else []
      intact = (int(words[5], 16) == zlib.crc32(f"{body} {entry_name}".encode()) and len(groups) == int(words[1])
                and all(n >= 0 for n in groups))
    except ValueError:
      return None
    return groups if intact else None
