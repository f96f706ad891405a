"""MaxText without packing: its own rows, bit for bit, and a mixture changed between SIGKILLed restarts.

With `packing: false` (what MaxText's own elastic iterator requires), each
record is one row, made by MaxText's `pretrain_preprocessing_pipeline`: an
epoch through ckpt_iter holds exactly the rows MaxText's own iterator yields
(order aside: ckpt_iter's is one global order). A chain of real jobs then
changes the host count 1 -> 2 -> 4 -> 3 -> 1, the global batch (24 at 4
hosts), the mixture's weights (`a,1;b,1` -> `a,1;b,3`) and adds a source
(`;c,2`), each job SIGKILLed after an unsaved step: every source's records are
trained in its own order, each once, none passed over (each source continues
at its own next record).

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
from ckpt_iter.maxtext import source_name  # pylint: disable=g-import-not-at-top,wrong-import-position

SOURCES = {"a": [range(0, 100), range(100, 200)], "b": [range(1000, 1150)], "c": [range(2000, 2100)]}
STEPS = 2


def _source_of(record: int) -> str:
  return next(name for name, files in SOURCES.items() if any(record in ids for ids in files))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  directory = tmp_path_factory.mktemp("mixture_corpus")
  for name, files in SOURCES.items():
    for number, ids in enumerate(files):
      maxtext_jobs.write_parquet(directory / f"{name}-{number}.parquet", ids)
  return directory


def _mixture(corpus: Path, **weights: int) -> str:
  return ";".join(f"{corpus}/{name}-*.parquet,{weight}" for name, weight in weights.items())


def test_an_epoch_holds_maxtexts_own_rows_bit_for_bit(tmp_path, corpus):
  settings = dict(files=str(corpus / "b-*.parquet"), packing=False, global_batch=10, steps=14)
  maxtext_jobs.run(tmp_path, "ours", 1, kill=False, side="ckpt_iter", ckpt_dir=str(tmp_path / "a"),
                   dump_rows=True, **settings)
  maxtext_jobs.run(tmp_path, "stock", 1, kill=False, side="stock", ckpt_dir=str(tmp_path / "b"),
                   dump_rows=True, **settings)
  ours, stock = (maxtext_jobs.row_bytes(tmp_path, name) for name in ("ours", "stock"))
  assert len(ours) == len(stock) == 150
  assert collections.Counter(ours) == collections.Counter(stock)


# (processes, global batch, mixture weights) of each job; each saves STEPS steps, the last is not killed.
CHAIN = ((1, 12, dict(a=1, b=1)), (2, 12, dict(a=1, b=1)), (4, 24, dict(a=1, b=3)), (3, 12, dict(a=1, b=3, c=2)),
         (1, 12, dict(a=1, b=3, c=2)))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, corpus):
  directory = tmp_path_factory.mktemp("mixture_chain")
  trained, resumed = [], []
  for number, (processes, global_batch, weights) in enumerate(CHAIN):
    killed = number < len(CHAIN) - 1
    results = maxtext_jobs.run(
        directory, f"job{number}", processes, kill=killed, side="ckpt_iter", packing=False, steps=STEPS,
        files=_mixture(corpus, **weights), global_batch=global_batch, ckpt_dir=str(directory / "ckpt"))
    resumed.append(results[0]["resumed_from"])
    trained.extend(maxtext_jobs.trained(directory, f"job{number}", processes, killed=killed))
  # Each source's own order: the uninterrupted runs of the first and the last mixture read far enough.
  orders = {}
  for name, weights, steps in (("first", CHAIN[0][2], 16), ("last", CHAIN[-1][2], 8)):
    maxtext_jobs.run(directory, name, 1, kill=False, side="ckpt_iter", packing=False, steps=steps,
                     files=_mixture(corpus, **weights), global_batch=12, ckpt_dir=str(directory / name))
    orders[name] = _by_source(maxtext_jobs.trained(directory, name, 1, killed=False))
  return {"trained": _by_source(trained), "resumed": resumed, "batches": trained, "ckpt_dir": directory / "ckpt",
          "orders": {"a": orders["first"]["a"], "b": orders["first"]["b"], "c": orders["last"]["c"]}}


def _by_source(batches) -> dict[str, list[int]]:
  by_source = collections.defaultdict(list)
  for batch in batches:
    for row in batch:
      assert len(row) == 1  # one record per row without packing
      by_source[_source_of(row[0])].append(row[0])
  return by_source


def test_every_job_resumes_from_the_step_its_predecessor_saved_last(chain):
  assert chain["resumed"] == [None, 1, 3, 5, 7]


def test_each_source_continues_at_its_own_next_record_through_every_change(chain):
  for name in SOURCES:
    trained, order = chain["trained"][name], chain["orders"][name]
    assert len(trained) <= len(order), name
    assert trained == order[:len(trained)], name  # in its order: no record twice, none passed over


def test_the_changes_took_effect(chain):
  counts = {name: len(records) for name, records in chain["trained"].items()}
  # 48 rows at 1:1, 48 at 1:3, 60 at 1:3:2 (the last job trains its unsaved step too).
  assert counts == {"a": 24 + 12 + 10, "b": 24 + 36 + 30, "c": 20}


def test_ckpt_iter_order_on_the_maxtext_checkpoint_directory_names_the_records_trained(chain, corpus, tmp_path):
  """`ckpt-iter order` answers from the saved states alone, with the restore's own rules: every saved step's
  batch, each record as (source, index in it), is the batch the jobs trained (decoded from their rows)."""
  out = tmp_path / "order.jsonl"
  code, text = support.cli_output("order", str(chain["ckpt_dir"]), "--out", str(out))
  assert code == 0, text
  first_id = {"a": 0, "b": 1000, "c": 2000}  # each source's files hold consecutive ids from these
  answered = []
  for line in out.read_text().splitlines():
    entry = json.loads(line)
    names = [next(n for n in first_id if source_name(f"{corpus}/{n}-*.parquet") == source) for source in entry["sources"]]
    answered.append([first_id[n] + r for n, r in zip(names, entry["records"])])
  trained = [[row[0] for row in batch] for batch in chain["batches"]]
  assert len(answered) == 10  # the saved steps 0-9 (the last job's last step was trained, not saved)
  assert answered == trained[:len(answered)]


# ---------------------------------------------------------------------------
# The same chain packed (`packing: true`): lanes read chunks at different stream records, so the new
# weights take effect after the furthest chunk any lane reached (ckpt_iter/_lane_mixture.py).

NUM_LANES = 12


@pytest.fixture(scope="module")
def packed_chain(tmp_path_factory, corpus):
  directory = tmp_path_factory.mktemp("packed_mixture_chain")
  trained, resumed = [], []
  for number, (processes, global_batch, weights) in enumerate(CHAIN):
    killed = number < len(CHAIN) - 1
    results = maxtext_jobs.run(
        directory, f"job{number}", processes, kill=killed, side="ckpt_iter", packing=True, steps=STEPS,
        files=_mixture(corpus, **weights), global_batch=global_batch, ckpt_dir=str(directory / "ckpt"),
        num_lanes=NUM_LANES, chunk_size=8)
    resumed.append(results[0]["resumed_from"])
    trained.extend(maxtext_jobs.trained(directory, f"job{number}", processes, killed=killed))
  return {"trained": trained, "resumed": resumed, "ckpt_dir": directory / "ckpt", "directory": directory}


def _uninterrupted_lanes(corpus: Path, directory: Path, state, rows_per_lane: int) -> list[list[list[int]]]:
  """Each lane's rows, decoded to records, in a one-process run from the start under the shares `state`
  records: built here from MaxText's config as the workers build it, its rows decoded as theirs."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import maxtext_worker  # pylint: disable=g-import-not-at-top
  from maxtext.input_pipeline import data_processing_utils  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _lane_mixture, _records, maxtext  # pylint: disable=g-import-not-at-top

  config = maxtext_worker.maxtext_config(dict(files=_mixture(corpus, **CHAIN[-1][2]), global_batch=NUM_LANES,
                                              num_processes=1, out_dir=str(directory / "out")))
  tokenizer, _ = data_processing_utils.get_tokenizer_and_pad_id(config)
  rows = iter(maxtext.train_dataset(config, shard_index=0, shard_count=1, num_lanes=NUM_LANES, chunk_size=8))
  schedule = _lane_mixture.of(_records.shares_of(state.fingerprint), state.position, origin="the last state")
  rows.set_state({_records.FIRST_LANE: 0, _records.LANES: [[0, 0]] * NUM_LANES,
                  _lane_mixture.MIXTURE: schedule.to_json()})
  lanes: list[list[list[int]]] = [[] for _ in range(NUM_LANES)]
  for _ in range(rows_per_lane):
    batch = next(rows)
    for lane, (tokens, segment_ids) in enumerate(zip(np.asarray(batch["inputs"]),
                                                      np.asarray(batch["inputs_segmentation"]))):
      lanes[lane].append([int(maxtext_worker.RECORD.search(tokenizer.decode(
          [int(t) for t in tokens[segment_ids == s]])).group(1)) for s in sorted(set(segment_ids.tolist()) - {0})])
  return lanes


