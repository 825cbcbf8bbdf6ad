"""The ``saffu`` command line: thin wrappers that parse flags into configs and call the library.

Every command prints a human summary, accepts ``--metrics-json PATH`` for a flat JSON object
of its figures (checked before any work starts), and reports bad input as one
``saffu: error: …`` line (exit status 2). Each command's flags and help are
:mod:`saffu.flags` (the flags of config fields generated from the config dataclasses of
:mod:`saffu.configs`: defaults and help come from there); what a command runs is a library
function (the recipes are :mod:`saffu.training.recipes`). Nothing heavy is imported before a
command runs, so ``saffu --help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

from saffu import configs, flags
from saffu._io import SaffuError, SaffuWarning, exclusive, is_disk_full, probe_writable, write_metrics
from saffu.flags import DEFAULT_CORPUS, config_from_args

SHARED_CORPUS = Path("../shared/data/babylm/2023")


def human(value) -> str:
    """A figure as a person reads it: ``1,428,424``, ``5.3400``, ``4.48e+11``, ``9,123.4``."""
    if hasattr(value, "item") and not isinstance(value, (bool, str)):    # numpy / jax scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3e}" if abs(value) >= 1e6 else f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4f}"


def _print_metrics(title: str, metrics: dict) -> dict:
    """The summary: a title, then ``key  value`` rows with the keys in one aligned column."""
    print(title)
    width = min(max((len(key) for key in metrics), default=0), 48)
    for key, value in metrics.items():
        print(f"  {key:<{width}}  {human(value)}")
    return metrics


def _say(args, message: str) -> None:
    """A progress announcement (silenced by ``--quiet``)."""
    if not getattr(args, "quiet", False):
        print(message, flush=True)


def _retry_save(error: SaffuError, run: Path) -> Path | None:
    """After a failed save of a finished solve: at a terminal, say so and ask where to save
    (Enter: the same ``run`` again; a path: another directory; ``q``: give up); elsewhere give up."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return None
    print(f"saffu: {error}", file=sys.stderr)
    answer = input("The solution is kept in memory. Free space and press Enter to save to the same --run, "
                   "type another directory, or q to give up: ").strip()
    return None if answer.lower() in ("q", "quit") else Path(answer) if answer else run


def _solve(args, workdir, config, solver, title: str, writer: bool = True) -> dict:
    """Solve ``config`` into ``--run`` (:func:`saffu.training.recipes.solve_run`; a full disk at a
    terminal asks where to save), score it and print the summary."""
    from saffu.models.interface import parameter_count
    from saffu.training.recipes import solve_run
    params, report, saved = solve_run(workdir, args.run, config, solver, writer, _retry_save, not args.quiet)
    if Path(saved) != Path(args.run):
        _say(args, f"saved to {saved} instead of {args.run}")
        args.run = Path(saved)
    size = {} if isinstance(config, configs.ExactConfig) else {"params": parameter_count(params)}
    metrics = {**report, **size, **_score_splits(params, config, workdir, args)}
    return _print_metrics(f"{title} on {workdir.meta['corpus']} -> {args.run}", metrics)


def _workdir(args):
    from saffu.data.workdir import open_workdir
    return open_workdir(args.workdir)


def _load_run(args):
    """``(workdir, model config, params, which weights)`` of ``--workdir`` / ``--run`` and
    ``--checkpoint`` / ``--step`` / ``--words``."""
    from saffu.training.checkpoints import check_inputs, load_weights
    workdir = _workdir(args)
    config = check_inputs(args.run, workdir)
    return (workdir, config, *load_weights(args.run, config, args.checkpoint, args.step, args.words))


#: The processes this one started for a local multi-process job (:func:`_join_processes`).
_FOLLOWERS: list = []


