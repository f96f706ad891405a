"""Stream-preserving pipeline changes: THE rule for "does this pipeline continue that stream?".

A restored state names the next unread element of the stream its pipeline
produced. A changed pipeline continues that stream exactly when the saved
stream's consumed part is, element for element, a prefix of the new
pipeline's stream (docs/guarantees.md, "Same stream"). `reconcile` decides
this from the two fingerprints and the saved position, and returns the
position to restore in the new pipeline together with the fields it accepts
and one log line per accepted change. It accepts exactly:

- a length change with the prefix unchanged: `num_epochs` of make_dataset or
  of a `repeat`, the `stop` of a slice or a range, a `[0:k]` slice added or
  removed (`ds[0:k]` then `ds`), provided every step after the changed node
  keeps prefixes (map, filter, batch, slice, ...; not shuffle or repeat);
- a batch-size change (make_dataset's `batch_size`, a hand-built `batch`
  followed only by per-batch maps): the position is translated to elements
  and back, and the first batch after the restore starts at the first unread
  element. MapDataset positions are batch indices, so the number of elements
  already consumed must be a multiple of the new batch size (within the epoch
  for make_dataset); otherwise the restore is refused and the error names the
  batch sizes that would fit.

Everything else is left to `state.check_fingerprint`, which refuses it naming
the field. Only states whose position is `{"next_index": n}` (MapDataset
pipelines, and `to_iter_dataset` on top of one) can change; a multiprocess or
other IterDataset position is refused on any change.

A fingerprint names how a pipeline is built, not what it yields: a changed
vocabulary file or record, or a library upgrade that changes a map function's
output, keeps it. So a state also records a digest of the element produced
last (the content record: `content_digest`, per leaf, taken from the element
already in memory; of a batch of `make_dataset` itself, its last row: `row_record`),
and a restore of a random-access pipeline produces that element (or row) again
(one element, O(1)) and compares (`iterator.DataIterator.check_restore`);
a mismatch names the first field that differs (`first_difference`). The
content record is the one answer to "is this the same element or batch"
(`content_difference`): for that content check, for a replayed plain iterable's
last batch (`replay.ReplayIterator`, whose fingerprint is only its type) and
for the prompts a Tunix RL learner trained last (`tunix/_input`). The digests
ckpt_iter 0.2.0 wrote there instead are read, never written (`legacy_batch_digest`,
`legacy_prompts_digest`).
"""

from __future__ import annotations

import dataclasses
import fractions
import hashlib
import logging
import math
import numbers
import re
import struct
import sys
import zlib
from collections.abc import Mapping
from typing import Any, Callable, Collection, Iterable

import numpy as np

from ckpt_iter import _lane_mixture
from ckpt_iter import _records
from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter import state as state_lib

LOGGER = logging.getLogger("ckpt_iter")

# Steps that keep a prefix a prefix: element i of their output depends only on
# elements of their input at indices that do not move when the input grows.
PREFIX_STABLE = frozenset({
    "MapMapDataset", "MapWithIndexMapDataset", "RandomMapMapDataset", "FilterMapDataset",
    "BatchMapDataset", "SliceMapDataset", "PrefetchIterDataset", "MapIterDataset",
})
# Steps that map one batch to one output on their own: a batch-size change
# below them keeps the element order.
ELEMENTWISE = frozenset({"MapMapDataset", "MapIterDataset", "PrefetchIterDataset"})
_LENGTH_PARAMS = {
    "RepeatMapDataset": "num_epochs", "SliceMapDataset": "stop", "RangeMapDataset": "stop",
}
_SPEC_BATCH = frozenset({"batch_size", "global_batch_size", "batches_per_epoch"})
_SPEC_LENGTH = frozenset({"num_epochs"})
_DERIVED = frozenset({"dataset_length", "pipeline"})
_NODE_FIELD = re.compile(r"^node\[(\d+)\]\.([^.]+)\.(.+)$")
_ABSENT = state_lib.ABSENT


@dataclasses.dataclass(frozen=True)
class Reconciled:
  """The outcome of `reconcile`.

  Attributes:
    position: the position to restore into the new pipeline.
    accepted: fingerprint fields that differ and are accepted as stream-preserving.
    changes: one human-readable line per accepted change, with where the stream resumes.
  """

  position: dict[str, Any]
  accepted: frozenset[str] = frozenset()
  changes: tuple[str, ...] = ()

  def log(self) -> None:
    for line in self.changes:
      LOGGER.info(line)


@dataclasses.dataclass
class _Node:
  kind: str
  params: dict[str, Any]
  field_index: int  # i of its node[i] fields


def reconcile(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    position: Mapping[str, Any],
    *,
    allow_drift: Collection[str] = (),
    origin: str = "the state",
    parent_length: Callable[[int], int | None] = lambda index: None,
) -> Reconciled:
  """Accepts the stream-preserving differences between two fingerprints.

  Args:
    saved: the fingerprint of the state.
    current: the fingerprint of the pipeline restored into.
    position: the state's position.
    allow_drift: fields the caller lets differ; they are not compared here.
    origin: what error messages name.
    parent_length: length of the input of the current pipeline's node[i] (for
      a batch-size change at the end of the stream), or None if unknown.

  Returns:
    The position to restore and the accepted fields. Differences it does not
    accept are left for `state.check_fingerprint` to refuse.

  Raises:
    ConfigDriftError: every difference is a stream change of an accepted kind,
      but at this position it would skip or repeat elements (the message says
      why and what would work).
  """
  unchanged = Reconciled(position=dict(position))
  if not saved:
    return unchanged
  if _records.NEXT_RECORD in position:
    return _reconcile_records(saved, current, position, allow_drift=allow_drift, origin=origin)
  if _records.LANES in position:
    return _reconcile_lanes(saved, current, position, allow_drift=allow_drift, origin=origin)
  _refuse_index_mixture_change(saved, current, origin)
  mixed = _iter_mixture_changes(saved, current, allow_drift, origin)
  if mixed.accepted:
    allow_drift = set(allow_drift) | mixed.accepted
    resumed = _reconcile_index(saved, current, position, allow_drift, origin, parent_length)
    return dataclasses.replace(resumed, accepted=resumed.accepted | mixed.accepted,
                               changes=mixed.changes + resumed.changes)
  return _reconcile_index(saved, current, position, allow_drift, origin, parent_length)


