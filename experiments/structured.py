"""Structured feed-forward layers against dense: dev loss at equal steps and equal FLOPs, latency,
and explicit-SVD against random-SVD init.

Part 1, the transformer's MLP (``mlp_in``, ``mlp_out``; :mod:`saffu.models.structured`): dense,
and each of ``lowrank``, ``blockdense``, ``blockshuffle`` at each ``--shares`` of the dense
layer's weights, trained plainly (init: the SVD of a random dense layer, as Wei et al.) and
self-guided (``--self-guided`` of the steps with a dense guide), at each ``--widths``; every run
the same steps, data order, learning rate and seed. Equal FLOPs: the dense run's dev loss
interpolated at the structured run's training FLOPs. Latency: the forward pass of every model
(random init) and of one MLP alone at ``--latency-width``, timed side by side in one process.

Part 2, a closed-form structured init: the factorised explicit model (``saffu factorise``) with
its output factor ``B`` (``r × V``, its largest matrix) structured at ``--shares[0]``: set from
the explicit ``B`` by SVD (``explicit``: explicit-SVD), against the same structure set from the
SVD of a random ``B`` next to the explicit embeddings (``explicit-embeddings``: random-SVD ``B``)
or next to random embeddings (``random``: the cold start), and against the dense model
(explicit and random); and the explicit-SVD ``B`` trained self-guided with the explicit dense
``B`` as its guide (``explicit-guided``: step 0 is the dense explicit model, the guide's weight
falls to 0 over ``--self-guided`` of the steps); dev loss before and after ``--steps`` of training.

Part 3, SAFFU's own dense layers: the chain (``--hidden K``, one block) with ``W_1`` and ``W_2``
dense, or each structured at ``--shares[0]`` — explicit (the SVD of the explicit layers,
calibrated first: a closed-form structured init) and random (the SVD of random layers); dev
loss before and after ``--steps`` (``--chain-learning-rate``). ``--part all`` leaves it out
(the chain's solve streams dense windows: run it on a subset, ``--workdir`` of
``subset_workdir``).

Finished runs are skipped on a rerun, so one process per core can share ``--out``;
``--report`` gathers them into ``report.md``, ``report.json`` and ``structured.png``.

    python experiments/structured.py --workdir runs/babylm --out runs/structured --part transformer
    python experiments/structured.py --workdir runs/babylm --out runs/structured --part factorised
    python experiments/structured.py --workdir runs/deep_saffu/data --out runs/structured --part chain
    python experiments/structured.py --workdir runs/babylm --out runs/structured --report
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np

from saffu._io import SaffuError
from saffu.flags import script_options
from saffu.models.interface import model_init, model_logits

KINDS = ("lowrank", "blockdense", "blockshuffle")


def transformer_specs(args) -> list[dict]:
    specs = []
    for width in args.widths:
        if "dense" in args.structures:
            specs.append({"part": "transformer", "width": width, "ffn": "dense", "share": 1.0, "training": "plain"})
        for kind in (k for k in KINDS if k in args.structures):
            for share in args.shares:
                for training in args.trainings:
                    specs.append({"part": "transformer", "width": width, "ffn": kind, "share": share,
                                  "training": training})
    return specs


def factorised_specs(args) -> list[dict]:
    specs = [{"part": "factorised", "output": "dense", "share": 1.0, "init": "explicit"},
             {"part": "factorised", "output": "dense", "share": 1.0, "init": "random"}]
    for kind in ("lowrank", "blockdense"):
        for init in ("explicit", "explicit-embeddings", "random", "explicit-guided"):
            specs.append({"part": "factorised", "output": kind, "share": args.shares[0], "init": init})
    return specs


def chain_specs(args) -> list[dict]:
    """The SAFFU chain (``--hidden K``): dense and each of lowrank / blockdense at ``--shares[0]``,
    explicit (structured: the SVD of the explicit layers) and random."""
    specs = []
    for kind in ("dense", "lowrank", "blockdense"):
        for init in ("explicit", "random"):
            specs.append({"part": "chain", "output": kind, "share": 1.0 if kind == "dense" else args.shares[0],
                          "init": init})
    return specs


def name_of(spec: dict, seed: int = 0) -> str:
    suffix = f"_s{seed}" if seed else ""
    if spec["part"] == "transformer":
        return f"tf_w{spec['width']}_{spec['ffn']}_{spec['share']:g}_{spec['training']}{suffix}"
    prefix = "fac" if spec["part"] == "factorised" else "chain"
    return f"{prefix}_{spec['output']}_{spec['share']:g}_{spec['init']}{suffix}"


def _transformer_config(spec: dict, args, vocab_size: int):
    from saffu.configs import TransformerConfig
    return TransformerConfig(vocab_size, width=spec["width"], layers=args.layers, ffn=spec["ffn"],
                             ffn_share=spec["share"], ffn_blocks=args.blocks,
                             guide_share=args.self_guided if spec["training"] == "self-guided" else 0.0,
                 block="gpt", output_bias=True)


def _factorised_config(spec: dict, args, vocab_size: int):
    from saffu.configs import FactorisedConfig
    return FactorisedConfig(vocab_size, rank=args.rank, output=spec["output"], output_share=spec["share"],
                            output_blocks=args.blocks,
                            guide_share=args.self_guided if spec["init"] == "explicit-guided" else 0.0)


def _chain_config(spec: dict, args, vocab_size: int):
    from saffu.configs import SaffuConfig
    return SaffuConfig(vocab_size, bits=args.chain_bits, hidden=args.chain_bits + 1, chain=spec["output"],
                       chain_share=spec["share"], chain_blocks=args.chain_blocks)


def run_one(spec: dict, args, workdir) -> dict:
    import jax

    from saffu.configs import TrainConfig
    from saffu.eval.scoring import evaluate_split
    from saffu.models.factorised import drop_output_guide
    from saffu.models.interface import parameter_count
    from saffu.models.transformer import drop_guide
    from saffu.solve.factors import solve_factorised
    from saffu.training.trainer import train

    key = jax.random.fold_in(jax.random.key(args.seed), 0)
    extra, solve_seconds = {}, 0.0
    if spec["part"] == "transformer":
        config = _transformer_config(spec, args, workdir.vocab_size)
        params = model_init(config, key)
    elif spec["part"] == "chain":
        config = _chain_config(spec, args, workdir.vocab_size)
        if spec["init"] == "explicit":
            from saffu.solve.stack import solve_explicit
            tick = time.perf_counter()
            params, _ = solve_explicit(workdir, config, progress=False)
            solve_seconds = time.perf_counter() - tick
            extra["before"] = evaluate_split(params, config, workdir, "dev", args.eval_tokens, progress=False)
        else:
            params = model_init(config, key)
    else:
        config = _factorised_config(spec, args, workdir.vocab_size)
        if spec["init"] != "random":
            tick = time.perf_counter()
            params, _ = solve_factorised(workdir, config, progress=False)
            solve_seconds = time.perf_counter() - tick
            if spec["init"] == "explicit-embeddings":     # B's structure from the SVD of a random B
                params = {**params, "output_factors": model_init(config, key)["output_factors"]}
            extra["before"] = evaluate_split(params, config, workdir, "dev", args.eval_tokens, progress=False)
        else:
            params = model_init(config, key)
    run = args.out / "runs" / name_of(spec, args.seed)
    settings = TrainConfig(steps=args.steps, learning_rate=args.chain_learning_rate if spec["part"] == "chain"
                           else args.learning_rate, seed=args.seed,
                           eval_every=args.eval_every, eval_windows=args.eval_windows, checkpoint_every=0)
    trained, history = train(config, params, workdir.tokens(workdir.train_split), settings, run / "train",
                             dev_stream=workdir.tokens("dev"), progress=False)
    if getattr(config, "guide_share", 0):
        config, trained = (drop_guide if spec["part"] == "transformer" else drop_output_guide)(trained, config)
    scores = evaluate_split(trained, config, workdir, "dev", args.eval_tokens, progress=False)
    result = {**spec, "name": name_of(spec, args.seed), "seed": args.seed, "params": parameter_count(trained),
              "steps": args.steps,
              "solve_seconds": solve_seconds, "history": history, "forward_flops": config.forward_flops(256),
              "tokens_per_s": history[-1]["tokens_per_s"], **extra, **scores}
    if spec["part"] == "transformer":
        result["mlp_weights"] = config.mlp_weights * config.layers
    (run / "result.json").write_text(json.dumps(result))
    return result


def _before_after(results: list[dict], rows: list[dict], part: str, title: str, inits: dict) -> list[str]:
    """Table lines of ``part``'s runs (dev bits/byte before and after training; dense first),
    their rows appended to ``rows``."""
    runs = [r for r in results if r["part"] == part]
    if not runs:
        return []
    lines = ["", f"| {title} | share | init | params | dev bits/byte before training | after {runs[0]['steps']} steps |",
             "|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["output"] != "dense", r["output"], r["init"])):
        before = r.get("before", {}).get("dev_bpb")
        rows.append({"name": r["name"], "output": r["output"], "share": r["share"], "init": r["init"],
                     "params": r["params"], "dev_bpb_before": before, "dev_bpb": r["dev_bpb"]})
        init = inits[r["init"]] if r["output"] != "dense" else r["init"]
        lines.append(f"| {r['output']} | {r['share']:.0%} | {init} | {r['params']:,} | "
                     f"{'—' if before is None else format(before, '.4f')} | {r['dev_bpb']:.4f} |")
    return lines


def _time(function, *inputs, repeats: int = 15) -> float:
    """Median seconds of ``function(*inputs)`` after a warm-up call."""
    import jax
    jax.block_until_ready(function(*inputs))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(function(*inputs))
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


def latency(args, vocab_size: int) -> dict:
    """Forward microseconds per token of every transformer variant (random init) and of one
    MLP (both layers) at ``--latency-width``, all timed here, side by side."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from saffu.configs import TransformerConfig
    from saffu.models.transformer import Block

    tokens = jnp.asarray(np.random.default_rng(0).integers(2, vocab_size, (args.latency_batch, 256)), jnp.int32)
    out = {}
    for spec in transformer_specs(args):
        if spec["training"] != "plain":        # self-guided ends as the plain structure
            continue
        config = _transformer_config(spec, args, vocab_size)
        params = model_init(config, jax.random.key(0))
        forward = jax.jit(lambda p, t, c=config: model_logits(c, p, t))
        out[f"model_w{spec['width']}_{spec['ffn']}_{spec['share']:g}"] = 1e6 * _time(forward, params, tokens) / tokens.size
    d = args.latency_width
    x = jnp.asarray(np.random.default_rng(1).normal(size=(args.latency_batch * 256, d)), jnp.float32)
    for kind in ("dense",) + KINDS:
        for share in ([1.0] if kind == "dense" else args.shares):
            config = TransformerConfig(vocab_size, width=d, layers=1, heads=4, ffn=kind, ffn_share=share,
                                       ffn_blocks=args.blocks, block="gpt", output_bias=True)
            block = Block(config, rngs=nnx.Rngs(0))
            graphdef, state = nnx.split((block.mlp_in, block.mlp_out))

            def mlp(state, x, graphdef=graphdef):
                mlp_in, mlp_out = nnx.merge(graphdef, state)
                return mlp_out(jax.nn.gelu(mlp_in(x)))

            out[f"mlp_w{d}_{kind}_{share:g}"] = 1e6 * _time(jax.jit(mlp), state, x) / x.shape[0]
    return out


