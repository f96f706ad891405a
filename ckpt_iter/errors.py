"""Errors raised by ckpt_iter.

Every error says what is wrong, shows the offending value, what was expected and
what to do about it. All of them derive from `CkptIterError`, so a caller can
catch one class to handle every expected problem with a data checkpoint.
"""

from __future__ import annotations

import heapq
import re
from typing import Any, Mapping

# How much of one value a message shows; longer ones are cut, their length shown.
SHOWN_VALUE_CHARS = 200
# A ConfigDriftError names this many differing fields (the first by name), each value cut to
# SHOWN_DRIFT_VALUE_CHARS, and counts the rest: its message stays a few KB whatever the count.
SHOWN_DIFFERENCES = 8
SHOWN_DRIFT_VALUE_CHARS = 80


def shown_value(value: Any, limit: int = SHOWN_VALUE_CHARS) -> str:
  """repr(value) for a message, cut to about `limit` characters with the full length said.

  A string is cut before repr, so a 60 MB field costs no 60 MB repr.
  """
  if isinstance(value, str) and len(value) > limit:
    return f"{value[:limit]!r}... ({len(value):,} chars)"
  try:
    text = repr(value)
  except RecursionError:  # a hostile value nested thousands deep
    return f"<{type(value).__name__} nested too deeply to show>"
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} chars)"


def shown_name(name: str) -> str:
  """A field's name as a message shows it: as it is, unless it is long (then cut, like a value)."""
  return name if isinstance(name, str) and len(name) <= SHOWN_VALUE_CHARS else shown_value(name)


def index_command(directory: str) -> str:
  """The command that indexes the files of `directory` again (all of them: an index is per directory), as
  the refusals of a stale or missing corpus index name it."""
  return f"ckpt-iter index {directory.rstrip('/')}"


class CkptIterError(Exception):
  """Base class of every error ckpt_iter raises on purpose."""

  def with_origin(self, origin: str) -> "CkptIterError":
    """Returns a copy of this error whose message starts with `origin`."""
    clone = self.__class__.__new__(self.__class__)
    clone.__dict__.update(self.__dict__)
    Exception.__init__(clone, f"{origin}: {self}")
    return clone


class InvalidStateError(CkptIterError, ValueError):
  """A state value or file is malformed, truncated or unreadable."""


class ItemNotFoundError(InvalidStateError):
  """An item directory holds no data state file at all (e.g. a step written without one)."""


class PendingTypeError(InvalidStateError):
  """A pending item's type has fields here that it had not where it was written, or lacks some.

  Not corruption: the item was written with another version of the library
  that defines its type (e.g. another Tunix). Fields only one side has are
  accepted when they hold their defaults (`_codec.decode_pytree`); this is
  raised for the rest.
  """


class StateVersionError(CkptIterError):
  """A state was written in a format version this release cannot read."""


