"""A toy Tunix RL run on CPU: the demo's, the tests' and the benchmarks' workload.

It uses the toy model and vocabulary that ship in the Tunix wheel
(`tunix.tests.test_common`), a prompt set shipped in this package, and real
RLCluster, GRPOLearner/PPOLearner, Orbax checkpoints and JIT. A run can be
preempted: the process is killed with `os._exit` right after checkpoint K is
on disk, the way a scheduler kills a job. Every trainer input (the
TrainExample handed to the actor update) is recorded, so runs can be compared
bit for bit.

Run one in a process of its own:
    python -m ckpt_iter.demo.toyrun --root /abs/dir --out run.npz --config '{"learner": "stock"}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

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
  algorithm: str = "grpo"  # "grpo", "dapo", "drgrpo" or "ppo"
  num_iterations: int = 2
  num_generations: int = 2
  batch_size: int = 1  # full batch, prompts per global step
  mini_batch_size: int | None = None
  train_micro_batch_size: int | None = None
  data_shuffle_seed: int | None = None
  dataset_seed: int | None = None
  async_rollout: bool = False
  max_steps: int = 8
  num_prompts: int = 64
  eval_every_n_steps: int = 1000
  with_eval: bool = False
  on_legacy_checkpoint: str = "raise"
  save_interval_steps: int = 1
  # Sleeps before each actor update: a slower trainer lets the producer
  # thread run ahead (async rollout), the case a save must not be fooled by.
  trainer_delay_seconds: float = 0.0
  # The same batches in several forms. "grain": make_dataset's MapDataset;
  # "map": a MapDataset built by hand with Grain's own methods; "iter": the
  # make_dataset pipeline `.to_iter_dataset()`; "dataloader": a
  # grain.DataLoader over it; "list": a list of the batches; "iterable": a
  # one-shot generator of them (the last two restored by replay).
  input_kind: str = "grain"
  # Passes over the prompts (None: repeat forever, so max_steps ends the run).
  num_epochs: int | None = None
  # "explicit": CheckpointManagerOptions(save_interval_steps, max_to_keep=1000);
  # "default": checkpointing_options=None (Tunix's own default policy).
  checkpointing: str = "explicit"
  # Prompts per batch, cycled (e.g. [2, 1]: uneven batches); None: batch_size.
  batch_sizes: list[int] | None = None
  # Sequence packing: RLTrainingConfig.max_seq_token_per_tpu (None: off).
  max_seq_token_per_tpu: int | None = None
  # Algorithm settings a resume may change (with a warning).
  beta: float = 0.04
  temperature: float | None = None  # None: RolloutConfig's default
  # None: optax.sgd(1e-2). A value: optax.inject_hyperparams(optax.sgd), whose
  # learning rate is visible to the resume.
  learning_rate: float | None = None


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
  """Builds RLCluster and the learner of `config` with its checkpoints in `root`."""
  return _make_learner(config, build_cluster(config, root))


def build_cluster(config: RunConfig, root: str) -> Any:
  """Builds the RLCluster of `config` with its checkpoints in `root`."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top
  from tunix.tests import test_common as tc  # pylint: disable=g-import-not-at-top

  if not (os.path.isabs(root) or _storage.is_url(root)):
    raise ValueError(f"root={root!r} must be absolute or a URL such as gs://... (Orbax needs absolute paths).")
  if config.learner != "stock":
    # Imported first, as a user's script does at the top (on Tunix main this
    # registers the data item's Orbax v1 handler before Tunix's Checkpointer).
    import ckpt_iter.tunix  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  vocab = tc.MockVocab()
  model_config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
  actor = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  reference = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
  devices = jax.devices()
  actor_mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1), ("fsdp", "tp"))
  if config.async_rollout:
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
  extra_models = {}
  if config.algorithm == "ppo":
    role_to_mesh[rl_cluster_lib.Role.CRITIC] = actor_mesh
    role_to_mesh[rl_cluster_lib.Role.REWARD] = actor_mesh
    extra_models["critic"] = tc.ToyTransformerWithScoreHead(
        tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(1)), rngs=nnx.Rngs(1)
    )
  training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=(optax.sgd(1e-2) if config.learning_rate is None
                       else optax.inject_hyperparams(optax.sgd)(learning_rate=config.learning_rate)),
      critic_optimizer=optax.sgd(1e-3) if config.algorithm == "ppo" else None,
      eval_every_n_steps=config.eval_every_n_steps,
      max_steps=config.max_steps,
      mini_batch_size=config.mini_batch_size,
      train_micro_batch_size=config.train_micro_batch_size,
      checkpoint_root_directory=root,
      checkpointing_options=_checkpointing_options(config),
      **_packing_options(config),
  )
  cluster = rl_cluster_lib.RLCluster(
      actor=actor,
      reference=reference,
      tokenizer=vocab,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh=role_to_mesh,
          rollout_engine="vanilla",
          offload_to_cpu=False,
          training_config=training,
          rollout_config=base_rollout.RolloutConfig(
              max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=64,
              # Tunix main takes the old log-probs of num_iterations > 1 from
              # the sampler (it refuses to run without them); 0.1.7 recomputes.
              return_logprobs=_sampler_logprobs_needed(),
              **({} if config.temperature is None else {"temperature": config.temperature}),
          ),
      ),
      **extra_models,
  )
  return cluster


