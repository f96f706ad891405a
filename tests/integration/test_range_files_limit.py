"""A local corpus of more files than the process may open, read in place (issue 65: 20,480 local JSONL files read
in place failed with EMFILE: each file's descriptor was kept open for good). In a process of its own, whose
open-file limit is lowered; the descriptors' bound itself: tests/unit/test_range_files.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_corpus_of_more_files_than_the_process_may_open_reads_whole_in_place(tmp_path):
  # In a process of its own: the open-file limit is lowered to 64 for 300 files (the test process keeps its own).
  for part in range(300):
    (tmp_path / f"part-{part:03d}.jsonl").write_text("".join(json.dumps({"id": part * 3 + i}) + "\n" for i in range(3)))
  code = textwrap.dedent(f"""
      import json, resource, sys
      resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
      import ckpt_iter
      from ckpt_iter import sources
      source = sources.JsonlSource({str(tmp_path / "part-*.jsonl")!r}, index_cache_dir="")
      dataset = ckpt_iter.make_dataset(source, batch_size=4, seed=1, num_epochs=2)
      ids = [int(v) for k in range(len(dataset)) for v in dataset[k]["id"]]
      print(json.dumps(ids))
  """)
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": _REPO})
  assert run.returncode == 0, run.stderr[-3000:]
  ids = json.loads(run.stdout)
  assert sorted(ids) == sorted(list(range(900)) * 2)  # every record of both epochs, once each
