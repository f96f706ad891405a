"""The object-store client: how every call to a store (gs://, s3://, ...) is made, and what its errors mean.

`_storage`'s object-store backend makes each of its calls through here: the
fsspec filesystem of a URL (`filesystem`; gcsfs for gs://, each request
bounded), the operation bound (`bounded`, by the bounds `store_bounds` holds),
`guarded`, through which every store call, store file (`StoreFile`) and
streamed upload (`Spool`) reaches `translate`: the one place
a store's error becomes ckpt_iter's (and `replaced_error`, its refusal of a
pinned object gone, which `_storage` gives a local file replaced too). What
each store takes and guarantees (its package, the bound of its requests, an
object read back at the version a reader pinned) is its `StoreProfile`, by
scheme: the one place GCS's differ from another store's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from ckpt_iter import errors
from ckpt_iter.store_bounds import BOUNDS_ENV
from ckpt_iter.store_bounds import object_store_bounds

_log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class StoreProfile:
  """What one store's fsspec filesystem takes and guarantees: a second store is one profile.

  Attributes:
    package: what to install for the scheme, and its extra's name where ckpt_iter has one.
    bounds_requests: the filesystem bounds each HTTP request (`requests_timeout`), and each request of a
      file it opens (`timeout`); a store without it is bounded by `bounded`'s operation bound only.
    pins: an object's metadata `generation` names that version for good, and the filesystem reads it back
      (`key#generation` opened version-aware, `cat_file(generation=...)`): a reader pinned to it reads one
      version or fails when it is gone, never a mix. Without it an object has no pin (its identity still
      tells a rewrite at a restart).
  """

  package: str
  extra: str | None = None
  bounds_requests: bool = False
  pins: bool = False

  def filesystem_options(self, versioned: bool) -> dict[str, Any]:
    """The options a filesystem of this store is made with (`versioned`: it reads pinned versions)."""
    options: dict[str, Any] = {}
    if self.bounds_requests:
      options["requests_timeout"] = object_store_bounds().request_seconds
    if versioned and self.pins:
      options["version_aware"] = True
    return options

  def file_options(self) -> dict[str, Any]:
    """What bounds each request of a file this store's filesystem opens."""
    return {"timeout": object_store_bounds().operation_seconds} if self.bounds_requests else {}

  def pin_of(self, info: dict[str, Any]) -> str | None:
    """The version an object's metadata names for good, which later reads are pinned to; None without."""
    generation = info.get("generation")
    return str(generation) if self.pins and generation not in (None, "") else None

  def pinned_target(self, key: str, pin: str | None) -> str:
    """What a version-aware filesystem opens to read `key` at `pin`."""
    return f"{key}#{pin}" if pin and self.pins else key

  def pinned_range(self, pin: str | None) -> dict[str, Any]:
    """What a ranged read of `key` at `pin` passes its filesystem's `cat_file`."""
    return {"generation": pin} if pin and self.pins else {}


_GCS = StoreProfile("gcsfs", extra="gcs", bounds_requests=True, pins=True)
PROFILES = {"gs": _GCS, "gcs": _GCS, "s3": StoreProfile("s3fs"), "az": StoreProfile("adlfs"),
            "abfs": StoreProfile("adlfs"), "hf": StoreProfile("huggingface_hub")}


def profile(url: str) -> StoreProfile:
  """The profile of a URL's store (by its scheme); a store without one is taken at its word: no pins, no
  request bounds beyond the operation bound."""
  scheme = url.split("://", 1)[0]
  return PROFILES.get(scheme) or StoreProfile(f"the fsspec implementation of {scheme}://")


def replaced_error(path: str, evidence: str, kind: str, *, deleted: bool = False) -> errors.InvalidStateError:
  """The refusal of a file (`kind` "file" or "object") replaced, or `deleted`, since a reader pinned it (both
  backends')."""
  # A source naming its files from a corpus index (files_from_index) is built from the index again, which
  # still holds the old version until the directory is indexed again.
  reindex = (" (a source with files_from_index=True: index the directory first, "
             f"{errors.index_command(path.rsplit('/', 1)[0])})")
  if deleted:
    return errors.InvalidStateError(
        f"{path}: deleted since this source indexed it ({evidence}). Put the {kind} back, or build the source "
        f"again (make_dataset) without it{reindex}.")
  return errors.InvalidStateError(
      f"{path}: replaced or rewritten since this source indexed it ({evidence}); its records would "
      f"mix two versions. Build the source again (make_dataset) to read the new {kind}{reindex}.")


