"""Tests for ckpt_iter.make_dataset and its record sources."""

import gc
import itertools
import json
import os
import tracemalloc

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import conftest

import ckpt_iter
from ckpt_iter import _stacking
from ckpt_iter import dataset as dataset_lib
from ckpt_iter import testing
from ckpt_iter import sources as sources_lib
import support


def _records(count):
  return [
      {"id": i, "text": f"prompt {i}" + "!" * (i % 3), "score": i / 7, "tokens": [i, i + 1, i * 2]}
      for i in range(count)
  ]


def _ids(batches):
  return [int(i) for batch in batches for i in batch["id"]]


def _all_batches(dataset):
  return [dataset[k] for k in range(len(dataset))]


def _make(source, **kwargs):
  kwargs.setdefault("shard_index", 0)
  kwargs.setdefault("shard_count", 1)
  return ckpt_iter.make_dataset(source, **kwargs)


# ---------------------------------------------------------------------------
# Argument validation

# (case id, keyword overrides, substrings the message must hold).
_BAD_ARGUMENTS = [
    ("batch_size_zero", {"batch_size": 0}, ["batch_size=0"]),
    ("batch_size_negative", {"batch_size": -2}, ["batch_size=-2"]),
    ("batch_size_float", {"batch_size": 2.0}, ["batch_size=2.0"]),
    ("batch_size_str", {"batch_size": "4"}, ["batch_size='4'"]),
    ("batch_size_bool", {"batch_size": True}, ["batch_size=True"]),
    ("batch_size_none", {"batch_size": None}, ["batch_size=None"]),
    ("seed_negative", {"seed": -1}, ["seed=-1", "None for no shuffle"]),
    ("seed_too_big", {"seed": 2**32}, [f"seed={2**32}"]),
    ("seed_float", {"seed": 1.5}, ["seed=1.5"]),
    ("seed_str", {"seed": "0"}, ["seed='0'"]),
    ("seed_bool", {"seed": True}, ["seed=True"]),
    ("num_epochs_zero", {"num_epochs": 0}, ["num_epochs=0", "None to repeat forever"]),
    ("num_epochs_negative", {"num_epochs": -1}, ["num_epochs=-1"]),
    ("num_epochs_float", {"num_epochs": 2.5}, ["num_epochs=2.5"]),
    ("num_epochs_bool", {"num_epochs": True}, ["num_epochs=True"]),
    ("drop_remainder_int", {"drop_remainder": 1}, ["drop_remainder=1"]),
    ("drop_remainder_none", {"drop_remainder": None}, ["drop_remainder=None"]),
    ("drop_remainder_str", {"drop_remainder": "yes"}, ["drop_remainder='yes'"]),
    ("shard_index_only", {"shard_index": 0, "shard_count": None}, ["shard_index=0", "shard_count=None"]),
    ("shard_count_only", {"shard_index": None, "shard_count": 2}, ["shard_index=None", "shard_count=2"]),
    ("shard_index_too_big", {"shard_index": 2, "shard_count": 2}, ["shard_index=2", "[0, 1]"]),
    ("shard_index_negative", {"shard_index": -1, "shard_count": 2}, ["shard_index=-1"]),
    ("shard_index_float", {"shard_index": 0.0, "shard_count": 2}, ["shard_index=0.0"]),
    ("shard_count_zero", {"shard_index": 0, "shard_count": 0}, ["shard_count=0"]),
    ("shard_count_float", {"shard_index": 0, "shard_count": 2.0}, ["shard_count=2.0"]),
    ("sharded_remainder", {"shard_index": 0, "shard_count": 2, "drop_remainder": False},
     ["drop_remainder=False", "shard_count=2"]),
    ("transform_int", {"transform": 5}, ["transform=5", "not callable"]),
    ("transform_str", {"transform": "upper"}, ["transform='upper'"]),
    ("source_int", {"source": 42}, ["source=42"]),
    ("source_none", {"source": None}, ["source=None"]),
    ("source_dict", {"source": {"id": 1}}, ["source={'id': 1}"]),
    ("source_empty", {"source": []}, ["source", "no records"]),
    ("source_suffix", {"source": "data.txt"}, ["source path 'data.txt'", ".jsonl"]),
    ("source_missing_file", {"source": "/nonexistent/train.jsonl"},
     ["source file '/nonexistent/train.jsonl'", "does not exist"]),
    ("source_empty_glob", {"source": "/nonexistent/part-*.jsonl"},
     ["source glob '/nonexistent/part-*.jsonl'", "matches no file"]),
    ("source_too_small", {"source": _records(3), "batch_size": 4},
     ["3 records", "batch_size=4", "global batch of 4"]),
]


