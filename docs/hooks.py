"""MkDocs hooks (mkdocs.yml, `make docs`): the API reference, generated from `__all__`.

docs/api.md holds MARKER, which this replaces with one mkdocstrings block
(`::: module.name`) per name in the `__all__` of each module in
REFERENCE_MODULES, so a name added to an `__all__` is in the reference with
nothing else to edit. The build fails if one of those names has no
docstring (`docstring`: a constant's is the string literal right after its
assignment, which mkdocstrings shows), if a public method or property of
one of those classes has none (`undocumented_members`: mkdocstrings would
leave it out), or if the rendered page lacks its entry;
tests/unit/test_api_docs.py checks the docstrings from the same list without
building. The repository's addresses come from ckpt_iter/_urls.py.
"""

import ast
import functools
import importlib
import importlib.util
import pathlib
import re

REFERENCE_MODULES = ("ckpt_iter", "ckpt_iter.sources", "ckpt_iter.testing", "ckpt_iter.tunix", "ckpt_iter.maxtext")
REFERENCE_PAGE = "api.md"
MARKER = "<!-- the reference: generated from __all__ by docs/hooks.py -->"


def public_names(module_name: str) -> list[str]:
  """The names `module_name` exports (its `__all__`), errors last, each group in `__all__` order.

  Read from the source, never imported: the site builds with the docs extra alone (`ckpt_iter.tunix`
  imports Tunix, which the docs extra does not install). An error is a class whose bases name one.
  """
  origin = _source_path(module_name)
  names = None
  for statement in _statements(origin):  # `__all__ = [...]`, then `__all__ += [...]` and `__all__.append(...)`
    if isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in statement.targets):
      names = list(ast.literal_eval(statement.value))
    elif (isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name)
          and statement.target.id == "__all__" and names is not None):
      names += list(ast.literal_eval(statement.value))
    elif (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
          and isinstance(statement.value.func, ast.Attribute) and statement.value.func.attr == "append"
          and getattr(statement.value.func.value, "id", None) == "__all__" and names is not None):
      names.append(ast.literal_eval(statement.value.args[0]))
  if names is None:
    raise _error(f"{module_name} has no literal __all__ for the API reference to list")
  return sorted(names, key=lambda name: _is_error(module_name, name))


def _is_error(module_name: str, name: str) -> bool:
  """Whether `module_name.name` is an exception class, from its definition's bases (followed by name)."""
  found = _definition(module_name, name)
  if found is None or not isinstance(found[0], ast.ClassDef):
    return False
  bases = [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in found[0].bases]
  return any(base.endswith(("Error", "Exception")) for base in bases)


def docstring(module_name: str, name: str) -> str | None:
  """The docstring of `module_name.name` in the source, as mkdocstrings reads it: "" if none, None if not found.

  Read from the source, not `__doc__`: a dataclass without a docstring has a
  generated `__doc__`, and a constant's docstring exists only in the source.
  An import (`from m import name`, under `if TYPE_CHECKING:` included) is followed.
  """
  found = _definition(module_name, name)
  if found is None:
    return None
  statement, following = found
  if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
    return ast.get_docstring(statement) or ""
  literal = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
  return following.value.value.strip() if literal and isinstance(following.value.value, str) else ""


def _definition(module_name: str, name: str) -> tuple[ast.stmt, ast.stmt | None] | None:
  """The statement that defines `module_name.name` and the one after it, imports followed; None if not found."""
  origin = _source_path(module_name)
  if origin is None:
    return None
  statements = _statements(origin)
  for statement, following in zip(statements, statements[1:] + [None]):
    if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
      return statement, following
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    if isinstance(statement, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == name for t in targets):
      return statement, following
    if isinstance(statement, ast.ImportFrom):
      for alias in statement.names:
        if (alias.asname or alias.name) == name:
          package = module_name if origin.name == "__init__.py" else module_name.rpartition(".")[0]
          source = importlib.util.resolve_name("." * statement.level + (statement.module or ""), package)
          return _definition(source, alias.name)
  return None


def undocumented_names(module_name: str) -> list[str]:
  """The names in `module_name.__all__` without a docstring (`docstring`)."""
  return [name for name in public_names(module_name) if not docstring(module_name, name)]


def undocumented_members(module_name: str) -> list[str]:
  """`Class.member` for each public method or property a class in `module_name.__all__` defines without a docstring.

  mkdocstrings leaves a member without a docstring out of the reference, so
  it would be public but shown nowhere. Inherited members are not the
  class's own entries; a property's setter and an `@overload` have none of
  their own either.
  """
  missing = []
  for name in public_names(module_name):
    found = _definition(module_name, name)
    if found is None or not isinstance(found[0], ast.ClassDef):
      continue
    for statement in _top_level(found[0].body):
      if (isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and not statement.name.startswith("_")
          and not any(_names_no_entry(d) for d in statement.decorator_list) and not ast.get_docstring(statement)):
        missing.append(f"{name}.{statement.name}")
  return missing


