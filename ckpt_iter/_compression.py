"""Compressed shards (`.jsonl.gz`, `.jsonl.zst`): which files are, and their bytes decompressed as they arrive.

A compressed file is read through the shard cache, which keeps its copy
decompressed (`ShardCache`): records are then byte ranges of the text, as for
a plain file. The checksum a download is compared with is the compressed
object's, over the bytes received; the copy's seal is over the text.
"""

from __future__ import annotations

import zlib
from typing import Any

# Suffix -> compression, for the files a JSONL source reads.
_KINDS = {".gz": "gzip", ".zst": "zstd"}
COMPRESSED_SUFFIXES = tuple(_KINDS)


def compression_of(path: str) -> str | None:
  """"gzip" or "zstd" for a file whose name says so; None for a plain one."""
  for suffix, kind in _KINDS.items():
    if path.endswith(suffix):
      return kind
  return None


def plain_suffix(path: str) -> str:
  """The file's suffix without its compression's: ".jsonl" for "x.jsonl.gz"."""
  import os  # pylint: disable=g-import-not-at-top

  stem = path[: -len(next(s for s in COMPRESSED_SUFFIXES if path.endswith(s)))] if compression_of(path) else path
  return os.path.splitext(stem)[1]


class DecompressingWriter:
  """A writable that decompresses what it is given into `out` (`write`, then `finish`).

  gzip: every member of a multi-member file (as `cat a.gz b.gz` makes);
  zstd: every frame. Raises ValueError on data that is not of its kind.
  """

  def __init__(self, out: Any, kind: str):
    self._out, self.kind = out, kind
    self._member_started = False
    if kind == "gzip":
      self._gzip = zlib.decompressobj(wbits=31)
    elif kind == "zstd":
      try:
        import zstandard  # pylint: disable=g-import-not-at-top
      except ImportError:
        raise ImportError(
            "reading .zst files needs the zstandard package: pip install 'ckpt_iter[files]' (or zstandard)"
        ) from None
      self._zstd = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
    else:
      raise ValueError(f"unknown compression {kind!r}")

  def write(self, data: Any) -> int:
    try:
      return self._write(bytes(data))
    except zlib.error as e:
      raise ValueError(f"not gzip data ({e})") from None
    except Exception as e:  # pylint: disable=broad-except
      if type(e).__name__ == "ZstdError":
        raise ValueError(f"not zstd data ({e})") from None
      raise

  def _write(self, data: bytes) -> int:
    count = len(data)
    if self.kind == "gzip":
      while data:
        self._member_started = True
        self._out.write(self._gzip.decompress(data))
        if not self._gzip.eof:
          break
        data = self._gzip.unused_data  # the next member
        self._gzip, self._member_started = zlib.decompressobj(wbits=31), False
    else:
      self._out.write(self._zstd.decompress(data))
    return count

  def finish(self) -> None:
    """Ends the stream: a truncated one raises ValueError."""
    if self.kind == "gzip":
      self._out.write(self._gzip.flush())
      if self._member_started and not self._gzip.eof:
        raise ValueError("the gzip stream ends inside a member (a truncated file)")
    else:
      self._out.write(self._zstd.flush())
