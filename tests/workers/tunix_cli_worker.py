"""Runs `ckpt-iter train ...` (Tunix's own YAML pipeline) on the toy model, in this process.

    python tunix_cli_worker.py --out OUT.npz [--preempt-after K] [--stock] -- grpo CONFIG.yaml [key=value ...]

Everything after `--` goes to the `ckpt-iter` command line unchanged
(`ckpt_iter.__main__.main(["train", ...])`); with --stock to Tunix's own
`python -m tunix.cli.grpo_main CONFIG.yaml ...` instead (stock classes). Tunix's pipeline loads real
models and tokenizers by name; here `tunix.cli.utils.model.create_model` and
`create_tokenizer`, which the pipeline calls to load them, return Tunix's toy
transformer and vocabulary instead (the same ones as demo.toyrun).
Everything else is the pipeline's: config loading and overrides, meshes,
rollout and training configs, the data_module dataset, reward functions, the
learner it builds, Orbax checkpoints on disk.

Recorded in OUT.npz: every trainer input (TrainExample given to the actor
update), the class of the learner whose `train` ran, and whether the module
attributes the entry point swapped hold Tunix's classes again afterwards.
With --preempt-after K the process dies with os._exit right after
checkpoint K is on disk, as a preempted job does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

PREEMPT_EXIT_CODE = 42

# The toy pipeline's config: every section Tunix's GRPO pipeline reads, for
# the toy model on one CPU device. The tests write it as YAML.
TOY_MESH = {"shape": "(1,1)", "axis_names": "('fsdp','tp')"}


def grpo_config(root: str, data: Any, **changes: Any) -> dict[str, Any]:
  """A complete GRPO pipeline config for the toy model; `changes` replace top-level keys."""
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  model = {"model_name": "toy", "model_id": "toy", "model_source": "internal", "mesh": dict(TOY_MESH),
           "model_display": False}
  config = {
      "model_config": model,
      # Reference and rollout have no section: they share the actor's mesh
      # (a section would inherit model_config's mesh and ask for a device of its own).
      "actor_model_config": dict(model),
      "tokenizer_config": {"tokenizer_type": "sentencepiece", "tokenizer_path": "/toy/tokenizer.model",
                           "add_bos": True, "add_eos": False},
      "data_module": "ckpt_iter.tunix.data",
      "data_config": {"source": data, "seed": 0, "num_epochs": 2},
      "apply_chat_template_to_dataset": False,
      "prompt_key": "prompts",
      "batch_size": 2,
      "num_batches": None,
      "num_train_epochs": 1,
      "train_fraction": 1.0,
      "training_mode": "grpo",
      "reward_functions": ["tunix_cli_rewards"],
      "verl_compatible": False,
      "rollout_engine": "vanilla",
      "offload_to_cpu": False,
      "rollout_config": {"total_generation_steps": 4, "max_prompt_length": 8, "temperature": 0.9,
                         "return_logprobs": toyrun.sampler_logprobs_needed()},
      "grpo_config": {"num_generations": 2, "num_iterations": 2, "beta": 0.04},
      "rl_training_config": {
          "actor_optimizer_config": {"opt_type": "sgd", "learning_rate": 0.01},
          "eval_every_n_steps": 1000,
          "max_steps": 6,
          "mini_batch_size": 2,
          "train_micro_batch_size": 1,
          "checkpoint_root_directory": root,
          "checkpointing_options": {"save_interval_steps": 1, "max_to_keep": 100},
      },
  }
  config.update(changes)
  return config


def _install_flat_mesh_allocator() -> None:
  """Gives each mesh the next devices in order.

  Tunix's allocator (`tunix.utils.mesh.allocate_named_mesh_device_slices`,
  0.1.7 and main) requires device coordinates, which CPU devices do not
  have, so the stock RL pipelines cannot build a mesh on the CPU backend.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from tunix.utils import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  def allocate(mesh_requirements, devices=None, allocation_policy=None):
    del allocation_policy
    pool = list(jax.devices() if devices is None else devices)
    allocated, start = {}, 0
    for name, count in mesh_requirements:
      if start + count > len(pool):
        raise ValueError(f"{name} needs {count} devices; {len(pool) - start} are left")
      allocated[name] = pool[start:start + count]
      start += count
    return allocated

  mesh_lib.allocate_named_mesh_device_slices = allocate


