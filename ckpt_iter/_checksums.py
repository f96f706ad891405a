"""Checksums that vouch for bytes before they are trained: a store's own, and the shard cache's seal.

Two kinds, for two questions:

- `StoreChecksum`: did a download receive the object the store holds? The
  store's own checksum of the object (GCS: crc32c, and md5 for objects that
  are not composite; base64 of the big-endian digest, as the store gives it),
  from the metadata a source's identity is made of, compared with the bytes
  as they arrive.
- `seal_of`: is a local copy still the bytes that were checked? A CRC-32 of
  the whole copy, recorded when the copy is published and compared when a
  process opens it (`ShardCache`); zlib's, so it needs no extra package.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import zlib
from typing import Any

from ckpt_iter import errors

# Bytes hashed per read of a local copy: bounded memory whatever its size.
_CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class StoreChecksum:
  """The store's checksum of an object: `kind` "crc32c" or "md5", `value` as the store encodes it (base64)."""

  kind: str
  value: str

  @classmethod
  def of_metadata(cls, info: dict[str, Any]) -> "StoreChecksum | None":
    """The checksum an object's metadata holds (crc32c first: composite objects have no md5), or None."""
    for key, kind in (("crc32c", "crc32c"), ("md5Hash", "md5")):
      value = info.get(key)
      if isinstance(value, str) and value:
        if kind == "crc32c" and _crc32c_module() is None and isinstance(info.get("md5Hash"), str):
          continue  # no crc32c here: the md5 vouches as well
        return cls(kind, value)
    return None

  def running(self) -> "RunningChecksum":
    """A digest of this kind, fed the bytes as they arrive."""
    return RunningChecksum(self.kind)


class RunningChecksum:
  """The digest of bytes fed in pieces, encoded as the store encodes its checksum."""

  def __init__(self, kind: str):
    if kind == "crc32c":
      crc32c = _crc32c_module()
      if crc32c is None:
        raise errors.MissingPackageError(
            "checking a download's crc32c needs the google-crc32c package (gcsfs installs it): "
            "pip install google-crc32c")
      self._digest: Any = crc32c.Checksum()
    elif kind == "md5":
      self._digest = hashlib.md5(usedforsecurity=False)
    else:
      raise ValueError(f"unknown checksum kind {kind!r}")
    self.kind = kind

  def update(self, data: Any) -> None:
    self._digest.update(bytes(data) if self.kind == "crc32c" and not isinstance(data, bytes) else data)

  def value(self) -> str:
    return base64.b64encode(self._digest.digest()).decode()


def seal_of(fd: int, size: int) -> int:
  """The CRC-32 of the first `size` bytes of open file `fd` (read in bounded chunks, from offset 0)."""
  crc = 0
  offset = 0
  while offset < size:
    data = os.pread(fd, min(_CHUNK_BYTES, size - offset), offset)
    if not data:
      break
    crc = zlib.crc32(data, crc)
    offset += len(data)
  return crc


def store_checksum_of(fd: int, size: int, kind: str) -> str:
  """The store-encoded checksum (`kind`) of the first `size` bytes of open file `fd`."""
  digest = RunningChecksum(kind)
  offset = 0
  while offset < size:
    data = os.pread(fd, min(_CHUNK_BYTES, size - offset), offset)
    if not data:
      break
    digest.update(data)
    offset += len(data)
  return digest.value()


def _crc32c_module() -> Any:
  try:
    import google_crc32c  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return google_crc32c
