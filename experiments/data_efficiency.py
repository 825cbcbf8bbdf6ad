"""Data efficiency: the ``compare`` suite on 10%, 25%, 50% and 100% of the training split.

Each fraction is a work directory of whole training documents spread over the whole split
(:func:`saffu.data.workdir.subset_workdir`, same tokenizer, same dev documents), and runs explicit
SAFFU, its warm start, cold start, the parameter-matched transformer and Kneser-Ney for one
epoch of that fraction (``experiments/compare.py`` with ``--seeds`` cold seeds, no BLiMP and no
larger transformer). Where does the warm start stop helping? ``results.json`` has every
model's dev bits per byte per fraction and the warm − cold and warm − transformer gaps;
``data_efficiency.png`` plots them against training tokens.

    python experiments/data_efficiency.py --corpus ../shared/data/babylm/2023 --workdir runs/babylm \\
        --out runs/data_efficiency --dev-tokens 400000 --reuse-full runs/compare
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from saffu._io import SaffuError, atomic_write_json, write_metrics

MODELS = ("explicit", "warm", "cold", "transformer", "kneser_ney")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--corpus", type=Path, required=True, help="BabyLM-layout corpus folder")
    parser.add_argument("--workdir", type=Path, required=True, help="its work directory (prepared if missing)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--dev-tokens", type=int, default=400_000,
                        help="whole-document dev subset scored at every fraction (0: all of dev)")
    parser.add_argument("--seeds", type=int, default=1, help="cold-start seeds per fraction")
    parser.add_argument("--reuse-full", type=Path,
                        help="a compare output folder run with the same --dev-tokens: its results stand for 100%%")
    parser.add_argument("--out", type=Path, default=Path("runs/data_efficiency"))
    parser.add_argument("--metrics-json", type=Path)
    args, compare_flags = parser.parse_known_args(argv)
    import compare  # experiments/compare.py

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log = args.out / "commands.log"
    full = compare.prepare_workdir(args.corpus, args.workdir, args.vocab_size, 0, log)
    from saffu.data.workdir import open_workdir, subset_workdir
    source = open_workdir(full)
    rows = {}
    for fraction in sorted(args.fractions):
        if not 0 < fraction <= 1:
            raise SaffuError(f"--fractions must lie in (0, 1], got {fraction}")
        if fraction == 1.0 and args.reuse_full:
            results = json.loads((args.reuse_full / "results.json").read_text())
        else:
            name = f"frac{fraction:g}"
            work = args.out / f"{name}-work"
            subset_workdir(source, work, train_fraction=fraction, dev_tokens=args.dev_tokens or None)
            compare.main(["--corpus", str(args.corpus), "--workdir", str(work), "--out", str(args.out / name),
                          "--seeds", str(args.seeds), "--blimp-seeds", "0", "--transformer-up", "0", "0",
                          *compare_flags])
            results = json.loads((args.out / name / "results.json").read_text())
        models = results["models"]
        rows[fraction] = {"train_tokens": results.get("train_tokens") or models["warm"]["tokens"],
                          "dev": results["dev"],
                          **{f"{m}_dev_bpb": models[m]["dev_bpb"] for m in MODELS if m in models},
                          **{f"{m}_total_seconds": models[m]["total_seconds"] for m in MODELS if m in models}}
        rows[fraction]["warm_minus_cold_bpb"] = models["warm"]["dev_bpb"] - models["cold"]["dev_bpb"]
        rows[fraction]["warm_minus_transformer_bpb"] = models["warm"]["dev_bpb"] - models["transformer"]["dev_bpb"]
        rows[fraction]["warm_minus_explicit_bpb"] = models["warm"]["dev_bpb"] - models["explicit"]["dev_bpb"]
    devs = {json.dumps(r["dev"], sort_keys=True) for r in rows.values()}
    if len(devs) > 1:
        raise SaffuError("the fractions were scored on different dev sets (is --reuse-full from a compare run "
                         "with the same --dev-tokens?); rerun without --reuse-full")
    summary = {"fractions": {str(k): v for k, v in rows.items()}, "seconds": time.perf_counter() - start,
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    atomic_write_json(args.out / "results.json", summary)
    plot(rows, args.out)
    write_metrics(args.metrics_json, {f"{k}_warm_minus_cold_bpb": v["warm_minus_cold_bpb"] for k, v in rows.items()})
    print("| fraction | train tokens | " + " | ".join(MODELS) + " | warm − cold | warm − transformer |")
    print("|---:|---:|" + "---:|" * (len(MODELS) + 2))
    for fraction, r in rows.items():
        cells = " | ".join(f"{r.get(f'{m}_dev_bpb', float('nan')):.4f}" for m in MODELS)
        print(f"| {fraction:g} | {r['train_tokens']:,} | {cells} | {r['warm_minus_cold_bpb']:+.4f} | "
              f"{r['warm_minus_transformer_bpb']:+.4f} |")


def plot(rows: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fractions = sorted(rows)
    tokens = [rows[f]["train_tokens"] for f in fractions]
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(11, 4))
    for model in MODELS:
        ys = [rows[f].get(f"{model}_dev_bpb") for f in fractions]
        if all(y is not None for y in ys):
            ax.plot(tokens, ys, "o-", label=model)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (one epoch)")
    ax.set_ylabel("dev bits per byte")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    gap.plot(tokens, [rows[f]["warm_minus_cold_bpb"] for f in fractions], "o-", label="warm − cold")
    gap.plot(tokens, [rows[f]["warm_minus_transformer_bpb"] for f in fractions], "s-", label="warm − transformer")
    gap.axhline(0, color="gray", lw=0.8)
    gap.set_xscale("log")
    gap.set_xlabel("training tokens (one epoch)")
    gap.set_ylabel("bits per byte (< 0: warm start better)")
    gap.legend(fontsize=8)
    gap.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "data_efficiency.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except SaffuError as err:
        raise SystemExit(f"data_efficiency: error: {err}") from None
