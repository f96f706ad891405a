"""Grain's `mp_prefetch` worker processes: a state's positions and the workers' lives.

`resume_workers` is THE rule for restoring a state saved with k workers with
k' (a per-worker position translated to the global one, or refused with the
reason); `exit_workers_with_parent` makes each worker exit when the process
that started it dies (it wraps their `_worker_init_fn`). The nodes come from
`_graph`, the only reader of Grain's node privates but the worker init
function this module wraps.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Mapping

from ckpt_iter import _graph
from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter import state as state_lib


@dataclasses.dataclass(frozen=True)
class WorkerResume:
  """How a state resumes with this pipeline's `mp_prefetch` worker count.

  Attributes:
    position: the position to restore (the saved one, or translated to the
      new worker count).
    accepted: the worker-count field, when a different count was accepted.
    changes: one line per accepted change, saying where the stream resumes.
  """

  position: dict[str, Any]
  accepted: frozenset[str] = frozenset()
  changes: tuple[str, ...] = ()


def resume_workers(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    position: Mapping[str, Any],
    dataset: Any,
    *,
    origin: str,
) -> WorkerResume:
  """THE rule for restoring an `mp_prefetch` state with another worker count.

  With `sequential_slice=False` (Grain's default) worker j of k reads
  elements j, j+k, j+2k, ... of the MapDataset it is given, and the
  interleave takes one element from each worker in turn, so the output is
  that MapDataset's order for every k: element p comes from worker p mod k,
  as its element p div k. A state holds one `next_index` per worker; their
  sum is the global position P, the number of elements consumed. With k'
  workers, worker j has consumed `len(range(j, P, k'))` elements and the
  interleave continues at worker P mod k'. The resumed stream is the
  uninterrupted one from element P: nothing skipped or repeated, the same
  order as an uninterrupted run with either count.

  This holds only when every worker yields every element of its slice and the
  slice is taken of an index-addressed dataset: a `make_dataset` pipeline
  (optionally followed by MapDataset steps other than `filter`) read by
  `to_iter_dataset()`, with at most element-wise `map`s between that and
  `mp_prefetch`. Anything else is refused.

  Args:
    saved: the state's fingerprint.
    current: this pipeline's fingerprint.
    position: the state's position.
    dataset: this pipeline (its live nodes are inspected).
    origin: what error messages name.

  Returns:
    The position to restore; unchanged when the worker counts agree.

  Raises:
    ConfigDriftError: another worker count that cannot be translated, with the
      reason and the fix (`allow_drift` cannot accept it).
    InvalidStateError: the saved per-worker positions are not those of a
      round-robin interleave.
  """
  for name, saved_count in saved.items():
    if not _graph.is_workers_field(name):
      continue
    here = current.get(name)
    if state_lib.same_field_value(saved_count, here):
      continue
    reason = _translation_refusal(name, saved, current, dataset)
    if reason is not None:
      raise _worker_count_error(name, saved_count, here, reason, origin)
    next_index = _global_position(position, int(saved_count), origin)
    new_position = _replace_interleave_state(position, _interleave_state(next_index, int(here)))
    return WorkerResume(
        position=new_position,
        accepted=frozenset({name}),
        changes=(
            f"{origin}: mp_prefetch num_workers {saved_count} -> {here} ({name}); "
            f"the stream resumes at element {next_index} of the workers' dataset, "
            "in the same order.",
        ),
    )
  return WorkerResume(position=dict(position))


def _translation_refusal(
    name: str, saved: Mapping[str, Any], current: Mapping[str, Any], dataset: Any
) -> str | None:
  """Why a per-worker position cannot be translated to another count, or None."""
  here = current.get(name)
  if here is None or not state_lib.is_int(here) or here < 1:
    return "this pipeline has no mp_prefetch with workers at that node"
  sequential = name[: -len(_graph.WORKERS_PARAM)] + "sequential_slice"
  if saved.get(sequential) or current.get(sequential):
    return (
        "with sequential_slice=True each worker reads one contiguous block of "
        "the data, so the order of the stream depends on the worker count"
    )
  if saved.get(_graph.GRAPH_FIELD) != current.get(_graph.GRAPH_FIELD):
    return "the graph differs as well"
  interleaves = [n for n in _graph.walk_nodes(dataset) if _graph.worker_shards(n)]
  if len(interleaves) != 1:
    return "the pipeline has more than one mp_prefetch"
  return _worker_pipeline_refusal(_graph.unwrap_worker(_graph.worker_shards(interleaves[0])[0]))


def _worker_pipeline_refusal(node: Any) -> str | None:
  """None if the workers read an index-addressed make_dataset pipeline."""
  while type(node).__name__ == "MapIterDataset" and len(node.parents) == 1:
    node = node.parents[0]
  if type(node).__name__ != "PrefetchIterDataset":
    return (
        f"the workers run IterDataset step {type(node).__name__} before mp_prefetch: "
        "what each worker yields depends on the worker count"
    )
  kinds = [kind for _, kind, _ in _graph.walk(node.parents[0], None)]
  per_element = [k for k in kinds if k.startswith("Filter") or k.endswith("IterDataset")]
  if per_element:
    return (
        f"the workers' pipeline applies {sorted(set(per_element))} before mp_prefetch: "
        "which elements each worker yields depends on the worker count"
    )
  if "GlobalBatchDataset" not in kinds:
    return (
        "the pipeline was not built by ckpt_iter.make_dataset, so its positions "
        "are not known to be index-addressed"
    )
  return None


def _worker_count_error(
    name: str, saved_count: Any, here: Any, reason: str, origin: str
) -> errors.ConfigDriftError:
  here_text = "no mp_prefetch there" if here is None else f"num_workers={here}"
  error = errors.ConfigDriftError({name: (saved_count, here)}, origin=origin)
  error.args = (
      f"{origin} was written by mp_prefetch with num_workers={saved_count} "
      f"(field {name!r}); this pipeline has {here_text}. Grain's multiprocess "
      "state holds one position per worker, and it cannot be translated to "
      f"another worker count here: {reason}. Rebuild the pipeline with "
      f"grain.MultiprocessingOptions(num_workers={saved_count}).",
  )
  return error


_INTERLEAVE_KEY = "iterators_in_use_states"


def _find_interleave_state(position: Any) -> Mapping[str, Any] | None:
  if isinstance(position, Mapping):
    if _INTERLEAVE_KEY in position:
      return position
    for value in position.values():
      found = _find_interleave_state(value)
      if found is not None:
        return found
  return None


def _replace_interleave_state(position: Any, new: dict[str, Any]) -> Any:
  if isinstance(position, Mapping):
    if _INTERLEAVE_KEY in position:
      return new
    return {k: _replace_interleave_state(v, new) for k, v in position.items()}
  return position


def _global_position(position: Mapping[str, Any], num_workers: int, origin: str) -> int:
  """The number of elements consumed, from a round-robin interleave state."""
  interleave = _find_interleave_state(position)
  problem = None
  if interleave is None:
    problem = "it holds no interleave state"
  else:
    states = interleave.get(_INTERLEAVE_KEY)
    indices = interleave.get("iterators_in_use_indices")
    if not isinstance(states, (list, tuple)) or len(states) != num_workers:
      problem = f"it does not hold {num_workers} worker positions"
    elif list(indices or ()) != list(range(num_workers)) or interleave.get("future_states"):
      problem = "its workers are not in cycle order"
    elif not all(
        isinstance(s, Mapping) and set(s) == {"next_index"} and state_lib.is_int(s["next_index"])
        and s["next_index"] >= 0 for s in states
    ):
      problem = "a worker position is not {'next_index': n}"
  if problem is None:
    counts = [int(s["next_index"]) for s in states]
    next_index = sum(counts)
    if counts == [len(range(j, next_index, num_workers)) for j in range(num_workers)]:
      return next_index
    problem = f"the worker positions {counts} are not a round-robin prefix"
  raise errors.InvalidStateError(
      f"{origin}: field 'position' is {state_lib.short_repr(position)}; as the state of "
      f"mp_prefetch with {num_workers} workers {problem}. Restore it with the worker "
      "count it was written with."
  )


def _interleave_state(next_index: int, num_workers: int) -> dict[str, Any]:
  """Grain's interleave state after `next_index` elements from `num_workers` workers."""
  return {
      "next_index_in_cycle": next_index % num_workers,
      "next_index_in_datasets": num_workers,
      "iterators_in_use_indices": list(range(num_workers)),
      _INTERLEAVE_KEY: [
          {"next_index": len(range(j, next_index, num_workers))} for j in range(num_workers)
      ],
      "exhausted": [0] * num_workers,
      "future_states": {},
  }


# ---------------------------------------------------------------------------
# Worker processes that outlive their process.
#
# Grain's mp_prefetch workers are spawned processes that block on their
# queues: after a SIGKILL of the process that started them they live on
# (20 minutes at 220 MB each were seen), holding memory and the resource
# tracker. PR_SET_PDEATHSIG would signal them when the *thread* that started
# them exits, and Grain starts them from whichever thread first reads the
# shard (the interleave's threads): it could kill live workers. So each worker
# runs a thread that polls its parent pid and exits once it changes (the
# parent died and the worker was re-parented), whichever thread started it.

# How often a worker checks that the process that started it is alive.
PARENT_CHECK_SECONDS = 0.5
_ORPHAN_EXIT_CODE = 70
# When a Grain release's mp_prefetch shards no longer hold the init function the watch wraps.
WORKERS_NOT_WATCHED = (
    "this Grain's mp_prefetch workers cannot be made to exit with their parent (its shards have no "
    "worker_init_fn): if this process is killed they outlive it until killed themselves "
    f"({_urls.doc_url('failure_modes.md', 'worker-processes-after-a-kill')}).")


def exit_workers_with_parent(dataset: Any) -> bool:
  """Makes every `mp_prefetch` worker of `dataset` exit when the process that started it dies.

  Wraps each worker's init function (Grain's, holding the user's
  `worker_init_fn`, which still runs right after the watch starts) in
  `_ExitWithParent`, once. Returns whether every worker is
  now watched: False when Grain's shards no longer hold that function (a
  Grain release renamed it), for the caller to say so.
  """
  for node in _graph.walk_nodes(dataset):
    for shard in _graph.worker_shards(node):
      init = getattr(shard, "_worker_init_fn", _MISSING)
      if init is _MISSING:
        return False
      if not isinstance(init, _ExitWithParent):
        shard._worker_init_fn = _ExitWithParent(init)  # pylint: disable=protected-access
  return True


def exit_loader_workers_with_parent(loader: Any) -> bool:
  """`exit_workers_with_parent` for a `grain.DataLoader` (its workers are an mp_prefetch inside it)."""
  dataset = getattr(loader, "_dataset", None)  # the pipeline the DataLoader builds once and iterates
  return dataset is not None and exit_workers_with_parent(dataset)


_MISSING = object()


class _ExitWithParent:
  """A worker init function that first starts the worker's parent watch, then calls `init`.

  Grain pickles it in the process that starts the worker, so the pid taken
  there is the worker's parent's (`__getstate__`).
  """

  def __init__(self, init: Callable[..., Any] | None):
    self._init = init
    self._parent_pid: int | None = None

  def __getstate__(self) -> dict[str, Any]:
    return {"init": self._init, "parent_pid": os.getpid()}

  def __setstate__(self, state: Mapping[str, Any]) -> None:
    self._init, self._parent_pid = state["init"], state["parent_pid"]

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self._parent_pid is not None:  # a copy unpickled in a worker; the object made here has none
      threading.Thread(target=_exit_when_orphaned, args=(self._parent_pid,), daemon=True,
                       name="ckpt_iter-parent-watch").start()
    return None if self._init is None else self._init(*args, **kwargs)


def _exit_when_orphaned(parent_pid: int) -> None:
  """Ends this process once its parent is no longer `parent_pid` (it died; this one was re-parented)."""
  while os.getppid() == parent_pid:
    time.sleep(PARENT_CHECK_SECONDS)
  os._exit(_ORPHAN_EXIT_CODE)  # pylint: disable=protected-access  (no cleanup is owed to a dead parent)