# A streamed object of at most this many bytes is sent as one simple upload
# (one request) from memory; a larger one as a resumable upload (two requests
# at least), its first bytes sent from this buffer.
SMALL_UPLOAD_BYTES = 16 * 2**20


# ---------------------------------------------------------------------------
# Object-store plumbing: the filesystem, bounds, and the one error translator.


def filesystem(url: str, *, versioned: bool = False) -> tuple[Any, str]:
  """The fsspec filesystem of a URL (fsspec caches instances, per process) and its key.

  On gs:// every HTTP request is bounded (`StoreBounds.request_seconds`);
  `versioned`: one that reads `key#generation` as that generation.
  """
  store = profile(url)
  try:
    import fsspec  # pylint: disable=g-import-not-at-top

    return fsspec.core.url_to_fs(url, **store.filesystem_options(versioned))
  except ImportError as e:
    scheme = url.split("://", 1)[0]
    raise errors.MissingPackageError(
        f"{url}: reading or writing {scheme}:// needs {store.package} ({e}). Install it with: "
        + (f"pip install 'ckpt_iter[{store.extra}]'" if store.extra else f"pip install {store.package}")
    ) from None


def bounded(fs: Any, path: str, operation: str, call: Any, *args: Any, reads_generation: str | None = None,
             **kwargs: Any) -> Any:
  """`call(*args, **kwargs)`, a method of `fs`, within the operation bound, through `guarded`.

  An asynchronous fsspec filesystem (gcsfs) runs each call on its own event
  loop: given `timeout`, the call is cancelled there when the bound passes.
  `reads_generation`: the one the call reads (a missing object is then a replaced one).
  """
  from fsspec import asyn  # pylint: disable=g-import-not-at-top

  bounds = object_store_bounds()
  if isinstance(fs, asyn.AsyncFileSystem):
    kwargs["timeout"] = bounds.operation_seconds
  return retried(lambda: guarded((path, operation, reads_generation), call, *args, **kwargs), path, operation)


# Causes an attempt may not meet again: tried again (`StoreBounds.retries`).
TRANSIENT_CAUSES = frozenset({"timeout", "server", "throttled", "network", "corrupt"})


def retried(attempt: Callable[[], Any], path: str, operation: str) -> Any:
  """`attempt()`, tried again after a transient `StorageError` (`StoreBounds.retries`, with backoff).

  Every call of a whole operation (a read, a write of a whole object, a
  listing) is idempotent: trying it again reads or writes the same bytes.
  """
  import time  # pylint: disable=g-import-not-at-top

  bounds = object_store_bounds()
  for number in range(bounds.retries + 1):
    try:
      return attempt()
    except errors.StorageError as e:
      if e.cause not in TRANSIENT_CAUSES or number == bounds.retries:
        if number:
          e.args = (f"{e.args[0]} ({number + 1} attempts, StoreBounds.retries={bounds.retries})",)
        raise
      wait = min(bounds.backoff_seconds * 2**number, 60.0)
      _log.warning("%s: %s failed (%s); trying again in %.3g s (%d of %d)", path, operation, e.cause, wait,
                   number + 1, bounds.retries)
      time.sleep(wait)
  raise AssertionError("unreachable")


def guarded(where: tuple[str, str, str | None], call: Any, *args: Any, **kwargs: Any) -> Any:
  """`call(*args, **kwargs)`, a store call, its errors translated by `translate(*where, error)`.

  `where`: the path the call is about, the operation, and the generation it
  reads (None: the newest).
  """
  try:
    return call(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    translated = translate(*where, e)
    if translated is None:
      raise
    raise translated from (e if isinstance(translated, errors.StorageError) else None)


class StoreFile:
  """A store file (for streamed reads or writes) whose every call is `guarded`, naming the file."""

  def __init__(self, f: Any, path: str, operation: str, generation: str | None = None):
    self._f = f
    self._where = (path, operation, generation)

  def read(self, *args: Any) -> bytes:
    return guarded(self._where, self._f.read, *args)

  def readinto(self, buffer: Any) -> int:
    return guarded(self._where, self._f.readinto, buffer)

  def readline(self, *args: Any) -> bytes:
    return guarded(self._where, self._f.readline, *args)

  def seek(self, *args: Any) -> int:
    return guarded(self._where, self._f.seek, *args)

  def write(self, data: Any) -> int:
    return guarded(self._where, self._f.write, data)

  def flush(self) -> None:
    guarded(self._where, self._f.flush)

  def close(self) -> None:
    guarded(self._where, self._f.close)

  def __iter__(self) -> Any:
    return iter(self.readline, b"")

  def __enter__(self) -> "StoreFile":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._f, name)


