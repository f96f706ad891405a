"""What one process reads to restore: O(1) files, O(1 + N/M) when elastic.

Every file a restore opens is counted by wrapping `builtins.open` (the only
way `_files` opens a state file), every stat of a state file's path by
wrapping `os.stat`, and every directory listing by wrapping `os.listdir` and
`os.scandir`, so the counts are what really happened. N saved processes are
simulated in one process with `IteratorCheckpointHandler(process_index,
process_count)`.
"""

import builtins
import contextlib
import dataclasses
import json
import math
import os
import re

import ml_dtypes
import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import _item as item_lib
from ckpt_iter import elastic
import support

ROWS_PER_PROCESS = 24  # every N -> M below splits it evenly
_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.(json|npz)$")


def produce(batch):
  ids = np.asarray(batch["id"])
  return {
      "id": ids,
      "completion_ids": (ids[:, None] * 3 + np.arange(2)).astype(np.int32),
      "logps": [np.cos(ids * 0.3).astype(ml_dtypes.bfloat16)],
  }


def iterator(shard_index, shard_count, global_rows, *, pending):
  records = [{"id": i} for i in range(global_rows * 4)]
  source = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      records, batch_size=global_rows // shard_count, seed=1, num_epochs=None,
      shard_index=shard_index, shard_count=shard_count))
  if not pending:
    next(source)
    return source
  it = ckpt_iter.RepeatIterator(source, produce=produce, num_repeats=3, shuffle_seed=9)
  next(it)  # mid-group: the item is pending on every process
  return it


def save(directory, count, *, pending=True):
  for index in range(count):
    it = iterator(index, count, ROWS_PER_PROCESS * count, pending=pending)
    checkpoint_lib.IteratorCheckpointHandler(index, count).save(directory, ckpt_iter.IteratorSave(it))


class IoCalls:
  """What a restore did to the item's files."""

  def __init__(self):
    self.opened = []  # (process_index, "json" | "npz") of each state file; (None, "count") for the count file
    self.stat = []  # (process_index, extension) of each state file whose path was stat'ed
    self.listings = 0


