"""One toy agentic GRPO training process: stock or Resumable, killable after checkpoint K.

    python tunix_agentic_worker.py --root DIR --out OUT.npz --learner resumable|stock
        [--max-steps M] [--mu MU] [--micro M] [--preempt-after K]

The run itself lives in the package (`ckpt_iter.demo.agentic_toyrun`), where
`ckpt-iter demo --learner agentic` runs it too; this script keeps the tests'
command line. It exits with PREEMPT_EXIT_CODE when killed after checkpoint K.
"""

import os
import sys

from ckpt_iter.demo.agentic_toyrun import PREEMPT_EXIT_CODE, main  # noqa: F401  # pylint: disable=unused-import

if __name__ == "__main__":
  code = main()
  # The run's record is on disk. Skip interpreter teardown: Tunix's agentic
  # learner leaves a daemon event-loop thread and its executor running, and
  # a teardown racing them can die of a signal (CI once saw -11 here).
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access
