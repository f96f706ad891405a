"""MaxText 0.2.5's own pretraining input path, with ckpt_iter's constructor: exact across host counts.

Real processes (tests/workers/maxtext_worker.py) join a `jax.distributed` job
on CPU and run MaxText's own `pyconfig`, `create_data_iterator`,
`save_checkpoint` and `load_state_if_possible` over Parquet files, tokenized
with MaxText's sentencepiece tokenizer and packed (`packing: true`). A chain
of jobs changes the host count 1 -> 2 -> 4 -> 3 -> 1 and the global batch
(12, 24 at 4 hosts), each job SIGKILLed after a step it trained but did not
save. Every row trained (decoded back to its records) is compared with an
uninterrupted run: each lane's rows are the same rows in the same order
(0 duplicates, 0 skips). Stock MaxText in the same chain refuses the first
host-count change.

Runs only in `make test-maxtext` (Python 3.12, MaxText installed).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")

import maxtext_jobs  # pylint: disable=g-import-not-at-top,wrong-import-position
import support  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_LANES = 12
RECORDS_PER_FILE = 40
# (processes, global batch) of each job of the chain; each saves STEPS steps, the last is not killed.
CHAIN = ((1, 12), (2, 12), (4, 24), (3, 12), (1, 12))
STEPS = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  directory = tmp_path_factory.mktemp("corpus")
  for f in range(3):
    maxtext_jobs.write_parquet(directory / f"train-{f}.parquet", range(f * 100, f * 100 + RECORDS_PER_FILE))
  return directory


def _settings(corpus: Path, **changes) -> dict:
  return dict(dict(files=str(corpus / "*.parquet"), num_lanes=NUM_LANES, chunk_size=8, steps=STEPS), **changes)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, corpus):
  """The chained jobs' trained batches (killed steps left out) and an uninterrupted run's."""
  directory = tmp_path_factory.mktemp("chain")
  trained: list[list[list[int]]] = []
  resumed = []
  for number, (processes, global_batch) in enumerate(CHAIN):
    killed = number < len(CHAIN) - 1
    results = maxtext_jobs.run(directory, f"job{number}", processes, kill=killed, **_settings(
        corpus, side="ckpt_iter", global_batch=global_batch, ckpt_dir=str(directory / "ckpt")))
    resumed.append(results[0]["resumed_from"])
    trained.extend(maxtext_jobs.trained(directory, f"job{number}", processes, killed=killed))
  rows_per_lane = sum(len(b) for b in trained) // NUM_LANES
  maxtext_jobs.run(directory, "reference", 1, kill=False, **_settings(
      corpus, side="ckpt_iter", global_batch=NUM_LANES, ckpt_dir=str(directory / "reference_ckpt"),
      steps=rows_per_lane - 1))
  return {"trained": trained, "reference": maxtext_jobs.trained(directory, "reference", 1, killed=False),
          "resumed": resumed, "ckpt_dir": directory / "ckpt"}


def test_every_job_resumes_from_the_step_its_predecessor_saved_last(chain):
  assert chain["resumed"] == [None, 1, 3, 5, 7]


def test_each_lane_trains_the_uninterrupted_runs_rows_in_order(chain):
  trained, reference = maxtext_jobs.lanes(chain["trained"], NUM_LANES), maxtext_jobs.lanes(chain["reference"], NUM_LANES)
  assert [len(lane) for lane in trained] == [len(lane) for lane in reference]
  assert trained == reference


def test_no_record_is_trained_twice_or_skipped(chain):
  def records(batches):
    return collections.Counter(r for batch in batches for row in batch for r in row)
  trained, reference = records(chain["trained"]), records(chain["reference"])
  duplicates = sum((trained - reference).values())
  skips = sum((reference - trained).values())
  assert (duplicates, skips) == (0, 0)
  assert sum(trained.values()) > 3 * RECORDS_PER_FILE  # more than one pass over the corpus


def test_the_cli_verifies_a_maxtext_checkpoint_directory_and_proves_every_resume(chain):
  code, text = support.cli_output("verify", str(chain["ckpt_dir"]))
  assert code == 0 and text.startswith("ok:") and "item 'iter'" in text, text
  code, text = support.cli_output("audit", str(chain["ckpt_dir"]), "--json")
  report = json.loads(text)
  assert code == 0, text
  # Each job's restore, at another host count each time, proven by the restore's own rule.
  assert report["proven_exact"] == len(CHAIN) - 1, text
  assert not [f for f in report["findings"] if f["verdict"] != "ok"], text


def test_stock_maxtext_refuses_the_first_host_count_change(tmp_path, corpus):
  settings = _settings(corpus, side="stock", global_batch=12, ckpt_dir=str(tmp_path / "ckpt"))
  maxtext_jobs.run(tmp_path, "stock1", 1, kill=True, **settings)
  results = maxtext_jobs.run(tmp_path, "stock2", 2, kill=True, **settings)
  assert all("refused" in r for r in results)
  assert "The number of stored checkpoint files (1) is incompatible with the number of JAX processes (2)" \
      in results[0]["refused"]
