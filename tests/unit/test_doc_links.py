"""Every pointer to the documentation reaches it from a wheel, which has no docs/ folder.

README.md (PyPI's project page) links by absolute address only; the
addresses into this repository that README.md and the docs hold, the
command line's help and the package's user-facing strings name files and
headings that exist; every doc pointer in those strings is an address under
ckpt_iter._urls, never a `docs/*.md` path. Nothing is fetched: an address is
checked against this checkout (GitHub's heading anchors computed from the
Markdown). The wheel's Project-URLs are checked in test_packaging.py.
"""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import tomllib

import pytest

import conftest
from ckpt_iter import _urls

_REPO = pathlib.Path(__file__).resolve().parents[2]
_NEEDS_TUNIX = pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason=conftest.NEEDS_TUNIX)
# Inline links and images `[text](target)`, reference definitions `[label]: target`, HTML src/href.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)|(?:src|href)=\"([^\"]+)\"", re.M)
_ADDRESS = re.compile(r"https?://[^\s)\"'`<>\]]+")
# A doc pointer in text: a path naming a page of docs/ (`docs/x.md`, possibly inside an address).
_DOC_POINTER = re.compile(r"(?:https?://[^\s)\"'`<>]*?)?\bdocs/[\w*.-]+(?:#[\w-]*)?")


def _links(markdown: str) -> list[str]:
  """Every link target of `markdown` outside code (fenced blocks and `spans`)."""
  text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
  text = re.sub(r"`[^`\n]*`", "", text)
  return [next(group for group in match.groups() if group) for match in _LINK.finditer(text)]


def _github_anchors(markdown: str) -> set[str]:
  """The heading anchors GitHub (and mkdocs.yml's slugify) make for `markdown`'s headings."""
  anchors, seen = set(), {}
  in_fence = False
  for line in markdown.splitlines():
    if line.startswith("```"):
      in_fence = not in_fence
    heading = not in_fence and re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not heading:
      continue
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text stays
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _problem(address: str) -> str | None:
  """Why `address` (into this repository) reaches nothing in this checkout, or None if it does."""
  address = address.rstrip(".,;:")
  path, _, anchor = address.partition("#")
  blob, tree = _urls.REPOSITORY_URL + "/blob/main/", _urls.REPOSITORY_URL + "/tree/main/"
  if path in (_urls.REPOSITORY_URL, _urls.REPOSITORY_URL + "/issues") and not anchor:
    return None
  if path.startswith(tree):
    return None if (_REPO / path[len(tree):]).is_dir() and not anchor else f"{address}: no such folder"
  if not path.startswith(blob):
    return f"{address}: not an address this repository serves (expected {blob}FILE or {tree}FOLDER)"
  target = _REPO / path[len(blob):]
  if not target.is_file():
    return f"{address}: {target.relative_to(_REPO)} does not exist"
  if anchor and anchor not in _github_anchors(target.read_text()):
    return f"{address}: {target.relative_to(_REPO)} has no heading with anchor #{anchor}"
  return None


def _markdown_files() -> list[pathlib.Path]:
  return [_REPO / "README.md", _REPO / "CHANGELOG.md", *sorted((_REPO / "docs").glob("*.md"))]


def test_the_addresses_are_one_scheme():
  assert _urls.DOCS_URL.startswith(_urls.REPOSITORY_URL + "/") and _urls.DOC_PAGE_URL.startswith(_urls.REPOSITORY_URL)
  assert _urls.doc_url("guarantees.md", "same-content") == _urls.DOC_PAGE_URL + "guarantees.md#same-content"
  assert _problem(_urls.DOCS_URL) is None and _problem(_urls.doc_url("guarantees.md", "same-content")) is None


def test_readme_links_are_absolute():
  """PyPI shows README.md as the project page, where a relative link leads nowhere."""
  relative = [target for target in _links((_REPO / "README.md").read_text())
              if not target.startswith(("https://", "http://", "mailto:"))]
  assert not relative, f"README.md has relative links (PyPI cannot follow them): {relative}"
  assert any(t.startswith(_urls.DOC_PAGE_URL) for t in _links((_REPO / "README.md").read_text()))


def test_every_address_into_the_repository_in_the_readme_and_docs_exists():
  problems = []
  for path in _markdown_files():
    for address in _ADDRESS.findall(path.read_text()):
      if address.startswith(_urls.REPOSITORY_URL) and (problem := _problem(address)):
        problems.append(f"{path.relative_to(_REPO)}: {problem}")
  assert not problems, "\n".join(problems)