@pytest.mark.parametrize(
    "overrides, fragments", [case[1:] for case in _BAD_ARGUMENTS],
    ids=[case[0] for case in _BAD_ARGUMENTS],
)
def test_make_dataset_rejects_bad_arguments_naming_them(overrides, fragments):
  kwargs = {"source": _records(8), "batch_size": 2, "shard_index": 0, "shard_count": 1}
  kwargs.update(overrides)
  source = kwargs.pop("source")
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.make_dataset(source, **kwargs)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_make_dataset_rejects_mixed_file_types(tmp_path):
  paths = [tmp_path / "a.jsonl", tmp_path / "b.parquet"]
  _write_jsonl(paths[0], _records(4))
  pq.write_table(pa.Table.from_pylist(_records(4)), paths[1])
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    _make([str(p) for p in paths], batch_size=2)
  assert "mixes file types" in str(info.value)
  assert "'.jsonl'" in str(info.value) and "'.parquet'" in str(info.value)


def test_default_sharding_is_the_jax_process():
  dataset = ckpt_iter.make_dataset(_records(8), batch_size=2)
  assert (dataset.spec.shard_index, dataset.spec.shard_count) == (0, 1)


# ---------------------------------------------------------------------------
# Semantics


@hypothesis.given(
    count=st.integers(1, 30), batch_size=st.integers(1, 6), drop_remainder=st.booleans(),
)
@hypothesis.settings(max_examples=30)
def test_no_seed_is_source_order(count, batch_size, drop_remainder):
  hypothesis.assume(count >= batch_size or not drop_remainder)
  dataset = _make(_records(count), batch_size=batch_size, drop_remainder=drop_remainder)
  expected = list(range(count))
  if drop_remainder:
    expected = expected[: count // batch_size * batch_size]
  assert _ids(_all_batches(dataset)) == expected


@hypothesis.given(
    count=st.integers(10, 25), batch_size=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1), drop_remainder=st.booleans(),
)
@hypothesis.settings(max_examples=20)
def test_seed_gives_a_new_permutation_each_epoch(count, batch_size, seed, drop_remainder):
  num_epochs = 3
  dataset = _make(
      _records(count), batch_size=batch_size, seed=seed, num_epochs=num_epochs,
      drop_remainder=drop_remainder,
  )
  per_epoch = dataset.spec.batches_per_epoch
  assert len(dataset) == per_epoch * num_epochs
  epochs = [
      _ids(dataset[k] for k in range(e * per_epoch, (e + 1) * per_epoch))
      for e in range(num_epochs)
  ]
  for ids in epochs:
    # Every element at most once per epoch; all of them without dropping.
    assert len(set(ids)) == len(ids)
    assert set(ids) <= set(range(count))
    if not drop_remainder:
      assert sorted(ids) == list(range(count))
    else:
      assert len(ids) == count // batch_size * batch_size
  # perm_e does not depend on the batch size (dataset.py): batch_size=1
  # lists each epoch's whole permutation.
  singles = _ids(_all_batches(_make(_records(count), batch_size=1, seed=seed, num_epochs=num_epochs)))
  full = [singles[e * count:(e + 1) * count] for e in range(num_epochs)]
  assert [f[: len(ids)] for f, ids in zip(full, epochs)] == epochs
  # With >= 10 records, equal permutations would mean the epoch is ignored
  # (chance of a false alarm < 1e-6 per example).
  assert full[0] != list(range(count))
  assert len({tuple(f) for f in full}) == num_epochs


def test_same_seed_same_order_other_seed_other_order():
  def order(seed):
    return _ids(_all_batches(_make(_records(20), batch_size=4, seed=seed)))

  assert order(5) == order(5)
  assert order(5) != order(6)


def test_num_epochs_none_repeats_forever():
  count, batch_size = 7, 2
  dataset = _make(_records(count), batch_size=batch_size, seed=3, num_epochs=None, drop_remainder=False)
  assert len(dataset) > 10**15
  iterator = ckpt_iter.DataIterator(dataset)
  per_epoch = dataset.spec.batches_per_epoch  # 4: three full batches and one of 1
  epochs = []
  for _ in range(6):
    epochs.append(_ids(itertools.islice(iterator, per_epoch)))
  assert all(sorted(ids) == list(range(count)) for ids in epochs)
  assert len({tuple(ids) for ids in epochs}) > 1
  assert iterator.get_state()["position"] == {"next_record": 6 * count}  # six whole epochs


@hypothesis.given(
    count=st.integers(1, 40), batch_size=st.integers(1, 4), shard_count=st.integers(1, 4),
    seed=st.one_of(st.none(), st.integers(0, 1000)), num_epochs=st.integers(1, 2),
)
@hypothesis.settings(max_examples=40)
def test_shards_partition_the_global_batch(count, batch_size, shard_count, seed, num_epochs):
  # dataset.py's documented design: shard i holds rows [i*B, (i+1)*B) of each
  # global batch of B*shard_count, so resuming with another shard count is exact.
  hypothesis.assume(count >= batch_size * shard_count)
  records = _records(count)
  global_ds = _make(records, batch_size=batch_size * shard_count, seed=seed, num_epochs=num_epochs)
  shards = [
      _make(records, batch_size=batch_size, seed=seed, num_epochs=num_epochs,
            shard_index=i, shard_count=shard_count)
      for i in range(shard_count)
  ]
  assert all(len(shard) == len(global_ds) for shard in shards)
  for t in range(len(global_ds)):
    rows = [shard[t] for shard in shards]
    assert all(len(r["id"]) == batch_size for r in rows)
    joined = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
    testing.assert_trees_equal([joined], [global_ds[t]])


