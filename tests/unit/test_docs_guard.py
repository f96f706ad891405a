"""The docs stay true to the code: tables render, named verbs and state fields exist.

What this guards (issue 50: pages that still described 0.1 after 0.2.0):

- every Markdown table in README.md and docs/*.md is well formed: each row
  has as many cells as its header, a table starts after a blank line, and no
  `| ... |` line stands outside a table (a paragraph inside a table ends it,
  and the rows after it render as literal text; the strict build does not
  see it);
- every `ckpt-iter VERB` a page names is a verb the command has (from its
  argparse parser and `__main__`'s dispatch), and a page that lists the verbs
  (three or more) lists every reading verb;
- a make_dataset position is `{"next_record": R}` since format 4: a block
  (paragraph, table row or code block) that gives a position as Grain's
  `next_index` must say whose it is (a hand-built, MapDataset, IterDataset
  or Grain pipeline's, or the format history), and one about make_dataset
  must say `next_record` (or stream record) too, unless it is read through
  an IterDataset (`mp_prefetch`), which keeps Grain's state;
- an elastic restore of a make_dataset pipeline may change the global batch:
  a page or public docstring that says it must stay the same is stale
  (Grain's ElasticIterator, which does need it, may say so);
- a "reads versions 0..N" message quotes this release's newest format;
- no prose line is on a page twice (cli.md held a merge's both sides).

The verbs, the position key, Grain's key and the format version come from the
code; the few deliberate exceptions are in `_ALLOWED`, each with its reason.
The table-driven tests at the end feed the checker the old (0.1) sentences
issue 50 found and check that each is caught.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import pathlib
import re

import grain
import pytest

import ckpt_iter
from ckpt_iter import __main__ as main_module
from ckpt_iter import _records
from ckpt_iter import cli
from ckpt_iter import state as state_lib

_REPO = pathlib.Path(__file__).resolve().parents[2]
_PAGES = [_REPO / "README.md", *sorted((_REPO / "docs").glob("*.md"))]

# (page, what the finding names): deliberate mentions the rules would flag.
_ALLOWED = {
    ("docs/cli.md", "demo"):
        "`ckpt-iter demo` is refused by name (__main__.py: exit 2, it says where the demo is); the page says so",
    ("docs/architecture.md", "verb list"):
        "the cli/ package's verbs interleaved with their modules: `| which | order` follow the parenthesis",
}


# ---------------------------------------------------------------------------
# What the code says.


def _parser_verbs() -> set[str]:
  """The verbs of `ckpt-iter`'s reading command line (its argparse subparsers)."""
  parser = cli.build_parser()
  (subparsers,) = [a for a in parser._actions if a.dest == "verb"]  # pylint: disable=protected-access
  return set(subparsers.choices)


def _dispatched_verbs() -> tuple[set[str], set[str]]:
  """(run, refused): the verbs `__main__.main` dispatches itself (`argv[:1] == ["train"]`).

  A branch whose body only prints and returns 2 refuses the verb (the demo,
  which is not in the wheel); any other runs it.
  """
  run, refused = set(), set()
  tree = ast.parse(inspect.getsource(main_module.main))
  for node in ast.walk(tree):
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
      continue
    right = node.test.comparators[0]
    if not (isinstance(right, ast.List) and len(right.elts) == 1 and isinstance(right.elts[0], ast.Constant)):
      continue
    verb = right.elts[0].value
    returns = [n for n in node.body if isinstance(n, ast.Return)]
    refuses = bool(returns) and all(isinstance(r.value, ast.Constant) and r.value.value == 2 for r in returns)
    (refused if refuses else run).add(verb)
  return run, refused - run


READING_VERBS = _parser_verbs()
_RUN, REFUSED_VERBS = _dispatched_verbs()
VERBS = READING_VERBS | _RUN
# make_dataset's position key (format 4) and Grain's own MapDataset key, which it was before.
NEXT_RECORD = _records.NEXT_RECORD
GRAIN_KEYS = frozenset(iter(grain.MapDataset.range(2)).get_state())


# ---------------------------------------------------------------------------
# Reading a page.


@dataclasses.dataclass(frozen=True)
class Block:
  line: int  # 1-based, of the block's first line
  text: str
  kind: str  # "paragraph", "row", "code"


def blocks(markdown: str) -> list[Block]:
  """Paragraphs (blank-line separated), table rows and fenced code blocks, in order."""
  result, lines, current, start, fence = [], markdown.splitlines(), [], 0, None
  def flush():
    if current:
      result.append(Block(start + 1, "\n".join(current), "paragraph"))
    current.clear()
  code: list[str] = []
  for index, line in enumerate(lines):
    if fence is not None:
      if line.startswith(fence):
        result.append(Block(start + 1, "\n".join(code), "code"))
        fence = None
      else:
        code.append(line)
      continue
    if line.startswith("```"):
      flush()
      fence, code, start = line[:3], [], index
    elif not line.strip():
      flush()
    elif line.lstrip().startswith("|"):
      flush()
      result.append(Block(index + 1, line, "row"))
    else:
      if not current:
        start = index
      current.append(line)
  flush()
  return result


