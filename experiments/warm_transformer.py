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
per core) can share ``--out``. ``--report`` gathers every finished run into ``report.json``, a
table (``report.md``) and ``curves.png``: dev loss against steps, seconds (solve included) and
FLOPs, and the steps-to-target table (target = the cold start's mean final dev loss on the
same windows).

    python experiments/warm_transformer.py --workdir runs/babylm --out runs/warm_transformer \\
        --exact-run runs/exact_kn --variants cold residual --seeds 0 1 2
    python experiments/warm_transformer.py --workdir runs/babylm --out runs/warm_transformer \\
        --exact-run runs/exact_kn --variants cold explicit-init residual kn-residual --seeds 0 \\
        --probe-lrs 0.003 0.01 0.03
    python experiments/warm_transformer.py --workdir runs/babylm --out runs/warm_transformer --report
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

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


def _first_at(history: list[dict], target: float, offset: float, key: str) -> float:
    """The first ``key`` (plus ``offset``) at which the recorded dev loss is at or below
    ``target``, interpolated linearly between evaluations; ``nan`` if never."""
    previous = None
    for record in history:
        if record["dev_loss"] <= target:
            if previous is None or previous["dev_loss"] == record["dev_loss"]:
                return record[key] + offset
            share = (previous["dev_loss"] - target) / (previous["dev_loss"] - record["dev_loss"])
            return previous[key] + share * (record[key] - previous[key]) + offset
        previous = record
    return math.nan


