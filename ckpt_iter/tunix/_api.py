"""Every private Tunix attribute ckpt_iter relies on, touched here and only here.

Tunix (google-tunix 0.1.7 and upstream main) has no public hook for the data side of a resume,
so the integration overrides two learner methods (`_prepare_data`,
`_run_global_step`, in `ckpt_iter.tunix`) and uses the private names listed in
one list per learner family (`RL_LEARNER_PRIVATE_API`,
`AGENTIC_LEARNER_PRIVATE_API`, `REQUIRED_SFT_TRAINER_ATTRIBUTES`). Each
Resumable mixin checks its list when a learner is built, and tests call the
checks directly, so a Tunix release that renames one fails loudly at
construction instead of resuming wrong mid-run.

The algorithm settings a resume may change are read here too, from those
attributes (`algorithm_settings`); `_settings` records them in the data state
and warns when a resume changes them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Iterator, Mapping

import numpy as np

from ckpt_iter import errors

# (module, class, attribute, parameters it must accept; None for data attributes)
PrivateName = tuple[str, str, str, "tuple[str, ...] | None"]

# RLLearner subclasses (GRPO, PPO, DAPO, Dr.GRPO): `ckpt_iter.tunix.Resumable`.
RL_LEARNER_PRIVATE_API: tuple[PrivateName, ...] = (
    ("tunix.rl.rl_learner", "RLLearner", "_prepare_data", (
        "iterator", "proceed_num_steps", "sample_repeat", "batch_repeat",
        "service_target_batch_size", "data_queue", "async_loading", "mode")),
    ("tunix.rl.rl_learner", "RLLearner", "_run_global_step", (
        "full_batch_size", "mini_batch_size", "service_target_batch_size",
        "grad_acc_steps", "train_iterator", "eval_ds", "skip_jit")),
    ("tunix.rl.rl_learner", "RLLearner", "_process_accumulated_batches", (
        "micro_batches", "micro_batch_sizes", "mode")),
    ("tunix.rl.rl_learner", "RLLearner", "_compute_trajectory_ids", ("example", "steps")),
    ("tunix.rl.rl_learner", "RLLearner", "_create_micro_batch_iterator", (
        "full_batch_iterator", "micro_batch_size")),
    ("tunix.rl.rl_learner", "RLLearner", "_num_iterations", ()),
    ("tunix.rl.rl_learner", "RLLearner", "_num_generations", ()),
)
# Instance attributes set by the constructors, checked on a built object.
REQUIRED_LEARNER_ATTRIBUTES = ("_data_shuffle_seed", "_iter_steps", "_training_config")
REQUIRED_TRAINER_ATTRIBUTES = ("_train_steps", "_iter_steps", "checkpoint_manager")

# AgenticRLLearner subclasses: `ckpt_iter.tunix.ResumableAgentic` (its loop in
# `_agentic_loop` calls these).
_AGENTIC = "tunix.rl.agentic.agentic_rl_learner"
AGENTIC_LEARNER_PRIVATE_API: tuple[PrivateName, ...] = (
    (_AGENTIC, "AgenticRLLearner", "_build_orchestrator", ()),
    (_AGENTIC, "AgenticRLLearner", "_create_agent_env_pair", ("single_example", "group_id", "pair_index")),
    (_AGENTIC, "AgenticRLLearner", "_batch_to_train_example", ("batch_results", "mode")),
    (_AGENTIC, "AgenticRLLearner", "_orchestrator_producer", (
        "orchestrator", "prompt_iterator", "num_generations")),
    (_AGENTIC, "AgenticRLLearner", "_create_micro_batch_iterator", (
        "full_batch_iterator", "micro_batch_size")),
    (_AGENTIC, "AgenticRLLearner", "_num_iterations", ()),
    (_AGENTIC, "AgenticRLLearner", "_num_generations", ()),
)
AGENTIC_LEARNER_ATTRIBUTES = (
    "_training_config", "_iter_steps", "_eval_iter_steps", "_last_eval_train_step",
    "_rollout_sync_lock", "_compute_logps_micro_batch_size", "_full_batch_size",
    "_rollout_micro_batch_size",
)
# Set by the agentic loop and read by Tunix's own methods (its orchestrator
# producer and trainer-input conversion): a Tunix that stopped reading one
# would silently ignore what the loop sets, so its code must still name it.
AGENTIC_ATTRIBUTES_TUNIX_READS = ("_process_in_consumer", "_full_batch_size", "_rollout_micro_batch_size")


def check_private_api(required: tuple[PrivateName, ...] = RL_LEARNER_PRIVATE_API) -> list[str]:
  """Returns one line per required private Tunix name that is missing."""
  import importlib  # pylint: disable=g-import-not-at-top

  problems = []
  for module_name, class_name, attribute, parameters in required:
    cls = getattr(importlib.import_module(module_name), class_name)
    member = getattr(cls, attribute, None)
    if member is None:
      problems.append(f"{module_name}.{class_name}.{attribute} is missing")
      continue
    if parameters is not None:
      accepted = set(inspect.signature(member).parameters)
      missing = [p for p in parameters if p not in accepted]
      if missing:
        problems.append(
            f"{module_name}.{class_name}.{attribute} no longer takes {missing}"
        )
  return problems


def check_instance_api(learner: Any) -> list[str]:
  """Like check_private_api, for attributes that exist on built objects only."""
  problems = [
      f"{type(learner).__name__}.{name} is missing"
      for name in REQUIRED_LEARNER_ATTRIBUTES
      if not hasattr(learner, name)
  ]
  return problems + _check_actor_trainer(learner.rl_cluster.actor_trainer)


def _check_actor_trainer(trainer: Any) -> list[str]:
  problems = [
      f"actor trainer {type(trainer).__name__}.{name} is missing"
      for name in REQUIRED_TRAINER_ATTRIBUTES
      if not hasattr(trainer, name)
  ]
  if checkpoint_backend(trainer.checkpoint_manager) is None:
    problems.append(
        f"tunix {type(trainer.checkpoint_manager).__name__} has neither "
        "_checkpoint_manager (an Orbax v0 CheckpointManager) nor _checkpointer and "
        "_save_checkpointables (an Orbax v1 training.Checkpointer)"
    )
  return problems


def check_agentic_api(learner: Any) -> list[str]:
  """What a built agentic learner lacks of the Tunix names its loop relies on."""
  from tunix.rl.agentic import agentic_rl_learner  # pylint: disable=g-import-not-at-top

  problems = check_private_api(AGENTIC_LEARNER_PRIVATE_API)
  problems += [
      f"{type(learner).__name__}.{name} is missing"
      for name in AGENTIC_LEARNER_ATTRIBUTES
      if not hasattr(learner, name)
  ]
  read = set()
  for member in vars(agentic_rl_learner.AgenticRLLearner).values():
    code = getattr(member, "__code__", None)
    if code is not None:
      read |= _code_names(code)
  problems += [
      f"{_AGENTIC}.AgenticRLLearner no longer reads {name}"
      for name in AGENTIC_ATTRIBUTES_TUNIX_READS
      if name not in read
  ]
  return problems + _check_actor_trainer(agentic_cluster(learner).actor_trainer)


def require_api(learner: Any, problems: list[str] | None = None) -> None:
  """Raises UnsupportedConfigError naming what this Tunix lacks (RL learner by default)."""
  if problems is None:
    problems = check_private_api() + check_instance_api(learner)
  if problems:
    version = tunix_version()
    raise errors.UnsupportedConfigError(
        f"this Tunix ({version}) lacks what ckpt_iter's exact resume relies on: "
        f"{'; '.join(problems)}. ckpt_iter supports google-tunix 0.1.7 and "
        "upstream main at 0.1.8; use one of them or a ckpt_iter release that supports this Tunix."
    )


# --- learner -----------------------------------------------------------------


def take_shuffle_key(learner: Any) -> np.ndarray | None:
  """Moves the repeat-order key out of the learner into ckpt_iter's hands.

  Stock Tunix splits this key from the producer thread and from the eval path
  alike; ckpt_iter keeps its own chain (saved with each checkpoint) and leaves
  None behind so the stock eval path neither shuffles nor consumes it.
  """
  key = learner._data_shuffle_seed  # pylint: disable=protected-access
  learner._data_shuffle_seed = None  # pylint: disable=protected-access
  return None if key is None else np.asarray(key)


def learner_iter_steps(learner: Any) -> int:
  return int(learner._iter_steps)  # pylint: disable=protected-access


def set_learner_iter_steps(learner: Any, value: int) -> None:
  learner._iter_steps = value  # pylint: disable=protected-access


def training_config(learner: Any) -> Any:
  return learner._training_config  # pylint: disable=protected-access


def num_iterations(learner: Any) -> int:
  return int(learner._num_iterations())  # pylint: disable=protected-access


def num_generations(learner: Any) -> int:
  return int(learner._num_generations())  # pylint: disable=protected-access


def trajectory_ids(learner: Any, example: Any, steps: int) -> list[str]:
  return learner._compute_trajectory_ids(example, steps)  # pylint: disable=protected-access


def process_accumulated_batches(learner: Any, micro_batches, micro_batch_sizes, mode) -> list[Any]:
  return learner._process_accumulated_batches(  # pylint: disable=protected-access
      micro_batches=micro_batches, micro_batch_sizes=micro_batch_sizes, mode=mode
  )


def micro_batch_iterator(learner: Any, full_batches: Any, micro_batch_size: int) -> Iterator[Any]:
  """Tunix's own re-batching of full batches into micro-batches (rows carry over)."""
  return learner._create_micro_batch_iterator(  # pylint: disable=protected-access
      iter(full_batches), micro_batch_size
  )


