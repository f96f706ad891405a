"""The agentic learner's driver (`ckpt_iter.tunix._agentic_loop.ConsumerLoop`), without a Tunix run.

`ConsumerLoop` runs here against in-process stand-ins for Tunix's agentic
learner and its RLCluster: they hold the attributes `_api` reads and record
every call the loop makes, so each rule of the driver is checked in
milliseconds. The producer (`ConsumerLoop._produce`, on the learner's asyncio
loop) is replaced by `_InlineRollout`, which rolls out the next fed prompt
whenever the loop waits for one; the real producer is left to the
integration tests. A prompt is the integer `p`; its group holds the
trajectories `10 * p + g` for each generation `g`, so every trainer input
tells which prompts it holds.
"""

import asyncio
import functools
import queue
import threading
import types

import numpy as np
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.agentic import agentic_rl_learner

from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter import testing
from ckpt_iter.tunix import _agentic_loop
from ckpt_iter.tunix import _agentic_schedule as schedule_lib
from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _input

REPEAT = api.AGENTIC_REPEAT_EACH
REPLAY = api.AGENTIC_REPLAY_FULL_BATCH
TRAIN = rl_cluster_lib.Mode.TRAIN
EVAL = rl_cluster_lib.Mode.EVAL


# --- trainer inputs and batches ----------------------------------------------------------



def _snapshot(loop):
  """The state Tunix's save of the actor's current step takes."""
  return loop.snapshot(int(loop.cluster.actor_trainer.train_steps))

def _example(*values):
  """A trainer input with one row per value (as Tunix makes one per trajectory)."""
  ids = np.asarray(values, dtype=np.int32).reshape(-1, 1)
  return agentic_rl_learner.TrainExample(
      prompt_ids=ids, prompt_mask=np.ones_like(ids), completion_ids=ids,
      completion_mask=np.ones_like(ids), advantages=ids[:, 0].astype(np.float32),
      ref_per_token_logps=None, old_per_token_logps=None)


def _rows(example):
  return tuple(int(x) for x in np.asarray(example.completion_ids)[:, 0])


def _group(prompt, generations):
  return [10 * prompt + g for g in range(generations)]


def _batches(*sizes):
  """Batch dicts of the consecutive prompts 0, 1, ...; every field is per row."""
  batches, start = [], 0
  for size in sizes:
    prompts = list(range(start, start + size))
    batches.append({"prompt": prompts, "answer": [f"answer {p}" for p in prompts]})
    start += size
  return batches


def _prompt(p):
  """A prompt as the stand-in's re-batcher hands it to the rollout."""
  return {"prompt": [p], "answer": [f"answer {p}"]}


def _drain(q):
  items = []
  while True:
    try:
      items.append(q.get_nowait())
    except queue.Empty:
      return items


# --- stand-ins for Tunix -------------------------------------------------------------------


class _SyncLock:
  """Tunix's RolloutSyncLock: logs when it is taken and given back."""

  def __init__(self, events):
    self.events = events

  def acquire_weight_sync(self):
    self.events.append("acquire_weight_sync")

  def release_weight_sync(self):
    self.events.append("release_weight_sync")


class _LoggedQueue(queue.Queue):
  """A prompt queue that logs each prompt put, to see what happens under the sync lock."""

  def __init__(self, events):
    super().__init__()
    self.events = events

  def put(self, item, block=True, timeout=None):
    self.events.append(("put", None if item is None else int(item["prompt"][0])))
    super().put(item, block, timeout)


class _Cluster:
  """Tunix's RLCluster as the loop uses it; records every call.

  `update_actor` trains one step per input chunk, as Tunix's trainer does,
  and calls `on_save` after each (Tunix saves inside `update_actor`).
  """

  def __init__(self, learner, events):
    self.learner = learner
    self.events = events
    self.global_steps = 0
    self.actor_trainer = types.SimpleNamespace(train_steps=0, iter_steps=0)
    self.perf_v2 = types.SimpleNamespace(export=lambda: {"perf/exported": 1})
    self.calls = []  # (inputs, eval_examples, skip_jit) of each update_actor call
    self.chunks = []  # (rows, learner iter steps, global_steps, policy_version) of each chunk
    self.async_metrics = []
    self.metrics = []
    self.closed = False
    self.on_save = None

  def update_actor(self, inputs, eval_examples, skip_jit):
    self.calls.append((list(inputs), eval_examples, skip_jit))
    for chunk in inputs:
      self.actor_trainer.train_steps += 1
      self.actor_trainer.iter_steps += 1
      self.chunks.append((_rows(chunk), api.learner_iter_steps(self.learner), self.global_steps,
                          self.learner.policy_version))
      if self.on_save is not None:
        self.on_save()

  def sync_weights(self):
    self.events.append("sync_weights")
    self.global_steps += 1  # as Tunix's: a sync ends a global step

  def buffer_metrics_async(self, metrics, mode, step):
    self.async_metrics.append((dict(metrics), mode, step))

  def buffer_metrics(self, metrics, mode):
    self.metrics.append((metrics, mode))

  def close(self):
    self.closed = True


