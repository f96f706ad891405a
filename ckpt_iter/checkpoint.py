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
process is written, so a step that did not finish is never restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Collection

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import elastic as elastic_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib


def snapshot(item: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Takes the state of `item` now: a JSON header and copies of its arrays.

  The only copy of the pending arrays a save makes: one host copy per leaf
  (`_codec.encode_pytree`; a JAX array on an accelerator is transferred, and
  that transfer is the copy). The handler writes these very arrays in Orbax's
  background thread, with no further defensive copy.
  """
  if hasattr(item, "state"):
    value = item.state()
  else:
    value = state_lib.IteratorState.from_dict(_grain_state_dict(item.get_state()))
  return codec.encode_state(value)


def _grain_state_dict(grain_state: Any) -> Any:
  """A plain Grain iterator's state as a dict: a DataLoader's comes as JSON bytes."""
  if isinstance(grain_state, bytes):
    try:
      return json.loads(grain_state.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise errors.InvalidStateError(
          f"the iterator's get_state() returned bytes that are not JSON ({e}); "
          "ckpt_iter stores Grain states as JSON. Wrap a grain.DataLoader in "
          "ckpt_iter.DataLoaderIterator."
      ) from None
  return grain_state


# ---------------------------------------------------------------------------
# Orbax handler and args.


class IteratorCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores ckpt_iter iterators as an Orbax checkpoint item."""

  def __init__(self, process_index: int | None = None, process_count: int | None = None):
    self._process_index = process_index
    self._process_count = process_count

  def _process(self) -> tuple[int, int]:
    index = jax.process_index() if self._process_index is None else self._process_index
    count = jax.process_count() if self._process_count is None else self._process_count
    return index, count

  async def async_save(self, directory: epath.Path, args: "IteratorSave") -> list[Any]:
    header, arrays = snapshot(args.item)
    index, count = self._process()

    async def write() -> None:
      _files.write_files(directory, header, arrays, process_index=index, process_count=count, count_file=True)

    return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="ckpt_iter_save")]

  def save(self, directory: epath.Path, args: "IteratorSave") -> None:
    header, arrays = snapshot(args.item)
    index, count = self._process()
    _files.write_files(directory, header, arrays, process_index=index, process_count=count, count_file=True)

  def restore(self, directory: epath.Path, args: "IteratorRestore | None" = None) -> Any:
    if args is None or args.item is None:
      raise errors.InvalidArgumentError(
          "restoring a ckpt_iter item needs the iterator to restore into: "
          "IteratorRestore(iterator)."
      )
    index, count = self._process()
    saved = read_item(directory, index, count, elastic=args.elastic)
    check_restore_saved(args.item, saved, allow_drift=args.allow_drift)()
    return args.item

  def metadata(self, directory: epath.Path) -> Any:
    """A summary for Orbax's item_metadata: never raises on a bad item."""
    try:
      files = _files.list_process_files(directory)
      return {"processes": [_files.process_file_stem(i, n) for i, n in files]}
    except OSError:
      return None

  def finalize(self, directory: epath.Path) -> None:
    pass

  def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class SavedState:
  """A data state as read from an item directory, for one process."""

  value: state_lib.IteratorState
  resized: bool  # written by another process count (re-sliced by elastic)
  origin: str  # what error messages name


def read_item(
    directory: str | os.PathLike[str], process_index: int, process_count: int, *, elastic: bool = False
) -> SavedState:
  """Reads process `process_index`'s state from an item directory, validated.

  The one read path of a data item: Orbax restores and the Tunix learners'
  restores both come through here.
  """
  directory = os.fspath(directory)
  if not elastic:
    return SavedState(
        _files.read_state(directory, process_index, process_count),
        resized=False,
        origin=_files.header_path(directory, process_index, process_count),
    )
  saved_count = _files.saved_process_count(directory)
  value = elastic_lib.read_for_process(
      directory, process_index, process_count, saved_count=saved_count
  )
  # With the saved process count an elastic restore is an exact one: each
  # process gets its own file, so per-process fields are checked as usual
  # (and a per-process filter, refused only when the count changes, works).
  return SavedState(value, resized=saved_count != process_count, origin=directory)


