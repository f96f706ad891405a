"""What a pod's processes exchange when they save (`_pod_exchange.share_arrays`): arrays, pod part, agreement.

The processes of one pod run as threads of this process, through one key-value store with the JAX job
store's calls (tests/support.py); tests/integration/test_multihost.py runs the same exchange through a real
`jax.distributed` job's store.
"""

from __future__ import annotations

import concurrent.futures
import logging

import numpy as np
import pytest

from ckpt_iter import _pod_exchange
import support

AGREED = "a" * 64


@pytest.fixture
def store(monkeypatch):
  store = support.KeyValueStore()
  monkeypatch.setattr(_pod_exchange, "_distributed_client", lambda count: store)
  monkeypatch.setattr(_pod_exchange, "SHARE_WAIT_SECONDS", 0.5)
  return store


def _pod(verdicts, *, saving=None):
  """Each process's `Shared` as a pod of len(verdicts) saves at once (process i's agreement digest
  verdicts[i]); process 0's `agreed()` asked as its write asks it. `saving`: the processes that save."""
  count = len(verdicts)
  saving = range(count) if saving is None else saving

  def save(index):
    shared = _pod_exchange.share_arrays("/pod/7/data", {"kind": "data"}, {}, index, count, pod_digest="p",
                                        agreement=lambda: verdicts[index])
    return shared, shared.agreed() if shared.agreed is not None else None

  with concurrent.futures.ThreadPoolExecutor(len(saving)) as pool:
    return dict(zip(saving, pool.map(save, saving)))


def test_sharing_changes_nothing_outside_a_jax_job_of_that_count():
  header, arrays = {"kind": "tunix"}, {"a0": np.arange(3)}
  # One process, and a process index given by hand (this process is not in a 4-process job).
  # One process refers to its own count file's pod part; a process index given by hand writes its header whole.
  assert _pod_exchange.share_arrays("/d", header, arrays, 0, 1, pod_digest="p") == (header, arrays, "p", None)
  assert _pod_exchange.share_arrays("/d", header, arrays, 2, 4, pod_digest="p") == (header, arrays, None, None)


def test_process_0_learns_that_all_agreed_and_the_store_keeps_no_counter(store):
  saved = _pod([AGREED] * 4)
  assert saved[0][1] == AGREED
  assert all(shared.agreed is None and shared.pod_digest == "p" for shared, _ in list(saved.values())[1:])
  assert not [key for key in store.values if key.startswith("ckpt_iter/agreement/")]


@pytest.mark.parametrize("verdict", ["b" * 64, None], ids=["another state", "a state that cannot be resized"])
def test_one_process_that_differs_leaves_no_agreement_without_a_wait(store, caplog, verdict):
  caplog.set_level(logging.WARNING)
  saved = _pod([AGREED, AGREED, verdict, AGREED])
  assert saved[0][1] is None
  assert "process 2's data state differs from process 0's" in caplog.text
  assert "reported their data state within" not in caplog.text  # every verdict came: no time-out


def test_a_process_that_never_reports_costs_process_0_a_bounded_wait_and_the_agreement(store, caplog):
  caplog.set_level(logging.WARNING)
  saved = _pod([AGREED] * 3, saving=[0, 1])  # process 2 never saves
  assert saved[0][1] is None
  assert "1 of 2 processes reported their data state within 0.5 s; the step records no agreement" in caplog.text
  assert not [key for key in store.values if key.startswith("ckpt_iter/agreement/")]  # its counter deleted


def test_a_state_process_0_cannot_resize_asks_no_verdict(store):
  saved = _pod([None, AGREED, AGREED])
  assert saved[0][0].agreed is None and saved[0][1] is None
  assert not [key for key in store.values if key.startswith("ckpt_iter/agreement/")]
