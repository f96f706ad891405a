"""The agentic learner's schedule, as a pure value: which trainer input is trained when.

Rollouts finish in any order; this value makes what is trained depend only on
the prompt order. It holds the finished groups waiting for their turn, the
queue of update inputs (one `update_actor` call each), the position of a
global step (micro-batches trained, main's replay pass), the fed batches a
checkpoint's input position needs, and the rules that turn all of it into a
saved state and back.

It imports no Tunix, JAX or threads. What it needs done it asks of a `Port`:
the agentic driver (`_agentic_loop.ConsumerLoop`) is the one for Tunix, and
`tests/unit/test_tunix_agentic_schedule.py` drives it with a toy one to check its
guarantees by property (every arrival order trains the same sequence; a kill
inside any update or replay chunk, resumed, trains the rest of that sequence).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Protocol, Sequence

from ckpt_iter import errors
from ckpt_iter import state as state_lib

# What `Port.receive` returns once the producer has finished.
PRODUCER_DONE = object()
# Where a saved position holds the input's state (a learner nests its input's).
INPUT = state_lib.NESTED["tunix"]


@dataclasses.dataclass
class Update:
  """One `update_actor` input; `ends_micro_batch` closes a stock micro-batch."""

  example: Any
  ends_micro_batch: bool


@dataclasses.dataclass
class FedBatch:
  position: Any  # the input's state this full batch was read from (opaque here)
  first_prompt: int  # its first prompt's index in the run


@dataclasses.dataclass(frozen=True)
class Saved:
  """The schedule's part of a data state."""

  items: tuple[Any, ...]  # each distinct pending input once
  order: tuple[int, ...]  # indices into items: replay inputs, then updates, then units
  position: dict[str, Any]
  micro_batches_in_step: int


class Port(Protocol):
  """What the schedule asks of the learner it drives."""

  def receive(self, block: bool) -> Any:
    """A finished `(prompt_index, payload)`, PRODUCER_DONE, or None (only when not blocking)."""

  def max_steps_reached(self) -> bool: ...

  def trainer_steps(self) -> int:
    """The actor trainer's step count (one per `update_actor` chunk)."""

  def input_position(self) -> Any:
    """The input's state now (where the next full batch is read), as a learner's position nests it."""

  def train(self, update: Update, first_mini_batch: bool) -> None:
    """One `update_actor` call on `update.example`."""

  def replay(self, inputs: list[Any], starts_pass: bool, pass_size: int) -> None:
    """One `update_actor` call on a replay pass's inputs (main's order)."""

  def end_global_step(self) -> None:
    """Sync weights or count the step, then feed the next full batch (`Schedule.feed`)."""