def read_item_if_present(
    directory: str | os.PathLike[str], process_index: int, process_count: int
) -> SavedState | None:
  """`read_item`, or None when the directory holds no data item at all.

  For learners that resume steps written without one (stock Tunix): the
  header is read directly, and only its absence costs a listing.
  """
  try:
    return read_item(directory, process_index, process_count)
  except errors.ItemNotFoundError:
    return None


def check_restore_saved(
    item: Any, saved: SavedState, *, allow_drift: Collection[str] = ()
) -> Callable[[], None]:
  """Checks a state read by `read_item` against `item`; returns the apply step.

  A state re-sliced for another process count may differ in the per-process
  fields (`elastic.ELASTIC_FIELDS`); everything else must match.
  """
  allowed = set(allow_drift) | (elastic_lib.ELASTIC_FIELDS if saved.resized else set())
  return check_restore_into(item, saved.value, allow_drift=allowed, origin=saved.origin)


def restore_into(
    item: Any, value: state_lib.IteratorState, *, allow_drift: Collection[str] = (), origin: str
) -> None:
  """Restores `value` into a ckpt_iter iterator (check, then apply) or a Grain one."""
  check_restore_into(item, value, allow_drift=allow_drift, origin=origin)()


def check_restore_into(
    item: Any, value: state_lib.IteratorState, *, allow_drift: Collection[str] = (), origin: str
) -> Callable[[], None]:
  """The check half of `restore_into`: raises or returns the apply step."""
  # What isinstance(item, state_lib.Restorable) decides, without typing's
  # protocol machinery, which walks the protocol's MRO on every call.
  check_restore = getattr(item, "check_restore", None)
  if check_restore is not None:
    return check_restore(value, allow_drift=allow_drift, origin=origin)
  if allow_drift:
    raise errors.InvalidArgumentError(
        f"allow_drift/elastic need a ckpt_iter iterator; {type(item).__qualname__} "
        "has only set_state."
    )
  # A plain Grain iterator: its own state is the position, in the form its
  # get_state gives (a DataLoader's iterator takes JSON bytes). Grain checks
  # it only when it is set.
  position = dict(value.position)
  if isinstance(item.get_state(), bytes):
    return lambda: item.set_state(json.dumps(position).encode("utf-8"))
  return lambda: item.set_state(position)


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Orbax args that save a DataIterator, RepeatIterator or Tunix data state.

  Attributes:
    item: the iterator; its state is taken when `save` is called.
  """

  item: Any


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Orbax args that restore into an existing iterator, in place.

  Attributes:
    item: the iterator to restore into, built from the same pipeline.
    allow_drift: fingerprint fields that may differ from the checkpoint's.
    elastic: resume a make_dataset pipeline with another process count (see
      docs/multihost.md); the global batch size must be the same.
  """

  item: Any
  allow_drift: Collection[str] = ()
  elastic: bool = False


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
    self.item = item
    self.allow_drift = allow_drift
    self.elastic = elastic
    self._handler = IteratorCheckpointHandler(process_index, process_count)
    register_v1_handler()

  async def save(self, directory: Any) -> Any:
    header, arrays = snapshot(self.item)
    index, count = self._handler._process()  # pylint: disable=protected-access

    async def write() -> None:
      path = await directory.await_creation()
      _files.write_files(path, header, arrays, process_index=index, process_count=count, count_file=True)

    return write()

  async def load(self, directory: Any) -> Any:
    # Read and check now, apply in the background step: Orbax wraps errors
    # of the background step in NoEntryError, but lets these through, so a
    # refused restore raises the same errors as through the v0 API.
    index, count = self._handler._process()  # pylint: disable=protected-access
    saved = read_item(epath.Path(directory), index, count, elastic=self.elastic)
    apply = check_restore_saved(self.item, saved, allow_drift=self.allow_drift)

    async def finish() -> None:
      apply()

    return finish()


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