@contextlib.contextmanager
def counted_io():
  calls = IoCalls()
  real = builtins.open, os.stat, os.listdir, os.scandir
  real_open, real_stat, real_listdir, real_scandir = real

  def state_file(file):
    return _STATE_FILE.search(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else None

  def counting_open(file, *args, **kwargs):
    match = state_file(file)
    if match:
      calls.opened.append((int(match.group(1)), match.group(3)))
    elif isinstance(file, (str, os.PathLike)) and os.path.basename(os.fspath(file)) == _files.COUNT_FILE:
      calls.opened.append((None, "count"))
    return real_open(file, *args, **kwargs)

  def counting_stat(path, *args, **kwargs):
    match = state_file(path)
    if match:
      calls.stat.append((int(match.group(1)), match.group(3)))
    return real_stat(path, *args, **kwargs)

  def counting_listdir(*args):
    calls.listings += 1
    return real_listdir(*args)

  def counting_scandir(*args):
    calls.listings += 1
    return real_scandir(*args)

  builtins.open, os.stat, os.listdir, os.scandir = counting_open, counting_stat, counting_listdir, counting_scandir
  try:
    yield calls
  finally:
    builtins.open, os.stat, os.listdir, os.scandir = real


def expected_state(directory, saved_count, index, count):
  """Process `index` of `count`, computed from all N files with plain numpy."""
  states = [_files.read_state(directory, i, saved_count) for i in range(saved_count)]

  def cut(arrays):
    whole = np.concatenate(arrays, axis=0)
    rows = whole.shape[0] // count
    return whole[index * rows : (index + 1) * rows]

  items = []
  for number in range(len(states[0].pending.items)):
    parts = [s.pending.items[number] for s in states]
    items.append({
        "id": cut([p["id"] for p in parts]),
        "completion_ids": cut([p["completion_ids"] for p in parts]),
        "logps": [cut([p["logps"][0] for p in parts])],
    })
  return states, items


def assert_items_equal(got, expected):
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    for key in ("id", "completion_ids"):
      assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
      assert a[key].tobytes() == b[key].tobytes()
    assert a["logps"][0].dtype == b["logps"][0].dtype
    assert a["logps"][0].tobytes() == b["logps"][0].tobytes()


@pytest.mark.parametrize("pending", [True, False], ids=["pending", "no_pending"])
def test_same_count_restore_opens_one_header_and_at_most_one_npz(tmp_path, pending):
  save(tmp_path, 8, pending=pending)
  own = lambda index: [(index, "json"), (index, "npz")] if pending else [(index, "json")]  # noqa: E731
  for index in (0, 5, 7):
    # A plain restore: its own files, no count file, no stat of a path, no listing.
    with counted_io() as calls:
      value = item_lib.read_item(tmp_path, index, 8).value
    assert (calls.opened, calls.stat, calls.listings) == (own(index), [], 0)
    assert elastic.data_part(value).fingerprint["shard_index"] == index
    # elastic=True with the saved count: the count file, then the same files, and nothing else (a missing
    # file is refused by the process it belongs to).
    with counted_io() as calls:
      value = elastic.read_for_process(tmp_path, index, 8)
    assert (calls.opened, calls.stat, calls.listings) == ([(None, "count")] + own(index), [], 0)
    assert elastic.data_part(value).fingerprint["shard_index"] == index


@pytest.mark.parametrize("saved,restored", [(16, 4), (4, 16), (6, 4), (3, 2), (2, 3), (8, 1), (1, 8)])
def test_elastic_restore_reads_only_the_files_that_hold_its_rows(tmp_path, saved, restored):
  save(tmp_path, saved)
  budget = math.ceil(saved / restored) + 1
  states, _ = expected_state(tmp_path, saved, 0, restored)
  headers_checked = set()
  for index in range(restored):
    with counted_io() as calls:
      value = elastic.read_for_process(tmp_path, index, restored)
    opened = calls.opened
    assert opened[0] == (None, "count") and calls.listings == 0  # the saved count, without a listing
    headers = [i for i, ext in opened if ext == "json"]
    arrays = [i for i, ext in opened if ext == "npz"]
    assert len(set(headers)) == len(headers) and len(set(arrays)) == len(arrays), opened
    assert len(arrays) <= budget, opened
    assert len(headers) <= budget + (0 not in arrays), opened
    assert set(arrays) <= set(headers)
    assert arrays == list(elastic.overlapping_files(saved, index, restored))
    headers_checked |= set(headers)
    _, items = expected_state(tmp_path, saved, index, restored)
    assert_items_equal(value.pending.items, items)
    assert_items_equal(elastic.redistribute(states, index, restored).pending.items, items)
    assert value.position == states[0].position
    assert value.shuffle_key == states[0].shuffle_key
    assert value.pending.schedule == states[0].pending.schedule
    assert value.fingerprint == states[0].fingerprint
  # Together the new processes check every saved file against process 0's.
  assert headers_checked == set(range(saved))


def test_elastic_restore_without_pending_reads_no_arrays(tmp_path):
  save(tmp_path, 16, pending=False)
  for index in range(4):
    with counted_io() as calls:
      value = elastic.read_for_process(tmp_path, index, 4)
    assert [ext for _, ext in calls.opened] == ["count"] + ["json"] * (len(calls.opened) - 1)
    assert len(calls.opened) - 1 <= math.ceil(16 / 4) + 2
    assert value.pending is None


def test_a_disagreeing_file_is_refused_by_the_processes_that_check_it(tmp_path):
  save(tmp_path, 16)
  bad = 9
  value = _files.read_state(tmp_path, bad, 16)
  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top

  header, arrays = codec.encode_state(dataclasses.replace(value, position={"next_index": 0}))
  _files.write_files(tmp_path, header, arrays, process_index=bad, process_count=16)
  refused = []
  for index in range(4):
    if bad in elastic.checked_files(16, index, 4):
      with pytest.raises(ckpt_iter.InvalidStateError, match=rf"process_{bad}-of-16\.json has position="):
        elastic.read_for_process(tmp_path, index, 4)
      refused.append(index)
    else:
      elastic.read_for_process(tmp_path, index, 4)
  assert refused  # at least the process whose rows the file holds
  assert set(refused) >= {bad * 4 // 16}


def test_checked_files_cover_every_saved_file_within_the_budget():
  for saved in range(1, 40):
    for restored in range(1, 40):
      budget = math.ceil(saved / restored) + 1
      union = set()
      for index in range(restored):
        rows_from = elastic.overlapping_files(saved, index, restored)
        checked = elastic.checked_files(saved, index, restored)
        assert 1 <= len(rows_from) <= budget
        assert set(rows_from) <= set(checked)
        assert len(checked) <= budget + (0 not in rows_from)
        union |= set(checked)
      assert union == set(range(saved)), (saved, restored)


@pytest.mark.parametrize("saved,restored", [(16, 4), (4, 16), (8, 8), (1, 3)])
def test_an_elastic_handler_restore_lists_nothing(tmp_path, saved, restored):
  save(tmp_path, saved)
  results = {}
  for count_file in (True, False):
    if not count_file:  # an item written before the count file (its headers whole, as then): listed once
      for name in os.listdir(tmp_path):
        if name.startswith("process_") and name.endswith(".json"):
          whole = _files.read_header(str(tmp_path / name))
          (tmp_path / name).write_text(json.dumps(whole))
      os.remove(tmp_path / _files.COUNT_FILE)
    index = restored // 2
    global_rows = ROWS_PER_PROCESS * saved
    fresh = ckpt_iter.RepeatIterator(ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        [{"id": i} for i in range(global_rows * 4)], batch_size=global_rows // restored, seed=1,
        num_epochs=None, shard_index=index, shard_count=restored)),
        produce=produce, num_repeats=3, shuffle_seed=9)
    with counted_io() as calls:
      checkpoint_lib.IteratorCheckpointHandler(index, restored).restore(
          tmp_path, ckpt_iter.IteratorRestore(fresh, elastic=True))
    # The count file is tried first (an open that fails when there is none).
    assert calls.opened.count((None, "count")) == 1
    assert calls.listings == (0 if count_file else 1)
    results[count_file] = fresh.state()
  assert results[True].position == results[False].position
  assert_items_equal(results[True].pending.items, results[False].pending.items)


