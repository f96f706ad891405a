"""Arrays one process writes for the pod (`_pod_exchange.share_arrays`), and how the others read them.

Real files in a temporary directory, read back by the one reader
(`_files.read_state`, `elastic.read_replicated`). The 2-process Tunix runs of
tests/integration/test_tunix_multihost.py check the same layout as real
processes write it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ckpt_iter import _files
from ckpt_iter import _npz
from ckpt_iter import _storage
from ckpt_iter import elastic
from ckpt_iter import errors
import support


def test_a_process_sharing_process_0s_arrays_reads_them_and_checks_their_digest(tmp_path):
  arrays = {"ids": np.arange(12, dtype=np.int32).reshape(3, 4), "logps": np.linspace(0, 1, 3, dtype=np.float32)}
  value = support.pending_state(arrays)
  support.write_process_files(tmp_path, value, 0, 2)
  support.write_process_files(tmp_path, value, 1, 2, shared_from=0)
  assert sorted(os.listdir(tmp_path)) == ["ckpt_iter.json", "process_0-of-2.json", "process_0-of-2.npz",
                                          "process_1-of-2.json"]
  support.assert_arrays_identical(_files.read_state(str(tmp_path), 1, 2).pending.items[0], arrays)
  # Process 0's npz replaced by a sound one of other arrays (its header with it):
  # process 1's digest no longer matches what it would load.
  support.write_process_files(tmp_path, support.pending_state({"ids": arrays["ids"] + 1, "logps": arrays["logps"]}), 0, 2)
  with pytest.raises(errors.InvalidStateError, match=r"process_1-of-2.json: shares the arrays of .*process_0-of-2.npz"):
    _files.read_state(str(tmp_path), 1, 2)


@pytest.mark.parametrize("field, value, says", [
    (_files.ARRAYS_FROM, 1, "must name another process"),
    (_files.ARRAYS_FROM, 7, "must name another process"),
    (_files.ARRAYS_FROM, "0", "must name another process"),
    (_npz.ARRAYS_SHA256, "abc", "not a SHA-256"),
])
def test_a_garbled_sharing_field_is_refused_naming_it(tmp_path, field, value, says):
  value_state = support.pending_state({"ids": np.arange(4, dtype=np.int32)})
  support.write_process_files(tmp_path, value_state, 0, 2)
  support.write_process_files(tmp_path, value_state, 1, 2, shared_from=0)
  path = tmp_path / "process_1-of-2.json"
  header = json.loads(path.read_text())
  header[field] = value
  path.write_text(json.dumps(header))
  with pytest.raises(errors.InvalidStateError, match=f"field '{field}'.*{says}"):
    _files.read_state(str(tmp_path), 1, 2)


def test_another_count_reads_every_header_and_one_npz(tmp_path, monkeypatch):
  arrays = {"ids": np.arange(4096, dtype=np.int32)}
  value = support.pending_state(arrays)
  for index in range(4):
    support.write_process_files(tmp_path, value, index, 4, shared_from=None if index == 0 else 0)
  read = []
  original = _storage.read_bytes
  monkeypatch.setattr(_storage, "read_bytes", lambda path, **kw: read.append(os.path.basename(path)) or original(path, **kw))
  restored = elastic.read_replicated(str(tmp_path), 4)
  support.assert_arrays_identical(restored.pending.items[0], arrays)
  assert sorted(read) == sorted(["process_0-of-4.json", "process_1-of-4.json", "process_2-of-4.json",
                                 "process_3-of-4.json", "process_0-of-4.json", "process_0-of-4.npz"])


def test_another_count_is_refused_when_a_process_saved_other_arrays(tmp_path):
  support.write_process_files(tmp_path, support.pending_state({"ids": np.arange(4, dtype=np.int32)}), 0, 2)
  support.write_process_files(tmp_path, support.pending_state({"ids": np.arange(4, dtype=np.int32) + 1}), 1, 2)
  with pytest.raises(errors.UnsupportedConfigError, match=r"process 1 of 2 saved another data state .*differ in arrays"):
    elastic.read_replicated(str(tmp_path), 2)
