"""The token-resolution explicit model (no backprop) on one work directory, against Kneser-Ney.

Solves :class:`saffu.configs.ExactConfig` (exact-token context groups, temperatures per group
and context-count bucket calibrated on held-out training documents) and scores dev, whole or a
spread sample of whole documents. With ``--ablate`` every group is also dropped in turn and
the model re-solved, so each group's contribution is the dev bits per byte it is worth.

    python experiments/exact_explicit.py --workdir runs/babylm --out runs/exact --eval-tokens 0 --ablate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from saffu._io import atomic_write_json, write_metrics
from saffu.configs import ExactConfig
from saffu.data.workdir import open_workdir
from saffu.eval.scoring import evaluate_split
from saffu.flags import exact_groups
from saffu.solve.exact import solve_exact


def solve_and_score(workdir, config: ExactConfig, eval_tokens: int) -> dict:
    tick = time.perf_counter()
    params, report = solve_exact(workdir, config, progress=False)
    metrics = evaluate_split(params, config, workdir, "dev", max_tokens=eval_tokens or None, progress=False)
    return {"groups": [list(g) for g in config.groups], **report, **metrics,
            "wall_seconds": time.perf_counter() - tick}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default = ExactConfig(vocab_size=1)
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory")
    parser.add_argument("--out", type=Path, default=Path("runs/exact"), help="results.json goes here")
    parser.add_argument("--groups", type=exact_groups, default=default.groups,
                        help='context offsets per group, e.g. "0 1 2 3 0,1 0,1,2" (0 = the previous token)')
    parser.add_argument("--mu", type=float, default=default.mu,
                        help="κ of μ_c = κ · (distinct successors) for witten_bell; μ for dirichlet")
    parser.add_argument("--buckets", type=int, nargs="*", default=list(default.buckets),
                        help="context-count bucket edges (none: one temperature per group)")
    parser.add_argument("--bucket-by", type=int, default=None,
                        help="index of the group whose context count sets every group's bucket (default: own)")
    parser.add_argument("--smoothing", choices=["dirichlet", "witten_bell", "kneser_ney"], default=default.smoothing,
                        help="dirichlet: one μ; witten_bell: μ_c = μ · (distinct targets after c); kneser_ney: modified "
                             "Kneser-Ney on the nested chain, witten_bell elsewhere")
    parser.add_argument("--no-nested", action="store_true",
                        help="smooth every group towards the unigram (not towards the group it extends)")
    parser.add_argument("--holdout-tokens", type=int, default=default.holdout_tokens,
                        help="held-out training tokens for the temperatures")
    parser.add_argument("--eval-tokens", type=int, default=200_000,
                        help="dev tokens scored (whole documents, spread over the split; 0 = all of dev)")
    parser.add_argument("--ablate", action="store_true", help="also re-solve without each group in turn")
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the figures")
    args = parser.parse_args(argv)
    workdir = open_workdir(args.workdir)
    config = ExactConfig(vocab_size=workdir.vocab_size, groups=args.groups, mu=args.mu,
                         buckets=tuple(args.buckets), bucket_by=args.bucket_by, nested=not args.no_nested,
                         smoothing=args.smoothing, holdout_tokens=args.holdout_tokens)
    full = solve_and_score(workdir, config, args.eval_tokens)
    print(f"all groups {config.groups}: dev {full['dev_loss']:.4f} nats/token, {full['dev_bpb']:.4f} bits/byte "
          f"(holdout {full['holdout_loss']:.4f}; solve {full['seconds']:.1f} s, peak RSS "
          f"{full['peak_rss_mb']:,.0f} MB)", flush=True)
    results = {"config": dataclasses.asdict(config), "all": full, "without": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", results)          # rewritten after every ablation
    if args.ablate and len(config.groups) > 1:
        for group in config.groups:
            rest = tuple(g for g in config.groups if g != group)
            by = None if config.bucket_by is None else config.groups[config.bucket_by]
            if by == group:
                continue                                  # the bucketing group stays
            bucket_by = None if by is None else rest.index(by)
            row = solve_and_score(workdir, dataclasses.replace(config, groups=rest, bucket_by=bucket_by),
                                  args.eval_tokens)
            results["without"][",".join(map(str, group))] = row
            atomic_write_json(args.out / "results.json", results)
            print(f"without {group}: dev {row['dev_bpb']:.4f} bits/byte (+{row['dev_bpb'] - full['dev_bpb']:.4f})",
                  flush=True)
    write_metrics(args.metrics_json, {"dev_bpb": full["dev_bpb"], "dev_loss": full["dev_loss"],
                                      "solve_seconds": full["seconds"], "peak_rss_mb": full["peak_rss_mb"],
                                      **{f"without_{k}_dev_bpb": v["dev_bpb"] for k, v in results["without"].items()}})
    print("\n| groups | dev loss | dev bits/byte | solve s |\n|---|---:|---:|---:|")
    print(f"| all: {' '.join(','.join(map(str, g)) for g in config.groups)} | {full['dev_loss']:.4f} | "
          f"{full['dev_bpb']:.4f} | {full['seconds']:.1f} |")
    for name, row in results["without"].items():
        print(f"| without {name} | {row['dev_loss']:.4f} | {row['dev_bpb']:.4f} (+{row['dev_bpb'] - full['dev_bpb']:.4f})"
              f" | {row['seconds']:.1f} |")
    print(json.dumps({key: full[key] for key in full if key.startswith("beta_")}))


if __name__ == "__main__":
    main()