def test_transform_is_applied_lazily_per_record():
  calls = []

  def tokenize(record):
    calls.append(record["id"])
    return {"ids": np.array([record["id"], len(record["text"])], np.int32)}

  dataset = _make(_records(20), batch_size=3, seed=1, transform=tokenize)
  assert calls == []  # building the dataset transforms nothing
  iterator = ckpt_iter.DataIterator(dataset)
  assert calls == []
  first = next(iterator)
  assert len(calls) == 3  # only the three records of the first batch
  assert sorted(first) == ["ids"]
  assert first["ids"].dtype == np.int32 and first["ids"].shape == (3, 2)
  assert first["ids"][:, 0].tolist() == calls


def test_batches_are_dicts_of_numpy_arrays_with_a_leading_batch_dim():
  batch = _make(_records(10), batch_size=4)[1]
  assert isinstance(batch, dict) and sorted(batch) == ["id", "score", "text", "tokens"]
  assert all(isinstance(v, np.ndarray) for v in batch.values())
  assert batch["id"].tolist() == [4, 5, 6, 7]
  assert batch["text"].shape == (4,) and batch["text"][0] == "prompt 4!"
  assert batch["tokens"].shape == (4, 3) and batch["tokens"][0].tolist() == [4, 5, 8]
  assert batch["score"].dtype == np.float64


def test_drop_remainder_false_keeps_the_short_last_batch():
  dataset = _make(_records(7), batch_size=3, drop_remainder=False, num_epochs=2)
  assert [len(b["id"]) for b in _all_batches(dataset)] == [3, 3, 1, 3, 3, 1]


@pytest.mark.parametrize("arguments, fragments", [
    (dict(skip=ckpt_iter.Skip(source_records=[(0, 98)])),
     ["skip=Skip(records=(), source_records=((0, 98),))", "leaves 2 of the source's 100 records per epoch",
      "fewer than one global batch of 4", "none ever again", "global batch of at most 2"]),
    (dict(skip=ckpt_iter.Skip(source_records=[(0, 50), (50, 97)]), num_epochs=3),
     ["leaves 3 of the source's 100", "every epoch from stream record 0 on would yield no batch."]),
    (dict(skip=ckpt_iter.Skip(source_records=[(0, 100)]), drop_remainder=False),
     ["leaves no record of the source's 100 in any epoch", "Skip fewer source records."]),
])
def test_a_skip_leaving_less_than_a_batch_per_epoch_is_refused_naming_it(arguments, fragments):
  arguments = {"num_epochs": None, **arguments}
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    _make([{"id": i} for i in range(100)], batch_size=4, seed=None, **arguments)
  assert all(fragment in str(info.value) for fragment in fragments), str(info.value)


def test_a_skip_leaving_one_batch_per_epoch_keeps_every_batch_full():
  dataset = _make([{"id": i} for i in range(100)], batch_size=4, seed=None, num_epochs=None,
                  skip=ckpt_iter.Skip(source_records=[(0, 96)]))
  iterator = iter(dataset)
  assert [next(iterator)["id"].tolist() for _ in range(3)] == [[96, 97, 98, 99]] * 3


@pytest.mark.parametrize("arguments", [
    dict(seed=3, skip=[(5, 11), (40, 41)]),
    dict(seed=None, skip=ckpt_iter.Skip(records=[(5, 11)], source_records=[(20, 23)])),
    dict(seed=3, weights={"a": 2, "b": 1}, skip=[(5, 11)]),
])
def test_with_skips_each_process_reads_its_rows_of_the_global_batch(arguments):
  """Each of 4 processes' batches (`BatchPlan.rows`) are its rows of the 1-process run's global batches."""
  records = [{"id": i} for i in range(50)]
  source = {"a": records, "b": records[:20]} if "weights" in arguments else records
  whole = _make(source, batch_size=8, shard_index=0, shard_count=1, num_epochs=3, **arguments)
  parts = [_make(source, batch_size=2, shard_index=i, shard_count=4, num_epochs=3, **arguments) for i in range(4)]
  assert len(whole) == len(parts[0]) > 5
  for index in range(len(whole)):
    assert np.concatenate([part[index]["id"] for part in parts]).tolist() == whole[index]["id"].tolist()


# ---------------------------------------------------------------------------
# Sources


def _write_jsonl(path, records, blank_lines=False):
  with open(path, "w") as f:
    for i, record in enumerate(records):
      if blank_lines and i % 3 == 0:
        f.write("\n" if i % 2 else "\r\n")
      f.write(json.dumps(record) + ("\r\n" if blank_lines and i % 4 == 1 else "\n"))
    if blank_lines:
      f.write("\n\n")


def _write_parquet(path, records):
  # Small row groups: reads cross row-group boundaries.
  pq.write_table(pa.Table.from_pylist(records), path, row_group_size=4)


def _write_array_record(path, records):
  support.write_array_record(str(path), records)


_WRITERS = {"jsonl": _write_jsonl, "parquet": _write_parquet, "array_record": _write_array_record}


