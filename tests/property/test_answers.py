"""Every answer about the data is the data (issue 47): `ckpt_iter.which`, `ckpt-iter which --json`
and `ckpt-iter order` against what a chain of restarts actually yielded.

A chain is drawn: segments with their process count, global batch, batches
saved, batches read past the last save (lost to the kill), a skip declared
once, a mixture reweighted, with a source added or removed; under Grain's
shuffle or the shard-aware one (make_dataset(shuffle="shards"), with shard lanes too). At every saved
step the Python API (with the pipeline that wrote the step), the CLI's
`which --step --json` and the batch the chain read must be the same records;
`order`'s rows must be the kept batches, in order; `verify` and `audit` pass
the honest root. Then the steps the run
resumed from are deleted (as Orbax's max_to_keep does) and `order` must
still be the same: a state's lineage records where each segment started (its
record, batch size, process count and, for a mixture, its shares and ledger).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile

import hypothesis
import pytest
from hypothesis import strategies as st

import ckpt_iter
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import errors
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter.cli import _which

import support

COUNTS: collections.Counter = collections.Counter()
_OFFSET = {"": 0, "a": 1000, "b": 2000}  # support.CHAIN_SOURCES' ids: 1000 + index in a, 2000 + in b
# {"b": 2, "a": 1} <-> {"b": 2}: a source added or removed where the shares' gcd moves (b: 2 -> 1).
_MIXTURES = [None, {"a": 1, "b": 1}, {"a": 3, "b": 1}, {"a": 1}, {"b": 2, "a": 1}, {"b": 2}]
# Grain's shuffle, or the shard-aware one (shards of 4 records, 2 to a window): the answers are the same code.
_LANE_RECORDS = [{"id": i} for i in range(24)]  # epochs of whole global batches: a restore can be at an epoch's start
_SHUFFLES = {"global": {}, "shards": {"shuffle": "shards", "shard_size": 4, "shuffle_window": 2},
             # Shard lanes: 2 lanes of 3 rows (a global batch of 6), or of 6 (12) after the documented change of
             # the global batch at an epoch's first record (allow_drift={"shuffle_lane_rows"}).
             "lanes": {"shuffle": "shards", "shard_size": 4, "shuffle_window": 2, "shard_lanes": 2,
                       "records": _LANE_RECORDS}}
_LANES_GLOBAL_BATCHES = (6, 12)


@st.composite
def _chains(draw, mixed: bool):
  segments = []
  # A chain that keeps epochs' short batches (drop_remainder=False, one process: make_dataset's rule) may
  # draw global batches larger than an epoch (support.CHAIN_RECORDS has 23 records).
  short = not mixed and draw(st.booleans())
  for number in range(draw(st.integers(2, 4))):
    count = 1 if short else draw(st.sampled_from([1, 2, 3]))
    per_process = draw(st.sampled_from([1, 3, 24, 30])) if short else draw(st.integers(1, 3))
    skip = None
    if number and not mixed and draw(st.booleans()):
      start = draw(st.integers(0, 60))
      skip = [(start, start + draw(st.integers(1, 8)))]
    mixture = draw(st.sampled_from(_MIXTURES[1:])) if mixed else None
    segments.append((count, count * per_process, draw(st.integers(1, 3)), draw(st.integers(0, 2)), skip, mixture,
                     not short))
  return segments


@st.composite
def _lane_chains(draw):
  """Chains of a lanes pipeline: any process count dividing the global batch (dividing the lanes or not),
  and, drawn, the global batch changed at an epoch's first record (6 <-> 12), where a segment then ends."""
  segments = []
  changes = draw(st.booleans())
  global_batch, read = _LANES_GLOBAL_BATCHES[0], 0  # records read up to the segment's last save
  for number in range(draw(st.integers(2, 4))):
    if changes and number and read and read % len(_LANE_RECORDS) == 0:
      global_batch = sum(_LANES_GLOBAL_BATCHES) - global_batch
    skip = None
    if number and not changes and draw(st.booleans()):
      start = draw(st.integers(0, 60))
      skip = [(start, start + draw(st.integers(1, 8)))]
    saved = draw(st.integers(1, 3))
    to_epoch_end = (len(_LANE_RECORDS) - read % len(_LANE_RECORDS)) // global_batch
    if changes and (len(_LANE_RECORDS) - read % len(_LANE_RECORDS)) % global_batch == 0 and draw(st.booleans()):
      saved = to_epoch_end  # the segment ends at an epoch's end: the next one may change the global batch
    read += saved * global_batch
    count = draw(st.sampled_from([c for c in (1, 2, 3, 4, 6) if global_batch % c == 0]))
    segments.append((count, global_batch, saved, draw(st.integers(0, 2)), skip, None, True))
  return segments


