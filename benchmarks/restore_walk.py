"""The code a reader follows: the files, lines and crossings of the save, restore, audit and `which` walks.

Each walk runs one thing a user does under `sys.setprofile` (and
`threading.setprofile`, for Orbax's save threads), noting every function of
`ckpt_iter/` that is entered:

- `save`: a make_dataset DataIterator saved with Orbax (`IteratorSave`), a step;
- `restore`: the same pipeline restored in a new iterator (`IteratorRestore`);
- `grpo_restore`: a toy Tunix GRPO run (num_iterations=2) killed in a process
  of its own right after checkpoint 3, inside a repeat; this process builds the
  drop-in learner on the same root and calls train() until the actor's first
  update (the first trainer input);
- `audit` and `which`: `ckpt-iter audit ROOT` and `ckpt-iter which ROOT
  --step 5` on the save walk's root (five steps, one resume).

For each: the files entered, in order; the lines a reader follows (the union
of the line spans of the functions entered, per file); the calls from one
file of the package into another, per pair of files (distinct caller and
callee functions: a call in a loop is followed once); and the files entered by
one call that runs at most TRIVIAL_LINES lines of them (a file a reader opens
for one trivial call). And the size of the modules: how many, the 90th
percentile of their line counts (`wc -l` of every ckpt_iter/**/*.py, numpy's
linear interpolation) and those over MODULE_LINES. A measure of code, not of
time: the figures do not depend on the machine (docs/architecture.md, "The
walks").
"""

from __future__ import annotations

import collections
import contextlib
import glob
import io
import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

import numpy as np

from _common import REPO_DIR, Reporter, parse_args

PACKAGE_DIR = os.path.join(REPO_DIR, "ckpt_iter") + os.sep
PREEMPT_STEP = 3
TRIVIAL_LINES = 10
# A pair of files with this many calls across it is one concern split in two (issue 51's measure).
PAIR_LIMIT = 10
# A module past this many lines holds more than a reader takes in at once (issue 51's measure: the p90 at most this).
MODULE_LINES = 700


class _FirstTrainerInput(Exception):
  """Raised by the actor's update: the GRPO walk ends where training would begin."""


class Walk:
  """What one call of the package enters: files, function spans, calls across files."""

  def __init__(self):
    self.files: list[str] = []
    self.spans: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
    self.entries: collections.Counter = collections.Counter()  # calls into a file from another file or outside
    # (caller file, callee file) -> the distinct calls across (caller function, callee function): the calls a
    # reader follows from one file into the other, each once however often it runs (audit loops over steps).
    self.edges: dict[tuple[str, str], set[tuple[str, str]]] = collections.defaultdict(set)

  def _profile(self, frame, event, unused_arg):
    if event != "call":
      return
    name = _package_file(frame.f_code.co_filename)
    if name is None:
      return
    code = frame.f_code
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    self.spans[name].add((code.co_firstlineno, last))
    if name not in self.files:
      self.files.append(name)
    caller = frame.f_back
    caller_name = _package_file(caller.f_code.co_filename) if caller is not None else None
    if caller_name != name:
      self.entries[name] += 1
      if caller_name is not None:
        self.edges[(caller_name, name)].add((caller.f_code.co_qualname, code.co_qualname))

  @contextlib.contextmanager
  def watching(self):
    threading.setprofile(self._profile)
    sys.setprofile(self._profile)
    try:
      yield self
    finally:
      sys.setprofile(None)
      threading.setprofile(None)

  def lines(self, name: str) -> int:
    """The lines of `name` a reader follows: the union of the spans of the functions entered in it."""
    covered: set[int] = set()
    for first, last in self.spans[name]:
      covered.update(range(first, last + 1))
    return len(covered)

  def summary(self) -> dict[str, Any]:
    unordered: dict[tuple[str, ...], set[tuple[str, str]]] = collections.defaultdict(set)
    for (a, b), edges in self.edges.items():
      unordered[tuple(sorted((a, b)))] |= edges
    heavy = [{"files": list(pair), "calls": len(edges), "called": sorted({callee for _, callee in edges})}
             for pair, edges in sorted(unordered.items(), key=lambda item: -len(item[1]))
             if len(edges) >= PAIR_LIMIT]
    trivial = [{"file": name, "lines": self.lines(name)} for name in self.files
               if self.entries[name] <= 1 and self.lines(name) <= TRIVIAL_LINES]
    return {
        "files": self.files,
        "lines": {name: self.lines(name) for name in self.files},
        "total_lines": sum(self.lines(name) for name in self.files),
        "crossings": sum(len(edges) for edges in self.edges.values()),
        "heavy_pairs": heavy,
        "trivial_files": trivial,
        # The import floors the files entered stand on: the highest, and how many distinct ones.
        "top_floor": max((_floors().get(name, 0) for name in self.files), default=0),
        "floors": len({_floors().get(name, 0) for name in self.files}),
    }