def _reconcile_index(
    saved: Mapping[str, Any], current: Mapping[str, Any], position: Mapping[str, Any],
    allow_drift: Collection[str], origin: str, parent_length: Callable[[int], int | None],
) -> Reconciled:
  """`reconcile` for positions that are Grain's own (a batch index, or an IterDataset's state)."""
  unchanged = Reconciled(position=dict(position))
  differing = set(state_lib.differing_fields(saved, current, allow_drift=allow_drift))
  next_index = position.get("next_index")
  if not differing or set(position) != {"next_index"} or not state_lib.is_int(next_index):
    return unchanged
  graph_fields = {n for n in differing if state_lib.is_graph_field(n)}
  other = differing - graph_fields - _DERIVED
  spec_fields = other & (_SPEC_BATCH | _SPEC_LENGTH)
  if other - spec_fields:
    return unchanged  # a change that is not a stream change: refused by name
  if spec_fields and "global_batch_size" not in saved:
    return unchanged
  plan = _Plan(saved, current, int(next_index), origin)
  if graph_fields and not plan.add_graph_changes(allow_drift, parent_length):
    return unchanged
  if spec_fields:
    plan.add_spec_changes(spec_fields)
  if not plan.changes or ("pipeline" in differing and not graph_fields):
    return unchanged  # e.g. only dataset_length differs: no known stream change explains it
  return plan.finish(accepted=frozenset(differing))


# ---------------------------------------------------------------------------
# make_dataset pipelines: positions that count stream records.

# A mixture source's own fields (its shard layout too: an added or removed source brings or takes it).
_SOURCE_FIELD = re.compile(r"^(?:source(?:_length|_digest)?|shuffle_shards)\[(.+)\]$")
_SHUFFLE_FIELDS = ("shuffle", "shuffle_window", "shuffle_shards", "shuffle_lanes", "shuffle_lane_rows")
_SHARDS_PREFIX = "shuffle_shards["
# Declared in allow_drift to change a mixture's weights / its set of sources.
WEIGHTS = "weights"
SOURCES = "sources"


def _reconcile_records(
    saved: Mapping[str, Any], current: Mapping[str, Any], position: Mapping[str, Any], *,
    allow_drift: Collection[str], origin: str,
) -> Reconciled:
  """The same-stream rule where the position counts stream records (make_dataset).

  Batches are cut from the record stream, so another batch size (or, with
  elastic, process count) never moves the position: the next batch starts at
  the saved record. More or fewer epochs keep the stream's prefix. A mixture
  whose weights or sources changed continues each source from its own next
  record under the new weights, when the change is declared (`WEIGHTS`,
  `SOURCES` in allow_drift): undeclared, it is refused naming what changed.
  Whatever allow_drift says, a changed mixture is never continued with the old
  ledger under new weights (that would skip and repeat records).
  """
  next_record, mixture = _records.checked_record_position(saved, position, origin=origin)
  differing = state_lib.differing_fields(saved, current, allow_drift=allow_drift)
  accepted: set[str] = {n for n in differing if n in _SPEC_BATCH or n == "dataset_length"}
  changes: list[str] = []
  shuffled = _shuffle_change(saved, current, next_record, mixture is not None, allow_drift, origin)
  if shuffled:
    accepted |= shuffled
    changes.append(f"the shuffle ({', '.join(sorted(shuffled))}) from epoch "
                   f"{next_record // int(saved['source_length'])} on")
  if accepted & _SPEC_BATCH:
    changes.append(
        f"batch_size {saved.get('batch_size')} -> {current.get('batch_size')} (global "
        f"{saved.get('global_batch_size')} -> {current.get('global_batch_size')})")
  if "num_epochs" in differing:
    accepted.add("num_epochs")
    changes.append(f"num_epochs {saved.get('num_epochs')} -> {current.get('num_epochs')}")
  result = {_records.NEXT_RECORD: next_record}
  current_shares = _records.shares_of(current)
  if mixture is not None and current_shares is not None:
    changed, fields, lines = _mixture_change(saved, current, mixture.shares, current_shares, allow_drift, origin)
    if changed:
      mixture = mixture.restarted(next_record, current_shares)
      accepted |= fields
      changes.extend(lines)
    result[_records.MIXTURE] = mixture.to_json()
  where = f"resuming at stream record {next_record}"
  lines = tuple(f"{origin}: accepted stream change: {c}; {where}." for c in changes)
  return Reconciled(position=result, accepted=frozenset(accepted), changes=lines)


def _is_shuffle_field(name: str) -> bool:
  return name in _SHUFFLE_FIELDS or name.startswith(_SHARDS_PREFIX)


# ---------------------------------------------------------------------------
# What continues the same stream: the one rule the restores above follow and `ckpt-iter audit` proves by.

# A Tunix RL learner's batch geometry: its input continues at the same prompt under other sizes
# (`tunix._session.DataSession._continuation`).
LEARNER_GEOMETRY = frozenset({
    "full_batch_size", "mini_batch_size", "train_micro_batch_size", "rollout_micro_batch_size",
    "compute_logps_micro_batch_size",
})
# The batch geometry and the process count (a make_dataset position counts stream records, which
# neither moves), the number of epochs (the stream's prefix is kept), the skips (audited as skips), a
# learner's batch sizes, and the shuffle, which a restore accepts only at an epoch's first record.
_SAME_STREAM_FIELDS = (_SPEC_BATCH | _SPEC_LENGTH | LEARNER_GEOMETRY
                       | {"dataset_length", "shard_index", "shard_count", "skips", *_SHUFFLE_FIELDS})
_WEIGHT_FIELD = re.compile(r"^weight\[(.+)\]$")


