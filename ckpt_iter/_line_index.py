"""The line index of a JSONL file: where each non-blank line starts and ends, built and kept.

Built by one pass over the file's bytes (`index_lines`, or `index_lines_of`
bytes in memory), the one rule for what a JSONL record is: a shard cache's
copies are indexed by it too (`_jsonl`). For a file read in place, the
index is kept in a local cache (`cached_line_index`, under
`index_cache_location`), used again only while the file's size and version
match and spot checks of its bytes agree.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

import numpy as np

from ckpt_iter import _storage
from ckpt_iter import errors

INDEX_CACHE_ENV = "CKPT_ITER_INDEX_CACHE_DIR"
_INDEX_CHUNK_BYTES = 16 * 2**20
_BLANK_BYTES = (b"\r", b" ", b"\t")  # a line of one of these alone is blank, as an empty one is
_FEW_LINES = 64  # bytes in memory with at most this many newlines are indexed line by line


def line_index_array(path: str) -> np.ndarray:
  """The line index of a local file as one (2, lines) int64 array: starts, then ends."""
  starts, ends = index_lines(path)
  return np.stack([starts, ends]) if len(starts) else np.zeros((2, 0), np.int64)


def index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns start and end byte offsets of the non-blank lines of a file.

  Reads the file in 16 MiB chunks: memory is 16 bytes per line, not the file.
  """
  with _storage.open_read(path) as f:
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    # Never more than is left: a read of N bytes first sets aside N, however small the file.
    chunks = iter(lambda: f.read(min(_INDEX_CHUNK_BYTES, max(size - f.tell(), 2**16))), b"")

    def byte_at(offset: int) -> bytes:
      f.seek(offset)
      return f.read(1)

    return _lines_of(chunks, byte_at)


def index_lines_of(data: bytes) -> tuple[np.ndarray, np.ndarray]:
  """`index_lines` of a file's bytes in memory (a small copy read whole)."""
  if data.count(b"\n") > _FEW_LINES:
    return _lines_of([data], lambda offset: data[offset:offset + 1])
  # A few lines: found one by one, where numpy's calls over the whole cost more than the scan (a 1 KiB copy
  # of 10 lines: 19 us). The same rule as `_lines_of`; a property holds the two equal.
  starts, ends = [], []
  start, size = 0, len(data)
  while start < size:
    end = data.find(b"\n", start)
    end = size if end < 0 else end
    if end - start > 1 or (end - start == 1 and data[start:end] not in _BLANK_BYTES):
      starts.append(start)
      ends.append(end)
    start = end + 1
  return np.array(starts, np.int64), np.array(ends, np.int64)


def _lines_of(chunks: Any, byte_at: Any) -> tuple[np.ndarray, np.ndarray]:
  """The start and end offsets of the non-blank lines of a file given as its `chunks` in order (`byte_at(i)`:
  its byte at offset i, to tell a blank line of one byte from a record)."""
  starts, ends = [], []
  position = 0
  line_start = 0
  for chunk in chunks:
    newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + position
    if len(newlines):
      starts.append(np.concatenate([[line_start], newlines[:-1] + 1]))
      ends.append(newlines)
      line_start = int(newlines[-1]) + 1
    position += len(chunk)
  if line_start < position:
    starts.append(np.array([line_start]))
    ends.append(np.array([position]))
  if not starts:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  start = np.concatenate(starts).astype(np.int64)
  end = np.concatenate(ends).astype(np.int64)
  # Drop blank lines ("" or "\r"); a record line is never that short.
  keep = end - start > 1
  for i in np.flatnonzero(end - start == 1):
    keep[i] = byte_at(int(start[i])) not in _BLANK_BYTES
  return start[keep], end[keep]


# ---------------------------------------------------------------------------
# The JSONL line-index cache: one local .npy per file, an int64 array
#   [magic, version, size, version_digest, line_count, starts..., ends...]
# written atomically, read with allow_pickle=False, and used only when the
# file's size and version (`_storage.identity`: inode, mtime and ctime of a
# local file; generation and checksum of an object) match, and, for a local
# file, the offsets agree with spot-checked bytes of the file. An object's
# generation changes with every write, so a remote file is not spot-checked
# (each check would be a request).

# Smaller files are scanned every time: that takes about a millisecond, and
# caching them would only litter the cache directory.
INDEX_CACHE_MIN_BYTES = 2**20
_CACHE_MAGIC = 0x636B70746964780A  # "ckptidx\n"
_CACHE_VERSION = 2
_CACHE_HEADER = 5
_CACHE_SPOT_CHECKS = 8
_CACHE_MAX_TAIL_BYTES = 64 * 2**10
_LINE_SPACE = frozenset(b"\r\n \t")

_log = logging.getLogger(__name__)


