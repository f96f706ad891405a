"""`ckpt-iter` and `python -m ckpt_iter`: the command line.

`train` runs Tunix's YAML pipelines with the Resumable learners
(`ckpt_iter.tunix.cli`); every other verb belongs to `ckpt_iter.cli` (which
only reads checkpoints). Dispatching here keeps the cli free of Tunix. The
preempt-and-resume demo is not part of the installed package: `make demo` in a
clone of the repository.
"""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line `argv` (default: sys.argv[1:]); returns the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["demo"]:
    print("ckpt-iter: the demo is not part of the installed package (the wheel holds the library); "
          "run it from a clone of the repository: `make demo`, or `python -m demo --help`.", file=sys.stderr)
    return 2
  if argv[:1] == ["train"] and not _has_tunix():
    print("ckpt-iter: `train` runs Tunix, which is not installed: pip install 'ckpt_iter[tunix]'",
          file=sys.stderr)
    return 2
  if argv[:1] == ["train"]:
    from ckpt_iter.tunix import cli as tunix_cli  # pylint: disable=g-import-not-at-top

    return tunix_cli.main(argv[1:], prog="ckpt-iter train")
  from ckpt_iter import cli  # pylint: disable=g-import-not-at-top

  return cli.main(argv)


def _has_tunix() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top

  return importlib.util.find_spec("tunix") is not None


if __name__ == "__main__":
  sys.exit(main())
