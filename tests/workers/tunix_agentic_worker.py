"""One toy agentic GRPO training process: stock or Resumable, killable after checkpoint K.

    python tunix_agentic_worker.py --root DIR --out OUT.npz --learner resumable|stock
        [--max-steps M] [--mu MU] [--batch B] [--mini M] [--micro M] [--preempt-after K]
        [--max-concurrency C] [--async-rollout] [--slow-prompt TEXT]
        [--max-seq-token-per-tpu N] [--critic]

The demo's run (`demo.agentic_toyrun`) with the settings only the
tests vary. It exits with PREEMPT_EXIT_CODE when killed after checkpoint K.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from demo import agentic_toyrun
from demo.agentic_toyrun import PREEMPT_EXIT_CODE  # noqa: F401  # pylint: disable=unused-import


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = agentic_toyrun.parser()
  parser.add_argument("--max-concurrency", type=int, default=agentic_toyrun.MAX_CONCURRENCY,
                      help="agent/env pairs rolled out at once (GRPOConfig.max_concurrency)")
  parser.add_argument("--async-rollout", action="store_true",
                      help="rollout on its own mesh (needs 2 devices), weights synced per global step")
  parser.add_argument("--slow-prompt", default=None,
                      help="this prompt's rollouts wait until the first checkpoint save begins, "
                      "so they are in flight at it however slow the first update is; needs "
                      "--preempt-after and --async-rollout (with one shared model every fed "
                      "prompt is rolled out before the first update)")
  parser.add_argument("--max-seq-token-per-tpu", type=int, default=None,
                      help="sequence packing budget (the drop-in refuses it)")
  parser.add_argument("--critic", action="store_true",
                      help="a critic model in the cluster (the drop-in refuses it)")
  args = parser.parse_args(argv)
  if args.slow_prompt and not (args.preempt_after and args.async_rollout):
    parser.error("--slow-prompt needs --preempt-after and --async-rollout (its rollouts wait for that save)")
  return args


def extension(args: argparse.Namespace) -> agentic_toyrun.Extension:
  """The Tunix settings and hooks the options ask for."""
  save_began = threading.Event()

  def hold_the_slow_prompt(prompt: str) -> None:
    if args.slow_prompt in prompt:
      save_began.wait(timeout=600.0)

  training = {}
  if args.max_seq_token_per_tpu is not None:
    training["max_seq_token_per_tpu"] = args.max_seq_token_per_tpu
  return agentic_toyrun.Extension(
      training_options=training,
      algo_options={"max_concurrency": args.max_concurrency},
      async_rollout=args.async_rollout,
      critic=args.critic,
      on_rollout=hold_the_slow_prompt if args.slow_prompt else None,
      on_save=save_began.set if args.slow_prompt else None,
  )


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  agentic_toyrun.run(args, extension(args))
  return 0


if __name__ == "__main__":
  code = main()
  # The run's record is on disk. Skip interpreter teardown: Tunix's agentic
  # learner leaves a daemon event-loop thread and its executor running, and
  # a teardown racing them can die of a signal (CI once saw -11 here).
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access
