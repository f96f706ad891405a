"""make_dataset(shuffle="shards"): the dataset and the data map follow the one order.

The order itself (`_permutation.ShardShuffle`, a pure function of seed, epoch
and stream index) is tested in tests/unit/test_permutation.py. Here the
dataset and the data map (`ckpt_iter.which`) are held to that one function
across restarts under other batch sizes and process counts, and a restore into
another shuffle is refused by the field's name.
"""

import collections
import json
import os
import pathlib
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ckpt_iter
from ckpt_iter import _permutation
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import datamap
from ckpt_iter import dataset as dataset_lib
from ckpt_iter import errors
from ckpt_iter import sources
from ckpt_iter import state as state_lib
import support


def _epoch(order, epoch):
  return [order.source(epoch * order.length + p) for p in range(order.length)]


def test_the_order_pickles_without_its_caches_for_mp_prefetch_workers():
  order = _permutation.ShardShuffle(_permutation.block_offsets(41, 6), 3, 11)
  records = _epoch(order, 1)
  copy = pickle.loads(pickle.dumps(order))
  assert _epoch(copy, 1) == records and (copy.offsets, copy.window, copy.seed) == (order.offsets, 3, 11)
  pipeline = _pipeline()
  assert _ids(pipeline[5]) == _ids(pickle.loads(pickle.dumps(pipeline))[5])


# ---------------------------------------------------------------------------
# The dataset yields what the function names.

RECORDS = [{"id": i} for i in range(24)]


def _pipeline(count=1, index=0, global_batch=4, *, window=2, shard_size=5, shuffle="shards", records=RECORDS,
              num_epochs=3, **more):
  extra = {} if shuffle == "global" else dict(shuffle_window=window, shard_size=shard_size)
  return ckpt_iter.make_dataset(records, batch_size=global_batch // count, seed=7, num_epochs=num_epochs,
                                shard_index=index, shard_count=count, shuffle=shuffle, **extra, **more)


def _ids(batch):
  return [int(v) for v in np.asarray(batch["id"]).reshape(-1)]


def test_make_dataset_yields_the_records_the_function_names_epoch_after_epoch():
  yielded = [i for batch in ckpt_iter.DataIterator(_pipeline(global_batch=1)) for i in _ids(batch)]
  order = _permutation.ShardShuffle(_permutation.block_offsets(24, 5), 2, 7)
  assert yielded == [order.source(g) for g in range(3 * 24)]
  # ... and it is not Grain's full shuffle (which the default keeps, with no new fingerprint field).
  default = ckpt_iter.DataIterator(_pipeline(global_batch=1, shuffle="global"))
  assert [i for batch in default for i in _ids(batch)] != yielded
  fields = ckpt_iter.DataIterator(_pipeline(shuffle="global")).state().fingerprint
  assert not {_permutation.SHUFFLE_FIELD, _permutation.WINDOW_FIELD, _permutation.SHARDS_FIELD} & set(fields)


def test_the_shards_of_a_file_source_are_its_files(tmp_path):
  sizes = [7, 3, 9, 5, 1]
  paths, first = [], 0
  for number, size in enumerate(sizes):
    path = tmp_path / f"part-{number}.jsonl"
    path.write_text("".join(json.dumps({"id": first + i}) + "\n" for i in range(size)))
    paths.append(str(path))
    first += size
  (tmp_path / "part-9.jsonl").write_text("")  # an empty file is no shard
  pipeline = ckpt_iter.make_dataset(str(tmp_path / "part-*.jsonl"), batch_size=1, seed=3, num_epochs=1,
                                    shard_index=0, shard_count=1, shuffle="shards", shuffle_window=2)
  iterator = ckpt_iter.DataIterator(pipeline)
  yielded = [i for batch in iterator for i in _ids(batch)]
  assert iterator.state().fingerprint[_permutation.SHARDS_FIELD] == "7,3,9,5,1"
  files = np.cumsum([0] + sizes).tolist()
  order = _permutation.ShardShuffle(files, 2, 3)
  assert yielded == _epoch(order, 0)
  # A window's records are read before the next window's: at most two files open at a time.
  position = 0
  for shards in order.windows(0):
    span = sum(sizes[s] for s in shards)
    assert {order.shard_of(r) for r in yielded[position:position + span]} == set(shards)
    position += span


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "array_record"])
def test_every_file_kind_gives_its_files_as_shards(tmp_path, kind):
  sizes, paths, first = [4, 9, 2], [], 0
  for number, size in enumerate(sizes):
    rows = [{"id": first + i} for i in range(size)]
    path = str(tmp_path / f"part-{number}.{kind}")
    if kind == "jsonl":
      pathlib.Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":  # row groups of 3: a file's offset is its first group's
      pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    else:
      support.write_array_record(path, rows)
    paths.append(path)
    first += size
  records, _ = sources.resolve_source(paths)
  assert sources.file_offsets(records) == [0, 4, 13, 15]
  pipeline = ckpt_iter.make_dataset(paths, batch_size=1, seed=2, num_epochs=1, shard_index=0, shard_count=1,
                                    shuffle="shards", shuffle_window=2)
  yielded = [i for batch in ckpt_iter.DataIterator(pipeline) for i in _ids(batch)]
  assert yielded == _epoch(_permutation.ShardShuffle([0, 4, 13, 15], 2, 2), 0)


