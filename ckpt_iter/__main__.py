"""`python -m ckpt_iter`: the ckpt-iter command line."""

import sys

from ckpt_iter import cli

if __name__ == "__main__":
  sys.exit(cli.main())