# --- trainers ----------------------------------------------------------------


def set_trainer_steps(trainer: Any, train_steps: int, iter_steps: int) -> None:
  trainer._train_steps = train_steps  # pylint: disable=protected-access
  trainer._iter_steps = iter_steps  # pylint: disable=protected-access


# --- Tunix's CheckpointManager ---------------------------------------------------
#
# Two shapes exist. google-tunix 0.1.7 holds an Orbax v0 CheckpointManager in
# `_checkpoint_manager` and saves through it; Tunix main (0.1.8) holds an
# Orbax v1 `training.Checkpointer` in `_checkpointer` and saves through
# `_save_checkpointables(step, checkpointables, force, custom_metadata)`.
# Which one is present is decided by what the object has, never by version.

ORBAX_V0 = "orbax_v0"
ORBAX_V1 = "orbax_v1"


def checkpoint_backend(tunix_manager: Any) -> str | None:
  """ORBAX_V0, ORBAX_V1, or None when this Tunix has neither shape."""
  if hasattr(tunix_manager, "_checkpoint_manager"):
    return ORBAX_V0
  if hasattr(tunix_manager, "_checkpointer") and hasattr(tunix_manager, "_save_checkpointables"):
    return ORBAX_V1
  return None


def orbax_manager(tunix_checkpoint_manager: Any) -> Any:
  """The Orbax v0 CheckpointManager inside (ORBAX_V0), or None when disabled."""
  return tunix_checkpoint_manager._checkpoint_manager  # pylint: disable=protected-access


