"""Roots written with Orbax's step-name options: the CLI reads them and the lineage names the step."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path import step as orbax_step  # the rule ckpt_iter mirrors
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import cli
from ckpt_iter import _item as item_lib

RECORDS = [{"prompts": f"prompt {i}", "answer": i} for i in range(12)]


def _iterator():
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=0, num_epochs=2))
  return ckpt_iter.RepeatIterator(
      source, produce=lambda b: {"ids": np.asarray(b["answer"]) + 1}, num_repeats=2, group_size=2,
      shuffle_seed=7)


@pytest.mark.parametrize("name", [
    "0", "12", "00000012", "ckpt_12", "ckpt_00000012", "a_b_7", "run-1_3",
    "12.orbax-checkpoint-tmp-1700000000", "ckpt_3.orbax-checkpoint-tmp-1", "x", "_5", "ckpt_", "",
])
def test_step_names_are_read_as_orbax_reads_them(name):
  try:
    expected = orbax_step.step_from_checkpoint_name(name)
  except ValueError:
    expected = None
  if ".orbax-checkpoint-tmp" in name:
    expected = None  # Orbax parses a tmp name too; it is not a step (uncommitted)
  assert item_lib.step_of_directory_name(name) == expected


@pytest.mark.parametrize("options, step_dir", [
    (dict(step_format_fixed_length=8), "00000003"),
    (dict(step_prefix="ckpt"), "ckpt_3"),
    (dict(step_prefix="ckpt", step_format_fixed_length=4), "ckpt_0003"),
])
def test_the_cli_and_the_lineage_read_roots_with_orbax_step_names(tmp_path, capsys, options, step_dir):
  root = tmp_path / "root"
  manager_options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False, **options)
  iterator = _iterator()
  with ocp.CheckpointManager(str(root), options=manager_options) as manager:
    for step in (1, 2, 3):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  assert (root / step_dir / "data").is_dir()
  # A resume from step 3, saved again at 4: the lineage records step 3.
  resumed = _iterator()
  with ocp.CheckpointManager(str(root), options=manager_options) as manager:
    manager.restore(3, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(resumed)))
    next(resumed)
    manager.save(4, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(resumed)))
  step_4 = step_dir[:-1] + "4"
  saved = _files.read_state(str(root / step_4 / "data"), 0, 1)
  assert [entry["step"] for entry in saved.lineage["recent"]] == [3]
  for argv in (["inspect", str(root), "--step", "3"], ["verify", str(root)], ["audit", str(root)],
               ["diff", str(root), "--step", "3", "--step", "4"]):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, (argv, out, err)
  assert cli.main(["inspect", str(root), "--step", "3"]) == cli.EXIT_OK
  out, _ = capsys.readouterr()
  assert f"{root / step_dir / 'data'}" in out and "steps: 1-4" in out
