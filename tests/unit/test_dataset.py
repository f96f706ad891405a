"""Tests for ckpt_iter.make_dataset and its record sources."""

import itertools
import json
import os

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import conftest

import ckpt_iter
from ckpt_iter import errors
from ckpt_iter import dataset as dataset_lib
from ckpt_iter import testing
from ckpt_iter import sources as sources_lib
import support


def _ids(batches):
  return [int(i) for batch in batches for i in batch["id"]]


def _all_batches(dataset):
  return [dataset[k] for k in range(len(dataset))]


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
    ("source_too_small", {"source": support.sample_records(3), "batch_size": 4},
     ["3 records", "batch_size=4", "global batch of 4"]),
]


@pytest.mark.parametrize(
    "overrides, fragments", [case[1:] for case in _BAD_ARGUMENTS],
    ids=[case[0] for case in _BAD_ARGUMENTS],
)
def test_make_dataset_rejects_bad_arguments_naming_them(overrides, fragments):
  kwargs = {"source": support.sample_records(8), "batch_size": 2, "shard_index": 0, "shard_count": 1}
  kwargs.update(overrides)
  source = kwargs.pop("source")
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    ckpt_iter.make_dataset(source, **kwargs)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_make_dataset_rejects_mixed_file_types(tmp_path):
  paths = [tmp_path / "a.jsonl", tmp_path / "b.parquet"]
  support.write_jsonl(paths[0], support.sample_records(4))
  pq.write_table(pa.Table.from_pylist(support.sample_records(4)), paths[1])
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    support.make_dataset([str(p) for p in paths], batch_size=2)
  assert "mixes file types" in str(info.value)
  assert "'.jsonl'" in str(info.value) and "'.parquet'" in str(info.value)


def test_default_sharding_is_the_jax_process():
  dataset = ckpt_iter.make_dataset(support.sample_records(8), batch_size=2)
  assert (dataset.spec.shard_index, dataset.spec.shard_count) == (0, 1)


# ---------------------------------------------------------------------------
# Semantics


