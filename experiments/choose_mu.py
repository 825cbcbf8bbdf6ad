"""The Dirichlet strength μ of the explicit SAFFU solver, chosen on held-out *training* data.

For each μ the default SAFFU model is solved explicitly (:func:`saffu.solve.stack.solve_explicit`)
and scored on the held-out tail of the training stream that the solver keeps out of its counts
to calibrate temperatures (``SolverConfig.holdout_tokens``): the calibrated holdout loss is the
criterion, so dev is never looked at. The solver's default μ is the minimum this script finds;
its table is what ``SolverConfig``'s default ``mu`` rests on.

    python experiments/choose_mu.py --workdir runs/babylm --out runs/choose_mu
"""

from __future__ import annotations

import argparse
from pathlib import Path

from saffu._io import atomic_write_json, write_metrics
from saffu.configs import SaffuConfig, Smoothing, SolverConfig
from saffu.data.workdir import open_workdir
from saffu.solve.stack import solve_explicit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory")
    parser.add_argument("--out", type=Path, default=Path("runs/choose_mu"), help="results.json goes here")
    parser.add_argument("--mu", type=float, nargs="+", default=[100.0, 1000.0, 3000.0, 10000.0],
                        help="Dirichlet strengths to try")
    parser.add_argument("--bits", type=int, default=SaffuConfig.bits, help="bit-cipher bits")
    parser.add_argument("--radius", type=int, default=SaffuConfig.radius, help="SAFFU radius M")
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the figures")
    args = parser.parse_args(argv)
    workdir = open_workdir(args.workdir)
    config = SaffuConfig(vocab_size=workdir.vocab_size, bits=args.bits, radius=args.radius)
    rows = []
    for mu in args.mu:
        solver = SolverConfig(smoothing=Smoothing(mu=mu))
        _, report = solve_explicit(workdir, config, solver, progress=False)
        rows.append({"mu": mu, "holdout_loss": report["block0_holdout_loss"], "solve_seconds": report["seconds"],
                     "holdout_tokens": report["holdout_tokens"]})
        print(f"μ = {mu:>8g}: holdout loss {rows[-1]['holdout_loss']:.4f} nats/token "
              f"({report['seconds']:.1f} s solve)", flush=True)
    best = min(rows, key=lambda r: r["holdout_loss"])
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", {"corpus": workdir.meta["corpus"], "rows": rows, "best_mu": best["mu"]})
    write_metrics(args.metrics_json, {"best_mu": best["mu"], **{f"holdout_loss_mu{r['mu']:g}": r["holdout_loss"]
                                                                for r in rows}})
    print(f"\n| μ | holdout loss (nats/token, {rows[0]['holdout_tokens']:,} held-out training tokens) |\n|---:|---:|")
    for r in rows:
        mark = " **(chosen)**" if r is best else ""
        print(f"| {r['mu']:g} | {r['holdout_loss']:.4f}{mark} |")


if __name__ == "__main__":
    main()
