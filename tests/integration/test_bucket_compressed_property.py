"""Compressed shards and indexed corpora on a bucket, drawn: every record once and only the store's, or a
refusal that names the file (issue 64).

Hypothesis draws a corpus of three files on the GCS emulator, each `.jsonl`, `.jsonl.gz` or `.jsonl.zst`,
each whole, cut short as a writer killed mid-file leaves it (compressed ones), or damaged in transit once
or on every download by a proxy that flips one bit; an index (none, honest, or edited consistently to count
0 or one record off for a file); and the shuffle. A source built through a fresh shard cache is read to
the end. It counts records lost (an epoch that ends normally must hold every record once), records whose
bytes are not the store's, attempts per download (at most the documented 1 + retries) and the peak of
Python memory while reading (bounded whatever a file's compression ratio: one file may be 64 MiB of text
in a few hundred KB). A damaged or edited corpus must be refused by name, never read as fewer records.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import tracemalloc
import uuid
import zlib

import hypothesis
from hypothesis import strategies as st
import pytest

import ckpt_iter
from ckpt_iter import _corpus_index
from ckpt_iter import cli
from ckpt_iter import _storage
from ckpt_iter import errors
from ckpt_iter import sources

REQUEST_SECONDS, OPERATION_SECONDS, RETRIES = 5.0, 30.0, 2  # the `proxy` fixture's store bounds
_PER_FILE = 60
_WIDE_RECORDS, _WIDE_TEXT = 1024, 64 * 2**10  # the file of a high ratio: 64 MiB of text


def _record(part: int, i: int, wide: bool) -> dict:
  return {"id": part * 10_000 + i, "text": ("w" if wide else "t") * (_WIDE_TEXT if wide else i % 13)}


def _text(part: int, wide: bool) -> bytes:
  count = _WIDE_RECORDS if wide else _PER_FILE
  return b"".join(json.dumps(_record(part, i, wide)).encode() + b"\n" for i in range(count))


def _packed(text: bytes, suffix: str) -> bytes:
  import zstandard  # pylint: disable=g-import-not-at-top

  if suffix == ".jsonl.gz":
    return gzip.compress(text, compresslevel=6)
  if suffix == ".jsonl.zst":
    return zstandard.ZstdCompressor(write_checksum=True).compress(text)
  return text


_FILE = st.tuples(st.sampled_from([".jsonl", ".jsonl.gz", ".jsonl.zst"]),
                  st.sampled_from(["whole", "whole", "truncated", "transit_once", "transit_always"]))
_CASES = dict(
    files=st.lists(_FILE, min_size=3, max_size=3),
    wide=st.booleans(),  # the first file compressed at a high ratio, when it is compressed
    index=st.sampled_from(["none", "honest", "zero", "one_off"]),
    edited=st.integers(0, 2),  # which file an edited index lies about
    shuffle=st.sampled_from(["global", "shards"]),
)


def _check(gcs_root, proxy, tmp_path_factory, files, wide, index, edited, shuffle):
  proxy.clear()
  hits_before = len(proxy.hits)
  prefix = f"{gcs_root}/{uuid.uuid4().hex[:8]}"
  urls, expected = [], {}
  for part, (suffix, _) in enumerate(files):
    is_wide = wide and part == 0 and suffix != ".jsonl"
    text = _text(part, is_wide)
    urls.append(f"{prefix}/part-{part}{suffix}")
    _storage.write_bytes(urls[-1], _packed(text, suffix))
    expected.update({r["id"]: r for r in (json.loads(line) for line in text.splitlines())})
  if index != "none":
    code = cli.main(["index", prefix])
    assert code == 0
  for part, (suffix, damage) in enumerate(files):
    if damage == "truncated" and suffix != ".jsonl":  # a writer killed mid-file, uploaded: its checksum its own
      whole = _storage.read_bytes(urls[part], max_bytes=2**30)
      _storage.write_bytes(urls[part], bytes(whole[:len(whole) * 2 // 3]))
    elif damage.startswith("transit"):
      proxy.add("flip", f"part-{part}{suffix}?alt=media", method="GET", times=1 if damage == "transit_once" else None)
  lied = None
  if index in ("zero", "one_off"):
    lied = urls[edited]
    _lie_in_index(prefix, os.path.basename(lied), index)
  refused_for = {url for url, (suffix, damage) in zip(urls, files)
                 if damage == "transit_always" or (damage == "truncated" and suffix != ".jsonl")}
  if lied is not None and lied not in refused_for:
    refused_for.add(lied)
  trained, not_the_stores, error = [], [], None
  cache = sources.ShardCache(str(tmp_path_factory.mktemp("cache")), 2**31)
  tracemalloc.start()
  try:
    dataset = ckpt_iter.make_dataset(sources.JsonlSource(urls, cache=cache), batch_size=4, seed=3, shuffle=shuffle,
                                     drop_remainder=False)
    # Batch by batch, in order, with no read-ahead: the memory measured is the downloads', not Grain's buffers
    # of records (which hold records, whatever the files' compression); the plan still prefetches.
    for index in range(len(dataset)):
      batch = dataset[index]
      for record_id, text in zip(batch["id"].tolist(), batch["text"].tolist()):
        trained.append(record_id)  # each record compared as it comes: the test holds no texts
        if expected.get(record_id, {}).get("text") != text:
          not_the_stores.append(record_id)
  except (errors.InvalidStateError, errors.StorageError) as e:
    error = e
  finally:
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    cache.wait()
  counts = collections.Counter(trained)
  attempts = collections.Counter(path.split("?")[0].rsplit("%2F", 1)[-1] for _, _, path in proxy.hits[hits_before:])
  hypothesis.note(f"trained {len(trained)} of {len(expected)}, error {error!r}, attempts {dict(attempts)}, "
                  f"peak {peak:,}")
  assert not not_the_stores, not_the_stores[:5]
  assert all(count == 1 for count in counts.values())
  assert max(attempts.values(), default=0) <= 1 + RETRIES, attempts
  # Python memory while downloading: a decompression step, never the 64 MiB of the wide file's text.
  assert peak < 48 * 2**20, peak
  if refused_for:
    assert error is not None, f"read {len(trained)} records of a corpus that should be refused"
    assert any(url in str(error) or os.path.dirname(url) in str(error) for url in refused_for), str(error)
    if isinstance(error, errors.StorageError):
      assert error.cause == "corrupt", error
  else:
    assert error is None, error
    assert sorted(counts) == sorted(expected), (len(counts), len(expected))  # no record lost


def _lie_in_index(prefix: str, name: str, how: str) -> None:
  """Edits the index consistently (its CRC-32 recomputed): only a look at the file's copy can catch it."""
  path = _corpus_index.location(prefix)
  value = json.loads(bytes(_storage.read_bytes(path, max_bytes=2**20)))
  entry = value["files"][name]
  entry["records"] = 0 if how == "zero" else entry["records"] + 1
  body = json.dumps(value["files"], sort_keys=True, separators=(",", ":"))
  value["crc32"] = zlib.crc32(body.encode())
  _storage.write_bytes(path, json.dumps(value).encode())


