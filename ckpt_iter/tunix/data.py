"""A `data_module` for Tunix's YAML configs, built with ckpt_iter.

Tunix's CLI (`tunix/cli/grpo_main.py`, `peft_main.py`) imports the module
named by `data_module` and calls `create_dataset(**data_config)`, which must
return a `grain.MapDataset` of records; Tunix then filters, batches and
(`num_train_epochs`) repeats it. Name this module there:

    data_module: "ckpt_iter.tunix.data"
    data_config:
      source: "/data/prompts-*.jsonl"   # .jsonl, .parquet or .array_record
      seed: 0                            # a new permutation every epoch
      num_epochs: 3                      # leave Tunix's num_train_epochs at 1
      prompt_key: "question"             # the field that holds the prompt

or a Hugging Face dataset (`source: hf`, with `path`, `split`, optionally
`name`, `data_files`, `cache_dir`; a `save_to_disk` directory as `path` works).

The result is a MapDataset, so a Resumable learner or trainer restores its
position in O(1).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from ckpt_iter import dataset as dataset_lib
from ckpt_iter import errors
from ckpt_iter import sources as sources_lib

PROMPTS = "prompts"
HF_SOURCE = "hf"
_HF_FIELDS = ("path", "split", "name", "data_files", "cache_dir")


class _Record:
  """Batch of one (from make_dataset) -> the record, with the prompt renamed.

  A class, not a closure: its name and prompt key are what the pipeline's
  fingerprint records, and it pickles for Grain's worker processes.
  """

  def __init__(self, prompt_key: str | None, output_prompt_key: str):
    self.prompt_key = prompt_key
    self.output_prompt_key = output_prompt_key

  def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
    record = {name: _first(value) for name, value in batch.items()}
    if self.prompt_key is not None and self.prompt_key != self.output_prompt_key:
      if self.prompt_key not in record:
        raise errors.InvalidArgumentError(
            f"prompt_key={self.prompt_key!r} is not a field of the records; they "
            f"have {sorted(record)}. Set data_config.prompt_key to one of them."
        )
      record[self.output_prompt_key] = record.pop(self.prompt_key)
    return record

  def __repr__(self) -> str:
    return f"_Record(prompt_key={self.prompt_key!r}, output_prompt_key={self.output_prompt_key!r})"


def _first(value: Any) -> Any:
  return value[0] if isinstance(value, np.ndarray) and value.ndim else value


def create_dataset(
    source: Any,
    *,
    seed: int | None = None,
    num_epochs: int | None = 1,
    prompt_key: str | None = None,
    output_prompt_key: str = PROMPTS,
    shard_index: int | None = None,
    shard_count: int | None = None,
    path: str | None = None,
    split: str | None = None,
    name: str | None = None,
    data_files: Any = None,
    cache_dir: str | None = None,
    shuffle: str = "global",
    shuffle_window: int | None = None,
    shard_size: int | None = None,
    shard_lanes: int | None = None,
    **unknown: Any,
) -> grain.MapDataset:
  """The records of `source`, shuffled per epoch, as a Tunix data_module dataset.

  Args:
    source: a path, glob or list of paths to `.jsonl`, `.parquet` or
      `.array_record` files (read lazily), a list of record dicts, or "hf"
      for a Hugging Face dataset named by the arguments below.
    seed: shuffle seed; every epoch is a different permutation. None: the
      source order.
    num_epochs: passes over the source; None repeats forever.
    prompt_key: the record field that holds the prompt; it is renamed to
      `output_prompt_key`. None: records are passed as they are.
    output_prompt_key: the name Tunix reads prompts from (its `prompt_key`,
      "prompts" by default).
    shard_index: this process's shard; defaults to `jax.process_index()`.
    shard_count: number of shards; defaults to `jax.process_count()`.
    path: with source "hf": the dataset's Hub name, a local dataset folder, a
      builder ("json", "parquet", ... with data_files), or a directory
      written by `save_to_disk`.
    split: with source "hf": the split (needed when there are several).
    name: with source "hf": the dataset configuration.
    data_files: with source "hf": load_dataset's data_files.
    cache_dir: with source "hf": load_dataset's cache directory.
    shuffle, shuffle_window, shard_size, shard_lanes: make_dataset's:
      "shards" reads whole shards (files, or blocks of shard_size records),
      shuffle_window of them at a time; shard_lanes (the process count, which
      is this dataset's global batch) has each host read its share of the
      shards (docs/datasets.md).
    **unknown: refused, with the accepted names (a YAML typo fails loudly).

  Returns:
    A `grain.MapDataset` of record dicts (numpy scalars and strings). Element
    e * N + i (N records per shard and epoch) is record i of epoch e's
    permutation, so the position of a resumed run is one index.

  Raises:
    InvalidArgumentError: an argument is invalid; the message names it.
  """
  if unknown:
    raise errors.InvalidArgumentError(
        f"data_config has unknown field(s) {sorted(unknown)}; create_dataset accepts "
        "source, seed, num_epochs, prompt_key, output_prompt_key, shard_index, shard_count, shuffle, "
        f"shuffle_window, shard_size, shard_lanes and, with source: {HF_SOURCE}, {', '.join(_HF_FIELDS)}."
    )
  hf_arguments = {"path": path, "split": split, "name": name, "data_files": data_files, "cache_dir": cache_dir}
  if source == HF_SOURCE:
    if path is None:
      raise errors.InvalidArgumentError(
          f"source: {HF_SOURCE} needs path: the dataset's name, folder or save_to_disk directory."
      )
    source = sources_lib.HuggingFaceSource(**hf_arguments)
  else:
    given = sorted(k for k, v in hf_arguments.items() if v is not None)
    if given:
      raise errors.InvalidArgumentError(
          f"data_config field(s) {given} apply to source: {HF_SOURCE} only; source is {source!r}."
      )
  if prompt_key is not None and not isinstance(prompt_key, str):
    raise errors.InvalidArgumentError(f"prompt_key={prompt_key!r} must be a field name (a string) or None.")
  batches = dataset_lib.make_dataset(
      source, batch_size=1, seed=seed, num_epochs=num_epochs,
      shard_index=shard_index, shard_count=shard_count,
      shuffle=shuffle, shuffle_window=shuffle_window, shard_size=shard_size, shard_lanes=shard_lanes,
  )
  return batches.map(_Record(prompt_key, output_prompt_key))
