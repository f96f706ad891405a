"""A Tunix GRPO run on 2 JAX processes resumes exactly, mid-repeat included.

Each job is 2 real processes (tests/workers/tunix_multihost_worker.py) joining a
`jax.distributed` job on 127.0.0.1 with the CPU backend, training
ResumableGRPOLearner (num_iterations=2, one prompt per batch, the same
batches on both processes, one mesh over both processes' devices,
sgd with momentum) with a checkpoint after every update. An uninterrupted
reference run of MAX_STEPS updates is compared with a chain of fresh jobs on
one checkpoint root: preempted right after checkpoint 1 (between the two
updates on the first rollout), resumed and preempted right after checkpoint
3 (between the two updates on the second), resumed to the end. Compared per
process, bit for bit: every trainer input (each array field of the
TrainExample, and whether it is a global array, with its spec), the actor
params before and after every update and the optimizer state before it.

Two things make it exact (see docs/multihost.md): pending TrainExample
leaves that were global arrays are restored as global arrays with the same
sharding, and the restored params / optimizer state get back the shardings
they had at save time. Without either, the first update after the resume
already differs.

Both Tunix versions: `make test-full` runs it on 0.1.7, `make test-tunix-main`
on main (0.1.8), where Tunix saves through Orbax v1 and the saved shardings
are read from v1's metadata (`tunix._shardings.read_saved_layouts`)."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import ckpt_iter
from ckpt_iter import testing
from demo import toyrun
import process_group  # pylint: disable=g-import-not-at-top,wrong-import-position

WORKER = Path(__file__).resolve().parent.parent / "workers" / "tunix_multihost_worker.py"
NUM_PROCESSES = 2
MAX_STEPS = 6  # three rollouts, each trained twice
PREEMPT_STEPS = (1, 3)  # both in the middle of a repeat (num_iterations=2)
# The four 2-process Tunix jobs take ~2 minutes on 2 cores: `make test-full`
# runs them. `make test` keeps the in-process tests below and, for the
# guarantees, the 2-process runs of test_multihost.py and the one-process
# Tunix chains of test_tunix_resume.py.
_JOBS = pytest.mark.slow
RUN_TIMEOUT_SECONDS = 300
# The trainer-input fields Tunix hands over as mesh-wide replicated arrays:
# 0.1.7 computes both log-probs on the mesh; main (0.1.8) takes the old ones
# from the sampler, process-local.
GLOBAL_FIELDS = (("ref_per_token_logps",) if toyrun.sampler_logprobs_needed()
                 else ("old_per_token_logps", "ref_per_token_logps"))


def _launch(directory: Path, name: str, root: Path, preempt_after: int | None, **extra) -> list[dict]:
  """Runs one 2-process job to its end (or its preemption); returns each process's record."""
  config = {"root": str(root), "preempt_after": preempt_after, "max_steps": MAX_STEPS, **extra}
  return process_group.run_group(
      WORKER, directory, name, [config] * NUM_PROCESSES, timeout_seconds=RUN_TIMEOUT_SECONDS,
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  steps = PREEMPT_STEPS
  directory = tmp_path_factory.mktemp("tunix_multihost")
  reference = _launch(directory, "reference", directory / "reference_root", None)
  chain_root = directory / "chain_root"
  jobs = {}
  for start, preempt in zip((0,) + steps, steps + (None,)):
    jobs[start] = _launch(directory, f"from{start}", chain_root, preempt)
  return {"reference": reference, "jobs": jobs, "chain_root": chain_root, "preempt_steps": steps}


def _by_step(results: dict) -> dict[int, dict]:
  return {record["train_step"]: record for record in results["inputs"]}


@_JOBS
def test_reference_trainer_inputs_mix_global_and_local_arrays(runs):
  # The situation the exact resume has to reproduce: Tunix hands the trainer
  # the log-probs as mesh-wide replicated arrays and the rest process-local.
  reference = runs["reference"]
  for index, result in enumerate(reference):
    assert result["process_index"] == index and result["restored_step"] == 0
    assert sorted(_by_step(result)) == list(range(MAX_STEPS))
    for record in result["inputs"]:
      for name, layout in record["layout"].items():
        if name in GLOBAL_FIELDS:
          assert layout == {"kind": "global", "spec": "P()", "replicated": True}, name
        else:
          assert layout == {"kind": "local"}, name
  # Both processes feed the same batches; each rollout is trained twice in a row.
  first, second = ([r["prompt_ids"] for r in result["inputs"]] for result in reference)
  assert first == second
  assert first[0] == first[1] != first[2] == first[3] != first[4] == first[5]


@_JOBS
@pytest.mark.parametrize("step", PREEMPT_STEPS)
def test_checkpoint_keeps_the_global_pending_leaves_global(runs, step):
  data_dir = runs["chain_root"] / "actor" / str(step) / "data"
  for index in range(NUM_PROCESSES):
    header = json.loads((data_dir / f"process_{index}-of-{NUM_PROCESSES}.json").read_text())
    assert header["pending"]["schedule"] == [0]  # the rollout's second update
    (group,) = header["pending"]["groups"]
    assert group["members"] == [[0, 1]]
    fields = group["structure"]["fields"]
    for name in GLOBAL_FIELDS:
      assert fields[name]["dataclass"] == "ckpt_iter.tunix.GlobalArray", name
      assert group["columns"][fields[name]["fields"]["mesh_role"]["column"]] == ["actor"]
      assert fields[name]["fields"]["spec"] == {"tuple": []}
    for name in ("prompt_ids", "completion_ids", "advantages"):
      assert set(fields[name]) == {"array"}, name  # process-local: stored as before
  # Both processes hold the same arrays: the pod writes them once, process 1's
  # header names process 0's npz and the SHA-256 both computed.
  headers = [json.loads((data_dir / f"process_{i}-of-{NUM_PROCESSES}.json").read_text()) for i in range(NUM_PROCESSES)]
  assert sorted(p.name for p in data_dir.glob("*.npz")) == [f"process_0-of-{NUM_PROCESSES}.npz"]
  assert "arrays_from" not in headers[0] and headers[1]["arrays_from"] == 0
  assert headers[0]["arrays_sha256"] == headers[1]["arrays_sha256"]
  # So are the fingerprints and lineage they share (one exchange for both digests): in the count file.
  assert headers[0]["pod_sha256"] == headers[1]["pod_sha256"]
  assert headers[1]["position"]["input"]["fingerprint"] == {"shard_index": 0}
  assert json.loads((data_dir / "ckpt_iter.json").read_text())["pod_sha256"] == headers[0]["pod_sha256"]


@_JOBS
@pytest.mark.parametrize("step", PREEMPT_STEPS)
def test_resume_after_checkpoint_mid_repeat_is_bit_exact(runs, step):
  reference = [_by_step(result) for result in runs["reference"]]
  resumed = runs["jobs"][step]
  for index, result in enumerate(resumed):
    assert result["restored_step"] == step
    assert result["restored_pending"] == 1, "the rollout's second update is restored, not redone"
    trained = _by_step(result)
    # Checkpoint K is written after update K-1 (records count from 0).
    end = min([s for s in runs["preempt_steps"] if s > step] + [MAX_STEPS])
    assert sorted(trained) == list(range(step, end)), f"process {index}"
    want = reference[index]
    # The restored model and optimizer state are the ones of the
    # uninterrupted run, values and shardings.
    assert trained[step]["specs_before"] == want[step]["specs_before"], f"process {index}"
    assert trained[step]["params_before"] == want[step - 1]["params_after"], f"process {index}"
    assert trained[step]["opt_before"] == want[step]["opt_before"], f"process {index}"
    for train_step, record in trained.items():
      where = f"process {index}, step {train_step}"
      assert record["prompt_ids"] == want[train_step]["prompt_ids"], where
      assert record["layout"] == want[train_step]["layout"], where
      assert record["fields"] == want[train_step]["fields"], where
      assert record["params_after"] == want[train_step]["params_after"], where


@_JOBS
def test_first_job_of_the_chain_equals_the_reference_before_its_preemption(runs):
  # Sanity of the comparison itself: identical runs give identical records.
  for want, got in zip(runs["reference"], runs["jobs"][0]):
    assert got["restored_step"] == 0 and got["preempted"]
    reference = _by_step(want)
    for train_step, record in _by_step(got).items():
      assert record == reference[train_step], f"step {train_step}"


@_JOBS
def test_a_one_process_job_resumes_the_two_process_checkpoint_exactly(runs, tmp_path):
  # Both processes fed the same batches, so they saved the same data state:
  # a 1-process job (two CPU devices, the same mesh shape) resumes the
  # chain's checkpoint 3, inside a repeat, and trains what the 2-process
  # reference trains after it.
  root = tmp_path / "root"
  shutil.copytree(runs["chain_root"], root)
  for role in root.iterdir():
    for step in role.iterdir():
      if step.name.isdigit() and int(step.name) > 3:
        shutil.rmtree(step)
  (resumed,) = process_group.run_group(
      WORKER, tmp_path, "one_process", [{"root": str(root), "max_steps": MAX_STEPS}],
      timeout_seconds=RUN_TIMEOUT_SECONDS,
      extra_env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
  )
  assert resumed["process_count"] == 1 and resumed["restored_step"] == 3
  assert resumed["restored_pending"] == 1, "the rollout's second update is restored, not redone"
  trained = _by_step(resumed)
  assert sorted(trained) == list(range(3, MAX_STEPS))
  want = _by_step(runs["reference"][0])
  # The restored update: every field bit for bit, as it was saved.
  assert trained[3]["fields"] == want[3]["fields"]
  # Every later input holds the same data: prompts, completions, advantages
  # (rolled out by the restored weights), bit for bit.
  data_fields = ("prompt_ids", "completion_ids", "advantages", "prompt_mask", "completion_mask")
  for train_step, record in trained.items():
    assert record["prompt_ids"] == want[train_step]["prompt_ids"], train_step
    for name in data_fields:
      assert record["fields"][name] == want[train_step]["fields"][name], (train_step, name)
  # The log-probs of the rollouts after the resume (actor and reference) are
  # computed by another XLA program on one process (the same mesh shape):
  # equal to float32 rounding, not in every bit (with jax 0.10 on this CPU the
  # actor's differ in the last bits too). That is the model's arithmetic on a
  # new topology, not data; the restored update's own were compared above.
  for train_step, record in trained.items():
    for name in ("old_per_token_logps", "ref_per_token_logps"):
      got, expected = (np.asarray(r["logps"][name]) for r in (record, want[train_step]))
      np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=f"step {train_step}, {name}")
  # The resume is recorded as one with another process count.
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top

  data = _files.read_state(str(root / "actor" / str(MAX_STEPS) / "data"), 0, 1)
  assert [(e["step"], e.get("resized", False)) for e in data.lineage["recent"]] == [(1, False), (3, True)]


