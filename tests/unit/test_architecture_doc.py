"""docs/architecture.md's "One home per rule" table names code and tests that exist.

Each row names its test in the "tested by" cell: a test file, or a
`file.py::test_name` whose function is defined in that file. Every test path
anywhere in a row is checked the same way. In the "answered by" cell, a code
span that is a dotted name rooted in a module of the package (`elastic.x`,
`tunix/_items.install`, `_input.GrainSource.row_boundary`, the short
`_input` standing for the one module of that name) or in a class of it
(`IteratorState.innermost`) must resolve to an attribute; a bare name must be
a name the package's code uses. Spans that are not code pointers (a command
line, a dict, a file name) are left alone. The last tests feed the checker
rows it must refuse, so it cannot pass by reading nothing.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import re

import pytest

import ckpt_iter
import test_docs_guard as docs_guard

_REPO = pathlib.Path(__file__).resolve().parents[2]
_PACKAGE = pathlib.Path(ckpt_iter.__file__).resolve().parent
_PAGE = _REPO / "docs" / "architecture.md"
_HEADING = "## One home per rule"
_TEST_PATH = re.compile(r"\btests/[\w/]+\.py(?:::[\w:]+)?")
_SPAN = re.compile(r"`([^`]+)`")
# A code pointer: a dotted (or slashed module) name, optionally called: `a.b.c`, `cli/_audit`, `f(x, y)`.
_POINTER = re.compile(r"([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?:?")
_FILE_SUFFIXES = (".json", ".txt", ".md", ".yml", ".yaml", ".toml")


def _modules() -> dict[str, str]:
  """Every module of the package by its path under ckpt_iter/, without `.py` (`tunix/_items`)."""
  result = {}
  for path in _PACKAGE.rglob("*.py"):
    relative = path.relative_to(_PACKAGE).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    result["/".join(parts)] = ".".join(("ckpt_iter", *parts))
  return result


_MODULES = _modules()
_BY_LAST_NAME: dict[str, list[str]] = {}
for _path, _name in _MODULES.items():
  if _path:
    _BY_LAST_NAME.setdefault(_path.split("/")[-1], []).append(_name)


def rows(markdown: str) -> list[tuple[int, list[str]]]:
  """The table's body rows under `_HEADING`, each as (line number, cells)."""
  lines = markdown.splitlines()
  start = lines.index(_HEADING)
  result = []
  for number, line in enumerate(lines[start + 1:], start + 2):
    if line.startswith("#"):
      break
    if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line):
      cells = docs_guard._cells(line)  # pylint: disable=protected-access
      result.append((number, [cell.strip() for cell in cells]))
  return result[1:]  # the header


@functools.cache
def _test_names(path: pathlib.Path) -> frozenset[str]:
  """The test functions of a test file, top-level (`name`) and in classes (`Class::name`)."""
  names = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      names.update(f"{node.name}::{item.name}" for item in node.body if isinstance(item, ast.FunctionDef))
  return frozenset(names)


def path_problem(reference: str, repo: pathlib.Path = _REPO) -> str | None:
  """Why a `tests/...py[::name]` reference names nothing, or None."""
  file, _, name = reference.partition("::")
  path = repo / file
  if not path.is_file():
    return f"{file} does not exist"
  if name and re.sub(r"\[.*\]$", "", name) not in _test_names(path):
    return f"{file} has no test {name}"
  return None


@functools.cache
def _code_names() -> frozenset[str]:
  """Every name the package's code (and the docs build's, docs/hooks.py) defines, reads or keys a dict with
  (docstrings and comments aside)."""
  names = set()
  for path in [*_PACKAGE.rglob("*.py"), _REPO / "docs" / "hooks.py"]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Name):
        names.add(node.id)
      elif isinstance(node, ast.Attribute):
        names.add(node.attr)
      elif isinstance(node, ast.arg):
        names.add(node.arg)
      elif isinstance(node, ast.keyword) and node.arg:
        names.add(node.arg)
      elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
        names.add(node.value)
  return frozenset(names)


def _has_attribute(owner, name: str) -> bool:
  if hasattr(owner, name):
    return True
  fields = getattr(owner, "__dataclass_fields__", None) or getattr(owner, "__annotations__", {})
  return name in fields


def _resolve(module_name: str, attributes: list[str]) -> str | None:
  """Why `module_name` + `attributes` is no attribute chain, or None (also when Tunix is absent)."""
  if module_name.startswith("ckpt_iter.tunix") and importlib.util.find_spec("tunix") is None:
    return None
  owner = importlib.import_module(module_name)
  for index, name in enumerate(attributes):
    if not _has_attribute(owner, name):
      return f"{module_name}.{'.'.join(attributes[:index + 1])} does not exist"
    owner = getattr(owner, name, None)
  return None