@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("kind", sorted(_WRITERS))
def test_file_sources_give_the_same_batches_as_in_memory(tmp_path, kind, seed):
  records = _records(23)
  path = tmp_path / f"train.{kind}"
  _WRITERS[kind](path, records)
  kwargs = dict(batch_size=4, seed=seed, num_epochs=2, drop_remainder=False)
  from_file = _make(str(path), **kwargs)
  in_memory = _make(records, **kwargs)
  testing.assert_trees_equal(_all_batches(from_file), _all_batches(in_memory))
  assert from_file.spec.source.length == 23
  assert from_file.spec.source.digest == in_memory.spec.source.digest


@pytest.mark.parametrize("kind", sorted(_WRITERS))
def test_globs_and_lists_of_paths_read_files_in_order(tmp_path, kind):
  records = _records(25)
  parts = [records[:9], records[9:10], records[10:]]
  paths = [tmp_path / f"part-{i}.{kind}" for i in range(len(parts))]
  for path, part in zip(paths, parts):
    _WRITERS[kind](path, part)
  expected = _all_batches(_make(records, batch_size=3, seed=2))
  # Listed out of order: a list is read in the order given.
  listed = _make([str(p) for p in paths], batch_size=3, seed=2)
  globbed = _make(str(tmp_path / f"part-*.{kind}"), batch_size=3, seed=2)
  testing.assert_trees_equal(_all_batches(listed), expected)
  testing.assert_trees_equal(_all_batches(globbed), expected)
  reordered = _make([str(p) for p in paths[::-1]], batch_size=3, seed=None)
  assert _ids(_all_batches(reordered))[:3] == [10, 11, 12]


_SOURCE_CLASSES = {
    "jsonl": sources_lib.JsonlSource, "parquet": sources_lib.ParquetSource,
    "array_record": sources_lib.ArrayRecordSource,
}


@pytest.mark.parametrize("kind", sorted(_WRITERS))
def test_file_source_classes_take_a_path_a_pathlike_a_glob_or_a_list(tmp_path, kind):
  records = _records(11)
  paths = [tmp_path / f"part-{i}.{kind}" for i in range(2)]
  _WRITERS[kind](paths[0], records[:5])
  _WRITERS[kind](paths[1], records[5:])
  source_class = _SOURCE_CLASSES[kind]
  # A single string is one file, not a sequence of one-character paths.
  assert [source_class(str(paths[0]))[i] for i in range(5)] == records[:5]
  assert [source_class(paths[1])[i] for i in range(6)] == records[5:]
  for whole in (str(tmp_path / f"part-*.{kind}"), [str(p) for p in paths], tuple(paths)):
    source = source_class(whole)
    assert source.paths == [str(p) for p in paths]
    assert [source[i] for i in range(len(source))] == records


@pytest.mark.parametrize("kind", sorted(_WRITERS))
def test_file_source_classes_refuse_what_names_no_file(tmp_path, kind):
  source_class = _SOURCE_CLASSES[kind]
  cases = [
      (str(tmp_path / f"missing.{kind}"), [f"{source_class.__name__} file", f"missing.{kind}", "does not exist"]),
      (str(tmp_path / f"none-*.{kind}"), [f"{source_class.__name__} glob", "matches no file"]),
      ([], [source_class.__name__, "paths=[]", "names no file", "glob"]),
      (42, [source_class.__name__, "paths=42", "(int)", "os.PathLike"]),
  ]
  for paths, fragments in cases:
    with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
      source_class(paths)
    for fragment in fragments:
      assert fragment in str(info.value), (paths, fragment, str(info.value))


def test_a_file_named_like_a_glob_is_not_globbed_twice(tmp_path):
  # make_dataset expands the glob once; the source reads the match as named.
  records = _records(6)
  path = tmp_path / "part[1].jsonl"
  _write_jsonl(path, records)
  (tmp_path / "part1.jsonl").write_text(json.dumps({"id": -1}) + "\n")
  dataset = _make(str(tmp_path / "part?1?.jsonl"), batch_size=2)
  assert _ids(_all_batches(dataset)) == list(range(6))


# (case id, records of one batch of 4, substrings the message must hold).
_UNSTACKABLE = [
    ("ragged_tokens", [{"id": i, "tokens": list(range(3 if i != 2 else 2))} for i in range(4)],
     ["batch 1", "field 'tokens'", "rows [0, 1, 3] have shape (3,)", "row 2 has shape (2,)", "`transform`", "pad"]),
    ("ragged_nested_field", [{"id": i, "meta": {"ids": [i] * (1 + i % 2)}} for i in range(4)],
     ["batch 1", "field 'meta.ids'", "rows [0, 2] have shape (1,)", "rows [1, 3] have shape (2,)"]),
    ("ragged_inside_a_row", [{"t": [[1, 2], [3]] if i == 3 else [[1], [2]]} for i in range(4)],
     ["field 't'", "row 3 is ragged", "rows [0, 1, 2] have shape (2, 1)"]),
    ("missing_key", [{"id": i, **({"tokens": [1]} if i != 1 else {})} for i in range(4)],
     ["batch 1", "different fields", "row 1 lacks ['tokens']", "row 0's keys ['id', 'tokens']"]),
    ("extra_key", [{"id": i, **({"extra": 1} if i == 3 else {})} for i in range(4)],
     ["row 3 has ['extra'] too"]),
]


