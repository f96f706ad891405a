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
are swapped is `ckpt_iter.tunix._api.CLI_PIPELINES`.

What `train()` takes beyond Tunix's arguments on a restart comes from a
`ckpt_iter:` section of the config or `ckpt_iter.KEY=VALUE` arguments
(`on_legacy_checkpoint`, `allow_drift`); Tunix never sees those arguments.
See https://github.com/ckpt-iter/ckpt_iter/blob/main/docs/tunix_cli.md.
"""

from __future__ import annotations

import contextlib
import os
import importlib.resources
import sys
from typing import Any, Iterator, Mapping, Sequence

from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter import tunix as ckpt_tunix
from ckpt_iter.dataset import with_skip
from ckpt_iter.tunix import _api as api
from ckpt_iter import skips as skips_lib

PROG = "python -m ckpt_iter.tunix.cli"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
KINDS = tuple(api.CLI_PIPELINES)
_BUNDLED_CONFIG = "base_config.yaml"  # the one bare name Tunix resolves inside its package
OPTIONS_SECTION = "ckpt_iter"
# A run started with Tunix's own command has stock checkpoints: continuing
# them the way stock does (with #2290's skip fixed) is never worse than stock.
DEFAULT_OPTIONS = {"on_legacy_checkpoint": "fast_forward", "allow_drift": (), "skip": None}
# The train() options each pipeline's learner takes (`skip` is declared on its train_ds, not passed).
_PIPELINE_OPTIONS = {"grpo": ("on_legacy_checkpoint", "allow_drift", "skip"),
                     "ppo": ("on_legacy_checkpoint", "allow_drift", "skip"),
                     "sft": ("allow_drift", "skip")}

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
  ckpt_iter.on_legacy_checkpoint=fast_forward|raise
                a checkpoint written by stock Tunix (e.g. `python -m
                tunix.cli.grpo_main`): continue it as stock does, skipping
                what it trained (default), or refuse it (grpo, ppo)
  ckpt_iter.allow_drift=field[,field...]
                fingerprint fields the checkpoint may differ in (as
                train(allow_drift=...)); also a `ckpt_iter:` section in CONFIG.yaml
  ckpt_iter.skip=records:A-B[,C-D][;source:E-F]
                stream records (or an unshuffled source's records) to skip from
                this restart on; the checkpoints keep them for every later
                restart (ckpt_iter.with_skip on the training data)
  --flag=value  absl flags of the Tunix pipeline (e.g. --pathways_bns=...)

`{prog} --example-config` prints a complete GRPO config that reads its
prompts through ckpt_iter.tunix.data, to start from (adapt model, tokenizer,
mesh and data). Every key and option:
{docs}
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


def _with_train_options(cls: type, options: Mapping[str, Any]) -> type:
  """`cls` whose `train()` takes `options` unless its caller (Tunix's pipeline) passes them.

  `skip` is not a train() argument: it is declared on the training data
  (`ckpt_iter.with_skip`), whose restore adds it to the checkpoint's skips.
  """
  options = dict(options or {})
  skip = options.pop("skip", None)
  if not options and not skip:
    return cls

  def train(self, *args, **kwargs):
    if skip:
      data = kwargs.get("train_ds", args[0] if args else None)
      with_skip(data, skip)
    return cls.train(self, *args, **{**options, **kwargs})

  return type(cls.__name__, (cls,), {"train": train, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


@contextlib.contextmanager
def resumable_learners(kind: str, train_options: Mapping[str, Any] | None = None) -> Iterator[Any]:
  """Within the block, Tunix's `kind` pipeline builds ckpt_iter's Resumable classes.

  Yields Tunix's pipeline module. The swapped module attributes get their
  original values back when the block exits, however it exits. The learners
  built take `train_options` (`on_legacy_checkpoint`, `allow_drift`) in
  `train()`, which Tunix's pipeline calls without them.

  Raises:
    UnsupportedConfigError: this Tunix lacks the pipeline, a class, or the
      lookup the swap relies on (the message names it).
  """
  if kind not in api.CLI_PIPELINES:
    raise errors.InvalidArgumentError(f"unknown pipeline {kind!r}; expected one of {list(KINDS)}.")
  pipeline, slots = api.cli_pipeline(kind)
  swaps = [(module, attribute, _with_train_options(_resumable_class(module, attribute), train_options or {}))
           for module, attribute in slots]
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
          "(every section the pipeline reads; `ckpt-iter train --example-config` prints one)."
      )
    return config
  if not os.path.isfile(config):
    raise _Usage(f"config file {config!r} does not exist (working directory {os.getcwd()!r}).")
  return config


class _Usage(Exception):
  pass


def train_options(kind: str, config: str, overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
  """ckpt_iter's restart options of a run, and the overrides left for Tunix.

  From the config's `ckpt_iter:` section, then `ckpt_iter.KEY=VALUE`
  arguments (taken out: Tunix accepts only keys its file has). Defaults:
  `DEFAULT_OPTIONS`, for the options `kind`'s learner takes.

  Raises:
    _Usage: an unknown key, a value that is not allowed, or an option this
      pipeline's learner does not take (the message names it).
  """
  section = _config_section(config)
  rest = []
  for argument in overrides:
    if argument.startswith(OPTIONS_SECTION + "."):
      key, _, value = argument[len(OPTIONS_SECTION) + 1:].partition("=")
      section[key] = value
    else:
      rest.append(argument)
  accepted = _PIPELINE_OPTIONS[kind]
  unknown = sorted(set(section) - set(DEFAULT_OPTIONS))
  if unknown:
    raise _Usage(f"{OPTIONS_SECTION}.{unknown[0]} is not an option; expected one of "
                 f"{', '.join(f'{OPTIONS_SECTION}.{k}' for k in DEFAULT_OPTIONS)}.")
  refused = sorted(set(section) - set(accepted))
  if refused:
    raise _Usage(f"{OPTIONS_SECTION}.{refused[0]} does not apply to the {kind} pipeline: its learner "
                 "continues a stock Tunix checkpoint as stock does. Remove it.")
  options = {key: DEFAULT_OPTIONS[key] for key in accepted if key != "skip"}
  if "on_legacy_checkpoint" in section:
    policy = section["on_legacy_checkpoint"]
    if policy not in ckpt_tunix.LEGACY_POLICIES:
      raise _Usage(f"{OPTIONS_SECTION}.on_legacy_checkpoint={policy!r}: expected one of "
                   f"{', '.join(ckpt_tunix.LEGACY_POLICIES)}.")
    options["on_legacy_checkpoint"] = policy
  if "allow_drift" in section:
    fields = section["allow_drift"]
    if isinstance(fields, str):
      fields = [f.strip() for f in fields.strip("[]").split(",") if f.strip()]
    if not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields):
      raise _Usage(f"{OPTIONS_SECTION}.allow_drift={fields!r}: expected a list of fingerprint field names.")
    options["allow_drift"] = tuple(fields)
  if section.get("skip"):
    try:
      options["skip"] = skips_lib.Skip.parse(str(section["skip"]))
    except errors.InvalidArgumentError as e:
      raise _Usage(f"{OPTIONS_SECTION}.skip: {e}") from None
  return options, rest


def _config_section(config: str) -> dict[str, Any]:
  """The config file's `ckpt_iter:` section, as plain values ({} without one)."""
  if config == _BUNDLED_CONFIG:
    return {}
  import omegaconf  # pylint: disable=g-import-not-at-top  (Tunix's config loader reads YAML with it)

  loaded = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(config), resolve=True)
  section = loaded.get(OPTIONS_SECTION) if isinstance(loaded, dict) else None
  if section is None:
    return {}
  if not isinstance(section, dict):
    raise _Usage(f"{config}: the {OPTIONS_SECTION!r} section must be a mapping, got {section!r}.")
  return dict(section)


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
        *, prog: str = PROG, options: Mapping[str, Any] | None = None) -> None:
  """Runs Tunix's `kind` pipeline on `config` with the Resumable learner.

  `options` are the learner's `train()` options (`train_options`); the
  overrides must not hold `ckpt_iter.` arguments any more.

  Raises whatever the pipeline raises (Tunix's ValueError for a bad config,
  ckpt_iter's ConfigDriftError for a resume into another configuration, ...).
  """
  with resumable_learners(kind, options) as pipeline:
    _parse_absl_flags(prog, list(flag_args))
    # argv[0] is Tunix's module name: its config check of perf metrics
    # accepts them only from an entry point named *grpo_main.
    pipeline.main([pipeline.__name__, config, *overrides])


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
  """The command line; returns the exit code (0 trained, 1 refused, 2 usage)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  usage = USAGE.format(prog=prog, kinds=",".join(KINDS), docs=_urls.doc_url("tunix_cli.md"))
  if argv[:1] in (["-h"], ["--help"]):
    print(usage, end="")
    return EXIT_OK
  if argv[:1] == ["--example-config"]:
    print(example_config(), end="")
    return EXIT_OK
  try:
    kind, config, overrides, flag_args = _split(argv)
    if any(a in ("-h", "--help") for a in flag_args):
      print(usage, end="")
      return EXIT_OK
    config = _config_path(config)
    options, overrides = train_options(kind, config, overrides)
  except _Usage as e:
    print(usage.splitlines()[0], file=sys.stderr)
    print(f"{prog}: {e}", file=sys.stderr)
    return EXIT_USAGE
  try:
    run(kind, config, overrides, flag_args, prog=prog, options=options)
  except errors.CkptIterError as e:
    print(f"{prog}: {e}{_command_line_way(e)}", file=sys.stderr)
    return EXIT_FAILED
  return EXIT_OK


def example_config() -> str:
  """The complete GRPO config the package ships (the `ckpt-iter train` guide shows the same file)."""
  return importlib.resources.files("ckpt_iter.tunix").joinpath("example_grpo.yaml").read_text(encoding="utf-8")


def _command_line_way(error: errors.CkptIterError) -> str:
  """The way through a refusal, said in this command line's words (its message says the API's)."""
  if isinstance(error, errors.ConfigDriftError):
    fields = sorted(error.differences)  # a content change's are content.<field>
    if len(fields) <= errors.SHOWN_DIFFERENCES:
      return f" On this command line: {OPTIONS_SECTION}.allow_drift={','.join(fields)}"
    # As bounded as the message: naming thousands of fields here would be the megabytes it avoids.
    return (f" On this command line: {OPTIONS_SECTION}.allow_drift=FIELD,FIELD,... names the fields "
            f"to accept, all {len(fields):,} of them to accept every change (the first: "
            f"{','.join(map(errors.shown_name, fields[:errors.SHOWN_DIFFERENCES]))})")
  if isinstance(error, errors.LegacyCheckpointError):
    return f" On this command line: {OPTIONS_SECTION}.on_legacy_checkpoint=fast_forward"
  return ""


if __name__ == "__main__":
  sys.exit(main())
