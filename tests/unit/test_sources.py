"""Tests for ckpt_iter.sources: the file and Hugging Face sources as Grain's workers take them.

Every file source (JSONL, Parquet, ArrayRecord), resolved from a path and
pickled after a first read, reads the same records in a clone; a Hugging Face
source is picked by split (its errors naming the choices) and pickles too.
"""

import io
import json
import pickle

import pytest

import ckpt_iter
from ckpt_iter import sources as sources_lib
import conftest
import support


def test_sources_are_picklable_for_grain_workers(tmp_path):
  records = support.sample_records(9)
  for kind, write in support.FILE_WRITERS.items():
    path = tmp_path / f"p.{kind}"
    write(path, records)
    source, _ = sources_lib.resolve_source(str(path))
    source[3]  # opens a file handle / caches a row group first
    clone = pickle.loads(pickle.dumps(source))
    assert [clone[i] for i in range(9)] == records, kind


def test_hf_splits_and_errors_name_the_choices(tmp_path):
  datasets = pytest.importorskip("datasets", reason=conftest.NEEDS_DATASETS)
  records = support.sample_records(6)
  path = str(tmp_path / "dict")
  datasets.DatasetDict(
      train=datasets.Dataset.from_list(records), test=datasets.Dataset.from_list(records[:2])
  ).save_to_disk(path)
  assert len(sources_lib.HuggingFaceSource(path, split="test")) == 2
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"splits \['test', 'train'\]; choose one with split="):
    sources_lib.HuggingFaceSource(path)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"no split 'valid'; it has \['test', 'train'\]"):
    sources_lib.HuggingFaceSource(path, split="valid")
  jsonl = tmp_path / "t.jsonl"
  support.write_jsonl(jsonl, records)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="Unknown split"):
    sources_lib.HuggingFaceSource("json", data_files=str(jsonl), split="nope", cache_dir=str(tmp_path / "c"))
  streaming = datasets.Dataset.from_list(records).to_iterable_dataset()
  with pytest.raises(ckpt_iter.InvalidArgumentError, match="no random access"):
    sources_lib.HuggingFaceSource(dataset=streaming)


def test_hf_source_is_picklable_for_grain_workers(tmp_path):
  records = support.sample_records(9)
  source = sources_lib.HuggingFaceSource(support.hf_saved(tmp_path, records))
  clone = pickle.loads(pickle.dumps(source))
  assert [clone[i] for i in range(9)] == [source[i] for i in range(9)]
  assert [clone[i]["id"] for i in range(9)] == list(range(9))


def _decodes(tmp_path, decoded_bytes):
  """(records read in a shuffled order, row groups decoded) of a Parquet file of 4 groups of 25 rows."""
  import random  # pylint: disable=g-import-not-at-top

  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  path = tmp_path / f"groups-{decoded_bytes}.parquet"
  pq.write_table(pa.Table.from_pylist([{"id": i, "text": "x" * 50} for i in range(100)]), path, row_group_size=25)
  source = sources_lib.ParquetSource(str(path), decoded_bytes=decoded_bytes)
  decoded = []
  read_group = source._read_group  # pylint: disable=protected-access
  source._read_group = lambda f, g: decoded.append(g) or read_group(f, g)  # pylint: disable=protected-access
  order = list(range(100))
  random.Random(0).shuffle(order)
  return [source[i]["id"] for i in order], order, decoded


def test_a_shuffled_read_decodes_each_row_group_once_within_the_budget(tmp_path):
  read, order, decoded = _decodes(tmp_path, 2**20)
  assert read == order
  assert sorted(decoded) == [0, 1, 2, 3]
  # With no budget only the last group is kept: a group per record that changes group.
  read, order, decoded = _decodes(tmp_path, 0)
  assert read == order
  assert len(decoded) == 1 + sum(a // 25 != b // 25 for a, b in zip(order, order[1:]))


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_build_over_a_store_asks_each_files_metadata_once(monkeypatch, kind):
  """make_dataset's source resolved once: the identities that describe the files, name them and make the
  digest are one set (a Parquet source read in place keeps none, and they were asked twice more)."""
  fsspec = pytest.importorskip("fsspec")
  from fsspec.implementations.memory import MemoryFileSystem  # pylint: disable=g-import-not-at-top

  store = fsspec.filesystem("memory")
  records = support.sample_records(30)
  for part in range(3):
    if kind == "parquet":
      import pyarrow as pa  # pylint: disable=g-import-not-at-top
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

      buffer = io.BytesIO()
      pq.write_table(pa.Table.from_pylist(records[10 * part:10 * part + 10]), buffer)
      store.pipe(f"/resolve-once/part-{part}.{kind}", buffer.getvalue())
    else:
      lines = "".join(json.dumps(r) + "\n" for r in records[10 * part:10 * part + 10])
      store.pipe(f"/resolve-once/part-{part}.{kind}", lines.encode())
  asked = []
  real_info = MemoryFileSystem.info
  monkeypatch.setattr(MemoryFileSystem, "info",
                      lambda self, path, **kw: (asked.append(path), real_info(self, path, **kw))[1])
  try:
    source, identity = sources_lib.resolve_source(f"memory://resolve-once/*.{kind}")
    assert [source[i] for i in range(len(source))] == records
    assert identity.description.startswith(f"{kind}[part-0.{kind}:") and len(identity.files) == 3
    per_file = [path for path in asked if path.endswith(f".{kind}")]
    assert len(per_file) == len(set(per_file)) <= 3, per_file  # at most once each (a pin where no listing gave it)
  finally:
    store.rm("/resolve-once", recursive=True)
