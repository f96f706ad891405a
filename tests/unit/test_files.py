"""A data item's files (`_files`): a step linked out of its root is refused; the pod part, written once.

Real Orbax item directories written by the handler in a temporary root; every
reading verb of the command line refuses the same way a restore does. The
headers' pod part (format 5): written once in the count file, referred to by
each process's header and put back whole by `read_header`.
"""

import json
import os

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ckpt_iter import _codec as codec
from ckpt_iter import _files
from ckpt_iter import _item as item_lib
from ckpt_iter import _pod_exchange
from ckpt_iter import _storage
from ckpt_iter import elastic
from ckpt_iter import errors
from ckpt_iter import state as state_lib
import support



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


# --- The pod part: fingerprint and lineage written once per pod (format 5) -------------------


def _lineage(resumes: int) -> dict:
  lineage = item_lib.empty()
  for step in range(1, resumes + 1):
    lineage = item_lib.extended(lineage, {"step": step, "state": f"{step:016x}", "record": 8 * step})
  return {**lineage, "run": 1}


def _pod_state(index: int, count: int, *, resumes: int = 3, sources: int = 2, skips: int = 1,
               arrays: dict | None = None, repeat: bool = False) -> state_lib.IteratorState:
  fingerprint = {"source": f"mixture[{','.join(f's{k}' for k in range(sources))}]"}
  for k in range(sources):
    fingerprint.update({f"source[s{k}]": "records", f"source_length[s{k}]": 200, f"weight[s{k}]": k + 1})
  fingerprint.update({"seed": 0, "batch_size": 8, "shard_index": index, "shard_count": count})
  if skips:
    fingerprint["skips"] = json.dumps({"records": [[500 + 40 * k, 503 + 40 * k] for k in range(skips)]},
                                      separators=(",", ":"))
  content = {"check": "index", "digest": f"{index:016x}", "fields": {}}
  pending = None if arrays is None else state_lib.Pending(items=(arrays,), schedule=(0,))
  lineage = _lineage(resumes) if resumes else None
  if repeat:  # its source's fingerprint nested in its position: in the pod part too
    parent = state_lib.IteratorState(kind="data", fingerprint=fingerprint, position={"next_record": 96},
                                     content=content)
    return state_lib.IteratorState(
        kind="repeat", fingerprint={"num_repeats": 2, "group_size": 1, "shuffle_seed": 0},
        position={"parent": parent}, shuffle_key=(1, 2), pending=pending, counters={"yielded": 3, "produced": 2},
        lineage=lineage)
  return state_lib.IteratorState(kind="data", fingerprint=fingerprint, position={"next_record": 96},
                                 pending=pending, content=content, lineage=lineage)


def _save(directory, value, index, count):
  header, arrays = codec.encode_state(value)
  item_lib.write(str(directory), header, arrays, index, count)


def _whole(directory, index, count) -> dict:
  """The header as `read_header` gives it (whole), as a dict."""
  return json.loads(json.dumps(_files.read_header(_files.header_path(str(directory), index, count))))


@pytest.fixture
def key_value_store(monkeypatch):
  store = support.KeyValueStore()
  monkeypatch.setattr(_pod_exchange, "_distributed_client", lambda count: store)
  return store


