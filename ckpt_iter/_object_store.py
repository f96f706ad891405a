"""The object-store client: how every call to a store (gs://, s3://, ...) is made, and what its errors mean.

`_storage`'s object-store backend makes each of its calls through here: the
fsspec filesystem of a URL (`filesystem`; gcsfs for gs://, each request
bounded), the operation bound (`StoreBounds`, `set_object_store_bounds`,
`bounded`), `guarded`, through which every store call, store file
(`StoreFile`) and streamed upload (`Spool`) reaches `translate`: the one place
a store's error becomes ckpt_iter's (and `replaced_error`, its refusal of a
pinned object gone, which `_storage` gives a local file replaced too).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from ckpt_iter import errors

# What to install for a scheme whose fsspec implementation is missing.
_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs", "hf": "huggingface_hub"}
_GCS_SCHEMES = ("gs", "gcs")


# ---------------------------------------------------------------------------
# How long an object store may take.


@dataclasses.dataclass(frozen=True)
class StoreBounds:
  """How long ckpt_iter waits on an object store, in seconds.

  Attributes:
    request_seconds: one HTTP request, from connecting to the last byte of
      its answer (the client retries a request that runs past it).
    operation_seconds: one operation (a read, a write, a listing), retries
      included; past it the call raises `StorageTimeoutError`.
  """

  request_seconds: float = 60.0
  operation_seconds: float = 300.0


# Where a process (e.g. a worker a launcher starts) takes its bounds from:
# "request=SECONDS,operation=SECONDS", either part optional.
BOUNDS_ENV = "CKPT_ITER_OBJECT_STORE_BOUNDS"


def _positive_seconds(name: str, value: Any, where: str) -> float:
  try:
    seconds = float(value)
  except (TypeError, ValueError):
    seconds = float("nan")
  if not (seconds > 0 and seconds != float("inf")):
    raise errors.InvalidArgumentError(
        f"{where}: {name} is {value!r}; it must be a positive number of seconds.")
  return seconds


def _bounds_from_env() -> StoreBounds:
  text = os.environ.get(BOUNDS_ENV, "").strip()
  fields: dict[str, float] = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    name = {"request": "request_seconds", "operation": "operation_seconds"}.get(name.strip())
    if name is None:
      raise errors.InvalidArgumentError(
          f"{BOUNDS_ENV}={text!r}: expected 'request=SECONDS,operation=SECONDS', got part {part!r}.")
    fields[name] = _positive_seconds(name, value, BOUNDS_ENV)
  return StoreBounds(**fields)


_bounds = _bounds_from_env()


def set_object_store_bounds(
    *, request_seconds: float | None = None, operation_seconds: float | None = None
) -> StoreBounds:
  """Sets how long ckpt_iter waits on an object store (gs://); returns the bounds now in force.

  Every object-store call ckpt_iter makes (its data items, the CLI, gs://
  sources) is bounded: a request by `request_seconds` (default 60), an
  operation with its retries by `operation_seconds` (default 300). A call
  past its bound raises `ckpt_iter.StorageTimeoutError` (an OSError) naming
  the object and the operation: a stalled connection ends in an error, never
  a hang. The defaults come from the environment variable
  CKPT_ITER_OBJECT_STORE_BOUNDS ("request=60,operation=300") when set.
  """
  global _bounds
  changes = {}
  if request_seconds is not None:
    changes["request_seconds"] = _positive_seconds("request_seconds", request_seconds, "set_object_store_bounds")
  if operation_seconds is not None:
    changes["operation_seconds"] = _positive_seconds(
        "operation_seconds", operation_seconds, "set_object_store_bounds")
  _bounds = dataclasses.replace(_bounds, **changes)
  return _bounds


def object_store_bounds() -> StoreBounds:
  """The bounds in force (`set_object_store_bounds`)."""
  return _bounds


def replaced_error(path: str, evidence: str, kind: str) -> errors.InvalidStateError:
  """The refusal of a file (`kind` "file" or "object") replaced since a reader pinned it (both backends')."""
  return errors.InvalidStateError(
      f"{path}: replaced or rewritten since this source indexed it ({evidence}); its records would "
      f"mix two versions. Build the source again (make_dataset) to read the new {kind}.")


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
  scheme = url.split("://", 1)[0]
  try:
    import fsspec  # pylint: disable=g-import-not-at-top

    options = {"requests_timeout": _bounds.request_seconds} if scheme in _GCS_SCHEMES else {}
    if versioned and scheme in _GCS_SCHEMES:
      options["version_aware"] = True
    return fsspec.core.url_to_fs(url, **options)
  except ImportError as e:
    package = _PACKAGES.get(scheme, f"the fsspec implementation of {scheme}://")
    raise ImportError(
        f"{url}: reading or writing {scheme}:// needs {package} ({e}). Install it with: "
        f"pip install {package}" + (" (or ckpt_iter[gcs])" if package == "gcsfs" else "")
    ) from None


def file_bound(fs: Any) -> dict[str, Any]:
  """What bounds each request of a gcsfs file (its `timeout`); other stores take none."""
  return {"timeout": _bounds.operation_seconds} if type(fs).__module__.startswith("gcsfs") else {}


def bounded(fs: Any, path: str, operation: str, call: Any, *args: Any, reads_generation: str | None = None,
             **kwargs: Any) -> Any:
  """`call(*args, **kwargs)`, a method of `fs`, within the operation bound, through `guarded`.

  An asynchronous fsspec filesystem (gcsfs) runs each call on its own event
  loop: given `timeout`, the call is cancelled there when the bound passes.
  `reads_generation`: the one the call reads (a missing object is then a replaced one).
  """
  from fsspec import asyn  # pylint: disable=g-import-not-at-top

  if isinstance(fs, asyn.AsyncFileSystem):
    kwargs["timeout"] = _bounds.operation_seconds
  return guarded((path, operation, reads_generation), call, *args, **kwargs)


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
    return replaced_error(path, f"generation {generation} is gone", "object") if generation else None
  if isinstance(error, errors.StorageError):
    return error
  if isinstance(error, (fsspec_exceptions.FSTimeoutError, asyncio.TimeoutError, TimeoutError)):
    return errors.StorageTimeoutError(
        f"{path}: {operation} did not finish within its bound ({_bounds.operation_seconds:g} s an "
        f"operation, {_bounds.request_seconds:g} s a request): the object store stalled or cannot be "
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
