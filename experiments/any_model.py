"""Explicit init of language models nobody here wrote: penzai's Llama-like transformer and its
GPT-NeoX, random init against explicit init, each a run spec of ``saffu train``.

The models are built by penzai (``pip install -e '.[models]'``) at the size of the project's
transformer (width 128, 5 blocks, 4 heads of 32): ``saffu train --model penzai``
(:class:`saffu.configs.PenzaiConfig`, its parameters a plain dict ``{label: array}``):

* ``llama``: embeddings ``[V, d]`` and an output kernel ``[d, V]`` (untied, no output bias:
  RMSNorm, RoPE, SwiGLU);
* ``llama-tied``: one matrix for both (penzai scales the embeddings by ``√d``), set to
  :func:`saffu.models.penzai.tied_matrix` (``--tied`` chooses the closed form);
* ``neox``: GPT-NeoX (LayerNorm, parallel attention and MLP, partial RoPE, GELU), untied, no bias;
* ``saffu-nobias``: the control, saffu's own transformer without an output bias (the gpt block).

None has an output bias, so the explicit start (``--init explicit``) sets the embeddings and the
output kernel only: the embeddings at RMS 1.0 (``--embedding-rms``; at penzai's own ``1/√d``
they are buried under the random blocks' outputs), the output kernel at its random RMS; a tied
matrix (also the output kernel) at its own RMS. ``random-rms`` is the scale ablation: random
init with the embeddings at RMS 1.0. Every run trains with ``saffu train`` (same windows, same
data order, AdamW on warm-up + cosine at ``--learning-rate``, the same for both: the rate the
project's own transformer uses for cold and explicit starts), one epoch of the training split
unless ``--epochs`` or ``--steps`` (``experiments/budgets.py`` runs the Llama-like model at
several budgets this way), in its own folder ``OUT/runs/MODEL-VARIANT_e1_w128_s0_lr0.01`` run by
:func:`saffu.runner.run` (finished runs are skipped, interrupted ones resume); each run is scored
on the whole dev split (``--eval-tokens`` of whole documents with ``--steps``: 100,000 unless
given). Figures per model: ``<model>_random_dev_loss`` / ``_explicit_dev_loss`` (nats/token),
``_dev_bpb``, and the explicit run's steps to the random run's final periodic dev loss.

    python experiments/any_model.py --workdir runs/babylm --steps 30 --metrics-json runs/any_model/m.json
    python experiments/any_model.py --workdir runs/babylm --models llama --inits random   # one run per core
    python experiments/any_model.py --workdir runs/babylm --report     # results/any_model.json, docs/results
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from saffu._io import SaffuError, write_metrics
from saffu.configs import PenzaiConfig, TrainConfig
from saffu.eval.race import steps_to_reach
from saffu.flags import script_main, script_options
from saffu.runner import gather_one, history, steps_per_epoch, sweep, write_result

RESULTS = Path(__file__).resolve().parents[1] / "results"

MODELS = ("llama", "neox", "llama-tied", "saffu-nobias")
INITS = ("random", "explicit", "random-rms")
#: The rate of the project's transformer, cold and explicit (experiments/budgets.py RATES).
LEARNING_RATE = 0.01
#: The explicit embeddings' root-mean-square (``saffu train --explicit-embedding-rms``).
EMBEDDING_RMS = 1.0
SHORT_EVAL_TOKENS = 100_000
#: A run's folder under ``OUT/runs``: ``llama-explicit_e1_w128_s0_lr0.01`` (``_n30_``: 30 steps),
#: the name ``experiments/budgets.py`` reads its Llama-like starts by.
NAME = re.compile(rf"(?P<model>{'|'.join(MODELS)})-(?P<variant>(?:random|explicit)[^_]*)_(?P<budget>[en])(?P<count>\d+)"
                  r"_w\d+_s(?P<seed>\d+)_lr[^_]+")


def default_rms(name: str) -> float:
    """The explicit embeddings' RMS: :data:`EMBEDDING_RMS`, or for a tied matrix (also the output
    kernel, where RMS 1.0 makes the step-0 logits huge) the random matrix's own (0)."""
    return 0.0 if name.endswith("-tied") else EMBEDDING_RMS


