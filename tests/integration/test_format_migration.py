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
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import tunix_harness as harness  # noqa: E402

from ckpt_iter import testing  # noqa: E402
from ckpt_iter.demo import agentic_toyrun  # noqa: E402
from ckpt_iter.demo import toyrun  # noqa: E402
from ckpt_iter.tunix import _api  # noqa: E402

_FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "v1_tunix_roots")
# The fixtures' Tunix: another one trains in another order (agentic) or with
# other settings, which its own tests cover.
pytestmark = pytest.mark.skipif(
    _api.tunix_version() != "0.1.7",
    reason=f"the format-1 roots were written on google-tunix 0.1.7, this is {_api.tunix_version()}",
)
_GRPO_CONFIG = {"learner": "ckpt_iter", "data_shuffle_seed": 5, "max_steps": 6}


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
  harness.assert_same_inputs(before_kill + resumed.inputs, reference.inputs, "format-1 GRPO root resumed")
  assert len(resumed.inputs) == 3  # one pending repeat restored, then a whole rollout
  # Tunix's own restore leaves ckpt_iter's item to it: Orbax's warning about
  # that is dropped (google-tunix 0.1.7 logs it twice per resume otherwise).
  assert "was found in the checkpoint, but could not" not in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.heavy
def test_a_format_1_peft_checkpoint_resumes_bit_for_bit(tmp_path, jax_cache):
  reference = harness.run_sft(tmp_path / "reference", tmp_path / "reference.npz", jax_cache)
  resumed = harness.run_sft(_copied("sft", tmp_path), tmp_path / "resumed.npz", jax_cache)
  assert resumed["meta"]["restored_step"] == 3
  np.testing.assert_array_equal(resumed["fed"], reference["fed"][3 * 2:])  # gradient accumulation 2
  for got, want in zip(resumed["params"], reference["params"], strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.heavy
def test_a_format_1_agentic_checkpoint_inside_a_repeat_resumes_bit_for_bit(tmp_path, jax_cache):
  before_kill = agentic_toyrun.load_record(os.path.join(_FIXTURES, "agentic", "segment0.npz"))
  reference = harness.run_agentic(tmp_path / "reference", tmp_path / "reference.npz", jax_cache)
  resumed = harness.run_agentic(_copied("agentic", tmp_path), tmp_path / "resumed.npz", jax_cache)
  assert resumed["meta"]["restored"]["train_steps"] == 1
  inputs = before_kill["inputs"] + resumed["inputs"]
  assert len(inputs) == len(reference["inputs"])
  for index, (got, want) in enumerate(zip(inputs, reference["inputs"])):
    testing.assert_trees_equal(got, want, path=f"input {index}")
  for got, want in zip(resumed["params"], reference["params"], strict=True):
    np.testing.assert_array_equal(got, want)
