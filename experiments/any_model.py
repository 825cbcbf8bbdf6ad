"""Explicit init of language models nobody here wrote: penzai's Llama-like transformer and its
GPT-NeoX, random init against explicit init, through the public API only.

The models are built by penzai (``pip install -e '.[models]'``) at the size of the project's
transformer (width 128, 5 blocks, 4 heads of 32), behind saffu's model interface by
:class:`saffu.interop.penzai.PenzaiModel`, whose parameters are a plain dict ``{label: array}``, so
:func:`saffu.interop.explicit_init` names the leaves by label:

* ``llama``: ``transformer/embedder.embeddings`` ``[V, d]``, ``transformer/lm_head.weights`` ``[d, V]``
  (untied, no output bias: RMSNorm, RoPE, SwiGLU);
* ``llama-tied``: one matrix for both (penzai scales the embeddings by ``√d``), set to
  :func:`saffu.interop.tied_matrix` (``--tied`` chooses the closed form);
* ``neox``: GPT-NeoX (LayerNorm, parallel attention and MLP, partial RoPE, GELU), untied ``lm_head`` without a bias.

None has an output bias, so the explicit init sets the embeddings and the output kernel only:
the embeddings at RMS 1.0 (``--embedding-rms``; at penzai's own ``1/√d`` they are buried under
the random blocks' outputs), the output kernel at its random RMS; a tied matrix (also the output
kernel) at its own RMS. Both inits train with the project's trainer (:func:`saffu.training.trainer.train`: same
windows, same data order, AdamW on warm-up + cosine at ``--learning-rate``, the same for both:
the rate the project's own transformer uses for cold and explicit starts), one epoch of the
training split unless ``--epochs`` or ``--steps`` (``experiments/budgets.py`` runs the Llama-like
model at several budgets this way); each run is scored on the whole dev split (``--eval-tokens``
of whole documents with ``--steps``: 100,000 unless given). Figures per model:
``<model>_random_dev_loss`` / ``_explicit_dev_loss`` (nats/token), ``_dev_bpb``, and the
explicit run's steps to the random run's final periodic dev loss.

    python experiments/any_model.py --workdir runs/babylm --steps 30 --metrics-json runs/any_model/m.json
    python experiments/any_model.py --workdir runs/babylm --models llama --inits random   # one run per core
    python experiments/any_model.py --workdir runs/babylm --report     # results/any_model.json, docs/results
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from saffu._io import SaffuError
from saffu.eval.race import steps_to_reach
from saffu.flags import script_options
from saffu.interop.init import FOLD_SHARE
from saffu.interop.penzai import PenzaiModel
from saffu.models.interface import model_init

MODELS = ("llama", "neox", "llama-tied", "saffu-nobias")
INITS = ("random", "explicit", "random-rms")
#: The rate of the project's transformer, cold and explicit (experiments/budgets.py RATES).
LEARNING_RATE = 0.01
#: The explicit embeddings' root-mean-square (see :func:`saffu.interop.explicit_init`).
EMBEDDING_RMS = 1.0
SHORT_EVAL_TOKENS = 100_000


@dataclasses.dataclass(frozen=True)
class SaffuNoBias:
    """The control: saffu's own transformer without an output bias (the layout ``saffu export``
    writes), initialised through the same public API as the penzai models."""

    vocab_size: int
    tied: bool = False

    def __post_init__(self):
        from saffu.configs import TransformerConfig
        object.__setattr__(self, "config", TransformerConfig(self.vocab_size, output_bias=False, block="gpt"))

    kind = "external"                             # a model with its own init and logits

    def __getattr__(self, name):                  # context, forward_flops, eval_seq_len, the config's fields
        return getattr(self.__dict__["config"], name)

    def init(self, key) -> dict:
        from saffu.models.interface import model_init
        return model_init(self.config, key)

    def logits(self, params: dict, tokens):
        from saffu.models.interface import model_logits
        return model_logits(self.config, params, tokens)

    def selectors(self) -> dict:
        return {"embedding": "embed/embedding", "output": "output/kernel"}


def default_rms(model) -> float:
    """The explicit embeddings' RMS: :data:`EMBEDDING_RMS`, or for a tied matrix (also the output
    kernel, where RMS 1.0 makes the step-0 logits huge) the random matrix's own (0)."""
    return 0.0 if model.tied else EMBEDDING_RMS


def model_for(name: str, vocab_size: int):
    if name == "saffu-nobias":
        return SaffuNoBias(vocab_size)
    return PenzaiModel("llama" if name.startswith("llama") else "neox", vocab_size, tied=name.endswith("-tied"))


def _embedding_leaf(params: dict, label: str) -> tuple[dict, str]:
    """``(the dict holding the embedding, its key)``: a flat label (penzai) or a nested path."""
    if label in params:
        return params, label
    *parents, last = label.split("/")
    for key in parents:
        params = params[key]
    return params, last


