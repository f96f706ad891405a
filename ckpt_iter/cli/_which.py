"""`ckpt-iter which` and `ckpt-iter order`: the records a run read, from its checkpoints.

Reads the data state headers of the steps it needs (no array, no model, no
user code) and asks `ckpt_iter.datamap`:

    ckpt-iter which ROOT --step S      the last batch read before checkpoint S was saved
    ckpt-iter which ROOT --batch K     global batch K of the run, across its resumes
    ckpt-iter order ROOT --out FILE    every global batch in order (JSONL, or Parquet)

A step's own batch needs that step's state (and, to number it and to place
an epoch's short last batch, the states its lineage resumed from); a global
batch needs the latest step's state and those of every step the run resumed
from. Where a needed step is no longer kept, the message says so and names
the keep policy. Where the position does not count stream records (a
filtered or packed make_dataset, a hand-built pipeline) the answer is
computed by user code: the message names `ckpt_iter.which(pipeline, state)`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _storage
from ckpt_iter import datamap
from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.cli import _inspect as inspection

KEEP_POLICY = ("the checkpoint manager's max_to_keep deleted it: Orbax CheckpointManagerOptions(max_to_keep=...), "
               "Tunix checkpointing_options")


class States(collections.abc.Mapping):
  """step -> one process's data state of a layout, each header read when first asked for.

  `for_streams()` is the view a run's map reads the steps it resumed from
  through: a step written by fewer processes than this one's index holds no
  state of it, and there any process's state says the stream (the global
  position, shuffle and mixture every process of a step shares).
  """

  def __init__(self, layout: inspection.Layout, process_index: int = 0, *, any_process_of_fewer: bool = False):
    self._layout, self._process = layout, process_index
    self._any_process_of_fewer = any_process_of_fewer
    self._read: dict[int, state_lib.IteratorState] = {}
    self.asked: set[int] = set()  # the steps a reader tried to read (asked when a read fails)

  def for_streams(self) -> "States":
    """This process's states, and process 0's of a step written by fewer processes (for `RunMap.from_states`)."""
    view = States(self._layout, self._process, any_process_of_fewer=True)
    view._read, view.asked = self._read, self.asked  # pylint: disable=protected-access
    return view

  def __getitem__(self, step: int) -> state_lib.IteratorState:
    if step not in self._read:
      if step not in self._layout.steps:
        raise KeyError(step)
      self.asked.add(step)
      item_dir = self._layout.item_dir(step)
      files = dict(inspection._process_files_or_none(item_dir))  # pylint: disable=protected-access
      process = self._process
      if process not in files and self._any_process_of_fewer and files and max(files.values()) <= process:
        process = 0 if 0 in files else min(files)  # written by fewer processes: none of them is this one
      if process not in files:
        raise KeyError(step)
      path = _files.header_path(item_dir, process, files[process])
      value = codec.header_state(_files.read_header(path), origin=path)
      state_lib.input_stream_skips(value, origin=path)  # a corrupt field named as a restore names it
      if process != self._process:
        return value  # not this process's own: kept out of the cache the strict view shares
      self._read[step] = value
    return self._read[step]

  def __contains__(self, step: Any) -> bool:
    try:
      self[step]
    except KeyError:
      return False
    return True

  def __iter__(self) -> Iterator[int]:
    return iter(self._layout.steps)

  def __len__(self) -> int:
    return len(self._layout.steps)


# ---------------------------------------------------------------------------
# Where a record is in the source files (`--source`).


class SourceFiles:
  """The source files a run read, checked against its fingerprint, to say where a record is.

  Args:
    paths: `--source` values: PATH (a single source; a glob or several
      paths) or NAME=PATH for a mixture's sources.
    fingerprint: the data state's fingerprint.

  Raises:
    UsageError: a path that does not resolve, or a source whose description,
      length or digest differs from the run's (other files than it read).
  """

  def __init__(self, paths: Sequence[str], fingerprint: Mapping[str, Any]):
    from ckpt_iter import sources as sources_lib  # pylint: disable=g-import-not-at-top  (pyarrow etc. when asked)

    self._sources: dict[str, Any] = {}
    self._lib = sources_lib
    grouped: dict[str, list[str]] = {}
    for value in paths:
      name, _, path = value.partition("=") if "=" in value and not _storage.is_url(value) else ("", "", value)
      grouped.setdefault(name, []).append(path)
    for name, group in grouped.items():
      suffix = "" if not name else f"[{name}]"
      try:
        resolved, identity = sources_lib.resolve_source(group if len(group) > 1 else group[0])
      except errors.CkptIterError as e:
        raise inspection.UsageError(f"--source {', '.join(group)}: {e}") from None
      for field, value in (("source", identity.description), ("source_length", identity.length),
                           ("source_digest", identity.digest)):
        saved = fingerprint.get(field + suffix)
        if saved is not None and saved != value:
          raise inspection.UsageError(
              f"--source {', '.join(group)}: its {field}{suffix} is {value!r}, but the run read {saved!r}: "
              "not the files this run read (or they changed since).")
      self._sources[name] = resolved

  def where(self, record: datamap.SourceRecord) -> str | None:
    source = self._sources.get(record.source)
    if source is None:
      return None
    found = self._lib.file_position(source, record.index)
    return None if found is None else f"{os.path.basename(found[0])} {found[1]}"


# ---------------------------------------------------------------------------
# which


@dataclasses.dataclass
class Answer:
  """What `which` found: the batch, and for a Tunix learner its global step."""

  step: int | None
  batch: datamap.Batch
  learner: datamap.LearnerStep | None = None
  note: str | None = None


def which_step(layout: inspection.Layout, step: int, process_index: int = 0,
               states: States | None = None) -> Answer:
  """The last batch read before checkpoint `step` (and a Tunix learner's global step)."""
  states = States(layout, process_index) if states is None else states
  if step not in states:
    raise inspection.UsageError(f"step {step} of {layout.root} holds no data state of process {process_index}.")
  value = states[step]
  note = None
  try:
    run = datamap.RunMap.from_states(states.for_streams(), step, keep_policy=KEEP_POLICY)
  except errors.ItemNotFoundError as e:
    run, note = None, f"not numbered: {e}"
  learner = None
  if value.kind == "tunix" and "learner" in value.fingerprint:
    learner = datamap.learner_step(value, run=run, origin=f"step {step}")
    return Answer(step, learner.prompts, learner, note)
  if run is not None:
    return Answer(step, run.last(), None, note)
  return Answer(step, datamap.last_batch_of(value, origin=f"step {step}"), None, note)


def which_batch(layout: inspection.Layout, number: int, process_index: int = 0,
                states: States | None = None) -> Answer:
  """Global batch `number` of the run the latest step ends."""
  states = States(layout, process_index) if states is None else states
  last = _latest_with_state(layout, states)
  run = datamap.RunMap.from_states(states.for_streams(), last, keep_policy=KEEP_POLICY)
  return Answer(None, run.batch(number), note=f"the run up to step {last}: {run.total} global batches")


def _latest_with_state(layout: inspection.Layout, states: States) -> int:
  for step in reversed(layout.steps):
    if step in states:
      return step
  raise inspection.UsageError(f"{layout.root}: no step holds a data state.")


def answer_json(answer: Answer, files: SourceFiles | None) -> dict[str, Any]:
  batch = answer.batch
  value: dict[str, Any] = {"step": answer.step, "records": [r.index for r in batch.records]}
  value.update({k: v for k, v in batch.to_json().items() if k != "records"})
  value["rows"] = [_row_json(r, files) for r in batch.records]
  if answer.learner is not None:
    value["global_step"] = {k: v for k, v in answer.learner.to_json().items() if k != "prompts"}
  if answer.note:
    value["note"] = answer.note
  return value


def _row_json(record: datamap.SourceRecord, files: SourceFiles | None) -> dict[str, Any]:
  row = record.to_json()
  where = None if files is None else files.where(record)
  if where is not None:
    row["file"] = where
  return row


def answer_lines(answer: Answer, files: SourceFiles | None) -> list[str]:
  batch = answer.batch
  number = ""
  if batch.number is not None:
    segment = f"; segment {batch.segment}, read after resume {batch.segment}" if batch.segment else ""
    number = f"global batch {batch.number} of the run (numbered from 0{segment})"
  if answer.step is not None:
    head = f"step {answer.step}: the last batch read before it was saved" + (f": {number}" if number else "")
    if answer.learner is not None:
      head = f"step {answer.step}: the prompts of global step {answer.learner.global_step}" + (
          f": {number}" if number else "")
  else:
    head = number
  lines = [head, f"  how      {batch.how}", "  records  " + " ".join(
      (f"{r.source}:{r.index}" if r.source else str(r.index)) for r in batch.records)]
  if answer.learner is not None:
    step = answer.learner
    inside = "inside the global step" if step.mid_step else "at its end"
    lines.append(f"  global step {step.global_step}: updates {step.first_update}-{step.last_update}; saved after "
                 f"update {step.saved_after}, {inside}")
    lines.extend(f"    {line}" for line in step.repeats)
  if answer.note:
    lines.append(f"  note     {answer.note}")
  lines.append("  row  process  stream record  source record  epoch" + ("  where" if files else ""))
  for record in batch.records:
    source = f"{record.source}:{record.index}" if record.source else str(record.index)
    where = (files.where(record) or "") if files else ""
    lines.append((f"  {record.row:<3}  {record.process_index:<7}  {record.stream_record:<13}  {source:<13}  "
                  f"{record.epoch:<5}" + (f"  {where}" if files else "")).rstrip())
  return lines


# ---------------------------------------------------------------------------
# order


class _Counting:
  """A write-only stream that counts its bytes (pyarrow asks for `tell`)."""

  def __init__(self, stream: BinaryIO):
    self._stream, self.written, self.closed = stream, 0, False

  def write(self, data: Any) -> int:
    count = self._stream.write(data)
    self.written += len(memoryview(data).cast("B"))
    return count

  def tell(self) -> int:
    return self.written

  def flush(self) -> None:
    self._stream.flush()

  def close(self) -> None:
    self.closed = True  # the stream is closed by its owner (`_storage.write_stream`)


@dataclasses.dataclass
class Progress:
  """`order`'s progress on stderr, with rate and time left: tqdm's bar on a terminal where tqdm is installed
  (Tunix, Hugging Face and Grain installs bring it), else a bar of our own; a counter line every `every`
  batches when stderr is not a terminal (a log file)."""

  total: int
  stream: Any = None
  every: int = 100_000
  use_tqdm: bool = True
  _started: float = dataclasses.field(default_factory=time.monotonic)
  _last: float = 0.0
  _bar: Any = None

  def update(self, done: int) -> None:
    # The bar is our own text (counts, a rate): its carriage returns must reach the terminal as they are.
    stream = self.stream or sys.stderr
    stream = getattr(stream, "unescaped", stream)
    if not getattr(stream, "isatty", lambda: False)():
      if done % self.every == 0 or done >= self.total:
        stream.write(f"order: {done}/{self.total} batches{self._pace(done)}\n")
        stream.flush()
      return
    if self._bar is None and self.use_tqdm:
      self._bar = _tqdm_bar(self.total, stream)
    if self._bar is not None:
      self._bar.update(done - self._bar.n)
      if done >= self.total:
        self._bar.close()
      return
    now = time.monotonic()
    if now - self._last < 0.2 and done < self.total:
      return
    self._last = now
    width = 30
    filled = width * done // max(self.total, 1)
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} batches{self._pace(done)}")
    if done >= self.total:
      stream.write("\n")
    stream.flush()

  def _pace(self, done: int) -> str:
    """`, 12,345 batches/s, 0:00:07 left` once a rate is known."""
    elapsed = time.monotonic() - self._started
    if done <= 0 or elapsed <= 0:
      return ""
    rate = done / elapsed
    left = datetime.timedelta(seconds=round(max(self.total - done, 0) / rate))
    return f", {rate:,.0f} batches/s, {left} left"