def test_the_pod_part_is_written_once_and_each_process_refers_to_it(tmp_path, key_value_store):
  arrays = {"ids": np.arange(6, dtype=np.int32)}
  states = [_pod_state(index, 3, arrays=arrays) for index in range(3)]
  for index, value in enumerate(states):
    _save(tmp_path, value, index, 3)
  count_file = json.loads((tmp_path / _files.COUNT_FILE).read_text())
  assert count_file["process_count"] == 3 and set(count_file["pod"]) == {"fingerprints", "lineage"}
  assert "shard_index" not in count_file["pod"]["fingerprints"][0] and "seed" in count_file["pod"]["fingerprints"][0]
  for index, value in enumerate(states):
    written = json.loads((tmp_path / f"process_{index}-of-3.json").read_text())
    # Only this process's own fields, and the reference where the lineage was.
    assert written["fingerprint"] == {"shard_index": index} and "lineage" not in written
    assert written[_files.POD_SHA256] == count_file[_files.POD_SHA256]
    assert written["format_version"] == state_lib.FORMAT_VERSION == 5
    restored = _files.read_state(str(tmp_path), index, 3)
    assert (dict(restored.fingerprint), restored.position, restored.lineage, restored.content) == (
        dict(value.fingerprint), value.position, value.lineage, value.content)
    support.assert_arrays_identical(restored.pending.items[0], arrays)
    # Readers above read_header see the header whole, in its own order (per-process fields last).
    header = _whole(tmp_path, index, 3)
    expected = codec.encode_state(value)[0]
    assert header["fingerprint"] == expected["fingerprint"] and header["lineage"] == expected["lineage"]
    assert list(header)[:list(header).index("lineage") + 1] == list(expected)[:list(expected).index("lineage") + 1]
  # The elastic comparison of the pod's headers still holds: they agree on every global field.
  elastic.check_agree(str(tmp_path), [_files.read_state(str(tmp_path), index, 3) for index in range(3)])


def test_a_process_whose_pod_part_differs_writes_its_header_whole(tmp_path, key_value_store):
  _save(tmp_path, _pod_state(0, 2), 0, 2)
  other = _pod_state(1, 2, resumes=4)  # another lineage than process 0's
  _save(tmp_path, other, 1, 2)
  written = json.loads((tmp_path / "process_1-of-2.json").read_text())
  assert _files.POD_SHA256 not in written and written["lineage"]["resumes"] == 4
  assert written["fingerprint"]["shard_index"] == 1 and "seed" in written["fingerprint"]
  assert _files.read_state(str(tmp_path), 1, 2).lineage == other.lineage
  assert json.loads((tmp_path / "process_0-of-2.json").read_text())[_files.POD_SHA256]


def test_without_the_job_s_key_value_store_every_process_of_several_writes_whole(tmp_path):
  # A process index given by hand (no JAX job of 2 processes here).
  for index in range(2):
    _save(tmp_path, _pod_state(index, 2), index, 2)
  assert json.loads((tmp_path / _files.COUNT_FILE).read_text()) == {"process_count": 2}
  for index in range(2):
    written = json.loads((tmp_path / f"process_{index}-of-2.json").read_text())
    assert _files.POD_SHA256 not in written and "lineage" in written
    assert _files.read_state(str(tmp_path), index, 2) == _pod_state(index, 2)


def test_process_0_s_digest_not_coming_means_a_whole_header(tmp_path, key_value_store, monkeypatch):
  monkeypatch.setattr(_pod_exchange, "SHARE_WAIT_SECONDS", 0.2)
  _save(tmp_path, _pod_state(1, 2), 1, 2)  # process 0 published nothing
  assert "lineage" in json.loads((tmp_path / "process_1-of-2.json").read_text())


def _tamper_count_file(directory, change):
  path = directory / _files.COUNT_FILE
  path.write_bytes(change(path.read_bytes()))


@pytest.mark.parametrize("change, says", [
    # The lineage changed (one more resume claimed), its digest left as it was.
    (lambda data: data.replace(b'"resumes":3', b'"resumes":4'),
     r"ckpt_iter.json: its pod part .* does not hash to its field 'pod_sha256' .*process_0-of-1.json.*"
     r"edited or is garbled. Restore an earlier step"),
    # Another save's pod part, digest and all.
    (lambda data: data.replace(b'"seed":0', b'"seed":1'), None),
    # The pod part gone.
    (lambda data: b'{"process_count": 1}',
     r"process_0-of-1.json: its fingerprint and lineage are in the pod part of .*ckpt_iter.json.*holds no pod part"),
], ids=["lineage edited", "another save's", "no pod part"])
def test_a_count_file_whose_pod_part_is_not_the_saved_one_is_refused_naming_both_files(tmp_path, change, says):
  _save(tmp_path, _pod_state(0, 1), 0, 1)
  if says is None:  # rewritten consistently, as another save would: the header's reference no longer matches
    def change(data, change=change):
      import hashlib  # pylint: disable=g-import-not-at-top
      head, text = data.split(b'"pod":', 1)
      text = change(text)[:-1]
      digest = hashlib.sha256(text).hexdigest().encode()
      return b'{"process_count":1,"pod_sha256":"' + digest + b'","pod":' + text + b"}"
    says = (r"process_0-of-1.json: field 'pod_sha256' is [0-9a-f]{16}\.\.\., but the pod part in .*ckpt_iter.json "
            r"is [0-9a-f]{16}\.\.\.: the two files come from different saves. Restore an earlier step")
  _tamper_count_file(tmp_path, change)
  with pytest.raises(errors.InvalidStateError, match=says):
    _files.read_state(str(tmp_path), 0, 1)
  with pytest.raises(errors.InvalidStateError, match=says):
    item_lib.read_item(str(tmp_path), 0, 1, elastic=True)


