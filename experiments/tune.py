"""One tuning protocol for every start: cold (random init) and the explicit init of the project's
transformer get the same search on dev, then train at longer budgets at their tuned values.

Protocol (the same for both starts, width 128, 5 layers, V 8,192, 16 × 256 targets a step):

1. ``grid``: the full grid at a quarter epoch: learning rate on a half-decade log grid
   (1e-3, 3e-3, 1e-2, 3e-2), AdamW weight decay (0, 0.1) and residual dropout (0, 0.1). Each probe's
   figure is dev bits per byte on about 200,000 tokens of whole dev documents. The best
   combination may not sit at a grid edge (:func:`saffu.eval.race.choose`; no weight decay and
   no dropout are floors, not edges): where it does, the grid grows one value beyond that edge
   and the new combinations are probed, until it does not.
2. ``budgets``: at each longer budget (1 and 4 epochs by default), the tuned weight decay and
   dropout with the tuned rate and its ½× and 2× neighbours, each its own run with its own
   warm-up and cosine schedule, scored on the whole dev split; the best rate of a budget may not
   sit at an edge of its three either (the budget then grows a rate beyond it).

Every probe and run is a run spec (:mod:`saffu.runner`: ``saffu train --config`` of its
``spec.json``) in its own folder (``OUT/runs/START/NAME``), run by :func:`saffu.runner.sweep`: a
finished one (its ``result.json`` written under the same spec) is skipped, an interrupted one
resumes from its checkpoint, a folder holding another spec is refused, and a run that
``results/tuning.json`` records (an earlier session's, its folder left on the machine that made
it) is not run again: the report reads its recorded row. ``--jobs 2`` runs
two at once, each pinned to a core of its own. ``--report`` writes ``results/tuning.json``: the
grid, every probe's and run's dev figure, seconds and command, and the chosen values per start
and budget.

    python experiments/tune.py --workdir runs/babylm --out runs/tune --phase grid --jobs 2
    python experiments/tune.py --workdir runs/babylm --out runs/tune --phase budgets --epochs 1 4 --jobs 2
    python experiments/tune.py --out runs/tune --report
    python experiments/tune.py --workdir runs/quick --out runs/tune-quick --quick    # minutes, a tiny model
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from pathlib import Path

from saffu._io import atomic_write_json
from saffu.eval.plots import plot_race
from saffu.eval.race import combinations, rate_search, search, tuned_race
from saffu.flags import TRANSFORMER_RENAME, flags_of, script_main, script_options
from saffu.runner import command, final_figures, history, joined, prepared, recorded, steps_per_epoch, sweep, write_result

ROOT = Path(__file__).resolve().parents[1]
#: The starts compared: each one's ``saffu train`` start (``--init`` and its start settings) and
#: model settings, the sections of its run spec (:mod:`saffu.runner`).
GPT, LLAMA = ({"block": "gpt", "output_bias": True, "across_documents": False},     # document-local (not
              {"block": "llama", "output_bias": False, "across_documents": False})  # the default since 2026-12-07)
XDOC = {**LLAMA, "across_documents": True}   # the default block: attention across documents
STARTS = {"cold": ("random", GPT, {}), "explicit-init": ("explicit", GPT, {}),
          "llama-cold-nobias": ("random", LLAMA, {}),
          "llama-explicit-nobias": ("explicit", LLAMA, {}),
          "llama-explicit": ("explicit", {**LLAMA, "output_bias": True}, {}),
          "llama-explicit-nobias-rms1": ("explicit", LLAMA, {"explicit_embedding_rms": 1.0}),
          # the output kernel at penzai's Llama-like random scale, √(2 / (d + V)) at d 128, V 8,192
          "llama-explicit-nobias-rms1-out": ("explicit", LLAMA, {"explicit_embedding_rms": 1.0,
                                                                 "explicit_output_rms": 0.0155}),
          # the scaling trend: the llama block at widths 64 and 256, at the width-128 grid's values
          "llama-cold-nobias-w64": ("random", {**LLAMA, "width": 64}, {}),
          "llama-explicit-nobias-w64": ("explicit", {**LLAMA, "width": 64}, {}),
          "llama-cold-nobias-w256": ("random", {**LLAMA, "width": 256}, {}),
          "llama-explicit-nobias-w256": ("explicit", {**LLAMA, "width": 256}, {}),
          # the default block: attention across the documents of a window (BabyLM's documents are lines)
          "llama-cold-nobias-xdoc": ("random", XDOC, {}), "llama-explicit-nobias-xdoc": ("explicit", XDOC, {}),
          "llama-explicit-nobias-xdoc-w256": ("explicit", {**XDOC, "width": 256}, {}),
          "llama-cold-nobias-xdoc-w256": ("random", {**XDOC, "width": 256}, {})}


def start_flags(start: str) -> list[str]:
    """The ``saffu train`` flags of a start's settings (``--block llama --no-output-bias``), as the
    results file and the README name it."""
    _, model, extra = STARTS[start]
    return flags_of(model, TRANSFORMER_RENAME) + flags_of(extra)


#: The starts the quarter-epoch grid tunes; the others run at those values (the architecture comparison).
GRID_STARTS = ("cold", "explicit-init")
#: Each architecture's cold start, which its explicit starts race against.
COLD_OF = {"explicit-init": "cold", "llama-explicit-nobias": "llama-cold-nobias",
           "llama-explicit-nobias-rms1": "llama-cold-nobias", "llama-explicit-nobias-rms1-out": "llama-cold-nobias",
           "llama-explicit-nobias-w64": "llama-cold-nobias-w64", "llama-explicit-nobias-w256": "llama-cold-nobias-w256",
           "llama-explicit-nobias-xdoc": "llama-cold-nobias-xdoc",
           "llama-explicit-nobias-xdoc-w256": "llama-cold-nobias-xdoc-w256"}
#: The quarter-epoch grid.
GRID = {"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.0, 0.1], "dropout": [0.0, 0.1]}
#: The llama block's grid, the same for its cold and explicit starts at width 128 (either mask): weight decay
#: starts at 0 and the gpt block's tuned cold value (0.9) rather than climbing there from 0.1 again.
LLAMA_GRID = {**GRID, "weight_decay": [0.0, 0.9]}
GRID_OF = {start: LLAMA_GRID for start, (_, model, extra) in STARTS.items() if not extra and model in (LLAMA, XDOC)}
#: ``--quick``'s grid: three rates, no weight decay or dropout (floors, not edges), a check of the protocol.
QUICK_GRID = {**GRID, "learning_rate": [3e-3, 1e-2, 3e-2], "weight_decay": [0.0], "dropout": [0.0]}


def grid_of(args, start: str) -> dict:
    """The grid ``start`` is tuned on (``--quick``: :data:`QUICK_GRID`)."""
    return QUICK_GRID if args.quick else GRID_OF.get(start, GRID)

@dataclasses.dataclass
class Options:
    """The tuning protocol's runs and report.

    Attributes:
      workdir: a prepared work directory
      out: where the runs go
      phase: what to run (then --report to gather)
      starts: the starts to run
      epochs: the budgets phase's budgets
      share: the grid's budget, in epochs
      jobs: runs at once, one per core
      report: write results/tuning.json from the finished runs
      quick: a tiny model on the embedded corpus (a check)
    """

    workdir: Path = ROOT / "runs" / "babylm"
    out: Path = ROOT / "runs" / "tune"
    phase: str | None = dataclasses.field(default=None, metadata={"choices": ("grid", "budgets")})
    starts: tuple[str, ...] = dataclasses.field(default=GRID_STARTS, metadata={"choices": tuple(STARTS)})
    epochs: tuple[float, ...] = (1, 4)
    share: float = 0.25
    jobs: int = 1
    report: bool = False
    quick: bool = False


def name_of(start: str, values: dict, epochs: float) -> str:
    parts = "_".join(f"{key[:2]}{values[key]:g}" for key in GRID)
    return f"{start}/{epochs:g}ep_{parts}"


def spec_of(args, start: str, values: dict, epochs: float) -> dict:
    """The run spec (:mod:`saffu.runner`) of ``start`` at ``values`` for ``epochs``: budgets of a
    whole epoch or more are scored on the whole dev split, probes on about 200,000 tokens."""
    init, model, extra = STARTS[start]
    steps = max(round(epochs * steps_per_epoch(args.workdir, (4 * 32) if args.quick else (16 * 256))), 1)
    whole = epochs >= 1 and not args.quick
    small = ({"width": 16, "layers": 1, "heads": 2, "context_tokens": 8}, {"seq_len": 32, "batch_size": 4}) \
        if args.quick else ({}, {})
    return {"start": {"init": init, "model": "transformer", **extra},
            "model": {"kind": "transformer", **model, **small[0]},
            "train": {"steps": steps, "eval_every": max(steps // 8, 1) if whole else steps,
                      "checkpoint_every": max(steps // 4, 1), **{k: float(v) for k, v in values.items()}, **small[1]},
            "eval": {"eval_tokens": 0 if whole else 200000}}


def run_all(args, wanted: list[tuple[str, dict, float]]) -> None:
    """Run every ``(start, values, epochs)`` not finished yet through :func:`saffu.runner.sweep`,
    ``--jobs`` at a time (each pinned to its own core); one recorded in ``results/tuning.json`` by an
    earlier session (:func:`recorded_rows`) is not run again."""
    earlier = recorded_rows(args)
    specs = {name_of(*w): spec_of(args, *w) for w in wanted if name_of(*w) not in earlier}
    sweep(specs, args.out / "runs", args.workdir, jobs=args.jobs)


def recorded_rows(args) -> dict[str, dict]:
    """``{run name: row}`` of ``results/tuning.json``: the runs of earlier sessions, whose folders
    stay on the machine that made them. Empty for ``--quick`` and for another work directory."""
    return {} if args.quick else _recorded((ROOT / args.workdir).resolve())


@functools.cache
def _recorded(workdir: Path) -> dict[str, dict]:
    figures = recorded(ROOT / "results" / "tuning.json")
    if not figures or (ROOT / figures["workdir"]).resolve() != workdir:
        return {}
    rows = [row for tuned in figures["starts"].values()
            for row in [*tuned["probes"], *(r for budget in tuned["budgets"].values() for r in budget["runs"])]]
    return {row["name"]: row for row in [*rows, *(r for runs in figures["architectures"].values() for r in runs)]}


def finished(args, start: str) -> dict[str, dict]:
    """``{name: row}`` (``cold/4ep_le0.01_we0.9_dr0``) of ``start``'s finished runs by name: this
    machine's (:func:`_row` of each folder), and the recorded ones (:func:`recorded_rows`) that no
    folder here holds."""
    here = [_row(args, path.parent) for path in (args.out / "runs" / start).glob("*/result.json")]
    earlier = [row for name, row in recorded_rows(args).items() if name.split("/", 1)[0] == start]
    return {row["name"]: row for row in sorted(joined(here, earlier, key=lambda row: row["name"]),
                                               key=lambda row: row["name"])}


def _losses(args, start: str, epochs: float, run: bool):
    """``combos -> [(values, dev bits per byte), …]`` of ``start``'s runs at ``epochs``, running
    the missing ones first when ``run`` (:func:`saffu.eval.race.search`)."""
    def losses(combos: list[dict]) -> list:
        wanted = [(start, values, epochs) for values in combos]
        if run:
            run_all(args, wanted)
        done = finished(args, start)
        return [(values, done[name_of(*w)]["dev_bpb"]) for values, w in zip(combos, wanted) if name_of(*w) in done]
    return losses


def search_of(args, start: str, run: bool, epochs: float | None = None, chosen: dict | None = None):
    """``start``'s search (:class:`saffu.eval.race.Search`): its quarter-epoch grid, or at
    ``epochs`` (a longer budget) the ``chosen`` rate with its ½× and 2× neighbours
    (:func:`saffu.eval.race.rate_search`, the weight decay and dropout the grid's); with ``run``,
    probes what is missing, growing past an edge until the choice holds (and, reporting, as far
    as runs exist)."""
    if chosen is None:
        found = search(grid_of(args, start), _losses(args, start, args.share, run), extend=run)
    else:
        found = rate_search(chosen, _losses(args, start, epochs, run), extend=run)
    if found.why:
        print(f"{start} at {epochs or args.share:g} epochs: {found.why}")
    return found


def report(args) -> dict:
    """``results/tuning.json``: each tuned start's grid, chosen values and longer budgets (the
    starts asked for, and every start of :data:`GRID_OF` whose grid has probes), every other run
    of a whole epoch or more as its architecture's rows, and the race (:func:`race`)."""
    starts = {}
    has_grid = lambda start: any(row["epochs"] == args.share for row in finished(args, start).values())
    for start in dict.fromkeys([*args.starts, *(s for s in GRID_OF if has_grid(s))]):
        grid, rows, budgets = search_of(args, start, run=False), finished(args, start), {}
        for epochs in args.epochs if grid.chosen else ():
            found = search_of(args, start, False, epochs, grid.chosen)
            if found.probes:
                budgets[f"{epochs:g}"] = {"rates": found.grid["learning_rate"], "chosen": found.chosen,
                                          "runs": [rows[name_of(start, v, epochs)] for v, _ in found.probes]}
        starts[start] = {"grid": grid.grid, "chosen": grid.chosen,
                         "probes": [rows[name_of(start, v, args.share)] for v, _ in grid.probes], "budgets": budgets}
    others = {}
    for start in STARTS:        # each run of an epoch or more that no tuned budget above holds
        if start in args.starts:
            continue
        tuned = {r["name"] for b in starts.get(start, {}).get("budgets", {}).values() for r in b["runs"]}
        rows = [row for name, row in finished(args, start).items() if row["epochs"] >= 1 and name not in tuned]
        if rows:
            others[start] = rows
    figures = {"protocol": {"grid": GRID, "share_epochs": args.share, "budget_epochs": args.epochs,
                            "probe_figure": "dev bits per byte on about 200,000 tokens of whole dev documents",
                            "budget_figure": "dev bits per byte on the whole dev split"},
               "workdir": str(args.workdir), "starts": starts, "architectures": others,
               "flags": {start: start_flags(start) for start in STARTS}}
    figures["race"] = race(figures)
    figures["plot"] = plot(figures["race"], (args.out if args.quick else ROOT / "docs" / "results") / "tuning.png",
                           tuple(start for start, t in starts.items() if t["chosen"]))
    if args.quick:      # a check: its figures stay beside its runs, never in results/
        atomic_write_json(args.out / "tuning.json", figures)
        print(f"wrote {args.out / 'tuning.json'}")
        return figures
    path = write_result(ROOT / "results", "tuning", figures, seeds=[0], load={
        "note": "two runs at a time, one per core (taskset), other work sharing the machine at times; each run's "
                "seconds are in its row"})
    print(f"wrote {path}")
    return figures


