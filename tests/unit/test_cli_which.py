"""`ckpt-iter which` and `ckpt-iter order` (ckpt_iter/cli/_which.py) on roots written in this process."""

import io
import json
import re
import os

import pyarrow.parquet as pq
import pytest

import ckpt_iter
from ckpt_iter import _files
from ckpt_iter import checkpoint as checkpoint_lib
from ckpt_iter import cli
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter.cli import _which

import support

RECORDS = support.CHAIN_RECORDS
run_chain = support.run_chain

_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1_tunix_roots", "grpo", "root")
SEGMENTS = [(1, 4, 3, 1, None), (2, 6, 2, 0, [(18, 30)]), (1, 5, 3, 0, None)]


@pytest.fixture(name="chain")
def _chain(tmp_path):
  root = str(tmp_path / "run")
  return root, run_chain(root, SEGMENTS)


def _main(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert "Traceback" not in out + err
  return code, out, err


def test_which_step_prints_the_records_of_the_steps_last_batch(chain, capsys):
  root, kept = chain
  for step in range(1, len(kept) + 1):
    code, out, _ = _main(capsys, "which", root, "--step", str(step), "--json")
    assert len(out.strip().splitlines()) == 1, out  # one line per answer (issue 58 item 5), as data_map.md shows
    answer = json.loads(out)
    assert code == 0 and answer["step"] == step and answer["records"] == kept[step - 1]
    assert answer["number"] == step - 1
  code, out, _ = _main(capsys, "which", root, "--step", "5")
  assert code == 0 and "global batch 4 of the run" in out and "restored stream record 12" in out
  assert not [line for line in out.splitlines() if line != line.rstrip()]  # no row ends in spaces (issue 66)


def test_which_batch_numbers_the_run_across_its_resumes_and_skips(chain, capsys):
  root, kept = chain
  stream_records = []
  for number, records in enumerate(kept):
    code, out, _ = _main(capsys, "which", root, "--batch", str(number), "--json")
    answer = json.loads(out)
    assert code == 0 and answer["records"] == records
    stream_records += [row["stream_record"] for row in answer["rows"]]
  assert not set(range(18, 30)) & set(stream_records)  # what the second segment's skip named
  assert stream_records == sorted(stream_records)
  code, _, err = _main(capsys, "which", root, "--batch", str(len(kept)))
  assert code == 1 and f"batch {len(kept)} is not among them" in err


def test_the_stream_ranges_printed_skip_a_batch_at_the_next_restore(chain, capsys):
  root, kept = chain
  code, out, _ = _main(capsys, "which", root, "--batch", str(len(kept) - 1), "--json")
  ranges = [tuple(r) for r in json.loads(out)["stream_records"]]
  # Restore the step before that batch, skipping it: the next batch is another one.
  layout = inspection.find_layout(root)
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(RECORDS, batch_size=5, seed=5, num_epochs=4,
                                                           shard_index=0, shard_count=1, skip=ranges))
  checkpoint_lib.IteratorCheckpointHandler(0, 1).restore(
      os.path.join(layout.item_dir(layout.steps[-2])), ckpt_iter.IteratorRestore(iterator))
  following = [int(v) for v in next(iterator)["id"]]
  assert not set(following) & set(kept[-1])


def test_source_files_add_file_and_line_and_other_files_are_refused(tmp_path, capsys):
  source = tmp_path / "train.jsonl"
  source.write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in range(23)))
  other = tmp_path / "other.jsonl"
  other.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(23)))
  root = str(tmp_path / "run")
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(str(source), batch_size=4, seed=1, num_epochs=1,
                                                           shard_index=0, shard_count=1))
  batch = next(iterator)
  os.makedirs(os.path.join(root, "1", "data"))
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(os.path.join(root, "1", "data"), ckpt_iter.IteratorSave(iterator))
  code, out, _ = _main(capsys, "which", root, "--step", "1", "--source", str(source), "--json")
  rows = json.loads(out)["rows"]
  assert [r["file"] for r in rows] == [f"train.jsonl line {int(i) + 1}" for i in batch["id"]]
  code, out, _ = _main(capsys, "which", root, "--step", "1", "--source", str(source))
  assert f"train.jsonl line {int(batch['id'][0]) + 1}" in out
  code, _, err = _main(capsys, "which", root, "--step", "1", "--source", str(other))
  assert code == 2 and "not the files this run read" in err


