"""ckpt_iter.tunix.data.create_dataset: a Tunix YAML data_module."""

import json

import grain
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter import DataIterator
from ckpt_iter import errors
from ckpt_iter.tunix import data


def _write_jsonl(path, count):
  with open(path, "w") as f:
    for i in range(count):
      f.write(json.dumps({"question": f"q{i}", "answer": i}) + "\n")
  return str(path)


def _questions(dataset):
  return [str(record["prompts"]) for record in dataset]


def test_records_with_the_prompt_renamed(tmp_path):
  ds = data.create_dataset(_write_jsonl(tmp_path / "a.jsonl", 4), prompt_key="question")
  assert isinstance(ds, grain.MapDataset)
  assert _questions(ds) == ["q0", "q1", "q2", "q3"]
  assert int(ds[2]["answer"]) == 2


def test_each_epoch_is_its_own_permutation_and_seeded(tmp_path):
  path = _write_jsonl(tmp_path / "a.jsonl", 16)
  ds = data.create_dataset(path, seed=0, num_epochs=2, prompt_key="question")
  order = _questions(ds)
  assert len(order) == 32
  first, second = order[:16], order[16:]
  assert sorted(first) == sorted(second) == sorted(f"q{i}" for i in range(16))
  assert first != second
  assert order == _questions(data.create_dataset(path, seed=0, num_epochs=2, prompt_key="question"))
  assert order != _questions(data.create_dataset(path, seed=1, num_epochs=2, prompt_key="question"))


def test_the_shard_shuffle_is_a_data_config_field(tmp_path):
  paths = [_write_jsonl(tmp_path / f"part-{i}.jsonl", 6) for i in range(3)]  # each file's questions q0..q5
  order = _questions(data.create_dataset(paths, seed=0, prompt_key="question", shuffle="shards", shuffle_window=1))
  # One file at a time: each window of 6 records is one whole file.
  assert all(sorted(order[i:i + 6]) == [f"q{j}" for j in range(6)] for i in (0, 6, 12))
  with pytest.raises(errors.InvalidArgumentError, match="applies to shuffle=\"shards\" only"):
    data.create_dataset(paths, seed=0, shard_size=2)


def test_shard_lanes_is_a_data_config_field_each_process_reading_its_lane(tmp_path):
  paths = []
  for part in range(4):  # 4 files of 6 records; a record's question names its file
    paths.append(str(tmp_path / f"part-{part}.jsonl"))
    with open(paths[-1], "w") as f:
      f.writelines(json.dumps({"question": f"f{part}-q{i}"}) + "\n" for i in range(6))
  made = [data.create_dataset(paths, seed=0, prompt_key="question", shuffle="shards", shuffle_window=1,
                              shard_lanes=2, shard_index=i, shard_count=2) for i in range(2)]
  assert DataIterator(made[0]).state().fingerprint["shuffle_lanes"] == 2
  # Each process reads its lane's share: two whole files of the four, and the two processes all four once.
  read = [_questions(ds) for ds in made]
  by_process = [sorted({q.split("-")[0] for q in questions}) for questions in read]
  assert all(len(questions) == 12 for questions in read) and all(len(files) == 2 for files in by_process)
  assert sorted(read[0] + read[1]) == sorted(f"f{p}-q{i}" for p in range(4) for i in range(6))


def test_parquet_source(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "a.parquet")
  pq.write_table(pa.table({"question": ["x", "y", "z"]}), path)
  assert _questions(data.create_dataset(path, prompt_key="question")) == ["x", "y", "z"]


def test_resumes_in_o1_from_an_index(tmp_path):
  path = _write_jsonl(tmp_path / "a.jsonl", 10)
  uninterrupted = _questions(data.create_dataset(path, seed=3, num_epochs=2, prompt_key="question"))
  iterator = DataIterator(data.create_dataset(path, seed=3, num_epochs=2, prompt_key="question"))
  for _ in range(7):
    next(iterator)
  state = iterator.get_state()
  assert state["position"] == {"next_record": 7}  # a make_dataset position counts stream records
  resumed = DataIterator(data.create_dataset(path, seed=3, num_epochs=2, prompt_key="question"))
  resumed.set_state(state)
  assert [str(r["prompts"]) for r in resumed] == uninterrupted[7:]