def model_section(name: str) -> dict:
    """The run spec's ``model`` section of the model ``name`` of :data:`MODELS`."""
    if name == "saffu-nobias":
        return {"kind": "transformer", "block": "gpt", "output_bias": False, "across_documents": False}
    return {"kind": "penzai", "family": "llama" if name.startswith("llama") else "neox", "tied": name.endswith("-tied")}


def spec_of(name: str, init: str, args, epoch: int) -> tuple[str, dict]:
    """``(folder name, run spec)`` of model ``name`` from ``init`` with ``args``' training, on a
    training split of ``epoch`` steps (:func:`saffu.runner.steps_per_epoch` at 16 × 256 targets a step)."""
    rms = default_rms(name) if args.embedding_rms is None else args.embedding_rms
    tied = name.endswith("-tied")
    variant = init if init.startswith("random") else "explicit" + \
        (f"-tied-{args.tied}" if tied and args.tied != "mean" else "") + (f"-rms{rms:g}" if rms != default_rms(name) else "")
    start = {"init": "random" if init == "random" else "explicit", "model": model_section(name)["kind"]}
    if init == "random-rms":            # the ablation: random embeddings at the explicit ones' scale
        start.update(explicit_pieces=[], explicit_embedding_rms=EMBEDDING_RMS)
    elif init == "explicit":
        start.update(explicit_pieces=["embeddings", "output"], explicit_embedding_rms=rms or None,
                     **({"explicit_tied": args.tied} if tied else {}))
    # a budget of several epochs is one run with its own warm-up and cosine schedule over all its steps
    train = {"steps": args.steps or args.epochs * epoch, "learning_rate": args.learning_rate, "seed": args.seed,
             "eval_every": args.eval_every}
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (SHORT_EVAL_TOKENS if args.steps else 0)
    budget = f"n{args.steps}" if args.steps else f"e{args.epochs}"
    return (f"{name}-{variant}_{budget}_w{PenzaiConfig.width}_s{args.seed}_lr{args.learning_rate:g}",
            {"start": start, "model": model_section(name), "train": train, "eval": {"eval_tokens": eval_tokens}})


def row_of(folder: Path) -> dict | None:
    """A finished run folder's row: :func:`saffu.runner.gather_one`'s, with ``model``,
    ``variant``, ``init``, ``seed``, ``epochs`` (``None`` for a run of ``--steps``),
    ``solve_seconds`` and its periodic evaluations ``history``; ``None`` for another folder."""
    match = NAME.fullmatch(folder.name)
    if match is None or not (folder / "spec.json").exists():
        return None
    variant, row = match["variant"], gather_one(folder)
    return {**row, "model": match["model"], "variant": variant, "seed": int(match["seed"]),
            "init": variant if variant.startswith("random") else "explicit", "history": history(folder),
            "epochs": int(match["count"]) if match["budget"] == "e" else None,
            "solve_seconds": row.get("solve_seconds", 0.0)}


def summarise(results: list[dict]) -> dict:
    """Flat figures per model: both inits' dev loss and bits/byte, the gain, and the explicit
    run's steps to the random run's final periodic dev loss. ``<model>_explicit_*`` is the
    default explicit init; other variants (``random-rms``, ``explicit-rms0``, …) get
    ``<model>_<variant>_dev_loss`` / ``_dev_bpb``."""
    figures = {}
    for name in MODELS:
        runs = {r["variant"]: r for r in results if r["model"] == name}
        warm = runs.get("explicit")
        if "random" not in runs or warm is None:
            continue
        cold = runs["random"]
        reached = steps_to_reach([(h["step"], h["dev_loss"]) for h in warm["history"]], cold["history"][-1]["dev_loss"])
        reached = math.nan if reached is None else reached       # never reached
        figures.update({f"{name}_{init}_{key}": run[key] for init, run in (("random", cold), ("explicit", warm))
                        for key in ("dev_loss", "dev_bpb", "train_seconds")})
        figures.update({f"{name}_gain_bpb": cold["dev_bpb"] - warm["dev_bpb"],
                        f"{name}_steps": cold["steps"], f"{name}_explicit_steps_to_random_final": reached,
                        f"{name}_explicit_share_of_steps": reached / cold["steps"],
                        f"{name}_dev_whole_split": bool(cold["dev_whole_split"]),
                        f"{name}_explicit_solve_seconds": warm["solve_seconds"]})
        for variant, run in runs.items():
            if run is not warm and variant != "random":
                figures.update({f"{name}_{variant}_dev_loss": run["dev_loss"], f"{name}_{variant}_dev_bpb": run["dev_bpb"]})
    return figures


