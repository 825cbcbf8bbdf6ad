"""The single-layer cipher bigram: explicit solution vs the same layer trained by Adam.

Fits the explicit solution (one statistics pass + β calibration), then trains the same layer
with the project's one trainer (:func:`saffu.training.trainer.train`, Adam without weight decay)
from random init (cold start, several seeds) and from the explicit solution (warm start) on the
same batches, evaluating dev loss along the way (evenly spaced dev windows; the final figures
score every dev pair). Writes JSON results and a PNG of dev bits per byte against training
seconds.

    python experiments/bigram_explicit_vs_adam.py --workdir W --out runs/bigram
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from saffu import (
    BigramConfig,
    CipherConfig,
    TrainConfig,
    bigram_nll,
    fit_explicit_bigram,
    open_workdir,
    pair_counts,
    random_bigram,
    split_metrics,
    train,
)
from saffu._io import atomic_write_json, write_metrics


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/bigram"))
    parser.add_argument("--bits", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=1.0, help="Adam budget in epochs of the training split")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="targets per window")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="cold-start peak learning rate")
    parser.add_argument("--warm-learning-rate", type=float, default=0.003, help="warm-start peak learning rate")
    parser.add_argument("--seeds", type=int, default=3, help="cold-start seeds")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--metrics-json", type=Path)
    args = parser.parse_args(argv)

    workdir = open_workdir(args.workdir)
    cipher = CipherConfig(bits=args.bits)
    layer = BigramConfig(cipher=cipher, vocab_size=workdir.vocab_size)
    train_stream, dev_stream = workdir.tokens(workdir.train_split), workdir.tokens("dev")
    dev = pair_counts(dev_stream, vocab_size=workdir.vocab_size)
    info = workdir.split_info("dev")
    bytes_per_token = info["bytes"] / info["predicted_tokens"]
    to_bpb = lambda loss: loss / np.log(2) / bytes_per_token

    explicit, report = fit_explicit_bigram(workdir, layer)
    results = {"explicit": {**split_metrics(bigram_nll(explicit, dev), info, "dev_"), **report}}
    tokens_per_step = args.batch_size * args.seq_len
    steps = int(args.epochs * (len(train_stream) - 1) // tokens_per_step)
    runs = {}

    def run(name, params, learning_rate, seed):
        run_dir = args.out / name
        shutil.rmtree(run_dir, ignore_errors=True)          # every run starts afresh
        config = TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             learning_rate=learning_rate, warmup_steps=20, weight_decay=0.0,
                             eval_every=args.eval_every, checkpoint_every=steps, seed=seed)
        trained, history = train(layer, params, train_stream, config, run_dir, dev_stream=dev_stream)
        runs[name] = history
        results[name] = {**split_metrics(bigram_nll(trained, dev), info, "dev_"),
                         "train_seconds": history[-1]["seconds"], "steps": steps}

    for seed in range(args.seeds):
        run(f"cold_seed{seed}", random_bigram(layer, workdir.vocab_size, jax.random.key(seed)),
            args.learning_rate, seed)
    run("warm", explicit, args.warm_learning_rate, 0)

    cold_losses = [results[f"cold_seed{s}"]["dev_loss"] for s in range(args.seeds)]
    summary = {
        "explicit_dev_loss": results["explicit"]["dev_loss"], "explicit_dev_bpb": results["explicit"]["dev_bpb"],
        "explicit_seconds": results["explicit"]["seconds"],
        "cold_dev_loss_mean": float(np.mean(cold_losses)), "cold_dev_loss_std": float(np.std(cold_losses)),
        "cold_dev_bpb_mean": float(np.mean([results[f"cold_seed{s}"]["dev_bpb"] for s in range(args.seeds)])),
        "cold_train_seconds_mean": float(np.mean([results[f"cold_seed{s}"]["train_seconds"]
                                                  for s in range(args.seeds)])),
        "warm_dev_loss": results["warm"]["dev_loss"], "warm_dev_bpb": results["warm"]["dev_bpb"],
        "warm_train_seconds": results["warm"]["train_seconds"], "steps": steps, "tokens_per_step": tokens_per_step,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "results.json", {"summary": summary, "models": results, "curves": runs})
    write_metrics(args.metrics_json, summary)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, history in runs.items():
        seconds = [h["seconds"] for h in history]
        ax.plot(seconds, [to_bpb(h["dev_loss"]) for h in history], label=name,
                color="tab:red" if name == "warm" else "tab:blue", alpha=1 if name == "warm" else 0.5)
    ax.axhline(results["explicit"]["dev_bpb"], color="k", ls="--",
               label=f"explicit ({results['explicit']['seconds']:.1f} s)")
    ax.set_xlabel("Adam training seconds")
    ax.set_ylabel("dev bits per byte")
    ax.set_ylim(top=max(3.0, results["explicit"]["dev_bpb"] + 0.3))
    ax.set_title(f"cipher bigram ({args.bits} bits) on {workdir.meta['corpus']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "dev_bpb_vs_seconds.png", dpi=120)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
