"""The package's import graph: acyclic, and layered as docs/architecture.md says; and its tests' layout.

Read from the source with `ast` (imports inside functions included), so a
cycle that only bites at call time is found too. Every module has a unit test
file of its name (`cli/_audit.py`: tests/unit/test_cli_audit.py), but the few
listed in `_NO_UNIT_TEST_FILE` with where they are tested instead.
"""

import ast
import os
import re

import ckpt_iter

_PACKAGE_DIR = os.path.dirname(os.path.abspath(ckpt_iter.__file__))
_FRAMEWORKS = ("jax", "grain", "orbax")
_OUTER_LAYERS = ("ckpt_iter.tunix", "ckpt_iter.cli")


def _module_name(path):
  relative = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))[: -len(".py")]
  parts = relative.split(os.sep)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _package_modules():
  """Module name -> source path, for every .py file of the package."""
  modules = {}
  for directory, _, names in os.walk(_PACKAGE_DIR):
    for name in names:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        modules[_module_name(path)] = path
  return modules


def _imported_names(path, module, modules=None):
  """Every absolute module name `module` imports, anywhere in its source."""
  with open(path, encoding="utf-8") as f:
    return _imports_in(f.read(), module, os.path.basename(path) == "__init__.py", modules)


def _imports_in(source, module, is_package, modules=None):
  """The absolute names of the modules `source` imports.

  `from p import x` imports p.x when that is a module, else p itself (x is
  then a name defined in p).
  """
  modules = _package_modules() if modules is None else modules
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = _absolute_base(node, module, is_package)
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        names.add(submodule if submodule in modules else base)
  return names


def _absolute_base(node, module, is_package):
  if not node.level:
    return node.module
  package = module.split(".") if is_package else module.split(".")[:-1]
  package = package[: len(package) - (node.level - 1)]
  return ".".join(package + ([node.module] if node.module else []))


def _graph():
  """Module -> the package modules it imports by name.

  A parent package is an edge only when imported by name: Python initialises
  it before any submodule anyway, which no module can change.
  """
  modules = _package_modules()
  graph = {}
  for module, path in modules.items():
    targets = set()
    for name in _imported_names(path, module, modules):
      if name in modules:
        targets.add(name)
    graph[module] = targets - {module}
  return graph


def _find_cycle(graph):
  """One import cycle as a list of modules (first == last), or None."""
  state = {}  # module -> "open" while on the path, "done" after
  path = []

  def visit(module):
    state[module] = "open"
    path.append(module)
    for target in sorted(graph[module]):
      if state.get(target) == "open":
        return path[path.index(target):] + [target]
      if target not in state:
        cycle = visit(target)
        if cycle:
          return cycle
    path.pop()
    state[module] = "done"
    return None

  for module in sorted(graph):
    if module not in state:
      cycle = visit(module)
      if cycle:
        return cycle
  return None


def test_the_graph_is_read_from_the_source():
  # Guards the checks below against an empty or blind graph.
  graph = _graph()
  assert {"ckpt_iter.state", "ckpt_iter.checkpoint", "ckpt_iter.tunix", "ckpt_iter.testing"} <= set(graph)
  assert "ckpt_iter.errors" in graph["ckpt_iter.state"]  # `from ckpt_iter import errors`
  assert "ckpt_iter.state" in graph["ckpt_iter.repeat"]


def test_find_cycle_finds_a_cycle_through_a_function_level_import():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None
  source = (
      "def f():\n"
      "  from . import state\n"
      "  from .tunix import _api\n"
      "  from ckpt_iter.checkpoint import IteratorSave\n"
      "  import ckpt_iter.cli\n"
  )
  names = _imports_in(source, "ckpt_iter.x", is_package=False)
  assert names == {"ckpt_iter.state", "ckpt_iter.tunix._api", "ckpt_iter.checkpoint", "ckpt_iter.cli"}


def test_the_package_has_no_import_cycle():
  cycle = _find_cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _framework_imports(module, frameworks):
  path = _package_modules()[module]
  return sorted(name for name in _imported_names(path, module) if name.split(".")[0] in frameworks)


