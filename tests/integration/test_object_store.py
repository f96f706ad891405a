"""Checkpoints and sources on gs://, against a real local GCS emulator, in fresh processes.

The emulator (fake-gcs-server, `gcs_emulator` fixture) serves every client
of the stack over HTTP on 127.0.0.1: gcsfs (ckpt_iter's files, epath),
tensorstore (Orbax's arrays) and array_record. Each save and each restore is
its own process (tests/workers/object_store_worker.py); a save run goes on
past its last checkpoint, so it is the uninterrupted run a restore is
compared with, batch for batch.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import ckpt_iter

from ckpt_iter import _object_store
from ckpt_iter import _storage
from ckpt_iter import errors

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "object_store_worker.py")
_MULTIHOST_WORKER = os.path.join(os.path.dirname(_HERE), "workers", "multihost_worker.py")
_REPO = os.path.dirname(os.path.dirname(_HERE))
_TIMEOUT_SECONDS = 300
# Over _line_index.INDEX_CACHE_MIN_BYTES (1 MiB) each, so their line indexes are cached.
_RECORDS_PER_FILE = 20_000


def _worker(tmp_path, name: str, **config) -> dict:
  config["out"] = str(tmp_path / f"{name}.json")
  path = tmp_path / f"{name}.config.json"
  path.write_text(json.dumps(config))
  process = subprocess.run(
      [sys.executable, _WORKER, str(path)], capture_output=True, text=True,
      timeout=_TIMEOUT_SECONDS, env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert process.returncode == 0, f"{name} failed:\n{process.stderr[-4000:]}"
  with open(config["out"]) as f:
    return json.load(f)


def _upload_sources(prefix: str, kind: str) -> str:
  """Two source files of 20,000 records each at `prefix`; returns their glob."""
  for part in range(2):
    records = [{"id": part * _RECORDS_PER_FILE + i, "text": "x" * 40} for i in range(_RECORDS_PER_FILE)]
    if kind == "jsonl":
      data = "".join(json.dumps(r) + "\n" for r in records).encode()
    else:
      import pyarrow as pa  # pylint: disable=g-import-not-at-top
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

      buffer = io.BytesIO()
      pq.write_table(pa.Table.from_pylist(records), buffer, row_group_size=1000)
      data = buffer.getvalue()
    _storage.write_bytes(f"{prefix}/prompts-{part}.{kind}", data)
  return f"{prefix}/prompts-*.{kind}"


def test_storage_reads_writes_and_lists_objects(gcs_root):
  path = f"{gcs_root}/a/b.json"
  _storage.write_bytes(path, b"0123456789")
  assert _storage.read_bytes(path, max_bytes=10) == b"0123456789"
  with pytest.raises(_storage.TooLargeError):
    _storage.read_bytes(path, max_bytes=9)
  with pytest.raises(FileNotFoundError):
    _storage.read_bytes(f"{gcs_root}/a/missing.json", max_bytes=10)
  _storage.write_bytes(f"{gcs_root}/a/c/d.json", b"{}")
  assert sorted(_storage.list_entries(f"{gcs_root}/a")) == [("b.json", False), ("c", True)]
  assert _storage.is_dir(f"{gcs_root}/a/c") and not _storage.is_dir(f"{gcs_root}/a/nothing")
  assert _storage.is_file(path) and not _storage.is_file(f"{gcs_root}/a/c")
  assert _storage.glob(f"{gcs_root}/a/*.json") == [path]
  with pytest.raises(FileNotFoundError):
    _storage.list_entries(f"{gcs_root}/nothing")
  assert _storage.RangeReader(path).read(3, 6) == b"345"


def test_a_range_reader_sent_to_a_grain_worker_reads_the_generation_it_pinned(gcs_root):
  path = f"{gcs_root}/a/pinned.jsonl"
  _storage.write_bytes(path, b"0123456789")
  clone = pickle.loads(pickle.dumps(_storage.RangeReader(path)))  # as Grain sends it to a worker
  assert clone.read(3, 6) == b"345"
  _storage.write_bytes(path, b"abcdefghij")  # same size: only the generation tells it apart
  with pytest.raises(errors.InvalidStateError, match=rf"{path}: replaced or rewritten .*generation \d+ is gone"):
    clone.read(3, 6)
  assert _storage.RangeReader(path).read(3, 6) == b"def"
  # Deleted, not replaced: said so (issue 66 item 16), with what to do.
  later = pickle.loads(pickle.dumps(_storage.RangeReader(path)))
  fs, key = __import__("ckpt_iter._object_store", fromlist=["filesystem"]).filesystem(path)
  fs.rm(key)
  with pytest.raises(errors.InvalidStateError, match=rf"{path}: deleted since this source indexed it .*Put the "
                     r"object back, or build the source again"):
    later.read(3, 6)


def test_an_overwritten_object_gets_a_new_identity_and_a_new_jsonl_index(gcs_root, tmp_path, monkeypatch):
  """The index cache of a remote file is keyed by the object's generation, not by its size or time."""
  from ckpt_iter import _line_index  # pylint: disable=g-import-not-at-top
  from ckpt_iter import sources as sources_lib  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_line_index, "INDEX_CACHE_MIN_BYTES", 0)
  built = []
  original = _line_index.index_lines
  monkeypatch.setattr(_line_index, "index_lines", lambda path: built.append(path) or original(path))
  path = f"{gcs_root}/data.jsonl"
  _storage.write_bytes(path, b'{"id": 1}\n{"id": 2}\n')
  first = _storage.identity(path)
  cache = str(tmp_path / "cache")
  assert [sources_lib.JsonlSource([path], index_cache_dir=cache)[i] for i in (0, 1)] == [{"id": 1}, {"id": 2}]
  sources_lib.JsonlSource([path], index_cache_dir=cache)
  assert len(built) == 1  # the second start used the cache
  _storage.write_bytes(path, b'{"id": 3}\n{"id": 4}\n')  # same size, a new generation
  assert _storage.identity(path).size == first.size and _storage.identity(path).version != first.version
  source = sources_lib.JsonlSource([path], index_cache_dir=cache)
  assert len(built) == 2 and source[1] == {"id": 4}