@_JOBS
def test_with_each_process_feeding_its_own_rows_the_drop_in_trains_what_stock_trains(tmp_path):
  # make_dataset's default sharding (each process reads its own shard) on the
  # mesh over both processes: the verdict on either Tunix version. Tunix hands
  # the trainer the prompt / completion fields as process-local arrays next to
  # global log-probs, so jit treats each process's rows as the whole batch:
  # the replicas of the replicated params come apart between the processes
  # within a few updates, in stock Tunix as in the drop-in. No checkpoint can
  # hold that state (Orbax writes one value per replicated array), so no
  # resume of it can be exact; the drop-in trains, update for update, what
  # stock trains.
  runs = {
      learner: _launch(tmp_path, learner, tmp_path / f"{learner}_root", None,
                       same_data=False, learner=learner)
      for learner in ("stock", "ckpt_iter")
  }
  for index in range(NUM_PROCESSES):
    stock, drop_in = (_by_step(runs[learner][index]) for learner in ("stock", "ckpt_iter"))
    assert sorted(stock) == sorted(drop_in) == list(range(MAX_STEPS))
    for train_step, record in drop_in.items():
      for field in ("prompt_ids", "fields", "params_after", "replicated_after"):
        assert record[field] == stock[train_step][field], (index, train_step, field)
  apart = [
      step for step in range(MAX_STEPS)
      if len({_by_step(r)[step]["replicated_after"] for r in runs["stock"]}) > 1
  ]
  assert apart, (
      "the replicated params of stock Tunix now agree across processes that feed their "
      "own rows: this mesh trains consistently, so test its resume for exactness")


