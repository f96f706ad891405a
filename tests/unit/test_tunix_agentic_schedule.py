"""Tests for the agentic learner's schedule (`ckpt_iter.tunix._agentic_schedule`).

The schedule is driven here by `_ToyLearner`, a `Port` whose rollouts finish
in an order Hypothesis picks. A prompt's content is its index times 10 plus 3
(so every input is told apart); a trainer input is the array of its prompts'
contents. Each `update_actor` chunk is recorded; a kill takes the state as a
Tunix save inside `update_actor` would, then the run stops.
"""

import dataclasses
import random

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

# The schedule imports no Tunix, but its package (ckpt_iter.tunix) does.
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

import ckpt_iter  # noqa: E402
from ckpt_iter import errors  # noqa: E402
from ckpt_iter import testing  # noqa: E402
from ckpt_iter.tunix import _agentic_schedule as schedule_lib  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Config:
  full: int  # prompts per fed batch
  micro: int
  grad_acc: int
  num_iterations: int
  replays: bool  # main's order
  raw_groups: bool  # converted per micro-batch
  shared_weights: bool
  off_policy_steps: int
  batches: int  # full batches in the input
  partial_last: int  # prompts of a last, short batch (stock drops it)
  max_steps: int | None
  eagerness: float  # the chance that a rollout has finished whenever the schedule looks


@st.composite
def _configs(draw):
  micro = draw(st.integers(1, 2))
  full = micro * draw(st.integers(1, 2))
  per_step = full // micro
  return _Config(
      full=full, micro=micro,
      grad_acc=draw(st.sampled_from([g for g in (1, 2) if per_step % g == 0])),
      num_iterations=draw(st.integers(1, 3)),
      replays=draw(st.booleans()), raw_groups=draw(st.booleans()),
      shared_weights=draw(st.booleans()), off_policy_steps=draw(st.integers(0, 1)),
      batches=draw(st.integers(1, 3)), partial_last=draw(st.integers(0, full - 1)),
      max_steps=draw(st.one_of(st.none(), st.integers(1, 3))),
      eagerness=draw(st.sampled_from([0.0, 0.5, 1.0])),
  )


class _Killed(Exception):
  pass


def _content(prompt: int) -> int:
  return prompt * 10 + 3