@pytest.mark.parametrize("small_upload_bytes, npz_writes", [(_object_store.SMALL_UPLOAD_BYTES, 1), (1024, 2)])
def test_an_npz_up_to_the_small_upload_size_is_one_upload_and_a_larger_one_streamed(
    gcs_emulator, gcs_root, monkeypatch, small_upload_bytes, npz_writes):
  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_object_store, "SMALL_UPLOAD_BYTES", small_upload_bytes)
  value = state_lib.IteratorState(
      kind="repeat", fingerprint={}, position={"next_index": 1},
      pending=state_lib.Pending(items=tuple({"ids": np.arange(1024, dtype=np.int32) * i} for i in range(3)),
                                schedule=(2, 0, 1)))
  header, arrays = codec.encode_state(value)
  since = os.path.getsize(gcs_emulator.log_path)
  _files.write_files(f"{gcs_root}/1/data", header, arrays, process_index=0, process_count=1)
  # A simple upload names its object in its body, a streamed one in its URL: counted as the
  # root's uploads, the npz's being all but the header's one.
  writes = [r for r in gcs_emulator.requests(since) if r.kind == "write"]
  assert len(writes) == npz_writes + 1, writes
  read = _files.read_state(f"{gcs_root}/1/data", 0, 1)
  for before, after in zip(value.pending.items, read.pending.items):
    assert before["ids"].tobytes() == after["ids"].tobytes()
  assert read.pending.schedule == (2, 0, 1)


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_one_step_costs_the_same_object_operations_however_many_steps_are_kept(gcs_emulator, gcs_root, verb, capsys):
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top

  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  counts = {}
  emulator_lib.write_repeat_steps(f"{gcs_root}/warm", 3)
  cli.main([verb, f"{gcs_root}/warm", "--step", "3"])  # the client's one-time bucket lookup
  for kept in (4, 32):
    root = f"{gcs_root}/kept{kept}"
    emulator_lib.write_repeat_steps(root, kept)
    runs = []
    for _ in range(3):
      since = os.path.getsize(gcs_emulator.log_path)
      assert cli.main([verb, root, "--step", "3"]) == cli.EXIT_OK
      capsys.readouterr()
      # Only the requests on this root: a late log line of an earlier call, or
      # the client's bucket lookup, is not this command's cost. Each distinct
      # request once: gcsfs sometimes asks for the same commit file's metadata
      # twice in one isfile() (in 4 of 10 runs here), whatever the root holds;
      # a cost that grew with the kept steps would name other objects.
      requests = sorted(set(gcs_emulator.requests(since, under=root)), key=repr)
      runs.append(emulator_lib.count_by_kind(requests))
    counts[kept] = min(runs, key=lambda c: sum(c.values()))
  assert counts[4] == counts[32], counts
  assert counts[32]["read"] >= 1 and counts[32]["list"] >= 1, counts[32]  # the command's own requests, counted
  assert sum(counts[32].values()) <= 16, counts[32]  # verify: 4 reads, 3 metadata, 8 listings here


