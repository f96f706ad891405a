"""Every private Tunix attribute ckpt_iter relies on, touched here and only here.

Tunix (google-tunix 0.1.7) has no public hook for the data side of a resume,
so the integration overrides two learner methods (`_prepare_data`,
`_run_global_step`, in `ckpt_iter.tunix`) and uses the private names listed in
`REQUIRED_PRIVATE_API`. `check_private_api()` verifies them; the Resumable
mixin calls it when a learner is built and tests call it directly, so a Tunix
release that renames one fails loudly instead of resuming wrong.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import numpy as np

from ckpt_iter import errors

# (module, class, attribute, parameters it must accept; None for data attributes)
REQUIRED_PRIVATE_API: tuple[tuple[str, str, str, tuple[str, ...] | None], ...] = (
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
REQUIRED_LEARNER_ATTRIBUTES = (
    "_data_shuffle_seed", "_iter_steps", "_training_config",
    "_rollout_micro_batch_size", "_compute_logps_micro_batch_size",
)
REQUIRED_TRAINER_ATTRIBUTES = ("_train_steps", "_iter_steps", "checkpoint_manager")
REQUIRED_CHECKPOINT_MANAGER_ATTRIBUTES = ("_checkpoint_manager",)


def check_private_api() -> list[str]:
  """Returns one line per required private Tunix name that is missing."""
  import importlib  # pylint: disable=g-import-not-at-top

  problems = []
  for module_name, class_name, attribute, parameters in REQUIRED_PRIVATE_API:
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
  trainer = learner.rl_cluster.actor_trainer
  problems += [
      f"actor trainer {type(trainer).__name__}.{name} is missing"
      for name in REQUIRED_TRAINER_ATTRIBUTES
      if not hasattr(trainer, name)
  ]
  problems += [
      f"tunix CheckpointManager.{name} is missing"
      for name in REQUIRED_CHECKPOINT_MANAGER_ATTRIBUTES
      if not hasattr(trainer.checkpoint_manager, name)
  ]
  return problems


def require_api(learner: Any) -> None:
  problems = check_private_api() + check_instance_api(learner)
  if problems:
    import tunix  # pylint: disable=g-import-not-at-top

    version = getattr(tunix, "__version__", "unknown")
    raise errors.UnsupportedConfigError(
        f"this Tunix ({version}) lacks what ckpt_iter's exact resume relies on: "
        f"{'; '.join(problems)}. Use google-tunix 0.1.7 or a ckpt_iter release "
        "that supports this Tunix."
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


def configured_micro_batch_sizes(learner: Any) -> tuple[int | None, int | None]:
  """Rollout and logps micro batch sizes (set by train(), None before)."""
  return (
      learner._rollout_micro_batch_size,  # pylint: disable=protected-access
      learner._compute_logps_micro_batch_size,  # pylint: disable=protected-access
  )


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


def split_full_batch(learner: Any, full_batch: Any, micro_batch_size: int) -> list[Any]:
  """Tunix's own split of one full batch into micro-batches."""
  split: Iterator[Any] = learner._create_micro_batch_iterator(  # pylint: disable=protected-access
      iter([full_batch]), micro_batch_size
  )
  return list(split)


# --- trainers ----------------------------------------------------------------


def orbax_manager(tunix_checkpoint_manager: Any) -> Any:
  return tunix_checkpoint_manager._checkpoint_manager  # pylint: disable=protected-access


def replace_orbax_manager(tunix_checkpoint_manager: Any, manager: Any) -> None:
  tunix_checkpoint_manager._checkpoint_manager = manager  # pylint: disable=protected-access


def set_trainer_steps(trainer: Any, train_steps: int, iter_steps: int) -> None:
  trainer._train_steps = train_steps  # pylint: disable=protected-access
  trainer._iter_steps = iter_steps  # pylint: disable=protected-access
