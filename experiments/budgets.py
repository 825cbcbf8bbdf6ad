"""Does the explicit start last? A budget sweep of the transformer and its compute multiplier.

Starts of the project's transformer (width 128 or 256, 5 blocks, the gpt block with an output
bias), each a run spec of ``saffu train`` (:func:`spec_of`) that :mod:`saffu.runner` trains in
its own folder: ``cold`` (random init), ``explicit-init`` (output bias, embeddings and output
kernel from the explicit factors at the random init's scale), ``explicit-init-rms1`` (its
embeddings at RMS 1.0), ``residual`` (a transformer over the frozen exact model, ``saffu exact``
of the training split, made here unless ``--exact-run``) and ``residual-crossfit`` (the residual
cross-fitted over 2 folds; ``-k4`` / ``-k8``: 4 and 8). Another architecture: penzai's
Llama-like transformer of :mod:`any_model`, random (``llama-random``) against explicit init
(``llama-explicit``); an explicit start's multiplier is against the random init of its own
architecture. Budgets of 1, 2 and 4 epochs, each its own run with its own warm-up and cosine
schedule; width 256 at 1 and 2 epochs; a second seed (:data:`GRID`; beyond it, :data:`EXTRA`).
Each run is scored on the whole dev split; finished runs are skipped, interrupted ones resume,
and ``results/budgets.json`` keeps the rows of earlier sessions, whose run folders stayed on
their machine.

Compute multiplier of an explicit run: the compute a cold start of the same width needs to reach
its final dev loss, divided by the explicit run's compute *with its solve*. Cold's need is read off
the cold runs' final dev bits per byte against their compute, interpolated linearly in log
compute; where cold never gets that low within the sweep, the multiplier is a lower bound (cold's
largest compute over the explicit run's); where the explicit run is worse than cold's smallest
budget, an upper bound. A run's compute is its training FLOPs (analytic, forward and backward)
plus its solve seconds at that run's own training FLOPs per second (what the trainer would have
done in the time the solve took).

    python experiments/budgets.py --workdir runs/babylm --out runs/budgets --plan
    python experiments/budgets.py --workdir runs/babylm --out runs/budgets --next 2 --jobs 2
    python experiments/budgets.py --workdir runs/babylm --out runs/budgets --runs cold:4:128:0
    python experiments/budgets.py --out runs/budgets --report      # results/budgets.json, the plot, the table
    python experiments/budgets.py --workdir runs/quick --out runs/budgets-quick --quick \
        --runs cold:1:16:0 residual-crossfit:1:16:0 --report --no-write          # a check: a minute

A real vocabulary size: the same runs on a work directory of another vocabulary (``babylm50k``:
``saffu prepare ... --vocab-size 50000 --allow-smaller-vocab``, which the corpus caps at
30,433) go to their own ``--out``; every row records its vocabulary, the multipliers compare
runs of one width and one vocabulary, and ``--report --also`` gathers several ``--out``::

    python experiments/budgets.py --workdir runs/babylm50k --out runs/budgets50k --runs cold:1:128:0
    python experiments/budgets.py --out runs/budgets --also runs/budgets50k --report
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from pathlib import Path

import any_model

from saffu._io import SaffuError
from saffu.data.workdir import open_workdir
from saffu.eval import race
from saffu.eval.plots import Series, plot_against_compute
from saffu.flags import script_main, script_options
from saffu.runner import final_figures, history, joined, recorded, steps_per_epoch, sweep, write_result

RESULTS = Path(__file__).resolve().parents[1] / "results"

#: The vocabulary of the work directory every run made before rows recorded their own
#: (babylm-2023-4src, BPE 8,192).
FIRST_VOCAB = 8192

#: The learning rate of each start: an earlier probe (25% of the training data, rates 0.003 /
#: 0.01 / 0.03, one epoch, seed 0; its losses are ``probes`` in ``results/budgets.json``) chose
#: 0.01 for cold and explicit init, 0.003 for both residuals and 0.03 for ``explicit-init-rms1``.
#: The Llama-like starts run at the rate :mod:`any_model` gives both of its inits (the project
#: transformer's cold and explicit rate; not probed for that architecture).
RATES = {"cold": 0.01, "explicit-init": 0.01, "residual": 0.003, "residual-crossfit": 0.003,
         "residual-crossfit-k4": 0.003, "residual-crossfit-k8": 0.003, "explicit-init-rms1": 0.03,
         "llama-random": any_model.LEARNING_RATE, "llama-explicit": any_model.LEARNING_RATE}
STARTS = tuple(RATES)
EXPLICIT = ("explicit-init", "residual", "residual-crossfit", "residual-crossfit-k4", "residual-crossfit-k8",
            "explicit-init-rms1", "llama-explicit")
#: The cross-fitted residual's starts: ``{start: its folds K}`` (``saffu train --cross-fit K``;
#: the more folds, the more of the training split each fold's exact model counted, the nearer the
#: tables it trains on are to the whole split's it is scored with). The K = 4 and 8 starts run at
#: the rate the probe chose for K = 2.
CROSSFIT_FOLDS = {"residual-crossfit": 2, "residual-crossfit-k4": 4, "residual-crossfit-k8": 8}
#: Starts of another architecture: ``{start: (any_model's model, its init)}``, its own cold start the random one.
MODEL_STARTS = {"llama-random": ("llama", "random"), "llama-explicit": ("llama", "explicit")}
#: What each architecture of the sweep is, as the results page names it.
ARCHITECTURE_NAMES = {"saffu": "the project's transformer", "llama": "penzai's Llama-like transformer"}
#: The starts the issue's sweep asks for; ``explicit-init-rms1`` (explicit init with the embeddings
#: at RMS 1.0 instead of the random init's) runs beyond it, in :data:`EXTRA`.
GRID_STARTS = ("cold", "explicit-init", "residual", "residual-crossfit")


#: The cold start of each start's architecture, which an explicit start's multiplier and steps are
#: measured against: the random init of the same model for a start of :data:`MODEL_STARTS` (a random
#: init is its own cold start); ``"cold"`` for the project's transformer (``COLD_OF.get(start, "cold")``).
COLD_OF = {start: next(name for name, (other, init) in MODEL_STARTS.items() if other == model and init == "random")
           for start, (model, _) in MODEL_STARTS.items()}


def grid() -> list[tuple[str, int, int, int]]:
    """The sweep's runs, ``(start, epochs, width, seed)``, cheapest first."""
    runs = [(start, epochs, 128, 0) for epochs in (1, 2, 4) for start in GRID_STARTS]
    runs += [(start, epochs, 256, 0) for epochs in (1, 2) for start in ("cold", "explicit-init", "residual-crossfit")]
    runs += [("cold", 4, 128, 1), ("explicit-init", 4, 128, 1)]
    return sorted(runs, key=lambda run: (run[1] * (run[2] / 128) ** 2, STARTS.index(run[0]), run[3]))


