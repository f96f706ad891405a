"""The checksums that vouch for bytes: a store's (crc32c, md5, as GCS encodes them) and the cache's seal."""

from __future__ import annotations

import base64
import hashlib
import os
import zlib

import google_crc32c
import hypothesis
from hypothesis import strategies as st
import pytest

from ckpt_iter import _checksums


def test_the_store_checksum_is_crc32c_first_as_gcs_gives_it():
  info = {"crc32c": "AAAAAA==", "md5Hash": "1B2M2Y8AsgTpgAmY7PhCfg=="}
  assert _checksums.StoreChecksum.of_metadata(info) == _checksums.StoreChecksum("crc32c", "AAAAAA==")
  assert _checksums.StoreChecksum.of_metadata({"md5Hash": "x"}) == _checksums.StoreChecksum("md5", "x")
  assert _checksums.StoreChecksum.of_metadata({"crc32c": None, "etag": "e"}) is None


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_a_running_checksum_fed_in_pieces_is_the_store_encoding_of_the_whole(data, cuts):
  pieces, start = [], 0
  for cut in sorted(c for c in cuts if c <= len(data)) + [len(data)]:
    pieces.append(data[start:cut])
    start = cut
  crc, md5 = _checksums.RunningChecksum("crc32c"), _checksums.RunningChecksum("md5")
  for piece in pieces:
    crc.update(memoryview(piece))
    md5.update(piece)
  assert crc.value() == base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
  assert md5.value() == base64.b64encode(hashlib.md5(data).digest()).decode()


def test_seal_and_store_checksum_of_an_open_file(tmp_path):
  data = os.urandom(3 * 2**20 + 17)
  path = tmp_path / "copy"
  path.write_bytes(data)
  fd = os.open(path, os.O_RDONLY)
  try:
    assert _checksums.seal_of(fd, len(data)) == zlib.crc32(data)
    assert _checksums.seal_of(fd, 10) == zlib.crc32(data[:10])
    expected = base64.b64encode(hashlib.md5(data).digest()).decode()
    assert _checksums.store_checksum_of(fd, len(data), "md5") == expected
  finally:
    os.close(fd)


def test_an_unknown_kind_is_refused():
  with pytest.raises(ValueError, match="unknown checksum kind 'sha1'"):
    _checksums.RunningChecksum("sha1")
