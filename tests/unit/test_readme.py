"""The README's Orbax quick start runs as written, in a fresh process."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_orbax_quick_start_runs_as_written():
  text = README.read_text()
  section = text.split("## Quick start (Orbax)", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert "IteratorRestore" in code and "assert" in code
  process = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )
  assert process.returncode == 0, process.stderr[-3000:]


def test_orbax_v1_quick_start_runs_after_the_v0_one():
  section = README.read_text().split("## Quick start (Orbax)", 1)[1].split("## Quick start (Tunix)", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2 and "load_checkpointables" in blocks[1] and "assert" in blocks[1]
  process = subprocess.run(
      [sys.executable, "-c", blocks[0] + blocks[1]], capture_output=True, text=True, timeout=300,
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )
  assert process.returncode == 0, process.stderr[-3000:]
