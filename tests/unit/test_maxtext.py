"""ckpt_iter.maxtext's reading of MaxText's config: what it refuses, by name, and how it names sources.

No MaxText needed: a config is any object with MaxText's attribute names
(tests/maxtext runs the real one).
"""

from __future__ import annotations

import types

import pytest

from ckpt_iter import errors
from ckpt_iter import maxtext


def _config(**changes):
  values = dict(use_sft=False, use_dpo=False, use_multimodal=False, is_offline_distillation=False,
                colocated_python_data_input=False, grain_file_type="parquet", expansion_factor_real_data=-1.0,
                num_epoch=1, grain_train_files="/data/train-*.parquet", grain_train_mixture_config_path="",
                train_data_columns=["text"])
  values.update(changes)
  return types.SimpleNamespace(**values)


def test_maxtexts_defaults_for_pretraining_are_accepted():
  maxtext.check_config(_config())
  maxtext.check_config(_config(grain_file_type="arrayrecord", expansion_factor_real_data=1.0))


@pytest.mark.parametrize("key, value, says", [
    ("use_sft", True, "PeftTrainer"),
    ("use_dpo", True, "DPO"),
    ("use_multimodal", True, "use_multimodal=false"),
    ("is_offline_distillation", True, "text pretraining"),
    ("colocated_python_data_input", True, "colocated_python_data_input=false"),
    ("grain_file_type", "tfrecord", "arrayrecord, parquet, jsonl"),
    ("grain_file_type", "mmap_npy", "arrayrecord, parquet, jsonl"),
    ("expansion_factor_real_data", 2.0, "unset it (-1)"),
    ("expansion_factor_real_data", 0.5, "unset it (-1)"),
    ("num_epoch", 0, "1 or more"),
    ("train_data_columns", ["text", "title"], "one text column"),
])
def test_a_setting_it_cannot_honour_is_refused_naming_the_key_value_and_fix(key, value, says):
  with pytest.raises(errors.UnsupportedConfigError) as refused:
    maxtext.check_config(_config(**{key: value}))
  message = str(refused.value)
  assert f"{key}={value!r}" in message or f"{key}={value}" in message
  assert says in message


@pytest.mark.parametrize("name, expected", [
    ("gs://bucket/c4/train-*.array_record", "gs_bucket_c4_train_array_record"),
    ("web", "web"),
    ("2024-crawl", "s_2024_crawl"),
    ("***", "source"),
])
def test_a_mixture_source_is_named_by_its_pattern_as_an_identifier(name, expected):
  assert maxtext.source_name(name) == expected
  assert maxtext.source_name(name).isidentifier()


def test_a_mixture_part_without_its_weight_is_refused_naming_the_part():
  with pytest.raises(errors.InvalidArgumentError, match=r"'/data/b-\*.parquet' is not 'pattern,weight'"):
    maxtext.sources(_config(grain_train_files="/data/a-*.parquet,0.7;/data/b-*.parquet"))


def test_the_data_items_of_the_steps_an_emergency_manager_deleted_are_deleted(tmp_path):
  for step in (1, 2, 5, 7):
    (tmp_path / str(step) / "iter").mkdir(parents=True)
  (tmp_path / "notes").mkdir()
  # The manager keeps 5 and 9; 7 is newer than its oldest (an asynchronous save it has not listed yet).
  maxtext._drop_data_items_before(str(tmp_path), [5, 9])  # pylint: disable=protected-access
  assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "7", "notes"]
  maxtext._drop_data_items_before(str(tmp_path), [])  # pylint: disable=protected-access
  assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "7", "notes"]


def test_an_emergency_managers_data_items_are_beside_its_directory():
  manager = types.SimpleNamespace(directory="gs://bucket/run/checkpoints/")
  assert maxtext.emergency_data_root(manager) == "gs://bucket/run/checkpoints-ckpt_iter-data"


def test_hugging_face_files_are_refused_naming_the_pattern_and_the_way():
  with pytest.raises(errors.UnsupportedConfigError, match=r"grain_train_files='hf://datasets/c4/\*\.parquet'.*"
                                                          r"HuggingFaceSource"):
    maxtext.sources(_config(grain_train_files="hf://datasets/c4/*.parquet"))
