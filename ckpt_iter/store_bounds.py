"""How long ckpt_iter waits on an object store: `StoreBounds`, `set_object_store_bounds`.

Public (`ckpt_iter.StoreBounds`, `ckpt_iter.set_object_store_bounds`); the
store client (`_object_store`) reads the bounds in force with
`object_store_bounds` at each call.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckpt_iter import errors


@dataclasses.dataclass(frozen=True)
class StoreBounds:
  """How long ckpt_iter waits on an object store, in seconds.

  Attributes:
    request_seconds: one HTTP request, from connecting to the last byte of
      its answer (the client retries a request that runs past it).
    operation_seconds: one operation (a read, a write, a listing), the
      client's own retries included; past it the attempt fails with
      `StorageTimeoutError`.
    retries: how many times ckpt_iter tries a whole operation again after an
      attempt failed for a cause that may pass (a timeout, a server error,
      throttling, a broken connection, a download whose checksum is not the
      object's), each within `operation_seconds`. 0: one attempt. A missing
      object, a permission or a refused request is never tried again.
    backoff_seconds: the wait before the first try again, doubled before
      each next one (at most 60 s a wait).
  """

  request_seconds: float = 60.0
  operation_seconds: float = 300.0
  retries: int = 2
  backoff_seconds: float = 1.0


# Where a process (e.g. a worker a launcher starts) takes its bounds from:
# "request=SECONDS,operation=SECONDS,retries=N,backoff=SECONDS", each part optional.
BOUNDS_ENV = "CKPT_ITER_OBJECT_STORE_BOUNDS"
_ENV_NAMES = {"request": "request_seconds", "operation": "operation_seconds", "retries": "retries",
              "backoff": "backoff_seconds"}


def _positive_seconds(name: str, value: Any, where: str) -> float:
  try:
    seconds = float(value)
  except (TypeError, ValueError):
    seconds = float("nan")
  if not (seconds > 0 and seconds != float("inf")):
    raise errors.InvalidArgumentError(
        f"{where}: {name} is {value!r}; it must be a positive number of seconds.")
  return seconds


def _retry_count(value: Any, where: str) -> int:
  try:
    count = int(str(value).strip())
  except (TypeError, ValueError):
    count = -1
  if isinstance(value, bool) or not 0 <= count <= 100 or (isinstance(value, float) and value != count):
    raise errors.InvalidArgumentError(f"{where}: retries is {value!r}; it must be an integer from 0 to 100.")
  return count


def _bounds_from_env() -> StoreBounds:
  text = os.environ.get(BOUNDS_ENV, "").strip()
  fields: dict[str, Any] = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    name = _ENV_NAMES.get(name.strip())
    if name is None:
      raise errors.InvalidArgumentError(
          f"{BOUNDS_ENV}={text!r}: expected 'request=SECONDS,operation=SECONDS,retries=N,backoff=SECONDS', "
          f"got part {part!r}.")
    fields[name] = _retry_count(value, BOUNDS_ENV) if name == "retries" else _positive_seconds(name, value, BOUNDS_ENV)
  return StoreBounds(**fields)


_bounds = _bounds_from_env()


def set_object_store_bounds(
    *, request_seconds: float | None = None, operation_seconds: float | None = None, retries: int | None = None,
    backoff_seconds: float | None = None,
) -> StoreBounds:
  """Sets how long ckpt_iter waits on an object store (gs://); returns the bounds now in force.

  Every object-store call ckpt_iter makes (its data items, the CLI, gs://
  sources) is bounded: a request by `request_seconds` (default 60), an
  operation with its retries by `operation_seconds` (default 300). A call
  past its bound raises `ckpt_iter.StorageTimeoutError` (an OSError) naming
  the object and the operation: a stalled connection ends in an error, never
  a hang. An attempt that failed for a cause that may pass is tried again
  `retries` times (default 2), after `backoff_seconds` (default 1), doubled
  each time; each attempt has its own operation bound. The defaults come
  from the environment variable CKPT_ITER_OBJECT_STORE_BOUNDS
  ("request=60,operation=300,retries=2,backoff=1") when set.
  """
  global _bounds
  changes = {}
  if request_seconds is not None:
    changes["request_seconds"] = _positive_seconds("request_seconds", request_seconds, "set_object_store_bounds")
  if operation_seconds is not None:
    changes["operation_seconds"] = _positive_seconds(
        "operation_seconds", operation_seconds, "set_object_store_bounds")
  if retries is not None:
    changes["retries"] = _retry_count(retries, "set_object_store_bounds")
  if backoff_seconds is not None:
    changes["backoff_seconds"] = _positive_seconds("backoff_seconds", backoff_seconds, "set_object_store_bounds")
  _bounds = dataclasses.replace(_bounds, **changes)
  return _bounds


def object_store_bounds() -> StoreBounds:
  """The bounds in force (`set_object_store_bounds`)."""
  return _bounds
