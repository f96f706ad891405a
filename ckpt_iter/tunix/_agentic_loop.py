"""The agentic learner's producer/consumer loop, in a deterministic order.

Producer (on the learner's asyncio loop): prompts are rolled out concurrently
by Tunix's RolloutOrchestrator; each finished group becomes trainer inputs
(`_batch_to_train_example`) and is handed over with its prompt index.

Consumer (the thread that called `train()`, which is also the thread that
saves): groups are absorbed strictly in prompt order into a queue of update
inputs (one `update_actor` call each), trained one by one; full batches are
fed at global-step boundaries as stock Tunix does. With num_iterations > 1 the
installed Tunix's order is followed (`_api.agentic_iteration_order`): 0.1.7
repeats each input in a row; main trains the full batch once, then replays it
whole. Everything a checkpoint needs is in this object's fields, so
`snapshot()` is a pure read.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import queue
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from ckpt_iter import errors
from ckpt_iter import state as state_lib
from ckpt_iter.tunix import _api as api
from ckpt_iter.tunix import _input

_LOG = logging.getLogger("ckpt_iter")
_TRAIN = rl_cluster_lib.Mode.TRAIN
_DONE = object()


@dataclasses.dataclass
class Update:
  """One `update_actor` input; `ends_micro_batch` closes a stock micro-batch."""

  example: Any
  ends_micro_batch: bool


@dataclasses.dataclass
class FedBatch:
  position: dict[str, Any]  # the input position this full batch was read from
  first_prompt: int  # its first prompt's index in the run


class ConsumerLoop:
  """One `train()` call of a ResumableAgentic learner."""

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
    self.shared_weights = not learner.should_sync_weights
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
    self.started = False
    # Sizes are set from the first batch (as stock does).
    self.full_batch_size = 0
    self.micro_batch_size = 0
    self.grad_acc_steps = 1
    self.in_consumer = False
    # Loop state, all of it consumer-thread owned.
    self.updates: collections.deque[Update] = collections.deque()
    self.units: list[Any] = []  # absorbed group inputs not yet forming a micro-batch
    self.produced: dict[int, Any] = {}  # finished groups waiting for their turn
    self.next_prompt = 0  # first prompt not yet absorbed
    self.fed_prompts = 0  # prompts handed to the rollout
    self.fed: list[FedBatch] = []
    self.feeding_done = False
    self.producer_done = False
    self.micro_batches_in_step = 0
    self.current: Update | None = None
    # Replay state (self.replays): the inputs trained by this global step's
    # first pass, the replay passes finished, and, while a replay's
    # `update_actor` runs, the trainer's micro-step count its chunk 0 has.
    self.step_inputs: list[Any] = []
    self.replay_pass = 0
    self.replay_chunks_done = 0
    self.replay_origin: int | None = None
    self.step_start_time = time.time()
    self.prompt_queue: queue.Queue = queue.Queue()
    self.results: queue.Queue = queue.Queue()

  @property
  def fingerprint(self) -> dict[str, Any]:
    # Only main's replay order adds a field: checkpoints of the other order
    # (and every num_iterations=1 one, the same in both) keep their fingerprint.
    order = {"num_iterations_order": api.AGENTIC_REPLAY_FULL_BATCH} if self.replays else {}
    return {
        **order,
        **self.source.fingerprint,
        "agentic_learner": next(c.__name__ for c in type(self.learner).__mro__ if c.__module__.startswith("tunix.")),
        "num_generations": int(self.algo.num_generations),
        "num_iterations": int(self.algo.num_iterations),
        "off_policy_steps": int(self.algo.off_policy_steps),
        "mini_batch_size": self.config.mini_batch_size,
        "train_micro_batch_size": self.config.train_micro_batch_size,
        "compute_logps_micro_batch_size": api.agentic_compute_logps_micro_batch_size(self.learner),
    }

  # --- setup -------------------------------------------------------------------

  def _set_sizes(self, first_batch: Any) -> None:
    full = len(next(iter(first_batch.values())))
    mini = self.config.mini_batch_size or full
    micro = self.config.train_micro_batch_size or mini
    logps_micro = api.agentic_compute_logps_micro_batch_size(self.learner)
    self.in_consumer = logps_micro > 1
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
    self.full_batch_size, self.micro_batch_size = full, micro
    self.grad_acc_steps = max(1, mini // micro)
    api.agentic_set_batch_sizes(self.learner, full, self.in_consumer)

  def learner_fingerprint(self) -> dict[str, Any]:
    """The fingerprint fields that are the learner's own (the rest are the input's)."""
    return _input.learner_part(self.fingerprint, self.source)

  def _restore(self, value: state_lib.IteratorState, checked_source: Any) -> list[Any]:
    """Applies a checkpoint's data state; returns the prompts to feed again first.

    `checked_source` is the input's checked apply step (`_input.check_learner_state`).
    """
    position = value.position
    counters = value.counters
    replay = self._check_replay(value)
    self.source.apply(checked_source, position["source"])
    self.lineage = value.lineage
    refeed: list[Any] = []
    first = int(position["prompt_index"])
    for index in range(int(position["batches_fed"])):
      batch_position = self.source.position()
      batch = next(self.source)
      if index == 0:
        self._set_sizes(batch)
      self.fed.append(FedBatch(batch_position, first + index * self.full_batch_size - int(position["prompt_offset"])))
      prompts = list(api.micro_batch_iterator(self.learner, [batch], 1))
      refeed.extend(prompts[int(position["prompt_offset"]) if index == 0 else 0:])
    self.next_prompt = first
    self.fed_prompts = first + len(refeed)
    items = [
        jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, item)
        for item in value.pending.items
    ]
    ends = position["ends_micro_batch"]
    num_updates = len(ends)
    schedule = list(value.pending.schedule)
    if replay is not None:
      kept = int(replay["inputs"])
      self.step_inputs = [items[index] for index in schedule[:kept]]
      schedule = schedule[kept:]
      self.replay_pass = int(replay["pass"])
      self.replay_chunks_done = int(replay["chunks_done"])
    for slot, index in enumerate(schedule):
      if slot < num_updates:
        self.updates.append(Update(items[index], bool(ends[slot])))
      else:
        self.units.append(items[index])
    self.cluster.global_steps = int(counters["global_steps"])
    self.learner.policy_version = int(counters["policy_version"])
    api.set_learner_iter_steps(self.learner, int(counters["learner_iter_steps"]))
    self.micro_batches_in_step = int(counters["micro_batches_in_step"])
    self.feeding_done = bool(counters["feeding_done"])
    if not self.full_batch_size:
      self.full_batch_size = int(counters["full_batch_size"])
      self._set_sizes_from_counters(counters)
    return refeed

  def _check_replay(self, value: state_lib.IteratorState) -> Any:
    """The saved replay state (main's order), validated before anything is changed."""
    replay = value.position.get("replay")
    origin = "the agentic data state"
    if (replay is not None) != self.replays:
      saved = "main's full-batch replay" if replay is not None else "0.1.7's per-group repeat"
      raise errors.UnsupportedConfigError(
          f"{origin} was written in {saved} order of num_iterations, and this Tunix "
          "and configuration train in the other: resume with the Tunix that wrote it."
      )
    if replay is None:
      return None
    names = ("inputs", "pass", "chunks_done")
    fields = {name: replay.get(name) if isinstance(replay, dict) else None for name in names}
    kept, passes, done = fields.values()
    if (
        not all(state_lib.is_int(x) for x in fields.values())
        or not 0 <= passes < int(self.algo.num_iterations)
        or kept != value.counters.get("micro_batches_in_step")
        or kept > len(value.pending.schedule)
        or not 0 <= done < max(kept, 1)
    ):
      raise errors.InvalidStateError(f"{origin}: inconsistent replay position {replay!r}.")
    return replay

  def _set_sizes_from_counters(self, counters: Any) -> None:
    self.micro_batch_size = int(counters["micro_batch_size"])
    mini = self.config.mini_batch_size or self.full_batch_size
    self.grad_acc_steps = max(1, mini // self.micro_batch_size)
    self.in_consumer = api.agentic_compute_logps_micro_batch_size(self.learner) > 1
    api.agentic_set_batch_sizes(self.learner, self.full_batch_size, self.in_consumer)

  def skip_full_batches(self, count: int) -> None:
    """Stock Tunix's resume without a data state: drop `count` full batches."""
    if count and not self.source.seek_full_batches(count):
      for _ in range(count):
        next(self.source)

  # --- the run -------------------------------------------------------------------

  def run(self, restored: state_lib.IteratorState | None, checked_source: Any = None) -> None:
    if restored is not None:
      refeed = self._restore(restored, checked_source)
      _LOG.info(
          "ckpt_iter: restored the agentic data state in O(1): %d pending update inputs, "
          "%d prompts to roll out again, next prompt %d.",
          len(self.updates), len(refeed), self.next_prompt,
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
        for _ in range(self.algo.off_policy_steps + 1):
          if not self._feed_next_batch():
            break
      elif self.micro_batches_in_step == self._micro_batches_per_step():
        self._finish_global_step()  # the killed run saved, then would have done this
      self._consume()
    finally:
      self.prompt_queue.put(None)
      self.feeding_done = True
    producer.result()
    self.cluster.close()

  def _micro_batches_per_step(self) -> int:
    return self.full_batch_size // self.micro_batch_size

  def _max_steps_reached(self) -> bool:
    max_steps = self.config.max_steps
    return bool(max_steps) and self.cluster.global_steps >= max_steps

  def _feed_next_batch(self) -> bool:
    """Hands the next full batch to the rollout, as stock does at a step boundary."""
    if self.feeding_done:
      return False
    position = self.source.position()
    try:
      batch = next(self.source)
    except StopIteration:
      batch = None
    if batch is not None and not self.full_batch_size:
      self._set_sizes(batch)
    if batch is None or self._max_steps_reached() or len(next(iter(batch.values()))) != self.full_batch_size:
      self.feeding_done = True
      self.prompt_queue.put(None)
      return False
    self.fed.append(FedBatch(position, self.fed_prompts))
    for prompt in api.micro_batch_iterator(self.learner, [batch], 1):
      self.prompt_queue.put(prompt)
      self.fed_prompts += 1
    return True

  def _consume(self) -> None:
    while not self._max_steps_reached():
      if not self.updates and not self._absorb_until_update():
        return
      if self.shared_weights:
        # Rollouts share the model the update changes: finish every fed one first.
        self._absorb_all_fed()
      update = self.updates.popleft()
      api.set_learner_iter_steps(self.learner, api.learner_iter_steps(self.learner) + 1)
      eval_examples = self._maybe_eval() if self._eval_due() else None
      example = update.example
      if self.replays:
        self.step_inputs.append(example)  # before the call: a save inside it must hold it
      self.current = update
      try:
        self.cluster.update_actor(self._chunks(example), eval_examples, self.skip_jit)
      finally:
        self.current = None
      if update.ends_micro_batch:
        self.micro_batches_in_step += 1
        if self.micro_batches_in_step == self._micro_batches_per_step():
          self._finish_global_step()

  def _eval_due(self) -> bool:
    # Main's loop evaluates only before a global step's first optimizer update.
    return not self.evaluates_once_per_step or self.micro_batches_in_step < self.grad_acc_steps

  def _finish_global_step(self) -> None:
    if self.replays:
      self._replay()
    self._end_global_step()

  def _replay(self) -> None:
    """Main's order: the step's inputs trained num_iterations - 1 more times, one call a pass.

    Resumes inside a pass from its saved chunk; Tunix adds a pass's chunks to
    the learner's `_iter_steps` before the call, so a resumed pass does not.
    """
    trainer = self.cluster.actor_trainer
    total = len(self.step_inputs)
    while self.replay_pass < int(self.algo.num_iterations) - 1:
      done = self.replay_chunks_done
      if self.shared_weights:
        self._absorb_all_fed()
      if not done:
        api.set_learner_iter_steps(self.learner, api.learner_iter_steps(self.learner) + total)
      self.replay_origin = int(trainer.iter_steps) - done
      try:
        self.cluster.update_actor(self.step_inputs[done:], None, self.skip_jit)
      finally:
        self.replay_origin = None
      self.replay_pass += 1
      self.replay_chunks_done = 0
    self.step_inputs = []
    self.replay_pass = 0

  def _chunks(self, example: Any) -> list[Any]:
    per_chunk = self.micro_batch_size * self.algo.num_generations
    total = example.completion_ids.shape[0]
    if total <= per_chunk:
      return [example]
    raise errors.UnsupportedConfigError(
        f"a trainer input of {total} sequences would be split into several train "
        f"steps of {per_chunk}, and a checkpoint could fall between them."
    )

  def _end_global_step(self) -> None:
    now = time.time()
    self.cluster.buffer_metrics_async(
        {"perf/global_step_time": (now - self.step_start_time, np.mean)},
        mode=_TRAIN, step=self.cluster.global_steps,
    )
    self.step_start_time = now
    if self.learner.should_sync_weights:
      self._absorb_all_fed()  # every fed prompt is rolled out with the weights of the last sync
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
    self.micro_batches_in_step = 0

  # --- absorbing produced groups in prompt order ------------------------------------

  def _receive(self, block: bool) -> bool:
    try:
      item = self.results.get(block=block)
    except queue.Empty:
      return False
    if item is _DONE:
      self.producer_done = True
    elif isinstance(item, BaseException):
      raise item
    else:
      prompt_index, payload = item
      self.produced[prompt_index] = payload
    return True

  def _absorb_ready(self) -> None:
    while self._receive(block=False):
      pass
    while self.next_prompt in self.produced:
      self._absorb(self.produced.pop(self.next_prompt))
      self.next_prompt += 1
    # A fed batch is needed for a checkpoint's position only while it holds a
    # prompt not yet absorbed (or a raw group waiting for its micro-batch).
    oldest_needed = self.next_prompt - (len(self.units) if self.in_consumer else 0)
    while self.fed and self.fed[0].first_prompt + self.full_batch_size <= oldest_needed:
      self.fed.pop(0)

  def _absorb_until_update(self) -> bool:
    """Waits for the groups the next update input needs; False: the stream ended."""
    while not self.updates:
      self._absorb_ready()
      if self.updates:
        return True
      if self.producer_done:
        return False
      self._receive(block=True)
    return True

  def _absorb_all_fed(self) -> None:
    while True:
      self._absorb_ready()
      if self.next_prompt >= self.fed_prompts or self.producer_done:
        return
      self._receive(block=True)

  def _absorb(self, payload: Any) -> None:
    # 0.1.7's order repeats each input in a row; main's replays the step later.
    mu = 1 if self.replays else int(self.algo.num_iterations)
    if self.in_consumer:
      self.units.append(payload)  # a raw group; converted per micro-batch
      if len(self.units) == self.micro_batch_size:
        trajectories = [t for group in self.units for t in group]
        example = api.agentic_to_train_examples(self.learner, trajectories, _TRAIN)[0]
        self.units = []
        for index in range(mu):
          self.updates.append(Update(example, index == mu - 1))
      return
    for _ in range(mu):
      self.units.extend(payload)
    while len(self.units) >= self.micro_batch_size:
      taken, self.units = self.units[:self.micro_batch_size], self.units[self.micro_batch_size:]
      merged = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *taken)
      self.updates.append(Update(merged, True))

  # --- the producer (runs on the learner's asyncio loop) ------------------------------

  async def _produce(self) -> None:
    learner = self.learner
    loop = asyncio.get_running_loop()
    generations = int(self.algo.num_generations)
    orchestrator = api.agentic_build_orchestrator(learner)

    async def pairs():
      prompt_index = self.next_prompt
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

  def snapshot(self) -> state_lib.IteratorState:
    """The data state matching the actor after the update in progress (if any).

    Runs in the consumer thread (Tunix saves from inside `update_actor`).
    Groups finished by now are absorbed first, so they are saved as arrays
    rather than rolled out again after a resume.
    """
    self._absorb_ready()
    items: list[Any] = []
    schedule: list[int] = []
    seen: dict[int, int] = {}

    def add(example: Any) -> None:
      if id(example) not in seen:
        seen[id(example)] = len(items)
        items.append(jax.tree.map(np.asarray, example))
      schedule.append(seen[id(example)])

    replay = None
    if self.replays:
      passes, done = self.replay_pass, 0
      if self.replay_origin is not None:  # saving inside a replay pass
        done = int(self.cluster.actor_trainer.iter_steps) - self.replay_origin
        if done >= len(self.step_inputs):
          passes, done = passes + 1, 0
      for example in self.step_inputs:
        add(example)
      replay = {"inputs": len(self.step_inputs), "pass": passes, "chunks_done": done}
    for update in self.updates:
      add(update.example)
    ends = [bool(u.ends_micro_batch) for u in self.updates]
    micro_batches = self.micro_batches_in_step
    if self.current is not None and self.current.ends_micro_batch:
      micro_batches += 1
    resume_prompt = self.next_prompt
    if self.in_consumer and self.units:
      # Raw groups are not arrays yet: roll them out again after a resume.
      resume_prompt -= len(self.units)
    else:
      for unit in self.units:
        add(unit)
    position = self._prompt_position(resume_prompt)
    position["ends_micro_batch"] = ends
    if replay is not None:
      position["replay"] = replay
    return state_lib.IteratorState(
        kind="tunix",
        fingerprint=self.fingerprint,
        position=position,
        pending=state_lib.Pending(items=tuple(items), schedule=tuple(schedule)),
        lineage=self.lineage,
        counters={
            "train_steps": int(self.cluster.actor_trainer.train_steps),
            "global_steps": int(self.cluster.global_steps),
            "policy_version": int(self.learner.policy_version),
            "learner_iter_steps": api.learner_iter_steps(self.learner),
            "micro_batches_in_step": micro_batches,
            "feeding_done": int(self.feeding_done),
            "full_batch_size": self.full_batch_size,
            "micro_batch_size": self.micro_batch_size,
        },
    )

  def _prompt_position(self, prompt_index: int) -> dict[str, Any]:
    """Where prompt `prompt_index` is read, and how many fed batches follow from there."""
    for number, batch in enumerate(self.fed):
      if batch.first_prompt <= prompt_index < batch.first_prompt + self.full_batch_size:
        return {
            "source": dict(batch.position), "prompt_index": prompt_index,
            "prompt_offset": prompt_index - batch.first_prompt,
            "batches_fed": len(self.fed) - number,
        }
    return {
        "source": self.source.position(), "prompt_index": prompt_index,
        "prompt_offset": 0, "batches_fed": 0,
    }
