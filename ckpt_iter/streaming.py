"""StreamingIterator: a stream that keeps its own position, restored in O(1).

A streaming source has no random access, so make_dataset cannot jump into
it; but some streams can say where they are. A Hugging Face
`datasets.IterableDataset` (and any source with `state_dict()` /
`load_state_dict()`, as torchdata's StatefulDataLoader) hands out its
position as a small dict and continues from it. A StreamingIterator reads
such a source, optionally cuts it into stacked batches, and checkpoints the
source's own state taken at the boundary of the element it yielded last, so
a restore loads that state and reads on: no element is replayed.

The state is kind "data":
  fingerprint  {"source": "stream:...", "batch_size", "drop_remainder", ...}
  position     {"elements_read": K, "records_read": N, "source_state": {...}}

What cannot resume exactly is refused by name where it is built: a Hugging
Face shuffle buffer (its examples are lost on resume), a batched `map` under
an Arrow format (may skip a batch), a source state that JSON would change.
A plain generator has no position at all: the refusal (`_hf.refusal`) says what to use.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from typing import Any, Callable, Collection, Mapping

from ckpt_iter import _hf
from ckpt_iter import _item as item_lib
from ckpt_iter import _stacking
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import state as state_lib

ELEMENTS_READ = state_lib.STREAM_ELEMENTS_READ
RECORDS_READ = state_lib.STREAM_RECORDS_READ
SOURCE_STATE = state_lib.STREAM_SOURCE_STATE
SOURCE_PREFIX = state_lib.STREAM_SOURCE_PREFIX
# The identity of a stream's files (names, sizes, and the bytes at both ends of each, or an object's version).
FILES_DIGEST = "source_files_digest"
_FILE_END_BYTES = 64 * 2**10
_NOTHING = object()
# `_source_state` when the source is paused right after the last element yielded: its own state now is
# that element's boundary, asked of it only when a state is taken (no state_dict() call per element).
_LIVE = object()


class StreamingIterator(item_lib.V1Checkpointable, state_lib.RestorableIterator):
  """Reads a stream that restores its own position (`state_dict` / `load_state_dict`).

  Args:
    source: a Hugging Face `datasets.IterableDataset` (streaming), or any
      iterable with `state_dict()` and `load_state_dict(state)` whose state
      is the position after the records its iterator yielded (torchdata's
      StatefulDataLoader, your own class). Its state must be JSON: dicts
      with string keys, lists, strings, numbers, booleans, None.
    batch_size: None yields records as the source gives them; an integer
      stacks that many records per element (dict batches of numpy arrays,
      as make_dataset's).
    drop_remainder: with `batch_size`, drop a last batch shorter than it.
    name: how the fingerprint names the source (default: a Hugging Face
      dataset's builder, configuration and split; else the source's type).

  Guarantees:
    The state of element k is the source's own state taken right after the
    records of elements 0..k were read, never later (a `peek`ed element is
    not counted; the source is asked for it when a state is taken, not per
    element, as it stays where element k left it), so after a restore into a fresh iterator over the same
    source the elements are exactly those the saving run would have yielded
    next, for as long as the source's `load_state_dict` is exact. Restoring
    costs one `load_state_dict`: O(1) in the position. The iterator must be
    the source's only reader: a Hugging Face dataset keeps one position per
    object, that of its newest iterator.

  Raises:
    UnsupportedConfigError: a Hugging Face shuffle buffer, or a batched map
      under an Arrow format, which Hugging Face itself does not resume exactly.
    InvalidArgumentError: `source` has no `state_dict` (the error says what reads it), or a
      bad `batch_size`.
  """

  def __init__(self, source: Any, *, batch_size: int | None = None, drop_remainder: bool = True,
               name: str | None = None):
    """Wraps `source` at its start; see the class docstring for the arguments."""
    why = _hf.refusal(source, "StreamingIterator(source=...)")
    if why is not None:
      raise errors.InvalidArgumentError(why)
    if batch_size is not None and (not state_lib.is_int(batch_size) or batch_size < 1):
      raise errors.InvalidArgumentError(
          f"StreamingIterator(batch_size={errors.shown_value(batch_size, 40)}): batch_size must be a "
          "positive integer, or None to yield records one by one.")
    if not isinstance(drop_remainder, bool):
      raise errors.InvalidArgumentError(
          f"StreamingIterator(drop_remainder={errors.shown_value(drop_remainder, 40)}): pass True or False.")
    if name is not None and (not isinstance(name, str) or not name):
      raise errors.InvalidArgumentError(
          f"StreamingIterator(name={errors.shown_value(name, 40)}): name must be a non-empty string.")
    if _hf.is_hf_iterable(source):
      _hf.refuse_inexact(source)
    self._source = source
    self._batch_size = batch_size
    self._drop_remainder = drop_remainder
    self._name = name
    self._iterator: Any = None  # the source's, made at the first read (after a restore's load)
    self._elements = 0
    self._records = 0
    # The source's state at the last element boundary: what state() saves.
    self._source_state = source.state_dict()
    # The layers a restored Hugging Face state must have (a state of a source of our own's is its own).
    self._initial_state = _plain(self._source_state) if _hf.is_hf_iterable(source) else None
    self._lookahead: Any = _NOTHING  # a peeked element, with the counts and state after it
    self._fingerprint = self._describe()

  # -- the state ---------------------------------------------------------------

  @property
  def source(self) -> Any:
    """The stream read."""
    return self._source

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The source's name and layout, and the batching: what a restore checks."""
    return dict(self._fingerprint)

  def position(self) -> dict[str, Any]:
    """Elements and records yielded, and the source's own state right after them."""
    source_state = self._source.state_dict() if self._source_state is _LIVE else self._source_state
    return {ELEMENTS_READ: self._elements, RECORDS_READ: self._records_read(),
            SOURCE_STATE: json_state(source_state, SOURCE_STATE)}

  def _records_read(self) -> int:
    # One record an element: the per-record path counts elements only (`__next__`), records are as many.
    return self._elements if self._batch_size is None else self._records

  def state(self) -> state_lib.IteratorState:
    """The current state as an immutable value.

    Raises:
      InvalidArgumentError: the source's state is not JSON (names the field).
    """
    return state_lib.IteratorState(
        kind="data", fingerprint=self._fingerprint, position=self.position(), lineage=self._lineage)

  def check_restore(
      self, state: state_lib.IteratorState, *, allow_drift: Collection[str] = (), origin: str = "the state"
  ) -> Callable[[], None]:
    """Validates `state`; the returned step loads its source state (nothing is read).

    Raises:
      InvalidStateError: the state is not a streaming iterator's.
      ConfigDriftError: the source, its layout or the batching differ
        (`allow_drift={"batch_size"}` continues at the next record with
        another batch size).
    """
    state_lib.check_kind(state, "data", "StreamingIterator", origin)
    current = self._fingerprint
    if FILES_DIGEST not in state.fingerprint:  # written before streams recorded their files' identity
      current = {k: v for k, v in current.items() if k != FILES_DIGEST}
    differences = state_lib.differing_fields(state.fingerprint, current, allow_drift=allow_drift)
    if FILES_DIGEST in differences:
      raise errors.ConfigDriftError(differences, origin=origin, way=(
          "The stream's files changed since the state was saved (same names, other bytes): its saved "
          "place is a position in the old files' records, which in these files may fall on other "
          "records, so records would be skipped or read twice with no way to name them. Restore the "
          "files the run was saved with, or start the stream afresh (a new checkpoint directory)."))
    state_lib.check_fingerprint(state.fingerprint, current, allow_drift=allow_drift, origin=origin)
    position = state.position
    state_lib.check_stream_position(state.fingerprint, position, origin)
    elements, records = position[ELEMENTS_READ], position[RECORDS_READ]
    saved = _plain(position[SOURCE_STATE])
    if _hf.is_hf_iterable(self._source):
      _check_same_layers(saved, self._initial_state, f"{origin}: field 'position.{SOURCE_STATE}'")
    epoch = saved.get("epoch") if _hf.is_hf_iterable(self._source) else None

    def apply() -> None:
      if state_lib.is_int(epoch) and epoch != self._source.epoch:
        # Hugging Face ignores a state of another epoch and would restart the stream silently.
        self._source.set_epoch(epoch)
      self._source.load_state_dict(saved)
      self._iterator, self._lookahead = None, _NOTHING
      self._elements, self._records = int(elements), int(records)
      self._source_state = _plain(saved)
      self._lineage = state.lineage

    return apply

  # -- reading ---------------------------------------------------------------

  def __iter__(self) -> "StreamingIterator":
    return self

  def __next__(self) -> Any:
    if self._lookahead is not _NOTHING:
      element, (self._elements, self._records, self._source_state) = self._lookahead
      self._lookahead = _NOTHING
      return element
    if self._batch_size is None and self._iterator is not None:
      # One record an element, the stream started: the per-record path, the element counted and no more.
      element = next(self._iterator)
      self._elements += 1
      self._source_state = _LIVE
      return element
    element, read = self._read()
    self._records = self._records_read() + read
    self._elements += 1
    self._source_state = _LIVE  # the source stopped right after this element: its state is asked when saved
    return element

  def peek(self) -> Any:
    """The next element, left to be yielded: the state stays that before it."""
    if self._lookahead is _NOTHING:
      if self._source_state is _LIVE:  # reading ahead moves the source: keep the boundary's state first
        self._source_state = self._source.state_dict()
      element, read = self._read()
      self._lookahead = (element, (self._elements + 1, self._records_read() + read, _LIVE))
    return self._lookahead[0]

  def skip(self, count: int) -> None:
    """Deprecated (too like `ckpt_iter.Skip`, which declares records to skip): `advance(count)`."""
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.warn("StreamingIterator.skip(count) is renamed advance(count) (too like ckpt_iter.Skip); the old "
                  "name goes in 0.4.0.", DeprecationWarning, stacklevel=2)
    self.advance(count)

  def advance(self, count: int) -> None:
    """Reads past `count` elements (what a stock resume's `next()` loop does; a restore needs none)."""
    for _ in range(count):
      try:
        next(self)
      except StopIteration:
        return

  def _read(self) -> tuple[Any, int]:
    """The next element and how many records it holds."""
    if self._iterator is None:
      self._iterator = iter(self._source)
    if self._batch_size is None:
      return next(self._iterator), 1
    records = list(itertools.islice(self._iterator, self._batch_size))
    if not records or (self._drop_remainder and len(records) < self._batch_size):
      raise StopIteration
    return _stacking.stack_records(records, batch_index=self._elements), len(records)

  def _describe(self) -> dict[str, Any]:
    fields: dict[str, Any] = {"source": SOURCE_PREFIX + (self._name or _hf.source_name(self._source)),
                              "batch_size": self._batch_size, "drop_remainder": self._drop_remainder}
    if _hf.is_hf_iterable(self._source):
      fields["source_shards"] = int(self._source.num_shards)
      fields["source_pipeline"] = state_lib.stream_layer_types(self._source_state)
      files = _hf.files_of(self._source)
      if files:
        fields["source_files"] = _hf.files_text(files)
        digest = files_digest(files)
        if digest is not None:
          fields[FILES_DIGEST] = digest
      distributed = getattr(self._source, "_distributed", None)  # split_dataset_by_node's
      if distributed is not None:
        fields["shard_index"], fields["shard_count"] = int(distributed.rank), int(distributed.world_size)
    return fields


  # -- the names torch and Hugging Face use ---------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """`get_state()` under the name torch and Hugging Face use: the state as a plain dict.

    Restore it with `load_state_dict` (checked as a checkpoint restore is);
    `ckpt_iter.IteratorSave(iterator)` writes it in the model's Orbax step.
    """
    return self.get_state()

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """`set_state(state)` under the name torch and Hugging Face use: checked in full, then applied."""
    self.set_state(state)


def files_digest(files: list[str]) -> str | None:
  """The identity of a stream's files: each file's name and size, and the bytes at both ends of a local
  file (an object's version on a store): host-independent, as make_dataset's sampled digest is. None
  when a file cannot be described (the field is then left out, and nothing compared)."""
  digest = hashlib.sha256(b"stream-files\n")
  for path in files:
    try:
      if _storage.is_url(path):
        found = _storage.identity(path)
        digest.update(f"{os.path.basename(path)}:{found.size}:{found.version}\n".encode())
        continue
      with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_FILE_END_BYTES)
        f.seek(max(0, size - _FILE_END_BYTES))
        tail = f.read(_FILE_END_BYTES)
    except (OSError, ImportError, errors.CkptIterError):
      return None
    digest.update(f"{os.path.basename(path)}:{size}:".encode())
    digest.update(hashlib.sha256(head + b"|" + tail).digest())
  return digest.hexdigest()[:16]


def _check_same_layers(saved: Any, fresh: Any, where: str, depth: int = 0) -> None:
  """A Hugging Face state has this stream's layers: the same keys and layer names as its fresh state.

  Values may differ (they are the position); an earlier state kept may be
  None or a state; a list may have other members only where the fresh one is empty.
  """
  if depth > 64:
    raise errors.InvalidStateError(f"{where}: nested more than 64 levels deep.")
  if isinstance(fresh, Mapping):
    if not isinstance(saved, Mapping) or set(saved) != set(fresh):
      raise errors.InvalidStateError(
          f"{where} is {state_lib.short_repr(saved, 60)}; this stream's state there has the fields "
          f"{sorted(fresh) if isinstance(fresh, Mapping) else fresh}: a state of another pipeline or "
          "edited. Restore a state this stream wrote.")
    if fresh.get("type") != saved.get("type"):
      raise errors.InvalidStateError(
          f"{where}.type is {state_lib.short_repr(saved.get('type'))}, this stream's layer there is "
          f"{fresh.get('type')!r}: a state of another pipeline. Restore a state this stream wrote.")
    for key, inner in fresh.items():
      if key.startswith("previous_state") and (inner is None or saved[key] is None):
        continue
      _check_same_layers(saved[key], inner, f"{where}.{key}", depth + 1)
  elif isinstance(fresh, list) and fresh:
    if not isinstance(saved, list) or len(saved) != len(fresh):
      raise errors.InvalidStateError(
          f"{where} is {state_lib.short_repr(saved, 60)}; this stream's state there is a list of "
          f"{len(fresh)}. Restore a state this stream wrote.")
    for i, (a, b) in enumerate(zip(saved, fresh)):
      _check_same_layers(a, b, f"{where}[{i}]", depth + 1)
  elif fresh is not None and not isinstance(fresh, list) and type(saved) is not type(fresh):
    raise errors.InvalidStateError(
        f"{where} is {state_lib.short_repr(saved, 40)} ({type(saved).__name__}), this stream's is a "
        f"{type(fresh).__name__}. Restore a state this stream wrote.")


# ---------------------------------------------------------------------------
# The source's state as JSON, unchanged by the trip.


def json_state(value: Any, path: str) -> Any:
  """`value` if JSON stores and reads it back unchanged; else InvalidArgumentError naming the leaf."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, int) and type(value) is int:
    return value
  if type(value) is float and math.isfinite(value):
    return value
  if isinstance(value, Mapping):
    for key in value:
      if not isinstance(key, str):
        raise _not_json(path, f"has the key {key!r} ({type(key).__name__}), which JSON would turn into a string")
    return {key: json_state(inner, f"{path}.{key}") for key, inner in value.items()}
  if isinstance(value, list):
    return [json_state(inner, f"{path}[{i}]") for i, inner in enumerate(value)]
  if isinstance(value, tuple):
    raise _not_json(path, "is a tuple, which JSON would give back as a list")
  raise _not_json(path, f"is {errors.shown_value(value, 40)} of type {type(value).__qualname__}")


def _not_json(path: str, what: str) -> errors.InvalidArgumentError:
  return errors.InvalidArgumentError(
      f"the source's state_dict() field {path!r} {what}; a checkpoint holds the state as JSON, so "
      "it would not restore as saved. Make the source's state plain JSON (str keys, lists, ints, "
      "finite floats, strings, None), or read the source with ckpt_iter.ReplayIterator (exact, "
      "O(position) restore).")


def _plain(value: Any) -> Any:
  """A mutable deep copy (a restored state is read-only; a source may update what it loads)."""
  return json.loads(json.dumps(value))