def _run(root: str, segments, shuffle: str = "global", restored: list | None = None
         ) -> tuple[list[list[int]], list[tuple[int, object]]]:
  """The chain (support.run_chain with a mixture per segment); returns the kept batches and, per step,
  the arguments of the pipeline that wrote it. `restored` gets, per restore, (the step restored, process
  0's state right after it, its pipeline, whether the restore changed the mixture)."""
  kept, writers, step = [], [], 0
  for number, (count, global_batch, saved, lost, skip, mixture, *rest) in enumerate(segments):
    drop = rest[0] if rest else True
    make = lambda i: support.chain_pipeline(count, i, global_batch, skip=skip, mixture=mixture, drop=drop,
                                            **_SHUFFLES[shuffle])
    iterators = [ckpt_iter.DataIterator(make(i)) for i in range(count)]
    if number and step:
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
            os.path.join(root, str(step), "data"),
            ckpt_iter.IteratorRestore(iterator, elastic=True,
                                      allow_drift={"weights", "sources", "shuffle_lane_rows"}))
      if restored is not None:
        restored.append((step, iterators[0].state(), make(0), segments[number - 1][5] != mixture))
    for _ in range(saved):
      try:
        batches = [next(iterator) for iterator in iterators]
      except StopIteration:
        break
      kept.append([r for batch in batches for r in support.batch_ids(batch)])
      step += 1
      item = os.path.join(root, str(step), "data")
      os.makedirs(item)
      for index, iterator in enumerate(iterators):
        checkpoint_lib.IteratorCheckpointHandler(index, count).save(item, ckpt_iter.IteratorSave(iterator))
      writers.append((step, (global_batch, mixture, drop)))
    for _ in range(lost):
      for iterator in iterators:
        next(iterator, None)
  return kept, writers


def _ids(batch) -> list[int]:
  return [_OFFSET[r.source] + r.index for r in batch.records]


_cli = support.cli_output


