"""The learner's input, as positions a checkpoint can hold.

A Tunix learner reads full batches and, when the micro batch is smaller,
splits each into micro-batches. The position of the next unread input
micro-batch is therefore (the source position of the full batch it comes from,
how many micro-batches of it were taken). A Grain source moves to a position
in O(1); a plain iterable can only get there by replaying what was read.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Collection, Iterable, Mapping

import grain

from ckpt_iter import _learner_state
from ckpt_iter import _loader as loader_lib
from ckpt_iter import errors
from ckpt_iter import iterator as iterator_lib
from ckpt_iter import replay as replay_lib
from ckpt_iter import state as state_lib

_LOG = logging.getLogger("ckpt_iter")


class _ContentBefore:
  """The content record of the element read before a position, digested only when a checkpoint asks.

  Holds the element (or a restored record): the producer's path only keeps
  a reference; the digest runs once, at the save that holds the position.
  """

  def __init__(self, make_record: Callable[[Any], Any] | None = None, element: Any = None,
               *, saved: Mapping[str, Any] | None = None):
    self._make_record = make_record
    self._element = element
    self._record = saved

  def to_json(self) -> dict[str, Any]:
    if self._record is None:
      self._record = self._make_record(self._element)
      self._element = self._make_record = None
    return dict(self._record)


class _RestorableSource:
  """Full batches from an iterator that restores its own state (`state.Restorable`).

  A learner's checkpoint nests that state (`nest`); a restore hands it back
  unchanged, to the iterator's own `check_restore`. An iterator that records
  content (`DataIterator.content_of`) has it recorded for the element before
  each position a learner saves, and checked by its restore.
  """

  def __init__(self, iterator: Any):
    self._iterator = iterator
    self._content_of = getattr(iterator, "content_of", None)
    self._last_content: _ContentBefore | None = None

  @property
  def fingerprint(self) -> dict[str, Any]:
    return self._iterator.fingerprint

  def position(self) -> dict[str, Any]:
    return dict(self._iterator.position())

  def restored_content_check(self) -> str:
    """What the last restore's content check found, for its log line."""
    return getattr(self._iterator, "restored_content_check", None) or "not applicable"

  def content_before(self) -> _ContentBefore | None:
    """The content record of the element read last (None: none read since the start)."""
    return self._last_content

  def check(self, fingerprint, position, *, allow_drift, origin, content=None) -> Callable[[], None]:
    value = state_lib.IteratorState(kind="data", fingerprint=fingerprint, position=position, content=content)
    return self._iterator.check_restore(value, allow_drift=allow_drift, origin=origin)

  def apply(self, checked: Callable[[], None], position: Mapping[str, Any], content: Any = None) -> None:
    del position  # the checked apply step already holds it
    checked()
    self._last_content = None if content is None else _ContentBefore(saved=content)

  def __next__(self) -> Any:
    element = next(self._iterator)
    if self._content_of is not None:
      # A reference only (its dict copied: a consumer adding keys does not change it).
      kept = dict(element) if type(element) is dict else element
      self._last_content = _ContentBefore(self._content_of, kept)
    return element