def _defining_modules(name: str) -> list[str]:
  """The package's modules that define a top-level `name` (a class or constant named without its module)."""
  found = []
  for module_name in _MODULES.values():
    source = pathlib.Path(importlib.util.find_spec(module_name).origin).read_text()
    if re.search(rf"^(?:class|def) {name}\b|^{name}\b[^=\n]*=", source, re.M):
      found.append(module_name)
  return found


def pointer_problem(span: str) -> str | None:
  """Why a code span of the "answered by" cell points at nothing in the package, or None."""
  match = _POINTER.fullmatch(span.strip())
  if match is None or span.endswith(_FILE_SUFFIXES):
    return None  # a command line, a literal, a file name: not a code pointer
  pointer = match.group(1)
  if pointer.startswith(("tests/", "docs/", "benchmarks/")):
    return None if (_REPO / pointer).exists() else f"`{span}`: {pointer} does not exist"
  head, *attributes = pointer.removesuffix(".py").split(".")
  head = head.removeprefix("ckpt_iter/")
  if head == "ckpt_iter":
    module_names = ["ckpt_iter"]
  elif "/" in head:
    if head not in _MODULES:
      return f"`{span}`: no module ckpt_iter/{head}.py"
    module_names = [_MODULES[head]]
  elif head in _BY_LAST_NAME:
    module_names = _BY_LAST_NAME[head]
  elif head[0].isupper() and attributes:
    module_names = _defining_modules(head)
    attributes = [head, *attributes]
    if not module_names:
      return f"`{span}`: no module of the package defines {head}"
  elif not attributes:
    return None if head in _code_names() else f"`{span}`: the package's code has no name {head}"
  else:
    return f"`{span}`: {head} is no module of the package"
  problems = [_resolve(name, attributes) for name in module_names]
  return None if None in problems else f"`{span}`: {problems[0]}"


def row_problems(cells: list[str]) -> list[str]:
  """What is wrong with one row: its test missing or not there, a code pointer that names nothing."""
  if len(cells) != 3:
    return [f"has {len(cells)} cells, expected 3 (question | answered by | tested by)"]
  _, answered_by, tested_by = cells
  problems = []
  if not _TEST_PATH.search(tested_by):
    problems.append(f"names no test: {tested_by!r}")
  problems.extend(f"names no code: `{span}`" for span in _SPAN.findall(tested_by) if not _TEST_PATH.fullmatch(span))
  for cell in cells:
    problems.extend(filter(None, map(path_problem, _TEST_PATH.findall(cell))))
  spans = [span for span in _SPAN.findall(answered_by) if not _TEST_PATH.fullmatch(span)]
  problems.extend(filter(None, map(pointer_problem, spans)))
  return problems


def test_every_row_names_its_test_and_code_that_exist():
  table = rows(_PAGE.read_text())
  assert len(table) > 30, "the table under " + _HEADING + " was not found or not read"
  problems = [f"docs/architecture.md:{number}: {problem}" for number, cells in table for problem in row_problems(cells)]
  assert not problems, "\n".join(problems)


def test_the_pointer_reader_reads_what_the_table_writes():
  assert pointer_problem("elastic.resize_refusal(kind, fingerprint)") is None
  assert pointer_problem("tunix/_session.DataSession._continuation") is None
  assert pointer_problem("_input.GrainSource.row_boundary") is None
  assert pointer_problem("IteratorState.innermost") is None
  assert pointer_problem("cli/_audit") is None
  assert pointer_problem("tunix/_api.py") is None
  assert pointer_problem("ckpt-iter which --step") is None
  assert pointer_problem("ckpt_iter.json") is None


@pytest.mark.parametrize("span", [
    "state.split_learner_position",  # gone: IteratorState.innermost
    "input_view",  # gone: IteratorState.own_position
    "IteratorState.split",
    "_lineage.entries",  # no such module
    "tunix/_learner_state.read",
    "datamap.input_part",
])
def test_a_pointer_to_code_that_is_gone_is_refused(span):
  assert pointer_problem(span) is not None


@pytest.mark.parametrize("tested_by, expected", [
    ("the integration tests", "names no test"),
    ("`tests/unit/test_no_such_file.py`", "does not exist"),
    ("`tests/unit/test_state.py::test_no_such_test`", "has no test test_no_such_test"),
    ("`tests/unit/test_state.py`; `state.migrate`", "names no code"),
])
def test_a_row_whose_test_is_missing_or_gone_is_refused(tested_by, expected):
  problems = row_problems(["a question?", "`state.migrate`", tested_by])
  assert any(expected in problem for problem in problems), problems


def test_a_row_that_names_its_test_and_code_passes():
  cells = ["a question?", "`IteratorState.innermost`", "`tests/unit/test_state.py`; `tests/unit/test_architecture_doc.py::"
           "test_a_row_that_names_its_test_and_code_passes`"]
  assert row_problems(cells) == []
