"""One JAX process of a multi-process toy GRPO run (tests/integration/test_tunix_multihost.py).

    python tests/workers/tunix_multihost_worker.py CONFIG.json

CONFIG holds port, num_processes, process_id, root (absolute checkpoint
root, shared by the processes), out, preempt_after (a step or null),
max_steps, same_data (default true), rollout_mesh (the rollout
mesh's shape over the same devices, default the actor's [n, 1]), learner
("ckpt_iter", the default, or "stock"), batch_size (prompts per batch,
default 1), mini_batch_size (default: the batch, one mini-batch per
global step) and shard_reference_logps (default false: hand the trainer
the reference log-probs sharded across the processes, a stand-in for a
batch axis that spans them). The process joins a
`jax.distributed` job on 127.0.0.1 (CPU backend) and trains
`ResumableGRPOLearner` on the toy model of `demo.toyrun` with one mesh
over all global devices for actor, reference and rollout,
`optax.sgd(lr, momentum=0.9)` (with plain sgd stock Tunix itself cannot
restore on several processes, see docs/multihost.md), num_iterations=2 and
one prompt per batch. It resumes from `root` when it holds checkpoints.

same_data: every process reads the same batches (make_dataset with
shard_count=1). Tunix 0.1.7 hands the trainer the prompt / completion
fields as process-local arrays next to global log-prob arrays, so its
shard_input leaves the batch as it is and jit treats the process-local
arrays as replicated: with a different shard per process (same_data=false,
make_dataset's default sharding) the replicas of replicated params drift
apart between processes, and no checkpoint can hold that state.

Recorded per trainer input (the TrainExample handed to the actor update):
a SHA-256 of this process's view of each array field (dtype, shape, bytes),
which fields are global arrays (not fully addressable) and with what
partition spec, and checksums of this process's view of the actor params
(before and after the update, with each param's partition spec) and
optimizer state (before). On Tunix main the rollout returns the sampler's
log-probs (`return_logprobs`), which main requires for num_iterations > 1. With
preempt_after=K the process dies with os._exit right after checkpoint K is
on disk, as a scheduler kills a job.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

import process_group  # tests/workers/process_group.py: this script runs from tests/workers/

os.environ.setdefault("JAX_PLATFORMS", "cpu")

NUM_ITERATIONS = 2
LEARNING_RATE = 1e-2
MOMENTUM = 0.9


def build_learner(root: str, max_steps: int, rollout_mesh=None, learner: str = "ckpt_iter",
                  mini_batch_size=None):
  """tunix_toy.build_learner, with a mesh over all processes' devices and momentum."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top
  from tunix.tests import test_common as tc  # pylint: disable=g-import-not-at-top

  import tunix_toy  # pylint: disable=g-import-not-at-top
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  vocab = tc.MockVocab()
  model_config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
  actor = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  reference = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"))
  # Another shape over the same devices makes the rollout model a copy of its own.
  rollout = mesh if rollout_mesh is None else jax.sharding.Mesh(
      np.array(devices).reshape(tuple(rollout_mesh)), ("fsdp", "tp"))
  training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(LEARNING_RATE, momentum=MOMENTUM),
      eval_every_n_steps=1000,
      max_steps=max_steps,
      mini_batch_size=mini_batch_size,
      train_micro_batch_size=mini_batch_size,
      checkpoint_root_directory=root,
      checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=1000),
  )
  cluster = rl_cluster_lib.RLCluster(
      actor=actor,
      reference=reference,
      tokenizer=vocab,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              rl_cluster_lib.Role.ACTOR: mesh,
              rl_cluster_lib.Role.REFERENCE: mesh,
              rl_cluster_lib.Role.ROLLOUT: rollout,
          },
          rollout_engine="vanilla",
          offload_to_cpu=False,
          training_config=training,
          rollout_config=base_rollout.RolloutConfig(
              max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=64,
              # Tunix main takes num_iterations > 1's old log-probs from the sampler.
              return_logprobs=toyrun.sampler_logprobs_needed(),
          ),
      ),
  )
  config = tunix_toy.RunConfig(num_iterations=NUM_ITERATIONS, max_steps=max_steps, learner=learner)
  return tunix_toy.make_learner(config, cluster)


