"""The Orbax checkpoint item for ckpt_iter iterators.

    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        data=ckpt_iter.IteratorSave(iterator)))
    mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params),
        data=ckpt_iter.IteratorRestore(iterator)))

Each process writes `process_<i>-of-<n>.json` (the state header) and, when it
has pending arrays, `process_<i>-of-<n>.npz` (plain .npy members, never
pickled); process 0 also writes `ckpt_iter.json`, the process count, which an
elastic restore reads instead of listing the directory. The state is
snapshotted synchronously in `save`; the files are written in Orbax's
background thread; Orbax makes the step visible only once every item of every
process is written, so a step that did not finish is never restored. What
is written and how it is read and checked is `_item`'s; this module adapts
it to Orbax's handler and args (v0) and checkpointable (v1) APIs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from typing import Any, Collection

from etils import epath
import orbax.checkpoint as ocp

from ckpt_iter import _files
from ckpt_iter import _item
from ckpt_iter import errors
from ckpt_iter import iterator as iterator_lib


# ---------------------------------------------------------------------------
# Orbax handler and args.


class IteratorCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores ckpt_iter iterators as an Orbax checkpoint item."""

  def __init__(self, process_index: int | None = None, process_count: int | None = None):
    self._process_index = process_index
    self._process_count = process_count

  def _process(self) -> tuple[int, int]:
    return _item.process(self._process_index, self._process_count)

  async def async_save(self, directory: epath.Path, args: "IteratorSave") -> list[Any]:
    """Takes the state now; returns the write of this process's files, which Orbax awaits before it commits the step."""
    try:
      header, arrays = _item.snapshot(iterator_lib.grain_iterator_view(args.item), _item.step_of(directory))
    except BaseException:
      _await_step_directories()
      raise
    index, count = self._process()
    return [_WriteWhenAwaited(lambda: _item.write(directory, header, arrays, index, count))]

  def save(self, directory: epath.Path, args: "IteratorSave") -> None:
    """Takes the state and writes this process's files into `directory` before returning."""
    header, arrays = _item.snapshot(iterator_lib.grain_iterator_view(args.item), _item.step_of(directory))
    _item.write(directory, header, arrays, *self._process())

  def restore(self, directory: epath.Path, args: "IteratorRestore | None" = None) -> Any:
    """Reads this process's state from `directory`, checks it in full, then applies it to `args.item` and returns it."""
    if args is None or args.item is None:
      raise errors.InvalidArgumentError(
          "restoring a ckpt_iter item needs the iterator to restore into: "
          "IteratorRestore(iterator)."
      )
    saved = _item.read_item(directory, *self._process(), elastic=args.elastic)
    _item.check_restore_saved(iterator_lib.grain_iterator_view(args.item), saved, allow_drift=args.allow_drift)()
    return args.item

  def metadata(self, directory: epath.Path) -> Any:
    """A summary for Orbax's item_metadata: never raises on a bad item."""
    try:
      files = _files.list_process_files(directory)
      return {"processes": [_files.process_file_stem(i, n) for i, n in files]}
    except OSError:
      return None

  def finalize(self, directory: epath.Path) -> None:
    """Nothing to do: each file is written in one piece, and Orbax commits the step."""
    pass

  def close(self) -> None:
    """Nothing to release: the handler holds no threads or files."""
    pass


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Orbax args that save a DataIterator, RepeatIterator or Tunix data state.

  Attributes:
    item: the iterator; its state is taken when `save` is called.
  """

  item: Any

  def __post_init__(self):
    _check_item(self.item, "IteratorSave", save=True)


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Orbax args that restore into an existing iterator, in place.

  Attributes:
    item: the iterator to restore into, built from the same pipeline.
    allow_drift: fingerprint fields that may differ from the checkpoint's.
    elastic: resume a make_dataset pipeline with another process count: any
      count that divides the global batch, which may itself change, and the
      run continues at the first stream record not read (see
      https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/multihost.md).
      Grain's ElasticIterator resumes with another count at the same global
      batch size.
  """

  item: Any
  allow_drift: Collection[str] = ()
  elastic: bool = False

  def __post_init__(self):
    _check_item(self.item, "IteratorRestore", restore=True)
    _check_restore_options(self.allow_drift, self.elastic, "IteratorRestore")


# ---------------------------------------------------------------------------
# The args' checks: a bad argument is refused where it is written, not inside
# Orbax's save (in its threads, with other items' writes under way).

_WHAT_TO_PASS = (
    "Pass the iterator the training loop reads: ckpt_iter.DataIterator(dataset) over a Grain "
    "MapDataset or IterDataset (make_dataset's included), a RepeatIterator, "
    "ckpt_iter.DataLoaderIterator(loader) for a grain.DataLoader, "
    "ckpt_iter.StreamingIterator(stream) for a stream with state_dict() (a Hugging Face "
    "IterableDataset), or ckpt_iter.ReplayIterator(iterable) for a list or generator."
)