def pieces_for(workdir, rank: int, out: Path):
    """The explicit pieces of rank ``rank``, solved once and kept as an init file in ``out``."""
    from saffu.interop import read_init_file, solve_pieces, write_init_file
    path = out / f"pieces_r{rank}.safetensors"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        tick = time.perf_counter()
        pieces = solve_pieces(workdir, rank, progress=False)
        write_init_file(pieces, path)
        (out / f"pieces_r{rank}_seconds.json").write_text(json.dumps({"seconds": time.perf_counter() - tick}))
    return read_init_file(path), json.loads((out / f"pieces_r{rank}_seconds.json").read_text())["seconds"]


def run_one(name: str, init: str, args) -> dict:
    """Train one (model, init) and score it; the result also lands in ``OUT/runs/NAME/result.json``."""
    import jax

    from saffu.configs import TrainConfig
    from saffu.data.workdir import open_workdir
    from saffu.eval.scoring import evaluate_split
    from saffu.interop import explicit_init
    from saffu.models.interface import parameter_count
    from saffu.training.trainer import steps_per_epoch, train
    workdir = open_workdir(args.workdir)
    model = model_for(name, workdir.vocab_size)
    rms = default_rms(model) if args.embedding_rms is None else args.embedding_rms
    variant = init if init.startswith("random") else "explicit" + \
        (f"-tied-{args.tied}" if model.tied and args.tied != "mean" else "") + \
        (f"-fold{args.fold_share:g}" if args.fold and not model.tied else "") + \
        (f"-rms{rms:g}" if rms != default_rms(model) else "")
    run = args.out / "runs" / f"{name}_{variant}_s{args.seed}_{args.steps or f'e{args.epochs}'}"
    if (run / "result.json").exists():
        return json.loads((run / "result.json").read_text())
    params = model_init(model, jax.random.key(args.seed))
    stream = workdir.tokens(workdir.train_split)
    solve_seconds = 0.0
    if init == "random-rms":            # the ablation: random embeddings at the explicit ones' scale
        holder, key = _embedding_leaf(params, model.selectors()["embedding"])
        holder[key] = holder[key] * (EMBEDDING_RMS / float(np.sqrt(np.mean(np.square(holder[key])))))
    if init == "explicit":
        pieces, solve_seconds = pieces_for(workdir, 128, args.out)
        fold = args.fold and not model.tied
        sample = jax.numpy.asarray(np.asarray(stream[:8 * 257]).reshape(8, 257).astype(np.int32))  # training tokens
        params = explicit_init(params, pieces, tied=args.tied, fold=fold, apply=model.logits if fold else None,
                               sample=sample if fold else None, fold_share=args.fold_share,
                               embedding_rms=rms or None, **model.selectors())
    # a budget of several epochs is one run with its own warm-up and cosine schedule over all its steps
    settings = TrainConfig(learning_rate=args.learning_rate, seed=args.seed, eval_every=args.eval_every,
                           steps=args.steps or args.epochs * steps_per_epoch(len(stream) - 1, TrainConfig()))
    trained, _ = train(model, params, stream, settings, run / "train", dev_stream=workdir.tokens("dev"),
                       progress=not args.quiet)
    history = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line]
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (SHORT_EVAL_TOKENS if args.steps else 0)
    scores = evaluate_split(trained, model, workdir, "dev", eval_tokens or None, progress=not args.quiet,
                            prefix="dev_")
    result = {"model": name, "init": init, "variant": variant, "seed": args.seed, "steps": settings.steps,
              "epochs": None if args.steps else args.epochs, "width": model.width, "layers": model.layers,
              "vocab_size": workdir.vocab_size, "workdir": str(args.workdir),
              "learning_rate": args.learning_rate, "tied": args.tied if model.tied else None,
              "trained_params": parameter_count(trained), "solve_seconds": solve_seconds,
              "train_seconds": history[-1]["seconds"], "history": history, **scores}
    (run / "result.json").write_text(json.dumps(result))
    return result