def _join_processes(args) -> bool:
    """Join the multi-process job of ``--num-processes`` (before any JAX work); returns whether
    this process writes the outputs (process 0; the others drop ``--metrics-json``). Without
    ``--coordinator``, process 0 starts the others on this machine, one per core
    (:func:`saffu.engine.distributed.spawn_local`); :func:`main` waits for them."""
    if args.num_processes <= 1:
        return True
    from saffu.engine import distributed
    if not args.coordinator:
        if args.process_id != 0:
            raise SaffuError("--process-id needs --coordinator HOST:PORT (process 0's address)")
        args.coordinator, started = distributed.spawn_local(sys.argv[1:] if args.argv is None else args.argv,
                                                            args.num_processes)
        _FOLLOWERS.extend(started)
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.process_id != 0:
        args.metrics_json = None
    return args.process_id == 0


def _score_splits(params, config, workdir, args, splits=None) -> dict:
    """:func:`saffu.eval.scoring.score_splits` of every non-training split (or ``splits``), ``--eval-tokens`` each."""
    from saffu.eval.scoring import score_splits
    return score_splits(params, config, workdir, splits, args.eval_tokens, not args.quiet, lambda m: _say(args, m))


def cmd_prepare(args) -> dict:
    from saffu.data.corpus import babylm_corpus, text_files_corpus
    from saffu.data.workdir import prepare
    if args.dev_files and not args.train_files:
        raise SaffuError("--dev-files goes with --train-files; with --corpus the dev split comes from its dev/ folder")
    if args.train_files:
        corpus = text_files_corpus({args.train_split or "train": args.train_files,
                                    **({"dev": args.dev_files} if args.dev_files else {})},
                                   name=args.corpus_name or "text-files")
    elif args.corpus is None:
        raise SaffuError("give --corpus DIR (BabyLM layout) or --train-files FILE ...")
    else:
        corpus = babylm_corpus(args.corpus, name=args.corpus_name)
    args.train_split = args.train_split or ("train" if args.train_files else configs.PrepareConfig.train_split)
    config = config_from_args(configs.PrepareConfig, args, (*flags.PREPARE, "train_split"))
    workdir = prepare(corpus, args.workdir, config, show_progress=not args.quiet)
    metrics = {"vocab_size": workdir.vocab_size, "seconds": workdir.meta["seconds"], **{
        f"{split}_{key}": value for split, info in workdir.meta["splits"].items() for key, value in info.items()}}
    _print_metrics(f"prepared {corpus.name} -> {workdir.path}", metrics)
    if workdir.vocab_size < args.vocab_size:
        print(f"  note: the corpus supports only {workdir.vocab_size:,} BPE tokens "
              f"(--vocab-size {args.vocab_size:,} was asked for)")
    for split, info in workdir.meta["splits"].items():
        if info["replaced_bytes"]:
            print(f"  note: {split} had {info['replaced_bytes']:,} invalid UTF-8 sequences, read as U+FFFD")
    return metrics


def cmd_stats(args) -> dict:
    from saffu.eval.metrics import split_metrics
    from saffu.solve.bigram import save_offset_statistics
    from saffu.training.recipes import count_model
    writer = _join_processes(args)
    workdir, config = _workdir(args), flags.bigram_from_args(args)
    nlls, report = count_model(workdir, args.model, config, workdir.eval_splits, progress=not args.quiet)
    metrics = {"model": args.model, "vocab_size": workdir.vocab_size, **{k: v for k, v in report.items() if k != "seconds"}}
    for split, nll in nlls.items():
        metrics.update(split_metrics(nll, workdir.split_info(split), prefix=f"{split}_"))
    metrics["seconds"] = report["seconds"]
    if args.radius > 1 or args.save_statistics:
        path = Path(args.workdir) / "statistics.npz" if writer else None
        metrics.update(save_offset_statistics(workdir, path, config.cipher.bits, args.radius, config.chunk_size,
                                              progress=not args.quiet))
    return _print_metrics(f"explicit {args.model} model on {workdir.meta['corpus']}", metrics)