def _cells(row: str) -> list[str]:
  """The cells of a table row: `|` splits outside code spans and unless escaped (`\\|`)."""
  cells, cell, in_code, escaped = [], "", False, False
  row = row.strip()
  row = row[1:] if row.startswith("|") else row
  row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
  for char in row:
    if escaped:
      cell, escaped = cell + char, False
    elif char == "\\":
      cell, escaped = cell + char, True
    elif char == "`":
      cell, in_code = cell + char, not in_code
    elif char == "|" and not in_code:
      cells.append(cell)
      cell = ""
    else:
      cell += char
  return cells + [cell]


_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def table_problems(markdown: str) -> list[str]:
  """Where the page's tables would not render as tables."""
  problems, lines, fence = [], markdown.splitlines(), False
  index = 0
  while index < len(lines):
    line = lines[index]
    if line.startswith("```"):
      fence = not fence
    if fence or not line.lstrip().startswith("|"):
      index += 1
      continue
    if index + 1 >= len(lines) or not _SEPARATOR.match(lines[index + 1]):
      problems.append(f"line {index + 1}: a `|` row outside a table (no header and separator above it, "
                      f"or a paragraph inside the table): {line[:80]!r}")
      index += 1
      continue
    if index > 0 and lines[index - 1].strip():
      problems.append(f"line {index + 1}: a table right after a paragraph line (needs a blank line before it)")
    width = len(_cells(line))
    if len(_cells(lines[index + 1])) != width:
      problems.append(f"line {index + 2}: the separator has {len(_cells(lines[index + 1]))} cells, the header {width}")
    index += 2
    while index < len(lines) and lines[index].lstrip().startswith("|"):
      if len(_cells(lines[index])) != width:
        problems.append(f"line {index + 1}: {len(_cells(lines[index]))} cells, the header has {width}: "
                        f"{lines[index][:80]!r}")
      index += 1
  return problems


# ---------------------------------------------------------------------------
# The rules on names.

# `ckpt-iter verb`, ckpt-iter `verb`, and lists: `ckpt-iter a | b | c`.
_VERB_MENTION = re.compile(r"ckpt-iter (?:`([a-z][a-z-]*)`|([a-z][a-z-]*)((?: \| [a-z]+)*))")
_GRAIN_KEY = re.compile(r"(?<![\w])(" + "|".join(sorted(GRAIN_KEYS)) + r")(?![\w])|next index")
# A make_dataset position: the pipeline named, or its batch change as the restore logs it (only a
# make_dataset fingerprint has global_batch_size, hence "(global A -> B)").
_ABOUT_MAKE_DATASET = re.compile(r"make_dataset|\(global \d+ -> \d+\)")
_SAYS_NEW_POSITION = re.compile(re.escape(NEXT_RECORD) + r"|stream record|hand-built|formats? [0-3]\b")
# What says a Grain key is a Grain pipeline's position: its kind. (make_dataset read through
# `to_iter_dataset`/`mp_prefetch` keeps Grain's IterDataset state.)
_GRAIN_KIND = re.compile(r"MapDataset|IterDataset|Grain|grain\.|mp_prefetch")
_SAME_GLOBAL_BATCH = re.compile(r"same global batch|global batch size must (?:be|stay) the same", re.I)
_ABOUT_ELASTIC = re.compile(r"elastic|another process count", re.I)
_VERSIONS = re.compile(r"reads versions 0\.\.(\d+)")