@hypothesis.given(
    count=st.integers(1, 30), batch_size=st.integers(1, 6), drop_remainder=st.booleans(),
)
@hypothesis.settings(max_examples=30)
def test_no_seed_is_source_order(count, batch_size, drop_remainder):
  hypothesis.assume(count >= batch_size or not drop_remainder)
  dataset = support.make_dataset(support.sample_records(count), batch_size=batch_size, drop_remainder=drop_remainder)
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
  dataset = support.make_dataset(
      support.sample_records(count), batch_size=batch_size, seed=seed, num_epochs=num_epochs,
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
  singles = _ids(_all_batches(support.make_dataset(support.sample_records(count), batch_size=1, seed=seed,
                                                   num_epochs=num_epochs)))
  full = [singles[e * count:(e + 1) * count] for e in range(num_epochs)]
  assert [f[: len(ids)] for f, ids in zip(full, epochs)] == epochs
  # With >= 10 records, equal permutations would mean the epoch is ignored
  # (chance of a false alarm < 1e-6 per example).
  assert full[0] != list(range(count))
  assert len({tuple(f) for f in full}) == num_epochs


def test_same_seed_same_order_other_seed_other_order():
  def order(seed):
    return _ids(_all_batches(support.make_dataset(support.sample_records(20), batch_size=4, seed=seed)))

  assert order(5) == order(5)
  assert order(5) != order(6)


def test_num_epochs_none_repeats_forever():
  count, batch_size = 7, 2
  dataset = support.make_dataset(support.sample_records(count), batch_size=batch_size, seed=3, num_epochs=None,
                                 drop_remainder=False)
  assert len(dataset) > 10**15
  iterator = ckpt_iter.DataIterator(dataset)
  per_epoch = dataset.spec.batches_per_epoch  # 4: three full batches and one of 1
  epochs = []
  for _ in range(6):
    epochs.append(_ids(itertools.islice(iterator, per_epoch)))
  assert all(sorted(ids) == list(range(count)) for ids in epochs)
  assert len({tuple(ids) for ids in epochs}) > 1
  assert iterator.get_state()["position"] == {"next_record": 6 * count}  # six whole epochs


def test_transform_is_applied_lazily_per_record():
  calls = []

  def tokenize(record):
    calls.append(record["id"])
    return {"ids": np.array([record["id"], len(record["text"])], np.int32)}

  dataset = support.make_dataset(support.sample_records(20), batch_size=3, seed=1, transform=tokenize)
  assert calls == []  # building the dataset transforms nothing
  iterator = ckpt_iter.DataIterator(dataset)
  assert calls == []
  first = next(iterator)
  assert len(calls) == 3  # only the three records of the first batch
  assert sorted(first) == ["ids"]
  assert first["ids"].dtype == np.int32 and first["ids"].shape == (3, 2)
  assert first["ids"][:, 0].tolist() == calls


def test_batches_are_dicts_of_numpy_arrays_with_a_leading_batch_dim():
  batch = support.make_dataset(support.sample_records(10), batch_size=4)[1]
  assert isinstance(batch, dict) and sorted(batch) == ["id", "score", "text", "tokens"]
  assert all(isinstance(v, np.ndarray) for v in batch.values())
  assert batch["id"].tolist() == [4, 5, 6, 7]
  assert batch["text"].shape == (4,) and batch["text"][0] == "prompt 4!"
  assert batch["tokens"].shape == (4, 3) and batch["tokens"][0].tolist() == [4, 5, 8]
  assert batch["score"].dtype == np.float64


def test_drop_remainder_false_keeps_the_short_last_batch():
  dataset = support.make_dataset(support.sample_records(7), batch_size=3, drop_remainder=False, num_epochs=2)
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
    support.make_dataset([{"id": i} for i in range(100)], batch_size=4, seed=None, **arguments)
  assert all(fragment in str(info.value) for fragment in fragments), str(info.value)


def test_a_skip_leaving_one_batch_per_epoch_keeps_every_batch_full():
  dataset = support.make_dataset([{"id": i} for i in range(100)], batch_size=4, seed=None, num_epochs=None,
                                 skip=ckpt_iter.Skip(source_records=[(0, 96)]))
  iterator = iter(dataset)
  assert [next(iterator)["id"].tolist() for _ in range(3)] == [[96, 97, 98, 99]] * 3


# ---------------------------------------------------------------------------
# Sources


@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("kind", sorted(support.FILE_WRITERS))
def test_file_sources_give_the_same_batches_as_in_memory(tmp_path, kind, seed):
  records = support.sample_records(23)
  path = tmp_path / f"train.{kind}"
  support.FILE_WRITERS[kind](path, records)
  kwargs = dict(batch_size=4, seed=seed, num_epochs=2, drop_remainder=False)
  from_file = support.make_dataset(str(path), **kwargs)
  in_memory = support.make_dataset(records, **kwargs)
  testing.assert_trees_equal(_all_batches(from_file), _all_batches(in_memory))
  assert from_file.spec.source.length == 23
  assert from_file.spec.source.digest == in_memory.spec.source.digest


@pytest.mark.parametrize("kind", sorted(support.FILE_WRITERS))
def test_globs_and_lists_of_paths_read_files_in_order(tmp_path, kind):
  records = support.sample_records(25)
  parts = [records[:9], records[9:10], records[10:]]
  paths = [tmp_path / f"part-{i}.{kind}" for i in range(len(parts))]
  for path, part in zip(paths, parts):
    support.FILE_WRITERS[kind](path, part)
  expected = _all_batches(support.make_dataset(records, batch_size=3, seed=2))
  # Listed out of order: a list is read in the order given.
  listed = support.make_dataset([str(p) for p in paths], batch_size=3, seed=2)
  globbed = support.make_dataset(str(tmp_path / f"part-*.{kind}"), batch_size=3, seed=2)
  testing.assert_trees_equal(_all_batches(listed), expected)
  testing.assert_trees_equal(_all_batches(globbed), expected)
  reordered = support.make_dataset([str(p) for p in paths[::-1]], batch_size=3, seed=None)
  assert _ids(_all_batches(reordered))[:3] == [10, 11, 12]


def test_a_file_named_like_a_glob_is_not_globbed_twice(tmp_path):
  # make_dataset expands the glob once; the source reads the match as named.
  records = support.sample_records(6)
  path = tmp_path / "part[1].jsonl"
  support.write_jsonl(path, records)
  (tmp_path / "part1.jsonl").write_text(json.dumps({"id": -1}) + "\n")
  dataset = support.make_dataset(str(tmp_path / "part?1?.jsonl"), batch_size=2)
  assert _ids(_all_batches(dataset)) == list(range(6))


def test_any_random_access_source_works():
  class Squares:
    def __len__(self):
      return 6

    def __getitem__(self, index):
      return {"x": index * index}

  dataset = support.make_dataset(Squares(), batch_size=2)
  assert [b["x"].tolist() for b in _all_batches(dataset)] == [[0, 1], [4, 9], [16, 25]]
  assert dataset.spec.source.description.endswith("Squares")


# ---------------------------------------------------------------------------
# Hugging Face datasets: built locally (no network), read from disk


@pytest.mark.parametrize("seed", [None, 5])
def test_hf_sources_give_the_same_batches_as_in_memory(tmp_path, seed):
  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  records = support.sample_records(23)
  jsonl = tmp_path / "train.jsonl"
  support.write_jsonl(jsonl, records)
  kwargs = dict(batch_size=4, seed=seed, num_epochs=2, drop_remainder=False)
  expected = _all_batches(support.make_dataset(records, **kwargs))
  from_disk = sources_lib.HuggingFaceSource(support.hf_saved(tmp_path, records))
  by_builder = sources_lib.HuggingFaceSource(
      "json", data_files=str(jsonl), split="train", cache_dir=str(tmp_path / "cache"))
  loaded = datasets.load_from_disk(str(tmp_path / "hf"))
  for source in (from_disk, by_builder, loaded):  # a datasets.Dataset itself works too
    dataset = support.make_dataset(source, **kwargs)
    testing.assert_trees_equal(_all_batches(dataset), expected)
    assert dataset.spec.source.length == 23
    assert dataset.spec.source.digest == support.make_dataset(records, **kwargs).spec.source.digest
  assert support.make_dataset(from_disk, **kwargs).spec.source.description == "hf[hf]"
  assert support.make_dataset(by_builder, **kwargs).spec.source.description == "hf[json:train]"
  assert support.make_dataset(loaded, **kwargs).spec.source.description == "hf[dataset]"


def test_hf_changed_dataset_is_refused_naming_the_field(tmp_path):
  records = support.sample_records(20)

  def iterator(directory, content):
    os.makedirs(tmp_path / directory)
    # The same directory name each time, as a dataset rewritten in place.
    source = sources_lib.HuggingFaceSource(support.hf_saved(tmp_path / directory, content))
    return ckpt_iter.DataIterator(support.make_dataset(source, batch_size=2))

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


# ---------------------------------------------------------------------------
# Weighted mixtures of named sources (docs/changing_the_run.md)


def _sources(**lengths):
  return {name: [{"id": 1000 * (ord(name[0]) - 96) + i} for i in range(length)] for name, length in lengths.items()}


def _mix(weights, lengths=None, **kwargs):
  lengths = lengths or {name: 30 for name in weights}
  kwargs.setdefault("batch_size", 4)
  kwargs.setdefault("seed", 1)
  kwargs.setdefault("num_epochs", None)
  return support.make_dataset(_sources(**lengths), weights=weights, **kwargs)


_BAD_MIXTURES = [
    ("dict_without_weights", dict(source=_sources(a=3, b=3)), ["source=", "weights={name: weight"]),
    ("weights_without_dict", dict(source=support.sample_records(4), weights={"a": 1}), ["weights={'a': 1}", "must be a dict"]),
    ("names_differ", dict(source=_sources(a=3, b=3), weights={"a": 1, "c": 1}), ["['a', 'b']", "['a', 'c']"]),
    ("bad_name", dict(source={"a b": support.sample_records(3)}, weights={"a b": 1}), ["'a b'", "identifiers"]),
    ("zero_weight", dict(source=_sources(a=3), weights={"a": 0}), ["weights['a']=0"]),
    ("weights_not_dict", dict(source=_sources(a=3), weights=[1]), ["weights=[1]"]),
]


@pytest.mark.parametrize("arguments, fragments", [c[1:] for c in _BAD_MIXTURES], ids=[c[0] for c in _BAD_MIXTURES])
def test_a_bad_mixture_is_refused_naming_the_argument(arguments, fragments):
  with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
    support.make_dataset(arguments.pop("source"), batch_size=2, **arguments)
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
    alone = ckpt_iter.DataIterator(support.make_dataset(_sources(**{name: 30})[name], batch_size=1, num_epochs=None,
                                                        seed=dataset_lib.source_seed(1, name)))
    got = [i for i in first + later if low <= i < low + 1000]
    assert got == _read(alone, len(got))
  assert resumed.get_state()["position"]["mixture"] == {"since_record": 20, "since": {"a": 10, "b": 10}}


def test_an_edited_record_is_refused_with_a_way_a_user_can_take_and_the_declared_way_continues_once():
  """A digest cannot be passed back to make_dataset: the message says to restore the data, or what
  accepting it does, and accepting it continues at the saved record with nothing read twice."""
  records = support.sample_records(12)
  saved = ckpt_iter.DataIterator(support.make_dataset(records, batch_size=2, seed=3))
  first = _ids(itertools.islice(saved, 2))
  state = saved.get_state()
  edited = [dict(r, text="edited") if r["id"] == 11 else r for r in records]
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    ckpt_iter.DataIterator(support.make_dataset(edited, batch_size=2, seed=3)).set_state(state)
  message = str(info.value)
  assert "source_digest" in info.value.differences and "Rebuild the pipeline with source_digest" not in message
  assert "Restore the records or code the run was saved with (source_digest" in message
  assert "allow_drift={'source_digest'}" in message and "reads what is there now" in message
  resumed = ckpt_iter.DataIterator(support.make_dataset(edited, batch_size=2, seed=3), allow_drift={"source_digest"})
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


@pytest.mark.parametrize("num_epochs", [None, 1, 3])
@pytest.mark.parametrize("batch_size, shard_count", [(16, 1), (6, 2)])
def test_a_global_batch_larger_than_an_epoch_with_drop_remainder_is_refused_naming_the_sizes(
    num_epochs, batch_size, shard_count):
  # issue 60 item 3: with num_epochs=None one short batch was yielded, then an untyped ValueError.
  records = [{"id": i} for i in range(10)]
  with pytest.raises(errors.InvalidArgumentError) as caught:
    ckpt_iter.make_dataset(records, batch_size=batch_size, seed=1, num_epochs=num_epochs, drop_remainder=True,
                           shard_index=0, shard_count=shard_count)
  message = str(caught.value)
  assert f"a global batch of {batch_size * shard_count} records" in message
  assert "more than one epoch of the source (10 records)" in message and "drop_remainder=False" in message


def test_a_global_batch_larger_than_an_epoch_without_drop_remainder_reads_one_short_batch_an_epoch():
  records = [{"id": i} for i in range(10)]
  iterator = iter(ckpt_iter.make_dataset(records, batch_size=16, seed=None, num_epochs=None, drop_remainder=False))
  assert [sorted(int(x) for x in next(iterator)["id"]) for _ in range(3)] == [list(range(10))] * 3
