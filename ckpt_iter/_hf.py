"""What a Hugging Face dataset is, and what a stream that cannot resume is told.

The one place that recognises a `datasets` object without importing
`datasets` (its class and module names), walks its examples-iterable layers
and finds the files it streams; and the words of every refusal that names
one: make_dataset's and HuggingFaceSource's of a streaming dataset,
StreamingIterator's of a source without a state or a layer that Hugging Face
does not resume exactly. Low in the package (errors and paths only), so a
source module can refuse a stream without importing the stream's iterator.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Iterable, Mapping

from ckpt_iter import _storage
from ckpt_iter import errors

# At most this many of a stream's files are named in a fingerprint or a refusal.
SHOWN_FILES = 4




def refusal(source: Any, where: str) -> str | None:
  """Why `source` cannot be read by a StreamingIterator, and what to do; None if it can.

  `where` names the call the value was passed to, e.g. "make_dataset(source=...)".
  """
  named = shown(source)
  if type(source).__name__ == "IterableDatasetDict" and is_hf_iterable(source):
    return (f"{where}: {named} is a datasets.IterableDatasetDict of splits {sorted(source)}; pass one "
            "split, e.g. source['train'].")
  if is_hf_iterable(source) and not callable(getattr(source, "state_dict", None)):
    return (f"{where}: {named} is a streaming datasets.IterableDataset of a datasets release without "
            "state_dict() (before 2.18), so its position cannot be saved. Upgrade datasets "
            "(pip install -U datasets), or load it without streaming=True (a datasets.Dataset for "
            "make_dataset).")
  if callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None)):
    if hasattr(source, "__iter__"):
      return None
    return f"{where}: {named} has state_dict() but is not iterable; pass the object records are read from."
  kind = ("generator" if inspect.isgenerator(source) else "one-shot iterator" if _is_one_shot(source)
          else f"{type(source).__qualname__} iterable")
  return (
      f"{where}: {named} is a {kind} without state_dict()/load_state_dict(), so nothing says where "
      "it is: the only way back to record N is to read the first N again. Ways through: "
      "ckpt_iter.ReplayIterator(iterable) resumes it exactly by replaying (O(position) at every "
      "restore); a list, files or any object with __len__ and __getitem__ go to "
      "ckpt_iter.make_dataset (O(1) restore, shuffled or not); an iterable with "
      "state_dict()/load_state_dict() (a Hugging Face streaming IterableDataset) goes to "
      "ckpt_iter.StreamingIterator(source, batch_size=...) (O(1) restore).")


def hf_streaming_refusal(source: Any, where: str) -> str:
  """make_dataset's refusal of a Hugging Face streaming dataset: what it needs, and both ways through."""
  shuffled = "BufferShuffledExamplesIterable" in {
      type(p).__name__ for p in chain(getattr(source, "_ex_iterable", None))}
  stream = ("(its shuffle buffer cannot be restored: stream it without .shuffle() for that)" if shuffled
            else "(unshuffled)")
  return (
      f"{where}: {shown(source)} is a streaming datasets.IterableDataset, which has no "
      "random access, so make_dataset cannot place records (nor shuffle them globally). Ways "
      "through: ckpt_iter.StreamingIterator(source, batch_size=...) resumes it in O(1) through "
      f"its own state_dict() {stream}; load it without streaming=True for a datasets.Dataset; or, "
      f"shuffled, pass its files to make_dataset{files_hint(source)} with seed=... and "
      "shuffle='shards' (whole files, a window at a time, O(1) restore).")


def make_dataset_refusal(source: Any, where: str) -> str:
  """Why make_dataset cannot take the iterable `source` (no random access), and what reads it instead."""
  if is_hf_iterable(source) and type(source).__name__ == "IterableDataset":
    return hf_streaming_refusal(source, where)
  return refusal(source, where) or (
      f"{where}: {errors.shown_value(source, 60)} is a stream with its own state_dict(), but no random "
      "access, so make_dataset cannot place its records. Read it with "
      "ckpt_iter.StreamingIterator(source, batch_size=...) (O(1) restore through that state).")