def test_order_writes_every_global_batch_in_jsonl_and_parquet(chain, tmp_path, capsys):
  root, kept = chain
  out_jsonl = str(tmp_path / "order.jsonl")
  code, out, err = _main(capsys, "order", root, "--out", out_jsonl)
  assert code == 0 and f"{len(kept)} global batches" in out
  assert f"order: {len(kept)}/{len(kept)} batches" in err  # the counter of a non-terminal stderr
  with open(out_jsonl) as f:
    lines = [json.loads(line) for line in f]
  assert [line["records"] for line in lines] == kept
  assert [line["batch"] for line in lines] == list(range(len(kept)))
  out_parquet = str(tmp_path / "order.parquet")
  assert _main(capsys, "order", root, "--out", out_parquet, "--from", "2", "--limit", "3")[0] == 0
  table = pq.read_table(out_parquet).to_pydict()
  assert table["batch"] == [2, 3, 4] and table["records"] == kept[2:5]


def test_order_past_2_63_refuses_parquet_naming_the_fix_and_writes_jsonl(tmp_path, capsys):
  root = str(tmp_path / "run")
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(RECORDS, batch_size=2, seed=None, num_epochs=None,
                                                           shard_index=0, shard_count=1, skip=[(2, 2**63 + 2)]))
  for step in range(1, 4):
    next(iterator)
    item = os.path.join(root, str(step), "data")
    os.makedirs(item)
    checkpoint_lib.IteratorCheckpointHandler(0, 1).save(item, ckpt_iter.IteratorSave(iterator))
  out_parquet = str(tmp_path / "order.parquet")
  code, _, err = _main(capsys, "order", root, "--out", out_parquet)
  assert code != 0 and not os.path.exists(out_parquet)
  assert f"batch 1's stream_start holds {2**63 + 2}, past {2**63 - 1}" in err
  assert "Write --out FILE.jsonl instead" in err
  out_jsonl = str(tmp_path / "order.jsonl")
  assert _main(capsys, "order", root, "--out", out_jsonl)[0] == 0
  with open(out_jsonl) as f:
    assert [json.loads(line)["stream_records"] for line in f] == [[0, 2], [2**63 + 2, 2**63 + 4], [2**63 + 4, 2**63 + 6]]


def test_the_progress_bar_draws_on_a_terminal():
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  stream = Terminal()
  progress = _which.Progress(total=4, stream=stream, use_tqdm=False)
  for done in range(1, 5):
    progress.update(done)
  text = stream.getvalue()
  assert "[" + "#" * 30 + "] 4/4 batches, " in text and text.endswith(" left\n")
  assert re.search(r"4/4 batches, [\d,]+ batches/s, 0:00:00 left\n$", text)


def test_the_progress_bar_on_a_terminal_is_tqdm_where_it_is_installed():
  """Tunix, Grain and Hugging Face installs bring tqdm; the lowest-versions venv may not."""
  pytest.importorskip("tqdm")

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  stream = Terminal()
  progress = _which.Progress(total=4, stream=stream)
  for done in range(1, 5):
    progress.update(done)
  assert re.search(r"order: 100%.*4/4 \[.*batch/s\]", stream.getvalue().splitlines()[-1].split("\r")[-1])


def test_the_progress_line_in_a_log_says_the_rate_and_time_left():
  stream = io.StringIO()
  progress = _which.Progress(total=4, stream=stream, every=2)
  for done in range(1, 5):
    progress.update(done)
  lines = stream.getvalue().splitlines()
  assert [line.split(",")[0] for line in lines] == ["order: 2/4 batches", "order: 4/4 batches"]
  assert lines[-1].endswith("0:00:00 left")


