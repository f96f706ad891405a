"""MaxText 0.2.5's SFT trainer with ckpt_iter's base: killed, resumed in a fresh process, bit for bit.

MaxText's `train_sft.py` trains with `MaxTextPeftTrainer`, a Tunix `PeftTrainer`
with a train step of its own; docs/maxtext.md's one-line change makes its base
`ckpt_iter.tunix.ResumablePeftTrainer` (here by the MRO:
`class T(MaxTextPeftTrainer, ResumablePeftTrainer)`). MaxText's entry point
builds a MaxText model, which this tier does not run on CPU, so its trainer
class runs one level below it, with Tunix's toy model
(tests/workers/tunix_sft_worker.py, `--trainer maxtext`): a shuffled two-epoch
Grain pipeline, a real Orbax checkpoint every step, the process ended with
os._exit right after checkpoint 3 and a new process resuming.

Without gradient accumulation: MaxText 0.2.5's train step accumulates through a
Tunix API newer than 0.1.7 (`grad_accumulator`), which this tier installs.

Runs only in `make test-maxtext` (Python 3.12, MaxText and Tunix installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")
pytest.importorskip("tunix", reason="make test-maxtext installs Tunix (requirements/maxtext-sft.txt)")

WORKER = Path(__file__).resolve().parents[1] / "workers" / "tunix_sft_worker.py"
PREEMPT_EXIT_CODE = 42  # tunix_sft_worker.PREEMPT_EXIT_CODE
KILLED_AFTER = 3


def _run(root: Path, name: str, trainer: str, *, preempt_after: int | None = None, expect_rc: int = 0):
  out = root.parent / f"{name}.npz"
  command = [sys.executable, str(WORKER), "--root", str(root), "--out", str(out), "--trainer", trainer,
             "--grad-acc", "1"]
  if preempt_after is not None:
    command += ["--preempt-after", str(preempt_after)]
  process = subprocess.run(command, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                           timeout=600, check=False)
  assert process.returncode == expect_rc, process.stderr[-4000:]
  if expect_rc:
    return None
  with np.load(out) as record:
    params = [record[k] for k in sorted((k for k in record.files if k.startswith("param_")),
                                        key=lambda k: int(k.split("_")[1]))]
    return {"fed": record["fed"], "params": params, "meta": json.loads(str(record["meta"]))}


def _assert_same(got, want):
  np.testing.assert_array_equal(got["fed"], want["fed"])
  assert len(got["params"]) == len(want["params"])
  for index, (a, b) in enumerate(zip(got["params"], want["params"])):
    np.testing.assert_array_equal(a, b, err_msg=f"param leaf {index}")


def test_maxtexts_sft_trainer_on_ckpt_iters_base_trains_as_stock_and_resumes_exactly(tmp_path):
  reference = _run(tmp_path / "reference", "reference", "maxtext")
  _assert_same(reference, _run(tmp_path / "stock", "stock", "maxtext_stock"))  # the same run as MaxText's own

  root = tmp_path / "killed"
  _run(root, "killed", "maxtext", preempt_after=KILLED_AFTER, expect_rc=PREEMPT_EXIT_CODE)
  assert (root / str(KILLED_AFTER) / "data").is_dir(), "the data item is in the model's Orbax step"
  resumed = _run(root, "resumed", "maxtext")
  assert resumed["meta"]["restored_step"] == KILLED_AFTER
  _assert_same(resumed, {"fed": reference["fed"][KILLED_AFTER:], "params": reference["params"]})
  # O(1): what it trained and the content check's one element, nothing replayed.
  assert resumed["meta"]["produced"] == len(resumed["fed"]) + 1
