"""The tests' toy Tunix RL run: the demo's toy (demo.toyrun) and every setting the tests vary.

On top of the demo's GRPO run it adds the learners (GRPO, DAPO, DrGRPO, PPO
with a critic), the pipeline forms a user passes to `train()`, uneven
batches, epochs, sequence packing, evaluation, async rollout, Tunix's default
checkpoint policy, algorithm settings a resume may change, and a slower
trainer. Each run records every trainer input and its final weights' digest.

Run one in a process of its own (what tunix_harness.run_toy does):
    python tunix_toy.py --root /abs/dir --out run.npz --config '{"learner": "stock", "algorithm": "ppo"}'
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np

from demo import toyrun


WORKER = __file__


@dataclasses.dataclass
class RunConfig(toyrun.RunConfig):
  """The demo's run settings, and the ones only tests vary."""

  algorithm: str = "grpo"  # "grpo", "dapo", "drgrpo" or "ppo"
  dataset_seed: int | None = None
  eval_every_n_steps: int = 1000
  with_eval: bool = False
  on_legacy_checkpoint: str = "raise"
  # Sleeps before each actor update: a slower trainer lets the producer
  # thread run ahead (async rollout), the case a save must not be fooled by.
  trainer_delay_seconds: float = 0.0
  # The same batches in several forms. "grain": make_dataset's MapDataset;
  # "map": a MapDataset built by hand with Grain's own methods; "iter": the
  # make_dataset pipeline `.to_iter_dataset()`; "iter_batched": "map" batched
  # after `.to_iter_dataset()` (Tunix's CLI form); "dataloader": a
  # grain.DataLoader over it; "list": a list of the batches; "iterable": a
  # one-shot generator of them (the last two restored by replay); "hf_stream": the prompts as a
  # Hugging Face streaming IterableDataset, one pass, through ckpt_iter.StreamingIterator.
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
  # Stream records the make_dataset input skips ([start, stop) ranges), declared in this run only.
  skip: list[list[int]] | None = None


def build_learner(config: RunConfig, root: str) -> Any:
  """Builds RLCluster and the learner of `config` with its checkpoints in `root`."""
  return make_learner(config, build_cluster(config, root))


def build_cluster(config: RunConfig, root: str) -> Any:
  """The RLCluster of `config` with its checkpoints in `root`."""
  import optax  # pylint: disable=g-import-not-at-top

  training = {
      "eval_every_n_steps": config.eval_every_n_steps,
      "max_steps": config.max_steps,
      "mini_batch_size": config.mini_batch_size,
      "train_micro_batch_size": config.train_micro_batch_size,
      "checkpointing_options": _checkpointing_options(config),
  }
  if config.learning_rate is not None:
    training["actor_optimizer"] = optax.inject_hyperparams(optax.sgd)(learning_rate=config.learning_rate)
  if config.max_seq_token_per_tpu is not None:  # only the options set: a default run builds the stock config
    training["max_seq_token_per_tpu"] = config.max_seq_token_per_tpu
  rollout = {} if config.temperature is None else {"temperature": config.temperature}
  return toyrun.toy_cluster(
      root, with_drop_ins=config.learner != "stock", training_options=training, rollout_options=rollout,
      async_rollout=config.async_rollout, critic=config.algorithm == "ppo")


def _checkpointing_options(config: RunConfig) -> Any:
  if config.checkpointing == "default":
    return None
  if config.checkpointing == "explicit":
    return toyrun.explicit_checkpointing(config.save_interval_steps)
  raise ValueError(f"checkpointing={config.checkpointing!r}: expected 'explicit' or 'default'.")


def _config_argument(learner_cls: type) -> str:
  """The name this Tunix gives the algorithm config (PPO: ppo_config or algo_config)."""
  import inspect  # pylint: disable=g-import-not-at-top

  parameters = inspect.signature(learner_cls.__init__).parameters
  return "algo_config" if "algo_config" in parameters else "ppo_config"