def continues_the_stream(name: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
  """Whether a restore that changed fingerprint field `name` (`before` -> `after`, flat fingerprints: a
  learner's input fields as `input.<name>`) continued the saved stream exactly, as docs/changing_the_run.md
  lists: the restore accepts no other change of these fields, so a state after one proves its resume.

  A mixture's weights and its sources added or removed (each source continues from its own next
  record), and a Grain IterDataset.mix reweighted (each source from its own next element) are such
  changes too; another seed, source, function or pipeline is not.
  """
  bare = name.removeprefix(f"{state_lib.INPUT}.")
  if bare in _SAME_STREAM_FIELDS or _is_shuffle_field(bare):
    return True
  names = {n.removeprefix(f"{state_lib.INPUT}.") for n in (*before, *after)}
  if any(_WEIGHT_FIELD.match(n) for n in names):  # make_dataset's mixture
    if bare == "source" or _WEIGHT_FIELD.match(bare):
      return True
    per_source = _SOURCE_FIELD.match(bare)
    if per_source and (name not in before or name not in after):  # the source added or removed
      return True
  node = _NODE_FIELD.match(bare)
  return bool(node and node.group(2) == "MixedIterDataset" and node.group(3) == "weights")


def _source_change(name: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
  """Whether a mixture source's shard layout differs because the source itself was added, removed or
  replaced (the sources rule decides those), not because its shuffle changed."""
  match = _SOURCE_FIELD.match(name)
  if match is None:
    return False
  source = match.group(1)
  return name not in saved or name not in current or any(
      not state_lib.same_field_value(saved.get(f"{field}[{source}]"), current.get(f"{field}[{source}]"))
      for field in ("source_length", "source_digest"))


def _shuffle_change(saved: Mapping[str, Any], current: Mapping[str, Any], next_record: int, mixture: bool,
                    allow_drift: Collection[str], origin: str) -> set[str]:
  """The shuffle fields a restore accepts (declared, at an epoch's first record); refuses the rest by name.

  An epoch's order is its shuffle's alone: records read under one order are
  not, in general, the first records of another, so a shuffle that changes
  inside an epoch would read some of them again and skip as many (whatever
  allow_drift says). At an epoch boundary nothing of the new epoch is read
  yet, and the change is exact from there on.
  """
  changed = {n: v for n, v in state_lib.differing_fields(saved, current).items()
              if _is_shuffle_field(n) and not _source_change(n, saved, current)}
  if not changed:
    return set()
  length = saved.get("source_length")
  at_boundary = not mixture and state_lib.is_int(length) and length > 0 and next_record % length == 0
  if at_boundary:
    return set(changed) & set(allow_drift)  # undeclared: check_fingerprint refuses it, recommending the declaration
  where = ("a mixture's sources are each inside an epoch of their own" if mixture or not state_lib.is_int(length)
           else f"record {next_record % length:,} of epoch {next_record // length} ({length:,} records an epoch)")
  lanes = ""
  if "shuffle_lane_rows" in changed and "shuffle_lanes" not in changed:
    lanes = (f"The shard lanes give each global batch global_batch_size / shard_lanes rows, so the global batch "
             f"({saved.get('global_batch_size')} -> {current.get('global_batch_size')}) cuts the epoch's lanes "
             f"anew: keep a global batch of {saved.get('global_batch_size')} until the epoch ends. ")
  raise errors.ConfigDriftError(changed, origin=origin, way=lanes + (
      f"The shuffle cannot change inside an epoch ({where}): the records read so far were chosen by the "
      "saved order, and the new order would read some of them again and skip as many, so no allow_drift "
      "continues it. Rebuild the pipeline with the saved shuffle" + (
          "." if mixture or not state_lib.is_int(length) else
          "; a restore whose position is an epoch's first record (a multiple of the source's length) accepts "
          f"the new shuffle with allow_drift={{{', '.join(repr(n) for n in sorted(changed))}}}.")))


def _reconcile_lanes(
    saved: Mapping[str, Any], current: Mapping[str, Any], position: Mapping[str, Any], *,
    allow_drift: Collection[str], origin: str,
) -> Reconciled:
  """The same-stream rule of a filtered or packed make_dataset (`_lanes`): lanes keep their rows.

  Another global batch only changes how many rows a batch takes from each
  lane; every lane continues at its own next row. A mixture's new weights or
  added sources take effect after the furthest chunk any lane reached
  (`_lane_mixture`), each source from its own count there.
  """
  position = dict(position)
  mixed, lines = _lanes_mixture_change(saved, current, position, allow_drift, origin)
  position.pop(_lane_mixture.EXTENT, None)
  differing = state_lib.differing_fields(saved, current, allow_drift=allow_drift)
  accepted = {n for n in differing if n in _SPEC_BATCH} | mixed
  changes = lines
  if accepted - mixed:
    changes.append(
        f"batch_size {saved.get('batch_size')} -> {current.get('batch_size')} (global "
        f"{saved.get('global_batch_size')} -> {current.get('global_batch_size')}): "
        f"{current.get('global_batch_size', 0) // max(current.get('num_lanes') or 1, 1)} rows per lane and batch")
  if "num_epochs" in differing:
    accepted.add("num_epochs")
    changes.append(f"num_epochs {saved.get('num_epochs')} -> {current.get('num_epochs')}")
  lines = tuple(f"{origin}: accepted stream change: {c}; every lane continues at its own next row." for c in changes)
  return Reconciled(position=position, accepted=frozenset(accepted), changes=lines)


def _lanes_mixture_change(saved: Mapping[str, Any], current: Mapping[str, Any], position: dict[str, Any],
                          allow_drift: Collection[str], origin: str) -> tuple[set[str], list[str]]:
  """(accepted fields, log lines) of a filtered or packed mixture's new weights or sources; sets the
  position's schedule (`_lane_mixture.MIXTURE`) to take them from the end of the furthest chunk any lane
  reached (`reached`: `_lane_mixture.EXTENT`, from every saved process's lanes).

  Raises:
    ConfigDriftError: a source removed (lanes behind still read chunks mixed with it), the change not
      declared (`_mixture_change`), or the furthest chunk unknown here (`lanes_reached_needed`: a restore
      from the checkpoint directory reads it from every saved process's lanes).
  """
  saved_shares, current_shares = _records.shares_of(saved), _records.shares_of(current)
  if saved_shares is None or current_shares is None:
    return set(), []
  removed = [n for n in saved_shares if n not in current_shares]
  if removed:
    fields = {f"weight[{n}]" for n in set(saved_shares) | set(current_shares)} | {"source"} | {
        name for name in set(saved) | set(current) if (m := _SOURCE_FIELD.match(name)) and m.group(1) in removed}
    differences = {f: (saved.get(f, _ABSENT), current.get(f, _ABSENT)) for f in sorted(fields)
                   if not state_lib.same_field_value(saved.get(f, _ABSENT), current.get(f, _ABSENT))}
    raise errors.ConfigDriftError(differences, origin=origin, way=(
        f"(The mixture's {_fractions_line(saved_shares, current_shares)}, there -> here.) A source of a filtered "
        f"or packed mixture (make_dataset with filter= or pack=) cannot be removed at a restart: its lanes "
        f"behind still read chunks mixed with {', '.join(removed)}. Keep it in the mixture (new weights and "
        "added sources are continued exactly), or rebuild the pipeline with the saved sources."))
  changed, fields, lines = _mixture_change(saved, current, saved_shares, current_shares, allow_drift, origin,
                                          takes_effect="after the furthest chunk any lane reached")
  if not changed:
    return set(), []
  chunk_size, num_lanes = saved.get("chunk_size"), saved.get("num_lanes")
  reached = position.pop(_lane_mixture.EXTENT, None)
  if reached is None and _lane_mixture.holds_every_lane(position, num_lanes):
    reached = _lane_mixture.extent([position], num_lanes=num_lanes, chunk_size=chunk_size)
  if not (state_lib.is_int(reached) and state_lib.is_int(chunk_size) and state_lib.is_int(num_lanes)):
    error = errors.ConfigDriftError({f: (saved.get(f, _ABSENT), current.get(f, _ABSENT)) for f in sorted(fields)},
                                    origin=origin, way=(
        f"(The mixture's {'; '.join(lines)}.) New weights or sources of a filtered or packed mixture take effect "
        "after the furthest chunk any lane reached, which this process's lanes alone do not tell: restore it "
        "from its checkpoint directory (Orbax with ckpt_iter's item, IteratorRestore, or MaxText's "
        "load_state_if_possible), which reads every saved process's lanes; where that is not how it is "
        "restored (a Tunix learner's input), rebuild the pipeline with the saved weights and sources."))
    error.lanes_reached_needed = True
    raise error
  schedule = _lane_mixture.of(saved_shares, position, origin=origin).changed(reached, current_shares, origin=origin)
  position[_lane_mixture.MIXTURE] = schedule.to_json()
  at = schedule.last.since_record
  return set(fields), [f"{line}, from stream record {at} on (after the furthest chunk any lane reached; the "
                       "chunks before it keep the shares they were mixed with)" for line in lines]


def _fraction(shares: Mapping[str, Any], name: str) -> str:
  """`name`'s part of the mix, as a user writes weights: 0.8, 0.333 (three significant digits), 0 if absent."""
  total = sum(shares.values())
  return f"{shares.get(name, 0) / total:.3g}" if total else "0"


def _fractions_line(saved_shares: Mapping[str, Any], current_shares: Mapping[str, Any]) -> str:
  """The weights as fractions of the mix, every source whose fraction changed named with both values: a
  reweight of one source changes every other one's part too (a 0.5 -> 0.8 makes b 0.5 -> 0.2), and integer
  shares (1 -> 4) do not say so."""
  names = list(saved_shares) + [n for n in current_shares if n not in saved_shares]
  moved = [n for n in names if _fraction(saved_shares, n) != _fraction(current_shares, n)]
  return "weights (fractions of the mix) " + ", ".join(
      f"{n} {_fraction(saved_shares, n)} -> {_fraction(current_shares, n)}" for n in moved)


def _mixture_change(
    saved: Mapping[str, Any], current: Mapping[str, Any], saved_shares: Mapping[str, Any],
    current_shares: Mapping[str, Any], allow_drift: Collection[str], origin: str,
    takes_effect: str = "from this restart",
) -> tuple[bool, set[str], list[str]]:
  """(changed, the fields it accepts, its log lines) of a mixture's weights and sources.

  Raises:
    ConfigDriftError: the change is not declared; the message says how to.
  """
  added = [n for n in current_shares if n not in saved_shares]
  removed = [n for n in saved_shares if n not in current_shares]
  reweighted = _reweighted(saved_shares, current_shares)
  if not (added or removed or reweighted):
    if list(saved_shares) == list(current_shares):
      return False, set(), []
    # The same sources and weights written in another order (a config loaded another way): not a change of
    # the data, but of the interleave's order. Each source continues from its own next record, the new
    # order from this restart on: nothing repeated or skipped, no declaration needed.
    order = f"source order {','.join(saved_shares)} -> {','.join(current_shares)}"
    return True, {"source"}, [order + " (each source continues from its own next record)"]
  # A kept source's integer share may move with the gcd alone (its part among the kept ones the same).
  rescaled = {n for n in current_shares if n in saved_shares and saved_shares[n] != current_shares[n]}
  fields = {f"weight[{n}]" for n in set(added) | set(removed) | rescaled} | {"source"}
  fields |= {name for name in set(saved) | set(current)
             if (m := _SOURCE_FIELD.match(name)) and m.group(1) in set(added) | set(removed)}
  needed = []
  if reweighted and WEIGHTS not in allow_drift and not {f"weight[{n}]" for n in reweighted} <= set(allow_drift):
    needed.append(WEIGHTS)
  if (added or removed) and SOURCES not in allow_drift:
    needed.append(SOURCES)
  lines = []
  if reweighted:
    lines.append(_fractions_line(saved_shares, current_shares))
  if added:
    lines.append("sources added: " + ", ".join(added) + " (each from its first record, or where it was left)")
  if removed:
    lines.append("sources removed: " + ", ".join(removed) + " (their ledger kept: mixing one again continues it)")
  if needed:
    differences = {f: (saved.get(f, _ABSENT), current.get(f, _ABSENT)) for f in sorted(fields)
                   if not state_lib.same_field_value(saved.get(f, _ABSENT), current.get(f, _ABSENT))}
    # The declarations it asks for are among the names it gives a program: `allow_drift=set(error.differences)`
    # accepts every change it names (docs/failure_modes.md).
    if WEIGHTS in needed:
      differences[WEIGHTS] = (dict(saved_shares), dict(current_shares))
    if SOURCES in needed:
      differences[SOURCES] = (list(saved_shares), list(current_shares))
    error = errors.ConfigDriftError(differences, origin=origin)
    error.args = (
        f"{origin}: the mixture changed ({'; '.join(lines)}). Declare it with allow_drift={set(needed)!r} "
        f"to continue each source from its own next record, the new weights taking effect {takes_effect}: "
        "no record of any source is repeated or skipped. Or rebuild the pipeline with the saved weights and "
        "sources.",)
    raise error
  return True, fields, lines


def _reweighted(saved_shares: Mapping[str, Any], current_shares: Mapping[str, Any]) -> list[str]:
  """The sources in both mixtures whose part of what those sources share changed.

  Compared among the sources both have, as proportions: shares are integers
  reduced by their gcd, so adding or removing a source can change every
  other source's integer share (`{a: 1, b: 2}` without a is `{b: 1}`) without
  changing how the sources kept are mixed with each other. A change of names
  alone is a sources change, whatever the shares' gcd.
  """
  common = [n for n in current_shares if n in saved_shares]
  saved_total = sum(saved_shares[n] for n in common)
  current_total = sum(current_shares[n] for n in common)
  if not saved_total or not current_total:
    return []
  return [n for n in common
          if fractions.Fraction(saved_shares[n], saved_total) != fractions.Fraction(current_shares[n], current_total)]


def _iter_mixture_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], allow_drift: Collection[str], origin: str
) -> Reconciled:
  """New weights of a Grain IterDataset.mix, accepted when declared (`WEIGHTS`).

  Its state holds each source's own iterator state, so under new weights
  every source continues from its own next element; only the choice of which
  source gives the next element follows the new weights.
  """
  fields = set()
  for name in sorted(set(saved) & set(current)):
    match = _NODE_FIELD.match(name)
    if (match and match.group(2) == "MixedIterDataset" and match.group(3) == "weights"
        and not state_lib.same_field_value(saved[name], current[name])):
      fields.add(name)
  if not fields or WEIGHTS not in allow_drift:
    return Reconciled(position={})
  lines = tuple(f"{origin}: accepted stream change: {n} {saved[n]} -> {current[n]}; every source continues "
                "from its own next element." for n in sorted(fields))
  return Reconciled(position={}, accepted=frozenset(fields), changes=lines)


