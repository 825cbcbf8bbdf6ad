"""How the exact explicit model's tables grow with the data: stored pairs, bytes and counting
seconds on 10 / 25 / 50 / 100% of the training split, with a power-law extrapolation.

Each share is a :func:`saffu.data.workdir.subset_workdir` (whole documents from evenly spaced
blocks); the tables are built without calibration (``holdout_tokens = 0``: the temperatures do
not change the tables' size). The fit ``pairs ≈ a · tokens^b`` per group is extrapolated to
``--extrapolate`` training tokens. ``--factorised`` also runs the factorised model's whole
explicit solve (:func:`saffu.solve.factors.solve_factorised`: counting, randomized SVD,
temperatures) on every share and records each stage's seconds, the offset matrices' stored
pairs and the peak RSS. Run it on a work directory of another vocabulary size to see how
``V`` moves the figures.

    python experiments/exact_scaling.py --workdir runs/babylm --out runs/exact_scaling --factorised
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from saffu._io import atomic_write_json, write_metrics
from saffu.configs import ExactConfig, FactorConfig, FactorisedConfig
from saffu.data.workdir import open_workdir, subset_workdir
from saffu.solve.exact import solve_exact
from saffu.solve.factors import solve_factorised


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory")
    parser.add_argument("--out", type=Path, default=Path("runs/exact_scaling"), help="results.json goes here")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0],
                        help="shares of the training split")
    parser.add_argument("--extrapolate", type=float, default=100e6, help="training tokens to extrapolate to")
    parser.add_argument("--factorised", action="store_true",
                        help="also time the factorised model's explicit solve (rank 96, 3 offsets) on every share")
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the figures")
    args = parser.parse_args(argv)
    source = open_workdir(args.workdir)
    config = ExactConfig(vocab_size=source.vocab_size, holdout_tokens=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="saffu-exact-scaling-") as tmp:
        for fraction in args.fractions:
            work = source if fraction >= 1 else subset_workdir(source, Path(tmp) / f"{fraction:g}",
                                                               train_fraction=fraction)
            _, report = solve_exact(work, config, progress=False)
            G = len(config.groups)
            rows.append({"fraction": fraction, "tokens": report["counted_tokens"],
                         "seconds_count": report["seconds_count"], "seconds_tables": report["seconds_tables"],
                         "pairs": [report[f"group{g}_pairs"] for g in range(G)],
                         "megabytes": [report[f"group{g}_megabytes"] for g in range(G)],
                         "peak_rss_mb": report["peak_rss_mb"]})
            print(f"{fraction:>5.0%}: {report['counted_tokens']:>10,} tokens, pairs "
                  f"{sum(rows[-1]['pairs']):>10,}, tables {sum(rows[-1]['megabytes']):7.1f} MB, counting "
                  f"{report['seconds_count']:.1f} s, peak RSS {report['peak_rss_mb']:,.0f} MB", flush=True)
            if args.factorised:
                _, factor = solve_factorised(work, FactorisedConfig(work.vocab_size), FactorConfig(), progress=False)
                rows[-1]["factorised"] = {key: factor[key] for key in
                                          ("seconds", "seconds_count", "seconds_factorise", "seconds_calibration",
                                           "peak_rss_mb", "holdout_loss", "offset_pairs") if key in factor}
                print(f"       factorised solve {factor['seconds']:.1f} s (counting {factor['seconds_count']:.1f}, "
                      f"SVD {factor['seconds_factorise']:.1f}, temperatures {factor['seconds_calibration']:.1f}), "
                      f"peak RSS {factor['peak_rss_mb']:,.0f} MB", flush=True)
    tokens = np.array([r["tokens"] for r in rows], np.float64)
    fits = []
    for g, offsets in enumerate(config.groups):
        pairs = np.array([r["pairs"][g] for r in rows], np.float64)
        exponent, log_scale = np.polyfit(np.log(tokens), np.log(pairs), 1)
        fits.append({"group": list(offsets), "exponent": float(exponent),
                     "pairs_at_extrapolation": float(np.exp(log_scale) * args.extrapolate ** exponent)})
    seconds_per_token = rows[-1]["seconds_count"] / rows[-1]["tokens"]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", {"rows": rows, "fits": fits, "extrapolate_tokens": args.extrapolate,
                                                  "counting_seconds_at_extrapolation": seconds_per_token * args.extrapolate})
    write_metrics(args.metrics_json, {f"group{g}_exponent": f["exponent"] for g, f in enumerate(fits)})
    print(f"\n| group | pairs ∝ tokens^b, b | pairs at {args.extrapolate:,.0f} tokens |\n|---|---:|---:|")
    for f in fits:
        print(f"| {','.join(map(str, f['group']))} | {f['exponent']:.2f} | {f['pairs_at_extrapolation']:,.0f} |")
    print(f"counting: {seconds_per_token * 1e6:.2f} s per million tokens here -> "
          f"{seconds_per_token * args.extrapolate / 60:.1f} min at {args.extrapolate:,.0f} tokens")


if __name__ == "__main__":
    main()
