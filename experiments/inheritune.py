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
  explicit factors, :func:`saffu.training.recipes.explicit_start`).

With ``--grow``, the inherited model is then grown by the reference's next block
(:func:`saffu.training.recipes.grow`) and trained one more epoch, until its full-dev loss
is at or below the reference's or it has the reference's depth. Every stage is a run spec of
``saffu train`` (``--init inherit --reference R``, grown with ``--start-from``), run by
:func:`saffu.runner.run` in ``OUT/runs/VARIANT_LN``, scored on the whole dev split and its attention
profiled by ``saffu inspect``. Finished stages are skipped on a rerun, so several processes can
share ``--out`` (say one variant per core).

    python experiments/inheritune.py --workdir runs/babylm --reference runs/budgets/runs/cold_e1_w128_s0_lr0.01 \\
        --out runs/inheritune --variants inherit scratch --grow
    python experiments/inheritune.py --workdir runs/babylm --reference R --out runs/inheritune --report \\
        --write-result                                  # results/inheritune.json, docs/results/inheritune.png
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from saffu.eval import bench
from saffu.eval.plots import Series, plot_curves
from saffu.flags import script_main, script_options
from saffu.models.interface import config_from_dict
from saffu.runner import history, run, run_saffu, write_result

RESULTS = Path(__file__).resolve().parents[1] / "results"

VARIANTS = ("inherit", "scratch", "explicit")


def reference_of(args) -> tuple[dict, dict]:
    """The reference's model settings (its ``config.json``) and its whole-dev scores (``saffu
    eval``, once, kept in ``OUT/reference.json``)."""
    if not (args.reference / "config.json").exists():
        raise SystemExit(f"{args.reference} holds no config.json: the reference must be a saffu train run")
    model = dataclasses.asdict(config_from_dict(json.loads((args.reference / "config.json").read_text())["model"]))
    if model["kind"] != "transformer":
        raise SystemExit(f"{args.reference} holds a {model['kind']}; the reference must be a transformer")
    record = args.out / "reference.json"
    if not record.exists():
        run_saffu("eval", "--workdir", args.workdir, "--run", args.reference, "--split", "dev", "--eval-tokens", 0,
               "--metrics-json", args.out / "scores.json")
        scores = json.loads((args.out / "scores.json").read_text())
        record.write_text(json.dumps({"run": str(args.reference), "layers": model["layers"], **scores}))
    return model, json.loads(record.read_text())


def spec_of(args, model: dict, variant: str, layers: int, grown_from: Path | None = None) -> dict:
    """A stage's run spec: one epoch at ``--learning-rate``, scored on the whole dev split, from
    the reference's first ``layers`` blocks (``inherit``; grown by its next block from the run
    ``grown_from``), or the reference's architecture with ``layers`` blocks from a random or an
    explicit init."""
    if variant == "inherit":
        start = {"init": "inherit", "model": "transformer", "reference": str(args.reference.resolve()),
                 **({"start_from": str(grown_from.resolve())} if grown_from else {"inherit_layers": layers})}
        shape = {}
    else:
        start = {"init": "random" if variant == "scratch" else "explicit", "model": "transformer"}
        shape = {k: v for k, v in model.items() if k != "vocab_size"} | {"layers": layers}
    return {"start": start, "model": {"kind": "transformer", **shape}, "eval": {"eval_tokens": 0},
            "train": {"learning_rate": args.learning_rate, "seed": args.seed, "eval_every": args.eval_every}}