# Grain's MapDataset.mix maps a global index to (source, index) by its weights.
_INDEX_MIXES = frozenset({"MixedMapDataset"})


def _refuse_index_mixture_change(saved: Mapping[str, Any], current: Mapping[str, Any], origin: str) -> None:
  """Refuses new weights of a Grain MapDataset.mix, whatever allow_drift says.

  Its position is a global index; under other weights that index maps to
  other records of every source, so continuing there would skip some and
  repeat others (measured: records 10-15 of a source never trained).
  """
  for name in sorted(set(saved) | set(current)):
    match = _NODE_FIELD.match(name)
    if match is None or match.group(2) not in _INDEX_MIXES or match.group(3) != "weights":
      continue
    before, after = saved.get(name, _ABSENT), current.get(name, _ABSENT)
    if before is _ABSENT or after is _ABSENT or state_lib.same_field_value(before, after):
      continue
    error = errors.ConfigDriftError({name: (before, after)}, origin=origin)
    error.args = (
        f"{origin}: the weights of a grain MapDataset.mix changed ({name}: {before} -> {after}). Its "
        "position is one global index, which new weights map to other records of every source: "
        "continuing there would skip some and repeat others, so this is refused even with allow_drift. "
        "Restore with the saved weights; to reweight between restarts build the mixture with "
        "ckpt_iter.make_dataset({name: source, ...}, weights={...}) or grain.IterDataset.mix over "
        f"named datasets, whose states keep each source's own position ({_urls.doc_url('changing_the_run.md')}).",)
    raise error