def test_state_imports_no_framework():
  frameworks = _framework_imports("ckpt_iter.state", _FRAMEWORKS)
  assert not frameworks, f"ckpt_iter/state.py imports {frameworks}; it must stay framework-free"


def test_the_agentic_schedule_imports_no_tunix_jax_or_threads():
  # The pure value the property tests drive; the driver is _agentic_loop.
  found = _framework_imports(
      "ckpt_iter.tunix._agentic_schedule", (*_FRAMEWORKS, "tunix", "threading", "asyncio", "queue"))
  assert not found, f"ckpt_iter/tunix/_agentic_schedule.py imports {found}; it must stay pure"
  tunix_parts = [
      name for name in _imported_names(
          _package_modules()["ckpt_iter.tunix._agentic_schedule"], "ckpt_iter.tunix._agentic_schedule")
      if name.startswith("ckpt_iter.tunix")
  ]
  assert not tunix_parts, f"the agentic schedule imports {tunix_parts}"


def test_core_modules_import_no_outer_layer():
  modules = _package_modules()
  # __main__ is the `python -m ckpt_iter` entry point: the top of the graph,
  # whose job is to dispatch to the CLI, not a core module.
  core = [
      m for m, p in modules.items()
      if os.path.dirname(p) == _PACKAGE_DIR and m != "ckpt_iter.__main__"
  ]
  assert "ckpt_iter.checkpoint" in core and "ckpt_iter.tunix" not in core
  offences = {
      module: sorted(
          name for name in _imported_names(modules[module], module, modules)
          if any(name == layer or name.startswith(layer + ".") for layer in _OUTER_LAYERS)
      )
      for module in core
  }
  offences = {m: names for m, names in offences.items() if names}
  assert not offences, f"core modules import tunix/cli/demo: {offences}"


# The arrows docs/architecture.md declares between the subpackages: which
# outer layer each may import (the core is open to all of them).
_DECLARED_OUTER_IMPORTS = {
    "ckpt_iter.tunix": (),
    "ckpt_iter.cli": ("ckpt_iter.tunix",),  # cli/_verify only, see below
}


def _layer_of(name):
  return next((layer for layer in _OUTER_LAYERS if name == layer or name.startswith(layer + ".")), None)


def test_subpackages_import_only_the_layers_architecture_md_declares():
  modules = _package_modules()
  offences = []
  for module, path in modules.items():
    layer = _layer_of(module)
    if layer is None:
      continue
    for name in _imported_names(path, module, modules):
      target = _layer_of(name)
      if target is None or target == layer:
        continue
      if target not in _DECLARED_OUTER_IMPORTS[layer]:
        offences.append(f"{module} imports {name}")
      elif layer == "ckpt_iter.cli" and module != "ckpt_iter.cli._verify":
        offences.append(f"{module} imports {name} (only cli/_verify may, for Tunix TrainExamples)")
  assert offences == []
  # Not blind: the one declared cli -> tunix arrow is there.
  assert any(_layer_of(n) == "ckpt_iter.tunix"
             for n in _imported_names(modules["ckpt_iter.cli._verify"], "ckpt_iter.cli._verify", modules))


_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiers whose tests run in the test's own process (robustness/ isolates one
# reader that must not hang the run in a process of its own).
_IN_PROCESS_TIERS = ("unit", "property")


def _tier_sources(tiers):
  """(tier/file name, source) of every test file of `tiers` but this one."""
  for tier in tiers:
    folder = os.path.join(_TESTS_DIR, tier)
    for name in sorted(os.listdir(folder)):
      path = os.path.join(folder, name)
      if name.endswith(".py") and path != os.path.abspath(__file__):
        with open(path, encoding="utf-8") as f:
          yield f"{tier}/{name}", f.read()


def _unit_test_offences(markers, tiers=("unit",)):
  return [f"{name}: {marker}" for name, source in _tier_sources(tiers) for marker in markers
          if marker in source]