def _interpolate(history: list[dict], flops: float) -> float:
    """Dev loss of a run at ``flops`` training FLOPs, linear between its evaluations."""
    points = [(h["flops"], h["dev_loss"]) for h in history]
    for (f0, l0), (f1, l1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            return l0 + (l1 - l0) * (flops - f0) / (f1 - f0) if f1 > f0 else l1
    return math.nan


def report(out: Path) -> dict:
    results = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/result.json"))]
    if not results:
        raise SystemExit(f"no finished runs under {out / 'runs'}")
    timing = json.loads((out / "latency.json").read_text()) if (out / "latency.json").exists() else {}
    rows, lines = [], []
    transformers = [r for r in results if r["part"] == "transformer"]
    if transformers:
        lines += ["| width | FFN | share | training | seed | params | MLP weights | dev bits/byte | Δ vs dense | "
                  "dev loss at end | dense's loss at equal FLOPs | training FLOPs | tokens/s | forward µs / token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for width in sorted({r["width"] for r in transformers}):
            here = [r for r in transformers if r["width"] == width]
            for r in sorted(here, key=lambda r: (r["ffn"] != "dense", r["ffn"], r["share"], r["training"],
                                                 r.get("seed", 0))):
                dense = next((d for d in here if d["ffn"] == "dense" and d.get("seed", 0) == r.get("seed", 0)), None)
                end = r["history"][-1]
                row = {"name": r["name"], "width": width, "ffn": r["ffn"], "share": r["share"], "training": r["training"],
                       "seed": r.get("seed", 0),
                       "params": r["params"], "mlp_weights": r["mlp_weights"], "dev_bpb": r["dev_bpb"],
                       "dev_loss_end": end["dev_loss"], "flops": end["flops"], "tokens_per_s": r["tokens_per_s"],
                       "forward_us_per_token": timing.get(f"model_w{width}_{r['ffn']}_{r['share']:g}")}
                if dense is not None:
                    row["delta_bpb"] = r["dev_bpb"] - dense["dev_bpb"]
                    row["dense_loss_at_equal_flops"] = _interpolate(dense["history"], end["flops"])
                rows.append(row)
                fmt = lambda v, f: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)
                lines.append(f"| {width} | {r['ffn']} | {r['share']:.0%} | {r['training']} | {row['seed']} "
                             f"| {r['params']:,} | "
                             f"{r['mlp_weights']:,} | {r['dev_bpb']:.4f} | {fmt(row.get('delta_bpb'), '+.4f')} | "
                             f"{end['dev_loss']:.4f} | {fmt(row.get('dense_loss_at_equal_flops'), '.4f')} | "
                             f"{end['flops']:.3g} | {r['tokens_per_s']:,.0f} | {fmt(row['forward_us_per_token'], '.1f')} |")
    mlp = {k: v for k, v in timing.items() if k.startswith("mlp_")}
    if mlp:
        dense_key = next(k for k in mlp if "_dense_" in k)
        lines += ["", "| one MLP alone (both layers) | forward µs / token | against dense |", "|---|---|---|"]
        for k, v in mlp.items():
            lines.append(f"| {k[4:]} | {v:.2f} | {v / mlp[dense_key]:.2f}× |")
    for part, title, inits in (
            ("factorised", "factorised model, output factor B",
             {"explicit": "explicit (B: explicit-SVD)", "explicit-embeddings": "explicit E, random-SVD B",
              "random": "random (B: random-SVD)", "explicit-guided": "explicit-SVD B, self-guided by the explicit dense B"}),
            ("chain", "SAFFU chain (W_1, W_2)",
             {"explicit": "explicit (structured: explicit-SVD)", "random": "random (structured: random-SVD)"})):
        lines += _before_after(results, rows, part, title, inits)
    table = "\n".join(lines)
    (out / "report.md").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps({"rows": rows, "latency": timing}, indent=1))
    if transformers:      # one seed in the figure (seed 0 where there is one)
        first = min(r.get("seed", 0) for r in transformers)
        _plot([r for r in transformers if r.get("seed", 0) == first], out / "structured.png")
    print(table)
    return {"rows": rows, "latency": timing}


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    widths = sorted({r["width"] for r in results})
    figure, axes = plt.subplots(1, len(widths), figsize=(6.5 * len(widths), 4.5), squeeze=False)
    colours = {"dense": "black", "lowrank": "tab:blue", "blockdense": "tab:orange", "blockshuffle": "tab:green"}
    for axis, width in zip(axes[0], widths):
        for r in (r for r in results if r["width"] == width):
            history = r["history"][1:]
            style = "-" if r["training"] == "plain" else "--"
            alpha = 1.0 if r["share"] >= 0.5 else 0.55
            label = "dense" if r["ffn"] == "dense" else f"{r['ffn']} {r['share']:.0%} {r['training']}"
            axis.plot([h["flops"] for h in history], [h["dev_loss"] for h in history], style,
                      color=colours[r["ffn"]], alpha=alpha, label=label)
        axis.set_xlabel("training FLOPs")
        axis.set_ylabel("dev loss (nats/token, evenly spaced windows)")
        axis.set_title(f"width {width}")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    figure.suptitle("transformer MLPs: dense against structured layers (solid: plain, dashed: self-guided; one seed)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _claimed(path: Path) -> bool:
    """Whether a live process has claimed this run (a dead one's claim does not count)."""
    try:
        os.kill(int(path.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@dataclasses.dataclass
class Options:
    """The structured layers' runs and report.

    Attributes:
      workdir: a prepared work directory (not needed for --report)
      out: runs and the report go here
      part: the runs to make
      widths: transformer widths
      layers: transformer blocks
      shares: structured weights as a share of the dense layer's
      blocks: blocks of blockdense / blockshuffle
      structures: the transformer runs to make (dense is the baseline of its width)
      trainings: how the structured transformers train
      self_guided: share of the steps with the dense guide
      rank: rank r of the factorised model
      chain_bits: cipher bits b of the SAFFU chain (D = b + 1)
      chain_blocks: blocks of a blockdense chain layer (K = 129 = 3 · 43)
      chain_learning_rate: peak learning rate of the chain runs
      steps: optimizer steps of every run
      learning_rate: peak learning rate (every run)
      seed: seed of the data order and the random init
      eval_every: steps between dev evaluations
      eval_windows: dev windows of the periodic evaluations
      eval_tokens: dev tokens of the final score
      latency_width: width of the MLP-alone latency
      latency_batch: windows of 256 tokens per timed forward
      report: only gather the finished runs
      metrics_json: flat JSON of the report's rows
    """

    workdir: Path | None = None
    out: Path = Path("runs/structured")
    part: str = dataclasses.field(default="all", metadata={
        "choices": ("transformer", "factorised", "chain", "latency", "all")})
    widths: tuple[int, ...] = dataclasses.field(default=(64, 128), metadata={"nargs": "+"})
    layers: int = 2
    shares: tuple[float, ...] = dataclasses.field(default=(0.32, 0.63), metadata={"nargs": "+"})
    blocks: int = 4
    structures: tuple[str, ...] = dataclasses.field(default=("dense",) + KINDS,
                                                    metadata={"nargs": "+", "choices": ("dense",) + KINDS})
    trainings: tuple[str, ...] = dataclasses.field(default=("plain", "self-guided"),
                                                   metadata={"nargs": "+", "choices": ("plain", "self-guided")})
    self_guided: float = 0.5
    rank: int = 128
    chain_bits: int = 128
    chain_blocks: int = 3
    chain_learning_rate: float = 0.003
    steps: int = 150
    learning_rate: float = 0.01
    seed: int = 0
    eval_every: int = 25
    eval_windows: int = 64
    eval_tokens: int = 200_000
    latency_width: int = 1024
    latency_batch: int = 4
    report: bool = False
    metrics_json: Path | None = None


def _check(options: Options) -> None:
    if min(options.shares) <= 0 or max(options.shares) > 1:
        raise SaffuError("--shares must lie in (0, 1]")
    if not options.report and options.workdir is None:
        raise SaffuError("--workdir is required to train")


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0], check=_check)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from saffu.data.workdir import open_workdir
        workdir = open_workdir(args.workdir)
        if args.part in ("latency", "all"):
            (args.out / "latency.json").write_text(json.dumps(latency(args, workdir.vocab_size), indent=1))
        specs = ((transformer_specs(args) if args.part in ("transformer", "all") else [])
                 + (factorised_specs(args) if args.part in ("factorised", "all") else [])
                 + (chain_specs(args) if args.part == "chain" else []))
        for spec in specs:
            run = args.out / "runs" / name_of(spec, args.seed)
            if (run / "result.json").exists() or _claimed(run / "claimed"):
                continue
            run.mkdir(parents=True, exist_ok=True)
            (run / "claimed").write_text(str(os.getpid()))      # another live process on --out skips it
            result = run_one(spec, args, workdir)
            print(f"{result['name']:>40}: dev {result['dev_bpb']:.4f} bits/byte, "
                  f"{result['history'][-1]['seconds']:.0f} s", flush=True)
    summary = report(args.out)
    if args.metrics_json:
        from saffu._io import write_metrics
        write_metrics(args.metrics_json, {f"{row['name']}_{key}": value for row in summary["rows"]
                                          for key, value in row.items() if isinstance(value, (int, float))})


if __name__ == "__main__":
    main()
