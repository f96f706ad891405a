"""A filtered or packed mixture whose weights or sources changed at a restart: its shares over the stream.

Lanes read chunks at different stream records (`_lanes`): at a restart some
lanes are inside chunks mixed under the saved shares while others are chunks
ahead. So new shares cannot take effect at one lane's position. They take
effect at the end of the furthest chunk any lane has reached (`extent`, from
every saved process's lanes): every chunk before it keeps the shares it was
mixed under, the lanes behind still read them, and from there on each
source continues from its own count (`_records.Mixture.restarted`). No record
of any source is read twice or passed over; a lane behind reads the chunks
before that point under the saved shares first.

The position carries the schedule (`MIXTURE`: every segment's start, shares
and each source's count there) once the shares ever changed; the fingerprint
holds the shares in effect last. Pure arithmetic: no Grain, JAX or files.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Iterable, Mapping, Sequence

from ckpt_iter import _records
from ckpt_iter import errors
from ckpt_iter import skips as skips_lib

MIXTURE = _records.MIXTURE  # the lanes position's field: the schedule, once the shares changed
# Given to the restore's same-stream rule, never saved: the end of the furthest chunk any lane of the saved
# run has reached (a stream record).
EXTENT = "lanes_reached"
# Segments a run may gather: each is a restart that changed the mixture.
MAX_SEGMENTS = 32


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The mixtures of a lanes stream in order: segment i from `segments[i].since_record` on."""

  segments: tuple[_records.Mixture, ...]

  @classmethod
  def initial(cls, shares: Mapping[str, int]) -> "Schedule":
    return cls((_records.Mixture(shares=dict(shares)),))

  @property
  def last(self) -> _records.Mixture:
    return self.segments[-1]

  @property
  def is_initial(self) -> bool:
    return len(self.segments) == 1 and self.last.since_record == 0

  def __post_init__(self):
    # Asked once a record: the segments' starts kept, and a run never changed goes straight to its mixture.
    object.__setattr__(self, "_starts", [segment.since_record for segment in self.segments])

  def source_of(self, record: int) -> tuple[str, int]:
    """(source name, index in that source's own stream) of stream record `record`."""
    if len(self.segments) == 1:
      return self.segments[0].source_of(record)
    return self.segments[bisect.bisect_right(self._starts, record) - 1].source_of(record)

  def changed(self, end_record: int, shares: Mapping[str, int], *, origin: str) -> "Schedule":
    """The schedule with `shares` from `end_record` on (or from the last segment's start, if no lane reached
    it yet: that segment's records were never read)."""
    last = self.last
    at = max(end_record, last.since_record)
    kept = self.segments if at > last.since_record else self.segments[:-1]
    if len(kept) + 1 > MAX_SEGMENTS:
      raise errors.UnsupportedConfigError(
          f"{origin}: this filtered or packed mixture's weights or sources changed at {MAX_SEGMENTS - 1} "
          "restarts already, each kept in its state so that lanes behind read their chunks as mixed: restore "
          "with the saved weights and sources.")
    return Schedule((*kept, last.restarted(at, shares)))

  def to_json(self) -> list[dict[str, Any]]:
    return [{"since_record": s.since_record, "shares": [[n, v] for n, v in s.shares.items()],
             "since": dict(s.since)} for s in self.segments]

  @classmethod
  def from_json(cls, value: Any, shares: Mapping[str, int], *, origin: str) -> "Schedule":
    """The schedule a lanes position's `mixture` field holds; its last segment's shares are `shares` (the
    fingerprint's), its first starts at record 0, the others in increasing order.

    Raises:
      InvalidStateError: the field is malformed (the message names it).
    """
    expected = (f"{origin}: lanes position field {MIXTURE!r} must be 1-{MAX_SEGMENTS} segments "
                "[{'since_record': int, 'shares': [[name, share], ...], 'since': {name: count}}, ...], the "
                "first from record 0, in increasing order, the last with the fingerprint's weights "
                f"{skips_lib.short_text(dict(shares))}; got {skips_lib.short_text(value)}. The state is "
                "corrupt or edited.")
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SEGMENTS:
      raise errors.InvalidStateError(expected)
    segments = []
    for entry in value:
      pairs = entry.get("shares") if isinstance(entry, Mapping) else None
      if (not isinstance(entry, Mapping) or set(entry) != {"since_record", "shares", "since"}
          or not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs)):
        raise errors.InvalidStateError(expected)
      segment_shares = {name: share for name, share in pairs}
      if len(segment_shares) != len(pairs):
        raise errors.InvalidStateError(expected)
      segments.append(_records.Mixture.from_json(
          {"since_record": entry["since_record"], "since": entry["since"]}, segment_shares, _records.INFINITE,
          origin=origin))
    starts = [s.since_record for s in segments]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or (
        dict(segments[-1].shares) != dict(shares)):
      raise errors.InvalidStateError(expected)
    return cls(tuple(segments))


def of(shares: Mapping[str, int], position: Mapping[str, Any], *, origin: str) -> Schedule:
  """The schedule of a lanes position under the fingerprint's `shares` (the initial one without `MIXTURE`)."""
  if MIXTURE not in position:
    return Schedule.initial(shares)
  return Schedule.from_json(position[MIXTURE], shares, origin=origin)


def check_position(fingerprint: Mapping[str, Any], position: Any, *, origin: str) -> None:
  """A lanes position's schedule checked as a restore checks it (`ckpt-iter verify`).

  Raises:
    InvalidStateError: the schedule is malformed, or held by a state that is no mixture.
  """
  if not (isinstance(position, Mapping) and _records.LANES in position and MIXTURE in position):
    return
  shares = _records.shares_of(fingerprint)
  if shares is None:
    raise errors.InvalidStateError(
        f"{origin}: the lanes position holds a mixture's schedule ({MIXTURE!r}) but the fingerprint names no "
        "weights: the state is corrupt or edited.")
  of(shares, position, origin=origin)


def extent(positions: Iterable[Mapping[str, Any]], *, num_lanes: int, chunk_size: int) -> int:
  """The end of the furthest chunk a lane reached (`EXTENT`), over lane positions that together hold every
  lane of the run."""
  chunks = [chunk_in_lane * num_lanes + lane
            for position in positions for lane, chunk_in_lane, _ in _records.lanes_of(position)]
  return (max(chunks) + 1) * chunk_size


def holds_every_lane(position: Mapping[str, Any], num_lanes: Any) -> bool:
  """Whether one lanes position holds every lane of the run (a run of one process)."""
  lanes = position.get(_records.LANES)
  return position.get(_records.FIRST_LANE) == 0 and isinstance(lanes, Sequence) and len(lanes) == num_lanes