def race(figures: dict) -> dict:
    """Each explicit start's multiplier at each budget (its best run there) against its
    architecture's cold curve (the best cold run of each budget of a whole epoch or more),
    :func:`saffu.eval.race.tuned_race`; and every such run's train–dev gap (nats)."""
    rows = {start: [r for b in tuned.get("budgets", {}).values() for r in b["runs"]]
            for start, tuned in figures["starts"].items()}
    for start, runs in figures["architectures"].items():     # a tuned start's other runs join its budgets'
        rows[start] = rows.get(start, []) + runs
    return tuned_race(rows, COLD_OF)


def plot(race_rows: dict, path: Path, tuned: tuple[str, ...] = ()) -> str:
    """One panel per cold start the race measured against: its cold curve (dev bits per byte
    against compute; ``tuned``: the cold starts with a grid of their own, the others run at
    another's values) and each explicit start's best run of each budget, the epochs by the
    points; written to ``path`` (PNG). Returns the path (from the project root where it is inside
    it); ``""`` and no file when the race has no rows."""
    drawn = plot_race(race_rows, path, heading=lambda cold: " ".join(start_flags(cold)) or "gpt block, width 128",
                      label=lambda cold: f"{cold} ({'tuned' if cold in tuned else 'width 128’s values'})",
                      xlabel="compute: training FLOPs + the explicit solve's share", ylabel="whole-dev bits per byte",
                      title="babylm-2023-4src: each explicit start against its architecture's cold curve "
                            "(epochs by the points)")
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path) if drawn else ""