class Spool:
  """A write-only stream that keeps its first SMALL_UPLOAD_BYTES; past them it opens `open_stream()`."""

  def __init__(self, open_stream: Callable[[], Any]):
    self._open_stream = open_stream
    self.buffer = bytearray()
    self.stream: Any = None

  def write(self, data: Any) -> int:
    view = memoryview(data).cast("B")
    if self.stream is None:
      if len(self.buffer) + len(view) <= SMALL_UPLOAD_BYTES:
        self.buffer += view
        return len(view)
      self.stream = self._open_stream()
      self.stream.write(bytes(self.buffer))
      self.buffer = bytearray()
    self.stream.write(view)
    return len(view)

  def flush(self) -> None:
    if self.stream is not None:
      self.stream.flush()

  def discard(self) -> None:
    """Cancels the upload begun, if any: no partial object is published."""
    discard = getattr(self.stream, "discard", None)
    if discard is not None:
      try:
        discard()
      except Exception:  # pylint: disable=broad-except
        pass


def _exists_now(path: str) -> bool:
  """Whether an object is at `path` now (one bounded metadata request; True when the store cannot say)."""
  try:
    fs, key = filesystem(path)
    fs.invalidate_cache(key)
    bounded(fs, path, "stat", fs.info, key)
  except FileNotFoundError:
    return False
  except Exception:  # pylint: disable=broad-except
    return True  # unknown: the general word, "replaced or rewritten"
  return True


def translate(path: str, operation: str, generation: str | None, error: Exception) -> Exception | None:
  """`error` of a store call about `path` as ckpt_iter's error; None to raise it as it is.

  The one translator: a missing object stays `FileNotFoundError` (None),
  unless the call read a pinned `generation`, which is then gone (replaced);
  the store's own errors become `StorageError` with the cause and a hint;
  anything else is not the store's (None).
  """
  import asyncio  # pylint: disable=g-import-not-at-top

  from fsspec import exceptions as fsspec_exceptions  # pylint: disable=g-import-not-at-top

  if isinstance(error, FileNotFoundError):
    if not generation:
      return None
    return replaced_error(path, f"generation {generation} is gone", "object", deleted=not _exists_now(path))
  if isinstance(error, errors.StorageError):
    return error
  if isinstance(error, (fsspec_exceptions.FSTimeoutError, asyncio.TimeoutError, TimeoutError)):
    bounds = object_store_bounds()
    return errors.StorageTimeoutError(
        f"{path}: {operation} did not finish within its bound ({bounds.operation_seconds:g} s an "
        f"operation, {bounds.request_seconds:g} s a request): the object store stalled or cannot be "
        "reached. Retry; the checkpoint being restored, or the last committed one, is intact. For a "
        f"slow store raise the bounds (ckpt_iter.set_object_store_bounds, or {BOUNDS_ENV}).",
        path=path, operation=operation, cause="timeout")
  code = getattr(error, "code", None) if type(error).__name__ == "HttpError" else None
  text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
  if isinstance(error, PermissionError) or code in (401, 403) or text.startswith("Forbidden"):
    cause, hint = "permission", (
        f"the credentials in use may not {operation} it: grant them access to the bucket, or "
        "use credentials that have it")
  elif code == 429:
    cause, hint = "throttled", "the store throttled the requests beyond the client's retries: retry later"
  elif isinstance(code, int) and code >= 500 or type(error).__name__ == "ProxyError":
    cause, hint = "server", "the store kept failing beyond the client's retries: retry later"
  elif isinstance(code, int) or (isinstance(error, ValueError) and text.startswith("Bad Request")):
    cause, hint = "request", "the store refused the request; check the path and the bucket"
  elif isinstance(error, (ConnectionError, OSError)) or type(error).__module__.startswith(("aiohttp", "requests")):
    cause, hint = "network", "the connection to the store failed beyond the client's retries: retry"
  else:
    return None
  shown = f"HTTP {code}: {text}" if code else f"{type(error).__name__}: {text}"
  return errors.StorageError(
      f"{path}: cannot {operation} it ({shown}): {hint}.", path=path, operation=operation, cause=cause)