def refuse_inexact(source: Any) -> None:
  """UnsupportedConfigError for a Hugging Face layer its own state_dict() does not resume exactly."""
  layers = list(chain(getattr(source, "_ex_iterable", None)))
  names = [type(part).__name__ for part in layers]
  if "BufferShuffledExamplesIterable" in names:
    buffer = next(getattr(p, "buffer_size", None) for p in layers
                  if type(p).__name__ == "BufferShuffledExamplesIterable")
    raise errors.UnsupportedConfigError(
        f"StreamingIterator(source=...): the dataset is shuffled with a buffer "
        f"(IterableDataset.shuffle(buffer_size={buffer})). Hugging Face's state_dict() does not hold "
        "the buffer: on resume its examples are lost and it is refilled from later ones, so a "
        "restore would skip records. Ways through: make_dataset over the files, "
        f"make_dataset({files_hint(source, bare=True) or 'files'}, seed=..., shuffle='shards') (a "
        "shard-aware shuffle that resumes exactly in O(1)); or load without streaming=True and "
        "pass the datasets.Dataset to make_dataset(..., seed=...); or stream without .shuffle().")
  formatting = getattr(source, "_formatting", None)
  table = bool(getattr(formatting, "is_table", False)) or getattr(formatting, "format_type", None) == "arrow"
  if table and any(n == "MappedExamplesIterable" and getattr(p, "batched", False) for n, p in zip(names, layers)):
    raise errors.UnsupportedConfigError(
        f"StreamingIterator(source=...): the dataset applies a batched map() under the "
        f"{formatting.format_type!r} format, which Hugging Face's state_dict() may resume one batch "
        "late (a skip). Map without batched=True, or set the format after the map "
        "(.map(...).with_format(...)), or use make_dataset(transform=...).")


def chain(part: Any) -> Iterable[Any]:
  """The examples-iterable layers of a Hugging Face dataset, outermost first."""
  seen = 0
  while part is not None and seen < 256:
    yield part
    seen += 1
    for inner in getattr(part, "ex_iterables", None) or ():
      yield from chain(inner)
    part = getattr(part, "ex_iterable", None)


def files_of(source: Any) -> list[str]:
  files: list[str] = []
  for part in chain(getattr(source, "_ex_iterable", None)):
    kwargs = getattr(part, "kwargs", None)
    if isinstance(kwargs, Mapping):
      found = kwargs.get("base_files") or kwargs.get("files")
      if isinstance(found, (list, tuple)) and all(isinstance(f, str) for f in found):
        files.extend(found)
  return files


def files_hint(source: Any, *, bare: bool = False) -> str:
  # In the order a glob gives them (a shuffled stream holds its files shuffled), relative to the working
  # directory when under it (Hugging Face resolves what the user wrote to absolute paths).
  files = sorted(shown_path(f) for f in files_of(source)) if is_hf_iterable(source) else []
  if not files:
    return "" if bare else "(paths, ...)"
  shown = repr(files[:SHOWN_FILES])[:-1] + (", ...]" if len(files) > SHOWN_FILES else "]")
  return shown if bare else f"({shown}, ...)"


def shown_path(path: str) -> str:
  """A stream's file as a user would write it: relative to the working directory when under it."""
  if _storage.is_url(path) or not os.path.isabs(path):
    return path
  relative = os.path.relpath(path)
  return path if relative.startswith(os.pardir) else relative


def files_text(files: list[str]) -> str:
  names = [os.path.basename(f.rstrip("/")) for f in files]
  if len(names) <= SHOWN_FILES:
    return ",".join(names)
  return f"{len(names)} files {names[0]}..{names[-1]}"


def shown(source: Any) -> str:
  if is_hf_iterable(source) and type(source).__name__ == "IterableDataset":
    return f"IterableDataset {source_name(source)}"
  return errors.shown_value(source, 60)


def source_name(source: Any) -> str:
  if is_hf_iterable(source):
    info = getattr(source, "info", None)
    parts = [getattr(info, "dataset_name", None), getattr(info, "config_name", None), getattr(source, "split", None)]
    return f"hf[{':'.join(str(p) for p in parts if p)}]"
  return f"{type(source).__module__}.{type(source).__qualname__}"


def is_hf_iterable(source: Any) -> bool:
  """A datasets.IterableDataset, recognised without importing datasets."""
  module = type(source).__module__ or ""
  return module.split(".")[0] == "datasets" and type(source).__name__ in ("IterableDataset", "IterableDatasetDict")



def _is_one_shot(source: Any) -> bool:
  try:
    return iter(source) is source
  except TypeError:
    return False
