"""`ckpt-iter audit` on real Tunix checkpoint roots: toy GRPO runs killed and resumed in fresh processes.

A Resumable GRPO chain (num_iterations=2, shuffled repeats) killed after
step 1 and after step 3 (between the two updates of a rollout, pending
repeats in the checkpoint) must audit as an unbroken chain with both resumes
proven; the same root with one step's data item replaced by another step's
must not; a root stock Tunix wrote and resumed has no data state to prove.
"""

import json
import os
import shutil

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix chains: `make test-heavy` (CI) and `make test-tunix-main` run them;
# make test audits real killed chains in test_crash.py and on gs://.
pytestmark = pytest.mark.heavy

from ckpt_iter import cli
import tunix_harness as harness

CONFIG = {"num_iterations": 2, "max_steps": 5, "data_shuffle_seed": 3}


def _audit(capsys, *argv):
  code = cli.main(["audit", *argv])
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, out


def test_audit_proves_a_preempted_grpo_chain_and_catches_a_swapped_item(tmp_path, jax_cache, capsys):
  segments, inputs = harness.chain(dict(CONFIG, learner="ckpt_iter"), str(tmp_path), [1, 3], jax_cache)
  assert [s.meta["restored_step"] for s in segments] == [0, 1, 3]
  # The run trained distinguishable prompts (not one repeated input): the
  # positions the audit checks moved.
  assert len({x["prompt_ids"].tobytes() for x in inputs}) >= 3
  root = os.path.join(str(tmp_path), "chain")
  plot = tmp_path / "timeline.png"
  code, out = _audit(capsys, root, "--json", "--plot", str(plot))
  report = json.loads(out)
  assert code == 0 and report["verdict"] == "ok", report["findings"]
  resumes = [f for f in report["findings"] if f["resumed_from"] is not None]
  assert [(f["resumed_from"], f["verdict"]) for f in resumes] == [(1, "ok"), (3, "ok")]
  assert "pending" in resumes[1]["message"]  # step 3 is inside a repeat
  progress = [p["progress"] for p in report["points"]]
  assert progress == sorted(progress) and progress[-1] > progress[0]
  # One run from the first save (step 1) on, across both resumes.
  assert [p["run"] for p in report["points"]] == [1] * len(report["points"])
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  # Step 4's data item replaced by step 2's (a bad copy): the audit names step 4.
  actor = os.path.join(root, "actor")
  shutil.rmtree(os.path.join(actor, "4", "data"))
  shutil.copytree(os.path.join(actor, "2", "data"), os.path.join(actor, "4", "data"))
  code, out = _audit(capsys, root)
  assert code == 1, out
  assert "broken: process 0: step 4: the data state was saved in step 2 but is stored in step 4" in out
  assert out.strip().splitlines()[-1].startswith("broken chain")


def test_audit_has_nothing_to_prove_in_a_root_stock_tunix_resumed(tmp_path, jax_cache, capsys):
  harness.chain(dict(CONFIG, learner="stock", max_steps=3), str(tmp_path), [1], jax_cache)
  code, out = _audit(capsys, os.path.join(str(tmp_path), "chain"))
  assert code == 4, out  # nothing to prove: no step holds a data state
  assert "unprovable: process 0: step 1: no data state in item 'data'" in out
  assert out.strip().splitlines()[-1].startswith("nothing to prove: 0 state(s)")
