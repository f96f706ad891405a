"""Checkpoints written before the renovation (commit 310ace5) still restore.

The files under tests/fixtures/ are the old code's output (see its README);
they are copied to a temporary directory first, so no test writes into the
repository.
"""

import dataclasses
import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import conftest

import ckpt_iter
from ckpt_iter import _item as item_lib
from ckpt_iter import _records
from ckpt_iter import state as state_lib

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
_V1_CHECKPOINT = os.path.join(_FIXTURES, "v1_checkpoint")
_V1_TUNIX_ITEM = os.path.join(_FIXTURES, "v1_tunix_data_item")
_STEP = 3


@pytest.fixture
def ckpt_dir(tmp_path):
  """Overrides conftest's: the legacy checkpoint, copied (ckpt_manager opens it)."""
  directory = (tmp_path / "ckpt").absolute()
  shutil.copytree(_V1_CHECKPOINT, directory)
  return directory


def _produce(batch):
  """The rollout stand-in of tests/fixtures/make_v1_checkpoint.py, unchanged."""
  ids = np.asarray(batch["id"])
  return {"ids": ids.astype(np.int32), "logps": np.sin(ids * 1.7).astype(np.float32),
          "completion": (ids[:, None] * 3 + np.arange(5)).astype(np.int64)}


def _as_lists(tree):
  return {k: np.asarray(v).tolist() for k, v in tree.items()}


def test_v1_checkpoint_restores_data_and_repeat_items_exactly(ckpt_dir, ckpt_manager, make_pipeline):
  with open(ckpt_dir / "expected.json") as f:
    expected = json.load(f)
  data = ckpt_iter.DataIterator(make_pipeline())  # 40 records, batch 4, seed 7, 2 epochs
  repeat = ckpt_iter.RepeatIterator(
      ckpt_iter.DataIterator(make_pipeline()), produce=_produce,
      num_repeats=3, group_size=2, shuffle_seed=11)
  assert ckpt_manager.all_steps() == [_STEP]

  restored = ckpt_manager.restore(_STEP, args=ocp.args.Composite(
      data=ckpt_iter.IteratorRestore(data), repeat=ckpt_iter.IteratorRestore(repeat)))

  assert restored["data"] is data and restored["repeat"] is repeat
  assert [_as_lists(next(data)) for _ in range(5)] == expected["data"]
  repeated = [next(repeat) for _ in range(8)]
  assert [_as_lists(item) for item in repeated] == expected["repeat"]
  # JSON holds values, not dtypes: the pending arrays keep the written ones.
  assert {k: v.dtype.str for k, v in repeated[0].items()} == {
      "ids": "<i4", "logps": "<f4", "completion": "<i8"}


def test_v1_checkpoint_refuses_another_pipeline_naming_the_field(ckpt_manager, make_pipeline):
  data = ckpt_iter.DataIterator(make_pipeline(seed=8))
  with pytest.raises(ckpt_iter.ConfigDriftError) as info:
    ckpt_manager.restore(_STEP, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(data)))
  assert "seed=7 there, seed=8 here" in str(info.value)
  assert data.get_state()["position"] == {"next_record": 0}


def _array_record(value):
  if value is None:
    return None
  array = np.asarray(value)
  return {"dtype": array.dtype.str, "shape": list(array.shape), "hex": array.tobytes().hex()}


def test_v1_tunix_data_item_reads_with_its_pending_arrays(tmp_path):
  pytest.importorskip("tunix", reason=conftest.NEEDS_TUNIX)
  import ckpt_iter.tunix  # noqa: F401  (registers TrainExample)

  directory = tmp_path / "data"
  shutil.copytree(_V1_TUNIX_ITEM, directory)
  with open(directory / "expected.json") as f:
    expected = json.load(f)

  value = item_lib.read_item(directory, 0, 1).value

  assert value.kind == "tunix" == expected["kind"]
  # Read as format 4: the input's whole state nested under "input" (its
  # make_dataset position as the stream record it stands for), the learner's
  # own fields left where they were.
  assert expected["format_version"] == 1 and value.format_version == state_lib.FORMAT_VERSION
  flat_position = dict(expected["position"])
  input_position = flat_position.pop("full_batch")
  assert {k: v for k, v in value.position.items() if k != "input"} == flat_position
  nested = value.part
  assert {**nested.fingerprint, **value.fingerprint} == expected["fingerprint"]
  assert (nested.kind, nested.position) == (
      "data", _records.next_record_of_index(nested.fingerprint, input_position))
  assert "learner" in value.fingerprint and "source" in nested.fingerprint
  assert not set(nested.fingerprint) & set(value.fingerprint)
  assert list(value.shuffle_key) == expected["shuffle_key"]
  assert dict(value.counters) == expected["counters"]
  assert list(value.pending.schedule) == expected["schedule"]
  items = [
      {"type": f"{type(item).__module__}.{type(item).__qualname__}",
       "fields": {f.name: _array_record(getattr(item, f.name)) for f in dataclasses.fields(item)}}
      for item in value.pending.items
  ]
  assert items == expected["items"]
  assert any(field is not None for field in items[0]["fields"].values())


# --- format-1 Tunix learner roots (ckpt_iter e237c81, google-tunix 0.1.7) --------------

