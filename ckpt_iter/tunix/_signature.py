"""Drop-in constructors that bind exactly like the Tunix class they extend.

A mixin's `__init__(self, *args, **kwargs)` forwards everything, but it hides
the Tunix class's parameters: `inspect.signature` shows `(*args, **kwargs)`
and a type checker accepts any keyword. The mixins therefore define their
`__init__` out of the type checker's sight (under `if not TYPE_CHECKING`), so
a checker sees the Tunix constructor, and `presents_stock_signature` gives
each concrete class the signature of the constructor its mixin forwards to.
"""

from __future__ import annotations

import inspect
from typing import Any


def forwarded_constructor(cls: type, mixin: type) -> Any:
  """The first `__init__` in `cls`'s MRO that is not `mixin`'s (the one it forwards to)."""
  for base in cls.__mro__:
    if base is mixin:
      continue
    if "__init__" in vars(base):
      return vars(base)["__init__"]
  return object.__init__


def presents_stock_signature(cls: type, mixin: type) -> None:
  """Sets `cls.__signature__` to its constructor's parameters, without `self`.

  For `class ResumableGRPOLearner(Resumable, GRPOLearner)` that is
  GRPOLearner's; a user subclass with its own `__init__` shows its own.
  """
  signature = inspect.signature(forwarded_constructor(cls, mixin))
  parameters = list(signature.parameters.values())[1:]  # drop self
  cls.__signature__ = signature.replace(parameters=parameters)