GRID = grid()
#: Runs beyond the issue's sweep: explicit init with the embeddings at RMS 1.0 at width 128, a
#: second seed of cold and explicit init at one epoch (the headline budget's seed-to-seed noise),
#: the cross-fitted residual over 4 and 8 folds at one epoch, and the Llama-like transformer's
#: random and explicit init at 1 and 2 epochs.
EXTRA = ([("explicit-init-rms1", epochs, 128, 0) for epochs in (1, 2, 4)]
         + [("cold", 1, 128, 1), ("explicit-init", 1, 128, 1)]
         + [("residual-crossfit-k4", 1, 128, 0), ("residual-crossfit-k8", 1, 128, 0)]
         + [(start, epochs, 128, 0) for epochs in (1, 2) for start in MODEL_STARTS])


#: ``--quick``: a one-block model on short windows, a small explicit holdout (a check on a tiny corpus).
QUICK = {"model": {"layers": 1, "heads": 2, "context_tokens": 8}, "train": {"seq_len": 32, "batch_size": 4},
         "options": {"holdout_tokens": 256}}


def spec_of(start: str, epochs: int, width: int, seed: int, rate: float, workdir: Path, exact: Path,
            quick: bool = False) -> dict:
    """The run spec (:mod:`saffu.runner`) of a start: ``epochs`` of ``workdir``'s training split
    at 16 × 256 targets a step, its dev loss on 128 dev windows every 50 steps, scored on the whole
    dev split; a residual over the exact run ``exact``; a start of :data:`MODEL_STARTS` is
    :mod:`any_model`'s model and start (``quick``: :data:`QUICK`'s settings over these)."""
    model = any_model.model_section(MODEL_STARTS[start][0]) if start in MODEL_STARTS else \
        {"kind": "transformer", "block": "gpt", "output_bias": True, "across_documents": False}
    init = MODEL_STARTS.get(start, ("", "explicit" if start.startswith("explicit") else "random"))[1]
    start_section, options = {"init": init, "model": model["kind"]}, {}
    if start == "explicit-init-rms1":
        start_section["explicit_embedding_rms"] = 1.0
    if start in MODEL_STARTS and init == "explicit":     # any_model's: the embeddings (at RMS 1) and output kernel
        start_section.update(explicit_pieces=["embeddings", "output"], explicit_embedding_rms=any_model.EMBEDDING_RMS)
    if start.startswith("residual"):
        start_section["residual"] = str(Path(exact).resolve())
        options = {"residual_scale": "fixed", "cross_fit": CROSSFIT_FOLDS.get(start, 0)}
    small = QUICK if quick else {}
    train = {"seq_len": 256, "batch_size": 16, **small.get("train", {})}
    return {"start": start_section, "options": {**options, **small.get("options", {})}, "eval": {"eval_tokens": 0},
            "model": {**model, "width": width, "layers": 5, **small.get("model", {})},
            "train": {**train, "steps": epochs * steps_per_epoch(workdir, train["seq_len"] * train["batch_size"]),
                      "learning_rate": rate, "seed": seed, "eval_every": 50, "eval_windows": 128,
                      "checkpoint_every": 200}}