def _install_toy_model() -> None:
  """The pipeline's model and tokenizer loaders return Tunix's toy ones."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.cli.utils import model as model_lib  # pylint: disable=g-import-not-at-top
  from tunix.generate import tokenizer_adapter  # pylint: disable=g-import-not-at-top
  from tunix.tests import test_common as tc  # pylint: disable=g-import-not-at-top

  def create_model(model_config, tokenizer_config, mesh, *args, **kwargs):
    del model_config, mesh, args, kwargs
    vocab_size = tc.MockVocab().GetPieceSize()
    return tc.ToyTransformer(config=tc.ModelConfig(vocab_size=vocab_size), rngs=nnx.Rngs(0)), \
        tokenizer_config["tokenizer_path"]

  def create_tokenizer(*args, **kwargs):
    del args, kwargs
    # Tunix's loader returns a tokenizer_adapter.Tokenizer, an adapter too.
    return tokenizer_adapter.TokenizerAdapter(tc.MockVocab())

  model_lib.create_model = create_model
  model_lib.create_tokenizer = create_tokenizer


class _Recorder:
  """Trainer inputs and the learner class, observed at Tunix's class level."""

  def __init__(self):
    from demo import toyrun  # pylint: disable=g-import-not-at-top
    from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
    from tunix.rl import rl_learner  # pylint: disable=g-import-not-at-top

    self.inputs: list[dict[str, np.ndarray]] = []
    self.learners: list[str] = []
    self.restored_steps: list[int] = []
    recorder = self
    update_actor = rl_cluster_lib.RLCluster.update_actor
    train = rl_learner.RLLearner.train

    def recording_update_actor(cluster, train_ds, eval_ds, skip_jit=False):
      example = train_ds[0]
      recorder.inputs.append({
          name: np.asarray(getattr(example, name))
          for name in toyrun.RECORDED_FIELDS
          if getattr(example, name, None) is not None
      })
      return update_actor(cluster, train_ds, eval_ds, skip_jit)

    def recording_train(learner, *args, **kwargs):
      recorder.learners.append(f"{type(learner).__module__}.{type(learner).__qualname__}")
      recorder.restored_steps.append(int(learner.rl_cluster.actor_trainer.train_steps))
      return train(learner, *args, **kwargs)

    rl_cluster_lib.RLCluster.update_actor = recording_update_actor
    rl_learner.RLLearner.train = recording_train

  def save(self, path: str, meta: dict[str, Any]) -> None:
    import json  # pylint: disable=g-import-not-at-top

    arrays = {f"input{i}_{k}": v for i, fields in enumerate(self.inputs) for k, v in fields.items()}
    meta = dict(meta, num_inputs=len(self.inputs), learners=self.learners, restored_steps=self.restored_steps)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def _preempt_after(step: int, on_preempt: Any) -> None:
  """Dies right after Tunix's CheckpointManager has written checkpoint `step`."""
  from tunix.sft import checkpoint_manager  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _api  # pylint: disable=g-import-not-at-top

  save = checkpoint_manager.CheckpointManager.save

  def save_then_maybe_die(manager, train_step, *args, **kwargs):
    saved = save(manager, train_step, *args, **kwargs)
    if saved and train_step == step:
      _api.wait_until_saved(manager)
      on_preempt()
      sys.stdout.flush()
      os._exit(PREEMPT_EXIT_CODE)  # pylint: disable=protected-access
    return saved

  checkpoint_manager.CheckpointManager.save = save_then_maybe_die


def _swapped_names_restored() -> bool:
  from tunix.rl.agentic import agentic_grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.sft import peft_trainer  # pylint: disable=g-import-not-at-top

  return (
      grpo_learner.GrpoLearner is grpo_learner.GRPOLearner
      and agentic_grpo_learner.GRPOLearner.__module__ == agentic_grpo_learner.__name__
      and peft_trainer.PeftTrainer.__module__ == peft_trainer.__name__
  )


def _run_stock(command: list[str]) -> int:
  """`python -m tunix.cli.<pipeline>_main CONFIG.yaml ...`, as a user runs it without ckpt_iter."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  from ckpt_iter.tunix import _api  # pylint: disable=g-import-not-at-top

  pipeline, _ = _api.cli_pipeline(command[0])
  flags.FLAGS([pipeline.__name__])  # what absl.app.run does before main
  pipeline.main([pipeline.__name__, *command[1:]])
  return 0


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--preempt-after", type=int, default=None)
  parser.add_argument("--stock", action="store_true", help="run Tunix's own command, not ckpt-iter train")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the `ckpt-iter train` arguments")
  args = parser.parse_args()
  command = args.command[1:] if args.command[:1] == ["--"] else args.command

  _install_flat_mesh_allocator()
  _install_toy_model()
  recorder = _Recorder()
  if args.preempt_after is not None:
    _preempt_after(args.preempt_after, lambda: recorder.save(args.out, {"preempted": True}))
  if args.stock:
    code = _run_stock(command)
  else:
    from ckpt_iter import __main__ as entry  # pylint: disable=g-import-not-at-top

    code = entry.main(["train", *command])
  recorder.save(args.out, {"preempted": False, "exit_code": code, "restored": _swapped_names_restored()})
  return code


if __name__ == "__main__":
  sys.exit(main())