def cmd_download(args) -> dict:
    from saffu.data.download import download_babylm
    start = time.perf_counter()
    dest = download_babylm(args.dest, args.url, args.sha256, progress=not args.quiet)
    return _print_metrics(f"downloaded {args.url}", {"dest": str(dest), "seconds": time.perf_counter() - start,
                                                     "splits": ",".join(sorted(p.name for p in dest.iterdir()))})


def cmd_demo(args) -> dict:
    from saffu.runner import demo
    config = config_from_args(configs.DemoConfig, args, ("vocab_size", "bits", "steps"))
    metrics, run, workdir = demo(args.corpus, args.workdir, flags.bigram_from_args(args), config, args.radius, args.saffu_mu,
                                 args.learning_rate, "saffu-default" if args.corpus == DEFAULT_CORPUS else None,
                                 not args.quiet, lambda m: _say(args, m))
    _print_metrics(f"saffu demo on {workdir.meta['corpus']}: explicit bigram, explicit SAFFU (radius {args.radius}), "
                   f"then {config.steps} AdamW steps from it", metrics)
    print(f"\nrun directory: {run}  (try: saffu generate --workdir {workdir.path} --run {run})")
    if SHARED_CORPUS.is_dir() and args.corpus == DEFAULT_CORPUS:
        print(f"The BabyLM corpus is at {SHARED_CORPUS}; run the same on it with\n"
              f"  saffu demo --corpus {SHARED_CORPUS} --workdir runs/babylm-demo --vocab-size 8192")
    return metrics


def cmd_fit(args) -> dict:
    workdir = _workdir(args)
    solver = configs.SolverConfig(smoothing=flags.smoothing_from_args(args), holdout_tokens=args.holdout_tokens,
                                  chunk_size=args.chunk_size)
    return _solve(args, workdir, flags.model_from_args("saffu", args, workdir.vocab_size), solver, "explicit SAFFU")


def cmd_exact(args) -> dict:
    writer = _join_processes(args)
    workdir = _workdir(args)
    config = config_from_args(configs.ExactConfig, args, flags.EXACT, vocab_size=workdir.vocab_size)
    _say(args, f"solving {len(config.groups)} exact groups {' '.join(','.join(map(str, g)) for g in config.groups)} "
               f"with {config.num_buckets} count buckets each")
    return _solve(args, workdir, config, None, "explicit token-resolution model", writer)


def cmd_factorise(args) -> dict:
    workdir = _workdir(args)
    config = flags.model_from_args("factorised", args, workdir.vocab_size)
    _say(args, f"factorising {config.positions} exact offset groups at rank {config.rank}")
    return _solve(args, workdir, config, config_from_args(configs.FactorConfig, args, flags.FACTOR),
                  "explicit factorised model")


