"""What each store takes and guarantees, in one place (`_object_store.StoreProfile`): a second store is one profile.

Only the profiles: the calls they shape need a store (tests/integration/test_object_store.py and
test_store_faults.py, on the GCS emulator).
"""

from __future__ import annotations

from ckpt_iter import _object_store as store
from ckpt_iter import _storage
from ckpt_iter import store_bounds

_RECORDED = (5, "generation=1700000000000001,crc32c=AAAAAA==")


def test_gcs_pins_the_generation_it_lists_and_bounds_each_request():
  gcs = store.profile("gs://bucket/part-0.jsonl")
  assert store.profile("gcs://bucket/x") is gcs and gcs.package == "gcsfs" and gcs.extra == "gcs"
  bounds = store_bounds.object_store_bounds()
  assert gcs.filesystem_options(versioned=False) == {"requests_timeout": bounds.request_seconds}
  assert gcs.filesystem_options(versioned=True) == {"requests_timeout": bounds.request_seconds, "version_aware": True}
  assert gcs.file_options() == {"timeout": bounds.operation_seconds}
  assert gcs.pin_of({"generation": 17, "size": 3}) == "17" and gcs.pin_of({"size": 3, "generation": ""}) is None
  assert gcs.pinned_target("bucket/x", "17") == "bucket/x#17" and gcs.pinned_target("bucket/x", None) == "bucket/x"
  assert gcs.pinned_range("17") == {"generation": "17"} and gcs.pinned_range(None) == {}
  found = _storage.identities_as_recorded(["gs://bucket/x"], [_RECORDED])[0]
  assert found.generation == "1700000000000001" and found.size == 5 and found.checksum is not None


def test_a_store_without_pins_reads_unpinned_whatever_its_metadata_holds():
  for url in ("s3://bucket/x", "az://container/x", "nosuch://x"):
    other = store.profile(url)
    assert not other.pins and not other.bounds_requests
    assert other.pin_of({"generation": 17}) is None
    assert other.pinned_target("bucket/x", "17") == "bucket/x" and other.pinned_range("17") == {}
    assert other.filesystem_options(versioned=True) == {} and other.file_options() == {}
    assert _storage.identities_as_recorded([url], [_RECORDED])[0].generation is None
  assert store.profile("nosuch://x").package == "the fsspec implementation of nosuch://"


def test_a_second_store_is_one_profile(monkeypatch):
  monkeypatch.setitem(store.PROFILES, "mem2", store.StoreProfile("mem2fs", pins=True))
  found = _storage.identities_as_recorded(["mem2://bucket/x"], [_RECORDED])[0]
  assert found.generation == "1700000000000001"  # its reads are pinned from now on
  assert store.profile("mem2://bucket/x").pinned_target("bucket/x", found.generation) == "bucket/x#1700000000000001"
