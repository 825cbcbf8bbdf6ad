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
import subprocess
import sys
from pathlib import Path

from results import write_result
from saffu._io import SaffuError, atomic_write_json
from saffu.eval.race import GROW_BY_TWO, combinations, compute_with_solve, multiplier, search
from saffu.flags import DEFAULT_CORPUS, TRANSFORMER_RENAME, flag_name, script_options
from saffu.runner import command, sweep

ROOT = Path(__file__).resolve().parents[1]
#: The starts compared: each one's ``saffu train`` start (``--init`` and its start settings) and
#: model settings, the sections of its run spec (:mod:`saffu.runner`).
GPT, LLAMA = {"block": "gpt", "output_bias": True}, {"block": "llama", "output_bias": False}
STARTS = {"cold": ("random", GPT, {}), "explicit-init": ("explicit", GPT, {}),
          "llama-cold-nobias": ("random", LLAMA, {}),
          "llama-explicit-nobias": ("explicit", LLAMA, {}),
          "llama-explicit": ("explicit", {"block": "llama", "output_bias": True}, {}),
          "llama-explicit-nobias-rms1": ("explicit", LLAMA, {"explicit_embedding_rms": 1.0}),
          # the output kernel at penzai's Llama-like random scale, √(2 / (d + V)) at d 128, V 8,192
          "llama-explicit-nobias-rms1-out": ("explicit", LLAMA, {"explicit_embedding_rms": 1.0,
                                                                 "explicit_output_rms": 0.0155}),
          # the scaling trend: the llama block at widths 64 and 256, at the width-128 grid's values
          "llama-cold-nobias-w64": ("random", {**LLAMA, "width": 64}, {}),
          "llama-explicit-nobias-w64": ("explicit", {**LLAMA, "width": 64}, {}),
          "llama-cold-nobias-w256": ("random", {**LLAMA, "width": 256}, {}),
          "llama-explicit-nobias-w256": ("explicit", {**LLAMA, "width": 256}, {})}


def flags_of(start: str) -> list[str]:
    """The ``saffu train`` flags of a start's settings (``--block llama --no-output-bias``), as the
    results file and the README name it."""
    _, model, extra = STARTS[start]
    flags = [(flag_name(name, TRANSFORMER_RENAME), value) for name, value in model.items()]
    flags += [(flag_name(name), value) for name, value in extra.items()]
    return [word for flag, value in flags for word in
            ([flag if value else "--no-" + flag[2:]] if isinstance(value, bool)
             else [flag, f"{value:g}" if isinstance(value, float) else str(value)])]


#: The starts the quarter-epoch grid tunes; the others run at those values (the architecture comparison).
GRID_STARTS = ("cold", "explicit-init")
#: Each architecture's cold start, which its explicit starts race against.
COLD_OF = {"explicit-init": "cold", "llama-explicit-nobias": "llama-cold-nobias",
           "llama-explicit-nobias-rms1": "llama-cold-nobias", "llama-explicit-nobias-rms1-out": "llama-cold-nobias",
           "llama-explicit-nobias-w64": "llama-cold-nobias-w64", "llama-explicit-nobias-w256": "llama-cold-nobias-w256"}