def test_a_restore_reads_the_pod_part_its_header_refers_to_once(gcs_emulator, gcs_root):
  """Format 5: the fingerprint and lineage are in the count file, once per pod. A same-count restore
  reads it after the header: one more GET than format 4's header alone (1 -> 2 reads here; 2 -> 3
  with pending arrays, docs/benchmarks.md section 9). An elastic restore reads it once, for the saved
  count and the pod part. Nothing is listed."""
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  pipeline = lambda: ckpt_iter.make_dataset([{"id": i} for i in range(64)], batch_size=4, seed=0,  # noqa: E731
                                            num_epochs=None)
  handler = checkpoint_lib.IteratorCheckpointHandler(0, 1)
  item = None
  for step in (1, 2):  # restored once in between: the pod part holds a lineage
    iterator = ckpt_iter.DataIterator(pipeline())
    if item is not None:
      handler.restore(item, ckpt_iter.IteratorRestore(iterator))
    next(iterator)
    item = f"{gcs_root}/pod/{step}/data"
    handler.save(item, ckpt_iter.IteratorSave(iterator))
  header = _files.read_header(f"{item}/process_0-of-1.json")
  assert header["lineage"]["resumes"] == 1 and "seed" in header["fingerprint"]
  for elastic in (False, True):
    since = gcs_emulator.mark()
    handler.restore(item, ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(pipeline()), elastic=elastic))
    counts = emulator_lib.count_by_kind(gcs_emulator.requests(since, under=item))
    assert (counts["read"], counts["list"]) == (2, 0), (elastic, counts)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_source_class_takes_one_url_or_a_url_glob(gcs_root, kind):
  # One gs:// string is one object (not its characters as paths); a glob lists the bucket.
  from ckpt_iter import sources as sources_lib  # pylint: disable=g-import-not-at-top

  pattern = _upload_sources(f"{gcs_root}/single", kind)
  make = {"jsonl": lambda paths: sources_lib.JsonlSource(paths, index_cache_dir=""),
          "parquet": sources_lib.ParquetSource}[kind]
  one = make(pattern.replace("*", "1"))
  assert len(one) == _RECORDS_PER_FILE and one[0]["id"] == _RECORDS_PER_FILE
  both = make(pattern)
  assert both.paths == [pattern.replace("*", str(part)) for part in range(2)]
  assert len(both) == 2 * _RECORDS_PER_FILE and both[_RECORDS_PER_FILE]["id"] == _RECORDS_PER_FILE


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_object_replaced_under_a_live_source_is_refused_not_read(gcs_root, tmp_path, kind):
  # The source reads the generation it indexed: a replacement with records of
  # the same sizes (the same line offsets, the same row groups) is refused
  # naming the object, as a replaced local file is.
  from ckpt_iter import sources as sources_lib  # pylint: disable=g-import-not-at-top

  pattern = _upload_sources(f"{gcs_root}/data", kind)
  path = pattern.replace("*", "0")
  make = {"jsonl": lambda: sources_lib.JsonlSource([path], index_cache_dir=""),
          "parquet": lambda: sources_lib.ParquetSource([path])}[kind]
  source = make()
  assert source[0] == {"id": 0, "text": "x" * 40}
  records = [{"id": i, "text": "y" * 40} for i in range(_RECORDS_PER_FILE)]
  replaced = "".join(json.dumps(r) + "\n" for r in records).encode()
  if kind == "parquet":
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buffer, row_group_size=1000)
    replaced = buffer.getvalue()
  _storage.write_bytes(path, replaced)
  with pytest.raises(errors.InvalidStateError, match=rf"{path}: replaced or rewritten since this source indexed it"):
    source[_RECORDS_PER_FILE - 1]  # another row group / line than the one read
  assert make()[_RECORDS_PER_FILE - 1]["text"] == "y" * 40  # a new source reads the new object