def summarise(results: list[dict]) -> dict:
    """Flat figures per model: both inits' dev loss and bits/byte, the gain, and the explicit
    run's steps to the random run's final periodic dev loss. ``<model>_explicit_*`` is the
    default explicit init; other variants (``random-rms``, ``explicit-fold10``, …) get
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
        figures.update({f"{name}_random_dev_loss": cold["dev_loss"], f"{name}_explicit_dev_loss": warm["dev_loss"],
                        f"{name}_random_dev_bpb": cold["dev_bpb"], f"{name}_explicit_dev_bpb": warm["dev_bpb"],
                        f"{name}_gain_bpb": cold["dev_bpb"] - warm["dev_bpb"],
                        f"{name}_steps": cold["steps"], f"{name}_explicit_steps_to_random_final": reached,
                        f"{name}_explicit_share_of_steps": reached / cold["steps"],
                        f"{name}_dev_whole_split": bool(cold["dev_whole_split"]),
                        f"{name}_explicit_solve_seconds": warm["solve_seconds"],
                        f"{name}_random_train_seconds": cold["train_seconds"],
                        f"{name}_explicit_train_seconds": warm["train_seconds"]})
        for variant, run in runs.items():
            if run is not warm and variant != "random":
                figures.update({f"{name}_{variant}_dev_loss": run["dev_loss"], f"{name}_{variant}_dev_bpb": run["dev_bpb"]})
    return figures


def table(figures: dict) -> str:
    rows = ["| model | steps | random dev bits/byte | explicit dev bits/byte | gain "
            "| explicit's steps to random's final loss |",
            "|---|---:|---:|---:|---:|---:|"]
    for name in MODELS:
        if f"{name}_gain_bpb" in figures:
            f = lambda key, name=name: figures[f"{name}_{key}"]
            rows.append(f"| {name} | {f('steps')} | {f('random_dev_bpb'):.4f} | {f('explicit_dev_bpb'):.4f} | "
                        f"{f('gain_bpb'):+.4f} | {f('explicit_steps_to_random_final'):.0f} "
                        f"({100 * f('explicit_share_of_steps'):.0f}%) |")
    return "\n".join(rows)


def short_table(results: list[dict]) -> str:
    """Every 30-step run: each variant's dev loss at steps 0, 10, 20 and 30 and at the end (a line
    saying how to make them where there are none)."""
    if not results:
        return "(no 30-step runs yet: `python experiments/any_model.py --workdir W --steps 30` makes them)"
    rows = ["| model | init | dev loss at step 0 / 10 / 20 / 30 (periodic windows) | dev loss (nats, end) | dev tokens |",
            "|---|---|---|---:|---:|"]
    for r in sorted(results, key=lambda r: (MODELS.index(r["model"]), r["variant"])):
        curve = " / ".join(f"{h['dev_loss']:.2f}" for h in r["history"])
        rows.append(f"| {r['model']} | {r['variant']} | {curve} | {r['dev_loss']:.4f} | {r['dev_tokens']:,} |")
    return "\n".join(rows)


@dataclasses.dataclass
class Options:
    """The models, inits and training of the runs.

    Attributes:
      workdir: prepared work directory (babylm-2023-4src)
      out: runs and pieces go here
      models: the models to train
      inits: the inits of each model (random-rms: random init with the embeddings at RMS 1, the scale ablation)
      steps: training steps (0: --epochs)
      epochs: epochs of the training split, one run with its own warm-up and cosine schedule over all its steps
        (without --steps)
      learning_rate: peak learning rate of every run
      tied: closed form of a tied matrix (llama-tied)
      fold: fold the unigram into the embeddings and the output kernel (untied models)
      fold_share: weight of the folded unigram's shared embedding component
      embedding_rms: root-mean-square of the explicit embeddings (0: the random embeddings' own; default: 1, for a
        tied matrix — also the output kernel — its own)
      seed: the seed of every run
      eval_every: steps between periodic dev losses
      eval_tokens: dev tokens scored at the end (0: the whole split; default: whole, or 100,000 with --steps)
      metrics_json: write the figures as a flat JSON object here
      report: gather the finished one-epoch runs into results/any_model.json
      quiet: no progress bars
    """

    workdir: Path | None = dataclasses.field(default=None, metadata={"required": True})
    out: Path = Path("runs/any_model")
    models: tuple[str, ...] = dataclasses.field(default=("llama", "neox"), metadata={"choices": MODELS, "nargs": "+"})
    inits: tuple[str, ...] = dataclasses.field(default=("random", "explicit"), metadata={"choices": INITS, "nargs": "+"})
    steps: int = 0
    epochs: int = 1
    learning_rate: float = LEARNING_RATE
    tied: str = dataclasses.field(default="mean", metadata={"choices": ("embedding", "output", "mean")})
    fold: bool = False
    fold_share: float = FOLD_SHARE
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
    try:
        import penzai  # noqa: F401
    except ImportError:
        raise SystemExit("penzai is not installed: pip install -e '.[models]'") from None
    if args.report:
        from results import write_result
        epoch = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*_e1/result.json"))]
        figures = summarise(epoch)
        if not figures:
            raise SystemExit(f"no finished pair of one-epoch runs under {args.out / 'runs'}")
        short = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*_30/result.json"))]
        write_result("any_model", {**figures, "table": table(figures), "short_table": short_table(short)},
                     seeds=sorted({r["seed"] for r in epoch + short}))
        print(table(figures))
        print(short_table(short))
        return 0
    results = []
    for name in args.models:
        for init in args.inits:
            result = run_one(name, init, args)
            results.append(result)
            print(f"{name:>10} {init:>8}: dev loss {result['dev_loss']:.4f} nats, {result['dev_bpb']:.4f} bits/byte "
                  f"({result['steps']} steps, {result['train_seconds']:.0f} s)", flush=True)
    figures = summarise(results)
    if figures:
        print(table(figures))
    if args.metrics_json:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps({**figures, **{f"{r['model']}_{r['init']}_dev_loss": r["dev_loss"]
                                                             for r in results}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