# A pending leaf sharded across the processes: the worker hands the trainer
# the reference log-probs with their rows on "fsdp" (a stand-in for a batch
# axis spanning the processes; neither Tunix version makes one with these
# meshes). Each process saves the rows it holds; a resume with 2 processes
# takes its own, one with 1 process joins both.
SHARDED_PREEMPT = 3  # inside the second rollout's repeat


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict:
  directory = tmp_path_factory.mktemp("tunix_multihost_sharded")
  extra = {"shard_reference_logps": True}
  reference = _launch(directory, "reference", directory / "reference_root", None, **extra)
  chain_root = directory / "chain_root"
  first = _launch(directory, "first", chain_root, SHARDED_PREEMPT, **extra)
  one_root = directory / "one_process_root"
  shutil.copytree(chain_root, one_root)
  resumed = _launch(directory, "resumed", chain_root, None, **extra)
  (one,) = process_group.run_group(
      WORKER, directory, "one_process", [{"root": str(one_root), "max_steps": MAX_STEPS, **extra}],
      timeout_seconds=RUN_TIMEOUT_SECONDS,
      extra_env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
  )
  return {"reference": reference, "first": first, "resumed": resumed, "one": one, "chain_root": chain_root}


@_JOBS
def test_a_pending_leaf_sharded_across_processes_is_saved_by_its_holders(sharded_runs):
  data_dir = sharded_runs["chain_root"] / "actor" / str(SHARDED_PREEMPT) / "data"
  rows = []
  for index in range(NUM_PROCESSES):
    header = json.loads((data_dir / f"process_{index}-of-{NUM_PROCESSES}.json").read_text())
    assert "arrays_from" not in header  # each process writes the rows it holds
    (group,) = header["pending"]["groups"]
    leaf = group["structure"]["fields"]["ref_per_token_logps"]
    assert leaf["dataclass"] == "ckpt_iter.tunix.ShardedArray"
    rows.append(sorted(leaf["fields"]["blocks"]["dict"]))
  (first,), (second,) = rows
  assert first.startswith("0:1,") and second.startswith("1:2,"), rows
  assert sorted(p.name for p in data_dir.glob("*.npz")) == [
      f"process_{i}-of-{NUM_PROCESSES}.npz" for i in range(NUM_PROCESSES)]