class GRPOLearnerStandIn:
  """The attributes of Tunix's agentic learner that `_api` reads, set as Tunix sets them."""

  __module__ = "tunix.rl.agentic.stand_in"  # the loop's fingerprint names the Tunix class

  def __init__(self, *, num_iterations=1, num_generations=2, off_policy_steps=0, mini_batch_size=None,
               train_micro_batch_size=None, max_steps=None, eval_every_n_steps=1,
               compute_logps_micro_batch_size=1, should_sync_weights=False, engine_name="rl_cluster"):
    self._training_config = types.SimpleNamespace(
        mini_batch_size=mini_batch_size, train_micro_batch_size=train_micro_batch_size,
        max_steps=max_steps, eval_every_n_steps=eval_every_n_steps)
    self.algo_config = types.SimpleNamespace(
        num_iterations=num_iterations, num_generations=num_generations, off_policy_steps=off_policy_steps)
    self._iter_steps = 0
    self._eval_iter_steps = 0
    self._last_eval_train_step = -1
    self._compute_logps_micro_batch_size = compute_logps_micro_batch_size
    self._full_batch_size = 0
    self._rollout_micro_batch_size = None
    self._process_in_consumer = None
    self.should_sync_weights = should_sync_weights
    self.policy_version = 0
    self.events = []
    self.cluster = _Cluster(self, self.events)
    setattr(self, engine_name, self.cluster)
    self._rollout_sync_lock = _SyncLock(self.events)
    self.loop = None  # the asyncio loop evaluations run on (`event_loop` fixture)
    self.conversions = []  # (trajectories, mode) of each `_batch_to_train_example` call

  def _create_micro_batch_iterator(self, full_batch_iterator, micro_batch_size):
    for batch in full_batch_iterator:
      rows = len(next(iter(batch.values())))
      for start in range(0, rows, micro_batch_size):
        yield {key: values[start:start + micro_batch_size] for key, values in batch.items()}

  def _batch_to_train_example(self, batch_results, mode):
    self.conversions.append((list(batch_results), mode))
    return [_example(*batch_results)]

  def _num_generations(self):
    return self.algo_config.num_generations

  def _build_orchestrator(self):
    return "orchestrator"

  async def _orchestrator_producer(self, orchestrator, prompt_iterator, num_generations):
    assert orchestrator == "orchestrator"
    for prompt in prompt_iterator:
      yield _group(int(prompt["prompt"][0]), num_generations)


class _Resumable(GRPOLearnerStandIn):
  """As `ResumableAgentic` sits on a Tunix class: a subclass from outside Tunix."""


class _InlineRollout:
  """The producer, synchronous: rolls out the next fed prompt when the loop waits for one.

  Takes the place of `ConsumerLoop.results`; numbers prompts from the
  schedule's next prompt, and hands raw groups or converted inputs, as
  `_produce` does.
  """

  def __init__(self, loop):
    self.loop = loop
    self.next_index = loop.schedule.next_prompt
    self.done = False

  def get(self, block=True):
    if not block:
      raise queue.Empty
    assert not self.done, "the loop waits for the producer after it finished"
    try:
      prompt = self.loop.prompt_queue.get_nowait()
    except queue.Empty:
      raise AssertionError("the loop waits for a rollout that was never fed: it would hang") from None
    if prompt is None:
      self.done = True
      return _agentic_loop._DONE  # pylint: disable=protected-access
    index, self.next_index = self.next_index, self.next_index + 1
    group = _group(int(prompt["prompt"][0]), self.loop.algo.num_generations)
    payload = group if self.loop.in_consumer else api.agentic_to_train_examples(self.loop.learner, group, TRAIN)
    return index, payload


class _Killed(Exception):
  pass


def _loop(monkeypatch, learner, batches=(), order=REPEAT, eval_dataset=None, skip_jit=False):
  monkeypatch.setattr(api, "agentic_iteration_order", lambda: order)
  return _agentic_loop.ConsumerLoop(learner, _input.make_source(list(batches)), eval_dataset, skip_jit)


@pytest.fixture
def event_loop():
  """A running asyncio loop in a thread, as the learner's `loop` is."""
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, daemon=True)
  thread.start()
  yield loop
  loop.call_soon_threadsafe(loop.stop)
  thread.join(timeout=10)
  loop.close()


# --- driving the loop as `ConsumerLoop.run` does, without the asyncio producer ----------------


def _start(loop):
  loop.results = _InlineRollout(loop)
  loop.started = True
  for _ in range(loop.algo.off_policy_steps + 1):
    if not loop._feed_next_batch():  # pylint: disable=protected-access
      break
  loop.schedule.consume(loop)


def _stored(value):
  """`value` as a checkpoint gives it back (JSON header, arrays through npz)."""
  return state_lib.IteratorState.from_dict(testing.stored_round_trip(value.to_dict()))


def _restore(loop, value):
  """What `ResumableAgentic` does with a checkpoint's data state; the prompts to roll out again."""
  value = _stored(value)
  saved_input, position = _input.input_part(value, "test")
  checked = _input.check_learner_state(
      value.fingerprint, loop.fingerprint, loop.source, saved_input,
      allow_drift=frozenset(), origin="test", optional_learner_fields=("num_iterations_order",))
  # Tunix restores its trainer's counters with the actor.
  loop.cluster.actor_trainer.train_steps = loop.cluster.actor_trainer.iter_steps = value.counters["train_steps"]
  return loop._restore(value, checked, position)  # pylint: disable=protected-access


def _continue(loop, refeed):
  loop.results = _InlineRollout(loop)
  loop.started = True
  for prompt in refeed:
    loop.prompt_queue.put(prompt)
  if loop.schedule.step_complete:
    loop.schedule.finish_global_step(loop)
  loop.schedule.consume(loop)


def _save_and_stop_at(loop, chunk):
  """Makes the run take a snapshot after its `chunk`-th trainer step (as a save) and stop."""
  saved = []

  def on_save():
    if len(loop.cluster.chunks) - 1 == chunk:
      saved.append(_snapshot(loop))
      raise _Killed

  loop.cluster.on_save = on_save
  return saved


# --- construction and fingerprint -----------------------------------------------------------


def test_more_than_one_iteration_in_an_unrecognised_tunix_order_is_refused(monkeypatch):
  with pytest.raises(errors.UnsupportedConfigError, match="num_iterations"):
    _loop(monkeypatch, GRPOLearnerStandIn(num_iterations=2), order=None)