def params_checksum(learner, opt: bool = False, replicated_only: bool = False) -> str:
  """SHA-256 of this process's view of the actor params (or optimizer state).

  A replicated leaf contributes this process's copy, a sharded one the shards
  this process holds: no collective, so it can run at any point. With
  replicated_only, only the leaves every process holds whole: their
  checksums must agree across processes in a consistent run.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  digest = hashlib.sha256()
  trainer = learner.rl_cluster.actor_trainer
  state = nnx.state(trainer.optimizer, nnx.optimizer.OptState) if opt else nnx.state(trainer.model, nnx.Param)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if replicated_only and not leaf.is_fully_replicated:
      continue
    digest.update(jax.tree_util.keystr(path).encode())
    if leaf.is_fully_addressable or leaf.is_fully_replicated:
      values = [np.asarray(leaf)]
    else:
      shards = sorted(leaf.addressable_shards, key=lambda shard: shard.device.id)
      values = [np.asarray(shard.data) for shard in shards]
    for value in values:
      digest.update(f"{value.dtype}{value.shape}".encode())
      digest.update(np.ascontiguousarray(value).tobytes())
  return digest.hexdigest()


def params_specs(learner) -> dict:
  """Each actor param's partition spec ("local" off the mesh): where a checksum differs, says
  whether the layout did."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  state = nnx.state(learner.rl_cluster.actor_trainer.model, nnx.Param)
  return {
      jax.tree_util.keystr(path): repr(getattr(leaf.sharding, "spec", "local"))
      for path, leaf in jax.tree_util.tree_leaves_with_path(state)
  }