@pytest.mark.parametrize("pipeline, api", [
    ("parquet", "v1"),
    # The same gs:// paths with other sources and iterators (make test stays
    # under 7 minutes; v0 on gs:// is in make test through the 2-process save).
    pytest.param("jsonl", "v0", marks=pytest.mark.heavy),
    pytest.param("repeat", "v0", marks=pytest.mark.heavy),
    pytest.param("loader", "v0", marks=pytest.mark.heavy),
    pytest.param("repeat", "v1", marks=pytest.mark.heavy),  # v1 is also covered by parquet-v1
])
def test_a_fresh_process_resumes_exactly_from_a_gs_checkpoint(tmp_path, gcs_root, pipeline, api):
  config = {
      "pipeline": pipeline, "api": api, "root": f"{gcs_root}/ckpt", "save_steps": 5, "total": 9,
      "index_cache_dir": str(tmp_path / "index_cache"),
  }
  if pipeline in ("jsonl", "parquet"):
    config["source"] = _upload_sources(f"{gcs_root}/data", pipeline)
  saved = _worker(tmp_path, "save", mode="save", **config)
  # Step 3 of the repeat pipeline falls inside a group's second repeat:
  # its pending items (with their noise) come from the checkpoint.
  restored = _worker(tmp_path, "restore", mode="restore", restore_step=3, **config)
  assert len(saved["batches"]) == 9
  assert [b["ids"] for b in restored["batches"]] == [b["ids"] for b in saved["batches"][3:]]
  assert restored["params"] == (np.arange(4.0) + 3).tolist()
  if pipeline == "jsonl":
    assert saved["index_builds"] == 2 and restored["index_builds"] == 0  # second start: cached
  if pipeline == "repeat":
    # Groups of 2 batches, each yielded twice: step 3 leaves the second
    # group member's second repeat pending. It comes from the checkpoint, bit
    # for bit; the groups after it are new rollouts of the resumed process
    # (fresh noise), each trained exactly num_repeats=2 times.
    assert restored["batches"][0] == saved["batches"][3]
    assert restored["batches"][1]["noise"] != saved["batches"][4]["noise"]
    noise = [n for b in saved["batches"][:3] + restored["batches"][:5] for n in b["noise"]]  # 2 whole groups
    assert sorted(set(noise.count(n) for n in noise)) == [2]
  else:
    assert restored["batches"] == saved["batches"][3:]