def test_a_packed_mixture_reweighted_and_grown_across_host_counts_trains_each_lanes_rows_once(packed_chain, corpus):
  """Stock MaxText refuses this chain's first host change; with ckpt_iter every job resumes where its
  predecessor saved, no record is trained twice, and every lane's rows are a one-process run's under the
  shares the last step records (read before each change as mixed then, none passed over)."""
  from ckpt_iter import _item  # pylint: disable=g-import-not-at-top

  assert packed_chain["resumed"] == [None, 1, 3, 5, 7]
  trained = packed_chain["trained"]
  counts = collections.Counter(r for batch in trained for row in batch for r in row)
  # A record twice only in another pass over its source (each source is read epoch after epoch).
  sizes = {name: sum(len(ids) for ids in files) for name, files in SOURCES.items()}
  per_source = collections.Counter()
  for record, times in counts.items():
    per_source[_source_of(record)] += times
  assert all(times <= -(-per_source[_source_of(r)] // sizes[_source_of(r)]) for r, times in counts.items())
  last_step = 9  # the saved steps 0-9; the last job's last step was trained, not saved
  state = _item.read_item(str(packed_chain["ckpt_dir"] / str(last_step) / "iter"), 0, CHAIN[-1][0]).value
  lanes = maxtext_jobs.lanes(trained[:last_step + 1], NUM_LANES)
  assert lanes == _uninterrupted_lanes(corpus, packed_chain["directory"], state, len(lanes[0]))
  # The changes took effect: c joined, and b's part grew.
  by_source = collections.Counter(_source_of(r) for r in counts)
  assert by_source["c"] > 0 and by_source["b"] > by_source["a"]


def test_ckpt_iter_verify_and_audit_on_the_packed_mixture_checkpoint_directory(packed_chain):
  code, text = support.cli_output("verify", str(packed_chain["ckpt_dir"]))
  assert code == 0 and text.startswith("ok:"), text
  code, text = support.cli_output("audit", str(packed_chain["ckpt_dir"]), "--json")
  assert code == 0, text
  report = json.loads(text)
  assert report["proven_exact"] == len(CHAIN) - 1, text
