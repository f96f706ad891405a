"""Compressed shards (`.jsonl.gz`, `.jsonl.zst`): which files are, and their bytes decompressed as they arrive.

A compressed file is read through the shard cache, which keeps its copy
decompressed (`ShardCache`): records are then byte ranges of the text, as for
a plain file. The checksum a download is compared with is the compressed
object's, over the bytes received; the copy's seal is over the text.
"""

from __future__ import annotations

import zlib
from typing import Any

from ckpt_iter import errors

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


# Decompression is fed in bounded steps, so memory follows these, never the file's compression ratio:
# deflate expands a byte to at most 1,032, so a gzip step of 16 KiB yields 16.5 MiB of text at most; a
# zstd block holds at most 128 KiB of text in as few as 4 bytes (one RLE block), so a 1 KiB step yields
# 32 MiB at most. What follows a member or frame's end in a step is at most a step too.
_INPUT_STEP = {"gzip": 16 * 2**10, "zstd": 2**10}


class DecompressingWriter:
  """A writable that decompresses what it is given into `out` (`write`, then `finish`), in bounded steps.

  gzip: every member of a multi-member file (as `cat a.gz b.gz` makes);
  zstd: every frame. Each member or frame must end: a file cut short
  (a writer killed mid-file) is refused at `finish`, never read as fewer
  records. Memory stays bounded whatever the ratio (a few MiB of text
  per step, written to `out` as it comes).

  Data that is not of its kind does not raise at once: the rest is taken
  and dropped, and `finish` raises. So a download's own checksum, compared
  when the last byte arrived, speaks first: bytes damaged in transit are
  the store's "corrupt" (retried), not a damaged file.
  """

  def __init__(self, out: Any, kind: str):
    self._out, self.kind = out, kind
    self._started = False  # inside a member or frame that has not ended
    self._error: str | None = None  # what the decompressor said of bad data; raised by `finish`
    if kind == "zstd":
      try:
        import zstandard  # pylint: disable=g-import-not-at-top
      except ImportError:
        raise errors.MissingPackageError(
            "reading .zst files needs the zstandard package: pip install 'ckpt_iter[files]' (or zstandard)"
        ) from None
      self._bad_data: tuple[type[BaseException], ...] = (zstandard.ZstdError,)
      self._new_unit = lambda: zstandard.ZstdDecompressor().decompressobj()
    elif kind == "gzip":
      self._bad_data = (zlib.error,)
      self._new_unit = lambda: zlib.decompressobj(wbits=31)
    else:
      raise ValueError(f"unknown compression {kind!r}")
    self._unit = self._new_unit()
    self._step = _INPUT_STEP[kind]

  def write(self, data: Any) -> int:
    view = memoryview(data).cast("B")
    if self._error is None:
      try:
        for start in range(0, len(view), self._step):
          self._decompress(view[start:start + self._step])
      except self._bad_data as e:
        self._error = f"not {self.kind} data ({e})"
    return len(view)

  def _decompress(self, piece: Any) -> None:
    while len(piece):
      self._started = True
      self._out.write(self._unit.decompress(piece))
      if not self._unit.eof:
        return
      piece = self._unit.unused_data  # a member or frame ended: what follows starts the next
      self._unit, self._started = self._new_unit(), False

  def finish(self) -> None:
    """Ends the stream.

    Raises:
      ValueError: the data was not of its kind, or ends inside a member or
        frame (a truncated file).
    """
    if self._error is not None:
      raise ValueError(self._error)
    if self.kind == "gzip":
      self._out.write(self._unit.flush())
    if self._started and not self._unit.eof:
      unit = "member" if self.kind == "gzip" else "frame"
      raise ValueError(f"the {self.kind} stream ends inside a {unit} (a truncated file)")
