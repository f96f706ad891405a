"""The learner's input and its state, as a learner's position nests it.

A Tunix learner reads full batches from an input that restores its own state
(`state.Restorable`: a `DataIterator`, a `DataLoaderIterator`, or a
`replay.ReplayIterator` over a plain iterable). A learner's position holds
that input's whole state under `INPUT` (an `IteratorState`, in memory as on
disk: `state.NESTED`), beside the learner's own fields; a restore hands the
saved state (`IteratorState.part`) to the input's own `check_restore`
unchanged, so the input's rule decides what it accepts.

A learner reads ahead of what it trained, so the state it saves is the
input's state at an earlier position: the full batch the next unread
micro-batch starts in, with the content record of the element before it. A
Grain source moves to a position in O(1); a plain iterable can only get there
by replaying what was read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Collection, Iterable, Mapping

import grain

from ckpt_iter import _drift
from ckpt_iter import loader as loader_lib
from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import iterator as iterator_lib
from ckpt_iter import replay as replay_lib
from ckpt_iter import state as state_lib
from ckpt_iter import streaming

_LOG = logging.getLogger("ckpt_iter")
# Where a learner's position holds its input's state.
INPUT = state_lib.NESTED["tunix"]
NEXT_RECORD = _records.NEXT_RECORD
# The RL learner's record of the prompts of the micro-batch before its position (`LastRows`), and
# the field ckpt_iter 0.2.0 held them in, read and carried but never written anew.
LAST_PROMPTS = state_lib.LAST_PROMPTS
LEGACY_LAST_ROWS = state_lib.LEGACY_LAST_ROWS
_NOTHING = object()


class _StateAt:
  """The input's state at a position read past, its content record digested only when a checkpoint asks.

  The producer's path keeps a reference to the element read before the
  position; the digest runs once, at the save that holds the position
  (`settled_state`).
  """

  __slots__ = ("position", "_template", "_content_of", "_element", "_state")

  def __init__(self, template: state_lib.IteratorState, position: Mapping[str, Any],
               content_of: Callable[[Any], Any], element: Any):
    self.position = position  # the input's own position (for a reader that only compares it)
    self._template = template
    self._content_of = content_of
    self._element = element
    self._state: state_lib.IteratorState | None = None

  def settled(self) -> state_lib.IteratorState:
    if self._state is None:
      self._state = dataclasses.replace(
          self._template, position=self.position, content=self._content_of(self._element))
      self._template = self._content_of = self._element = None
    return self._state


def settled_state(state: state_lib.IteratorState | _StateAt) -> state_lib.IteratorState:
  """The input's state as a checkpoint holds it (a read-ahead position's content record digested)."""
  return state.settled() if isinstance(state, _StateAt) else state


class _RestorableSource:
  """Full batches from an iterator that restores its own state (`state.Restorable`).

  `state()` is the iterator's state at the next unread full batch: its own
  (`state_part`) where it has read nothing since it started, was restored or
  skipped; otherwise at the position it read past, with the content record
  (`DataIterator.content_of`) of the element before it, digested lazily.
  """

  def __init__(self, iterator: Any):
    self._iterator = iterator
    self._content_of = getattr(iterator, "content_of", None)
    self._last: Any = _NOTHING  # the element read last since the start, a restore or a skip
    self._state: Any = None  # state() until the input moves
    self._take_template()

  def _take_template(self) -> None:
    # Kind and fingerprint of the states of the positions read past (no content: each has its own).
    # Taken again after every restore: a restore may change the fingerprint (the skips it merges).
    self._template = dataclasses.replace(self._iterator.state_part(), content=None)

  @property
  def fingerprint(self) -> dict[str, Any]:
    return self._iterator.fingerprint

  def state(self) -> state_lib.IteratorState | _StateAt:
    """The input's state at the next unread full batch (`settled_state` gives it as saved)."""
    if self._state is None:
      if self._last is _NOTHING or self._content_of is None:
        self._state = self._iterator.state_part()
      else:
        self._state = _StateAt(self._template, self._iterator.position(), self._content_of, self._last)
    return self._state

  def position(self) -> Mapping[str, Any]:
    """The input's own position of the next unread full batch."""
    return self.state().position

  def restored_content_check(self) -> str:
    """What the last restore's content check found, for its log line."""
    return getattr(self._iterator, "restored_content_check", None) or "not applicable"

  def check(
      self, saved: state_lib.IteratorState, *, allow_drift: Collection[str], origin: str
  ) -> Callable[[], None]:
    """The input's own check of its saved state (handed over unchanged); returns the apply step."""
    return self._iterator.check_restore(saved, allow_drift=allow_drift, origin=origin)

  def apply(self, checked: Callable[[], None]) -> None:
    checked()
    self._moved()

  def _moved(self) -> None:
    """What was read before the new position is not known here: the iterator's own state says it."""
    self._last, self._state = _NOTHING, None
    self._take_template()

  def __next__(self) -> Any:
    element = next(self._iterator)
    self._read(element)
    return element

  def _read(self, element: Any) -> None:
    if self._content_of is not None:
      # A reference only (its dict copied: a consumer adding keys does not change it).
      self._last = dict(element) if type(element) is dict else element
    self._state = None


