"""The README's Orbax quick start runs as written, in a fresh process."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


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
