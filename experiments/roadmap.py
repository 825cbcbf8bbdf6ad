"""Roadmap sweep: 100+ explicit-only SAFFU variants on one slice, ranked by dev bits per byte.

Every variant comes with its parameter count, and the variants that are best per parameter
(the Pareto front of bits per byte against parameters) are listed and plotted.

The training split is cut to ``--train-tokens`` (whole documents from evenly spaced blocks of
the stream, :func:`saffu.data.workdir.subset_workdir`) and the dev split to ``--dev-tokens`` the
same way, so every variant is solved and scored on the same data and bits per byte stays
exact (the subset's byte count is recomputed). The grid varies, around the default
(M = 8, b = 128, 1 head, 2 positions, direct output, linear value, μ = 3000, calibrated β):

* radius ``M`` × bits ``b`` (the cipher width, ≥ :func:`saffu.engine.codes.min_bits` of ``V``),
* output positions ``P`` × bits, heads × bits, log-space value × bits,
* Dirichlet strength μ × bits, no calibration (β = 1, ``holdout_tokens = 0``) × bits,
* the chain output (``hidden = K = b + 1``, what the explicit chain supports) × bits,
* a few combinations of the factors above aimed at small or strong models.

The grid was sized to finish in under an hour on 2 shared CPU cores with the default slice:
Newton's calibration costs ``O(G²)`` per holdout token for ``G`` output groups, so wide
direct outputs (8 positions, 2 heads + 4 positions) appear only with small ``b``.

Each variant is :func:`saffu.solve.stack.solve_explicit` followed by a dev evaluation, in this
process (no subprocesses). Nothing counted is shared between variants: every stage after the
first reads the weights solved before it (which depend on μ, ``M`` and ``b``), and the counted
range depends on the holdout, so only stage 1 could be shared and it costs under a second.
Newton calibration of the direct form is capped at ``--calibration-iterations`` (default 2:
Newton converges quadratically from β = 1 — on the 1M-token slice the temperatures of the
b = 16 default agree to 1e-4 after 2 and 4 steps — and each step costs about as much as all
the counting passes of a small model); the chain's L-BFGS keeps the solver's 12 iterations. The dev
evaluation is :func:`saffu.eval.scoring.evaluate_split` of the whole split, whose loss takes the
parameters as arguments, so it compiles once per shape instead of once per variant.

Results are appended per variant to ``variants.jsonl`` (with a fingerprint of the slice and
its solver settings), so a rerun skips every finished variant whose slice and settings match.
Outputs in ``--out``: ``results.json`` (every variant, ranked), ``bpb_vs_params.png`` (log x,
Pareto front highlighted), ``factors.png`` (one panel per swept factor), a Markdown table of
the top 20 and of the Pareto front on stdout, and ``--metrics-json`` with the headline figures.

    python experiments/roadmap.py --workdir runs/babylm --out runs/roadmap
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError, atomic_write_json, write_metrics
from saffu.data.workdir import WorkDir, open_workdir, subset_workdir
from saffu.engine.codes import min_bits
from saffu.engine.explicit import Smoothing
from saffu.eval.scoring import evaluate_split
from saffu.models.interface import parameter_count
from saffu.models.saffu import SaffuConfig
from saffu.solve.stack import SolverConfig, solve_explicit

DEFAULT = {"radius": 8, "bits": 128, "heads": 1, "positions": 2, "hidden": 0, "value_form": "linear",
           "mu": 3000.0, "holdout_tokens": 16_384}
#: Swept factors: (variant key, panel title, how a value is shown).
FACTORS = [("radius", "radius M", str), ("bits", "cipher bits b", str), ("heads", "heads", str),
           ("positions", "output positions P (direct)", str), ("form", "output form", str),
           ("value_form", "value form", str), ("mu", "smoothing μ", lambda v: f"{v:g}"),
           ("calibrated", "temperature calibration", lambda v: "on" if v else "off (β=1)")]


def variant(**changes) -> dict:
    """A variant: the default with ``changes``; chain variants (``hidden = -1`` means
    ``K = bits + 1``) have no output positions."""
    v = {**DEFAULT, **changes}
    if v["hidden"]:
        v["hidden"] = v["bits"] + 1
        v["positions"] = 0
    v["mu"] = float(v["mu"])
    return v


def variant_name(v: dict) -> str:
    form = f"chain{v['hidden']}" if v["hidden"] else f"P{v['positions']}"
    return (f"M{v['radius']}-b{v['bits']}-H{v['heads']}-{form}-{v['value_form']}-mu{v['mu']:g}"
            f"-{'cal' if v['holdout_tokens'] else 'nocal'}")


def build_grid(vocab_size: int) -> list[dict]:
    """The sweep, in run order (the default first), without duplicates; bits below
    ``min_bits(vocab_size)`` are left out."""
    low = min_bits(vocab_size)
    ok = lambda b: b >= low
    grid = [variant()]
    # radius × bits (direct, P=2, 1 head)
    grid += [variant(radius=m, bits=b) for b in (16, 32, 64, 128) for m in (2, 4, 8, 16)]
    grid += [variant(radius=m, bits=256) for m in (8, 16)]
    grid += [variant(bits=low)] + [variant(radius=32, bits=b) for b in (32, 128)]
    # output positions × bits, heads × bits, log value × bits
    grid += [variant(positions=p, bits=b) for b in (16, 32, 64, 128) for p in (0, 1, 4)]
    grid += [variant(positions=8, bits=16)]
    grid += [variant(heads=2, bits=b) for b in (16, 32, 64, 128)] + [variant(heads=3, bits=b) for b in (16, 32, 64)]
    grid += [variant(value_form="log", bits=b) for b in (16, 32, 64, 128)] + [variant(value_form="log", heads=2, bits=32)]
    # smoothing × bits
    grid += [variant(mu=mu, bits=b) for b in (16, 32, 64, 128) for mu in (300, 1000, 10_000, 30_000)]
    grid += [variant(mu=mu, bits=low) for mu in (1000, 10_000)]
    # no calibration (β = 1) × bits, smoothing, radius, heads, positions, value form
    grid += [variant(holdout_tokens=0, bits=b) for b in (low, 16, 32, 64, 128)]
    grid += [variant(holdout_tokens=0, mu=mu, bits=b) for b in (32, 128) for mu in (1000, 10_000)]
    grid += [variant(holdout_tokens=0, bits=64, radius=m) for m in (4, 16)] + [variant(holdout_tokens=0, bits=128, radius=2)]
    grid += [variant(holdout_tokens=0, bits=32, **c) for c in ({"positions": 4}, {"heads": 2}, {"value_form": "log"})]
    grid += [variant(holdout_tokens=0, bits=16, radius=16), variant(holdout_tokens=0, bits=64, positions=1)]
    # the chain (D = K) × bits, and around it
    grid += [variant(hidden=-1, bits=b) for b in (low, 16, 32, 64)]
    grid += [variant(hidden=-1, bits=32, **c) for c in ({"heads": 2}, {"value_form": "log"}, {"radius": 16},
                                                          {"mu": 300}, {"mu": 30_000}, {"holdout_tokens": 0})]
    # combinations aimed at small or strong models
    grid += [variant(radius=16, positions=4, heads=2, bits=b) for b in (16, 32)]
    grid += [variant(radius=16, positions=1, bits=b) for b in (32, 64)]
    grid += [variant(radius=16, positions=0, heads=2, bits=64), variant(positions=0, heads=2, bits=64)]
    grid += [variant(radius=4, positions=4, bits=32), variant(positions=0, bits=256)]
    grid += [variant(bits=low, positions=4), variant(bits=low, heads=2), variant(bits=low, radius=16)]
    unique = {}
    for v in grid:
        if ok(v["bits"]):
            unique.setdefault(variant_name(v), v)
    return list(unique.values())


def predicted_seconds(v: dict) -> float:
    """A rough cost model of one variant (solve + eval on the default slice, 2 shared cores),
    for the time-left estimate only: compiles and passes plus terms in the output width."""
    K = v["bits"] + 1
    if v["hidden"]:
        return 30.0 + 0.15 * (v["heads"] + 1) * K * v["radius"] / 8
    G = v["positions"] + v["heads"]
    calibration = 3.0 + 1.3 * G * G if v["holdout_tokens"] else 0.0      # Newton's Hessian: G² per token
    passes = 2.0 + 0.012 * K * v["radius"] * (1 + 0.5 * (v["heads"] - 1))
    return passes + calibration + 4.0 + 0.012 * G * K


def model_config(v: dict, vocab_size: int) -> SaffuConfig:
    return SaffuConfig(vocab_size=vocab_size, bits=v["bits"], radius=v["radius"], heads=v["heads"],
                       positions=v["positions"], hidden=v["hidden"], value_form=v["value_form"])


def evaluate_dev(params, config: SaffuConfig, workdir: WorkDir) -> dict:
    """Loss, perplexity and bits per byte of the whole dev split
    (:func:`saffu.eval.scoring.evaluate_split`, which also counts its targets and documents)."""
    return evaluate_split(params, config, workdir, "dev", None, progress=False)


def make_slice(source: WorkDir, out: Path, train_tokens: int, dev_tokens: int) -> WorkDir:
    """The work directory every variant uses: ``source`` cut to the requested sizes (0 or at
    least the split's size: the whole split)."""
    if "dev" not in source.meta["splits"] or source.train_split == "dev":
        raise SaffuError(f"{source.path} has no dev split to rank the variants on; prepare it with one")
    train = train_tokens if 0 < train_tokens < source.split_info(source.train_split)["tokens"] else None
    dev = dev_tokens if 0 < dev_tokens < source.split_info("dev")["tokens"] else None
    if train is None and dev is None:
        return source
    name = f"slice_train{train or 'all'}_dev{dev or 'all'}"
    return subset_workdir(source, out / name, train_tokens=train, dev_tokens=dev)


def fingerprint(workdir: WorkDir) -> dict:
    """The data a variant's result depends on besides its own config and solver settings."""
    subset = workdir.meta.get("subset", {}).get("request")
    source = subset or {"source": str(workdir.path.resolve()), "seconds": workdir.meta["seconds"]}
    return {"data": source, "train_tokens": workdir.split_info(workdir.train_split)["tokens"],
            "dev_tokens": workdir.split_info("dev")["tokens"]}


def solver_settings(v: dict, newton_iterations: int) -> dict:
    """Solver options besides μ and the holdout: Newton (direct form) capped at
    ``newton_iterations``; the chain's L-BFGS keeps :class:`SolverConfig`'s default."""
    default = SolverConfig()
    return {"calibration_iterations": default.calibration_iterations if v["hidden"] else newton_iterations,
            "chunk_size": default.chunk_size}


def load_done(path: Path, stamp: dict) -> dict[str, dict]:
    """Finished variants of ``variants.jsonl`` made from the same data (the caller checks
    their solver settings)."""
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by an interrupted write
                continue
            if record.get("fingerprint") == stamp and "dev_bpb" in record:
                done[record["name"]] = record
    return done


def run_variant(v: dict, workdir: WorkDir, settings: dict) -> dict:
    config = model_config(v, workdir.vocab_size)
    solver = SolverConfig(smoothing=Smoothing(mu=v["mu"]), holdout_tokens=v["holdout_tokens"], **settings)
    tick = time.perf_counter()
    params, report = solve_explicit(workdir, config, solver, progress=False)
    solve_seconds = time.perf_counter() - tick
    tick = time.perf_counter()
    metrics = evaluate_dev(params, config, workdir)
    eval_seconds = time.perf_counter() - tick
    return {"params": parameter_count(params), **metrics, "solve_seconds": solve_seconds,
            "eval_seconds": eval_seconds, "solver": settings, "holdout_loss": report.get("block0_holdout_loss"),
            "temperatures": [report[k] for k in sorted(report) if k.startswith("block0_temperature_")],
            "stage_seconds": {k[len("seconds_block0_"):]: v for k, v in report.items()
                              if k.startswith("seconds_block0_")}}


def pareto_front(records: list[dict]) -> list[dict]:
    """Variants no other variant beats with as few or fewer parameters, by parameters."""
    front, best = [], float("inf")
    for r in sorted(records, key=lambda r: (r["params"], r["dev_bpb"])):
        if r["dev_bpb"] < best:
            front.append(r)
            best = r["dev_bpb"]
    return front


def factor_value(r: dict, key: str):
    c = r["config"]
    if key == "form":
        return "chain (D=K)" if c["hidden"] else "direct"
    if key == "calibrated":
        return bool(c["holdout_tokens"])
    if key == "positions" and c["hidden"]:
        return None
    return c[key]


def table(records: list[dict], title: str) -> str:
    lines = [f"### {title}", "",
             "| # | variant | M | b | heads | P / D | value | μ | β | params | dev bpb | dev loss | solve s | eval s |",
             "|---:|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(records, 1):
        c = r["config"]
        form = f"D={c['hidden']}" if c["hidden"] else f"P={c['positions']}"
        lines.append(f"| {i} | `{r['name']}` | {c['radius']} | {c['bits']} | {c['heads']} | {form} | "
                     f"{c['value_form']} | {c['mu']:g} | {'cal' if c['holdout_tokens'] else '1'} | "
                     f"{r['params']:,} | {r['dev_bpb']:.4f} | {r['dev_loss']:.4f} | {r['solve_seconds']:.1f} | "
                     f"{r['eval_seconds']:.1f} |")
    return "\n".join(lines)


def plot_pareto(records: list[dict], front: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 6))
    bits = sorted({r["config"]["bits"] for r in records})
    colors = {b: plt.cm.viridis(i / max(len(bits) - 1, 1)) for i, b in enumerate(bits)}
    for form, marker in (("direct", "o"), ("chain", "s")):
        subset = [r for r in records if bool(r["config"]["hidden"]) == (form == "chain")]
        ax.scatter([r["params"] for r in subset], [r["dev_bpb"] for r in subset], marker=marker, s=28,
                   c=[colors[r["config"]["bits"]] for r in subset], alpha=0.75, edgecolors="none")
    ax.step([r["params"] for r in front], [r["dev_bpb"] for r in front], where="post", color="tab:red", lw=1.5,
            label="Pareto front (best bpb for its size)")
    ax.scatter([r["params"] for r in front], [r["dev_bpb"] for r in front], facecolors="none",
               edgecolors="tab:red", s=80, lw=1.5)
    for i, r in enumerate(front):   # alternate sides so neighbours on the front stay readable
        ax.annotate(r["name"], (r["params"], r["dev_bpb"]), fontsize=6, textcoords="offset points",
                    xytext=(5, 3) if i % 2 else (-5, -8), ha="left" if i % 2 else "right")
    for b in bits:
        ax.scatter([], [], color=colors[b], label=f"b = {b}")
    ax.scatter([], [], marker="o", color="grey", label="direct output")
    ax.scatter([], [], marker="s", color="grey", label="chain output")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("dev bits per byte")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_factors(records: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(2, 4, figsize=(16, 8), sharey=True)
    rng = np.random.default_rng(0)
    for ax, (key, label, show) in zip(axes.ravel(), FACTORS):
        groups: dict = {}
        for r in records:
            value = factor_value(r, key)
            if value is not None:
                groups.setdefault(value, []).append(r["dev_bpb"])
        values = sorted(groups, key=lambda v: (isinstance(v, str), v))
        ax.boxplot([groups[v] for v in values], widths=0.5, showfliers=False)
        for i, v in enumerate(values, 1):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(groups[v])), groups[v], s=9, alpha=0.6)
        ax.set_xticks(range(1, len(values) + 1), [f"{show(v)}\n(n={len(groups[v])})" for v in values], fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].set_ylabel("dev bits per byte")
    axes[1, 0].set_ylabel("dev bits per byte")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python experiments/roadmap.py --workdir runs/babylm "
                                            "--out runs/roadmap")
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory (saffu prepare)")
    parser.add_argument("--out", type=Path, default=Path("runs/roadmap"),
                        help="output folder: the slice, variants.jsonl, results.json, PNG plots")
    parser.add_argument("--train-tokens", type=int, default=1_000_000,
                        help="training slice in tokens (0: the whole training split)")
    parser.add_argument("--dev-tokens", type=int, default=100_000,
                        help="dev slice in tokens that ranks the variants (0: the whole dev split)")
    parser.add_argument("--limit", type=int, default=0, help="run only the first N variants (smoke tests)")
    parser.add_argument("--only", nargs="*", help="run only variants whose name contains one of these")
    parser.add_argument("--calibration-iterations", type=int, default=2,
                        help="Newton iterations of the direct form's temperature calibration (saffu fit: 12; "
                             "the chain's L-BFGS keeps 12)")
    parser.add_argument("--list", action="store_true", help="print the grid and exit")
    parser.add_argument("--metrics-json", type=Path, help="write the headline figures as a flat JSON object here")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SaffuError as err:
        print(f"roadmap: error: {err}", file=sys.stderr)
        return 2