def folder_name(start: str, epochs: int, width: int, seed: int, rate: float) -> str:
    """A run's folder under ``OUT/runs``: ``cold_e4_w128_s0_lr0.01``."""
    return f"{start}_e{epochs}_w{width}_s{seed}_lr{rate:g}"


NAME = re.compile(r"(?P<start>[a-z0-9-]+)_e(?P<epochs>\d+)_w(?P<width>\d+)_s(?P<seed>\d+)_lr(?P<rate>[0-9.e-]+)")


#: The sweep's name of each multiplier kind of :mod:`saffu.eval.race` (its rows keep these words):
#: the cold curve reaches the run's figure inside it, only beyond its largest compute (a lower
#: bound) or before its smallest (an upper bound).
HOW = {race.MEASURED: "interpolated", race.LOWER_BOUND: "beyond", race.UPPER_BOUND: "before"}


def colds(row: dict, rows: list[dict], *same: str) -> list[dict]:
    """The runs of ``row``'s cold start (:data:`COLD_OF`) of its vocabulary and width, and of its
    ``same`` settings too (``"epochs"``, ``"seed"``: the cold run of its budget)."""
    return [r for r in rows if r["start"] == COLD_OF.get(row["start"], "cold")
            and all(r[k] == row[k] for k in ("vocab_size", "width", *same))]


def share_of_steps_to_cold(row: dict, rows: list[dict]) -> tuple[float | None, str]:
    """The share of an explicit run's steps it took to reach the final periodic dev loss of the
    cold run of the same budget (vocabulary, width, epochs, seed), read off both runs' curves of
    the same dev windows, and the table's text of it; ``None`` when a curve is missing (the text
    "–") or the run never got there ("not reached")."""
    cold = next((r for r in colds(row, rows, "epochs", "seed") if r.get("curve")), None)
    if cold is None or not row.get("curve"):
        return None, "–"
    step = race.steps_to_reach(row["curve"], cold["curve"][-1][1])
    return (None, "not reached") if step is None else (step / row["steps"], f"{step / row['steps']:.0%}")


DERIVED = ("cold_compute_to_match", "multiplier", "multiplier_is", "multiplier_text", "share_of_steps_to_cold",
           "steps_to_cold_text", "at_probed_rate")