def module_sizes() -> dict[str, Any]:
  """The modules of the package: their count, the 90th percentile of their lines, those over MODULE_LINES."""
  lines = {}
  for path in sorted(glob.glob(os.path.join(PACKAGE_DIR, "**", "*.py"), recursive=True)):
    with open(path, "rb") as f:
      lines[os.path.relpath(path, PACKAGE_DIR)] = f.read().count(b"\n")  # as `wc -l` counts
  over = sorted(((name, count) for name, count in lines.items() if count > MODULE_LINES), key=lambda item: -item[1])
  floors = _floors()
  return {"modules": len(lines), "p90_lines": round(float(np.percentile(list(lines.values()), 90)), 1),
          "over": [{"module": name, "lines": count} for name, count in over],
          "floors": max(floors.values()),
          "chain": _longest_chain(import_graph(), floors)}


def _longest_chain(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
  """One import chain from a top-floor module down to floor 1."""
  name = max(sorted(floors), key=lambda n: floors[n])
  chain = [name]
  while floors[name] > 1:
    name = next(m for m in sorted(graph[name]) if floors.get(m) == floors[name] - 1)
    chain.append(name)
  return chain


def import_graph() -> dict[str, set[str]]:
  """Each module of the package (a path under ckpt_iter/) and the package modules it imports, anywhere in
  it (a lazy import inside a function is an edge too: the module still needs the other to be there)."""
  modules = {os.path.relpath(path, PACKAGE_DIR): path
             for path in glob.glob(os.path.join(PACKAGE_DIR, "**", "*.py"), recursive=True)}

  def module_of(dotted: str) -> str | None:
    parts = dotted.split(".")[1:]  # below ckpt_iter
    for candidate in (os.path.join(*parts, "__init__.py") if parts else "__init__.py",
                      os.path.join(*parts) + ".py" if parts else None):
      if candidate in modules:
        return candidate
    return None

  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    package = ["ckpt_iter", *os.path.dirname(name).split(os.sep)] if os.path.dirname(name) else ["ckpt_iter"]
    with open(path) as f:
      tree = ast.parse(f.read())
    imported: set[str] = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        imported |= {module_of(a.name) for a in node.names if a.name.split(".")[0] == "ckpt_iter"}
      elif isinstance(node, ast.ImportFrom):
        base = ".".join(package[:len(package) - node.level + 1]) if node.level else node.module or ""
        if node.level and node.module:
          base = f"{base}.{node.module}"
        if base.split(".")[0] != "ckpt_iter":
          continue
        for alias in node.names:  # a submodule by name, else a name of the module `base`
          imported.add(module_of(f"{base}.{alias.name}") or module_of(base))
    graph[name] = {m for m in imported if m is not None and m != name}
  return graph


def import_floors(graph: dict[str, set[str]]) -> dict[str, int]:
  """Each module's floor: 1 for a module importing none of the package, else one above the highest floor
  it imports (the longest import chain down from it; an import that closes a cycle is not followed)."""
  floors: dict[str, int] = {}
  visiting: set[str] = set()

  def floor(name: str) -> int:
    if name not in floors:
      visiting.add(name)
      floors[name] = 1 + max((floor(m) for m in graph[name] if m not in visiting), default=0)
      visiting.discard(name)
    return floors[name]

  for name in sorted(graph):
    floor(name)
  return floors


@functools.lru_cache(maxsize=1)
def _floors() -> dict[str, int]:
  return import_floors(import_graph())


def _package_file(path: str) -> str | None:
  return os.path.relpath(path, PACKAGE_DIR) if path.startswith(PACKAGE_DIR) else None


def _records():
  return [{"id": i, "x": [i % 7, i % 5]} for i in range(40)]


def _pipeline():
  import ckpt_iter  # pylint: disable=g-import-not-at-top
  return ckpt_iter.make_dataset(_records(), batch_size=4, seed=0, num_epochs=2, shard_index=0, shard_count=1)


def _data_walks(root: str) -> dict[str, Walk]:
  """save, restore, audit, which: a make_dataset run saved through Orbax, with one resume."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import ckpt_iter  # pylint: disable=g-import-not-at-top
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  walks = {name: Walk() for name in ("save", "restore", "audit", "which")}
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(root, options=options) as manager:
    data = ckpt_iter.DataIterator(_pipeline())
    for step in range(1, PREEMPT_STEP + 1):
      next(data)
      args = ocp.args.Composite(data=ckpt_iter.IteratorSave(data))
      with walks["save"].watching() if step == PREEMPT_STEP else contextlib.nullcontext():
        manager.save(step, args=args)
        manager.wait_until_finished()
  with ocp.CheckpointManager(root, options=options) as manager:
    data = ckpt_iter.DataIterator(_pipeline())
    args = ocp.args.Composite(data=ckpt_iter.IteratorRestore(data))  # the package's lazy attribute, outside
    with walks["restore"].watching():
      manager.restore(PREEMPT_STEP, args=args)
    for step in range(PREEMPT_STEP + 1, PREEMPT_STEP + 3):
      next(data)
      manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(data)))
    manager.wait_until_finished()
  for name, argv in (("audit", ["audit", root]), ("which", ["which", root, "--step", "5"])):
    with contextlib.redirect_stdout(io.StringIO()) as out, walks[name].watching():
      code = cli.main(argv)
    if code != 0:
      raise RuntimeError(f"ckpt-iter {' '.join(argv)} exited {code}: {out.getvalue()}")
  return walks


def _grpo_walk(root: str) -> Walk:
  from demo import toyrun  # pylint: disable=g-import-not-at-top

  config = toyrun.RunConfig()
  learner = toyrun.build_learner(config, root)
  train_ds = toyrun.make_train_dataset(config)

  def first_update(*unused_args, **unused_kwargs):
    raise _FirstTrainerInput

  learner.rl_cluster.update_actor = first_update
  walk = Walk()
  with walk.watching():
    try:
      learner.train(train_ds, None)
    except _FirstTrainerInput:
      pass
  return walk


def _measure(name: str, run: Callable[[], Walk], report: Reporter) -> dict[str, Any]:
  summary = run().summary()
  report.measurement(name=f"walk_{name}", value=len(summary["files"]), **summary)
  return summary


def main() -> None:
  args = parse_args(__doc__.splitlines()[0])
  report = Reporter("restore_walk", args.quick)
  with tempfile.TemporaryDirectory() as workdir:
    walks = _data_walks(os.path.join(workdir, "data_root"))
    summaries = {name: _measure(name, lambda w=walk: w, report) for name, walk in walks.items()}
    root = os.path.join(workdir, "grpo_root")
    subprocess.run(
        [sys.executable, "-m", "demo.toyrun", "--root", root, "--out", os.path.join(workdir, "first.npz"),
         "--preempt-after", str(PREEMPT_STEP)],
        check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL)
    summaries["grpo_restore"] = _measure("grpo_restore", lambda: _grpo_walk(root), report)
  print(json.dumps({name: s["files"] for name, s in summaries.items()}), file=sys.stderr)
  sizes = module_sizes()
  report.measurement(name="module_sizes", value=sizes["p90_lines"], **sizes)
  checks = []
  for name, s in summaries.items():
    checks.append({"name": f"{name}: files entered for one trivial call", "value": len(s["trivial_files"]),
                   "target": "0", "met": not s["trivial_files"]})
    checks.append({"name": f"{name}: file pairs with >= {PAIR_LIMIT} calls across", "value": len(s["heavy_pairs"]),
                   "target": "0 (the codec's validators apart)",
                   "met": all(p["files"][1] == "_codec.py" or p["files"][0] == "_codec.py" for p in s["heavy_pairs"])})
  over = ", ".join(f"{m['module']} {m['lines']}" for m in sizes["over"]) or "none"
  checks.append({"name": f"module p90 lines ({sizes['modules']} modules)", "value": sizes["p90_lines"],
                 "target": f"<= {MODULE_LINES}", "met": sizes["p90_lines"] <= MODULE_LINES,
                 f"over {MODULE_LINES}": over})
  report.summary(checks)


if __name__ == "__main__":
  main()