def test_inspect_verify_and_diff_read_a_gs_checkpoint(gcs_root, capsys):
  """The CLI on a gs:// root (in this process: what is tested is reading the bucket)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import cli as cli_lib  # pylint: disable=g-import-not-at-top
  import object_store_worker as worker  # pylint: disable=g-import-not-at-top

  root = f"{gcs_root}/ckpt"
  iterator = worker.build({"pipeline": "repeat"})
  with ocp.CheckpointManager(root) as manager:
    for step in range(1, 4):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()

  class Result:
    def __init__(self, code, out):
      self.returncode, self.stdout = code, out

  def cli(*args):
    code = cli_lib.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return Result(code, out)

  inspected = cli("inspect", root, "--json")
  assert inspected.returncode == 0
  summary = json.loads(inspected.stdout)
  assert summary["step"] == 3 and summary["processes"][0]["kind"] == "repeat"
  verified = cli("verify", root)
  assert verified.returncode == 0, verified.stdout
  assert verified.stdout.startswith("ok: ") and "3 steps (1-3)" in verified.stdout
  diffed = cli("diff", root, "--step", "1", "--step", "3", "--json")
  assert diffed.returncode == 0
  assert json.loads(diffed.stdout)["processes"][0]["pending"]["remaining"] == [3, 1]  # pending after steps 1 and 3

  # A torn object in a committed step: verify names it, exit 1.
  _storage.write_bytes(f"{root}/2/data/process_0-of-1.npz", b"PK\x03\x04 torn")
  broken = cli("verify", root)
  assert broken.returncode == 1
  assert "step 2: " in broken.stdout and "process_0-of-1.npz: not a readable npz" in broken.stdout

  # A step without Orbax's commit file (a save cut short on an object store,
  # where Orbax commits by writing it instead of renaming) is not a step,
  # for Orbax and for the CLI alike.
  import fsspec  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  fs, key = fsspec.core.url_to_fs(f"{root}/3/commit_success.txt")
  fs.rm(key)
  with ocp.CheckpointManager(root) as manager:
    assert manager.all_steps() == [1, 2]
  uncommitted = cli("verify", root)
  assert uncommitted.returncode == 1 and "step 2: " in uncommitted.stdout and "step 3" not in uncommitted.stdout
  assert json.loads(cli("inspect", root, "--json").stdout)["step"] == 2
  # And as the command a user runs, finding the bucket through the environment.
  command = subprocess.run([sys.executable, "-m", "ckpt_iter", "inspect", root, "--step", "1"],
                           capture_output=True, text=True, timeout=_TIMEOUT_SECONDS,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert command.returncode == 0 and f"{root}" in command.stdout, command.stderr[-2000:]


def test_audit_proves_a_resumed_gs_chain_and_writes_its_picture_to_the_bucket(gcs_root, capsys):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import cli as cli_lib  # pylint: disable=g-import-not-at-top
  import object_store_worker as worker  # pylint: disable=g-import-not-at-top

  root = f"{gcs_root}/chain"
  for steps in ([1, 2], [3, 4]):  # two processes' worth: the second resumes from step 2
    iterator = worker.build({"pipeline": "repeat"})
    with ocp.CheckpointManager(root) as manager:
      if manager.latest_step() is not None:
        manager.restore(manager.latest_step(), args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
      for step in steps:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
      manager.wait_until_finished()
  code = cli_lib.main(["audit", root, "--json", "--plot", f"{gcs_root}/timeline.png"])
  report = json.loads(capsys.readouterr().out)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  assert [(f["resumed_from"], f["verdict"]) for f in report["findings"]] == [(2, "ok")]
  assert _storage.read_bytes(f"{gcs_root}/timeline.png", max_bytes=2**22)[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------
# Corrupt objects give the same typed errors as corrupt files, and leave the
# iterator as it was.


def _save_repeat_step(root: str):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  import object_store_worker as worker  # pylint: disable=g-import-not-at-top

  iterator = worker.build({"pipeline": "repeat"})
  for _ in range(3):
    next(iterator)
  with ocp.CheckpointManager(root) as manager:
    manager.save(3, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  return iterator


@pytest.mark.parametrize("damage, fragment", [
    ("truncate_npz", "not a readable npz"),
    ("truncate_header", "not valid JSON"),
    ("delete_header", "process_0-of-1.json is missing"),
    ("delete_npz", "process_0-of-1.npz: missing; the state refers to array"),
])
def test_a_torn_or_missing_object_is_a_typed_error_that_changes_nothing(gcs_root, damage, fragment):
  import fsspec  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  import object_store_worker as worker  # pylint: disable=g-import-not-at-top

  root = f"{gcs_root}/ckpt"
  _save_repeat_step(root)
  item = f"{root}/3/data"
  name = "process_0-of-1.npz" if damage.endswith("npz") else "process_0-of-1.json"
  fs, _ = fsspec.core.url_to_fs(item)
  if damage.startswith("truncate"):
    data = _storage.read_bytes(f"{item}/{name}", max_bytes=2**24)
    _storage.write_bytes(f"{item}/{name}", data[: len(data) // 2])
  else:
    fs.rm(f"{item}/{name}".split("://", 1)[1])
  fresh = worker.build({"pipeline": "repeat"})
  before = fresh.get_state()
  with ocp.CheckpointManager(root) as manager, pytest.raises(errors.InvalidStateError) as raised:
    manager.restore(3, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(fresh)))
  assert fragment in str(raised.value) and item in str(raised.value)
  assert fresh.get_state() == before


# ---------------------------------------------------------------------------
# Several JAX processes writing one gs:// step; restored by another count.


def test_two_processes_save_to_gs_and_one_resumes_elastically(tmp_path, gcs_root):
  """jax.distributed with 2 CPU processes writes one gs:// step; 1 process resumes it."""
  import multihost_worker  # pylint: disable=g-import-not-at-top
  import process_group  # pylint: disable=g-import-not-at-top

  def launch(name, count, mode, elastic=False):
    config = {"ckpt_dir": f"{gcs_root}/ckpt", "mode": mode, "elastic": elastic}
    return process_group.run_group(_MULTIHOST_WORKER, tmp_path, name, [config] * count, timeout_seconds=240)

  saved = launch("save2", 2, "save")
  restored = launch("restore2to1", 1, "restore", elastic=True)
  assert restored[0]["params_ok"] and restored[0]["errors"].keys() >= {"data_plain"}
  assert restored[0]["batch_size"] == multihost_worker.GLOBAL_BATCH_SIZE
  # The one process takes both saved processes' rows, in process order.
  for field in ("data_after", "repeat_after"):
    merged = [
        {key: before[key] + other[key] for key in before if key != "tag"}
        for before, other in zip(saved[0][field], saved[1][field])
    ]
    got = [{key: value for key, value in item.items() if key != "tag"} for item in restored[0][field]]
    assert got == merged and got, field