def test_a_missing_count_file_or_a_garbled_reference_is_refused(tmp_path):
  _save(tmp_path, _pod_state(0, 1), 0, 1)
  path = tmp_path / "process_0-of-1.json"
  header = json.loads(path.read_text())
  path.write_text(json.dumps({**header, _files.POD_SHA256: "abc"}))
  with pytest.raises(errors.InvalidStateError, match=r"field 'pod_sha256' is 'abc', not a SHA-256"):
    _files.read_state(str(tmp_path), 0, 1)
  path.write_text(json.dumps({**header, "lineage": None}))
  with pytest.raises(errors.InvalidStateError, match=r"refers to the pod part .* but holds field 'lineage' beside it"):
    _files.read_state(str(tmp_path), 0, 1)
  path.write_text(json.dumps(header))
  (tmp_path / _files.COUNT_FILE).unlink()
  with pytest.raises(errors.InvalidStateError, match=r"ckpt_iter.json .*but that file is missing.*restore an earlier step"):
    _files.read_state(str(tmp_path), 0, 1)


def test_a_process_reads_the_count_file_once_for_its_count_and_its_pod_part(tmp_path, monkeypatch):
  _save(tmp_path, _pod_state(0, 1), 0, 1)
  read = []
  original = _storage.read_bytes
  monkeypatch.setattr(_storage, "read_bytes", lambda path, **kw: read.append(os.path.basename(path)) or original(path, **kw))
  item_lib.read_item(str(tmp_path), 0, 1, elastic=True)
  assert sorted(read) == [_files.COUNT_FILE, "process_0-of-1.json"]
  read.clear()
  item_lib.read_item(str(tmp_path), 0, 1)
  assert sorted(read) == [_files.COUNT_FILE, "process_0-of-1.json"]  # one more small read than a whole header


@settings(max_examples=40, deadline=None)
@given(resumes=st.integers(0, 64), sources=st.integers(1, 8), skips=st.integers(0, 10),
       count=st.integers(1, 3), repeat=st.booleans(), data=st.data())
def test_a_referring_header_reads_as_the_whole_one(tmp_path_factory, resumes, sources, skips, count, repeat, data):
  index = data.draw(st.integers(0, count - 1))
  drawn = {"resumes": resumes, "sources": sources, "skips": skips, "repeat": repeat}
  value = _pod_state(index, count, **drawn)
  referring, whole = tmp_path_factory.mktemp("referring"), tmp_path_factory.mktemp("whole")
  store = support.KeyValueStore()
  original = _pod_exchange._distributed_client  # pylint: disable=protected-access
  _pod_exchange._distributed_client = lambda count: store  # pylint: disable=protected-access
  try:
    if index:  # process 0 of the same pod first (its count file holds the pod part)
      _save(referring, _pod_state(0, count, **drawn), 0, count)
    _save(referring, value, index, count)
  finally:
    _pod_exchange._distributed_client = original  # pylint: disable=protected-access
  header, _ = codec.encode_state(value)
  _files.write_files(str(whole), header, {}, process_index=index, process_count=count)
  written = json.loads((referring / f"process_{index}-of-{count}.json").read_text())
  assert _files.POD_SHA256 in written and "lineage" not in written
  own = written["position"]["parent"]["fingerprint"] if repeat else written["fingerprint"]
  assert own == {"shard_index": index}  # every other fingerprint field is the pod's
  a, b = _files.read_state(str(referring), index, count), _files.read_state(str(whole), index, count)
  assert a == b == value
  assert (a.lineage, a.content, dict(a.fingerprint)) == (b.lineage, b.content, dict(b.fingerprint))
  assert item_lib.resume_digest(a) == item_lib.resume_digest(b)


