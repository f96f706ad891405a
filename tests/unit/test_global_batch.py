"""Tests for ckpt_iter._global_batch: make_dataset's node, its batches, its restore and its pipeline's fingerprint.

Each process's batch is its rows of the global batch, with skips too; the
pipeline's fingerprint holds the node's spec fields once (`describe_pipeline`);
a restore checks the full batch that ended at the restored record, keeps the
saved skips and adds the declared ones from its position on, saying which were
already read (`merged_skips`), refuses a state's skips as it refuses a declared
skip (`check_node_can_skip`), and under other Grain steps the node yields None
for a skipped record (`pipeline_nodes`). make_dataset's argument checks and
sources are tests/unit/test_dataset.py's.
"""

import itertools
import json
import os

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _global_batch
from ckpt_iter import testing
import support


# ---------------------------------------------------------------------------
# The global batch: each process's rows of it (`BatchPlan.rows`).


@hypothesis.given(
    count=st.integers(1, 40), batch_size=st.integers(1, 4), shard_count=st.integers(1, 4),
    seed=st.one_of(st.none(), st.integers(0, 1000)), num_epochs=st.integers(1, 2),
)
@hypothesis.settings(max_examples=40)
def test_shards_partition_the_global_batch(count, batch_size, shard_count, seed, num_epochs):
  # dataset.py's documented design: shard i holds rows [i*B, (i+1)*B) of each
  # global batch of B*shard_count, so resuming with another shard count is exact.
  hypothesis.assume(count >= batch_size * shard_count)
  records = support.sample_records(count)
  global_ds = support.make_dataset(records, batch_size=batch_size * shard_count, seed=seed, num_epochs=num_epochs)
  shards = [
      support.make_dataset(records, batch_size=batch_size, seed=seed, num_epochs=num_epochs,
                           shard_index=i, shard_count=shard_count)
      for i in range(shard_count)
  ]
  assert all(len(shard) == len(global_ds) for shard in shards)
  for t in range(len(global_ds)):
    rows = [shard[t] for shard in shards]
    assert all(len(r["id"]) == batch_size for r in rows)
    joined = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
    testing.assert_trees_equal([joined], [global_ds[t]])


@pytest.mark.parametrize("arguments", [
    dict(seed=3, skip=[(5, 11), (40, 41)]),
    dict(seed=None, skip=ckpt_iter.Skip(records=[(5, 11)], source_records=[(20, 23)])),
    dict(seed=3, weights={"a": 2, "b": 1}, skip=[(5, 11)]),
])
def test_with_skips_each_process_reads_its_rows_of_the_global_batch(arguments):
  """Each of 4 processes' batches (`BatchPlan.rows`) are its rows of the 1-process run's global batches."""
  records = [{"id": i} for i in range(50)]
  source = {"a": records, "b": records[:20]} if "weights" in arguments else records
  whole = support.make_dataset(source, batch_size=8, shard_index=0, shard_count=1, num_epochs=3, **arguments)
  parts = [support.make_dataset(source, batch_size=2, shard_index=i, shard_count=4, num_epochs=3, **arguments)
           for i in range(4)]
  assert len(whole) == len(parts[0]) > 5
  for index in range(len(whole)):
    assert np.concatenate([part[index]["id"] for part in parts]).tolist() == whole[index]["id"].tolist()


# ---------------------------------------------------------------------------
# The pipeline's fingerprint (`describe_pipeline`).


def _per_batch(batch):
  return batch


def test_make_dataset_spec_fields_are_not_repeated_under_its_node(make_pipeline):
  fields = _global_batch.describe_pipeline(make_pipeline().map(_per_batch))
  assert fields["pipeline"] == "MapMapDataset"  # the meaning elastic.resize_refusal parses
  assert fields["graph"] == "MapMapDataset<GlobalBatchDataset"
  assert not [k for k in fields if k.startswith("node[1].")]
  assert fields["seed"] == 7


# ---------------------------------------------------------------------------
# Its restore (`check_record_restore`): the batch before, the skips it keeps and adds (`merged_skips`).


def _chain_restore(root, step, iterator, **args):
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(os.path.join(root, str(step), "data"),
                                                         ckpt_iter.IteratorRestore(iterator, **args))


