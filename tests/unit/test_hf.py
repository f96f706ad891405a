"""_hf: what a Hugging Face dataset is, and the refusals that name a stream, wherever they are raised.

The datasets are Hugging Face streaming datasets over local files (no network).
sources.py refuses a stream with these words without importing streaming.py.
"""

import ast
import json
import pathlib

import pytest

import ckpt_iter
import conftest
from ckpt_iter import _hf as hf_lib
from ckpt_iter import errors
import support

datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory):
  directory = tmp_path_factory.mktemp("stream")
  paths = [str(directory / f"part-{i}.jsonl") for i in range(3)]
  for path, (start, stop) in zip(paths, [(0, 13), (13, 25), (25, 37)]):
    support.write_jsonl(path, [{"id": n} for n in range(start, stop)])
  return paths


_stream = support.hf_stream


class CountingStream:
  """A stream of our own with a state: not a Hugging Face dataset."""

  def __init__(self, count):
    self._count, self._next = count, 0

  def __iter__(self):
    while self._next < self._count:
      self._next += 1
      yield {"id": self._next - 1}

  def state_dict(self):
    return {"next": self._next}

  def load_state_dict(self, state):
    self._next = state["next"]


def test_a_hugging_face_stream_is_recognised_by_its_class_without_importing_datasets(jsonl_files):
  assert hf_lib.is_hf_iterable(_stream(jsonl_files))
  assert hf_lib.is_hf_iterable(datasets.load_dataset("json", data_files=jsonl_files, streaming=True))  # the dict
  assert not hf_lib.is_hf_iterable(CountingStream(3))
  IterableDataset = type("IterableDataset", (), {})  # the name alone, in another module
  assert not hf_lib.is_hf_iterable(IterableDataset())


def test_the_layers_and_files_of_a_stream_are_found_through_its_map_and_shuffle(jsonl_files):
  source = _stream(jsonl_files).map(lambda r: r).shuffle(seed=0, buffer_size=4)
  names = [type(layer).__name__ for layer in hf_lib.chain(source._ex_iterable)]
  assert names[0] == "BufferShuffledExamplesIterable" and "MappedExamplesIterable" in names
  assert sorted(hf_lib.files_of(source)) == sorted(jsonl_files)
  assert hf_lib.files_text(jsonl_files) == "part-0.jsonl,part-1.jsonl,part-2.jsonl"
  assert hf_lib.files_text([f"d/part-{i}.jsonl" for i in range(9)]) == "9 files part-0.jsonl..part-8.jsonl"


def test_a_source_with_a_state_is_read_and_a_generator_is_not():
  assert hf_lib.refusal(CountingStream(3), "here") is None
  assert "generator without state_dict()" in hf_lib.refusal((x for x in range(2)), "here")


def test_sources_refuses_a_stream_without_importing_the_streaming_iterator():
  # issue 58 item 11: the refusal's words lifted sources.py above the checkpoint-item layer.
  tree = ast.parse(pathlib.Path(hf_lib.__file__).with_name("sources.py").read_text())
  imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
  assert "_hf" in imported and "streaming" not in imported, imported


def test_a_shuffle_buffer_is_refused_naming_the_buffer_and_the_shard_shuffle(jsonl_files):
  with pytest.raises(errors.UnsupportedConfigError) as refused:
    ckpt_iter.StreamingIterator(_stream(jsonl_files).shuffle(seed=0, buffer_size=16))
  message = str(refused.value)
  assert "shuffle(buffer_size=16)" in message and "skip records" in message
  assert "shuffle='shards'" in message and "part-0.jsonl" in message


def test_a_batched_map_under_an_arrow_format_is_refused(jsonl_files):
  source = _stream(jsonl_files).with_format("arrow").map(lambda t: t, batched=True)
  with pytest.raises(errors.UnsupportedConfigError, match="batched map.*'arrow'"):
    ckpt_iter.StreamingIterator(source)


_GENERATOR_FIX = r"ReplayIterator\(iterable\) resumes it exactly by replaying.*make_dataset.*StreamingIterator"


@pytest.mark.parametrize("make_source, pattern", [
    (lambda files: (r for r in [{"id": 0}]), r"is a generator without state_dict\(\).*" + _GENERATOR_FIX),
    (lambda files: iter([{"id": 0}]), r"one-shot iterator without state_dict\(\).*" + _GENERATOR_FIX),
    (lambda files: _stream(files), r"streaming datasets.IterableDataset.*StreamingIterator\(source, batch_size=...\)"
                                r".*without streaming=True.*part-0.jsonl.*shuffle='shards'"),
    (lambda files: _stream(files).shuffle(seed=1, buffer_size=4), r"shuffle buffer cannot be restored"),
    (lambda files: CountingStream(3), r"own state_dict\(\).*StreamingIterator"),
], ids=["generator", "iterator", "hf-stream", "hf-shuffled", "state-dict-stream"])
def test_make_dataset_refuses_a_stream_saying_why_and_what_reads_it(jsonl_files, make_source, pattern):
  with pytest.raises(errors.InvalidArgumentError, match=r"make_dataset\(source=...\): .*" + pattern):
    ckpt_iter.make_dataset(make_source(jsonl_files), batch_size=2, shard_index=0, shard_count=1)


def test_a_hugging_face_source_of_a_streaming_dataset_points_at_the_streaming_iterator(jsonl_files):
  with pytest.raises(errors.InvalidArgumentError, match=r"HuggingFaceSource\('dataset'\).*StreamingIterator"):
    ckpt_iter.sources.HuggingFaceSource(dataset=_stream(jsonl_files))


def test_a_generator_is_refused_by_the_streaming_iterator_with_the_same_ways_through():
  with pytest.raises(errors.InvalidArgumentError, match=r"StreamingIterator\(source=...\).*" + _GENERATOR_FIX):
    ckpt_iter.StreamingIterator(x for x in range(3))


def test_a_shuffle_buffer_refusal_lists_the_files_as_a_user_writes_them(tmp_path, monkeypatch):
  # issue 58 item 8: the paths came in the stream's shuffled order, resolved to absolute paths.
  directory = tmp_path / "corpus"
  directory.mkdir()
  for part in range(6):
    (directory / f"part-{part}.jsonl").write_text(json.dumps({"id": part}) + "\n")
  monkeypatch.chdir(tmp_path)
  written = [f"corpus/part-{part}.jsonl" for part in range(6)]
  stream = datasets.load_dataset("json", data_files=written, split="train", streaming=True).shuffle(seed=3,
                                                                                                    buffer_size=4)
  with pytest.raises(errors.UnsupportedConfigError) as refusal:
    ckpt_iter.StreamingIterator(stream, batch_size=2)
  assert f"make_dataset({written[:4]!r}"[:-1] + ", ...]" in str(refusal.value), str(refusal.value)