def name_problems(page: str, markdown: str) -> list[str]:
  """Verbs, position keys and claims of `markdown` (the page `page`) the code contradicts."""
  problems = []
  for block in blocks(markdown):
    text = block.text
    for match in _VERB_MENTION.finditer(text):
      verb, rest = match.group(1) or match.group(2), match.group(3) or ""
      named = [verb] + [v for v in rest.split(" | ") if v]
      for name in named:
        if name not in VERBS and (page, name) not in _ALLOWED:
          problems.append(f"{page}:{block.line}: `ckpt-iter {name}`: no such verb (the command has "
                          f"{sorted(VERBS)}{'; ' + name + ' is refused' if name in REFUSED_VERBS else ''})")
      if len(named) >= 3 and not READING_VERBS <= set(named) and (page, "verb list") not in _ALLOWED:
        problems.append(f"{page}:{block.line}: the verb list `ckpt-iter {' | '.join(named)}` leaves out "
                        f"{sorted(READING_VERBS - set(named))}")
    grain_key = _GRAIN_KEY.search(text)
    about_make_dataset = _ABOUT_MAKE_DATASET.search(text) and not re.search(r"IterDataset|mp_prefetch", text)
    if grain_key and not _SAYS_NEW_POSITION.search(text) and (about_make_dataset or not _GRAIN_KIND.search(text)):
      problems.append(f"{page}:{block.line}: gives a position as Grain's {grain_key.group()!r} without saying "
                      f"whose: a make_dataset position is {{{NEXT_RECORD!r}: R}} since format 4 (name the "
                      f"pipeline kind, or {NEXT_RECORD!r} beside it): {text[:100]!r}")
    problems.extend(f"{page}:{block.line}: {p}" for p in claim_problems(text))
    for match in _VERSIONS.finditer(text):
      if int(match.group(1)) != state_lib.FORMAT_VERSION:
        problems.append(f"{page}:{block.line}: {match.group()!r}, but this release reads versions "
                        f"0..{state_lib.FORMAT_VERSION}")
  return problems


def claim_problems(text: str) -> list[str]:
  """A stale claim in one block or docstring: an elastic make_dataset restore needs the same global batch."""
  if (_SAME_GLOBAL_BATCH.search(text) and _ABOUT_ELASTIC.search(text) and "make_dataset" in text
      and "ElasticIterator" not in text):
    return [f"says an elastic make_dataset restore needs the same global batch ({_SAME_GLOBAL_BATCH.search(text).group()!r}); "
            "since format 4 the global batch may change (docs/changing_the_run.md)"]
  return []


def repeated_lines(markdown: str) -> list[str]:
  """Prose lines of 50 characters or more that a page holds twice: a merge that kept both sides."""
  counts = collections.Counter(
      line.strip() for block in blocks(markdown) if block.kind == "paragraph"
      for line in block.text.splitlines() if len(line.strip()) >= 50)
  return [line for line, count in counts.items() if count > 1]


# ---------------------------------------------------------------------------
# The pages as they are.


@pytest.mark.parametrize("path", _PAGES, ids=lambda p: str(p.relative_to(_REPO)))
def test_every_table_is_well_formed(path):
  assert table_problems(path.read_text()) == []


@pytest.mark.parametrize("path", _PAGES, ids=lambda p: str(p.relative_to(_REPO)))
def test_a_page_names_only_verbs_and_position_keys_the_code_has(path):
  assert name_problems(str(path.relative_to(_REPO)), path.read_text()) == []


@pytest.mark.parametrize("path", _PAGES, ids=lambda p: str(p.relative_to(_REPO)))
def test_no_prose_line_is_there_twice(path):
  assert repeated_lines(path.read_text()) == []


def rows_rendered_as_text(page_text: str) -> list[str]:
  """Table rows the site would show as literal `| ... |` text (Python-Markdown, as mkdocs renders)."""
  markdown = pytest.importorskip("markdown")  # with the docs extra (mkdocs)
  html = markdown.markdown(page_text, extensions=["tables", "fenced_code"])
  text = re.sub(r"<pre>.*?</pre>|<code>.*?</code>", "", html, flags=re.S)
  return [line for line in text.splitlines() if re.match(r"\s*(<p>)?\|.*\|\s*(</p>)?$", line)]


@pytest.mark.parametrize("path", _PAGES, ids=lambda p: str(p.relative_to(_REPO)))
def test_every_table_renders_as_a_table(path):
  assert rows_rendered_as_text(path.read_text()) == []


def test_public_docstrings_make_no_stale_claim():
  """The API reference is generated from them: the same claims are checked there."""
  problems = []
  for name in ckpt_iter.__all__:
    doc = inspect.getdoc(getattr(ckpt_iter, name)) or ""
    problems.extend(f"ckpt_iter.{name}: {p}" for p in claim_problems(doc))
  assert problems == []


def test_the_rules_read_the_code():
  """The verbs and keys the rules use come from the code; a change there shows here."""
  assert {"inspect", "verify", "diff", "audit", "which", "order"} <= READING_VERBS
  assert "train" in VERBS and "demo" in REFUSED_VERBS and "demo" not in VERBS
  assert NEXT_RECORD == "next_record" and GRAIN_KEYS == {"next_index"}
  for (page, _), reason in _ALLOWED.items():
    assert (_REPO / page).exists() and reason


# ---------------------------------------------------------------------------
# The checker catches what issue 50 found in the 0.1 text (excerpts of e9f37c0).

_OLD_TABLE = """\
| source | read how |
|---|---|
| list/tuple of records (dicts) | in memory |

Paths, globs and lists of paths may be local or `gs://` URLs:
JSONL and Parquet files are listed and read through fsspec (gcsfs).
| a Hugging Face `datasets.Dataset` | Arrow, memory-mapped |
| any object with `__len__` and `__getitem__` | as is |
"""