# --- A pod whose processes agreed when saved (`_pod_exchange.share_arrays`): one header for all -----------------


def _agreed(directory, count):
  """What process 0's header records the pod agreed on, or None."""
  path = _files.header_path(str(directory), 0, count)
  return _files.agreed_in(json.loads(open(path).read()), path)


def save_pod(directory, count, *, pending=True, ahead=()):
  """Saves N processes at once, as a JAX job does; the processes in `ahead` read one global batch more."""
  iterators = [iterator(i, count, ROWS_PER_PROCESS * count, pending=pending) for i in range(count)]
  for index in ahead:
    next(iterators[index])
  return support.save_as_pod(directory, iterators)


@pytest.mark.parametrize("pending", [True, False], ids=["pending", "no_pending"])
@pytest.mark.parametrize("saved,restored", [(16, 4), (4, 16), (6, 4), (3, 2), (2, 3), (8, 1), (6, 9)])
def test_a_pod_that_agreed_restores_with_another_count_from_the_files_of_its_rows(tmp_path, saved, restored, pending):
  save_pod(tmp_path, saved, pending=pending)
  assert _agreed(tmp_path, saved) is not None
  states = [_files.read_state(str(tmp_path), i, saved) for i in range(saved)]
  for index in range(restored):
    rows_from = elastic.overlapping_files(saved, index, restored)
    with counted_io() as calls:
      value = elastic.read_for_process(tmp_path, index, restored)
    # Process 0's header (and its npz where it holds rows of this process), then the files of its rows.
    own = [(0, "json")] + [(0, "npz")] * (pending and 0 in rows_from)
    if pending:
      own += [(i, ext) for i in rows_from if i != 0 for ext in ("json", "npz")]
    assert (calls.opened, calls.stat, calls.listings) == ([(None, "count")] + own, [], 0)
    assert codec.state_parts(value) == codec.state_parts(elastic.redistribute(states, index, restored))
    if pending:
      assert_items_equal(value.pending.items, expected_state(tmp_path, saved, index, restored)[1])
  # The resume a restore records names the state process 0 saved, as when every header is read.
  agreed = item_lib.read_item(str(tmp_path), restored - 1, restored, elastic=True).resumed()
  first = tmp_path / f"process_0-of-{saved}.json"
  first.write_bytes(re.sub(rb',"agreed_sha256":"[0-9a-f]{64}"', b"", first.read_bytes()))
  assert _agreed(tmp_path, saved) is None
  checked = item_lib.read_item(str(tmp_path), restored - 1, restored, elastic=True).resumed()
  assert agreed.lineage == checked.lineage and codec.state_parts(agreed) == codec.state_parts(checked)


