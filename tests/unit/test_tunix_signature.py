"""A drop-in's constructor shows and binds its stock Tunix class's (`tunix/_signature.py`)."""

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")


def _drop_ins():
  import ckpt_iter.tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top

  names = [n for n in ckpt_tunix.__all__ if n.startswith("Resumable") and n not in (
      "Resumable", "ResumableSft", "ResumableAgentic")]
  return [getattr(ckpt_tunix, n) for n in names]


def _stock_class(cls):
  return next(base for base in cls.__mro__ if base.__module__.startswith("tunix."))


def test_every_drop_in_shows_its_stock_class_signature():
  import inspect  # pylint: disable=g-import-not-at-top

  drop_ins = _drop_ins()
  assert len(drop_ins) >= 7  # GRPO, PPO, DAPO, DrGRPO, PEFT, DPO, agentic GRPO
  for cls in drop_ins:
    stock = _stock_class(cls)
    assert inspect.signature(cls) == inspect.signature(stock), cls.__name__
    assert "args" not in inspect.signature(cls).parameters, cls.__name__


def test_a_misspelt_argument_is_a_type_error_naming_it():
  import ckpt_iter.tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top

  with pytest.raises(TypeError, match="data_shuffel_seed"):
    ckpt_tunix.ResumableGRPOLearner(None, None, None, data_shuffel_seed=0)


def test_type_checkers_see_the_stock_constructor():
  """The mixins' `__init__` is defined only outside `TYPE_CHECKING`, so a checker
  resolves the constructor to the Tunix class's (and flags a misspelt keyword)."""
  import ast  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top

  import ckpt_iter.tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top

  for mixin in (ckpt_tunix.Resumable, ckpt_tunix.ResumableSft, ckpt_tunix.ResumableAgentic):
    tree = ast.parse(inspect.getsource(inspect.getmodule(mixin)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == mixin.__name__).body
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in body), mixin
    guarded = [n for n in body if isinstance(n, ast.If) and ast.unparse(n.test) == "not TYPE_CHECKING"]
    assert any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for g in guarded for n in g.body), mixin


def test_a_user_subclass_shows_its_own_constructor():
  import inspect  # pylint: disable=g-import-not-at-top

  import ckpt_iter.tunix as ckpt_tunix  # pylint: disable=g-import-not-at-top

  class Mine(ckpt_tunix.ResumableGRPOLearner):
    def __init__(self, extra, **kwargs):  # pylint: disable=useless-parent-delegation
      super().__init__(**kwargs)

  assert list(inspect.signature(Mine).parameters) == ["extra", "kwargs"]