class ConfigDriftError(CkptIterError):
  """A state was written by a pipeline whose defining fields differ.

  The message names the first `SHOWN_DIFFERENCES` fields (by name) with both
  values, each cut to `SHOWN_DRIFT_VALUE_CHARS`, and counts the rest: a big
  pipeline's graph can differ in 200,000 fields, which named in full made a
  14 MB message. Programs read them all from `differences`.

  Attributes:
    differences: field name -> (value in the checkpoint, value in this run),
      every differing field.
    changed_files: where the source's files differ, those written after the
      checkpoint was (paths), as far as their store says when a file was
      written (GCS, local disk); also named in the message.
  """

  def __init__(self, differences: Mapping[str, tuple[Any, Any]], origin: str = "the state", *,
               way: str | None = None):
    """`way`: the way through, where rebuilding or `allow_drift` is not one (it replaces that advice)."""
    self.differences = dict(differences)
    self.changed_files: list[str] = []
    self.way = way
    shown = heapq.nsmallest(SHOWN_DIFFERENCES, self.differences.items(), key=lambda item: item[0])
    parts = [
        f"{shown_name(name)}={shown_value(saved, SHOWN_DRIFT_VALUE_CHARS)} there, "
        f"{shown_name(name)}={shown_value(current, SHOWN_DRIFT_VALUE_CHARS)} here"
        for name, (saved, current) in shown
    ]
    names = ", ".join(shown_value(name) for name, _ in shown)
    hidden = len(self.differences) - len(shown)
    if way is not None:
      more = f"; and {hidden:,} more (in the error's `differences`)" if hidden else ""
      super().__init__(f"{origin} was written by a different pipeline: {'; '.join(parts)}{more}. {way}")
      return
    if not hidden:
      super().__init__(f"{origin} was written by a different pipeline: {'; '.join(parts)}. "
                       f"{_way_back(shown)}, or pass allow_drift={{{names}}} to accept the change"
                       f"{_ACCEPTED_DIGEST if any(is_digest_field(n) for n, _ in shown) else ''}.")
      return
    super().__init__(
        f"{origin} was written by a different pipeline: {len(self.differences):,} fields differ, the "
        f"first {len(shown)} by name: {'; '.join(parts)}; and {hidden:,} more (every one, with both "
        "values, is in the error's `differences`). Rebuild the pipeline with the checkpoint's values, "
        "or accept the changes you made on purpose: allow_drift=set(error.differences) accepts all "
        f"{len(self.differences):,} (from the caught error), allow_drift={{{names}}} the {len(shown)} shown."
    )


# A field whose value is a digest of what the pipeline reads or runs (a source's records, a function's code):
# a user sets it back by restoring the data or the code, never by passing the value.
_DIGEST_FIELD = re.compile(r"(?:^|[.\]])(?:source_digest|digest|fn_code|transform_code|code)(?:\[[^\]]*\])?$")
_ACCEPTED_DIGEST = (" (the run continues at its saved position and reads what is there now; what was read "
                    "before it is not read again)")


def is_digest_field(name: Any) -> bool:
  """Whether `name` is a fingerprint field holding a digest of records or code rather than a setting."""
  return isinstance(name, str) and _DIGEST_FIELD.search(name) is not None


def _way_back(shown: list[tuple[str, tuple[Any, Any]]]) -> str:
  """How to build the checkpoint's pipeline again: the settings to pass back, and for a digest what to
  restore (no one can pass a digest to a constructor)."""
  # A source's files or length: no argument sets them back; what the run read must be put back. Their digest
  # says the same thing then.
  data = [name for name, (saved, _) in shown if _is_files(name, saved) or _SOURCE_LENGTH.match(str(name))]
  if data:
    data += [name for name, _ in shown if str(name).startswith("source_digest") and name not in data]
  settings = [(name, saved) for name, (saved, _) in shown if not is_digest_field(name) and name not in data]
  digests = [name for name, _ in shown if is_digest_field(name) and name not in data]
  ways = []
  if settings:
    ways.append("Rebuild the pipeline with " + ", ".join(
        f"{shown_name(name)}={shown_value(saved, SHOWN_DRIFT_VALUE_CHARS)}" for name, saved in settings))
  if data:
    ways.append(f"{'restore' if ways else 'Restore'} the data the run read as it was "
                f"({', '.join(map(shown_name, sorted(data)))}: its files or records, which changed)")
  if digests:
    ways.append(f"{'restore' if ways else 'Restore'} the records or code the run was saved with "
                f"({', '.join(map(shown_name, digests))}: a digest of what the pipeline reads or runs, "
                "which changed)")
  return "; ".join(ways)


# A file source's description (`sources._describe_files`): kind[name:size,...] or kind[N files a..b sha256:d].
_SOURCE_LENGTH = re.compile(r"^source_length(?:\[[^\]]*\])?$")
_FILES_DESCRIPTION = re.compile(r"^(?:jsonl|parquet|array_record)\[.*\]$")