def _check_item(item: Any, args_name: str, *, save: bool = False, restore: bool = False) -> None:
  """Refuses an item that has no state to save or none to restore into (`save` or `restore`: either suffices).

  Saved: what has `state()` (ckpt_iter's iterators) or `get_state()` (a
  Grain iterator). Restored into: what has `check_restore` or `set_state`.
  """
  savable = save and not isinstance(item, type) and (
      callable(getattr(item, "state", None)) or callable(getattr(item, "get_state", None)))
  restorable = restore and not isinstance(item, type) and (
      callable(getattr(item, "check_restore", None)) or callable(getattr(item, "set_state", None)))
  if savable or restorable:
    return
  has = "no state to save" if save and not restore else (
      "no state to restore into" if restore and not save else "no state to save or restore")
  raise errors.InvalidArgumentError(
      f"{args_name}(item={errors.shown_value(item, 60)}): item is of type {_type_name(item)}, which has "
      f"{has}. {_hint(item) or _WHAT_TO_PASS}"
  )


def _type_name(item: Any) -> str:
  return f"class {item.__qualname__}" if isinstance(item, type) else type(item).__qualname__


def _hint(item: Any) -> str:
  """The likely mistake, for the types users pass by mistake."""
  names = {kind.__name__ for kind in type(item).__mro__}
  if names & {"MapDataset", "IterDataset"}:
    return "A dataset has no position: wrap it, ckpt_iter.DataIterator(dataset), and read batches from that."
  if "DataLoader" in names:
    return "Wrap the loader, ckpt_iter.DataLoaderIterator(loader), and read batches from that."
  return ""


def _check_restore_options(allow_drift: Any, elastic: Any, args_name: str) -> None:
  if isinstance(allow_drift, (str, bytes)) or not isinstance(allow_drift, Collection) or not all(
      isinstance(name, str) for name in allow_drift
  ):
    raise errors.InvalidArgumentError(
        f"{args_name}(allow_drift={errors.shown_value(allow_drift, 60)}): allow_drift is of type "
        f"{type(allow_drift).__qualname__}; pass a collection of fingerprint field names, "
        "e.g. allow_drift={'seed'} (a bare string would be read as its letters)."
    )
  if not isinstance(elastic, bool):
    raise errors.InvalidArgumentError(
        f"{args_name}(elastic={errors.shown_value(elastic, 60)}): elastic is of type "
        f"{type(elastic).__qualname__}, not bool; pass True or False."
    )


class _WriteWhenAwaited:
  """The background write of this process's files, as the future Orbax awaits before it commits the step.

  Orbax awaits the futures of a step's items one after the other in its
  background save thread (`async_save`), and the first of them creates the
  step's directories. The write runs there, at the first `result()`, once
  the directories exist (the same signals
  `CommitFutureAwaitingContractedSignals` waits for, captured here, at
  save time): no thread and no event loop of its own per save, and nothing
  of it runs while `save()` still blocks the training loop. Its error is
  raised by every `result()`, so Orbax does not commit the step.
  """

  def __init__(self, write: Any):
    self._write = write
    self._lock = threading.Lock()
    self._state = "pending"  # -> "cancelled" | "done" | "failed"
    self._error: BaseException | None = None
    self._signals = _contracted_signals()
    if self._signals is None:  # an Orbax without them: its own thread, as before
      async def write_files() -> None:
        write()

      self._thread_future = ocp.future.CommitFutureAwaitingContractedSignals(write_files(), name="ckpt_iter_save")

  def result(self, timeout: float | None = None) -> None:
    if self._signals is None:
      return self._thread_future.result(timeout=timeout)
    with self._lock:
      if self._state == "pending":
        try:
          self._signals.wait(timeout)
          self._write()
          self._state = "done"
        except BaseException as e:  # pylint: disable=broad-except  (raised below, and on every later call)
          self._state, self._error = "failed", e
      if self._state == "cancelled":
        raise concurrent.futures.CancelledError()
      if self._error is not None:
        raise self._error
    return None

  def cancel(self) -> bool:
    if self._signals is None:
      return self._thread_future.cancel()
    with self._lock:
      if self._state == "pending":
        self._state = "cancelled"
    return self._state == "cancelled"


class _Signals:
  """The Orbax signals (the step's directories created) a write of this save waits for."""

  def __init__(self, future_lib: Any, operation_id: str):
    self._future_lib = future_lib
    self._operation_id = operation_id
    self._signals = future_lib.AwaitableSignalsContract.get_awaitable_signals_from_contract(operation_id=operation_id)

  def wait(self, timeout: float | None) -> None:
    if not self._signals:
      return
    timeout_secs = self._future_lib.multihost.coordination_timeout() if timeout is None else max(1, math.ceil(timeout))
    self._future_lib.wait_for_signals(self._signals, timeout_secs=timeout_secs, operation_id=self._operation_id)


