"""Benchmark: scoring (a dev split, BLiMP) against training, side by side, for the transformer, the
exact model and the explicit residual.

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

    python experiments/bench_scoring.py --quick
    python experiments/bench_scoring.py --before --metrics-json /tmp/bench_scoring.json --write-result
    python experiments/bench_scoring.py --rounds 3 --models transformer residual   # medians of 3 interleaved rounds
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from saffu._io import SaffuError
from saffu.flags import script_options

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("transformer", "exact", "residual")


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
      step_rounds: with the transformer and the residual: their training steps timed alternately in
        one process for this many rounds; 0: skip
      rounds: measure every model this many times, the models interleaved round by round, and keep
        the medians (a shared machine's load drifts during a run)
      width: transformer width
      layers: transformer layers
      models: the models measured
      before: also time the previous scoring paths
      before_blimp_files: paradigm files of the previous BLiMP path (default: as --blimp-files)
      quick: tiny settings, one process per model (peak RSS figures cumulative): 2,000 dev tokens,
        1 paradigm file, 1 timed step, --before
      metrics_json: write the figures here as JSON
      write_result: write results/bench_scoring.json
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
    import jax

    from saffu.configs import TransformerConfig
    from saffu.data.workdir import open_workdir
    from saffu.models.interface import model_init
    workdir = open_workdir(args.workdir)
    base = TransformerConfig(workdir.vocab_size, width=args.width, layers=args.layers, block="gpt", output_bias=True)
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
    output = model_init(base, jax.random.key(1))["output"]
    params["model"]["output"] = output
    return config, params, workdir


def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Stepper:
    """``kind``'s jitted training step (:class:`saffu.configs.TrainConfig`'s batch) over ``steps``
    random windows of the training split; :meth:`step` runs the next one to completion."""

    def __init__(self, kind: str, args, steps: int):
        import jax.numpy as jnp
        import numpy as np

        from saffu.configs import TrainConfig
        from saffu.data.windows import stack_windows
        from saffu.training.trainer import StepStats, make_optimizer, make_train_step
        config, params, workdir = _model(kind, args)
        self.train, stream = TrainConfig(), workdir.tokens(workdir.train_split)
        names = set(getattr(config, "fixed_params", ()))
        self.fixed = {k: v for k, v in params.items() if k in names}
        self.params = {k: v for k, v in params.items() if k not in names}
        optimizer = make_optimizer(self.train, 1000)
        self.opt_state, self.stats, self.count = optimizer.init(self.params), StepStats.zeros(), 0
        self.function = make_train_step(config, optimizer, self.train)
        rng, self.batches = np.random.default_rng(0), []
        for _ in range(steps):
            starts = rng.integers(1, len(stream) - self.train.seq_len, self.train.batch_size)
            windows, mask = stack_windows(stream, starts, [len(stream)] * len(starts), config.context,
                                          self.train.seq_len)
            self.batches.append((jnp.asarray(windows), jnp.asarray(mask)))

    def step(self) -> float:
        """One step (to completion); its wall seconds."""
        import jax
        windows, mask = self.batches[self.count % len(self.batches)]
        start = time.perf_counter()
        self.params, self.opt_state, self.stats = self.function(self.params, self.opt_state, self.stats,
                                                                jax.numpy.int32(self.count), windows, mask, self.fixed)
        jax.block_until_ready(self.stats)
        self.count += 1
        return time.perf_counter() - start


def measure_train(kind: str, args) -> dict:
    """Tokens/s and seconds per step of ``--train-steps`` steps after two compiling ones."""
    stepper = Stepper(kind, args, args.train_steps + 2)
    times = [stepper.step() for _ in stepper.batches]
    seconds = statistics.median(times[2:])
    return {"train_step_s": seconds, "train_tokens_per_s": stepper.train.batch_size * stepper.train.seq_len / seconds,
            "train_compile_s": times[0], "train_peak_rss_mb": _peak_rss_mb()}


def measure_alternate(kind: str, args) -> dict:
    """The transformer's and the residual's steps timed alternately in one process (``kind`` is
    ``both``), ``--step-rounds`` rounds of one step each on the same batches after a compiling
    and a warm step, so load drifts hit both alike."""
    steppers = {name: Stepper(name, args, 4) for name in ("transformer", "residual")}
    for stepper in steppers.values():
        for _ in range(2):                      # a compiling and a warm step
            stepper.step()
    times = {name: [] for name in steppers}
    for round_ in range(args.step_rounds):
        for name in (steppers if round_ % 2 == 0 else reversed(steppers)):
            times[name].append(steppers[name].step())
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"rounds": args.step_rounds, "step_seconds": times, "median_step_seconds": medians,
            "min_step_seconds": {name: min(t) for name, t in times.items()},
            "step_time_ratio": medians["residual"] / medians["transformer"],
            "step_time_ratio_of_minima": min(times["residual"]) / min(times["transformer"])}


def _old_loss():
    """The previous evaluation path: whole-window logits, a ``V``-wide log-softmax and a gather."""
    import jax

    from saffu.models.interface import window_loss
    return jax.jit(window_loss, static_argnums=1)


def measure_score(kind: str, args, before: bool = False) -> dict:
    """Tokens/s of scoring ``--eval-tokens`` of dev: the second of two runs (the first compiles)."""
    from saffu.data.windows import total_nll
    from saffu.eval.scoring import evaluate_split
    config, params, workdir = _model(kind, args)
    name = "before_score" if before else "score"
    if before:
        import functools
        loss = functools.partial(_old_loss(), params, config)
        stream = workdir.tokens("dev")

        def run(tokens):
            ranges, _ = workdir.sample_documents("dev", tokens or len(stream))
            nll, count = total_nll(loss, stream, ranges, config.context, config.eval_seq_len, 16, tight=False)
            return nll / count, count
    else:
        def run(tokens):
            report = evaluate_split(params, config, workdir, "dev", tokens or None, progress=False)
            return report["dev_loss"], report["dev_tokens"]
    start = time.perf_counter()
    run(args.eval_tokens)                                       # the first run compiles every window shape
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    loss, count = run(args.eval_tokens)
    seconds = time.perf_counter() - start
    return {f"{name}_tokens": count, f"{name}_seconds": seconds, f"{name}_tokens_per_s": count / seconds,
            f"{name}_loss": loss, f"{name}_first_seconds": first_s, f"{name}_peak_rss_mb": _peak_rss_mb()}


def measure_blimp(kind: str, args, before: bool = False) -> dict:
    """Seconds to score every sentence of the paradigm files (after compiling every call shape on
    a small sample of them), the tokens scored and the accuracy."""
    import tempfile

    import jax
    import numpy as np

    import saffu.eval.blimp as blimp
    config, params, workdir = _model(kind, args)
    tokenizer = workdir.tokenizer()
    files = sorted(args.blimp_dir.glob("*.jsonl"))
    count = args.before_blimp_files if before else args.blimp_files
    files = files[:count] if count else files
    with tempfile.TemporaryDirectory() as folder:
        for path in files:
            (Path(folder) / path.name).symlink_to(path.resolve())
        pairs = blimp.load_blimp(folder)
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(sentences, add_special_tokens=False))
    pack = None
    name = "before_blimp" if before else "blimp"
    if before:                                   # one sentence per row, whole-window log-softmax
        from saffu.models.interface import window_nll
        old = jax.jit(window_nll, static_argnums=1)
        blimp._target_nll = lambda params, config, windows, mask, context, positions: old(params, config, windows, mask)
        blimp.CALL_POSITIONS = 16 * (8 + 256)                # its calls: 16 rows of the default SAFFU
        pack = False
    lengths = np.asarray([len(e.ids) for e in tokenizer.encode_batch(sentences, add_special_tokens=False)])
    # compile every call shape first: a sample of one sentence of each power-of-two length bucket
    buckets = 1 << np.maximum(np.ceil(np.log2(np.maximum(lengths, 1))).astype(int), 3)
    sample = [int(np.flatnonzero(buckets == w)[0]) for w in np.unique(buckets)]
    start = time.perf_counter()
    blimp.sentence_log_probs(params, config, tokenizer, [sentences[i] for i in sample], progress=False, pack=pack)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = blimp.sentence_log_probs(params, config, tokenizer, sentences, progress=False, pack=pack)
    seconds = time.perf_counter() - start
    accuracy = blimp.blimp_accuracy(pairs, scores[:len(pairs)], scores[len(pairs):])["blimp_accuracy"]
    return {f"{name}_seconds": seconds, f"{name}_pairs": len(pairs), f"{name}_files": len(files),
            f"{name}_tokens": tokens, f"{name}_tokens_per_s": tokens / seconds, f"{name}_accuracy": accuracy,
            f"{name}_compile_s": compile_s, f"{name}_peak_rss_mb": _peak_rss_mb(),
            f"{name}_log_prob_sum": float(scores.sum())}


def child(args) -> None:
    """Run ``--child MODEL:MEASUREMENT[,MEASUREMENT…]`` and print its figures as one JSON line."""
    kind, measurements = args.child.split(":")
    figures = {}
    for measurement in measurements.split(","):
        before = measurement.startswith("before_")
        function = {"train": measure_train, "score": measure_score, "blimp": measure_blimp,
                    "alternate": measure_alternate}[measurement.removeprefix("before_")]
        figures.update(function(kind, args, before) if before else function(kind, args))
    print("RESULT " + json.dumps(figures), flush=True)


# ---------------------------------------------------------------- the side-by-side run

def _run_child(kind: str, measurement: str, argv: list[str]) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", f"{kind}:{measurement}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{kind} {measurement} failed (exit {done.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _child_argv(args) -> list[str]:
    argv = ["--workdir", str(args.workdir), "--exact-run", str(args.exact_run), "--blimp-dir", str(args.blimp_dir),
            "--blimp-files", str(args.blimp_files), "--before-blimp-files", str(args.before_blimp_files),
            "--eval-tokens", str(args.eval_tokens), "--train-steps", str(args.train_steps),
            "--width", str(args.width), "--layers", str(args.layers), "--step-rounds", str(args.step_rounds)]
    return argv


def _ratio(a, b):
    return a / b if a is not None and b else None


def _median_row(rows: list[dict]) -> dict:
    """One model's figures over ``--rounds`` rounds: the median of every number (the rounds'
    own values under ``per_round``, with each round's scoring / training ratio)."""
    row = {key: statistics.median(r[key] for r in rows) if isinstance(rows[0][key], (int, float)) else rows[0][key]
           for key in rows[0]}
    row["per_round"] = {key: [r[key] for r in rows] for key in ("train_tokens_per_s", "train_step_s",
                                                                 "score_tokens_per_s", "blimp_tokens_per_s")
                        if key in rows[0]}
    if "train_tokens_per_s" in rows[0]:
        row["per_round"]["score_vs_train"] = [r["score_tokens_per_s"] / r["train_tokens_per_s"] for r in rows]
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    if {"exact", "residual"} & set(args.models):      # what they read: made here on a fresh clone
        from saffu.runner import exact_run
        try:
            exact_run(args.workdir, args.exact_run)
        except SaffuError as err:
            raise SystemExit(f"--exact-run: {err}") from None
    started_load = os.getloadavg()
    started = time.time()
    argv = _child_argv(args)
    figures = {"settings": {"eval_tokens": args.eval_tokens, "blimp_files": args.blimp_files,
                            "before_blimp_files": args.before_blimp_files, "train_steps": args.train_steps,
                            "width": args.width, "layers": args.layers, "workdir": str(args.workdir),
                            "exact_run": str(args.exact_run), "quick": args.quick, "rounds": args.rounds}}
    measurements = ["train", "score", "blimp"] + (["before_score", "before_blimp"] if args.before else [])
    rounds = {kind: [] for kind in args.models}
    for round_ in range(args.rounds):          # models interleaved round by round: load drifts hit each alike
        for kind in args.models:
            row, wanted = {}, [m for m in measurements if not (m == "train" and kind == "exact")]   # exact: solved
            # --quick: one process per model (its peak RSS figures are then that process's, cumulative)
            for group in ([",".join(wanted)] if args.quick else wanted):
                row.update(_run_child(kind, group, argv))
                print(f"  round {round_ + 1}/{args.rounds}  {kind:<11} {group:<13} done  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
            rounds[kind].append(row)
    for kind in args.models:
        figures[kind] = _median_row(rounds[kind])
    train_reference = figures.get("transformer", {}).get("train_tokens_per_s")
    for kind in args.models:
        row = figures[kind]
        reference = row.get("train_tokens_per_s", train_reference)
        row["score_vs_train"] = _ratio(row.get("score_tokens_per_s"), reference)
        row["blimp_vs_train"] = _ratio(row.get("blimp_tokens_per_s"), reference)
        if args.before:
            row["score_speedup"] = _ratio(row.get("score_tokens_per_s"), row.get("before_score_tokens_per_s"))
            row["blimp_speedup"] = _ratio(row.get("blimp_tokens_per_s"), row.get("before_blimp_tokens_per_s"))
            row["before_score_vs_train"] = _ratio(row.get("before_score_tokens_per_s"), reference)
            row["before_blimp_vs_train"] = _ratio(row.get("before_blimp_tokens_per_s"), reference)
    if "residual" in figures and "transformer" in figures and args.step_rounds:
        # each one's peak RSS is its training process's: building, compiling and stepping that model alone
        rss = {kind: figures[kind]["train_peak_rss_mb"] / 1024 for kind in ("residual", "transformer")}
        figures["residual_step"] = {**_run_child("both", "alternate", argv), "peak_rss_gb": rss,
                                    "peak_rss_extra_gb": rss["residual"] - rss["transformer"]}
        print(f"  alternating training steps done  (load {os.getloadavg()[0]:.1f})", flush=True)
    if "residual" in figures and "transformer" in figures:
        residual, plain = figures["residual"], figures["transformer"]
        figures["residual_vs_transformer"] = {
            "train_step_ratio": _ratio(residual.get("train_step_s"), plain.get("train_step_s")),
            "train_step_ratio_per_round": [_ratio(r, p) for r, p in zip(residual["per_round"].get("train_step_s", []),
                                                                        plain["per_round"].get("train_step_s", []))],
            "train_peak_rss_ratio": _ratio(residual.get("train_peak_rss_mb"), plain.get("train_peak_rss_mb")),
            "score_peak_rss_ratio": _ratio(residual.get("score_peak_rss_mb"), plain.get("score_peak_rss_mb"))}
        if "residual_step" in figures:        # the alternating measurement: one process, the same batches
            step = figures["residual_step"]
            figures["residual_vs_transformer"].update(
                alternating_step_ratio=step["step_time_ratio"],
                alternating_step_ratio_of_minima=step["step_time_ratio_of_minima"],
                alternating_rounds=step["rounds"], peak_rss_extra_gb=step.get("peak_rss_extra_gb"))
    figures["load"] = {"load_average_1min_start": started_load[0], "load_average_1min_end": os.getloadavg()[0],
                       "load_average_5min_end": os.getloadavg()[1], "cores": os.cpu_count()}
    figures["wall_seconds"] = time.time() - started
    print_table(figures, args)
    if args.metrics_json:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.write_result:
        from results import write_result
        path = write_result("bench_scoring", figures, seeds=[0],
                            load={"load_average_1min_start": started_load[0],
                                  "load_average_1min_end": figures["load"]["load_average_1min_end"]})
        print(f"wrote {path}")
    return figures


def print_table(figures: dict, args) -> None:
    def cell(value, form):
        return "—" if value is None else format(value, form)
    columns = [("train tok/s", "train_tokens_per_s", ",.0f"), ("step s", "train_step_s", ".2f"),
               ("train RSS MB", "train_peak_rss_mb", ",.0f"), ("score tok/s", "score_tokens_per_s", ",.0f"),
               ("×train", "score_vs_train", ".2f"), ("BLiMP s", "blimp_seconds", ".1f"),
               ("BLiMP tok/s", "blimp_tokens_per_s", ",.0f"), ("×train", "blimp_vs_train", ".2f")]
    if args.before:
        columns += [("old score tok/s", "before_score_tokens_per_s", ",.0f"), ("score ×", "score_speedup", ".2f"),
                    ("old BLiMP tok/s", "before_blimp_tokens_per_s", ",.0f"), ("BLiMP ×", "blimp_speedup", ".2f")]
    print()
    print(f"{'model':<12}" + "".join(f"{title:>16}" for title, _, _ in columns))
    for kind in args.models:
        row = figures[kind]
        print(f"{kind:<12}" + "".join(f"{cell(row.get(key), form):>16}" for _, key, form in columns))
    if args.rounds > 1:
        for kind in args.models:
            ratios = figures[kind]["per_round"].get("score_vs_train")
            if ratios:
                print(f"{kind}: scoring ×train per round {', '.join(f'{r:.2f}' for r in ratios)}")
        steps = figures.get("residual_vs_transformer", {}).get("train_step_ratio_per_round")
        if steps:
            print(f"residual / transformer step time per round {', '.join(f'{r:.2f}' for r in steps)}")
    versus = figures.get("residual_vs_transformer", {})
    if "alternating_step_ratio" in versus:
        print(f"residual / transformer, steps alternating in one process ({versus['alternating_rounds']} rounds): "
              f"×{versus['alternating_step_ratio']:.3f} median, ×{versus['alternating_step_ratio_of_minima']:.3f} "
              f"of minima; peak RSS +{versus['peak_rss_extra_gb']:.2f} GB")
    settings = figures["settings"]
    print(f"\ndev tokens scored: {figures[args.models[0]].get('score_tokens')}, BLiMP pairs: "
          f"{figures[args.models[0]].get('blimp_pairs')} ({settings['blimp_files'] or 'all'} files); "
          f"load average {figures['load']['load_average_1min_start']:.1f} → {figures['load']['load_average_1min_end']:.1f} "
          f"on {figures['load']['cores']} cores; {figures['wall_seconds']:.0f} s")
    if "residual_vs_transformer" in figures:
        ratio = figures["residual_vs_transformer"]
        print(f"residual / transformer: step time ×{cell(ratio['train_step_ratio'], '.2f')}, "
              f"training peak RSS ×{cell(ratio['train_peak_rss_ratio'], '.2f')}, "
              f"scoring peak RSS ×{cell(ratio['score_peak_rss_ratio'], '.2f')}")


if __name__ == "__main__":
    main()
