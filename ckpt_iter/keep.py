"""Which checkpoint steps to keep: Orbax's latest N, and every step a run resumed from.

`ckpt-iter audit` proves a resume by comparing the state the resume recorded
with the state its step holds, so it needs that step. Orbax's `max_to_keep`
deletes it a few saves later, and the audit of a root kept that way says
"not proven" (exit 3). `KeepResumedSteps` is an Orbax preservation policy
(`CheckpointManagerOptions(preservation_policy=...)`) that keeps what
`max_to_keep` keeps plus every step a kept step's data state records a
resume from (its `lineage`, which `_item` extends at each restore): a few more steps, one per
preemption.

Orbax asks the policy when a save starts, before that step is written, so
the step this process resumed from is read from the first state it saves,
one save later; until a later step's state says otherwise, the newest step
that existed when this process first saved is kept too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from orbax.checkpoint import checkpoint_managers

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import _item as item_lib

_LOG = logging.getLogger("ckpt_iter")


class KeepResumedSteps(checkpoint_managers.PreservationPolicy):
  """Keeps the latest `max_to_keep` steps and every step a kept step's data state resumed from.

  Use it in place of `max_to_keep` (Orbax takes one or the other):

      options = ocp.CheckpointManagerOptions(
          preservation_policy=ckpt_iter.KeepResumedSteps(root, max_to_keep=3))
      manager = ocp.CheckpointManager(root, options=options)

  `directory` is the one the CheckpointManager writes its steps into (for a
  Tunix learner, the checkpoint root's `actor/`); `item` the item holding
  the data state. Each step's state header is read once (process 0's, a few
  KB), when the first save after it starts. A state records its run's last
  64 resumes, so a run preempted more often than that between two kept
  states keeps only the steps of its last 64. A step whose state cannot be
  read keeps nothing (a warning says which); a save never fails because of
  this policy.

  Attributes:
    directory: the CheckpointManager's directory.
    max_to_keep: how many of the latest steps are kept (None: all).
    item: the item name of the data state.
  """

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None, item: str = "data"):
    if max_to_keep is not None and not (type(max_to_keep) is int and max_to_keep >= 1):
      raise errors.InvalidArgumentError(
          f"KeepResumedSteps: max_to_keep must be a positive int or None (keep every step), got "
          f"{errors.shown_value(max_to_keep)}.")
    if not (isinstance(item, str) and item and "/" not in item):
      raise errors.InvalidArgumentError(
          f"KeepResumedSteps: item must be the name of the step's item holding the data state (e.g. 'data'), "
          f"got {errors.shown_value(item)}.")
    self.directory = os.fspath(directory)
    self.max_to_keep = max_to_keep
    self.item = item
    self._sources: dict[int, frozenset[int]] = {}  # step -> the steps its state resumed from
    self._newest_before: int | None = None  # the newest step when this process first saved

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
    """Which of `checkpoints` (Orbax's, oldest first; the last is the one being saved) to keep."""
    del context
    steps = [info.step for info in checkpoints]
    if not steps:
      return []
    keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep:])
    keep |= self.resumed_from(saving=steps[-1], earlier=steps[:-1])
    return [step in keep for step in steps]

  def resumed_from(self, *, saving: int, earlier: Sequence[int] = ()) -> set[int]:
    """The steps the kept steps' states resumed from (`saving` is not written yet, so not read)."""
    if self._newest_before is None:
      self._newest_before = max(earlier, default=-1)
    names = self._step_names()
    self._sources = {step: found for step, found in self._sources.items() if step in names}
    for step, name in names.items():
      if step != saving and step not in self._sources:
        self._sources[step] = self._read_sources(name)
    sources = set().union(*self._sources.values())
    if self._newest_before >= 0 and not any(step > self._newest_before for step in self._sources):
      sources.add(self._newest_before)  # what this process resumed from shows in its first state, not yet read
    return sources

  def _step_names(self) -> dict[int, str]:
    """Step -> directory name of the steps in the directory (Orbax's names; its temporary ones are not steps)."""
    try:
      entries = _storage.list_entries(self.directory)
    except (FileNotFoundError, NotADirectoryError):
      return {}
    names = {}
    for name, is_dir in entries:
      step = item_lib.step_of_directory_name(name) if is_dir else None
      if step is not None:
        names.setdefault(step, name)
    return names

  def _read_sources(self, name: str) -> frozenset[int]:
    """The steps the state in step directory `name` records resumes from (none without a state)."""
    item_dir = os.path.join(self.directory, name, self.item)
    try:
      files = _files.list_process_files(item_dir)
    except (FileNotFoundError, NotADirectoryError):
      return frozenset()  # no data item in this step (written without ckpt_iter)
    if not files:
      return frozenset()
    path = _files.header_path(item_dir, *files[0])
    try:
      value = codec.header_state(_files.read_header(path), origin=path)
    except (errors.CkptIterError, OSError) as e:
      _LOG.warning("ckpt_iter.KeepResumedSteps: %s: cannot read the steps it resumed from (%s); only "
                   "max_to_keep keeps them.", path, e)
      return frozenset()
    recent = value.lineage["recent"] if value.lineage else []
    return frozenset(entry["step"] for entry in recent if isinstance(entry.get("step"), int))
