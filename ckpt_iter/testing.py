"""Checks that a pipeline resumes exactly: for your tests and ours.

    from ckpt_iter import testing

    testing.assert_exact_resume(
        lambda: ckpt_iter.DataIterator(make_my_dataset()),
        checkpoint_at=[0, 3, 17], num_elements=40)

`assert_exact_resume` is the contract of
https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/guarantees.md as one call: the
stream after a restore into a fresh iterator equals the uninterrupted stream,
bit for bit, with the state passed through its stored form on the way.
`assert_trees_equal` is the bit-for-bit comparison it uses, public so tests
compare elements the same way everywhere.

Imported as `from ckpt_iter import testing` (not re-exported by the package);
it needs no Tunix and writes no files.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from ckpt_iter import _codec as codec
from ckpt_iter import state as state_lib

__all__ = [
    "assert_exact_resume",
    "assert_trees_equal",
    "stored_round_trip",
    "trees_equal",
]


# ---------------------------------------------------------------------------
# Bit-for-bit pytree equality.


def assert_trees_equal(actual: Any, expected: Any, *, path: str = "") -> None:
  """Asserts two pytrees are equal bit for bit.

  Containers (dict, list, tuple, dataclass) must have the same type and keys
  or length; array leaves (numpy, JAX, numpy scalars) the same kind (array or
  scalar), dtype, shape and bytes, so NaN equals the same NaN and -0.0 is not
  0.0; other leaves (int, float, str, None ...) the same type and value.

  Args:
    actual: the tree produced.
    expected: the tree it must equal.
    path: the name of the root, prefixed to the leaf path in messages.

  Raises:
    AssertionError: naming the first differing leaf path and both values.
  """
  problem = _first_difference(actual, expected, path or "tree")
  if problem is not None:
    raise AssertionError(problem)


def trees_equal(actual: Any, expected: Any) -> bool:
  """True if `assert_trees_equal(actual, expected)` would pass."""
  return _first_difference(actual, expected, "tree") is None


def _first_difference(actual: Any, expected: Any, path: str) -> str | None:
  """A message for the first difference found, or None for equal trees."""
  if _is_array(expected) or _is_array(actual):
    return _array_difference(actual, expected, path)
  if type(actual) is not type(expected):
    return (
        f"{path}: type {type(actual).__qualname__} != expected "
        f"{type(expected).__qualname__} ({_short(actual)} vs {_short(expected)})"
    )
  if isinstance(expected, Mapping):
    if set(actual) != set(expected):
      return (
          f"{path}: keys {sorted(map(str, actual))} != expected "
          f"{sorted(map(str, expected))}"
      )
    children = ((f"{path}[{k!r}]", actual[k], expected[k]) for k in expected)
  elif isinstance(expected, (list, tuple)):
    if len(actual) != len(expected):
      return f"{path}: length {len(actual)} != expected {len(expected)}"
    children = (
        (f"{path}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))
    )
  elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
    children = (
        (f"{path}.{f.name}", getattr(actual, f.name), getattr(expected, f.name))
        for f in dataclasses.fields(expected)
    )
  else:
    return _scalar_difference(actual, expected, path)
  for child_path, a, e in children:
    problem = _first_difference(a, e, child_path)
    if problem is not None:
      return problem
  return None


def _is_array(value: Any) -> bool:
  return isinstance(value, (np.ndarray, np.generic)) or (
      hasattr(value, "__array__") and hasattr(value, "dtype")
      and hasattr(value, "shape")
  )


def _array_difference(actual: Any, expected: Any, path: str) -> str | None:
  if not (_is_array(actual) and _is_array(expected)):
    return (
        f"{path}: {type(actual).__qualname__} != expected "
        f"{type(expected).__qualname__} (one is an array, the other is not)"
    )
  # A numpy scalar and a 0-d array hold the same bytes but are not the same
  # leaf: code that calls .item() or indexes them behaves differently.
  if isinstance(actual, np.generic) != isinstance(expected, np.generic):
    return (
        f"{path}: {type(actual).__qualname__} != expected "
        f"{type(expected).__qualname__} (numpy scalar vs array)"
    )
  a, e = np.asarray(actual), np.asarray(expected)
  if a.dtype != e.dtype:
    return f"{path}: dtype {a.dtype} != expected {e.dtype}"
  if a.shape != e.shape:
    return f"{path}: shape {a.shape} != expected {e.shape}"
  if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(e).tobytes():
    return f"{path}: bytes differ: {_short(a)} != expected {_short(e)}"
  return None


def _scalar_difference(actual: Any, expected: Any, path: str) -> str | None:
  if isinstance(expected, float):
    same = struct.pack("<d", actual) == struct.pack("<d", expected)
  else:
    same = actual == expected
  if not same:
    return f"{path}: {_short(actual)} != expected {_short(expected)}"
  return None


def _short(value: Any) -> str:
  return state_lib.short_repr(value, limit=120)


# ---------------------------------------------------------------------------
# The stored form of a state.


def stored_round_trip(state: Any) -> Any:
  """`state` as it comes back from a checkpoint, without writing files.

  A ckpt_iter state (a dict with `format_version`, as `get_state()` returns)
  is split by the checkpoint codec into a JSON header and arrays; the header
  goes through `json.dumps`/`json.loads` (NaN refused, as on disk) and the
  arrays through an in-memory npz read without pickle. Any other state (a
  Grain iterator's) goes through JSON, as Grain's own checkpoint handler
  stores it.

  Args:
    state: what an iterator's `get_state()` returned.

  Returns:
    A new state of the same form; it shares no array with `state`.
  """
  if isinstance(state, Mapping) and "format_version" in state:
    value = state_lib.IteratorState.from_dict(state)
    header, arrays = codec.encode_state(value)
    header = json.loads(json.dumps(header, allow_nan=False))
    stored = _npz_round_trip(arrays)
    result = codec.decode_state(header, lambda name, spec: _checked(stored[name], name, spec)).to_dict()
    if any(isinstance(state.get(name), str) for name in ("content", "lineage")):
      result = state_lib.grain_form(result)  # it came as get_state() gives it
    return result
  return json.loads(json.dumps(state))


def _npz_round_trip(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  buffer.seek(0)
  with np.load(buffer, allow_pickle=False) as npz:
    return {name: npz[name] for name in npz.files}


def _checked(array: np.ndarray, name: str, spec: codec.ArraySpec) -> np.ndarray:
  if array.dtype.str != spec.dtype or array.shape != spec.shape:
    raise AssertionError(
        f"array {name!r} came back as {array.dtype.str}{list(array.shape)}, "
        f"the header says {spec.dtype}{list(spec.shape)}"
    )
  return array


# ---------------------------------------------------------------------------
# The exact-resume check.


def assert_exact_resume(
    make_iterator: Callable[[], Iterator[Any]],
    *,
    checkpoint_at: Iterable[int],
    num_elements: int | None = None,
) -> None:
  """Asserts that restoring at each checkpoint continues the stream exactly.

  Runs one iterator from `make_iterator()` without interruption and takes
  its state before element k, for each k in `checkpoint_at`. For each k it
  builds a fresh iterator with `make_iterator()` (as a new process would),
  restores the state after `stored_round_trip`, and checks that the
  restored iterator reports the same state and yields exactly elements
  k, k+1, ... of the uninterrupted stream: same pytree structure, and the
  dtype, shape and bytes of every array leaf.

  Works for `DataIterator`, `RepeatIterator` and any iterator following
  Grain's protocol (`get_state()` / `set_state(state)`).

  Args:
    make_iterator: builds a new iterator at the start of the pipeline; every
      call must build the same pipeline.
    checkpoint_at: element indices to checkpoint before, each in
      0..num_elements (0..the stream length when num_elements is None). An
      index equal to the stream length checks that the end restores as the
      end.
    num_elements: how many elements to compare; None reads the whole
      stream, which must be finite.

  Raises:
    ValueError: bad `checkpoint_at` or `num_elements`, or a checkpoint index
      past the end of the stream.
    AssertionError: naming the checkpoint index, the element index and the
      leaf path of the first difference.
  """
  points = _checked_points(checkpoint_at, num_elements)
  reference = make_iterator()
  try:
    expected, states, exhausted = _uninterrupted(reference, points, num_elements)
  finally:
    _close(reference)
  for point in points:
    resumed = make_iterator()
    try:
      _check_resume_at(resumed, point, states[point], expected, exhausted)
    finally:
      _close(resumed)


def _checked_points(checkpoint_at: Iterable[int], num_elements: int | None) -> list[int]:
  if num_elements is not None and (
      isinstance(num_elements, bool) or not isinstance(num_elements, int)
      or num_elements < 0
  ):
    raise ValueError(
        f"num_elements={num_elements!r} must be a non-negative integer or None "
        "(read the whole stream)."
    )
  points = sorted(set(checkpoint_at))
  if not points:
    raise ValueError("checkpoint_at is empty; give at least one element index.")
  for point in points:
    if isinstance(point, bool) or not isinstance(point, int) or point < 0:
      raise ValueError(
          f"checkpoint_at holds {point!r}; indices must be integers >= 0."
      )
    if num_elements is not None and point > num_elements:
      raise ValueError(
          f"checkpoint_at holds {point}, past num_elements={num_elements}. "
          f"Use indices in 0..{num_elements}, or raise num_elements."
      )
  return points


def _uninterrupted(
    iterator: Iterator[Any], points: list[int], num_elements: int | None
) -> tuple[list[Any], dict[int, Any], bool]:
  """Reads the reference stream.

  Returns:
    The elements (at most num_elements), the stored state before each point,
    and whether the stream ended on its own.
  """
  wanted, expected, states, exhausted = set(points), [], {}, False
  for index in itertools.count():
    if index in wanted:
      # Stored now: a later next() may reuse the buffers the state refers to.
      states[index] = stored_round_trip(iterator.get_state())
    if num_elements is not None and index >= num_elements:
      break
    try:
      expected.append(_snapshot_element(next(iterator)))
    except StopIteration:
      exhausted = True
      break
  missing = sorted(wanted - set(states))
  if missing:
    raise ValueError(
        f"checkpoint_at holds {missing}, but the stream ended after "
        f"{len(expected)} elements. Use indices in 0..{len(expected)}."
    )
  return expected, states, exhausted


def _check_resume_at(
    iterator: Iterator[Any],
    point: int,
    state: Any,
    expected: list[Any],
    exhausted: bool,
) -> None:
  where = f"checkpoint at element {point}"
  iterator.set_state(state)
  # Taken now, compared last: a wrong element names more than a wrong state.
  restored_state = stored_round_trip(iterator.get_state())
  wanted = len(expected) - point
  # One more than the rest when the stream ended: it must end here too.
  resumed = list(itertools.islice(iterator, wanted + 1 if exhausted else wanted))
  for offset, (got, want) in enumerate(zip(resumed, expected[point:])):
    problem = _first_difference(got, want, "element")
    if problem is not None:
      raise AssertionError(f"{where}, element {point + offset}: {problem}")
  if len(resumed) < wanted:
    raise AssertionError(
        f"{where}, element {point + len(resumed)}: the resumed stream ended; "
        f"the uninterrupted one has {len(expected)} elements."
    )
  if len(resumed) > wanted:
    raise AssertionError(
        f"{where}, element {len(expected)}: the resumed stream goes on past "
        f"the end of the uninterrupted one ({len(expected)} elements)."
    )
  problem = _first_difference(restored_state, state, "state")
  if problem is not None:
    raise AssertionError(
        f"{where}: right after set_state the iterator reports another state "
        f"than the one restored: {problem}"
    )


def _close(iterator: Any) -> None:
  # A DataIterator may hold reader threads or worker processes.
  close = getattr(iterator, "close", None)
  if callable(close):
    close()


def _snapshot_element(element: Any) -> Any:
  """A copy of an element's arrays, safe from buffer reuse by the pipeline."""
  if isinstance(element, np.ndarray):
    return element.copy()
  if type(element) is dict:
    return {k: _snapshot_element(v) for k, v in element.items()}
  if type(element) in (list, tuple):
    return type(element)(_snapshot_element(v) for v in element)
  return element