def replace_orbax_manager(tunix_checkpoint_manager: Any, manager: Any) -> None:
  tunix_checkpoint_manager._checkpoint_manager = manager  # pylint: disable=protected-access


def orbax_manager_options(manager: Any) -> Any:
  """The options an Orbax v0 CheckpointManager was built with (Tunix's default included)."""
  return manager._options  # pylint: disable=protected-access


def orbax_checkpointer(tunix_checkpoint_manager: Any) -> Any:
  """The Orbax v1 training.Checkpointer inside (ORBAX_V1), or None when disabled."""
  return tunix_checkpoint_manager._checkpointer  # pylint: disable=protected-access


def orbax_context(tunix_checkpoint_manager: Any) -> Any:
  """The Orbax v1 Context Tunix applies to its own loads (ORBAX_V1)."""
  return tunix_checkpoint_manager._context  # pylint: disable=protected-access


def wrap_save_checkpointables(tunix_checkpoint_manager: Any, make_wrapper: Any) -> bool:
  """Puts `make_wrapper(original)` in place of Tunix's `_save_checkpointables` (ORBAX_V1).

  Returns False when it is already wrapped.
  """
  original = tunix_checkpoint_manager._save_checkpointables  # pylint: disable=protected-access
  if getattr(original, "_ckpt_iter_wrapped", False):
    return False
  wrapper = make_wrapper(original)
  wrapper._ckpt_iter_wrapped = True  # pylint: disable=protected-access
  tunix_checkpoint_manager._save_checkpointables = wrapper  # pylint: disable=protected-access
  return True


