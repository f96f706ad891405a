"""Every Python block of README.md and docs/ marked runnable runs as written, in a fresh process.

A block is marked by the line `<!-- runnable -->` right before it (run on
its own) or `<!-- runnable: continues -->` (run after the file's previous
runnable blocks, as a reader who typed them in order would), or
`<!-- runnable: heavy -->` (on its own, in `make test-heavy`: a real Tunix
training of a minute). Each must check something: it holds an `assert` or
calls `testing.assert_...`.

A page that walks through commands (docs/getting_started.md) marks a Python
block `<!-- runnable: file NAME -->` (written to NAME) and shell blocks
`<!-- runnable: shell -->`: they run in order in one fresh directory, each
with `bash -eu`, where `python` and `ckpt-iter` are this environment's; the
page's shell blocks must check something (a `diff`, `cmp` or `test`).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[2]
_MARKED = re.compile(r"<!-- runnable(: continues|: heavy)? -->\n```python\n(.*?)```", re.S)
# A shell block may be followed by the output it prints (a plain ``` block right after it): compared.
_WALKTHROUGH = re.compile(
    r"<!-- runnable: (?:file ([\w.-]+)|(shell)) -->\n```(?:python|sh)\n(.*?)```(?:\n\n```\n(.*?)```)?", re.S)
# What may differ from run to run in a shown output: where it ran, process ids, wall times.
_PAGE_DIRECTORY = re.compile(r"(?:/[\w.-]+)+/(?=ckpt_\w+/)")
# bash pads the pid to a width that depends on the pid: the padding is masked with it.
_KILLED = re.compile(r"^(bash: line \d+:) +\d+ Killed +")
# Another library's log line (e.g. absl's warning about an older jaxlib): it depends on the versions
# installed, not on the page, and the page shows none.
_OTHER_LOGGER = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR):(?!ckpt_iter)[\w.]+:")
_TIMES = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|ms|us)\b")


def _programs() -> list[tuple[str, str]]:
  """(id, program) per runnable block, continued blocks prefixed by what they continue."""
  return [(name, program) for name, program, _ in _marked_blocks()]


def _marked_blocks() -> list[tuple[str, str, bool]]:
  """(id, program, heavy) per runnable block."""
  programs = []
  for path in [_REPO / "README.md", *sorted((_REPO / "docs").glob("*.md"))]:
    so_far = ""
    for index, match in enumerate(_MARKED.finditer(path.read_text())):
      kind, code = match.group(1), match.group(2)
      so_far = (so_far if kind == ": continues" else "") + code
      programs.append((f"{path.relative_to(_REPO)}#{index}", so_far, kind == ": heavy"))
  return programs


def test_the_docs_mark_their_runnable_blocks():
  ids = [name for name, _ in _programs()]
  assert {"README.md#0", "README.md#1", "docs/guarantees.md#0"} <= set(ids), ids


@pytest.mark.parametrize("name, program", [
    pytest.param(name, program, marks=[pytest.mark.heavy] if heavy else [], id=name)
    for name, program, heavy in _marked_blocks()
])
def test_a_runnable_block_runs_as_written(name, program):
  assert "assert" in program, f"{name} checks nothing"
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  if "tunix" in program:  # a real training: the session's compile cache (tests/conftest.py)
    env.update({k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR",) if k in os.environ})
  process = subprocess.run(
      [sys.executable, "-c", program], capture_output=True, text=True, timeout=600, cwd="/", env=env,
  )
  assert process.returncode == 0, f"{name}:\n{process.stderr[-3000:]}"


def _walkthroughs() -> list[tuple[str, list[tuple[str | None, str]]]]:
  """(page, [(file name or None for a shell block, text), ...]) per page with a walkthrough."""
  pages = []
  for path in [_REPO / "README.md", *sorted((_REPO / "docs").glob("*.md"))]:
    steps = [(m.group(1), m.group(3), m.group(4)) for m in _WALKTHROUGH.finditer(path.read_text())]
    if steps:
      pages.append((str(path.relative_to(_REPO)), steps))
  return pages


def _comparable(output: str, directory: pathlib.Path) -> list[str]:
  """An output's lines with what may differ between runs masked: the directory the page ran in (this
  run's, or the absolute one the page shows before a checkpoint root), process ids, wall times."""
  text = output.replace(f"{directory}/", "").replace(str(directory), ".")
  text = _PAGE_DIRECTORY.sub("", text)
  lines = [_KILLED.sub(r"\1 <pid> Killed ", line.rstrip()) for line in text.strip("\n").splitlines()
           if not _OTHER_LOGGER.match(line)]
  return [_TIMES.sub("<time>", line) for line in lines]


def test_the_getting_started_page_is_a_walkthrough():
  assert "docs/getting_started.md" in dict(_walkthroughs())


@pytest.mark.parametrize("page, steps", _walkthroughs(), ids=[page for page, _ in _walkthroughs()])
def test_a_walkthrough_runs_as_written(page, steps, tmp_path):
  shell = "".join(text for name, text, _ in steps if name is None)
  assert re.search(r"^(diff|cmp|test) |&& (diff|cmp|test) ", shell, re.M), f"{page}: its commands check nothing"
  bin_dir = os.path.dirname(sys.executable)  # python and the ckpt-iter script of this environment
  env = {"JAX_PLATFORMS": "cpu", "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
  env.update({k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ})  # a checkout under test
  for index, (name, text, shown) in enumerate(steps):
    if name is not None:
      (tmp_path / name).write_text(text)
      continue
    # stderr into stdout, in the order written: a page shows both as a terminal does.
    process = subprocess.run(["bash", "-eu", "-c", text], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=600, cwd=tmp_path, env=env)
    assert process.returncode == 0, f"{page} shell block {index}:\n{process.stdout[-5000:]}"
    if shown is not None:  # the page shows what the commands print: it must be what they print now
      assert _comparable(process.stdout, tmp_path) == _comparable(shown, tmp_path), (
          f"{page} shell block {index}: the shown output differs from what runs:\n{process.stdout}")


_REFERENCE_WITHOUT_TUNIX = """
import sys
sys.modules["tunix"] = None  # as where only the docs extra is installed: importing Tunix fails
sys.path.insert(0, {docs!r})
import hooks
markdown = hooks.reference_markdown()
assert "::: ckpt_iter.tunix.ResumableGRPOLearner" in markdown, markdown
assert not any(hooks.undocumented_names(m) + hooks.undocumented_members(m) for m in hooks.REFERENCE_MODULES)
assert "ckpt_iter.tunix" not in sys.modules  # read from the source, never imported
print("ok")
"""


def test_the_api_reference_is_made_without_tunix(tmp_path):
  # issue 58 item 3: `pip install 'ckpt_iter[docs]'` then `mkdocs build --strict` failed: the API page
  # imported ckpt_iter.tunix, which needs Tunix. And `make docs` installs the docs extra alone.
  done = subprocess.run([sys.executable, "-c", _REFERENCE_WITHOUT_TUNIX.format(docs=str(_REPO / "docs"))],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
  makefile = (_REPO / "Makefile").read_text()
  docs_install = re.search(r"^\$\(DOCS_STAMP\):.*\n\t(.*)$", makefile, re.M).group(1)
  assert "'.[docs]'" in docs_install and "test" not in docs_install, docs_install
