"""`ckpt_iter.which(pipeline, state)` (`provenance`): the last batch's records where user code makes the rows.

A state alone answers where its position counts stream records (the data map,
tests/unit/test_datamap.py); a filtered or packed make_dataset, or one under
other Grain steps, is answered with the pipeline that wrote the state.
"""

import pytest

import ckpt_iter
from ckpt_iter import datamap
from ckpt_iter import errors
import support

RECORDS = support.CHAIN_RECORDS
_pipeline = support.chain_pipeline
_ids = support.batch_ids


@pytest.mark.parametrize("kind, fragment", [
    ("lanes", "filtered or packed make_dataset"),
    ("batched", "not a stream record"),
])
def test_a_state_whose_rows_user_code_computes_names_the_python_api(kind, fragment):
  if kind == "lanes":
    pipeline = ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=1, num_epochs=None, shard_index=0, shard_count=1,
                                      filter=lambda r: r["id"] % 2 == 0, chunk_size=4, num_lanes=2)
  else:
    pipeline = ckpt_iter.make_dataset(RECORDS, batch_size=1, seed=1, num_epochs=1, shard_index=0,
                                      shard_count=1).batch(3)
  iterator = ckpt_iter.DataIterator(pipeline)
  last = next(iterator)
  value = iterator.state()
  fingerprint, position = value.innermost.fingerprint, value.innermost.position
  with pytest.raises(errors.UnsupportedConfigError) as info:
    datamap.RecordStream(fingerprint, position, origin="step 1")
  assert fragment in str(info.value) and "ckpt_iter.which(pipeline, state)" in str(info.value)
  # ... which answers with the pipeline.
  batch = ckpt_iter.which(pipeline, value)
  if kind == "lanes":
    assert set(_ids(last)) <= {r.index for r in batch.records}
    assert "lane 0" in batch.how
  else:
    assert [r.index for r in batch.records] == _ids(last)


def test_which_traces_tunix_cli_pipelines_through_filter_and_iter_batches():
  pipeline = (ckpt_iter.make_dataset(RECORDS, batch_size=1, seed=2, num_epochs=1, shard_index=0, shard_count=1)
              .filter(lambda b: b["id"][0] % 3 != 0).repeat(2).to_iter_dataset().batch(4))
  iterator = ckpt_iter.DataIterator(pipeline)
  for _ in range(7):  # into the second repeat
    last = next(iterator)
  batch = ckpt_iter.which(pipeline, iterator.state())
  assert [r.index for r in batch.records] == _ids(last)


def test_which_refuses_another_source():
  iterator = ckpt_iter.DataIterator(_pipeline(1, 0, 4))
  next(iterator)
  with pytest.raises(errors.ConfigDriftError) as info:
    ckpt_iter.which(_pipeline(1, 0, 4, seed=6), iterator.state())
  assert "seed" in str(info.value)
