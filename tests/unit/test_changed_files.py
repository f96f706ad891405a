"""A restore refused because the source's files changed names the files written after the checkpoint
(issue 66 item 12): the digest of many files cannot say which one changed, and the refusal said to rebuild with
source='jsonl[6 files ... sha256:...]', which no one can act on."""

from __future__ import annotations

import json
import os
import re
import time

import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _changed_files
from ckpt_iter import _storage


def _files(directory, count=6, lines=10):
  os.makedirs(directory, exist_ok=True)
  for part in range(count):
    with open(os.path.join(directory, f"part-{part}.jsonl"), "w") as f:
      f.writelines(json.dumps({"id": part * 100 + i}) + "\n" for i in range(lines))
  return os.path.join(directory, "part-*.jsonl")


def _save_one_step(root, make):
  iterator = ckpt_iter.DataIterator(make())
  next(iterator)
  with ocp.CheckpointManager(root) as manager:
    manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()


def _restore(root, make, **restore):
  with ocp.CheckpointManager(root) as manager:
    manager.restore(1, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(make()),
                                                                               **restore)))


def _rewrite_same_size(path, shift):
  with open(path) as f:
    lines = [json.loads(line) for line in f]
  time.sleep(0.01)  # a change time after the checkpoint's, however coarse the clock
  with open(path, "w") as f:
    f.writelines(json.dumps({"id": (r["id"] + shift) % 1000}) + "\n" for r in lines)


@pytest.mark.parametrize("mixture", [False, True])
def test_a_refused_restore_names_the_files_written_after_the_checkpoint(tmp_path, mixture):
  glob = _files(str(tmp_path / "data"))
  other = _files(str(tmp_path / "other"), count=2)
  if mixture:
    make = lambda: ckpt_iter.make_dataset({"a": glob, "b": other}, weights={"a": 1, "b": 1}, batch_size=2, seed=0)  # noqa: E731
  else:
    make = lambda: ckpt_iter.make_dataset(glob, batch_size=2, seed=0)  # noqa: E731
  root = str(tmp_path / "ckpt")
  _save_one_step(root, make)
  changed = str(tmp_path / "data" / "part-3.jsonl")
  _rewrite_same_size(changed, 1)  # same size: the description is the same, only the digest differs
  with pytest.raises(ckpt_iter.ConfigDriftError) as refused:
    _restore(root, make)
  message = str(refused.value)
  assert refused.value.changed_files == [changed]
  assert re.search(r"Written after this checkpoint was \(.* UTC\): .*part-3.jsonl \(written .* UTC\)\. Put back "
                   r"what they held", message), message
  assert "Rebuild the pipeline with source=" not in message
  # The way it names is one: the same restore with the digest accepted continues.
  _restore(root, make, allow_drift=set(refused.value.differences))


def test_a_file_grown_among_many_is_named_and_the_summary_is_not_offered_as_a_value(tmp_path):
  glob = _files(str(tmp_path / "data"))
  make = lambda: ckpt_iter.make_dataset(glob, batch_size=2, seed=0)  # noqa: E731
  root = str(tmp_path / "ckpt")
  _save_one_step(root, make)
  time.sleep(0.01)
  with open(tmp_path / "data" / "part-5.jsonl", "a") as f:
    f.write(json.dumps({"id": 999}) + "\n")
  with pytest.raises(ckpt_iter.ConfigDriftError) as refused:
    _restore(root, make)
  message = str(refused.value)
  assert ("Restore the data the run read as it was (source, source_digest, source_length: its files or records, "
          "which changed)") in message
  assert "sha256:" in message and "Rebuild the pipeline with source=" not in message  # the summary is shown, once
  assert refused.value.changed_files == [str(tmp_path / "data" / "part-5.jsonl")]


def test_with_no_file_newer_than_the_checkpoint_the_one_written_last_is_named_as_a_lead(tmp_path):
  # A file changed between the build and the save, or a source changed otherwise (here: a file left out): no
  # file is named as changed, and the one written last is given as a lead.
  glob = _files(str(tmp_path / "data"))
  make = lambda: ckpt_iter.make_dataset(glob, batch_size=2, seed=0)  # noqa: E731
  root = str(tmp_path / "ckpt")
  _save_one_step(root, make)
  fewer = lambda: ckpt_iter.make_dataset(glob.replace("part-*", "part-[0-4]"), batch_size=2, seed=0)  # noqa: E731
  with pytest.raises(ckpt_iter.ConfigDriftError) as refused:
    _restore(root, fewer)
  message = str(refused.value)
  assert refused.value.changed_files == [] and "Written after" not in message
  assert re.search(r"No file of the source was written after this checkpoint was \(.* UTC\); the one written "
                   r"last is .*part-4.jsonl \(written .* UTC\)\.$", message), message


def test_written_at_reads_a_gcs_generation_and_a_local_change_time(tmp_path):
  path = tmp_path / "f"
  path.write_text("x")
  found = _storage.identity(str(path))
  assert abs(_storage.written_at(found) - os.stat(path).st_ctime) < 1e-3
  assert _storage.written_at(_storage.Identity(1, "generation=1765000000123456", "1765000000123456")) == 1765000000.123456
  assert _storage.written_at(_storage.Identity(1, "ETag=abc", None)) is None  # another store: unknown
  assert _storage.written_at(_storage.Identity(1, "generation=7", "7")) is None  # not a time
  assert _changed_files._utc(0) == "1970-01-01 00:00:00 UTC"  # pylint: disable=protected-access
