"""A fair race between starts: the tuning record (a grid search whose best value may not sit at
a grid edge, :func:`choose`; the search that grows a grid past its edges until it does not,
:func:`search`) and the compute multiplier of an explicit start against a tuned cold start's
loss-vs-compute curve.

A multiplier is ``measured`` only when the explicit run's loss lies inside the cold curve (the
cold compute that reaches it is interpolated between two cold budgets); outside it, it is a
``lower_bound`` (cold never got that low: its largest compute over the explicit run's) or an
``upper_bound`` (cold's smallest budget was already as good).

A cold curve is one point per budget: the best run of each (:func:`best_per_budget`, a tuned
start) or its seeds averaged (:func:`mean_curve`); :func:`saffu.eval.plots.plot_against_compute`
draws such curves and the explicit runs against them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from saffu._io import SaffuError

#: Kinds of a multiplier (:func:`multiplier`).
MEASURED, LOWER_BOUND, UPPER_BOUND = "measured", "lower_bound", "upper_bound"

#: Hyper-parameters whose grid may start at their natural floor (a best value there is not an
#: edge to extend beyond: no weight decay, no dropout).
FLOORS = {"weight_decay": 0.0, "dropout": 0.0}


class Multiplier(NamedTuple):
    """An explicit run's compute multiplier against a cold curve.

    Attributes:
      value: cold's compute to reach the explicit run's loss over the explicit run's compute.
      kind: :data:`MEASURED`, :data:`LOWER_BOUND` or :data:`UPPER_BOUND`.
      cold_compute: the cold compute the value divides (interpolated, or the curve's end).
    """

    value: float
    kind: str
    cold_compute: float


def compute_with_solve(flops: float, train_seconds: float, solve_seconds: float = 0.0) -> float:
    """A run's compute with its explicit solve, FLOPs: the training's ``flops`` plus the solve's
    seconds at the training's FLOPs per second, ``flops · (1 + solve_seconds / train_seconds)``."""
    if not train_seconds > 0:
        raise SaffuError(f"a run's training seconds must be > 0, not {train_seconds}")
    return flops * (1.0 + solve_seconds / train_seconds)


def row_compute(row: Mapping) -> float:
    """A run row's compute with its solve (:func:`compute_with_solve` of its ``flops``,
    ``train_seconds`` and ``solve_seconds``, 0 where it has none)."""
    return compute_with_solve(row["flops"], row["train_seconds"], row.get("solve_seconds", 0.0))


def running_best(curve: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``[(compute, loss), …]`` sorted by compute, each loss the best so far (a longer budget
    that ends worse does not make cold need less compute)."""
    best: list[tuple[float, float]] = []
    for compute, loss in sorted(curve):
        best.append((compute, min(loss, best[-1][1]) if best else loss))
    return best


def multiplier(cold_curve: Sequence[tuple[float, float]], loss: float, compute: float) -> Multiplier:
    """The multiplier of a run that reached ``loss`` with ``compute`` (FLOPs, its solve
    included) against ``cold_curve`` ``[(compute, loss), …]`` (one point per cold budget, lower
    loss better): cold's compute to reach ``loss``, interpolating the loss linearly in
    ``log(compute)`` between the two budgets around it (on :func:`running_best`), over ``compute``.

    Raises :class:`SaffuError` for an empty curve or a non-positive compute."""
    if not cold_curve:
        raise SaffuError("a multiplier needs a cold curve of at least one budget")
    if compute <= 0 or any(c <= 0 for c, _ in cold_curve):
        raise SaffuError("computes must be positive")
    best = running_best(cold_curve)
    if loss >= best[0][1]:
        return Multiplier(best[0][0] / compute, UPPER_BOUND, best[0][0])
    for (c0, y0), (c1, y1) in zip(best, best[1:]):
        if loss >= y1:            # y0 > loss ≥ y1, so y0 > y1
            share = (y0 - loss) / (y0 - y1)
            needed = math.exp(math.log(c0) + share * (math.log(c1) - math.log(c0)))
            return Multiplier(needed / compute, MEASURED, needed)
    return Multiplier(best[-1][0] / compute, LOWER_BOUND, best[-1][0])


def bound_text(value: float, kind: str) -> str:
    """A multiplier as tables print it, two decimals: ``"2.35×"`` when :data:`MEASURED`, a
    :data:`LOWER_BOUND` rounded down (``"≥ 1.99×"``) and an :data:`UPPER_BOUND` rounded up
    (``"≤ 1.01×"``), so a printed bound still holds."""
    if kind not in _PRINTED:
        raise SaffuError(f"a multiplier's kind is {MEASURED!r}, {LOWER_BOUND!r} or {UPPER_BOUND!r}, not {kind!r}")
    return _PRINTED[kind](value)


#: How :func:`bound_text` prints a multiplier of each kind (a bound rounded so that it still holds).
_PRINTED = {MEASURED: lambda value: f"{value:.2f}×",
            LOWER_BOUND: lambda value: f"≥ {math.floor(value * 100) / 100:.2f}×",
            UPPER_BOUND: lambda value: f"≤ {math.ceil(value * 100) / 100:.2f}×"}


def steps_to_reach(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first step at which a run's periodic dev loss ``[(step, loss), …]`` reaches ``target``,
    linear between its evaluations; ``None`` when it never does."""
    points = sorted(curve)
    if points and points[0][1] <= target:
        return float(points[0][0])
    for (s0, y0), (s1, y1) in zip(points, points[1:]):
        if y1 <= target:                    # y0 > target (else the loop had stopped before)
            return s0 + (y0 - target) / (y0 - y1) * (s1 - s0)
    return None


def choose(grid: Mapping[str, Sequence[float]], probes: Sequence[tuple[Mapping[str, float], float]]) -> dict:
    """The best probe of a full grid search, refused where it sits at a grid edge.

    Args:
      grid: ``{name: values}`` searched (every combination), e.g. ``{"learning_rate": [1e-3,
        3e-3, 1e-2, 3e-2], "weight_decay": [0, 0.1], "dropout": [0, 0.1]}``.
      probes: ``[(values {name: value}, dev loss), …]``, one per combination (lower is better).

    Returns ``{name: best value}``. Raises :class:`SaffuError` when a combination has no probe,
    or when a best value is the grid's largest or smallest value of its name (a name of
    :data:`FLOORS` may be best at its floor): the search must extend the grid beyond it first,
    and the message says where."""
    names = list(grid)
    seen = {tuple(float(values[n]) for n in names): loss for values, loss in probes}
    missing = [combo for combo in _combinations(grid) if combo not in seen]
    if missing:
        raise SaffuError(f"{len(missing)} of the grid's combinations have no probe, e.g. "
                         f"{dict(zip(names, missing[0]))}")
    best_combo = min((combo for combo in _combinations(grid)), key=lambda combo: seen[combo])
    best = dict(zip(names, best_combo))
    for name, value in best.items():
        values = sorted(float(v) for v in grid[name])
        if len(values) > 1 and value == values[-1]:
            raise SaffuError(f"the best {name} ({value:g}) is the grid's largest; extend the grid above it")
        if len(values) > 1 and value == values[0] and FLOORS.get(name) != value:
            raise SaffuError(f"the best {name} ({value:g}) is the grid's smallest; extend the grid below it")
        if len(values) == 1 and FLOORS.get(name) != value:
            raise SaffuError(f"{name} was searched at one value ({value:g}); a grid needs values around the best")
    return best


def _combinations(grid: Mapping[str, Sequence[float]]) -> list[tuple[float, ...]]:
    combos: list[tuple[float, ...]] = [()]
    for values in grid.values():
        combos = [combo + (float(v),) for combo in combos for v in values]
    return combos


def half_decade(value: float, up: bool) -> float:
    """The next value of the half-decade grid 1, 3, 10, 30, … × 10^k above (``up``) or below
    ``value``: a learning-rate grid's next value beyond its edge."""
    decade = 10.0 ** math.floor(math.log10(value) + 1e-9)
    steps = [decade * m for m in (0.3, 1, 3, 10, 30)]
    return round(min(s for s in steps if s > value * 1.01) if up else max(s for s in steps if s < value * 0.99), 12)


#: How a grid grows beyond an edge (:func:`search`): ``{name: (next above the largest, next below
#: the smallest or None)}``; a name of :data:`FLOORS` grows upwards only.
GROW = {"learning_rate": (lambda v: half_decade(v, True), lambda v: half_decade(v, False)),
        "weight_decay": (lambda v: round(v * 3, 12), None), "dropout": (lambda v: round(v + 0.1, 12), None)}
#: A budget's rates grow by factors of two (the chosen rate's ½× and 2× neighbours, then beyond).
GROW_BY_TWO = {"learning_rate": (lambda v: round(v * 2, 12), lambda v: round(v / 2, 12))}


def combinations(grid: Mapping[str, Sequence[float]]) -> list[dict]:
    """Every combination of ``grid`` ``{name: values}`` as ``{name: value}``, the first name outermost."""
    return [dict(zip(grid, combo)) for combo in _combinations(grid)]


def grown(grid: Mapping[str, Sequence[float]], error: SaffuError,
          rules: Mapping[str, tuple] = GROW) -> dict | None:
    """``grid`` grown one value beyond the edge that ``error`` (from :func:`choose`) names, by
    ``rules`` (:data:`GROW`); ``None`` when no rule grows it that way."""
    text = str(error)
    for name, (up, down) in rules.items():
        if f"best {name} " in text and name in grid:
            values = sorted(grid[name])
            if "largest" in text:
                return {**grid, name: values + [up(values[-1])]}
            if "smallest" in text and down is not None:
                return {**grid, name: [down(values[0])] + values}
    return None


class Search(NamedTuple):
    """What :func:`search` found.

    Attributes:
      grid: the grid searched, grown beyond the edges the best sat at.
      chosen: the best combination ``{name: value}``, or ``None`` while the grid is incomplete
        or its best still sits at an edge.
      probes: ``[(values, loss), …]`` of the grid's combinations that have a loss.
      why: why nothing was chosen (the last :func:`choose` error); empty when chosen.
    """

    grid: dict
    chosen: dict | None
    probes: list
    why: str


def search(grid: Mapping[str, Sequence[float]], losses, extend: bool = True, rules: Mapping[str, tuple] = GROW,
           max_values: int = 7) -> Search:
    """The tuning protocol's search: the full ``grid``, grown one value beyond an edge wherever its
    best sits at one (:func:`choose`, :func:`grown`), until it does not.

    Args:
      grid: ``{name: values}`` to start from.
      losses: ``combos -> [(values, loss), …]``: the loss of each combination of the list it is
        given that it has, or runs (a sweep); the combinations it leaves out count as missing.
      extend: grow the grid and ask ``losses`` for the new combinations; without it (a report of
        the runs there are), the grid grows only where every grown combination already has a loss.
      rules: how each name grows (:data:`GROW`, :data:`GROW_BY_TWO`).
      max_values: no name grows past this many values.
    """
    grid = {name: list(values) for name, values in grid.items()}
    probes = list(losses(combinations(grid)))
    while True:
        try:
            return Search(grid, choose(grid, probes), probes, "")
        except SaffuError as error:
            bigger = grown(grid, error, rules)
            if bigger is None or any(len(values) > max_values for values in bigger.values()):
                return Search(grid, None, probes, str(error))
            wanted = combinations(bigger)
            more = list(losses(wanted))       # runs the new combinations when extending
            if not extend and len(more) < len(wanted):
                return Search(grid, None, probes, str(error))
            grid, probes = bigger, more


def best_per_budget(rows: Iterable[Mapping], budget: str = "epochs", loss: str = "dev_bpb") -> dict:
    """``{budget: row}``: the row of each budget with the lowest ``loss`` (the first of equals), the
    budgets in the order they first appear in ``rows`` (a start's tuned point per budget)."""
    best: dict = {}
    for row in rows:
        if row[budget] not in best or row[loss] < best[row[budget]][loss]:
            best[row[budget]] = row
    return best


def mean_curve(rows: Sequence[Mapping], budget: str = "epochs", compute: str = "compute",
               loss: str = "dev_bpb") -> list[tuple[float, float]]:
    """``[(compute, loss), …]`` with one point per budget, budgets ascending: the mean ``compute``
    and the mean ``loss`` of the rows of that budget (a cold curve with its seeds averaged)."""
    curve = []
    for value in sorted({row[budget] for row in rows}):
        group = [row for row in rows if row[budget] == value]
        curve.append((sum(r[compute] for r in group) / len(group), sum(r[loss] for r in group) / len(group)))
    return curve



def rate_search(chosen: Mapping[str, float], losses, extend: bool = True, max_values: int = 6) -> Search:
    """A longer budget's search, the tuning protocol's second phase: ``chosen``'s learning rate
    (the grid's choice) and its ½× and 2× neighbours, grown by factors of two past an edge the best
    sits at (:data:`GROW_BY_TWO`, at most ``max_values`` rates), ``chosen``'s other values fixed.

    ``losses`` and ``extend`` are :func:`search`'s; ``losses`` is given whole combinations
    (``chosen`` with each rate). The :class:`Search` has the rates searched as its grid
    (``{"learning_rate": rates}``), the chosen combination whole and whole combinations as probes."""
    rates = sorted({round(chosen["learning_rate"] * f, 12) for f in (0.5, 1.0, 2.0)})
    found = search({"learning_rate": rates}, lambda combos: losses([{**chosen, **c} for c in combos]), extend=extend,
                   rules=GROW_BY_TWO, max_values=max_values)
    return found._replace(chosen={**chosen, **found.chosen} if found.chosen else None)


def tuned_race(runs: Mapping[str, Sequence[Mapping]], cold_of: Mapping[str, str],
               compute: Callable[[Mapping], float] = row_compute, budget: str = "epochs", loss: str = "dev_bpb") -> dict:
    """The race of tuned starts: each start's best run of each budget of a whole epoch or more
    (:func:`best_per_budget`), and each explicit start's multiplier at each of its budgets against
    its cold start's curve of those runs (:func:`multiplier`).

    Args:
      runs: ``{start: [row, …]}``, each row with its ``name``, ``budget`` (epochs), ``loss``, its
        ``dev_loss`` and ``train_loss`` (nats) and what ``compute`` reads.
      cold_of: ``{explicit start: the cold start it races}``.
      compute: a row's compute, FLOPs with its solve (default :func:`row_compute`).

    Returns ``{explicit start: [race row, …]}``, budgets ascending, each race row holding
    ``budget``, ``name``, ``loss``, ``compute``, ``multiplier``, ``multiplier_kind``,
    ``cold_compute``, ``cold``, ``cold_curve`` (``[(compute, loss), …]``) and both runs' train–dev
    gaps ``gap_nats`` and ``cold_gap_nats`` (``None`` where cold has no run of the budget). A
    start without a run of an epoch or more, or whose cold start has none, is left out."""
    best = {start: best_per_budget((r for r in rows if r[budget] >= 1), budget, loss) for start, rows in runs.items()}
    out: dict = {}
    for start, cold in cold_of.items():
        if not best.get(start) or not best.get(cold):
            continue
        curve = sorted((compute(r), r[loss]) for r in best[cold].values())
        for epochs, r in sorted(best[start].items()):
            m = multiplier(curve, r[loss], compute(r))
            other = best[cold].get(epochs)
            out.setdefault(start, []).append({
                budget: epochs, "name": r["name"], loss: r[loss], "compute": compute(r), "multiplier": m.value,
                "multiplier_kind": m.kind, "cold_compute": m.cold_compute, "cold": cold, "cold_curve": curve,
                "gap_nats": r["dev_loss"] - r["train_loss"],
                "cold_gap_nats": None if other is None else other["dev_loss"] - other["train_loss"]})
    return out
