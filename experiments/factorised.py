"""The factorised explicit model on one work directory: its sparse source, the explicit factors,
one warm-started epoch, and (``--study``) how much each factorisation choice loses.

One run, side by side on the same machine:

1. the **sparse source**: the exact model with the same offset groups (Witten-Bell, temperatures
   per offset and count bucket; :func:`saffu.solve.exact.solve_exact`);
2. the **factorised explicit model** (:func:`saffu.solve.factors.solve_factorised`): counts,
   randomized SVD, likelihood refinement and calibration, timed stage by stage; and the same
   without the refinement (the SVD's factors, calibrated);
3. **one epoch of backprop** from it (warm start, the one trainer), timed the same way, so the
   explicit cost is a measured share of the epoch;
4. with ``--study``: held-out loss (the selection criterion) and dev bits per byte of the
   explicit factors for other ranks, target weightings ``p(y)^a`` and refinements (steps,
   offsets).

Writes ``results.json`` (and ``--metrics-json``) and prints a table.

    python experiments/factorised.py --workdir runs/babylm --out runs/factorised --study
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

from saffu._io import atomic_write_json, write_metrics
from saffu.configs import ExactConfig, FactorConfig, FactorisedConfig, TrainConfig
from saffu.data.workdir import open_workdir
from saffu.eval.scoring import evaluate_split
from saffu.models.interface import parameter_count
from saffu.solve.exact import solve_exact
from saffu.solve.factors import solve_factorised
from saffu.training.trainer import train


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default, solver = FactorisedConfig, FactorConfig()
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory")
    parser.add_argument("--out", type=Path, default=Path("runs/factorised"), help="results.json and the run go here")
    parser.add_argument("--rank", type=int, default=default.rank, help="factor rank r")
    parser.add_argument("--positions", type=int, default=default.positions, help="offsets with their own embeddings")
    parser.add_argument("--learning-rate", type=float, default=0.01, help="peak learning rate of the warm epoch")
    parser.add_argument("--eval-tokens", type=int, default=0,
                        help="dev tokens scored (whole documents, spread over the split; 0 = all of dev)")
    parser.add_argument("--study", action="store_true",
                        help="also solve other ranks and target weightings (explicit only, dev sample of 200k)")
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the figures")
    args = parser.parse_args(argv)
    workdir = open_workdir(args.workdir)
    V = workdir.vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    limit = args.eval_tokens or None
    results: dict = {"workdir": str(args.workdir), "rank": args.rank, "positions": args.positions,
                     "learning_rate": args.learning_rate}

    source = ExactConfig(V, groups=tuple((p,) for p in range(args.positions)), smoothing="witten_bell",
                         nested=False, holdout_tokens=solver.holdout_tokens)
    params, report = solve_exact(workdir, source, progress=False)
    results["sparse"] = {**report, **evaluate_split(params, source, workdir, "dev", limit, progress=False)}
    print(f"sparse source ({args.positions} exact offset groups): dev {results['sparse']['dev_bpb']:.4f} bits/byte",
          flush=True)

    config = FactorisedConfig(V, rank=args.rank, positions=args.positions)
    params, report = solve_factorised(workdir, config, solver, progress=False)
    results["explicit"] = {**report, "params": parameter_count(params),
                           **evaluate_split(params, config, workdir, "dev", limit, progress=False)}
    print(f"factorised explicit (rank {args.rank}, {parameter_count(params):,} params): dev "
          f"{results['explicit']['dev_bpb']:.4f} bits/byte, solve {report['seconds']:.1f} s", flush=True)

    params_svd, report = solve_factorised(workdir, config, dataclasses.replace(solver, refine_steps=0),
                                          progress=False)
    results["explicit_svd"] = {**report, **evaluate_split(params_svd, config, workdir, "dev", limit, progress=False)}
    del params_svd
    print(f"factorised explicit without the refinement (the SVD's factors): dev "
          f"{results['explicit_svd']['dev_bpb']:.4f} bits/byte, solve {report['seconds']:.1f} s", flush=True)

    run = args.out / "warm"
    shutil.rmtree(run, ignore_errors=True)
    train_config = TrainConfig(learning_rate=args.learning_rate)
    tick = time.perf_counter()
    trained, history = train(config, params, workdir.tokens(workdir.train_split), train_config, run,
                             dev_stream=workdir.tokens("dev"), progress=False)
    last = history[-1]
    results["warm"] = {"wall_seconds": time.perf_counter() - tick, "train_seconds": last["seconds"],
                       "steps": last["step"], "tokens": last["tokens"], "tokens_per_s": last["tokens_per_s"],
                       "flops": last["flops"], "history": history,
                       **evaluate_split(trained, config, workdir, "dev", limit, progress=False)}
    results["solve_share_of_epoch"] = results["explicit"]["seconds"] / last["seconds"]
    print(f"warm start, one epoch ({last['step']} steps, {last['seconds']:.0f} s): dev "
          f"{results['warm']['dev_bpb']:.4f} bits/byte; explicit solve = "
          f"{results['solve_share_of_epoch']:.1%} of the epoch", flush=True)

    if args.study:
        results["study"] = []
        refine = (solver.refine_steps, solver.refine_offsets)
        study = [(args.rank, 0.0, *refine), (args.rank, 1.0, *refine), (64, 0.5, *refine), (128, 0.5, *refine),
                 (256, 0.5, *refine), (args.rank, 0.5, 0, 1), (args.rank, 0.5, 5, 1), (args.rank, 0.5, 20, 1),
                 (args.rank, 0.5, 10, 2), (args.rank, 0.5, 10, 3)]
        for rank, power, steps, offsets in study:
            variant = FactorisedConfig(V, rank=rank, positions=args.positions)
            params, report = solve_factorised(workdir, variant, dataclasses.replace(
                solver, column_power=power, refine_steps=steps, refine_offsets=offsets), progress=False)
            row = {"rank": rank, "column_power": power, "refine_steps": steps, "refine_offsets": offsets,
                   "params": parameter_count(params), "holdout_loss": report["holdout_loss"],
                   "seconds": report["seconds"],
                   **evaluate_split(params, variant, workdir, "dev", 200_000, progress=False)}
            results["study"].append(row)
            atomic_write_json(args.out / "results.json", results)
            print(f"  rank {rank:>3}, targets weighted p^{power}, {steps} refinement steps on {offsets} offset(s): "
                  f"held-out {row['holdout_loss']:.4f}, dev sample {row['dev_bpb']:.4f} bits/byte, solve "
                  f"{row['seconds']:.1f} s", flush=True)
    atomic_write_json(args.out / "results.json", results)
    flat = {f"{part}_{key}": value for part in ("sparse", "explicit", "explicit_svd", "warm")
            for key, value in results[part].items() if isinstance(value, (int, float))}
    write_metrics(args.metrics_json, {**flat, "solve_share_of_epoch": results["solve_share_of_epoch"]})
    print(json.dumps({key: flat[key] for key in ("sparse_dev_bpb", "explicit_dev_bpb", "explicit_svd_dev_bpb",
                                                 "warm_dev_bpb")}))


if __name__ == "__main__":
    main()