def cmd_train(args) -> dict:
    import jax

    from saffu.training import recipes
    from saffu.training.checkpoints import latest_checkpoint_step, load_run_config
    from saffu.training.trainer import data_parallel_mesh, run_steps
    run = Path(args.run)
    start = config_from_args(configs.StartConfig, args, (*flags.START, "ffn_from"))
    if args.num_processes > 1 and (start.residual is not None or start.init == "inherit" or start.ffn_from
                                   or ((run / "config.json").exists() and
                                   isinstance(load_run_config(run), configs.ResidualConfig))):
        raise SaffuError("--num-processes trains random and explicit starts; train a residual or inherited start "
                         "in one process (--devices for several devices of one process)")
    writer = _join_processes(args)
    workdir = _workdir(args)
    if (start.init == "inherit" and start.inherit_before_lazy and start.inherit_layers is None
            and start.reference is not None and start.start_from is None):
        from saffu.eval.attention import run_layers_before_lazy
        start = dataclasses.replace(start, inherit_layers=run_layers_before_lazy(
            args.reference, workdir, not args.quiet, lambda m: _say(args, m)))
    config, params, solve_seconds = recipes.start_training(
        workdir, run, start, jax.random.fold_in(jax.random.key(args.seed), 0),
        lambda: flags.model_from_args(args.model, args, workdir.vocab_size),
        {"scale": args.residual_scale, "anneal_share": args.anneal_share, "folds": args.cross_fit},
        configs.FactorConfig(holdout_tokens=args.holdout_tokens), not args.quiet, lambda message: _say(args, message))
    train_config = config_from_args(configs.TrainConfig, args, flags.TRAIN)
    steps, resumed = run_steps(workdir.tokens(workdir.train_split), train_config), latest_checkpoint_step(run)
    if resumed is not None:
        _say(args, f"resuming {run} from its checkpoint at step {resumed:,} of {steps:,}")
    args.on_interrupt = (f"rerun the same command to resume {run} from its last checkpoint "
                         f"(saved every {train_config.checkpoint_every:,} steps and at the end)")
    show = None if args.quiet else (lambda r: print(f"  step {r['step']:>6,}  dev_loss {r['dev_loss']:.4f}  "
                                                    f"train_loss {r['train_loss']:.4f}  {r['seconds']:.1f} s"))
    mesh = (data_parallel_mesh() if args.num_processes > 1 else
            data_parallel_mesh(args.devices or None) if args.devices != 1 else None)
    explicit_pass = start.init == "explicit" or start.residual is not None
    options = {name: getattr(args, name) for name in flags.TRAIN_OPTIONS}
    model = config.base if isinstance(config, configs.ResidualConfig) else config    # a residual: what it trains
    # the spec as train.json holds it
    spec = json.loads(json.dumps(flags.train_spec(start, model, train_config, options), default=str))
    _same_training(run, spec)
    if writer:          # the run's spec: how it was trained (saffu train --config reads it back)
        import shlex

        from saffu._io import atomic_write_json
        command = "saffu " + shlex.join(sys.argv[1:] if args.argv is None else args.argv)
        atomic_write_json(run / "train.json", {"command": command, **spec})
    config, params, figures = recipes.train_run(workdir, run, config, params, train_config, mesh, show, not args.quiet,
                                                explicit_pass)
    if args.num_processes > 1:        # every process is done with collectives
        from saffu.engine.distributed import leave
        leave()
    if not writer:            # process 0 scores and reports on its own
        return {}
    if "train_seconds" not in figures:
        _say(args, f"{run} had already finished its {steps:,} steps; nothing to train "
                   f"(use a new --run, or more --steps, to train further)")
    metrics = {"model": config.kind, "init": args.init, **figures, **({"solve_seconds": solve_seconds} if solve_seconds
                                                                      else {})}
    metrics.update(_score_splits(params, config, workdir, args))
    return _print_metrics(f"{args.init}-init training of {run}", metrics)


def _same_training(run: Path, spec: dict) -> None:
    """Refuse to resume ``run`` with settings (``spec``, JSON values as ``train.json`` holds them)
    that change what it learns (anything but
    :data:`saffu.flags.RESUMABLE`): one line naming each differing field, its recorded value and the fix."""
    path = run / "train.json"
    if not path.is_file() or not (run / "checkpoints").is_dir():
        return
    recorded = json.loads(path.read_text())
    # a start option left at its default is the run's own (a residual resumes without restating --residual)
    defaults = vars(build_parser().parse_args(["train", "--workdir", "w", "--run", "r", "--init", "random"]))
    unstated = lambda section, name, value: section in ("start", "options") and value == json.loads(
        json.dumps(defaults.get(name), default=str))
    differ = [f"{section}.{name} {recorded[section][name]!r} → {value!r}"
              for section in ("start", "model", "train", "options") if section in recorded
              for name, value in spec.get(section, {}).items()
              if name not in flags.RESUMABLE and name in recorded[section] and recorded[section][name] != value
              and not unstated(section, name, value)]
    if differ:
        raise SaffuError(f"{run} was trained with other settings ({'; '.join(differ)}); resume it as it was "
                         f"(saffu train --config {path} --run {run}) or train into a new --run")


def cmd_pack(args) -> dict:
    from saffu.training.checkpoints import pack_run
    return _print_metrics(f"packed {args.run}: its exact model is now {args.run / 'exact'}", pack_run(args.run))