def _tqdm_bar(total: int, stream: Any) -> Any:
  """A tqdm bar counting batches, or None without tqdm (it is no dependency of ckpt_iter)."""
  try:
    import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return tqdm.tqdm(total=total, file=stream, unit="batch", desc="order", leave=True)


PARQUET_ROWS_PER_GROUP = 8192


def write_order(layout: inspection.Layout, out: str, *, process_index: int = 0, start: int = 0,
                limit: int | None = None, progress: Progress | None = None, states: States | None = None) -> int:
  """Writes the run's global batches in order to `out` (Parquet if it ends in .parquet, else JSONL).

  One batch at a time (a Parquet row group of at most PARQUET_ROWS_PER_GROUP
  batches): memory does not grow with the run. On gs:// one streamed upload,
  published when complete (`_storage.write_stream`).

  Returns:
    The batches written.
  """
  states = States(layout, process_index) if states is None else states
  last = _latest_with_state(layout, states)
  run = datamap.RunMap.from_states(states.for_streams(), last, keep_policy=KEEP_POLICY)
  stop = run.total if limit is None else min(run.total, start + limit)
  total = max(stop - start, 0)
  progress = progress or Progress(total)
  rows = (row for row, _ in zip(run.order(start), range(total)))
  produce = _parquet_writer if out.endswith(".parquet") else _jsonl_writer
  written = [0]

  def counted() -> Iterator[datamap.OrderRow]:
    for row in rows:
      yield row
      written[0] += 1
      progress.update(written[0])

  _storage.write_stream(out, lambda f: produce(f, counted()))
  if total == 0:
    progress.update(0)
  return written[0]


