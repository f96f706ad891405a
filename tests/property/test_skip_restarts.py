"""Skips survive resumes: the trained stream is the uninterrupted one minus exactly the skipped records.

One property draws a run of chained restarts (tests/support.py `run_chain`):
each segment has its own process count (1, 2 or 4), global batch (4 or 8),
batches saved and batches read after the last save (lost: read again by the
next segment), and may declare skip ranges (`make_dataset(skip=...)`) at its
restart; later segments do not declare them again (a segment that saves
nothing leaves them in no state: the next one restores without them). Each "process" is an
iterator saved into and restored from real item files by the Orbax handler
(elastic, so the count changes).

The oracle is built without restarts: the uninterrupted single-process
stream, minus the skips the run must hold (each segment's declared ranges
from its restored position on: what was read before was trained), cut into
the segments' global batches by the documented rule (batches keep to their
epoch; a rest shorter than the batch is dropped). The property: what the run
trained equals the oracle, batch for batch; the last state holds exactly those
skips; the data map (`ckpt_iter.datamap`) names every batch the run trained;
and the records each skip named were never trained after it was declared.
"""

import collections
import glob
import tempfile

import hypothesis
from hypothesis import strategies as st
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import datamap
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter.cli import _which
from ckpt_iter import skips as skips_lib
import support

EPOCH = len(support.CHAIN_RECORDS)
EPOCHS = 4  # support.chain_pipeline's num_epochs
COUNTS = collections.Counter()


@st.composite
def _runs(draw):
  segments = []
  for number in range(draw(st.integers(2, 5), label="segments")):
    global_batch = draw(st.sampled_from([4, 8]))
    count = draw(st.sampled_from([n for n in (1, 2, 4) if global_batch % n == 0]))
    skip = None
    if number and draw(st.booleans()):
      ranges = draw(st.lists(st.tuples(st.integers(0, EPOCH * EPOCHS - 1), st.integers(1, 9)), min_size=1,
                             max_size=2))
      skip = [(a, a + n) for a, n in ranges]
    segments.append((count, global_batch, draw(st.integers(0, 3), label="saved"), draw(st.integers(0, 2)), skip))
  return segments


def _stream():
  """The uninterrupted single-process stream: record id at each stream position."""
  iterator = ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 1))
  return [support.batch_ids(batch)[0] for batch in iterator]


_STREAM = []


def _oracle(segments):
  """(the batches the run must train, the skips its last state must hold, whether the stream ends,
  the restores that kept skips declared before them), without restarts."""
  stream = _STREAM or _STREAM.extend(_stream()) or _STREAM
  skips, batches, kept_over = skips_lib.NO_SKIPS, [], 0
  epoch, offset = 0, 0  # the next kept record: its epoch, and its offset among the epoch's kept records
  position = 0  # the stream record after the last batch trained
  for number, (count, global_batch, saved, _, skip) in enumerate(segments):
    del count
    kept_over += bool(number and batches and skips)
    if skip and saved:  # a segment that saves nothing leaves no state: the next restores without its skips
      declared, _ = skips_lib.resolve(skips_lib.Skip(records=skip), from_record=position, epoch_length=EPOCH,
                                   shuffled=True, mixture=False, origin="oracle")
      skips = skips.union(declared)
    for _ in range(saved):
      kept = [g for g in range(epoch * EPOCH, (epoch + 1) * EPOCH) if not skips.skipped(g, EPOCH)]
      if len(kept) - offset < global_batch:  # the epoch's rest is dropped
        epoch, offset = epoch + 1, 0
        kept = [g for g in range(epoch * EPOCH, (epoch + 1) * EPOCH) if not skips.skipped(g, EPOCH)]
      if epoch >= EPOCHS:
        return batches, skips, True, kept_over
      batch = kept[offset:offset + global_batch]
      batches.append([stream[g] for g in batch])
      offset += global_batch
      position = batch[-1] + 1
  return batches, skips, False, kept_over


def _check(segments, expected, skips, kept_over):
  with tempfile.TemporaryDirectory() as root:
    trained = support.run_chain(root, segments)
    assert trained == expected
    if not trained:
      return
    last = sorted(glob.glob(f"{root}/{len(trained)}/data/process_0-of-*.json"))[0]
    saved = skips_lib.Skips.from_text(_files.read_header(last)["fingerprint"].get("skips"), origin=last)
    assert saved == skips
    layout = inspection.find_layout(root)
    run = datamap.RunMap.from_states(_which.States(layout), layout.steps[-1])
    assert [[r.index for r in b.records] for b in run.batches()] == trained
  COUNTS.update({"runs": 1, "batches": len(trained), "skip ranges": len(skips),
                 "records skipped": skips_lib.count(skips.records), "restores that kept skips": kept_over,
                 "runs whose skips survived 2+ restores": int(kept_over >= 2)})


def _property(segments):
  expected, skips, ends, kept_over = _oracle(segments)
  hypothesis.assume(not ends)  # the stream has no more epochs: not this property's concern
  _check(segments, expected, skips, kept_over)


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(data=st.data())
def test_skips_survive_chained_restarts(data):
  _property(data.draw(_runs(), label="segments"))


@pytest.mark.slow
@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(data=st.data())
def test_skips_survive_chained_restarts_long(data):
  _property(data.draw(_runs(), label="segments"))


def test_a_skip_survives_two_resumes_and_the_counts_are_reported():
  """A fixed run: skip declared at the first restart, two more restarts (4, 2 and 1 processes) keep it."""
  segments = [(1, 4, 2, 1, None), (4, 8, 2, 0, [(14, 20)]), (2, 4, 2, 1, None), (1, 8, 2, 0, None)]
  expected, skips, ends, kept_over = _oracle(segments)
  assert not ends and skips == skips_lib.Skips.of([(14, 20)]) and kept_over == 2  # restored twice after it
  _check(segments, expected, skips, kept_over)
  print({k: v for k, v in sorted(COUNTS.items())})