@pytest.mark.parametrize("records, fragments", [c[1:] for c in _UNSTACKABLE], ids=[c[0] for c in _UNSTACKABLE])
def test_records_that_do_not_stack_are_refused_naming_the_field_rows_and_shapes(records, fragments):
  # Batch 0 stacks; batch 1 holds the four records given.
  uniform = [{**records[0]} for _ in range(4)]
  dataset = _make(uniform + records, batch_size=4)
  dataset[0]
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    dataset[1]
  assert isinstance(info.value, ValueError)  # what numpy raised before
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="batch 1"):
    list(ckpt_iter.DataIterator(dataset))


def test_a_batch_of_one_record_is_what_np_stack_makes_of_it():
  """One row takes a shortcut past np.stack (`_stacked`): the same arrays, copies of the record's."""
  record = {"i": 5, "f": 2.5, "b": True, "s": "abc", "y": b"xy", "l": [[1, 2], [3, 4]],
            "c": np.arange(12).reshape(3, 4), "fortran": np.asfortranarray(np.arange(12).reshape(3, 4)),
            "strided": np.arange(20)[::3], "scalar": np.float32(3), "empty": np.zeros((0, 3))}
  batch = _stacking.stack_records([record])
  for name, value in record.items():
    expected = np.stack([np.asarray(value)])
    got = batch[name]
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    assert np.array_equal(got, expected), name
    assert got.flags.c_contiguous == expected.flags.c_contiguous and got.flags.f_contiguous == expected.flags.f_contiguous
    assert not np.shares_memory(got, np.asarray(value)), name


def test_jsonl_blank_lines_and_crlf_are_ignored(tmp_path):
  records = _records(13)
  path = tmp_path / "blank.jsonl"
  _write_jsonl(path, records, blank_lines=True)
  assert b"\n\n" in path.read_bytes() and b"\r\n" in path.read_bytes()
  source = sources_lib.JsonlSource([str(path)])
  assert len(source) == 13
  assert [source[i] for i in range(13)] == records
  assert source[-1] == records[-1]
  with pytest.raises(IndexError):
    source[13]


def test_jsonl_without_trailing_newline(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"a": 1}\n{"a": 2}')
  source = sources_lib.JsonlSource([str(path)])
  assert [source[0], source[1]] == [{"a": 1}, {"a": 2}]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"a": 1}\n{"a": \n')
  source = sources_lib.JsonlSource([str(path)])
  with pytest.raises(ckpt_iter.CkptIterError) as info:
    source[1]
  assert str(path) in str(info.value) and "line 2" in str(info.value)


def test_sources_are_picklable_for_grain_workers(tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top

  records = _records(9)
  for kind, write in _WRITERS.items():
    path = tmp_path / f"p.{kind}"
    write(path, records)
    source, _ = sources_lib.resolve_source(str(path))
    source[3]  # opens a file handle / caches a row group first
    clone = pickle.loads(pickle.dumps(source))
    assert [clone[i] for i in range(9)] == records, kind


def test_any_random_access_source_works():
  class Squares:
    def __len__(self):
      return 6

    def __getitem__(self, index):
      return {"x": index * index}

  dataset = _make(Squares(), batch_size=2)
  assert [b["x"].tolist() for b in _all_batches(dataset)] == [[0, 1], [4, 9], [16, 25]]
  assert dataset.spec.source.description.endswith("Squares")


# ---------------------------------------------------------------------------
# Hugging Face datasets: built locally (no network), read from disk


def _hf_saved(tmp_path, records, name="hf"):
  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  path = str(tmp_path / name)
  datasets.Dataset.from_list(records).save_to_disk(path)
  return path


@pytest.mark.parametrize("seed", [None, 5])
def test_hf_sources_give_the_same_batches_as_in_memory(tmp_path, seed):
  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  records = _records(23)
  jsonl = tmp_path / "train.jsonl"
  _write_jsonl(jsonl, records)
  kwargs = dict(batch_size=4, seed=seed, num_epochs=2, drop_remainder=False)
  expected = _all_batches(_make(records, **kwargs))
  from_disk = sources_lib.HuggingFaceSource(_hf_saved(tmp_path, records))
  by_builder = sources_lib.HuggingFaceSource(
      "json", data_files=str(jsonl), split="train", cache_dir=str(tmp_path / "cache"))
  loaded = datasets.load_from_disk(str(tmp_path / "hf"))
  for source in (from_disk, by_builder, loaded):  # a datasets.Dataset itself works too
    dataset = _make(source, **kwargs)
    testing.assert_trees_equal(_all_batches(dataset), expected)
    assert dataset.spec.source.length == 23
    assert dataset.spec.source.digest == _make(records, **kwargs).spec.source.digest
  assert _make(from_disk, **kwargs).spec.source.description == "hf[hf]"
  assert _make(by_builder, **kwargs).spec.source.description == "hf[json:train]"
  assert _make(loaded, **kwargs).spec.source.description == "hf[dataset]"


def test_hf_changed_dataset_is_refused_naming_the_field(tmp_path):
  records = _records(20)

  def iterator(directory, content):
    os.makedirs(tmp_path / directory)
    # The same directory name each time, as a dataset rewritten in place.
    source = sources_lib.HuggingFaceSource(_hf_saved(tmp_path / directory, content))
    return ckpt_iter.DataIterator(_make(source, batch_size=2))

  saved = iterator("first", records)
  next(saved)
  state = saved.get_state()
  edited = [dict(r) for r in records]
  edited[0]["text"] = "changed"
  for field, content in (("source_digest", edited), ("source_length", records[:18])):
    with pytest.raises(ckpt_iter.ConfigDriftError, match=field):
      iterator(field, content).set_state(state)
  same = iterator("same", records)
  same.set_state(state)
  assert _ids([next(same)]) == _ids([next(saved)])


def test_hf_splits_and_errors_name_the_choices(tmp_path):
  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  records = _records(6)
  path = str(tmp_path / "dict")
  datasets.DatasetDict(
      train=datasets.Dataset.from_list(records), test=datasets.Dataset.from_list(records[:2])
  ).save_to_disk(path)
  assert len(sources_lib.HuggingFaceSource(path, split="test")) == 2
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"splits \['test', 'train'\]; choose one with split="):
    sources_lib.HuggingFaceSource(path)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"no split 'valid'; it has \['test', 'train'\]"):
    sources_lib.HuggingFaceSource(path, split="valid")
  jsonl = tmp_path / "t.jsonl"
  _write_jsonl(jsonl, records)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="Unknown split"):
    sources_lib.HuggingFaceSource("json", data_files=str(jsonl), split="nope", cache_dir=str(tmp_path / "c"))
  streaming = datasets.Dataset.from_list(records).to_iterable_dataset()
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="no random access"):
    sources_lib.HuggingFaceSource(dataset=streaming)