def _is_files(name: str, saved: Any) -> bool:
  """Whether field `name` describes a file source's files: passing the description back builds nothing."""
  return (isinstance(name, str) and re.match(r"^source(?:\[[^\]]*\])?$", name) is not None
          and isinstance(saved, str) and _FILES_DESCRIPTION.match(saved) is not None)


class ContentDriftError(ConfigDriftError):
  """The pipeline is defined as before, but the element before the saved position changed.

  Attributes:
    differences: {"content.<field>": (digest in the checkpoint, digest now)}.
    index: the index of the element produced again.
    recorded_at: the index of an element near it that is the one the checkpoint saw, when one is: then
      the saved position may be what changed (edited or damaged), not the data.
  """

  def __init__(self, field: str, saved: str, current: str, *, index: int, origin: str = "the state",
               recorded_at: int | None = None):
    self.differences = {f"content.{field}": (saved, current)}
    self.index, self.recorded_at = index, recorded_at
    what = (f"{origin}: content: the element before the saved position (index {index}) is not "
            f"the one the checkpoint saw: field {shown_value(field)} has digest {saved} there, {current} here.")
    if recorded_at is not None:
      CkptIterError.__init__(
          self,
          f"{what} The one it saw is element {recorded_at}, {abs(recorded_at - index)} "
          f"{'after' if recorded_at > index else 'before'} it: field 'position' may be what disagrees (edited "
          "or damaged), the data as it was. If the data did not change, restore an earlier checkpoint: an "
          "allow_drift here would train from the wrong record. If it did change (a data file, a map "
          f"function, a library), continue with the new output: {content_way_through(field)}.")
      return
    CkptIterError.__init__(
        self,
        f"{what} The pipeline is defined as before, but what it produces changed (a vocabulary or data "
        "file, a record, a map function or a library), or field 'position' was edited. Resume with the data "
        f"the run was saved with, or continue with the new output: {content_way_through(field)}.",
    )


def content_way_through(field: str) -> str:
  """How a restore continues past a content check on `field` (the new output accepted)."""
  return (f"pass allow_drift={{{shown_value('content.' + field)}}} to this restore, or check_content=False to "
          "the iterator")


class ProcessCountError(CkptIterError):
  """A checkpoint was written by another number of processes.

  `saved_count` and `process_count` say which, for callers that word their
  own advice (a Tunix learner cannot take `elastic=True`).
  """

  def __init__(self, message: str, *, saved_count: int, process_count: int):
    super().__init__(message)
    self.saved_count = saved_count
    self.process_count = process_count


class LegacyCheckpointError(CkptIterError):
  """A Tunix checkpoint holds no ckpt_iter data state (written by stock Tunix)."""


class InvalidArgumentError(CkptIterError, ValueError):
  """An argument to a ckpt_iter function is invalid."""


class UnsupportedConfigError(CkptIterError, ValueError):
  """A configuration that cannot be resumed exactly, refused up front."""


class MissingPackageError(CkptIterError, ImportError):
  """An optional package a path or a file needs is not installed; the message gives the install line."""


class StorageError(CkptIterError, OSError):
  """An object-store operation failed: names the object, the operation and the cause.

  Raised for every error of the store itself (permission, throttling, a
  server error that outlasted the client's retries, a refused request, a
  broken connection), never for a missing object, which stays
  `FileNotFoundError`. `cause` is one of "permission", "throttled",
  "server", "request", "network", "timeout", "corrupt" (bytes whose
  checksum is not the object's, after the retries) and, for the local shard
  cache, "no_space" and "cache" (its directory cannot be written).
  """

  def __init__(self, message: str, *, path: str, operation: str, cause: str):
    super().__init__(message)
    self.path = path
    self.operation = operation
    self.cause = cause

  def __str__(self) -> str:
    return self.args[0] if self.args else ""


class StorageTimeoutError(StorageError, TimeoutError):
  """An object-store operation ran past its bound (`ckpt_iter.set_object_store_bounds`)."""

