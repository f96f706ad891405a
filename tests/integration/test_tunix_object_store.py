"""Tunix learners with their checkpoint root on gs:// (a real local GCS emulator).

TPU jobs keep Tunix checkpoints in buckets (`checkpoint_root_directory=
"gs://..."`). Here the toy GRPO learner and the SFT trainer run in real
processes against fake-gcs-server (Orbax's arrays through tensorstore,
ckpt_iter's data item through gcsfs), are killed right after a checkpoint and
resumed in a fresh process. The resumed run must give the trainer exactly
what an uninterrupted run on local disk gives it, bit for bit. Runs on
Tunix 0.1.7 (`make test`) and on main (`make test-tunix-main`).
"""

from __future__ import annotations

import os

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter import _storage
import tunix_harness as harness  # pylint: disable=g-import-not-at-top,wrong-import-order
import test_tunix_sft as sft  # pylint: disable=g-import-not-at-top,wrong-import-order


@pytest.mark.heavy  # run by make test-heavy (CI) on 0.1.7 and make test-tunix-main on main
def test_grpo_on_gs_killed_inside_a_repeat_resumes_bit_for_bit(tmp_path, gcs_root, jax_cache):
  # num_iterations=2: update 3 is the first of the two on the second prompt,
  # so the checkpoint holds a pending repeat; the shuffle key is restored too.
  config = {"num_iterations": 2, "max_steps": 6, "data_shuffle_seed": 5, "learner": "ckpt_iter"}
  reference = harness.run_toy(config, str(tmp_path / "local"), str(tmp_path / "reference.npz"),
                              cache_dir=jax_cache)
  root = f"{gcs_root}/grpo"
  killed = harness.run_toy(config, root, str(tmp_path / "killed.npz"), preempt_after=3, cache_dir=jax_cache)
  assert killed.meta["preempted"] and len(killed.inputs) == 3
  item = f"{root}/actor/3/data"
  assert _storage.is_file(f"{item}/process_0-of-1.json") and _storage.is_file(f"{item}/process_0-of-1.npz")
  assert not os.path.exists(root) and not os.path.exists("gs:")  # nothing went to a local "gs:" directory
  resumed = harness.run_toy(config, root, str(tmp_path / "resumed.npz"), cache_dir=jax_cache)
  assert resumed.meta["restored_step"] == 3
  harness.assert_same_inputs(killed.inputs + resumed.inputs, reference.inputs, "gs:// resume after update 3")


@pytest.mark.heavy
def test_sft_on_gs_killed_mid_run_resumes_bit_for_bit(tmp_path, gcs_root, jax_cache):
  reference = sft._run(tmp_path / "local", tmp_path / "reference.npz", jax_cache)  # pylint: disable=protected-access
  root = f"{gcs_root}/sft"
  sft._run(root, tmp_path / "killed.npz", jax_cache, preempt_after=3, expect_rc=sft._PREEMPT_EXIT_CODE)  # pylint: disable=protected-access
  assert _storage.is_file(f"{root}/3/data/process_0-of-1.json")
  resumed = sft._run(root, tmp_path / "resumed.npz", jax_cache)  # pylint: disable=protected-access
  assert resumed["meta"]["restored_step"] == 3
  sft._assert_resumed_equals(resumed["fed"], resumed["params"], reference, 3)  # pylint: disable=protected-access
  # O(1): nothing replayed (the content check produces one element again).
  assert resumed["meta"]["produced"] == len(resumed["fed"]) + sft.CONTENT_CHECK_READS
