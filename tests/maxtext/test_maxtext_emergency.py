"""MaxText's emergency (multi-tier) checkpoints carry the data item with ckpt_iter's iterator.

MaxText's emergency manager (Orbax's multi-tier `CheckpointManager`, built by
MaxText's own `create_orbax_emergency_checkpoint_manager`) saves the train
state alone: a job SIGKILLed and resumed from it starts its data again at the
first record. With ckpt_iter's iterator, MaxText's `save_checkpoint` and
`load_state_if_possible` also write and restore the step's data item: the
resumed job trains the uninterrupted run's batches. On CPU there is one slice,
so Orbax's manager keeps the persistent tier only (its local tier is for the
other slices of a multi-slice job).

Runs only in `make test-maxtext` (Python 3.12, MaxText installed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")

import maxtext_jobs  # pylint: disable=g-import-not-at-top,wrong-import-position

STEPS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  directory = tmp_path_factory.mktemp("emergency_corpus")
  maxtext_jobs.write_parquet(directory / "train-0.parquet", range(0, 120))
  return directory


def _resumed(directory: Path, corpus: Path, side: str) -> tuple[list, list, int | None]:
  settings = dict(files=str(corpus / "*.parquet"), packing=False, global_batch=12, side=side, manager="emergency",
                  ckpt_dir=str(directory / "persistent"), local_dir=str(directory / "local"), steps=STEPS)
  maxtext_jobs.run(directory, "killed", 1, kill=True, **settings)
  results = maxtext_jobs.run(directory, "resumed", 1, kill=False, **settings)
  trained = (maxtext_jobs.trained(directory, "killed", 1, killed=True)
             + maxtext_jobs.trained(directory, "resumed", 1, killed=False))
  maxtext_jobs.run(directory, "reference", 1, kill=False, **dict(
      settings, steps=len(trained) - 1, ckpt_dir=str(directory / "reference"), local_dir=str(directory / "rl")))
  return trained, maxtext_jobs.trained(directory, "reference", 1, killed=False), results[0]["resumed_from"]


def test_a_resume_from_an_emergency_checkpoint_trains_the_uninterrupted_runs_batches(tmp_path, corpus):
  trained, reference, resumed_from = _resumed(tmp_path, corpus, "ckpt_iter")
  assert resumed_from == STEPS - 1
  assert len(trained) == 2 * STEPS + 1
  assert trained == reference
  # A data item for each step the manager holds, and no other.
  steps = lambda path: sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())
  assert steps(tmp_path / "persistent-ckpt_iter-data") == steps(tmp_path / "persistent") == list(range(2 * STEPS))


def test_stock_maxtext_starts_the_data_again_after_an_emergency_restore(tmp_path, corpus):
  trained, reference, resumed_from = _resumed(tmp_path, corpus, "stock")
  assert resumed_from == STEPS - 1
  # The batches after the resume are the run's first ones again: STEPS batches trained twice.
  assert trained[STEPS:2 * STEPS] == reference[:STEPS]
  assert trained != reference
