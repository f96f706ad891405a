"""The API reference's coverage: every public name has a docstring, and an entry.

`make docs` builds the reference (docs/api.md) from the `__all__` of each
module in docs/hooks.py's REFERENCE_MODULES and fails on a name without a
docstring; these tests check the same without building the site.
"""

import ast
import importlib
import importlib.util
import pathlib

import pytest

import conftest

_REPO = pathlib.Path(__file__).resolve().parents[2]
_NEEDS_TUNIX = pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason=conftest.NEEDS_TUNIX)


def _load_hooks():
  spec = importlib.util.spec_from_file_location("ckpt_iter_docs_hooks", _REPO / "docs" / "hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


hooks = _load_hooks()


def _reference_modules():
  return [pytest.param(name, marks=[_NEEDS_TUNIX] if name.startswith("ckpt_iter.tunix") else [], id=name)
          for name in hooks.REFERENCE_MODULES]


@pytest.mark.parametrize("module_name", _reference_modules())
def test_every_public_name_has_a_docstring(module_name):
  module = importlib.import_module(module_name)
  assert module.__doc__ and module.__doc__.strip(), f"{module_name} has no module docstring"
  missing = hooks.undocumented_names(module_name)
  assert not missing, (
      f"{module_name}: no docstring for {', '.join(missing)}; a constant's is a string literal on the line "
      "after its assignment (as mkdocstrings reads it)"
  )


@pytest.mark.parametrize("module_name", _reference_modules())
def test_every_public_method_and_property_has_a_docstring(module_name):
  """mkdocstrings leaves a member without a docstring out of the reference: public, yet shown nowhere."""
  missing = hooks.undocumented_members(module_name)
  assert not missing, f"{module_name}: no docstring for {', '.join(missing)}"


@pytest.mark.parametrize("module_name", _reference_modules())
def test_the_reference_has_an_entry_per_public_name(module_name):
  """The page's entries come from `__all__` (the build also checks each is rendered)."""
  assert hooks.MARKER in (_REPO / "docs" / hooks.REFERENCE_PAGE).read_text()
  lines = set(hooks.reference_markdown([module_name]).splitlines())  # imports this module only
  missing = [name for name in importlib.import_module(module_name).__all__ if f"::: {module_name}.{name}" not in lines]
  assert not missing, f"{module_name}: no reference entry for {missing}"


def test_every_public_module_with_an_all_is_in_the_reference():
  """A module that declares its public names (`__all__`) and is not private is documented."""
  declared = set()
  for path in sorted((_REPO / "ckpt_iter").rglob("*.py")):
    parts = path.relative_to(_REPO).with_suffix("").parts
    if any(part.startswith("_") and part != "__init__" for part in parts):
      continue  # private modules (and everything under a private package)
    tree = ast.parse(path.read_text())
    if any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
           for node in tree.body):
      declared.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  assert "ckpt_iter" in declared and "ckpt_iter.tunix" in declared, declared
  assert declared <= set(hooks.REFERENCE_MODULES), (
      f"add {sorted(declared - set(hooks.REFERENCE_MODULES))} to REFERENCE_MODULES in docs/hooks.py")


def test_the_docstring_finder_reads_the_source(tmp_path, monkeypatch):
  """Classes, functions, constants (the literal after the assignment) and imports followed; None if absent."""
  package = tmp_path / "docpkg"
  package.mkdir()
  (package / "__init__.py").write_text(
      "import typing\n"
      "from docpkg.impl import Documented, LIMIT\n"
      "if typing.TYPE_CHECKING:\n"
      "  from docpkg.impl import Bare, UNDOCUMENTED\n"
  )
  (package / "impl.py").write_text(
      "import dataclasses\n"
      "LIMIT = 3\n"
      '"""The limit."""\n'
      "UNDOCUMENTED = 4\n"
      "@dataclasses.dataclass\n"
      "class Bare:\n"
      "  x: int\n"  # its runtime __doc__ is generated ("Bare(x: int)"): not a docstring
      "class Documented:\n"
      '  """Says what it is."""\n'
      "  def told(self):\n"
      '    """Says what it does."""\n'
      "  @property\n"
      "  def bare_property(self):\n"
      "    return 1\n"
      "  @bare_property.setter\n"  # the property's entry is the getter's
      "  def bare_property(self, value):\n"
      "    pass\n"
      "  async def bare_method(self):\n"
      "    pass\n"
      "  def _private(self):\n"
      "    pass\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  assert hooks.docstring("docpkg", "Documented") == "Says what it is."
  assert hooks.docstring("docpkg", "LIMIT") == "The limit."
  assert hooks.docstring("docpkg", "UNDOCUMENTED") == ""
  assert hooks.docstring("docpkg", "Bare") == ""
  assert hooks.docstring("docpkg", "missing") is None
  monkeypatch.setattr(hooks, "public_names", lambda module_name: ["Documented", "Bare", "LIMIT"])
  assert hooks.undocumented_members("docpkg") == ["Documented.bare_property", "Documented.bare_method"]


def test_the_package_lists_its_public_names_and_modules_only():
  # issue 66: dir(ckpt_iter) listed importlib and typing, which the package imports for itself.
  import ckpt_iter  # pylint: disable=g-import-not-at-top

  import types  # pylint: disable=g-import-not-at-top

  listed = set(dir(ckpt_iter)) - set(ckpt_iter.__all__) - {"__version__"}
  # Besides the public names: the package's own submodules (an import of one makes it an attribute).
  assert not [n for n in listed if not (isinstance(getattr(ckpt_iter, n), types.ModuleType)
                                        and getattr(ckpt_iter, n).__name__ == f"ckpt_iter.{n}")], sorted(listed)
  assert set(ckpt_iter.__all__) <= set(dir(ckpt_iter))