def test_hf_source_is_picklable_for_grain_workers(tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top

  records = _records(9)
  source = sources_lib.HuggingFaceSource(_hf_saved(tmp_path, records))
  clone = pickle.loads(pickle.dumps(source))
  assert [clone[i] for i in range(9)] == [source[i] for i in range(9)]
  assert [clone[i]["id"] for i in range(9)] == list(range(9))


def test_large_jsonl_is_indexed_not_loaded(tmp_path):
  # ~96 MB of JSONL: building the dataset and reading a few random records
  # must allocate a bounded amount (index + read chunk), not the file.
  path = tmp_path / "large.jsonl"
  padding = "x" * 950
  count = 100_000
  try:
    with open(path, "w") as f:
      for i in range(count):
        f.write(f'{{"id": {i}, "text": "{padding}"}}\n')
    file_bytes = os.path.getsize(path)
    assert file_bytes > 90 * 2**20
    gc.collect()
    tracemalloc.start()
    try:
      dataset = _make(str(path), batch_size=4, seed=7)
      iterator = ckpt_iter.DataIterator(dataset)
      iterator.set_state({"next_index": 20_000})
      batch = next(iterator)
      _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
      tracemalloc.stop()
    assert len(dataset.spec.source.description) < 100
    assert dataset.spec.source.length == count
    assert all(record_id < count for record_id in batch["id"])
    assert batch["text"][0] == padding
    # Loading the file would need >= file_bytes; the index is 16 bytes a line
    # (1.6 MB) and the indexer reads 16 MiB chunks: measured peak 35 MB.
    assert peak_bytes < file_bytes / 2, (peak_bytes, file_bytes)
  finally:
    path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# Weighted mixtures of named sources (docs/changing_the_run.md)


def _sources(**lengths):
  return {name: [{"id": 1000 * (ord(name[0]) - 96) + i} for i in range(length)] for name, length in lengths.items()}


def _mix(weights, lengths=None, **kwargs):
  lengths = lengths or {name: 30 for name in weights}
  kwargs.setdefault("batch_size", 4)
  kwargs.setdefault("seed", 1)
  kwargs.setdefault("num_epochs", None)
  return _make(_sources(**lengths), weights=weights, **kwargs)


_BAD_MIXTURES = [
    ("dict_without_weights", dict(source=_sources(a=3, b=3)), ["source=", "weights={name: weight"]),
    ("weights_without_dict", dict(source=_records(4), weights={"a": 1}), ["weights={'a': 1}", "must be a dict"]),
    ("names_differ", dict(source=_sources(a=3, b=3), weights={"a": 1, "c": 1}), ["['a', 'b']", "['a', 'c']"]),
    ("bad_name", dict(source={"a b": _records(3)}, weights={"a b": 1}), ["'a b'", "identifiers"]),
    ("zero_weight", dict(source=_sources(a=3), weights={"a": 0}), ["weights['a']=0"]),
    ("weights_not_dict", dict(source=_sources(a=3), weights=[1]), ["weights=[1]"]),
]


@pytest.mark.parametrize("arguments, fragments", [c[1:] for c in _BAD_MIXTURES], ids=[c[0] for c in _BAD_MIXTURES])
def test_a_bad_mixture_is_refused_naming_the_argument(arguments, fragments):
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    _make(arguments.pop("source"), batch_size=2, **arguments)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_a_mixture_interleaves_its_sources_by_weight_each_in_its_own_shuffled_epochs():
  dataset = _mix({"a": 3, "b": 1}, lengths={"a": 12, "b": 5})
  ids = _ids(itertools.islice(ckpt_iter.DataIterator(dataset), 8))  # 32 records
  a, b = [i for i in ids if i < 2000], [i for i in ids if i >= 2000]
  assert (len(a), len(b)) == (24, 8)
  assert sorted(a[:12]) == sorted(a[12:24]) == [1000 + i for i in range(12)] and a[:12] != a[12:24]
  assert sorted(b[:5]) == [2000 + i for i in range(5)]
  assert dataset.spec.fingerprint()["weight[a]"] == 3 and dataset.spec.fingerprint()["batches_per_epoch"] is None


def _read(iterator, batches):
  return _ids(itertools.islice(iterator, batches))


def test_a_reweighted_mixture_is_refused_undeclared_and_continues_each_source_when_declared(caplog):
  saved = ckpt_iter.DataIterator(_mix({"a": 1, "b": 1}))
  first = _read(saved, 5)  # 20 records: 10 of each
  state = saved.get_state()
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    ckpt_iter.DataIterator(_mix({"a": 4, "b": 1})).set_state(state)
  # In the user's terms: fractions of the mix, and b named too (its part fell though its share did not).
  assert "weights (fractions of the mix) a 0.5 -> 0.8, b 0.5 -> 0.2" in str(info.value)
  assert "allow_drift={'weights'}" in str(info.value)
  resumed = ckpt_iter.DataIterator(_mix({"a": 4, "b": 1}), allow_drift={"weights"})
  with caplog.at_level("INFO", logger="ckpt_iter"):
    resumed.set_state(state)
  assert any("a 0.5 -> 0.8, b 0.5 -> 0.2" in r.getMessage() for r in caplog.records)
  later = _read(resumed, 5)  # 20 records: 16 of a, 4 of b
  assert (sum(i < 2000 for i in later), sum(i >= 2000 for i in later)) == (16, 4)
  # Each source goes on from its own next record: its own stream, uninterrupted.
  for name, low in (("a", 1000), ("b", 2000)):
    alone = ckpt_iter.DataIterator(_make(_sources(**{name: 30})[name], batch_size=1, num_epochs=None,
                                         seed=dataset_lib.source_seed(1, name)))
    got = [i for i in first + later if low <= i < low + 1000]
    assert got == _read(alone, len(got))
  assert resumed.get_state()["position"]["mixture"] == {"since_record": 20, "since": {"a": 10, "b": 10}}


def test_an_edited_record_is_refused_with_a_way_a_user_can_take_and_the_declared_way_continues_once():
  """A digest cannot be passed back to make_dataset: the message says to restore the data, or what
  accepting it does, and accepting it continues at the saved record with nothing read twice."""
  records = _records(12)
  saved = ckpt_iter.DataIterator(_make(records, batch_size=2, seed=3))
  first = _ids(itertools.islice(saved, 2))
  state = saved.get_state()
  edited = [dict(r, text="edited") if r["id"] == 11 else r for r in records]
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    ckpt_iter.DataIterator(_make(edited, batch_size=2, seed=3)).set_state(state)
  message = str(info.value)
  assert "source_digest" in info.value.differences and "Rebuild the pipeline with source_digest" not in message
  assert "Restore the records or code the run was saved with (source_digest" in message
  assert "allow_drift={'source_digest'}" in message and "reads what is there now" in message
  resumed = ckpt_iter.DataIterator(_make(edited, batch_size=2, seed=3), allow_drift={"source_digest"})
  resumed.set_state(state)
  rest = _ids(resumed)
  assert sorted(first + rest) == list(range(12))  # each record once, the edited one in its new form


def test_a_source_added_or_removed_must_be_declared_and_keeps_its_ledger():
  saved = ckpt_iter.DataIterator(_mix({"a": 1, "b": 1}))
  _read(saved, 3)
  with pytest.raises(ckpt_iter.ConfigDriftError, match=r"sources added: c.*allow_drift=\{'sources'\}"):
    ckpt_iter.DataIterator(_mix({"a": 1, "b": 1, "c": 1})).set_state(saved.get_state())
  only_a = ckpt_iter.DataIterator(_mix({"a": 1}), allow_drift={"sources"})
  only_a.set_state(saved.get_state())
  assert all(i < 2000 for i in _read(only_a, 2))
  back = ckpt_iter.DataIterator(_mix({"a": 1, "b": 1}), allow_drift={"sources"})
  back.set_state(only_a.get_state())
  ledger = back.get_state()["position"]["mixture"]["since"]
  assert ledger == {"a": 14, "b": 6}  # b kept its 6 records while it was out


def test_inspect_shows_a_mixtures_ledger():
  from ckpt_iter import state
  iterator = ckpt_iter.DataIterator(_mix({"a": 3, "b": 1}, lengths={"a": 12, "b": 5}))
  _read(iterator, 5)
  value = iterator.state()
  text = state.summary_line(value)
  assert text == "stream record 20; read a 15 (epoch 1, 3 of 12), b 5 (epoch 1, 0 of 5)"


# ---------------------------------------------------------------------------
# Filter and pack in lanes (docs/changing_the_run.md)


_BAD_LANES = [
    ("lanes_not_multiple_of_shards", dict(shard_count=4, shard_index=0, num_lanes=6), ["num_lanes=6", "shard_count=4"]),
    ("batch_not_multiple_of_lanes", dict(batch_size=3, num_lanes=2), ["global batch of 3", "num_lanes=2"]),
    ("short_batches", dict(drop_remainder=False, num_epochs=None), ["drop_remainder=False with filter or pack"]),
    ("finite", dict(num_epochs=2), ["num_epochs=2 with filter or pack", "num_epochs=None"]),
    ("chunk_zero", dict(chunk_size=0), ["chunk_size=0"]),
    ("lanes_zero", dict(num_lanes=0), ["num_lanes=0"]),
    ("filter_not_callable", dict(filter=3), ["filter=3", "not callable"]),
]


@pytest.mark.parametrize("arguments, fragments", [c[1:] for c in _BAD_LANES], ids=[c[0] for c in _BAD_LANES])
def test_bad_lane_arguments_are_refused_naming_them(arguments, fragments):
  kwargs = {"batch_size": 4, "filter": lambda r: True, "num_lanes": 2, **arguments}
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    _make(_records(20), **kwargs)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_a_filter_that_drops_everything_is_named_not_waited_out(monkeypatch):
  from ckpt_iter import _lanes  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_lanes, "MAX_EMPTY_CHUNKS", 5)
  dataset = _make(_records(200), batch_size=2, num_epochs=None, filter=lambda r: False, chunk_size=2, num_lanes=1)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="filter dropped every record of 5 chunks"):
    next(ckpt_iter.DataIterator(dataset))