def _row(args, folder: Path) -> dict:
    """The row of a finished run's folder (``OUT/runs/START/4ep_le0.01_we0.9_dr0``): its values
    and budget (from its name), its figures (:func:`saffu.runner.final_figures`) and command."""
    start, name = folder.parent.name, folder.name
    result = json.loads((folder / "result.json").read_text())
    values = {key: float(part[2:]) for key, part in zip(GRID, name.split("_")[1:])}
    return {"name": f"{start}/{name}", **values, "epochs": float(name.split("ep_")[0]),
            **final_figures(result, history(folder)), "dev_whole_split": result.get("dev_whole_split"),
            "flags": start_flags(start), **({"rescored": result["rescored"]} if "rescored" in result else {}),
            "command": shlex.join(["python", *command(folder, args.workdir)[1:]])}


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    if args.quick:
        args.share, args.epochs = 0.25, [1.0]
        prepared(args.workdir)
        args.phase = args.phase or "grid"
    if not args.report and not args.phase:
        raise SystemExit("give --phase grid, --phase budgets or --report")
    if args.phase == "grid":      # every start's grid in one queue (no core waits), then each grows past its edges
        run_all(args, [(start, values, args.share) for start in args.starts
                     for values in combinations(grid_of(args, start))])
        for start in args.starts:
            print(f"{start}: {search_of(args, start, run=True).chosen}", flush=True)
    elif args.phase == "budgets":
        chosen = {start: search_of(args, start, run=False).chosen for start in args.starts}
        if None in chosen.values():
            raise SystemExit("the grid phase has not chosen every start's values yet (--phase grid)")
        # the tuned rate of every start first (a comparison as soon as one round ends), then the neighbours
        first = [(start, {**values, "learning_rate": round(values["learning_rate"] * f, 12)}, epochs)
                 for epochs in args.epochs for f in (1.0, 2.0, 0.5) for start, values in chosen.items()]
        run_all(args, first)
        for start, values in chosen.items():
            for epochs in args.epochs:
                print(f"{start} at {epochs:g} epochs: {search_of(args, start, True, epochs, values).chosen}", flush=True)
    if args.report or args.quick:
        report(args)
    return 0


if __name__ == "__main__":
    script_main(main)
