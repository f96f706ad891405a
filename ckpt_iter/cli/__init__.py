"""The `ckpt-iter` command: inspect, verify, diff and audit data checkpoints.

    ckpt-iter inspect /ckpts/run1            # Tunix root, .../actor, Orbax root, or gs://...
    ckpt-iter verify /ckpts/run1             # exit 0 ok, 1 problems, 2 usage
    ckpt-iter diff /ckpts/run1 3 5             # or --step 3 --step 5
    ckpt-iter audit /ckpts/run1 --plot run1.png   # exit 0 an unbroken chain of resumes
    ckpt-iter which /ckpts/run1 --step 1200  # the records the last batch before step 1200 held
    ckpt-iter order /ckpts/run1 --out order.parquet   # every global batch of the run, in order

Everything is read from the state files: no model is restored, no array is
loaded by `inspect` or `diff`, and neither JAX, Grain, Orbax nor Tunix is
imported (verify imports ckpt_iter.tunix only for a state holding Tunix
items). Errors go to stderr as `ckpt-iter: <message>`; a closed pipe
(`| head`) ends the output quietly. This module holds the parser, the
dispatch and the verbs; what they print is `_text`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import Any, Sequence

from ckpt_iter import _urls
from ckpt_iter import errors
from ckpt_iter.cli import _audit as auditing
from ckpt_iter.cli import _inspect as inspection
from ckpt_iter.cli import _text
from ckpt_iter.cli import _verify as verification

PROG = "ckpt-iter"
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
# audit: no check failed, but not every resume was proven; audit and verify: nothing to check (no
# data state; for verify, every step was deleted while being read).
EXIT_UNPROVEN, EXIT_NOTHING = 3, 4


class _HelpFormatter(argparse.HelpFormatter):
  """argparse's help layout, with addresses kept whole (never split at a hyphen or a line end)."""

  def _fill_text(self, text: str, width: int, indent: str) -> str:
    return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)

  def _split_lines(self, text: str, width: int) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
  """argparse with errors as `ckpt-iter: <message>` and no SystemExit leak."""

  def __init__(self, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("formatter_class", _HelpFormatter)  # the verbs' parsers too
    super().__init__(*args, **kwargs)

  def error(self, message: str) -> None:  # type: ignore[override]
    self.print_usage(sys.stderr)
    raise _UsageExit(message)


class _UsageExit(Exception):
  pass


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line `argv` (default: sys.argv[1:]); returns the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except _UsageExit as e:
    return _fail(str(e), EXIT_USAGE)
  except SystemExit as e:  # --help
    return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
  if args.verb is None:
    parser.print_help(sys.stderr)
    return EXIT_USAGE
  try:
    if args.verb in _READING_VERBS:
      with _text.escaped_output():
        return args.run(args)
    return args.run(args)
  except BrokenPipeError:
    # The reader (`| head`) has what it wanted: no traceback, no message, and
    # nothing more written at exit (stdout now goes nowhere).
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
  except inspection.UsageError as e:
    return _fail(str(e), EXIT_USAGE)
  except _NothingToAnswer as e:
    return _fail(str(e), EXIT_NOTHING)
  except (errors.CkptIterError, OSError) as e:
    return _fail(str(e), EXIT_PROBLEMS)


# The verbs that print what checkpoint files hold: their output is escaped.
_READING_VERBS = ("inspect", "verify", "diff", "audit", "which", "order")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog=PROG,
      description="Inspect, verify and compare the data state that ckpt_iter "
      "writes into Orbax and Tunix checkpoints.",
      epilog="`ckpt-iter train grpo|ppo|sft CONFIG.yaml [key=value ...]` runs Tunix's "
      "YAML pipeline with the Resumable learners; `ckpt-iter train --help`. "
      "It needs Tunix (pip install 'ckpt_iter[tunix]'). The preempt-and-resume "
      "demo runs from a clone of the repository: `make demo`. "
      f"Documentation: {_urls.DOCS_URL}",
  )
  from ckpt_iter import __version__  # pylint: disable=g-import-not-at-top

  parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
  verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")
  _add_inspect(verbs)
  _add_verify(verbs)
  _add_diff(verbs)
  _add_audit(verbs)
  _add_which(verbs)
  _add_order(verbs)
  _add_index(verbs)
  return parser