class _Plan:
  """The accepted changes of one restore and the position they lead to."""

  def __init__(self, saved: Mapping[str, Any], current: Mapping[str, Any], next_index: int, origin: str):
    self.saved, self.current, self.origin = saved, current, origin
    self.saved_index = next_index
    self.next_index = next_index
    self.changes: list[str] = []
    self.batch_changes = 0

  # -- make_dataset (spec fields)

  def add_spec_changes(self, fields: set[str]) -> None:
    above = [s for s in str(self.current.get("pipeline") or "").split("<") if s]
    if "global_batch_size" in fields:
      if "batch_size" not in fields or self.saved.get("shard_count") != self.current.get("shard_count"):
        raise self._refuse(fields, "the global batch size changed but not the per-process one")
      self._require(above, ELEMENTWISE, fields, "a batch-size change")
      self._translate_spec_batch(fields)
    elif fields & _SPEC_BATCH:
      raise self._refuse(fields, "the batches per epoch changed without a batch-size change")
    if "num_epochs" in fields:
      self._require(above, PREFIX_STABLE, fields, "a num_epochs change")
      self.changes.append(
          f"num_epochs {self.saved.get('num_epochs')} -> {self.current.get('num_epochs')}"
      )

  def _translate_spec_batch(self, fields: set[str]) -> None:
    old_batch, new_batch = self.saved["global_batch_size"], self.current["global_batch_size"]
    old_per_epoch, new_per_epoch = self.saved["batches_per_epoch"], self.current["batches_per_epoch"]
    epoch, batch = divmod(self.saved_index, old_per_epoch)
    row = batch * old_batch  # rows of this epoch already consumed
    if row % new_batch:
      raise self._misaligned(fields, row, old_batch, new_batch, within="of epoch %d" % epoch)
    self.next_index = epoch * new_per_epoch + row // new_batch
    self.batch_changes += 1
    self.changes.append(
        f"batch_size {self.saved.get('batch_size')} -> {self.current.get('batch_size')} "
        f"(global {old_batch} -> {new_batch}): epoch {epoch}, row {row}"
    )

  # -- hand-built graphs (node fields)

  def add_graph_changes(self, allow_drift: Collection[str], parent_length: Callable[[int], int | None]) -> bool:
    old_nodes, old_cuts = _canonical(_nodes(self.saved, allow_drift))
    new_nodes, new_cuts = _canonical(_nodes(self.current, allow_drift))
    if [n.kind for n in old_nodes] != [n.kind for n in new_nodes]:
      return False
    kinds = [n.kind for n in new_nodes]
    length_changes: list[tuple[int, str, dict[str, tuple[Any, Any]]]] = []
    batch_change = None
    for index, (old, new) in enumerate(zip(old_nodes, new_nodes)):
      for param in set(old.params) | set(new.params):
        before, after = old.params.get(param, _ABSENT), new.params.get(param, _ABSENT)
        if state_lib.same_field_value(before, after):
          continue
        named = {f"node[{new.field_index}].{new.kind}.{param}": (before, after)}
        if _LENGTH_PARAMS.get(old.kind) == param:
          length_changes.append((index, f"{old.kind}.{param} {before} -> {after}", named))
        elif old.kind == "BatchMapDataset" and param == "batch_size" and batch_change is None:
          batch_change = (index, old, new, named)
        else:
          return False
    for index in sorted(set(old_cuts) | set(new_cuts)):
      if old_cuts.get(index) != new_cuts.get(index):
        (before, old_field), (after, new_field) = old_cuts.get(index, (None, None)), new_cuts.get(index, (None, None))
        describe = lambda cut: "no slice" if cut is None else f"[0:{cut}]"
        below = kinds[index] if index < len(kinds) else "the end"
        named = {new_field or old_field: (_ABSENT if before is None else before, _ABSENT if after is None else after)}
        length_changes.append(
            (index, f"slice above {below} {describe(before)} -> {describe(after)}", named)
        )
    if not length_changes and batch_change is None:
      return False
    # A refusal names every candidate change: one may be the other's effect
    # (an inner batch size moves the normalized stop of a slice after it).
    every = {k: v for _, _, named in length_changes for k, v in named.items()}
    if batch_change is not None:
      every.update(batch_change[3])
    if batch_change is not None:
      self._require(kinds[:batch_change[0]], ELEMENTWISE, every, "a batch-size change")
    for index, text, _ in length_changes:
      self._require(kinds[:index], PREFIX_STABLE, every, f"the change {text}")
      if self.saved_index == self.saved.get("dataset_length") and any(
          n.kind == "BatchMapDataset" and not n.params.get("drop_remainder") for n in new_nodes[:index]
      ):
        raise self._refuse(
            every,
            f"the change {text} lengthens the input of a batch with drop_remainder=False, "
            "and the saved stream was read to its end: its last batch may have been short, "
            "so the next batch would repeat elements",
        )
      self.changes.append(text)
    if batch_change is not None:
      index, old, new, named = batch_change
      self._translate_graph_batch(every, old, new, bool(length_changes), parent_length(new.field_index))
    return True

  def _translate_graph_batch(
      self, fields: Any, old: _Node, new: _Node, length_changed: bool, parent_length: int | None
  ) -> None:
    old_batch, new_batch = old.params["batch_size"], new.params["batch_size"]
    text = f"BatchMapDataset.batch_size {old_batch} -> {new_batch}"
    element = self.saved_index * old_batch
    at_end = self.saved_index == self.saved.get("dataset_length")
    if at_end and not length_changed and parent_length is not None and element >= parent_length:
      # The whole input was read (the last batch may have been short).
      full, partial = divmod(parent_length, new_batch)
      self.next_index = full + (1 if partial and not new.params.get("drop_remainder") else 0)
      element = parent_length
    elif element % new_batch:
      raise self._misaligned(fields, element, old_batch, new_batch, within="")
    else:
      self.next_index = element // new_batch
    self.batch_changes += 1
    self.changes.append(f"{text}: element {element}")

  # -- common

  def finish(self, accepted: frozenset[str]) -> Reconciled:
    if self.batch_changes > 1:
      raise self._refuse(accepted, "both make_dataset's batch size and a batch step changed")
    length = self.current.get("dataset_length")
    if state_lib.is_int(length) and self.next_index > length:
      raise self._refuse(
          accepted,
          f"the saved position (element index {self.next_index} in this pipeline) is past "
          f"the end of the new stream ({length} elements)",
      )
    where = f"resuming at next_index {self.next_index}"
    if self.next_index != self.saved_index:
      where += f" (was {self.saved_index})"
    lines = tuple(f"{self.origin}: accepted stream change: {c}; {where}." for c in self.changes)
    return Reconciled(position={"next_index": self.next_index}, accepted=accepted, changes=lines)

  def _require(self, kinds: list[str], allowed: frozenset[str], fields: Collection[str], what: str) -> None:
    bad = [k for k in kinds if k not in allowed]
    if bad:
      raise self._refuse(
          fields,
          f"{what} keeps the stream only if the steps after it keep prefixes "
          f"({sorted(allowed)}), but this pipeline applies {bad} after it",
      )

  def _misaligned(
      self, fields: Collection[str], element: int, old_batch: int, new_batch: int, within: str
  ) -> errors.ConfigDriftError:
    step = old_batch * new_batch // math.gcd(old_batch, new_batch)
    # Bounded by the batch sizes, not by the position (a hint, not a scan).
    divisors = [b for b in range(1, min(element, 4 * max(old_batch, new_batch)) + 1) if element % b == 0]
    return self._refuse(
        fields,
        f"the state was saved after {element} elements {within}".rstrip() + f" (batches of {old_batch}); "
        f"a batch size of {new_batch} cannot start a batch there, because batches are "
        f"index-addressed. Use a batch size dividing {element} (e.g. {divisors[-3:]}), "
        f"or resume with batch size {old_batch} and save again after a multiple of "
        f"{step} elements",
    )

  def _refuse(self, fields: Collection[str] | Mapping[str, tuple[Any, Any]], reason: str) -> errors.ConfigDriftError:
    if isinstance(fields, Mapping):
      differences = dict(fields)
    else:
      differences = {
          n: (self.saved.get(n, _ABSENT), self.current.get(n, _ABSENT)) for n in sorted(fields)
          if not state_lib.same_field_value(self.saved.get(n, _ABSENT), self.current.get(n, _ABSENT))
      }
    error = errors.ConfigDriftError(differences, origin=self.origin)
    error.args = (f"{error} Not a stream-preserving change: {reason}.",)
    return error


