"""A toy agentic GRPO run on CPU: the workload of `make demo DEMO_ARGS='--learner agentic'`.

Trains Tunix's ToyTransformer with `tunix.rl.agentic.agentic_grpo_learner.GRPOLearner`
(stock) or ckpt_iter's drop-in `ResumableAgenticGRPOLearner` on a Grain MapDataset
of prompts made of MockVocab words, with real Orbax checkpoints under ROOT. It
writes to OUT.npz every input handed to the actor's train step, in order
(prompt ids, completion ids, advantages, old and reference log-probs), how many
inputs each `update_actor` call had, the final params, and the prompt of every
rollout it made. With --preempt-after K it writes the same right after
checkpoint K is on disk (the async save finished) and dies with os._exit, the
way a scheduler kills a job.

    python -m demo.agentic_toyrun --root DIR --out OUT.npz --learner resumable|stock
        [--max-steps M] [--mu MU] [--batch B] [--mini M] [--micro M] [--preempt-after K]

The tests' worker (tests/workers/tunix_agentic_worker.py) runs it with an
`Extension`: more Tunix settings, and hooks into rollouts and saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
from typing import Any, Callable

import numpy as np

PREEMPT_EXIT_CODE = 42
WORDS = ("hello", "world", "input", "string", "there", "My", "name", "is", "Tunix", "library")
NUM_PROMPTS = 16
FIELDS = ("prompt_ids", "completion_ids", "advantages", "old_per_token_logps", "ref_per_token_logps")
MAX_CONCURRENCY = 8  # agent/env pairs rolled out at once (GRPOConfig.max_concurrency)


@dataclasses.dataclass(frozen=True)
class Extension:
  """What a caller adds to the demo's run: Tunix settings and hooks."""

  training_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # more RLTrainingConfig fields
  algo_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # more GRPOConfig fields
  async_rollout: bool = False  # the rollout model on a device of its own, synced per global step
  critic: bool = False  # a critic model in the cluster
  on_rollout: Callable[[str], None] | None = None  # called with a rollout's prompt before it runs
  on_save: Callable[[], None] | None = None  # called as each checkpoint save begins


class ChatParser:
  """Minimal chat parser (contents may arrive as numpy strings)."""

  assistant_token = "Assistant:"

  def parse(self, messages, add_generation_prompt=False, is_first_msg=False):
    del is_first_msg
    text = " ".join(_text(m["content"]) for m in messages)
    return text + (" " if add_generation_prompt else "")

  def update_assistant_end_tokens(self, tokens):
    # Tunix main calls it on each assistant turn: (tokens, how many appended).
    return tokens, 0


def _text(content) -> str:
  if isinstance(content, np.ndarray):  # a prompt arrives as a 1-element array
    content = content.reshape(-1)[0] if content.size else ""
  return f"{content}"


def prompt_text(index: int) -> str:
  """Two MockVocab words, distinct for every index below 100."""
  # The second word's offset grows with each ten, so prompt 10 is not prompt 0
  # again (the demo names prompts by their tokens); indices 0-9 are unchanged.
  return f"{WORDS[index % len(WORDS)]} {WORDS[(index * 3 + 1 + index // 10) % len(WORDS)]}"


def prompt_label(index: int) -> str:
  """A, B, ... for prompts 0, 1, ...: the names the demo prints."""
  return chr(ord("A") + index) if index < 26 else f"#{index}"


def make_train_ds(batch_size: int) -> Any:
  import grain  # pylint: disable=g-import-not-at-top

  return (
      grain.MapDataset.range(NUM_PROMPTS)
      .map(lambda i: {"prompts": prompt_text(int(i)), "label": np.int32(i)})
      .batch(batch_size)
  )


def reward_fn(prompts, completions, **kwargs):
  del prompts, kwargs
  return [float(len(str(c)) % 5) for c in completions]


def load_record(path: str) -> dict[str, Any]:
  """What a run wrote: {"inputs": [per-input arrays], "meta": {...}, "params": [arrays]}."""
  with np.load(path) as data:
    meta = json.loads(str(data["meta"]))
    inputs = [
        {f: data[f"{i}/{f}"] for f in FIELDS if f"{i}/{f}" in data.files} for i in range(meta["num_inputs"])
    ]
    params = [data[f"param_{i}"] for i in range(sum(k.startswith("param_") for k in data.files))]
  return {"inputs": inputs, "meta": meta, "params": params}


def input_labels(prompt_ids: np.ndarray) -> list[str]:
  """The prompts ("A", "B", ...) of a trainer input's rows, consecutive repeats merged."""
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  return toyrun.label_rows(prompt_ids, {prompt_text(i): prompt_label(i) for i in range(NUM_PROMPTS)})


def parser() -> argparse.ArgumentParser:
  """The run's command line (the tests' worker adds its options to it)."""
  parser_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser_.add_argument("--root", required=True)
  parser_.add_argument("--out", required=True)
  parser_.add_argument("--learner", choices=("resumable", "stock"), required=True)
  parser_.add_argument("--max-steps", type=int, default=6)
  parser_.add_argument("--mu", type=int, default=2)
  parser_.add_argument("--batch", type=int, default=2)
  parser_.add_argument("--mini", type=int, default=2)
  parser_.add_argument("--micro", type=int, default=1)
  parser_.add_argument("--preempt-after", type=int, action="append", default=[])
  return parser_