def _add_inspect(verbs: Any) -> None:
  summary = "show each process's data state of a step (default: the latest)"
  parser = verbs.add_parser("inspect", help=summary, description=summary + ".",
                            epilog="exit codes: 0 shown, 1 a state file is unreadable, 2 usage error")
  _add_checkpoint_argument(parser)
  parser.add_argument("--step", type=_step_number, help="step to show (default: latest)")
  _add_item_argument(parser)
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  parser.set_defaults(run=run_inspect)


def _add_verify(verbs: Any) -> None:
  summary = "check every step (or one): exit 0 if sound, 1 with one line per problem"
  parser = verbs.add_parser("verify", help=summary, description=summary + ".",
                            epilog="exit codes: 0 sound, 1 problems (one line each), 2 usage error, 4 nothing checked "
                            "(every step asked for was deleted while being read, e.g. by max_to_keep)")
  _add_checkpoint_argument(parser)
  parser.add_argument("--step", type=_step_number, help="check only this step")
  _add_item_argument(parser)
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  parser.set_defaults(run=run_verify)


def _add_diff(verbs: Any) -> None:
  summary = "compare the data states of two steps, or of two checkpoints"
  parser = verbs.add_parser(
      "diff", help=summary,
      usage="%(prog)s [-h] [--item ITEM] [--json] CKPT_DIR [CKPT_DIR_B] [STEP_A STEP_B]\n"
      "       %(prog)s [-h] [--item ITEM] [--json] CKPT_DIR [CKPT_DIR_B] --step STEP_A --step STEP_B",
      description=summary + ": `diff DIR A B` (or `diff DIR --step A --step B`), `diff DIR_A DIR_B` "
      "(latest steps) or `diff DIR_A DIR_B A B` (or with --step A --step B).",
      epilog="exit codes: 0 compared (whether or not they differ), 1 a state file is unreadable, 2 usage error, "
      "4 a step asked for was deleted while being read (e.g. by max_to_keep)",
  )
  parser.add_argument("checkpoints", nargs="+", metavar="CKPT_DIR",
                      help="one checkpoint (with two steps) or two, then optionally the two steps")
  parser.add_argument("--step", type=_step_number, action="append", default=[],
                      help="a step to compare; give it twice (once per side)")
  _add_item_argument(parser)
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  parser.set_defaults(run=run_diff)


def _add_audit(verbs: Any) -> None:
  summary = "prove from the kept steps that every resume continued exactly where its step stopped"
  parser = verbs.add_parser(
      "audit", help=summary, description=f"{summary} ({_urls.doc_url('prove_your_run.md')}).",
      epilog="exit codes: 0 an unbroken chain (every resume the kept states record proven), "
      "1 a break (one line each), 2 usage error (or --plot without matplotlib), 3 not proven "
      "(nothing broken, but a resume before the earliest kept step, from a step not kept, or "
      "a step without a data state), 4 nothing to prove (no data state in the kept steps)",
  )
  _add_checkpoint_argument(parser)
  _add_item_argument(parser)
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  parser.add_argument("--plot", metavar="FILE.png",
                      help="also draw the timeline (needs matplotlib: pip install 'ckpt_iter[plot]')")
  parser.set_defaults(run=run_audit)


def _add_which(verbs: Any) -> None:
  summary = "which source records a step's last batch, or a global batch of the run, held"
  parser = verbs.add_parser(
      "which", help=summary,
      description=summary + f" ({_urls.doc_url('data_map.md')}). From the checkpoint alone for a "
      "make_dataset pipeline whose position counts stream records; elsewhere it names "
      "ckpt_iter.which(pipeline, state).",
      epilog="exit codes: 0 answered, 1 not answerable from the checkpoint (the message says why and what "
      "answers instead: a step not kept, a pipeline whose rows user code computes), 2 usage error, 4 the step "
      "asked for was deleted while being read (e.g. by max_to_keep)")
  _add_checkpoint_argument(parser)
  where = parser.add_mutually_exclusive_group(required=True)
  where.add_argument("--step", type=_step_number, help="the last batch read before this checkpoint was saved")
  where.add_argument("--batch", type=_step_number, help="global batch K of the run (from 0), across its resumes")
  _add_item_argument(parser)
  parser.add_argument("--process", type=_step_number, default=0,
                      help="read this process's states (default 0; every process's batches are the same)")
  parser.add_argument("--source", action="append", default=[], metavar="PATH|NAME=PATH",
                      help="the source files the run read (checked against its fingerprint): "
                      "adds each record's file and line or row")
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  parser.set_defaults(run=run_which)