def _nodes(fingerprint: Mapping[str, Any], allow_drift: Collection[str]) -> list[_Node]:
  kinds = str(fingerprint.get(state_lib.GRAPH_FIELD) or "").split("<")
  nodes = [_Node(kind, {}, index) for index, kind in enumerate(kinds)]
  for name, value in fingerprint.items():
    match = _NODE_FIELD.match(name)
    if match is None or name in allow_drift:
      continue
    index = int(match.group(1))
    if index < len(nodes) and nodes[index].kind == match.group(2):
      nodes[index].params[match.group(3)] = value
  return nodes


def _canonical(nodes: list[_Node]) -> tuple[list[_Node], dict[int, tuple[Any, str]]]:
  """Nodes without `[0:k]` slices, and those slices (stop, field) keyed by the index below them."""
  kept: list[_Node] = []
  cuts: dict[int, tuple[Any, str]] = {}
  for node in nodes:
    params = node.params
    if node.kind == "SliceMapDataset" and params.get("start") == 0 and params.get("step") == 1:
      stop = params.get("stop")
      if state_lib.is_int(stop) and stop >= sys.maxsize:
        continue  # cuts nothing
      position = len(kept)
      field = f"node[{node.field_index}].SliceMapDataset.stop"
      if position in cuts:  # two cuts in a row: the shorter one counts
        stop = min(cuts[position][0], stop)
      cuts[position] = (stop, field)
      continue
    kept.append(node)
  return kept, cuts


# ---------------------------------------------------------------------------
# What a pipeline produced, as a digest: the content check of a restore.

# How a state says its element can be produced again: by its index in a
# MapDataset. Any other `check` value says why it cannot (and has no digest).
BY_INDEX = "index"
ITER_DATASET = "unavailable: an IterDataset cannot produce an element again"
_NPY_OBJECT, _NPY_VOID = np.dtype(object).num, np.dtype("V1").num
WHOLE_ELEMENT = "element"
_SCALARS = (bool, int, float, complex)
_CONTENT_MAX_DEPTH = 32


class Undigestible(Exception):
  """An element holds a value whose bytes do not define it (an arbitrary object)."""