def test_unit_tests_run_no_tunix_training():
  """Real Tunix runs (toy trainings in processes of their own) live in tests/integration."""
  assert _unit_test_offences(('"demo.toyrun"', '"demo.agentic_toyrun"', "tunix_harness",
                              "toyrun.run(", "tunix_toy.run(", "tunix_toy.WORKER", "tunix_sft_worker",
                              "tunix_agentic_worker", "tunix_conformance_worker")) == []


_DEMO_RUN_BUILDERS = ("toyrun.RunConfig", "toyrun.build_learner", "toyrun.build_cluster", "toyrun.run(",
                      "toyrun.toy_cluster", '"demo.toyrun"', '"demo.agentic_toyrun"',
                      "agentic_toyrun.run(", "agentic_toyrun.main(")


def _test_sources():
  tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for folder, _, names in os.walk(tests_dir):
    for name in sorted(names):
      path = os.path.join(folder, name)
      if name.endswith(".py") and path != os.path.abspath(__file__):
        with open(path, encoding="utf-8") as f:
          yield os.path.relpath(path, tests_dir), f.read()


def test_tests_train_their_own_toy_workload_not_the_demos():
  """The runs tests train are built in tests/workers (tunix_toy.py, tunix_agentic_worker.py).

  The demo's modules (demo/) hold only what `make demo` and the benchmarks run;
  the tests' toy builds on their parts (cluster, recorder, record format).
  """
  builders = {"workers/tunix_toy.py": ("toyrun.RunConfig", "toyrun.toy_cluster"),
              "workers/tunix_agentic_worker.py": ("agentic_toyrun.run(",)}
  offences = [f"{path}: {marker}" for path, source in _test_sources() for marker in _DEMO_RUN_BUILDERS
              if re.search(r"(?<!\w)" + re.escape(marker), source) and marker not in builders.get(path, ())]
  assert offences == []
  # Not blind: the tests' toy is built on the demo's cluster.
  assert any(path == "workers/tunix_toy.py" and "toyrun.toy_cluster(" in source for path, source in _test_sources())


def test_in_process_tiers_start_no_python_process():
  """Fresh-process tests (restores, the installed command, imports) live in tests/integration."""
  markers = ("sys.executable", "process_group", "multiprocessing")
  assert _unit_test_offences(markers, _IN_PROCESS_TIERS) == []
  # Not blind: the integration tier does start them.
  assert any(marker in source for _, source in _tier_sources(("integration",)) for marker in markers)


def test_every_property_file_draws_with_hypothesis():
  """tests/property holds Hypothesis properties; adversarial tables and soaks are robustness/."""
  sources = dict(_tier_sources(("property",)))
  assert sources
  assert [name for name, source in sources.items() if "@hypothesis.given" not in source
          and "@given" not in source] == []


def test_the_package_never_imports_the_demo():
  """demo/ lives outside the installed package (the wheel holds the library): nothing in it may need demo."""
  modules = _package_modules()
  offences = [f"{module} imports {name}" for module, path in modules.items()
              for name in _imported_names(path, module, modules) if name == "demo" or name.startswith("demo.")]
  assert offences == []
  assert "ckpt_iter.demo" not in modules and not os.path.exists(os.path.join(_PACKAGE_DIR, "demo"))


# ---------------------------------------------------------------------------
# Every module has a unit test file of its name.

# Module (path under ckpt_iter/, without .py) -> why it has no tests/unit/test_<name>.py.
_NO_UNIT_TEST_FILE = {
    "__main__": "the entry point's dispatch, run by test_cli.py's entry point test",
    "_urls": "addresses only; test_doc_links.py checks each against the repository's files and headings",
    "cli/_inspect": "read through the verbs: test_cli.py (inspect, diff), test_cli_which.py, test_cli_audit.py",
    "cli/_text": "what the verbs print: test_cli.py, and tests/robustness/test_hostile.py (terminal escaping)",
    "tunix/agentic": "drives a Tunix agentic learner, which a unit test may not train: "
                      "tests/integration/test_tunix_agentic.py",
}
# tests/integration holds test_tunix_sft.py, test_tunix_cli.py and test_object_store.py; pytest's rootdir imports
# need unique names.
_SUFFIXED_UNIT_TEST_FILE = {"tunix/sft": "test_tunix_sft_feed.py", "tunix/cli": "test_tunix_cli_options.py",
                            "_object_store": "test_object_store_profiles.py"}


