"""MaxText's own Grain input pipeline against ckpt_iter's for the same config: tokenize + pack.

Hand-run in the MaxText venv (`make bench-maxtext`; `--quick` for a smoke
pass). One MaxText 0.2.5 config (`pyconfig` from its base.yml: Parquet files,
its sentencepiece tokenizer, first-fit packing, 1,024 tokens a row, a global
batch of 8 on one host, shuffled, no worker processes), read by MaxText's
`make_grain_train_iterator` and by `ckpt_iter.maxtext.make_grain_train_iterator`.
Each measurement is a fresh process that builds one side's iterator and reads
BATCHES batches, timed from the build on (wall and the process's CPU, every
thread: both sides prefetch in threads, so a window that starts later would
count batches made before it for free); the two sides alternate in paired
rounds (ABBA), and each ratio is the median of the rounds' ratios. Records are counted as the rows' segments,
tokens as their non-pad positions.

Prints JSON lines (one per measurement, then a summary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCHES, ROUNDS = 200, 6
FILES, RECORDS_PER_FILE = 4, 4000


def _corpus(directory: Path, files: int, records: int) -> None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  rng = random.Random(0)
  letters = "abcdefghijklmnopqrstuvwxyz"
  words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
  for f in range(files):
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 400)))} for _ in range(records)]
    pq.write_table(pa.Table.from_pylist(rows), directory / f"train-{f}.parquet")


def _measure(side: str, corpus: str, batches: int) -> dict:
  """One side, in this (fresh) process: build, warm up, read `batches` batches timed."""
  import maxtext  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  from maxtext.utils import maxtext_utils  # pylint: disable=g-import-not-at-top

  package = Path(maxtext.__file__).parent
  config = pyconfig.initialize([
      None, str(package / "configs" / "base.yml"), "run_name=bench", f"base_output_directory={corpus}/out",
      "dataset_type=grain", f"grain_train_files={corpus}/*.parquet", "grain_file_type=parquet",
      "per_device_batch_size=8", "max_target_length=1024", "packing=true", "grain_worker_count=0",
      f"tokenizer_path={package / 'assets' / 'tokenizers' / 'tokenizer.default'}", "data_shuffle_seed=1",
      "skip_jax_distributed_system=true",
  ])
  mesh = maxtext_utils.get_mesh_from_config(config)
  wall, cpu = time.perf_counter(), time.process_time()
  if side == "ckpt_iter":
    from ckpt_iter import maxtext as ckpt_iter_maxtext  # pylint: disable=g-import-not-at-top
    iterator = ckpt_iter_maxtext.make_grain_train_iterator(config, mesh, [0])
  else:
    from maxtext.input_pipeline import grain_data_processing  # pylint: disable=g-import-not-at-top
    iterator = grain_data_processing.make_grain_train_iterator(config, mesh, [0])
  records = tokens = rows = 0
  first = None
  for _ in range(batches):
    batch = next(iterator)
    first = first if first is not None else time.perf_counter() - wall
    segments = np.asarray(batch["inputs_segmentation"])
    rows += segments.shape[0]
    tokens += int((segments > 0).sum())
    records += sum(len(set(row[row > 0].tolist())) for row in segments)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  return {"side": side, "first_batch_s": round(first, 3), "batches": batches, "rows": rows,
          "records": records, "tokens": tokens, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
          "records_per_s": round(records / wall, 1), "tokens_per_s": round(tokens / wall, 1),
          "cpu_us_per_token": round(cpu / tokens * 1e6, 3), "tokens_per_row": round(tokens / rows, 1)}


def _run_side(side: str, corpus: str, batches: int) -> dict:
  out = subprocess.run([sys.executable, __file__, "--measure", side, "--corpus", corpus, "--batches", str(batches)],
                       check=True, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--measure")
  parser.add_argument("--corpus")
  parser.add_argument("--batches", type=int, default=BATCHES)
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(_measure(args.measure, args.corpus, args.batches)))
    return
  rounds, batches = (2, 20) if args.quick else (ROUNDS, BATCHES)
  with tempfile.TemporaryDirectory() as corpus:
    _corpus(Path(corpus), FILES, 400 if args.quick else RECORDS_PER_FILE)
    ratios = {"tokens_per_s": [], "records_per_s": [], "cpu_us_per_token": []}
    for number in range(rounds):
      order = ("stock", "ckpt_iter") if number % 2 == 0 else ("ckpt_iter", "stock")
      measured = {side: _run_side(side, corpus, batches) for side in order}
      for side in order:
        print(json.dumps({"kind": "maxtext_input", "round": number, **measured[side]}), flush=True)
      for key in ratios:
        ratios[key].append(measured["ckpt_iter"][key] / measured["stock"][key])
  summary = {key: round(statistics.median(values), 3) for key, values in ratios.items()}
  print(json.dumps({"kind": "summary", "script": "maxtext_input", "ckpt_iter_over_stock_median": summary,
                    "ratios": {k: [round(v, 3) for v in vs] for k, vs in ratios.items()},
                    "target": "tokens_per_s and cpu_us_per_token within 3% (0.97-1.03)"}))


if __name__ == "__main__":
  main()