def local_view(value):
  """This process's view of a trainer-input field: the whole array, or its shards' rows."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  if value.is_fully_addressable or value.is_fully_replicated:
    return np.asarray(value)
  shards = sorted(value.addressable_shards, key=lambda shard: shard.device.id)
  return np.concatenate([np.asarray(shard.data) for shard in shards])


def shard_reference_logps(learner) -> None:
  """Hands the trainer reference log-probs sharded across processes (rows on "fsdp").

  Tunix makes them a replicated global array; this stand-in reshards them
  as a batch axis spanning the processes would, so a mid-repeat checkpoint
  holds a pending leaf of which each process has only its own rows.
  """
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  original = learner._process_accumulated_batches  # pylint: disable=protected-access

  def process(*args, **kwargs):
    produced = original(*args, **kwargs)
    out = []
    for example in produced:
      logps = example.ref_per_token_logps
      sharding = jax.sharding.NamedSharding(logps.sharding.mesh, jax.sharding.PartitionSpec("fsdp"))
      out.append(dataclasses.replace(example, ref_per_token_logps=jax.device_put(logps, sharding)))
    return out

  learner._process_accumulated_batches = process  # pylint: disable=protected-access


def field_layout(value) -> dict:
  """How a TrainExample field is held: process-local or global, and its spec."""
  import jax  # pylint: disable=g-import-not-at-top

  if not isinstance(value, jax.Array):
    return {"kind": type(value).__name__}
  if value.is_fully_addressable:
    return {"kind": "local"}
  spec = getattr(value.sharding, "spec", None)
  return {"kind": "global", "spec": repr(spec), "replicated": bool(value.is_fully_replicated)}


class Recorder:
  """Each trainer input (this process's view) and the actor state around its update."""

  def __init__(self, learner):
    import dataclasses  # pylint: disable=g-import-not-at-top

    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    self.inputs: list[dict] = []
    cluster = learner.rl_cluster
    original = cluster.update_actor

    def update_actor(train_ds, eval_ds, skip_jit=False):
      example = train_ds[0]
      arrays = {
          field.name: getattr(example, field.name) for field in dataclasses.fields(example)
          if isinstance(getattr(example, field.name), jax.Array)
      }
      record = {
          "train_step": int(cluster.actor_trainer.train_steps),
          "prompt_ids": np.asarray(example.prompt_ids).tolist(),
          # Bit for bit: dtype, shape and bytes of this process's view.
          "fields": {
              name: hashlib.sha256(
                  f"{local_view(value).dtype}{local_view(value).shape}".encode()
                  + np.ascontiguousarray(local_view(value)).tobytes()
              ).hexdigest()
              for name, value in arrays.items()
          },
          "layout": {name: field_layout(value) for name, value in arrays.items()},
          # The log-prob values themselves, to say how far two topologies differ.
          "logps": {
              name: np.asarray(local_view(value), dtype=np.float64).ravel().tolist()
              for name, value in arrays.items() if name.endswith("per_token_logps")
          },
          "params_before": params_checksum(learner),
          "specs_before": params_specs(learner),
          "opt_before": params_checksum(learner, opt=True),
      }
      self.inputs.append(record)
      result = original(train_ds, eval_ds, skip_jit)
      record["params_after"] = params_checksum(learner)
      record["replicated_after"] = params_checksum(learner, replicated_only=True)
      record["specs_after"] = params_specs(learner)
      return result

    cluster.update_actor = update_actor


def main(config_path: str) -> int:
  with open(config_path) as f:
    config = json.load(f)
  started = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top

  process_group.initialize_distributed(config)
  from ckpt_iter.tunix import _session as _tunix_session  # pylint: disable=g-import-not-at-top
  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  index, count = jax.process_index(), jax.process_count()
  assert (index, count) == (config["process_id"], config["num_processes"]), (index, count)
  begin = time.perf_counter()
  learner = build_learner(  # restores the model
      config["root"], config["max_steps"], config.get("rollout_mesh"), config.get("learner", "ckpt_iter"),
      config.get("mini_batch_size"))
  result = {
      "process_index": index,
      "process_count": count,
      "restored_step": int(learner.rl_cluster.actor_trainer.train_steps),
      "build_seconds": time.perf_counter() - begin,
  }
  # The data-state restore, timed on its own.
  original_restore = _tunix_session.DataSession.restore

  def timed_restore(self, *args, **kwargs):
    begin = time.perf_counter()
    try:
      return original_restore(self, *args, **kwargs)
    finally:
      result["data_restore_seconds"] = time.perf_counter() - begin
      pending = self._restored_pending  # pylint: disable=protected-access
      result["restored_pending"] = 0 if pending is None else len(pending)

  _tunix_session.DataSession.restore = timed_restore
  if config.get("shard_reference_logps"):
    shard_reference_logps(learner)
  recorder = Recorder(learner)

  def finish(preempted: bool) -> None:
    result["preempted"] = preempted
    result["inputs"] = recorder.inputs
    result["seconds"] = time.perf_counter() - started
    with open(config["out"], "w") as f:
      json.dump(result, f)

  if config.get("preempt_after") is not None:
    step = config["preempt_after"]

    def on_preempt():
      # The update of step K happened inside update_actor, whose wrapper
      # never returns: record its params here.
      recorder.inputs[-1]["params_after"] = params_checksum(learner)
      recorder.inputs[-1]["replicated_after"] = params_checksum(learner, replicated_only=True)
      recorder.inputs[-1]["specs_after"] = params_specs(learner)
      finish(True)
      # Every process has written its record before any exits: the first to
      # exit takes the coordination service down with it.
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("ckpt_iter_test_preempted")

    toyrun.preempt_after(learner, step, on_preempt)
  if config.get("same_data", True):
    # Every process feeds the same batches: Tunix 0.1.7 trains on them as
    # process-local arrays that jit treats as replicated (see the module doc).
    shards = {"shard_index": 0, "shard_count": 1}
  else:
    shards = {}  # default sharding: shard jax.process_index() of jax.process_count()
  dataset = dataset_lib.make_dataset(
      toyrun.load_prompts(64), batch_size=config.get("batch_size", 1), seed=None, num_epochs=None, **shards
  )
  learner.train(dataset)  # closes the checkpoint manager: every write is done
  finish(False)
  return 0


if __name__ == "__main__":
  try:
    code = main(sys.argv[1])
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    # Do not wait for the other processes in jax.distributed's shutdown.
    os._exit(1)  # pylint: disable=protected-access
  sys.stdout.flush()
  sys.exit(code)
