"""The errors' messages (`errors`): a drift names the fields that differ, bounded however many do."""

import ast
import re

import pytest

from ckpt_iter import errors
from ckpt_iter import state as state_lib


def test_a_drift_of_200000_fields_names_the_first_few_counts_the_rest_and_keeps_them_all():
  """A big pipeline's graph can honestly differ in every node: the message stays a few KB."""
  count = 200_000
  saved = {f"stage_{i}.fn_code": f"saved {i} " + "x" * 300 for i in range(count)}
  current = {name: i for i, name in enumerate(saved)}
  with pytest.raises(errors.ConfigDriftError) as info:
    state_lib.check_fingerprint(saved, current, origin="step 12")
  error, message = info.value, str(info.value)
  assert len(message) < 4096, len(message)
  assert error.differences == {name: (saved[name], current[name]) for name in saved}
  first = sorted(saved)[:errors.SHOWN_DIFFERENCES]
  for name in first:
    cut = errors.shown_value(saved[name], errors.SHOWN_DRIFT_VALUE_CHARS)
    assert f"{name}={cut} there, {name}={current[name]} here" in message, name
  assert sorted(saved)[errors.SHOWN_DIFFERENCES] not in message
  assert f"{count:,} fields differ, the first {len(first)} by name" in message
  assert f"and {count - len(first):,} more" in message
  # Both ways to accept it are copy-pasteable: the fields shown, and all of them.
  shown_set = re.search(r"allow_drift=(\{[^}]*\}) the 8 shown", message).group(1)
  assert ast.literal_eval(shown_set) == set(first)
  assert "allow_drift=set(error.differences) accepts all 200,000" in message
  state_lib.check_fingerprint(saved, current, allow_drift=set(error.differences))


def test_a_drift_of_a_few_fields_names_each_in_full_with_the_allow_drift_to_paste():
  names = [f"field_{i}" for i in range(errors.SHOWN_DIFFERENCES)]
  with pytest.raises(errors.ConfigDriftError) as info:
    state_lib.check_fingerprint({n: 0 for n in names}, {n: 1 for n in names})
  message = str(info.value)
  assert all(f"{n}=0 there, {n}=1 here" in message for n in names)
  assert ast.literal_eval(re.search(r"allow_drift=(\{[^}]*\})", message).group(1)) == set(names)
  assert "more" not in message