def test_a_filtered_pipeline_filters_the_shard_order():
  pipeline = _pipeline(global_batch=1, num_epochs=None, filter=lambda r: r["id"] % 3 != 0, chunk_size=4,
                       num_lanes=1)
  iterator = ckpt_iter.DataIterator(pipeline)
  yielded = [_ids(next(iterator))[0] for _ in range(30)]
  order = _permutation.ShardShuffle(_permutation.block_offsets(24, 5), 2, 7)
  assert yielded == [r for r in (order.source(g) for g in range(3 * 24)) if r % 3][:30]
  # which() names the records of the chunk the last row came from (the filter's input): that row among them.
  chunk = ckpt_iter.which(pipeline, iterator.state()).records
  assert yielded[-1] in [r.index for r in chunk]
  assert [r.index for r in chunk] == [order.source(r.stream_record) for r in chunk]


# ---------------------------------------------------------------------------
# One plan: the dataset and the data map agree across restarts (another batch size, another process count).

# (processes, global batch, batches read): 68 of the 72 records of 3 epochs of 24; every batch size divides 24.
SEGMENTS = [(1, 4, 3), (2, 6, 5), (3, 6, 2), (1, 2, 3), (4, 8, 1)]


def _save(directory, iterators):
  os.makedirs(directory)
  for index, iterator in enumerate(iterators):
    checkpoint_lib.IteratorCheckpointHandler(index, len(iterators)).save(directory, ckpt_iter.IteratorSave(iterator))


