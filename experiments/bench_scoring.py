"""Benchmark: scoring (a dev split, BLiMP) against training, side by side, for the transformer, the
exact model and the explicit residual; and ``--compute-dtype bfloat16`` against float32.

For each model, in its own subprocess (so each peak RSS is that measurement's alone):

* ``train``: tokens/s and seconds per step of a few timed training steps (the trainer's jitted
  step, :class:`saffu.configs.TrainConfig`'s batch) after compilation; the exact model is solved,
  not trained;
* ``score``: :func:`saffu.eval.scoring.evaluate_split` on ``--eval-tokens`` of the dev split
  (whole documents, spread over the split), tokens/s of a second run (the first, compilation
  included, is ``score_first_seconds``);
* ``blimp``: :func:`saffu.eval.blimp.sentence_log_probs` of every good and bad sentence of the
  paradigm files, seconds after a compiling call, and the accuracy;
* ``alternate`` (``--step-rounds``): the transformer's and the residual's training steps timed
  alternately in one process, the same batches, so load drifts hit both alike;
* with ``--before``: the same scoring through the previous paths (whole-window logits and a
  ``V``-wide log-softmax, 16 windows per call; BLiMP one sentence per row behind ``context``
  pads in power-of-two buckets), for the speed-ups.

The transformer is random-init (speed does not depend on the weights); the residual is that
transformer (``f_θ``) over the exact run's tables, as ``saffu train --residual`` builds
it. Each figure is also a ratio to the model's own training tokens/s (the exact model's to the
transformer's). The machine's load average is printed and recorded: timings on a shared machine
are noisy, compare figures of one run.

``--dtypes`` measures instead what ``--compute-dtype bfloat16`` does on this backend (the
``dtypes`` measurement, once ``bench_bf16.py``): the transformer's training steps in float32 and
bfloat16 alternating in one process as ``alternate`` times its two models, and the output layer's
product alone three ways (f32, bf16 → bf16, bf16 inputs → f32 accumulation). XLA's CPU backend
runs a bf16 × bf16 → bf16 product by converting both operands to float32 and the result back (no
bf16 arithmetic at all, plus the conversions), while bf16 × bf16 → f32 runs natively where the
processor has bf16 dot-product units (``avx512_bf16``, AMX); the figures say which of the two the
compiler chose, so a backend on which bf16 does not pay shows it.

    python experiments/bench_scoring.py --quick
    python experiments/bench_scoring.py --before --metrics-json /tmp/bench_scoring.json --write-result
    python experiments/bench_scoring.py --rounds 3 --models transformer residual   # medians of 3 interleaved rounds
    python experiments/bench_scoring.py --dtypes --write-result                     # results/bench_bf16.json
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import SaffuError, atomic_write_json
from saffu.engine.accounting import peak_rss_mb
from saffu.eval import bench
from saffu.flags import flags_of, script_main, script_options
from saffu.runner import exact_run, write_result

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("transformer", "exact", "residual")
#: The options a measurement's process reads (passed on to it, and recorded with the figures).
CHILD_OPTIONS = ("workdir", "exact_run", "blimp_dir", "blimp_files", "before_blimp_files", "eval_tokens", "train_steps",
                 "width", "layers", "step_rounds")
#: The compute dtypes ``--dtypes`` compares.
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class Options:
    """The models, the measurements and their settings.

    Attributes:
      workdir: prepared work directory
      exact_run: a `saffu exact` run on --workdir (the exact model and the residual's tables); made
        there first when it does not exist
      blimp_dir: folder of BLiMP *.jsonl paradigm files
      blimp_files: first N paradigm files only (0: all)
      eval_tokens: dev tokens scored (whole documents spread over the split; 0: the whole split)
      train_steps: timed training steps (after two compiling ones; the median is kept)
      step_rounds: with the transformer and the residual (or with --dtypes): their training steps
        timed alternately in one process for this many rounds; 0: skip
      rounds: measure every model this many times, the models interleaved round by round, and keep
        the medians (a shared machine's load drifts during a run)
      width: transformer width
      layers: transformer layers
      models: the models measured
      before: also time the previous scoring paths
      before_blimp_files: paradigm files of the previous BLiMP path (default: as --blimp-files)
      dtypes: measure --compute-dtype bfloat16 against float32 instead (the transformer's steps
        alternating, --step-rounds of them, and the output layer's product three ways); with
        --write-result it writes results/bench_bf16.json
      quick: tiny settings, one process per model (peak RSS figures cumulative): 2,000 dev tokens,
        1 paradigm file, 1 timed step, --before
      metrics_json: write the figures here as JSON
      write_result: write results/bench_scoring.json (with --dtypes, results/bench_bf16.json)
      child: internal: MODEL:MEASUREMENT[,MEASUREMENT…], run in a subprocess
    """

    workdir: Path = ROOT / "runs" / "babylm"
    exact_run: Path = ROOT / "runs" / "budgets" / "exact" / "1"
    blimp_dir: Path = ROOT.parent / "shared" / "data" / "blimp"
    blimp_files: int = 0
    eval_tokens: int = 100_000
    train_steps: int = 8
    step_rounds: int = 20
    rounds: int = 1
    width: int = 128
    layers: int = 5
    models: tuple[str, ...] = dataclasses.field(default=MODELS, metadata={"choices": MODELS, "nargs": "+"})
    before: bool = False
    before_blimp_files: int | None = None
    dtypes: bool = False
    quick: bool = False
    metrics_json: Path | None = None
    write_result: bool = False
    child: str | None = dataclasses.field(default=None, metadata={"hidden": True})


def parse_args(argv=None) -> Options:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    if args.quick:
        args.eval_tokens, args.blimp_files, args.train_steps, args.before, args.rounds = 2000, 1, 1, True, 1
        args.step_rounds = min(args.step_rounds, 2)
    if args.before_blimp_files is None:
        args.before_blimp_files = args.blimp_files
    return args


# ---------------------------------------------------------------- measurements (in a subprocess)

def _model(kind: str, args):
    """``(config, params, workdir)`` of ``kind``."""
    from saffu.configs import TransformerConfig
    from saffu.data.workdir import open_workdir
    from saffu.models.interface import model_init
    workdir = open_workdir(args.workdir)
    base = TransformerConfig(workdir.vocab_size, width=args.width, layers=args.layers, block="gpt", output_bias=True,
                             across_documents=False)
    key = jax.random.key(0)
    if kind == "transformer":
        return base, model_init(base, key), workdir
    from saffu.training.checkpoints import load_explicit, load_run_config
    if kind == "exact":
        config = load_run_config(args.exact_run)
        return config, load_explicit(args.exact_run, config), workdir
    from saffu.training.recipes import residual_start
    config, params = residual_start(base, args.exact_run, key)
    # a trained-looking f_θ: its output layer off zero (the cost is the same, the scores non-trivial)
    params["model"]["output"] = model_init(base, jax.random.key(1))["output"]
    return config, params, workdir


def _stepper(kind: str, args, batches: int, dtype: str = "float32") -> bench.Stepper:
    """``kind``'s training step (:class:`saffu.configs.TrainConfig`'s batch, computed in ``dtype``)
    over ``batches`` random windows of the training split."""
    from saffu.configs import TrainConfig
    config, params, workdir = _model(kind, args)
    return bench.Stepper(config, params, workdir.tokens(workdir.train_split), TrainConfig(compute_dtype=dtype), batches)


def measure_train(kind: str, args) -> dict:
    """Tokens/s and seconds per step of ``--train-steps`` steps after two compiling ones."""
    stepper = _stepper(kind, args, args.train_steps + 2)
    times = bench.interleave({kind: stepper.step}, args.train_steps + 2)[0][kind]
    seconds = statistics.median(times[2:])
    return {"train_step_s": seconds, "train_tokens_per_s": stepper.tokens_per_step / seconds,
            "train_compile_s": times[0], "train_peak_rss_mb": peak_rss_mb()}


def measure_alternate(kind: str, args) -> dict:
    """The transformer's and the residual's steps timed alternately in one process (``kind`` is
    ``both``), ``--step-rounds`` rounds, so load drifts hit both alike."""
    times, medians = bench.alternate({name: _stepper(name, args, 4) for name in ("transformer", "residual")},
                                     args.step_rounds)
    return {"rounds": args.step_rounds, "step_seconds": times, "median_step_seconds": medians,
            "min_step_seconds": {name: min(t) for name, t in times.items()},
            "step_time_ratio": medians["residual"] / medians["transformer"],
            "step_time_ratio_of_minima": min(times["residual"]) / min(times["transformer"])}


def measure_dtypes(kind: str, args) -> dict:
    """``kind``'s training steps in each of :data:`DTYPES` timed alternately in one process
    (``--step-rounds`` rounds), and the output layer's product ``[B·T, d] @ [d, V]`` three ways
    (median seconds), with whether XLA compiled the bf16 → bf16 product with conversions to f32."""
    steppers = {name: _stepper(kind, args, 4, name) for name in DTYPES}
    times, seconds = bench.alternate(steppers, args.step_rounds)
    config, train = steppers["float32"].config, steppers["float32"].train
    tokens = train.batch_size * train.seq_len
    x = jax.random.normal(jax.random.key(0), (tokens, config.width))
    w = jax.random.normal(jax.random.key(0), (config.width, config.vocab_size))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    plain = jax.jit(jnp.matmul)
    wide = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    hlo = plain.lower(xb, wb).compile().as_text()
    matmul = {name: bench.median_seconds(product, *operands, repeats=max(args.step_rounds, 2)) for name, product, operands
              in (("float32", plain, (x, w)), ("bf16_to_bf16", plain, (xb, wb)), ("bf16_to_f32", wide, (xb, wb)))}
    return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "cpu_bf16_units": bench.cpu_features(("avx512_bf16", "amx_bf16", "avx_ne_convert")),
            "matmul": {"seconds": matmul, "bf16_to_bf16_converts_to_f32": "f32[" in hlo and "convert" in hlo,
                       "shape": [tokens, config.width, config.vocab_size]},
            "training": {"seconds_per_step": seconds, "tokens_per_s": {n: tokens / s for n, s in seconds.items()},
                         "bf16_over_f32_step": seconds["bfloat16"] / seconds["float32"], "rounds": args.step_rounds,
                         "step_seconds": times, "mean_loss": {n: s.mean_loss() for n, s in steppers.items()},
                         "model": {**{k: getattr(config, k) for k in ("vocab_size", "width", "layers", "context")},
                                   "batch_size": train.batch_size, "seq_len": train.seq_len}}}


def measure_score(kind: str, args, before: bool = False) -> dict:
    """Tokens/s of scoring ``--eval-tokens`` of dev: the second of two runs (the first compiles)."""
    from saffu.data.windows import total_nll
    from saffu.eval.scoring import evaluate_split
    config, params, workdir = _model(kind, args)
    name = "before_score" if before else "score"
    if before:     # the previous evaluation path: whole-window logits, a ``V``-wide log-softmax and a gather
        from saffu.models.interface import window_loss
        loss = functools.partial(jax.jit(window_loss, static_argnums=1), params, config)
        stream = workdir.tokens("dev")

        def run(tokens):
            ranges, _ = workdir.sample_documents("dev", tokens or len(stream))
            nll, count = total_nll(loss, stream, ranges, config.context, config.eval_seq_len, 16, tight=False)
            return nll / count, count
    else:
        def run(tokens):
            report = evaluate_split(params, config, workdir, "dev", tokens or None, progress=False)
            return report["dev_loss"], report["dev_tokens"]
    first_s = bench.timed(run, args.eval_tokens)[0]             # the first run compiles every window shape
    seconds, (loss, count) = bench.timed(run, args.eval_tokens)
    return {f"{name}_tokens": count, f"{name}_seconds": seconds, f"{name}_tokens_per_s": count / seconds,
            f"{name}_loss": loss, f"{name}_first_seconds": first_s, f"{name}_peak_rss_mb": peak_rss_mb()}


def measure_blimp(kind: str, args, before: bool = False) -> dict:
    """Seconds to score every sentence of the paradigm files (after compiling every call shape on
    a small sample of them), the tokens scored and the accuracy."""
    import tempfile

    import saffu.eval.blimp as blimp
    config, params, workdir = _model(kind, args)
    tokenizer = workdir.tokenizer()
    files = sorted(args.blimp_dir.glob("*.jsonl"))[:(args.before_blimp_files if before else args.blimp_files) or None]
    with tempfile.TemporaryDirectory() as folder:
        for path in files:
            (Path(folder) / path.name).symlink_to(path.resolve())
        pairs = blimp.load_blimp(folder)
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    lengths = np.asarray([len(e.ids) for e in tokenizer.encode_batch(sentences, add_special_tokens=False)])
    tokens = int(lengths.sum())
    pack = None
    name = "before_blimp" if before else "blimp"
    if before:                                   # one sentence per row, whole-window log-softmax
        from saffu.models.interface import window_nll
        old = jax.jit(window_nll, static_argnums=1)
        blimp._target_nll = lambda params, config, windows, mask, context, positions: old(params, config, windows, mask)
        blimp.CALL_POSITIONS = 16 * (8 + 256)                # its calls: 16 rows of the default SAFFU
        pack = False
    # compile every call shape first: a sample of one sentence of each power-of-two length bucket
    buckets = 1 << np.maximum(np.ceil(np.log2(np.maximum(lengths, 1))).astype(int), 3)
    sample = [int(np.flatnonzero(buckets == w)[0]) for w in np.unique(buckets)]
    score = functools.partial(blimp.sentence_log_probs, params, config, tokenizer, progress=False, pack=pack)
    compile_s = bench.timed(score, [sentences[i] for i in sample])[0]
    seconds, scores = bench.timed(score, sentences)
    accuracy = blimp.blimp_accuracy(pairs, scores[:len(pairs)], scores[len(pairs):])["blimp_accuracy"]
    return {f"{name}_seconds": seconds, f"{name}_pairs": len(pairs), f"{name}_files": len(files),
            f"{name}_tokens": tokens, f"{name}_tokens_per_s": tokens / seconds, f"{name}_accuracy": accuracy,
            f"{name}_compile_s": compile_s, f"{name}_peak_rss_mb": peak_rss_mb(),
            f"{name}_log_prob_sum": float(scores.sum())}


def child(args) -> None:
    """Run ``--child MODEL:MEASUREMENT[,MEASUREMENT…]`` and print its figures (:func:`saffu.eval.bench.emit`)."""
    kind, measurements = args.child.split(":")
    functions = {"train": measure_train, "score": measure_score, "blimp": measure_blimp, "alternate": measure_alternate,
                 "dtypes": measure_dtypes, "before_score": functools.partial(measure_score, before=True),
                 "before_blimp": functools.partial(measure_blimp, before=True)}
    bench.emit({key: value for m in measurements.split(",") for key, value in functions[m](kind, args).items()})


# ---------------------------------------------------------------- the side-by-side run

def _run_child(kind: str, measurement: str, args) -> dict:
    """``kind``'s ``measurement`` (comma-separated ones) in a process of its own: its figures."""
    argv = flags_of({name: getattr(args, name) for name in CHILD_OPTIONS})
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", f"{kind}:{measurement}"]
    return bench.run_pinned([command], [None], cwd=ROOT)


def measure_models(args) -> dict:
    """Every model's measurements (medians over ``--rounds``, the models interleaved round by
    round), their ratios to training, and the residual against the transformer."""
    figures = {"settings": {**{name: str(v) if isinstance(v := getattr(args, name), Path) else v
                               for name in CHILD_OPTIONS}, "quick": args.quick, "rounds": args.rounds}}
    measurements = ["train", "score", "blimp"] + (["before_score", "before_blimp"] if args.before else [])

    def measure(kind: str) -> dict:     # one round of kind's measurements, each in a process of its own
        wanted = [m for m in measurements if not (m == "train" and kind == "exact")]   # exact: solved
        # --quick: one process per model (its peak RSS figures are then that process's, cumulative)
        return dict(item for group in ([",".join(wanted)] if args.quick else wanted)
                    for item in _run_child(kind, group, args).items())
    # models interleaved round by round: load drifts hit each alike
    rounds = bench.in_rounds({kind: functools.partial(measure, kind) for kind in args.models}, args.rounds,
                             lambda i, kind, _: print(f"  round {i}/{args.rounds}  {kind:<11} done  "
                                                      f"(load {os.getloadavg()[0]:.1f})", flush=True))
    per_round = ("train_tokens_per_s", "train_step_s", "score_tokens_per_s", "blimp_tokens_per_s")
    figures.update({kind: bench.median_row(rounds[kind], per_round) for kind in args.models})
    train_reference = figures.get("transformer", {}).get("train_tokens_per_s")
    for kind in args.models:
        row = figures[kind]
        if "train_tokens_per_s" in row["per_round"]:
            row["per_round"]["score_vs_train"] = [r["score_tokens_per_s"] / r["train_tokens_per_s"]
                                                  for r in rounds[kind]]
        reference = row.get("train_tokens_per_s", train_reference)
        for what in ("score", "blimp"):
            row[f"{what}_vs_train"] = bench.ratio(row.get(f"{what}_tokens_per_s"), reference)
            if args.before:
                row[f"{what}_speedup"] = bench.ratio(row.get(f"{what}_tokens_per_s"),
                                                     row.get(f"before_{what}_tokens_per_s"))
                row[f"before_{what}_vs_train"] = bench.ratio(row.get(f"before_{what}_tokens_per_s"), reference)
    if "residual" in figures and "transformer" in figures:
        residual, plain = figures["residual"], figures["transformer"]
        versus = figures["residual_vs_transformer"] = {
            **{name: bench.ratio(residual.get(key), plain.get(key)) for name, key in
               (("train_step_ratio", "train_step_s"), ("train_peak_rss_ratio", "train_peak_rss_mb"),
                ("score_peak_rss_ratio", "score_peak_rss_mb"))},
            "train_step_ratio_per_round": list(map(bench.ratio, residual["per_round"].get("train_step_s", []),
                                                   plain["per_round"].get("train_step_s", [])))}
        if args.step_rounds:        # the alternating measurement: one process, the same batches
            # each one's peak RSS is its training process's: building, compiling and stepping that model alone
            rss = {kind: figures[kind]["train_peak_rss_mb"] / 1024 for kind in ("residual", "transformer")}
            step = figures["residual_step"] = {**_run_child("both", "alternate", args), "peak_rss_gb": rss,
                                               "peak_rss_extra_gb": rss["residual"] - rss["transformer"]}
            print(f"  alternating training steps done  (load {os.getloadavg()[0]:.1f})", flush=True)
            versus.update(alternating_step_ratio=step["step_time_ratio"],
                          alternating_step_ratio_of_minima=step["step_time_ratio_of_minima"],
                          alternating_rounds=step["rounds"], peak_rss_extra_gb=step["peak_rss_extra_gb"])
    return figures


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    if {"exact", "residual"} & set(args.models) and not args.dtypes:   # what they read: made here on a fresh clone
        try:
            exact_run(args.workdir, args.exact_run)
        except SaffuError as err:
            raise SystemExit(f"--exact-run: {err}") from None
    watch = bench.Watch()
    figures = _run_child("transformer", "dtypes", args) if args.dtypes else measure_models(args)
    figures["load"] = watch.load()
    (print_dtypes if args.dtypes else print_table)(figures, args)
    if args.metrics_json:
        atomic_write_json(args.metrics_json, figures)
    if args.write_result:
        load = {key: figures["load"][key] for key in ("load_average_1min_before", "load_average_1min_after")}
        name = 'bench_bf16' if args.dtypes else 'bench_scoring'
        print(f"wrote {write_result(ROOT / 'results', name, figures, seeds=[0], load=load)}")
    return figures


def print_dtypes(figures: dict, args) -> None:
    mm, tr = figures["matmul"]["seconds"], figures["training"]
    print(f"backend {figures['backend']} ({figures['device']}); bf16 units: {figures['cpu_bf16_units'] or 'none found'}")
    print(f"output-layer matmul {figures['matmul']['shape']}: f32 {mm['float32'] * 1e3:.1f} ms, "
          f"bf16→bf16 {mm['bf16_to_bf16'] * 1e3:.1f} ms, bf16→f32 {mm['bf16_to_f32'] * 1e3:.1f} ms"
          f"{' (bf16→bf16 compiled as f32 with conversions)' if figures['matmul']['bf16_to_bf16_converts_to_f32'] else ''}")
    for name in DTYPES:
        print(f"training step {name:>8}: {tr['seconds_per_step'][name] * 1e3:7.1f} ms "
              f"({tr['tokens_per_s'][name]:,.0f} tokens/s, mean loss {tr['mean_loss'][name]:.4f})")
    print(f"bf16 step time over float32's: {tr['bf16_over_f32_step']:.2f} ({tr['rounds']} rounds); "
          f"load {figures['load']}")


def print_table(figures: dict, args) -> None:
    columns = [("model", "model", ""), ("train tok/s", "train_tokens_per_s", ",.0f"),
               ("step s", "train_step_s", ".2f"), ("train RSS MB", "train_peak_rss_mb", ",.0f"),
               ("score tok/s", "score_tokens_per_s", ",.0f"), ("×train", "score_vs_train", ".2f"),
               ("BLiMP s", "blimp_seconds", ".1f"), ("BLiMP tok/s", "blimp_tokens_per_s", ",.0f"),
               ("×train", "blimp_vs_train", ".2f")]
    if args.before:
        columns += [("old score tok/s", "before_score_tokens_per_s", ",.0f"), ("score ×", "score_speedup", ".2f"),
                    ("old BLiMP tok/s", "before_blimp_tokens_per_s", ",.0f"), ("BLiMP ×", "blimp_speedup", ".2f")]
    print("\n" + bench.table([{"model": kind, **figures[kind]} for kind in args.models], columns, width=16))
    versus, load = figures.get("residual_vs_transformer", {}), figures["load"]
    per_round = [(f"{kind}: scoring ×train", figures[kind]["per_round"].get("score_vs_train")) for kind in args.models]
    for what, ratios in per_round + [("residual / transformer step time", versus.get("train_step_ratio_per_round"))]:
        if ratios and args.rounds > 1:
            print(f"{what} per round {', '.join(f'{r:.2f}' for r in ratios)}")
    if "alternating_step_ratio" in versus:
        print(f"residual / transformer, steps alternating in one process ({versus['alternating_rounds']} rounds): "
              f"×{versus['alternating_step_ratio']:.3f} median, ×{versus['alternating_step_ratio_of_minima']:.3f} "
              f"of minima; peak RSS +{versus['peak_rss_extra_gb']:.2f} GB")
    print(f"\ndev tokens scored: {figures[args.models[0]].get('score_tokens')}, BLiMP pairs: "
          f"{figures[args.models[0]].get('blimp_pairs')} ({figures['settings']['blimp_files'] or 'all'} files); "
          f"load average {load['load_average_1min_before']:.1f} → {load['load_average_1min_after']:.1f} "
          f"on {load['cores']} cores; {load['minutes'] * 60:.0f} s")
    if versus:
        print("residual / transformer: " + ", ".join(
            f"{what} ×{'—' if versus[key] is None else format(versus[key], '.2f')}" for what, key in
            (("step time", "train_step_ratio"), ("training peak RSS", "train_peak_rss_ratio"),
             ("scoring peak RSS", "score_peak_rss_ratio"))))


if __name__ == "__main__":
    script_main(main)