_SETTINGS = dict(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))


@hypothesis.settings(max_examples=2, derandomize=True, **_SETTINGS)
@hypothesis.given(**_CASES)
@hypothesis.example(files=[(".jsonl.zst", "truncated"), (".jsonl", "whole"), (".jsonl.gz", "whole")], wide=False,
                    index="none", edited=0, shuffle="global")
@hypothesis.example(files=[(".jsonl.gz", "transit_once"), (".jsonl.zst", "transit_always"), (".jsonl", "whole")],
                    wide=True, index="honest", edited=0, shuffle="shards")
@hypothesis.example(files=[(".jsonl.zst", "whole"), (".jsonl", "whole"), (".jsonl.gz", "whole")], wide=True,
                    index="zero", edited=1, shuffle="global")
@hypothesis.example(files=[(".jsonl", "whole"), (".jsonl.zst", "transit_once"), (".jsonl.gz", "whole")], wide=False,
                    index="one_off", edited=2, shuffle="shards")
def test_compressed_and_indexed_corpora_read_every_record_once_or_are_refused_by_name(
    gcs_root, proxy, tmp_path_factory, files, wide, index, edited, shuffle):
  _check(gcs_root, proxy, tmp_path_factory, files, wide, index, edited, shuffle)


@pytest.mark.slow
@hypothesis.settings(max_examples=40, **_SETTINGS)
@hypothesis.given(**_CASES)
def test_compressed_and_indexed_corpora_property_long(gcs_root, proxy, tmp_path_factory, files, wide, index, edited,
                                                      shuffle):
  _check(gcs_root, proxy, tmp_path_factory, files, wide, index, edited, shuffle)
