"""`ckpt-iter audit`: prove from the saved data states that a run resumed exactly.

Reads each kept step's data state header (small reads; no array, no model)
and checks the chain step by step, for each process:
  * a state whose lineage records new resumes (its `lineage` field): each
    resume restored exactly the state its step saved (the digest recorded at
    the restore equals the digest of the state kept there), from the latest
    step saved before it, so no element is skipped or trained twice;
  * a state with no new resume: the same run as the step before (the same
    lineage and run identity: the step the run first saved at), at a
    position no earlier than that step's, and not the very state that step
    holds unless both say they were saved where they are stored;
  * the resume records a state carries from before the step before are that
    step's own (a running digest covers only the new ones, and `which` and
    `order` follow each record's step): one that differs is a break, judged
    against the state the step it names holds;
  * a state was saved at the step it is stored in (its `saved_step`; a Tunix
    learner's `train_steps` counter);
  * a state with no new resume has the fingerprint of the step before: a
    pipeline that changes without a resume is another job in the root;
  * a RepeatIterator's state consumed each produced item exactly
    num_repeats times (yielded = num_repeats x produced - pending).
One bad item is one break: each state is compared with the one before it,
and when that one was broken and this one continues the last sound state,
with that one instead (the broken one was an item between them). Each resume
is judged once per process and counted once: a resume of a job of several
processes is one resume, proven when each of its processes proved it; from a
resume by another process count on, a process continues process 0's chain.
A step without a data state (written by stock Tunix, or without ckpt_iter)
cannot be proven. Resumes recorded before the earliest kept step are outside
what the root can prove and are counted, not judged.

The verdict never claims more than was proven: `ok` (an unbroken chain)
only when no check failed and every resume the kept states record was
proven; `unproven` when nothing failed but some resume could not be judged
(recorded before the earliest kept step, from a step not kept, or a step
without a data state); `nothing` when the kept steps hold no data state
at all; `broken` when a check failed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ckpt_iter import _drift
from ckpt_iter import _files
from ckpt_iter import _codec as codec
from ckpt_iter import _storage
from ckpt_iter import _records
from ckpt_iter import _urls
from ckpt_iter import datamap
from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import state as state_lib
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter import skips as skips_lib

OK, BROKEN, UNPROVABLE = "ok", "broken", "unprovable"
# The report's verdicts beyond a finding's: nothing was left to prove, or some resume was not proven.
UNPROVEN, NOTHING = "unproven", "nothing"


@dataclasses.dataclass(frozen=True)
class Saved:
  """What the audit knows of one process's state at one step."""

  step: int
  process_index: int
  process_count: int
  kind: str
  digests: tuple[str, ...]  # the first is the current format's (`_item.header_resume_digests`)
  progress: int | None  # elements (data), items yielded (repeat), prompts (Tunix)
  lineage: Mapping[str, Any]
  counters: Mapping[str, int]
  fingerprint: Mapping[str, Any]  # every field, a learner's input's as `input.<name>`
  remaining: int  # pending items still to be yielded
  saved_step: int | None  # the step it was written in, when the writer recorded it
  run: int | None  # the step its run first saved at (`_item.run_of`), when recorded
  skips: skips_lib.Skips = skips_lib.NO_SKIPS  # the records its run skips (`skips_lib.Skips`)
  next_record: int | None = None  # its input's stream position, where the position counts stream records
  # A Tunix learner inside a full batch (micro-batches of it taken): the stream record after that batch,
  # before which a resume must not add skips (the learner continues that very batch).
  inside_until: int | None = None


@dataclasses.dataclass(frozen=True)
class Finding:
  """A verdict on one resume, or on one step's state."""

  verdict: str  # OK, BROKEN or UNPROVABLE
  step: int  # the step whose state the finding is about
  process_index: int
  message: str
  resumed_from: int | None = None  # for a resume: the step it restored
  # For a resume: which of its run's resumes it is (1 = the first), the same on every process.
  resume_number: int | None = None
  # For a resume: its record (the lineage entry) as text, what makes it one resume of this process.
  record: str | None = dataclasses.field(default=None, repr=False, compare=False)
  # For a resume into another pipeline: the fingerprint fields it accepted (`accepted_changes`).
  accepted: tuple[str, ...] = ()

  def line(self) -> str:
    what = f"resume from step {self.resumed_from}" if self.resumed_from is not None else f"step {self.step}"
    if self.resumed_from is not None:
      what += f" (the first step kept after it: {self.step})"
    return f"{self.verdict}: process {self.process_index}: {what}: {self.message}"


