"""A toy Tunix GRPO run on CPU: the workload of `make demo` and the benchmarks.

It uses the toy model and vocabulary that ship in the Tunix wheel
(`tunix.tests.test_common`), a prompt set shipped in this package, and real
RLCluster, GRPOLearner, Orbax checkpoints and JIT. A run can be preempted: the
process is killed with `os._exit` right after checkpoint K is on disk, the way
a scheduler kills a job. Every trainer input (the TrainExample handed to the
actor update) is recorded, so runs can be compared bit for bit.

The tests' workload (tests/workers/tunix_toy.py) builds on these parts and
adds what only the tests vary: other algorithms, pipeline forms, packing,
evaluation, checkpoint policies.

Run one in a process of its own:
    python -m demo.toyrun --root /abs/dir --out run.npz --config '{"learner": "stock"}'
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from ckpt_iter import _storage

PROMPTS_FILE = os.path.join(os.path.dirname(__file__), "prompts.jsonl")
RECORDED_FIELDS = (
    "prompt_ids",
    "completion_ids",
    "advantages",
    "old_per_token_logps",
    "ref_per_token_logps",
    # Set on packed inputs only (max_seq_token_per_tpu).
    "segment_ids",
    "segment_positions",
    "completion_mask",
    "is_update_step",
)


@dataclasses.dataclass
class RunConfig:
  """What defines a toy run."""

  learner: str = "ckpt_iter"  # "stock" (Tunix as released) or "ckpt_iter"
  num_iterations: int = 2
  num_generations: int = 2
  batch_size: int = 1  # full batch, prompts per global step
  mini_batch_size: int | None = None
  train_micro_batch_size: int | None = None
  data_shuffle_seed: int | None = None
  max_steps: int = 8
  num_prompts: int = 64
  save_interval_steps: int = 1
  # A separate rollout model on a second CPU device (the benchmarks' RL-scale runs).
  async_rollout: bool = False


def load_prompts(limit: int | None = None) -> list[dict[str, str]]:
  with open(PROMPTS_FILE) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records[:limit]


def reward_fn(prompts, completions, answer, **unused) -> list[float]:
  """Rewards completions that use the answer word, and brevity a little."""
  del prompts, unused
  return [
      float(text.split().count(str(word))) - 0.05 * len(text.split())
      for text, word in zip(completions, answer)
  ]


def build_learner(config: RunConfig, root: str) -> Any:
  """Builds RLCluster and the GRPO learner of `config` with its checkpoints in `root`."""
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top

  cluster = build_cluster(config, root)
  if config.learner == "stock":
    learner_cls = grpo_learner.GRPOLearner
  else:
    from ckpt_iter.tunix import ResumableGRPOLearner as learner_cls  # pylint: disable=g-import-not-at-top
  return learner_cls(
      rl_cluster=cluster,
      reward_fns=reward_fn,
      algo_config=grpo_learner.GRPOConfig(
          num_generations=config.num_generations, num_iterations=config.num_iterations, beta=0.04),
      data_shuffle_seed=config.data_shuffle_seed,
  )


def build_cluster(config: RunConfig, root: str) -> Any:
  """The RLCluster of `config` with its checkpoints in `root`."""
  return toy_cluster(root, with_drop_ins=config.learner != "stock", async_rollout=config.async_rollout,
                     training_options={
                         "max_steps": config.max_steps,
                         "mini_batch_size": config.mini_batch_size,
                         "train_micro_batch_size": config.train_micro_batch_size,
                         "checkpointing_options": explicit_checkpointing(config.save_interval_steps),
                     })


def explicit_checkpointing(save_interval_steps: int, max_to_keep: int = 1000) -> Any:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp.CheckpointManagerOptions(save_interval_steps=save_interval_steps, max_to_keep=max_to_keep)


def toy_cluster(
    root: str,
    *,
    with_drop_ins: bool,
    training_options: dict[str, Any],
    rollout_options: dict[str, Any] | None = None,
    async_rollout: bool = False,
    critic: bool = False,
    tokenizer_adapter: bool = False,
) -> Any:
  """An RLCluster of Tunix's toy models on CPU, checkpointing to `root`.

  `training_options` and `rollout_options` are RLTrainingConfig and
  RolloutConfig fields over the toy's defaults (SGD at 1e-2, no evaluation,
  4 generated tokens). `async_rollout` puts the rollout model on a device of
  its own; `critic` adds a critic with a score head (PPO); `tokenizer_adapter`
  wraps the vocabulary the way the agentic learner wants it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top
  from tunix.tests import test_common as tc  # pylint: disable=g-import-not-at-top

  if not (os.path.isabs(root) or _storage.is_url(root)):
    raise ValueError(f"root={root!r} must be absolute or a URL such as gs://... (Orbax needs absolute paths).")
  if with_drop_ins:
    # Imported first, as a user's script does at the top (on Tunix main this
    # registers the data item's Orbax v1 handler before Tunix's Checkpointer).
    import ckpt_iter.tunix  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  vocab = tc.MockVocab()
  model_config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
  actor = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  reference = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  devices = jax.devices()
  actor_mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1), ("fsdp", "tp"))
  if async_rollout:
    if len(devices) < 2:
      raise RuntimeError(
          "async rollout needs 2 devices: set "
          "XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts."
      )
    rollout_mesh = jax.sharding.Mesh(np.array(devices[1:2]).reshape(1, 1), ("fsdp", "tp"))
  else:
    rollout_mesh = actor_mesh
  role_to_mesh = {
      rl_cluster_lib.Role.ACTOR: actor_mesh,
      rl_cluster_lib.Role.REFERENCE: actor_mesh,
      rl_cluster_lib.Role.ROLLOUT: rollout_mesh,
  }
  training = {"actor_optimizer": optax.sgd(1e-2), "eval_every_n_steps": 1000,
              "checkpoint_root_directory": root}
  extra_models = {}
  if critic:
    role_to_mesh[rl_cluster_lib.Role.CRITIC] = actor_mesh
    role_to_mesh[rl_cluster_lib.Role.REWARD] = actor_mesh
    extra_models["critic"] = tc.ToyTransformerWithScoreHead(
        tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(1)), rngs=nnx.Rngs(1)
    )
    training["critic_optimizer"] = optax.sgd(1e-3)
  rollout = {"max_tokens_to_generate": 4, "max_prompt_length": 8, "kv_cache_size": 64,
             # Tunix main takes the old log-probs of num_iterations > 1 from
             # the sampler (it refuses to run without them); 0.1.7 recomputes.
             "return_logprobs": sampler_logprobs_needed()}
  if tokenizer_adapter:
    from tunix.generate import tokenizer_adapter as adapter_lib  # pylint: disable=g-import-not-at-top

    tokenizer = adapter_lib.TokenizerAdapter(vocab)
  else:
    tokenizer = vocab
  return rl_cluster_lib.RLCluster(
      actor=actor,
      reference=reference,
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh=role_to_mesh,
          rollout_engine="vanilla",
          offload_to_cpu=False,
          training_config=rl_cluster_lib.RLTrainingConfig(**{**training, **training_options}),
          rollout_config=base_rollout.RolloutConfig(**{**rollout, **(rollout_options or {})}),
      ),
      **extra_models,
  )