def _jsonl_writer(f: BinaryIO, rows: Iterator[datamap.OrderRow]) -> None:
  buffered = []
  for row in rows:
    value: dict[str, Any] = {"batch": row.batch, "records": row.records,
                             "stream_records": [row.stream_start, row.stream_stop], "segment": row.segment}
    if row.sources is not None:
      value["sources"] = row.sources
    buffered.append(json.dumps(value, separators=(",", ":")))
    if len(buffered) >= 4096:
      f.write(("\n".join(buffered) + "\n").encode())
      buffered = []
  if buffered:
    f.write(("\n".join(buffered) + "\n").encode())


def _parquet_writer(f: BinaryIO, rows: Iterator[datamap.OrderRow]) -> None:
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.InvalidArgumentError(
        "--out FILE.parquet needs pyarrow (pip install 'ckpt_iter[files]', or 'pyarrow>=15'); or write .jsonl."
    ) from None
  schema = pa.schema([("batch", pa.int64()), ("segment", pa.int64()), ("records", pa.list_(pa.int64())),
                      ("sources", pa.list_(pa.string())), ("stream_start", pa.int64()), ("stream_stop", pa.int64())])
  sink = _Counting(f)

  def table(columns: dict[str, list[Any]]) -> Any:
    try:
      return pa.table(columns, schema=schema)
    except (OverflowError, pa.ArrowInvalid):
      raise _past_int64(columns) or errors.InvalidArgumentError(
          "--out FILE.parquet cannot hold the batches: write --out FILE.jsonl instead.") from None

  with pq.ParquetWriter(sink, schema) as writer:
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for row in rows:
      for name in schema.names:
        columns[name].append(getattr(row, name))
      if len(columns["batch"]) >= PARQUET_ROWS_PER_GROUP:
        writer.write_table(table(columns))
        columns = {name: [] for name in schema.names}
    if columns["batch"]:
      writer.write_table(table(columns))


_INT64_MAX = 2**63 - 1


def _past_int64(columns: dict[str, list[Any]]) -> errors.InvalidArgumentError | None:
  """The error naming the first value of a row group that a Parquet int64 column cannot hold, or None."""
  for index, batch in enumerate(columns["batch"]):
    for name in ("batch", "segment", "records", "stream_start", "stream_stop"):
      value = columns[name][index]
      for number in value if isinstance(value, list) else [value]:
        if not -_INT64_MAX - 1 <= number <= _INT64_MAX:
          return errors.InvalidArgumentError(
              f"batch {batch}'s {name} holds {number}, past {_INT64_MAX}, the largest integer of a Parquet "
              "int64 column (the run's position passed 2^63, e.g. after a skip of stream records that far). "
              "Write --out FILE.jsonl instead: JSON holds any integer.")
  return None
