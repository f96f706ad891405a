"""MaxText's RL input, resumed mid-`num_iterations` by ckpt_iter's learner where stock Tunix skips.

MaxText 0.2.5's `train_rl.py` builds Tunix's `GrpoLearner` (the one-line
change: `from ckpt_iter.tunix import ResumableGRPOLearner as GrpoLearner`)
and trains it on the prompts its `prepare_datasets` builds: a shuffled
`MapDataset`, mapped, filtered, cut, repeated, batched after
`to_iter_dataset()` (tunix_toy's `maxtext_rl` input). Its own entry point
cannot run on CPU (its rollouts go through vLLM), so this runs one level below
it: a real toy GRPO learner with Tunix's own rollout, num_iterations=2,
killed inside a global step and resumed in a fresh process.
"""

import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import tunix_harness as harness  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.heavy  # real toy Tunix runs

CONFIG = dict(num_iterations=2, max_steps=6, input_kind="maxtext_rl", batch_size=2, num_prompts=12,
              dataset_seed=3)


def test_maxtexts_rl_input_resumes_inside_a_global_step_bit_for_bit_where_stock_skips(tmp_path, jax_cache):
  reference = harness.check_chain(CONFIG, [3], str(tmp_path / "ckpt_iter"), jax_cache)
  stock_segments, _ = harness.chain(dict(CONFIG, learner="stock"), str(tmp_path / "stock"), [3], jax_cache)
  stock_labels = [label for run in stock_segments for label in run.labels]
  # Stock Tunix (tunix#2290) fast-forwards num_iterations times too far: a batch it never trained is skipped.
  assert stock_labels != reference.labels
  assert set(reference.labels) - set(stock_labels), (stock_labels, reference.labels)
