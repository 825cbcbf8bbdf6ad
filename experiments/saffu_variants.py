"""Explicit-only SAFFU variants on one work directory: what the formulation says to try when a
claim fails (value form, temperatures, smoothing, hidden chain, heads, positions).

Each variant is ``saffu fit`` with extra flags; results (full-dev loss and bits per byte,
parameters, solve seconds) go to ``variants.json`` and a Markdown table on stdout.

    python experiments/saffu_variants.py --workdir runs/babylm --out runs/variants
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from saffu._io import atomic_write_json, write_metrics
from saffu.cli import main as saffu

VARIANTS = {
    "default (M=8, P=2 positions, 1 head, linear value, Dirichlet μ=100)": [],
    "log-space value": ["--value-form", "log"],
    "2 heads": ["--heads", "2"],
    "4 positions": ["--positions", "4"],
    "Dirichlet μ=1000": ["--mu", "1000"],
    "no calibration (β = 1)": ["--holdout-tokens", "0"],
    "chain, D = K = 129": ["--hidden", "129"],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/variants"))
    parser.add_argument("--only", nargs="*", help="names (substrings) of the variants to run")
    parser.add_argument("--metrics-json", type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for i, (name, flags) in enumerate(VARIANTS.items()):
        if args.only and not any(o in name for o in args.only):
            continue
        metrics_path = args.out / f"variant{i}.json"
        if not metrics_path.exists():
            argv_fit = ["fit", "--workdir", str(args.workdir), "--run", str(args.out / f"variant{i}"), "--quiet",
                        "--eval-tokens", "0", "--metrics-json", str(metrics_path), *flags]
            if saffu(argv_fit) != 0:
                raise SystemExit(f"variant {name!r} failed")
        m = json.loads(metrics_path.read_text())
        results[name] = {"flags": " ".join(flags), "dev_loss": m["dev_loss"], "dev_bpb": m["dev_bpb"],
                         "params": m["params"], "seconds": m["seconds"]}
    atomic_write_json(args.out / "variants.json", results)
    write_metrics(args.metrics_json, {f"{i}_dev_bpb": r["dev_bpb"] for i, r in enumerate(results.values())})
    print("| variant | flags | dev loss | dev bits/byte | params | solve s |\n|---|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | `{r['flags']}` | {r['dev_loss']:.4f} | {r['dev_bpb']:.4f} | {r['params']:,} "
              f"| {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