def key(row: dict) -> tuple:
    return row["start"], row["epochs"], row["width"], row["seed"], row["learning_rate"], row["vocab_size"]


def recorded_rows() -> list[dict]:
    """The rows ``results/budgets.json`` already holds (runs of earlier sessions, whose run
    folders stayed on their machine), without what :func:`report` derives from all rows."""
    return [{"vocab_size": FIRST_VOCAB, **{k: v for k, v in row.items() if k not in DERIVED}}
            for row in recorded(RESULTS / "budgets.json").get("rows", [])]


def _row(folder: Path, out: Path) -> dict | None:
    """The row of a finished run folder of the sweep under ``out`` (a run of :func:`spec_of`): its
    settings from its name, its vocabulary from its config, its figures
    (:func:`saffu.runner.final_figures`), compute, periodic dev curve and the command that
    reproduces it; ``None`` for any other folder."""
    r = json.loads((folder / "result.json").read_text())
    match = NAME.fullmatch(folder.name)
    if not (folder / "spec.json").exists() or not match or match["start"] not in STARTS:
        return None
    config = json.loads((folder / "config.json").read_text())
    row = {"start": match["start"], "epochs": int(match["epochs"]), "width": int(match["width"]),
           "seed": int(match["seed"]), "learning_rate": float(match["rate"]),
           "trained_params": r.get("trained_params", r["params"]),     # a residual's vocabulary: its base's
           "vocab_size": config["model"].get("vocab_size") or config["model"]["base"]["vocab_size"]}
    records = history(folder)
    row.update(final_figures(r, records))
    finished = datetime.datetime.fromtimestamp((folder / "result.json").stat().st_mtime, datetime.UTC)
    row.update(compute=race.row_compute(row), finished=finished.isoformat(timespec="seconds"),
               curve=[(h["step"], h["dev_loss"]) for h in records if h.get("dev_loss") is not None],
               reproduce=f"python experiments/budgets.py --workdir {config['workdir']} --out {out} "
                         f"--runs {row['start']}:{row['epochs']}:{row['width']}:{row['seed']}"
                         + ("" if row["learning_rate"] == RATES[row["start"]] else f":{row['learning_rate']:g}"))
    return row


def gathered_rows(*outs: Path, earlier: bool = True) -> list[dict]:
    """One row per finished run of the sweep: this machine's under each ``out/runs`` (:func:`_row`),
    then (``earlier``) the rows of ``results/budgets.json`` from earlier sessions that none of them
    holds; without what :func:`report` derives from all rows."""
    here = [_row(path.parent, out) for out in outs for path in sorted((out / "runs").glob("*/result.json"))]
    return joined([row for row in here if row is not None], recorded_rows() if earlier else [], key)