@dataclasses.dataclass
class Report:
  root: str
  item: str
  steps: tuple[int, ...]
  points: list[Saved] = dataclasses.field(default_factory=list)
  findings: list[Finding] = dataclasses.field(default_factory=list)
  resumes_before_window: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> count
  # Listed, then deleted while being read (a writer's retention): not kept, so not audited.
  removed: list[int] = dataclasses.field(default_factory=list)

  @property
  def resumes(self) -> list[Finding]:
    """The findings on resumes, one per process that saved after each."""
    return [f for f in self.findings if f.resumed_from is not None]

  def resume_counts(self) -> tuple[int, int]:
    """(resumes, proven exact): a resume of a job of several processes is one resume, proven when
    every process that saved after it proved it, and none accepted a change of pipeline."""
    verdicts: dict[tuple[Any, ...], set[str]] = {}
    for f in self.resumes:
      verdicts.setdefault((f.step, f.resumed_from, f.resume_number), set()).add(
          "changed" if f.accepted else f.verdict)
    return len(verdicts), sum(found == {OK} for found in verdicts.values())

  def resume_summary(self) -> str:
    """"N resume(s) (B before the earliest kept step), P proven exact, C into another pipeline": the audit's
    count in words, as its last line and its picture's title give it."""
    resumes, proven = self.resume_counts()
    before = sum(self.resumes_before_window.values())
    beyond = f" ({before} before the earliest kept step)" if before else ""
    changed = self.changed_resumes()
    into = f", {changed} into another pipeline (accepted changes named above)" if changed else ""
    return f"{resumes} resume(s){beyond}, {proven} proven exact{into}"

  def changed_resumes(self) -> int:
    """The resumes into another pipeline (an accepted `allow_drift` of the data)."""
    return len({(f.step, f.resumed_from, f.resume_number) for f in self.resumes if f.accepted})

  @property
  def verdict(self) -> str:
    """BROKEN, OK (every resume proven), UNPROVEN (some not) or NOTHING (no state to check)."""
    verdicts = {f.verdict for f in self.findings}
    if BROKEN in verdicts:
      return BROKEN
    if not self.points:
      return NOTHING
    if UNPROVABLE in verdicts or self.resumes_before_window:
      return UNPROVEN
    return OK


def audit(layout: inspection.Layout) -> Report:
  """Audits every kept step of `layout` (see the module docstring)."""
  report = Report(root=layout.root, item=layout.item, steps=layout.steps)
  by_step: dict[int, dict[int, Saved]] = {}
  unreadable: set[int] = set()
  for step in layout.steps:
    states = _read_step(layout, step, report, unreadable)
    if states is None:
      report.removed.append(step)
    else:
      by_step[step] = states
  report.steps = tuple(by_step)
  processes = sorted({p for states in by_step.values() for p in states}) or [0]
  for process_index in processes:
    latest: Saved | None = None  # the state before, whatever was found in it
    sound: Saved | None = None  # the last state in which no check failed
    judged: set[str] = set()  # this process's resume records already judged (`Finding.record`)
    for step in report.steps:
      saved = by_step[step].get(process_index)
      if saved is None:
        if not by_step[step]:  # the whole step has none (one finding per step, not per process)
          if process_index == processes[0] and step not in unreadable:  # a garbled one is broken, said once
            report.findings.append(Finding(
                UNPROVABLE, step, process_index,
                f"no data state in item {layout.item!r} (written by stock Tunix, or without ckpt_iter)",
            ))
        elif all(s.process_count > process_index for s in by_step[step].values()):
          report.findings.append(Finding(
              BROKEN, step, process_index,
              "no state of this process, though the step's other processes have one (an incomplete "
              "item: `ckpt-iter verify` says more)",
          ))
        continue
      report.points.append(saved)
      findings = _own_checks(saved)
      # A process that joins the run at a resume by another process count continues process 0's state.
      before = latest or _resized_origin(saved, by_step)
      if before is None:
        if saved.lineage["resumes"]:
          report.resumes_before_window[process_index] = saved.lineage["resumes"]
      else:
        chain = _chain_checks(before, saved, by_step, judged)
        if _broken(chain) and sound is not None and sound is not before:
          # The state before was broken. One bad item is one break: when this state continues
          # the last sound one, that state was a bad item between them, and this one is sound.
          again = _chain_checks(sound, saved, by_step, judged)
          if not _broken(again):
            chain = again
        findings += chain
      judged.update(f.record for f in findings if f.record is not None)
      report.findings.extend(findings)
      # The next state is compared with this one: a break in the run's history (a rollback, a
      # second job, a skip inside a started batch) is reported where it happened, once, and
      # the states the run saved after it continue it.
      latest = saved
      if not _broken(findings):
        sound = saved
  return report