def short_runs(results: list[dict]) -> list[dict]:
    """Every 30-step run (the page's table of them): each variant's ``model``, ``variant``, final
    ``dev_loss`` and ``dev_tokens`` and its periodic dev losses (``curve``: at steps 0, 10, 20 and 30)."""
    return [{"curve": [h["dev_loss"] for h in r["history"]],
             **{key: r[key] for key in ("model", "variant", "dev_loss", "dev_tokens")}}
            for r in sorted(results, key=lambda r: (MODELS.index(r["model"]), r["variant"]))]


@dataclasses.dataclass
class Options:
    """The models, inits and training of the runs.

    Attributes:
      workdir: prepared work directory (babylm-2023-4src)
      out: the runs go to OUT/runs
      models: the models to train
      inits: the inits of each model (random-rms: random init with the embeddings at RMS 1, the scale ablation)
      steps: training steps (0: --epochs)
      epochs: epochs of the training split, one run with its own warm-up and cosine schedule over all its steps
        (without --steps)
      learning_rate: peak learning rate of every run
      tied: closed form of a tied matrix (llama-tied)
      embedding_rms: root-mean-square of the explicit embeddings (0: the random embeddings' own; default: 1, for a
        tied matrix — also the output kernel — its own)
      seed: the seed of every run
      eval_every: steps between periodic dev losses
      eval_tokens: dev tokens scored at the end (0: the whole split; default: whole, or 100,000 with --steps)
      metrics_json: write the figures as a flat JSON object here
      report: gather the finished one-epoch runs into results/any_model.json
      quiet: no line per run
    """

    workdir: Path | None = dataclasses.field(default=None, metadata={"required": True})
    out: Path = Path("runs/any_model")
    models: tuple[str, ...] = dataclasses.field(default=("llama", "neox"), metadata={"choices": MODELS, "nargs": "+"})
    inits: tuple[str, ...] = dataclasses.field(default=("random", "explicit"), metadata={"choices": INITS, "nargs": "+"})
    steps: int = 0
    epochs: int = 1
    learning_rate: float = LEARNING_RATE
    tied: str = dataclasses.field(default="mean", metadata={"choices": ("embedding", "output", "mean")})
    embedding_rms: float | None = None
    seed: int = 0
    eval_every: int = 50
    eval_tokens: int | None = None
    metrics_json: Path | None = None
    report: bool = False
    quiet: bool = False


def check(options: Options) -> None:
    if options.epochs < 1:
        raise SaffuError(f"--epochs must be at least 1, got {options.epochs}")


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0], check=check)
    folders = sorted((args.out / "runs").glob("*/result.json")) if (args.out / "runs").is_dir() else []
    if args.report:
        rows = [row for row in map(row_of, (path.parent for path in folders)) if row is not None]
        epoch = [row for row in rows if row["epochs"] == 1]
        figures = summarise(epoch)
        if not figures:
            raise SystemExit(f"no finished pair of one-epoch runs under {args.out / 'runs'}")
        short = [row for row in rows if row["epochs"] is None and row["steps"] == 30]
        path = write_result(RESULTS, "any_model", {**figures, "short_runs": short_runs(short)},   # the page: its tables
                            seeds=sorted({r["seed"] for r in epoch + short}))
        print(f"wrote {path}")
        return 0
    epoch = steps_per_epoch(args.workdir, TrainConfig.seq_len * TrainConfig.batch_size)
    specs = dict(spec_of(name, init, args, epoch) for name in args.models for init in args.inits)
    sweep(specs, args.out / "runs", args.workdir, jobs=1, say=(lambda message: None) if args.quiet else print)
    results = [row_of(args.out / "runs" / folder) for folder in specs]
    figures = summarise(results)
    if figures:
        print(json.dumps(figures, indent=1))
    write_metrics(args.metrics_json, {**figures, **{f"{r['model']}_{r['init']}_dev_loss": r["dev_loss"] for r in results}})
    return 0


if __name__ == "__main__":
    script_main(main)
