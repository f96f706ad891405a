"""Tests for ckpt_iter.elastic: re-slicing N process states for M processes.

These run in one process: each "process" is an iterator built with an
explicit shard_index/shard_count and a handler told its process index and
count. tests/test_multihost.py does the same with real JAX processes.
"""

import dataclasses
import json
import os
import tempfile

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import testing
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import elastic
from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib
import support

RECORDS = [{"id": i} for i in range(24)]


def produce(batch):
  ids = np.asarray(batch["id"])
  return {
      "id": ids,
      "completion_ids": (ids[:, None] * 3 + np.arange(2)).astype(np.int32),
      "old_logps": [np.cos(ids * 0.3).astype(np.float32)],
  }


def repeat_iterator(shard_index, shard_count, global_batch_size=4, *, seed=1, group_size=2, num_repeats=2):
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=global_batch_size // shard_count, seed=seed, num_epochs=2,
      shard_index=shard_index, shard_count=shard_count))
  return ckpt_iter.RepeatIterator(
      source, produce=produce, num_repeats=num_repeats, group_size=group_size, shuffle_seed=9)


def save(directory, iterators):
  count = len(iterators)
  for index, it in enumerate(iterators):
    checkpoint_lib.IteratorCheckpointHandler(index, count).save(directory, ckpt_iter.IteratorSave(it))


def restore(directory, iterators, *, elastic_resume=True):
  count = len(iterators)
  for index, it in enumerate(iterators):
    checkpoint_lib.IteratorCheckpointHandler(index, count).restore(
        directory, ckpt_iter.IteratorRestore(it, elastic=elastic_resume))


def global_items(iterators):
  """Reads all processes to the end; step t's global item, rows in process order."""
  steps = []
  for parts in zip(*iterators):
    steps.append({
        "id": np.concatenate([p["id"] for p in parts]),
        "completion_ids": np.concatenate([p["completion_ids"] for p in parts]),
        "old_logps": np.concatenate([p["old_logps"][0] for p in parts]),
    })
  return steps


GLOBAL_SIZES_AND_COUNTS = [(4, (1, 2, 4)), (6, (1, 2, 3)), (8, (1, 2, 4))]


@hypothesis.settings(max_examples=25)
@hypothesis.given(
    data=st.data(),
    sizes=st.sampled_from(GLOBAL_SIZES_AND_COUNTS),
    group_size=st.integers(1, 2),
    num_repeats=st.integers(1, 3),
)
def test_any_n_to_m_resume_yields_the_uninterrupted_global_items(data, sizes, group_size, num_repeats):
  global_batch_size, counts = sizes
  n = data.draw(st.sampled_from(counts), label="saved processes")
  m = data.draw(st.sampled_from(counts), label="restoring processes")
  total = (len(RECORDS) // global_batch_size) * 2 // group_size * group_size * num_repeats
  consumed = data.draw(st.integers(0, total), label="items read before the checkpoint")

  def build(shard_count):
    return [
        repeat_iterator(i, shard_count, global_batch_size, group_size=group_size, num_repeats=num_repeats)
        for i in range(shard_count)
    ]

  # Saved as a JAX job's processes save (at once, their agreement recorded: a restore reads process 0's
  # header for all) or one by one with indices given by hand (no agreement: a window of headers is checked).
  as_pod = data.draw(st.booleans(), label="saved at once, through the job's store")
  saved = build(n)
  for it in saved:
    for _ in range(consumed):
      next(it)
  with tempfile.TemporaryDirectory() as directory:
    if as_pod:
      support.save_as_pod(directory, saved)
    else:
      save(directory, saved)
    header = json.loads(open(_files.header_path(directory, 0, n)).read())
    assert (_files.AGREED_SHA256 in header) == (as_pod and n > 1)
    resumed = build(m)
    restore(directory, resumed)
  testing.assert_trees_equal(global_items(resumed), global_items(saved))


def test_pending_rows_are_resliced_in_process_order(tmp_path):
  saved = [repeat_iterator(i, 2) for i in range(2)]
  for it in saved:
    for _ in range(3):
      next(it)  # group 0 has 4 yields: one pending, with rows from both processes
  save(tmp_path, saved)
  whole = [s.state().pending.items[0]["id"] for s in saved]
  parts = [elastic.read_for_process(tmp_path, j, 4).pending.items[0]["id"] for j in range(4)]
  assert [p.tolist() for p in parts] == [[x] for x in np.concatenate(whole).tolist()]
  first = elastic.read_for_process(tmp_path, 1, 4)
  assert first.position == saved[0].state().position
  assert first.shuffle_key == saved[0].state().shuffle_key
  assert first.pending.schedule == saved[0].state().pending.schedule


def test_the_saved_process_count_returns_each_process_its_own_state(tmp_path):
  saved = [repeat_iterator(i, 2) for i in range(2)]
  for it in saved:
    next(it)
  save(tmp_path, saved)
  for index in range(2):
    state = elastic.read_for_process(tmp_path, index, 2)
    assert state.part.fingerprint["shard_index"] == index
    assert np.array_equal(state.pending.items[0]["id"], saved[index].state().pending.items[0]["id"])


def test_elastic_restore_with_the_saved_count_is_exact_and_allows_a_filter(tmp_path):
  def build(index):
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        RECORDS, batch_size=2, seed=3, shard_index=index, shard_count=2,
    ).filter(lambda batch: int(batch["id"].sum()) % 3 != 0))

  saved = [build(i) for i in range(2)]
  for it in saved:
    next(it)
  save(tmp_path, saved)
  resumed = [build(i) for i in range(2)]
  restore(tmp_path, resumed)
  for a, b in zip(resumed, saved):
    assert [x["id"].tolist() for x in a] == [x["id"].tolist() for x in b]


