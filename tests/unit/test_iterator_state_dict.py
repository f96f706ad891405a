"""`DataIterator.state_dict()` / `load_state_dict()`: the names torch and Hugging Face users reach for.

They are `get_state` / `set_state` under other names: the same dict, the same
checks, the same exact resume. (In tests/unit/test_iterator.py's own file,
which another change edits; one concern, one small file.)
"""

import json

import numpy as np
import pytest

import ckpt_iter
from ckpt_iter import testing


def _pipeline(seed=0):
  records = [{"prompts": f"question {i}", "answer": i} for i in range(50)]
  return ckpt_iter.make_dataset(records, batch_size=4, seed=seed, num_epochs=3)


def test_state_dict_is_get_state():
  iterator = ckpt_iter.DataIterator(_pipeline())
  next(iterator)
  assert iterator.state_dict() == iterator.get_state()


@pytest.mark.parametrize("read", [0, 1, 7, 12, 25])  # 12 batches an epoch
def test_a_state_dict_saved_as_json_resumes_a_fresh_iterator_exactly(read):
  uninterrupted = ckpt_iter.DataIterator(_pipeline())
  iterator = ckpt_iter.DataIterator(_pipeline())
  for _ in range(read):
    next(iterator)
  saved = json.loads(json.dumps(iterator.state_dict()))  # what torch.save / a JSON file would keep
  resumed = ckpt_iter.DataIterator(_pipeline())
  resumed.load_state_dict(saved)
  expected = [next(uninterrupted) for _ in range(read + 10)][read:]
  for element in expected:
    testing.assert_trees_equal(next(resumed), element)


def test_load_state_dict_refuses_another_pipeline_and_changes_nothing():
  iterator = ckpt_iter.DataIterator(_pipeline())
  next(iterator)
  saved = iterator.state_dict()
  other = ckpt_iter.DataIterator(_pipeline(seed=1))
  before = other.state_dict()
  with pytest.raises(ckpt_iter.ConfigDriftError, match="seed"):
    other.load_state_dict(saved)
  assert other.state_dict() == before
  np.testing.assert_array_equal(next(other)["answer"], next(ckpt_iter.DataIterator(_pipeline(seed=1)))["answer"])