def _hf_init(args) -> dict:
    """``init-weights --hf-config``: a GPT-2 or Llama checkpoint with the explicit embeddings and
    output kernel (or, with ``--random``, none), the rest random."""
    import jax

    from saffu.interop.hf import export_hf
    from saffu.models.interface import model_init
    from saffu.training.recipes import explicit_start
    workdir = _workdir(args)
    block = {"gpt2": "gpt", "llama": "llama"}[args.hf_config]
    # one token of context: Hugging Face trains and reads from position 0
    config = configs.TransformerConfig(workdir.vocab_size, width=args.rank, layers=args.layers,
                                       heads=args.attention_heads, context_tokens=1, max_len=args.max_len,
                                       output_bias=False, block=block)
    key = jax.random.key(args.seed)
    if args.random:
        params, start = model_init(config, key), "random init (the control)"
    else:
        pieces = configs.StartConfig(init="explicit", model="transformer", explicit_pieces=("embeddings", "output"))
        params, _, _ = explicit_start(workdir, config, key, pieces, configs.FactorConfig(holdout_tokens=args.holdout_tokens),
                                      not args.quiet)
        start = "explicit embeddings and output kernel, the rest random"
    card = (f"# An initial {args.hf_config} checkpoint from saffu\n\n{start} (seed {args.seed}), width {args.rank}, "
            f"{args.layers} layers, {args.attention_heads} heads, for {workdir.meta['corpus']} "
            f"({workdir.vocab_size:,} BPE tokens). Untrained: train it with any framework. Neither architecture "
            f"has an output bias, so the explicit log-unigram is not in it.\n")
    report = export_hf(params, config, Path(args.workdir) / "tokenizer.json", args.out, card)
    metrics = {"out": str(args.out), "architecture": report["architecture"], "parameters": report["parameters"],
               "start": "random" if args.random else "explicit"}
    return _print_metrics(f"wrote {args.out}", metrics)


def cmd_init_weights(args) -> dict:
    if args.hf_config:
        return _hf_init(args)
    from saffu.interop.tokens import solve_pieces
    from saffu.interop.weights_file import write_init_file
    pieces = solve_pieces(_workdir(args), args.rank, configs.FactorConfig(holdout_tokens=args.holdout_tokens),
                          progress=not args.quiet)
    manifest = write_init_file(pieces, args.out)
    metrics = {"out": str(args.out), **{key: manifest[key] for key in ("vocab_size", "rank", "seconds", "holdout_loss")}}
    return _print_metrics(f"wrote {args.out} and {args.out.with_suffix('.json')}", metrics)


def cmd_export(args) -> dict:
    from saffu.interop.hf import export_hf, exportable, model_card
    from saffu.training.checkpoints import load_run_config
    exportable(load_run_config(args.run))
    workdir, config, params, which = _load_run(args)
    card = model_card(args.run, workdir, config, which)
    metrics = {**export_hf(params, config, Path(args.workdir) / "tokenizer.json", args.out, card), "weights": which}
    metrics["files"] = ",".join(metrics["files"])
    return _print_metrics(f"exported {args.run} ({which} weights) to {args.out}", metrics)


def cmd_eval(args) -> dict:
    workdir, config, params, which = _load_run(args)
    return _print_metrics(f"{args.run} ({which})",
                          {"weights": which, **_score_splits(params, config, workdir, args, args.split)})


def cmd_blimp(args) -> dict:
    from saffu.eval.blimp import evaluate_blimp
    workdir, config, params, which = _load_run(args)
    return _print_metrics(f"BLiMP of {args.run} ({which})", {
        "weights": which, **evaluate_blimp(params, config, workdir.tokenizer(), args.blimp, progress=not args.quiet)})