def report(out: Path, write: bool = True, also: tuple[Path, ...] = (), earlier: bool = True) -> dict:
    """Every finished run of the sweep (:func:`gathered_rows` of ``out`` and each of ``also``, and
    ``earlier`` sessions' rows) with the multipliers, ``results/budgets.json`` and ``docs/results/budgets.png``."""
    rows = gathered_rows(out, *also, earlier=earlier)
    if not rows:
        raise SystemExit(f"no finished runs under {out / 'runs'} or in {RESULTS / 'budgets.json'}")
    rows.sort(key=lambda row: (row["vocab_size"], row["width"], row["epochs"], STARTS.index(row["start"]),
                               row["seed"], row["learning_rate"]))
    for row in rows:
        # a run at another rate than its start's probe chose is measured and listed, never a start's figure
        row["at_probed_rate"] = row["learning_rate"] == RATES[row["start"]]
        # what the results page reads a row's architecture ("saffu": the project's transformer, else the
        # any_model model it trains) and its cold start from
        row.update(architecture=MODEL_STARTS.get(row["start"], ("saffu",))[0],
                   cold_start=COLD_OF.get(row["start"], "cold"), folds=CROSSFIT_FOLDS.get(row["start"], 0))
        row["architecture_name"] = ARCHITECTURE_NAMES[row["architecture"]]
        cold = race.mean_curve(colds(row, rows))        # the cold start's budgets, seeds averaged
        if row["start"] in EXPLICIT and cold:
            found = race.multiplier(cold, row["dev_bpb"], row["compute"])
            row.update(cold_compute_to_match=found.cold_compute, multiplier=found.value, multiplier_is=HOW[found.kind],
                       multiplier_text=race.bound_text(found.value, found.kind))
        if row["start"] in EXPLICIT:
            row["share_of_steps_to_cold"], row["steps_to_cold_text"] = share_of_steps_to_cold(row, rows)
    for row in rows:
        print(f"V {row['vocab_size']:,} width {row['width']} {row['epochs']} epochs {row['start']} seed {row['seed']} lr "
              f"{row['learning_rate']:g}: dev {row['dev_bpb']:.4f} bits/byte, multiplier {row.get('multiplier_text', '–')}")
    if write:
        figure = _plot(rows, RESULTS.parent / "docs" / "results" / "budgets.png")
        # the learning-rate probes of earlier sessions (per start its losses by rate, the best, the share of train)
        write_result(RESULTS, "budgets", {"rows": rows, "plot": figure,
                                 "probes": recorded(RESULTS / "budgets.json").get("probes", {})},
                     seeds=sorted({r["seed"] for r in rows}),
                     load={"note": "each run's seconds were measured with one run per core and other runs or "
                                   "development work sharing the machine at times; FLOPs are analytic; each row "
                                   "carries the command that reproduces it and when it finished"})
    return {"rows": rows}


