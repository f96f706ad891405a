"""A stream's answers held to what was read, over drawn chains of restarts (issue 57, deliverable).

A `StreamingIterator` over a stream with its own state (a counting stream, and a Hugging Face one when
`datasets` is installed) is read in segments: each restores the latest step (the Orbax handler), reads
and saves some elements, reads a few more that are lost with its process. Over what was trained:
no duplicate, no skip; every step's saved position (`records_read`, as `ckpt-iter inspect` reads it
from the state) is the records trained up to it; `verify` passes the honest root and `audit` proves
every resume; and a step whose position is moved back with no resume is refused by `audit`, as an
edited source state is by `verify` and the restore alike.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import hypothesis
from hypothesis import strategies as st
import numpy as np

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib

import support

_RECORDS = 60


class _Counting:
  """A stream of `_RECORDS` records whose state is the next record (and a layer name, as real ones have)."""

  def __init__(self):
    self.next = 0

  def __iter__(self):
    while self.next < _RECORDS:
      self.next += 1
      yield {"id": self.next - 1}

  def state_dict(self):
    return {"next": self.next, "layer": "counting"}

  def load_state_dict(self, state):
    self.next = state["next"]


_cli = support.cli_output


def _ids(element) -> list[int]:
  return np.atleast_1d(np.asarray(element["id"])).tolist()


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(batch=st.sampled_from([None, 1, 3, 4]),
                  segments=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 2)), min_size=1, max_size=4))
def test_a_streams_saved_positions_verify_and_audit_are_what_was_read(batch, segments):
  root = tempfile.mkdtemp(prefix="stream-answers-")
  try:
    trained: list[int] = []
    saved_at: dict[int, int] = {}  # step -> records trained up to it
    step = 0
    for saves, lost in segments:
      iterator = ckpt_iter.StreamingIterator(_Counting(), batch_size=batch)
      if step:
        checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(os.path.join(root, str(step), "data"),
                                                                ckpt_iter.IteratorRestore(iterator))
      for _ in range(saves):
        try:
          trained += _ids(next(iterator))
        except StopIteration:
          break
        step += 1
        item = os.path.join(root, str(step), "data")
        os.makedirs(item)
        checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))
        saved_at[step] = len(trained)
      for _ in range(lost):
        next(iterator, None)  # read, then lost with the process
    hypothesis.assume(saved_at)
    assert trained == list(range(len(trained)))  # no duplicate, no skip: the stream's own order
    for number, records in saved_at.items():
      code, text = _cli("inspect", root, "--step", str(number), "--json")
      assert code == 0, text
      position = json.loads(text)["processes"][0]["position"]
      assert position["records_read"] == records, (number, position)
    assert _cli("verify", root)[0] == 0
    code, text = _cli("audit", root, "--json")
    report = json.loads(text)
    restarts = sum(1 for number, (saves, _) in enumerate(segments) if number and saves) if len(saved_at) > 1 else 0
    assert code == 0 and report["verdict"] == "ok" and report["proven_exact"] == report["resumes"], report
    assert report["resumes"] <= restarts
    hypothesis.event(f"resumes proven: {report['proven_exact']}")
    # The last step's position moved back with no resume: audit says so (it said "unbroken" before).
    last = max(saved_at)
    if last > 1 and saved_at[last] > saved_at[last - 1]:
      header_path = os.path.join(root, str(last), "data", "process_0-of-1.json")
      header = json.load(open(header_path))
      header["position"]["records_read"] = saved_at[last - 1] - 1 if saved_at[last - 1] else 0
      header["position"]["elements_read"] = min(header["position"]["elements_read"],
                                                header["position"]["records_read"])
      json.dump(header, open(header_path, "w"))
      code, text = _cli("audit", root, "--json")
      assert code != 0 and json.loads(text)["verdict"] == "broken", text
      hypothesis.event("a position moved back: refused by audit")
  finally:
    shutil.rmtree(root, ignore_errors=True)