def _contracted_signals() -> _Signals | None:
  """This save's signals, taken now (at save time, as Orbax's own commit futures do); None on an Orbax without them."""
  try:
    from orbax.checkpoint._src.futures import future as future_lib  # pylint: disable=g-import-not-at-top
    from orbax.checkpoint._src.futures import synchronization  # pylint: disable=g-import-not-at-top

    operation_id = synchronization.OperationIdGenerator.get_current_operation_id()
    return _Signals(future_lib, operation_id)
  except (ImportError, AttributeError):
    return None


def _await_step_directories() -> None:
  """Waits (bounded) until Orbax has created this save's directories, before an error leaves save().

  Orbax creates them in a background thread, and the other items' writes
  (threads of their own) wait for its signal. An error that leaves save()
  at once lets the program end while that thread has not run: at interpreter
  shutdown it cannot start its work, the signal never comes, and the
  waiting threads hold the process for Orbax's 300 s signal timeout.
  """

  async def nothing() -> None:
    pass

  try:
    ocp.future.CommitFutureAwaitingContractedSignals(
        nothing(), name="ckpt_iter_failed_save", timeout_secs=_item.STEP_DIRECTORIES_WAIT_SECONDS
    ).result()
  except Exception:  # pylint: disable=broad-except  (the save's own error is the one to raise)
    pass


# ---------------------------------------------------------------------------
# Orbax v1 (`orbax.checkpoint.experimental.v1`, `orbax.checkpoint.v1`):
# the same item as a StatefulCheckpointable, written in the same files.


class IteratorCheckpointable:
  """A ckpt_iter iterator as an Orbax v1 checkpointable (`StatefulCheckpointable`).

      checkpointer.save_checkpointables(step, {
          "params": params, "data": ckpt_iter.IteratorCheckpointable(iterator)})
      checkpointer.load_checkpointables(step, {
          "params": abstract_params, "data": ckpt_iter.IteratorCheckpointable(iterator)})

  Orbax v1 resolves its built-in StatefulCheckpointableHandler for it, so no
  registration is needed. The state is taken synchronously when Orbax calls
  `save`; this process's files are written in the background once Orbax
  has created the item directory. The files are those of
  `IteratorCheckpointHandler` (v0): a step written by either API reads with
  `read_item`.

  Attributes:
    item: the iterator (or Tunix data state) to save from / restore into.
    allow_drift: fingerprint fields that may differ on load.
    elastic: as in `IteratorRestore`.
  """

  def __init__(
      self, item: Any, *, allow_drift: Collection[str] = (), elastic: bool = False,
      process_index: int | None = None, process_count: int | None = None,
  ):
    # Used for both: Orbax calls save or load on it.
    _check_item(item, "IteratorCheckpointable", save=True, restore=True)
    _check_restore_options(allow_drift, elastic, "IteratorCheckpointable")
    self.item = item
    self.allow_drift = allow_drift
    self.elastic = elastic
    self._process_index = process_index
    self._process_count = process_count
    register_v1_handler()

  async def save(self, directory: Any) -> Any:
    """Orbax v1 calls this: takes the state now; returns the write of this process's files, run in the background."""
    return await _item.v1_save(iterator_lib.grain_iterator_view(self.item), directory, self._process_index,
                               self._process_count)

  async def load(self, directory: Any) -> Any:
    """Orbax v1 calls this: reads and checks this process's state now; returns the step that applies it."""
    return await _item.v1_load(
        iterator_lib.grain_iterator_view(self.item), epath.Path(directory), allow_drift=self.allow_drift,
        elastic=self.elastic, index=self._process_index, count=self._process_count)


class _IteratorCheckpointableHandler:
  """Orbax v1 handler for IteratorCheckpointable: the stateful save/load, plus metadata.

  Orbax's generic StatefulCheckpointableHandler has no metadata, so every
  `checkpointables_metadata` of a step (Tunix calls it on each restore) would
  log a failure for the item; this one answers with the item's summary.
  """

  async def save(self, directory: Any, checkpointable: IteratorCheckpointable) -> Any:
    return await checkpointable.save(directory)

  async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Any:
    if abstract_checkpointable is None:
      raise errors.InvalidArgumentError(
          "loading a ckpt_iter item needs the iterator to restore into: "
          "IteratorCheckpointable(iterator)."
      )
    background = await abstract_checkpointable.load(directory)

    async def finish() -> Any:
      await background
      return abstract_checkpointable

    return finish()

  async def metadata(self, directory: Any) -> Any:
    return IteratorCheckpointHandler().metadata(epath.Path(directory))

  def is_handleable(self, checkpointable: Any) -> bool:
    return isinstance(checkpointable, IteratorCheckpointable)

  def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
    return isinstance(abstract_checkpointable, IteratorCheckpointable)


_V1_REGISTERED = False


def register_v1_handler() -> None:
  """Registers the v1 handler once, when the first IteratorCheckpointable is made."""
  global _V1_REGISTERED
  if _V1_REGISTERED:
    return
  from orbax.checkpoint.experimental.v1 import handlers as v1_handlers  # pylint: disable=g-import-not-at-top

  try:
    v1_handlers.register_handler(_IteratorCheckpointableHandler)
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ != "AlreadyExistsError":
      raise
  _V1_REGISTERED = True
