"""What the processes of a pod exchange through JAX's job key-value store when they save a data item.

Three digests go from process 0 to the others, each to save the pod bytes or
reads: its pending arrays' (a process holding the same arrays writes none),
its header's pod part's (a process with the same refers to it), and its
state's agreement digest (`elastic.agreement_sha256`: each process counts its
verdict, and process 0 records the digest in its header only when all N-1
agreed, so a restore with another count reads that one header for all).
Without a JAX job of the saving count nothing is exchanged; every wait is
bounded by SHARE_WAIT_SECONDS, past which a process writes its own copy and
the step records no agreement. JAX and Orbax are imported only to find a job of
several processes, so the read-only CLI, which imports `_item`, loads neither.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from ckpt_iter import _files
from ckpt_iter import _npz

_log = logging.getLogger(__name__)


# How long a process waits for process 0's digest before writing its own copy.
SHARE_WAIT_SECONDS = 120


class Shared(NamedTuple):
  """A snapshot as `share_arrays` leaves it for this process to write."""

  header: dict[str, Any]
  arrays: dict[str, np.ndarray]
  pod_digest: str | None  # process 0's pod part's digest (see `share_arrays`)
  # Process 0's: waits for the others' verdicts and gives the digest all agreed on, or None.
  agreed: Callable[[], str | None] | None = None


def share_arrays(
    directory: str, header: dict[str, Any], arrays: dict[str, np.ndarray], index: int, count: int,
    *, pod_digest: str | None = None, agreement: Callable[[], str | None] | None = None,
) -> Shared:
  """A snapshot as this process writes it: arrays identical to process 0's are not written again.

  In a JAX job of several processes that all feed the same data (Tunix's
  default) every process holds the same pending arrays. Each hashes its own
  (SHA-256, once per save, in the background write); process 0 publishes
  its digest in the job's key-value store (the one Orbax's barriers use) and
  writes its npz; a process holding the same arrays writes only its header,
  which names process 0's npz and the digest the reader checks the loaded
  arrays against. Arrays that differ (each process fed its own rows) are
  written by their process, as before. So the pod writes each distinct array
  set once, and `save()` does not wait for any of it.

  The same exchange carries the digest of the header's pod part
  (`pod_digest`, `_files.split_header`): `Shared.pod_digest` is process
  0's, which process 0 writes in the count file; a process whose own is the
  same refers to it instead of writing its fingerprint and lineage (`write`).
  With one process it is `pod_digest` itself.

  And the digest of what a restore with another process count takes from
  one saved process for all (`agreement()`, `elastic.agreement_sha256`):
  each other process counts its verdict against process 0's in the store,
  and process 0, once its npz is written, waits for all N-1 of them
  (`Shared.agreed`) and records the digest in its header only when all
  agreed (`_files.AGREED_SHA256`), so that such a restore reads that one
  header, not a window of them (`elastic.read_for_process`).

  Without a JAX job of `count` processes (a process index given by hand) it
  changes nothing and returns no pod digest: every process writes its header
  whole. If process 0's digests do not come within SHARE_WAIT_SECONDS, this
  process writes its own copy of both (exact, only larger), and the step
  records no agreement.
  """
  if count < 2:
    return Shared(header, arrays, pod_digest)
  client = _distributed_client(count)
  if client is None:
    return Shared(header, arrays, None)
  key = f"ckpt_iter/digests/{directory}"
  digest = _npz.arrays_sha256(arrays) if arrays else ""
  own_agreement = None if agreement is None else agreement()
  if index == 0:
    # A verdict counter of this save's own: a save retried into the same directory counts afresh.
    nonce = os.urandom(8).hex() if own_agreement is not None else "none"
    client.key_value_set(key, f"{digest or 'none'} {pod_digest or 'none'} {own_agreement or 'none'} {nonce}",
                         allow_overwrite=True)
  if digest:
    header = {**header, _npz.ARRAYS_SHA256: digest}
  if index == 0:
    waits = None if own_agreement is None else (
        lambda: _agreed_by_all(client, f"ckpt_iter/agreement/{directory}/{nonce}", own_agreement, count, directory))
    return Shared(header, arrays, pod_digest, waits)
  try:
    leader = client.blocking_key_value_get(key, int(SHARE_WAIT_SECONDS * 1000))
  except Exception as e:  # pylint: disable=broad-except
    # The store's errors are not typed; a missing digest only costs bytes.
    _log.warning("%s: process 0's digests did not come (%s); this process writes its own copy of "
                 "its header's pod part and of its pending arrays.", directory, e)
    return Shared(header, arrays, None)
  leader_arrays, leader_pod, leader_agreement, nonce = (leader.split(" ") + ["none"] * 4)[:4]
  if nonce != "none":  # process 0 waits for every verdict, this one's too
    _report_agreement(client, f"ckpt_iter/agreement/{directory}/{nonce}",
                      own_agreement is not None and own_agreement == leader_agreement, directory, index)
  if digest and leader_arrays == digest:
    header, arrays = {**header, _files.ARRAYS_FROM: 0}, {}
  return Shared(header, arrays, leader_pod)


def _report_agreement(client: Any, base: str, agrees: bool, directory: str, index: int) -> None:
  """Counts this process's verdict for process 0 (`_agreed_by_all`): agreed first, then reported."""
  if not agrees:
    _log.warning("%s: process %d's data state differs from process 0's beyond its own rows; a restore of "
                 "this step with another process count reads process 0's header and checks its neighbours'.",
                 directory, index)
  try:
    if agrees:
      client.key_value_increment(f"{base}/agreed", 1)
    client.key_value_increment(f"{base}/reported", 1)
  except Exception as e:  # pylint: disable=broad-except
    _log.warning("%s: process %d could not report to process 0 (%s); the step records no agreement.",
                 directory, index, e)


def _agreed_by_all(client: Any, base: str, agreement: str, count: int, directory: str) -> str | None:
  """`agreement` once all `count` - 1 other processes reported the same; None if one differed or did not
  report within SHARE_WAIT_SECONDS (then a restore with another count checks a window of headers instead)."""
  deadline, pause = time.monotonic() + SHARE_WAIT_SECONDS, 0.001
  try:
    while (reported := _counted(client, f"{base}/reported")) < count - 1:
      if time.monotonic() > deadline:
        _log.warning("%s: %d of %d processes reported their data state within %g s; the step records no "
                     "agreement.", directory, reported, count - 1, SHARE_WAIT_SECONDS)
        client.key_value_delete(base)  # (a report still to come leaves one counter behind)
        return None
      time.sleep(pause)
      pause = min(2 * pause, 0.05)
    agreed = _counted(client, f"{base}/agreed")
    client.key_value_delete(base)  # the job's store keeps no counter per save
  except Exception as e:  # pylint: disable=broad-except
    _log.warning("%s: the processes' verdicts could not be read (%s); the step records no agreement.",
                 directory, e)
    return None
  return agreement if agreed == count - 1 else None


def _counted(client: Any, key: str) -> int:
  """A counter of the job's store; 0 before its first increment."""
  try:
    return int(client.key_value_try_get(key))
  except Exception:  # pylint: disable=broad-except
    return 0  # not counted yet (the store's NOT_FOUND is not typed)


def _distributed_client(count: int) -> Any:
  """The JAX job's key-value client, when this is a JAX job of `count` processes."""
  import jax  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top

  if jax.process_count() != count or not multihost.is_jax_distributed_client_initialized():
    return None
  return multihost.get_jax_distributed_client()
