"""The agentic learner's driver: runs the schedule (`_agentic_schedule`) against Tunix.

Producer (on the learner's asyncio loop): prompts are rolled out concurrently
by Tunix's RolloutOrchestrator; each finished group becomes trainer inputs
(`_batch_to_train_example`) and is handed over with its prompt index.

Consumer (the thread that called `train()`, which is also the thread that
saves): the schedule takes the groups strictly in prompt order and decides
which input each `update_actor` call trains; this driver is its `Port`: it
reads and feeds the input, calls Tunix, and keeps Tunix's counters. With
num_iterations > 1 the installed Tunix's order is followed
(`_api.agentic_iteration_order`): 0.1.7 repeats each input in a row; main
trains the full batch once, then replays it whole. Everything a checkpoint
needs is in the schedule and Tunix's counters: `snapshot()` waits for the
fed rollouts, then only reads.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from ckpt_iter import errors
from ckpt_iter import _item as item_lib
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _agentic_schedule as schedule_lib
from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _input

_LOG = logging.getLogger("ckpt_iter")
_TRAIN = rl_cluster_lib.Mode.TRAIN
_DONE = object()


class ConsumerLoop:
  """One `train()` call of a ResumableAgentic learner; the schedule's `Port` for Tunix."""

  def __init__(self, learner: Any, source: Any, eval_dataset: Any, skip_jit: bool):
    self.learner = learner
    self.cluster = api.agentic_cluster(learner)
    self.source = source
    self.lineage: Any = None  # the restored state's, with its resume
    self.eval_dataset = eval_dataset
    self.skip_jit = skip_jit
    config = api.training_config(learner)
    self.config = config
    self.algo = learner.algo_config
    mu = int(self.algo.num_iterations)
    order = api.agentic_iteration_order()
    if order is None and mu > 1:
      raise errors.UnsupportedConfigError(
          "this Tunix's agentic learner repeats groups for num_iterations in a way "
          "ckpt_iter does not recognise (neither 0.1.7's per-group repeats nor main's "
          "full-batch replay); use num_iterations=1 or a supported Tunix."
      )
    # Main's order: the first pass's inputs are kept for the replays.
    self.replays = order == api.AGENTIC_REPLAY_FULL_BATCH and mu > 1
    self.evaluates_once_per_step = order == api.AGENTIC_REPLAY_FULL_BATCH
    self.schedule = schedule_lib.Schedule(
        mu, self.replays, shared_weights=not learner.should_sync_weights, merge=self._merge)
    self.started = False
    self.in_consumer = False  # groups are converted per micro-batch, in this thread
    self.feeding_done = False
    self.step_start_time = time.time()
    self.prompt_queue: queue.Queue = queue.Queue()
    self.results: queue.Queue = queue.Queue()

  @property
  def fingerprint(self) -> dict[str, Any]:
    # Only main's replay order adds a field: checkpoints of the other order
    # (and every num_iterations=1 one, the same in both) keep their fingerprint.
    order = {"num_iterations_order": api.AGENTIC_REPLAY_FULL_BATCH} if self.replays else {}
    # The learner's own fields; the input's are nested with its position.
    return {
        **order,
        "agentic_learner": next(c.__name__ for c in type(self.learner).__mro__ if c.__module__.startswith("tunix.")),
        "num_generations": int(self.algo.num_generations),
        "num_iterations": int(self.algo.num_iterations),
        "off_policy_steps": int(self.algo.off_policy_steps),
        "mini_batch_size": self.config.mini_batch_size,
        "train_micro_batch_size": self.config.train_micro_batch_size,
        "compute_logps_micro_batch_size": api.agentic_compute_logps_micro_batch_size(self.learner),
    }

  # --- setup -------------------------------------------------------------------

  def _set_sizes(self, full: int, micro: int | None = None) -> None:
    """Sizes from the first batch (as stock sets them), or `micro` from a checkpoint."""
    mini = self.config.mini_batch_size or full
    logps_micro = api.agentic_compute_logps_micro_batch_size(self.learner)
    self.in_consumer = logps_micro > 1
    if micro is None:
      micro = self.config.train_micro_batch_size or mini
      if self.in_consumer and logps_micro != micro:
        raise ValueError(
            f"compute_logps_micro_batch_size ({logps_micro}) must be equal to "
            f"train_micro_batch_size ({micro})"
        )
      if full % mini:
        raise ValueError(f"mini_batch_size={mini} must divide the full batch size {full}.")
      if full % micro:
        raise errors.UnsupportedConfigError(
            f"train_micro_batch_size={micro} does not divide the full batch size {full}: "
            "a micro-batch would span two fed batches."
        )
    self.schedule.set_sizes(full, micro, max(1, mini // micro), raw_groups=self.in_consumer)
    api.agentic_set_batch_sizes(self.learner, full, self.in_consumer)

  def _restore(self, value: state_lib.IteratorState, checked_source: Any, position: dict[str, Any]) -> list[Any]:
    """Applies a checkpoint's data state; returns the prompts to feed again first.

    `checked_source` is the input's checked apply step (`_input.check_learner_state`),
    `position` the learner's own position fields (`_input.input_part`).
    """
    counters = value.counters
    replay = self.schedule.check_replay(
        position, counters.get("micro_batches_in_step"), len(value.pending.schedule),
        origin="the agentic data state")
    self.source.apply(checked_source)
    self.lineage = value.lineage
    refeed: list[Any] = []
    fed_positions = []
    offset = int(position["prompt_offset"])
    for index in range(int(position["batches_fed"])):
      fed_positions.append(self.source.state())
      batch = next(self.source)
      if index == 0:
        self._set_sizes(_batch_size(batch))
      prompts = list(api.micro_batch_iterator(self.learner, [batch], 1))
      refeed.extend(prompts[offset if index == 0 else 0:])
    if not fed_positions:
      self._set_sizes(int(counters["full_batch_size"]), int(counters["micro_batch_size"]))
    items = [
        jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, item)
        for item in value.pending.items
    ]
    self.schedule.restore(
        items, value.pending.schedule, position, int(counters["micro_batches_in_step"]),
        fed_positions, replay)
    self.cluster.global_steps = int(counters["global_steps"])
    self.learner.policy_version = int(counters["policy_version"])
    api.set_learner_iter_steps(self.learner, int(counters["learner_iter_steps"]))
    # Feeding stays ended only where it would end again now: a run stopped by
    # max_steps and continued with a larger one feeds on from the first batch
    # it never read, as stock does; an input that ran out is found out again
    # at the next read.
    self.feeding_done = bool(counters["feeding_done"]) and self.max_steps_reached()
    return refeed

  def skip_full_batches(self, count: int) -> None:
    """Stock Tunix's resume without a data state: drop `count` full batches."""
    self.source.skip_full_batches(count)

  # --- the run -------------------------------------------------------------------

  def run(
      self, restored: state_lib.IteratorState | None, checked_source: Any = None, position: Any = None
  ) -> None:
    if restored is not None:
      refeed = self._restore(restored, checked_source, position)
      _LOG.info(
          "ckpt_iter: restored the agentic data state in O(1): %d pending update inputs, "
          "%d prompts to roll out again, next prompt %d; content check: %s.",
          len(self.schedule.updates), len(refeed), self.schedule.next_prompt,
          self.source.restored_content_check(),
      )
      if self.learner.should_sync_weights:
        # A separate rollout model starts from its initial weights; the killed
        # run's were those of its last sync, which the checkpoint does not
        # hold. The restored actor's are the closest: load them before any
        # rollout starts (inexact for the prompts rolled out before this
        # global step ends; docs/tunix.md).
        global_steps = self.cluster.global_steps
        self.cluster.sync_weights()  # it counts a global step; this is not one
        self.cluster.global_steps = global_steps
    else:
      refeed = []
    self.started = True
    producer = asyncio.run_coroutine_threadsafe(self._produce(), self.learner.loop)
    try:
      for prompt in refeed:
        self.prompt_queue.put(prompt)
      if restored is None:
        self._feed_ahead()
      else:
        if self.feeding_done:
          # The saved run had ended its input: its end marker went to that
          # process's producer, so this one gets it after the prompts refed.
          self.prompt_queue.put(None)
        if self.schedule.step_complete:
          self.schedule.finish_global_step(self)  # the killed run saved, then would have done this
        if restored.counters["feeding_done"] and not self.feeding_done:
          self._feed_ahead()  # feeding had ended, not for this run: it starts again as a run starts
      self.schedule.consume(self)
    finally:
      self.prompt_queue.put(None)
      self.feeding_done = True
    producer.result()
    self.cluster.close()

  def _feed_ahead(self) -> None:
    """Feeds full batches until as many are in flight as a run keeps (off_policy_steps + 1)."""
    schedule = self.schedule
    unabsorbed = schedule.fed_prompts - schedule.next_prompt
    in_flight = -(-unabsorbed // schedule.full_batch_size) if schedule.full_batch_size else 0
    for _ in range(self.algo.off_policy_steps + 1 - in_flight):
      if not self._feed_next_batch():
        break

  def _feed_next_batch(self) -> bool:
    """Hands the next full batch to the rollout, as stock does at a step boundary."""
    if self.feeding_done:
      return False
    if self.max_steps_reached():
      # Checked before reading, so a saved position does not point past a
      # batch that was never fed.
      self.feeding_done = True
      self.prompt_queue.put(None)
      return False
    position = self.source.state()
    try:
      batch = next(self.source)
    except StopIteration:
      batch = None
    if batch is not None and not self.schedule.full_batch_size:
      self._set_sizes(_batch_size(batch))
    full = self.schedule.full_batch_size
    if batch is None or _batch_size(batch) != full:
      self.feeding_done = True
      self.prompt_queue.put(None)
      return False
    self.schedule.feed(position, full)
    for prompt in api.micro_batch_iterator(self.learner, [batch], 1):
      self.prompt_queue.put(prompt)
    return True

  def _merge(self, units: list[Any]) -> Any:
    if self.in_consumer:  # raw groups: converted now, one input for the micro-batch
      trajectories = [t for group in units for t in group]
      return api.agentic_to_train_examples(self.learner, trajectories, _TRAIN)[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *units)

  # --- the schedule's Port ---------------------------------------------------------

  def receive(self, block: bool) -> Any:
    try:
      item = self.results.get(block=block)
    except queue.Empty:
      return None
    if item is _DONE:
      return schedule_lib.PRODUCER_DONE
    if isinstance(item, BaseException):
      raise item
    return item

  def max_steps_reached(self) -> bool:
    max_steps = self.config.max_steps
    return bool(max_steps) and self.cluster.global_steps >= max_steps

  def trainer_steps(self) -> int:
    return int(self.cluster.actor_trainer.iter_steps)

  def input_position(self) -> Any:
    return self.source.state()

  def train(self, update: schedule_lib.Update, first_mini_batch: bool) -> None:
    api.set_learner_iter_steps(self.learner, api.learner_iter_steps(self.learner) + 1)
    # Main's loop evaluates only before a global step's first optimizer update.
    eval_due = not self.evaluates_once_per_step or first_mini_batch
    eval_examples = self._maybe_eval() if eval_due else None
    self.cluster.update_actor(self._chunks(update.example), eval_examples, self.skip_jit)

  def replay(self, inputs: list[Any], starts_pass: bool, pass_size: int) -> None:
    # Tunix adds a pass's chunks to the learner's `_iter_steps` before the
    # call, so a pass resumed in its middle does not add them again.
    if starts_pass:
      api.set_learner_iter_steps(self.learner, api.learner_iter_steps(self.learner) + pass_size)
    self.cluster.update_actor(inputs, None, self.skip_jit)

  def end_global_step(self) -> None:
    now = time.time()
    self.cluster.buffer_metrics_async(
        {"perf/global_step_time": (now - self.step_start_time, np.mean)},
        mode=_TRAIN, step=self.cluster.global_steps,
    )
    self.step_start_time = now
    if self.learner.should_sync_weights:
      lock = api.agentic_rollout_sync_lock(self.learner)
      lock.acquire_weight_sync()
      try:
        self.cluster.sync_weights()  # increments global_steps
        self.learner.policy_version += 1
        self._feed_next_batch()
      finally:
        lock.release_weight_sync()
    else:
      self.cluster.global_steps += 1
      self._feed_next_batch()
    self.cluster.buffer_metrics(self.cluster.perf_v2.export(), mode=_TRAIN)

  def _chunks(self, example: Any) -> list[Any]:
    per_chunk = self.schedule.micro_batch_size * self.algo.num_generations
    total = example.completion_ids.shape[0]
    if total <= per_chunk:
      return [example]
    raise errors.UnsupportedConfigError(
        f"a trainer input of {total} sequences would be split into several train "
        f"steps of {per_chunk}, and a checkpoint could fall between them."
    )

  # --- the producer (runs on the learner's asyncio loop) ------------------------------

  async def _produce(self) -> None:
    learner = self.learner
    loop = asyncio.get_running_loop()
    generations = int(self.algo.num_generations)
    orchestrator = api.agentic_build_orchestrator(learner)

    async def pairs():
      prompt_index = self.schedule.next_prompt
      while True:
        prompt = await loop.run_in_executor(None, self.prompt_queue.get)
        if prompt is None:
          return
        made = await asyncio.gather(*[
            loop.run_in_executor(
                None, api.agentic_create_agent_env_pair, learner, copy.deepcopy(prompt),
                prompt_index, pair,
            )
            for pair in range(generations)
        ])
        for agent, env in made:
          yield agent, env
        prompt_index += 1

    task = asyncio.create_task(orchestrator.run_producers_from_stream(
        pairs_stream=pairs(), group_size=generations,
        group_key_fn=lambda i, env, traj: env.extra_kwargs["group_id"], collect_mode="Token",
    ))
    await asyncio.sleep(0)
    try:
      async for group in orchestrator.yield_batches(batch_size=generations):
        if not group:
          continue
        prompt_index = int(group[0].group_id)
        # Within a group too, completion order is timing: order by generation.
        group = sorted(group, key=lambda item: (item.pair_index, item.start_step))
        if self.in_consumer:
          payload = group
        else:
          payload = api.agentic_to_train_examples(learner, group, _TRAIN)
        self.results.put((prompt_index, payload))
      await task
    except BaseException as e:  # pylint: disable=broad-except
      self.results.put(e)
      raise
    finally:
      if not task.done():
        task.cancel()
      self.results.put(_DONE)

  # --- evaluation (as stock: when the train step is a multiple of eval_every_n_steps) --

  def _maybe_eval(self) -> Any:
    if self.eval_dataset is None:
      return None
    step = int(self.cluster.actor_trainer.train_steps)
    if step % self.config.eval_every_n_steps or step == api.agentic_last_eval_train_step(self.learner):
      return None
    prompts = list(api.micro_batch_iterator(self.learner, iter(self.eval_dataset), 1))
    if not prompts:
      return None
    api.agentic_set_last_eval_train_step(self.learner, step)
    learner = self.learner

    async def run_eval():
      examples = []
      orchestrator = api.agentic_build_orchestrator(learner)
      async for group in api.agentic_eval_producer(learner, orchestrator, prompts):
        examples.extend(api.agentic_to_train_examples(learner, group, rl_cluster_lib.Mode.EVAL))
      return examples

    return asyncio.run_coroutine_threadsafe(run_eval(), learner.loop).result()

  # --- the data state --------------------------------------------------------------

  def snapshot(self, step: int) -> state_lib.IteratorState:
    """The data state matching the actor after the update in progress (if any).

    Runs in the consumer thread (Tunix saves from inside `update_actor`).
    """
    self.lineage = item_lib.started(self.lineage, step)
    saved = self.schedule.snapshot(self)
    schedule = self.schedule
    return state_lib.IteratorState(
        kind="tunix",
        fingerprint=self.fingerprint,
        position=_input.settled(saved.position),
        pending=state_lib.Pending(
            items=tuple(jax.tree.map(np.asarray, item) for item in saved.items),
            schedule=saved.order),
        lineage=self.lineage,
        counters={
            "train_steps": int(self.cluster.actor_trainer.train_steps),
            "global_steps": int(self.cluster.global_steps),
            "policy_version": int(self.learner.policy_version),
            "learner_iter_steps": api.learner_iter_steps(self.learner),
            "micro_batches_in_step": saved.micro_batches_in_step,
            "feeding_done": int(self.feeding_done),
            "full_batch_size": schedule.full_batch_size,
            "micro_batch_size": schedule.micro_batch_size,
        },
    )




def _batch_size(batch: Any) -> int:
  return len(next(iter(batch.values())))
