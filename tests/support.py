"""Helpers the tests share: writing source files, reading whole checkpoints."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Sequence

import grain

from ckpt_iter import _files
from ckpt_iter import elastic
from ckpt_iter import state as state_lib


def orbax_save(directory: str | os.PathLike[str], step: int, **items: Any) -> None:
  """One Orbax step holding `items` (v0 args), written and finished."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(directory)
  manager.save(step, args=ocp.args.Composite(**items))
  manager.wait_until_finished()
  manager.close()


def orbax_restore(directory: str | os.PathLike[str], step: int, **items: Any) -> Any:
  """The Composite restored from one Orbax step (v0 args)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(directory)
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  finally:
    manager.close()


def write_array_record(path: str | os.PathLike[str], records: Sequence[Any]) -> None:
  """Writes records as JSON objects into one ArrayRecord file."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  writer = array_record_module.ArrayRecordWriter(os.fspath(path), "group_size:1")
  try:
    for record in records:
      writer.write(json.dumps(record).encode("utf-8"))
  finally:
    writer.close()


def write_jsonl(path: str | os.PathLike[str], records: Sequence[Any], blank_lines: bool = False) -> None:
  """Writes records one JSON object a line; `blank_lines` puts blank lines and CRLF endings among them."""
  with open(path, "w") as f:
    for i, record in enumerate(records):
      if blank_lines and i % 3 == 0:
        f.write("\n" if i % 2 else "\r\n")
      f.write(json.dumps(record) + ("\r\n" if blank_lines and i % 4 == 1 else "\n"))
    if blank_lines:
      f.write("\n\n")


_STREAMS: dict[tuple[str, ...], Any] = {}


def hf_stream(files: Sequence[str]) -> Any:
  """A fresh Hugging Face streaming dataset over JSONL `files`, at its start (a copy of one loaded once)."""
  import copy  # pylint: disable=g-import-not-at-top

  import datasets  # pylint: disable=g-import-not-at-top

  key = tuple(files)
  if key not in _STREAMS:
    _STREAMS[key] = datasets.load_dataset("json", data_files=list(files), split="train", streaming=True)
  return copy.deepcopy(_STREAMS[key])


def write_parquet(path: str | os.PathLike[str], records: Sequence[Any]) -> None:
  """Writes records into one Parquet file of small row groups (4 rows): reads cross row-group boundaries."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  pq.write_table(pa.Table.from_pylist(records), path, row_group_size=4)


# A file source's suffix -> the function writing records into one file of it.
FILE_WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet, "array_record": write_array_record}


def sample_records(count: int) -> list[dict[str, Any]]:
  """`count` records holding an int, a string, a float and a list (ids 0 to count - 1)."""
  return [
      {"id": i, "text": f"prompt {i}" + "!" * (i % 3), "score": i / 7, "tokens": [i, i + 1, i * 2]}
      for i in range(count)
  ]


def make_dataset(source: Any, **kwargs: Any) -> Any:
  """ckpt_iter.make_dataset as shard 0 of 1 unless `kwargs` say otherwise (not the JAX process)."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  kwargs.setdefault("shard_index", 0)
  kwargs.setdefault("shard_count", 1)
  return ckpt_iter.make_dataset(source, **kwargs)


def hf_saved(directory: Any, records: Sequence[Any], name: str = "hf") -> str:
  """A Hugging Face dataset of `records` saved to disk under `directory` (the test is skipped without datasets)."""
  import pytest  # pylint: disable=g-import-not-at-top

  import conftest  # pylint: disable=g-import-not-at-top

  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  path = str(directory / name)
  datasets.Dataset.from_list(records).save_to_disk(path)
  return path


def read_all(directory: str | os.PathLike[str]) -> list[state_lib.IteratorState]:
  """Every process's state of an item directory, checked to agree (as verify does)."""
  directory = os.fspath(directory)
  count = _files.saved_process_count(directory)
  states = [_files.read_state(directory, i, count) for i in range(count)]
  elastic.check_agree(directory, states)
  return states


# Read options for a to_iter_dataset read in the test's own thread, nothing read ahead.
NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

CHAIN_RECORDS = [{"id": i} for i in range(23)]
CHAIN_SOURCES = {"a": [{"id": 1000 + i} for i in range(17)], "b": [{"id": 2000 + i} for i in range(11)]}


