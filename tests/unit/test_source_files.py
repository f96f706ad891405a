"""Tests for ckpt_iter._source_files: the paths every file source takes, and what it refuses.

Each file source class (JSONL, Parquet, ArrayRecord) reads one path, a
path-like, a glob or a list of them, in order; a missing file, a glob matching
nothing, an empty list or a non-path is refused naming the class and the paths.
"""

import pytest

import ckpt_iter
from ckpt_iter import _source_files
from ckpt_iter import _storage
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


def _define_tsv_source():
  """Defines a format ckpt_iter does not ship, as one class (defining it registers it)."""

  class _TsvSource(_source_files.FileSource):
    """A format ckpt_iter does not ship, declared as one class: lines of `id<TAB>text`, read in place."""

    suffixes = (".tsv",)

    def __init__(self, paths, cache=None):
      assert cache is None, "read in place only"
      self._paths = [_storage.absolute(p) for p in _source_files.expand_paths(paths, "_TsvSource")]
      self._rows = []
      self._offsets = [0]
      for path in self._paths:
        with open(path, encoding="utf-8") as f:
          rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        self._rows.extend({"id": int(i), "text": text} for i, text in rows)
        self._offsets.append(len(self._rows))

    def __len__(self):
      return len(self._rows)

    def __getitem__(self, index):
      return self._rows[index]

    cache = None

    def identities(self):
      return _storage.identities(self._paths)

    def file_offsets(self):
      return list(self._offsets)

    def file_position(self, index):
      file_index, line = _source_files.locate(self._offsets, index, len(self))
      return self._paths[file_index], f"line {line + 1}"

    prefetch_files = 0

    def prefetch(self, file_indices):
      del file_indices

    def follow_plan(self):
      pass

    def cached_bytes(self):
      return [0 for _ in self._paths]

    def release(self, keep):
      del keep

  return _TsvSource


@pytest.fixture
def tsv_format():
  """_TsvSource, registered for the test only."""
  defined = _define_tsv_source()
  try:
    yield defined
  finally:
    del sources_lib.SOURCE_BY_SUFFIX[".tsv"]


def test_the_shipped_file_sources_are_registered_by_their_suffixes():
  assert sources_lib.SOURCE_BY_SUFFIX == {".jsonl": sources_lib.JsonlSource, ".parquet": sources_lib.ParquetSource,
                                          ".array_record": sources_lib.ArrayRecordSource}
  assert _source_files.file_suffixes() == (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".array_record")
  assert all(issubclass(cls, _source_files.FileSource) for cls in sources_lib.SOURCE_BY_SUFFIX.values())


def test_a_new_format_is_one_class_make_dataset_reads_and_names_its_files(tmp_path, tsv_format):
  for part in range(2):
    (tmp_path / f"part-{part}.tsv").write_text("".join(f"{10 * part + i}\trow {i}\n" for i in range(5)))
  dataset = ckpt_iter.make_dataset(str(tmp_path / "*.tsv"), batch_size=2, seed=None, num_epochs=1)
  assert [int(i) for batch in dataset for i in batch["id"]] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
  assert sources_lib.file_position(tsv_format([str(tmp_path / "part-1.tsv")]), 2)[1] == "line 3"
  assert sources_lib.SOURCE_BY_SUFFIX[".tsv"] is tsv_format and ".tsv" in _source_files.file_suffixes()
  source, identity = sources_lib.resolve_source(str(tmp_path / "*.tsv"))
  assert type(source) is tsv_format and identity.description.startswith("tsv[part-0.tsv:")


def test_a_file_source_that_leaves_out_what_every_one_answers_is_refused_when_built():
  class Partial(_source_files.FileSource):  # no suffixes: registers nothing
    def __len__(self):
      return 0

  with pytest.raises(TypeError, match="abstract") as refused:
    Partial()
  for name in ("cache", "identities", "file_offsets", "file_position", "prefetch", "release"):
    assert name in str(refused.value)
  assert Partial not in sources_lib.SOURCE_BY_SUFFIX.values()


def test_a_glob_listing_more_pages_than_a_restart_reads_tells_once_how_to_list_nothing(monkeypatch, caplog):
  # The store's side is the listing's size alone (a page per 1,000 objects); the GCS emulator's listing of
  # 20,480 objects is benchmarks/worked_case.py's.
  sizes = {"gs://bucket/corpus/*.jsonl": 4001, "gs://bucket/small/*.jsonl": 4000, "gs://bucket/*/part-*.parquet": 9000,
           "gs://bucket/shards/*.jsonl.zst": 5000}

  def listing(pattern):
    directory = pattern.rsplit("/", 1)[0].replace("*", "d")
    return {f"{directory}/part-{i:05d}{pattern.rsplit('*', 1)[1]}": _storage.Identity(10, f"generation={i}") for i in range(sizes[pattern])}

  monkeypatch.setattr(_storage, "glob_identities", listing)
  monkeypatch.setattr(_source_files, "_told_listings", set())
  with caplog.at_level("WARNING", logger="ckpt_iter"):
    for _ in range(2):  # a second build in the process is not told again
      paths = _source_files.expand_paths("gs://bucket/corpus/*.jsonl", "JsonlSource")
    _source_files.expand_paths("gs://bucket/small/*.jsonl", "JsonlSource")  # 4 pages: within a restart's 4
    _source_files.expand_paths("gs://bucket/*/part-*.parquet", "ParquetSource")
    _source_files.expanded(["gs://bucket/shards/*.jsonl.zst"], "source")  # as make_dataset expands its path
  assert len(paths) == 4001 and paths == sorted(paths)
  told = [record.getMessage() for record in caplog.records]
  assert len(told) == 3, told
  assert "'gs://bucket/corpus/*.jsonl' lists 4,001 objects: at least 5 requests" in told[0]
  assert "Indexed once (ckpt-iter index gs://bucket/corpus), JsonlSource(..., files_from_index=True) names them from the index, one read a directory" in told[0]
  assert "9,000 objects: at least 9 requests" in told[1]
  assert "With each directory indexed once and named by a glob of its own, ParquetSource(" in told[1]
  assert told[2].startswith("source: the glob 'gs://bucket/shards/*.jsonl.zst' lists 5,000 objects")
  assert ("(ckpt-iter index gs://bucket/shards), make_dataset(ckpt_iter.sources.JsonlSource("
          "'gs://bucket/shards/*.jsonl.zst', files_from_index=True, cache=ckpt_iter.sources.ShardCache.from_env()), "
          "...) names them") in told[2]
  # ... names what exists: the class make_dataset picks for the suffix, the cache it picks.
  assert sources_lib.SOURCE_BY_SUFFIX[".jsonl"] is sources_lib.JsonlSource
  assert callable(sources_lib.ShardCache.from_env)