_V1_ROOTS = os.path.join(_FIXTURES, "v1_tunix_roots")
# (family, data item of the root's latest step, where format 1 kept the input's position)
_V1_LEARNER_ITEMS = [
    ("grpo", "root/actor/4/data", "full_batch"),
    ("sft", "root/3/data", None),
    ("agentic", "root/actor/1/data", "source"),
]


def _header(relative):
  with open(os.path.join(_V1_ROOTS, relative, "process_0-of-1.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("family, item, input_key", _V1_LEARNER_ITEMS)
def test_a_format_1_learner_state_reads_with_its_input_state_nested(family, item, input_key):
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  header = _header(f"{family}/{item}")
  value = state_lib.IteratorState.from_dict(header, origin=family)
  assert header["format_version"] == 1 and value.format_version == state_lib.FORMAT_VERSION
  nested = value.part
  own = {k: v for k, v in value.position.items() if k != "input"}
  saved_position = dict(header["position"])
  input_position = saved_position if input_key is None else saved_position.pop(input_key)
  assert (nested.kind, nested.position) == (
      "data", _records.next_record_of_index(nested.fingerprint, input_position))
  assert own == ({} if input_key is None else saved_position)
  # Every fingerprint field kept, each on its own side: the pipeline's fields
  # with the input, the learner's (and only those) with the learner.
  assert {**nested.fingerprint, **value.fingerprint} == header["fingerprint"]
  assert not set(nested.fingerprint) & set(value.fingerprint)
  assert "dataset_length" in nested.fingerprint
  assert {"num_iterations", "trainer"} & set(value.fingerprint)
  assert not {"pipeline", "graph", "source", "seed"} & set(value.fingerprint)


def test_a_resume_recorded_by_format_1_is_still_proven_by_the_audit(tmp_path):
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  resumed_at_4 = _header("grpo/root/actor/4/data")["lineage"]["recent"][-1]
  step_3 = _header("grpo/root/actor/3/data")
  assert resumed_at_4["step"] == 3
  # The old code digested step 3 as it was written; today's reads it nested.
  assert item_lib.header_resume_digest(step_3, origin="step 3") != resumed_at_4["state"]
  assert resumed_at_4["state"] in item_lib.header_resume_digests(step_3, origin="step 3")
  root = tmp_path / "grpo"
  shutil.copytree(os.path.join(_V1_ROOTS, "grpo", "root"), root)
  assert cli.main(["audit", str(root), "--json"]) == 0


@pytest.mark.parametrize("family, item, shown", [
    ("grpo", "root", "input: epoch 0, 2 of 64 records read (next_record 2)"),
    ("sft", "root", "input: next_index 6"),
    ("agentic", "root", "input: next_index 1"),
])
def test_inspect_shows_every_learner_family_s_input_position(capsys, family, item, shown):
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  assert cli.main(["inspect", os.path.join(_V1_ROOTS, family, item)]) == 0
  out = capsys.readouterr().out
  assert shown in out
  assert '{"' not in out  # no position printed as raw JSON


# --- format 4 (ckpt_iter 8ce205b: each process's header whole) ----------------------------

_V4_ROOT = os.path.join(_FIXTURES, "v4_checkpoint")


def _v4_iterators():
  """The pipelines of tests/fixtures/make_v4_checkpoint.py, unchanged."""
  sources = {"a": [{"id": i} for i in range(30)], "b": [{"id": 100 + i} for i in range(20)]}

  def data():
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        sources, weights={"a": 2, "b": 1}, batch_size=4, seed=3, num_epochs=None, skip=[(10, 13)]))

  def produce(batch):
    ids = np.asarray(batch["id"])
    return {"ids": ids.astype(np.int32), "logps": np.sin(ids * 1.7).astype(np.float32)}

  return data(), ckpt_iter.RepeatIterator(data(), produce=produce, num_repeats=3, group_size=2, shuffle_seed=11)


def test_a_format_4_root_restores_exactly_and_resumes_from_it_are_proven(tmp_path):
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  root = tmp_path / "v4"
  shutil.copytree(_V4_ROOT, root)
  with open(root / "expected.json") as f:
    expected = json.load(f)
  header = _files_header(root / "6" / "data")
  assert header["format_version"] == 4 and header["lineage"]["resumes"] == 2
  data, repeat = _v4_iterators()
  with ocp.CheckpointManager(str(root)) as manager:
    manager.restore(6, args=ocp.args.Composite(
        data=ckpt_iter.IteratorRestore(data), repeat=ckpt_iter.IteratorRestore(repeat)))
    assert [_as_lists(next(data)) for _ in range(5)] == expected["data"]
    assert [_as_lists(next(repeat)) for _ in range(7)] == expected["repeat"]
    # Resumed once more by this code and saved: the audit proves the resumes format 4
    # recorded and the one this code records, in one chain.
    manager.save(7, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(data),
                                            repeat=ckpt_iter.IteratorSave(repeat)))
    manager.wait_until_finished()
  for item in ("data", "repeat"):
    assert cli.main(["audit", str(root), "--item", item, "--json"]) == 0, item
    assert cli.main(["verify", str(root), "--item", item]) == 0, item


def _files_header(directory):
  with open(directory / "process_0-of-1.json") as f:
    return json.load(f)
