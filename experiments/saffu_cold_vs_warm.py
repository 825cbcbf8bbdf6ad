"""SAFFU on BabyLM: explicit only, warm start (explicit init + Adam) and cold start (random
init + Adam, several seeds), same architecture, data order, optimizer and step budget.

Runs (or reuses, when their metrics JSON exists) ``saffu fit``, ``saffu train --init explicit``
and ``saffu train --init random --seed s``, then writes ``summary.json`` and plots of dev loss
against steps, tokens and seconds. Claims it checks (and reports, met or not):

* warm start beats cold start on full-dev loss after the budget;
* warm start reaches cold start's final dev loss (on the periodic dev subset) in at most a
  quarter of the steps;
* the explicit model is no worse than the cold start after the budget.

    python experiments/saffu_cold_vs_warm.py --workdir runs/babylm --out runs/saffu
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from saffu._io import atomic_write_json, write_metrics
from saffu.cli import main as saffu


def run_once(out: Path, name: str, argv: list[str]) -> dict:
    metrics = out / f"{name}.json"
    if not metrics.exists() and saffu([*argv, "--metrics-json", str(metrics)]) != 0:
        raise SystemExit(f"{name} failed")
    return json.loads(metrics.read_text())


def curve(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/saffu"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="0: one epoch")
    parser.add_argument("--warm-learning-rate", type=float, default=0.003)
    parser.add_argument("--cold-learning-rate", type=float, default=0.05)
    parser.add_argument("--architecture", default="", help='architecture flags for fit and cold runs, e.g. "--radius 4"')
    parser.add_argument("--fit-flags", default="", help='extra flags for saffu fit only, e.g. "--mu 100"')
    parser.add_argument("--metrics-json", type=Path)
    args = parser.parse_args(argv)
    out, work = args.out, str(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--workdir", work, "--quiet", "--eval-tokens", "0"]   # whole dev split
    budget = ["--steps", str(args.steps), "--eval-every", "50"]

    architecture = shlex.split(args.architecture)
    explicit = run_once(out, "explicit", ["fit", *common, "--run", str(out / "explicit"), *architecture,
                                          *shlex.split(args.fit_flags)])
    if not (out / "warm" / "explicit").exists():
        shutil.copytree(out / "explicit", out / "warm", dirs_exist_ok=True)
    warm = run_once(out, "warm", ["train", *common, "--run", str(out / "warm"), "--init", "explicit",
                                  "--learning-rate", str(args.warm_learning_rate), *budget])
    colds = [run_once(out, f"cold{s}", ["train", *common, "--run", str(out / f"cold{s}"), "--init", "random",
                                        "--seed", str(s), "--learning-rate", str(args.cold_learning_rate),
                                        *budget, *architecture]) for s in range(args.seeds)]

    warm_curve = curve(out / "warm")
    cold_curves = [curve(out / f"cold{s}") for s in range(args.seeds)]
    cold_final_subset = float(np.mean([c[-1]["dev_loss"] for c in cold_curves]))
    reached = next((r["step"] for r in warm_curve if r["dev_loss"] <= cold_final_subset), None)
    total_steps = warm_curve[-1]["step"]
    cold_loss = [c["dev_loss"] for c in colds]
    summary = {
        "explicit_dev_loss": explicit["dev_loss"], "explicit_dev_bpb": explicit["dev_bpb"],
        "explicit_seconds": explicit["seconds"], "params": explicit["params"],
        "warm_dev_loss": warm["dev_loss"], "warm_dev_bpb": warm["dev_bpb"],
        "warm_train_seconds": warm["train_seconds"], "warm_tokens_per_s": warm["tokens_per_s"],
        "cold_dev_loss_mean": float(np.mean(cold_loss)), "cold_dev_loss_std": float(np.std(cold_loss)),
        "cold_dev_bpb_mean": float(np.mean([c["dev_bpb"] for c in colds])),
        "cold_train_seconds_mean": float(np.mean([c["train_seconds"] for c in colds])),
        "cold_tokens_per_s_mean": float(np.mean([c["tokens_per_s"] for c in colds])),
        "steps": total_steps, "cold_final_subset_dev_loss": cold_final_subset,
        "warm_steps_to_cold_final": reached if reached is not None else -1,
        "claim_warm_beats_cold": warm["dev_loss"] < float(np.mean(cold_loss)),
        "claim_warm_reaches_cold_in_quarter": reached is not None and reached <= total_steps / 4,
        "claim_explicit_no_worse_than_cold": explicit["dev_loss"] <= float(np.mean(cold_loss)),
    }
    atomic_write_json(out / "summary.json", summary)
    write_metrics(args.metrics_json, summary)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, key, label in zip(axes, ("step", "tokens", "seconds"), ("steps", "training tokens", "training seconds")):
        ax.plot([r[key] for r in warm_curve], [r["dev_loss"] for r in warm_curve], color="tab:red",
                label="warm (explicit init)")
        for s, c in enumerate(cold_curves):
            ax.plot([r[key] for r in c], [r["dev_loss"] for r in c], color="tab:blue", alpha=0.6,
                    label="cold (random init)" if s == 0 else None)
        ax.axhline(warm_curve[0]["dev_loss"], color="k", ls="--", label="explicit only")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dev loss, nats/token (periodic dev subset)")
    axes[0].set_ylim(top=max(6.5, warm_curve[0]["dev_loss"] + 0.5))
    axes[0].legend()
    corpus = json.loads((args.workdir / "meta.json").read_text())["corpus"]
    fig.suptitle(f"SAFFU cold vs warm start on {corpus}: {total_steps} steps of "
                 f"{warm_curve[-1]['tokens'] // max(total_steps, 1):,} tokens")
    fig.tight_layout()
    fig.savefig(out / "dev_loss_curves.png", dpi=110)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