def content_digest(element: Any) -> dict[str, Any]:
  """The content record of `element`: its digest and a CRC-32 per leaf (the first 64).

  Leaves are numpy arrays and scalars (dtype, shape and bytes), Python
  scalars, str and bytes; containers are dicts (in key order), lists,
  tuples and dataclasses. Anything else has no stable bytes: the record then
  says so and the restore checks nothing.
  """
  leaves: list[str] = []  # "name\0crc", every leaf
  try:
    if type(element) is dict and all(type(v) is np.ndarray for v in element.values()):
      # The usual batch, a dict of arrays, without the walk: a save runs this
      # cold, right after a batch, where every call costs several times more.
      leaves = [f"{key}\0{_leaf_crc(element[key]):08x}" for key in _sorted_keys(element)]
    else:
      _visit(element, "", 0, leaves)
  except Undigestible as e:
    return {"check": f"unavailable: the element holds {e}"}
  fields = dict(leaf.rsplit("\0", 1) for leaf in leaves[: state_lib.MAX_CONTENT_FIELDS])
  # Over every leaf's name and CRC: two 32-bit checksums of a short string (a
  # hash object would cost more than the rest, cold, at a save).
  joined = "\0".join(leaves).encode("utf-8", "surrogatepass")
  return {"check": BY_INDEX, "digest": f"{zlib.crc32(joined):08x}{zlib.adler32(joined):08x}", "fields": fields}


def _visit(node: Any, path: str, depth: int, leaves: list[str]) -> None:
  # Runs at every save, cold, right after a batch: the common shapes (a dict
  # of arrays, an array) take the shortest path.
  if depth > _CONTENT_MAX_DEPTH:
    raise Undigestible(f"containers nested deeper than {_CONTENT_MAX_DEPTH}")
  kind = type(node)
  if kind is np.ndarray:
    leaves.append(f"{path or WHOLE_ELEMENT}\0{_leaf_crc(node):08x}")
  elif kind is dict or isinstance(node, Mapping):
    for key in _sorted_keys(node):
      _visit(node[key], f"{path}.{key}" if path else str(key), depth + 1, leaves)
  elif isinstance(node, (list, tuple)):
    for index, child in enumerate(node):
      _visit(child, f"{path}[{index}]", depth + 1, leaves)
  elif dataclasses.is_dataclass(node) and not isinstance(node, type):
    for field in dataclasses.fields(node):
      _visit(getattr(node, field.name), f"{path}.{field.name}" if path else field.name, depth + 1, leaves)
  else:
    leaves.append(f"{path or WHOLE_ELEMENT}\0{_leaf_crc(node):08x}")


def _sorted_keys(mapping: Mapping[Any, Any]) -> list[Any]:
  try:
    return sorted(mapping)
  except TypeError:  # keys of mixed types
    return sorted(mapping, key=repr)


def _leaf_crc(node: Any) -> int:
  """CRC-32 of a leaf's type, dtype, shape and bytes.

  A CRC, not a cryptographic hash: the check is for data that changed by
  accident (a file, a library), and CRC-32 runs at memory speed (3.6 GB/s
  here against 0.8 for blake2b), which keeps a save's digest within 2% of a
  batch's production (benchmarks/content_check.py).
  """
  if type(node) is not np.ndarray and (isinstance(node, np.generic) or hasattr(node, "__array__")
                                        and hasattr(node, "dtype")):
    node = np.asarray(node)
  if type(node) is np.ndarray or isinstance(node, np.ndarray):
    # As few dtype attributes as possible: each costs microseconds cold.
    kind = node.dtype.num
    header = struct.pack(f"<{node.ndim + 1}q", kind, *node.shape)
    if kind == _NPY_OBJECT:
      return _object_array_crc(node, header)
    if kind == _NPY_VOID:  # structured or opaque: its layout and fields too
      if node.dtype.hasobject:
        raise Undigestible(f"an object array ({node.dtype})")
      header += str(node.dtype.descr).encode("utf-8")
    elif node.dtype.byteorder == ">":
      header += b">"
    crc = zlib.crc32(header)
    if not node.flags.c_contiguous:
      node = np.ascontiguousarray(node)
    if not node.size:
      return crc
    try:
      return zlib.crc32(node.data, crc)  # C-contiguous: its buffer, without a copy
    except (ValueError, TypeError):  # dtypes with no buffer format (datetime64, ...)
      return zlib.crc32(node.reshape(-1).view(np.uint8).data, crc)
  if node is None or isinstance(node, _SCALARS):
    return zlib.crc32(f"{type(node).__name__}:{node!r}".encode("ascii"))
  if isinstance(node, str):
    return zlib.crc32(node.encode("utf-8", "surrogatepass"), zlib.crc32(b"str:"))
  if isinstance(node, bytes):
    return zlib.crc32(node, zlib.crc32(b"bytes:"))
  raise Undigestible(f"a {type(node).__qualname__}")


def _object_array_crc(array: np.ndarray, header: bytes) -> int:
  """An object array (of Python strings, say): its shape, then each item's CRC; items must be
  None, Python scalars, str or bytes."""
  crc = zlib.crc32(header)
  for item in array.ravel().tolist():
    if not (item is None or isinstance(item, (*_SCALARS, str, bytes))):
      raise Undigestible(f"an object array holding a {type(item).__qualname__}")
    crc = zlib.crc32(struct.pack("<I", _leaf_crc(item)), crc)
  return crc


# A make_dataset batch's record may hold its last row only: a restore then produces that one record again, where
# the whole batch would cost a batch of reads (and, shuffled, one Grain `index_shuffle` each: 13-50 us apiece for
# a source under 2**16 records). Each field's value is "<crc>:<dtype>": a batch widens its strings to the longest
# row and promotes mixed numbers (an int row beside a float one is float), which the record alone does not, so a
# string is digested by its characters and a number cast to the batch's dtype before its CRC.
BY_ROW = "row"
_ROW_NUMBER_DTYPE = re.compile(r"[<>|=][biufc](1|2|4|8|16)")


def row_record(batch: Any) -> dict[str, Any] | None:
  """The content record of `batch`'s last row (`BY_ROW`), or None where a row cannot stand for it.

  None (the caller records the whole batch) unless every leaf is a numpy
  array with a batch dimension, of numbers, bools or strings, at most 64 of them.
  """
  return _row_record(batch, None)


def row_difference(saved: Mapping[str, Any], row: Any) -> tuple[tuple[str, str, str] | None, str | None]:
  """`content_difference` for a `BY_ROW` record: `row` is the saved batch's last row produced again from its
  record alone, as a batch of one (`GlobalBatchDataset.last_row`)."""
  fields = saved.get("fields", {})
  dtypes = {name: value.partition(":")[2] for name, value in fields.items()}
  current = _row_record(row, dtypes)
  if current is None:
    return None, "not applicable (the row produced again is no batch of arrays)"
  return first_difference(saved, current), None


