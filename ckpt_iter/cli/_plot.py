"""The timeline picture of an audit: position against step, resumes marked, breaks in red.

matplotlib is an optional extra (`pip install 'ckpt_iter[plot]'`), imported
only here and only when `ckpt-iter audit --plot` asks for a picture.
"""

from __future__ import annotations

import io

from ckpt_iter import _storage
from ckpt_iter.cli import _audit as auditing


class MissingMatplotlib(Exception):
  pass


_PROGRESS_LABEL = {
    "data": "records read (next_record) or elements read (next_index)",
    "repeat": "items yielded to the trainer",
    "tunix": "prompts consumed",
}


def timeline(report: auditing.Report, path: str) -> None:
  """Writes a PNG of `report` to `path`."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")  # no display: a file only
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingMatplotlib(
        "--plot needs matplotlib, which is not installed: pip install 'ckpt_iter[plot]'."
    ) from None
  figure, axes = pyplot.subplots(figsize=(9, 4.5), dpi=110)
  try:
    _draw(axes, report)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
  finally:
    pyplot.close(figure)
  _storage.write_bytes(path, png.getvalue())  # beside the checkpoints on gs:// too


def _draw(axes, report: auditing.Report) -> None:
  processes = sorted({p.process_index for p in report.points})
  kinds = sorted({p.kind for p in report.points})
  _shade_runs(axes, report)
  if not any(p.progress is not None for p in report.points):
    _no_positions(axes, report)
    return
  _epoch_lines(axes, report)
  for process_index in processes:
    points = [p for p in report.points if p.process_index == process_index and p.progress is not None]
    if points:
      axes.plot([p.step for p in points], [p.progress for p in points], "-o", color="#3b6ea8",
                markersize=4, linewidth=1.4, alpha=1.0 if process_index == processes[0] else 0.4,
                label="saved states" if process_index == processes[0] else None)
  for point in report.points:
    if point.process_index == processes[0] and point.remaining and point.progress is not None:
      axes.annotate(f"{point.remaining} pending", (point.step, point.progress), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=7, color="#555555")
  progress = {(p.step, p.process_index): p.progress for p in report.points}
  first_resume = first_break = first_unprovable = True
  for finding in report.findings:
    y = progress.get((finding.step, finding.process_index))
    if finding.resumed_from is not None and finding.verdict == auditing.OK:
      axes.axvline(finding.resumed_from, color="#7a7a7a", linestyle=":", linewidth=1,
                   label="preemption, resumed from this step" if first_resume else None)
      resumed_at = progress.get((finding.resumed_from, finding.process_index))
      if resumed_at is not None:
        axes.plot([finding.resumed_from], [resumed_at], "o", markersize=10, markerfacecolor="none",
                  markeredgecolor="#2ca02c", markeredgewidth=1.6,
                  label="resume proven exact" if first_resume else None)
      first_resume = False
    elif finding.verdict == auditing.BROKEN:
      axes.axvline(finding.step, color="#d62728", linewidth=1.5, alpha=0.6)
      if y is not None:
        axes.plot([finding.step], [y], "X", color="#d62728", markersize=11,
                  label="break" if first_break else None)
      first_break = False
    elif finding.verdict == auditing.UNPROVABLE:
      axes.axvspan(finding.step - 0.4, finding.step + 0.4, color="#f0b429", alpha=0.3,
                   label="no data state: unprovable" if first_unprovable else None)
      first_unprovable = False
  _title(axes, report)
  axes.set_ylabel(" / ".join(_PROGRESS_LABEL.get(kind, "position") for kind in kinds) or "position")
  axes.grid(alpha=0.25)
  axes.margins(y=0.12)  # room for the pending labels
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  axes.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  if axes.get_legend_handles_labels()[0]:
    axes.legend(loc="lower right", fontsize=8)


def _title(axes, report: auditing.Report) -> None:
  verdict = {auditing.OK: "unbroken chain", auditing.BROKEN: "BROKEN chain",
             auditing.UNPROVEN: "not proven", auditing.NOTHING: "nothing to prove"}[report.verdict]
  where = "/".join(report.root.rstrip("/").split("/")[-2:])
  summary = report.resume_summary().replace(" (accepted changes named above)", "")
  axes.set_title(f"{verdict}: {summary}  (.../{where})",
                 fontsize=9, color="#d62728" if report.verdict == auditing.BROKEN else "black")
  axes.set_xlabel("checkpoint step")


def _shade_runs(axes, report: auditing.Report) -> None:
  """Each run between two preemptions (a process lifetime) shaded, alternately.

  A run that resumed from step r trains the steps after r: those the killed
  run trained after saving r are trained again there.
  """
  if not report.steps or not report.resumes:
    return
  restored = sorted({f.resumed_from for f in report.resumes})
  edges = [min(report.steps) - 1] + restored + [max(report.steps)]
  for number, (start, end) in enumerate(zip(edges, edges[1:])):
    if number % 2 and end > start:
      axes.axvspan(start + 0.5, end + 0.5, color="#dde7f3", alpha=0.6, zorder=0,
                   label="runs between preemptions (alternating shade)" if number == 1 else None)


def _epoch_lines(axes, report: auditing.Report) -> None:
  """Epoch boundaries, where the progress counts a single source's records (make_dataset)."""
  points = [p for p in report.points if p.kind == "data" and p.progress is not None]
  per_epoch = {p.fingerprint.get("source_length") for p in points}
  if len(per_epoch) != 1:
    return
  (per_epoch,) = per_epoch
  if not isinstance(per_epoch, int) or isinstance(per_epoch, bool) or per_epoch <= 0:
    return
  top = max(p.progress for p in points)
  for epoch in range(1, top // per_epoch + 1):
    axes.axhline(epoch * per_epoch, color="#9a9a9a", linestyle="--", linewidth=0.8, zorder=0,
                 label="epoch boundary" if epoch == 1 else None)
    # Epochs numbered from 0, as `ckpt-iter inspect` and `which` number them: the one this line starts.
    axes.annotate(f"epoch {epoch}", (0, epoch * per_epoch), xycoords=("axes fraction", "data"),
                  xytext=(3, 2), textcoords="offset points", fontsize=7, color="#777777")


def _no_positions(axes, report: auditing.Report) -> None:
  """A root with no data state: the steps, and why there is no position to draw."""
  unprovable = [f for f in report.findings if f.verdict == auditing.UNPROVABLE]
  for number, finding in enumerate(unprovable):
    axes.axvspan(finding.step - 0.4, finding.step + 0.4, color="#f0b429", alpha=0.3,
                 label="no data state: unprovable" if not number else None)
  axes.set_yticks([])
  axes.set_ylim(0, 1)
  axes.text(0.5, 0.5, "no data state in any step: no input position to draw\n"
            "(written by stock Tunix, or without ckpt_iter)", transform=axes.transAxes,
            ha="center", va="center", fontsize=9, color="#555555")
  _title(axes, report)
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  if unprovable:
    axes.legend(loc="lower right", fontsize=8)