def _read_step(
    layout: inspection.Layout, step: int, report: Report, unreadable: set[int]
) -> dict[int, Saved] | None:
  """Each process's state of `step`; None when the step was deleted while it was read.

  Unreadable states are reported broken, unless the step was deleted under the
  read (`inspection.removed_while_read`): then what the read ran into is no fault.
  """
  item_dir = layout.item_dir(step)
  try:
    names = _storage.list_names(item_dir)
  except (FileNotFoundError, NotADirectoryError):
    names = []
  result, findings = {}, []
  count_files: dict[str, Any] = {}  # the pod part the step's headers refer to: read once
  for index, count in _files.process_files_in(names):
    path = _files.header_path(item_dir, index, count)
    try:
      header = _files.read_header(path, count_files=count_files)
      result[index] = _saved(step, index, count, header, path)
    except (errors.CkptIterError, OSError) as e:
      message = str(e) if isinstance(e, errors.CkptIterError) else f"{path}: cannot read it ({e.strerror or e})"
      findings.append(Finding(BROKEN, step, index, f"unreadable state: {inspection.one_line(message)}"))
  if (findings or not result) and inspection.removed_while_read(layout, step, names):
    return None
  if findings:
    unreadable.add(step)
    report.findings.extend(findings)
  return result


def _saved(step: int, index: int, count: int, header: Any, origin: str) -> Saved:
  value = codec.header_state(header, origin=origin)
  inner, own = value.innermost, value.own_position
  input_fingerprint, input_position = inner.fingerprint, inner.position
  next_record = input_position.get(_records.NEXT_RECORD) if isinstance(input_position, Mapping) else None
  return Saved(
      skips=state_lib.input_stream_skips(value, origin=origin),  # a restore's refusal is an unreadable state
      next_record=next_record if state_lib.is_int(next_record) else None,
      inside_until=_inside_until(input_fingerprint, input_position, own, origin),
      step=step, process_index=index, process_count=count, kind=value.kind,
      digests=item_lib.header_resume_digests(header, origin=origin, value=value),
      progress=_progress(value, inner.position, own),
      lineage=value.lineage or item_lib.empty(),
      counters=value.counters,
      fingerprint=state_lib.flat_fingerprint(value),
      remaining=0 if value.pending is None else len(value.pending.schedule),
      saved_step=_saved_step(header, origin),
      run=item_lib.run_of(value.lineage),
  )


def _inside_until(fingerprint: Mapping[str, Any], position: Any, own: Mapping[str, Any], origin: str) -> int | None:
  """For a learner inside a full batch: the stream record after that batch (None otherwise, or unknown)."""
  if not (own.get("micro_batches_taken") or own.get("rows_taken")) or not isinstance(position, Mapping):
    return None
  try:
    stream = datamap.RecordStream(fingerprint, position, origin=origin)
    plan = stream.plan_at(stream.next_record)
    return plan.span(plan.index_of(stream.next_record))[1]
  except (errors.CkptIterError, TypeError):
    return None


