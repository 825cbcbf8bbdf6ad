"""The ``saffu`` command line: thin wrappers that parse flags into configs and call the library.

Every command prints a human summary, accepts ``--metrics-json PATH`` for a flat JSON object
of its figures, and reports bad input as one ``saffu: error: …`` line (exit status 2).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

from saffu._io import SaffuError, atomic_write_bytes, write_metrics

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "default_corpus"
SHARED_CORPUS = Path("../shared/data/babylm/2023")


def _print_metrics(title: str, metrics: dict) -> None:
    print(title)
    for key, value in metrics.items():
        print(f"  {key:>24}: {value:.4f}" if isinstance(value, float) else f"  {key:>24}: {value}")


def _corpus_from_args(args):
    from saffu.corpus import babylm_corpus, text_files_corpus
    if args.train_files:
        splits = {args.train_split: args.train_files}
        if args.dev_files:
            splits["dev"] = args.dev_files
        return text_files_corpus(splits, name=args.corpus_name or "text-files")
    if args.corpus is None:
        raise SaffuError("give --corpus DIR (BabyLM layout) or --train-files FILE ...")
    return babylm_corpus(args.corpus, name=args.corpus_name)


def cmd_prepare(args) -> dict:
    from saffu.prepare import PrepareConfig, prepare
    corpus = _corpus_from_args(args)
    config = PrepareConfig(vocab_size=args.vocab_size, train_split=args.train_split,
                           allow_smaller_vocab=args.allow_smaller_vocab)
    workdir = prepare(corpus, args.workdir, config, show_progress=not args.quiet)
    metrics = {"vocab_size": workdir.vocab_size, "seconds": workdir.meta["seconds"]}
    for split, info in workdir.meta["splits"].items():
        for key, value in info.items():
            metrics[f"{split}_{key}"] = value
    _print_metrics(f"prepared {corpus.name} -> {workdir.path}", metrics)
    if workdir.vocab_size < args.vocab_size:
        print(f"  note: the corpus supports only {workdir.vocab_size} BPE tokens "
              f"(--vocab-size {args.vocab_size} was asked for)")
    for split, info in workdir.meta["splits"].items():
        if info["replaced_bytes"]:
            print(f"  note: {split} had {info['replaced_bytes']} invalid UTF-8 sequences, "
                  f"read as U+FFFD")
    return metrics


def _bigram_config(args):
    from saffu.bigram import BigramConfig
    from saffu.codes import CipherConfig
    from saffu.explicit import Smoothing
    return BigramConfig(cipher=CipherConfig(bits=args.bits, background=args.background),
                        smoothing=Smoothing(kind=args.smoothing, alpha=args.alpha, mu=args.mu),
                        holdout_tokens=args.holdout_tokens, chunk_size=args.chunk_size)


def _eval_splits(workdir) -> list[str]:
    return [s for s in workdir.meta["splits"] if s != workdir.train_split]


def cmd_stats(args) -> dict:
    from saffu import statistics
    from saffu.bigram import bigram_nll, fit_explicit_bigram
    from saffu.codes import sparse_bit_cipher
    from saffu.evaluation import pair_counts, split_metrics
    from saffu.explicit import unigram_prior
    from saffu.prepare import open_workdir

    if args.num_processes > 1:
        from saffu import distributed
        if not args.coordinator:
            raise SaffuError("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        if args.process_id != 0:  # every process computes the same totals; process 0 writes them
            args.metrics_json, args.write_outputs = None, False
    workdir = open_workdir(args.workdir)
    config = _bigram_config(args)
    start = time.perf_counter()
    metrics: dict = {"model": args.model, "vocab_size": workdir.vocab_size}
    if args.model == "bigram":
        model, report = fit_explicit_bigram(workdir, config, progress=not args.quiet)
        metrics.update({"bits": config.cipher.bits, **report})
        nll = lambda pairs: bigram_nll(model, pairs)
    else:  # unigram
        stream = workdir.tokens(workdir.train_split)
        stats = statistics.accumulate(stream, {"unigram": statistics.unigram_counts(workdir.vocab_size)},
                                      progress=None if args.quiet else "statistics")
        log_prior = np.log(unigram_prior(stats["unigram"]))
        nll = lambda pairs: float(-(pairs[2] * log_prior[pairs[1]]).sum())
    fit_seconds = time.perf_counter() - start
    for split in _eval_splits(workdir):
        pairs = pair_counts(workdir.tokens(split), vocab_size=workdir.vocab_size)
        metrics.update(split_metrics(nll(pairs), workdir.split_info(split), prefix=f"{split}_"))
    metrics["seconds"] = fit_seconds
    if args.radius > 1 or args.save_statistics:
        sparse = sparse_bit_cipher(workdir.vocab_size, config.cipher.bits)
        offsets = statistics.accumulate(
            workdir.tokens(workdir.train_split),
            {"offset_cooccurrence": statistics.offset_cooccurrence(sparse, workdir.vocab_size, args.radius),
             "unigram": statistics.unigram_counts(workdir.vocab_size)},
            chunk_size=config.chunk_size, progress=None if args.quiet else f"offsets M={args.radius}")
        buffer = io.BytesIO()
        np.savez(buffer, offset_cooccurrence=offsets["offset_cooccurrence"], unigram=offsets["unigram"],
                 bits=config.cipher.bits, radius=args.radius)
        if args.write_outputs:
            atomic_write_bytes(Path(args.workdir) / "statistics.npz", buffer.getvalue())
        metrics["offset_stats_seconds"] = offsets["seconds"]
        metrics["offset_stats_tokens_per_s"] = (len(workdir.tokens(workdir.train_split)) - 1) / offsets["seconds"]
    _print_metrics(f"explicit {args.model} model on {workdir.meta['corpus']}", metrics)
    return metrics


def cmd_download(args) -> dict:
    from saffu.download import download_babylm
    start = time.perf_counter()
    dest = download_babylm(args.dest, args.url, args.sha256, progress=not args.quiet)
    metrics = {"dest": str(dest), "seconds": time.perf_counter() - start,
               "splits": ",".join(sorted(p.name for p in dest.iterdir()))}
    _print_metrics(f"downloaded {args.url}", metrics)
    return metrics


def cmd_demo(args) -> dict:
    """Embedded corpus -> tokenizer -> explicit SAFFU -> short Adam warm start -> evaluation,
    with the explicit bigram for reference."""
    from saffu.bigram import bigram_nll, fit_explicit_bigram
    from saffu.corpus import babylm_corpus
    from saffu.evaluation import pair_counts, split_metrics
    from saffu.model import SaffuConfig, parameter_count
    from saffu.prepare import PrepareConfig, prepare
    from saffu.runs import evaluate_split, save_explicit, save_run_config
    from saffu.explicit import Smoothing
    from saffu.solver import SolverConfig, solve_explicit
    from saffu.training import TrainConfig, train

    corpus = babylm_corpus(args.corpus, name="saffu-default" if args.corpus == DEFAULT_CORPUS else None)
    workdir = prepare(corpus, Path(args.workdir) / "data", PrepareConfig(vocab_size=args.vocab_size),
                      show_progress=not args.quiet)
    info = workdir.split_info("dev")
    bigram, _ = fit_explicit_bigram(workdir, _bigram_config(args), progress=not args.quiet)
    metrics = split_metrics(bigram_nll(bigram, pair_counts(workdir.tokens("dev"), vocab_size=workdir.vocab_size)),
                            info, "bigram_dev_")
    config = SaffuConfig(vocab_size=workdir.vocab_size, bits=args.bits, radius=args.radius)
    params, report = solve_explicit(workdir, config, SolverConfig(smoothing=Smoothing(mu=args.saffu_mu)),
                                    progress=not args.quiet)
    run = Path(args.workdir) / "saffu"
    run.mkdir(parents=True, exist_ok=True)
    save_run_config(run, config, workdir)
    save_explicit(run, params)
    metrics.update(explicit_seconds=report["seconds"], params=parameter_count(params))
    metrics.update(evaluate_split(params, config, workdir, "dev", progress=not args.quiet, prefix="explicit_dev_"))
    trained, history = train(config, params, workdir.tokens(workdir.train_split),
                             TrainConfig(steps=args.steps, learning_rate=args.learning_rate,
                                         eval_every=args.steps, checkpoint_every=args.steps),
                             run, dev_stream=workdir.tokens("dev"), progress=not args.quiet)
    metrics.update(warm_steps=args.steps, warm_seconds=history[-1]["seconds"] if history else 0.0)
    metrics.update(evaluate_split(trained, config, workdir, "dev", progress=not args.quiet, prefix="warm_dev_"))
    _print_metrics(f"saffu demo on {corpus.name}: explicit bigram, explicit SAFFU (radius {args.radius}), "
                   f"then {args.steps} Adam steps from it", metrics)
    print(f"\nrun directory: {run}  (try: saffu generate --workdir {workdir.path} --run {run})")
    if SHARED_CORPUS.is_dir() and args.corpus == DEFAULT_CORPUS:
        print(f"The BabyLM corpus is at {SHARED_CORPUS}; run the same on it with\n"
              f"  saffu demo --corpus {SHARED_CORPUS} --workdir runs/babylm-demo --vocab-size 8192")
    return metrics


def _model_config(args, vocab_size: int):
    if getattr(args, "model", "saffu") == "transformer":
        from saffu.transformer import TransformerConfig
        return TransformerConfig(vocab_size=vocab_size, width=args.width, layers=args.layers,
                                 heads=args.attention_heads, mlp_ratio=args.mlp_ratio,
                                 context_tokens=args.context, max_len=args.max_len)
    from saffu.model import SaffuConfig
    return SaffuConfig(vocab_size=vocab_size, bits=args.bits, radius=args.radius, heads=args.heads,
                       positions=args.positions, hidden=args.hidden, value_form=args.value_form,
                       blocks=args.blocks)


def _score_splits(params, config, workdir, args, splits=None) -> dict:
    """Figures of every non-training split (or ``splits``), limited by ``--eval-tokens``."""
    from saffu.runs import evaluate_split
    limit = None if args.eval_tokens == 0 else args.eval_tokens
    metrics = {}
    for split in splits or _eval_splits(workdir):
        metrics.update(evaluate_split(params, config, workdir, split, limit, not args.quiet))
    return metrics


def cmd_fit(args) -> dict:
    """Explicit solution of a SAFFU model -> run directory (config + explicit checkpoint)."""
    from saffu.explicit import Smoothing
    from saffu.model import parameter_count
    from saffu.prepare import open_workdir
    from saffu.runs import save_explicit, save_run_config
    from saffu.solver import SolverConfig, solve_explicit

    workdir = open_workdir(args.workdir)
    if args.background:
        raise SaffuError("--background is not supported by the SAFFU solver yet (codes are unblended); "
                         "drop the flag")
    config = _model_config(args, workdir.vocab_size)
    solver = SolverConfig(smoothing=Smoothing(kind=args.smoothing, alpha=args.alpha, mu=args.mu),
                          holdout_tokens=args.holdout_tokens, chunk_size=args.chunk_size)
    params, report = solve_explicit(workdir, config, solver, progress=not args.quiet)
    Path(args.run).mkdir(parents=True, exist_ok=True)
    save_run_config(args.run, config, workdir)
    save_explicit(args.run, params)
    metrics = {**report, "params": parameter_count(params), **_score_splits(params, config, workdir, args)}
    _print_metrics(f"explicit SAFFU on {workdir.meta['corpus']} -> {args.run}", metrics)
    return metrics


def cmd_train(args) -> dict:
    """Backprop from the explicit solution (warm) or from random init (cold)."""
    import jax
    from saffu.model import parameter_count
    from saffu.prepare import open_workdir
    from saffu.runs import load_explicit, load_run_config, save_run_config
    from saffu.training import TrainConfig, train

    workdir = open_workdir(args.workdir)
    run = Path(args.run)
    if args.init == "explicit":
        if args.model == "transformer":
            raise SaffuError("a transformer has no explicit solution; use --init random")
        config = _check_vocabulary(load_run_config(run), workdir, run)
        params = load_explicit(run, config)
    else:
        config = (_check_vocabulary(load_run_config(run), workdir, run) if (run / "config.json").exists()
                  else _model_config(args, workdir.vocab_size))
        if config.kind == "saffu":
            workdir.check_radius(config.radius)
        run.mkdir(parents=True, exist_ok=True)
        save_run_config(run, config, workdir)
        params = config.init(jax.random.fold_in(jax.random.key(args.seed), 0))
    if config.kind == "saffu":
        workdir.check_radius(config.radius)  # also for explicit runs made from another work directory
    train_config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                               learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                               weight_decay=args.weight_decay, adam_eps=args.adam_eps,
                               eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                               seed=args.seed, freeze=tuple(args.freeze), thaw_step=args.thaw_step,
                               on_nonfinite=args.on_nonfinite)
    dev = workdir.tokens("dev") if "dev" in workdir.meta["splits"] else None
    show = None if args.quiet else (lambda r: print(f"  step {r['step']:>6}  dev_loss {r['dev_loss']:.4f}  "
                                                    f"train_loss {r['train_loss']:.4f}  {r['seconds']:.1f} s"))
    from saffu.training import data_parallel_mesh
    mesh = data_parallel_mesh(args.devices or None) if args.devices != 1 else None
    params, history = train(config, params, workdir.tokens(workdir.train_split), train_config, run,
                            dev_stream=dev, on_eval=show, progress=not args.quiet, mesh=mesh)
    metrics = {"model": config.kind, "init": args.init, "params": parameter_count(params),
               "steps": history[-1]["step"] if history else 0}
    if history:
        metrics.update({key: history[-1][key] for key in ("seconds", "tokens", "tokens_per_s", "flops",
                                                          "xla_flops", "peak_rss_mb") if key in history[-1]})
        metrics["train_seconds"] = metrics.pop("seconds")
    metrics.update(_score_splits(params, config, workdir, args))
    _print_metrics(f"{args.init}-init training of {run}", metrics)
    return metrics


def _load_run(args):
    """``(workdir, model config, params, which checkpoint)`` of ``--workdir`` / ``--run`` / ``--checkpoint``."""
    from saffu.prepare import open_workdir
    from saffu.runs import load_params, load_run_config
    workdir = open_workdir(args.workdir)
    config = _check_vocabulary(load_run_config(args.run), workdir, args.run)
    params, which = load_params(args.run, config, args.checkpoint)
    return workdir, config, params, which


def _check_vocabulary(config, workdir, run):
    if config.vocab_size != workdir.vocab_size:
        raise SaffuError(f"run {run} has a {config.vocab_size}-token model but {workdir.path} a "
                         f"{workdir.vocab_size}-token tokenizer; use the work directory the run was made from")
    return config


def cmd_eval(args) -> dict:
    workdir, config, params, which = _load_run(args)
    metrics = {"checkpoint": which, **_score_splits(params, config, workdir, args, args.split)}
    _print_metrics(f"{args.run} ({which})", metrics)
    return metrics


def cmd_blimp(args) -> dict:
    """BLiMP accuracy of a run: overall, per field, per paradigm."""
    from saffu.blimp import evaluate_blimp
    workdir, config, params, which = _load_run(args)
    metrics = {"checkpoint": which, **evaluate_blimp(params, config, workdir.tokenizer(), args.blimp,
                                                      progress=not args.quiet)}
    _print_metrics(f"BLiMP of {args.run} ({which})", metrics)
    return metrics


def cmd_ngram(args) -> dict:
    """Interpolated modified Kneser-Ney from the engine's n-gram counts: dev figures, ARPA file,
    BLiMP."""
    from saffu import accounting, kneser_ney
    from saffu.evaluation import split_metrics
    from saffu.prepare import open_workdir
    if not 1 <= args.order <= 9:
        raise SaffuError(f"--order must be between 1 and 9, got {args.order}")
    workdir = open_workdir(args.workdir)
    train_stream = workdir.tokens(workdir.train_split)
    start = time.perf_counter()
    model = kneser_ney.fit_kneser_ney(train_stream, args.order, vocab_size=workdir.vocab_size,
                                      progress=None if args.quiet else "count n-grams")
    fit_seconds = time.perf_counter() - start
    entries = model.num_ngrams()
    metrics = {"order": args.order, "fit_seconds": fit_seconds, "tokens_per_s": (len(train_stream) - 1) / fit_seconds,
               # one probability per n-gram and one backoff weight per n-gram below the top order
               "params": int(sum(entries) + sum(entries[:-1])),
               **{f"ngrams_{k}": n for k, n in enumerate(entries, 1)}}
    for split in _eval_splits(workdir):
        stream = workdir.tokens(split)
        tick = time.perf_counter()
        scores = kneser_ney.log_probs(model, stream, 1, len(stream), progress=None if args.quiet else f"score {split}")
        metrics.update(split_metrics(-float(scores.sum()), workdir.split_info(split), f"{split}_"))
        metrics[f"{split}_score_seconds"] = time.perf_counter() - tick
    if args.arpa:
        tick = time.perf_counter()
        kneser_ney.write_arpa(model, args.arpa)
        metrics.update(arpa=str(args.arpa), arpa_seconds=time.perf_counter() - tick)
    if args.blimp:
        from saffu.blimp import blimp_accuracy, load_blimp
        pairs = load_blimp(args.blimp)
        tokenizer = workdir.tokenizer()
        encode = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        good = kneser_ney.sentence_log_probs(model, encode([p.good for p in pairs]))
        bad = kneser_ney.sentence_log_probs(model, encode([p.bad for p in pairs]))
        metrics.update(blimp_accuracy(pairs, good, bad))
    metrics.update(accounting.memory_record())
    _print_metrics(f"Kneser-Ney {args.order}-gram on {workdir.meta['corpus']}", metrics)
    return metrics


def cmd_generate(args) -> dict:
    import jax
    from saffu.runs import generate
    workdir, config, params, which = _load_run(args)
    texts = generate(params, config, workdir.tokenizer(), jax.random.key(args.seed), args.num_samples,
                     args.max_tokens, args.temperature, args.top_k)
    print(f"{len(texts)} samples from {args.run} ({which}):")
    for text in texts:
        print(f"  > {text}")
    return {"checkpoint": which, "samples": len(texts), "mean_chars": float(np.mean([len(t) for t in texts])),
            **{f"sample_{i}": t for i, t in enumerate(texts)}}


def _add_common(parser):
    parser.add_argument("--metrics-json", type=Path, help="write the figures as a flat JSON object here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_model_flags(parser):
    parser.add_argument("--bits", type=int, default=128, help="bit-cipher bits b (codes have b+1 dims)")
    parser.add_argument("--background", type=float, default=0.0, help="background blend weight λ in [0,1)")
    parser.add_argument("--smoothing", choices=["dirichlet", "additive", "noise"], default="dirichlet")
    parser.add_argument("--mu", type=float, default=100.0, help="Dirichlet prior strength")
    parser.add_argument("--alpha", type=float, default=0.5, help="additive / noise pseudo-count")
    parser.add_argument("--holdout-tokens", type=int, default=100_000,
                        help="training-stream tail held out of the counts to calibrate β (0: β=1)")
    parser.add_argument("--chunk-size", type=int, default=1 << 15, help="targets per device per step")


def _add_architecture_flags(parser):
    parser.add_argument("--radius", type=int, default=8, help="context rows M per block")
    parser.add_argument("--heads", type=int, default=1, help="attention heads (head h attends over M >> h rows)")
    parser.add_argument("--positions", type=int, default=2, help="nearest rows with their own output group")
    parser.add_argument("--hidden", type=int, default=0, help="0: direct output layer; D: softmax hidden chain")
    parser.add_argument("--value-form", choices=["linear", "log"], default="linear")
    parser.add_argument("--blocks", type=int, default=1, help="stacked SAFFU blocks")


def _add_eval_flags(parser):
    parser.add_argument("--eval-tokens", type=int, default=0,
                        help="score only the first N tokens of each split (0: all, with bits per byte)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saffu", description="Explicit (closed-form) SAFFU language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="corpus -> tokenizer + memory-mapped token streams",
                       description="Train a byte-level BPE on the training split, re-rank ids by "
                                   "frequency and write every split's token stream to the work directory.")
    p.add_argument("--corpus", type=Path, help="BabyLM-layout folder (train_10M/, dev/, ...)")
    p.add_argument("--train-files", nargs="+", help="plain-text training files instead of --corpus")
    p.add_argument("--dev-files", nargs="+", help="plain-text dev files (with --train-files)")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--train-split", default="train_10M", help="train_10M or train_100M")
    p.add_argument("--allow-smaller-vocab", action="store_true",
                   help="accept fewer tokens than --vocab-size when the corpus supports no more merges")
    p.add_argument("--corpus-name", help="label for reports (default: the folder name), "
                                         "e.g. babylm-2023-4src for ../shared/data/babylm/2023")
    _add_common(p)
    p.set_defaults(run_command=cmd_prepare)

    p = sub.add_parser("stats", help="streaming statistics + explicit model + dev figures",
                       description="Stream the training split through the accumulators, solve the "
                                   "explicit model and score every other split.")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--model", choices=["bigram", "unigram"], default="bigram")
    p.add_argument("--radius", type=int, default=1,
                   help="also compute and save offset statistics F_δ, δ < radius, to statistics.npz")
    p.add_argument("--save-statistics", action="store_true", help="save statistics.npz even for radius 1")
    p.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) in a multi-process job; each streams its own documents")
    p.add_argument("--process-id", type=int, default=0, help="this process's index in [0, num-processes)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (jax.distributed)")
    p.set_defaults(write_outputs=True)
    _add_model_flags(p)
    _add_common(p)
    p.set_defaults(run_command=cmd_stats)

    p = sub.add_parser("fit", help="explicit SAFFU solution -> run directory (no backprop)",
                       description="Solve a SAFFU model stage by stage from streaming statistics, save it "
                                   "to --run and score every non-training split.")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True, help="run directory to create")
    _add_architecture_flags(p)
    _add_model_flags(p)
    p.set_defaults(holdout_tokens=16_384, chunk_size=1 << 12, mu=3000.0)
    _add_eval_flags(p)
    _add_common(p)
    p.set_defaults(run_command=cmd_fit)

    p = sub.add_parser("train", help="backprop with optax from explicit (warm) or random (cold) init",
                       description="Train a SAFFU model; resumes from --run/checkpoints when present.")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--init", choices=["explicit", "random"], required=True)
    p.add_argument("--model", choices=["saffu", "transformer"], default="saffu",
                   help="architecture of a new random-init run (an existing run keeps its own)")
    _add_architecture_flags(p)
    t = p.add_argument_group("transformer (with --model transformer)")
    t.add_argument("--width", type=int, default=128, help="model width d")
    t.add_argument("--layers", type=int, default=5, help="transformer blocks")
    t.add_argument("--attention-heads", type=int, default=4)
    t.add_argument("--mlp-ratio", type=int, default=4, help="MLP hidden width = ratio · d")
    t.add_argument("--context", type=int, default=32, help="left-context tokens before each window's targets")
    t.add_argument("--max-len", type=int, default=512, help="longest window (learned positions)")
    p.add_argument("--bits", type=int, default=128)
    p.add_argument("--steps", type=int, default=0, help="0: one epoch")
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="targets per window")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze", nargs="*", default=[], help="parameter names frozen until --thaw-step")
    p.add_argument("--thaw-step", type=int, default=0)
    p.add_argument("--devices", type=int, default=1,
                   help="data-parallel over this many local devices (0: all); the batch is split over them")
    p.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a step with a non-finite loss is never applied: stop with an error, or skip it")
    _add_eval_flags(p)
    _add_common(p)
    p.set_defaults(run_command=cmd_train)

    p = sub.add_parser("eval", help="loss, perplexity, bits per byte of a run")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--split", nargs="*", help="splits to score (default: all but training)")
    p.add_argument("--checkpoint", choices=["latest", "explicit"], default="latest")
    _add_eval_flags(p)
    _add_common(p)
    p.set_defaults(run_command=cmd_eval)

    p = sub.add_parser("blimp", help="BLiMP minimal-pair accuracy of a run")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--blimp", type=Path, required=True, help="folder of BLiMP paradigm *.jsonl files")
    p.add_argument("--checkpoint", choices=["latest", "explicit"], default="latest")
    _add_common(p)
    p.set_defaults(run_command=cmd_blimp)

    p = sub.add_parser("ngram", help="Kneser-Ney n-gram baseline from the engine's counts (+ ARPA, BLiMP)",
                       description="Count n-grams of the training split (documents never crossed), estimate "
                                   "interpolated modified Kneser-Ney, score every other split, optionally "
                                   "write the ARPA file (kenlm loads it) and score BLiMP.")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--order", type=int, default=5)
    p.add_argument("--arpa", type=Path, help="write the model as an ARPA file here")
    p.add_argument("--blimp", type=Path, help="folder of BLiMP paradigm *.jsonl files")
    _add_common(p)
    p.set_defaults(run_command=cmd_ngram)

    p = sub.add_parser("generate", help="sample documents from a run")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--checkpoint", choices=["latest", "explicit"], default="latest")
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50, help="0: sample from the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)
    _add_common(p)
    p.set_defaults(run_command=cmd_generate)

    p = sub.add_parser("download", help="download the official BabyLM release (needs internet)")
    p.add_argument("--dest", type=Path, required=True, help="new folder for the corpus")
    from saffu.download import BABYLM_2023_URL
    p.add_argument("--url", default=BABYLM_2023_URL)
    p.add_argument("--sha256", help="expected checksum of the archive")
    _add_common(p)
    p.set_defaults(run_command=cmd_download)

    p = sub.add_parser("demo", help="the main job on the embedded corpus: explicit init, warm start, evaluation")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"))
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--radius", type=int, default=8, help="SAFFU context rows")
    p.add_argument("--saffu-mu", type=float, default=3000.0, help="Dirichlet strength of the SAFFU solver")
    p.add_argument("--steps", type=int, default=40, help="Adam warm-start steps")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    _add_model_flags(p)
    _add_common(p)
    p.set_defaults(run_command=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        metrics = args.run_command(args)
        write_metrics(args.metrics_json, metrics)
    except SaffuError as err:
        print(f"saffu: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:
        print(f"saffu: numerical error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("saffu: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