def default_decompression_cache() -> str:
  """Where compressed JSONL files read with no `ShardCache` are kept decompressed: beside the line
  index cache (`~/.cache/ckpt_iter/decompressed`, or under $XDG_CACHE_HOME)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "ckpt_iter", "decompressed")


def index_cache_location(index_cache_dir: str | None = None) -> str | None:
  """The directory JSONL line indexes are cached in, or None when disabled."""
  if index_cache_dir is None:
    index_cache_dir = os.environ.get(INDEX_CACHE_ENV)
  if index_cache_dir is None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    index_cache_dir = os.path.join(base, "ckpt_iter", "jsonl_index")
  if index_cache_dir and _storage.is_url(index_cache_dir):
    raise errors.InvalidArgumentError(
        f"index_cache_dir={index_cache_dir!r}: the JSONL index cache must be a local directory "
        f"(it is memory-mapped); pass a local path, or set {INDEX_CACHE_ENV} to one."
    )
  return index_cache_dir or None


def index_cache_path(path: str, cache_dir: str) -> str:
  """The cache file of one JSONL file: keyed by its absolute path or URL."""
  path = _storage.absolute(path)
  key = hashlib.sha256(path.encode()).hexdigest()[:24]
  return os.path.join(cache_dir, f"{key}.{os.path.basename(path)}.ckpt_iter-index.npy")


def cached_line_index(path: str, cache_dir: str | None,
                       identity: _storage.Identity | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The line index of `path` (`identity`: its identity, if just read): from its cache if valid, else built."""
  identity = identity or _storage.identity(path)
  if cache_dir is None or identity.size < INDEX_CACHE_MIN_BYTES or identity.version is None:
    return index_lines(path)
  cache_path = index_cache_path(path, cache_dir)
  cached = _read_index_cache(cache_path, path, identity)
  if cached is not None:
    return cached
  starts, ends = index_lines(path)
  # Cache only an index of a file that did not change while it was read.
  if _storage.identity(path) == identity:
    _write_index_cache(cache_path, identity, starts, ends)
  return starts, ends


def _read_index_cache(
    cache_path: str, path: str, identity: _storage.Identity
) -> tuple[np.ndarray, np.ndarray] | None:
  """The cached (starts, ends) if the cache is intact and matches the file."""
  try:
    # Mapped, not read: the checks below touch the offsets once, and the
    # index is then used in place (no copy of 16 bytes per line).
    array = np.load(cache_path, mmap_mode="r", allow_pickle=False)
  except FileNotFoundError:
    return None
  except (OSError, ValueError, EOFError) as e:  # truncated, not an .npy, pickled
    _log.info("ignoring the unreadable JSONL index cache %s (%s)", cache_path, e)
    return None
  if (
      array.dtype != np.int64 or array.ndim != 1 or len(array) < _CACHE_HEADER
      or array[0] != _CACHE_MAGIC or array[1] != _CACHE_VERSION
  ):
    _log.info("ignoring the JSONL index cache %s: not a version %d index", cache_path, _CACHE_VERSION)
    return None
  size, version, count = (int(v) for v in array[2:5])
  if (size, version) != (identity.size, _storage.version_digest(identity.version)):
    return None  # stale: the file changed since it was indexed
  if len(array) != _CACHE_HEADER + 2 * count:
    return None
  starts = array[_CACHE_HEADER:_CACHE_HEADER + count]
  ends = array[_CACHE_HEADER + count:]
  if not _storage.is_url(path) and not _offsets_agree_with_file(path, size, starts, ends):
    _log.info("ignoring the JSONL index cache %s: it disagrees with %s", cache_path, path)
    return None
  return np.asarray(starts), np.asarray(ends)


def _offsets_agree_with_file(path: str, size: int, starts: np.ndarray, ends: np.ndarray) -> bool:
  """Offsets ordered and in range; spot-checked lines start and end at newlines.

  Reads at most a few dozen bytes plus the tail after the last line: the last
  line must end where the file's records end (only blank space after it).
  """
  count = len(starts)
  if count == 0:
    return _only_space(path, 0, size)
  if starts[0] < 0 or ends[-1] > size or np.any(ends <= starts):
    return False
  if count > 1 and np.any(starts[1:] <= ends[:-1]):
    return False
  checks = sorted({(i * count) // _CACHE_SPOT_CHECKS for i in range(_CACHE_SPOT_CHECKS)} | {count - 1})
  with _storage.open_read(path) as f:
    for i in checks:
      start, end = int(starts[i]), int(ends[i])
      if start > 0:
        f.seek(start - 1)
        if f.read(1) != b"\n":
          return False
      if end < size:
        f.seek(end)
        if f.read(1) != b"\n":
          return False
  return _only_space(path, int(ends[-1]), size)


def _only_space(path: str, start: int, size: int) -> bool:
  if size - start > _CACHE_MAX_TAIL_BYTES:
    return False
  with _storage.open_read(path) as f:
    f.seek(start)
    return all(byte in _LINE_SPACE for byte in f.read(size - start))


def _write_index_cache(
    cache_path: str, identity: _storage.Identity, starts: np.ndarray, ends: np.ndarray
) -> None:
  """Writes the cache atomically; a directory that is not writable is skipped."""
  header = np.array([
      _CACHE_MAGIC, _CACHE_VERSION, identity.size, _storage.version_digest(identity.version), len(starts)
  ], np.int64)
  temporary = f"{cache_path}.tmp-{os.getpid()}-{threading.get_ident()}"
  try:
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with open(temporary, "wb") as f:
      # One .npy array written in parts: no second copy of the index in memory.
      np.lib.format.write_array_header_1_0(f, {
          "descr": np.dtype(np.int64).str, "fortran_order": False,
          "shape": (len(header) + 2 * len(starts),)})
      for part in (header, starts, ends):
        np.ascontiguousarray(part, dtype=np.int64).tofile(f)
    os.replace(temporary, cache_path)
  except OSError as e:
    _log.info("not caching the JSONL line index at %s (%s)", cache_path, e)
    try:
      os.unlink(temporary)
    except OSError:
      pass