def test_resume_with_another_seed_names_the_field(tmp_path):
  path = _write_jsonl(tmp_path / "a.jsonl", 10)
  iterator = DataIterator(data.create_dataset(path, seed=3))
  next(iterator)
  other = DataIterator(data.create_dataset(path, seed=4))
  with pytest.raises(errors.ConfigDriftError, match="seed"):
    other.set_state(iterator.get_state())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seeds": 1}, r"unknown field\(s\) \['seeds'\]"),
        ({"prompt_key": 3}, "prompt_key=3 must be a field name"),
        ({"seed": -1}, "seed"),
        ({"num_epochs": 0}, "num_epochs"),
    ],
)
def test_bad_config_names_the_field(tmp_path, kwargs, message):
  path = _write_jsonl(tmp_path / "a.jsonl", 4)
  with pytest.raises(errors.InvalidArgumentError, match=message):
    data.create_dataset(path, **kwargs)


def test_missing_prompt_key_names_the_fields(tmp_path):
  ds = data.create_dataset(_write_jsonl(tmp_path / "a.jsonl", 2), prompt_key="prompt")
  with pytest.raises(errors.InvalidArgumentError, match=r"prompt_key='prompt'.*\['answer', 'question'\]"):
    ds[0]


# ---------------------------------------------------------------------------
# source: hf (Hugging Face datasets, built locally: no network)


def _hf_dataset(tmp_path, count, name="hf"):
  import datasets  # pylint: disable=g-import-not-at-top  (the test extra installs it)
  path = str(tmp_path / name)
  datasets.Dataset.from_list([{"question": f"q{i}", "answer": i} for i in range(count)]).save_to_disk(path)
  return path


def test_hf_source_from_a_saved_dataset_and_a_builder(tmp_path):
  path = _hf_dataset(tmp_path, 10)
  from_disk = data.create_dataset("hf", path=path, seed=3, num_epochs=2, prompt_key="question")
  from_jsonl = data.create_dataset(_write_jsonl(tmp_path / "a.jsonl", 10), seed=3, num_epochs=2, prompt_key="question")
  assert _questions(from_disk) == _questions(from_jsonl)
  by_builder = data.create_dataset(
      "hf", path="json", data_files=str(tmp_path / "a.jsonl"), split="train",
      cache_dir=str(tmp_path / "cache"), seed=3, num_epochs=2, prompt_key="question",
  )
  assert _questions(by_builder) == _questions(from_jsonl)
  assert int(by_builder[0]["answer"]) == int(from_jsonl[0]["answer"])


def test_hf_source_resumes_and_refuses_a_changed_dataset(tmp_path):
  path = _hf_dataset(tmp_path, 10)
  uninterrupted = _questions(data.create_dataset("hf", path=path, seed=3, prompt_key="question"))
  iterator = DataIterator(data.create_dataset("hf", path=path, seed=3, prompt_key="question"))
  for _ in range(4):
    next(iterator)
  state = iterator.get_state()
  assert state["fingerprint"]["source"] == "hf[hf]"
  resumed = DataIterator(data.create_dataset("hf", path=path, seed=3, prompt_key="question"))
  resumed.set_state(state)
  assert [str(r["prompts"]) for r in resumed] == uninterrupted[4:]
  (tmp_path / "other").mkdir()
  longer = _hf_dataset(tmp_path / "other", 12)
  with pytest.raises(errors.ConfigDriftError, match="source_length"):
    DataIterator(data.create_dataset("hf", path=longer, seed=3, prompt_key="question")).set_state(state)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "hf"}, "source: hf needs path"),
        ({"split": "train"}, r"\['split'\] apply to source: hf only"),
    ],
)
def test_hf_fields_are_checked(tmp_path, kwargs, message):
  kwargs.setdefault("source", _write_jsonl(tmp_path / "a.jsonl", 4))
  with pytest.raises(errors.InvalidArgumentError, match=message):
    data.create_dataset(**kwargs)