def sampler_logprobs_needed() -> bool:
  """True on a Tunix whose learners take `rl_engine=` (upstream main, 0.1.8)."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

  return hasattr(rl_cluster_lib, "RLEngine")


def make_train_dataset(config: RunConfig) -> Any:
  """make_dataset over the shipped prompts, repeated forever (max_steps ends the run)."""
  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top

  return dataset_lib.make_dataset(
      load_prompts(config.num_prompts), batch_size=config.batch_size, seed=None, num_epochs=None,
      shard_index=0, shard_count=1,
  )


class TrainerInputRecorder:
  """Records every TrainExample the actor is updated on, as numpy arrays."""

  def __init__(self, learner: Any, delay_seconds: float = 0.0):
    self.inputs: list[dict[str, np.ndarray]] = []
    self.train_steps: list[int] = []
    # Per update: a digest of the evaluation input Tunix passed with it (its
    # rollout ran on the rollout model's weights), or None.
    self.eval_digests: list[str | None] = []
    cluster = learner.rl_cluster
    original = cluster.update_actor

    def update_actor(train_ds, eval_ds, skip_jit=False):
      self._call_started_at = int(cluster.actor_trainer.train_steps)
      example = train_ds[0]
      self.inputs.append({
          name: np.asarray(getattr(example, name))
          for name in RECORDED_FIELDS
          if getattr(example, name, None) is not None
      })
      self.train_steps.append(int(cluster.actor_trainer.train_steps))
      self.eval_digests.append(None if not eval_ds else _digest_example(eval_ds[0]))
      if delay_seconds:
        time.sleep(delay_seconds)
      return original(train_ds, eval_ds, skip_jit)

    cluster.update_actor = update_actor
    # Where the actor's trainer evaluates (Tunix decides, per update, from its
    # eval input): when an update call starts, and after an update's save at
    # a multiple of eval_every_n_steps ("after update").
    self.eval_steps: list[int] = []
    self.eval_after_update: list[bool] = []
    self._call_started_at: int | None = None
    trainer = cluster.actor_trainer
    run_eval = trainer._run_eval  # pylint: disable=protected-access

    def record_eval(*args, **kwargs):
      step = int(trainer.train_steps)
      self.eval_steps.append(step)
      self.eval_after_update.append(self._call_started_at is not None and step != self._call_started_at)
      return run_eval(*args, **kwargs)

    trainer._run_eval = record_eval  # pylint: disable=protected-access

  def save(self, path: str, meta: dict[str, Any]) -> None:
    arrays = {
        f"input{i}_{name}": value
        for i, fields in enumerate(self.inputs)
        for name, value in fields.items()
    }
    meta = dict(meta, num_inputs=len(self.inputs), train_steps=self.train_steps, eval_steps=self.eval_steps,
                eval_after_update=self.eval_after_update, eval_digests=self.eval_digests)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def _digest_example(example: Any) -> str:
  digest = hashlib.sha256()
  for name in RECORDED_FIELDS:
    value = getattr(example, name, None)
    if value is not None:
      array = np.asarray(value)
      digest.update(f"{name}{array.dtype}{array.shape}".encode())
      digest.update(array.tobytes())
  return digest.hexdigest()[:16]


def load_record(path: str) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
  with np.load(path, allow_pickle=False) as data:
    meta = json.loads(bytes(data["meta"]).decode())
    inputs = [
        {
            name: data[f"input{i}_{name}"]
            for name in RECORDED_FIELDS
            if f"input{i}_{name}" in data.files
        }
        for i in range(meta["num_inputs"])
    ]
  return inputs, meta


def prompt_labels(prompt_ids: np.ndarray) -> list[str]:
  """The prompt ids ("A", "B", ...) of the rows of a trainer input, deduplicated."""
  return label_rows(prompt_ids, {r["prompts"]: r["id"] for r in load_prompts()})


def label_rows(prompt_ids: np.ndarray, label_of_text: dict[str, str]) -> list[str]:
  """The labels of a trainer input's prompt rows (MockVocab tokens), consecutive repeats merged."""
  from tunix.tests import test_common as tc  # pylint: disable=g-import-not-at-top

  vocab = tc.MockVocab()
  by_tokens = {tuple(vocab.EncodeAsIds(text)): label for text, label in label_of_text.items()}
  labels = []
  for row in np.asarray(prompt_ids):
    tokens = tuple(int(t) for t in row if t not in (vocab.pad_id(), vocab.bos_id()))
    label = by_tokens.get(tokens, "?")
    if not labels or labels[-1] != label:
      labels.append(label)
  return labels