def test_elastic_restore_may_change_the_global_batch_too(tmp_path):
  # 2 processes x 2 rows read 3 global batches of 4 (records 0-11 of the stream);
  # 1 process with a global batch of 8 continues at record 12.
  def build(index, count, batch_size):
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        RECORDS, batch_size=batch_size, seed=1, num_epochs=2, shard_index=index, shard_count=count))

  stream = [int(i) for b in build(0, 1, 1) for i in b["id"]]
  saved = [build(i, 2, 2) for i in range(2)]
  for it in saved:
    for _ in range(3):
      next(it)
  save(tmp_path, saved)
  resumed = build(0, 1, 8)
  restore(tmp_path, [resumed])
  assert [int(i) for i in next(resumed)["id"]] == stream[12:20]


def test_a_state_saved_before_reading_after_an_elastic_restore_restores_again(tmp_path):
  # Found by the long draw of tests/property/test_changing_the_run.py: 1 process
  # read a global batch of 16 and saved; 2 processes restored it and saved at
  # once; 2 processes restoring that were refused (ContentDriftError), because
  # the first save's content record (a batch of 16 rows) was carried through the
  # elastic restore and checked against a process's batch of 8.
  def build(index, count):
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        RECORDS, batch_size=16 // count, seed=1, num_epochs=2, shard_index=index, shard_count=count))

  stream = [int(i) for b in build(0, 1) for i in b["id"]]
  first = build(0, 1)
  next(first)
  os.makedirs(tmp_path / "1")  # Orbax makes the item directory; the handler writes into it
  save(tmp_path / "1", [first])
  for step in (2, 3):  # saved before reading, then restored at the same count
    resumed = [build(i, 2) for i in range(2)]
    restore(tmp_path / str(step - 1), resumed)
    os.makedirs(tmp_path / str(step))
    save(tmp_path / str(step), resumed)
  assert [int(i) for it in resumed for i in next(it)["id"]] == stream[16:32]


# ---------------------------------------------------------------------------
# Incomplete, inconsistent and unsupported file sets.


def _states(count=2, consumed=3):
  its = [repeat_iterator(i, count) for i in range(count)]
  for it in its:
    for _ in range(consumed):
      next(it)
  return [it.state() for it in its]


def _write(directory, states, count=None):
  count = count or len(states)
  for index, value in enumerate(states):
    if value is None:
      continue
    header, arrays = codec.encode_state(value)
    _files.write_files(directory, header, arrays, process_index=index, process_count=count)