class GrainSource(_RestorableSource):
  """Full batches from a Grain dataset or DataLoader, or a stream with its own state; positions restored in O(1).

  Wraps a `DataIterator`, a `DataLoaderIterator` or a `StreamingIterator`:
  each restores an exact position through its own `check_restore`.
  """

  def __init__(self, data_iterator: iterator_lib.DataIterator | loader_lib.DataLoaderIterator
               | streaming.StreamingIterator):
    super().__init__(data_iterator)
    self._lookahead: Any = _NOTHING  # a batch `peek` read, and the state before it

  def state(self) -> state_lib.IteratorState | _StateAt:
    if self._lookahead is not _NOTHING:
      return self._lookahead[0]
    return super().state()

  def __next__(self) -> Any:
    if self._lookahead is _NOTHING:
      return super().__next__()
    _, element = self._lookahead
    self._lookahead = _NOTHING
    self._read(element)
    return element

  def _moved(self) -> None:
    self._lookahead = _NOTHING
    super()._moved()

  def peek(self) -> Any:
    """The next full batch, left to be read (its state stays the input's state)."""
    if self._lookahead is _NOTHING:
      before = self.state()
      element = next(self._iterator)
      self._lookahead = (before, element)
    return self._lookahead[1]

  def skip_full_batches(self, count: int) -> None:
    """Moves past the next `count` full batches (a legacy resume), as stock's `next()` loop does.

    O(1) for a MapDataset pipeline (`DataIterator.skip`: its index counts
    this input's own elements, batches if it batches). An IterDataset's
    position counts rows of the MapDataset it was made from, which differ
    from its elements once it batches or filters (`to_iter_dataset().batch(n)`,
    Tunix's CLI form), and a DataLoader's is per record: those are replayed,
    as stock does.
    """
    if count > 0 and self._lookahead is not _NOTHING:
      next(self)
      count -= 1
    if count > 0 and isinstance(self._iterator, iterator_lib.DataIterator) and isinstance(
        self._iterator.dataset, grain.MapDataset):
      self._iterator.advance(count)
      self._moved()
      return
    for _ in range(count):
      try:
        next(self)
      except StopIteration:
        return  # the input ran out, as it would have for stock

  def row_boundary(self, stream_rows: int, last_rows: LastRows | None) -> tuple[int | None, str | None]:
    """The batch of this pipeline that starts at row `stream_rows` of its stream, or why there is none.

    For an input whose position is a batch index (a hand-built MapDataset of
    batches): the prompt count continuation of `_session.DataSession._continuation`.
    The batch is that row's if one starts there and this stream's rows just
    before it are the ones the checkpoint's run consumed last (`last_rows`,
    `saved_last_rows` of the checkpoint's position).

    Returns:
      (batch index, None) or (None, reason).
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
    if last_rows is not None:
      count = last_rows.count
      first = stream_rows - count
      if first < 0:
        return None, "the checkpoint's last prompts lie before this input's start"
      prompts: list[Any] = []
      for index in range(first // batch_rows, (stream_rows - 1) // batch_rows + 1):
        prompts.extend(dataset[index]["prompts"])
      offset = first - (first // batch_rows) * batch_rows
      if last_rows.differs_from(prompts[offset:offset + count]):
        return None, (
            f"the {count} prompts before row {stream_rows} differ from those the "
            "checkpoint's run trained last, so its stream is not a prefix of this one"
        )
    return next_index, None

  def move_to_batch(self, next_index: int) -> None:
    """Moves to batch `next_index` of this pipeline (`row_boundary`'s), through the input's own restore."""
    here = dataclasses.replace(self._template, position={"next_index": next_index})
    self.apply(self.check(here, allow_drift=(), origin="the input"))


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
    self._iterator.advance(count)
    self._moved()

  def row_boundary(self, stream_rows: int, last_rows: Any) -> tuple[None, str]:
    del stream_rows, last_rows
    return None, "the input is a plain iterable, whose rows can only be replayed"

  def peek(self) -> Any:
    return self._iterator.peek()


def make_source(train_ds: Any) -> GrainSource | ReplaySource:
  # A StreamingIterator restores through its stream's own state_dict: O(1) too, no replay.
  if isinstance(train_ds, (iterator_lib.DataIterator, loader_lib.DataLoaderIterator, streaming.StreamingIterator)):
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


def counts_records(saved: state_lib.IteratorState) -> bool:
  """Whether a saved input state's position counts stream records (a make_dataset pipeline's).

  Such an input continues at the saved record under another batch size by
  its own restore (`_drift.reconcile`); other positions (a hand-built
  pipeline's batch index, a replayed iterable's count) cannot say that.
  """
  return NEXT_RECORD in saved.position


def input_part(
    value: state_lib.IteratorState, origin: str, *, learner_fields: bool = True
) -> tuple[state_lib.IteratorState, dict[str, Any]]:
  """(the input's state a learner's state nests, the learner's own position fields): `state.learner_parts`."""
  return state_lib.learner_parts(value, origin, learner_fields=learner_fields)


def check_learner_state(
    saved: Mapping[str, Any],
    learner_fingerprint: Mapping[str, Any],
    source: _RestorableSource,
    saved_input: state_lib.IteratorState,
    *,
    allow_drift: frozenset[str],
    origin: str,
    optional_learner_fields: Collection[str] = (),
) -> Callable[[], None]:
  """The one fingerprint rule of every learner's restore; returns the input's checked apply step.

  A learner's state holds two fingerprints: the learner's own (`saved`:
  batch geometry, num_iterations, seeds...), compared strictly with
  `learner_fingerprint`, and its input's, in the input's state its position
  nests (`saved_input`), which goes to the input's own `check_restore`
  unchanged (for a Grain dataset `DataIterator.check_restore`, whose
  `_drift.reconcile` accepts what keeps the stream, such as more epochs after
  the data ran out, or another batch size of a make_dataset pipeline). So
  every change the input accepts is accepted by every learner. `allow_drift`
  names fields of either; those of the learner (`optional_learner_fields`
  too: fields it holds only in some configurations) go to the learner's
  comparison, the rest to the input's.

  Raises:
    ConfigDriftError: a learner field differs, or the input refuses the change.
  """
  learner_fields = frozenset(learner_fingerprint) | frozenset(saved) | frozenset(optional_learner_fields)
  if saved:
    learner_drift = state_lib.differing_fields(saved, learner_fingerprint, allow_drift=allow_drift & learner_fields)
    if learner_drift:
      # One refusal names everything the change needs: the input's differences too (a batch size both
      # hold), so that following it is not met by a second refusal.
      try:
        source.check(saved_input, allow_drift=allow_drift - learner_fields, origin=origin)
      except errors.ConfigDriftError as e:
        raise errors.ConfigDriftError({**learner_drift, **e.differences}, origin=origin,
                                      way=getattr(e, "way", None)) from None
      raise errors.ConfigDriftError(learner_drift, origin=origin)
  return source.check(saved_input, allow_drift=allow_drift - learner_fields, origin=origin)


class LastRows:
  """The prompts of the micro-batch read last, as a checkpoint records them: their count and
  content record (`_drift.content_digest` of the prompts as text), digested only when a
  checkpoint asks.

  Digesting reads every prompt's text: done per micro-batch on the producer's
  path it grew with sequence length, so it waits for a save (once per
  micro-batch at most, cached). A state of ckpt_iter 0.2.0 holds them under
  `LEGACY_LAST_ROWS` as a count and a digest, checked with the digest 0.2.0
  took (`_drift.legacy_prompts_digest`) and carried on as it is.
  """

  def __init__(self, prompts: Any = None, *, field: str = LAST_PROMPTS, saved: Mapping[str, Any] | None = None):
    self._prompts = prompts
    self.field = field
    self._json = saved

  @property
  def count(self) -> int:
    return len(self._prompts) if self._json is None else int(self._json["count"])

  def to_json(self) -> dict[str, Any]:
    if self._json is None:
      self._json = {"count": len(self._prompts), "content": _drift.content_digest(_as_text(self._prompts))}
      self._prompts = None
    return dict(self._json)

  def differs_from(self, prompts: list[Any]) -> bool:
    """Whether `prompts` (`count` of them) are not the prompts recorded."""
    saved = self.to_json()
    if self.field == LEGACY_LAST_ROWS:
      return _drift.legacy_prompts_digest(prompts) != saved["digest"]
    difference, _ = _drift.content_difference(saved["content"], _as_text(prompts))
    return difference is not None


def _as_text(prompts: Any) -> list[str]:
  # A micro-batch holds its prompts as a list or an array, and `row_boundary` gathers another
  # pipeline's as a list of the arrays' items: as text, the same prompts have one record.
  return [str(prompt) for prompt in prompts]


def saved_last_rows(position: Mapping[str, Any]) -> LastRows | None:
  """The record of the last prompts a checkpoint's position holds (`LAST_PROMPTS`, or 0.2.0's
  `LEGACY_LAST_ROWS`), or None."""
  for field in (LAST_PROMPTS, LEGACY_LAST_ROWS):
    if position.get(field) is not None:
      return LastRows(field=field, saved=position[field])
  return None


def _batch_rows(batch: Any) -> int:
  return len(batch["prompts"])


def _drop_rows(batch: Any, count: int) -> Any:
  """`batch` without its first `count` rows (every field is per row)."""
  return {key: values[count:] for key, values in batch.items()}


def settled(position: Mapping[str, Any]) -> dict[str, Any]:
  """A learner's working position as a checkpoint holds it (the input's state and the last rows digested)."""
  result = dict(position)
  if INPUT in result:
    result[INPUT] = settled_state(result[INPUT])
  for field in (LAST_PROMPTS, LEGACY_LAST_ROWS):
    if isinstance(result.get(field), LastRows):
      result[field] = result[field].to_json()
  return result


class MicroBatchInput:
  """Input micro-batches with a position that includes the offset in a full batch.

  With `micro_batch_size=None` full batches pass through as they are, of
  whatever size (Tunix does that when the micro batch is the first batch's
  size). Otherwise Tunix's own re-batcher cuts the stream of rows into
  micro-batches, carrying the rows a full batch leaves over into the next
  micro-batch, as stock Tunix does.

  A position is {INPUT: <the input's state at the full batch the next
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
    self._last_rows: LastRows | None = None
    self._reset()

  def _reset(self) -> None:
    # Full batches read into the current stream: (the input's state before
    # each, its rows, the stream-relative index of its first row).
    self._read: list[tuple[Any, int, int]] = []
    self._rows_read = 0
    self._rows_yielded = 0
    self._stream: Any = None

  @property
  def source(self) -> GrainSource | ReplaySource:
    return self._source

  def _full_batches(self, skip_rows: int) -> Any:
    first = True
    while True:
      state = self._source.state()
      try:
        batch = next(self._source)
      except StopIteration:
        return
      rows = _batch_rows(batch)
      if first and skip_rows >= rows:
        raise errors.InvalidStateError(
            f"the restored position takes {skip_rows} rows of a full batch that holds {rows}: the next "
            "micro-batch cannot start in it (the position's micro_batches_taken or rows_taken was edited or "
            "damaged). Restore an earlier checkpoint.")
      self._read.append((state, rows, self._rows_read - (skip_rows if first else 0)))
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
      self._last_rows = LastRows(micro_batch["prompts"])
      return micro_batch
    if self._stream is None:
      self._stream = iter(self._rebatch(self._full_batches(self._start_rows), self._micro_batch_size))
    micro_batch = next(self._stream)
    self._rows_yielded += _batch_rows(micro_batch)
    self._last_rows = LastRows(micro_batch["prompts"])
    # Keep only the full batches the next micro-batch can still start in.
    while len(self._read) > 1 and self._read[1][2] <= self._rows_yielded:
      self._read.pop(0)
    return micro_batch

  def position(self) -> dict[str, Any]:
    """Where the next unread micro-batch starts, as a checkpoint holds it.

    Besides the input's state and the micro-batches taken of its full batch:
    `stream_rows`, how many rows (prompts) of the source precede it, and
    `LAST_PROMPTS`, the record of the micro-batch just before it; they let a
    resume continue in a changed pipeline that cannot count records but
    holds the same rows (`GrainSource.row_boundary`).
    """
    return settled(self.unsettled_position())

  def unsettled_position(self) -> dict[str, Any]:
    """`position()` with the input's state and the last rows not digested yet: cheap, for the producer's path.

    `settled` turns it into the position a checkpoint holds.
    """
    result = self._buffered_position()
    if self._stream_rows_base is not None:
      result["stream_rows"] = self._stream_rows_base + self._rows_yielded
    if self._last_rows is not None:
      result[self._last_rows.field] = self._last_rows
    return result

  def _buffered_position(self) -> dict[str, Any]:
    if self._micro_batch_size is not None and not self._read and self._start_rows:
      # Restored inside a full batch and nothing read since: still there (a
      # checkpoint before the next read, e.g. after the restored repeats,
      # must not lose the offset).
      return self._inside(self._source.state(), self._start_rows)
    if self._micro_batch_size is None or not self._read or self._rows_yielded >= self._rows_read:
      # Nothing buffered: the next micro-batch starts at the next full batch.
      return {INPUT: self._source.state(), "micro_batches_taken": 0}
    state, _, first_row = self._read[0]
    return self._inside(state, self._rows_yielded - first_row)

  def _inside(self, state: Any, rows_taken: int) -> dict[str, Any]:
    taken, rest = divmod(rows_taken, self._micro_batch_size)
    result = {INPUT: state, "micro_batches_taken": taken}
    if rest:
      result["rows_taken"] = rows_taken
    return result

  def apply(self, checked: Callable[[], None], position: Mapping[str, Any]) -> str:
    """Runs the input's checked apply step; `position`: the learner's own fields (`state.check_micro_batch_position`'s).

    Returns:
      What the input's restore found of its content (its `restored_content_check`), for the log line.
    """
    self._source.apply(checked)
    rows = position.get("rows_taken")
    if rows is None:
      rows = position["micro_batches_taken"] * (self._micro_batch_size or 0)
    self._start_at(rows, position)
    return self._source.restored_content_check()

  def continue_at(self, next_index: int, position: Mapping[str, Any]) -> None:
    """Moves to batch `next_index` of a changed pipeline, which starts at `position`'s row."""
    self._source.move_to_batch(next_index)
    self._start_at(0, position)

  def _start_at(self, rows: int, position: Mapping[str, Any]) -> None:
    self._reset()
    self._start_rows = rows
    self._stream_rows_base = position.get("stream_rows")
    self._last_rows = saved_last_rows(position)

  def seek_micro_batches(self, count: int, micro_per_full: int) -> None:
    """Moves past the first `count` micro-batches (legacy fast-forward)."""
    full, taken = divmod(count, micro_per_full)
    self._source.skip_full_batches(full)
    self._reset()
    self._start_rows = taken * (self._micro_batch_size or 0)
    self._stream_rows_base = None  # unknown with uneven batches; not needed again
