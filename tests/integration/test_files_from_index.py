"""A source naming its files from the corpus index (`files_from_index=True`), against a real GCS emulator.

Issue 65 items 7 and the worked case: a glob is listed at every start of every
process, a request per thousand objects (21 at 20,480 objects: 215,000 for a
restart of 10,240 hosts), though the corpus index `ckpt-iter index` wrote
already names every file with its size and version. Named from the index, a
start reads that one object and lists nothing; what it reads is what the
listed source reads, under the same identity, so a checkpoint of either
restores into the other; what the index vouches for is still checked (an
object rewritten since is refused when read, never trained).
"""

from __future__ import annotations

import numpy as np
import pytest

import ckpt_iter
import gcs_emulator as gcs_emulator_lib
import support
from ckpt_iter import _corpus_index
from ckpt_iter import _storage
from ckpt_iter import sources

_SOURCES = {"jsonl": sources.JsonlSource, "parquet": sources.ParquetSource,
            "array_record": sources.ArrayRecordSource}
_FILES, _PER_FILE = 5, 12


def _corpus(gcs_root, tmp_path, kind) -> tuple[str, list[dict]]:
  """`_FILES` files of `kind` on the bucket, indexed; returns (glob, records in order)."""
  records = []
  for part in range(_FILES):
    local = tmp_path / "local" / f"part-{part}.{kind}"
    local.parent.mkdir(exist_ok=True)
    part_records = [{"id": part * 100 + i} for i in range(_PER_FILE)]
    support.FILE_WRITERS[kind](local, part_records)
    _storage.write_bytes(f"{gcs_root}/data/part-{part}.{kind}", local.read_bytes())
    records += part_records
  glob = f"{gcs_root}/data/part-*.{kind}"
  code, out = support.cli_output("index", glob, "--cache", str(tmp_path / "indexing"))
  assert code == 0 and f"indexed {_FILES} files" in out, out
  return glob, records


def _records(source) -> list[dict]:
  return [{"id": int(np.asarray(source[i]["id"]))} for i in range(len(source))]


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_a_start_reads_the_index_and_lists_nothing(gcs_root, gcs_emulator, tmp_path, kind):
  glob, records = _corpus(gcs_root, tmp_path, kind)
  listed = _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "listed", 10**8), prefetch_files=0)
  index_name = gcs_emulator_lib.object_name(f"{gcs_root}/data/{_corpus_index.INDEX_NAME}")
  for host in ("new host", "warm restart"):
    mark = gcs_emulator.mark()
    named = _SOURCES[kind](glob, cache=sources.ShardCache(tmp_path / "host", 10**8), prefetch_files=0,
                           files_from_index=True)
    requests = gcs_emulator.requests(mark)
    assert [(r.kind, r.name) for r in requests] == [("read", index_name)], (host, requests)
    # The same files under the same identities (size, version, the generation reads pin, the checksum).
    assert named.identities() == listed.identities(), host
    assert ([(f.generation, f.checksum) for f in named.identities()]
            == [(f.generation, f.checksum) for f in listed.identities()]), host
    assert _records(named) == records, host


def test_a_list_of_paths_is_named_by_the_index_too(gcs_root, gcs_emulator, tmp_path):
  glob, records = _corpus(gcs_root, tmp_path, "jsonl")
  paths = [glob.replace("*", str(part)) for part in (3, 0)]
  mark = gcs_emulator.mark()
  named = sources.JsonlSource(paths, cache=sources.ShardCache(tmp_path / "c", 10**8), files_from_index=True)
  assert [r.kind for r in gcs_emulator.requests(mark)] == ["read"]
  assert _records(named) == records[3 * _PER_FILE:4 * _PER_FILE] + records[:_PER_FILE]


def test_a_checkpoint_of_the_listed_source_restores_into_the_named_one_and_back(gcs_root, gcs_emulator, tmp_path,
                                                                                ckpt_dir):
  del gcs_emulator
  glob, _ = _corpus(gcs_root, tmp_path, "jsonl")

  def dataset(files_from_index):
    source = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "cache", 10**8),
                                 files_from_index=files_from_index)
    return ckpt_iter.make_dataset(source, batch_size=4, seed=3, num_epochs=1)

  expected = [np.asarray(batch["id"]).tolist() for batch in ckpt_iter.DataIterator(dataset(False))]
  seen, step = [], 0
  for files_from_index in (False, True, False, True):
    iterator = ckpt_iter.DataIterator(dataset(files_from_index))
    if step:
      support.orbax_restore(ckpt_dir, step, data=ckpt_iter.IteratorRestore(iterator))
    for _ in range(3):
      seen.append(np.asarray(next(iterator)["id"]).tolist())
    step += 1
    support.orbax_save(ckpt_dir, step, data=ckpt_iter.IteratorSave(iterator))
  assert seen == expected[:len(seen)] and len(seen) == 12