def test_which_names_what_was_read_across_chained_restarts_with_no_duplicate_or_skip(tmp_path):
  trained, step = [], None
  for number, (count, global_batch, batches) in enumerate(SEGMENTS):
    pipelines = [_pipeline(count, i, global_batch) for i in range(count)]
    iterators = support.pod_iterators(pipelines, step)
    for _ in range(batches):
      batch = [i for iterator in iterators for i in _ids(next(iterator))]
      trained.append(batch)
      for pipeline, iterator in zip(pipelines, iterators):
        answer = ckpt_iter.which(pipeline, iterator.state())
        assert [r.index for r in answer.records] == batch
        assert answer.batch_size == global_batch and answer.process_count == count
    step = str(tmp_path / str(number))
    _save(step, iterators)
  order = _permutation.ShardShuffle(_permutation.block_offsets(24, 5), 2, 7)
  flat = [i for batch in trained for i in batch]
  assert flat == [order.source(g) for g in range(len(flat))]
  # Per epoch: each record at most once (no duplicate), and every record of a finished epoch (no skip).
  per_epoch = [collections.Counter(flat[e * 24:(e + 1) * 24]) for e in range(len(flat) // 24 + 1)]
  assert all(max(c.values(), default=1) == 1 for c in per_epoch)
  assert all(len(c) == 24 for c in per_epoch[:len(flat) // 24])
  # The state alone (no pipeline) says the same.
  value = iterators[0].state()
  stream = datamap.RecordStream(value.fingerprint, value.position)
  assert [stream.source_of(g)[1] for g in range(len(flat))] == flat
  assert stream.source_indices(range(len(flat)))[0] == flat


def test_skipped_stream_records_are_passed_over_in_the_shard_order():
  order = _permutation.ShardShuffle(_permutation.block_offsets(24, 5), 2, 7)
  pipeline = _pipeline(global_batch=1, skip=[(4, 9)])
  yielded = [i for batch in ckpt_iter.DataIterator(pipeline) for i in _ids(batch)]
  assert yielded == [order.source(g) for g in range(3 * 24) if not 4 <= g < 9]


# ---------------------------------------------------------------------------
# A restore into another shuffle is refused, by the field's name.


@pytest.mark.parametrize("change, field", [
    (dict(window=3), _permutation.WINDOW_FIELD),
    (dict(shard_size=6), _permutation.SHARDS_FIELD),
    (dict(shuffle="global"), _permutation.SHUFFLE_FIELD),
])
def test_a_restore_into_another_shuffle_is_refused_naming_the_field(tmp_path, change, field):
  for number, (saved, restored) in enumerate(((_pipeline(), _pipeline(**change)),
                                              (_pipeline(**change), _pipeline()))):
    step = str(tmp_path / str(number))
    writer = ckpt_iter.DataIterator(saved)
    next(writer)
    _save(step, [writer])
    with pytest.raises(errors.ConfigDriftError) as info:
      checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(
          step, ckpt_iter.IteratorRestore(ckpt_iter.DataIterator(restored)))
    assert field in str(info.value)
    with pytest.raises(errors.ConfigDriftError) as info:
      ckpt_iter.which(restored, writer.state())
    assert field in str(info.value)


@pytest.mark.parametrize("arguments, fragment", [
    (dict(shuffle="window"), "must be one of ['global', 'shards']"),
    (dict(shuffle_window=4), "applies to shuffle=\"shards\" only"),
    (dict(shard_size=4), "applies to shuffle=\"shards\" only"),
    (dict(shuffle="shards", seed=None, shard_size=4), "needs a seed"),
    (dict(shuffle="shards"), "Pass shard_size=<records per shard> (e.g. shard_size=1: 24 shards"),
    (dict(shuffle="shards", shard_size=0), "shard_size=0 must be a positive integer"),
    (dict(shuffle="shards", shard_size=4, shuffle_window=0), "shuffle_window=0 must be a positive integer"),
])
def test_bad_shuffle_arguments_are_refused_with_the_fix(arguments, fragment):
  common = dict(batch_size=2, seed=1, shard_index=0, shard_count=1)
  with pytest.raises(errors.InvalidArgumentError) as info:
    ckpt_iter.make_dataset(RECORDS, **{**common, **arguments})
  assert fragment in str(info.value)


SOURCES = {"a": [{"id": 1000 + i} for i in range(17)], "b": [{"id": 2000 + i} for i in range(11)],
           "c": [{"id": 3000 + i} for i in range(13)]}


def _mixture(names, global_batch=4, count=1, index=0):
  return ckpt_iter.make_dataset({n: SOURCES[n] for n in names}, weights={n: 1 for n in names}, num_epochs=None,
                                batch_size=global_batch // count, seed=7, shard_index=index, shard_count=count,
                                shuffle="shards", shard_size=4, shuffle_window=2)


def test_each_source_of_a_mixture_reads_its_own_shard_order_across_an_added_source(tmp_path):
  iterator = ckpt_iter.DataIterator(_mixture("ab"))
  trained = [_ids(next(iterator)) for _ in range(5)]
  fields = iterator.state().fingerprint
  assert fields["shuffle_shards[a]"] == "4x4,1" and fields["shuffle_shards[b]"] == "4x2,3"
  assert [r.index + 1000 for r in ckpt_iter.which(_mixture("ab"), iterator.state()).records if r.source == "a"] == [
      i for i in trained[-1] if i < 2000]
  _save(str(tmp_path / "1"), [iterator])
  # Restored with a source added, by two processes and another batch size: each source continues its own order.
  restored = [ckpt_iter.DataIterator(_mixture("abc", 6, 2, i)) for i in range(2)]
  for index, it in enumerate(restored):
    checkpoint_lib.IteratorCheckpointHandler(index, 2).restore(
        str(tmp_path / "1"), ckpt_iter.IteratorRestore(it, elastic=True, allow_drift={"sources"}))
  for _ in range(6):
    trained.append([i for it in restored for i in _ids(next(it))])
  for name, base in (("a", 1000), ("b", 2000), ("c", 3000)):
    read = [i - base for batch in trained for i in batch if base <= i < base + 1000]
    order = _permutation.ShardShuffle(_permutation.block_offsets(len(SOURCES[name]), 4), 2,
                                      dataset_lib.source_seed(7, name))
    assert read == [order.source(g) for g in range(len(read))], name
  answer = ckpt_iter.which(_mixture("abc", 6, 2, 0), restored[0].state())
  assert [r.index + {"a": 1000, "b": 2000, "c": 3000}[r.source] for r in answer.records] == trained[-1]


def test_a_state_with_an_unknown_shuffle_kind_is_named():
  iterator = ckpt_iter.DataIterator(_pipeline())
  next(iterator)
  value = iterator.state()
  fingerprint = {**value.fingerprint, _permutation.SHUFFLE_FIELD: "rings"}
  with pytest.raises(errors.InvalidStateError, match="'shuffle' is 'rings'"):
    datamap.RecordStream(fingerprint, value.position)
  fingerprint = {**value.fingerprint, _permutation.SHARDS_FIELD: "5x4"}
  with pytest.raises(errors.InvalidStateError, match="summing to the source.s length 24"):
    datamap.RecordStream(fingerprint, value.position)


# -- a shuffle change at a restore: exact at an epoch boundary, refused inside one (issue 57 item 12) --


def _shard_pipeline(records, **kwargs):
  options = dict(batch_size=4, seed=1, shuffle="shards", shard_size=4, shuffle_window=2)
  options.update(kwargs)
  return ckpt_iter.make_dataset(records, **options)


@pytest.mark.parametrize("change", [{"shuffle_window": 3}, {"shuffle": "global", "shard_size": None,
                                                              "shuffle_window": None}])
def test_a_shuffle_change_inside_an_epoch_is_refused_even_when_allowed(change):
  records = [{"id": i} for i in range(48)]
  iterator = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=1))
  for _ in range(3):
    next(iterator)
  saved = iterator.state()
  changed = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=1, **change))
  names = set(state_lib.differing_fields(saved.fingerprint, changed.state().fingerprint))
  for allow in (set(), names):
    with pytest.raises(errors.ConfigDriftError) as caught:
      changed.restore_state(saved, allow_drift=allow)
    assert "cannot change inside an epoch (record 12 of epoch 0" in str(caught.value)
    assert "no allow_drift continues it" in str(caught.value)