@pytest.mark.parametrize("order, num_iterations, replays, evaluates_once_per_step", [
    (None, 1, False, False),
    (REPEAT, 1, False, False),
    (REPEAT, 3, False, False),
    (REPLAY, 1, False, True),
    (REPLAY, 3, True, True),
])
def test_only_mains_order_with_more_than_one_iteration_replays_and_it_evaluates_once_per_step(
    monkeypatch, order, num_iterations, replays, evaluates_once_per_step):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(num_iterations=num_iterations), order=order)
  assert loop.replays is replays and loop.schedule.replays is replays
  assert loop.evaluates_once_per_step is evaluates_once_per_step
  assert loop.schedule.num_iterations == num_iterations


@pytest.mark.parametrize("should_sync_weights", [False, True])
def test_the_schedule_shares_weights_exactly_when_tunix_does_not_sync_them(monkeypatch, should_sync_weights):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(should_sync_weights=should_sync_weights))
  assert loop.schedule.shared_weights is (not should_sync_weights)


def test_mains_rl_engine_is_the_cluster_the_loop_drives(monkeypatch):
  learner = GRPOLearnerStandIn(engine_name="rl_engine")
  assert not hasattr(learner, "rl_cluster")
  assert _loop(monkeypatch, learner).cluster is learner.cluster


def test_the_fingerprint_names_the_tunix_class_and_the_batch_geometry(monkeypatch):
  learner = _Resumable(num_iterations=2, num_generations=4, off_policy_steps=1, mini_batch_size=4,
                       train_micro_batch_size=2, compute_logps_micro_batch_size=2)
  assert _loop(monkeypatch, learner, order=REPEAT).fingerprint == {
      "agentic_learner": "GRPOLearnerStandIn",  # not the subclass outside Tunix
      "num_generations": 4,
      "num_iterations": 2,
      "off_policy_steps": 1,
      "mini_batch_size": 4,
      "train_micro_batch_size": 2,
      "compute_logps_micro_batch_size": 2,
  }


@pytest.mark.parametrize("order, num_iterations, has_order_field", [
    (REPLAY, 2, True),
    (REPLAY, 1, False),
    (REPEAT, 2, False),
    (None, 1, False),
])
def test_only_the_replay_order_with_more_than_one_iteration_adds_it_to_the_fingerprint(
    monkeypatch, order, num_iterations, has_order_field):
  fingerprint = _loop(monkeypatch, _Resumable(num_iterations=num_iterations), order=order).fingerprint
  assert ("num_iterations_order" in fingerprint) is has_order_field
  if has_order_field:
    assert fingerprint["num_iterations_order"] == REPLAY


# --- sizes -------------------------------------------------------------------------------------


def test_a_mini_batch_that_does_not_divide_the_full_batch_is_refused(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(mini_batch_size=3, train_micro_batch_size=1))
  with pytest.raises(ValueError, match="mini_batch_size=3 must divide the full batch size 4"):
    loop._set_sizes(4)  # pylint: disable=protected-access


def test_a_micro_batch_that_does_not_divide_the_full_batch_is_unsupported(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=3))
  with pytest.raises(errors.UnsupportedConfigError, match="train_micro_batch_size=3 does not divide"):
    loop._set_sizes(4)  # pylint: disable=protected-access


def test_a_logps_micro_batch_other_than_the_train_micro_batch_is_refused_as_stock_does(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=1, compute_logps_micro_batch_size=2))
  with pytest.raises(ValueError, match=r"compute_logps_micro_batch_size \(2\) must be equal"):
    loop._set_sizes(4)  # pylint: disable=protected-access


@pytest.mark.parametrize("config, sizes", [
    # Nothing set: the micro and mini batches are the full batch.
    (dict(), (4, 4, 1, False)),
    # A micro batch of 1 in mini batches of 2: two micro-batches per optimizer update.
    (dict(mini_batch_size=2, train_micro_batch_size=1), (4, 1, 2, False)),
    # Log-probs computed in micro-batches: groups converted in the consumer.
    (dict(mini_batch_size=4, train_micro_batch_size=2, compute_logps_micro_batch_size=2), (4, 2, 2, True)),
])
def test_the_sizes_go_to_the_schedule_and_to_tunix_as_stock_sets_them(monkeypatch, config, sizes):
  learner = GRPOLearnerStandIn(**config)
  loop = _loop(monkeypatch, learner)
  loop._set_sizes(4)  # pylint: disable=protected-access
  schedule = loop.schedule
  assert (schedule.full_batch_size, schedule.micro_batch_size, schedule.grad_acc_steps, schedule.raw_groups) == sizes
  in_consumer = sizes[3]
  assert loop.in_consumer is in_consumer
  assert (learner._full_batch_size, learner._rollout_micro_batch_size, learner._process_in_consumer) == (
      4, 1, in_consumer)


def test_a_checkpoints_micro_batch_is_taken_as_it_is(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=3))
  loop._set_sizes(6, micro=2)  # pylint: disable=protected-access
  assert (loop.schedule.full_batch_size, loop.schedule.micro_batch_size) == (6, 2)


# --- feeding -----------------------------------------------------------------------------------


def test_a_full_batch_is_fed_prompt_by_prompt_at_its_input_position(monkeypatch):
  learner = GRPOLearnerStandIn(train_micro_batch_size=1)
  loop = _loop(monkeypatch, learner, _batches(2, 2))
  start = loop.source.state()
  assert loop._feed_next_batch() is True  # pylint: disable=protected-access
  assert loop.schedule.full_batch_size == 2 and learner._full_batch_size == 2  # from the first batch
  assert _drain(loop.prompt_queue) == [_prompt(0), _prompt(1)]
  second = loop.source.state()
  assert loop._feed_next_batch() is True  # pylint: disable=protected-access
  assert _drain(loop.prompt_queue) == [_prompt(2), _prompt(3)]
  assert loop.schedule.fed == [schedule_lib.FedBatch(start, 0), schedule_lib.FedBatch(second, 2)]
  assert start.position["full_batches_read"] == 0 and second.position["full_batches_read"] == 1
  assert loop.schedule.fed_prompts == 4 and not loop.feeding_done


