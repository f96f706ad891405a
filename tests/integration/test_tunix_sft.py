"""Exact resume of Tunix's SFT trainer (ResumablePeftTrainer), in real killed processes.

Each run is a fresh process (tests/workers/tunix_sft_worker.py): Tunix's toy
model, a shuffled two-epoch Grain pipeline, gradient accumulation 2, a real
Orbax checkpoint every optimizer update. A run killed with os._exit right
after checkpoint k and resumed in a new process must give the train step
exactly the micro-batches the uninterrupted run gives it after k, and end
with bit-identical params, without re-reading any input element.
"""


import json

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
# Real Tunix runs beyond make test's representative ones: `make test-heavy` (CI) runs them.
pytestmark = pytest.mark.heavy

import tunix_harness as harness  # noqa: E402

from ckpt_iter import cli  # noqa: E402

_PREEMPT_EXIT_CODE = harness.SFT_PREEMPT_EXIT_CODE
_GRAD_ACC = 2
_MAX_STEPS = 8
# A resume's content check produces the example before the saved position once
# more (O(1), whatever the position), to compare it with the saved digest.
CONTENT_CHECK_READS = 1


def _run(root, out, jax_cache, **kwargs):
  return harness.run_sft(root, out, jax_cache, **kwargs)


def _labels(fed):
  """One label per micro-batch: its first token identifies the source element."""
  return [int(batch[0, 0]) for batch in fed]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("sft")


@pytest.fixture(scope="module")
def reference(workdir, jax_cache):
  """The uninterrupted ResumablePeftTrainer run."""
  return _run(workdir / "reference", workdir / "reference.npz", jax_cache)


def _assert_resumed_equals(resumed_fed, resumed_params, reference, k):
  expected = reference["fed"][k * _GRAD_ACC:]
  assert _labels(resumed_fed) == _labels(expected), (
      f"after checkpoint {k}: trained {_labels(resumed_fed)}, expected {_labels(expected)}"
  )
  np.testing.assert_array_equal(resumed_fed, expected)
  assert len(resumed_params) == len(reference["params"])
  for index, (got, want) in enumerate(zip(resumed_params, reference["params"])):
    np.testing.assert_array_equal(got, want, err_msg=f"param leaf {index} after resume from {k}")


def test_uninterrupted_matches_stock(reference, workdir, jax_cache):
  stock = _run(workdir / "stock_reference", workdir / "stock_reference.npz", jax_cache, trainer="stock")
  assert reference["fed"].shape[0] == _MAX_STEPS * _GRAD_ACC
  np.testing.assert_array_equal(reference["fed"], stock["fed"])
  for got, want in zip(reference["params"], stock["params"]):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_killed_after_checkpoint_k_resumes_exactly_in_o1(reference, workdir, jax_cache, k):
  root = workdir / f"kill_{k}"
  _run(root, workdir / f"kill_{k}.npz", jax_cache, preempt_after=k, expect_rc=_PREEMPT_EXIT_CODE)
  assert (root / str(k) / "data").is_dir(), "the data item is in the model's Orbax step"
  resumed = _run(root, workdir / f"resumed_{k}.npz", jax_cache)
  assert resumed["meta"]["restored_step"] == k
  _assert_resumed_equals(resumed["fed"], resumed["params"], reference, k)
  # O(1): the resumed pipeline produced what it trained and the content check's
  # one element, nothing replayed.
  assert resumed["meta"]["produced"] == len(resumed["fed"]) + CONTENT_CHECK_READS


