"""`ckpt-iter order` on a real pseudo-terminal: its progress bar redraws in place (issue 58 item 1).

The reading verbs escape what they print (a crafted state cannot rewrite the screen); the bar's own
carriage returns were escaped with it and showed as literal `\\r` text on one growing line. A run of
30,000 batches takes long enough to draw the bar several times.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import orbax.checkpoint as ocp

import ckpt_iter

_BATCHES = 30_000


def test_the_progress_bar_redraws_in_place_on_a_terminal(tmp_path):
  root = str(tmp_path / "run")
  iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset([{"id": i} for i in range(_BATCHES)], batch_size=1,
                                                           seed=None, num_epochs=1))
  for _ in range(_BATCHES):
    next(iterator)
  with ocp.CheckpointManager(root, item_names=("data",)) as manager:
    manager.save(_BATCHES, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))
    manager.wait_until_finished()
  leader, follower = pty.openpty()
  process = subprocess.Popen([sys.executable, "-m", "ckpt_iter", "order", root, "--out", str(tmp_path / "o.jsonl")],
                             stdin=follower, stdout=follower, stderr=follower, close_fds=True)
  os.close(follower)
  screen = b""
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    ready, _, _ = select.select([leader], [], [], 1.0)
    if ready:
      try:
        chunk = os.read(leader, 65536)
      except OSError:  # the follower side closed: the process is done
        break
      if not chunk:
        break
      screen += chunk
    elif process.poll() is not None:
      break
  process.wait(60)
  os.close(leader)
  assert process.returncode == 0, screen[-2000:]
  text = screen.decode("utf-8", "replace")
  assert "\\r" not in text and "\\x1b" not in text, text[-2000:]  # nothing of the bar escaped
  # Redrawn in place, more than once (a terminal turns every newline into "\r\n": those do not count).
  assert len(re.findall("\r(?!\n)", text)) >= 2, text[-2000:]
  assert f"{_BATCHES}/{_BATCHES}" in text, text[-2000:]
  assert len(open(tmp_path / "o.jsonl").read().splitlines()) == _BATCHES
