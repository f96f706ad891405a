"""The audit's picture (`ckpt-iter audit --plot`, `cli/_plot.py`), drawn in memory from real Orbax roots."""

import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckpt_iter
from ckpt_iter import cli


def _chain(root, *runs):
  """One process per run of steps (3 batches of 4 an epoch): restore the latest step, then train and save each."""
  records = [{"id": i} for i in range(12)]
  for steps in runs:
    iterator = ckpt_iter.DataIterator(ckpt_iter.make_dataset(records, batch_size=4, seed=1, num_epochs=3))
    with ocp.CheckpointManager(str(root), item_names=("data",)) as manager:
      if manager.latest_step() is not None:
        manager.restore(manager.latest_step(), args=ocp.args.Composite(data=ckpt_iter.IteratorRestore(iterator)))
      for step in steps:
        next(iterator)
        manager.save(step, args=ocp.args.Composite(data=ckpt_iter.IteratorSave(iterator)))


def test_plot_without_matplotlib_is_a_usage_error_naming_the_extra(tmp_path, capsys, monkeypatch):
  _chain(tmp_path, [1])
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  code = cli.main(["audit", str(tmp_path), "--plot", str(tmp_path / "t.png")])
  assert code == 2 and "pip install 'ckpt_iter[plot]'" in capsys.readouterr().err


def _drawn(root):
  """The audit picture's axes for `root`, drawn in memory."""
  pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'ckpt_iter[plot]')")
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  from ckpt_iter.cli import _audit as auditing  # pylint: disable=g-import-not-at-top
  from ckpt_iter.cli import _inspect as inspection  # pylint: disable=g-import-not-at-top
  from ckpt_iter.cli import _plot  # pylint: disable=g-import-not-at-top

  figure, axes = pyplot.subplots()
  layout = inspection.find_layout(str(root), require_state=False)  # as `ckpt-iter audit` finds it
  _plot._draw(axes, auditing.audit(layout))  # pylint: disable=protected-access
  pyplot.close(figure)
  return axes


def test_a_plain_chains_picture_shows_its_epochs_and_each_run_between_preemptions(tmp_path):
  _chain(tmp_path, [1, 2, 3], [4, 5, 6], [7, 8])
  axes = _drawn(tmp_path)
  labels = [handle.get_label() for handle in axes.get_legend_handles_labels()[0]]
  assert "epoch boundary" in labels and "runs between preemptions (alternating shade)" in labels
  epoch_lines = [line for line in axes.get_lines() if line.get_linestyle() == "--"]
  assert sorted(line.get_ydata()[0] for line in epoch_lines) == [12, 24]  # 12 records an epoch; 32 read
  # The second run (after the resume from step 3) is shaded: steps 4-6.
  shaded = [patch.get_x() for patch in axes.patches]
  assert shaded == [3.5], shaded
  # Epochs numbered from 0, as `inspect` numbers them: the line at 12 records starts epoch 1 (issue 66).
  assert sorted(text.get_text() for text in axes.texts if text.get_text().startswith("epoch")) == ["epoch 1",
                                                                                                   "epoch 2"]


def test_the_title_counts_the_resumes_the_text_counts(tmp_path, capsys):
  # issue 66 item 14: "0 resume(s)" in the title where the text said 3 happened before the kept steps.
  import shutil  # pylint: disable=g-import-not-at-top

  _chain(tmp_path, [1, 2], [3, 4], [5, 6], [7, 8])
  for step in range(1, 7):
    shutil.rmtree(tmp_path / str(step))
  assert cli.main(["audit", str(tmp_path)]) in (0, 3)
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert "3 resume(s) before the earliest kept step" not in last and "(3 before the earliest kept step)" in last
  title = _drawn(tmp_path).get_title()
  assert last.split(": ", 1)[1].split(", ", 1)[1] in title, (last, title)


def test_a_root_without_data_states_draws_no_position_axis_and_says_why(tmp_path):
  with ocp.CheckpointManager(str(tmp_path), item_names=("params",)) as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(2)})))
  axes = _drawn(tmp_path)
  assert list(axes.get_yticks()) == []
  assert any("no data state in any step" in text.get_text() for text in axes.texts)