def _add_order(verbs: Any) -> None:
  summary = "write the run's data order: every global batch's source records, in order"
  parser = verbs.add_parser(
      "order", help=summary, description=summary + " (JSONL, or Parquet when FILE ends in .parquet; streamed, "
      "O(1) memory in the run's length; FILE may be gs://...).",
      epilog="exit codes: 0 written, 1 not answerable from the checkpoint, 2 usage error, 4 the steps it needs "
      "were deleted while being read, 3 times over (e.g. by max_to_keep)")
  _add_checkpoint_argument(parser)
  parser.add_argument("--out", required=True, metavar="FILE", help="where to write (.jsonl or .parquet)")
  parser.add_argument("--from", dest="start", type=_step_number, default=0, metavar="K",
                      help="first global batch to write (default 0)")
  parser.add_argument("--limit", type=_step_number, metavar="N", help="write at most N batches")
  _add_item_argument(parser)
  parser.add_argument("--process", type=_step_number, default=0, help="read this process's states (default 0)")
  parser.set_defaults(run=run_order)


def _add_index(verbs: Any) -> None:
  summary = "count a corpus's records once and write its index object beside the files"
  parser = verbs.add_parser(
      "index", help=summary, description=summary + " (ckpt_iter_index.json in each directory: every file's "
      "size, version and records, and a Parquet file's row groups). A cached JsonlSource then takes the counts "
      "from it instead of downloading every file to count it, a cached ParquetSource or ArrayRecordSource "
      "instead of reading every footer; a file changed since is refused by name.",
      epilog="exit codes: 0 written, 1 a file cannot be read or indexed, 2 usage error")
  parser.add_argument("paths", nargs="+", metavar="PATH",
                      help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or ArrayRecord files, globs or gs:// "
                      "URLs, as the sources take them; a directory: every such file in it")
  parser.add_argument("--cache", metavar="DIR",
                      help="the shard cache to count through (default: a temporary directory, removed after)")
  parser.add_argument("--max-bytes", type=_step_number, default=None, metavar="N",
                      help="the cache's limit in bytes (default 64 GiB); counts outlive evicted copies")
  parser.set_defaults(run=run_index)


def _add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "checkpoint", metavar="CKPT_DIR",
      help="a Tunix checkpoint root (holding actor/), its actor/ directory, or an Orbax root",
  )


def _add_item_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--item", help=f"item holding the data state (default: the only one, else {inspection.DEFAULT_ITEM!r})"
  )


def _step_number(text: str) -> int:
  if not _is_step(text):
    raise argparse.ArgumentTypeError(f"step must be a non-negative integer, got {text!r}")
  return int(text)


def _fail(message: str, code: int) -> int:
  print(f"{PROG}: {message}", file=sys.stderr)
  return code



# ---------------------------------------------------------------------------
# index


def run_index(args: argparse.Namespace) -> int:
  import tempfile  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _compression  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _corpus_index  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _shard_cache  # pylint: disable=g-import-not-at-top
  from ckpt_iter import sources  # pylint: disable=g-import-not-at-top  (Grain only when indexing)

  paths = []
  for path in args.paths:
    files = _corpus_index.files_in(path)
    if files == []:
      return _fail(f"{path}: a directory holding no file an index covers ({', '.join(_corpus_index.INDEXED_SUFFIXES)})",
                   EXIT_PROBLEMS)
    paths.extend(files or [path])
  by_kind: dict[str, list[str]] = {}
  for path in paths:
    by_kind.setdefault(_compression.plain_suffix(path), []).append(path)
  readers = sources.SOURCE_BY_SUFFIX
  unknown = sorted(set(by_kind) - set(readers))
  if unknown:
    return _fail(f"{by_kind[unknown[0]][0]}: not a file an index covers ({', '.join(_corpus_index.INDEXED_SUFFIXES)})",
                 EXIT_USAGE)
  indexed_paths, identities, counts, row_groups = [], [], [], []
  with tempfile.TemporaryDirectory(prefix="ckpt-iter-index-") as scratch:
    cache = sources.ShardCache(args.cache or scratch, args.max_bytes or _shard_cache.DEFAULT_MAX_BYTES)
    for suffix, kind_paths in sorted(by_kind.items()):
      # Counted from the files themselves (never from an index already there), by each source's own count.
      source = readers[suffix](kind_paths if len(kind_paths) > 1 else kind_paths[0], cache=cache, corpus_index=False)
      offsets = source.file_offsets()
      indexed_paths += source.paths
      identities += source.identities()
      counts += [b - a for a, b in zip(offsets, offsets[1:])]
      row_groups += source.row_groups() if suffix == ".parquet" else [None] * len(source.paths)
    written = _corpus_index.write(indexed_paths, identities, counts, row_groups)
  print(f"indexed {len(counts):,} files, {sum(counts):,} records: wrote {', '.join(written)}")
  return EXIT_OK