def chain_pipeline(count: int, index: int, global_batch: int, *, seed: int | None = 5, skip: Any = None,
                   mixture: dict[str, int] | None = None, drop: bool = True, records: Any = None,
                   **shuffle: Any) -> Any:
  """Process `index` of `count`'s make_dataset over CHAIN_RECORDS (4 epochs; or `records`) or a mixture of
  CHAIN_SOURCES.

  `shuffle`: make_dataset's shuffle arguments (shuffle="shards", shard_size, shuffle_window).
  """
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  common = dict(batch_size=global_batch // count, seed=seed, shard_index=index, shard_count=count,
                drop_remainder=drop, skip=skip, **shuffle)
  if mixture is not None:
    sources = {name: CHAIN_SOURCES[name] for name in mixture}
    return ckpt_iter.make_dataset(sources, weights=mixture, num_epochs=None, **common)
  return ckpt_iter.make_dataset(CHAIN_RECORDS if records is None else records, num_epochs=4, **common)


def pack_ids_by_size(rows: Any) -> list[dict[str, Any]]:
  """Greedy packing of records ({"id", "size"}) into rows of at most 4 units; ids padded with -1."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  packed, current, used = [], [], 0
  for record in rows:
    if used + int(record["size"]) > 4:
      packed.append(current)
      current, used = [], 0
    current.append(int(record["id"]))
    used += int(record["size"])
  if current:
    packed.append(current)
  return [{"ids": np.array(ids + [-1] * (4 - len(ids)), dtype=np.int32)} for ids in packed]


def batch_ids(batch: Any) -> list[int]:
  import numpy as np  # pylint: disable=g-import-not-at-top

  return [int(v) for v in np.asarray(batch["id"]).reshape(-1)]


def run_chain(root: str, segments: Sequence[tuple[int, int, int, int, Any]], *,
              make: Callable[..., Any] | None = None, **pipeline: Any) -> list[list[int]]:
  """Trains `segments` [(processes, global batch, batches saved, batches lost, skip)] into `root`.

  `make(count, index, global_batch, skip=...)` builds a process's pipeline (default: `chain_pipeline` with
  `pipeline`'s arguments).

  A step (`<root>/<step>/data`, written by the Orbax handler for every
  process) is saved after each batch; "lost" batches are read after the last
  save (then the segment is killed) and read again by the next segment, which
  restores the latest step (elastic, other weights and sources allowed).

  Returns:
    The global batches the chain kept (the processes' rows in order): the run's data order.
  """
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  kept, step = [], 0
  for number, (count, global_batch, saved, lost, skip) in enumerate(segments):
    build = make or functools.partial(chain_pipeline, **pipeline)
    iterators = [ckpt_iter.DataIterator(build(count, i, global_batch, skip=skip)) for i in range(count)]
    if number and step:  # the latest step, if any was saved
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
            os.path.join(root, str(step), "data"),
            ckpt_iter.IteratorRestore(iterator, elastic=True, allow_drift={"weights", "sources"}))
    for _ in range(saved):
      kept.append([r for iterator in iterators for r in batch_ids(next(iterator))])
      step += 1
      item = os.path.join(root, str(step), "data")
      os.makedirs(item)
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).save(item, ckpt_iter.IteratorSave(iterator))
    for _ in range(lost):
      for iterator in iterators:
        next(iterator, None)  # read past the last save (the stream may end there)
  return kept


def pod_iterators(pipelines: Sequence[Any], step: str | None) -> list[Any]:
  """A DataIterator per process of `pipelines`, each restored from `step` (elastic) when given."""
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  iterators = [ckpt_iter.DataIterator(p) for p in pipelines]
  if step is not None:
    for index, iterator in enumerate(iterators):
      checkpoint_lib.IteratorCheckpointHandler(index, len(iterators)).restore(
          step, ckpt_iter.IteratorRestore(iterator, elastic=True))
  return iterators


def pending_state(arrays: dict[str, Any], **fingerprint: Any) -> state_lib.IteratorState:
  """A learner's state whose one pending item holds `arrays`."""
  return state_lib.IteratorState(
      kind="tunix", fingerprint={"learner": "GRPOLearner", **fingerprint}, position={"next_index": 3},
      pending=state_lib.Pending(items=(arrays,), schedule=(0,)), counters={"train_steps": 3})


def write_process_files(directory: Any, value: state_lib.IteratorState, index: int, count: int, *,
                        shared_from: int | None = None) -> None:
  """Writes process `index`'s files as `_pod_exchange.share_arrays` leaves them (no npz when `shared_from`)."""
  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _npz  # pylint: disable=g-import-not-at-top

  header, arrays = codec.encode_state(value)
  if count > 1:
    header[_npz.ARRAYS_SHA256] = _npz.arrays_sha256(arrays)
  if shared_from is not None:
    header[_files.ARRAYS_FROM] = shared_from
    arrays = {}
  _files.write_files(str(directory), header, arrays, process_index=index, process_count=count, count_file=True)


def assert_arrays_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
  """The same names, dtypes, shapes and bytes."""
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def cli_output(*argv: str) -> tuple[int, str]:
  """`ckpt-iter ARGV` run in this process: (exit code, stdout and stderr); never a traceback."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top

  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  assert "Traceback" not in out.getvalue() + err.getvalue()
  return code, out.getvalue() + err.getvalue()


def modules_entered(call: Any) -> set[str]:
  """The ckpt_iter modules (file names, e.g. "_workers.py") whose functions run in `call()` on this thread."""
  import sys  # pylint: disable=g-import-not-at-top

  package = os.path.dirname(os.path.dirname(_files.__file__)) + os.sep + "ckpt_iter" + os.sep
  entered: set[str] = set()

  def profile(frame: Any, event: str, unused_arg: Any) -> None:
    if event == "call" and frame.f_code.co_filename.startswith(package):
      entered.add(os.path.relpath(frame.f_code.co_filename, package))

  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
  return entered


class StepDeleter:
  """Deletes one step's directory the first time a state header in it is read: after a reader listed the
  root, before it reads (what a writer's retention, e.g. Orbax's max_to_keep, does to a live reader).
  `files_first`: as Orbax does, the files at once and the directories `delay_s` later, from a thread."""

  def __init__(self, monkeypatch: Any, step_dir: str, *, files_first: bool = False, delay_s: float = 0.3):
    self._step_dir, self._files_first, self._delay_s = step_dir, files_first, delay_s
    self._later: Any = None
    self.fired = False
    self._read_header = _files.read_header
    monkeypatch.setattr(_files, "read_header", self._hooked)

  def _hooked(self, path: str, **kwargs: Any) -> Any:
    import shutil  # pylint: disable=g-import-not-at-top
    import threading  # pylint: disable=g-import-not-at-top

    if not self.fired and os.fspath(path).startswith(self._step_dir + os.sep):
      self.fired = True
      if self._files_first:
        for directory, _, names in os.walk(self._step_dir):
          for name in names:
            os.remove(os.path.join(directory, name))
        self._later = threading.Timer(self._delay_s, shutil.rmtree, [self._step_dir])
        self._later.start()
      else:
        shutil.rmtree(self._step_dir)
    return self._read_header(path, **kwargs)

  def join(self) -> None:
    if self._later is not None:
      self._later.join()


def lose_header_on_read(monkeypatch: Any, header: str) -> None:
  """The state file `header` is removed as it is first read, and its step stays (not retention)."""
  real = _files.read_header

  def delete_the_header(path: Any, **kwargs: Any) -> Any:
    if os.fspath(path) == header and os.path.exists(header):
      os.remove(header)
    return real(path, **kwargs)

  monkeypatch.setattr(_files, "read_header", delete_the_header)


class KeyValueStore:
  """The JAX job's key-value store as `_pod_exchange.share_arrays` uses it: set, blocking get, increment, try get,
  delete a directory; safe for the processes of one pod saving from threads of this process at once."""

  def __init__(self) -> None:
    import threading  # pylint: disable=g-import-not-at-top
    self.values: dict[str, str] = {}
    self._changed = threading.Condition()

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    with self._changed:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value
      self._changed.notify_all()

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    with self._changed:
      if not self._changed.wait_for(lambda: key in self.values, timeout=timeout_ms / 1000):
        raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  def key_value_try_get(self, key: str) -> str:
    with self._changed:
      if key not in self.values:
        raise KeyError(f"NOT_FOUND: {key}")
      return self.values[key]

  def key_value_increment(self, key: str, increment: int) -> int:
    with self._changed:
      value = int(self.values.get(key, "0")) + increment
      self.values[key] = str(value)
      self._changed.notify_all()
      return value

  def key_value_delete(self, key: str) -> None:
    with self._changed:
      for name in [k for k in self.values if k == key or k.startswith(key + "/")]:
        del self.values[name]


def save_as_pod(directory: Any, iterators: Sequence[Any], store: "KeyValueStore | None" = None) -> KeyValueStore:
  """Saves process i's iterator as process i of a JAX job of len(iterators) processes, all at once (threads),
  through the checkpoint handler and one `KeyValueStore`: what a pod's save exchanges and writes."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _pod_exchange  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  store = KeyValueStore() if store is None else store
  count = len(iterators)
  original = _pod_exchange._distributed_client  # pylint: disable=protected-access
  _pod_exchange._distributed_client = lambda n: store if n == count else None  # pylint: disable=protected-access
  try:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
      list(pool.map(lambda i: checkpoint_lib.IteratorCheckpointHandler(i, count).save(
          directory, ckpt_iter.IteratorSave(iterators[i])), range(count)))
  finally:
    _pod_exchange._distributed_client = original  # pylint: disable=protected-access
  return store
