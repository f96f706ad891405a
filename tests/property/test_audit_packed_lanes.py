"""The audit proves a packed pipeline's resumes at another process count exact.

A packed (or filtered) make_dataset keeps each lane's position per process, so
a restore by another count re-slices the positions: the resume's record must
digest the state as saved (process 0's, which the audit reads at that step),
not the re-sliced one, or every such honest resume reads as broken. Drawn:
chains of process counts dividing the lanes, each segment saving some steps
and losing some batches after its last save (a preemption).
"""

from __future__ import annotations

import json
import tempfile

import hypothesis
from hypothesis import strategies as st

import ckpt_iter
import support

NUM_LANES = 4
GLOBAL_BATCH = 4
RECORDS = [{"id": i} for i in range(48)]


def _pipeline(count: int, index: int, global_batch: int, *, skip=None):
  return ckpt_iter.make_dataset(
      RECORDS, batch_size=global_batch // count, seed=3, num_epochs=None, shard_index=index, shard_count=count,
      pack=lambda records: records.filter(lambda r: r["id"] % 5), num_lanes=NUM_LANES, chunk_size=4, skip=skip)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(0, 2)),
                           min_size=2, max_size=4))
def test_every_resume_of_a_packed_pipeline_at_another_count_is_proven_exact(segments):
  with tempfile.TemporaryDirectory() as root:
    support.run_chain(root, [(count, GLOBAL_BATCH, saved, lost, None) for count, saved, lost in segments],
                      make=_pipeline)
    code, text = support.cli_output("audit", root, "--json")
    report = json.loads(text)
    assert code == 0, text
    assert report["proven_exact"] >= len(segments) - 1 > 0
    assert not [f for f in report["findings"] if f["verdict"] != "ok"], text