def _names_no_entry(decorator: ast.expr) -> bool:
  """`@x.setter`, `@x.deleter`, `@overload`: a definition that is not an entry of its own."""
  name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", None)
  return name in ("setter", "deleter", "overload")


def _source_path(module_name: str) -> pathlib.Path | None:
  """The source file of a module: one of ckpt_iter found without importing it (nor its package, which
  for `ckpt_iter.tunix` imports Tunix); another package's by its spec; None where it cannot be found
  (a package that is not installed)."""
  parts = module_name.split(".")
  if parts[0] == "ckpt_iter":
    base = pathlib.Path(importlib.util.find_spec("ckpt_iter").origin).parent.joinpath(*parts[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
      if path.is_file():
        return path
    return None
  try:
    spec = importlib.util.find_spec(module_name)
  except (ImportError, ValueError):
    return None
  return None if spec is None or spec.origin is None else pathlib.Path(spec.origin)


@functools.lru_cache(maxsize=None)
def _statements(path: pathlib.Path) -> list[ast.stmt]:
  return _top_level(ast.parse(path.read_text()).body)


def _top_level(statements: list[ast.stmt]) -> list[ast.stmt]:
  """Module-level statements, those inside if/try/with blocks included (not inside defs)."""
  flat = []
  for statement in statements:
    if isinstance(statement, (ast.If, ast.Try, ast.With)):
      nested = [statement.body, getattr(statement, "orelse", []), getattr(statement, "finalbody", [])]
      nested += [handler.body for handler in getattr(statement, "handlers", [])]
      for block in nested:
        flat.extend(_top_level(block))
    else:
      flat.append(statement)
  return flat


def reference_markdown(modules: tuple[str, ...] | list[str] = REFERENCE_MODULES) -> str:
  """The mkdocstrings blocks of the reference: each module's docstring, then each public name."""
  blocks = []
  for module_name in modules:
    # The module's own docstring, as the section's heading and introduction.
    blocks.append(f"::: {module_name}\n    options:\n      members: false\n      heading_level: 2\n")
    blocks.extend(f"::: {module_name}.{name}\n" for name in public_names(module_name))
  return "\n".join(blocks)


def on_config(config, **kwargs):
  from ckpt_iter import _urls  # pylint: disable=g-import-not-at-top

  config["repo_url"] = _urls.REPOSITORY_URL
  config["edit_uri"] = _urls.DOC_PAGE_URL.removeprefix(_urls.REPOSITORY_URL + "/")
  return config


def on_page_markdown(markdown, page, **kwargs):
  if page.file.src_uri != REFERENCE_PAGE:
    return markdown
  if MARKER not in markdown:
    raise _error(f"docs/{REFERENCE_PAGE} lost the line {MARKER!r} that the reference replaces")
  undocumented = [f"{module}.{name}" for module in REFERENCE_MODULES
                  for name in undocumented_names(module) + undocumented_members(module)]
  if undocumented:
    raise _error(f"no docstring for {', '.join(undocumented)}: the API reference documents every public name")
  return markdown.replace(MARKER, reference_markdown())


def on_page_content(html, page, files, **kwargs):
  if page.file.src_uri != REFERENCE_PAGE:
    return html
  missing = [f"{module}.{name}" for module in REFERENCE_MODULES for name in public_names(module)
             if f'id="{module}.{name}"' not in html]
  if missing:
    raise _error(f"the API reference has no entry for {', '.join(missing)}")
  return _docs_links_in_site(html, page, files)


def _docs_links_in_site(html, page, files):
  """A docstring's address of a docs page (ckpt_iter._urls.doc_url) becomes a link to this site's page."""
  from ckpt_iter import _urls  # pylint: disable=g-import-not-at-top

  def relative(match):
    target = files.get_file_from_path(match.group(1))
    if target is None:
      raise _error(f"a docstring points at docs/{match.group(1)}, which does not exist")
    return f'href="{target.url_relative_to(page.file)}{match.group(2) or ""}"'

  return re.sub(rf'href="{re.escape(_urls.DOC_PAGE_URL)}([\w-]+\.md)(#[\w-]*)?"', relative, html)


def _error(message):
  from mkdocs.exceptions import PluginError  # pylint: disable=g-import-not-at-top

  return PluginError(message)