@pytest.mark.parametrize("case", ["short last batch", "input exhausted", "max_steps reached"])
def test_feeding_ends_with_a_short_batch_the_end_of_the_input_or_max_steps(monkeypatch, case):
  learner = GRPOLearnerStandIn(max_steps=1 if case == "max_steps reached" else None)
  loop = _loop(monkeypatch, learner, _batches(2, 1) if case == "short last batch" else _batches(2, 2))
  assert loop._feed_next_batch() is True  # pylint: disable=protected-access
  if case == "input exhausted":
    assert loop._feed_next_batch() is True  # pylint: disable=protected-access
  if case == "max_steps reached":
    loop.cluster.global_steps = 1
  fed = list(loop.schedule.fed)
  _drain(loop.prompt_queue)
  assert loop._feed_next_batch() is False  # pylint: disable=protected-access
  assert loop.feeding_done
  assert _drain(loop.prompt_queue) == [None]  # the producer's end
  assert loop.schedule.fed == fed


def test_once_feeding_is_done_the_input_is_not_read_again(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(), _batches(2, 1, 2))
  loop._feed_next_batch()  # pylint: disable=protected-access
  # The short batch ends feeding.
  loop._feed_next_batch()  # pylint: disable=protected-access
  position = loop.source.position()
  _drain(loop.prompt_queue)
  assert loop._feed_next_batch() is False  # pylint: disable=protected-access
  assert loop.source.position() == position
  assert _drain(loop.prompt_queue) == []


# --- receiving ------------------------------------------------------------------------------------


def test_receive_hands_over_the_producers_groups_its_end_and_its_failure(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn())
  assert loop.receive(block=False) is None
  loop.results.put((3, "payload"))
  assert loop.receive(block=True) == (3, "payload")
  loop.results.put(_agentic_loop._DONE)  # pylint: disable=protected-access
  assert loop.receive(block=False) is schedule_lib.PRODUCER_DONE
  loop.results.put(RuntimeError("rollout failed"))
  with pytest.raises(RuntimeError, match="rollout failed"):
    loop.receive(block=True)


# --- training ------------------------------------------------------------------------------------


def test_a_trained_input_counts_one_iteration_and_is_one_update_actor_call(monkeypatch):
  learner = GRPOLearnerStandIn(train_micro_batch_size=1)
  learner._iter_steps = 5
  loop = _loop(monkeypatch, learner, _batches(2), skip_jit=True)
  loop._set_sizes(2)  # pylint: disable=protected-access
  example = _example(0, 1)
  loop.train(schedule_lib.Update(example, True), first_mini_batch=True)
  assert learner._iter_steps == 6
  assert len(learner.cluster.calls) == 1
  inputs, eval_examples, skip_jit = learner.cluster.calls[0]
  assert len(inputs) == 1 and inputs[0] is example
  assert eval_examples is None and skip_jit is True


@pytest.mark.parametrize("order, evaluated", [(REPLAY, [True, False]), (REPEAT, [True, True])])
def test_mains_order_evaluates_only_before_a_steps_first_mini_batch(monkeypatch, event_loop, order, evaluated):
  learner = GRPOLearnerStandIn(train_micro_batch_size=1, eval_every_n_steps=1)
  learner.loop = event_loop
  loop = _loop(monkeypatch, learner, _batches(2), order=order, eval_dataset=[{"prompt": [7, 8]}])
  loop._set_sizes(2)  # pylint: disable=protected-access
  loop.train(schedule_lib.Update(_example(0, 1), True), first_mini_batch=True)
  loop.train(schedule_lib.Update(_example(10, 11), True), first_mini_batch=False)
  assert [call[1] is not None for call in learner.cluster.calls] == evaluated
  assert [_rows(e) for e in learner.cluster.calls[0][1]] == [(70, 71), (80, 81)]


def test_an_evaluation_runs_once_per_multiple_of_eval_every_n_steps(monkeypatch, event_loop):
  learner = GRPOLearnerStandIn(eval_every_n_steps=2)
  learner.loop = event_loop
  loop = _loop(monkeypatch, learner, eval_dataset=[{"prompt": [5]}])
  trainer = learner.cluster.actor_trainer
  trainer.train_steps = 3
  assert loop._maybe_eval() is None  # pylint: disable=protected-access
  trainer.train_steps = 4
  evaluated = loop._maybe_eval()  # pylint: disable=protected-access
  assert [_rows(e) for e in evaluated] == [(50, 51)]
  assert learner.conversions == [([50, 51], EVAL)]
  assert learner._last_eval_train_step == 4
  # Already evaluated at this train step.
  assert loop._maybe_eval() is None  # pylint: disable=protected-access
  assert len(learner.conversions) == 1


def test_without_an_eval_dataset_nothing_is_evaluated(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn())
  assert loop._maybe_eval() is None  # pylint: disable=protected-access


def test_an_input_bigger_than_one_train_step_is_unsupported(monkeypatch):
  # micro batch 1, 2 generations: a train step holds 2 sequences.
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=1, num_generations=2))
  loop._set_sizes(2)  # pylint: disable=protected-access
  example = _example(0, 1)
  assert loop._chunks(example) == [example]  # pylint: disable=protected-access
  with pytest.raises(errors.UnsupportedConfigError, match="3 sequences would be split into several train steps of 2"):
    loop._chunks(_example(0, 1, 2))  # pylint: disable=protected-access