# ---------------------------------------------------------------------------
# inspect


def run_inspect(args: argparse.Namespace) -> int:
  layout = inspection.find_layout(args.checkpoint, args.item, step=args.step)
  step = layout.choose_step(args.step)
  processes = inspection.read_summaries(layout, step)
  if args.json:
    print(json.dumps(_inspect_json(layout, step, processes), indent=1))
  else:
    print("\n".join(_text.render_inspect(layout, step, processes)))
  failed = [p for p in processes if p.error is not None]
  for process in failed:
    print(f"{PROG}: {process.error}", file=sys.stderr)
  return EXIT_PROBLEMS if failed else EXIT_OK


def _inspect_json(layout: inspection.Layout, step: int, processes: list[inspection.ProcessState]) -> dict[str, Any]:
  return {
      "checkpoint": layout.root,
      "step": step,
      "steps": list(layout.steps),
      "item": layout.item,
      "processes": [_process_json(p) for p in processes],
  }


def _process_json(process: inspection.ProcessState) -> dict[str, Any]:
  value = {
      "process_index": process.process_index,
      "process_count": process.process_count,
      "file": process.path,
  }
  if process.error is not None:
    value["error"] = process.error
  else:
    value.update(process.summary)
  return value




# ---------------------------------------------------------------------------
# verify


def run_verify(args: argparse.Namespace) -> int:
  layout = inspection.find_layout(args.checkpoint, args.item, step=args.step)
  listed = list(layout.steps) if args.step is None else [layout.choose_step(args.step)]
  checks = [verification.verify_step(layout, step) for step in listed]
  removed = [check.step for check in checks if check.removed]
  steps = [check.step for check in checks if not check.removed]
  problems = [problem for check in checks for problem in check.problems]
  files = sum(check.files_read for check in checks)
  arrays = sum(check.arrays_read for check in checks)
  code = EXIT_PROBLEMS if problems else EXIT_NOTHING if not steps else EXIT_OK
  if args.json:
    print(json.dumps({
        "checkpoint": layout.root, "item": layout.item, "steps": steps, "ok": code == EXIT_OK,
        "removed_while_reading": removed, "state_files": files, "pending_arrays": arrays,
        "problems": [{"step": p.step, "path": p.path, "message": p.message} for p in problems],
    }, indent=1))
    return code
  for problem in problems:
    print(problem.line())
  gone = (f"; {_text.plural(len(removed), 'step')} ({inspection.format_steps(removed)}) removed while reading "
          "(deleted by the writer's retention, e.g. Orbax's max_to_keep), not checked") if removed else ""
  if problems:
    print(f"{PROG}: {_text.plural(len(problems), 'problem')} in {layout.root}{gone}", file=sys.stderr)
  elif not steps:
    print(f"{PROG}: nothing checked in {layout.root}: {_text.plural(len(removed), 'step')} "
          f"({inspection.format_steps(removed)}) removed while reading (deleted by the writer's retention, "
          "e.g. Orbax's max_to_keep); verify the steps kept now", file=sys.stderr)
  else:
    print(
        f"ok: {layout.root}: {_text.plural(len(steps), 'step')} ({inspection.format_steps(steps)}), "
        f"item {layout.item!r}, {_text.plural(files, 'state file')}, "
        f"{_text.plural(arrays, 'pending array')} checked{gone}"
    )
  return code


# ---------------------------------------------------------------------------
# audit


def run_audit(args: argparse.Namespace) -> int:
  layout = inspection.find_layout(args.checkpoint, args.item, require_state=False)
  report = auditing.audit(layout)
  if args.plot:
    from ckpt_iter.cli import _plot  # pylint: disable=g-import-not-at-top  (matplotlib, optional)

    try:
      _plot.timeline(report, args.plot)
    except _plot.MissingMatplotlib as e:
      return _fail(str(e), EXIT_USAGE)
  if args.json:
    print(json.dumps(auditing.report_json(report), indent=1))
  else:
    for line in auditing.report_lines(report):
      print(line)
    if args.plot:
      print(f"timeline: {args.plot}")
  return {
      auditing.OK: EXIT_OK, auditing.BROKEN: EXIT_PROBLEMS,
      auditing.UNPROVEN: EXIT_UNPROVEN, auditing.NOTHING: EXIT_NOTHING,
  }[report.verdict]


