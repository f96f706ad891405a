"""Counts a process's JAX persistent compilation cache lookups and hits, for the test suite's hit rate.

Active only when CKPT_ITER_JAX_CACHE_STATS names a directory (tests/conftest.py
then puts this directory on every child's PYTHONPATH, so Python imports this
file at start-up). Each lookup and hit is appended, as it happens, to
`<dir>/<pid>.log`: a worker killed with os._exit keeps what it counted. JAX is
not imported here: the listener is attached when JAX imports its monitoring
module, so processes that never use JAX are not slowed or changed.
`python tests/cache_stats/summary.py <dir>` adds them up.
"""

import importlib.abc
import importlib.util
import os
import sys

_STATS_DIR = os.environ.get("CKPT_ITER_JAX_CACHE_STATS")
_MONITORING = "jax._src.monitoring"
_EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "lookup",
    "/jax/compilation_cache/cache_hits": "hit",
}


def _listener(event, **unused):
  kind = _EVENTS.get(event)
  if kind is not None:
    with open(os.path.join(_STATS_DIR, f"{os.getpid()}.log"), "a", encoding="ascii") as f:
      f.write(kind + "\n")


def attach(monitoring) -> None:
  monitoring.register_event_listener(_listener)


class _AttachOnImport(importlib.abc.MetaPathFinder):
  """Attaches the listener right after JAX's monitoring module is executed."""

  def find_spec(self, name, path=None, target=None):
    if name != _MONITORING:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    execute = spec.loader.exec_module

    def exec_module(module):
      execute(module)
      attach(module)

    spec.loader.exec_module = exec_module
    return spec


def install() -> None:
  if _MONITORING in sys.modules:
    attach(sys.modules[_MONITORING])
  elif not any(isinstance(f, _AttachOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AttachOnImport())


if _STATS_DIR:
  install()
