"""Loss against compute: a race's curves drawn as the results pages show them
(:func:`plot_against_compute`), a cold start's curve and the explicit runs against it, each
point's budget by it; and plain curves, loss against steps (:func:`plot_curves`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple


class Series(NamedTuple):
    """One line, or one set of markers, of a panel of :func:`plot_against_compute` or :func:`plot_curves`.

    Attributes:
      points: ``[(compute, loss), …]`` (:func:`plot_curves`: ``[(x, y), …]``), drawn in this order.
      label: its legend entry; ``None``: none.
      style: matplotlib's line settings (``marker``, ``linestyle``, ``color``, ``markerfacecolor``, …).
      notes: a short text by each point (its budget), or ``()`` for none.
      note_style: the notes' text settings (``fontsize``, ``color``).
    """

    points: Sequence[tuple[float, float]]
    label: str | None = None
    style: Mapping = {}
    notes: Sequence[str] = ()
    note_style: Mapping = {"fontsize": 7}


def plot_against_compute(path, panels: Sequence[tuple[str, Sequence[Series]]], xlabel: str, ylabel: str,
                         title: str = "", panel_size: tuple[float, float] = (4.2, 4.0), title_size: int = 9,
                         legend: Mapping | None = None, decades_only: bool = True) -> None:
    """Loss against compute (a log scale; ``decades_only``: only the decades labelled, else
    matplotlib's labels between them too), one panel per ``(heading, series)`` of ``panels`` side
    by side, each :class:`Series` a line or markers with its notes by its points; ``ylabel`` on
    the first panel, ``title`` over them all, the legend's settings ``legend`` (default: small
    type). Written to ``path`` (PNG), its folder made."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    for axis, (heading, series) in zip(axes[0], panels):
        _draw(axis, series)
        axis.set_xscale("log")
        if decades_only:
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel(xlabel)
        axis.set_title(heading, fontsize=title_size)
        axis.grid(alpha=0.3, which="both")
        axis.legend(**(legend or {"fontsize": 7}))
    axes[0][0].set_ylabel(ylabel)
    if title:
        figure.suptitle(title, fontsize=10)
    _save(figure, path)


def _draw(axis, series: Sequence[Series]) -> None:
    """Each of ``series`` on ``axis``: its points as a line or markers (none when it has no points),
    its notes by them."""
    for line in series:
        if line.points:
            axis.plot(*zip(*line.points), label=line.label, **line.style)
        for point, note in zip(line.points, line.notes):
            axis.annotate(note, point, textcoords="offset points", xytext=(4, 4), **line.note_style)


def _save(figure, path) -> None:
    """``figure`` written to ``path`` (PNG at 110 dots per inch, laid out tightly, its folder made), then closed."""
    import matplotlib.pyplot as plt
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_curves(path, series: Sequence[Series], xlabel: str, ylabel: str,
                levels: Sequence[tuple[float, Mapping]] = (), ylim: tuple[float, float] | None = None,
                size: tuple[float, float] = (8, 4.5), legend: Mapping | None = None) -> None:
    """Curves on linear axes in one panel (e.g. dev loss against optimizer steps): each
    :class:`Series` of ``series`` a line, its ``points`` ``[(x, y), …]`` (an ``x`` such as a
    step, cumulative over a run's stages), drawn in order; each ``(y, style)`` of ``levels`` a
    horizontal line across the panel at ``y`` (matplotlib's line settings ``style``, its
    ``label`` among them); the y range ``ylim`` (default: matplotlib's); a figure of ``size``
    inches, the legend's settings ``legend`` (default: small type). Written to ``path`` (PNG), its
    folder made."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=size)
    _draw(axis, series)
    for y, style in levels:
        axis.axhline(y, **style)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if ylim is not None:
        axis.set_ylim(*ylim)
    axis.grid(alpha=0.3)
    axis.legend(**(legend or {"fontsize": 7}))
    _save(figure, path)


def plot_race(race: Mapping[str, Sequence[Mapping]], path, heading: Callable[[str], str],
              label: Callable[[str], str], budget: str = "epochs", loss: str = "dev_bpb", **options) -> bool:
    """A race's plot (:func:`saffu.eval.race.tuned_race`'s rows ``race``): one panel per cold start
    raced against, ``heading(cold)`` over it, its cold curve (grey, ``label(cold)``) and each
    explicit start's best run of each budget, the budget by each point. ``options``:
    :func:`plot_against_compute`'s (``xlabel``, ``ylabel``, ``title``). ``False``, and no file,
    when the race has no rows."""
    colds = list(dict.fromkeys(r["cold"] for rows in race.values() for r in rows))
    panels = []
    for cold in colds:
        curve = next(r["cold_curve"] for rows in race.values() for r in rows if r["cold"] == cold)
        series = [Series(curve, label(cold), {"marker": "o", "color": "tab:gray"})]
        for start, rows in race.items():
            mine = [r for r in rows if r["cold"] == cold]
            series.append(Series([(r["compute"], r[loss]) for r in mine], start, {"marker": "s"},
                                 [f"{r[budget]:g}" for r in mine]))
        panels.append((heading(cold), series))
    if panels:
        plot_against_compute(path, panels, **options)
    return bool(panels)