def run(args: argparse.Namespace, extension: Extension | None = None) -> None:
  """Trains (resuming from args.root if it holds checkpoints) and writes args.out."""
  extension = extension or Extension()
  # pylint: disable=g-import-not-at-top
  import jax
  import optax
  from flax import nnx
  from tunix.rl.agentic import agentic_grpo_learner

  from demo import toyrun
  from ckpt_iter.tunix import _api
  # pylint: enable=g-import-not-at-top

  if args.learner == "resumable":
    from ckpt_iter.tunix import ResumableAgenticGRPOLearner as base  # pylint: disable=g-import-not-at-top
  else:
    base = agentic_grpo_learner.GRPOLearner

  cluster = toyrun.toy_cluster(
      os.path.abspath(args.root), with_drop_ins=args.learner == "resumable", tokenizer_adapter=True,
      training_options={
          "actor_optimizer": optax.adamw(1e-2), "max_steps": args.max_steps,
          "mini_batch_size": args.mini, "train_micro_batch_size": args.micro,
          "checkpointing_options": toyrun.explicit_checkpointing(1, max_to_keep=100),
          **extension.training_options,
      },
      rollout_options={"return_logprobs": True, "temperature": 0.9},
      async_rollout=extension.async_rollout, critic=extension.critic,
  )
  generate = cluster.generate
  rollout_generate = cluster.rollout.generate
  pair_seed = threading.local()

  def seeded_rollout_generate(prompts, rollout_config, **kw):
    # Tunix samples every call with the same key, so the 2 generations of a
    # prompt would be identical (zero advantages, no learning). Key each
    # rollout by (prompt, generation) instead: still deterministic.
    seed = getattr(pair_seed, "value", None)
    if seed is not None:
      rollout_config = dataclasses.replace(rollout_config, seed=jax.random.PRNGKey(seed))
    return rollout_generate(prompts, rollout_config, **kw)

  cluster.rollout.generate = seeded_rollout_generate

  rolled: list[str] = []  # the prompt of every rollout this process made
  # Tunix runs the agent/env pairs on a thread pool (max_concurrency), and
  # each calls the rollout model. Its vanilla sampler is not safe to call
  # from several threads at once: on CPU a process died of SIGSEGV inside
  # concurrent generate calls (CI, 0.1.7 and main alike). Rollouts stay
  # concurrent; the model call itself runs one at a time.
  generate_lock = threading.Lock()

  def short_generate(prompts, *a, max_generation_steps=None, **kw):
    # The toy model rarely emits EOS: a rollout that fills the whole response
    # budget is recorded with an empty completion, so stop one token short.
    del max_generation_steps
    rolled.extend([prompts] if isinstance(prompts, str) else [str(p) for p in prompts])
    if extension.on_rollout:
      extension.on_rollout(str(prompts))
    tags = kw.get("trace_tags") or {}
    pair_seed.value = 1000 * int(tags.get("group_id", 0)) + int(tags.get("pair_index", 0))
    try:
      with generate_lock:
        return generate(prompts, *a, max_generation_steps=3, **kw)
    finally:
      pair_seed.value = None

  cluster.generate = short_generate
  fed: list[dict[str, np.ndarray]] = []
  calls: list[int] = []  # trainer inputs per update_actor call, in order
  update_actor = cluster.update_actor

  class Recorded(list):
    """The call's inputs, each recorded when the trainer takes it: a kill
    inside a multi-input call (main's replay) leaves the rest unrecorded."""

    def __iter__(self):
      for example in super().__iter__():
        fed.append({f: np.asarray(getattr(example, f)) for f in FIELDS if getattr(example, f) is not None})
        yield example

  def recording_update_actor(batches, *a, **kw):
    calls.append(len(batches))
    return update_actor(Recorded(batches), *a, **kw)

  cluster.update_actor = recording_update_actor
  learner = base(
      rl_cluster=cluster,
      algo_config=agentic_grpo_learner.GRPOConfig(
          num_generations=2, num_iterations=args.mu, beta=0.04, max_response_length=4,
          **{"max_concurrency": MAX_CONCURRENCY, **extension.algo_options}),
      reward_fns=reward_fn, chat_parser=ChatParser(),
  )
  restored = {"train_steps": int(cluster.actor_trainer.train_steps),
              "global_steps": int(cluster.global_steps)}

  def dump() -> None:
    arrays = {}
    for i, x in enumerate(fed):
      for f, v in x.items():
        arrays[f"{i}/{f}"] = v
    # The trainer's model: Tunix trains a copy of `actor` (the object passed in
    # keeps its initial weights), so read the weights where the updates land.
    params = jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param))
    arrays.update({f"param_{i}": np.asarray(p) for i, p in enumerate(params)})
    np.savez(args.out, meta=np.array(json.dumps({
        "restored": restored, "num_inputs": len(fed), "rolled": rolled, "calls": calls,
        "train_steps": int(cluster.actor_trainer.train_steps),
        "global_steps": int(cluster.global_steps)})), **arrays)

  if args.preempt_after or extension.on_save:
    tunix_manager = cluster.actor_trainer.checkpoint_manager
    save = tunix_manager.save

    def save_then_maybe_die(step, *a, **kw):
      if extension.on_save:
        extension.on_save()
      saved = save(step, *a, **kw)
      if saved and step in args.preempt_after:
        _api.wait_until_saved(tunix_manager)
        dump()  # what this process trained, for the caller to compare
        sys.stdout.flush()
        os._exit(PREEMPT_EXIT_CODE)  # pylint: disable=protected-access
      return saved

    tunix_manager.save = save_then_maybe_die

  learner.train(make_train_ds(args.batch))
  dump()
  # Tunix runs the learner's asyncio loop on a daemon thread it never stops;
  # stop it, so the interpreter does not tear down under a running loop.
  learner.loop.call_soon_threadsafe(learner.loop.stop)


def main(argv: list[str] | None = None) -> int:
  run(parser().parse_args(argv))
  return 0


if __name__ == "__main__":
  sys.exit(main())
