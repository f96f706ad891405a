"""What the prose points at in the package exists: no docstring, comment or page names code that is gone.

A module is split, renamed or deleted and the docstrings that named it stay
(six pointed at a deleted `lineage` module; tests named `skips` by its old,
private name).
Checked here, in the package's, the tests' and the benchmarks' docstrings and
comments and in README.md and docs/*.md:

- a pointer into a private module (`_codec.encode_state`, `tunix/_items.install`,
  `_input.GrainSource.row_boundary`, the short `_input` standing for the one
  module of that name) resolves to an attribute;
- `ckpt_iter.NAME[.ATTR...]` names a module or attribute of the package, or an option of
  `ckpt-iter train` (`ckpt_iter.skip=...`, from `tunix/cli.py`'s
  `DEFAULT_OPTIONS`), or a pending dataclass's stored name.

Public modules (`state.position`, `iterator.close`) are left out: their names
are the usual names of variables. `_HISTORY` holds the few pointers that say
what was, each with where it stands; `_NOT_YET` the stale ones in files another
change is editing (each must still be there: fixed, it leaves the list).
"""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import tokenize

import pytest

import test_architecture_doc as architecture

_REPO = pathlib.Path(__file__).resolve().parents[2]
_PRIVATE = re.compile(
    r"(?<![\w./-])(?:ckpt_iter[./])?((?:(?:cli|tunix)[/.])?_[a-z]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_PUBLIC = re.compile(r"(?<![\w./-])ckpt_iter\.([a-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w/-])")
_FILE_SUFFIXES = ("py", "md", "json", "npz", "txt", "yml", "yaml", "toml", "jsonl")
# (file, pointer): history, said as such where it stands.
_HISTORY = {
    # "before format 4's nested states it also went through ..."
    ("docs/architecture.md", "_input.unnest"), ("docs/architecture.md", "_learner_state.split"),
}
# (file, pointer): stale, in a file another change is editing; fix it there, then take it out.
_NOT_YET: set[tuple[str, str]] = set()


@functools.cache
def _train_options() -> set[str]:
  source = (_REPO / "ckpt_iter" / "tunix" / "cli.py").read_text()
  options = re.search(r"^DEFAULT_OPTIONS = \{(.*)\}$", source, re.M)
  return set(re.findall(r'"(\w+)":', options.group(1)))


@functools.cache
def _stored_type_names() -> set[str]:
  """The names pending dataclasses are stored under (`ckpt_iter.tunix.GlobalArray`): a state's, not a path."""
  return {name for path in (_REPO / "ckpt_iter").rglob("*.py")
          for name in re.findall(r'register_pytree_dataclass\(\s*"([\w.]+)"', path.read_text())}


def prose(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, text) of a page's lines, or of a Python file's docstrings and comments."""
  source = path.read_text()
  if path.suffix != ".py":
    return list(enumerate(source.splitlines(), 1))
  result = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
      result.extend((node.lineno + number, line) for number, line in enumerate(node.value.value.splitlines()))
  return result


def pointer_problems(text: str) -> list[str]:
  """Why each pointer into the package in `text` names nothing."""
  problems = []
  for match in _PRIVATE.finditer(text):
    module, attributes = match.groups()
    if attributes.split(".")[-1] in _FILE_SUFFIXES:
      continue  # a file: `_files.py`, `_item.json`
    module = module.replace(".", "/")
    if module.split("/")[-1] not in architecture._BY_LAST_NAME and module not in architecture._MODULES:  # pylint: disable=protected-access
      problems.append(f"{match.group(0)}: no module {module}")
      continue
    problem = architecture.pointer_problem(f"{module}.{attributes}")
    if problem:
      problems.append(problem)
  for match in _PUBLIC.finditer(text):
    parts = match.group(1).split(".")
    if parts[-1] in _FILE_SUFFIXES or parts[0] in _train_options() or match.group(0) in _stored_type_names():
      continue  # a file (`ckpt_iter.json`), an option of `ckpt-iter train`, a stored dataclass's name
    # The longest module the name starts with, then attributes of it.
    modules = architecture._MODULES.values()  # pylint: disable=protected-access
    depth = max(i for i in range(len(parts) + 1) if ".".join(["ckpt_iter", *parts[:i]]) in modules)
    problem = architecture._resolve(".".join(["ckpt_iter", *parts[:depth]]), parts[depth:])  # pylint: disable=protected-access
    if problem:
      problems.append(f"ckpt_iter.{match.group(1)}: {problem}")
  return problems


def _files() -> list[pathlib.Path]:
  files = [_REPO / "README.md", *sorted((_REPO / "docs").glob("*.md"))]
  for folder in ("ckpt_iter", "tests", "benchmarks"):
    files.extend(sorted((_REPO / folder).rglob("*.py")))
  return files


def test_every_pointer_into_the_package_names_code_that_exists():
  problems, known = [], set()
  for path in _files():
    relative = str(path.relative_to(_REPO))
    for line, text in prose(path):
      for problem in pointer_problems(text):
        allowed = {entry for entry in _HISTORY | _NOT_YET if entry[0] == relative and entry[1] in problem}
        known |= allowed
        if not allowed:
          problems.append(f"{relative}:{line}: {problem}")
  assert problems == [], "\n".join(problems)
  assert known == _HISTORY | _NOT_YET, f"no longer found, take out of the lists: {(_HISTORY | _NOT_YET) - known}"


@pytest.mark.parametrize("text", [
    "its lineage (`ckpt_iter.lineage`)",  # a module that was deleted
    "Tests for ckpt_iter._skips and the batch plan",  # renamed to skips
    "the state's input (`state.split_learner_position` / `_input.unnest`)",
    "`tunix/_learner_state.split`",
    "`_codec.state_digest`, test-only",
    "written by `ckpt_iter.tunix._items.write_everything`",
    "every reader finds it in one place (`ckpt_iter.state.input_view`)",
])
def test_a_pointer_to_code_that_is_gone_is_named(text):
  assert pointer_problems(text)


@pytest.mark.parametrize("text", [
    "`_codec.encode_state`, `tunix/_items.install`, `_input.GrainSource.row_boundary`",
    "`ckpt_iter.which(pipeline, state)`, `ckpt_iter.tunix`, ckpt_iter.skip=0:100",
    "the files `_files.py` and `ckpt_iter.json`; a variable's `state.position`",
    "stored as a `ckpt_iter.tunix.GlobalArray`; read by `ckpt_iter.state.IteratorState.innermost`",
])
def test_pointers_that_exist_pass(text):
  assert pointer_problems(text) == []