def test_the_checker_catches_a_paragraph_inside_a_table():
  problems = table_problems(_OLD_TABLE)
  assert len(problems) == 2 and all("outside a table" in p for p in problems), problems
  assert table_problems("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n") == [
      "line 3: 3 cells, the header has 2: '| 1 | 2 | 3 |'"]
  assert table_problems("text\n| a | b |\n|---|---|\n")[0].startswith("line 2: a table right after")
  assert table_problems("| `a \\| b` | c |\n|---|---|\n| `x|y` | z |\n") == []


def test_the_rendered_check_catches_a_paragraph_inside_a_table():
  assert len(rows_rendered_as_text(_OLD_TABLE)) == 2


@pytest.mark.parametrize("page, old", [
    # docs/guarantees.md: the position, the global batch, the INFO example.
    ("docs/guarantees.md", '| `make_dataset` (+ per-batch maps) | `{"next_index"}`, global | exact resume, O(1); '
     'same-stream changes above; another process count with `elastic=True` and the same global batch | any other field |'),
    ("docs/guarantees.md", "    INFO ckpt_iter: <item>: accepted stream change: batch_size 2 -> 4 (global 2 -> 4): "
     "epoch 0, row 8; resuming at next_index 2 (was 4)."),
    # docs/cli.md: the verify example and the inspect row.
    ("docs/cli.md", "```\nstep 2: .../actor/2/data/process_0-of-1.json: has format_version 2, but this ckpt_iter "
     "reads versions 0..1. ...\n```"),
    ("docs/cli.md", "| `inspect CKPT_DIR [--step N] [--item NAME] [--json]` | each process's data state of a step "
     "(default: latest): format version, kind, position (epoch and next index), shuffle key, pending repeats (count, "
     "schedule, bytes, types), counters, fingerprint | 0, 1 a state file is unreadable, 2 usage |"),
    # docs/README.md: a verb the wheel has not, and which/order left out.
    ("docs/README.md", "- [The command line](cli.md): `ckpt-iter demo | inspect | verify | diff | audit | train`"),
    # docs/prove_your_run.md.
    ("docs/prove_your_run.md", "| positions only move forward | the position (prompts consumed for a Tunix learner, "
     "items yielded for a RepeatIterator, `next_index` for a DataIterator) | elements trained again |"),
])
def test_the_checker_catches_the_old_text(page, old):
  assert name_problems(page, old), old


def test_the_checker_catches_the_old_cli_pages_second_json_paragraph():
  old = """`audit --json`: `verdict`, `steps` (those audited), `removed_while_reading`,
`points`, each state's `{step, process_index, kind, progress, resumes, pending, run}`).

**A live root.** A training job's Orbax `max_to_keep` deletes old steps while
command raised a false alarm; `tests/robustness/test_live_root.py`.
(the step's, and those its lineage resumed from) and load Grain's compiled shuffle by its file (no JAX).
`audit --json`: `verdict`, `steps` (those audited), `removed_while_reading`,
"""
  assert repeated_lines(old) == ["`audit --json`: `verdict`, `steps` (those audited), `removed_while_reading`,"]


def test_the_checker_catches_the_old_iterator_restore_docstring():
  old = """Orbax args that restore into an existing iterator, in place.

  Attributes:
    elastic: resume a make_dataset pipeline with another process count; the
      global batch size must be the same (see docs/multihost.md)."""
  assert claim_problems(inspect.cleandoc(old))
  assert not claim_problems("Grain's ElasticIterator resumes with another count at the same global batch size.")


def test_the_readme_states_the_sampled_digest_s_limit_as_the_guarantees_do():
  # issue 58 item 4: the README said a changed record is refused; a same-size edit of one record outside
  # the sample restores silently (docs/guarantees.md says so).
  readme = (_REPO / "README.md").read_text()
  guarantees = (_REPO / "docs" / "guarantees.md").read_text()
  assert "touches only records outside the sample is not detected" in guarantees
  assert "a\nsame-size edit of one record elsewhere restores silently" in readme or (
      "same-size edit of one record elsewhere restores silently" in " ".join(readme.split()))


def test_the_hardware_notes_say_what_bit_for_bit_needs_on_each_device():
  # issue 58 item 10: CPU, TPU v5e (measured: default XLA flags) and the H200 (deterministic ops).
  text = " ".join((_REPO / "docs" / "guarantees.md").read_text().split())
  assert "| TPU v5e | exact | with default XLA flags" in text
  assert "| GPU (H200) | exact | only with `XLA_FLAGS=--xla_gpu_deterministic_ops=true`" in text
