"""The ``saffu`` command line: thin wrappers that parse flags into configs and call the library.

Every command prints a human summary, accepts ``--metrics-json PATH`` for a flat JSON object
of its figures (checked before any work starts), and reports bad input as one
``saffu: error: …`` line (exit status 2). Defaults come from the config dataclasses of
:mod:`saffu.configs` and ``--help`` shows them. Nothing heavy is imported before a command
runs, so ``saffu --help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shutil
import sys
import time
import warnings
from pathlib import Path

from saffu import configs
from saffu._io import SaffuError, SaffuWarning, exclusive, is_disk_full, probe_writable, write_metrics


DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "default_corpus"
SHARED_CORPUS = Path("../shared/data/babylm/2023")
#: Tokens of each split a final evaluation scores unless ``--eval-tokens`` says otherwise
#: (whole documents, exact bits per byte); ``--eval-tokens 0`` scores whole splits.
EVAL_TOKENS = 200_000
STRUCTURE_CHOICES = configs.STRUCTURES


def human(value) -> str:
    """A figure as a person reads it: ``1,428,424``, ``5.3400``, ``4.48e+11``, ``9,123.4``."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if hasattr(value, "item"):  # numpy / jax scalars
        value = value.item()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e6:
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        return f"{value:.4f}"
    return str(value)


def _print_metrics(title: str, metrics: dict) -> None:
    """The summary: a title, then ``key  value`` rows with the keys in one aligned column."""
    print(title)
    width = min(max((len(key) for key in metrics), default=0), 48)
    for key, value in metrics.items():
        print(f"  {key:<{width}}  {human(value)}")


def _say(args, message: str) -> None:
    """A progress announcement (silenced by ``--quiet``)."""
    if not getattr(args, "quiet", False):
        print(message, flush=True)


def _check_writable(path: Path | None, flag: str, directory: bool = False) -> None:
    """Fail before any work when ``path`` (an output of ``flag``) cannot be written."""
    if path is not None:
        probe_writable(path, flag, directory)


def _retry_save(error: SaffuError, run: Path) -> Path | None:
    """After a failed save of a finished solve: at a terminal, say so and ask where to save
    (Enter: the same ``run`` again once space is freed; a path: another directory; ``q``: give
    up); elsewhere give up (the caller reports the one-line error)."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return None
    print(f"saffu: {error}", file=sys.stderr)
    answer = input("The solution is kept in memory. Free space and press Enter to save to the same --run, "
                   "type another directory, or q to give up: ").strip()
    return None if answer.lower() in ("q", "quit") else Path(answer) if answer else run


def _save_solution(args, config, workdir, params) -> None:
    """Commit a finished solve to ``--run`` (:func:`saffu.training.checkpoints.save_explicit_run`);
    a full disk at a terminal asks where to save rather than losing the solve."""
    from saffu.training.checkpoints import save_explicit_run
    saved = save_explicit_run(args.run, config, workdir, params, retry=_retry_save)
    if Path(saved) != Path(args.run):
        _say(args, f"saved to {saved} instead of {args.run}")
        args.run = Path(saved)


def _check_room_for(args, config) -> None:
    """Refuse before solving when ``config``'s explicit solution (sizes known in advance)
    cannot fit in ``--run``'s file system."""
    import jax

    from saffu._io import check_free
    from saffu.training.checkpoints import tree_bytes
    check_free(args.run, tree_bytes(jax.eval_shape(lambda: config.init(jax.random.key(0)))) + (1 << 20),
               f"the explicit solution ({config.kind})", "free space or give another --run")


def check_inputs(run, workdir, streams: bool = False):
    """The model config of ``run`` once ``workdir`` is checked to be its own
    (:func:`saffu.training.checkpoints.check_inputs`: tokenizer, and with ``streams`` the token
    streams, by fingerprint)."""
    from saffu.training import checkpoints
    return checkpoints.check_inputs(run, workdir, streams)


def _corpus_from_args(args):
    from saffu.data.corpus import babylm_corpus, text_files_corpus
    if args.train_files:
        splits = {args.train_split: args.train_files}
        if args.dev_files:
            splits["dev"] = args.dev_files
        return text_files_corpus(splits, name=args.corpus_name or "text-files")
    if args.dev_files:
        raise SaffuError("--dev-files goes with --train-files; with --corpus the dev split comes from its dev/ folder")
    if args.corpus is None:
        raise SaffuError("give --corpus DIR (BabyLM layout) or --train-files FILE ...")
    return babylm_corpus(args.corpus, name=args.corpus_name)


def cmd_prepare(args) -> dict:
    from saffu.data.workdir import prepare
    if args.train_split is None:  # text files form a split named "train"; the BabyLM layout's is train_10M
        args.train_split = "train" if args.train_files else configs.PrepareConfig.train_split
    corpus = _corpus_from_args(args)
    config = configs.PrepareConfig(vocab_size=args.vocab_size, train_split=args.train_split,
                                   allow_smaller_vocab=args.allow_smaller_vocab, strict=args.strict)
    workdir = prepare(corpus, args.workdir, config, show_progress=not args.quiet)
    metrics = {"vocab_size": workdir.vocab_size, "seconds": workdir.meta["seconds"]}
    for split, info in workdir.meta["splits"].items():
        for key, value in info.items():
            metrics[f"{split}_{key}"] = value
    _print_metrics(f"prepared {corpus.name} -> {workdir.path}", metrics)
    if workdir.vocab_size < args.vocab_size:
        print(f"  note: the corpus supports only {workdir.vocab_size:,} BPE tokens "
              f"(--vocab-size {args.vocab_size:,} was asked for)")
    for split, info in workdir.meta["splits"].items():
        if info["replaced_bytes"]:
            print(f"  note: {split} had {info['replaced_bytes']:,} invalid UTF-8 sequences, read as U+FFFD")
    return metrics


def _smoothing(args) -> configs.Smoothing:
    return configs.Smoothing(kind=args.smoothing, alpha=args.alpha, mu=args.mu)


def _bigram_config(args) -> configs.BigramConfig:
    return configs.BigramConfig(cipher=configs.CipherConfig(bits=args.bits, background=args.background),
                                smoothing=_smoothing(args), holdout_tokens=args.holdout_tokens,
                                chunk_size=args.chunk_size)


def _eval_splits(workdir) -> list[str]:
    return [s for s in workdir.meta["splits"] if s != workdir.train_split]


