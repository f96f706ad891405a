"""`tunix/_items.py` against stand-ins: Orbax's warning about ckpt_iter's items, dropped only where harmless."""

import logging
import os

import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter.tunix import _items

_WARNING = ('Item "%s" was found in the checkpoint, but could not be restored. Please provide a '
            "`CheckpointHandlerRegistry`, or call `restore` with an appropriate `CheckpointArgs` subclass.")


def _warn_from(filename, item):
  """Logs Orbax's warning on absl's logger from code that claims to live in `filename`."""
  code = compile(f"logging.getLogger('absl').warning({_WARNING!r}, {item!r})", filename, "exec")
  exec(code, {"logging": logging})  # pylint: disable=exec-used


@pytest.mark.parametrize("filename, item, shown", [
    (os.path.join("site-packages", "tunix", "sft", "checkpoint_manager.py"), "data", False),
    (os.path.join("site-packages", "tunix", "sft", "checkpoint_manager.py"), "rollout_params", False),
    (os.path.join("site-packages", "tunix", "sft", "checkpoint_manager.py"), "model_extra", True),
    (os.path.join("my_project", "train.py"), "data", True),  # a user's own restore still warns
])
def test_the_warning_is_dropped_only_for_own_items_inside_tunix_s_restore(caplog, filename, item, shown):
  _items.silence_tunix_restore_warning()
  _items.silence_tunix_restore_warning()  # idempotent: one filter
  assert sum(isinstance(f, _items._OwnItemsNotRestoredByTunix)  # pylint: disable=protected-access
             for f in logging.getLogger("absl").filters) == 1
  with caplog.at_level(logging.WARNING, logger="absl"):
    _warn_from(filename, item)
  assert any(f'Item "{item}" was found' in r.getMessage() for r in caplog.records) == shown


def test_the_data_item_is_the_first_item_orbax_awaits():
  """Orbax awaits the items' writes in the Composite's order; the data item's write runs when awaited,
  so it comes first, overlapping the model's writes instead of following them."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  saved = []

  class Real:
    def save(self, step, args=None, **kwargs):
      saved.append(list(args.keys()))
      return True

  class Items:
    def add_items(self, step, items, custom_metadata):
      items[_items.DATA_ITEM] = _items.Snapshot(state_lib.IteratorState(kind="tunix", fingerprint={}, position={}))
      return custom_metadata

    def critic(self):
      return None

  saving = _items._SavingManager(Real(), Items())  # pylint: disable=protected-access
  tree = {"w": 1.0}
  assert saving.save(3, args=ocp.args.Composite(
      model_params=ocp.args.PyTreeSave(tree), optimizer_state=ocp.args.PyTreeSave(tree)), custom_metadata={})
  assert saved == [[_items.DATA_ITEM, "model_params", "optimizer_state"]]