def _plot(rows: list[dict], path: Path) -> str:
    colours = {"cold": "tab:gray", "explicit-init": "tab:blue", "residual": "tab:red", "residual-crossfit": "tab:brown",
               "residual-crossfit-k4": "tab:orange", "residual-crossfit-k8": "tab:pink",
               "explicit-init-rms1": "tab:cyan", "llama-random": "tab:olive", "llama-explicit": "tab:green"}
    main = lambda r: r["seed"] == 0 and r["at_probed_rate"]     # on the lines; the others as open markers
    groups = {}     # per start: its widths of the first vocabulary, then the other vocabularies; by compute
    for r in sorted(rows, key=lambda r: (STARTS.index(r["start"]), r["vocab_size"] != FIRST_VOCAB, r["vocab_size"],
                                         r["width"], not main(r), r["compute"])):
        groups.setdefault((r["start"], r["width"], r["vocab_size"], main(r)), []).append(r)
    series = []
    for (start, width, vocab, on_line), points in groups.items():      # each point's budget by it
        first = vocab == FIRST_VOCAB        # width 128 circles, 256 squares; another vocabulary's dashed, triangles
        style = {"marker": ("o" if width == 128 else "s") if first else "^", "color": colours[start],
                 **({"linestyle": "-" if first else "--"} if on_line else {"linestyle": "none", "markerfacecolor": "none"})}
        series.append(Series([(r["compute"], r["dev_bpb"]) for r in points],
                             f"{start}, width {width}" + ("" if first else f", V {vocab:,}") if on_line else None,
                             style, [f"{r['epochs']}" for r in points], {"fontsize": 7, "color": colours[start]}))
    epochs = " / ".join(str(e) for e in sorted({r["epochs"] for r in rows}))
    seeds = sorted({r["seed"] for r in rows})
    title = (f"babylm-2023-4src: dev loss against compute, {epochs} epochs (the numbers by the points)\n"
             + "open markers: " + ("seed " + ", ".join(str(s) for s in seeds[1:]) + " or " if len(seeds) > 1
                                   else "") + "another learning rate than the start's probe chose")
    plot_against_compute(path, [(title, series)], xlabel="compute: training FLOPs + the solve at the run's FLOPs/s",
                         ylabel="whole-dev bits per byte", panel_size=(10, 4.5), title_size=10,
                         legend={"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}, decades_only=False)
    return str(path.relative_to(RESULTS.parent))


@dataclasses.dataclass
class Options:
    """The sweep's runs to plan, train or report.

    Attributes:
      workdir: the prepared work directory (babylm-2023-4src, BPE 8,192)
      out: runs go here
      plan: list the sweep's runs and which are finished
      next: run the next N unfinished runs of the sweep
      runs: run these (e.g. cold:4:128:0), each at its start's rate (RATES) unless LR is given
      exact_run: the residual starts' `saffu exact` run of the whole training split (default: OUT/exact/1, made
        there unless it exists)
      jobs: runs at once, one per core
      quick: a one-block model on short windows (a check on a tiny corpus; its runs go to their own --out, its
        report is printed only, without earlier sessions' rows)
      report: gather the finished runs (results/budgets.json)
      also: with --report: further --out folders (e.g. the runs of another vocabulary)
      write: with --report: write results/budgets.json and the plot (--no-write: print only)
    """

    workdir: Path | None = None
    out: Path = Path("runs/budgets")
    plan: bool = False
    next: int = 0
    runs: tuple[str, ...] = dataclasses.field(default=(), metadata={"nargs": "+",
                                                                     "metavar": "START:EPOCHS:WIDTH:SEED[:LR]"})
    exact_run: Path | None = None
    jobs: int = 1
    quick: bool = False
    report: bool = False
    also: tuple[Path, ...] = dataclasses.field(default=(), metadata={"nargs": "+"})
    write: bool = True


def run_of(spec: str) -> tuple[str, int, int, int, float]:
    """A ``--runs`` spec ``START:EPOCHS:WIDTH:SEED[:LR]`` as ``(start, epochs, width, seed, rate)``
    (the rate its start's, :data:`RATES`, unless LR is given)."""
    start, *numbers = spec.split(":")
    if start not in STARTS:
        raise SaffuError(f"unknown start {start!r} in {spec!r}; one of {', '.join(STARTS)}")
    try:
        (epochs, width, seed), rate = map(int, numbers[:3]), float(numbers[3]) if len(numbers) > 3 else RATES[start]
        if len(numbers) > 4 or not rate > 0:
            raise ValueError
    except ValueError:
        raise SaffuError(f"--runs takes START:EPOCHS:WIDTH:SEED or START:EPOCHS:WIDTH:SEED:LR (LR > 0), "
                         f"got {spec!r}") from None
    return start, epochs, width, seed, rate


def check(options: Options) -> None:
    """Every ``--runs`` spec well-formed (:func:`run_of`); ``--workdir`` given when there is training to do."""
    for spec in options.runs:
        run_of(spec)
    if (options.runs or options.next > 0) and options.workdir is None:
        raise SaffuError("--workdir is required to train")


def train(todo: list[tuple[str, int, int, int, float]], args) -> None:
    """Train the runs ``todo`` through :func:`saffu.runner.sweep` (``--jobs`` at a time), the
    exact run of the residual starts first where one is missing."""
    from saffu.runner import exact_run
    exact = args.exact_run or args.out / "exact" / "1"
    if any(run[0].startswith("residual") for run in todo):
        exact_run(args.workdir, exact)
    specs = {folder_name(*run): spec_of(*run, args.workdir, exact, args.quick) for run in todo}
    sweep(specs, args.out / "runs", args.workdir, jobs=args.jobs)


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0], check=check)
    vocab = FIRST_VOCAB if args.workdir is None else open_workdir(args.workdir).vocab_size
    rows = {key(row): row for row in gathered_rows(args.out, earlier=not args.quick)}   # this machine's, earlier sessions'
    finished = lambda run: rows.get((*run, RATES[run[0]], vocab))
    line = lambda run: (f"{run[0]:>18}  {run[1]} epochs  width {run[2]}  seed {run[3]}  lr {RATES[run[0]]:g}: "
                        + (f"dev {finished(run)['dev_bpb']:.4f} bits/byte" if finished(run) else "to run"))
    if args.plan:
        print(*map(line, GRID), "beyond the issue's sweep (--runs):", *map(line, EXTRA), sep="\n")
    todo = [run_of(spec) for spec in args.runs]
    todo += [(*run, RATES[run[0]]) for run in GRID if finished(run) is None][:args.next]
    if todo:
        train(todo, args)
    if args.report:
        report(args.out, write=args.write and not args.quick, also=args.also, earlier=not args.quick)


if __name__ == "__main__":
    script_main(main)