def test_a_shuffle_change_at_an_epoch_boundary_is_exact_when_declared():
  records = [{"id": i} for i in range(48)]
  iterator = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2))
  first = [int(x) for _ in range(12) for x in next(iterator)["id"]]  # epoch 0, whole
  saved = iterator.state()
  changed = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2, shuffle_window=3))
  with pytest.raises(errors.ConfigDriftError, match=r"allow_drift=\{'shuffle_window'\}"):
    changed.restore_state(saved)
  changed.restore_state(saved, allow_drift={"shuffle_window"})
  second = [int(x) for batch in changed for x in batch["id"]]
  assert sorted(first) == sorted(second) == list(range(48))
  fresh = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2, shuffle_window=3))
  assert second == [int(x) for batch in list(fresh)[12:] for x in batch["id"]]


# ---------------------------------------------------------------------------
# Shard lanes (make_dataset(shard_lanes=V)): the fields, the refusals, a batch change.


@pytest.mark.parametrize("arguments, fragment", [
    (dict(shard_lanes=2), "shard_lanes=2 applies to shuffle=\"shards\" only"),
    (dict(shuffle="shards", shard_size=4, shard_lanes=0), "shard_lanes=0 must be an integer in [1, 1048576]"),
    (dict(shuffle="shards", shard_size=4, shard_lanes=3), "shard_lanes=3 does not divide the global batch of 4"),
    (dict(shuffle="shards", shard_size=4, shard_lanes=2, filter=lambda r: True), "with filter or pack"),
])
def test_bad_shard_lanes_are_refused_with_the_fix(arguments, fragment):
  with pytest.raises(errors.InvalidArgumentError) as info:
    ckpt_iter.make_dataset(RECORDS, **{**dict(batch_size=4, seed=1, shard_index=0, shard_count=1), **arguments})
  assert fragment in str(info.value)
  with pytest.raises(errors.InvalidArgumentError, match="shard_lanes=2 with weights"):
    ckpt_iter.make_dataset(SOURCES, weights={n: 1 for n in SOURCES}, batch_size=4, seed=1, shard_index=0,
                           shard_count=1, shuffle="shards", shard_size=4, shard_lanes=2)


def test_one_lane_is_the_pipeline_without_lanes_and_lanes_write_their_two_fields():
  plain, one = ckpt_iter.DataIterator(_pipeline()), ckpt_iter.DataIterator(_pipeline(shard_lanes=1))
  assert plain.state().fingerprint == one.state().fingerprint
  assert [_ids(b) for b in plain] == [_ids(b) for b in one]
  fields = ckpt_iter.DataIterator(_pipeline(shard_lanes=2)).state().fingerprint
  assert (fields[_permutation.LANES_FIELD], fields[_permutation.LANE_ROWS_FIELD]) == (2, 2)