def test_a_same_size_restore_after_a_batch_size_change_checks_the_batch_that_ended_the_epoch(tmp_path):
  # 23 records: batches of 4 to record 8, then of 5 from 8: 8-12, 13-17, 18-22 end epoch 0 exactly. The
  # batch before record 23 is 18-22, not the 15-19 batches of 5 from the epoch's first record would give.
  root = str(tmp_path)
  support.run_chain(root, [(1, 4, 2, 0, None), (1, 5, 3, 0, None)])
  resumed = ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 5))
  _chain_restore(root, 5, resumed)
  assert resumed.restored_content_check.startswith("same element")


def test_skips_declared_at_a_restore_apply_from_its_position_and_every_later_restore_keeps_them(tmp_path, caplog):
  root = str(tmp_path)
  kept = support.run_chain(root, [(1, 4, 2, 0, None), (1, 4, 2, 0, [(4, 10), (12, 14)]), (2, 4, 2, 0, None)])
  caplog.set_level("INFO", logger="ckpt_iter")
  state = json.load(open(os.path.join(root, "6", "data", "process_0-of-2.json")))
  assert json.loads(state["fingerprint"]["skips"]) == {"records": [[8, 10], [12, 14]]}  # 4-7 were read
  # The uninterrupted stream minus the skipped records, cut in batches of 4 that keep to their epoch.
  stream = [r for batch in ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 1)) for r in support.batch_ids(batch)]
  expected = []
  for epoch in range(2):
    kept_epoch = [stream[g] for g in range(23 * epoch, 23 * (epoch + 1)) if not (8 <= g < 10 or 12 <= g < 14)]
    expected += kept_epoch[:len(kept_epoch) // 4 * 4]
  assert [r for batch in kept for r in batch] == expected[:24]


def test_a_declared_skip_already_read_is_said_and_not_applied(tmp_path, caplog):
  root = str(tmp_path)
  support.run_chain(root, [(1, 4, 2, 0, None)])
  caplog.set_level("INFO", logger="ckpt_iter")
  resumed = ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 4, skip=[(2, 12)]))
  _chain_restore(root, 2, resumed)
  assert json.loads(resumed.fingerprint["skips"]) == {"records": [[8, 12]]}
  assert "declared skip of stream records [2, 8) not applied: they were read before the restored position" in caplog.text
  assert "skips added at this restore: stream records [8, 12) (4 records)" in caplog.text
  # Not (fully) applied is a WARNING (shown by default, issue 60 item 6); what was added stays INFO.
  levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records if r.name == "ckpt_iter"}
  assert levels["declared skip of stream records [2, 8) not applied"] == "WARNING"
  assert levels["skips added at this restore"] == "INFO"


def test_source_records_of_an_unshuffled_source_are_skipped_in_every_epoch_from_the_restart(tmp_path):
  root = str(tmp_path)
  support.run_chain(root, [(1, 4, 1, 0, None)], seed=None)
  resumed = ckpt_iter.DataIterator(support.chain_pipeline(1, 0, 4, seed=None, skip=ckpt_iter.Skip(
      source_records=[(2, 3), (6, 9)])))
  _chain_restore(root, 1, resumed)
  read = [r for batch in itertools.islice(resumed, 12) for r in support.batch_ids(batch)]
  assert read[:4] == [4, 5, 9, 10] and read[16:20] == [0, 1, 3, 4]  # epoch 1 skips them too
  assert not {2, 6, 7, 8} & set(read)
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as info:
    support.chain_pipeline(1, 0, 4, seed=3, skip=ckpt_iter.Skip(source_records=[(2, 3)]))
  assert "shuffled" in str(info.value) and "stream_records" in str(info.value)


def _hundred(seed=None, batch_size=4, skip=None, **arguments):
  return ckpt_iter.make_dataset([{"id": i} for i in range(100)], batch_size=batch_size, seed=seed,
                                num_epochs=None, shard_index=0, shard_count=1, skip=skip, **arguments)