def test_a_process_ahead_of_process_0_leaves_the_step_unagreed_and_is_refused_by_its_readers(tmp_path):
  save_pod(tmp_path, 8, ahead=[5])
  assert _agreed(tmp_path, 8) is None
  for index in range(2):  # the whole window is checked again: the process whose rows file 5 holds refuses
    if 5 in elastic.checked_files(8, index, 2):
      with pytest.raises(ckpt_iter.InvalidStateError, match=r"process_5-of-8\.json has counters="):
        elastic.read_for_process(tmp_path, index, 2)


@pytest.mark.parametrize("edited, pending", [(6, True), (0, False)])
def test_a_header_edited_after_the_pod_agreed_is_refused_naming_it(tmp_path, edited, pending):
  save_pod(tmp_path, 8, pending=pending)
  path = tmp_path / f"process_{edited}-of-8.json"
  header = json.loads(path.read_text())
  header["shuffle_key"] = [1, 2]
  path.write_text(json.dumps(header))
  with pytest.raises(ckpt_iter.InvalidStateError,
                     match=rf"process_{edited}-of-8\.json: its data state is not the one all 8 processes agreed on"):
    elastic.read_for_process(tmp_path, 3, 4)  # rows of files 6 and 7, and process 0's header
  if edited:
    elastic.read_for_process(tmp_path, 0, 4)  # a process that takes no row of it does not read it


def test_a_lane_position_is_read_from_process_0s_file_and_each_file_of_its_rows(tmp_path):
  def lanes(index, count):
    it = ckpt_iter.DataIterator(support.make_dataset(
        support.sample_records(400), batch_size=8 // count, num_epochs=None, filter=lambda r: r["id"] % 2 == 0,
        chunk_size=16, num_lanes=8, shard_index=index, shard_count=count))
    for _ in range(9):
      next(it)
    return it

  support.save_as_pod(tmp_path, [lanes(i, 4) for i in range(4)])
  assert _agreed(tmp_path, 4) is not None
  states = [_files.read_state(str(tmp_path), i, 4) for i in range(4)]
  with counted_io() as calls:
    saved_first = []
    value = elastic.read_for_process(tmp_path, 1, 2, saved_first=saved_first)
  assert calls.opened == [(None, "count"), (0, "json"), (2, "json"), (3, "json")]
  assert codec.state_parts(value) == codec.state_parts(elastic.redistribute(states, 1, 2))
  assert saved_first == [states[0]]


def test_two_files_of_a_pod_that_agreed_swapped_are_refused_by_the_process_taking_their_rows(tmp_path):
  save_pod(tmp_path, 8)
  for ext in ("json", "npz"):  # process 6's files under process 7's name, and back
    six, seven = tmp_path / f"process_6-of-8.{ext}", tmp_path / f"process_7-of-8.{ext}"
    os.rename(six, tmp_path / "swap"), os.rename(seven, six), os.rename(tmp_path / "swap", seven)
  with pytest.raises(ckpt_iter.InvalidStateError, match=r"process_6-of-8\.json was written by shard 7 of 8"):
    elastic.read_for_process(tmp_path, 3, 4)