def _saved_step(header: Mapping[str, Any], origin: str) -> int | None:
  step = header.get(_files.SAVED_STEP)
  if step is not None and not (state_lib.is_int(step) and step >= 0):
    raise errors.InvalidStateError(
        f"{origin}: field {_files.SAVED_STEP!r} is {state_lib.short_repr(step)}, expected a step number.")
  return step


def _progress(value: state_lib.IteratorState, position: Any, own: Mapping[str, Any]) -> int | None:
  """How far the state is into its stream, as one number (None when its position has none).

  `position`: its innermost state's position; `own`: its own position fields (as `_saved` read them).
  """
  if value.kind == "repeat":
    return value.counters.get("yielded")
  for name in ("stream_rows", "prompt_index"):  # Tunix RL, agentic: prompts consumed
    if state_lib.is_int(own.get(name)):
      return own[name]
  # make_dataset's records, a Grain index, or a stream's records read.
  for name in (_records.NEXT_RECORD, "next_index", state_lib.STREAM_RECORDS_READ):
    if state_lib.is_int(position.get(name)):
      return position[name]
  return None


def _own_checks(saved: Saved) -> list[Finding]:
  """What one state must satisfy by itself."""
  findings = []
  counters = saved.counters
  if saved.saved_step is not None and saved.saved_step != saved.step:
    findings.append(Finding(
        BROKEN, saved.step, saved.process_index,
        f"the data state was saved in step {saved.saved_step} but is stored in step {saved.step} "
        "(a data item copied from another step?)",
    ))
  elif saved.kind == "tunix" and "train_steps" in counters and counters["train_steps"] != saved.step:
    findings.append(Finding(
        BROKEN, saved.step, saved.process_index,
        f"the data state was taken at train step {counters['train_steps']} but is stored in step "
        f"{saved.step} (a data item copied from another step?)",
    ))
  if saved.kind == "repeat" and {"yielded", "produced"} <= set(counters):
    repeats = saved.fingerprint.get("num_repeats")
    if state_lib.is_int(repeats):
      expected = repeats * counters["produced"] - saved.remaining
      if counters["yielded"] != expected:
        findings.append(Finding(
            BROKEN, saved.step, saved.process_index,
            f"{counters['yielded']} items yielded, but {counters['produced']} produced x "
            f"num_repeats={repeats} - {saved.remaining} pending = {expected}: pending repeats "
            "were lost or repeated",
        ))
  return findings


def _broken(findings: list[Finding]) -> bool:
  return any(f.verdict == BROKEN for f in findings)


def _resized_origin(saved: Saved, by_step: Mapping[int, Mapping[int, Saved]]) -> Saved | None:
  """Process 0's kept state at the step `saved`'s run last resumed from by another process count.

  A resume by another process count hands every process process 0's lineage
  (`elastic.read_for_process`), so from there on a process's chain continues
  process 0's, not its own. None when no recorded resume changed the count,
  or that step's process 0 state is not kept.
  """
  recent = list(saved.lineage["recent"])
  for entry in reversed(recent):
    if entry.get("resized"):
      origin = by_step.get(entry.get("step"), {}).get(0)
      return origin if origin is not None and origin.step < saved.step else None
  return None