def _with_pending(value, transform):
  items = tuple(transform(item) for item in value.pending.items)
  return dataclasses.replace(value, pending=state_lib.Pending(items, value.pending.schedule))


def _with_part(value, **changes):
  """A repeat state whose nested source state has `changes`."""
  part = dataclasses.replace(value.part, **changes)
  return dataclasses.replace(value, position={**value.position, "parent": part})


def _tweak_second(change):
  def build():
    first, second = _states()
    return [first, change(second)]
  return build


BAD_FILE_SETS = [
    ("missing file", lambda: [_states()[0], None],
     ckpt_iter.InvalidStateError, r"process_1-of-2\.json: missing: process 1 of 2"),
    ("position differs", _tweak_second(lambda s: _with_part(s, position={"next_record": 0})),
     ckpt_iter.InvalidStateError, r"process_1-of-2\.json has position=\{'next_record': 0\}, but process_0-of-2\.json"),
    ("key differs", _tweak_second(lambda s: dataclasses.replace(s, shuffle_key=(1, 2))),
     ckpt_iter.InvalidStateError, r"process_1-of-2\.json has shuffle_key=\(1, 2\)"),
    ("seed differs", _tweak_second(lambda s: _with_part(s, fingerprint={**s.part.fingerprint, "seed": 5})),
     ckpt_iter.InvalidStateError, r"position\.parent\.fingerprint\.seed=5, but process_0-of-2\.json has 1"),
    ("schedule differs", _tweak_second(lambda s: dataclasses.replace(
        s, pending=state_lib.Pending(s.pending.items, s.pending.schedule[:-1]))),
     ckpt_iter.InvalidStateError, r"pending\.schedule"),
    ("files swapped", lambda: _states()[::-1],
     ckpt_iter.InvalidStateError, r"process_0-of-2\.json was written by shard 1 of 2; expected shard 0 of 2"),
    ("scalar leaf", lambda: [_with_pending(s, lambda item: {**item, "step": np.int32(3)}) for s in _states()],
     ckpt_iter.UnsupportedConfigError, r"pending item 0\['step'\].*scalar array.*batch-major"),
    ("rows differ", lambda: [
        _with_pending(s, lambda item, i=i: {**item, "id": item["id"][: i + 1]}) for i, s in enumerate(_states())],
     ckpt_iter.UnsupportedConfigError, r"pending item 0\['id'\]: its arrays differ across processes"),
    ("tunix state", lambda: [dataclasses.replace(s, kind="tunix") for s in _states()],
     ckpt_iter.UnsupportedConfigError, r"Tunix learner's data state.*Restore with 2 processes"),
    ("hand-built", lambda: [_with_part(s, fingerprint={"pipeline": "", "dataset_length": 6}) for s in _states()],
     ckpt_iter.UnsupportedConfigError, r"hand-built and its position is per process"),
]


@pytest.mark.parametrize("build,error,message", [c[1:] for c in BAD_FILE_SETS], ids=[c[0] for c in BAD_FILE_SETS])
def test_bad_file_sets_are_refused_with_the_reason(tmp_path, build, error, message):
  _write(tmp_path, build())
  with pytest.raises(error, match=message):
    elastic.read_for_process(tmp_path, 0, 4)


def test_rows_that_do_not_split_evenly_are_refused(tmp_path):
  _write(tmp_path, _states(count=2))  # 2 x 2 rows per pending item
  with pytest.raises(ckpt_iter.UnsupportedConfigError, match=r"2 x 2 = 4 rows do not split into 3 equal parts"):
    elastic.read_for_process(tmp_path, 0, 3)


def test_mixed_and_missing_process_counts_are_refused(tmp_path):
  with pytest.raises(ckpt_iter.InvalidStateError, match="holds no process_<i>-of-<n>.json"):
    elastic.read_for_process(tmp_path, 0, 1)
  states = _states()
  _write(tmp_path, states)
  _write(tmp_path, states[:1], count=3)
  with pytest.raises(ckpt_iter.InvalidStateError, match="different process counts"):
    elastic.read_for_process(tmp_path, 0, 2)