def test_a_micro_batchs_groups_are_concatenated_into_one_input(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=2))
  loop._set_sizes(2)  # pylint: disable=protected-access
  assert _rows(loop._merge([_example(0, 1), _example(10, 11)])) == (0, 1, 10, 11)  # pylint: disable=protected-access


def test_raw_groups_are_converted_together_when_their_micro_batch_is_trained(monkeypatch):
  learner = GRPOLearnerStandIn(train_micro_batch_size=2, compute_logps_micro_batch_size=2)
  loop = _loop(monkeypatch, learner)
  loop._set_sizes(2)  # pylint: disable=protected-access
  merged = loop._merge([[0, 1], [10, 11]])  # pylint: disable=protected-access
  assert _rows(merged) == (0, 1, 10, 11)
  assert learner.conversions == [([0, 1, 10, 11], TRAIN)]


@pytest.mark.parametrize("starts_pass, iter_steps", [(True, 8), (False, 5)])
def test_a_replay_counts_its_pass_only_when_it_starts_the_pass(monkeypatch, starts_pass, iter_steps):
  learner = GRPOLearnerStandIn(num_iterations=2)
  learner._iter_steps = 5
  loop = _loop(monkeypatch, learner, order=REPLAY, skip_jit=True)
  inputs = [_example(0, 1), _example(10, 11)]
  loop.replay(inputs, starts_pass=starts_pass, pass_size=3)
  assert learner._iter_steps == iter_steps
  [(called, eval_examples, skip_jit)] = learner.cluster.calls  # one call for the whole pass
  assert len(called) == 2 and called[0] is inputs[0] and called[1] is inputs[1]
  assert eval_examples is None and skip_jit is True


# --- the end of a global step -------------------------------------------------------------------


def test_with_shared_weights_a_global_step_is_counted_and_the_next_batch_fed(monkeypatch):
  learner = GRPOLearnerStandIn()
  loop = _loop(monkeypatch, learner, _batches(2, 2))
  loop._feed_next_batch()  # pylint: disable=protected-access
  _drain(loop.prompt_queue)
  loop.end_global_step()
  cluster = learner.cluster
  assert cluster.global_steps == 1
  assert _drain(loop.prompt_queue) == [_prompt(2), _prompt(3)]
  assert loop.schedule.fed_prompts == 4
  assert learner.events == [] and learner.policy_version == 0  # no sync
  [(metrics, mode, step)] = cluster.async_metrics
  assert set(metrics) == {"perf/global_step_time"} and mode == TRAIN and step == 0
  assert cluster.metrics == [({"perf/exported": 1}, TRAIN)]


def test_with_a_separate_rollout_model_weights_are_synced_and_the_next_batch_fed_under_the_lock(monkeypatch):
  learner = GRPOLearnerStandIn(should_sync_weights=True)
  loop = _loop(monkeypatch, learner, _batches(2, 2))
  loop._feed_next_batch()  # pylint: disable=protected-access
  loop.prompt_queue = _LoggedQueue(learner.events)
  loop.end_global_step()
  assert learner.events == [
      "acquire_weight_sync", "sync_weights", ("put", 2), ("put", 3), "release_weight_sync"]
  assert learner.cluster.global_steps == 1  # counted by sync_weights, not again by the loop
  assert learner.policy_version == 1


def test_the_lock_is_given_back_when_the_sync_fails(monkeypatch):
  learner = GRPOLearnerStandIn(should_sync_weights=True)
  loop = _loop(monkeypatch, learner, _batches(2, 2))

  def failing_sync():
    raise RuntimeError("sync failed")

  learner.cluster.sync_weights = failing_sync
  with pytest.raises(RuntimeError, match="sync failed"):
    loop.end_global_step()
  assert learner.events == ["acquire_weight_sync", "release_weight_sync"]


# --- whole runs, driven through the schedule --------------------------------------------------

# Every run ends by max_steps or has feeding end at its last global step, so
# no save inside update_actor has feeding_done set. A state that has it is
# left out on purpose: restored, `run` puts no end (None) on the prompt queue,
# so once the pending inputs are trained the loop waits for a producer that
# waits for prompts, and never returns.
_RUNS = {
    # 0.1.7's order: each group's input twice in a row, stopped by max_steps.
    "repeat each": (REPEAT, dict(num_iterations=2, mini_batch_size=2, train_micro_batch_size=1, max_steps=4),
                    _batches(2, 2, 2, 2, 2)),
    # Main's order with a separate rollout model, one batch fed ahead, stopped by max_steps.
    "replay": (REPLAY, dict(num_iterations=3, train_micro_batch_size=1, should_sync_weights=True,
                            off_policy_steps=1, max_steps=2), _batches(2, 2, 2, 2)),
    # Groups converted per micro-batch (compute_logps_micro_batch_size > 1), repeated in a row.
    "raw groups": (REPEAT, dict(num_iterations=2, mini_batch_size=4, train_micro_batch_size=2,
                                compute_logps_micro_batch_size=2), _batches(4, 4)),
    # num_iterations=1 in an order this Tunix does not have, a separate rollout model.
    "one iteration": (None, dict(train_micro_batch_size=2, should_sync_weights=True), _batches(2, 2, 2)),
}


def _run_loop(monkeypatch, name):
  order, config, batches = _RUNS[name]
  return _loop(monkeypatch, GRPOLearnerStandIn(**config), batches, order=order)


def _uninterrupted(monkeypatch, name):
  loop = _run_loop(monkeypatch, name)
  _start(loop)
  return loop.cluster.chunks