def _chain_checks(
    previous: Saved, saved: Saved, by_step: Mapping[int, Mapping[int, Saved]], judged: set[str] = frozenset(),
) -> list[Finding]:
  """What `saved` must satisfy given the state kept at the step before it.

  `judged`: this process's resume records judged already (`Finding.record`):
  a resume is judged, and counted, once.
  """
  before, after = previous.lineage, saved.lineage
  new = after["resumes"] - before["resumes"]
  where = (saved.step, saved.process_index)
  if new < 0 or (new == 0 and after["digest"] != before["digest"]):
    rollback = _rollback(previous, saved, by_step, judged)
    if rollback is not None:
      return [rollback]
  if new < 0:
    return [Finding(
        BROKEN, *where,
        f"its lineage records {after['resumes']} resumes, fewer than step {previous.step}'s "
        f"{before['resumes']}: it is an older state than step {previous.step}'s "
        "(a data item copied from an earlier step?)",
    )]
  if new == 0:
    if after["digest"] != before["digest"]:
      return [Finding(BROKEN, *where, f"another run than step {previous.step}'s (their lineages differ)")]
    edited = _edited_record(previous, saved, by_step, list(after["recent"]))
    if edited is not None:
      return [edited]
    changed = state_lib.differing_fields(previous.fingerprint, saved.fingerprint)
    if changed and saved.skips != previous.skips:
      return [_skips_finding_without_resume(previous, saved)]
    if changed:
      shown = ", ".join(f"{name}: {state_lib.short_repr(a, 24)} -> {state_lib.short_repr(b, 24)}"
                        for name, (a, b) in sorted(changed.items())[:3])
      return [Finding(
          BROKEN, *where,
          f"its pipeline differs from step {previous.step}'s ({shown}{', ...' if len(changed) > 3 else ''}) "
          "with no resume between them: another job writing into this root?",
      )]
    if saved.run != previous.run:
      behind = (f"; its position {saved.progress} is behind step {previous.step}'s {previous.progress}"
                if _forward(previous, saved, "") else "")
      return [Finding(
          BROKEN, *where,
          f"another run than step {previous.step}'s (this state's {_run_name(saved.run)}, step "
          f"{previous.step}'s {_run_name(previous.run)}) with no resume between them{behind}: a second "
          "job started into this root?",
      )]
    return _forward(previous, saved, "") or _repeated(previous, saved)
  recent = list(after["recent"])
  if new > len(recent):
    return [Finding(
        UNPROVABLE, *where,
        f"{new} resumes since step {previous.step}, more than the {len(recent)} a state records",
    )]
  first = len(recent) - new  # the index in `recent` of the first resume since step `previous.step`
  resized = [i for i in range(first, len(recent)) if recent[i].get("resized")]
  if resized:
    # From a resume by another process count on, this process continues process 0's chain.
    origin = by_step.get(recent[resized[-1]].get("step"), {}).get(0)
    if origin is not None and origin is not previous and origin.step < saved.step:
      return _chain_checks(origin, saved, by_step, judged)
  digest = before["digest"]
  for entry in recent[first:]:
    digest = item_lib.fold(digest, entry)
  if digest != after["digest"]:
    return [Finding(
        BROKEN, *where,
        f"its lineage does not continue step {previous.step}'s (the resumes recorded differ)",
    )]
  edited = _edited_record(previous, saved, by_step, recent[:first])
  if edited is not None:
    return [edited]
  number = after["resumes"] - new
  findings = []
  for offset, entry in enumerate(recent[first:], 1):
    finding = dataclasses.replace(_resume_finding(entry, previous, saved, by_step), resume_number=number + offset,
                                  record=f"{number + offset}:{_record_text(entry)}")
    findings.append(finding)
  if all(f.verdict == OK for f in findings):
    findings += _forward(previous, saved, " after the resume")
  findings = [f for f in findings if f.record not in judged]
  return findings + _skip_findings(previous, saved, recent[first:], by_step)


def _rollback(previous: Saved, saved: Saved, by_step: Mapping[int, Mapping[int, Saved]],
              judged: set[str]) -> Finding | None:
  """The break of a state whose run resumed from an earlier step than `previous` (its lineage continues
  that step's by its last resume), or None when its lineage does not say so, or that resume was judged
  already (a copy of an earlier item: its own check says so)."""
  recent = list(saved.lineage["recent"])
  if not recent:
    return None
  entry, number = recent[-1], saved.lineage["resumes"]
  step = entry.get("step")
  owner = 0 if entry.get("resized") else saved.process_index
  origin = by_step.get(step, {}).get(owner) if state_lib.is_int(step) else None
  if (origin is None or origin.step >= previous.step or entry.get("state") not in origin.digests
      or origin.lineage["resumes"] + 1 != number
      or item_lib.fold(origin.lineage["digest"], entry) != saved.lineage["digest"]
      or f"{number}:{_record_text(entry)}" in judged):
    return None
  return Finding(
      BROKEN, saved.step, saved.process_index,
      f"restored step {step} though step {previous.step} was already saved: what was trained after step {step} "
      "was trained again", resumed_from=step, resume_number=number, record=f"{number}:{_record_text(entry)}",
  )


