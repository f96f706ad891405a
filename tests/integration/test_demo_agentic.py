"""`make demo DEMO_ARGS='--learner agentic'` (`python -m demo`), run as a user runs it (four real processes, ~30 s).

The default scenario: batches of 2 prompts (A B, then C D), num_iterations=2,
one group per update, 2 global steps, killed after checkpoint 1 (A's first
update). The ckpt_iter column is deterministic; stock Tunix trains a batch's
groups in rollout completion order, so only its multiset of prompts is fixed.
"""

import os
import re
import subprocess
import sys

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter.tunix import _api

pytestmark = pytest.mark.slow

_REPLAYS = _api.agentic_iteration_order() == _api.AGENTIC_REPLAY_FULL_BATCH
# The uninterrupted run, one label per update: main trains each batch once,
# then replays it; 0.1.7 repeats each group in a row, and its global step takes
# 2 queue items (one prompt's 2 repeats), so 2 steps train A and B only.
_REFERENCE = "A B A B C D C D" if _REPLAYS else "A A B B"


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("demo_agentic") / "run"
  process = subprocess.run(
      [sys.executable, "-m", "demo", "--learner", "agentic", "--dir", str(workdir), "--show-state"],
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=900, check=False,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  )
  assert process.returncode == 0, process.stderr[-4000:]
  return process.stdout


def _phase(out, number):
  match = re.search(rf"^\[{number}/4 [^\]]+\] \.\.\. \d+ s, trained (.*)$", out, re.M)
  assert match, out
  return match.group(1)


def test_phases_trained_what_each_process_should(demo_output):
  assert _phase(demo_output, 1) == _REFERENCE
  assert _phase(demo_output, 2) == "A (then killed)"
  # ckpt_iter picks up right after the killed run's one update.
  assert _phase(demo_output, 4) == _REFERENCE.split(" ", 1)[1]
  order = "main's order" if _REPLAYS else "0.1.7's order"
  assert re.search(rf"^  this Tunix .*\({order}\)\.$", demo_output, re.M)


def test_table_rows_are_exact_for_ckpt_iter_and_stock_skips_the_batch(demo_output):
  expected = _REFERENCE.split()[1:]
  rows = re.findall(r"^ +(\d+)  (\S) {14}(.{40})  (.*?)\s*$", demo_output, re.M)
  assert [int(number) for number, *_ in rows] == list(range(1, len(expected) + 1)), demo_output
  stock_labels = []
  for (_, want, stock, ours), label in zip(rows, expected):
    assert want == label
    assert ours == f"{label}  exact (bit for bit)"
    cell = stock.rstrip()
    if cell == "-  missing":
      continue
    got = cell[0]
    stock_labels.append(got)
    verdict = "same prompt, other values" if got == label else f"wrong input: {label} expected"
    assert cell == f"{got}  {verdict}"
  # Stock restored global_steps=1 and dropped batch 0: it trains batch 1 only
  # (main: C and D, each twice; 0.1.7: one step of 2 queue items, one group).
  if _REPLAYS:
    assert sorted(stock_labels) == ["C", "C", "D", "D"]
  else:
    assert len(stock_labels) == 2 and len(set(stock_labels)) == 1 and stock_labels[0] in "CD"


def test_summary_and_final_weights(demo_output):
  stock = re.search(r"^  stock Tunix  (.*)$", demo_output, re.M).group(1)
  assert stock.startswith("A lost 1 update(s); B skipped")
  assert "  ckpt_iter    every prompt exactly as uninterrupted\n" in demo_output
  weights = demo_output.split("Final actor weights, compared with the uninterrupted run's:\n", 1)[1]
  assert weights.startswith("  stock Tunix  different\n  ckpt_iter    bit for bit the same\n")


def test_every_verdict_word_is_explained_under_the_table(demo_output):
  legend = demo_output.split("each row is one update's input, the letters the prompts it trains on:", 1)[1]
  legend = " ".join(legend.split())
  for word in ("exact (bit for bit):", "same prompt, other values:", "wrong input:", "missing:", "extra:"):
    assert word in legend, word


def test_the_checkpoint_data_state_is_inspected_with_show_state(demo_output):
  assert re.search(r"^  kind +tunix$", demo_output, re.M)
  assert re.search(r"^  counter train_steps +1$", demo_output, re.M)
  assert re.search(r"^  agentic_learner +GRPOLearner$", demo_output, re.M)