def _join_processes(args) -> bool:
    """Join the multi-process job of ``--num-processes`` / ``--process-id`` / ``--coordinator``
    (before any JAX work); returns whether this process writes the outputs. Every process
    computes the same totals; process 0 writes them (the others drop ``--metrics-json``)."""
    if args.num_processes <= 1:
        return True
    from saffu.engine import distributed
    if not args.coordinator:
        raise SaffuError("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.process_id != 0:
        args.metrics_json = None
    return args.process_id == 0


def cmd_stats(args) -> dict:
    from saffu.data.workdir import open_workdir
    from saffu.eval.metrics import pair_counts, split_metrics
    from saffu.models.bigram import bigram_nll
    from saffu.solve.bigram import fit_explicit_bigram, save_offset_statistics, unigram_log_prior, unigram_nll

    writer = _join_processes(args)
    workdir = open_workdir(args.workdir)
    config = _bigram_config(args)
    start = time.perf_counter()
    metrics: dict = {"model": args.model, "vocab_size": workdir.vocab_size}
    if args.model == "bigram":
        model, report = fit_explicit_bigram(workdir, config, progress=not args.quiet)
        metrics.update({"bits": config.cipher.bits, **report})
        nll = lambda pairs: bigram_nll(model, pairs)
    else:
        log_prior = unigram_log_prior(workdir, progress=not args.quiet)
        nll = lambda pairs: unigram_nll(log_prior, pairs)
    fit_seconds = time.perf_counter() - start
    for split in _eval_splits(workdir):
        pairs = pair_counts(workdir.tokens(split), vocab_size=workdir.vocab_size)
        metrics.update(split_metrics(nll(pairs), workdir.split_info(split), prefix=f"{split}_"))
    metrics["seconds"] = fit_seconds
    if args.radius > 1 or args.save_statistics:
        path = Path(args.workdir) / "statistics.npz" if writer else None
        metrics.update(save_offset_statistics(workdir, path, config.cipher.bits, args.radius, config.chunk_size,
                                              progress=not args.quiet))
    _print_metrics(f"explicit {args.model} model on {workdir.meta['corpus']}", metrics)
    return metrics


def cmd_download(args) -> dict:
    from saffu.data.download import download_babylm
    start = time.perf_counter()
    dest = download_babylm(args.dest, args.url, args.sha256, progress=not args.quiet)
    metrics = {"dest": str(dest), "seconds": time.perf_counter() - start,
               "splits": ",".join(sorted(p.name for p in dest.iterdir()))}
    _print_metrics(f"downloaded {args.url}", metrics)
    return metrics


def cmd_demo(args) -> dict:
    """Embedded corpus -> tokenizer -> explicit SAFFU -> short Adam warm start -> evaluation,
    with the explicit bigram for reference. Every run starts afresh (a rerun replaces the
    previous demo run)."""
    from saffu.data.corpus import babylm_corpus
    from saffu.data.workdir import prepare
    from saffu.eval.metrics import pair_counts, split_metrics
    from saffu.eval.scoring import evaluate_split
    from saffu.models.bigram import bigram_nll
    from saffu.models.interface import parameter_count
    from saffu.solve.bigram import fit_explicit_bigram
    from saffu.solve.saffu import solve_explicit
    from saffu.training.checkpoints import save_explicit_run
    from saffu.training.trainer import train

    start = time.perf_counter()
    corpus = babylm_corpus(args.corpus, name="saffu-default" if args.corpus == DEFAULT_CORPUS else None)
    workdir = prepare(corpus, Path(args.workdir) / "data", configs.PrepareConfig(vocab_size=args.vocab_size),
                      show_progress=not args.quiet)
    info = workdir.split_info("dev")
    bigram, _ = fit_explicit_bigram(workdir, _bigram_config(args), progress=not args.quiet)
    metrics = split_metrics(bigram_nll(bigram, pair_counts(workdir.tokens("dev"), vocab_size=workdir.vocab_size)),
                            info, "bigram_dev_")
    config = configs.SaffuConfig(vocab_size=workdir.vocab_size, bits=args.bits, radius=args.radius)
    _say(args, f"solving explicit SAFFU (radius {args.radius}, {args.bits}-bit codes) on "
               f"{workdir.split_info(workdir.train_split)['tokens']:,} training tokens")
    params, report = solve_explicit(workdir, config, configs.SolverConfig(smoothing=configs.Smoothing(mu=args.saffu_mu)),
                                    progress=not args.quiet)
    run = Path(args.workdir) / "saffu"
    if run.exists():   # the demo's own run: a rerun trains again instead of finding it finished
        shutil.rmtree(run)
    save_explicit_run(run, config, workdir, params)
    metrics.update(explicit_seconds=report["seconds"], params=parameter_count(params))
    metrics.update(evaluate_split(params, config, workdir, "dev", progress=not args.quiet, prefix="explicit_dev_"))
    _say(args, f"warm start: {args.steps} AdamW steps from the explicit solution")
    trained, history = train(config, params, workdir.tokens(workdir.train_split),
                             configs.TrainConfig(steps=args.steps, learning_rate=args.learning_rate,
                                                 eval_every=args.steps, checkpoint_every=args.steps),
                             run, dev_stream=workdir.tokens("dev"), progress=not args.quiet)
    metrics.update(warm_steps=args.steps, warm_seconds=history[-1]["seconds"])
    metrics.update(evaluate_split(trained, config, workdir, "dev", progress=not args.quiet, prefix="warm_dev_"))
    metrics["total_seconds"] = time.perf_counter() - start
    _print_metrics(f"saffu demo on {corpus.name}: explicit bigram, explicit SAFFU (radius {args.radius}), "
                   f"then {args.steps} AdamW steps from it", metrics)
    print(f"\nrun directory: {run}  (try: saffu generate --workdir {workdir.path} --run {run})")
    if SHARED_CORPUS.is_dir() and args.corpus == DEFAULT_CORPUS:
        print(f"The BabyLM corpus is at {SHARED_CORPUS}; run the same on it with\n"
              f"  saffu demo --corpus {SHARED_CORPUS} --workdir runs/babylm-demo --vocab-size 8192")
    return metrics


def _model_config(args, vocab_size: int):
    if getattr(args, "model", "saffu") == "transformer":
        return configs.TransformerConfig(vocab_size=vocab_size, width=args.width, layers=args.layers,
                                         heads=args.attention_heads, mlp_ratio=args.mlp_ratio,
                                         context_tokens=args.context, max_len=args.max_len, ffn=args.ffn,
                                         ffn_share=args.ffn_share, ffn_blocks=args.ffn_blocks,
                                         guide_share=args.self_guided, output_bias=not getattr(args, "no_output_bias", False))
    if getattr(args, "model", "saffu") == "factorised":
        return _factorised_config(args, vocab_size)
    return configs.SaffuConfig(vocab_size=vocab_size, bits=args.bits, radius=args.radius, heads=args.heads,
                               positions=args.positions, hidden=args.hidden, value_form=args.value_form,
                               blocks=args.blocks, exact_positions=tuple(args.exact_positions),
                               chain=args.chain_structure, chain_share=args.chain_share, chain_blocks=args.chain_blocks)


def _factorised_config(args, vocab_size: int):
    return configs.FactorisedConfig(vocab_size=vocab_size, rank=args.rank, positions=args.positions,
                                    radius=args.radius, heads=args.heads, output=args.output_structure,
                                    output_share=args.output_share, output_blocks=args.output_blocks,
                                    guide_share=args.output_guided)


def _add_output_structure_flags(parser) -> None:
    f = configs.FactorisedConfig
    parser.add_argument("--output-structure", choices=STRUCTURE_CHOICES, default=f.output,
                        help="the factorised model's output factor B: dense, or structured (set from the "
                             "explicit B by SVD: a closed-form structured init)")
    parser.add_argument("--output-share", type=float, default=f.output_share,
                        help="a structured B's weights as a share of the dense r × V")
    parser.add_argument("--output-blocks", type=int, default=f.output_blocks,
                        help="blocks of a blockdense / blockshuffle B")
    parser.add_argument("--output-guided", type=float, default=f.guide_share, metavar="SHARE",
                        help="self-guided training of a structured B: the dense B it was set from (explicit, or "
                             "random) is mixed in with a weight falling from 1 to 0 on a cosine over this share of "
                             "the steps, then dropped (0: none)")


def _score_splits(params, config, workdir, args, splits=None) -> dict:
    """Figures of every non-training split (or ``splits``), bounded by ``--eval-tokens``
    (whole documents); each split is announced with its size before it is scored."""
    from saffu.eval.scoring import evaluate_split
    limit = None if args.eval_tokens == 0 else args.eval_tokens
    metrics = {}
    for split in splits or _eval_splits(workdir):
        total = workdir.split_info(split)["predicted_tokens"]
        if limit is None or limit >= total:
            _say(args, f"evaluating {split}: all {total:,} tokens")
        else:
            _say(args, f"evaluating {split}: about {limit:,} of its {total:,} tokens, whole documents from evenly "
                       f"spaced parts of it (--eval-tokens 0 scores all)")
        metrics.update(evaluate_split(params, config, workdir, split, limit, not args.quiet))
    return metrics


def cmd_fit(args) -> dict:
    """Explicit solution of a SAFFU model -> run directory (config + explicit checkpoint)."""
    from saffu.data.workdir import open_workdir
    from saffu.models.interface import parameter_count
    from saffu.solve.saffu import solve_explicit

    workdir = open_workdir(args.workdir)
    if args.background:
        raise SaffuError("--background is not supported by the SAFFU solver yet (codes are unblended); "
                         "drop the flag")
    config = _model_config(args, workdir.vocab_size)
    solver = configs.SolverConfig(smoothing=_smoothing(args), holdout_tokens=args.holdout_tokens,
                                  chunk_size=args.chunk_size)
    if not config.exact_positions:        # exact tables' sizes come from the data
        _check_room_for(args, config)
    params, report = solve_explicit(workdir, config, solver, progress=not args.quiet)
    _save_solution(args, config, workdir, params)
    metrics = {**report, "params": parameter_count(params), **_score_splits(params, config, workdir, args)}
    _print_metrics(f"explicit SAFFU on {workdir.meta['corpus']} -> {args.run}", metrics)
    return metrics


def exact_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``"0 1 0,1"`` -> ``((0,), (1,), (0, 1))`` (argparse type of ``--groups``)."""
    try:
        return tuple(tuple(int(x) for x in group.split(",")) for group in text.split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--groups takes space-separated groups of comma-separated offsets, "
                                         f"e.g. \"0 1 0,1\"; got {text!r}") from None


def cmd_exact(args) -> dict:
    """Explicit token-resolution model (exact context groups) -> run directory; with
    ``--num-processes`` every process counts its own documents and process 0 writes."""
    import jax

    from saffu.data.workdir import open_workdir
    from saffu.solve.exact import solve_exact
    from saffu.training.checkpoints import save_explicit

    writer = _join_processes(args)
    workdir = open_workdir(args.workdir)
    config = configs.ExactConfig(vocab_size=workdir.vocab_size, groups=args.groups, mu=args.mu,
                                 buckets=tuple(args.buckets), bucket_by=args.bucket_by, nested=args.nested,
                                 smoothing=args.smoothing, holdout_tokens=args.holdout_tokens,
                                 chunk_size=args.chunk_size)
    _say(args, f"solving {len(config.groups)} exact groups {' '.join(','.join(map(str, g)) for g in config.groups)} "
               f"with {config.num_buckets} count buckets each")
    params, report = solve_exact(workdir, config, progress=not args.quiet)
    # every process takes part (orbax synchronises them); of host arrays only process 0 writes
    if writer:
        _save_solution(args, config, workdir, jax.device_get(params))
    else:
        save_explicit(args.run, jax.device_get(params))
    metrics = {**report, **_score_splits(params, config, workdir, args)}
    _print_metrics(f"explicit token-resolution model on {workdir.meta['corpus']} -> {args.run}", metrics)
    return metrics


def cmd_factorise(args) -> dict:
    """Explicit low-rank factors of the exact offset groups -> factorised-model run directory."""
    from saffu.data.workdir import open_workdir
    from saffu.models.interface import parameter_count
    from saffu.solve.factors import solve_factorised

    workdir = open_workdir(args.workdir)
    config = _factorised_config(args, workdir.vocab_size)
    solver = configs.FactorConfig(mu=args.mu, column_power=args.column_power, oversample=args.oversample,
                                  power_iterations=args.power_iterations, seed=args.seed,
                                  refine_steps=args.refine_steps, refine_offsets=args.refine_offsets,
                                  refine_learning_rate=args.refine_learning_rate, buckets=tuple(args.buckets),
                                  holdout_tokens=args.holdout_tokens,
                                  chunk_size=args.chunk_size)
    _check_room_for(args, config)
    _say(args, f"factorising {config.positions} exact offset groups at rank {config.rank}")
    params, report = solve_factorised(workdir, config, solver, progress=not args.quiet)
    _save_solution(args, config, workdir, params)
    metrics = {**report, "params": parameter_count(params), **_score_splits(params, config, workdir, args)}
    _print_metrics(f"explicit factorised model on {workdir.meta['corpus']} -> {args.run}", metrics)
    return metrics


def cmd_train(args) -> dict:
    """Backprop from the explicit solution (warm) or from random init (cold)."""
    import jax

    from saffu.data.workdir import open_workdir
    from saffu.models.interface import parameter_count
    from saffu.training.checkpoints import latest_checkpoint_step, load_explicit, load_run_config, save_run_config
    from saffu.training.trainer import data_parallel_mesh, run_steps, train

    workdir = open_workdir(args.workdir)
    run = Path(args.run)
    existing = (run / "config.json").exists()
    solve_seconds = 0.0
    if args.ffn_from is not None and (args.init != "random" or args.residual is not None):
        raise SaffuError("--ffn-from starts a structured transformer of its own (--init random, no --residual)")
    if args.residual is not None or (existing and load_run_config(run).kind == "residual"):
        if args.init != "random":
            raise SaffuError("--residual trains a randomly initialised model over the exact one: use --init random")
        config, params = _residual_model(args, workdir, run, existing)
    elif args.init == "inherit":
        config, params = _inherited(args, workdir, run, existing)
    elif args.init == "explicit" and (args.model == "transformer" or
                                      (existing and load_run_config(run).kind == "transformer")):
        config, params, solve_seconds = _explicit_transformer(args, workdir, run, existing)
    elif args.init == "explicit":
        config = check_inputs(run, workdir, streams=True)
        if config.kind == "exact" or getattr(config, "exact_positions", ()):
            raise SaffuError(f"{run} holds a model with exact token-resolution tables, which are not trained; "
                             f"score it with `saffu eval` / `saffu blimp`")
        params = load_explicit(run, config)
    else:
        config = (check_inputs(run, workdir, streams=True) if (run / "config.json").exists()
                  else _model_config(args, workdir.vocab_size))
        if config.kind == "exact" or getattr(config, "exact_positions", ()):
            raise SaffuError("exact token-resolution tables (the exact model, --exact-positions) come from the "
                             "data and have no random init; solve them with `saffu exact` / `saffu fit`")
        if config.kind in ("saffu", "factorised"):
            workdir.check_radius(config.radius)
        run.mkdir(parents=True, exist_ok=True)
        save_run_config(run, config, workdir)
        params = config.init(jax.random.fold_in(jax.random.key(args.seed), 0))
        if args.ffn_from is not None:
            params = _structured_from(args, workdir, config)
    if config.kind in ("saffu", "factorised"):
        workdir.check_radius(config.radius)  # also for explicit runs made from another work directory
    train_config = configs.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, adam_eps=args.adam_eps,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
        freeze=tuple(args.freeze), thaw_step=args.thaw_step, on_nonfinite=args.on_nonfinite,
        log_every=args.log_every, compute_dtype=args.compute_dtype)
    train_stream = workdir.tokens(workdir.train_split)
    steps = run_steps(train_stream, train_config)
    resumed = latest_checkpoint_step(run)
    if resumed is not None:
        _say(args, f"resuming {run} from its checkpoint at step {resumed:,} of {steps:,}")
    args.on_interrupt = (f"rerun the same command to resume {run} from its last checkpoint "
                         f"(saved every {train_config.checkpoint_every:,} steps and at the end)")
    dev = workdir.tokens("dev") if "dev" in workdir.meta["splits"] else None
    show = None if args.quiet else (lambda r: print(f"  step {r['step']:>6,}  dev_loss {r['dev_loss']:.4f}  "
                                                    f"train_loss {r['train_loss']:.4f}  {r['seconds']:.1f} s"))
    mesh = data_parallel_mesh(args.devices or None) if args.devices != 1 else None
    params, history = train(config, params, train_stream, train_config, run,
                            dev_stream=dev, on_eval=show, progress=not args.quiet, mesh=mesh)
    params.pop("folds", None)                  # cross-fitted: the folds' tables served training only
    if getattr(config, "guide_share", 0):      # self-guided: the dense guide is gone by the end
        from saffu.models.factorised import drop_output_guide
        from saffu.models.transformer import drop_guide
        config, params = (drop_guide if config.kind == "transformer" else drop_output_guide)(params, config)
    metrics = {"model": config.kind, "init": args.init, "params": parameter_count(params),
               "steps": history[-1]["step"] if history else (resumed or 0)}
    if config.kind == "residual":
        fixed = {name: params[name] for name in config.fixed_params if name in params}
        metrics.update(trained_params=metrics["params"] - parameter_count(fixed),
                       scale=float(params["scale"]) if "scale" in params else 0.0)    # annealed: λ ends at 0
    if solve_seconds:
        metrics["solve_seconds"] = solve_seconds
    if history:
        metrics.update({key: history[-1][key] for key in ("seconds", "tokens", "tokens_per_s", "flops",
                                                          "xla_flops", "peak_rss_mb") if key in history[-1]})
        metrics["train_seconds"] = metrics.pop("seconds")
    else:
        _say(args, f"{run} had already finished its {steps:,} steps; nothing to train "
                   f"(use a new --run, or more --steps, to train further)")
    metrics.update(_score_splits(params, config, workdir, args))
    _print_metrics(f"{args.init}-init training of {run}", metrics)
    return metrics


def _residual_model(args, workdir, run: Path, existing: bool):
    """``(ResidualConfig, params at step 0)`` of a new ``--residual`` run (``--cross-fit K``:
    with the exact model of every fold's complement, solved into ``RUN/folds``) or an
    existing one (its tables checked against its fingerprints)."""
    import jax

    from saffu.training.checkpoints import pack_run, save_run_config
    from saffu.training.recipes import residual_start, solve_folds
    key = jax.random.fold_in(jax.random.key(args.seed), 0)
    if existing:
        config = check_inputs(run, workdir, streams=True)
        if config.kind != "residual":
            raise SaffuError(f"{run} already holds a {config.kind} run; use a new --run for --residual")
        config, params = residual_start(config.base, config.explicit_run, key, config=config)
    else:
        explicit = check_inputs(args.residual, workdir)
        if explicit.kind != "exact":
            raise SaffuError(f"--residual {args.residual} holds a {explicit.kind}; it must be a `saffu exact` run")
        fold_runs = ()
        if args.cross_fit:
            _say(args, f"solving the exact model of each of {args.cross_fit} folds' complements into {run / 'folds'}")
            fold_runs, _, _ = solve_folds(workdir, explicit, args.cross_fit, run / "folds", progress=not args.quiet)
        config, params = residual_start(_model_config(args, workdir.vocab_size), args.residual, key,
                                        args.residual_scale, args.anneal_share, tuple(fold_runs))
    if config.base.kind in ("saffu", "factorised"):
        workdir.check_radius(config.base.radius)
    if not existing:
        run.mkdir(parents=True, exist_ok=True)
        save_run_config(run, config, workdir)
    if args.bundle:
        pack_run(run)
    return config, params


def _structured_from(args, workdir, config):
    """``--ffn-from RUN``: every weight of a trained dense transformer run, its MLP kernels
    turned into ``config``'s structure by SVD (and kept as the guide when self-guided)."""
    from saffu.models.transformer import structure_mlp
    from saffu.training.checkpoints import load_params
    if config.kind != "transformer" or config.ffn == "dense":
        raise SaffuError("--ffn-from needs a structured transformer: --model transformer --ffn lowrank|blockdense|"
                         "blockshuffle")
    source = check_inputs(args.ffn_from, workdir)
    if source.kind != "transformer":
        raise SaffuError(f"--ffn-from {args.ffn_from} holds a {source.kind}; it must be a dense transformer run")
    return structure_mlp(load_params(args.ffn_from, source)[0], source, config)


def _inherited(args, workdir, run: Path, existing: bool):
    """``(config, params)`` of ``--init inherit``: the first ``--inherit-layers`` blocks of
    ``--reference`` (a transformer: with its embeddings, positions, final norm and output layer;
    a SAFFU stack: its first blocks, each with its own output layer), or ``--start-from``'s
    weights grown block by block (``--grow-by reference``: the reference's next blocks;
    ``solve``: SAFFU blocks solved explicitly on top of the trained stack)."""
    from saffu.models import saffu as saffu_model
    from saffu.models import transformer
    from saffu.training.checkpoints import load_params, load_run_config, save_run_config
    if args.reference is None:
        raise SaffuError("--init inherit needs --reference RUN, a trained transformer or SAFFU run")
    reference = check_inputs(args.reference, workdir)
    if reference.kind not in ("transformer", "saffu"):
        raise SaffuError(f"--reference {args.reference} holds a {reference.kind}; Inheritune takes a transformer "
                         f"or a SAFFU stack")
    depth = "layers" if reference.kind == "transformer" else "blocks"
    inherit = transformer.inherit_layers if depth == "layers" else saffu_model.inherit_blocks
    if args.grow_by == "solve" and reference.kind != "saffu":
        raise SaffuError("--grow-by solve solves SAFFU blocks explicitly; a transformer grows by the reference's blocks")
    reference_params, _ = load_params(args.reference, reference)
    if args.start_from is None:
        layers = args.inherit_layers
        if layers is None and args.inherit_before_lazy:
            from saffu.eval.attention import inspect_attention, layers_before_lazy
            profile = inspect_attention(reference_params, reference, workdir.tokens("dev"), progress=not args.quiet)
            layers = layers_before_lazy(profile, getattr(reference, depth))
            _say(args, f"the reference's lazy layers: {profile['lazy_layers'] or 'none'}; inheriting {layers} blocks")
        config, params = inherit(reference_params, reference, layers or max(1, getattr(reference, depth) // 2))
    else:
        start = check_inputs(args.start_from, workdir)
        if start.kind != reference.kind:
            raise SaffuError(f"--start-from {args.start_from} holds a {start.kind}; it must be a {reference.kind} run "
                             f"like --reference")
        config, params = start, load_params(args.start_from, start)[0]
        target = args.inherit_layers or getattr(start, depth) + 1
        if target <= getattr(start, depth):
            raise SaffuError(f"--inherit-layers {target} must exceed --start-from's {getattr(start, depth)} blocks")
        if depth == "layers":
            while config.layers < target:
                config, params = transformer.grow_layer(params, config, reference_params, reference)
        elif dataclasses.replace(reference, blocks=start.blocks) != start:
            raise SaffuError("the stack to grow and the reference differ in more than their block count")
        elif args.grow_by == "solve":
            from saffu.solve.saffu import solve_explicit
            _say(args, f"solving blocks {start.blocks} … {target - 1} explicitly on top of {args.start_from}")
            params, _ = solve_explicit(workdir, dataclasses.replace(start, blocks=target), progress=not args.quiet,
                                       below=params)
            config = dataclasses.replace(start, blocks=target)
        else:
            if target > reference.blocks:
                raise SaffuError(f"the reference has {reference.blocks} blocks; cannot grow to {target} "
                                 f"(--grow-by solve can)")
            while config.blocks < target:
                config, params = saffu_model.grow_block(params, config, reference_params["blocks"][config.blocks])
    if existing:
        saved = load_run_config(run)
        if saved != config:
            raise SaffuError(f"{run} holds a different model than this inheritance gives; use a new --run")
    else:
        run.mkdir(parents=True, exist_ok=True)
        save_run_config(run, config, workdir)
    return config, params


def _explicit_transformer(args, workdir, run: Path, existing: bool):
    """``(TransformerConfig, params, solve seconds)``: random init with ``--explicit-pieces``
    from explicit factors of rank ``--width`` solved from ``--workdir``."""
    import jax

    from saffu.models.transformer import explicit_transformer_init
    from saffu.solve.factors import solve_factorised
    from saffu.training.checkpoints import save_run_config
    config = (check_inputs(run, workdir, streams=True) if existing
              else _model_config(args, workdir.vocab_size))
    tick = time.perf_counter()
    factors, _ = solve_factorised(workdir, configs.FactorisedConfig(workdir.vocab_size, rank=config.width, positions=1),
                                  configs.FactorConfig(holdout_tokens=args.holdout_tokens), progress=not args.quiet)
    params = explicit_transformer_init(config, jax.random.fold_in(jax.random.key(args.seed), 0), factors,
                                       tuple(args.explicit_pieces))
    if not existing:
        run.mkdir(parents=True, exist_ok=True)
        save_run_config(run, config, workdir)
    return config, params, time.perf_counter() - tick


def _load_run(args):
    """``(workdir, model config, params, which weights)`` of ``--workdir`` / ``--run`` / ``--checkpoint``."""
    from saffu.data.workdir import open_workdir
    from saffu.training.checkpoints import load_params
    workdir = open_workdir(args.workdir)
    config = check_inputs(args.run, workdir)
    params, which = load_params(args.run, config, args.checkpoint)
    return workdir, config, params, which


def cmd_pack(args) -> dict:
    """Make a run self-contained: a residual run's exact model copied into it."""
    from saffu.training.checkpoints import pack_run
    metrics = pack_run(args.run)
    _print_metrics(f"packed {args.run}: its exact model is now {args.run / 'exact'}", metrics)
    return metrics


def cmd_init_weights(args) -> dict:
    """The explicit pieces of rank ``--rank`` as a framework-free safetensors init file."""
    from saffu.data.workdir import open_workdir
    from saffu.interop.tokens import solve_pieces
    from saffu.interop.weights_file import write_init_file
    workdir = open_workdir(args.workdir)
    pieces = solve_pieces(workdir, args.rank, configs.FactorConfig(holdout_tokens=args.holdout_tokens),
                          progress=not args.quiet)
    manifest = write_init_file(pieces, args.out)
    metrics = {"out": str(args.out), "vocab_size": manifest["vocab_size"], "rank": manifest["rank"],
               "seconds": manifest["seconds"], "holdout_loss": manifest["holdout_loss"]}
    _print_metrics(f"wrote {args.out} and {args.out.with_suffix('.json')}", metrics)
    return metrics


def cmd_export(args) -> dict:
    """A trained transformer run as a Hugging Face GPT-2 checkpoint."""
    from saffu.interop.hf import export_gpt2, exportable
    from saffu.training.checkpoints import load_run_config
    exportable(load_run_config(args.run))
    _, config, params, which = _load_run(args)
    metrics = {**export_gpt2(params, config, Path(args.workdir) / "tokenizer.json", args.out), "weights": which}
    metrics["files"] = ",".join(metrics["files"])
    _print_metrics(f"exported {args.run} ({which} weights) to {args.out}", metrics)
    return metrics


def cmd_eval(args) -> dict:
    """Loss, perplexity and bits per byte of a run's latest (or explicit) weights."""
    workdir, config, params, which = _load_run(args)
    metrics = {"weights": which, **_score_splits(params, config, workdir, args, args.split)}
    _print_metrics(f"{args.run} ({which})", metrics)
    return metrics


def cmd_blimp(args) -> dict:
    """BLiMP accuracy of a run: overall, per field, per paradigm."""
    from saffu.eval.blimp import evaluate_blimp
    workdir, config, params, which = _load_run(args)
    metrics = {"weights": which, **evaluate_blimp(params, config, workdir.tokenizer(), args.blimp,
                                                   progress=not args.quiet)}
    _print_metrics(f"BLiMP of {args.run} ({which})", metrics)
    return metrics


def cmd_ngram(args) -> dict:
    """Interpolated modified Kneser-Ney from the engine's n-gram counts: dev figures, ARPA file,
    BLiMP."""
    from saffu.data.workdir import open_workdir
    from saffu.engine import accounting
    from saffu.eval import ngram
    from saffu.ngram import arpa, kneser_ney
    if not 1 <= args.order <= 9:
        raise SaffuError(f"--order must be between 1 and 9, got {args.order}")
    workdir = open_workdir(args.workdir)
    train_stream = workdir.tokens(workdir.train_split)
    start = time.perf_counter()
    model = kneser_ney.fit_kneser_ney(train_stream, args.order, vocab_size=workdir.vocab_size,
                                      progress=None if args.quiet else "count n-grams")
    fit_seconds = time.perf_counter() - start
    metrics = {"order": args.order, "fit_seconds": fit_seconds, "tokens_per_s": (len(train_stream) - 1) / fit_seconds,
               **kneser_ney.model_size(model),
               **ngram.score_splits(model, workdir, _eval_splits(workdir), progress=not args.quiet)}
    if args.arpa:
        tick = time.perf_counter()
        arpa.write_arpa(model, args.arpa)
        metrics.update(arpa=str(args.arpa), arpa_seconds=time.perf_counter() - tick)
    if args.blimp:
        metrics.update(ngram.evaluate_blimp(model, workdir.tokenizer(), args.blimp))
    metrics.update(accounting.memory_record())
    _print_metrics(f"Kneser-Ney {args.order}-gram on {workdir.meta['corpus']}", metrics)
    return metrics


def cmd_generate(args) -> dict:
    """Sample documents from a run."""
    import jax

    from saffu.eval.scoring import generate
    workdir, config, params, which = _load_run(args)
    texts = generate(params, config, workdir.tokenizer(), jax.random.key(args.seed), args.num_samples,
                     args.max_tokens, args.temperature, args.top_k)
    print(f"{len(texts)} samples from {args.run} ({which}):")
    for text in texts:
        print(f"  > {text}")
    return {"weights": which, "samples": len(texts), "mean_chars": sum(map(len, texts)) / max(len(texts), 1),
            **{f"sample_{i}": t for i, t in enumerate(texts)}}


def cmd_inspect(args) -> dict:
    """Attention diagnostics of a run: effective ranks, largest-column shares, lazy layers."""
    from saffu._io import atomic_write_json
    from saffu.eval.attention import flat_metrics, inspect_attention, plot_profiles, profile_table
    workdir, config, params, which = _load_run(args)
    profile = inspect_attention(params, config, workdir.tokens(args.split), args.windows, args.seq_len,
                                args.energy, args.lazy_rank, progress=not args.quiet)
    out = args.out if args.out is not None else args.run / "attention"
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out.with_suffix(".json"), out.with_suffix(".png")
    atomic_write_json(json_path, {"run": str(args.run), "weights": which, "split": args.split, **profile})
    plot_profiles({f"{args.run.name} ({which})": profile}, plot_path,
                  f"attention of {args.run.name}: {profile['windows']} {args.split} windows of "
                  f"{profile['window_tokens']} tokens")
    print(f"attention of {args.run} ({which}), {profile['windows']} {args.split} windows of "
          f"{profile['window_tokens']} tokens, effective rank at {args.energy:.0%} energy, lazy at rank "
          f"≤ {args.lazy_rank}:")
    print(profile_table(profile))
    print(f"(uniform attention would put {profile['first_key_share_if_uniform']:.3f} on the first visible key)")
    print(f"lazy layers: {profile['lazy_layers'] or 'none'}; written to {json_path} and {plot_path}")
    return {"weights": which, **flat_metrics(profile), "json": str(json_path), "plot": str(plot_path)}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (taken from the configs) after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is not None and default is not argparse.SUPPRESS and not isinstance(default, bool)
                and default != [] and action.option_strings and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


def _add_common(parser):
    parser.add_argument("--metrics-json", type=Path, help="write the figures as a flat JSON object here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or announcements")


def _add_process_flags(parser):
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes (hosts) in a multi-process job; each streams its own documents")
    parser.add_argument("--process-id", type=int, default=0, help="this process's index in [0, num-processes)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (jax.distributed)")


def _add_model_flags(parser, smoothing: configs.Smoothing, holdout_tokens: int, chunk_size: int, what: str):
    """Code and smoothing flags; the defaults are those of the config that ``what`` uses."""
    parser.add_argument("--bits", type=int, default=configs.CipherConfig.bits,
                        help="bit-cipher bits b (codes have b+1 dims)")
    parser.add_argument("--background", type=float, default=configs.CipherConfig.background,
                        help="background blend weight λ in [0,1)")
    parser.add_argument("--smoothing", choices=configs.SMOOTHING_KINDS, default=smoothing.kind,
                        help=f"smoothing of {what}")
    parser.add_argument("--mu", type=float, default=smoothing.mu, help=f"Dirichlet prior strength of {what}")
    parser.add_argument("--alpha", type=float, default=smoothing.alpha, help="additive / noise pseudo-count")
    parser.add_argument("--holdout-tokens", type=int, default=holdout_tokens,
                        help="training-stream tail held out of the counts to calibrate temperatures (0: all 1)")
    parser.add_argument("--chunk-size", type=int, default=chunk_size, help="targets per device per statistics step")


def _add_bigram_flags(parser):
    bigram = configs.BigramConfig
    _add_model_flags(parser, bigram.smoothing, bigram.holdout_tokens, bigram.chunk_size,
                     "the bigram layer's P(next | code)")


def _add_architecture_flags(parser):
    saffu = configs.SaffuConfig
    parser.add_argument("--radius", type=int, default=saffu.radius, help="context rows M per block")
    parser.add_argument("--heads", type=int, default=saffu.heads,
                        help="attention heads (head h attends over M >> h rows)")
    parser.add_argument("--positions", type=int, default=saffu.positions,
                        help="nearest rows with their own output group")
    parser.add_argument("--hidden", type=int, default=saffu.hidden,
                        help="0: direct output layer; D: softmax hidden chain")
    parser.add_argument("--value-form", choices=configs.VALUE_FORMS, default=saffu.value_form,
                        help="attended value: linear, or log-space (geometric mixture)")
    parser.add_argument("--blocks", type=int, default=saffu.blocks, help="stacked SAFFU blocks")
    parser.add_argument("--exact-positions", type=int, nargs="*", default=list(saffu.exact_positions),
                        help="position groups that read exact token identity (sparse exact tables) instead of "
                             "cipher codes, e.g. 0 (none: all cipher; direct output, one block; `saffu fit` only)")
    parser.add_argument("--chain-structure", choices=STRUCTURE_CHOICES, default=saffu.chain,
                        help="the chain's W_1 and W_2 (--hidden D): dense, or structured, set by SVD from the dense "
                             "layers (`saffu fit`: the explicit ones, a closed-form structured init)")
    parser.add_argument("--chain-share", type=float, default=saffu.chain_share,
                        help="a structured chain layer's weights as a share of the dense layer's")
    parser.add_argument("--chain-blocks", type=int, default=saffu.chain_blocks,
                        help="blocks of a blockdense / blockshuffle chain layer")


def _add_eval_flags(parser, default: int = EVAL_TOKENS):
    parser.add_argument("--eval-tokens", type=int, default=default,
                        help="score about this many tokens of each split: whole documents from evenly spaced "
                             "parts of it, with exact bits per byte (0: whole splits)")


def _add_run_flags(parser, explicit_help: str = "the latest training checkpoint, or the explicit solution "
                                                "when there is none"):
    parser.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    parser.add_argument("--run", type=Path, required=True, help="run directory (of `saffu fit` or `saffu train`)")
    parser.add_argument("--checkpoint", choices=["latest", "explicit"], default="latest",
                        help=f"latest: {explicit_help}; explicit: the explicit solution")


def build_parser() -> argparse.ArgumentParser:
    """The ``saffu`` parser; building it imports nothing heavy."""
    parser = argparse.ArgumentParser(prog="saffu", description="Explicit (closed-form) SAFFU language models.",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help, description, run_command):
        p = sub.add_parser(name, help=help, description=description, formatter_class=_HelpFormatter)
        p.set_defaults(run_command=run_command)
        return p

    train = configs.TrainConfig
    p = command("prepare", "corpus -> tokenizer + memory-mapped token streams",
                "Train a byte-level BPE on the training split, re-rank ids by frequency and write every "
                "split's token stream to the work directory.", cmd_prepare)
    p.add_argument("--corpus", type=Path, help="BabyLM-layout folder (train_10M/, dev/, ...)")
    p.add_argument("--train-files", nargs="+", help="plain-text training files instead of --corpus")
    p.add_argument("--dev-files", nargs="+", help="plain-text dev files (with --train-files)")
    p.add_argument("--workdir", type=Path, required=True, help="work directory to create")
    p.add_argument("--vocab-size", type=int, default=configs.PrepareConfig.vocab_size,
                   help="BPE vocabulary size, <pad> and <eod> included")
    p.add_argument("--train-split",
                   help="the split to train on: train_10M or train_100M of a BabyLM folder (default: train_10M; "
                        "with --train-files the split is called train)")
    p.add_argument("--allow-smaller-vocab", action="store_true",
                   help="accept fewer tokens than --vocab-size when the corpus supports no more merges")
    p.add_argument("--strict", action="store_true",
                   help=f"refuse a split that is mostly not text (more than "
                        f"{100 * configs.PrepareConfig.max_replaced_share:.0f}%% invalid UTF-8) instead of warning")
    p.add_argument("--corpus-name", help="label for reports (default: the folder name), "
                                         "e.g. babylm-2023-4src for ../shared/data/babylm/2023")
    _add_common(p)

    p = command("stats", "streaming statistics + explicit bigram or unigram + dev figures",
                "Stream the training split through the accumulators, solve the explicit model and score "
                "every other split.", cmd_stats)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--model", choices=["bigram", "unigram"], default="bigram")
    p.add_argument("--radius", type=int, default=1,
                   help="also compute and save offset statistics F_δ, δ < radius, to statistics.npz")
    p.add_argument("--save-statistics", action="store_true", help="save statistics.npz even for radius 1")
    _add_process_flags(p)
    _add_bigram_flags(p)
    _add_common(p)

    p = command("fit", "explicit SAFFU solution -> run directory (no backprop)",
                "Solve a SAFFU model stage by stage from streaming statistics, save it to --run and score "
                "every non-training split (about --eval-tokens tokens each).", cmd_fit)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--run", type=Path, required=True, help="run directory to create")
    _add_architecture_flags(p)
    solver = configs.SolverConfig
    _add_model_flags(p, solver.smoothing, solver.holdout_tokens, solver.chunk_size,
                     "every SAFFU stage's conditional distributions")
    _add_eval_flags(p)
    _add_common(p)

    factorised, factor = configs.FactorisedConfig, configs.FactorConfig
    p = command("factorise", "explicit low-rank factors -> factorised-model run directory (no backprop)",
                "Count the exact offset groups, factorise their stacked log-likelihood-ratio matrices with one "
                "matrix-free randomized SVD (per-offset embeddings E_p, one output factor B), refine them with "
                "a few likelihood steps against the offsets' smoothed conditionals, calibrate "
                "temperatures per offset and count bucket on held-out training documents, save to --run "
                "(`saffu train --init explicit --run R` warm-starts from it) and score every non-training "
                "split.", cmd_factorise)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--run", type=Path, required=True, help="run directory to create")
    p.add_argument("--rank", type=int, default=factorised.rank, help="embedding / output-factor width r")
    p.add_argument("--positions", type=int, default=factorised.positions,
                   help="nearest tokens with their own embedding table (offsets 0 … positions − 1)")
    p.add_argument("--radius", type=int, default=factorised.radius, help="tokens the attention heads read")
    p.add_argument("--heads", type=int, default=factorised.heads,
                   help="attention heads (zero in the explicit solution; training moves them)")
    _add_output_structure_flags(p)
    p.add_argument("--mu", type=float, default=factor.mu, help="Witten-Bell κ of the exact offset groups")
    p.add_argument("--column-power", type=float, default=factor.column_power,
                   help="targets weighted by p(y)^a in the SVD (rows by √count)")
    p.add_argument("--oversample", type=int, default=factor.oversample, help="extra directions of the randomized SVD")
    p.add_argument("--power-iterations", type=int, default=factor.power_iterations,
                   help="subspace iterations of the randomized SVD")
    p.add_argument("--seed", type=int, default=factor.seed, help="seed of the randomized SVD")
    p.add_argument("--refine-steps", type=int, default=factor.refine_steps,
                   help="Adam steps of the SVD's factors on the cross-entropy against the offsets' smoothed "
                        "conditionals (0: the SVD's factors)")
    p.add_argument("--refine-offsets", type=int, default=factor.refine_offsets,
                   help="the first offsets whose embeddings those steps move (B always moves)")
    p.add_argument("--refine-learning-rate", type=float, default=factor.refine_learning_rate,
                   help="Adam's rate of the refinement steps")
    p.add_argument("--buckets", type=int, nargs="*", default=list(factor.buckets),
                   help="context-count bucket edges of the temperatures (none: one per offset)")
    p.add_argument("--holdout-tokens", type=int, default=factor.holdout_tokens,
                   help="whole training documents kept out of the counts for the temperatures")
    p.add_argument("--chunk-size", type=int, default=factor.chunk_size, help="targets per counting step")
    _add_eval_flags(p)
    _add_common(p)

    exact = configs.ExactConfig
    p = command("exact", "explicit token-resolution model -> run directory (no backprop)",
                "Count exact-token context groups (offsets and conjunctions), solve their log-likelihood-"
                "ratio tables with temperatures per group and context-count bucket on held-out training "
                "documents, save to --run and score every non-training split.", cmd_exact)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--run", type=Path, required=True, help="run directory to create")
    p.add_argument("--groups", type=exact_groups, default=exact.groups,
                   help='context offsets per group, space-separated, e.g. "0 1 2 3 0,1 0,1,2" (0 = the '
                        'previous token; "0,1" = the previous two tokens together)')
    p.add_argument("--mu", type=float, default=exact.mu,
                   help="smoothing strength: κ of μ_c = κ · (distinct successors of c) for witten_bell, μ for dirichlet")
    p.add_argument("--buckets", type=int, nargs="*", default=list(exact.buckets),
                   help="context-count bucket edges; each group has a temperature per bucket (none: one)")
    p.add_argument("--bucket-by", type=int, default=exact.bucket_by,
                   help="index of the group whose context count sets every group's bucket (default: each its own)")
    p.add_argument("--smoothing", choices=["dirichlet", "witten_bell", "kneser_ney"], default=exact.smoothing,
                   help="one --mu per group (dirichlet); a context's strength --mu × its distinct successors "
                        "(witten_bell); or kneser_ney: modified Kneser-Ney discounts and continuation counts on the "
                        "nested chain, witten_bell elsewhere")
    p.add_argument("--no-nested", dest="nested", action="store_false",
                   help="smooth every group towards the unigram, not towards the group it extends")
    p.add_argument("--holdout-tokens", type=int, default=exact.holdout_tokens,
                   help="whole training documents kept out of the counts for the temperatures")
    p.add_argument("--chunk-size", type=int, default=exact.chunk_size, help="targets per counting step")
    _add_process_flags(p)
    _add_eval_flags(p)
    _add_common(p)

    p = command("train", "backprop with optax from explicit (warm) or random (cold) init",
                "Train a SAFFU model (or the transformer baseline); a rerun resumes from --run's last "
                "checkpoint. Ends with an evaluation of about --eval-tokens tokens per split.", cmd_train)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--run", type=Path, required=True, help="run directory (of `saffu fit` for --init explicit)")
    p.add_argument("--init", choices=["explicit", "random", "inherit"], required=True,
                   help="explicit: warm start from --run's explicit solution (a transformer: from explicit "
                        "low-rank factors solved here, see --explicit-pieces); random: cold start; inherit: "
                        "a transformer or SAFFU stack from the first blocks of --reference (Inheritune)")
    p.add_argument("--model", choices=["saffu", "transformer", "factorised"], default="saffu",
                   help="architecture of a new run (an existing run keeps its own)")
    p.add_argument("--explicit-pieces", nargs="+", default=list(configs.EXPLICIT_PIECES), choices=configs.EXPLICIT_PIECES,
                   help="transformer --init explicit: output bias = log unigram, token embeddings and output "
                        "kernel from the explicit factors (rank = --width), rescaled to the random init's scale")
    p.add_argument("--holdout-tokens", type=int, default=configs.FactorConfig.holdout_tokens,
                   help="transformer --init explicit: training tokens held out to calibrate the factors")
    p.add_argument("--residual", type=Path, metavar="EXACT_RUN",
                   help="learn a residual over the exact model of this run (`saffu exact`): logits = "
                        "λ · log P_exact + f(context), f's output layer at zero, so step 0 is the exact model")
    p.add_argument("--residual-scale", choices=configs.RESIDUAL_SCALES, default=configs.ResidualConfig.scale,
                   help="λ fixed at 1, learned, or annealed from 1 to 0 over --anneal-share of the steps, "
                        "after which the explicit part is dropped (with --residual)")
    p.add_argument("--anneal-share", type=float, default=configs.ResidualConfig.anneal_share,
                   help="--residual-scale annealed: share of the training steps over which λ falls to 0")
    p.add_argument("--cross-fit", type=int, default=0, metavar="K",
                   help="with --residual: cross-fit over K ≥ 2 folds of whole documents: each training step's windows "
                        "come from one fold and its explicit part is the exact model solved without that fold (solved "
                        "into RUN/folds); evaluation uses the exact model of the whole split (0: off)")
    p.add_argument("--bundle", action="store_true",
                   help="with --residual: copy the exact model into the run (RUN/exact), so it survives moving "
                        "and re-solving the exact run (`saffu pack` does it later)")
    p.add_argument("--reference", type=Path, metavar="RUN",
                   help="--init inherit: a trained transformer run whose token embeddings, positions, first "
                        "--inherit-layers blocks, final norm and output layer start the new run; or a SAFFU "
                        "stack run, whose first blocks (each with its own output layer) start it")
    p.add_argument("--inherit-layers", type=int,
                   help="--init inherit: blocks to take (default: half the reference's, at least 1)")
    p.add_argument("--inherit-before-lazy", action="store_true",
                   help="--init inherit without --inherit-layers: take the blocks before the reference's first lazy "
                        "layer (`saffu inspect`'s profile on 64 dev windows; half when none is lazy)")
    p.add_argument("--start-from", type=Path, metavar="RUN",
                   help="--init inherit: grow this trained run (fewer blocks, same width) instead: all of its "
                        "weights, then new blocks up to --inherit-layers (default: one more), see --grow-by")
    p.add_argument("--grow-by", choices=["reference", "solve"], default="reference",
                   help="--start-from: the new blocks are the reference's next blocks, or (SAFFU) blocks solved "
                        "explicitly on top of the trained stack, which may grow past the reference's depth")
    p.add_argument("--rank", type=int, default=configs.FactorisedConfig.rank,
                   help="embedding / output-factor width r of a factorised model")
    _add_output_structure_flags(p)
    _add_architecture_flags(p)
    tf = configs.TransformerConfig
    t = p.add_argument_group("transformer (with --model transformer)")
    t.add_argument("--width", type=int, default=tf.width, help="model width d")
    t.add_argument("--layers", type=int, default=tf.layers, help="transformer blocks")
    t.add_argument("--attention-heads", type=int, default=tf.heads, help="attention heads per block")
    t.add_argument("--mlp-ratio", type=int, default=tf.mlp_ratio, help="MLP hidden width = ratio · d")
    t.add_argument("--context", type=int, default=tf.context_tokens,
                   help="left-context tokens before each window's targets")
    t.add_argument("--max-len", type=int, default=tf.max_len, help="longest window (learned positions)")
    t.add_argument("--no-output-bias", action="store_true",
                   help="an output layer without a bias: the layout `saffu export` writes as a GPT-2 checkpoint")
    t.add_argument("--ffn", choices=STRUCTURE_CHOICES, default=tf.ffn,
                   help="the MLP's two layers: dense, or structured (U(Vx), U(Bx) with block-diagonal B, or "
                        "block-diagonal / shuffle / block-diagonal), set from the SVD of a random dense layer")
    t.add_argument("--ffn-share", type=float, default=tf.ffn_share,
                   help="a structured MLP layer's weights as a share of the dense layer's")
    t.add_argument("--ffn-blocks", type=int, default=tf.ffn_blocks, help="blocks of blockdense / blockshuffle")
    t.add_argument("--ffn-from", type=Path, metavar="RUN",
                   help="start the structured transformer from this trained dense transformer run: all of its "
                        "weights, the MLP kernels as their SVD (trained-SVD init; the guide when self-guided)")
    t.add_argument("--self-guided", type=float, default=tf.guide_share, metavar="SHARE",
                   help="self-guided training of a structured MLP: a dense guide's weight falls from 1 to 0 on "
                        "a cosine over this share of the steps, then the dense path is dropped (0: none)")
    p.add_argument("--bits", type=int, default=configs.SaffuConfig.bits, help="bit-cipher bits of a SAFFU model")
    p.add_argument("--steps", type=int, default=train.steps, help="optimizer steps (0: one epoch)")
    p.add_argument("--batch-size", type=int, default=train.batch_size, help="windows per step")
    p.add_argument("--seq-len", type=int, default=train.seq_len, help="targets per window")
    p.add_argument("--learning-rate", type=float, default=train.learning_rate, help="peak of warm-up + cosine")
    p.add_argument("--warmup-steps", type=int, default=train.warmup_steps, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=train.weight_decay, help="AdamW decoupled weight decay")
    p.add_argument("--adam-eps", type=float, default=train.adam_eps, help="Adam's epsilon")
    p.add_argument("--eval-every", type=int, default=train.eval_every,
                   help="steps between dev evaluations on evenly spaced dev windows")
    p.add_argument("--checkpoint-every", type=int, default=train.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=train.seed, help="seed of the data order and the random init")
    p.add_argument("--freeze", nargs="*", default=[], help="parameter names frozen until --thaw-step")
    p.add_argument("--thaw-step", type=int, default=train.thaw_step, help="step at which frozen parameters train")
    p.add_argument("--devices", type=int, default=1,
                   help="data-parallel over this many local devices (0: all); the batch is split over them")
    p.add_argument("--on-nonfinite", choices=["stop", "skip"], default=train.on_nonfinite,
                   help="a step with a non-finite loss is never applied: stop with an error, or skip it")
    p.add_argument("--log-every", type=int, default=train.log_every,
                   help="steps between host reads of the training loss (the device runs ahead in between)")
    p.add_argument("--compute-dtype", choices=configs.COMPUTE_DTYPES, default=train.compute_dtype,
                   help="dtype of the forward and backward passes (weights and optimizer stay float32)")
    _add_eval_flags(p)
    _add_common(p)

    p = command("eval", "loss, perplexity, bits per byte of a run",
                "Score a run's weights on every non-training split (or --split): loss in nats/token, "
                "perplexity, bits per byte and per-word perplexity.", cmd_eval)
    _add_run_flags(p)
    p.add_argument("--split", nargs="*", help="splits to score (default: all but training)")
    _add_eval_flags(p)
    _add_common(p)

    p = command("pack", "make a run self-contained (a residual's exact model copied in)",
                "Copy the exact model a residual run was trained over into the run (RUN/exact; its content "
                "fingerprint checked first) and point the run at the copy, so the run survives moving it "
                "and re-solving or deleting the exact run.", cmd_pack)
    p.add_argument("--run", type=Path, required=True, help="a residual run directory (of `saffu train --residual`)")
    _add_common(p)

    p = command("init-weights", "the explicit pieces as a framework-free safetensors init file",
                "Solve the explicit pieces of rank --rank from the work directory's training split and write "
                "them (log-unigram bias, embeddings, output kernel, their RMS, the unigram counts) to a "
                "safetensors file with a JSON manifest beside it, for any framework to load.", cmd_init_weights)
    p.add_argument("--workdir", type=Path, required=True, help="prepared work directory")
    p.add_argument("--rank", type=int, required=True, help="width d of the model the pieces initialise")
    p.add_argument("--out", type=Path, required=True, help="the init file (NAME.safetensors; NAME.json beside it)")
    p.add_argument("--holdout-tokens", type=int, default=configs.FactorConfig.holdout_tokens,
                   help="training tokens held out to calibrate the factors")
    _add_common(p)

    p = command("export", "a trained transformer run as a Hugging Face GPT-2 checkpoint",
                "Write a transformer run (trained with --no-output-bias) as config.json, model.safetensors and "
                "the tokenizer files of a GPT-2 checkpoint that transformers loads.", cmd_export)
    _add_run_flags(p)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    _add_common(p)

    p = command("blimp", "BLiMP minimal-pair accuracy of a run",
                "Score every BLiMP pair (good sentence above bad, ties wrong) with a run's weights: "
                "accuracy overall, per field and per paradigm.", cmd_blimp)
    _add_run_flags(p)
    p.add_argument("--blimp", type=Path, required=True, help="folder of BLiMP paradigm *.jsonl files")
    _add_common(p)

    p = command("ngram", "Kneser-Ney n-gram baseline from the engine's counts (+ ARPA, BLiMP)",
                "Count n-grams of the training split (documents never crossed), estimate interpolated "
                "modified Kneser-Ney, score every other split, optionally write the ARPA file (kenlm "
                "loads it) and score BLiMP.", cmd_ngram)
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--order", type=int, default=5, help="n-gram order, 1 to 9")
    p.add_argument("--arpa", type=Path, help="write the model as an ARPA file here")
    p.add_argument("--blimp", type=Path, help="folder of BLiMP paradigm *.jsonl files")
    _add_common(p)

    p = command("generate", "sample documents from a run",
                "Sample documents from a run's weights, each from a document start to its <eod> or "
                "--max-tokens.", cmd_generate)
    _add_run_flags(p)
    p.add_argument("--num-samples", type=int, default=3, help="documents to sample")
    p.add_argument("--max-tokens", type=int, default=60, help="longest sample")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    _add_common(p)

    p = command("inspect", "attention diagnostics of a run: effective ranks, lazy layers",
                "Average every layer's and head's post-softmax attention over evenly spaced windows of a "
                "split, then report its effective rank (the smallest r whose top-r singular values hold "
                "--energy of the squared total), its largest column's share of the mass, each layer's "
                "maximum rank over heads and whether the layer is lazy (maximum rank ≤ --lazy-rank). "
                "Writes JSON and a per-layer plot.", cmd_inspect)
    _add_run_flags(p)
    p.add_argument("--split", default="dev", help="split whose windows are averaged")
    p.add_argument("--windows", type=int, default=64, help="evenly spaced windows to average over")
    p.add_argument("--seq-len", type=int, help="targets per window (default: the model's evaluation length)")
    p.add_argument("--energy", type=float, default=0.9, help="energy threshold of the effective rank, in (0, 1]")
    p.add_argument("--lazy-rank", type=int, default=1, help="a layer is lazy when no head's rank exceeds this")
    p.add_argument("--out", type=Path, help="path stem of the JSON and PNG (default: RUN/attention)")
    _add_common(p)

    p = command("download", "download the official BabyLM release (needs internet)",
                "Fetch the BabyLM release zip and lay it out as <dest>/train_10M, dev, test, train_100M.",
                cmd_download)
    p.add_argument("--dest", type=Path, required=True, help="new folder for the corpus")
    p.add_argument("--url", default=configs.BABYLM_2023_URL, help="release archive (any URL, file:// included)")
    p.add_argument("--sha256", help="expected checksum of the archive")
    _add_common(p)

    p = command("demo", "the main job on the embedded corpus: explicit init, warm start, evaluation",
                "Prepare the embedded corpus, solve the explicit bigram and an explicit SAFFU model, run a "
                "short AdamW warm start from it and score dev after each stage. A rerun starts afresh.",
                cmd_demo)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="BabyLM-layout folder")
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="folder for everything the demo writes")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size")
    p.add_argument("--radius", type=int, default=configs.SaffuConfig.radius, help="SAFFU context rows")
    p.add_argument("--saffu-mu", type=float, default=configs.SolverConfig.smoothing.mu,
                   help="Dirichlet strength of the SAFFU solver")
    p.add_argument("--steps", type=int, default=40, help="AdamW warm-start steps")
    p.add_argument("--learning-rate", type=float, default=train.learning_rate, help="peak learning rate")
    _add_bigram_flags(p)
    p.set_defaults(bits=64)   # half the solve and training time of 128 bits on the small demo corpus
    _add_common(p)
    return parser


def _one_line_warnings(show):
    """``warnings.showwarning`` that prints a :class:`SaffuWarning` as one ``saffu: warning:`` line."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SaffuWarning):
            print(f"saffu: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


#: What each writing command writes into: ``(flag, attribute, a directory?)``; the command
#: holds that directory's write lock (an ARPA file: its folder's) for the whole run.
OUTPUTS = {"prepare": ("--workdir", "workdir", True), "stats": ("--workdir", "workdir", True),
           "fit": ("--run", "run", True), "exact": ("--run", "run", True), "factorise": ("--run", "run", True),
           "train": ("--run", "run", True), "pack": ("--run", "run", True), "demo": ("--workdir", "workdir", True),
           "ngram": ("--arpa", "arpa", False), "init-weights": ("--out", "out", False),
           "export": ("--out", "out", True)}


def _lock(args) -> contextlib.AbstractContextManager:
    """The write lock of the command's output directory (none for readers, and for the
    processes of a multi-process job other than process 0, which alone writes)."""
    if args.command not in OUTPUTS or getattr(args, "process_id", 0) != 0:
        return contextlib.nullcontext()
    flag, name, directory = OUTPUTS[args.command]
    path = getattr(args, name)
    if path is None:
        return contextlib.nullcontext()
    _check_writable(path, flag, directory)
    return exclusive(path if directory else Path(path).parent)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = _one_line_warnings(warnings.showwarning)
    try:
        _check_writable(args.metrics_json, "--metrics-json")
        with _lock(args):
            metrics = args.run_command(args)
        write_metrics(args.metrics_json, metrics)
    except SaffuError as err:
        print(f"saffu: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:
        print(f"saffu: numerical error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        hint = getattr(args, "on_interrupt", None)
        print(f"saffu: interrupted{'; ' + hint if hint else ''}", file=sys.stderr)
        return 130
    except Exception as err:       # a full disk anywhere else (OSError, or a library's error wrapping it)
        if not is_disk_full(err):
            raise
        where = getattr(err, "filename", None) or "a file"
        print(f"saffu: error: cannot write {where}: the disk is full; free space and rerun the same command",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
