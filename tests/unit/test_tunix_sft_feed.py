"""`tunix/sft.py` against stand-ins: the feed's position, its stop at max_steps, the format-2 state."""

import types

import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import ckpt_iter  # noqa: E402
from ckpt_iter.tunix import _input, sft  # noqa: E402


class _Trainer:
  """What the feed reads of a PeftTrainer: its config and step counters."""

  def __init__(self, max_steps):
    self.config = types.SimpleNamespace(max_steps=max_steps)
    self.train_steps = 0
    self.iter_steps = 0


def _feed(max_steps=None):
  records = [{"x": i} for i in range(10)]
  return sft._Feed(_Trainer(max_steps), _input.make_source(  # pylint: disable=protected-access
      ckpt_iter.make_dataset(records, batch_size=1, seed=None, num_epochs=1)))


def test_the_position_is_the_next_example_the_train_step_has_not_taken():
  feed = _feed()
  next(feed), next(feed)
  feed._trainer.iter_steps = 2  # pylint: disable=protected-access
  position = feed.position()
  # The input's own state, nested as the checkpoint holds it: nothing but the input's.
  assert set(position) == {_input.INPUT}
  assert position[_input.INPUT] == feed.source._iterator.state_part()  # pylint: disable=protected-access
  assert position[_input.INPUT].position == {"next_record": 2}
  assert position[_input.INPUT].content["check"] == "row"  # make_dataset's batch: its last row


def test_an_input_read_elsewhere_is_refused_rather_than_saved_at_the_wrong_place():
  feed = _feed()
  next(feed)  # the trainer has not counted it: something else read it
  with pytest.raises(ckpt_iter.CkptIterError, match="iter_steps=0 but its input has yielded 1"):
    feed.position()


def test_the_feed_stops_at_max_steps_before_reading():
  feed = _feed(max_steps=3)
  feed._trainer.train_steps = 3  # pylint: disable=protected-access
  with pytest.raises(StopIteration):
    next(feed)
  assert feed.examples_read == 0 and feed.source.position() == {"next_record": 0}