def test_0_1_7s_order_trains_each_groups_input_num_iterations_times_in_a_row(monkeypatch):
  # Two micro-batches a global step: one prompt's group twice, so the fed
  # prompts outrun the trained ones (stock 0.1.7's backlog) until max_steps.
  loop = _run_loop(monkeypatch, "repeat each")
  _start(loop)
  expected = [((10 * p, 10 * p + 1), i + 1, i // 2, 0) for i, p in enumerate(p for p in range(4) for _ in "ab")]
  assert loop.cluster.chunks == expected
  assert loop.schedule.fed_prompts == 8 and loop.feeding_done


def test_after_a_short_last_batch_the_fed_backlog_is_still_trained(monkeypatch):
  learner = GRPOLearnerStandIn(num_iterations=2, mini_batch_size=2, train_micro_batch_size=1)
  loop = _loop(monkeypatch, learner, _batches(2, 2, 1, 2), order=REPEAT)
  _start(loop)
  # The batch of 1 ends feeding (stock drops it); the batch after it is never read.
  assert [rows for rows, *_ in learner.cluster.chunks] == [(10 * p, 10 * p + 1) for p in range(4) for _ in "ab"]
  assert learner.cluster.global_steps == 4
  assert loop.source.position()["full_batches_read"] == 3


def test_mains_order_trains_the_full_batch_then_replays_it_whole(monkeypatch):
  step_1 = [((0, 1), 1, 0, 0), ((10, 11), 2, 0, 0), ((0, 1), 4, 0, 0), ((10, 11), 4, 0, 0),
            ((0, 1), 6, 0, 0), ((10, 11), 6, 0, 0)]
  step_2 = [((20, 21), 7, 1, 1), ((30, 31), 8, 1, 1), ((20, 21), 10, 1, 1), ((30, 31), 10, 1, 1),
            ((20, 21), 12, 1, 1), ((30, 31), 12, 1, 1)]
  loop = _run_loop(monkeypatch, "replay")
  _start(loop)
  assert loop.cluster.chunks == step_1 + step_2
  assert [len(inputs) for inputs, _, _ in loop.cluster.calls] == [1, 1, 2, 2, 1, 1, 2, 2]
  assert loop.feeding_done  # max_steps


@pytest.mark.parametrize("name", sorted(_RUNS))
def test_a_save_at_any_trainer_step_resumed_in_a_fresh_loop_trains_the_rest_of_the_run(monkeypatch, name):
  expected = _uninterrupted(monkeypatch, name)
  assert expected
  for chunk in range(len(expected)):
    killed = _run_loop(monkeypatch, name)
    saved = _save_and_stop_at(killed, chunk)
    with pytest.raises(_Killed):
      _start(killed)
    resumed = _run_loop(monkeypatch, name)
    refeed = _restore(resumed, saved[0])
    assert refeed == []  # the save waited for every fed rollout
    _continue(resumed, refeed)
    assert killed.cluster.chunks + resumed.cluster.chunks == expected, f"saved after trainer step {chunk}"


# --- the data state --------------------------------------------------------------------------------


def test_a_snapshot_nests_the_input_position_and_holds_the_pending_inputs_and_counters(monkeypatch):
  learner = GRPOLearnerStandIn(mini_batch_size=2, train_micro_batch_size=1)
  loop = _loop(monkeypatch, learner, _batches(2, 2))
  saved = _save_and_stop_at(loop, 0)  # inside the first update_actor call
  with pytest.raises(_Killed):
    _start(loop)
  [value] = saved
  assert value.kind == "tunix"
  assert value.fingerprint == loop.fingerprint
  # The input's own state, nested: one full batch read, all of it rolled out.
  assert value.part == loop.source.state() and value.part.fingerprint == {"source": "iterable:list"}
  assert value.part.position["full_batches_read"] == 1
  assert {k: v for k, v in value.position.items() if k != "input"} == {
      "prompt_index": 2, "prompt_offset": 0, "batches_fed": 0, "ends_micro_batch": [True]}
  assert [_rows(value.pending.items[i]) for i in value.pending.schedule] == [(10, 11)]  # prompt 1, not trained yet
  assert dict(value.counters) == {
      "train_steps": 1, "global_steps": 0, "policy_version": 0, "learner_iter_steps": 1,
      "micro_batches_in_step": 1, "feeding_done": 0, "full_batch_size": 2, "micro_batch_size": 1}


def test_a_snapshot_waits_for_every_fed_prompt_to_be_rolled_out(monkeypatch):
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=1, off_policy_steps=1), _batches(2, 2, 2))
  loop.results = _InlineRollout(loop)
  loop._feed_next_batch()  # pylint: disable=protected-access
  loop._feed_next_batch()  # pylint: disable=protected-access
  value = _snapshot(loop)
  assert loop.prompt_queue.empty()
  assert [_rows(value.pending.items[i]) for i in value.pending.schedule] == [(0, 1), (10, 11), (20, 21), (30, 31)]
  assert (value.position["prompt_index"], value.position["batches_fed"]) == (4, 0)
  assert value.part.position["full_batches_read"] == 2