class _CountingRecords:
  """Records that count how many were read (a bucket's cost is per record read)."""

  def __init__(self, count):
    self.records, self.reads = _records(count), 0

  def __len__(self):
    return len(self.records)

  def __getitem__(self, index):
    self.reads += 1
    return self.records[index]


def test_lanes_landing_on_one_host_compute_only_the_rows_their_first_batch_takes():
  """256 lanes of a 256-host run restarted on one host: the first batch takes one row of each lane, and
  reads a record and the next of each lane's chunk (the next tells whether the chunk goes on), not every
  chunk whole (issue 49 item 5: 28 s of CPU before the first batch)."""
  source = _CountingRecords(256 * 64)
  lanes = dict(batch_size=256, num_epochs=None, filter=lambda r: True, chunk_size=64, num_lanes=256)
  iterator = ckpt_iter.DataIterator(_make(source, **lanes))
  built = source.reads  # the source's sampled digest
  first = next(iterator)
  assert source.reads - built == 2 * 256  # before: 256 * 64 = 16,384
  # The same rows, and later the same positions, as a lane computing its chunk whole.
  whole = iterator.dataset
  assert list(first["id"]) == [whole.chunk_rows(lane)[0]["id"] for lane in range(256)]
  for _ in range(63):
    next(iterator)
  assert iterator.get_state()["position"]["lanes"][:2] == [[1, 0], [1, 0]]  # each chunk left once taken