class _ToyLearner:
  """A Port: feeds batches of prompt indices, finishes rollouts in a random order."""

  def __init__(self, config: _Config, arrivals: random.Random, kill_at: int | None = None,
               slow: frozenset[int] = frozenset(), wait_for_fed: bool = True):
    self.config = config
    self.wait_for_fed = wait_for_fed  # False: save as checkpoints before the wait rule were
    self.arrivals = arrivals
    self.slow = slow  # prompts whose rollout finishes only when the schedule waits for it
    self.kill_at = kill_at  # the chunk (counted over the whole run) after which to save and stop
    sizes = [config.full] * config.batches + ([config.partial_last] if config.partial_last else [])
    starts = np.cumsum([0] + sizes)
    self.batches = [list(range(starts[i], starts[i + 1])) for i in range(len(sizes))]
    self.schedule = schedule_lib.Schedule(
        config.num_iterations, config.replays, config.shared_weights, merge=np.concatenate)
    self.schedule.set_sizes(config.full, config.micro, config.grad_acc, config.raw_groups)
    self.next_batch = 0
    self.feeding_done = False
    self.outstanding: list[int] = []  # fed prompts whose rollout has not finished
    self.done_sent = False
    self.global_steps = 0
    self.trainer_steps_count = 0
    self.learner_iter_steps = 0
    self.records: list[tuple] = []
    self.refed: list[int] = []  # prompts a resume rolls out again
    self.saved: ckpt_iter.IteratorState | None = None

  # --- the run, fresh or resumed -----------------------------------------------------

  def start(self) -> None:
    for _ in range(self.config.off_policy_steps + 1):
      if not self._feed():
        break
    self._consume()

  def resume(self, value: ckpt_iter.IteratorState) -> None:
    counters = value.counters
    position = value.position
    replay = self.schedule.check_replay(
        position, counters["micro_batches_in_step"], len(value.pending.schedule), origin="toy")
    self.next_batch = value.part.position["next_batch"]  # the input's state, nested as a learner's is
    fed_positions = []
    for _ in range(position["batches_fed"]):
      fed_positions.append(self.input_position())
      self.next_batch += 1
    refeed = self.schedule.restore(
        value.pending.items, value.pending.schedule, position,
        counters["micro_batches_in_step"], fed_positions, replay)
    self.outstanding = list(refeed)
    self.refed = list(refeed)
    self.global_steps = counters["global_steps"]
    self.trainer_steps_count = counters["trainer_steps"]
    self.learner_iter_steps = counters["learner_iter_steps"]
    self.feeding_done = bool(counters["feeding_done"])
    self._consume(finish_step=self.schedule.step_complete)  # the killed run saved, then would have

  def _consume(self, finish_step: bool = False) -> None:
    try:
      if finish_step:
        self.schedule.finish_global_step(self)
      self.schedule.consume(self)
    except _Killed:
      pass

  def _feed(self) -> bool:
    if self.feeding_done:
      return False
    position = self.input_position()
    batch = self.batches[self.next_batch] if self.next_batch < len(self.batches) else None
    self.next_batch += 1
    if batch is None or self.max_steps_reached() or len(batch) != self.config.full:
      self.feeding_done = True
      return False
    fed = self.schedule.feed(position, len(batch))
    assert list(fed) == batch
    self.outstanding.extend(batch)
    return True

  # --- the Port --------------------------------------------------------------------

  def receive(self, block: bool):
    ready = self.outstanding if block else [p for p in self.outstanding if p not in self.slow]
    if ready and (block or self.arrivals.random() < self.config.eagerness):
      prompt = ready[self.arrivals.randrange(len(ready))]
      self.outstanding.remove(prompt)
      unit = np.array([_content(prompt)])
      return prompt, (unit if self.config.raw_groups else [unit])
    if not self.outstanding and self.feeding_done and not self.done_sent:
      self.done_sent = True
      return schedule_lib.PRODUCER_DONE
    assert not block, "the schedule waits for a rollout that was never fed"
    return None

  def max_steps_reached(self) -> bool:
    return self.config.max_steps is not None and self.global_steps >= self.config.max_steps

  def trainer_steps(self) -> int:
    return self.trainer_steps_count

  def input_position(self):
    return ckpt_iter.IteratorState(kind="data", fingerprint={"source": "toy"}, position={"next_batch": self.next_batch})

  def train(self, update, first_mini_batch):
    self.learner_iter_steps += 1
    self._chunk("train", update.example, first_mini_batch)

  def replay(self, inputs, starts_pass, pass_size):
    if starts_pass:
      self.learner_iter_steps += pass_size
    for example in inputs:
      self._chunk("replay", example, None)

  def end_global_step(self) -> None:
    if not self.config.shared_weights:
      assert not self.outstanding, "weights synced while a fed prompt's rollout was unfinished"
    self.global_steps += 1
    self._feed()

  def _chunk(self, kind, example, first_mini_batch) -> None:
    if self.config.shared_weights:
      assert not self.outstanding, "an update ran while a fed prompt's rollout was unfinished"
    self.trainer_steps_count += 1
    self.records.append((kind, tuple(int(x) for x in example), first_mini_batch, self.learner_iter_steps))
    if len(self.records) - 1 == self.kill_at:
      self.saved = self._snapshot()
      raise _Killed

  def _snapshot(self) -> ckpt_iter.IteratorState:
    saved = self.schedule.snapshot(self, wait_for_fed=self.wait_for_fed)
    value = ckpt_iter.IteratorState(
        kind="tunix", fingerprint={}, position=saved.position,
        pending=ckpt_iter.Pending(items=saved.items, schedule=saved.order),
        counters={
            "micro_batches_in_step": saved.micro_batches_in_step,
            "global_steps": self.global_steps, "trainer_steps": self.trainer_steps_count,
            "learner_iter_steps": self.learner_iter_steps, "feeding_done": int(self.feeding_done),
        },
    )
    return ckpt_iter.IteratorState.from_dict(testing.stored_round_trip(value.to_dict()))