def _order(root: str, out: str, *extra: str) -> list[list[int]]:
  code, text = _cli("order", root, "--out", out, *extra)
  assert code == 0, text
  with open(out, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return [[_OFFSET[name or ""] + index for index, name in zip(row["records"], row.get("sources") or [None] * len(row["records"]))]
          for row in rows]


def _removes_a_source(segments) -> bool:
  """Whether an earlier segment mixed a source the last one does not (its shard layout is then only in the
  steps' states)."""
  earlier = set().union(*(set(segment[5] or ()) for segment in segments[:-1]))
  return bool(earlier - set(segments[-1][5] or ()))


def _check(segments, shuffle: str = "global") -> bool:
  root = tempfile.mkdtemp(prefix="answers-")
  try:
    restored: list = []
    kept, writers = _run(root, segments, shuffle, restored)
    if not kept:
      return False
    by_step = {step: batch for (step, _), batch in zip(writers, kept)}
    for step, state, pipeline, mixture_changed in restored:
      # Right after a restore, before a batch is read: the last batch the run before it read.
      try:
        assert _ids(ckpt_iter.which(pipeline, state)) == by_step[step], f"right after the restore of step {step}"
        COUNTS["which right after a restore"] += 1
      except errors.InvalidStateError as e:
        assert mixture_changed and f"which --step {step}" in str(e), str(e)
        COUNTS["which right after a reweighting restore: refused naming the step"] += 1
    layout = inspection.find_layout(root)
    states = _which.States(layout)
    for (step, (global_batch, mixture, drop)), trained in zip(writers, kept):
      api = _ids(ckpt_iter.which(support.chain_pipeline(1, 0, global_batch, mixture=mixture, drop=drop,
                                                        **_SHUFFLES[shuffle]), states[step]))
      if global_batch > len(support.CHAIN_RECORDS):
        COUNTS["steps of a global batch larger than an epoch"] += 1
      code, text = _cli("which", root, "--step", str(step), "--json")
      assert code == 0, text
      answer = json.loads(text[:text.rindex("}") + 1])
      cli_ids = [_OFFSET[row["source"]] + row["index"] for row in answer["rows"]]
      assert api == cli_ids == trained, f"step {step}: api {api}, cli {cli_ids}, trained {trained}"
      COUNTS["steps"] += 1
    assert _order(root, os.path.join(root, "order.jsonl")) == kept
    # Another process's view of the same run: a step its index did not write (fewer processes) is read for
    # the stream it shares, never taken for one deleted.
    last_count = len([n for n in os.listdir(os.path.join(root, str(writers[-1][0]), "data"))
                      if n.startswith("process_") and n.endswith(".json")])
    if last_count > 1:
      assert _order(root, os.path.join(root, "order-p.jsonl"), "--process", str(last_count - 1)) == kept
      COUNTS["orders of another process"] += 1
    if len({segment[1] for segment in segments}) > 1 and shuffle == "lanes":
      COUNTS["lanes chains whose global batch changed at an epoch's start"] += 1
    for verb in ("verify", "audit"):  # an honest root passes both
      code, text = _cli(verb, root)
      assert code == 0, f"{verb}: {text}"
    # Every resume the chain drew continues the same stream (a batch, a process count, a mixture's weights
    # or sources, skips, the lanes' rows at an epoch's start): the audit proves each by the restore's rule.
    code, text = _cli("audit", root, "--json")
    report = json.loads(text[:text.rindex("}") + 1])
    assert report["resumes"] == report["proven_exact"], report["findings"]
    COUNTS["resumes proven by the audit"] += report["proven_exact"]
    resumed_from = {w[0] for w in writers} - {writers[-1][0]}
    if resumed_from:
      for step in resumed_from:  # what max_to_keep leaves: the latest step only
        shutil.rmtree(os.path.join(root, str(step)))
      if shuffle == "shards" and _removes_a_source(segments):
        # The one case a resume record cannot answer: a removed source's shard layout is only in its
        # step's state. The refusal names the way to keep the steps.
        code, text = _cli("order", root, "--out", os.path.join(root, "order-latest.jsonl"))
        assert code == 1 and "KeepResumedSteps" in text, text
        COUNTS["orders refused naming KeepResumedSteps"] += 1
      else:
        assert _order(root, os.path.join(root, "order-latest.jsonl")) == kept
        code, text = _cli("which", root, "--step", str(writers[-1][0]), "--json")
        assert code == 0, text
        answer = json.loads(text[:text.rindex("}") + 1])
        assert [_OFFSET[row["source"]] + row["index"] for row in answer["rows"]] == kept[-1]
        COUNTS["orders and the latest step's which from the lineage alone"] += 1
    COUNTS["chains"] += 1
    return True
  finally:
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("shuffle", ["global", "shards"])
@pytest.mark.parametrize("mixed", [False, True], ids=["single", "mixture"])
@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(data=st.data())
def test_which_api_cli_and_order_are_what_was_read(mixed, shuffle, data):
  hypothesis.assume(_check(data.draw(_chains(mixed), label="segments"), shuffle))


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", ["global", "shards"])
@pytest.mark.parametrize("mixed", [False, True], ids=["single", "mixture"])
@hypothesis.settings(max_examples=120, deadline=None)
@hypothesis.given(data=st.data())
def test_which_api_cli_and_order_are_what_was_read_long(mixed, shuffle, data):
  hypothesis.assume(_check(data.draw(_chains(mixed), label="segments"), shuffle))


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(data=st.data())
def test_which_api_cli_and_order_are_what_a_lanes_pipeline_read(data):
  hypothesis.assume(_check(data.draw(_lane_chains(), label="segments"), "lanes"))


@pytest.mark.slow
@hypothesis.settings(max_examples=120, deadline=None)
@hypothesis.given(data=st.data())
def test_which_api_cli_and_order_are_what_a_lanes_pipeline_read_long(data):
  hypothesis.assume(_check(data.draw(_lane_chains(), label="segments"), "lanes"))


def test_the_issue_66_cases_answer_what_was_read():
  """issue 66 items 1-4: a lanes pipeline's global batch changed at an epoch's first record, its resumed-from
  steps then deleted; a mixture whose source is removed as the process count grows, read as process 1."""
  COUNTS.clear()
  assert _check([(1, 6, 4, 0, None, None, True), (2, 12, 3, 1, None, None, True), (3, 12, 1, 0, None, None, True)],
                "lanes")
  assert _check([(1, 4, 1, 0, None, {"a": 1, "b": 1}, True), (2, 4, 2, 0, None, {"a": 1}, True)], "shards")
  assert COUNTS["lanes chains whose global batch changed at an epoch's start"] == 1
  assert COUNTS["orders of another process"] == 2 and COUNTS["resumes proven by the audit"] == 3


def test_the_issue_cases_answer_what_was_read():
  """The cases of issue 47 (1, 2): batch 2 then 4 inside an epoch; G 6 -> 12 on 2 processes; a mixture
  source removed at a restart."""
  assert _check([(1, 2, 1, 0, None, None), (1, 4, 2, 0, None, None)])
  assert _check([(2, 6, 2, 0, None, None), (2, 12, 2, 0, None, None)])
  assert _check([(1, 4, 2, 0, None, {"a": 1, "b": 1}), (1, 4, 2, 0, None, {"a": 1})])
  print(dict(COUNTS))
