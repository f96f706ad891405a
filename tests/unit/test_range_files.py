"""Local files read in place by range (`_storage.RangeReader`): a process holds at most a quarter of its open-file
limit of them open (issue 65: a JSONL corpus of 20,480 local files read in place failed with EMFILE, each file's
descriptor kept open for good; the whole corpus read under a lowered limit, in a process of its own:
tests/integration/test_range_files_limit.py)."""

from __future__ import annotations

import pytest

from ckpt_iter import _storage
from ckpt_iter import errors


def test_a_file_closed_past_the_limit_and_replaced_meanwhile_is_refused_when_opened_again(tmp_path, monkeypatch):
  monkeypatch.setattr(_storage, "_open_file_limit", lambda: 4 * 16)  # 16 descriptors at most
  readers = []
  for part in range(20):
    path = tmp_path / f"f{part}"
    path.write_bytes(b"x" * 10)
    readers.append(_storage.RangeReader(str(path)))
  for reader in readers:
    assert reader.read(0, 3) == b"xxx"
  assert len(_storage._RANGE_FILES._open) <= 16  # pylint: disable=protected-access
  (tmp_path / "f0").unlink()
  (tmp_path / "f0").write_bytes(b"y" * 12)  # replaced while its descriptor was closed
  with pytest.raises(errors.InvalidStateError, match=r"f0: replaced or rewritten since this source indexed it"):
    readers[0].read(0, 3)