@pytest.mark.parametrize("feeding_done", [False, True])
def test_a_restored_loop_takes_the_snapshots_counters_sizes_and_pending_inputs(monkeypatch, feeding_done):
  # A saved run that ended feeding did so at max_steps (global step 3), which the restored run keeps.
  config = dict(num_iterations=2, mini_batch_size=2, train_micro_batch_size=1, should_sync_weights=True,
                max_steps=3 if feeding_done else None)
  learner = GRPOLearnerStandIn(**config)
  loop = _loop(monkeypatch, learner, _batches(2, 2, 2))
  loop.results = _InlineRollout(loop)
  loop._feed_next_batch()  # pylint: disable=protected-access
  loop.schedule.absorb_all_fed(loop)
  learner.cluster.global_steps, learner.policy_version, learner._iter_steps = 3, 2, 9
  learner.cluster.actor_trainer.train_steps = 7
  loop.feeding_done = feeding_done
  value = _snapshot(loop)

  fresh_learner = GRPOLearnerStandIn(**config)
  fresh = _loop(monkeypatch, fresh_learner, _batches(2, 2, 2))
  assert _restore(fresh, value) == []
  assert fresh_learner.cluster.global_steps == 3
  assert fresh_learner.policy_version == 2
  assert fresh_learner._iter_steps == 9
  assert fresh.feeding_done is feeding_done
  assert (fresh.schedule.full_batch_size, fresh.schedule.micro_batch_size, fresh.schedule.grad_acc_steps) == (2, 1, 2)
  assert fresh_learner._full_batch_size == 2  # Tunix told the sizes too
  # 0.1.7's order: each prompt's input twice in a row, stored once.
  assert [(_rows(u.example), u.ends_micro_batch) for u in fresh.schedule.updates] == [
      ((0, 1), True), ((0, 1), True), ((10, 11), True), ((10, 11), True)]
  assert fresh.source.position() == loop.source.position()
  assert fresh.schedule.next_prompt == fresh.schedule.fed_prompts == 2
  # The run is named by its first save (step 7) and carried on (`ckpt-iter audit`).
  assert value.lineage["run"] == 7 and _snapshot(fresh).lineage["run"] == 7
  # Feeding goes on at the next batch, unless the saved run had ended it.
  assert fresh._feed_next_batch() is (not feeding_done)  # pylint: disable=protected-access
  if not feeding_done:
    assert _drain(fresh.prompt_queue) == [_prompt(2), _prompt(3)]
    assert fresh.schedule.fed == [schedule_lib.FedBatch(loop.source.state(), 2)]


def test_a_state_written_before_the_wait_rule_rolls_out_its_unfinished_prompts_again(monkeypatch):
  # Checkpoints written before a save waited for the fed rollouts could hold a
  # prompt fed but not rolled out. `snapshot()` no longer writes them, so this
  # one is written with the schedule's earlier rule (`wait_for_fed=False`).
  config = dict(train_micro_batch_size=1, off_policy_steps=1)
  loop = _loop(monkeypatch, GRPOLearnerStandIn(**config), _batches(2, 2, 2))
  monkeypatch.setattr(loop.schedule, "snapshot",
                      functools.partial(schedule_lib.Schedule.snapshot, loop.schedule, wait_for_fed=False))
  loop._feed_next_batch()  # pylint: disable=protected-access
  loop._feed_next_batch()  # pylint: disable=protected-access
  loop.results.put((0, api.agentic_to_train_examples(loop.learner, _group(0, 2), TRAIN)))  # prompt 0 only
  value = _snapshot(loop)
  assert {k: value.position[k] for k in ("prompt_index", "prompt_offset", "batches_fed")} == {
      "prompt_index": 1, "prompt_offset": 1, "batches_fed": 2}
  assert value.part.position["full_batches_read"] == 0  # where prompt 1's batch is read

  fresh = _loop(monkeypatch, GRPOLearnerStandIn(**config), _batches(2, 2, 2))
  refeed = _restore(fresh, value)
  assert refeed == [_prompt(1), _prompt(2), _prompt(3)]  # the rest of the fed batch, and the one after it
  assert (fresh.schedule.next_prompt, fresh.schedule.fed_prompts) == (1, 4)
  assert fresh.source.position()["full_batches_read"] == 2  # past both fed batches
  assert fresh.schedule.full_batch_size == 2  # from the batch read again
  _continue(fresh, refeed)
  assert [rows for rows, *_ in fresh.cluster.chunks] == [(10 * p, 10 * p + 1) for p in range(6)]


# --- regressions found by this file -----------------------------------------------------------


class _Orchestrator:
  """Tunix's RolloutOrchestrator as `_produce` uses it: groups from a stream of (agent, env) pairs."""

  def __init__(self):
    self.groups = asyncio.Queue()

  async def run_producers_from_stream(self, pairs_stream, group_size, group_key_fn, collect_mode):
    del group_key_fn, collect_mode
    open_groups = {}
    async for agent, env in pairs_stream:
      group = open_groups.setdefault(env.extra_kwargs["group_id"], [])
      group.append(agent)
      if len(group) == group_size:
        await self.groups.put(open_groups.pop(env.extra_kwargs["group_id"]))
    await self.groups.put(None)

  async def yield_batches(self, batch_size):
    del batch_size
    while (group := await self.groups.get()) is not None:
      yield group


class _ProducingLearner(GRPOLearnerStandIn):
  """The stand-in with the pieces `ConsumerLoop._produce` calls, so `run()` runs whole."""

  __module__ = "tunix.rl.agentic.stand_in"

  def _build_orchestrator(self):
    return _Orchestrator()

  def _create_agent_env_pair(self, example, group_id, pair_index):
    agent = types.SimpleNamespace(group_id=group_id, pair_index=pair_index, start_step=0,
                                  value=10 * int(example["prompt"][0]) + pair_index)
    return agent, types.SimpleNamespace(extra_kwargs={"group_id": group_id})

  def _batch_to_train_example(self, batch_results, mode):
    return super()._batch_to_train_example([getattr(x, "value", x) for x in batch_results], mode)


def _finishes(target, seconds=20):
  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  return not thread.is_alive()


