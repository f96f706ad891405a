"""MaxText's pretraining input with ckpt_iter's iterator, killed and resumed (`make demo-maxtext`).

Runs in the MaxText venv (`make test-maxtext` builds it), one process on CPU:

    .venv-maxtext/bin/python -m demo.maxtext_pretrain --workdir /tmp/mt --steps 4 --kill
    .venv-maxtext/bin/python -m demo.maxtext_pretrain --workdir /tmp/mt --steps 4

The first run trains steps 0-3, saving each through MaxText's own
`save_checkpoint`, trains step 4 and is SIGKILLed before saving it; the
second restores step 3 through MaxText's `load_state_if_possible` and trains
step 4 again, the same batch, then 5-7. Each step prints the records packed
into its global batch (MaxText's tokenizer decodes them). The only change to
MaxText is the train iterator's constructor (docs/maxtext.md).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path

import numpy as np

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _corpus(directory: Path) -> None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  directory.mkdir(parents=True, exist_ok=True)
  for f in range(3):
    rows = [{"text": f"record {f * 1000 + i} " + " ".join(WORDS[: (i * 7 + f) % 10 + 1])} for i in range(400)]
    pq.write_table(pa.Table.from_pylist(rows), directory / f"train-{f}.parquet")


def _records(batch, tokenizer) -> list[list[int]]:
  """Each row's records, in order, decoded from its segments."""
  rows = []
  for tokens, segments in zip(np.asarray(batch["inputs"]), np.asarray(batch["inputs_segmentation"])):
    texts = [tokenizer.decode([int(t) for t in tokens[segments == s]]) for s in sorted(set(segments[segments > 0]))]
    rows.append([int(re.search(r"record (\d+)", text).group(1)) for text in texts])
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--steps", type=int, default=4, help="steps to train and save in this run")
  parser.add_argument("--kill", action="store_true", help="train one more step, then SIGKILL before saving it")
  args = parser.parse_args()
  workdir = Path(args.workdir)
  if not (workdir / "data").exists():
    _corpus(workdir / "data")

  import maxtext  # pylint: disable=g-import-not-at-top
  from maxtext.common import checkpointing  # pylint: disable=g-import-not-at-top
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  from maxtext.input_pipeline import data_processing_utils  # pylint: disable=g-import-not-at-top
  from maxtext.input_pipeline import input_pipeline_interface  # pylint: disable=g-import-not-at-top
  from maxtext.utils import maxtext_utils  # pylint: disable=g-import-not-at-top

  from ckpt_iter import maxtext as ckpt_iter_maxtext  # pylint: disable=g-import-not-at-top

  # The one change: MaxText builds its train iterator with ckpt_iter's constructor.
  input_pipeline_interface.make_grain_train_iterator = ckpt_iter_maxtext.make_grain_train_iterator

  package = Path(maxtext.__file__).parent
  config = pyconfig.initialize([
      None, str(package / "configs" / "base.yml"), "run_name=demo", f"base_output_directory={workdir}/out",
      "dataset_type=grain", f"grain_train_files={workdir}/data/*.parquet", "grain_file_type=parquet",
      "per_device_batch_size=4", "max_target_length=32", "packing=true", "grain_worker_count=0",
      f"tokenizer_path={package / 'assets' / 'tokenizers' / 'tokenizer.default'}", "skip_jax_distributed_system=true",
  ])
  mesh = maxtext_utils.get_mesh_from_config(config)
  tokenizer, _ = data_processing_utils.get_tokenizer_and_pad_id(config)
  data_iterator, _ = input_pipeline_interface.create_data_iterator(config, mesh)
  manager = checkpointing.create_orbax_checkpoint_manager(
      str(workdir / "checkpoints"), True, use_async=False, save_interval_steps=1)
  restored, _ = checkpointing.load_state_if_possible(
      manager, data_iterator, "", "", 96, {"step": np.zeros((), np.int64)}, dataset_type="grain")
  start = 0 if restored is None else int(restored["items"]["step"]) + 1
  print(f"{'resumed after step ' + str(start - 1) if start else 'a new run'}; training steps {start}-"
        f"{start + args.steps - 1}", flush=True)
  for step in range(start, start + args.steps + (1 if args.kill else 0)):
    print(f"step {step}: records {_records(next(data_iterator), tokenizer)}", flush=True)
    if step == start + args.steps:  # the --kill step: trained, never saved
      print("SIGKILL before saving this step", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    checkpointing.save_checkpoint(manager, step, {"step": np.asarray(step, np.int64)}, config, data_iterator,
                                  force=True)
    checkpointing.wait_until_finished(manager)


if __name__ == "__main__":
  main()