def test_after_64_restarts_a_mixture_of_8_with_10_skips_writes_under_1_kb_per_process(tmp_path):
  from ckpt_iter import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  sources = {f"s{k}": [{"id": 1000 * k + i} for i in range(200)] for k in range(8)}

  def iterator():
    return ckpt_iter.DataIterator(ckpt_iter.make_dataset(
        sources, weights={name: 1 + k % 3 for k, name in enumerate(sources)}, batch_size=8, seed=0,
        num_epochs=None, skip=[(500 + 40 * k, 503 + 40 * k) for k in range(10)]))

  handler = checkpoint_lib.IteratorCheckpointHandler(0, 1)
  item = None
  for step in range(1, 66):
    current = iterator()
    if item is not None:
      handler.restore(item, ckpt_iter.IteratorRestore(current))
    next(current)
    item = tmp_path / str(step) / "data"
    item.mkdir(parents=True)
    handler.save(item, ckpt_iter.IteratorSave(current))
  header = _files.read_header(str(item / "process_0-of-1.json"))
  assert header["lineage"]["resumes"] == 64 and len(header["lineage"]["recent"]) == item_lib.MAX_RECENT
  assert (item / "process_0-of-1.json").stat().st_size < 1024  # the pod part (about 5 KB) is written once
  assert (item / _files.COUNT_FILE).stat().st_size > 4096
  # Restored from it, or from the same header written whole: the same state.
  whole = tmp_path / "whole"
  whole.mkdir()
  _files.write_files(str(whole), dict(header), {}, process_index=0, process_count=1)
  a, b = _files.read_state(str(item), 0, 1), _files.read_state(str(whole), 0, 1)
  assert a == b and (a.lineage, a.content) == (b.lineage, b.content)
  for directory in (item, whole):
    target = iterator()
    handler.restore(directory, ckpt_iter.IteratorRestore(target))
    assert target.state() == a


def test_a_pod_part_rewritten_with_a_matching_digest_is_still_checked_entry_by_entry(tmp_path):
  """The digest binds the files, it does not vouch for them: whoever writes both can match it. A pod
  part is checked the first time its text is read (then kept by that text's own SHA-256)."""
  import hashlib  # pylint: disable=g-import-not-at-top

  _save(tmp_path, _pod_state(0, 1), 0, 1)
  assert _files.read_state(str(tmp_path), 0, 1).lineage["resumes"] == 3  # read (and kept) once
  data = (tmp_path / _files.COUNT_FILE).read_bytes()
  text = data.split(b'"pod":', 1)[1][:-1].replace(b'"state":"0000000000000002"', b'"state":2')
  digest = hashlib.sha256(text).hexdigest()
  (tmp_path / _files.COUNT_FILE).write_bytes(
      b'{"process_count":1,"pod_sha256":"%s","pod":%s}' % (digest.encode(), text))
  header = json.loads((tmp_path / "process_0-of-1.json").read_text())
  (tmp_path / "process_0-of-1.json").write_text(json.dumps({**header, _files.POD_SHA256: digest}))
  with pytest.raises(errors.InvalidStateError, match=r"ckpt_iter.json \(pod part\): field 'lineage' must be"):
    _files.read_state(str(tmp_path), 0, 1)


@pytest.mark.parametrize("pod", [b'[{"a":1}]', b'{"fingerprints":{}}', b'{"fingerprints":[]}', b'{"fingerprints":[1]}',
                                 b'{"fingerprints":[{}],"extra":1}', b'{"fingerprints":[{}],"lineage":[]}'])