class GrainSource(_RestorableSource):
  """Full batches from a Grain dataset or DataLoader; positions restored in O(1).

  Wraps a `DataIterator` or a `DataLoaderIterator`: both restore an exact
  position through their own `check_restore`.
  """

  def __init__(self, data_iterator: iterator_lib.DataIterator | loader_lib.DataLoaderIterator):
    super().__init__(data_iterator)

  def position(self) -> dict[str, Any]:
    if isinstance(self._iterator, loader_lib.DataLoaderIterator):
      return dict(self._iterator.state().position)
    return super().position()

  def skip_full_batches(self, count: int) -> None:
    """Moves past the next `count` full batches (a legacy resume), as stock's `next()` loop does.

    O(1) where the position counts this input's own elements: a MapDataset's
    `next_index` does (its batches, if it batches). An IterDataset's counts
    rows of the MapDataset it was made from, which differ from its elements
    once it batches or filters (`to_iter_dataset().batch(n)`, Tunix's CLI
    form), and a DataLoader's is per record: those are replayed, as stock does.
    """
    if isinstance(getattr(self._iterator, "dataset", None), grain.MapDataset) and (
        set(self.position()) == {"next_index"}
    ):
      self._move_to({"next_index": self.position()["next_index"] + count})
      return
    for _ in range(count):
      try:
        next(self)
      except StopIteration:
        return  # the input ran out, as it would have for stock

  def row_boundary(self, stream_rows: int, last_rows: Mapping[str, Any] | None, *, origin: str) -> Any:
    """Where row `stream_rows` of this pipeline's stream starts, or why it cannot continue there.

    For a resume into a changed pipeline (another batch size, a grown or
    re-sliced source, more epochs): the position of the full batch that
    starts at that row, if one does, and if this stream's rows just before it
    are the ones the checkpoint's run consumed last (`last_rows` digest).

    Returns:
      (position, None) or (None, reason).
    """
    dataset = getattr(self._iterator, "dataset", None)
    if not isinstance(dataset, grain.MapDataset):
      return None, "the input is not a random-access Grain MapDataset"
    if set(self.position()) != {"next_index"}:
      return None, "the input's position is not a batch index"
    if len(dataset) == 0:
      return None, "the input is empty"
    batch_rows = len(dataset[0]["prompts"])
    if stream_rows % batch_rows:
      return None, (
          f"the checkpoint's run consumed {stream_rows} prompts, which is not a whole "
          f"number of this input's batches of {batch_rows}"
      )
    next_index = stream_rows // batch_rows
    if next_index > len(dataset):
      return None, f"this input has {len(dataset)} batches of {batch_rows}, fewer than {stream_rows} prompts"
    if last_rows:
      count = int(last_rows["count"])
      first = stream_rows - count
      if first < 0:
        return None, "the checkpoint's last prompts lie before this input's start"
      prompts: list[Any] = []
      for index in range(first // batch_rows, (stream_rows - 1) // batch_rows + 1):
        prompts.extend(dataset[index]["prompts"])
      offset = first - (first // batch_rows) * batch_rows
      if prompts_digest(prompts[offset:offset + count]) != last_rows["digest"]:
        return None, (
            f"the {count} prompts before row {stream_rows} differ from those the "
            "checkpoint's run trained last, so its stream is not a prefix of this one"
        )
    return {"next_index": next_index}, None

  def peek(self) -> Any:
    position, last_content = self.position(), self._last_content
    element = next(self._iterator)
    self._move_to(position)
    self._last_content = last_content
    return element

  def _move_to(self, position: Mapping[str, Any]) -> None:
    self.check(self.fingerprint, position, allow_drift=(), origin="the input")()
    self._last_content = None  # what was read before `position` is not known here


class ReplaySource(_RestorableSource):
  """Full batches from any iterable (`replay.ReplayIterator`); a position is a count of batches read.

  The position also holds a digest of the last batch read; a restore replays
  the iterable and refuses it when the last replayed batch has another
  digest: it is not the saved stream.
  """

  def __init__(self, iterable: Iterable[Any]):
    super().__init__(replay_lib.ReplayIterator(iterable))

  def skip_full_batches(self, count: int) -> None:
    """Moves past the first `count` full batches (a legacy resume): a replay."""
    self._iterator.skip(count)

  def row_boundary(self, stream_rows: int, last_rows: Any, *, origin: str) -> Any:
    del stream_rows, last_rows, origin
    return None, "the input is a plain iterable, whose rows can only be replayed"

  def peek(self) -> Any:
    return self._iterator.peek()


def make_source(train_ds: Any) -> GrainSource | ReplaySource:
  if isinstance(train_ds, (iterator_lib.DataIterator, loader_lib.DataLoaderIterator)):
    return GrainSource(train_ds)
  if isinstance(train_ds, (grain.MapDataset, grain.IterDataset)):
    return GrainSource(iterator_lib.DataIterator(train_ds))
  if isinstance(train_ds, grain.DataLoader):
    # Its iterator's state is Grain's exact per-record position: O(1), no replay.
    return GrainSource(loader_lib.DataLoaderIterator(train_ds))
  if isinstance(train_ds, (str, bytes)) or not hasattr(train_ds, "__iter__"):
    raise errors.InvalidArgumentError(
        f"train_ds of type {type(train_ds).__qualname__} is not iterable; pass a "
        "Grain dataset (ckpt_iter.make_dataset) or an iterable of batch dicts."
    )
  return ReplaySource(train_ds)


# Where a learner's working position keeps the content record of its input's
# element before the position: moved into the nested input state by `nest`.
INPUT_CONTENT = "input_content"


def nest(input_fingerprint: Mapping[str, Any], position: Mapping[str, Any], input_key: str | None) -> dict[str, Any]:
  """A learner's position as its checkpoint holds it: the input's state nested (format 2).

  `position` is the learner's working form, with the input's position under
  `input_key` (or, with None, the input's position alone).
  """
  position = dict(position)
  content = position.pop(INPUT_CONTENT, None)
  if isinstance(content, _ContentBefore):
    content = content.to_json()
  if input_key is None:
    return _learner_state.nested(input_fingerprint, position, input_content=content)
  own = {k: v for k, v in position.items() if k != input_key}
  return _learner_state.nested(input_fingerprint, position[input_key], input_content=content, **own)


def split_content(position: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
  """(the working position without its input's content record, that record or None)."""
  position = dict(position)
  return position, position.pop(INPUT_CONTENT, None)


def unnest(value: state_lib.IteratorState, input_key: str | None, *, origin: str) -> tuple[Any, dict[str, Any]]:
  """(the input's saved fingerprint, the learner's working position): `nest` undone, checked.

  Raises:
    InvalidStateError: the position does not nest an input state.
  """
  parts = _learner_state.split(value.position)
  if parts is None or (input_key is None and parts[2]):
    raise errors.InvalidStateError(
        f"{origin}: field 'position' is {state_lib.short_repr(value.position)}; a learner's "
        f"position is {_learner_state.expected_form()}."
    )
  fingerprint, position, own = parts
  content = _learner_state.input_content(value.position)
  if content is not None:
    try:
      content = state_lib.IteratorState(kind="data", fingerprint=fingerprint, position=position,
                                        content=content).content
    except errors.InvalidStateError as e:
      raise errors.InvalidStateError(
          f"{origin}: field 'position.{_learner_state.INPUT}.{_learner_state.CONTENT}' is "
          f"{state_lib.short_repr(content)}; {e}") from None
    own = {**own, INPUT_CONTENT: content}
  if input_key is None:
    return fingerprint, {**position, **own}
  return fingerprint, {input_key: position, **own}


def check_learner_state(
    saved: Mapping[str, Any],
    learner_fingerprint: Mapping[str, Any],
    restorable: Any,
    input_fingerprint: Mapping[str, Any],
    position: Any,
    *,
    allow_drift: frozenset[str],
    origin: str,
    optional_learner_fields: Collection[str] = (),
    content: Any = None,
) -> Any:
  """The one fingerprint rule of every learner's restore; returns the checked apply value.

  A learner's state holds two fingerprints: the learner's own (`saved`:
  batch geometry, num_iterations, seeds...), compared strictly with
  `learner_fingerprint`, and its input's, nested in the position and left to
  the input's own `check` (for a Grain dataset, `DataIterator.check_restore`,
  whose `_drift.reconcile` accepts what keeps the stream, such as more epochs
  after the data ran out). So every change `DataIterator` accepts is accepted
  by every learner. `allow_drift` names fields of either; those of the
  learner (`optional_learner_fields` too: fields it holds only in some
  configurations) go to the learner's comparison, the rest to the input's.
  `content`: the input's content record the state holds (`split_content`),
  checked by the input's own restore.

  Raises:
    ConfigDriftError: a learner field differs, or the input refuses the change.
  """
  learner_fields = frozenset(learner_fingerprint) | frozenset(saved) | frozenset(optional_learner_fields)
  state_lib.check_fingerprint(
      saved, learner_fingerprint, allow_drift=allow_drift & learner_fields, origin=origin,
  )
  return restorable.check(
      input_fingerprint, position, allow_drift=allow_drift - learner_fields, origin=origin, content=content,
  )


def prompts_digest(prompts: Iterable[Any]) -> str:
  """A short digest of prompts, to tell whether two streams hold the same rows."""
  text = "\x00".join(str(p) for p in prompts)
  return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class _LastRows:
  """The prompts of the micro-batch read last, digested only when a checkpoint asks.

  Digesting reads every prompt's text: done per micro-batch on the producer's
  path it grew with sequence length, so it waits for a save (once per
  micro-batch at most, cached).
  """

  def __init__(self, prompts: Any = None, *, saved: Mapping[str, Any] | None = None):
    self._prompts = prompts
    self._json = saved

  def to_json(self) -> dict[str, Any]:
    if self._json is None:
      self._json = {"count": len(self._prompts), "digest": prompts_digest(self._prompts)}
      self._prompts = None
    return dict(self._json)


def _batch_rows(batch: Any) -> int:
  return len(batch["prompts"])


def _drop_rows(batch: Any, count: int) -> Any:
  """`batch` without its first `count` rows (every field is per row)."""
  return {key: values[count:] for key, values in batch.items()}


_OPTIONAL_POSITION_KEYS = frozenset({"rows_taken", "stream_rows", "last_rows"})


def settled(position: Mapping[str, Any]) -> dict[str, Any]:
  """An `unsettled_position` as a checkpoint holds it (the last rows and the content digested)."""
  result = dict(position)
  if isinstance(result.get("last_rows"), _LastRows):
    result["last_rows"] = result["last_rows"].to_json()
  if isinstance(result.get(INPUT_CONTENT), _ContentBefore):
    result[INPUT_CONTENT] = result[INPUT_CONTENT].to_json()
  return result


def _saved_last_rows(position: Mapping[str, Any]) -> _LastRows | None:
  saved = position.get("last_rows")
  return None if saved is None else _LastRows(saved=saved)


class MicroBatchInput:
  """Input micro-batches with a position that includes the offset in a full batch.

  With `micro_batch_size=None` full batches pass through as they are, of
  whatever size (Tunix does that when the micro batch is the first batch's
  size). Otherwise Tunix's own re-batcher cuts the stream of rows into
  micro-batches, carrying the rows a full batch leaves over into the next
  micro-batch, as stock Tunix does.

  A position is {"full_batch": <source position of the full batch the next
  micro-batch starts in>, "micro_batches_taken": m} and, when the start is
  not m whole micro-batches into that full batch (uneven full batches),
  "rows_taken": the rows of it already consumed.
  """

  def __init__(
      self,
      source: GrainSource | ReplaySource,
      micro_batch_size: int | None,
      rebatch: Callable[[Iterable[Any], int], Iterable[Any]],
  ):
    self._source = source
    self._micro_batch_size = micro_batch_size
    self._rebatch = rebatch
    self._start_rows = 0  # rows of the first full batch read before the stream
    self._stream_rows_base: int | None = 0  # source rows before the stream (None: unknown)
    self._last_rows: _LastRows | None = None
    self._reset()

  def _reset(self) -> None:
    # Full batches read into the current stream: (source position, rows, the
    # stream-relative index of their first row, the content record of the
    # full batch before them).
    self._read: list[tuple[dict[str, Any], int, int, _ContentBefore | None]] = []
    self._rows_read = 0
    self._rows_yielded = 0
    self._stream: Any = None

  @property
  def source(self) -> GrainSource | ReplaySource:
    return self._source

  def _full_batches(self, skip_rows: int) -> Any:
    first = True
    while True:
      position, before = self._source.position(), self._source.content_before()
      try:
        batch = next(self._source)
      except StopIteration:
        return
      rows = _batch_rows(batch)
      self._read.append((position, rows, self._rows_read - (skip_rows if first else 0), before))
      if first and skip_rows:
        batch = _drop_rows(batch, skip_rows)
        rows -= skip_rows
      first = False
      self._rows_read += rows
      yield batch

  def next_micro_batch(self) -> Any:
    if self._micro_batch_size is None:
      micro_batch = next(self._source)
      self._rows_yielded += _batch_rows(micro_batch)
      self._last_rows = _LastRows(micro_batch["prompts"])
      return micro_batch
    if self._stream is None:
      self._stream = iter(self._rebatch(self._full_batches(self._start_rows), self._micro_batch_size))
    micro_batch = next(self._stream)
    self._rows_yielded += _batch_rows(micro_batch)
    self._last_rows = _LastRows(micro_batch["prompts"])
    # Keep only the full batches the next micro-batch can still start in.
    while len(self._read) > 1 and self._read[1][2] <= self._rows_yielded:
      self._read.pop(0)
    return micro_batch

  def position(self) -> dict[str, Any]:
    """Where the next unread micro-batch starts.

    Besides the source position: `stream_rows`, how many rows (prompts) of
    the source precede it, and `last_rows`, a digest of the micro-batch just
    before it; they let a resume continue in a changed pipeline whose stream
    holds the same rows (`GrainSource.row_boundary`).
    """
    return settled(self.unsettled_position())

  def unsettled_position(self) -> dict[str, Any]:
    """`position()` with the last rows not digested yet: cheap, for the producer's path.

    `settled` turns it into the position a checkpoint holds.
    """
    result = self._source_position()
    if self._stream_rows_base is not None:
      result["stream_rows"] = self._stream_rows_base + self._rows_yielded
    if self._last_rows is not None:
      result["last_rows"] = self._last_rows
    return result

  def _source_position(self) -> dict[str, Any]:
    result = self._buffered_position()
    if result.get(INPUT_CONTENT, "") is None:
      del result[INPUT_CONTENT]
    return result

  def _buffered_position(self) -> dict[str, Any]:
    # Each with the content record of the full batch before it (`INPUT_CONTENT`).
    if self._micro_batch_size is not None and not self._read and self._start_rows:
      # Restored inside a full batch and nothing read since: still there (a
      # checkpoint before the next read, e.g. after the restored repeats,
      # must not lose the offset).
      taken, rest = divmod(self._start_rows, self._micro_batch_size)
      result = {"full_batch": self._source.position(), "micro_batches_taken": taken,
                INPUT_CONTENT: self._source.content_before()}
      if rest:
        result["rows_taken"] = self._start_rows
      return result
    if self._micro_batch_size is None or not self._read or self._rows_yielded >= self._rows_read:
      # Nothing buffered: the next micro-batch starts at the next full batch.
      return {"full_batch": self._source.position(), "micro_batches_taken": 0,
              INPUT_CONTENT: self._source.content_before()}
    position, _, first_row, before = self._read[0]
    rows_taken = self._rows_yielded - first_row
    taken, rest = divmod(rows_taken, self._micro_batch_size)
    result = {"full_batch": dict(position), "micro_batches_taken": taken, INPUT_CONTENT: before}
    if rest:
      result["rows_taken"] = rows_taken
    return result

  def check(self, fingerprint, position, *, allow_drift, origin, content=None) -> Any:
    """Checks a position (`position()`'s form: its content record inside, or given as `content`)."""
    if isinstance(position, Mapping):
      position, inline = split_content(position)
      content = inline if content is None else content
    taken = position.get("micro_batches_taken") if isinstance(position, Mapping) else None
    rows = position.get("rows_taken", 0) if isinstance(position, Mapping) else None
    if (
        not isinstance(position, Mapping)
        or set(position) - _OPTIONAL_POSITION_KEYS != {"full_batch", "micro_batches_taken"}
        or not isinstance(taken, int) or isinstance(taken, bool) or taken < 0
        or not isinstance(rows, int) or isinstance(rows, bool) or rows < 0
        or not isinstance(position["full_batch"], Mapping)
    ):
      raise errors.InvalidStateError(
          f"{origin}: field 'position' is {position!r}; expected "
          "{'full_batch': <source position>, 'micro_batches_taken': N[, 'rows_taken': R]}."
      )
    return self._source.check(
        fingerprint, position["full_batch"], allow_drift=allow_drift, origin=origin, content=content
    )

  def apply(self, checked: Any, position: Mapping[str, Any], content: Any = None) -> None:
    position, inline = split_content(position)
    self._source.apply(checked, position["full_batch"], inline if content is None else content)
    self._reset()
    rows = position.get("rows_taken")
    if rows is None:
      rows = position["micro_batches_taken"] * (self._micro_batch_size or 0)
    self._start_rows = rows
    self._stream_rows_base = position.get("stream_rows")
    self._last_rows = _saved_last_rows(position)

  def continue_at(self, full_batch_position: Mapping[str, Any], position: Mapping[str, Any]) -> None:
    """Moves to a full batch of a changed pipeline that starts at `position`'s row."""
    self._source.apply(self._source.check(
        self._source.fingerprint, full_batch_position, allow_drift=(), origin="the input"),
        full_batch_position)
    self._reset()
    self._start_rows = 0
    self._stream_rows_base = position["stream_rows"]
    self._last_rows = _saved_last_rows(position)

  def seek_micro_batches(self, count: int, micro_per_full: int) -> None:
    """Moves past the first `count` micro-batches (legacy fast-forward)."""
    full, taken = divmod(count, micro_per_full)
    self._source.skip_full_batches(full)
    self._reset()
    self._start_rows = taken * (self._micro_batch_size or 0)
    self._stream_rows_base = None  # unknown with uneven batches; not needed again