# ---------------------------------------------------------------------------
# which, order


def run_which(args: argparse.Namespace) -> int:
  from ckpt_iter.cli import _which  # pylint: disable=g-import-not-at-top  (Grain's shuffle, loaded when asked)

  def attempt() -> tuple[Any, Any]:
    layout = inspection.find_layout(args.checkpoint, args.item)
    states = _which.States(layout, args.process)
    named = [] if args.step is None else [layout.choose_step(args.step)]

    def answer() -> tuple[Any, Any]:
      if args.step is not None:
        found = _which.which_step(layout, named[0], args.process, states)
      else:
        found = _which.which_batch(layout, args.batch, args.process, states)
      files = None
      if args.source:
        fingerprint = states[found.step if found.step is not None else layout.steps[-1]].innermost.fingerprint
        files = _which.SourceFiles(args.source, fingerprint)
      return found, files

    return _read_or_gone(layout, lambda: states.asked, answer, named)

  answer, files = _retrying(attempt)
  if args.json:
    print(json.dumps(_which.answer_json(answer, files)))  # one line per answer: JSONL, as docs/data_map.md shows
  else:
    print("\n".join(_which.answer_lines(answer, files)))
  return EXIT_OK


def run_order(args: argparse.Namespace) -> int:
  from ckpt_iter.cli import _which  # pylint: disable=g-import-not-at-top

  def attempt() -> int:
    layout = inspection.find_layout(args.checkpoint, args.item)
    states = _which.States(layout, args.process)
    return _read_or_gone(layout, lambda: states.asked, lambda: _which.write_order(
        layout, args.out, process_index=args.process, start=args.start, limit=args.limit, states=states))

  written = _retrying(attempt)
  print(f"{args.out}: {_text.plural(written, 'global batch', 'global batches')} from batch {args.start}")
  return EXIT_OK


# ---------------------------------------------------------------------------
# Steps a writer's retention deletes while which, order or diff reads them.

# A verb that reads from the latest step lists the root again at most this many times.
READ_ATTEMPTS = 3
_GONE = "deleted while being read (by the writer's retention, e.g. Orbax's max_to_keep)"


class _StepsRemoved(Exception):
  """Steps of `layout` a verb read were deleted meanwhile (not damaged: deleted); listing again answers."""

  def __init__(self, layout: inspection.Layout, steps: list[int]):
    super().__init__(steps)
    self.layout, self.steps = layout, steps


class _NothingToAnswer(Exception):
  """The step the user asked about was deleted while it was read: exit 4 with this message."""


def _read_or_gone(layout: inspection.Layout, asked: Any, read: Any, named: Sequence[int] = ()) -> Any:
  """`read()`; when it fails and a step it read (`asked()`) was deleted meanwhile: `_NothingToAnswer`
  when the user named that step (`named`), else `_StepsRemoved` (the caller lists the root again).

  A step that stays but lost its files is damaged: the error stands (`inspection.removed_while_read`).
  """
  try:
    return read()
  except (errors.CkptIterError, OSError, inspection.UsageError) as e:
    gone = [step for step in sorted(set(asked()) | set(named)) if inspection.removed_while_read(layout, step)]
    if [step for step in gone if step in named]:
      raise _NothingToAnswer(_gone_text(layout, [step for step in gone if step in named])) from None
    if gone:
      raise _StepsRemoved(layout, gone) from e
    raise


def _retrying(attempt: Any) -> Any:
  """`attempt()`, again over a fresh listing when a step it read was deleted meanwhile
  (at most READ_ATTEMPTS times; then `_NothingToAnswer`)."""
  for number in range(READ_ATTEMPTS):
    try:
      return attempt()
    except _StepsRemoved as e:
      if number == READ_ATTEMPTS - 1:
        raise _NothingToAnswer(_gone_text(e.layout, e.steps, attempts=READ_ATTEMPTS)) from None
  raise AssertionError("unreachable")


