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