def test_a_malformed_pod_part_with_its_own_digest_is_refused_naming_it(tmp_path, pod):
  import hashlib  # pylint: disable=g-import-not-at-top

  _save(tmp_path, _pod_state(0, 1), 0, 1)
  digest = hashlib.sha256(pod).hexdigest()
  (tmp_path / _files.COUNT_FILE).write_bytes(b'{"process_count":1,"pod_sha256":"%s","pod":%s}' % (digest.encode(), pod))
  header = json.loads((tmp_path / "process_0-of-1.json").read_text())
  (tmp_path / "process_0-of-1.json").write_text(json.dumps({**header, _files.POD_SHA256: digest}))
  with pytest.raises(errors.InvalidStateError, match=r"ckpt_iter.json \(pod part\)"):
    _files.read_state(str(tmp_path), 0, 1)


def test_an_edited_process_count_is_one_verdict_for_the_restore_and_every_verb(tmp_path, capsys):
  # issue 57 item 14: verify and the elastic restore refused it; the same-count restore, audit, inspect,
  # which and order read on.
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  root = str(tmp_path / "run")
  _two_steps(root)
  count_path = os.path.join(root, "2", "data", _files.COUNT_FILE)
  data = open(count_path, "rb").read()
  assert data.startswith(b'{"process_count":1,')
  open(count_path, "wb").write(data.replace(b'{"process_count":1,', b'{"process_count":2,', 1))
  refusal = f"{count_path}: says 2 processes, but process_0-of-1.json is one of 1"
  with pytest.raises(errors.InvalidStateError) as info:
    _restore(os.path.join(root, "2", "data"))
  assert refusal in str(info.value)
  for argv in (["inspect", root, "--step", "2"], ["verify", root], ["audit", root], ["which", root, "--step", "2"],
               ["order", root, "--out", str(tmp_path / "o.jsonl")]):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == cli.EXIT_PROBLEMS and "says 2 processes" in out + err and "Traceback" not in out + err, (
        argv, code, out, err)
  assert cli.main(["inspect", root, "--step", "1"]) == 0


_FIELDS = st.dictionaries(st.sampled_from(["shard_index", "shard_count", "batch_size", "seed", "source"]),
                          st.integers(0, 9), max_size=5)


@st.composite
def _nested_headers(draw, depth=0):
  """A header as a state writes it: data, or a repeat / tunix state nesting one (at most 2 levels)."""
  kind = draw(st.sampled_from(["data", "repeat", "tunix"] if depth < 2 else ["data"]))
  header = {"kind": kind, "fingerprint": draw(_FIELDS), "position": {"next_record": draw(st.integers(0, 99))}}
  if kind in state_lib.NESTED:
    header["position"][state_lib.NESTED[kind]] = draw(_nested_headers(depth + 1))
  if depth == 0 and draw(st.booleans()):
    header["lineage"] = {"resumes": draw(st.integers(0, 5)), "digest": "0" * 16, "recent": []}
  return header


@settings(max_examples=60, deadline=None)
@given(header=_nested_headers())
def test_the_pod_part_is_the_cut_the_resume_digest_covers_and_puts_the_header_back(header):
  # issue 58 item 13: one walk cuts a state into what a pod holds alike; the pod part and the digest agree.
  own, text, digest = _files.split_header(header, elastic.PER_PROCESS_FIELDS)
  pod = json.loads(text)
  common_fingerprint, common_position = _files.pod_common(
      header["kind"], header["fingerprint"], header["position"], elastic.PER_PROCESS_FIELDS)
  common = {"kind": header["kind"], "fingerprint": common_fingerprint, "position": common_position}
  assert pod["fingerprints"] == list(_own_fingerprints(common))
  assert all(set(f) <= elastic.PER_PROCESS_FIELDS for f in _own_fingerprints(own))
  assert own[_files.POD_SHA256] == digest and "lineage" not in own
  count = _files.CountFile(path="ckpt_iter.json", process_count=1, pod_sha256=digest, pod_text=text)
  assert _files._with_pod_part(own, "process_0-of-1.json", count) == header  # pylint: disable=protected-access


def _own_fingerprints(state):
  while True:
    yield state["fingerprint"]
    if state["kind"] not in state_lib.NESTED:
      return
    state = state["position"][state_lib.NESTED[state["kind"]]]