def preempt_after(learner: Any, step: int, on_preempt: Any) -> None:
  """Kills the process right after checkpoint `step` is completely on disk.

  With a critic (PPO) a step is complete once the critic's checkpoint for it
  is written, which comes after the actor's update, save and the critic's
  update of the same trainer input.
  """
  cluster = learner.rl_cluster
  has_critic = hasattr(cluster, "critic_trainer")
  trainer = cluster.critic_trainer if has_critic else cluster.actor_trainer
  manager = trainer.checkpoint_manager
  original = manager.save

  def save(train_step, *args, **kwargs):
    saved = original(train_step, *args, **kwargs)
    if saved and train_step == step:
      cluster.actor_trainer.checkpoint_manager.close()  # waits for async writes
      if has_critic:
        cluster.critic_trainer.checkpoint_manager.close()
      on_preempt()
      sys.stdout.flush()
      os._exit(0)  # pylint: disable=protected-access
    return saved

  manager.save = save


def run(config: RunConfig, root: str, out: str, preempt_step: int | None = None) -> dict[str, Any]:
  """Trains (resuming from `root` if it holds checkpoints) and records inputs."""
  started = time.perf_counter()
  learner = build_learner(config, root)
  return record_training(learner, make_train_dataset(config), None, out,
                         {"config": dataclasses.asdict(config)}, started, preempt_step)


def record_training(
    learner: Any,
    train_ds: Any,
    eval_ds: Any,
    out: str,
    meta: dict[str, Any],
    started: float,
    preempt_step: int | None = None,
    *,
    train_kwargs: dict[str, Any] | None = None,
    trainer_delay_seconds: float = 0.0,
) -> dict[str, Any]:
  """Trains `learner` and writes what it trained to `out` (also when killed at `preempt_step`)."""
  meta = dict(meta, restored_step=int(learner.rl_cluster.actor_trainer.train_steps))
  recorder = TrainerInputRecorder(learner, trainer_delay_seconds)

  def finish(preempted: bool) -> None:
    meta["preempted"] = preempted
    meta["seconds"] = time.perf_counter() - started
    recorder.save(out, meta)

  if preempt_step is not None:
    preempt_after(learner, preempt_step, lambda: finish(True))
  learner.train(train_ds, eval_ds, **(train_kwargs or {}))
  meta["actor_digest"] = actor_digest(learner)
  finish(False)
  return meta


def actor_digest(learner: Any) -> str:
  """sha256 of the actor's parameters, leaf by leaf (the final weights, bit for bit)."""
  import hashlib  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  digest = hashlib.sha256()
  model = learner.rl_cluster.actor_trainer.model
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    value = np.asarray(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}:{value.dtype}:{value.shape}".encode())
    digest.update(value.tobytes())
  return digest.hexdigest()


def main(
    argv: list[str] | None = None,
    *,
    config_type: type = RunConfig,
    run_one: Callable[..., dict[str, Any]] = run,
) -> int:
  """The command line of a toy run; the tests' toy passes its own config type and run."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", required=True, help="absolute checkpoint root")
  parser.add_argument("--out", required=True, help="where to write the recorded inputs (.npz)")
  parser.add_argument("--preempt-after", type=int, default=None)
  parser.add_argument("--config", default="{}", help=f"{config_type.__name__} fields as JSON")
  args = parser.parse_args(argv)
  config = config_type(**json.loads(args.config))
  meta = run_one(config, args.root, args.out, args.preempt_after)
  print(json.dumps({"restored_step": meta["restored_step"], "seconds": round(meta["seconds"], 2)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
