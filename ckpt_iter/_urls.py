"""Where the documentation and the source live: the one place that says so.

The documentation is the docs/ folder of the source repository as GitHub
shows it (docs/README.md is its contents page, each page renders at its own
address); `make docs` builds the same pages, with the API reference from the
docstrings, into site/. The command line's help derives its pointers from
here. README.md's links, pyproject.toml's [project.urls] and the docstrings of
the public API hold these addresses as text, and tests/unit/test_doc_links.py
checks every one against this module and against the files it names: moving
the documentation is an edit here, then the literal addresses that test lists.
"""

REPOSITORY_URL = "https://github.com/ckpt-iter/ckpt_iter"
# The docs folder (with docs/README.md, the contents, shown below its listing).
DOCS_URL = REPOSITORY_URL + "/tree/main/docs"
# A page of the docs folder is this followed by its file name (and #anchor).
DOC_PAGE_URL = REPOSITORY_URL + "/blob/main/docs/"


def doc_url(page: str, anchor: str = "") -> str:
  """The address of docs/`page` (e.g. "guarantees.md"), at heading `anchor` if given."""
  return DOC_PAGE_URL + page + (f"#{anchor}" if anchor else "")