def _uninterrupted(config, seed=0):
  learner = _ToyLearner(config, random.Random(seed))
  learner.start()
  return learner.records


def _check_counts(config, records):
  """Without max_steps every prompt of a full batch is trained num_iterations times, and
  no prompt more. (With max_steps the run stops at a global step boundary, which
  0.1.7's order counts in repeated inputs, as stock does: a prompt may be cut.)"""
  trained: dict[int, int] = {}
  for _, prompts, _, _ in records:
    for content in prompts:
      trained[content] = trained.get(content, 0) + 1
  everything = {_content(p): config.num_iterations for p in range(config.batches * config.full)}
  if config.max_steps is None:
    assert trained == everything
  else:
    assert trained and all(count <= everything.get(content, 0) for content, count in trained.items())


@hypothesis.given(config=_configs(), seeds=st.lists(st.integers(0, 2**16), min_size=2, max_size=2))
@hypothesis.settings(max_examples=150, deadline=None)
def test_every_arrival_order_trains_the_same_sequence(config, seeds):
  in_order = _uninterrupted(config, seed=0)
  for seed in seeds:
    assert _uninterrupted(config, seed) == in_order
  _check_counts(config, in_order)


@hypothesis.given(config=_configs(), data=st.data())
@hypothesis.settings(max_examples=150, deadline=None)
def test_kills_at_any_chunk_resume_the_rest_of_the_run_exactly(config, data):
  expected = _uninterrupted(config)
  hypothesis.assume(expected)
  kills = sorted(set(data.draw(
      st.lists(st.integers(0, len(expected) - 1), min_size=1, max_size=2), label="kills")))
  records: list[tuple] = []
  saved = None
  for run, kill_at in enumerate([*kills, None]):
    seed = data.draw(st.integers(0, 2**16), label=f"arrivals of run {run}")
    learner = _ToyLearner(config, random.Random(seed), kill_at=None if kill_at is None else kill_at - len(records),
                          wait_for_fed=data.draw(st.booleans(), label=f"run {run} saves waiting for rollouts"))
    if saved is None:
      learner.start()
    else:
      learner.resume(saved)
    records.extend(learner.records)
    saved = learner.saved
    assert (saved is None) == (kill_at is None)
  assert records == expected


def test_finished_groups_wait_for_every_earlier_prompt():
  config = _Config(full=2, micro=1, grad_acc=1, num_iterations=1, replays=False, raw_groups=False,
                   shared_weights=False, off_policy_steps=0, batches=1, partial_last=0, max_steps=None,
                   eagerness=0.0)
  learner = _ToyLearner(config, random.Random(0))
  learner.schedule.feed({"next_batch": 0}, 2)
  learner.schedule.produced[1] = [np.array([13])]
  learner.schedule.absorb_ready(learner)
  assert not learner.schedule.updates and learner.schedule.next_prompt == 0
  learner.schedule.produced[0] = [np.array([3])]
  learner.schedule.absorb_ready(learner)
  assert [int(u.example[0]) for u in learner.schedule.updates] == [3, 13]


def _replay_config():
  return _Config(full=2, micro=1, grad_acc=1, num_iterations=3, replays=True, raw_groups=False,
                 shared_weights=True, off_policy_steps=0, batches=2, partial_last=0, max_steps=None,
                 eagerness=0.5)