def test_a_restart_from_the_state_saved_after_the_input_ran_out_finishes(monkeypatch, event_loop):
  """Found here: restored with feeding_done set, run() never gave its producer the end
  marker, and waited forever for rollouts of prompts no one would feed."""
  def new_loop():
    learner = _ProducingLearner(train_micro_batch_size=2)
    learner.loop = event_loop
    return _loop(monkeypatch, learner, _batches(2, 2))

  first = new_loop()
  saved = []
  first.cluster.close = lambda: saved.append(_snapshot(first))  # Tunix saves the last step in close()
  assert _finishes(lambda: first.run(None))
  assert [chunk[0] for chunk in first.cluster.chunks] == [(0, 1, 10, 11), (20, 21, 30, 31)]
  value = _stored(saved[0])
  assert value.counters["feeding_done"] == 1

  second = new_loop()
  saved_input, position = _input.input_part(value, "test")
  checked = _input.check_learner_state(value.fingerprint, second.fingerprint, second.source, saved_input,
                                       allow_drift=frozenset(), origin="test")
  assert _finishes(lambda: second.run(value, checked, position))
  assert second.cluster.chunks == []  # everything was trained before the save


@pytest.mark.parametrize("max_steps", [1, 2, 3])
def test_a_finished_run_continued_with_a_larger_max_steps_trains_on_as_stock_does(
    monkeypatch, event_loop, max_steps):
  """A run that stopped at max_steps=1, restarted with max_steps=2 (or 3, past the end of its
  3 batches), trains the batches it never fed; with the same max_steps it trains nothing."""
  def new_loop(max_steps):
    learner = _ProducingLearner(train_micro_batch_size=2, max_steps=max_steps)
    learner.loop = event_loop
    return _loop(monkeypatch, learner, _batches(2, 2, 2))

  first = new_loop(1)
  saved = []
  first.cluster.close = lambda: saved.append(_snapshot(first))
  assert _finishes(lambda: first.run(None))
  assert [chunk[0] for chunk in first.cluster.chunks] == [(0, 1, 10, 11)]
  value = _stored(saved[0])
  assert value.counters["feeding_done"] == 1

  second = new_loop(max_steps)
  saved_input, position = _input.input_part(value, "test")
  checked = _input.check_learner_state(value.fingerprint, second.fingerprint, second.source, saved_input,
                                       allow_drift=frozenset(), origin="test")
  assert _finishes(lambda: second.run(value, checked, position))
  assert [chunk[0] for chunk in second.cluster.chunks] == [
      (20, 21, 30, 31), (40, 41, 50, 51)][:max_steps - 1]


def test_reaching_max_steps_reads_no_batch_it_does_not_feed(monkeypatch):
  """The saved position is after the last fed batch, so a run continued with a larger
  max_steps starts at the first batch never trained."""
  loop = _loop(monkeypatch, GRPOLearnerStandIn(train_micro_batch_size=2, max_steps=1), _batches(2, 2, 2))
  _start(loop)
  value = _snapshot(loop)
  assert [chunk[0] for chunk in loop.cluster.chunks] == [(0, 1, 10, 11)]
  assert value.counters["feeding_done"] == 1
  assert value.part.position["full_batches_read"] == 1


# --- the content check of the agentic learner's input ----------------------------------------

_ANSWER_SUFFIX = [""]


def _answers_from_key(batch):
  """A transform that reads a setting at production time (as a tokenizer reads its vocabulary)."""
  return {**batch, "answer": [a + _ANSWER_SUFFIX[0] for a in batch["answer"]]}


def _grain_loop(monkeypatch, name):
  import grain  # pylint: disable=g-import-not-at-top

  order, config, batches = _RUNS[name]
  dataset = grain.MapDataset.source(batches).map(_answers_from_key)
  monkeypatch.setattr(api, "agentic_iteration_order", lambda: order)
  return _agentic_loop.ConsumerLoop(GRPOLearnerStandIn(**config), _input.make_source(dataset), None, False)


@pytest.mark.parametrize("name", sorted(_RUNS))
def test_a_save_records_the_batch_before_its_input_position_and_a_changed_one_is_refused(monkeypatch, name):
  """Saved at every trainer step: the record is of the full batch before the saved
  position (the same pipeline resumes and trains the rest; a wrong record would be
  refused), and a table the pipeline reads that changed since is refused."""
  expected = _uninterrupted(monkeypatch, name)
  recorded = 0
  for chunk in range(len(expected)):
    killed = _grain_loop(monkeypatch, name)
    saved = _save_and_stop_at(killed, chunk)
    with pytest.raises(_Killed):
      _start(killed)
    content = saved[0].part.content
    recorded += content is not None and content["check"] == "index"
    resumed = _grain_loop(monkeypatch, name)
    _continue(resumed, _restore(resumed, saved[0]))
    assert killed.cluster.chunks + resumed.cluster.chunks == expected, f"saved after trainer step {chunk}"
    if content is not None:
      _ANSWER_SUFFIX[0] = " (edited)"
      try:
        with pytest.raises(errors.ContentDriftError, match="answer"):
          _restore(_grain_loop(monkeypatch, name), saved[0])
      finally:
        _ANSWER_SUFFIX[0] = ""
  assert recorded  # not blind: some saves fall after the first batch


def test_the_record_of_an_earlier_fed_batchs_position_is_of_the_batch_before_it(monkeypatch):
  """A checkpoint whose resume point lies in a batch fed earlier (raw groups rolled out
  again) takes that batch's record, kept when it was fed, not the latest one."""
  loop = _grain_loop(monkeypatch, "one iteration")
  for _ in range(3):
    assert loop._feed_next_batch()  # pylint: disable=protected-access
  # Settled (digested) only now, after the input read on: each holds the batch before its position.
  states = [_input.settled_state(batch.position) for batch in loop.schedule.fed] + [
      _input.settled_state(loop.source.state())]
  assert [state.position for state in states] == [{"next_index": i} for i in range(4)]
  assert states[0].content is None  # nothing before the first batch
  digests = [state.content["digest"] for state in states[1:]]
  assert len(set(digests)) == 3
  fresh = _grain_loop(monkeypatch, "one iteration")
  for index, digest in enumerate(digests, start=1):
    next(fresh.source)
    assert _input.settled_state(fresh.source.state()).content["digest"] == digest, index
