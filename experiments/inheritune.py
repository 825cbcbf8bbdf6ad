"""Inheritune on the transformer: a smaller model that inherits the first blocks of a trained
reference, against the same small model trained from scratch and from explicit init, at equal
training tokens; then grown one block at a time until it matches the reference.

The reference is any trained transformer run (``saffu train --model transformer``, e.g. a run of
``experiments/budgets.py``: its ``runs/<name>`` folder). Variants, each the
reference's architecture with ``--layers`` blocks (default: half the reference's), one epoch
each, the same learning rate, batches and seed:

* ``inherit``: token embeddings, positions, the first blocks, final norm and output layer of the
  reference (:func:`saffu.training.recipes.inherit`);
* ``scratch``: random init;
* ``explicit``: explicit init (output bias = log unigram, embeddings and output kernel from the
  explicit factors, :func:`saffu.training.recipes.explicit_transformer_start`).

With ``--grow``, the inherited model is then grown by the reference's next block
(:func:`saffu.training.recipes.grow`) and trained one more epoch, until its full-dev loss
is at or below the reference's or it has the reference's depth. Every stage is scored on the
whole dev split and its attention profiled (:mod:`saffu.eval.attention`). Finished stages are
skipped on a rerun, so several processes can share ``--out`` (say one variant per core).

    python experiments/inheritune.py --workdir runs/babylm --reference runs/budgets/runs/cold_e1_w128_s0_lr0.01 \\
        --out runs/inheritune --variants inherit scratch --grow
    python experiments/inheritune.py --workdir runs/babylm --reference R --out runs/inheritune --report \\
        --write-result                                  # results/inheritune.json, docs/results/inheritune.png
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from results import RESULTS, write_result
from saffu.flags import script_options
from saffu.models.interface import model_init

VARIANTS = ("inherit", "scratch", "explicit")


def _stage(args, source, reference, reference_params, variant: str, layers: int, start) -> dict:
    """Train one stage (one epoch) and score it; ``start`` is ``(config, params)`` or None."""
    import jax

    from saffu.configs import TrainConfig
    from saffu.eval.attention import inspect_attention
    from saffu.eval.scoring import evaluate_split
    from saffu.models.interface import parameter_count
    from saffu.training.recipes import explicit_transformer_start, inherit, start_run
    from saffu.training.trainer import train

    key = jax.random.fold_in(jax.random.key(args.seed), 0)
    solve_seconds = 0.0
    if start is not None:
        config, params = start
    elif variant == "inherit":
        config, params = inherit(reference_params, reference, layers)
    else:
        config = dataclasses.replace(reference, layers=layers)
        params = model_init(config, key)
        if variant == "explicit":
            params, solve_seconds, _ = explicit_transformer_start(source, config, key)
    run = args.out / "runs" / f"{variant}_L{config.layers}"
    start_run(run, config, source)                            # a CLI run: saffu eval / inspect / blimp take it
    train_config = TrainConfig(learning_rate=args.learning_rate, seed=args.seed, eval_every=args.eval_every,
                               checkpoint_every=0)
    trained, history = train(config, params, source.tokens(source.train_split), train_config, run,
                             dev_stream=source.tokens("dev"), progress=False)
    scores = evaluate_split(trained, config, source, "dev", None, progress=False)
    profile = inspect_attention(trained, config, source.tokens("dev"), windows=args.inspect_windows)
    result = {"variant": variant, "layers": config.layers, "params": parameter_count(trained),
              "train_tokens": history[-1]["tokens"], "train_seconds": history[-1]["seconds"],
              "flops": history[-1]["flops"], "solve_seconds": solve_seconds, "history": history,
              "attention": {"max_rank": [layer["max_rank"] for layer in profile["layers"]],
                            "first_key_share": [layer["mean_first_key_share"] for layer in profile["layers"]],
                            "lazy_layers": profile["lazy_layers"]}, **scores}
    (run / "result.json").write_text(json.dumps(result))
    print(f"{variant} with {config.layers} blocks: dev {scores['dev_bpb']:.4f} bits/byte "
          f"({history[-1]['seconds']:.0f} s training)", flush=True)
    return result


def _finished(args, variant: str, layers: int) -> dict | None:
    path = args.out / "runs" / f"{variant}_L{layers}" / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def _load(run: Path, config):
    import jax

    from saffu.training.checkpoints import load_latest_params
    loaded = load_latest_params(run, jax.eval_shape(lambda: model_init(config, jax.random.key(0))))
    if loaded is None:
        raise SystemExit(f"{run} has no training checkpoint")
    return loaded[0]


def reference_of(args, source):
    """The reference's config, params and full-dev scores (computed once, kept in ``--out``)."""
    from saffu.eval.scoring import evaluate_split
    from saffu.training.checkpoints import load_run_config
    if not (args.reference / "config.json").exists():
        raise SystemExit(f"{args.reference} holds no config.json: the reference must be a saffu train run")
    config = load_run_config(args.reference)
    if config.kind != "transformer":
        raise SystemExit(f"{args.reference} holds a {config.kind}; the reference must be a transformer")
    params = _load(args.reference, config)
    record = args.out / "reference.json"
    if not record.exists():
        scores = evaluate_split(params, config, source, "dev", None, progress=False)
        record.write_text(json.dumps({"run": str(args.reference), "layers": config.layers, **scores}))
    return config, params, json.loads(record.read_text())


