"""Grain's per-epoch shuffle, as the positions of a make_dataset stream need it.

`grain.MapDataset.source(records).shuffle(seed)` gives index e*L + p the
record `index_shuffle(p, L - 1, (seed + e) % 2**32, rounds=4)`: every epoch its
own permutation (grain/_src/python/dataset/transformations/shuffle.py). The
data map (`datamap`) asks that for every record it names, from a state alone,
so this module calls Grain's compiled `index_shuffle` directly: loaded by its
file under Grain's own module name, without importing Grain's package (which
imports JAX: 1.5 s for a command that reads a few headers); a later `import
grain` finds it loaded. Where the file is not found (another Grain
layout), Grain's public `MapDataset.range(L).shuffle(seed)` answers instead
(same values, slower). tests/unit/test_datamap.py holds both equal to Grain's
shuffle.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable

_MODULE = "index_shuffle_module"
_PACKAGE = "grain._src.python.experimental.index_shuffle.python"
_RELATIVE = os.path.join(*_PACKAGE.split(".")[1:])
_ROUNDS = 4  # what Grain's ShuffleMapDataset uses


@functools.lru_cache(maxsize=1)
def _compiled() -> Callable[[int, int, int, int], int] | None:
  name = f"{_PACKAGE}.{_MODULE}"
  if name in sys.modules:  # Grain loaded it: one copy of an extension per process
    return sys.modules[name].index_shuffle
  spec = importlib.util.find_spec("grain")
  if spec is None or not spec.submodule_search_locations:
    return None
  for base in spec.submodule_search_locations:
    directory = os.path.join(base, _RELATIVE)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
      path = os.path.join(directory, _MODULE + suffix)
      if os.path.isfile(path):
        # Under Grain's own name, so that a later `import grain` finds it loaded and loads no second copy.
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(module_spec)
        loader.exec_module(module)
        sys.modules[name] = module
        return module.index_shuffle
  return None


@functools.lru_cache(maxsize=16)
def _public(length: int, seed: int):
  import grain  # pylint: disable=g-import-not-at-top

  return grain.MapDataset.range(length).shuffle(seed=seed)


def shuffled(index: int, length: int, seed: int | None) -> int:
  """The source record at index `index` of `MapDataset.source(L records).shuffle(seed)` (None: no shuffle).

  `index` may pass the length: index e*L + p is epoch e's record at p.
  """
  epoch, offset = divmod(index, length)
  if seed is None:
    return offset
  compiled = _compiled()
  if compiled is None:
    return int(_public(length, seed)[index])  # a range wraps: its value is the offset in the epoch
  return compiled(offset, length - 1, (seed + epoch) % 2**32, _ROUNDS)


def epoch_function(epoch: int, length: int, seed: int | None) -> Callable[[int], int]:
  """p -> the source record at position p of epoch `epoch` (one lookup per call, no setup per record)."""
  if seed is None:
    return lambda offset: offset
  compiled = _compiled()
  if compiled is None:
    dataset = _public(length, seed)
    return lambda offset: int(dataset[epoch * length + offset])
  epoch_seed, last = (seed + epoch) % 2**32, length - 1
  return lambda offset: compiled(offset, last, epoch_seed, _ROUNDS)
