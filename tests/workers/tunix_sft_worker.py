"""One toy SFT training process: stock or Resumable PeftTrainer, killable after checkpoint K.

    python tunix_sft_worker.py --root DIR --out OUT.npz --trainer resumable|stock
        [--grad-acc G] [--max-steps M] [--seed S] [--epochs E] [--preempt-after K]
        [--input-form map|iter_batched] [--vocabulary-file F]

Trains Tunix's ToyTransformer on a Grain MapDataset of token batches (shuffled,
two epochs) with real Orbax checkpoints under DIR, and writes to OUT.npz the
batches given to the train step (in order), the final params, and how many
elements the input pipeline produced (stock resume re-reads what it skips).
With --preempt-after K it dies with os._exit right after checkpoint K is on disk.
"""

from __future__ import annotations

import argparse
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tunix.sft import peft_trainer
from tunix.tests import test_common as tc

from ckpt_iter import _storage
from ckpt_iter.tunix import _api

from ckpt_iter.tunix import ResumablePeftTrainer

PREEMPT_EXIT_CODE = 42
NUM_DISTINCT_BATCHES = 10
BATCH_SHAPE = (2, 16)
_produced = [0]  # elements the pipeline produced, skipped ones included
# A file the tokenization reads (a stand-in for a tokenizer's vocabulary): its
# integer shifts every token id. Changing it changes what the unchanged
# pipeline produces.
_vocabulary_file: list[str | None] = [None]


def _vocabulary_shift() -> int:
  if _vocabulary_file[0] is None:
    return 0
  with open(_vocabulary_file[0]) as f:
    return int(json.load(f))


def _make_batch(index: int) -> peft_trainer.TrainingInput:
  # Unchanged since format 1: its code is in the fixtures' pipeline fingerprint.
  _produced[0] += 1
  size = int(np.prod(BATCH_SHAPE))
  tokens = ((index * 7 + np.arange(size)) % 200 + 1).reshape(BATCH_SHAPE).astype(np.int32)
  return peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(BATCH_SHAPE, np.int32))


def _make_batch_with_vocabulary(index: int) -> peft_trainer.TrainingInput:
  _produced[0] += 1
  size = int(np.prod(BATCH_SHAPE))
  tokens = ((index * 7 + np.arange(size) + _vocabulary_shift()) % 200 + 1).reshape(BATCH_SHAPE).astype(np.int32)
  return peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(BATCH_SHAPE, np.int32))


def make_train_ds(seed: int, epochs: int = 2) -> grain.MapDataset:
  make_batch = _make_batch if _vocabulary_file[0] is None else _make_batch_with_vocabulary
  return (
      grain.MapDataset.range(NUM_DISTINCT_BATCHES).shuffle(seed=seed).repeat(epochs).map(make_batch)
  )


def _make_row(index: int) -> dict[str, np.ndarray]:
  _produced[0] += 1
  width = BATCH_SHAPE[1]
  tokens = ((index * 7 + np.arange(width)) % 200 + 1).astype(np.int32)
  return {"input_tokens": tokens, "input_mask": np.ones(width, np.int32)}


def make_iter_batched_ds(epochs: int = 2) -> grain.IterDataset:
  """Tunix's CLI form: rows batched after `to_iter_dataset()` (Grain's `next_index` counts rows)."""
  rows = NUM_DISTINCT_BATCHES * BATCH_SHAPE[0]
  return (
      grain.MapDataset.range(rows).map(_make_row).repeat(epochs).to_iter_dataset()
      .batch(BATCH_SHAPE[0]).map(lambda batch: peft_trainer.TrainingInput(**batch))
  )


def _gen_model_input(x: peft_trainer.TrainingInput):
  return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": jnp.arange(x.input_tokens.shape[1]),
      "attention_mask": jnp.ones_like(x.input_tokens),
  }


def _recording(base: type) -> type:
  class Recording(base):
    """Records every example given to the train step (not eval: no eval_ds here)."""

    fed: list[np.ndarray] = []

    def _prepare_inputs(self, input_data):
      type(self).fed.append(np.asarray(input_data.input_tokens))
      return super()._prepare_inputs(input_data)

  return Recording


def _maxtext(trainer: str) -> type:
  """MaxText 0.2.5's SFT trainer (`train_sft.MaxTextPeftTrainer`, a Tunix PeftTrainer with its own train
  step), as stock, or with its base made ckpt_iter's (docs/maxtext.md's one-line change, here by the MRO)."""
  from maxtext.trainers.post_train.sft import train_sft  # pylint: disable=g-import-not-at-top

  if trainer == "maxtext_stock":
    return train_sft.MaxTextPeftTrainer
  return type("ResumableMaxTextPeftTrainer", (train_sft.MaxTextPeftTrainer, ResumablePeftTrainer), {})


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--root", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--trainer", choices=("resumable", "stock", "maxtext", "maxtext_stock"), required=True)
  parser.add_argument("--grad-acc", type=int, default=2)
  parser.add_argument("--max-steps", type=int, default=8)
  parser.add_argument("--seed", type=int, default=3)
  parser.add_argument("--preempt-after", type=int, default=None)
  parser.add_argument("--epochs", type=int, default=2, help="passes over the batches")
  parser.add_argument("--input-form", choices=("map", "iter_batched"), default="map")
  parser.add_argument("--vocabulary-file", default=None, help="JSON integer: shifts every token id")
  args = parser.parse_args()
  _vocabulary_file[0] = args.vocabulary_file

  base = {"resumable": ResumablePeftTrainer, "stock": peft_trainer.PeftTrainer}.get(args.trainer) or _maxtext(args.trainer)
  trainer_cls = _recording(base)
  config = peft_trainer.TrainingConfig(
      eval_every_n_steps=1000,
      max_steps=args.max_steps,
      gradient_accumulation_steps=args.grad_acc if args.grad_acc > 1 else None,
      checkpoint_root_directory=_storage.absolute(args.root),
      checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=100),
  )
  model = tc.ToyTransformer(config=tc.ModelConfig(), rngs=nnx.Rngs(0))
  trainer = trainer_cls(model, optax.adamw(1e-2), config).with_gen_model_input_fn(_gen_model_input)
  restored_step = trainer.train_steps

  if args.preempt_after is not None:
    tunix_manager = trainer.checkpoint_manager
    save = tunix_manager.save

    def save_then_maybe_die(step, *a, **kw):
      saved = save(step, *a, **kw)
      if saved and step == args.preempt_after:
        _api.wait_until_saved(tunix_manager)
        os._exit(PREEMPT_EXIT_CODE)
      return saved

    tunix_manager.save = save_then_maybe_die

  if args.input_form == "iter_batched":
    train_ds = make_iter_batched_ds(args.epochs)
  else:
    train_ds = make_train_ds(args.seed, args.epochs)
  trainer.train(train_ds)
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  fed = trainer_cls.fed
  np.savez(
      args.out,
      fed=np.stack(fed) if fed else np.zeros((0, *BATCH_SHAPE), np.int32),
      **{f"param_{i}": np.asarray(p) for i, p in enumerate(params)},
      meta=np.array(json.dumps({
          "restored_step": restored_step,
          "produced": _produced[0],
          "train_steps": trainer.train_steps,
          "iter_steps": trainer.iter_steps,
      })),
  )


if __name__ == "__main__":
  main()