def test_a_kill_inside_a_replay_pass_resumes_at_its_next_chunk():
  config = _replay_config()
  expected = _uninterrupted(config)
  kill_at = [kind for kind, *_ in expected].index("replay")  # the first replay chunk
  learner = _ToyLearner(config, random.Random(1), kill_at=kill_at)
  learner.start()
  assert learner.saved.position["replay"] == {"inputs": 2, "pass": 0, "chunks_done": 1}
  resumed = _ToyLearner(config, random.Random(2))
  resumed.resume(learner.saved)
  assert learner.records + resumed.records == expected


def _slow_second_batch_config():
  # Off-policy feeding with separate weights: the next batch is fed while the
  # step trains, and its first group finishes before the save.
  return _Config(full=2, micro=2, grad_acc=1, num_iterations=1, replays=False, raw_groups=True,
                 shared_weights=False, off_policy_steps=1, batches=3, partial_last=0, max_steps=None,
                 eagerness=1.0)


def test_a_save_waits_for_every_fed_rollout_so_a_resume_rolls_out_nothing_again():
  config = _slow_second_batch_config()
  expected = _uninterrupted(config)
  learner = _ToyLearner(config, random.Random(0), kill_at=0, slow=frozenset({3}))
  learner.start()
  assert not learner.outstanding and learner.saved.position["batches_fed"] == 0
  assert learner.saved.position["prompt_index"] == 4  # batches 0 and 1, all in the checkpoint
  resumed = _ToyLearner(config, random.Random(0))
  resumed.resume(learner.saved)
  assert resumed.refed == []
  assert learner.records + resumed.records == expected


def test_an_earlier_state_with_a_raw_group_short_of_its_micro_batch_rolls_it_out_again():
  # Written without the wait (as before it), prompt 3 still in flight: prompt
  # 2's raw group is not an input yet, so the state starts at its prompt.
  config = _slow_second_batch_config()
  expected = _uninterrupted(config)
  learner = _ToyLearner(config, random.Random(0), kill_at=0, slow=frozenset({3}), wait_for_fed=False)
  learner.start()
  assert learner.schedule.units and learner.saved.position["prompt_index"] == 2
  assert learner.saved.position["batches_fed"] == 1
  resumed = _ToyLearner(config, random.Random(0))
  resumed.resume(learner.saved)
  assert resumed.refed == [2, 3]
  assert learner.records + resumed.records == expected


@pytest.mark.parametrize("replay, fragment", [
    ({"inputs": 2, "pass": 3, "chunks_done": 0}, "inconsistent replay position"),
    ({"inputs": 1, "pass": 0, "chunks_done": 0}, "inconsistent replay position"),
    ({"inputs": 2, "pass": 0, "chunks_done": 2}, "inconsistent replay position"),
    ({"inputs": 2, "pass": "0", "chunks_done": 0}, "inconsistent replay position"),
    (None, "0.1.7's per-group repeat order"),
])
def test_a_bad_saved_replay_position_is_refused_before_anything_changes(replay, fragment):
  config = _replay_config()
  learner = _ToyLearner(config, random.Random(0), kill_at=2)
  learner.start()
  position = dict(learner.saved.position)
  position.pop("replay")
  if replay is not None:
    position["replay"] = replay
  fresh = _ToyLearner(config, random.Random(0))
  with pytest.raises((errors.InvalidStateError, errors.UnsupportedConfigError), match=fragment):
    fresh.schedule.check_replay(position, 2, len(learner.saved.pending.schedule), origin="toy")
  assert not fresh.schedule.updates and fresh.schedule.next_prompt == 0


def test_main_order_state_is_refused_by_the_per_group_order():
  config = _replay_config()
  learner = _ToyLearner(config, random.Random(0), kill_at=2)
  learner.start()
  other = _ToyLearner(dataclasses.replace(config, replays=False), random.Random(0))
  with pytest.raises(errors.UnsupportedConfigError, match="main's full-batch replay order"):
    other.schedule.check_replay(learner.saved.position, 2, len(learner.saved.pending.schedule), origin="toy")