def make_learner(config: RunConfig, cluster: Any) -> Any:
  """The stock Tunix learner of `config.algorithm`, or its Resumable version, on `cluster`."""
  stock_cls, config_argument, algo_config = _algorithm(config)
  learner_cls = stock_cls if config.learner == "stock" else _resumable(stock_cls)
  return learner_cls(
      rl_cluster=cluster,
      reward_fns=toyrun.reward_fn,
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
  """The prompts in the form `config.input_kind` names."""
  import grain  # pylint: disable=g-import-not-at-top

  from ckpt_iter import dataset as dataset_lib  # pylint: disable=g-import-not-at-top

  dataset = dataset_lib.make_dataset(
      toyrun.load_prompts(config.num_prompts),
      batch_size=config.batch_size,
      seed=config.dataset_seed,
      num_epochs=config.num_epochs,
      shard_index=0,
      shard_count=1,
      skip=[tuple(r) for r in config.skip] if config.skip else None,
  )
  if config.batch_sizes:
    return _uneven_batches(config)
  if config.input_kind == "grain":
    return dataset
  if config.input_kind in ("map", "iter_batched"):
    return _hand_built_dataset(config)
  if config.input_kind == "maxtext_rl":
    return _maxtext_rl_dataset(config)
  if config.input_kind == "iter":
    return dataset.to_iter_dataset()
  if config.input_kind == "dataloader":
    # As a DataLoader user writes it: records, a seeded sampler, a Batch operation.
    rows = toyrun.load_prompts(config.num_prompts)
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
  if config.input_kind == "hf_stream":
    import datasets  # pylint: disable=g-import-not-at-top

    import ckpt_iter  # pylint: disable=g-import-not-at-top
    rows = toyrun.load_prompts(config.num_prompts)
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=2)
    return ckpt_iter.StreamingIterator(stream, batch_size=config.batch_size)
  if config.input_kind == "list":
    if config.num_epochs is None:
      raise ValueError("input_kind='list' needs num_epochs (a finite list of batches).")
    return [dataset[index] for index in range(len(dataset))]
  raise ValueError(
      f"input_kind={config.input_kind!r}: expected 'grain', 'map', 'iter', 'iter_batched', 'maxtext_rl', "
      "'dataloader', 'list', 'iterable' or 'hf_stream'."
  )


def _hand_built_dataset(config: RunConfig) -> Any:
  """The prompts as a user builds them with Grain alone: source, shuffle, repeat, batch."""
  import grain  # pylint: disable=g-import-not-at-top

  rows = toyrun.load_prompts(config.num_prompts)
  dataset = grain.MapDataset.source(rows)
  if config.dataset_seed is not None:
    dataset = dataset.shuffle(seed=config.dataset_seed)
  dataset = dataset.repeat(config.num_epochs)
  if config.input_kind == "iter_batched":
    # Tunix's CLI form: batched after to_iter_dataset (Grain's next_index counts rows).
    return dataset.to_iter_dataset().batch(config.batch_size, drop_remainder=True)
  return dataset.batch(config.batch_size, drop_remainder=True)


def _maxtext_rl_dataset(config: RunConfig) -> Any:
  """The prompts as MaxText 0.2.5's RL trainer builds them (`train_rl.prepare_datasets`): a shuffled source,
  each row processed, long prompts filtered out, the first rows kept, repeated, batched after
  `to_iter_dataset`."""
  import grain  # pylint: disable=g-import-not-at-top

  rows = toyrun.load_prompts(config.num_prompts)
  dataset = (grain.MapDataset.source(rows).shuffle(seed=config.dataset_seed or 0)
             .map(dict)  # MaxText's process_data: a new dict per row
             .filter(lambda x: len(str(x)) < 10_000))  # its long-prompt filter (none is long here)
  dataset = dataset[:config.num_prompts].repeat(config.num_epochs)
  return dataset.to_iter_dataset().batch(config.batch_size, drop_remainder=True)


def _uneven_batches(config: RunConfig) -> list[dict[str, Any]]:
  """A plain list of batches of config.batch_sizes prompts, cycled."""
  prompts = toyrun.load_prompts(config.num_prompts)
  batches, start, index = [], 0, 0
  while start < len(prompts):
    size = config.batch_sizes[index % len(config.batch_sizes)]
    rows = prompts[start:start + size]
    batches.append({k: np.asarray([r[k] for r in rows]) for k in rows[0]})
    start, index = start + size, index + 1
  return batches


def make_eval_dataset() -> list[dict[str, np.ndarray]]:
  """Two held-out prompts, one per batch."""
  return [{k: np.asarray([r[k]]) for k in r} for r in toyrun.load_prompts()[-2:]]


def run(config: RunConfig, root: str, out: str, preempt_step: int | None = None) -> dict[str, Any]:
  """Trains (resuming from `root` if it holds checkpoints) and records inputs."""
  started = time.perf_counter()
  learner = build_learner(config, root)
  return toyrun.record_training(
      learner, make_train_dataset(config), make_eval_dataset() if config.with_eval else None, out,
      {"config": dataclasses.asdict(config)}, started, preempt_step,
      train_kwargs={} if config.learner == "stock" else {"on_legacy_checkpoint": config.on_legacy_checkpoint},
      trainer_delay_seconds=config.trainer_delay_seconds,
  )


if __name__ == "__main__":
  sys.exit(toyrun.main(config_type=RunConfig, run_one=run))