def unit_test_file(module_path):
  """`cli/_audit.py` -> `test_cli_audit.py`: the path's parts without their leading underscore."""
  parts = module_path[: -len(".py")].split("/")
  return "test_" + "_".join(part.lstrip("_") for part in parts) + ".py"


def missing_unit_test_files(module_paths, test_files, exempt, suffixed):
  """The modules (paths under the package, `__init__.py` aside) with no unit test file of their name."""
  missing = []
  for path in module_paths:
    name = path[: -len(".py")]
    if os.path.basename(path) == "__init__.py" or name in exempt:
      continue
    if suffixed.get(name, unit_test_file(path)) not in test_files:
      missing.append(f"ckpt_iter/{path}: no tests/unit/{unit_test_file(path)}")
  return missing


def _module_paths():
  return sorted(os.path.relpath(path, _PACKAGE_DIR).replace(os.sep, "/") for path in _package_modules().values())


def test_every_module_has_a_unit_test_file_of_its_name():
  """Named as `unit_test_file` says; the few exempt modules are listed above with where they are tested."""
  test_files = set(os.listdir(os.path.join(_TESTS_DIR, "unit")))
  paths = _module_paths()
  missing = missing_unit_test_files(paths, test_files, _NO_UNIT_TEST_FILE, _SUFFIXED_UNIT_TEST_FILE)
  assert missing == [], "\n".join(missing)
  # The lists stay true: every entry is a module, and an exempt module that gains its file leaves the list.
  names = {path[: -len(".py")] for path in paths}
  assert set(_NO_UNIT_TEST_FILE) | set(_SUFFIXED_UNIT_TEST_FILE) <= names
  gained = [name for name in _NO_UNIT_TEST_FILE if unit_test_file(name + ".py") in test_files]
  assert gained == [], f"{gained} now have their unit test file: take them out of _NO_UNIT_TEST_FILE"
  assert set(_SUFFIXED_UNIT_TEST_FILE.values()) <= test_files


def test_a_module_without_its_test_file_is_named():
  paths = ["__init__.py", "state.py", "_codec.py", "cli/__init__.py", "cli/_audit.py", "tunix/sft.py", "__main__.py"]
  files = {"test_state.py", "test_codec_old.py", "test_audit.py", "test_tunix_sft_feed.py"}
  assert missing_unit_test_files(paths, files, {"__main__"}, {"tunix/sft": "test_tunix_sft_feed.py"}) == [
      "ckpt_iter/_codec.py: no tests/unit/test_codec.py", "ckpt_iter/cli/_audit.py: no tests/unit/test_cli_audit.py"]


# Public names defined in a private module, with why they stay there.
_PUBLIC_IN_PRIVATE_MODULE = {
    "register_pytree_dataclass": "writes the codec's table of stored dataclasses, which every decode reads: "
                                 "_codec.py is its one home (its __module__ says ckpt_iter)",
}


def _defining_module(value):
  """The module `value` is defined in: a class's `__module__`, a function's source file."""
  code = getattr(value, "__code__", None)
  if code is None:
    return value.__module__
  return _module_name(code.co_filename)


def test_public_names_live_in_public_modules():
  import importlib  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  packages = [ckpt_iter]
  if importlib.util.find_spec("tunix") is not None:
    packages.append(importlib.import_module("ckpt_iter.tunix"))
  private = {}
  for package in packages:
    for name in package.__all__:
      value = getattr(package, name)
      if isinstance(value, type) or callable(value):
        module = _defining_module(value)
        if any(part.startswith("_") for part in module.split(".")) and name not in _PUBLIC_IN_PRIVATE_MODULE:
          private[f"{package.__name__}.{name}"] = module
  assert private == {}, f"public names defined in private modules: {private}"
  assert ckpt_iter.register_pytree_dataclass.__module__ == "ckpt_iter"