def test_a_process_count_not_dividing_the_lanes_is_exact_and_says_what_it_downloads(caplog):
  pipelines = [_pipeline(3, i, global_batch=6, shard_lanes=2) for i in range(3)]
  assert "a process reads rows of up to 2 lanes, so its host downloads up to 2/2" in caplog.text
  whole = [_ids(_pipeline(1, 0, global_batch=6, shard_lanes=2)[k]) for k in range(8)]
  assert [[i for p in pipelines for i in _ids(p[k])] for k in range(8)] == whole


def test_a_global_batch_change_inside_an_epoch_is_refused_naming_the_lanes_way():
  records = [{"id": i} for i in range(48)]
  iterator = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2, shard_lanes=2))
  for _ in range(3):
    next(iterator)
  changed = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2, shard_lanes=2, batch_size=8))
  with pytest.raises(errors.ConfigDriftError) as caught:
    changed.restore_state(iterator.state(), allow_drift={_permutation.LANE_ROWS_FIELD})
  assert "shuffle_lane_rows" in str(caught.value)
  assert "keep a global batch of 4 until the epoch ends" in str(caught.value)
  # At the epoch's end the new global batch cuts the next epoch's lanes, declared.
  for _ in range(9):
    next(iterator)
  first = iterator.state()
  changed = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=2, shard_lanes=2, batch_size=8))
  changed.restore_state(first, allow_drift={_permutation.LANE_ROWS_FIELD})
  second = [int(x) for batch in changed for x in batch["id"]]
  assert sorted(second) == list(range(48))


def test_the_lanes_declaration_is_accepted_where_there_is_one_lane():
  # issue 66 item 5: shard_lanes=jax.process_count() is 1 on one host, whose fingerprint writes no lane
  # field; a launch script that always declares the global batch's change was refused ("not fingerprint
  # fields"). One lane's order does not depend on the global batch: the change continues exactly anywhere.
  records = [{"id": i} for i in range(48)]
  iterator = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=1, shard_lanes=1))
  read = [int(x) for _ in range(3) for x in next(iterator)["id"]]
  changed = ckpt_iter.DataIterator(_shard_pipeline(records, num_epochs=1, shard_lanes=1, batch_size=6))
  changed.restore_state(iterator.state(), allow_drift={_permutation.LANE_ROWS_FIELD, _permutation.LANES_FIELD})
  assert sorted(read + [int(x) for batch in changed for x in batch["id"]]) == list(range(48))
  with pytest.raises(errors.InvalidArgumentError, match="not fingerprint fields"):  # a real typo is still one
    changed.restore_state(iterator.state(), allow_drift={"shuffle_lane_row"})


@pytest.mark.parametrize("fields", [
    {_permutation.LANES_FIELD: 2},  # its rows missing
    {_permutation.LANES_FIELD: 3, _permutation.LANE_ROWS_FIELD: 2},  # 6 rows, the global batch is 4
    {_permutation.LANES_FIELD: 2**40, _permutation.LANE_ROWS_FIELD: 1},  # past the bound
    {_permutation.LANES_FIELD: "2", _permutation.LANE_ROWS_FIELD: 2},
])
def test_malformed_lane_fields_are_refused_by_the_restore_verify_and_the_data_map(fields):
  saved = ckpt_iter.DataIterator(_pipeline(shard_lanes=2))
  next(saved)
  value = saved.state().to_dict()
  value["fingerprint"] = {k: v for k, v in value["fingerprint"].items()
                          if k not in (_permutation.LANES_FIELD, _permutation.LANE_ROWS_FIELD)} | fields
  with pytest.raises(errors.InvalidStateError, match="shuffle_lanes"):
    ckpt_iter.DataIterator(_pipeline(shard_lanes=2)).restore_state(state_lib.IteratorState.from_dict(value))
  with pytest.raises(errors.InvalidStateError, match="shuffle_lanes"):  # what `ckpt-iter verify` asks of a state
    state_lib.input_stream_skips(state_lib.IteratorState.from_dict(value), origin="verify")
  with pytest.raises(errors.InvalidStateError, match="shuffle_lanes"):
    datamap.RecordStream(value["fingerprint"], value["position"])
