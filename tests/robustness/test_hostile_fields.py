"""Hostile checkpoint fields are refused by every entry point, and never reach the terminal raw.

A real Orbax root (a RepeatIterator saved at steps 1 and 2); step 2's header
is then replaced by a crafted one. Each case is tried through every way a
user reads a state: an Orbax restore (the v0 and the v1 API), `set_state` on the iterator, and the
CLI verbs `inspect`, `verify`, `audit` and `diff`. A refusal is an
`InvalidStateError` naming the field or the path; the CLI exits 1 with that
message, never with a traceback.
"""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import cli
from ckpt_iter import errors

RECORDS = [{"prompts": f"prompt {i}", "answer": i} for i in range(12)]
HEADER = "process_0-of-1.json"


def _iterator():
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=0, num_epochs=2))
  return ckpt_iter.RepeatIterator(
      source, produce=lambda b: {"ids": np.asarray(b["answer"]) + 1}, num_repeats=2, group_size=2,
      shuffle_seed=7)


@pytest.fixture
def root(tmp_path):
  path = tmp_path / "root"
  iterator = _iterator()
  options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False)
  with ocp.CheckpointManager(str(path), options=options) as manager:
    for step in (1, 2):
      next(iterator)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
  return path


def _nested(depth: int):
  value = {"next_index": 0}
  for _ in range(depth):
    value = {"a": value}
  return value


def _with(field_path: tuple[str, ...], value):
  def mutate(header: dict) -> dict:
    node = header
    for key in field_path[:-1]:
      node = node.setdefault(key, {})
    node[field_path[-1]] = value
    return header
  return mutate


# name -> (how step 2's header is changed, what the refusal names)
CASES = {
    "surrogate_in_fingerprint": (_with(("fingerprint", "source"), "records\ud800"), "field 'fingerprint'"),
    "surrogate_in_lineage_digest": (
        _with(("lineage",), {"resumes": 1, "digest": "\udfff" * 16, "recent": [{"step": 1, "state": "x"}]}),
        "field 'lineage'"),
    "lineage_run_not_a_step": (_with(("lineage", "run"), [2**70]), "field 'lineage'"),
    "surrogate_in_position_key": (_with(("position", "\ud800"), 1), "position"),
    "position_nested_500_deep": (_with(("position",), _nested(500)), "nested deeper than 64 levels"),
    "nested_state_holding_a_lineage": (
        _with(("position", "parent", "lineage"), {"resumes": 0, "digest": "0" * 16, "recent": []}),
        r"nested state holds \['lineage'\]"),
    "nested_state_holding_pending": (
        _with(("position", "parent", "pending"), {"items": [], "schedule": []}), r"nested state holds \['pending'\]"),
    "nested_state_of_an_unknown_kind": (_with(("position", "parent", "kind"), "model"), "field 'kind'"),
}

# Cases of the pending items' stored form (a header's groups; `set_state` takes items, not groups).
STORED_CASES = {
    **CASES,
    "pending_item_in_two_groups": (
        lambda h: {**h, "pending": {**h["pending"], "groups": h["pending"]["groups"] * 2}}, "is twice"),
    "pending_column_holding_a_tree": (lambda h: {**h, "pending": {**h["pending"], "groups": [
        _tree_in_a_column(group) for group in h["pending"]["groups"]]}}, "a column holds JSON scalars"),
}


def _tree_in_a_column(group: dict) -> dict:
  """The group with its items made one Python scalar leaf, whose column holds trees instead."""
  size = sum(stop - start for start, stop in group["members"])
  return {**group, "structure": {"column": 0}, "columns": [[{"dict": {}}] * size]}


def _craft(root, mutate, step_dir: str = "2") -> str:
  path = root / step_dir / "data" / HEADER
  # Whole, as a process whose pod part differs writes it (the fingerprints and lineage in the header).
  header = json.loads(json.dumps(_files.read_header(str(path))))
  # json.dumps escapes a lone surrogate as \\ud800, which the reader decodes back.
  path.write_text(json.dumps(mutate(header)))
  return str(path)