def _packing_options(config: RunConfig) -> dict[str, Any]:
  """Only the options set: a default run builds the config it always built."""
  options = {}
  if config.max_seq_token_per_tpu is not None:
    options["max_seq_token_per_tpu"] = config.max_seq_token_per_tpu
  return options


def _checkpointing_options(config: RunConfig) -> Any:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if config.checkpointing == "default":
    return None
  if config.checkpointing == "explicit":
    return ocp.CheckpointManagerOptions(
        save_interval_steps=config.save_interval_steps, max_to_keep=1000
    )
  raise ValueError(f"checkpointing={config.checkpointing!r}: expected 'explicit' or 'default'.")


def _sampler_logprobs_needed() -> bool:
  """True on a Tunix whose learners take `rl_engine=` (upstream main, 0.1.8)."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

  return hasattr(rl_cluster_lib, "RLEngine")


def _config_argument(learner_cls: type) -> str:
  """The name this Tunix gives the algorithm config (PPO: ppo_config or algo_config)."""
  import inspect  # pylint: disable=g-import-not-at-top

  parameters = inspect.signature(learner_cls.__init__).parameters
  return "algo_config" if "algo_config" in parameters else "ppo_config"


def _make_learner(config: RunConfig, cluster: Any) -> Any:
  """The stock Tunix learner of `config.algorithm`, or its Resumable version."""
  stock_cls, config_argument, algo_config = _algorithm(config)
  learner_cls = stock_cls if config.learner == "stock" else _resumable(stock_cls)
  return learner_cls(
      rl_cluster=cluster,
      reward_fns=reward_fn,
      data_shuffle_seed=config.data_shuffle_seed,
      **{config_argument: algo_config},
  )


def _algorithm(config: RunConfig) -> tuple[type, str, Any]:
  """(stock learner class, name of its config argument, algorithm config)."""
  if config.algorithm == "grpo":
    from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top

    return grpo_learner.GRPOLearner, "algo_config", grpo_learner.GRPOConfig(
        num_generations=config.num_generations,
        num_iterations=config.num_iterations,
        beta=config.beta,
    )
  if config.algorithm == "dapo":
    from tunix.rl.grpo import dapo_learner  # pylint: disable=g-import-not-at-top

    return dapo_learner.DAPOLearner, "algo_config", dapo_learner.DAPOConfig(
        num_generations=config.num_generations,
        num_iterations=config.num_iterations,
        overlong_buffer={
            "enable": True, "overlong_buffer_length": 2,
            "overlong_buffer_penalty": 1.0, "max_response_length": 4,
        },
    )
  if config.algorithm == "drgrpo":
    from tunix.rl.grpo import drgrpo_learner  # pylint: disable=g-import-not-at-top

    return drgrpo_learner.DrGRPOLearner, "algo_config", drgrpo_learner.DrGRPOConfig(
        num_generations=config.num_generations,
        num_iterations=config.num_iterations,
        beta=config.beta,
    )
  if config.algorithm == "ppo":
    from tunix.rl.ppo import ppo_learner  # pylint: disable=g-import-not-at-top

    return ppo_learner.PPOLearner, _config_argument(ppo_learner.PPOLearner), ppo_learner.PPOConfig(
        num_iterations=config.num_iterations, beta=config.beta
    )
  raise ValueError(f"algorithm={config.algorithm!r}: expected 'grpo', 'dapo', 'drgrpo' or 'ppo'.")


def _resumable(stock_cls: type) -> type:
  from ckpt_iter import tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top

  ready_made = {
      "DAPOLearner": ckpt_tunix.ResumableDAPOLearner,
      "GRPOLearner": ckpt_tunix.ResumableGRPOLearner,
      "PPOLearner": ckpt_tunix.ResumablePPOLearner,
  }
  if hasattr(ckpt_tunix, "ResumableDrGRPOLearner"):
    ready_made["DrGRPOLearner"] = ckpt_tunix.ResumableDrGRPOLearner
  if stock_cls.__name__ in ready_made:
    return ready_made[stock_cls.__name__]
  # Any other RLLearner subclass resumes exactly through the mixin.
  return type(f"Resumable{stock_cls.__name__}", (ckpt_tunix.Resumable, stock_cls), {})


def make_train_dataset(config: RunConfig) -> Any:
  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top

  import grain  # pylint: disable=g-import-not-at-top

  dataset = dataset_lib.make_dataset(
      load_prompts(config.num_prompts),
      batch_size=config.batch_size,
      seed=config.dataset_seed,
      num_epochs=config.num_epochs,
      shard_index=0,
      shard_count=1,
  )
  if config.batch_sizes:
    return _uneven_batches(config)
  if config.input_kind == "grain":
    return dataset
  if config.input_kind == "map":
    return _hand_built_dataset(config)
  if config.input_kind == "iter":
    return dataset.to_iter_dataset()
  if config.input_kind == "dataloader":
    # As a DataLoader user writes it: records, a seeded sampler, a Batch operation.
    rows = load_prompts(config.num_prompts)
    return grain.DataLoader(
        data_source=rows,
        sampler=grain.samplers.IndexSampler(
            len(rows), shard_options=grain.sharding.NoSharding(),
            shuffle=config.dataset_seed is not None, seed=config.dataset_seed or 0,
            num_epochs=config.num_epochs),
        operations=[grain.transforms.Batch(config.batch_size, drop_remainder=True)],
        worker_count=0,
    )
  if config.input_kind == "iterable":
    return (dataset[index] for index in range(len(dataset)))
  if config.input_kind == "list":
    if config.num_epochs is None:
      raise ValueError("input_kind='list' needs num_epochs (a finite list of batches).")
    return [dataset[index] for index in range(len(dataset))]
  raise ValueError(
      f"input_kind={config.input_kind!r}: expected 'grain', 'map', 'iter', 'dataloader', 'list' or 'iterable'."
  )


def _hand_built_dataset(config: RunConfig) -> Any:
  """The prompts as a user builds them with Grain alone: source, shuffle, repeat, batch."""
  import grain  # pylint: disable=g-import-not-at-top

  rows = load_prompts(config.num_prompts)
  dataset = grain.MapDataset.source(rows)
  if config.dataset_seed is not None:
    dataset = dataset.shuffle(seed=config.dataset_seed)
  dataset = dataset.repeat(config.num_epochs)
  return dataset.batch(config.batch_size, drop_remainder=True)


def _uneven_batches(config: RunConfig) -> list[dict[str, Any]]:
  """A plain list of batches of config.batch_sizes prompts, cycled."""
  prompts = load_prompts(config.num_prompts)
  batches, start, index = [], 0, 0
  while start < len(prompts):
    size = config.batch_sizes[index % len(config.batch_sizes)]
    rows = prompts[start:start + size]
    batches.append({k: np.asarray([r[k] for r in rows]) for k in rows[0]})
    start, index = start + size, index + 1
  return batches


class TrainerInputRecorder:
  """Records every TrainExample the actor is updated on, as numpy arrays."""

  def __init__(self, learner: Any, delay_seconds: float = 0.0):
    self.inputs: list[dict[str, np.ndarray]] = []
    self.train_steps: list[int] = []
    cluster = learner.rl_cluster
    original = cluster.update_actor

    def update_actor(train_ds, eval_ds, skip_jit=False):
      example = train_ds[0]
      self.inputs.append({
          name: np.asarray(getattr(example, name))
          for name in RECORDED_FIELDS
          if getattr(example, name, None) is not None
      })
      self.train_steps.append(int(cluster.actor_trainer.train_steps))
      if delay_seconds:
        time.sleep(delay_seconds)
      return original(train_ds, eval_ds, skip_jit)

    cluster.update_actor = update_actor
    # Where the actor's trainer evaluates (Tunix decides, per update, from its eval input).
    self.eval_steps: list[int] = []
    trainer = cluster.actor_trainer
    run_eval = trainer._run_eval  # pylint: disable=protected-access

    def record_eval(*args, **kwargs):
      self.eval_steps.append(int(trainer.train_steps))
      return run_eval(*args, **kwargs)

    trainer._run_eval = record_eval  # pylint: disable=protected-access

  def save(self, path: str, meta: dict[str, Any]) -> None:
    arrays = {
        f"input{i}_{name}": value
        for i, fields in enumerate(self.inputs)
        for name, value in fields.items()
    }
    meta = dict(meta, num_inputs=len(self.inputs), train_steps=self.train_steps, eval_steps=self.eval_steps)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


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
  restored_step = int(learner.rl_cluster.actor_trainer.train_steps)
  recorder = TrainerInputRecorder(learner, config.trainer_delay_seconds)
  meta: dict[str, Any] = {"config": dataclasses.asdict(config), "restored_step": restored_step}

  def finish(preempted: bool) -> None:
    meta["preempted"] = preempted
    meta["seconds"] = time.perf_counter() - started
    recorder.save(out, meta)

  if preempt_step is not None:
    preempt_after(learner, preempt_step, lambda: finish(True))
  train_kwargs = {}
  if config.learner != "stock":
    train_kwargs["on_legacy_checkpoint"] = config.on_legacy_checkpoint
  eval_ds = None
  if config.with_eval:
    eval_ds = make_eval_dataset(config)
  learner.train(make_train_dataset(config), eval_ds, **train_kwargs)
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


def make_eval_dataset(config: RunConfig) -> Any:
  """Two held-out prompts, one per batch."""
  del config
  return [
      {k: np.asarray([r[k]]) for k in r}
      for r in load_prompts()[-2:]
  ]



def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", required=True, help="absolute checkpoint root")
  parser.add_argument("--out", required=True, help="where to write the recorded inputs (.npz)")
  parser.add_argument("--preempt-after", type=int, default=None)
  parser.add_argument("--config", default="{}", help="RunConfig fields as JSON")
  args = parser.parse_args(argv)
  config = RunConfig(**json.loads(args.config))
  meta = run(config, args.root, args.out, args.preempt_after)
  print(json.dumps({"restored_step": meta["restored_step"], "seconds": round(meta["seconds"], 2)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
