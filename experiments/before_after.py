"""Side-by-side figures of two revisions of saffu on one work directory, in one run.

Each revision is checked out into its own git worktree and run as a user would run it (the
`saffu` command line, in its own process, with that worktree first on ``PYTHONPATH``); the
revisions alternate, repeat by repeat, so both see the same machine load. Per revision:

* ``saffu --help`` wall time (median of 3),
* ``saffu fit`` on the default SAFFU model: explicit solve seconds, per-stage seconds and the
  peak RSS of the process,
* ``saffu train --init explicit`` for ``--steps`` steps: training tokens/s, and the solve's
  share of one backprop epoch (``solve seconds / epoch seconds``, epoch = the training split
  at that throughput).

    python experiments/before_after.py --workdir runs/babylm --before 70b1b1d --after HEAD --out runs/before_after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from saffu._io import atomic_write_json, write_metrics

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, into: Path) -> Path:
    """A detached git worktree of ``rev`` under ``into``."""
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
                   check=True, capture_output=True)
    return path


def saffu(tree: Path, *argv: str) -> float:
    """Run ``python -m saffu ARGV`` in ``tree`` (``-m`` puts the working directory first on the
    import path, so that tree's package is the one imported); returns the wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "saffu", *argv], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree.name}: saffu {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def measure(tree: Path, workdir: Path, scratch: Path, steps: int) -> dict:
    help_seconds = statistics.median(saffu(tree, "--help") for _ in range(3))
    run, fit_json, train_json = scratch / "run", scratch / "fit.json", scratch / "train.json"
    saffu(tree, "fit", "--workdir", str(workdir), "--run", str(run), "--eval-tokens", "5000", "--quiet",
          "--metrics-json", str(fit_json))
    fit = json.loads(fit_json.read_text())
    saffu(tree, "train", "--workdir", str(workdir), "--run", str(run), "--init", "explicit", "--steps", str(steps),
          "--eval-every", str(steps), "--checkpoint-every", str(steps), "--eval-tokens", "5000", "--quiet",
          "--metrics-json", str(train_json))
    trained = json.loads(train_json.read_text())
    return {"help_seconds": help_seconds, "solve_seconds": fit["seconds"], "peak_rss_mb": fit["peak_rss_mb"],
            "holdout_loss": fit.get("block0_holdout_loss"),
            **{key: fit[key] for key in fit if key.startswith("seconds_")},
            "train_tokens_per_s": trained["tokens_per_s"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a prepared work directory")
    parser.add_argument("--before", default="70b1b1d", help="the earlier revision")
    parser.add_argument("--after", default="HEAD", help="the later revision")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats per revision")
    parser.add_argument("--steps", type=int, default=40, help="training steps measured per run")
    parser.add_argument("--out", type=Path, default=Path("runs/before_after"))
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the medians")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    meta = json.loads((workdir / "meta.json").read_text())
    train_tokens = meta["splits"][meta.get("train_split", "train_10M")]["predicted_tokens"]
    results: dict[str, list[dict]] = {args.before: [], args.after: []}
    with tempfile.TemporaryDirectory(prefix="saffu-before-after-") as tmp:
        trees = {rev: worktree(rev, Path(tmp)) for rev in results}
        try:
            for repeat in range(args.repeats):
                for rev, tree in trees.items():
                    scratch = Path(tmp) / f"{tree.name}_{repeat}"
                    scratch.mkdir()
                    load = os.getloadavg()[0]
                    results[rev].append({**measure(tree, workdir, scratch, args.steps), "load_before": load})
                    print(f"{rev} repeat {repeat}: {json.dumps(results[rev][-1])}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    summary = {}
    for rev, rows in results.items():
        median = lambda key, rows=rows: statistics.median(r[key] for r in rows)
        epoch_seconds = train_tokens / median("train_tokens_per_s")
        summary[rev] = {"help_seconds": median("help_seconds"), "solve_seconds": median("solve_seconds"),
                        "train_tokens_per_s": median("train_tokens_per_s"), "epoch_seconds": epoch_seconds,
                        "solve_per_epoch": median("solve_seconds") / epoch_seconds,
                        "peak_rss_mb": median("peak_rss_mb"), "holdout_loss": rows[0]["holdout_loss"]}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", {"runs": results, "summary": summary, "train_tokens": train_tokens})
    write_metrics(args.metrics_json, {f"{'before' if rev == args.before else 'after'}_{key}": value
                                      for rev, row in summary.items() for key, value in row.items()})
    print(f"\n| figure | {args.before} | {args.after} |\n|---|---:|---:|")
    b, a = summary[args.before], summary[args.after]
    for key, fmt in (("help_seconds", "{:.2f} s"), ("solve_seconds", "{:.1f} s"), ("train_tokens_per_s", "{:,.0f}"),
                     ("epoch_seconds", "{:.0f} s"), ("solve_per_epoch", "{:.3f}"), ("peak_rss_mb", "{:,.0f} MB"),
                     ("holdout_loss", "{:.4f}")):
        print(f"| {key} | {fmt.format(b[key])} | {fmt.format(a[key])} |")


if __name__ == "__main__":
    main()