@_JOBS
def test_a_pending_leaf_sharded_across_processes_resumes_bit_exact(sharded_runs):
  for index in range(NUM_PROCESSES):
    want = _by_step(sharded_runs["reference"][index])
    layout = want[0]["layout"]["ref_per_token_logps"]
    assert layout["kind"] == "global" and not layout["replicated"], layout
    assert layout["spec"] in ("P('fsdp',)", "PartitionSpec('fsdp',)"), layout
    first, resumed = sharded_runs["first"][index], sharded_runs["resumed"][index]
    assert resumed["restored_step"] == SHARDED_PREEMPT and resumed["restored_pending"] == 1
    trained = {**_by_step(first), **_by_step(resumed)}
    assert sorted(trained) == sorted(want) == list(range(MAX_STEPS))
    for train_step, record in trained.items():
      where = f"process {index}, step {train_step}"
      for field in ("prompt_ids", "fields", "layout", "params_before", "opt_before", "params_after"):
        assert record[field] == want[train_step][field], (where, field)


@_JOBS
def test_one_process_resumes_a_pending_leaf_sharded_across_two(sharded_runs):
  one = sharded_runs["one"]
  assert one["process_count"] == 1 and one["restored_step"] == SHARDED_PREEMPT
  assert one["restored_pending"] == 1, "the rollout's second update is restored, not redone"
  restored = _by_step(one)[SHARDED_PREEMPT]
  parts = [_by_step(r)[SHARDED_PREEMPT] for r in sharded_runs["reference"]]
  # The restored update's reference log-probs: both processes' rows, bit for bit.
  assert restored["logps"]["ref_per_token_logps"] == (
      parts[0]["logps"]["ref_per_token_logps"] + parts[1]["logps"]["ref_per_token_logps"])
  for name in ("prompt_ids", "completion_ids", "advantages", "old_per_token_logps"):
    if name in restored["fields"]:
      assert restored["fields"][name] == parts[0]["fields"][name], name
  assert restored["prompt_ids"] == parts[0]["prompt_ids"]