def test_chained_resumes(reference, workdir, jax_cache, capsys):
  root = workdir / "chain"
  _run(root, workdir / "chain_a.npz", jax_cache, preempt_after=2, expect_rc=_PREEMPT_EXIT_CODE)
  # The second process records what it trains before it is killed after step 5.
  _run(root, workdir / "chain_b.npz", jax_cache, preempt_after=5, expect_rc=_PREEMPT_EXIT_CODE)
  last = _run(root, workdir / "chain_c.npz", jax_cache)
  assert last["meta"]["restored_step"] == 5
  _assert_resumed_equals(last["fed"], last["params"], reference, 5)
  # The audit proves both resumes, all in the one run named by its first save.
  assert cli.main(["audit", str(root), "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert [(f["resumed_from"], f["verdict"]) for f in report["findings"]] == [(2, "ok"), (5, "ok")]
  assert {p["run"] for p in report["points"]} == {1}


@pytest.mark.slow
def test_stock_resume_is_exact_but_replays_the_input(reference, workdir, jax_cache):
  """The same scenario with stock PeftTrainer: right examples, O(position) reads."""
  k = 3
  root = workdir / "stock_kill"
  _run(root, workdir / "stock_kill.npz", jax_cache, trainer="stock", preempt_after=k,
       expect_rc=_PREEMPT_EXIT_CODE)
  resumed = _run(root, workdir / "stock_resumed.npz", jax_cache, trainer="stock")
  _assert_resumed_equals(resumed["fed"], resumed["params"], reference, k)
  # It re-reads the k * grad_acc micro-batches it skips (and, through Grain's
  # default prefetching iterator, reads ahead besides).
  assert resumed["meta"]["produced"] >= len(resumed["fed"]) + k * _GRAD_ACC


@pytest.mark.slow
def test_resuming_a_stock_checkpoint_skips_as_stock_does(reference, workdir, jax_cache):
  """A checkpoint without a data item (stock Tunix wrote it) is resumed the stock way."""
  k = 3
  root = workdir / "legacy"
  _run(root, workdir / "legacy_kill.npz", jax_cache, trainer="stock", preempt_after=k,
       expect_rc=_PREEMPT_EXIT_CODE)
  resumed = _run(root, workdir / "legacy_resumed.npz", jax_cache)
  _assert_resumed_equals(resumed["fed"], resumed["params"], reference, k)
  # Skipped in O(1) all the same: the input is a MapDataset.
  assert resumed["meta"]["produced"] == len(resumed["fed"])


def test_switching_a_stock_run_batched_after_to_iter_dataset_trains_what_stock_trains(workdir, jax_cache):
  """Issue 31, case 1: a stock PeftTrainer run on rows batched after `to_iter_dataset()`,
  preempted after step 2 and restarted with the drop-in, trains the batches stock's own
  resume trains (it used to seek Grain's row index to a batch count: R02 R03 twice)."""
  k, form = 2, {"input_form": "iter_batched"}
  runs = {}
  for restarted_with in ("stock", "resumable"):
    root = workdir / f"switch_to_{restarted_with}"
    _run(root, workdir / f"switch_kill_{restarted_with}.npz", jax_cache, trainer="stock",
         preempt_after=k, expect_rc=_PREEMPT_EXIT_CODE, **form)
    runs[restarted_with] = _run(root, workdir / f"switch_{restarted_with}.npz", jax_cache,
                                trainer=restarted_with, **form)
  stock, ours = runs["stock"], runs["resumable"]
  assert len(set(_labels(stock["fed"]))) > 1, "the batches must be distinguishable"
  assert _labels(ours["fed"]) == _labels(stock["fed"])
  np.testing.assert_array_equal(ours["fed"], stock["fed"])
  for got, want in zip(ours["params"], stock["params"]):
    np.testing.assert_array_equal(got, want)


def test_resume_into_another_pipeline_names_the_field(workdir, jax_cache):
  root = workdir / "drift"
  _run(root, workdir / "drift.npz", jax_cache, preempt_after=1, expect_rc=_PREEMPT_EXIT_CODE)
  stderr = _run(root, workdir / "drift_resumed.npz", jax_cache, expect_rc=1, seed=4)
  assert "ConfigDriftError" in stderr and "seed" in stderr, stderr[-2000:]


def test_a_changed_vocabulary_behind_an_unchanged_pipeline_is_refused_naming_the_field(workdir, jax_cache):
  """The SFT content check: the state records the digest of the example trained last,
  which the resume produces again; a tokenizer file that changed since is refused."""
  root, vocabulary = workdir / "vocabulary", workdir / "vocabulary.json"
  vocabulary.write_text("0")
  _run(root, workdir / "vocabulary.npz", jax_cache, preempt_after=2, expect_rc=_PREEMPT_EXIT_CODE,
       vocabulary_file=vocabulary)
  vocabulary.write_text("5")
  stderr = _run(root, workdir / "vocabulary_resumed.npz", jax_cache, expect_rc=1, vocabulary_file=vocabulary)
  assert "ContentDriftError" in stderr and "field 'input_tokens'" in stderr, stderr[-2000:]
  vocabulary.write_text("0")  # put back: the same run resumes, its check passing
  resumed = _run(root, workdir / "vocabulary_back.npz", jax_cache, vocabulary_file=vocabulary)
  assert resumed["meta"]["restored_step"] == 2


def test_one_more_epoch_after_the_data_ran_out_continues_like_stock(workdir, jax_cache):
  """A run that ended by exhausting repeat(1), restarted with repeat(2), trains epoch 2 as stock does.

  The trainer's own fields are compared strictly; the input's change is left
  to DataIterator's rule, which accepts more epochs of the same stream.
  """
  results = {}
  for trainer in ("resumable", "stock"):
    root = workdir / f"more_epochs_{trainer}"
    first = _run(root, workdir / f"epoch1_{trainer}.npz", jax_cache, trainer=trainer, epochs=1, max_steps=100)
    assert first["meta"]["train_steps"] == 5  # 10 batches, gradient accumulation 2: the data ran out
    second = _run(root, workdir / f"epoch2_{trainer}.npz", jax_cache, trainer=trainer, epochs=2, max_steps=100)
    assert second["meta"]["restored_step"] == 5 and second["meta"]["train_steps"] == 10
    results[trainer] = (first, second)
  (ours_1, ours_2), (stock_1, stock_2) = results["resumable"], results["stock"]
  np.testing.assert_array_equal(ours_1["fed"], stock_1["fed"])
  assert len(ours_2["fed"]) == 10, _labels(ours_2["fed"])
  np.testing.assert_array_equal(ours_2["fed"], stock_2["fed"])
  for got, want in zip(ours_2["params"], stock_2["params"]):
    np.testing.assert_array_equal(got, want)
  # O(1): stock re-reads the 10 batches of epoch 1 to skip them; the drop-in reads none.
  assert ours_2["meta"]["produced"] == 10 and stock_2["meta"]["produced"] == 20, (
      ours_2["meta"], stock_2["meta"])
