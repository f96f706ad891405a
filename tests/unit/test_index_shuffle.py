"""`_index_shuffle`: Grain's index_shuffle over numpy arrays, held equal to Grain's own extension."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from ckpt_iter import _index_shuffle
from ckpt_iter import _permutation


def _grain():
  compiled = _permutation._compiled()  # pylint: disable=protected-access
  assert compiled is not None, "Grain's index_shuffle extension is installed with grain"
  return compiled


@settings(max_examples=100, deadline=None)
@given(max_index=st.one_of(st.integers(0, 300), st.integers(0, 2**40), st.integers(0, 2**63 - 1),
                           st.sampled_from([2**k + d for k in (16, 20, 32, 48, 62) for d in (-1, 0, 1)])),
       seed=st.integers(0, 2**32 - 1), rounds=st.sampled_from([4, 6, 8]), data=st.data())
def test_it_is_grains_index_shuffle_for_any_size_seed_and_index(max_index, seed, rounds, data):
  indices = data.draw(st.lists(st.integers(0, max_index), min_size=1, max_size=40))
  assert (_index_shuffle.index_shuffle(indices, max_index, seed, rounds).tolist()
          == [_grain()(i, max_index, seed, rounds) for i in indices])


@pytest.mark.parametrize("max_index", [0, 1, 255, 65_535, 20_479])
def test_a_whole_range_is_a_permutation_equal_to_grains(max_index):
  values = _index_shuffle.index_shuffle(np.arange(max_index + 1), max_index, 77).tolist()
  assert sorted(values) == list(range(max_index + 1))
  assert values == [_grain()(i, max_index, 77, 4) for i in range(max_index + 1)]


# std::seed_seq{seed}.generate(n words): the first four and the last, as libstdc++ (g++ 12) wrote them.
_SEED_SEQ = [
    (0, 4, [2963817213, 69796629, 1973464570, 532167439, 532167439]),
    (0, 80, [1489317837, 802642079, 2928584458, 4238630647, 3517751477]),
    (7, 10, [1701264920, 2215747448, 1069929805, 957768666, 2189226359]),
    (4294967295, 4, [3258260622, 2976084991, 227751652, 537413182, 537413182]),
    (4294967295, 80, [4258323893, 2943627605, 2620311759, 2846808434, 1888907339]),
]


@pytest.mark.parametrize("seed,count,words", _SEED_SEQ)
def test_the_round_keys_are_cpps_seed_seq(seed, count, words):
  generated = _index_shuffle.seed_sequence(seed, count)
  assert len(generated) == count and generated[:4] + generated[-1:] == words


def test_agrees_is_what_the_plans_rely_on_and_can_say_no():
  assert _index_shuffle.agrees(_grain())
  assert not _index_shuffle.agrees(lambda i, max_index, seed, rounds: i)  # another function
  assert not _index_shuffle.agrees(lambda i, m, seed, rounds: _grain()(i, m, seed ^ 1, rounds))


def test_the_epoch_order_and_the_ranked_windows_are_the_extensions(monkeypatch):
  # The plans' two bulk uses give what a call into the extension per index gives.
  vectorized_order = _permutation._index_shuffle_range(70_000, 70_000, 5)  # pylint: disable=protected-access
  vectorized_ranked = _permutation._ranked(500, 9)  # pylint: disable=protected-access
  monkeypatch.setattr(_permutation, "_vectorized", lambda: False)
  assert vectorized_order == [_permutation._index_shuffle(k, 70_000, 5) for k in range(70_000)]  # pylint: disable=protected-access
  assert vectorized_ranked == _permutation._ranked(500, 9)  # pylint: disable=protected-access
