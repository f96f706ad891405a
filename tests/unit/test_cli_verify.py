"""`ckpt-iter verify` checks what a restore checks: a field a restore refuses, verify refuses by the same message.

Each case saves an honest root with a real Orbax CheckpointManager and
`ckpt_iter.IteratorSave` (a make_dataset pipeline: a single source, or a
mixture for the ledger and weights), corrupts one field of the latest step's
`process_0-of-1.json`, and asks a restore, `verify` and `which`. The other
verify cases (files, arrays, process sets) are in test_cli.py.
"""

import json
import os

import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import cli
import support

MIXTURE = {"a": 2, "b": 1}


def _pipeline(mixture):
  return support.chain_pipeline(1, 0, 4, mixture=mixture)


def _save_root(root, mixture):
  iterator = ckpt_iter.DataIterator(_pipeline(mixture))
  with ocp.CheckpointManager(root, item_names=("data",)) as manager:
    for step in (1, 2, 3):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()


def _restore(root, mixture):
  iterator = ckpt_iter.DataIterator(_pipeline(mixture))
  with ocp.CheckpointManager(root, item_names=("data",)) as manager:
    manager.restore(3, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))


def _set(section, name, value):
  return lambda header: header[section].update({name: value})


# name: (mixture or None, the edit of step 3's header, what every refusal names)
CORRUPT_FIELDS = {
    "skips not JSON": (None, _set("fingerprint", "skips", "not json"), "fingerprint field 'skips'"),
    "a skip range with start > stop": (
        None, _set("fingerprint", "skips", '{"records":[[12,10]]}'), "fingerprint field 'skips'"),
    "next_record -5": (None, _set("position", "next_record", -5), "position field 'next_record'"),
    "next_record '36'": (None, _set("position", "next_record", "36"), "position field 'next_record'"),
    "a garbled mixture ledger": (
        MIXTURE, _set("position", "mixture", {"since_record": "x", "since": 3}), "position field 'mixture'"),
    "a negative weight": (MIXTURE, _set("fingerprint", "weight[a]", -1), "the fingerprint's weight[...] fields"),
}


@pytest.mark.parametrize("name", list(CORRUPT_FIELDS))
def test_verify_refuses_each_field_a_restore_refuses_with_the_restores_message(tmp_path, capsys, name):
  mixture, edit, field = CORRUPT_FIELDS[name]
  root = str(tmp_path / "run")
  _save_root(root, mixture)
  assert cli.main(["verify", root]) == 0  # honest
  capsys.readouterr()
  path = os.path.join(root, "3", "data", "process_0-of-1.json")
  with open(path) as f:
    header = json.load(f)
  edit(header)
  with open(path, "w") as f:
    json.dump(header, f)

  with pytest.raises(ckpt_iter.InvalidStateError) as refused:
    _restore(root, mixture)
  restore_message = str(refused.value)
  assert restore_message.startswith(f"{path}: ") and field in restore_message

  code = cli.main(["verify", root])
  out, err = capsys.readouterr()
  assert code == 1 and "Traceback" not in out + err
  (line,) = out.splitlines()
  # The very message of the restore, the file named once at the front.
  assert line == f"step 3: {path}: {restore_message[len(path) + 2:]}"

  code = cli.main(["which", root, "--step", "3"])
  out, err = capsys.readouterr()
  assert code == 1 and "Traceback" not in out + err
  assert field in err, err
  assert "not a stream record" not in err and "rolls back" not in err


def test_verify_checks_each_header_against_the_agreement_a_pods_save_recorded(tmp_path, capsys):
  """A pod of 4 saved at once records in its count file what all agreed on; a restore with another count
  then reads process 0's header alone and checks it hashes to that, and verify checks every header so."""
  item = tmp_path / "run" / "3" / "data"
  iterators = [ckpt_iter.DataIterator(support.chain_pipeline(4, index, 8)) for index in range(4)]
  for iterator in iterators:
    next(iterator)
  item.mkdir(parents=True)
  support.save_as_pod(str(item), iterators)
  assert cli.main(["verify", str(tmp_path / "run")]) == 0
  capsys.readouterr()
  path = str(item / "process_0-of-4.json")
  with open(path) as f:
    header = json.load(f)
  header["position"]["next_record"] += 8  # one global batch further: a sound state, not the one agreed on
  with open(path, "w") as f:
    json.dump(header, f)

  with pytest.raises(ckpt_iter.InvalidStateError) as refused:
    ckpt_iter.elastic.read_for_process(str(item), 1, 2)
  restore_message = str(refused.value)
  assert restore_message.startswith(f"{path}: its data state is not the one all 4 processes agreed on")

  code = cli.main(["verify", str(tmp_path / "run")])
  out, err = capsys.readouterr()
  assert code == 1 and "Traceback" not in out + err
  assert f"step 3: {path}: {restore_message[len(path) + 2:]}" in out.splitlines()