def _row_record(batch: Any, dtypes: Mapping[str, str] | None) -> dict[str, Any] | None:
  """`row_record`; with `dtypes` (the saved record's), each number leaf cast to its saved dtype where numpy
  casts it safely, so a row stacked alone compares with the same row stacked in its batch."""
  named: list[tuple[str, Any]] = []
  if not _row_leaves(batch, "", 0, named) or not named or len(named) > state_lib.MAX_CONTENT_FIELDS:
    return None
  fields = {}
  for name, leaf in named:
    if not leaf.ndim or not len(leaf) or leaf.dtype.kind not in "biufcUS":
      return None
    row = leaf[-1:]
    if row.dtype.kind in "US":
      # Its characters, whatever width the batch gave it.
      items = row.ravel().tolist()
      header = struct.pack(f"<c{row.ndim}q", row.dtype.kind.encode(), *row.shape)
      crc = zlib.crc32(b"".join(struct.pack("<I", len(item)) + (item if type(item) is bytes else
                                                                 item.encode("utf-8", "surrogatepass"))
                                for item in items), zlib.crc32(header))
      fields[name] = f"{crc:08x}:{row.dtype.kind}"
      continue
    wanted = None if dtypes is None else dtypes.get(name)
    if wanted and wanted != row.dtype.str and _ROW_NUMBER_DTYPE.fullmatch(wanted) and np.can_cast(
        row.dtype, np.dtype(wanted), "safe"):
      row = row.astype(wanted)
    fields[name] = f"{_leaf_crc(row):08x}:{row.dtype.str}"
  joined = "\0".join(f"{name}\0{value}" for name, value in fields.items()).encode("utf-8", "surrogatepass")
  return {"check": BY_ROW, "digest": f"{zlib.crc32(joined):08x}{zlib.adler32(joined):08x}", "fields": fields}


def _row_leaves(node: Any, path: str, depth: int, named: list[tuple[str, Any]]) -> bool:
  """Appends (name, array) for each leaf of a stacked batch (dicts in key order, lists and tuples), named as
  `content_digest` names them; False at anything else (a batch a row cannot stand for) or past 64 leaves."""
  kind = type(node)
  if kind is np.ndarray:
    named.append((path or WHOLE_ELEMENT, node))
    return len(named) <= state_lib.MAX_CONTENT_FIELDS
  if depth >= _CONTENT_MAX_DEPTH:
    return False
  if kind is dict:
    return all(_row_leaves(node[key], f"{path}.{key}" if path else str(key), depth + 1, named)
               for key in _sorted_keys(node))
  if kind is list or kind is tuple:
    return all(_row_leaves(child, f"{path}[{index}]", depth + 1, named) for index, child in enumerate(node))
  return False


def first_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[str, str, str] | None:
  """(field, saved digest, current digest) of the first leaf that differs, or None.

  Fields in the saved order; when every recorded leaf agrees but the whole
  digest does not (a leaf past the first 64, or another structure), the
  field is the whole element.
  """
  if saved.get("digest") == current.get("digest"):
    return None
  saved_fields, current_fields = saved.get("fields", {}), current.get("fields", {})
  for name in list(saved_fields) + [n for n in current_fields if n not in saved_fields]:
    before, after = saved_fields.get(name, state_lib.ABSENT), current_fields.get(name, state_lib.ABSENT)
    if before != after:
      return name, before, after
  return WHOLE_ELEMENT, str(saved.get("digest")), str(current.get("digest"))


def content_difference(saved: Mapping[str, Any], element: Any) -> tuple[tuple[str, str, str] | None, str | None]:
  """Whether `element` is the one the content record `saved` describes: the content check, a replay's
  last batch and a learner's last prompts all ask this.

  Returns:
    (`first_difference` of the two records, or None; None, or why nothing
    was compared: the saved record holds no digest, or `element` cannot be
    digested, either said in the record's `check`).
  """
  if saved.get("check") != BY_INDEX:
    return None, f"not recorded ({saved.get('check')})"
  current = content_digest(element)
  if current.get("check") != BY_INDEX:
    return None, f"not applicable ({current.get('check')})"
  return first_difference(saved, current), None


# ---------------------------------------------------------------------------
# Read only: the digests ckpt_iter 0.2.0 wrote where states now hold a content record.

_LEGACY_MAX_DEPTH = 64


def legacy_batch_digest(batch: Any) -> str:
  """The 16-hex-digit digest of one batch 0.2.0 wrote (`replay.LEGACY_LAST_FIELD`), to check a state it wrote.

  Dicts (keys in sorted order), lists and tuples are structure; arrays (numpy,
  JAX, anything with `__array__`) are hashed by dtype, shape and bytes, object
  arrays element by element; Python scalars, strings and bytes by type and
  value; a leaf of another type by its type name only.
  """
  digest = hashlib.blake2b(digest_size=8)
  _legacy_hash_tree(batch, digest, 0)
  return digest.hexdigest()


def _legacy_hash_tree(node: Any, digest: Any, depth: int) -> None:
  if depth > _LEGACY_MAX_DEPTH:
    raise errors.InvalidArgumentError(f"a batch nested deeper than {_LEGACY_MAX_DEPTH} levels cannot be digested.")
  if isinstance(node, Mapping):
    digest.update(b"{%d" % len(node))
    for key in sorted(node, key=lambda k: (type(k).__name__, str(k))):
      _legacy_hash_tree(key, digest, depth + 1)
      _legacy_hash_tree(node[key], digest, depth + 1)
  elif isinstance(node, (list, tuple)):
    digest.update(b"[%d" % len(node) if isinstance(node, list) else b"(%d" % len(node))
    for item in node:
      _legacy_hash_tree(item, digest, depth + 1)
  elif node is None or (isinstance(node, (bool, numbers.Number, str)) and not isinstance(node, np.generic)):
    digest.update(f"{type(node).__name__}:{node!r};".encode("utf-8", "surrogatepass"))
  elif isinstance(node, bytes):
    digest.update(b"bytes:%d:" % len(node) + node)
  elif isinstance(node, (np.ndarray, np.generic)) or hasattr(node, "__array__"):
    array = np.asarray(node)
    if array.dtype.hasobject:  # e.g. an array of Python strings: element by element
      digest.update(f"objects{array.shape};".encode())
      for item in array.ravel().tolist():
        _legacy_hash_tree(item, digest, depth + 1)
      return
    digest.update(f"array:{array.dtype.str}{array.shape};".encode())
    digest.update(np.ascontiguousarray(array).view(np.uint8).ravel().data)
  else:
    digest.update(f"<{type(node).__module__}.{type(node).__qualname__}>;".encode())


def legacy_prompts_digest(prompts: Iterable[Any]) -> str:
  """The digest of a Tunix learner's last prompts 0.2.0 wrote (`tunix/_input.LEGACY_LAST_ROWS`), to check a state
  it wrote."""
  text = "\x00".join(str(p) for p in prompts)
  return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