def run_variant(args, source, variant: str) -> None:
    from saffu.training.recipes import grow
    reference, reference_params, reference_scores = reference_of(args, source)
    layers = args.layers or max(1, reference.layers // 2)
    result = _finished(args, variant, layers) or _stage(args, source, reference, reference_params, variant, layers,
                                                         None)
    while (args.grow and variant == "inherit" and result["dev_loss"] > reference_scores["dev_loss"]
           and result["layers"] < reference.layers):
        done = _finished(args, variant, result["layers"] + 1)
        if done is None:
            run = args.out / "runs" / f"{variant}_L{result['layers']}"
            small = dataclasses.replace(reference, layers=result["layers"])
            done = _stage(args, source, reference, reference_params, variant, result["layers"] + 1,
                          grow(_load(run, small), small, reference_params, reference))
        result = done


def report(args) -> None:
    """``report.md``, ``report.json`` and ``curves.png`` of every finished stage (with
    ``--write-result``: ``results/inheritune.json`` and ``docs/results/inheritune.png``)."""
    reference = json.loads((args.out / "reference.json").read_text())
    results = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*/result.json"))]
    lines = ["| model | blocks | params | training tokens (cumulative) | dev loss | dev bits/byte | "
             "max attention rank per layer | lazy layers |", "|---|---|---|---|---|---|---|---|"]
    lines.append(f"| reference ({reference['run']}) | {reference['layers']} | | | {reference['dev_loss']:.4f} | "
                 f"{reference['dev_bpb']:.4f} | | |")
    for r in sorted(results, key=lambda r: (r["variant"], r["layers"])):
        earlier = sum(x["train_tokens"] for x in results if x["variant"] == r["variant"] and x["layers"] < r["layers"])
        lines.append(f"| {r['variant']} | {r['layers']} | {r['params']:,} | {earlier + r['train_tokens']:,} | "
                     f"{r['dev_loss']:.4f} | {r['dev_bpb']:.4f} | {' '.join(map(str, r['attention']['max_rank']))} | "
                     f"{r['attention']['lazy_layers'] or 'none'} |")
    table = "\n".join(lines)
    stages = [{k: v for k, v in r.items() if k != "history"} for r in results]
    (args.out / "report.md").write_text(table + "\n")
    (args.out / "report.json").write_text(json.dumps({"reference": reference, "stages": stages}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(8, 4.5))
    colours = dict(zip(VARIANTS, ("tab:red", "tab:gray", "tab:blue")))
    for variant in VARIANTS:
        offset = 0
        for r in sorted((r for r in results if r["variant"] == variant), key=lambda r: r["layers"]):
            steps = np.array([h["step"] for h in r["history"]]) + offset
            axis.plot(steps, [h["dev_loss"] for h in r["history"]], color=colours[variant],
                      label=f"{variant}, {r['layers']} blocks", alpha=0.5 + 0.5 * (r["layers"] % 2))
            offset = steps[-1]
    axis.axhline(reference["dev_loss"], color="black", linestyle=":", label=f"reference ({reference['layers']} blocks), "
                                                                           "full dev")
    axis.set_xlabel("optimizer steps (cumulative over growth stages)")
    axis.set_ylabel("dev loss (evenly spaced windows)")
    low = min([reference["dev_loss"]] + [h["dev_loss"] for r in results for h in r["history"]])
    axis.set_ylim(low - 0.05, low + 1.5)             # the first steps of a cold start are far above
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    plot = RESULTS.parent / "docs" / "results" / "inheritune.png" if args.write_result else args.out / "curves.png"
    figure.savefig(plot, dpi=110)
    plt.close(figure)
    print(table)
    if args.write_result:
        write_result("inheritune", {"reference": reference, "stages": stages, "table": table,
                                    "learning_rate": args.learning_rate, "plot": str(plot.relative_to(RESULTS.parent))},
                     seeds=[args.seed], load={"note": "one stage at a time on one core (taskset), other runs on the "
                                                      "other core; each stage's seconds are in its row"})


@dataclasses.dataclass
class Options:
    """The reference, the variants and their training.

    Attributes:
      workdir: a prepared work directory
      reference: a trained transformer run (a saffu train run folder)
      out: stages and the report go here
      variants: the small models to train
      layers: blocks of the small model (default: half the reference's)
      grow: grow the inherited model until it matches the reference
      learning_rate: peak learning rate (every stage)
      seed: seed of the batches and the random init
      eval_every: steps between dev evaluations
      inspect_windows: dev windows of the attention profile
      report: only gather the finished stages
      write_result: write results/inheritune.json and its plot (docs/results/inheritune.png)
    """

    workdir: Path = dataclasses.field(metadata={"required": True})
    reference: Path = dataclasses.field(metadata={"required": True})
    out: Path = Path("runs/inheritune")
    variants: tuple[str, ...] = dataclasses.field(default=VARIANTS, metadata={"nargs": "+", "choices": VARIANTS})
    layers: int | None = None
    grow: bool = False
    learning_rate: float = 0.01
    seed: int = 0
    eval_every: int = 50
    inspect_windows: int = 64
    report: bool = False
    write_result: bool = False


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0])
    args.out.mkdir(parents=True, exist_ok=True)
    from saffu.data.workdir import open_workdir
    source = open_workdir(args.workdir)
    if not args.report:
        reference_of(args, source)
        for variant in args.variants:
            run_variant(args, source, variant)
    report(args)


if __name__ == "__main__":
    main()
