"""Tunix's own YAML pipelines, run with ckpt_iter's Resumable learners.

    python -m ckpt_iter.tunix.cli grpo CONFIG.yaml [key=value ...] [--absl_flag=...]
    ckpt-iter train grpo|ppo|sft CONFIG.yaml [key=value ...]

The pipeline is Tunix's (`tunix.cli.grpo_main`, `ppo_main` on upstream main,
`peft_main`): its config loading, overrides, models, meshes, data
(`data_module`, e.g. `ckpt_iter.tunix.data`), reward functions and learner
arguments are unchanged. Those pipelines build the learner inside a method by
looking the class up on a module, so for the run only, that module attribute
holds the Resumable subclass (`ResumableGRPOLearner`,
`ResumableAgenticGRPOLearner`, `ResumablePPOLearner`, `ResumablePeftTrainer`);
the originals are put back afterwards, also when the run fails. Which names
are swapped is `ckpt_iter.tunix._api.CLI_PIPELINES`. See docs/tunix_cli.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Sequence

from ckpt_iter import errors
from ckpt_iter import tunix as ckpt_tunix
from ckpt_iter.tunix import _api as api

PROG = "python -m ckpt_iter.tunix.cli"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
KINDS = tuple(api.CLI_PIPELINES)
_BUNDLED_CONFIG = "base_config.yaml"  # the one bare name Tunix resolves inside its package

USAGE = """\
usage: {prog} {{{kinds}}} CONFIG.yaml [key=value ...] [--absl_flag=value ...]

Runs Tunix's own pipeline (grpo: tunix.cli.grpo_main, standard and agentic;
ppo: tunix.cli.ppo_main, upstream Tunix main only; sft: tunix.cli.peft_main)
with ckpt_iter's Resumable learner in place of Tunix's, so a restart resumes
the data exactly from the latest checkpoint.

  CONFIG.yaml   a complete Tunix config (the Tunix wheels ship no
                base_config.yaml to inherit from); data_module:
                ckpt_iter.tunix.data reads JSONL/Parquet/ArrayRecord/HF data
  key=value     Tunix's overrides (OmegaConf dot-list: rl_training_config.max_steps=10);
                a key must exist in CONFIG.yaml. Also override_config_file=FILE.yaml
  --flag=value  absl flags of the Tunix pipeline (e.g. --pathways_bns=...)

See docs/tunix_cli.md.
"""


def _resumable_class(module: Any, attribute: str) -> type:
  """The Resumable class that replaces `module.attribute` (see api.CLI_PIPELINES)."""
  replacements = {
      ("tunix.rl.grpo.grpo_learner", "GrpoLearner"): ckpt_tunix.ResumableGRPOLearner,
      ("tunix.rl.agentic.agentic_grpo_learner", "GRPOLearner"): ckpt_tunix.ResumableAgenticGRPOLearner,
      ("tunix.rl.ppo.ppo_learner", "PpoLearner"): ckpt_tunix.ResumablePPOLearner,
      ("tunix.sft.peft_trainer", "PeftTrainer"): ckpt_tunix.ResumablePeftTrainer,
  }
  replacement = replacements[(module.__name__, attribute)]
  original = getattr(module, attribute)
  if not issubclass(replacement, original):
    raise errors.UnsupportedConfigError(
        f"{module.__name__}.{attribute} is {original!r}, which "
        f"{replacement.__qualname__} does not derive from; was it replaced by other code?"
    )
  return replacement


@contextlib.contextmanager
def resumable_learners(kind: str) -> Iterator[Any]:
  """Within the block, Tunix's `kind` pipeline builds ckpt_iter's Resumable classes.

  Yields Tunix's pipeline module. The swapped module attributes get their
  original values back when the block exits, however it exits.

  Raises:
    UnsupportedConfigError: this Tunix lacks the pipeline, a class, or the
      lookup the swap relies on (the message names it).
  """
  if kind not in api.CLI_PIPELINES:
    raise errors.InvalidArgumentError(f"unknown pipeline {kind!r}; expected one of {list(KINDS)}.")
  pipeline, slots = api.cli_pipeline(kind)
  swaps = [(module, attribute, _resumable_class(module, attribute)) for module, attribute in slots]
  originals = [(module, attribute, getattr(module, attribute)) for module, attribute, _ in swaps]
  try:
    for module, attribute, replacement in swaps:
      setattr(module, attribute, replacement)
    yield pipeline
  finally:
    for module, attribute, original in reversed(originals):
      setattr(module, attribute, original)


def _parse_absl_flags(prog: str, flag_args: list[str]) -> None:
  """Parses the absl flags Tunix's pipelines read (as `absl.app.run` would)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  if flags.FLAGS.is_parsed() and not flag_args:
    return
  flags.FLAGS([prog, *flag_args])