def _gone_text(layout: inspection.Layout, steps: list[int], attempts: int = 1) -> str:
  try:
    kept = inspection.format_steps(list(inspection.step_directories(layout.root))) or "none"
  except (errors.CkptIterError, OSError):
    kept = "unknown"
  what = f"step {steps[0]} of {layout.root} was" if len(steps) == 1 else (
      f"steps {inspection.format_steps(steps)} of {layout.root} were")
  again = f" on each of {attempts} attempts" if attempts > 1 else ""
  return f"{what} {_GONE}{again}; ask about a step kept now (steps: {kept})."


# ---------------------------------------------------------------------------
# diff


def run_diff(args: argparse.Namespace) -> int:
  sides = [(layout, step, _read_or_gone(layout, lambda: (), lambda: inspection.read_summaries(layout, step), [step]))
           for layout, step in _diff_sides(args)]
  for layout, step, processes in sides:  # a header deleted under the read is no damage
    if any(p.error is not None for p in processes) and inspection.removed_while_read(layout, step):
      raise _NothingToAnswer(_gone_text(layout, [step]))
  failed = [p for _, _, processes in sides for p in processes if p.error is not None]
  for process in failed:
    print(f"{PROG}: {process.error}", file=sys.stderr)
  if failed:
    return EXIT_PROBLEMS
  (layout_a, step_a, a), (layout_b, step_b, b) = sides
  pairs = _process_pairs(a, b)
  if args.json:
    print(json.dumps({
        "a": {"checkpoint": layout_a.root, "step": step_a, "item": layout_a.item},
        "b": {"checkpoint": layout_b.root, "step": step_b, "item": layout_b.item},
        "process_count": [a[0].process_count, b[0].process_count],
        "processes": [
            {"process_index": index, **inspection.diff_summaries(x, y)} for index, x, y in pairs
        ],
    }, indent=1))
    return EXIT_OK
  lines = _text.aligned([
      ("a", f"{layout_a.root} step {step_a} (item {layout_a.item})"),
      ("b", f"{layout_b.root} step {step_b} (item {layout_b.item})"),
  ])
  if a[0].process_count != b[0].process_count:
    lines.append(f"process count {a[0].process_count} -> {b[0].process_count}: "
                 "comparing the processes present in both")
  for index, x, y in pairs:
    lines.append("")
    lines.append(f"process {index}")
    lines.extend(_text.aligned(_text.diff_rows(x, y), indent=2))
  print("\n".join(lines))
  return EXIT_OK


def _diff_sides(args: argparse.Namespace) -> list[tuple[inspection.Layout, int]]:
  paths, steps = _positional_steps(args.checkpoints, args.step)
  if len(paths) == 1 and len(steps) == 2:
    layout = inspection.find_layout(paths[0], args.item)
    return [(layout, layout.choose_step(steps[0])), (layout, layout.choose_step(steps[1]))]
  if len(paths) == 2 and len(steps) in (0, 2):
    layouts = [inspection.find_layout(path, args.item) for path in paths]
    chosen = steps or [None, None]
    return [(layout, layout.choose_step(step)) for layout, step in zip(layouts, chosen)]
  raise inspection.UsageError(
      f"diff compares two states: give one CKPT_DIR and two steps (`diff DIR 8 12` or "
      f"--step twice), or two CKPT_DIRs (with two steps or none); got {len(paths)} "
      f"director{'y' if len(paths) == 1 else 'ies'} and {len(steps)} step{'' if len(steps) == 1 else 's'}."
  )


def _positional_steps(arguments: list[str], flag_steps: list[int]) -> tuple[list[str], list[int]]:
  """(directories, steps) of `diff DIR A B` / `diff DIR_A DIR_B A B`: two trailing step numbers.

  Only after one or two directories: `diff 8 12` is two directories (which
  may be named like steps), `diff DIR 8 12` one directory and two steps.
  """
  if len(arguments) not in (3, 4) or not all(_is_step(text) for text in arguments[-2:]):
    return arguments, flag_steps
  if flag_steps:
    raise inspection.UsageError(
        f"diff got the steps {arguments[-2]} and {arguments[-1]} after the directories and "
        f"--step {' --step '.join(map(str, flag_steps))} as well; give the two steps one way."
    )
  return arguments[:-2], [_step_number(text) for text in arguments[-2:]]


def _is_step(text: str) -> bool:
  return text.isascii() and text.isdigit()


def _process_pairs(
    a: list[inspection.ProcessState], b: list[inspection.ProcessState]
) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
  """(process index, summary in a, summary in b) for indices in both."""
  by_index = {p.process_index: p.summary for p in b}
  return [(p.process_index, p.summary, by_index[p.process_index]) for p in a if p.process_index in by_index]