def _record_text(entry: Mapping[str, Any]) -> str:
  return json.dumps(dict(entry), sort_keys=True, separators=(",", ":"), default=repr)


def _edited_record(
    previous: Saved, saved: Saved, by_step: Mapping[int, Mapping[int, Saved]], older: list[Mapping[str, Any]]
) -> Finding | None:
  """A resume record of `saved` from before `previous` that `previous` records otherwise (or None).

  The records `saved` carries from before `previous` must be `previous`'s own
  (a lineage's running digest covers only the resumes since, and `which` and
  `order` follow each record's step). The first that differs is judged
  against the step it names: the state it records restoring, against the
  state that step holds (`_item.header_resume_digests`).
  """
  mine = list(previous.lineage["recent"])[len(previous.lineage["recent"]) - len(older):] if older else []
  if len(mine) == len(older) and all(_record_text(a) == _record_text(b) for a, b in zip(older, mine)):
    return None
  where = (saved.step, saved.process_index)
  index = next((i for i, (a, b) in enumerate(zip(older, mine)) if _record_text(a) != _record_text(b)),
               min(len(older), len(mine)))
  number = saved.lineage["resumes"] - len(saved.lineage["recent"]) + index + 1
  if index >= len(older):
    return Finding(BROKEN, *where, f"its lineage records {len(older)} resume(s) before step {previous.step}'s "
                   f"last, step {previous.step}'s {len(mine)}, with no resume between them: an edited lineage?")
  entry = older[index]
  step = entry.get("step")
  # A resume by another process count, or a later one, took process 0's lineage.
  owner = 0 if any(e.get("resized") for e in older[index:]) or any(
      e.get("resized") for e in list(saved.lineage["recent"])[len(older):]) else saved.process_index
  kept = by_step.get(step, {}).get(owner) if state_lib.is_int(step) else None
  if kept is not None and entry.get("state") not in kept.digests:
    return Finding(
        BROKEN, *where,
        f"its resume record {number} names step {step}, but the state it records restoring (digest "
        f"{entry.get('state')}) is not the one step {step} holds ({kept.digests[0]}); step "
        f"{previous.step}'s record {number} is {_record_text(mine[index]) if index < len(mine) else 'absent'}: "
        "an edited lineage (`which` and `order` follow it)",
    )
  return Finding(
      BROKEN, *where,
      f"its resume records differ from step {previous.step}'s with no resume between them (record {number}: "
      f"{_record_text(entry)} here, {_record_text(mine[index]) if index < len(mine) else 'absent'} there): "
      "an edited lineage (`which` and `order` follow it)",
  )


def _skips_finding_without_resume(previous: Saved, saved: Saved) -> Finding:
  where = (saved.step, saved.process_index)
  if not saved.skips.covers(previous.skips):
    return Finding(BROKEN, *where, f"lost skips with no resume between it and step {previous.step}: step "
                   f"{previous.step} skips {previous.skips.describe()}, this state {saved.skips.describe()}")
  return Finding(BROKEN, *where, f"skips {saved.skips.added_to(previous.skips).describe()} appeared with no "
                 f"resume since step {previous.step} (skips are added only by a restore)")