# A rollout model of its own, on the same two devices in another mesh shape
# ((1, 2) where the actor's is (2, 1)), two mini-batches per global step: the
# checkpoints inside a global step carry the rollout weights, which Tunix's
# device_put between the two meshes leaves in a form Orbax's writer could not
# list the shards of (the drop-in died saving checkpoint 1, where stock trains).
ROLLOUT_MESH_STEPS = 8  # two global steps of 2 mini-batches x 2 iterations
ROLLOUT_MESH_PREEMPTS = (1, 2)  # both inside the first global step


@pytest.fixture(scope="module")
def rollout_mesh_runs(tmp_path_factory) -> dict:
  directory = tmp_path_factory.mktemp("tunix_multihost_rollout_mesh")
  base = {"max_steps": ROLLOUT_MESH_STEPS, "rollout_mesh": [1, 2], "batch_size": 2, "mini_batch_size": 1}

  def launch(name: str, root: Path, **config) -> list[dict]:
    configs = [dict(base, root=str(root), **config)] * NUM_PROCESSES
    return process_group.run_group(WORKER, directory, name, configs, timeout_seconds=RUN_TIMEOUT_SECONDS)

  stock = launch("stock", directory / "stock_root", learner="stock", preempt_after=None)
  chain_root = directory / "chain_root"
  jobs = [
      launch(f"from{start}", chain_root, preempt_after=preempt)
      for start, preempt in zip((0,) + ROLLOUT_MESH_PREEMPTS, ROLLOUT_MESH_PREEMPTS + (None,))
  ]
  return {"stock": stock, "jobs": jobs, "chain_root": chain_root}


@_JOBS  # four 2-process jobs (about 2.5 minutes): make test-full and make test-tunix-main
def test_a_rollout_mesh_of_another_shape_trains_and_resumes_as_stock_trains(rollout_mesh_runs):
  runs = rollout_mesh_runs
  for step in ROLLOUT_MESH_PREEMPTS:  # the weights a later rollout of the step reads
    assert (runs["chain_root"] / "actor" / str(step) / "rollout_params").is_dir(), step
  for index in range(NUM_PROCESSES):
    want = _by_step(runs["stock"][index])
    assert sorted(want) == list(range(ROLLOUT_MESH_STEPS))
    trained: dict[int, dict] = {}
    for job in runs["jobs"]:
      trained.update(_by_step(job[index]))
    assert [job[index]["restored_step"] for job in runs["jobs"]] == [0, *ROLLOUT_MESH_PREEMPTS]
    assert sorted(trained) == sorted(want)
    for train_step, record in trained.items():
      where = f"process {index}, step {train_step}"
      for field in ("prompt_ids", "fields", "layout", "params_before", "opt_before", "params_after"):
        assert record[field] == want[train_step][field], (where, field)