def cmd_harness(args) -> dict:
    import tempfile
    try:
        from saffu.interop.harness import evaluate, write_blimp_tasks
    except ModuleNotFoundError as err:
        raise SaffuError(f"the harness needs lm-evaluation-harness ({err}); pip install -e '.[eval]'") from None
    tasks, include = list(args.tasks), list(args.include_path)
    with tempfile.TemporaryDirectory(prefix="saffu-tasks-") as scratch:
        if args.blimp is not None:
            folder = args.write_tasks or Path(scratch)
            write_blimp_tasks(args.blimp, folder)
            tasks.append("saffu_blimp")
            include.append(folder)
        if not tasks:
            raise SaffuError("name --tasks, or give --blimp FOLDER")
        results = evaluate(args.run, tasks, include, args.workdir, args.checkpoint, args.limit, args.batch_size,
                           progress=not args.quiet, step=args.step, words=args.words)["results"]
    metrics = {}
    for task, figures in results.items():
        for key, value in figures.items():
            name, _, harness_filter = key.partition(",")      # lm-eval's "acc,none": the metric, its filter
            if isinstance(value, (int, float)) and not isinstance(value, bool) and harness_filter == "none":
                metrics[f"{task}_{name}"] = value
    return _print_metrics(f"lm-evaluation-harness on {args.run}", metrics)


def cmd_sweep(args) -> dict:
    from saffu._io import atomic_write_json
    from saffu.runner import grid, read_grid, sweep
    specs = grid(*read_grid(args.grid))
    rows = sweep(specs, args.out, args.workdir, args.jobs, say=lambda message: _say(args, message))
    atomic_write_json(args.out / "rows.json", rows)
    width = max(len(name) for name in specs)
    print(f"{'run':<{width}}  dev bits/byte  train loss  train–dev gap  compute (FLOPs)")
    for row in rows:
        get = lambda key, row=row: row.get(key, float("nan"))
        print(f"{row['name']:<{width}}  {get('dev_bpb'):13.4f}  {get('train_loss'):10.3f}  {get('gap_nats'):13.3f}"
              f"  {get('compute'):15.3e}")
    best = min(rows, key=lambda row: row.get("dev_bpb", float("inf")))
    return {"runs": len(rows), "best": best["name"], "best_dev_bpb": best.get("dev_bpb"),
            "rows": str(args.out / "rows.json")}


def cmd_ngram(args) -> dict:
    from saffu.eval.ngram import ngram_baseline
    config, workdir = config_from_args(configs.NgramConfig, args, ("order",)), _workdir(args)
    metrics = ngram_baseline(workdir, config, args.arpa, args.blimp, progress=not args.quiet)
    return _print_metrics(f"Kneser-Ney {config.order}-gram on {workdir.meta['corpus']}", metrics)


def cmd_generate(args) -> dict:
    import jax

    from saffu.data.tokenizer import decode
    from saffu.eval.scoring import generate_ids
    workdir, config, params, which = _load_run(args)
    tokenizer, tick = workdir.tokenizer(), time.perf_counter()
    prompt = tokenizer.encode(args.prompt).ids if args.prompt else []
    samples = generate_ids(params, config, prompt, jax.random.key(args.seed), args.num_samples, args.max_tokens,
                           args.temperature, args.top_k)
    seconds, texts = time.perf_counter() - tick, [decode(tokenizer, [*prompt, *ids]) for ids in samples]
    print(f"{len(texts)} samples from {args.run} ({which}):")
    for text in texts:
        print(f"  > {text}")
    new = sum(map(len, samples))
    print(f"{new:,} new tokens in {seconds:.2f} s, compilation included ({new / seconds:,.1f} tokens/s)")
    return {"weights": which, "samples": len(texts), "mean_chars": sum(map(len, texts)) / max(len(texts), 1),
            "new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds,
            **{f"sample_{i}": t for i, t in enumerate(texts)}}