def run(args) -> int:
    start = time.perf_counter()
    source = open_workdir(args.workdir)
    grid = build_grid(source.vocab_size)
    if args.only:
        grid = [v for v in grid if any(o in variant_name(v) for o in args.only)]
    if args.limit:
        grid = grid[:args.limit]
    if args.list:
        for i, v in enumerate(grid):
            print(f"{i:>3} {variant_name(v):<40} ~{predicted_seconds(v):4.0f} s")
        print(f"{len(grid)} variants, ~{sum(map(predicted_seconds, grid)) / 60:.0f} min predicted")
        return 0
    if args.calibration_iterations < 1:
        raise SaffuError("--calibration-iterations must be ≥ 1")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = make_slice(source, args.out, args.train_tokens, args.dev_tokens)
    stamp = fingerprint(workdir)
    jsonl = args.out / "variants.jsonl"
    settings = {variant_name(v): solver_settings(v, args.calibration_iterations) for v in grid}
    done = {n: r for n, r in load_done(jsonl, stamp).items() if r.get("solver") == settings.get(n)}
    train_info, dev_info = workdir.split_info(workdir.train_split), workdir.split_info("dev")
    print(f"{len(grid)} variants ({sum(variant_name(v) in done for v in grid)} already done) on {workdir.path}: "
          f"train {train_info['tokens']:,} tokens, dev {dev_info['tokens']:,} tokens / {dev_info['bytes']:,} bytes",
          flush=True)
    errors = {}
    ran, predicted_done = 0, 0.0
    loop_start = time.perf_counter()
    bar = tqdm(grid, desc="variants", unit="variant", file=sys.stdout, mininterval=5)
    for v in bar:
        name = variant_name(v)
        if name in done:
            continue
        try:
            result = run_variant(v, workdir, settings[name])
        except SaffuError as err:   # e.g. a radius longer than every document of a tiny corpus
            errors[name] = str(err)
            tqdm.write(f"  {name}: skipped ({err})")
            continue
        record = {"name": name, "config": v, **result, "fingerprint": stamp,
                  "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(jsonl, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        done[name] = record
        ran += 1
        predicted_done += predicted_seconds(v)
        elapsed = time.perf_counter() - loop_start
        left = sum(predicted_seconds(g) for g in grid if variant_name(g) not in done and variant_name(g) not in errors)
        tqdm.write(f"  {name}: {result['dev_bpb']:.4f} bpb, {result['params']:,} params, solve "
                   f"{result['solve_seconds']:.1f} s, eval {result['eval_seconds']:.1f} s | {elapsed / 60:.1f} min, "
                   f"~{elapsed / predicted_done * left / 60:.0f} min left", file=sys.stdout)
        bar.set_postfix(best=f"{min(r['dev_bpb'] for r in done.values()):.4f}")
    bar.close()

    names = {variant_name(v) for v in grid}
    records = sorted((r for n, r in done.items() if n in names), key=lambda r: r["dev_bpb"])
    if not records:
        raise SaffuError("no variant finished; see the messages above")
    front = pareto_front(records)
    best = records[0]
    default = done.get(variant_name(variant()))
    near = min((r for r in records if r["dev_bpb"] <= best["dev_bpb"] * 1.01), key=lambda r: r["params"])
    wall = time.perf_counter() - start
    summary = {
        "variants": len(records), "errors": len(errors), "ran_now": ran,
        "best_variant": best["name"], "best_dev_bpb": best["dev_bpb"], "best_params": best["params"],
        "default_dev_bpb": default["dev_bpb"] if default else None,
        "smallest_within_1pct_variant": near["name"], "smallest_within_1pct_dev_bpb": near["dev_bpb"],
        "smallest_within_1pct_params": near["params"], "pareto_size": len(front),
        "total_seconds": float(sum(r["solve_seconds"] + r["eval_seconds"] for r in records)),
        "wall_seconds": wall, "train_tokens": train_info["tokens"], "dev_tokens": dev_info["tokens"],
        "dev_bytes": dev_info["bytes"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    clean = [{k: r[k] for k in r if k != "fingerprint"} for r in records]
    atomic_write_json(args.out / "results.json", {
        "summary": summary, "workdir": str(workdir.path), "source": str(source.path),
        "newton_iterations": args.calibration_iterations, "fingerprint": stamp, "pareto": [r["name"] for r in front],
        "errors": errors, "variants": clean})
    title = (f"{len(records)} explicit SAFFU variants, {workdir.meta['corpus']}: train "
             f"{train_info['tokens'] / 1e6:.2f}M tokens, dev {dev_info['tokens'] / 1e3:.0f}k tokens")
    plot_pareto(records, front, args.out / "bpb_vs_params.png", title)
    plot_factors(records, args.out / "factors.png", title)
    write_metrics(args.metrics_json, summary)
    print(table(records[:20], f"Top {min(20, len(records))} of {len(records)} by dev bits per byte"))
    print()
    print(table(front, "Best per parameter (Pareto front: no variant with as few parameters does better)"))
    print()
    print(f"best {best['name']}: {best['dev_bpb']:.4f} bpb with {best['params']:,} parameters; smallest within 1%: "
          f"{near['name']} ({near['dev_bpb']:.4f} bpb, {near['params']:,} parameters)")
    print(f"sweep cost {summary['total_seconds'] / 60:.1f} min of solve + eval; this run {wall / 60:.1f} min wall; "
          f"outputs in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