def test_a_lane_states_position_is_small_and_per_process():
  dataset = _make(_records(400), batch_size=8, num_epochs=None, filter=lambda r: r["id"] % 2 == 0,
                  chunk_size=16, num_lanes=8, shard_index=1, shard_count=2)
  iterator = ckpt_iter.DataIterator(dataset)
  for _ in range(50):
    next(iterator)
  state = iterator.get_state()
  assert state["position"]["first_lane"] == 4 and len(state["position"]["lanes"]) == 4
  assert len(json.dumps(state["position"])) < 100


# make_dataset's weights as a mixture's integer shares (`dataset.proportions`).


@pytest.mark.parametrize("weights, shares", [
    ({"a": 0.7, "b": 0.3}, {"a": 7, "b": 3}),
    ({"a": 1, "b": 1}, {"a": 1, "b": 1}),
    ({"a": 1 / 3, "b": 2 / 3}, {"a": 1, "b": 2}),
    ({"a": 0.5, "b": 0.25, "c": 0.25}, {"a": 2, "b": 1, "c": 1}),
    ({"x": 3}, {"x": 1}),
])
def test_proportions_are_integer_ratios_in_lowest_terms(weights, shares):
  assert dataset_lib.proportions(weights) == shares


@pytest.mark.parametrize("weights, fragment", [
    ({}, "weights is empty"),
    ({"a": 0}, "weights['a']=0"),
    ({"a": -1.0}, "weights['a']=-1.0"),
    ({"a": float("nan")}, "weights['a']=nan"),
    ({"a": True}, "weights['a']=True"),
    ({"a": "1"}, "weights['a']='1'"),
    ({"a": 1, "b": 1e-9}, "more than"),
])
def test_bad_weights_are_refused_naming_them(weights, fragment):
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    dataset_lib.proportions(weights)
  assert fragment in str(info.value)