def test_the_project_urls_exist_in_the_repository():
  urls = tomllib.loads((_REPO / "pyproject.toml").read_text())["project"]["urls"]
  assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls), urls
  problems = [problem for address in urls.values() if (problem := _problem(address))]
  assert not problems, "\n".join(problems)


def _docstring_nodes(tree: ast.AST) -> set[int]:
  """ids of the string statements: docstrings (and a constant's), which are never printed."""
  return {id(node.value) for node in ast.walk(tree)
          if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _printed_strings() -> list[tuple[str, str]]:
  """(where, text) of every string literal in the package that is not a docstring: messages, help, output."""
  strings = []
  for path in sorted((_REPO / "ckpt_iter").rglob("*.py")):
    tree = ast.parse(path.read_text())
    docstrings = _docstring_nodes(tree)
    strings += [(f"{path.relative_to(_REPO)}:{node.lineno}", node.value) for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
  return strings


def _public_docstrings() -> list[tuple[str, str]]:
  """(where, text) of the docstrings help() and the API reference show: each reference module's, each
  public name's and, for a class, its own members' (those ckpt_iter defines, inherited ones included)."""
  spec = importlib.util.spec_from_file_location("ckpt_iter_docs_hooks", _REPO / "docs" / "hooks.py")
  hooks = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hooks)
  docs = []
  for module_name in hooks.REFERENCE_MODULES:
    if module_name.startswith("ckpt_iter.tunix") and importlib.util.find_spec("tunix") is None:
      continue
    module = importlib.import_module(module_name)
    docs.append((module_name, module.__doc__ or ""))
    for name in module.__all__:
      value = getattr(module, name)
      docs.append((f"{module_name}.{name}", hooks.docstring(module_name, name) or ""))
      for klass in inspect.getmro(value) if inspect.isclass(value) else ():
        if klass.__module__.startswith("ckpt_iter"):
          for member_name, member in vars(klass).items():
            member = getattr(member, "__func__", getattr(member, "fget", member))
            if getattr(member, "__doc__", None) and (callable(member) or isinstance(member, property)):
              docs.append((f"{module_name}.{name}.{member_name}", member.__doc__))
  return docs


def _pointer_problems(strings: list[tuple[str, str]]) -> list[str]:
  problems = []
  for where, text in strings:
    for pointer in _DOC_POINTER.findall(text):
      if not pointer.startswith(_urls.DOC_PAGE_URL):
        problems.append(f"{where}: {pointer!r} names a file a wheel lacks; use its address "
                        f"(ckpt_iter._urls.doc_url, {_urls.DOC_PAGE_URL}PAGE.md)")
    for address in _ADDRESS.findall(text):
      if address.startswith(_urls.REPOSITORY_URL) and (problem := _problem(address)):
        problems.append(f"{where}: {problem}")
  return problems


def test_the_packages_printed_strings_point_at_doc_addresses():
  strings = _printed_strings()
  assert any("prove_your_run" in text for _, text in strings)  # the scan sees the help texts
  problems = _pointer_problems(strings)
  assert not problems, "\n".join(problems)


def test_the_public_apis_docstrings_point_at_doc_addresses():
  docs = _public_docstrings()
  assert any(where == "ckpt_iter.IteratorRestore" for where, _ in docs), [where for where, _ in docs]
  problems = _pointer_problems(docs)
  assert not problems, "\n".join(problems)


def test_the_pointer_check_fails_on_a_path_and_on_a_dead_address():
  problems = _pointer_problems([
      ("a", "see docs/tunix.md"),
      ("b", f"see {_urls.doc_url('no_such_page.md')}"),
      ("c", f"see {_urls.doc_url('tunix.md', 'no-such-heading')}"),
      ("d", f"see {_urls.doc_url('tunix.md', 'agentic-learners')}."),
  ])
  assert [p.split(":")[0] for p in problems] == ["a", "b", "c"], problems


def _help(capsys, monkeypatch, *argv, columns=40):
  from ckpt_iter import __main__ as entry  # pylint: disable=g-import-not-at-top

  monkeypatch.setenv("COLUMNS", str(columns))  # a narrow terminal: an address must not be split
  assert entry.main([*argv, "--help"]) == 0
  return capsys.readouterr().out


def test_the_help_points_at_the_docs_by_whole_addresses(capsys, monkeypatch):
  assert _urls.DOCS_URL in _help(capsys, monkeypatch).split()
  assert f"({_urls.doc_url('prove_your_run.md')})." in _help(capsys, monkeypatch, "audit").split()


@_NEEDS_TUNIX
def test_the_train_help_points_at_its_guide(capsys, monkeypatch):
  assert _urls.doc_url("tunix_cli.md") in _help(capsys, monkeypatch, "train").split()