def step_directory(tunix_checkpoint_manager: Any, step: int) -> str | None:
  """The directory of checkpoint `step`, or None when checkpointing is off."""
  if checkpoint_backend(tunix_checkpoint_manager) == ORBAX_V1:
    checkpointer = orbax_checkpointer(tunix_checkpoint_manager)
    if checkpointer is None:
      return None
    for checkpoint in checkpointer.checkpoints:
      if checkpoint.step == step:
        return os.fspath(checkpoint.path)
    return os.path.join(os.fspath(checkpointer.directory), str(step))
  manager = orbax_manager(tunix_checkpoint_manager)
  if manager is None:
    return None
  # Orbax has no public per-step path; this is its default `<root>/<step>`.
  return os.path.join(os.fspath(manager.directory), str(step))


def item_directory(tunix_checkpoint_manager: Any, step: int, item: str) -> str | None:
  """Where `item` of checkpoint `step` lives (`<step dir>/<item>`, both Orbax APIs)."""
  step_dir = step_directory(tunix_checkpoint_manager, step)
  return None if step_dir is None else os.path.join(step_dir, item)


def latest_step(tunix_checkpoint_manager: Any) -> int | None:
  return tunix_checkpoint_manager.latest_step()


def load_pytrees(tunix_checkpoint_manager: Any, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
  """Restores the named pytree items of `step`, shaped like `abstract`."""
  if checkpoint_backend(tunix_checkpoint_manager) == ORBAX_V1:
    checkpointer = orbax_checkpointer(tunix_checkpoint_manager)
    with orbax_context(tunix_checkpoint_manager):
      return dict(checkpointer.load_checkpointables(step, abstract))
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = orbax_manager(tunix_checkpoint_manager)
  restored = manager.restore(step, args=ocp.args.Composite(**{
      name: ocp.args.PyTreeRestore(
          item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
      for name, tree in abstract.items()
  }))
  return {name: restored[name] for name in abstract}


def saved_item_metadata(tunix_checkpoint_manager: Any, step: int) -> dict[str, Any]:
  """Per-item metadata (array shardings) of `step`; {} when unavailable."""
  if checkpoint_backend(tunix_checkpoint_manager) == ORBAX_V1:
    checkpointer = orbax_checkpointer(tunix_checkpoint_manager)
    metadata = checkpointer.checkpointables_metadata(step)
    return dict(metadata.metadata) if metadata is not None else {}
  metadata = orbax_manager(tunix_checkpoint_manager).item_metadata(step)
  return {name: metadata[name] for name in metadata.keys()}


# --- SFT trainer (ResumablePeftTrainer) --------------------------------------

# What ResumableSft relies on in a built PeftTrainer: the step counters it
# sets on restore, the flag that makes Tunix's loop neither skip nor stop by
# itself, and the CheckpointManager it adds the data item to.
REQUIRED_SFT_TRAINER_ATTRIBUTES = (
    "_train_steps", "_iter_steps", "is_managed_externally", "checkpoint_manager", "config",
)


def require_sft_api(trainer: Any) -> None:
  """Raises UnsupportedConfigError naming what a built PeftTrainer lacks."""
  missing = [name for name in REQUIRED_SFT_TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
  if missing:
    raise errors.UnsupportedConfigError(
        f"this Tunix ({tunix_version()}) PeftTrainer "
        f"({type(trainer).__name__}) lacks {missing}, which ckpt_iter's SFT resume "
        "relies on. ckpt_iter supports google-tunix 0.1.7 and upstream main at 0.1.8."
    )


# --- agentic learners (tunix.rl.agentic.agentic_rl_learner.AgenticRLLearner) -----


def agentic_build_orchestrator(learner: Any) -> Any:
  return learner._build_orchestrator()  # pylint: disable=protected-access


def agentic_create_agent_env_pair(learner: Any, example: Any, group_id: int, pair_index: int) -> Any:
  return learner._create_agent_env_pair(example, group_id, pair_index)  # pylint: disable=protected-access


def agentic_to_train_examples(learner: Any, trajectories: Any, mode: Any) -> list[Any]:
  return learner._batch_to_train_example(batch_results=trajectories, mode=mode)  # pylint: disable=protected-access


def agentic_eval_producer(learner: Any, orchestrator: Any, prompts: Any) -> Any:
  return learner._orchestrator_producer(  # pylint: disable=protected-access
      orchestrator, prompts, num_generations=learner._num_generations()  # pylint: disable=protected-access
  )


def agentic_rollout_sync_lock(learner: Any) -> Any:
  return learner._rollout_sync_lock  # pylint: disable=protected-access


def agentic_compute_logps_micro_batch_size(learner: Any) -> int:
  return int(learner._compute_logps_micro_batch_size)  # pylint: disable=protected-access


def agentic_set_batch_sizes(learner: Any, full_batch_size: int, process_in_consumer: bool) -> None:
  learner._full_batch_size = full_batch_size  # pylint: disable=protected-access
  learner._rollout_micro_batch_size = 1  # pylint: disable=protected-access
  learner._process_in_consumer = process_in_consumer  # pylint: disable=protected-access


# How a group is trained `num_iterations` times. Two shapes exist:
#   * google-tunix 0.1.7: the producer queues each group's trainer input
#     num_iterations times in a row (or, converting in the consumer, each
#     micro-batch is trained num_iterations times in a row);
#   * upstream main: the producer queues it once; `train()` trains every
#     micro-batch of the full batch once, then replays the whole full batch
#     num_iterations - 1 times (one `update_actor` call per replay).
AGENTIC_REPEAT_EACH = "repeat_each"
AGENTIC_REPLAY_FULL_BATCH = "replay_full_batch"


def _code_names(code: Any) -> set[str]:
  """Names a code object and the functions nested in it refer to."""
  names = set(code.co_names)
  for const in code.co_consts:
    if inspect.iscode(const):
      names |= _code_names(const)
  return names


def agentic_iteration_order() -> str | None:
  """AGENTIC_REPEAT_EACH, AGENTIC_REPLAY_FULL_BATCH, or None when neither is recognised.

  Read from the installed code, not its version: a producer that asks for
  `_num_iterations` repeats each group itself; otherwise the loop in
  `train()` that asks for it replays the full batch.
  """
  from tunix.rl.agentic import agentic_rl_learner  # pylint: disable=g-import-not-at-top

  learner_class = agentic_rl_learner.AgenticRLLearner
  for method, order in (("_producer", AGENTIC_REPEAT_EACH), ("train", AGENTIC_REPLAY_FULL_BATCH)):
    code = getattr(getattr(learner_class, method, None), "__code__", None)
    if code is not None and "_num_iterations" in _code_names(code):
      return order
  return None


def agentic_last_eval_train_step(learner: Any) -> int:
  return int(learner._last_eval_train_step)  # pylint: disable=protected-access


def agentic_set_last_eval_train_step(learner: Any, step: int) -> None:
  learner._last_eval_train_step = step  # pylint: disable=protected-access
  learner._eval_iter_steps = 0  # pylint: disable=protected-access


# --- sequence packing (`max_seq_token_per_tpu`) ---------------------------------
#
# Tunix packs the trainer's queue, per mini-batch, with `tunix.rl.utils.pack_sequences`
# and hands the trainer one packed input per `next()`. Two shapes exist:
#   * google-tunix 0.1.7: greedy, one packed row per trainer input, an
#     optimizer update every `gradient_accumulation_steps` packed rows, so an
#     update (and a checkpoint) can fall between two rows of one queue item;
#   * upstream main: `sequences_per_update` chunks, an update only on a chunk
#     marked `is_update_step` (each mini-batch pass), so a checkpoint is always
#     at a boundary between queue items.


def packing_budget(learner: Any) -> int | None:
  return training_config(learner).max_seq_token_per_tpu


def packing_updates_per_pass() -> bool:
  """True when this Tunix's packer updates once per mini-batch pass (upstream main)."""
  from tunix.rl import utils as rl_utils  # pylint: disable=g-import-not-at-top

  return "sequences_per_update" in inspect.signature(rl_utils.pack_sequences).parameters


def unpadded_lengths(example: Any) -> list[int]:
  """Token count of each row of `example`, as Tunix's packer measures it."""
  from tunix.rl import utils as rl_utils  # pylint: disable=g-import-not-at-top

  return [len(item["prompt_ids"]) + len(item["completion_ids"]) for item in rl_utils.unpad_train_example(example)]


def rows_of(example: Any) -> int:
  return int(np.shape(example.completion_ids)[0])


def drop_leading_rows(example: Any, count: int) -> Any:
  """`example` without its first `count` rows, as Tunix's packer unpads it.

  Every per-row field is sliced; `policy_version`, which Tunix's 0.1.7
  packer copies whole onto each row, is kept whole.
  """
  import dataclasses  # pylint: disable=g-import-not-at-top

  rows = rows_of(example)
  changes = {}
  for field in dataclasses.fields(example):
    value = getattr(example, field.name)
    if field.name == "policy_version" or value is None or np.ndim(value) == 0:
      continue
    if np.shape(value)[0] == rows:
      changes[field.name] = value[count:]
  return dataclasses.replace(example, **changes)


# --- waiting for saves (both Orbax APIs) -------------------------------------


def wait_until_saved(tunix_checkpoint_manager: Any) -> None:
  """Blocks until every save started by Tunix's CheckpointManager is on disk."""
  backend = checkpoint_backend(tunix_checkpoint_manager)
  if backend == ORBAX_V1:
    checkpointer = orbax_checkpointer(tunix_checkpoint_manager)
    if checkpointer is not None:
      checkpointer.wait()
  elif backend == ORBAX_V0:
    manager = orbax_manager(tunix_checkpoint_manager)
    if manager is not None:
      manager.wait_until_finished()


def agentic_cluster(learner: Any) -> Any:
  """The learner's RLCluster: `rl_cluster` on 0.1.7, `rl_engine` on main.

  Tunix main renamed it (`RLCluster = RLEngine`); its agentic learners, unlike
  RLLearner, keep no `rl_cluster` alias.
  """
  engine = getattr(learner, "rl_engine", None)
  return engine if engine is not None else learner.rl_cluster


# =============================================================================
# Tunix's YAML pipelines (`tunix.cli.*_main`), for ckpt_iter.tunix.cli.
#
# Each pipeline builds its learner inside a method, looking the class up on a
# module at call time: `grpo_learner.GrpoLearner(...)`, `from
# tunix.rl.agentic.agentic_grpo_learner import GRPOLearner`,
# `ppo_learner.PpoLearner(...)` (main's ppo_main), `peft_trainer.PeftTrainer(...)`.
# ckpt_iter.tunix.cli puts its Resumable subclasses at those names for the run.
# Each slot also names the text the pipeline's source must contain: a Tunix
# that bound the class at import time instead would silently train stock.

# kind -> (pipeline module, ((class module, attribute, lookup text in the pipeline), ...))
CLI_PIPELINES: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "grpo": ("tunix.cli.grpo_main", (
        ("tunix.rl.grpo.grpo_learner", "GrpoLearner", "grpo_learner.GrpoLearner("),
        ("tunix.rl.agentic.agentic_grpo_learner", "GRPOLearner",
         "from tunix.rl.agentic.agentic_grpo_learner import GRPOLearner"),
    )),
    "ppo": ("tunix.cli.ppo_main", (
        ("tunix.rl.ppo.ppo_learner", "PpoLearner", "ppo_learner.PpoLearner("),
    )),
    "sft": ("tunix.cli.peft_main", (
        ("tunix.sft.peft_trainer", "PeftTrainer", "peft_trainer.PeftTrainer("),
    )),
}


def tunix_version() -> str:
  """The installed Tunix's version string ("unknown" when it has none)."""
  import tunix  # pylint: disable=g-import-not-at-top

  return getattr(tunix, "__version__", "unknown")


def cli_pipeline(kind: str) -> tuple[Any, list[tuple[Any, str]]]:
  """(Tunix's pipeline module for `kind`, [(module, attribute) it builds its learner from]).

  Raises:
    UnsupportedConfigError: naming the pipeline module, class or lookup this
      Tunix lacks.
  """
  import importlib  # pylint: disable=g-import-not-at-top

  module_name, slots = CLI_PIPELINES[kind]
  try:
    pipeline = importlib.import_module(module_name)
  except ImportError as e:
    raise errors.UnsupportedConfigError(
        f"this Tunix ({tunix_version()}) has no {module_name} ({e}), so "
        f"`train {kind}` cannot run here; upstream Tunix main has it."
    ) from None
  problems = []
  if not callable(getattr(pipeline, "main", None)):
    problems.append(f"{module_name}.main is missing")
  try:
    source = inspect.getsource(pipeline)
  except (OSError, TypeError):
    source = ""
  found = []
  for class_module, attribute, lookup in slots:
    module = importlib.import_module(class_module)
    if not isinstance(getattr(module, attribute, None), type):
      problems.append(f"{class_module}.{attribute} is missing")
    elif lookup not in source:
      problems.append(f"{module_name} no longer builds its learner through `{lookup}`")
    else:
      found.append((module, attribute))
  if problems:
    raise errors.UnsupportedConfigError(
        f"this Tunix ({tunix_version()}) does not build its `{kind}` learner where "
        f"ckpt_iter swaps in the Resumable class: {'; '.join(problems)}. ckpt_iter "
        "supports the pipelines of google-tunix 0.1.7 and upstream main at 0.1.8."
    )
  return pipeline, found


def cli_bundled_config_path(name: str) -> str:
  """Where Tunix's HyperParameters looks for a config given by this bare name.

  It resolves the literal argument "base_config.yaml" next to tunix/cli/config.py;
  the 0.1.7 and 0.1.8 wheels do not ship that file.
  """
  from tunix.cli import config as tunix_cli_config  # pylint: disable=g-import-not-at-top

  return os.path.join(os.path.dirname(os.path.abspath(tunix_cli_config.__file__)), name)


# ---------------------------------------------------------------------------
# Algorithm settings a resume may change, read from the learner (their field: `_settings`).

# Fingerprinted in their own right (a change is refused): not repeated here.
_REFUSED = frozenset({"num_generations", "num_iterations"})
# The rollout's sampling knobs in the training mode.
_ROLLOUT_FIELDS = ("temperature", "top_p", "top_k")


def algorithm_settings(learner: Any) -> dict[str, int | float]:
  """The learner's numeric changeable settings, name -> value."""
  settings: dict[str, int | float] = {}
  algo_config = getattr(learner, "algo_config", None)
  if dataclasses.is_dataclass(algo_config):
    for field in dataclasses.fields(algo_config):
      value = getattr(algo_config, field.name, None)
      # GRPO copies the rollout temperature into its config: recorded once, below.
      if field.name not in _REFUSED and field.name not in _ROLLOUT_FIELDS and _is_number(value):
        settings[field.name] = value
  rollout = _train_rollout_config(learner)
  for name in _ROLLOUT_FIELDS:
    value = getattr(rollout, name, None)
    if _is_number(value):
      settings[name] = value
  learning_rate = _initial_learning_rate(learner)
  if learning_rate is not None:
    settings["learning_rate"] = learning_rate
  return settings


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _train_rollout_config(learner: Any) -> Any:
  cluster = getattr(learner, "rl_cluster", None)
  try:
    from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

    return cluster.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN)
  except Exception:  # pylint: disable=broad-except
    # A cluster without a rollout config for training records no rollout settings.
    return None


def _initial_learning_rate(learner: Any) -> float | None:
  """The actor optimizer's learning rate at step 0, when it is visible.

  An optax transformation hides its constants in closures; only one built
  with `optax.inject_hyperparams` exposes them, in the state its `init`
  returns. `init({})` builds that state without touching the model. The live
  optimizer state cannot be used: Tunix restored it from the checkpoint.
  """
  try:
    optimizer = learner.rl_cluster.cluster_config.training_config.actor_optimizer
    found = _find_learning_rate(optimizer.init({}))
  except Exception:  # pylint: disable=broad-except
    return None  # an optimizer that cannot init without parameters: not recorded
  # float32 in the state: keep the digits it holds, not its binary tail.
  return None if found is None else float(f"{float(found):.7g}")


def _find_learning_rate(opt_state: Any) -> Any:
  hyperparams = getattr(opt_state, "hyperparams", None)
  if isinstance(hyperparams, Mapping) and "learning_rate" in hyperparams:
    return hyperparams["learning_rate"]
  if isinstance(opt_state, (tuple, list)):
    for part in opt_state:
      found = _find_learning_rate(part)
      if found is not None:
        return found
  return None
