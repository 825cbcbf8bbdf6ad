"""Explicit-only, warm start, cold start (several seeds), transformers and Kneser-Ney on one corpus.

Every model is trained and scored by the ``saffu`` command line in its own process (so the
peak memory of each run is its own), on the same prepared work directory and the same
training windows:

* ``explicit``   — ``saffu fit``: the explicit SAFFU solution, no backprop;
* ``warm``       — ``saffu train --init explicit`` from it (its seconds and FLOPs include the solve);
* ``cold``       — ``saffu train --init random``, one run per seed (the table gives the mean);
* ``transformer`` — the flax decoder-only baseline with about SAFFU's parameter count, and
  ``transformer_up`` one size up, both ``saffu train --init random --model transformer``;
* ``kneser_ney`` — ``saffu ngram``: interpolated modified Kneser-Ney from the engine's counts.

Outputs in ``--out``: ``results.json`` (per model ``dev_bpb``, ``dev_ppl``, ``dev_loss``,
``blimp_accuracy``, ``train_seconds``, ``total_seconds``, ``flops``, ``xla_flops``, ``params``,
``tokens_per_s``, ``peak_rss_mb`` and the dev curve), ``curves.png`` (dev bits per byte against
steps, tokens, seconds and FLOPs), ``blimp.png``, ``table.md`` (the comparison table) and the
equal-seconds verdicts of the issue's targets. Curves use the trainer's evenly spaced dev
windows (bits per byte from the split's bytes per token); final figures score the whole dev
split (or the ``--dev-tokens`` subset). Rerunning skips finished runs (delete ``--out`` to redo).

    python experiments/compare.py --corpus ../shared/data/babylm/2023 --workdir runs/babylm \\
        --blimp ../shared/data/blimp --out runs/compare
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from saffu._io import SaffuError, atomic_write_json, write_metrics

SAFFU_ARCH = ["--radius", "8", "--heads", "1", "--positions", "2", "--bits", "128"]


def saffu(args: list[str], log: Path) -> None:
    """Run ``python -m saffu ARGS`` in its own process; its output goes to ``log``."""
    with open(log, "a") as handle:
        handle.write(f"$ saffu {' '.join(args)}\n")
        handle.flush()
        done = subprocess.run([sys.executable, "-m", "saffu", *args], stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"`saffu {' '.join(args)}` failed (exit {done.returncode}); see {log}")


def cached(path: Path, make) -> dict:
    """The JSON at ``path``, made by ``make()`` (which writes it) unless it exists."""
    if not path.exists():
        make()
    return json.loads(path.read_text())


def prepare_workdir(corpus: Path, workdir: Path, vocab_size: int, dev_tokens: int | None, log: Path) -> Path:
    """The work directory of ``corpus`` (prepared once), or a dev subset of it."""
    if not (workdir / "meta.json").exists():
        saffu(["prepare", "--corpus", str(corpus), "--workdir", str(workdir), "--vocab-size", str(vocab_size),
               "--quiet"], log)
    if not dev_tokens:
        return workdir
    from saffu.data.workdir import open_workdir, subset_workdir
    target = workdir.parent / f"{workdir.name}-dev{dev_tokens}"
    subset_workdir(open_workdir(workdir), target, dev_tokens=dev_tokens)
    return target


def curve(run: Path, bytes_per_token: float, seconds_offset: float = 0.0, flops_offset: float = 0.0) -> list[dict]:
    """The run's ``metrics.jsonl`` as points with dev bits per byte (offsets: the solve of a
    warm start, so its curve starts where the explicit solution was ready)."""
    points = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        points.append({"step": r["step"], "tokens": r["tokens"], "seconds": r["seconds"] + seconds_offset,
                       "flops": r["flops"] + flops_offset, "dev_loss": r["dev_loss"],
                       "dev_bpb": r["dev_loss"] / math.log(2) / bytes_per_token})
    return points


def interpolate(points: list[dict], key: str, at: float) -> float:
    xs = [p[key] for p in points]
    if not xs or at < xs[0]:
        return math.nan
    return float(np.interp(at, xs, [p["dev_bpb"] for p in points]))


def equal_budget_verdict(warm: list[dict], other: list[dict], key: str) -> dict:
    """At every budget (``key`` = seconds or flops) where ``other`` was evaluated and the warm
    start existed, is warm's dev bits per byte lower? Returns counts and the worst margin."""
    margins = []
    for p in other:
        w = interpolate(warm, key, p[key])
        if not math.isnan(w) and p[key] <= warm[-1][key]:
            margins.append(p["dev_bpb"] - w)          # > 0: warm is better
    return {"budgets": len(margins), "warm_better": int(sum(m > 0 for m in margins)),
            "smallest_margin_bpb": min(margins) if margins else math.nan}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--corpus", type=Path, required=True, help="BabyLM-layout corpus folder")
    parser.add_argument("--workdir", type=Path, required=True, help="its work directory (prepared if missing)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--blimp", type=Path, help="folder of BLiMP *.jsonl paradigms (omit: no BLiMP)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--seeds", type=int, default=3, help="cold-start seeds")
    parser.add_argument("--blimp-seeds", type=int, default=1, help="cold seeds also scored on BLiMP")
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: one epoch)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--warm-lr", type=float, default=3e-3)
    parser.add_argument("--cold-lr", type=float, default=5e-2)
    parser.add_argument("--transformer-lr", type=float, default=3e-3)
    parser.add_argument("--transformer", nargs=2, type=int, default=[128, 5], metavar=("WIDTH", "LAYERS"),
                        help="the parameter-matched transformer")
    parser.add_argument("--transformer-up", nargs=2, type=int, default=[192, 7], metavar=("WIDTH", "LAYERS"),
                        help="one size up (0 0: skip)")
    parser.add_argument("--kn-order", type=int, default=5)
    parser.add_argument("--dev-tokens", type=int, default=0,
                        help="score a whole-document dev subset of about N tokens (0: the whole dev split)")
    parser.add_argument("--metrics-json", type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "commands.log"
    start = time.perf_counter()

    workdir = prepare_workdir(args.corpus, args.workdir, args.vocab_size, args.dev_tokens, log)
    from saffu.data.workdir import open_workdir
    opened = open_workdir(workdir)
    info = opened.split_info("dev")
    train_tokens = opened.split_info(opened.train_split)["predicted_tokens"]
    bytes_per_token = info["bytes"] / info["predicted_tokens"]
    W = ["--workdir", str(workdir)]
    train_flags = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--checkpoint-every", "1000000"]
    out = args.out
    results: dict[str, dict] = {}

    def blimp(name: str, run: Path, checkpoint: str = "latest") -> float | None:
        if not args.blimp:
            return None
        path = out / f"{name}_blimp.json"
        return cached(path, lambda: saffu(["blimp", *W, "--run", str(run), "--blimp", str(args.blimp), "--checkpoint",
                                           checkpoint, "--quiet", "--metrics-json", str(path)], log))["blimp_accuracy"]

    # explicit SAFFU, then the warm start from it
    m = cached(out / "explicit.json", lambda: saffu(["fit", *W, "--run", str(out / "warm"), *SAFFU_ARCH, "--quiet",
                                                     "--eval-tokens", "0",
                                                     "--metrics-json", str(out / "explicit.json")], log))
    solve_seconds, solve_flops = m["seconds"], m["flops"]
    results["explicit"] = {"dev_bpb": m["dev_bpb"], "dev_ppl": m["dev_ppl"], "dev_loss": m["dev_loss"],
                           "train_seconds": solve_seconds, "total_seconds": solve_seconds, "flops": solve_flops,
                           "xla_flops": m["xla_flops"], "params": m["params"], "tokens_per_s": m["tokens_per_s"],
                           "peak_rss_mb": m["peak_rss_mb"], "blimp_accuracy": blimp("explicit", out / "warm", "explicit")}

    def trained(name, run, flags, seconds_offset=0.0, flops_offset=0.0, xla_offset=0.0, score_blimp=True):
        path = out / f"{name}.json"
        m = cached(path, lambda: saffu(["train", *W, "--run", str(run), *flags, *train_flags, "--quiet",
                                        "--eval-tokens", "0",
                                        "--metrics-json", str(path)], log))
        points = curve(run, bytes_per_token, seconds_offset, flops_offset)
        return {"dev_bpb": m["dev_bpb"], "dev_ppl": m["dev_ppl"], "dev_loss": m["dev_loss"],
                "train_seconds": m["train_seconds"], "total_seconds": m["train_seconds"] + seconds_offset,
                "flops": m["flops"] + flops_offset,
                "xla_flops": None if m.get("xla_flops") is None else m["xla_flops"] + xla_offset,
                "params": m["params"], "steps": m["steps"], "tokens": m["tokens"], "tokens_per_s": m["tokens_per_s"],
                "peak_rss_mb": m["peak_rss_mb"], "blimp_accuracy": blimp(name, run) if score_blimp else None,
                "curve": points}

    results["warm"] = trained("warm", out / "warm", ["--init", "explicit", "--learning-rate", str(args.warm_lr)],
                              solve_seconds, solve_flops, m["xla_flops"] or 0.0)
    results["explicit"]["curve"] = results["warm"]["curve"][:1]
    seeds = [trained(f"cold{s}", out / f"cold{s}", ["--init", "random", *SAFFU_ARCH, "--seed", str(s),
                                                    "--learning-rate", str(args.cold_lr)],
                     score_blimp=s < args.blimp_seeds) for s in range(args.seeds)]
    results["cold"] = {key: float(np.mean([r[key] for r in seeds])) for key in
                       ("dev_bpb", "dev_ppl", "dev_loss", "train_seconds", "total_seconds", "flops", "params",
                        "tokens_per_s", "peak_rss_mb")}
    results["cold"].update(dev_bpb_std=float(np.std([r["dev_bpb"] for r in seeds])), seeds=args.seeds,
                           xla_flops=seeds[0]["xla_flops"],
                           blimp_accuracy=float(np.mean([r["blimp_accuracy"] for r in seeds[:args.blimp_seeds]]))
                           if args.blimp and args.blimp_seeds else None,
                           curve=seeds[0]["curve"], seed_curves=[r["curve"] for r in seeds])
    for name, (width, layers) in (("transformer", args.transformer), ("transformer_up", args.transformer_up)):
        if width and layers:
            results[name] = trained(name, out / name, ["--init", "random", "--model", "transformer", "--block", "gpt",
                                                       "--output-bias", "--width", str(width), "--layers", str(layers),
                                                       "--learning-rate", str(args.transformer_lr)])

    # Kneser-Ney from the engine's n-gram counts
    path = out / "kneser_ney.json"
    kn = cached(path, lambda: saffu(["ngram", *W, "--order", str(args.kn_order), "--arpa", str(out / "kn.arpa"),
                                     *(["--blimp", str(args.blimp)] if args.blimp else []), "--quiet",
                                     "--metrics-json", str(path)], log))
    results["kneser_ney"] = {"dev_bpb": kn["dev_bpb"], "dev_ppl": kn["dev_ppl"], "dev_loss": kn["dev_loss"],
                             "train_seconds": kn["fit_seconds"], "total_seconds": kn["fit_seconds"],
                             "flops": None, "xla_flops": None, "params": kn["params"],
                             "tokens_per_s": kn["tokens_per_s"], "peak_rss_mb": kn["peak_rss_mb"],
                             "blimp_accuracy": kn.get("blimp_accuracy"), "order": args.kn_order,
                             "flops_note": "counting and table look-ups; no multiply-add work to count"}

    verdicts = {}
    warm_curve = results["warm"]["curve"]
    for name in ("transformer", "cold"):
        if name in results:
            verdicts[f"warm_vs_{name}_at_equal_seconds"] = equal_budget_verdict(warm_curve, results[name]["curve"],
                                                                                "seconds")
            verdicts[f"warm_vs_{name}_at_equal_flops"] = equal_budget_verdict(warm_curve, results[name]["curve"],
                                                                              "flops")
    kn_point = [{"seconds": results["kneser_ney"]["train_seconds"], "dev_bpb": results["kneser_ney"]["dev_bpb"]}]
    verdicts["warm_vs_kneser_ney_at_its_fit_seconds"] = equal_budget_verdict(warm_curve, kn_point, "seconds")
    verdicts["warm_final_beats_kneser_ney"] = results["warm"]["dev_bpb"] < results["kneser_ney"]["dev_bpb"]
    verdicts["warm_final_beats_transformer"] = ("transformer" in results
                                                and results["warm"]["dev_bpb"] < results["transformer"]["dev_bpb"])
    scored = [r["blimp_accuracy"] for k, r in results.items()
              if k in ("explicit", "warm", "cold") and r["blimp_accuracy"] is not None]
    verdicts["best_saffu_blimp"] = max(scored) if scored else None
    verdicts["best_saffu_blimp_at_least_65"] = max(scored) >= 0.65 if scored else None

    summary = {"corpus": str(args.corpus), "workdir": str(workdir), "dev": info, "train_tokens": train_tokens,
               "models": results,
               "verdicts": verdicts, "seconds": time.perf_counter() - start,
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    atomic_write_json(out / "results.json", summary)
    table = markdown_table(results, args)
    (out / "table.md").write_text(table)
    plot(results, out)
    write_metrics(args.metrics_json, {f"{k}_dev_bpb": r["dev_bpb"] for k, r in results.items()})
    print(table)
    print(json.dumps(verdicts, indent=1))


def markdown_table(results: dict, args) -> str:
    rows = ["| model | params | dev loss (nats) | dev ppl | dev bits/byte | BLiMP | train s | total s | "
            "FLOPs (analytic) | tokens/s | peak RSS MB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x, f: "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)
    for name, r in results.items():
        label = f"{name} (mean of {r['seeds']} seeds, ±{r['dev_bpb_std']:.4f})" if name == "cold" else name
        rows.append(f"| {label} | {r['params']:,.0f} | {r['dev_loss']:.4f} | {r['dev_ppl']:.1f} | {r['dev_bpb']:.4f} | "
                    f"{fmt(r['blimp_accuracy'], '.3f')} | {r['train_seconds']:.0f} | {r['total_seconds']:.0f} | "
                    f"{fmt(r['flops'], '.2e')} | {fmt(r['tokens_per_s'], ',.0f')} | {r['peak_rss_mb']:,.0f} |")
    return "\n".join(rows) + "\n"


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"explicit": "tab:green", "warm": "tab:blue", "cold": "tab:orange", "transformer": "tab:red",
              "transformer_up": "tab:purple", "kneser_ney": "black"}
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5), sharey=True)
    for ax, key, label in zip(axes, ("step", "tokens", "seconds", "flops"),
                              ("steps", "training tokens", "seconds (warm: solve + training)", "FLOPs (analytic)")):
        for name, r in results.items():
            if name == "kneser_ney":
                ax.axhline(r["dev_bpb"], color=colors[name], ls="--", lw=1, label=f"Kneser-Ney {r['order']}-gram")
                if key == "seconds":
                    ax.plot([r["train_seconds"]], [r["dev_bpb"]], "k*", ms=10)
                continue
            curves = r.get("seed_curves", [r["curve"]])
            for i, c in enumerate(curves):
                c = [p for p in c if key != "flops" or p[key] > 0]      # log axis: no zero-FLOP start
                ax.plot([p[key] for p in c], [p["dev_bpb"] for p in c], "o-" if name == "explicit" else "-",
                        color=colors[name], alpha=1.0 if i == 0 else 0.4, ms=7, label=name if i == 0 else None)
        ax.set_xlabel(label)
        if key == "flops":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    if "explicit" in results:   # the random-init start (~4 bits/byte) would flatten everything else
        lowest = min(r["dev_bpb"] for r in results.values())
        axes[0].set_ylim(lowest - 0.05, results["explicit"]["dev_bpb"] + 0.35)
    axes[0].set_ylabel("dev bits per byte (evenly spaced dev windows)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)

    named = [(k, r["blimp_accuracy"]) for k, r in results.items() if r.get("blimp_accuracy") is not None]
    if named:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([k for k, _ in named], [v for _, v in named], color=[colors[k] for k, _ in named])
        ax.axhline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_ylabel("BLiMP accuracy")
        ax.set_ylim(0.3, 0.8)
        fig.tight_layout()
        fig.savefig(out / "blimp.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except SaffuError as err:
        raise SystemExit(f"compare: error: {err}") from None
