"""Explicit warm start of the transformer, measured in steps, seconds and FLOPs to a target.

Variants, all the same transformer (the same trainable parameters), the same trainer, learning
rate and data order per seed:

* ``cold``: random init;
* ``explicit-init``: output bias = log unigram, token embeddings and output kernel from the
  explicit low-rank factors at rank = width (offset 0, ``--factor-refine-steps`` likelihood steps
  after the SVD), rescaled to the random init's scale
  (:func:`saffu.models.transformer.explicit_transformer_init`); the ablation of its pieces:
  ``explicit-bias`` takes the bias only, ``explicit-embed`` the bias and the embeddings;
  ``explicit-init-rms1`` is explicit init with the embeddings at RMS 1.0 (the scale a norm layer
  outputs) instead of the random init's;
* ``residual``: ``logits = log P_exact + f_θ`` over the exact token-resolution model
  (``saffu exact``, Kneser-Ney chain, frozen), ``f_θ``'s output layer at zero, so step 0 is the
  exact model; ``residual-learned`` also learns ``λ``; ``residual-annealed`` lets ``λ`` fall
  from 1 to 0 over the first half of the steps, then trains (and keeps) ``f_θ`` alone;
* ``kn-residual``: the same residual over a plain interpolated modified Kneser-Ney 5-gram from the
  engine's counts (the exact model's nested chain ``0 | 0,1 | 0,1,2 | 0,1,2,3`` with every
  temperature 1 and no held-out calibration: the log-linear sum telescopes to the 5-gram);
* ``residual-crossfit``: the residual cross-fitted over ``--folds`` folds of whole documents:
  each step's windows come from one fold and its explicit part is the exact model solved
  without that fold (those solves count in its seconds); evaluation uses the whole split's.

Learning rates: ``--probe-lrs`` gives every variant the same probe budget — one run per rate on
``--probe-fraction`` of the training data (seed 0, one epoch of it), scored by its last periodic
dev loss — and each variant's main runs use its best rate (``probe/choice.json``); without it,
every variant runs at ``--learning-rate``.

For every fraction of the training data (whole documents, :func:`saffu.data.workdir.
subset_workdir`) the explicit parts are solved from that fraction only, and their seconds are
added to the variant's training seconds. Each run (variant, seed, fraction) trains one epoch,
records dev loss every ``--eval-every`` steps on evenly spaced dev windows, and is scored on the
whole dev split at the end; finished runs are skipped on a rerun, so several processes (say one
per core) can share ``--out``. Each run's ``result.json`` holds its history (dev loss against
steps, seconds and FLOPs); :mod:`budgets` gathers these runs into the sweep's table, its
multipliers and its steps to the cold start's loss, and ``saffu inspect`` profiles a run's
attention.

    python experiments/warm_transformer.py --workdir runs/babylm --out runs/warm_transformer \\
        --exact-run runs/exact_kn --variants cold residual --seeds 0 1 2
    python experiments/warm_transformer.py --workdir runs/babylm --out runs/warm_transformer \\
        --exact-run runs/exact_kn --variants cold explicit-init residual kn-residual --seeds 0 \\
        --probe-lrs 0.003 0.01 0.03
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from saffu._io import SaffuError
from saffu.configs import FactorConfig  # imports no jax
from saffu.flags import script_options
from saffu.models.interface import model_init

VARIANTS = ("cold", "explicit-init", "explicit-init-rms1", "explicit-bias", "explicit-embed", "residual", "residual-learned",
            "residual-annealed", "kn-residual", "residual-crossfit")
RESIDUAL_SCALE = {"residual": "fixed", "residual-learned": "learned", "residual-annealed": "annealed",
                  "kn-residual": "fixed", "residual-crossfit": "fixed"}
#: The learning rate of every variant without a probe; runs at another rate carry it in their name.
DEFAULT_LR = 0.01
#: Kneser-Ney 5-gram as an exact model: the nested chain of the previous 1 … 4 tokens.
KN_GROUPS = ((0,), (0, 1), (0, 1, 2), (0, 1, 2, 3))
PIECES = {"explicit-init": ("bias", "embeddings", "output"), "explicit-init-rms1": ("bias", "embeddings", "output"),
          "explicit-bias": ("bias",), "explicit-embed": ("bias", "embeddings")}
#: The embeddings' scale of an explicit init (default: the random init's RMS).
EMBEDDING_RMS = {"explicit-init-rms1": 1.0}


def _workdir(source, out: Path, fraction: float):
    from saffu.data.workdir import open_workdir, subset_workdir
    if fraction >= 1:
        return source
    path = out / "data" / f"{fraction:g}"
    if (path / "meta.json").exists():
        return open_workdir(path)
    return subset_workdir(source, path, train_fraction=fraction)


def _exact(workdir, out: Path, fraction: float, exact_run: Path | None, kneser_ney: bool = False):
    """The exact model's run directory for this fraction (solved here unless given) and its
    seconds; ``kneser_ney``: the plain Kneser-Ney 5-gram (:data:`KN_GROUPS`, temperatures 1)."""
    from saffu.configs import ExactConfig
    from saffu.eval.scoring import evaluate_split
    from saffu.solve.exact import solve_exact
    from saffu.training.checkpoints import save_explicit_run
    name = "kn" if kneser_ney else "exact"
    run = exact_run if (exact_run is not None and fraction >= 1) else out / name / f"{fraction:g}"
    record = run / "solve.json"
    if record.exists():
        return run, json.loads(record.read_text())
    metrics = run / "metrics.json"
    if metrics.exists() and (run / "explicit").exists():        # a `saffu exact` run with --metrics-json
        report = json.loads(metrics.read_text())
    else:
        config = (ExactConfig(workdir.vocab_size, groups=KN_GROUPS, buckets=(), holdout_tokens=0) if kneser_ney
                  else ExactConfig(workdir.vocab_size))
        params, report = solve_exact(workdir, config, progress=False)
        save_explicit_run(run, config, workdir, params)
        report.update(evaluate_split(params, config, workdir, "dev", None, progress=False))
    summary = {"seconds": report["seconds"], "dev_bpb": report["dev_bpb"], "dev_loss": report["dev_loss"],
               "peak_rss_mb": report.get("peak_rss_mb")}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(summary))
    return run, summary


def run_name(variant: str, seed: int, fraction: float, learning_rate: float, epochs: int = 1, width: int = 128,
             folds: int = 2) -> str:
    """A main run's directory name (the rate only where it is not :data:`DEFAULT_LR`, the epochs
    where they are not 1, the width where it is not 128, a cross-fitted residual's folds where
    they are not 2)."""
    return (f"{variant}_s{seed}_f{fraction:g}" + ("" if learning_rate == DEFAULT_LR else f"_lr{learning_rate:g}")
            + ("" if epochs == 1 else f"_e{epochs}") + ("" if width == 128 else f"_w{width}")
            + ("" if variant != "residual-crossfit" or folds == 2 else f"_k{folds}"))


def run_one(variant: str, seed: int, fraction: float, args, source, learning_rate: float,
            run: Path | None = None, final_eval: bool = True) -> dict:
    import jax

    from saffu.configs import TrainConfig
    from saffu.eval.scoring import evaluate_split
    from saffu.models.interface import parameter_count
    from saffu.training.checkpoints import load_run_config, save_run_config
    from saffu.training.recipes import explicit_transformer_start, residual_start, solve_folds
    from saffu.training.trainer import steps_per_epoch, train

    workdir = _workdir(source, args.out, fraction)
    base = _transformer(args, workdir.vocab_size)
    key = jax.random.fold_in(jax.random.key(seed), 0)
    solve_seconds, extra = 0.0, {}
    if variant == "cold":
        config, params = base, model_init(base, key)
    elif variant in PIECES:
        params, solve_seconds, report = explicit_transformer_start(
            workdir, base, key, PIECES[variant], FactorConfig(refine_steps=args.factor_refine_steps),
            embedding_rms=EMBEDDING_RMS.get(variant))
        config = base
        extra.update(factor_holdout_loss=report.get("holdout_loss"), factor_refine_steps=args.factor_refine_steps)
    else:
        kneser_ney = variant == "kn-residual"
        exact_run, summary = _exact(workdir, args.out, fraction, args.kn_run if kneser_ney else args.exact_run,
                                    kneser_ney)
        fold_runs, fold_seconds = (), 0.0
        if variant == "residual-crossfit":       # the folds' exact models: part of the start's cost
            record = args.out / "folds" / f"{fraction:g}_k{args.folds}" / "solve.json"
            fold_runs, _, fold_seconds = solve_folds(workdir, load_run_config(exact_run), args.folds, record.parent)
            if record.exists():                  # solved by an earlier run of this experiment
                fold_seconds = json.loads(record.read_text())["seconds"]
            else:
                record.write_text(json.dumps({"seconds": fold_seconds}))
            extra.update(folds=args.folds, fold_seconds=fold_seconds)
        config, params = residual_start(base, exact_run, key, RESIDUAL_SCALE[variant], fold_runs=tuple(fold_runs))
        solve_seconds = summary["seconds"] + fold_seconds
        extra.update(explicit_dev_bpb=summary["dev_bpb"], explicit_dev_loss=summary["dev_loss"])
    fixed = {name: params[name] for name in getattr(config, "fixed_params", ()) if name in params}
    epochs = getattr(args, "epochs", 1) if final_eval else 1      # probes: one epoch of their share
    run = run or args.out / "runs" / run_name(variant, seed, fraction, learning_rate, epochs, base.width, args.folds)
    train_config = TrainConfig(learning_rate=learning_rate, seed=seed, eval_every=args.eval_every,
                               eval_windows=args.eval_windows, checkpoint_every=args.checkpoint_every)
    # a budget of several epochs is its own run with its own cosine schedule over all its steps
    train_config = dataclasses.replace(train_config, steps=epochs * steps_per_epoch(
        len(workdir.tokens(workdir.train_split)) - 1, train_config))
    # RUN/train is a saffu run folder: saffu eval, blimp, export and the harness read it
    save_run_config(run / "train", config, workdir)
    trained, _ = train(config, params, workdir.tokens(workdir.train_split), train_config, run / "train",
                       dev_stream=workdir.tokens("dev"), progress=False)
    # every evaluation of the run, also those before a resume (the trainer returns only this call's)
    history = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line]
    scores = evaluate_split(trained, config, workdir, "dev", args.eval_tokens or None, progress=False) \
        if final_eval else {}
    result = {"variant": variant, "seed": seed, "fraction": fraction, "learning_rate": learning_rate,
              "epochs": epochs, "width": base.width, "layers": base.layers,
              "trained_params": parameter_count(trained) - parameter_count(fixed),
              "train_tokens": int(len(workdir.tokens(workdir.train_split))), "solve_seconds": solve_seconds,
              "vocab_size": workdir.vocab_size, "workdir": str(args.workdir),
              "history": history, **extra, **scores}
    if variant == "residual-learned":
        result["scale"] = float(trained["scale"])
    (run / "result.json").write_text(json.dumps(result))
    return result


def probe(variant: str, args, source) -> dict:
    """The learning-rate probe of one variant: one run per rate of ``--probe-lrs`` on
    ``--probe-fraction`` of the training data (seed 0, one epoch of it), each scored by its last
    periodic dev loss (a main run of the same variant, fraction, seed and rate counts as its
    probe). Returns and records (``probe/choice.json``) ``{"losses": {rate: loss},
    "learning_rate": the best rate}``; a run that diverges scores ``inf``."""
    fraction, losses = args.probe_fraction, {}
    for learning_rate in args.probe_lrs:
        main = args.out / "runs" / run_name(variant, 0, fraction, learning_rate) / "result.json"
        path = args.out / "probe" / f"{variant}_lr{learning_rate:g}_f{fraction:g}"
        if main.exists():
            result = json.loads(main.read_text())
        elif (path / "result.json").exists():
            result = json.loads((path / "result.json").read_text())
        else:
            result = run_one(variant, 0, fraction, args, source, learning_rate, run=path, final_eval=False)
            print(f"probe {variant:>17} lr {learning_rate:g}: dev loss {result['history'][-1]['dev_loss']:.4f}",
                  flush=True)
        loss = result["history"][-1]["dev_loss"]
        losses[f"{learning_rate:g}"] = loss if math.isfinite(loss) else math.inf
    best = min(args.probe_lrs, key=lambda rate: losses[f"{rate:g}"])
    record = args.out / "probe" / "choice.json"
    choice = json.loads(record.read_text()) if record.exists() else {}
    choice[variant] = {"losses": losses, "learning_rate": best, "fraction": fraction}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(choice, indent=1))
    return choice[variant]


def _transformer(args, vocab_size: int):
    from saffu.configs import TransformerConfig
    return TransformerConfig(vocab_size, width=args.width, layers=args.layers, block="gpt", output_bias=True)


@dataclasses.dataclass
class Options:
    """The variants, seeds and shares of the training data to run.

    Attributes:
      workdir: a prepared work directory
      out: the runs go here
      variants: the variants to train
      seeds: the seeds of each variant
      fractions: shares of the training split
      exact_run: an existing `saffu exact` run of the whole training split
      kn_run: an existing Kneser-Ney 5-gram `saffu exact` run of the whole training split
        (--groups "0 0,1 0,1,2 0,1,2,3" --buckets --holdout-tokens 0), for kn-residual
      learning_rate: peak learning rate of every variant (without --probe-lrs)
      probe_lrs: probe these peak learning rates per variant (the same budget for each) and train each variant at
        its best
      probe_fraction: share of the training data of each probe run
      factor_refine_steps: likelihood steps of the explicit factors after the SVD, for explicit init (0: the SVD's
        factors, as the README's 100% rows were measured; run names do not carry it: use another --out to compare)
      width: transformer width
      folds: folds of residual-crossfit
      epochs: epochs of each main run (its own warm-up + cosine schedule over all of them)
      checkpoint_every: steps between checkpoints (an interrupted run resumes from its last one)
      layers: transformer blocks
      eval_every: steps between dev evaluations
      eval_windows: dev windows of the periodic evaluations
      eval_tokens: dev tokens of the final score (0: all)
    """

    workdir: Path | None = None
    out: Path = Path("runs/warm_transformer")
    variants: tuple[str, ...] = dataclasses.field(default=("cold", "explicit-init", "residual"),
                                                  metadata={"choices": VARIANTS, "nargs": "+"})
    seeds: tuple[int, ...] = dataclasses.field(default=(0, 1, 2), metadata={"nargs": "+"})
    fractions: tuple[float, ...] = dataclasses.field(default=(1.0,), metadata={"nargs": "+"})
    exact_run: Path | None = None
    kn_run: Path | None = None
    learning_rate: float = DEFAULT_LR
    probe_lrs: tuple[float, ...] = dataclasses.field(default=(), metadata={"nargs": "+"})
    probe_fraction: float = 0.25
    factor_refine_steps: int = FactorConfig.refine_steps
    width: int = 128
    folds: int = 2
    epochs: int = 1
    checkpoint_every: int = 200
    layers: int = 5
    eval_every: int = 50
    eval_windows: int = 128
    eval_tokens: int = 0


def check(options: Options) -> None:
    if options.probe_lrs and not 0 < options.probe_fraction <= 1:
        raise SaffuError("--probe-fraction must be in (0, 1]")
    if options.workdir is None:
        raise SaffuError("--workdir is required")


def main(argv=None):
    from saffu.data.workdir import open_workdir
    args = script_options(Options, argv, __doc__.splitlines()[0], check=check)
    args.out.mkdir(parents=True, exist_ok=True)
    source = open_workdir(args.workdir)
    rates = {variant: probe(variant, args, source)["learning_rate"] if args.probe_lrs else args.learning_rate
             for variant in args.variants}
    for fraction in args.fractions:
        for seed in args.seeds:
            for variant in args.variants:
                name = run_name(variant, seed, fraction, rates[variant], args.epochs, args.width, args.folds)
                if (args.out / "runs" / name / "result.json").exists():
                    continue
                result = run_one(variant, seed, fraction, args, source, rates[variant])
                print(f"{fraction:.0%} {variant:>16} seed {seed}: dev {result['dev_bpb']:.4f} bits/byte, "
                      f"{result['history'][-1]['seconds']:.0f} s training + {result['solve_seconds']:.0f} s solve",
                      flush=True)


if __name__ == "__main__":
    main()