def test_processes_that_fed_different_data_are_refused_another_count(tmp_path):
  # Each process read its own shard: the saved states differ, and no state
  # fits a process of another count. Real files, the learner's one reader.
  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _items as items  # pylint: disable=g-import-not-at-top

  data_dir = tmp_path / "actor" / "3" / "data"
  data_dir.mkdir(parents=True)
  for index in range(2):
    value = state_lib.IteratorState(
        kind="tunix", fingerprint={"learner": "GRPOLearner", "shard_index": index, "shard_count": 2},
        position={"next_index": 2}, counters={"train_steps": 3},
    )
    header, arrays = codec.encode_state(value)
    _files.write_files(str(data_dir), header, arrays, process_index=index, process_count=2)
  with pytest.raises(ckpt_iter.ProcessCountError) as refused:
    items.read_step_state(str(data_dir), 3, learner_field="learner", writer="a Resumable RL learner")
  message = str(refused.value)
  assert "written by 2 JAX process(es); resuming with 1 is exact only when every saved process" in message
  assert "process 1 of 2 saved another data state than process 0 (they differ in fingerprint.shard_index)" in message
  assert "Resume with 2 processes." in message and "elastic=True" not in message


def _write_sharded_states(data_dir: Path, blocks_of: list[dict], *, position=(2, 2)) -> None:
  """Two processes' states of step 3 that hold other blocks of one sharded pending leaf."""
  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top

  data_dir.mkdir(parents=True)
  for index, blocks in enumerate(blocks_of):
    leaf = shardings.ShardedArray(blocks=blocks, shape=(2, 3), mesh_role="actor", spec=("fsdp",))
    value = state_lib.IteratorState(
        kind="tunix", fingerprint={"learner": "GRPOLearner"},
        position={"next_index": position[index]}, counters={"train_steps": 3},
        pending=state_lib.Pending(items=({"logps": leaf, "ids": np.arange(2)},), schedule=(0,)),
    )
    header, arrays = codec.encode_state(value)
    _files.write_files(str(data_dir), header, arrays, process_index=index, process_count=2)