def test_remove_tree_deletes_every_object_under_a_prefix_and_no_other(gcs_root):
  for name in ("7/iter/process_0-of-2.json", "7/iter/process_1-of-2.json", "8/iter/process_0-of-1.json"):
    _storage.write_bytes(f"{gcs_root}/{name}", b"{}")
  _storage.remove_tree(f"{gcs_root}/7")
  assert _storage.list_names(gcs_root) == ["8"]


def test_a_restore_refused_after_an_object_was_rewritten_names_the_object(gcs_root, tmp_path, monkeypatch):
  # issue 66 item 12: a bucket object rewritten (same size: the description is the same, the digest of the
  # files' generations is not) was refused without naming it, and the way through said to rebuild with
  # source='jsonl[6 files ... sha256:...]'. The refusal names the object written after the checkpoint.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  monkeypatch.setenv("CKPT_ITER_SHARD_CACHE_DIR", str(tmp_path / "cache"))
  for part in range(6):
    _storage.write_bytes(f"{gcs_root}/data/part-{part}.jsonl",
                         "".join(json.dumps({"id": part * 100 + i}) + "\n" for i in range(10)).encode())
  make = lambda: ckpt_iter.make_dataset(f"{gcs_root}/data/part-*.jsonl", batch_size=2, seed=0)  # noqa: E731
  iterator = ckpt_iter.DataIterator(make())
  next(iterator)
  with ocp.CheckpointManager(f"{gcs_root}/ckpt") as manager:
    manager.save(1, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  rewritten = f"{gcs_root}/data/part-2.jsonl"
  _storage.write_bytes(rewritten, "".join(json.dumps({"id": 299 - i}) + "\n" for i in range(10)).encode())
  with ocp.CheckpointManager(f"{gcs_root}/ckpt") as manager, pytest.raises(ckpt_iter.ConfigDriftError) as refused:
    manager.restore(1, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(make()))))
  assert refused.value.changed_files == [rewritten], str(refused.value)
  assert "Written after this checkpoint was" in str(refused.value) and f"{rewritten} (written " in str(refused.value)