class Schedule:
  """The agentic loop's state and order, owned by the thread that trains and saves.

  Args:
    num_iterations: Tunix's `num_iterations`.
    replays: main's order (train the full batch once, then replay it whole)
      rather than 0.1.7's (repeat each input in a row).
    shared_weights: actor and rollout share one model, so every fed prompt
      is rolled out before the next optimizer update.
    merge: turns a micro-batch's units into one update input.
  """

  def __init__(
      self, num_iterations: int, replays: bool, shared_weights: bool,
      merge: Callable[[list[Any]], Any],
  ):
    self.num_iterations = int(num_iterations)
    self.replays = replays
    self.shared_weights = shared_weights
    self.merge = merge
    # Sizes come from the first batch, as stock sets them.
    self.full_batch_size = 0
    self.micro_batch_size = 0
    self.grad_acc_steps = 1
    self.raw_groups = False  # units are raw groups, converted per micro-batch
    self.updates: collections.deque[Update] = collections.deque()
    self.units: list[Any] = []  # absorbed group inputs not yet forming a micro-batch
    self.produced: dict[int, Any] = {}  # finished groups waiting for their turn
    self.next_prompt = 0  # first prompt not yet absorbed
    self.fed_prompts = 0  # prompts handed to the rollout
    self.fed: list[FedBatch] = []
    self.producer_done = False
    self.micro_batches_in_step = 0
    self.current: Update | None = None
    # Replay (main's order): this global step's first-pass inputs, the passes
    # finished, and, while a pass runs, the trainer step its chunk 0 has.
    self.step_inputs: list[Any] = []
    self.replay_pass = 0
    self.replay_chunks_done = 0
    self.replay_origin: int | None = None

  def set_sizes(self, full: int, micro: int, grad_acc_steps: int, raw_groups: bool) -> None:
    self.full_batch_size, self.micro_batch_size = full, micro
    self.grad_acc_steps, self.raw_groups = grad_acc_steps, raw_groups

  @property
  def micro_batches_per_step(self) -> int:
    return self.full_batch_size // self.micro_batch_size

  @property
  def step_complete(self) -> bool:
    return self.micro_batches_in_step == self.micro_batches_per_step

  # --- feeding and absorbing, in prompt order -----------------------------------------

  def feed(self, position: Any, count: int) -> range:
    """Records a full batch read at input state `position` and handed to the rollout; its prompt indices."""
    self.fed.append(FedBatch(position, self.fed_prompts))
    self.fed_prompts += count
    return range(self.fed_prompts - count, self.fed_prompts)

  def _receive(self, port: Port, block: bool) -> bool:
    item = port.receive(block)
    if item is None:
      return False
    if item is PRODUCER_DONE:
      self.producer_done = True
    else:
      prompt_index, payload = item
      self.produced[prompt_index] = payload
    return True

  def absorb_ready(self, port: Port) -> None:
    """Takes every finished group whose earlier prompts are all taken."""
    while self._receive(port, block=False):
      pass
    while self.next_prompt in self.produced:
      self._absorb(self.produced.pop(self.next_prompt))
      self.next_prompt += 1
    # A fed batch is needed for a checkpoint's position only while it holds a
    # prompt not yet absorbed (or a raw group waiting for its micro-batch).
    oldest_needed = self.next_prompt - (len(self.units) if self.raw_groups else 0)
    while self.fed and self.fed[0].first_prompt + self.full_batch_size <= oldest_needed:
      self.fed.pop(0)

  def _absorb_until_update(self, port: Port) -> bool:
    """Waits for the groups the next update input needs; False: the stream ended."""
    while not self.updates:
      self.absorb_ready(port)
      if self.updates:
        return True
      if self.producer_done:
        return False
      self._receive(port, block=True)
    return True

  def absorb_all_fed(self, port: Port) -> None:
    """Waits until every prompt handed to the rollout is absorbed."""
    while True:
      self.absorb_ready(port)
      if self.next_prompt >= self.fed_prompts or self.producer_done:
        return
      self._receive(port, block=True)

  def _absorb(self, payload: Any) -> None:
    # 0.1.7's order repeats each input in a row; main's replays the step later.
    mu = 1 if self.replays else self.num_iterations
    if self.raw_groups:
      self.units.append(payload)
      if len(self.units) == self.micro_batch_size:
        example, self.units = self.merge(self.units), []
        for index in range(mu):
          self.updates.append(Update(example, index == mu - 1))
      return
    for _ in range(mu):
      self.units.extend(payload)
    while len(self.units) >= self.micro_batch_size:
      taken, self.units = self.units[:self.micro_batch_size], self.units[self.micro_batch_size:]
      self.updates.append(Update(self.merge(taken), True))

  # --- training -------------------------------------------------------------------------

  def consume(self, port: Port) -> None:
    """Trains until the stream ends or `max_steps` is reached."""
    while not port.max_steps_reached():
      if not self.updates and not self._absorb_until_update(port):
        return
      if self.shared_weights:
        # Rollouts share the model the update changes: finish every fed one first.
        self.absorb_all_fed(port)
      with self._training() as update:
        port.train(update, self.micro_batches_in_step < self.grad_acc_steps)
      if self.step_complete:
        self.finish_global_step(port)

  @contextlib.contextmanager
  def _training(self) -> Iterator[Update]:
    update = self.updates.popleft()
    if self.replays:
      self.step_inputs.append(update.example)  # before the call: a save inside it must hold it
    self.current = update
    try:
      yield update
    finally:
      self.current = None
    if update.ends_micro_batch:
      self.micro_batches_in_step += 1

  def finish_global_step(self, port: Port) -> None:
    if self.replays:
      self._replay(port)
    if not self.shared_weights:
      self.absorb_all_fed(port)  # every fed prompt is rolled out with the weights of the last sync
    port.end_global_step()
    self.micro_batches_in_step = 0

  def _replay(self, port: Port) -> None:
    """Main's order: the step's inputs trained num_iterations - 1 more times, one call a pass.

    A resumed pass starts at its saved chunk.
    """
    while self.replay_pass < self.num_iterations - 1:
      if self.shared_weights:
        self.absorb_all_fed(port)
      done = self.replay_chunks_done
      self.replay_origin = port.trainer_steps() - done
      try:
        port.replay(self.step_inputs[done:], starts_pass=not done, pass_size=len(self.step_inputs))
      finally:
        self.replay_origin = None
      self.replay_pass += 1
      self.replay_chunks_done = 0
    self.step_inputs = []
    self.replay_pass = 0

  # --- the saved state ------------------------------------------------------------------

  def snapshot(self, port: Port, wait_for_fed: bool = True) -> Saved:
    """The pending inputs and input position matching the actor after the update in progress.

    Called from inside `Port.train` or `Port.replay` (Tunix saves inside
    `update_actor`) or between them. It first waits until every prompt
    handed to the rollout is rolled out, so the checkpoint holds their
    groups and a resume rolls out nothing again: the rollout weights of the
    killed run's last sync are in no checkpoint, and a prompt rolled out
    again after a resume would sample with others. With shared weights
    there is nothing to wait for (every fed prompt is absorbed before an
    update); with a separate rollout model the wait only moves earlier the
    one the global step's sync makes. `wait_for_fed=False` takes only the
    groups finished by now, as checkpoints before this rule were written
    (their restore path stays; the tests use it).
    """
    if wait_for_fed:
      self.absorb_all_fed(port)
    else:
      self.absorb_ready(port)
    items: list[Any] = []
    order: list[int] = []
    seen: dict[int, int] = {}

    def add(example: Any) -> None:
      if id(example) not in seen:
        seen[id(example)] = len(items)
        items.append(example)
      order.append(seen[id(example)])

    replay = None
    if self.replays:
      passes, done = self.replay_pass, 0
      if self.replay_origin is not None:  # inside a replay pass
        done = port.trainer_steps() - self.replay_origin
        if done >= len(self.step_inputs):
          passes, done = passes + 1, 0
      for example in self.step_inputs:
        add(example)
      replay = {"inputs": len(self.step_inputs), "pass": passes, "chunks_done": done}
    for update in self.updates:
      add(update.example)
    micro_batches = self.micro_batches_in_step
    if self.current is not None and self.current.ends_micro_batch:
      micro_batches += 1
    resume_prompt = self.next_prompt
    if self.raw_groups and self.units:
      # Raw groups are not arrays yet: roll them out again after a resume.
      resume_prompt -= len(self.units)
    else:
      for unit in self.units:
        add(unit)
    position = self._prompt_position(resume_prompt, port.input_position)
    position["ends_micro_batch"] = [bool(u.ends_micro_batch) for u in self.updates]
    if replay is not None:
      position["replay"] = replay
    return Saved(tuple(items), tuple(order), position, micro_batches)

  def _prompt_position(self, prompt_index: int, current_position: Callable[[], Any]) -> dict[str, Any]:
    """Where prompt `prompt_index` is read (the input's state there), and how many fed batches follow."""
    for number, batch in enumerate(self.fed):
      if batch.first_prompt <= prompt_index < batch.first_prompt + self.full_batch_size:
        return {
            INPUT: batch.position, "prompt_index": prompt_index,
            "prompt_offset": prompt_index - batch.first_prompt,
            "batches_fed": len(self.fed) - number,
        }
    return {
        INPUT: current_position(), "prompt_index": prompt_index,
        "prompt_offset": 0, "batches_fed": 0,
    }

  def check_replay(self, position: dict[str, Any], micro_batches_in_step: Any, pending: int, origin: str) -> Any:
    """The saved replay position (main's order), validated; raises before anything changes."""
    replay = position.get("replay")
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
        or not 0 <= passes < self.num_iterations
        or kept != micro_batches_in_step
        or kept > pending
        or not 0 <= done < max(kept, 1)
    ):
      raise errors.InvalidStateError(f"{origin}: inconsistent replay position {replay!r}.")
    return replay

  def restore(
      self, items: Sequence[Any], order: Sequence[int], position: dict[str, Any],
      micro_batches_in_step: int, fed_positions: Sequence[Any], replay: Any,
  ) -> range:
    """Applies a saved schedule (checked by `check_replay`); the prompt indices to roll out again.

    `fed_positions`: the input's state where each of the `batches_fed` saved
    batches is read, in order, from the saved input position on.
    """
    first = int(position["prompt_index"])
    offset = int(position["prompt_offset"])
    for index, batch_position in enumerate(fed_positions):
      self.fed.append(FedBatch(batch_position, first - offset + index * self.full_batch_size))
    self.next_prompt = first
    self.fed_prompts = first - offset + len(fed_positions) * self.full_batch_size if fed_positions else first
    ends = position["ends_micro_batch"]
    order = list(order)
    if replay is not None:
      kept = int(replay["inputs"])
      self.step_inputs = [items[index] for index in order[:kept]]
      order = order[kept:]
      self.replay_pass = int(replay["pass"])
      self.replay_chunks_done = int(replay["chunks_done"])
    for slot, index in enumerate(order):
      if slot < len(ends):
        self.updates.append(Update(items[index], bool(ends[slot])))
      else:
        self.units.append(items[index])
    self.micro_batches_in_step = int(micro_batches_in_step)
    return range(first, self.fed_prompts)