ROWS = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_the_rows_two_processes_held_of_a_sharded_leaf_are_joined_for_one_process(tmp_path):
  # Real files as two processes write them; one process (of another count,
  # on a one-device mesh) reads both and re-creates the whole array.
  import jax  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _items as items  # pylint: disable=g-import-not-at-top
  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top

  data_dir = tmp_path / "actor" / "3" / "data"
  _write_sharded_states(data_dir, [{"0:1,0:3": ROWS[:1]}, {"1:2,0:3": ROWS[1:]}])
  value = items.read_step_state(str(data_dir), 3, learner_field="learner", writer="a Resumable RL learner")
  assert value.lineage["recent"][-1].get("resized") is True
  (item,) = value.pending.items
  assert sorted(item["logps"].blocks) == ["0:1,0:3", "1:2,0:3"]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  placed = shardings.to_device(_learner_with_meshes(actor=mesh), item, "test")
  assert placed["logps"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
  np.testing.assert_array_equal(np.asarray(placed["logps"]), ROWS)


def test_processes_whose_sharded_rows_disagree_or_that_fed_other_data_are_refused(tmp_path):
  from ckpt_iter.tunix import _items as items  # pylint: disable=g-import-not-at-top

  # The same block with other values: corrupt, named.
  data_dir = tmp_path / "a" / "3" / "data"
  _write_sharded_states(data_dir, [{"0:1,0:3": ROWS[:1]}, {"0:1,0:3": ROWS[1:]}])
  with pytest.raises(ckpt_iter.InvalidStateError, match="different values for block '0:1,0:3'"):
    items.read_step_state(str(data_dir), 3, learner_field="learner", writer="a Resumable RL learner")
  # Other rows and another position: the processes fed other data.
  data_dir = tmp_path / "b" / "3" / "data"
  _write_sharded_states(data_dir, [{"0:1,0:3": ROWS[:1]}, {"1:2,0:3": ROWS[1:]}], position=(2, 4))
  with pytest.raises(ckpt_iter.ProcessCountError, match=r"differ in .*position\b.*Resume with 2 processes"):
    items.read_step_state(str(data_dir), 3, learner_field="learner", writer="a Resumable RL learner")


@pytest.mark.parametrize(("blocks", "shape", "message"), [
    ({"0:1": ROWS[:1]}, (2, 3), "does not name one 'start:stop' per axis"),
    ({"0:1,0:x": ROWS[:1]}, (2, 3), "malformed bounds '0:x'"),
    ({"0:1,0:9": ROWS[:1]}, (2, 3), "reaches outside an axis of size 3"),
    ({"0:1,0:2": ROWS[:1]}, (2, 3), r"not an array of shape \(1, 2\)"),
    ({"0:1,0:3": ROWS[:1]}, (2, 3), r"hold fewer values than shape \(2, 3\)"),
    ({"0:1,0:3": ROWS[:1], "0:2,0:2": ROWS[:, :2]}, (2, 3), r"'0:2,0:2'\]\) do not cover '0:2,0:3'"),
    ({"0:1,0:3": ROWS[:1]}, (10**12, 3), r"hold fewer values than shape"),
    ({}, (2, 3), "field 'blocks' holds no blocks"),
    ({"0:1,0:3": ROWS[:1]}, (2, -3), "field 'shape' is"),
])
def test_a_malformed_sharded_leaf_is_refused_naming_what(blocks, shape, message):
  import jax  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  leaf = shardings.ShardedArray(blocks=blocks, shape=shape, mesh_role="actor", spec=("fsdp",))
  with pytest.raises(ckpt_iter.InvalidStateError, match=message):
    shardings.to_device(_learner_with_meshes(actor=mesh), {"logps": leaf}, "checkpoint step 3")


# ---------------------------------------------------------------------------
# The wrapper itself, in this process (one process: every array is addressable).


def _learner_with_meshes(**meshes) -> types.SimpleNamespace:
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

  r2m = {rl_cluster_lib.Role(role): mesh for role, mesh in meshes.items()}
  return types.SimpleNamespace(rl_cluster=types.SimpleNamespace(r2m=r2m))


def test_single_process_pending_items_are_stored_as_before():
  import jax  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  learner = _learner_with_meshes(actor=mesh)
  replicated = jax.device_put(np.arange(6.0, dtype=np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tree = {"logps": replicated, "ids": jax.device_put(np.arange(3)), "none": None}
  wrapped = shardings.for_checkpoint(learner, tree, "test")
  assert wrapped["logps"] is replicated and wrapped["ids"] is tree["ids"] and wrapped["none"] is None


def test_global_array_is_recreated_on_its_role_mesh_with_its_spec():
  import jax  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  learner = _learner_with_meshes(actor=mesh, reference=mesh)
  value = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
  restored = shardings.to_device(learner, {
      "logps": shardings.GlobalArray(value=value, mesh_role="reference", spec=(None, "fsdp")),
      "ids": np.arange(3),
  }, "test")
  logps = restored["logps"]
  assert isinstance(logps.sharding, jax.sharding.NamedSharding)
  assert logps.sharding.mesh == mesh and logps.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  testing.assert_trees_equal(np.asarray(logps), value)
  # A process-local leaf is put on the device as JAX holds it (int32 without x64).
  testing.assert_trees_equal(np.asarray(restored["ids"]), np.arange(3, dtype=np.int32))


def test_global_array_of_a_role_the_cluster_lacks_is_refused():
  import jax  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _shardings as shardings  # pylint: disable=g-import-not-at-top
  from ckpt_iter import errors  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  learner = _learner_with_meshes(actor=mesh)
  leaf = shardings.GlobalArray(value=np.zeros(2, np.float32), mesh_role="critic", spec=())
  with pytest.raises(errors.InvalidStateError, match=r"role 'critic', which this cluster does not have \(roles: \['actor'\]\)"):
    shardings.to_device(learner, {"values": leaf}, "checkpoint step 7")