def _config_path(config: str) -> str:
  """The config file Tunix will load, checked to exist (Tunix's own error is terse)."""
  if config == _BUNDLED_CONFIG:
    bundled = api.cli_bundled_config_path(_BUNDLED_CONFIG)
    if not os.path.isfile(bundled):
      raise _Usage(
          f"{config!r} means Tunix's bundled base config ({bundled}), which this "
          "Tunix wheel does not ship. Pass the path of a complete config file "
          "(every section the pipeline reads; see docs/tunix_cli.md for one)."
      )
    return config
  if not os.path.isfile(config):
    raise _Usage(f"config file {config!r} does not exist (working directory {os.getcwd()!r}).")
  return config


class _Usage(Exception):
  pass


def _split(argv: list[str]) -> tuple[str, str, list[str], list[str]]:
  """(kind, config, overrides, absl flag arguments) of the command line."""
  if not argv:
    raise _Usage("give a pipeline and a config file.")
  kind, rest = argv[0], argv[1:]
  if kind not in KINDS:
    raise _Usage(f"unknown pipeline {kind!r}; expected one of {', '.join(KINDS)}.")
  if not rest or rest[0].startswith("-") or "=" in rest[0]:
    raise _Usage(f"the argument after {kind!r} must be the config file (CONFIG.yaml).")
  config, rest = rest[0], rest[1:]
  flag_args = [a for a in rest if a.startswith("-")]
  overrides = [a for a in rest if not a.startswith("-")]
  return kind, config, overrides, flag_args


def run(kind: str, config: str, overrides: Sequence[str] = (), flag_args: Sequence[str] = (),
        *, prog: str = PROG) -> None:
  """Runs Tunix's `kind` pipeline on `config` with the Resumable learner.

  Raises whatever the pipeline raises (Tunix's ValueError for a bad config,
  ckpt_iter's ConfigDriftError for a resume into another configuration, ...).
  """
  with resumable_learners(kind) as pipeline:
    _parse_absl_flags(prog, list(flag_args))
    # argv[0] is Tunix's module name: its config check of perf metrics
    # accepts them only from an entry point named *grpo_main.
    pipeline.main([pipeline.__name__, config, *overrides])


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
  """The command line; returns the exit code (0 trained, 1 refused, 2 usage)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  usage = USAGE.format(prog=prog, kinds=",".join(KINDS))
  if argv[:1] in (["-h"], ["--help"]):
    print(usage, end="")
    return EXIT_OK
  try:
    kind, config, overrides, flag_args = _split(argv)
    if any(a in ("-h", "--help") for a in flag_args):
      print(usage, end="")
      return EXIT_OK
    config = _config_path(config)
  except _Usage as e:
    print(usage.splitlines()[0], file=sys.stderr)
    print(f"{prog}: {e}", file=sys.stderr)
    return EXIT_USAGE
  try:
    run(kind, config, overrides, flag_args, prog=prog)
  except errors.CkptIterError as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return EXIT_FAILED
  return EXIT_OK


if __name__ == "__main__":
  sys.exit(main())