def cmd_inspect(args) -> dict:
    from saffu.eval.attention import profile_table, run_attention_profile
    workdir, config, params, which = _load_run(args)
    inspect = config_from_args(configs.InspectConfig, args, ("split", "windows", "seq_len", "energy", "lazy_rank"))
    out = args.out if args.out is not None else args.run / "attention"
    profile, metrics = run_attention_profile(params, config, workdir, inspect, out, f"{args.run.name} ({which})",
                                         progress=not args.quiet)
    print(f"attention of {args.run} ({which}), {profile['windows']} {inspect.split} windows of "
          f"{profile['window_tokens']} tokens, effective rank at {inspect.energy:.0%} energy, lazy at rank "
          f"≤ {inspect.lazy_rank}:\n{profile_table(profile)}")
    print(f"(uniform attention would put {profile['first_key_share_if_uniform']:.3f} on the first visible key)")
    print(f"lazy layers: {profile['lazy_layers'] or 'none'}; written to {metrics['json']} and {metrics['plot']}")
    return {"weights": which, **metrics}


def cmd_device_check(args) -> dict:
    from saffu.eval.device import device_check
    check = config_from_args(configs.DeviceCheckConfig, args, flags.DEVICE_CHECK)
    metrics = device_check(args.workdir, check, args.out)
    if not metrics["pass"]:
        write_metrics(args.metrics_json, metrics)
        raise SaffuError(f"the device check failed: {metrics['failed']} (see {args.out / 'device_check.json'})")
    return metrics


COMMANDS = {"prepare": cmd_prepare, "stats": cmd_stats, "fit": cmd_fit, "factorise": cmd_factorise,
            "exact": cmd_exact, "train": cmd_train, "eval": cmd_eval, "pack": cmd_pack,
            "init-weights": cmd_init_weights, "export": cmd_export, "blimp": cmd_blimp, "harness": cmd_harness,
            "sweep": cmd_sweep, "ngram": cmd_ngram,
            "generate": cmd_generate, "inspect": cmd_inspect, "download": cmd_download, "demo": cmd_demo,
            "device-check": cmd_device_check}


def build_parser() -> argparse.ArgumentParser:
    """The ``saffu`` parser (:func:`saffu.flags.build_parser`); building it imports nothing heavy."""
    return flags.build_parser(COMMANDS)


def _one_line_warnings(show):
    """``warnings.showwarning`` that prints a :class:`SaffuWarning` as one ``saffu: warning:`` line."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SaffuWarning):
            print(f"saffu: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


def _lock(args) -> contextlib.AbstractContextManager:
    """The write lock of the command's output directory (none for readers, and for the
    processes of a multi-process job other than process 0, which alone writes)."""
    if args.command not in flags.OUTPUTS or getattr(args, "process_id", 0) != 0:
        return contextlib.nullcontext()
    flag, name, directory = flags.OUTPUTS[args.command]
    path = getattr(args, name)
    if path is None:
        return contextlib.nullcontext()
    probe_writable(path, flag, directory)
    return exclusive(path if directory else Path(path).parent)


def _end_followers(finished: bool) -> None:
    """Wait for the processes this one started (:func:`_join_processes`); stop them when this
    process did not finish (they would wait for it in a collective)."""
    for process in _FOLLOWERS:
        if not finished:
            process.terminate()
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if finished and code:
            print(f"saffu: warning: process {process.args[-2]} of the job ended with exit status {code}",
                  file=sys.stderr)
    _FOLLOWERS.clear()


def main(argv: list[str] | None = None) -> int:
    try:
        args = flags.parse(build_parser(), argv)
    except SaffuError as err:
        print(f"saffu: error: {err}", file=sys.stderr)
        return 2
    args.argv = argv          # what a local multi-process job's other processes run
    warnings.showwarning = _one_line_warnings(warnings.showwarning)
    finished = False
    try:
        if args.metrics_json is not None:
            probe_writable(args.metrics_json, "--metrics-json", False)
        with _lock(args):
            metrics = args.run_command(args)
        finished = True
        if getattr(args, "num_processes", 1) > 1:   # meet the others where they end (their exit's shutdown)
            from saffu.engine.distributed import leave
            leave()
        _end_followers(True)
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
    finally:
        if not finished:
            _end_followers(False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