#: The quarter-epoch grid.
GRID = {"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.0, 0.1], "dropout": [0.0, 0.1]}
#: The llama block's grid, the same for its cold and explicit starts: the weight decay starts at 0 and
#: the gpt block's tuned cold value (0.9) rather than climbing there from 0.1 again (24 probes a start).
LLAMA_GRID = {**GRID, "weight_decay": [0.0, 0.9]}
GRID_OF = {"llama-cold-nobias": LLAMA_GRID, "llama-explicit-nobias": LLAMA_GRID}
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


def parse_args(argv=None) -> Options:
    return script_options(Options, argv, __doc__.splitlines()[0])


def steps_per_epoch(workdir: Path, quick: bool) -> int:
    meta = json.loads((workdir / "meta.json").read_text())
    targets = meta["splits"][meta.get("train_split", "train_10M")]["tokens"] - 1
    return max(targets // ((4 * 32) if quick else (16 * 256)), 1)


def name_of(start: str, values: dict, epochs: float) -> str:
    parts = "_".join(f"{key[:2]}{values[key]:g}" for key in GRID)
    return f"{start}/{epochs:g}ep_{parts}"


def spec_of(args, start: str, values: dict, epochs: float) -> dict:
    """The run spec (:mod:`saffu.runner`) of ``start`` at ``values`` for ``epochs``: budgets of a
    whole epoch or more are scored on the whole dev split, probes on about 200,000 tokens."""
    init, model, extra = STARTS[start]
    steps = max(round(epochs * steps_per_epoch(args.workdir, args.quick)), 1)
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
    recorded = recorded_rows(args)
    specs = {name_of(*w): spec_of(args, *w) for w in wanted if name_of(*w) not in recorded}
    sweep(specs, args.out / "runs", args.workdir, jobs=args.jobs)


def recorded_rows(args) -> dict[str, dict]:
    """``{run name: row}`` of ``results/tuning.json``: the runs of earlier sessions, whose folders
    stay on the machine that made them. Empty for ``--quick`` and for another work directory."""
    return {} if args.quick else _recorded((ROOT / args.workdir).resolve())


@functools.cache
def _recorded(workdir: Path) -> dict[str, dict]:
    path = ROOT / "results" / "tuning.json"
    if not path.exists():
        return {}
    figures = json.loads(path.read_text())["figures"]
    if (ROOT / figures["workdir"]).resolve() != workdir:
        return {}
    rows = [row for tuned in figures["starts"].values()
            for row in [*tuned["probes"], *(r for budget in tuned["budgets"].values() for r in budget["runs"])]]
    return {row["name"]: row for row in [*rows, *(r for runs in figures["architectures"].values() for r in runs)]}


def finished(args, start: str) -> list[str]:
    """The names (``4ep_le0.01_we0.9_dr0``) of ``start``'s finished runs: this machine's and the
    recorded ones (:func:`recorded_rows`)."""
    here = {p.parent.name for p in (args.out / "runs" / start).glob("*/result.json")}
    return sorted(here | {name.split("/", 1)[1] for name in recorded_rows(args) if name.split("/", 1)[0] == start})


def _losses(args, start: str, epochs: float, run: bool, fixed: dict | None = None):
    """``combos -> [(values, dev bits per byte), …]`` of ``start``'s runs at ``epochs`` (each combo
    over ``fixed``), running the missing ones first when ``run`` (:func:`saffu.eval.race.search`)."""
    def losses(combos: list[dict]) -> list:
        wanted = [(start, {**(fixed or {}), **values}, epochs) for values in combos]
        if run:
            run_all(args, wanted)
        done = set(finished(args, start))
        return [(values, _row(args, *w)["dev_bpb"]) for values, w in zip(combos, wanted)
                if name_of(*w).split("/", 1)[1] in done]
    return losses


def tuned_grid(args, start: str, run: bool) -> tuple[dict, dict | None, list]:
    """``(grid, chosen values or None, probes)`` of ``start``'s quarter-epoch search; with
    ``run``, probes what is missing, growing the grid past an edge until the choice holds."""
    found = search(grid_of(args, start), _losses(args, start, args.share, run), extend=run)
    if found.why:
        print(f"{start}: {found.why}")
    return found.grid, found.chosen, found.probes


def budget_rates(args, start: str, chosen: dict, epochs: float, run: bool) -> tuple[list, dict | None, list]:
    """``(rates, chosen values or None, runs)`` of ``start`` at ``epochs``: the tuned rate and its
    ½× and 2× neighbours, grown past an edge while running (and, reporting, as far as runs exist);
    the weight decay and dropout stay the grid's."""
    rates = sorted({round(chosen["learning_rate"] * f, 12) for f in (0.5, 1.0, 2.0)})
    found = search({"learning_rate": rates}, _losses(args, start, epochs, run, chosen), extend=run,
                   rules=GROW_BY_TWO, max_values=6)
    if found.why:
        print(f"{start} at {epochs:g} epochs: {found.why}")
    runs = [({**chosen, **values}, loss) for values, loss in found.probes]
    return found.grid["learning_rate"], {**chosen, **found.chosen} if found.chosen else None, runs


def report(args) -> dict:
    """``results/tuning.json``: each tuned start's grid, chosen values and longer budgets (the
    starts asked for, and every start of :data:`GRID_OF` whose grid has probes), every other run
    of a whole epoch or more as its architecture's rows, and the race (:func:`race`)."""
    starts = {}
    has_grid = lambda start: any(_epochs(name) == args.share for name in finished(args, start))
    for start in dict.fromkeys([*args.starts, *(s for s in GRID_OF if has_grid(s))]):
        grid, chosen, probes = tuned_grid(args, start, run=False)
        budgets = {}
        if chosen is not None:
            for epochs in args.epochs:
                rates, best, runs = budget_rates(args, start, chosen, epochs, run=False)
                if runs:
                    budgets[f"{epochs:g}"] = {"rates": rates, "chosen": best, "runs": [_row(args, start, v, epochs)
                                                                                      for v, _ in runs]}
        starts[start] = {"grid": grid, "chosen": chosen, "probes": [_row(args, start, v, args.share) for v, _ in probes],
                         "budgets": budgets}
    others = {}
    for start in STARTS:        # each run of an epoch or more that no tuned budget above holds
        if start in args.starts:
            continue
        tuned = {r["name"] for b in starts.get(start, {}).get("budgets", {}).values() for r in b["runs"]}
        names = [name for name in finished(args, start) if _epochs(name) >= 1 and f"{start}/{name}" not in tuned]
        if names:
            others[start] = [_row(args, start, _values(name), _epochs(name)) for name in names]
    figures = {"protocol": {"grid": GRID, "share_epochs": args.share, "budget_epochs": args.epochs,
                            "probe_figure": "dev bits per byte on about 200,000 tokens of whole dev documents",
                            "budget_figure": "dev bits per byte on the whole dev split"},
               "workdir": str(args.workdir), "starts": starts, "architectures": others,
               "flags": {start: flags_of(start) for start in STARTS}}
    figures["race"] = race(figures)
    figures["plot"] = plot(figures["race"], (args.out if args.quick else ROOT / "docs" / "results") / "tuning.png",
                           tuple(start for start, t in starts.items() if t["chosen"]))
    if args.quick:      # a check: its figures stay beside its runs, never in results/
        atomic_write_json(args.out / "tuning.json", figures)
        print(f"wrote {args.out / 'tuning.json'}")
        return figures
    path = write_result("tuning", figures, seeds=[0], load={
        "note": "two runs at a time, one per core (taskset), other work sharing the machine at times; each run's "
                "seconds are in its row"})
    print(f"wrote {path}")
    return figures


def _values(name: str) -> dict:
    """A run folder's name (``4ep_le0.01_we0.9_dr0``) back to its values."""
    parts = name.split("_")[1:]
    return {key: float(part[2:]) for key, part in zip(GRID, parts)}


def _epochs(name: str) -> float:
    return float(name.split("ep_")[0])


def compute(row: dict) -> float:
    """A run's FLOPs with its explicit solve (:func:`saffu.eval.race.compute_with_solve`)."""
    return compute_with_solve(row["flops"], row["train_seconds"], row.get("solve_seconds", 0.0))


def race(figures: dict) -> dict:
    """Each explicit start's multiplier at each budget (its best run there) against its
    architecture's cold curve (the best cold run of each budget of a whole epoch or more),
    :func:`saffu.eval.race.multiplier`; and every such run's train–dev gap (nats)."""
    rows = {start: [r for b in tuned.get("budgets", {}).values() for r in b["runs"]]
            for start, tuned in figures["starts"].items()}
    for start, runs in figures["architectures"].items():     # a tuned start's other runs join its budgets'
        rows[start] = rows.get(start, []) + runs
    best = {}
    for start, runs in rows.items():
        for r in runs:
            if r["epochs"] >= 1 and (r["epochs"] not in best.get(start, {}) or
                                     r["dev_bpb"] < best[start][r["epochs"]]["dev_bpb"]):
                best.setdefault(start, {})[r["epochs"]] = r
    out = {}
    for start, cold in COLD_OF.items():
        if start not in best or cold not in best:
            continue
        curve = sorted((compute(r), r["dev_bpb"]) for r in best[cold].values())
        for epochs, r in sorted(best[start].items()):
            m = multiplier(curve, r["dev_bpb"], compute(r))
            out.setdefault(start, []).append({
                "epochs": epochs, "name": r["name"], "dev_bpb": r["dev_bpb"], "compute": compute(r),
                "multiplier": m.value, "multiplier_kind": m.kind, "cold_compute": m.cold_compute, "cold": cold,
                "cold_curve": curve, "gap_nats": r["dev_loss"] - r["train_loss"],
                "cold_gap_nats": best[cold][epochs]["dev_loss"] - best[cold][epochs]["train_loss"]
                if epochs in best[cold] else None})
    return out


def plot(race_rows: dict, path: Path, tuned: tuple[str, ...] = ()) -> str:
    """One panel per cold start the race measured against: its cold curve (dev bits per byte
    against compute; ``tuned``: the cold starts with a grid of their own, the others run at
    another's values) and each explicit start's best run of each budget, the epochs by the
    points; written to ``path`` (PNG). Returns the path (from the project root where it is inside
    it); ``""`` and no file when the race has no rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colds = list(dict.fromkeys(r["cold"] for rows in race_rows.values() for r in rows))
    if not colds:
        return ""
    figure, axes = plt.subplots(1, len(colds), figsize=(4.2 * len(colds), 4), squeeze=False)
    for axis, cold in zip(axes[0], colds):
        curve = next(r["cold_curve"] for rows in race_rows.values() for r in rows if r["cold"] == cold)
        how = "tuned" if cold in tuned else "width 128’s values"
        axis.plot(*zip(*curve), marker="o", color="tab:gray", label=f"{cold} ({how})")
        for start, rows in race_rows.items():
            mine = [r for r in rows if r["cold"] == cold]
            if mine:
                axis.plot([r["compute"] for r in mine], [r["dev_bpb"] for r in mine], marker="s", label=start)
                for r in mine:
                    axis.annotate(f"{r['epochs']:g}", (r["compute"], r["dev_bpb"]), textcoords="offset points",
                                  xytext=(4, 4), fontsize=7)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())       # the decades' labels only
        axis.set_xlabel("compute: training FLOPs + the explicit solve's share")
        axis.set_title(" ".join(flags_of(cold)) or "gpt block, width 128", fontsize=9)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("whole-dev bits per byte")
    figure.suptitle("babylm-2023-4src: each explicit start against its architecture's cold curve "
                    "(epochs by the points)", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _row(args, start: str, values: dict, epochs: float) -> dict:
    """A finished run's row: from its folder, else as :func:`recorded_rows` holds it."""
    name = name_of(start, values, epochs)
    if not (args.out / "runs" / name / "result.json").exists():
        return recorded_rows(args)[name]
    result = json.loads((args.out / "runs" / name / "result.json").read_text())
    history = [json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {"name": name, **values, "epochs": epochs, "dev_bpb": result["dev_bpb"], "dev_loss": result["dev_loss"],
            "train_loss": history[-1]["train_loss"], "last_dev_window_loss": history[-1]["dev_loss"],
            "steps": result["steps"], "train_seconds": history[-1]["seconds"],   # also of a run resumed at its end
            "solve_seconds": result.get("solve_seconds", 0.0), "flops": result.get("flops"),
            "dev_whole_split": result.get("dev_whole_split"), "flags": flags_of(start),
            **({"rescored": result["rescored"]} if "rescored" in result else {}),
            "command": _command(args, args.out / "runs" / name)}


def _command(args, folder: Path) -> str:
    """How a run was started: the runner's command."""
    return shlex.join(["python", *command(folder, args.workdir)[1:]])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.share, args.epochs = 0.25, [1.0]
        if not (args.workdir / "meta.json").exists():
            subprocess.run([sys.executable, "-m", "saffu", "prepare", "--corpus", str(DEFAULT_CORPUS),
                            "--workdir", str(args.workdir),
                            "--vocab-size", "512", "--allow-smaller-vocab", "--quiet"], check=True)
        args.phase = args.phase or "grid"
    if not args.report and not args.phase:
        raise SystemExit("give --phase grid, --phase budgets or --report")
    if args.phase == "grid":      # every start's grid in one queue (no core waits), then each grows past its edges
        run_all(args, [(start, values, args.share) for start in args.starts
                     for values in combinations(grid_of(args, start))])
        for start in args.starts:
            print(f"{start}: {tuned_grid(args, start, run=True)[1]}", flush=True)
    elif args.phase == "budgets":
        chosen = {start: tuned_grid(args, start, run=False)[1] for start in args.starts}
        if None in chosen.values():
            raise SystemExit("the grid phase has not chosen every start's values yet (--phase grid)")
        # the tuned rate of every start first (a comparison as soon as one round ends), then the neighbours
        first = [(start, {**values, "learning_rate": round(values["learning_rate"] * f, 12)}, epochs)
                 for epochs in args.epochs for f in (1.0, 2.0, 0.5) for start, values in chosen.items()]
        run_all(args, first)
        for start, values in chosen.items():
            for epochs in args.epochs:
                print(f"{start} at {epochs:g} epochs: {budget_rates(args, start, values, epochs, run=True)[1]}",
                      flush=True)
    if args.report or args.quick:
        report(args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SaffuError as error:         # a failed run: the runner names it and its log
        sys.exit(f"tune.py: {error}")