def stage(args, model: dict, variant: str, layers: int, grown_from: Path | None = None) -> dict:
    """Train one stage through :func:`saffu.runner.run` (a finished one is skipped), profile its
    attention (``saffu inspect``) and keep its figures in ``OUT/runs/VARIANT_LN/stage.json``."""
    name = f"{variant}_L{layers}"
    folder = args.out / "runs" / name
    if (folder / "stage.json").exists():
        return json.loads((folder / "stage.json").read_text())
    row = run(spec_of(args, model, variant, layers, grown_from), args.out / "runs", args.workdir, name)
    run_saffu("inspect", "--workdir", args.workdir, "--run", folder, "--windows", args.inspect_windows)
    profile = json.loads((folder / "attention.json").read_text())
    result = {"variant": variant, "layers": layers, "params": row["params"], "train_tokens": row["tokens"],
              "train_seconds": row["train_seconds"], "flops": row["flops"],
              "solve_seconds": row.get("solve_seconds", 0.0), "history": history(folder),
              "attention": {"max_rank": [layer["max_rank"] for layer in profile["layers"]],
                            "first_key_share": [layer["mean_first_key_share"] for layer in profile["layers"]],
                            "lazy_layers": profile["lazy_layers"]},
              **{k: v for k, v in row.items() if k.startswith("dev_")}}
    (folder / "stage.json").write_text(json.dumps(result))
    print(f"{variant} with {layers} blocks: dev {result['dev_bpb']:.4f} bits/byte "
          f"({result['train_seconds']:.0f} s training)", flush=True)
    return result


def run_variant(args, variant: str) -> None:
    """A variant's first stage; ``inherit`` with ``--grow`` then grows by the reference's next
    block, one epoch a stage, until it is at or below the reference's dev loss or as deep."""
    model, reference = reference_of(args)
    layers = args.layers or max(1, model["layers"] // 2)
    result = stage(args, model, variant, layers)
    while (args.grow and variant == "inherit" and result["dev_loss"] > reference["dev_loss"]
           and result["layers"] < model["layers"]):
        result = stage(args, model, variant, result["layers"] + 1, args.out / "runs" / f"inherit_L{result['layers']}")


def report(args) -> None:
    """``report.json`` and ``curves.png`` of every finished stage (with
    ``--write-result``: ``results/inheritune.json`` and ``docs/results/inheritune.png``)."""
    reference = json.loads((args.out / "reference.json").read_text())
    results = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*/stage.json"))]
    stages = [{k: v for k, v in r.items() if k != "history"} for r in results]
    (args.out / "report.json").write_text(json.dumps({"reference": reference, "stages": stages}, indent=1))
    colours = dict(zip(VARIANTS, ("tab:red", "tab:gray", "tab:blue")))
    curves, offset = [], {}         # each variant's stages one after another: steps cumulative over its growth
    for r in sorted(results, key=lambda r: (VARIANTS.index(r["variant"]), r["layers"])):
        points = [(offset.get(r["variant"], 0) + h["step"], h["dev_loss"]) for h in r["history"]]
        offset[r["variant"]] = points[-1][0]
        curves.append(Series(points, f"{r['variant']}, {r['layers']} blocks",
                             {"color": colours[r["variant"]], "alpha": 0.5 + 0.5 * (r["layers"] % 2)}))
    low = min([reference["dev_loss"]] + [h["dev_loss"] for r in results for h in r["history"]])
    plot = RESULTS.parent / "docs" / "results" / "inheritune.png" if args.write_result else args.out / "curves.png"
    plot_curves(plot, curves, xlabel="optimizer steps (cumulative over growth stages)",
                ylabel="dev loss (evenly spaced windows)", legend={"fontsize": 8},
                levels=[(reference["dev_loss"], {"color": "black", "linestyle": ":",
                                                 "label": f"reference ({reference['layers']} blocks), full dev"})],
                ylim=(low - 0.05, low + 1.5))           # the first steps of a cold start are far above
    columns = [("variant", "variant", ""), ("blocks", "layers", "d"), ("dev loss", "dev_loss", ".4f"),
               ("bits/byte", "dev_bpb", ".4f")]
    print(f"reference ({reference['layers']} blocks): dev {reference['dev_loss']:.4f} nats\n"
          + bench.table(sorted(stages, key=lambda r: (r["variant"], r["layers"])), columns))
    if args.write_result:       # the page's table: experiments/pages/inheritune.md
        write_result(RESULTS, "inheritune", {"reference": reference, "stages": stages,
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
    for variant in () if args.report else args.variants:      # a failed stage: the runner names it and its log
        run_variant(args, variant)
    report(args)


if __name__ == "__main__":
    script_main(main)