def _skip_findings(previous: Saved, saved: Saved, entries: list[Mapping[str, Any]],
                   by_step: Mapping[int, Mapping[int, Saved]]) -> list[Finding]:
  """Skips across resumes: kept (a state that lost some is broken), and the added ones accounted for.

  An added stream range must start at or after the restored position: the
  records before it were read (trained) before the checkpoint, so a state
  claiming them skipped would not be the uninterrupted stream minus them.
  """
  where = (saved.step, saved.process_index)
  if not saved.skips.covers(previous.skips):
    return [Finding(BROKEN, *where, f"lost skips across the resume since step {previous.step}: step "
                    f"{previous.step} skips {previous.skips.describe()}, this state {saved.skips.describe()}: "
                    "records the run was told to skip may have been trained")]
  added = saved.skips.added_to(previous.skips)
  if not added:
    return []
  last = entries[-1] if entries else {}
  restored = by_step.get(last.get("step"), {}).get(0 if last.get("resized") else saved.process_index)
  start = None if restored is None else restored.next_record
  early = [(a, b) for a, b in added.records if start is not None and a < start]
  if early:
    return [Finding(BROKEN, *where, f"skips stream records {skips_lib.ranges_text(early[:1])}, before the restored "
                    f"position {start}: those records were read before the checkpoint")]
  inside = restored.inside_until if restored is not None else None
  partial = [(a, b) for a, b in added.records if inside is not None and a < inside]
  if partial:
    return [Finding(BROKEN, *where, f"skips stream records {skips_lib.ranges_text(partial[:1])}, inside the full "
                    f"batch {skips_lib.ranges_text([(start, inside)])} the learner had started at the restored step: "
                    "part of it was trained, so skipping in it changes the rest of that batch. Skip from its end "
                    "on, or restore a step at a full-batch boundary")]
  at = "" if start is None else f", all at or after the restored position {start}"
  return [Finding(OK, *where, f"skips added at the resume since step {previous.step}: {added.describe()}{at}; "
                  f"the run skips {saved.skips.describe()}")]


def _resume_finding(
    entry: Mapping[str, Any], previous: Saved, saved: Saved, by_step: Mapping[int, Mapping[int, Saved]]
) -> Finding:
  source_step = entry.get("step")
  where = (saved.step, saved.process_index)
  if source_step is None:
    return Finding(UNPROVABLE, *where, "restored from a path with no step number (or through set_state)",
                   resumed_from=None)
  if source_step < previous.step:
    return Finding(
        BROKEN, *where,
        f"restored step {source_step} though step {previous.step} was already saved: what was "
        f"trained after step {source_step} was trained again", resumed_from=source_step,
    )
  if source_step >= saved.step:
    return Finding(BROKEN, *where, f"restored step {source_step}, not earlier than the step it saved",
                   resumed_from=source_step)
  kept = by_step.get(source_step)
  if not kept:
    return Finding(UNPROVABLE, *where, f"step {source_step} is not kept: its saved state cannot be compared",
                   resumed_from=source_step)
  # Another process count (elastic): every process continues from process 0's global fields.
  origin = kept.get(0 if entry.get("resized") else saved.process_index)
  if origin is None:
    return Finding(UNPROVABLE, *where, f"step {source_step} has no state of process {saved.process_index}",
                   resumed_from=source_step)
  if entry.get("state") not in origin.digests:
    return Finding(
        BROKEN, *where,
        f"restored a state (digest {entry.get('state')}) that is not the one step {source_step} "
        f"holds ({origin.digests[0]})", resumed_from=source_step,
    )
  if origin.run is not None and saved.run != origin.run:
    return Finding(
        BROKEN, *where,
        f"restored step {source_step}'s state, but its {_run_name(saved.run)} is not step "
        f"{source_step}'s ({_run_name(origin.run)})", resumed_from=source_step,
    )
  at = "" if origin.progress is None else f", position {origin.progress}"
  pending = f", {origin.remaining} pending" if origin.remaining else ""
  accepted = accepted_changes(origin.fingerprint, saved.fingerprint)
  if accepted:
    shown = "; ".join(f"{name} {state_lib.short_repr(a, 24)} -> {state_lib.short_repr(b, 24)}"
                      for name, (a, b) in accepted[:4]) + ("; ..." if len(accepted) > 4 else "")
    return Finding(OK, *where, f"resumed at step {source_step}'s saved state{at}{pending}, into another pipeline: "
                   f"accepted changes {shown} (declared with allow_drift at that restore: what was read from "
                   "here on is the changed pipeline's, not the saved run's continuation)",
                   resumed_from=source_step, accepted=tuple(name for name, _ in accepted))
  return Finding(OK, *where, f"resumed exactly at step {source_step}'s saved state{at}{pending}",
                 resumed_from=source_step)


