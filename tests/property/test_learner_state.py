"""A learner's state nests its input's (format 2 on), and every format-1 state reads losslessly.

Hypothesis builds format-1 learner states of every family (RL, SFT,
agentic) over arbitrary input fingerprints and positions; reading one
(`IteratorState.from_dict`) must nest the input's state so that nothing is
lost or moved to the wrong side, and the CLI's view must find the input.
"""

import json

from hypothesis import assume, given, settings, strategies as st

from ckpt_iter import _item as item_lib
from ckpt_iter import errors
from ckpt_iter import state as state_lib

# Each family's own fingerprint fields as format 1 wrote them (a sample: the
# family's naming field is always there) and where its input's position was.
_FAMILIES = {
    "learner": (["num_iterations", "num_generations", "full_batch_size", "mini_batch_size",
                 "train_micro_batch_size", "data_shuffle_seed", "async_rollout", "settings"], "full_batch"),
    "trainer": (["gradient_accumulation_steps"], None),
    "agentic_learner": (["num_iterations_order", "num_generations", "num_iterations", "off_policy_steps",
                         "mini_batch_size"], "source"),
}
_INPUT_NAMES = st.sampled_from([
    "source", "source_length", "source_digest", "seed", "num_epochs", "batch_size", "pipeline",
    "graph", "dataset_length", "node[0].BatchMapDataset.batch_size", "shard_index", "loader.sampler",
])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.text(max_size=12))
_INPUT_POSITIONS = st.one_of(
    st.builds(lambda n: {"next_index": n}, st.integers(0, 10**6)),
    st.builds(lambda n, d: {"full_batches_read": n, "last_batch": {"check": "index", "digest": d, "fields": {"ids": d[:8]}}},
              st.integers(0, 10**6), st.text("0123456789abcdef", min_size=16, max_size=16)),
    st.builds(lambda n, d: {"full_batches_read": n, "last_batch_digest": d},  # as 0.2.0 wrote it
              st.integers(0, 10**6), st.text("0123456789abcdef", min_size=16, max_size=16)),
    st.dictionaries(st.sampled_from(["parent", "index", "epoch"]),
                    st.one_of(st.integers(0, 99), st.dictionaries(st.just("next_index"), st.integers(0, 9))),
                    min_size=1),
)
_LEARNER_POSITIONS = st.dictionaries(
    st.sampled_from(["micro_batches_taken", "rows_taken", "stream_rows", "prompt_index", "batches_fed"]),
    st.integers(0, 10**4),
)


@st.composite
def _v1_states(draw):
  family = draw(st.sampled_from(sorted(_FAMILIES)))
  fields, input_key = _FAMILIES[family]
  learner = {family: draw(st.text(min_size=1, max_size=12))}
  learner.update({name: draw(_SCALARS) for name in draw(st.lists(st.sampled_from(fields), unique=True))})
  input_fingerprint = draw(st.dictionaries(_INPUT_NAMES, _SCALARS, min_size=1))
  # Format 1 wrote the input's fields first (the agentic order field before them).
  order = draw(st.permutations(list(input_fingerprint) + list(learner)))
  fingerprint = {name: {**input_fingerprint, **learner}[name] for name in order}
  input_position = draw(_INPUT_POSITIONS)
  if input_key is None:
    position = input_position
  else:
    position = {input_key: input_position, **draw(_LEARNER_POSITIONS)}
  header = {
      "format_version": 1, "kind": "tunix", "fingerprint": fingerprint, "position": position,
      "shuffle_key": None, "pending": None, "counters": {"train_steps": draw(st.integers(0, 99))},
  }
  return header, family, input_key


@settings(max_examples=200, deadline=None)
@given(_v1_states())
def test_a_format_1_learner_state_reads_nested_with_nothing_lost_or_misplaced(drawn):
  header, family, input_key = drawn
  value = state_lib.IteratorState.from_dict(json.loads(json.dumps(header)), origin="drawn")
  assert value.format_version == state_lib.FORMAT_VERSION
  assert isinstance(value.part, state_lib.IteratorState) and value.part.kind == "data"
  input_fingerprint, input_position, own = value.innermost.fingerprint, value.innermost.position, value.own_position
  # Each field on its side: the learner's own (named by format 1's list), the rest the input's.
  assert family in value.fingerprint
  assert set(input_fingerprint) == {k for k in header["fingerprint"] if not (
      k == family or k in _FAMILIES[family][0])}
  assert {**input_fingerprint, **value.fingerprint} == header["fingerprint"]
  if input_key is None:
    assert (dict(input_position), own) == (header["position"], {})
  else:
    assert {input_key: input_position, **own} == header["position"]
  # The one way down a state finds the nested input.
  assert value.innermost is value.part
  flat = state_lib.flat_fingerprint(value)
  assert len(flat) == len(header["fingerprint"])
  # A resume format 1 recorded from this state is still recognised by the audit.
  as_written = item_lib.resume_digest(state_lib.validated(json.loads(json.dumps(header)), "drawn"),
                                      per_process=True)  # format 1 digested the whole fingerprint
  assert as_written in item_lib.header_resume_digests(header, origin="drawn")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_INPUT_NAMES, _SCALARS), _INPUT_POSITIONS, _LEARNER_POSITIONS)
def test_nesting_then_splitting_gives_back_each_part(input_fingerprint, input_position, learner_position):
  part = state_lib.IteratorState(kind="data", fingerprint=input_fingerprint, position=input_position)
  value = state_lib.IteratorState(kind="tunix", fingerprint={"learner": "x"},
                                  position={"input": part, **learner_position})
  read = state_lib.IteratorState.from_dict(json.loads(json.dumps(value.to_dict())))
  assert read.format_version == state_lib.FORMAT_VERSION and read == value and read.part == part
  inner = read.innermost
  assert (dict(inner.fingerprint), read.own_position) == (input_fingerprint, learner_position)
  assert dict(inner.position) == input_position


@given(st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.sampled_from(["kind", "fingerprint", "position", "x"]),
                                 st.one_of(st.none(), st.just("data"), st.just({})))))
def test_a_position_without_a_well_formed_input_state_is_not_split(nested):
  well_formed = (
      isinstance(nested, dict) and set(nested) == {"kind", "fingerprint", "position"}
      and nested["kind"] == "data" and nested["fingerprint"] == {} and nested["position"] == {})
  assume(not well_formed)
  try:
    value = state_lib.IteratorState(kind="tunix", fingerprint={"learner": "x"},
                                    position={"input": nested, "micro_batches_taken": 0})
  except errors.InvalidStateError:
    return  # refused, naming the field
  assert value.part is None and value.innermost is value and value.own_position == {}
