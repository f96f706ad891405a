"""MaxText's default `grain_worker_count: 1`: the rows come from a Grain worker process, the same rows.

A packed job reading through one worker process (`mp_prefetch`, as MaxText's
default config asks) is SIGKILLed after an unsaved step and resumed the same
way: it trains an uninterrupted in-process run's batches, bit for bit. Packed
rows cannot change their worker count at a restart (each worker packs its own
lanes' chunks): another count is refused naming `num_workers`.

Runs only in `make test-maxtext` (Python 3.12, MaxText installed).
"""

from __future__ import annotations

import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")

import maxtext_jobs  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_a_run_read_by_a_worker_process_resumes_with_the_uninterrupted_runs_batches(tmp_path):
  maxtext_jobs.write_parquet(tmp_path / "train-0.parquet", range(0, 200))
  settings = dict(files=str(tmp_path / "*.parquet"), side="ckpt_iter", global_batch=4, num_lanes=4, chunk_size=16,
                  steps=2, ckpt_dir=str(tmp_path / "ckpt"))
  maxtext_jobs.run(tmp_path, "workers", 1, kill=True, workers=1, **settings)
  maxtext_jobs.run(tmp_path, "resumed", 1, kill=False, workers=1, **settings)
  trained = (maxtext_jobs.trained(tmp_path, "workers", 1, killed=True)
             + maxtext_jobs.trained(tmp_path, "resumed", 1, killed=False))
  maxtext_jobs.run(tmp_path, "reference", 1, kill=False, workers=0, **dict(
      settings, steps=len(trained) - 1, ckpt_dir=str(tmp_path / "reference")))
  assert len(trained) == 5
  assert trained == maxtext_jobs.trained(tmp_path, "reference", 1, killed=False)