def accepted_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, tuple[Any, Any]]]:
  """The fingerprint fields a resume changed that are not a continuation of the same stream (by the
  restore's own rule, `_drift.continues_the_stream`): each an `allow_drift` a restore accepted (another
  seed, source, records or function), sorted by name."""
  changed = state_lib.differing_fields(before, after)
  return [(name, values) for name, values in sorted(changed.items())
          if not _drift.continues_the_stream(name, before, after)]


def _forward(previous: Saved, saved: Saved, context: str) -> list[Finding]:
  if previous.progress is not None and saved.progress is not None and saved.progress < previous.progress:
    return [Finding(
        BROKEN, saved.step, saved.process_index,
        f"position {saved.progress}{context}, behind step {previous.step}'s {previous.progress}: "
        "elements trained again, or a data item copied from an earlier step",
    )]
  return []


def _repeated(previous: Saved, saved: Saved) -> list[Finding]:
  """The very state of the step before, with no resume between: nothing was consumed, or the
  item was copied. Two states that each say they were saved where they are stored are not
  copies (a save with no data consumed since the last one)."""
  if saved.digests[0] != previous.digests[0]:
    return []
  if saved.saved_step is not None and saved.saved_step != saved.step:
    return []  # a copy, reported by its own check
  if saved.saved_step == saved.step and previous.saved_step == previous.step:
    return []
  return [Finding(
      BROKEN, saved.step, saved.process_index,
      f"the same state as step {previous.step} (position {saved.progress}) with no resume between: "
      f"step {previous.step}'s data item copied here, or a save with nothing consumed since",
  )]


def _run_name(run: int | None) -> str:
  return "run recorded no identity" if run is None else f"run first saved at step {run}"


def report_json(report: Report) -> dict[str, Any]:
  return {
      "checkpoint": report.root, "item": report.item, "steps": list(report.steps),
      "verdict": report.verdict,
      "resumes": report.resume_counts()[0], "proven_exact": report.resume_counts()[1],
      "into_another_pipeline": report.changed_resumes(),
      "resumes_before_kept_steps": report.resumes_before_window,
      "removed_while_reading": report.removed,
      "findings": [{k: v for k, v in dataclasses.asdict(f).items() if k != "record"} for f in report.findings],
      "points": [
          {"step": p.step, "process_index": p.process_index, "kind": p.kind, "progress": p.progress,
           "resumes": p.lineage["resumes"], "pending": p.remaining, "run": p.run,
           "skips": skips_lib.count(p.skips.records)}
          for p in report.points
      ],
  }


def report_lines(report: Report) -> list[str]:
  lines = [f"audit of {report.root}: item {report.item!r}, "
           f"steps {inspection.format_steps(report.steps) or 'none'}"]
  if report.removed:
    lines.append(f"  step(s) {inspection.format_steps(report.removed)}: removed while reading (deleted by the "
                 "writer's retention, e.g. Orbax's max_to_keep): not kept, not audited")
  for count in sorted(set(report.resumes_before_window.values())):
    lines.append(f"  {count} resume(s) before the earliest kept step: not provable from this root")
  for finding in report.findings:
    lines.append("  " + finding.line())
  resumes, proven = report.resume_counts()
  verdict = {
      OK: "unbroken chain",
      BROKEN: "broken chain",
      UNPROVEN: "not proven",
      NOTHING: "nothing to prove",
  }[report.verdict]
  before = sum(report.resumes_before_window.values())
  if report.verdict == UNPROVEN and (before or any(
      f.verdict == UNPROVABLE and f.resumed_from is not None for f in report.findings)):
    # The usual cause: max_to_keep deleted the steps the run resumed from.
    lines.append(f"  steps a resume came from are not kept: to keep them, {datamap.KEEP_RESUMED_STEPS} "
                 f"({_urls.doc_url('prove_your_run.md')})")
  lines.append(f"{verdict}: {len(report.points)} state(s), {report.resume_summary()}")
  return lines
