"""A cached copy's companions (`_cache_companions`): its seal, and the count that binds its index to it."""

from __future__ import annotations

from ckpt_iter import _cache_companions


def test_a_seal_reads_back_and_anything_else_is_none(tmp_path):
  seal = tmp_path / "copy.seal"
  seal.write_text(_cache_companions.seal_text(1234, 0xABCDEF))
  assert _cache_companions.read_seal(str(seal)) == (1234, 0xABCDEF)
  for text in ("crc32 zz size 3\n", "garbage", ""):
    seal.write_text(text)
    assert _cache_companions.read_seal(str(seal)) is None
  assert _cache_companions.read_seal(str(tmp_path / "absent")) is None


def test_a_count_record_is_bound_to_its_copys_name_and_its_own_check():
  record = _cache_companions.CompanionRecord(50, 0x1234, 0x5678)
  text = record.format("key-version-part-0.jsonl")
  assert _cache_companions.CompanionRecord.parse(text, "key-version-part-0.jsonl") == record
  assert _cache_companions.CompanionRecord.parse(text, "key-version-part-1.jsonl") is None  # another copy's
  assert _cache_companions.CompanionRecord.parse(text.replace("records 50", "records 40"),
                                                 "key-version-part-0.jsonl") is None  # edited
