"""Tests for ckpt_iter._source_files: the paths every file source takes, and what it refuses.

Each file source class (JSONL, Parquet, ArrayRecord) reads one path, a
path-like, a glob or a list of them, in order; a missing file, a glob matching
nothing, an empty list or a non-path is refused naming the class and the paths.
"""

import pytest

import ckpt_iter
from ckpt_iter import sources as sources_lib
import support


_SOURCE_CLASSES = {
    "jsonl": sources_lib.JsonlSource, "parquet": sources_lib.ParquetSource,
    "array_record": sources_lib.ArrayRecordSource,
}


@pytest.mark.parametrize("kind", sorted(support.FILE_WRITERS))
def test_file_source_classes_take_a_path_a_pathlike_a_glob_or_a_list(tmp_path, kind):
  records = support.sample_records(11)
  paths = [tmp_path / f"part-{i}.{kind}" for i in range(2)]
  support.FILE_WRITERS[kind](paths[0], records[:5])
  support.FILE_WRITERS[kind](paths[1], records[5:])
  source_class = _SOURCE_CLASSES[kind]
  # A single string is one file, not a sequence of one-character paths.
  assert [source_class(str(paths[0]))[i] for i in range(5)] == records[:5]
  assert [source_class(paths[1])[i] for i in range(6)] == records[5:]
  for whole in (str(tmp_path / f"part-*.{kind}"), [str(p) for p in paths], tuple(paths)):
    source = source_class(whole)
    assert source.paths == [str(p) for p in paths]
    assert [source[i] for i in range(len(source))] == records


@pytest.mark.parametrize("kind", sorted(support.FILE_WRITERS))
def test_file_source_classes_refuse_what_names_no_file(tmp_path, kind):
  source_class = _SOURCE_CLASSES[kind]
  cases = [
      (str(tmp_path / f"missing.{kind}"), [f"{source_class.__name__} file", f"missing.{kind}", "does not exist"]),
      (str(tmp_path / f"none-*.{kind}"), [f"{source_class.__name__} glob", "matches no file"]),
      ([], [source_class.__name__, "paths=[]", "names no file", "glob"]),
      (42, [source_class.__name__, "paths=42", "(int)", "os.PathLike"]),
  ]
  for paths, fragments in cases:
    with pytest.raises(ckpt_iter.InvalidArgumentError) as info:
      source_class(paths)
    for fragment in fragments:
      assert fragment in str(info.value), (paths, fragment, str(info.value))