def test_an_object_rewritten_after_the_index_is_refused_when_read_and_a_warm_copy_is_the_indexed_one(
    gcs_root, gcs_emulator, tmp_path):
  del gcs_emulator
  glob, records = _corpus(gcs_root, tmp_path, "jsonl")
  warm = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "warm", 10**8), files_from_index=True)
  assert _records(warm) == records  # every copy cached, each checked against the index's checksum
  _storage.write_bytes(glob.replace("*", "2"), b'{"id": 999}\n' * _PER_FILE)  # same count, other records
  # A new host: the build lists nothing, so it cannot see the change; the download of the indexed
  # generation is refused, naming the object and the command that indexes it again.
  new_host = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "new", 10**8), prefetch_files=0,
                                 files_from_index=True)
  assert [new_host[i]["id"] for i in range(2 * _PER_FILE)] == [r["id"] for r in records[:2 * _PER_FILE]]
  with pytest.raises(ckpt_iter.InvalidStateError,
                     match=r"part-2\.jsonl: .*files_from_index=True: index the directory first, ckpt-iter index "):
    new_host[2 * _PER_FILE]
  # The warm host reads the copy the index vouches for: the run's records, never the new ones.
  again = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "warm", 10**8), files_from_index=True)
  assert _records(again) == records
  # Indexed again, the new object is the corpus: the listed source and the named one agree on it.
  support.cli_output("index", glob, "--cache", str(tmp_path / "indexing2"))
  fresh = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "fresh", 10**8), files_from_index=True)
  assert _records(fresh)[2 * _PER_FILE:3 * _PER_FILE] == [{"id": 999}] * _PER_FILE


def test_a_file_added_after_the_index_is_not_read_until_indexed(gcs_root, gcs_emulator, tmp_path):
  del gcs_emulator
  glob, records = _corpus(gcs_root, tmp_path, "jsonl")
  _storage.write_bytes(glob.replace("*", "9"), b'{"id": 9000}\n')
  named = sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "c", 10**8), files_from_index=True)
  assert _records(named) == records  # the index is the corpus (documented)
  assert len(sources.JsonlSource(glob, cache=sources.ShardCache(tmp_path / "c", 10**8))) == len(records) + 1


def test_what_the_index_cannot_name_is_refused_by_name(gcs_root, gcs_emulator, tmp_path):
  del gcs_emulator
  _storage.write_bytes(f"{gcs_root}/raw/part-0.jsonl", b'{"id": 1}\n')
  cache = sources.ShardCache(tmp_path / "c", 10**8)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"raw holds no ckpt_iter_index\.json\. Index its files "
                                                           r"\(ckpt-iter index gs://.*/raw\)"):
    sources.JsonlSource(f"{gcs_root}/raw/*.jsonl", cache=cache, files_from_index=True)
  glob, _ = _corpus(gcs_root, tmp_path, "jsonl")
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"wildcard in its directory"):
    sources.JsonlSource(f"{gcs_root}/*/part-*.jsonl", cache=cache, files_from_index=True)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"holds no file matching .*part-7\.jsonl"):
    sources.JsonlSource(glob.replace("*", "7"), cache=cache, files_from_index=True)
  with pytest.raises(ckpt_iter.InvalidArgumentError, match=r"corpus_index=False ignores"):
    sources.ParquetSource(glob, cache=cache, corpus_index=False, files_from_index=True)


def test_parquet_read_in_place_takes_its_pins_from_the_listing_or_the_index(gcs_root, gcs_emulator, tmp_path):
  # In place (no cache) a Parquet source asked each file's generation again (a stat a file, about 4 requests on
  # gcsfs) though the glob's listing or the index had just described it: now only the footers are read.
  glob, records = _corpus(gcs_root, tmp_path, "parquet")
  for files_from_index in (False, True):
    mark = gcs_emulator.mark()
    source = sources.ParquetSource(glob, files_from_index=files_from_index)
    kinds = gcs_emulator_lib.count_by_kind(gcs_emulator.requests(mark))
    assert kinds["metadata"] == 0 and kinds["list"] == (0 if files_from_index else 1), kinds
    assert _records(source) == records
