"""A make_dataset batch's content record is its last row: the restore's check is exact on drawn records.

Records are drawn with what a batch stacks differently from one record alone:
strings of different lengths (a batch widens them to its longest), numbers
that are ints in some records and floats or bools in others (a batch promotes
them), nested fields and token lists; one source or a mixture of two. A state taken at a drawn position, kept
through JSON as a checkpoint keeps it, restores into a fresh pipeline with
the check passing on the one record it reads; the same state over data whose
last row changed (a field of the record the state recorded) is refused naming
that field; and a dtype edited in the record is used only where it is a
number's that the row widens to safely, nothing allocated from any other.
"""

import json
import os

import hypothesis
from hypothesis import strategies as st
import pytest

import ckpt_iter
from ckpt_iter import _drift
from ckpt_iter import errors

_EXAMPLES = hypothesis.settings(
    max_examples=300 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 25, deadline=None)

_TEXT = st.text(alphabet="ab\u00e9\u4e2d ", max_size=12)
_NUMBER = st.one_of(st.integers(-1000, 1000), st.floats(-1e3, 1e3, allow_nan=False), st.booleans())


@st.composite
def _runs(draw):
  count = draw(st.integers(4, 40))
  width = draw(st.integers(1, 3))
  records = [{"id": i, "text": draw(_TEXT), "score": draw(_NUMBER),
              "meta": {"tokens": draw(st.lists(st.integers(0, 99), min_size=width, max_size=width)),
                       "tag": draw(_TEXT)}}
             for i in range(count)]
  batch_size = draw(st.integers(1, min(8, count)))
  seed = draw(st.one_of(st.none(), st.integers(0, 2**32 - 1)))
  batches = draw(st.integers(1, 3 * (count // batch_size)))
  if draw(st.booleans()):  # a mixture of two sources, drawn shares: each row read through its source
    split = draw(st.integers(1, count - 1))
    records = _Mixture({"a": records[:split], "b": records[split:]}, draw(st.sampled_from([(1, 1), (1, 3), (2, 1)])))
  return records, batch_size, seed, batches


class _Mixture(dict):
  """Two sources and their weights, which `_pipeline` hands make_dataset as a mixture."""

  def __init__(self, sources, weights):
    super().__init__(sources)
    self.weights = dict(zip(sources, weights))


# A record the transform changes, as a changed vocabulary file or library would: the definition stays the same.
_EDIT = {"row": None, "field": None}


def _transform(record):
  if record["id"] != _EDIT["row"]:
    return record
  if _EDIT["field"] == "text":
    return {**record, "text": record["text"] + "!"}
  return {**record, "meta": {**record["meta"], "tokens": [t + 1 for t in record["meta"]["tokens"]]}}


def _pipeline(records, batch_size, seed):
  if isinstance(records, _Mixture):
    return ckpt_iter.make_dataset(dict(records), weights=records.weights, batch_size=batch_size, seed=seed,
                                  num_epochs=None, transform=_transform)
  return ckpt_iter.make_dataset(records, batch_size=batch_size, seed=seed, num_epochs=None, transform=_transform)


def _state_after(records, batch_size, seed, batches):
  iterator = ckpt_iter.DataIterator(_pipeline(records, batch_size, seed))
  for _ in range(batches):
    last = next(iterator)
  return json.loads(json.dumps(iterator.get_state())), last


@_EXAMPLES
@hypothesis.given(_runs())
def test_a_restore_checks_the_last_row_and_continues_exactly(run):
  records, batch_size, seed, batches = run
  state, last = _state_after(*run)
  assert json.loads(state["content"])["check"] == _drift.BY_ROW  # a state dict holds it as JSON text
  reference = ckpt_iter.DataIterator(_pipeline(records, batch_size, seed))
  for _ in range(batches):
    next(reference)
  fresh = ckpt_iter.DataIterator(_pipeline(records, batch_size, seed))
  fresh.set_state(state)
  assert fresh.restored_content_check == f"same element at index {batches - 1} (its last row)"
  produced, expected = next(fresh), next(reference)
  assert produced["id"].tolist() == expected["id"].tolist()
  # The row recorded is the batch's last: its record produced otherwise is refused naming the field.
  for field, name in (("text", "text"), ("tokens", "meta.tokens")):
    _EDIT.update(row=int(last["id"][-1]), field=field)
    try:
      edited = ckpt_iter.DataIterator(_pipeline(records, batch_size, seed))
      with pytest.raises(errors.ContentDriftError, match=rf"field '{name}'"):
        edited.set_state(state)
    finally:
      _EDIT.update(row=None, field=None)


@_EXAMPLES
@hypothesis.given(_runs(), st.sampled_from(["(100000000,)<i8", "<U999999999", "|O", "<f8", "junk", ""]))
def test_an_edited_dtype_in_the_record_is_used_only_for_a_safe_number_cast(run, dtype):
  """The record's digest vouches for the row: a dtype that is no plain number's is not used (nothing is allocated
  from it); a number dtype the row widens to is, and the digest then differs."""
  records, batch_size, seed, batches = run
  state, last = _state_after(*run)
  content = json.loads(state["content"])
  crc, _, saved = content["fields"]["score"].partition(":")
  hypothesis.assume(dtype != saved)
  content["fields"]["score"] = f"{crc}:{dtype}"
  state["content"] = json.dumps(content)
  fresh = ckpt_iter.DataIterator(_pipeline(records, batch_size, seed))
  if dtype == "<f8":  # the row's score (int or bool here) is cast to it: another CRC
    with pytest.raises(errors.ContentDriftError, match=r"field 'score'"):
      fresh.set_state(state)
    assert fresh.state().position["next_record"] == 0  # refused before anything was applied
    return
  # Not a plain number's dtype: not used. The row compares as recorded, unless the batch had promoted its
  # score (a bool or int beside a float), which only the recorded dtype undoes: then refused by name.
  try:
    fresh.set_state(state)
  except errors.ContentDriftError as e:
    assert "field 'score'" in str(e)
    assert last["score"].dtype.kind in "iuf" and fresh.state().position["next_record"] == 0
    return
  assert fresh.restored_content_check == f"same element at index {batches - 1} (its last row)"
  assert fresh.state().position == state["position"]


def test_a_pipeline_with_a_map_after_make_dataset_records_the_whole_batch():
  dataset = ckpt_iter.make_dataset([{"id": i} for i in range(8)], batch_size=2, seed=1, num_epochs=1)
  iterator = ckpt_iter.DataIterator(dataset.map(lambda batch: {"id": batch["id"] * 2}))
  next(iterator)
  assert iterator.state().content["check"] == _drift.BY_INDEX