def test_the_same_process_count_needs_the_whole_set(tmp_path):
  _write(tmp_path, [_states()[0], None])
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"process_1-of-2\.json: missing: process 1 of 2"):
    elastic.read_for_process(tmp_path, 0, 2)


def test_a_process_index_out_of_range_is_refused(tmp_path):
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"process_index=2 is not in \[0, 2\)"):
    elastic.read_for_process(os.fspath(tmp_path), 2, 2)


def test_read_all_checks_positions_only_where_they_are_global(tmp_path):
  (tmp_path / "global").mkdir()
  (tmp_path / "filtered").mkdir()
  _write(tmp_path / "global", _tweak_second(lambda s: dataclasses.replace(s, position={"next_index": 0}))())
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"process_1-of-2\.json has position="):
    support.read_all(tmp_path / "global")
  # A per-process filter: each process's position is its own.
  filtered = [
      ckpt_iter.DataIterator(ckpt_iter.make_dataset(
          RECORDS, batch_size=2, seed=3, shard_index=i, shard_count=2,
      ).filter(lambda batch, i=i: i == 0 or int(batch["id"].sum()) % 2 == 0))
      for i in range(2)
  ]
  for it in filtered:
    next(it)
  save(tmp_path / "filtered", filtered)
  states = support.read_all(tmp_path / "filtered")
  assert states[0].position != states[1].position


# ---------------------------------------------------------------------------
# The saved count from the count file (no listing), and what a restore then
# still refuses.


def _saved_by_handler(directory, count):
  its = [repeat_iterator(i, count, 4) for i in range(count)]
  for it in its:
    next(it)
  save(directory, its)
  return its


def test_the_handler_records_the_process_count_once(tmp_path):
  _saved_by_handler(tmp_path, 4)
  with open(tmp_path / _files.COUNT_FILE) as f:
    assert json.load(f) == {"process_count": 4}
  assert _files.saved_process_count(tmp_path) == 4
  os.remove(tmp_path / _files.COUNT_FILE)  # as an item written before the count file
  assert _files.saved_process_count(tmp_path) == 4  # listed instead


def test_a_missing_file_of_a_recorded_set_is_named_and_changes_nothing(tmp_path):
  _saved_by_handler(tmp_path, 4)
  os.remove(tmp_path / "process_2-of-4.json")
  for index in range(2):  # both windows of 4 -> 2 hold file 2
    it = repeat_iterator(index, 2, 4)
    before = it.state()
    with pytest.raises(ckpt_iter.InvalidStateError,
                       match=r"process_2-of-4\.json: missing: process 2 of 4 wrote no state.*restore an earlier step"):
      checkpoint_lib.IteratorCheckpointHandler(index, 2).restore(
          tmp_path, ckpt_iter.IteratorRestore(it, elastic=True))
    testing.assert_trees_equal(it.state().pending, before.pending)
    assert it.state().position == before.position


def test_a_same_count_elastic_restore_refuses_an_incomplete_set_where_the_file_is_missing(tmp_path):
  _saved_by_handler(tmp_path, 4)
  os.remove(tmp_path / "process_3-of-4.json")
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"process_3-of-4\.json: missing: process 3 of 4"):
    elastic.read_for_process(tmp_path, 3, 4)  # the process it belongs to, in the same job as the others


@pytest.mark.parametrize("text,message", [
    ('{"process_count": "4"}', r"ckpt_iter\.json: field 'process_count' is '4', expected .*delete ckpt_iter\.json"),
    ('{"process_count": 0}', r"field 'process_count' is 0"),
    ('[4]', r"field 'process_count' is \[4\]"),
    ('{"process_count": 4', r"ckpt_iter\.json: not valid JSON"),
    ('{"process_count": 2}', r"ckpt_iter\.json: says 2 processes, but the state files are the set of 4"),
])
def test_a_bad_count_file_is_refused_with_the_fix(tmp_path, text, message):
  _saved_by_handler(tmp_path, 4)
  (tmp_path / _files.COUNT_FILE).write_text(text)
  it = repeat_iterator(0, 2, 4)
  before = it.state()
  with pytest.raises(ckpt_iter.InvalidStateError, match=message):
    checkpoint_lib.IteratorCheckpointHandler(0, 2).restore(tmp_path, ckpt_iter.IteratorRestore(it, elastic=True))
  assert it.state().position == before.position


