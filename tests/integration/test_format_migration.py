"""Runs killed by the format-1 ckpt_iter resume, bit for bit, with today's (format 2).

tests/fixtures/v1_tunix_roots/ holds three checkpoint roots that ckpt_iter
as of e237c81 (format 1: the input's fingerprint and position mixed into the
learner's) wrote on google-tunix 0.1.7 (`make_v1_tunix_roots.py`): a toy GRPO
run killed after checkpoint 3 (inside a rollout's repeats, one trainer input
pending; the root's step 4, written by a format-1 resume, is dropped here so
that step 3 is the latest), a PEFT run killed after checkpoint 3, an agentic GRPO run killed
after checkpoint 1 (inside a repeat). Each is resumed in a fresh process by
today's code and must train what an uninterrupted run of today's code
trains after that checkpoint, and end with the same weights.

The roots were written on another machine, and XLA's CPU kernels differ by
machine in the last bits of float results (the same toy run gives log-probs
a few ULP apart). So each test first asks whether this machine trains the
fixture's first segment to the very same weights (`_same_arithmetic`): then
everything is compared bit for bit; otherwise the data is (prompts, token
ids, masks, the restored pending input, what a trainer was fed), the
floats computed from the weights agree to 1e-5 and the final weights to
2e-4 (the differences grow over the updates).
"""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import tunix_harness as harness  # noqa: E402

from ckpt_iter import testing  # noqa: E402
from demo import agentic_toyrun  # noqa: E402
from demo import toyrun  # noqa: E402
from ckpt_iter.tunix import _api  # noqa: E402

_FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "v1_tunix_roots")
# The fixtures' Tunix: another one trains in another order (agentic) or with
# other settings, which its own tests cover.
pytestmark = pytest.mark.skipif(
    _api.tunix_version() != "0.1.7",
    reason=f"the format-1 roots were written on google-tunix 0.1.7, this is {_api.tunix_version()}",
)
_GRPO_CONFIG = {"learner": "ckpt_iter", "data_shuffle_seed": 5, "max_steps": 6}


def _params(step_dir) -> list[np.ndarray]:
  """The model params an Orbax step holds, as host arrays in tree order."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # no target: the shardings come from the files
    tree = ocp.PyTreeCheckpointer().restore(os.path.abspath(os.path.join(step_dir, "model_params")))
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _same_arithmetic(fixture_step_dir, reference_step_dir) -> bool:
  """Whether this machine trained to the fixture's saved weights bit for bit (same XLA arithmetic)."""
  got, want = _params(reference_step_dir), _params(fixture_step_dir)
  assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
  return all(g.tobytes() == w.tobytes() for g, w in zip(got, want))


def _assert_same_data(actual: list[dict], expected: list[dict], exact: bool, what: str) -> None:
  """Trainer inputs equal: bit for bit when `exact`, else data bit for bit and floats to 1e-5."""
  if exact:
    harness.assert_same_inputs(actual, expected, what)
    return
  assert len(actual) == len(expected), what
  for index, (got, want) in enumerate(zip(actual, expected)):
    assert set(got) == set(want), f"{what}: input {index}"
    for field in sorted(want):
      where = f"{what}: input {index} field {field}"
      if np.issubdtype(np.asarray(want[field]).dtype, np.floating):
        np.testing.assert_allclose(got[field], want[field], rtol=1e-5, atol=1e-5, err_msg=where)
      else:
        testing.assert_trees_equal(got[field], want[field], path=where)


def _assert_same_params(actual: list, expected: list, exact: bool) -> None:
  for got, want in zip(actual, expected, strict=True):
    if exact:
      np.testing.assert_array_equal(got, want)
    else:  # a few ULP in the restored weights, grown over the updates since
      np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4)


def _copied(family, tmp_path, drop_steps=()):
  root = tmp_path / family
  shutil.copytree(os.path.join(_FIXTURES, family, "root"), root)
  for step in drop_steps:
    shutil.rmtree(root / "actor" / str(step))
  return root


@pytest.mark.heavy  # two real trainings; make test keeps the fixtures' fast read checks (test_legacy_checkpoint)
def test_a_format_1_grpo_checkpoint_inside_a_repeat_resumes_bit_for_bit(tmp_path, jax_cache):
  before_kill = toyrun.load_record(os.path.join(_FIXTURES, "grpo", "segment0.npz"))[0]
  reference = harness.run_toy(_GRPO_CONFIG, str(tmp_path / "reference"), str(tmp_path / "reference.npz"),
                              cache_dir=jax_cache)
  root = _copied("grpo", tmp_path, drop_steps=[4])
  resumed = harness.run_toy(_GRPO_CONFIG, str(root), str(tmp_path / "resumed.npz"), cache_dir=jax_cache)
  assert resumed.meta["restored_step"] == 3
  exact = _same_arithmetic(root / "actor" / "3", tmp_path / "reference" / "actor" / "3")
  # The restored pending input is the second update on the fixture's last
  # rollout: the very input its first update trained on, from any machine.
  testing.assert_trees_equal(resumed.inputs[0], before_kill[-1], path="the restored pending input")
  _assert_same_data(before_kill + resumed.inputs, reference.inputs, exact, "format-1 GRPO root resumed")
  assert len(resumed.inputs) == 3  # one pending repeat restored, then a whole rollout
  # Tunix's own restore leaves ckpt_iter's item to it: Orbax's warning about
  # that is dropped (google-tunix 0.1.7 logs it twice per resume otherwise).
  assert "was found in the checkpoint, but could not" not in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.heavy
def test_a_format_1_peft_checkpoint_resumes_bit_for_bit(tmp_path, jax_cache):
  reference = harness.run_sft(tmp_path / "reference", tmp_path / "reference.npz", jax_cache)
  root = _copied("sft", tmp_path)
  resumed = harness.run_sft(root, tmp_path / "resumed.npz", jax_cache)
  assert resumed["meta"]["restored_step"] == 3
  np.testing.assert_array_equal(resumed["fed"], reference["fed"][3 * 2:])  # gradient accumulation 2
  _assert_same_params(resumed["params"], reference["params"], _same_arithmetic(root / "3", tmp_path / "reference" / "3"))


@pytest.mark.heavy
def test_a_format_1_agentic_checkpoint_inside_a_repeat_resumes_bit_for_bit(tmp_path, jax_cache):
  before_kill = agentic_toyrun.load_record(os.path.join(_FIXTURES, "agentic", "segment0.npz"))
  reference = harness.run_agentic(tmp_path / "reference", tmp_path / "reference.npz", jax_cache)
  root = _copied("agentic", tmp_path)
  resumed = harness.run_agentic(root, tmp_path / "resumed.npz", jax_cache)
  assert resumed["meta"]["restored"]["train_steps"] == 1
  exact = _same_arithmetic(root / "actor" / "1", tmp_path / "reference" / "actor" / "1")
  inputs = before_kill["inputs"] + resumed["inputs"]
  assert len(inputs) == len(reference["inputs"])
  for index, (got, want) in enumerate(zip(inputs, reference["inputs"])):
    if exact:
      testing.assert_trees_equal(got, want, path=f"input {index}")
    else:
      _assert_same_data([got], [want], exact, f"input {index}")
  _assert_same_params(resumed["params"], reference["params"], exact)