def report(out: Path) -> dict:
    """Gather every finished run under ``out/runs`` into ``report.json``, ``report.md`` and ``curves.png``."""
    results = [json.loads(path.read_text()) for path in sorted((out / "runs").glob("*/result.json"))]
    # this experiment's runs only: budgets.py puts any_model.py's runs (a "model", no "fraction") beside them
    results = [r for r in results if "fraction" in r and "model" not in r]
    if not results:
        raise SystemExit(f"no finished runs under {out / 'runs'}")
    rows, lines = [], []
    # one group per data fraction, budget and width: runs of other budgets are not more seeds
    setting = lambda r: (r["fraction"], r.get("epochs", 1), r.get("width", 128))
    settings = sorted({setting(r) for r in results})
    record = out / "probe" / "choice.json"
    probes = json.loads(record.read_text()) if record.exists() else {}      # the learning-rate probes so far
    chosen = {variant: entry["learning_rate"] for variant, entry in probes.items()}
    rate_of = lambda variant: chosen.get(variant, DEFAULT_LR)
    lines.append("| data | epochs | width | variant | learning rate | seeds | trained params | dev bits/byte (mean ± sd) | "
                 "dev loss | steps to target | seconds to target (solve incl.) | FLOPs to target |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fraction, epochs, width in settings:
        here = [r for r in results if setting(r) == (fraction, epochs, width)]
        # the target: the cold start at its own (probed) rate, else at any rate it was run at
        cold = ([r for r in here if r["variant"] == "cold" and r["learning_rate"] == rate_of("cold")]
                or [r for r in here if r["variant"] == "cold"])
        if cold:
            cold = [r for r in cold if r["learning_rate"] == cold[0]["learning_rate"]]
            target = float(np.mean([r["history"][-1]["dev_loss"] for r in cold]))
            cold_steps = float(np.mean([r["history"][-1]["step"] for r in cold]))
            cold_seconds = float(np.mean([r["history"][-1]["seconds"] for r in cold]))
            cold_flops = float(np.mean([r["history"][-1]["flops"] for r in cold]))
        for variant, learning_rate in sorted({(r["variant"], r["learning_rate"]) for r in here},
                                             key=lambda pair: (VARIANTS.index(pair[0]), pair[1])):
            group = [r for r in here if r["variant"] == variant and r["learning_rate"] == learning_rate]
            bpb = [r["dev_bpb"] for r in group]
            row = {"fraction": fraction, "epochs": epochs, "width": width, "variant": variant,
                   "learning_rate": learning_rate,
                   "probe_choice": variant in chosen and chosen[variant] == learning_rate,
                   "seeds": [r["seed"] for r in group],
                   "trained_params": group[0]["trained_params"], "dev_bpb_mean": float(np.mean(bpb)),
                   "dev_bpb_sd": float(np.std(bpb, ddof=1)) if len(bpb) > 1 else 0.0,
                   "dev_loss_mean": float(np.mean([r["dev_loss"] for r in group])),
                   "solve_seconds": float(np.mean([r["solve_seconds"] for r in group])),
                   "train_seconds": float(np.mean([r["history"][-1]["seconds"] for r in group]))}
            if "scale" in group[0]:
                row["scale_mean"] = float(np.mean([r["scale"] for r in group]))
            if cold:
                # the target is the cold seeds' mean final loss; the cold start's own share is 100%
                # by definition (a seed that ends above the mean would otherwise read "not reached")
                own = all(r in cold for r in group)
                at = (lambda r, key, offset: r["history"][-1][key]) if own else \
                    (lambda r, key, offset, target=target: _first_at(r["history"], target, offset, key))
                steps = [at(r, "step", 0.0) for r in group]
                seconds = [at(r, "seconds", r["solve_seconds"]) for r in group]
                flops = [at(r, "flops", 0.0) for r in group]
                row.update(target_dev_loss=target, steps_to_target=float(np.mean(steps)),
                           steps_share=float(np.mean(steps)) / cold_steps,
                           seconds_to_target=float(np.mean(seconds)), seconds_share=float(np.mean(seconds)) / cold_seconds,
                           flops_to_target=float(np.mean(flops)), flops_share=float(np.mean(flops)) / cold_flops)
            rows.append(row)
            share = (lambda key, row=row: f"{row[key]:.0%}" if key in row and math.isfinite(row[key]) else "not reached")
            sd = f" ± {row['dev_bpb_sd']:.4f}" if len(group) > 1 else " (one seed)"
            rate = f"{learning_rate:g}" + (" (probed)" if row["probe_choice"] else "")
            lines.append(f"| {fraction:.0%} | {epochs} | {width} | {variant} | {rate} | {len(group)} | "
                         f"{row['trained_params']:,} | "
                         f"{row['dev_bpb_mean']:.4f}{sd} | {row['dev_loss_mean']:.4f} | "
                         f"{share('steps_share')} | {share('seconds_share')} | {share('flops_share')} |")
    if probes:
        rates = sorted({float(rate) for entry in probes.values() for rate in entry["losses"]})
        lines += ["", f"Learning-rate probe (one run per rate on {next(iter(probes.values()))['fraction']:.0%} of "
                      "the training data, seed 0; last periodic dev loss, nats/token):", "",
                  "| variant | " + " | ".join(f"lr {rate:g}" for rate in rates) + " | chosen |",
                  "|---|" + "---|" * (len(rates) + 1)]
        for variant in sorted(probes, key=VARIANTS.index):
            losses = probes[variant]["losses"]
            lines.append(f"| {variant} | " + " | ".join(f"{losses[f'{rate:g}']:.4f}" if f"{rate:g}" in losses else "–"
                                                        for rate in rates)
                         + f" | {probes[variant]['learning_rate']:g} |")
    table = "\n".join(lines)
    (out / "report.md").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps({"rows": rows, "probes": probes}, indent=1))
    _plot([r for r in results if r["learning_rate"] == rate_of(r["variant"])] or results, out / "curves.png")
    print(table)
    return {"rows": rows}


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    full = [r for r in results if r["fraction"] == max(x["fraction"] for x in results)]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    colours = dict(zip(VARIANTS, ("tab:gray", "tab:blue", "tab:olive", "tab:cyan", "tab:purple", "tab:red",
                                  "tab:orange", "tab:pink", "tab:green", "tab:brown"), strict=True))
    for variant in VARIANTS:
        group = [r for r in full if r["variant"] == variant]
        for i, r in enumerate(group):
            history = r["history"]
            loss = [h["dev_loss"] for h in history]
            label = variant if i == 0 else None
            axes[0].plot([h["step"] for h in history], loss, color=colours[variant], alpha=0.8, label=label)
            axes[1].plot([h["seconds"] + r["solve_seconds"] for h in history], loss, color=colours[variant], alpha=0.8)
            axes[2].plot([h["flops"] for h in history], loss, color=colours[variant], alpha=0.8)
    for axis, name in zip(axes, ("optimizer steps", "seconds (explicit solve included)", "training FLOPs")):
        axis.set_xlabel(name)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("dev loss (nats/token, evenly spaced windows)")
    axes[0].legend()
    figure.suptitle("transformer, one epoch: cold start against explicit init and explicit residuals "
                    "(each seed, each variant at its own learning rate)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def inspect(out: Path, args, source) -> dict:
    """Attention diagnostics (:mod:`saffu.eval.attention`) of every finished run's final
    transformer (``f_θ`` of a residual) on ``--inspect-windows`` evenly spaced dev windows;
    each saved as the run's ``attention.json``, all of them in ``attention.png`` and ``attention.md``."""
    import jax

    from saffu.eval.attention import inspect_attention, plot_profiles
    from saffu.training.checkpoints import load_latest_params
    profiles, lines = {}, ["| run | max effective rank per layer (90% energy) | largest column's share per layer | "
                           "first visible key's share per layer (uniform attention) | lazy layers |",
                           "|---|---|---|---|---|"]
    for path in sorted((out / "runs").glob("*/result.json")):
        run = path.parent
        record = run / "attention.json"
        if not record.exists():
            config = _transformer(args, source.vocab_size)
            template = jax.eval_shape(lambda config=config: model_init(config, jax.random.key(0)))
            if run.name.startswith("residual"):            # λ is trained (so checkpointed) when learned only
                template = {"model": template, **({"scale": jax.ShapeDtypeStruct((), "float32")}
                                                  if run.name.startswith("residual-learned") else {})}
            loaded = load_latest_params(run / "train", template)
            if loaded is None:
                continue
            params = loaded[0]["model"] if run.name.startswith("residual") else loaded[0]
            record.write_text(json.dumps(inspect_attention(params, config, source.tokens("dev"),
                                                           windows=args.inspect_windows)))
        profiles[run.name] = profile = json.loads(record.read_text())
        ranks = " ".join(str(layer["max_rank"]) for layer in profile["layers"])
        shares = " ".join(f"{layer['mean_top_column_share']:.2f}" for layer in profile["layers"])
        firsts = " ".join(f"{layer['mean_first_key_share']:.2f}" for layer in profile["layers"])
        lines.append(f"| {run.name} | {ranks} | {shares} | {firsts} ({profile['first_key_share_if_uniform']:.2f}) | "
                     f"{profile['lazy_layers'] or 'none'} |")
    if profiles:
        plot_profiles(profiles, out / "attention.png", "attention of the trained transformers (f_θ for residuals): "
                      "effective rank and largest-column share per layer")
        (out / "attention.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return profiles


@dataclasses.dataclass
class Options:
    """The variants, seeds and shares of the training data to run, and the report.

    Attributes:
      workdir: a prepared work directory (not needed for --report)
      out: runs and the report go here
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
      report: only gather the finished runs
      metrics_json: flat JSON of the report's rows
      inspect: also the attention diagnostics of every finished run (needs --workdir)
      inspect_windows: dev windows of the attention diagnostics
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
    report: bool = False
    metrics_json: Path | None = None
    inspect: bool = False
    inspect_windows: int = 64


def check(options: Options) -> None:
    if options.probe_lrs and not 0 < options.probe_fraction <= 1:
        raise SaffuError("--probe-fraction must be in (0, 1]")
    if options.workdir is None and not options.report:
        raise SaffuError("--workdir is required to train")
    if options.workdir is None and options.inspect:
        raise SaffuError("--inspect needs --workdir")


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0], check=check)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from saffu.data.workdir import open_workdir
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
    summary = report(args.out)
    if args.inspect:
        from saffu.data.workdir import open_workdir
        inspect(args.out, args, open_workdir(args.workdir))
    if args.metrics_json:
        from saffu._io import write_metrics
        write_metrics(args.metrics_json, {f"{row['variant']}_f{row['fraction']:g}_lr{row['learning_rate']:g}_{key}": value
                                          for row in summary["rows"] for key, value in row.items()
                                          if isinstance(value, float)})


if __name__ == "__main__":
    main()