# ---------------------------------------------------------------------------
# States that cannot be re-sliced (a Tunix learner's) resume with another
# count only when every saved process holds the same one.


def _replicated(count):
  """What each process of a Tunix job feeding the same batches saves: one state, `count` times."""
  value = dataclasses.replace(_states(count=1)[0], kind="tunix")
  return [value] * count


@pytest.mark.parametrize("count", [1, 2, 3])
def test_identical_process_states_are_read_as_one(tmp_path, count):
  states = _replicated(count)
  _write(str(tmp_path), states)
  restored = elastic.read_replicated(str(tmp_path), count)
  assert codec.state_parts(restored) == codec.state_parts(states[0])
  testing.assert_trees_equal(restored.pending.items, states[0].pending.items)


@pytest.mark.parametrize("change, part", [
    (lambda s: dataclasses.replace(s, position={"next_index": 0}), "position"),
    (lambda s: dataclasses.replace(s, fingerprint={**s.fingerprint, "shard_index": 1}), "fingerprint.shard_index"),
    (lambda s: _with_pending(s, _flipped), "array a"),
])
def test_a_process_state_that_differs_is_refused_naming_the_part(tmp_path, change, part):
  first, second, third = _replicated(3)
  _write(str(tmp_path), [first, second, change(third)])
  with pytest.raises(ckpt_iter.UnsupportedConfigError) as refused:
    elastic.read_replicated(str(tmp_path), 3)
  message = str(refused.value)
  assert "process 2 of 3 saved another data state than process 0" in message
  assert f"differ in {part}" in message and "Resume with 3 processes." in message


def _flipped(item):
  """The same pending item with one array element changed (one bit is enough)."""
  def flip(leaf):
    if isinstance(leaf, np.ndarray) and leaf.size:
      leaf = leaf.copy()
      leaf.reshape(-1)[0] += 1
    return leaf
  return {k: flip(v) for k, v in item.items()} if isinstance(item, dict) else flip(item)


def test_state_parts_tell_states_apart_by_any_part():
  (value,) = _replicated(1)
  other = dataclasses.replace(value, counters={**value.counters, "extra": 1})
  assert codec.state_parts(value) == codec.state_parts(dataclasses.replace(value))
  differing = {name for name, digest in codec.state_parts(other).items() if codec.state_parts(value)[name] != digest}
  assert differing == {"counters"}


def test_one_reader_gives_a_step_of_another_process_count_by_the_callers_policy(tmp_path):
  # issue 58 item 15: the learners read another count through a path of their own; read_item is the one reader.
  from ckpt_iter import _item as item_lib  # pylint: disable=g-import-not-at-top

  same, differing = tmp_path / "same", tmp_path / "differing"
  for directory in (same, differing):
    directory.mkdir()
  _write(str(same), _replicated(2))
  first, second = _replicated(2)
  _write(str(differing), [first, dataclasses.replace(second, position={"next_index": 0})])
  with pytest.raises(ckpt_iter.ProcessCountError, match=r"written by 2 process\(es\).*elastic=True"):
    item_lib.read_item(str(same), 0, 1)  # no policy: refused, naming both counts
  shared = item_lib.read_item(str(same), 0, 1, replicated=True)
  assert shared.resized and codec.state_parts(shared.value) == codec.state_parts(first)
  with pytest.raises(ckpt_iter.ProcessCountError, match=r"written by 2 JAX process\(es\); resuming with 1 is exact "
                     r"only when every saved process holds the same data state\..*differ in position"):
    item_lib.read_item(str(differing), 0, 1, replicated=True)
  asked = []
  joined = item_lib.SavedState(first, resized=True, origin="joined", step=None)
  got = item_lib.read_item(str(differing), 0, 1, replicated=True, join=lambda d, n: asked.append((d, n)) or joined)
  assert got is joined and asked == [(str(differing), 2)]
  assert item_lib.read_item(str(same), 0, 2, replicated=True).resized is False  # its own count: its own file