def test_which_of_a_tunix_root_names_the_global_step_and_each_repeat(capsys):
  code, out, _ = _main(capsys, "which", _FIXTURE, "--step", "3")
  assert code == 0 and "the prompts of global step 1" in out
  assert "repeat 1 of 2: update 3: trained before the checkpoint" in out
  assert "repeat 2 of 2: update 4: pending" in out
  code, out, _ = _main(capsys, "which", _FIXTURE, "--step", "4", "--json")
  answer = json.loads(out)
  assert answer["records"] == [1] and answer["global_step"]["updates"] == [3, 4] and answer["number"] == 1


def test_a_lanes_root_names_the_python_api(tmp_path, capsys):
  root = str(tmp_path / "lanes")
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(
      RECORDS, batch_size=2, seed=1, num_epochs=None, shard_index=0, shard_count=1,
      filter=lambda r: r["id"] % 2 == 0, chunk_size=4, num_lanes=2))
  next(iterator)
  os.makedirs(os.path.join(root, "1", "data"))
  checkpoint_lib.IteratorCheckpointHandler(0, 1).save(os.path.join(root, "1", "data"), ckpt_iter.IteratorSave(iterator))
  for verb in (["which", root, "--step", "1"], ["order", root, "--out", str(tmp_path / "o.jsonl")]):
    code, _, err = _main(capsys, *verb)
    assert code == 1 and "ckpt_iter.which(pipeline, state)" in err and "filtered or packed" in err


def test_order_answers_from_the_lineage_when_a_resumed_step_is_gone(chain, tmp_path, capsys):
  # Issue 47 (9): each resume records where its segment started; max_to_keep deleting the step
  # a run resumed from no longer stops `order` or `which --batch`.
  root, kept = chain
  os.rename(os.path.join(root, "3"), os.path.join(root, "3.orbax-checkpoint-tmp-9"))
  code, _, err = _main(capsys, "order", root, "--out", str(tmp_path / "o.jsonl"))
  assert code == 0, err
  with open(tmp_path / "o.jsonl") as f:
    assert [json.loads(line)["records"] for line in f] == kept


def test_order_answers_a_mixture_from_the_lineage_and_names_the_keep_policy_for_an_older_state(tmp_path, capsys):
  root = str(tmp_path / "run")
  kept = run_chain(root, [(1, 4, 2, 0, None), (1, 4, 2, 0, None)], mixture={"a": 1, "b": 1})
  os.rename(os.path.join(root, "2"), os.path.join(root, "2.orbax-checkpoint-tmp-9"))
  code, _, err = _main(capsys, "order", root, "--out", str(tmp_path / "o.jsonl"))
  assert code == 0, err
  with open(tmp_path / "o.jsonl") as f:
    rows = [json.loads(line) for line in f]
  offset = {"a": 1000, "b": 2000}
  assert [[offset[s] + i for i, s in zip(r["records"], r["sources"])] for r in rows] == kept
  # A state written before resume records carried the segment: the step is needed, and named.
  last = os.path.join(root, "4", "data", "process_0-of-1.json")
  header = json.loads(json.dumps(_files.read_header(last)))  # whole, as 0.2.0 wrote it
  header["lineage"]["recent"] = [{"step": e["step"], "state": e["state"]} for e in header["lineage"]["recent"]]
  with open(last, "w") as f:
    json.dump(header, f)
  code, _, err = _main(capsys, "order", root, "--out", str(tmp_path / "o2.jsonl"))
  assert code == 1 and "step 2, which is no longer kept" in err and "max_to_keep" in err
  assert "KeepResumedSteps" in err and "mixture's ledger" in err
  assert not os.path.exists(tmp_path / "o2.jsonl")


def test_a_pipeline_not_built_by_make_dataset_is_refused_naming_it(capsys):
  root = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1_tunix_roots", "sft", "root")
  code, _, err = _main(capsys, "which", root, "--step", "3")
  assert code == 1 and "not written by a ckpt_iter.make_dataset pipeline" in err and "RepeatMapDataset" in err