def _cli(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.parametrize("name", sorted(STORED_CASES))
def test_a_hostile_field_is_refused_by_an_orbax_restore(root, name):
  mutate, names = STORED_CASES[name]
  _craft(root, mutate)
  with ocp.CheckpointManager(str(root)) as manager:
    with pytest.raises(errors.InvalidStateError, match=names):
      manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(_iterator())))
    manager.restore(1, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(_iterator())))


@pytest.mark.parametrize("name", sorted(STORED_CASES))
def test_a_hostile_field_is_refused_by_an_orbax_v1_restore(tmp_path, name):
  """Orbax's v1 API restores an iterator as a checkpointable: the same refusal, the good step still restores."""
  import orbax.checkpoint.experimental.v1 as ocp1  # pylint: disable=g-import-not-at-top

  mutate, names = STORED_CASES[name]
  iterator = _iterator()
  for step in (1, 2):
    next(iterator)
    ocp1.save_checkpointables(str(tmp_path / f"step_{step}"), {"data": iterator})
  assert json.loads((tmp_path / "step_2" / "data" / HEADER).read_text())["pending"] is not None
  _craft(tmp_path / "step_2", mutate, step_dir="")
  with pytest.raises(errors.InvalidStateError, match=names):
    ocp1.load_checkpointables(str(tmp_path / "step_2"), {"data": _iterator()})
  resumed = _iterator()
  ocp1.load_checkpointables(str(tmp_path / "step_1"), {"data": resumed})
  expected = _iterator()
  next(expected)
  assert [next(resumed)["ids"].tolist() for _ in range(3)] == [next(expected)["ids"].tolist() for _ in range(3)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hostile_field_is_refused_by_set_state(root, name):
  mutate, names = CASES[name]
  header = mutate(json.loads((root / "2" / "data" / HEADER).read_text()))
  header = json.loads(json.dumps(header))  # the form a caller's dict would have
  header.pop("arrays", None)
  header.pop("arrays_digest", None)
  header["pending"] = None
  with pytest.raises(errors.InvalidStateError, match=names):
    _iterator().set_state(header)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("verb", ["inspect", "verify", "audit"])
def test_a_hostile_field_is_reported_by_the_cli_not_crashed_on(root, capsys, name, verb):
  mutate, _ = CASES[name]
  path = _craft(root, mutate)
  argv = [verb, str(root)] + (["--step", "2"] if verb == "inspect" else [])
  code, out, err = _cli(capsys, *argv)
  assert code == cli.EXIT_PROBLEMS, (out, err)
  assert "Traceback" not in out + err
  assert path in out + err
  assert "\ud800" not in out + err and "\udfff" not in out + err


def test_a_symlinked_state_file_is_refused_everywhere_and_its_target_never_shown(root, tmp_path, capsys):
  secret = tmp_path / "credentials.json"
  secret.write_text(json.dumps({"client_secret": "hunter2-do-not-print", "next_index": 0}))
  header = root / "2" / "data" / HEADER
  header.unlink()
  os.symlink(secret, header)
  with ocp.CheckpointManager(str(root)) as manager:
    with pytest.raises(errors.InvalidStateError, match=rf"{header}: cannot read the state file \(is a symbolic link"):
      manager.restore(2, args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(_iterator())))
  for argv in (["inspect", str(root), "--step", "2"], ["verify", str(root)], ["audit", str(root)],
               ["diff", str(root), "--step", "1", "--step", "2"]):
    code, out, err = _cli(capsys, *argv)
    assert code == cli.EXIT_PROBLEMS, (argv, out, err)
    assert "hunter2" not in out + err and "symbolic link" in out + err, argv


def test_control_characters_in_a_field_are_printed_escaped(root, capsys):
  forged = "records\x1b[2J\rverdict: ok\nforged line\u202e"
  _craft(root, _with(("fingerprint", "source"), forged))
  for argv in (["inspect", str(root), "--step", "2"], ["diff", str(root), "--step", "1", "--step", "2"]):
    code, out, err = _cli(capsys, *argv)
    shown = out + err
    assert "\x1b" not in shown and "\r" not in shown and "\u202e" not in shown, argv
    assert "\\x1b[2J\\rverdict: ok" in shown, (argv, shown)
    assert "\nforged line" not in shown, argv  # a value never starts a line of its own
