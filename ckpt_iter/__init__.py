"""ckpt_iter: exactly resumable input pipelines for JAX training.

Grain datasets whose iterator state (position, shuffle key, pending repeats)
is a versioned value saved as an Orbax checkpoint item, in the same step as
the model. `ckpt_iter.tunix` (imported separately) makes Tunix RL learners
resume exactly.
"""

import importlib as _importlib
import typing as _typing

from ckpt_iter.errors import CkptIterError
from ckpt_iter.errors import ConfigDriftError
from ckpt_iter.errors import ContentDriftError
from ckpt_iter.errors import InvalidArgumentError
from ckpt_iter.errors import InvalidStateError
from ckpt_iter.errors import ItemNotFoundError
from ckpt_iter.errors import LegacyCheckpointError
from ckpt_iter.errors import ProcessCountError
from ckpt_iter.errors import StateVersionError
from ckpt_iter.errors import StorageError
from ckpt_iter.errors import StorageTimeoutError
from ckpt_iter.errors import UnsupportedConfigError
from ckpt_iter.skips import Skip
from ckpt_iter.datamap import Batch
from ckpt_iter.datamap import LearnerStep
from ckpt_iter.datamap import RunMap
from ckpt_iter.datamap import SourceRecord
from ckpt_iter.datamap import RecordStream
from ckpt_iter.datamap import last_batch
from ckpt_iter.datamap import learner_step
from ckpt_iter.state import FORMAT_VERSION
from ckpt_iter.state import IteratorState
from ckpt_iter.state import Pending
from ckpt_iter.store_bounds import StoreBounds
from ckpt_iter.store_bounds import set_object_store_bounds

# The names that need JAX, Grain or Orbax are imported on first use, so that
# `import ckpt_iter` (and the read-only `ckpt-iter inspect/verify/diff`,
# which only read JSON headers) loads none of them.
_LAZY = {
    "IteratorCheckpointable": "ckpt_iter.checkpoint",
    "IteratorCheckpointHandler": "ckpt_iter.checkpoint",
    "IteratorRestore": "ckpt_iter.checkpoint",
    "IteratorSave": "ckpt_iter.checkpoint",
    "make_dataset": "ckpt_iter.dataset",
    "ELASTIC_FIELDS": "ckpt_iter.elastic",
    "KeepResumedSteps": "ckpt_iter.keep",
    "DataIterator": "ckpt_iter.iterator",
    "DataLoaderIterator": "ckpt_iter.loader",
    "RepeatIterator": "ckpt_iter.repeat",
    "ReplayIterator": "ckpt_iter.replay",
    "StreamingIterator": "ckpt_iter.streaming",
    "register_pytree_dataclass": "ckpt_iter._codec",
    "which": "ckpt_iter.provenance",
    "with_skip": "ckpt_iter.dataset",
}

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see: the names themselves
  from ckpt_iter._codec import register_pytree_dataclass
  from ckpt_iter.loader import DataLoaderIterator
  from ckpt_iter.provenance import which
  from ckpt_iter.dataset import with_skip
  from ckpt_iter.checkpoint import IteratorCheckpointable
  from ckpt_iter.checkpoint import IteratorCheckpointHandler
  from ckpt_iter.checkpoint import IteratorRestore
  from ckpt_iter.checkpoint import IteratorSave
  from ckpt_iter.dataset import make_dataset
  from ckpt_iter.elastic import ELASTIC_FIELDS
  from ckpt_iter.iterator import DataIterator
  from ckpt_iter.keep import KeepResumedSteps
  from ckpt_iter.repeat import RepeatIterator
  from ckpt_iter.replay import ReplayIterator
  from ckpt_iter.streaming import StreamingIterator


# Names renamed, kept for one release (0.3.x) with a DeprecationWarning: old name -> new name.
_RENAMED = {"Stream": "RecordStream"}


def __getattr__(name: str):
  if name in _RENAMED:
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.warn(f"ckpt_iter.{name} is renamed ckpt_iter.{_RENAMED[name]} (too like StreamingIterator); the old "
                  "name goes in 0.4.0.", DeprecationWarning, stacklevel=2)
    return globals()[_RENAMED[name]]
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'ckpt_iter' has no attribute {name!r}")
  value = getattr(_importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  # The public names and the package's modules, never what it imports for itself (importlib, typing).
  return sorted({n for n in globals() if not n.startswith("_") or n in ("__version__",)} | set(__all__))


__version__ = "0.3.0"

__all__ = [
    "Batch",
    "CkptIterError",
    "ConfigDriftError",
    "ContentDriftError",
    "DataIterator",
    "DataLoaderIterator",
    "ELASTIC_FIELDS",
    "FORMAT_VERSION",
    "InvalidArgumentError",
    "InvalidStateError",
    "ItemNotFoundError",
    "IteratorCheckpointHandler",
    "IteratorCheckpointable",
    "IteratorRestore",
    "IteratorSave",
    "IteratorState",
    "KeepResumedSteps",
    "LearnerStep",
    "LegacyCheckpointError",
    "Pending",
    "ProcessCountError",
    "RecordStream",
    "RepeatIterator",
    "ReplayIterator",
    "RunMap",
    "Skip",
    "SourceRecord",
    "StateVersionError",
    "StorageError",
    "StorageTimeoutError",
    "StoreBounds",
    "StreamingIterator",
    "UnsupportedConfigError",
    "last_batch",
    "learner_step",
    "make_dataset",
    "register_pytree_dataclass",
    "set_object_store_bounds",
    "which",
    "with_skip",
]
