"""A data item's directory (`_files.check_item_directory`): a step linked out of its root is refused.

Real Orbax item directories written by the handler in a temporary root; every
reading verb of the command line refuses the same way a restore does.
"""

import os

import pytest

from ckpt_iter import errors



def _two_steps(root: str) -> None:
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(_ten_records())
  for step in (1, 2):
    next(iterator)
    item = os.path.join(root, str(step), "data")
    os.makedirs(item)
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))


def _ten_records():
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  return ckpt_iter.make_dataset([{"id": i} for i in range(10)], batch_size=2, seed=None, num_epochs=None,
                                shard_index=0, shard_count=1)


def _restore(item: str):
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  iterator = ckpt_iter.DataIterator(_ten_records())
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(item, ckpt_iter.IteratorRestore(iterator))
  return iterator


@pytest.mark.parametrize("linked", ["item", "step"])
def test_a_step_linked_out_of_its_root_is_refused_by_restore_and_every_verb(tmp_path, capsys, linked):
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  root = str(tmp_path / "run")
  _two_steps(root)
  moved = os.path.join(root, "2", "data") if linked == "item" else os.path.join(root, "2")
  outside = str(tmp_path / "elsewhere")
  os.rename(moved, outside)
  os.symlink(outside, moved)
  refusal = f"resolves to {os.path.realpath(os.path.join(root, '2', 'data'))}, outside the checkpoint root {root}"
  with pytest.raises(errors.InvalidStateError, match="outside the checkpoint root") as info:
    _restore(os.path.join(root, "2", "data"))
  assert refusal in str(info.value) and "Move or copy the directory into the root" in str(info.value)
  for argv in (["inspect", root, "--step", "2"], ["verify", root], ["audit", root], ["which", root, "--step", "2"],
               ["diff", root, "--step", "1", "--step", "2"], ["order", root, "--out", str(tmp_path / "o.jsonl")]):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == cli.EXIT_PROBLEMS and refusal in out + err and "Traceback" not in out + err, (argv, out, err)
  assert cli.main(["inspect", root, "--step", "1"]) == 0  # the other steps read as before


def test_a_link_inside_the_root_and_a_linked_root_are_followed(tmp_path):
  real_root = str(tmp_path / "run")
  _two_steps(real_root)
  os.rename(os.path.join(real_root, "2", "data"), os.path.join(real_root, "2", "data.moved"))
  os.symlink(os.path.join(real_root, "2", "data.moved"), os.path.join(real_root, "2", "data"))
  linked_root = str(tmp_path / "link_to_run")
  os.symlink(real_root, linked_root)
  for root in (real_root, linked_root):
    assert [int(x) for x in next(_restore(os.path.join(root, "2", "data")))["id"]] == [4, 5]
