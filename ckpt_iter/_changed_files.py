"""Which of a source's files were written after a checkpoint: what a refused restore names (issue 66 item 12).

A restore whose source changed is refused by its fingerprint (`source`,
`source_digest`), which describes many files by one digest: it cannot say
which file changed. The pipeline's build kept each file's identity
(`SourceIdentity.files`), and an identity says when its file was written (a
GCS object's generation, a local file's change time: `_storage.written_at`).
The files written after the newest file of the checkpoint's item are the ones
to name. Asked only once a restore is refused: one listing of the item.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from ckpt_iter import _storage
from ckpt_iter import errors

_SOURCE_FIELD = re.compile(r"^source(?:_length|_digest)?(?:\[.+\])?$")
_SHOWN = 8


def note(error: errors.ConfigDriftError, spec: Any, item: str) -> None:
  """Adds to `error` (a refused restore) the files of `spec`'s sources written after the item `item` (its
  directory, or a file in it) was: in its message, and as `error.changed_files` (paths; empty when none is
  known)."""
  error.changed_files = []
  if spec is None or not any(_SOURCE_FIELD.match(str(name)) for name in error.differences):
    return
  identities = [spec.source] if spec.source is not None else [identity for _, identity in spec.sources]
  files = [entry for identity in identities for entry in getattr(identity, "files", ())]
  if not files:
    return
  try:
    saved_at = _storage.newest_write(item if _storage.is_dir(item) else item.rstrip("/").rsplit("/", 1)[0])
  except (OSError, errors.CkptIterError):  # the refusal stands as it is
    return
  if saved_at is None:
    return
  written = [(path, when) for path, found in files if (when := _storage.written_at(found)) is not None]
  changed = [(path, when) for path, when in written if when > saved_at]
  if not changed:
    if written:  # changed between the build and the save, or put back with its old times: the newest is a lead
      path, when = max(written, key=lambda entry: entry[1])
      error.args = (f"{error} No file of the source was written after this checkpoint was ({_utc(saved_at)}); "
                    f"the one written last is {path} (written {_utc(when)}).",)
    return
  error.changed_files = [path for path, _ in changed]
  shown = ", ".join(f"{path} (written {_utc(when)})" for path, when in changed[:_SHOWN])
  more = f", and {len(changed) - _SHOWN:,} more (in the error's `changed_files`)" if len(changed) > _SHOWN else ""
  error.args = (f"{error} Written after this checkpoint was ({_utc(saved_at)}): {shown}{more}. Put back what "
                "they held when it was saved to resume exactly; or continue with what they hold now by the "
                "allow_drift above.",)


def _utc(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