def _state_after_a_batch(pipeline, skips=None):
  """The state after one batch of `pipeline`, its `skips` field replaced by `skips` (a dict) when given."""
  saved = ckpt_iter.DataIterator(pipeline)
  next(saved)
  state = saved.get_state()
  if skips is not None:
    state["fingerprint"]["skips"] = json.dumps(skips)
  return state


@pytest.mark.parametrize("seed, skips, error, fragments", [
    (3, {"every_epoch": [[0, 100, 36]]}, ckpt_iter.UnsupportedConfigError,
     ["fingerprint field 'skips' (source records [0, 100) of every epoch from stream record 36)",
      "needs a single unshuffled source", "seed is set"]),
    (None, {"every_epoch": [[0, 10**30, 36]]}, ckpt_iter.InvalidStateError,
     ["fingerprint field 'skips'", f"[(0, {10**30})] of every epoch, past the source's 100 records",
      "restore another step"]),
    (None, {"every_epoch": [[98, 101, 0]]}, ckpt_iter.InvalidStateError, ["past the source's 100 records"]),
    (None, {"every_epoch": [[0, 98, 36]]}, ckpt_iter.UnsupportedConfigError,
     ["fingerprint field 'skips'", "leaves 2 of the source's 100 records per epoch, fewer than one global batch of 4",
      "Restore it with a global batch of at most 2"]),
])
def test_a_restored_skips_field_is_checked_as_a_declared_skip_is(seed, skips, error, fragments):
  state = _state_after_a_batch(_hundred(seed), skips)
  resumed = ckpt_iter.DataIterator(_hundred(seed))
  with pytest.raises(error) as info:
    resumed.set_state(state)
  assert all(fragment in str(info.value) for fragment in fragments), str(info.value)


def test_skips_that_leave_less_than_a_batch_only_with_this_restore_are_refused_naming_the_cause():
  # Written with batches of 2 and 3 records kept per epoch: a restore with batches of 4 cannot continue it.
  state = _state_after_a_batch(_hundred(batch_size=2, skip=ckpt_iter.Skip(source_records=[(0, 97)])))
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as info:
    ckpt_iter.DataIterator(_hundred()).set_state(state)
  assert "leaves 3 of the source's 100 records per epoch" in str(info.value)
  assert "global batch of at most 3" in str(info.value)
  # Each declaration leaves a batch, the saved and the declared together do not: the declaration is named.
  state = _state_after_a_batch(_hundred(skip=ckpt_iter.Skip(source_records=[(0, 50)])))
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.DataIterator(_hundred(skip=ckpt_iter.Skip(source_records=[(50, 98)]))).set_state(state)
  assert "skip=Skip(records=(), source_records=((50, 98),)) added to the state's skips (source records [0, 50)" in str(
      info.value)
  assert "leaves 2 of the source's 100 records per epoch" in str(info.value)


# ---------------------------------------------------------------------------
# Under other Grain steps (`pipeline_nodes`): one record per element, None for a skipped one.


def test_make_dataset_under_other_steps_skips_a_record_as_grains_filter_drops_one():
  def pipeline(skip=None):
    return (ckpt_iter.make_dataset(support.CHAIN_RECORDS, batch_size=1, seed=None, num_epochs=1, shard_index=0,
                                   shard_count=1, skip=skip).to_iter_dataset(support.NO_THREADS).batch(3))
  saved = ckpt_iter.DataIterator(pipeline(skip=[(4, 6)]))
  assert support.batch_ids(next(saved)) == [0, 1, 2] and support.batch_ids(next(saved)) == [3, 6, 7]
  resumed = ckpt_iter.DataIterator(pipeline())  # not declared again: the state carries them
  resumed.set_state(saved.get_state())
  assert support.batch_ids(next(resumed)) == [8, 9, 10]
  assert json.loads(resumed.fingerprint["skips"]) == {"records": [[4, 6]]}
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as info:
    ckpt_iter.DataIterator(ckpt_iter.make_dataset(support.CHAIN_RECORDS, batch_size=2, shard_index=0, shard_count=1,
                                                  skip=[(1, 2)]).to_iter_dataset(support.NO_THREADS).batch(2))
  assert "global batch of one record; this one has 2" in str(info.value)
