"""Recipes the command line and the experiments share: how a model is solved, put together
from solved pieces, trained and kept.

* :func:`solve_run` — an explicit solution (SAFFU, exact, factorised) solved and saved as a run;
  :func:`count_model` — the explicit bigram (or the unigram) and its NLL on splits.
* :func:`solve_folds` — the exact model of every fold's complement, for a cross-fitted
  residual (:class:`saffu.configs.ResidualConfig` with ``folds``).
* :func:`residual_start` — a residual model's config and its step-0 parameters over an exact
  run (cross-fitted or not); :func:`residual_run` — the same as a run directory (new or resumed).
* :func:`explicit_start` — a transformer's or a penzai model's random init with pieces from
  explicit low-rank factors.
* :func:`inherit` / :func:`grow` — Inheritune: the first blocks of a trained reference, and a
  trained stack grown block by block (by the reference's next blocks, or SAFFU blocks solved).
* :func:`structured_from` — a structured-MLP transformer from a trained dense one.
* :func:`start_run` — a run directory's config written (or checked against an existing one);
  :func:`start_training` — the config and step-0 parameters of ``saffu train``'s run, by its
  :class:`saffu.configs.StartConfig`.
* :func:`train_run` — a run trained (resumed from its last checkpoint) and :func:`finish`-ed,
  with its figures; :func:`finish` — a trained model as it is kept: without training-only parts.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax

from saffu._io import SaffuError, release_free_memory, tree_fingerprint
from saffu.configs import (
    FOLD_BLOCKS,
    ExactConfig,
    FactorConfig,
    FactorisedConfig,
    Params,
    ResidualConfig,
    StartConfig,
    TransformerConfig,
)
from saffu.data.folds import fold_documents, other_folds
from saffu.data.workdir import WorkDir, subset_workdir
from saffu.models.exact import compact_tables
from saffu.models.interface import KINDS, RESIDUAL, kind_of, model_init
from saffu.models.residual import with_explicit
from saffu.training.checkpoints import (
    check_inputs,
    load_explicit,
    load_params,
    load_run_config,
    pack_run,
    run_record,
    save_explicit_run,
    save_run_config,
)


def check_room(run: str | Path, config) -> None:
    """Refuse before solving when ``config``'s explicit solution (sizes known in advance) cannot
    fit in ``run``'s file system."""
    from saffu._io import check_free
    from saffu.training.checkpoints import tree_bytes
    check_free(run, tree_bytes(jax.eval_shape(lambda: model_init(config, jax.random.key(0)))) + (1 << 20),
               f"the explicit solution ({config.kind})", "free space or give another --run")


def solve_run(workdir: WorkDir, run: str | Path, config, solver=None, writer: bool = True, retry=None,
              progress: bool = False) -> tuple[Params, dict, str]:
    """Solve the explicit model ``config`` (a SAFFU stack: :func:`saffu.solve.stack.solve_explicit`
    with ``solver``, a :class:`SolverConfig`; the exact model: :func:`saffu.solve.exact.solve_exact`;
    the factorised model: :func:`saffu.solve.factors.solve_factorised` with a :class:`FactorConfig`)
    from ``workdir`` and save it as the run ``run`` (first checked to have room where the size is
    known in advance). ``retry``: :func:`saffu.training.checkpoints.save_explicit_run`'s question
    after a failed save; ``writer=False`` (a multi-process job's other processes): only take part
    in the save. Returns ``(params, the solver's report, the run it was saved to)``."""
    from saffu.training.checkpoints import save_explicit
    if isinstance(config, ExactConfig):
        from saffu.solve.exact import solve_exact
        params, report = solve_exact(workdir, config, progress=progress)
        params = jax.device_get(params)     # every process takes part (orbax synchronises them)
    else:
        if not kind_of(config).exact_tables(config):       # exact tables' sizes come from the data
            check_room(run, config)
        if isinstance(config, FactorisedConfig):
            from saffu.solve.factors import solve_factorised
            params, report = solve_factorised(workdir, config, solver or FactorConfig(), progress=progress)
        else:
            from saffu.solve.stack import SolverConfig, solve_explicit
            params, report = solve_explicit(workdir, config, solver or SolverConfig(), progress=progress)
    if not writer:
        save_explicit(run, params)
        return params, report, str(run)
    return params, report, save_explicit_run(run, config, workdir, params, retry=retry)


def _bigram(workdir: WorkDir, config, progress: bool):
    from saffu.models.bigram import bigram_nll
    from saffu.solve.bigram import fit_explicit_bigram
    model, report = fit_explicit_bigram(workdir, config, progress=progress)
    return {"bits": config.cipher.bits, **report}, lambda pairs: bigram_nll(model, pairs)


def _unigram(workdir: WorkDir, config, progress: bool):
    from saffu.solve.bigram import unigram_log_prior, unigram_nll
    log_prior = unigram_log_prior(workdir, progress=progress)
    return {}, lambda pairs: unigram_nll(log_prior, pairs)


#: The count models: ``(workdir, config, progress) -> (report, pairs -> NLL)``.
COUNT_MODELS = {"bigram": _bigram, "unigram": _unigram}


def count_model(workdir: WorkDir, model: str, config, splits, progress: bool = False) -> tuple[dict[str, float], dict]:
    """The explicit count model ``model`` (``"bigram"``: :func:`saffu.solve.bigram.fit_explicit_bigram`
    with the :class:`saffu.configs.BigramConfig` ``config``; ``"unigram"``: the unigram prior)
    of ``workdir``'s training split, and its total NLL (nats) on each of ``splits``. Returns
    ``({split: nll}, report)``; the report holds the fit's ``seconds`` (and the bigram's figures)."""
    from saffu.engine.rows import pair_counts
    if model not in COUNT_MODELS:
        raise SaffuError(f"unknown count model {model!r}; choose from {', '.join(COUNT_MODELS)}")
    start = time.perf_counter()
    report, nll = COUNT_MODELS[model](workdir, config, progress)
    report["seconds"] = time.perf_counter() - start
    return {split: nll(pair_counts(workdir.tokens(split), vocab_size=workdir.vocab_size)) for split in splits}, report


def solve_folds(source: WorkDir, config: ExactConfig, folds: int, out: str | Path, blocks: int = FOLD_BLOCKS,
                progress: bool = False) -> tuple[list[str], list[str], float]:
    """For each fold ``k`` of ``source``'s training split (:mod:`saffu.data.folds`), the exact
    model ``config`` solved from every other fold: the documents of the complement as a
    subset work directory (``out/fold<k>/data``), solved and saved as an exact run
    (``out/fold<k>``). A fold whose run already holds this config for this data is kept.

    Returns ``(run paths, content fingerprints, seconds spent solving)``, in fold order.
    """
    from saffu.solve.exact import solve_exact
    out = Path(out)
    documents = fold_documents(source.tokens(source.train_split), folds, blocks)
    runs, fingerprints, seconds = [], [], 0.0
    for k in range(folds):
        run = out / f"fold{k}"
        data = subset_workdir(source, run / "data", train_documents=other_folds(documents, k), show_progress=progress)
        if not ((run / "config.json").is_file() and load_run_config(run) == config
                and run_record(run).get("workdir_fingerprint") == data.fingerprint):
            tick = time.perf_counter()
            params, _ = solve_exact(data, config, progress=progress)
            save_explicit_run(run, config, data, jax.device_get(params))
            seconds += time.perf_counter() - tick
        runs.append(str(run.resolve()))
        fingerprints.append(run_record(run)["explicit_sha256"])
    return runs, fingerprints, seconds


def _compact_explicit(run: str | Path, config, expect: str = "") -> tuple[Params, str]:
    """One exact run's tables as the residual holds them (:func:`compact_tables`) and the
    fingerprint of the tables as saved: each run's padded tables are dropped before the next is
    read, so loading a cross-fitted residual never holds every run's padded tables at once."""
    tables = load_explicit(run, config, expect)
    return compact_tables(tables), expect or tree_fingerprint(tables)


def residual_start(base, explicit_run: str | Path, key: jax.Array, scale: str = "fixed", anneal_share: float = 0.5,
                   fold_runs: tuple[str, ...] = (), fold_blocks: int = FOLD_BLOCKS,
                   config: ResidualConfig | None = None) -> tuple[ResidualConfig, Params]:
    """``(ResidualConfig, parameters at step 0)`` of a residual over the exact run
    ``explicit_run``: ``f_θ`` (``base``) randomly initialised from ``key`` with its output
    layer at zero, the exact tables as fixed inputs (their content fingerprint recorded), and
    with ``fold_runs`` (:func:`solve_folds`) the cross-fitted training tables. Given an
    existing run's ``config``, its tables are loaded and checked against its fingerprints."""
    if config is None:
        explicit_config = load_run_config(explicit_run)
        if not isinstance(explicit_config, ExactConfig):
            raise SaffuError(f"{explicit_run} holds a {explicit_config.kind}; a residual needs a `saffu exact` run")
        if any(load_run_config(run) != explicit_config for run in fold_runs):
            raise SaffuError(f"a fold run holds another exact model than {explicit_run}; solve the folds again")
        (explicit, explicit_sha256), *folds = [_compact_explicit(run, explicit_config)
                                               for run in (explicit_run, *fold_runs)]
        config = ResidualConfig(base, explicit_config, str(Path(explicit_run).resolve()), scale=scale,
                                anneal_share=anneal_share, explicit_sha256=explicit_sha256,
                                folds=len(fold_runs), fold_blocks=fold_blocks,
                                fold_runs=tuple(str(Path(run).resolve()) for run in fold_runs),
                                fold_sha256=tuple(sha for _, sha in folds))
    else:
        explicit, _ = _compact_explicit(config.explicit_run, config.explicit, config.explicit_sha256)
        folds = [_compact_explicit(run, config.explicit, sha) for run, sha in zip(config.fold_runs, config.fold_sha256)]
    params = with_explicit(model_init(config, key), explicit, [tables for tables, _ in folds] if config.folds else None)
    release_free_memory()           # the padded tables and the restore's buffers, no longer held
    return config, params


def start_run(run: str | Path, config, workdir: WorkDir) -> None:
    """Make ``run`` the run directory of ``config`` on ``workdir``: its config written, or — in
    a run that already has one — checked to be the same model."""
    run = Path(run)
    if (run / "config.json").exists():
        if load_run_config(run) != config:
            raise SaffuError(f"{run} holds a different model than this one; use a new --run")
        return
    if jax.process_index() != 0:       # a multi-process job's process 0 alone writes the run's files
        return
    run.mkdir(parents=True, exist_ok=True)
    save_run_config(run, config, workdir)


def residual_run(workdir: WorkDir, run: str | Path, key: jax.Array, base=None, explicit_run: str | Path | None = None,
                 scale: str = "fixed", anneal_share: float = 0.5, folds: int = 0, bundle: bool = False,
                 progress: bool = False, announce=print) -> tuple[ResidualConfig, Params]:
    """``(ResidualConfig, params at step 0)`` of the residual run ``run``: a new one over the
    exact run ``explicit_run`` with trainable part ``base`` (``folds`` ≥ 2: cross-fitted, the
    exact model of every fold's complement solved into ``run/folds``), or the existing one (its
    tables checked against its fingerprints). ``bundle``: the exact model copied into the run."""
    run = Path(run)
    existing = (run / "config.json").exists()
    if existing:
        config = check_inputs(run, workdir, streams=True)
        if not isinstance(config, ResidualConfig):
            raise SaffuError(f"{run} already holds a {config.kind} run; use a new --run for --residual")
        config, params = residual_start(config.base, config.explicit_run, key, config=config)
    else:
        explicit = check_inputs(explicit_run, workdir)
        if not isinstance(explicit, ExactConfig):
            raise SaffuError(f"--residual {explicit_run} holds a {explicit.kind}; it must be a `saffu exact` run")
        fold_runs = ()
        if folds:
            announce(f"solving the exact model of each of {folds} folds' complements into {run / 'folds'}")
            fold_runs, _, _ = solve_folds(workdir, explicit, folds, run / "folds", progress=progress)
        config, params = residual_start(base, explicit_run, key, scale, anneal_share, tuple(fold_runs))
    if kind_of(config.base).radius:
        workdir.check_radius(config.base.radius)
    if not existing:
        start_run(run, config, workdir)
    if bundle:
        pack_run(run)
    return config, params


def explicit_start(workdir: WorkDir, config, key: jax.Array, start: StartConfig = StartConfig(init="explicit"),
                   solver: FactorConfig = FactorConfig(), progress: bool = False) -> tuple[Params, float, dict]:
    """The explicit start of a model whose kind builds one from the explicit low-rank factors
    (its record's ``explicit_init``: the transformer,
    :func:`saffu.models.transformer.explicit_transformer_init`; a penzai model,
    :func:`saffu.models.penzai.explicit_penzai_init`): its random init (from ``key``) with
    ``start.explicit_pieces`` from the factors of rank ``config.width`` solved from ``workdir``
    (none solved when it takes no piece), at ``start``'s scales (``explicit_embedding_rms``,
    ``explicit_output_rms``; a tied matrix's ``explicit_tied``). Returns ``(params, seconds of
    the solve and init, the factor solve's report)``."""
    from saffu.solve.factors import solve_factorised
    kind = kind_of(config)
    if kind.explicit_init is None:
        raise SaffuError(f"a {kind.name} model's explicit start is its saved solution, not the explicit factors")
    tick = time.perf_counter()
    factors, report = (solve_factorised(workdir, FactorisedConfig(workdir.vocab_size, rank=config.width, positions=1),
                                        solver, progress=progress) if start.explicit_pieces else (None, {}))
    params = kind.explicit_init(config, key, factors, start)
    return params, time.perf_counter() - tick, report


def _depth(config) -> str:
    """The field counting ``config``'s stacked blocks (``"layers"``, ``"blocks"``); one error line
    for a model that is not a stack."""
    depth = kind_of(config).depth
    if depth is None:
        raise SaffuError(f"Inheritune takes a transformer or a SAFFU stack, not a {config.kind}")
    return depth


def inherit(reference_params: Params, reference, layers: int | None = None) -> tuple[object, Params]:
    """Inheritune's start: the first ``layers`` blocks (default: half the reference's, at least
    one) of a trained transformer (with its embeddings, positions, final norm and output layer)
    or SAFFU stack (each block with its own output layer)."""
    from saffu.models import saffu as saffu_model
    from saffu.models import transformer
    depth = _depth(reference)
    layers = layers or max(1, getattr(reference, depth) // 2)
    if depth == "layers":
        return transformer.inherit_layers(reference_params, reference, layers)
    return saffu_model.inherit_blocks(reference_params, reference, layers)


def grow(params: Params, config, reference_params: Params, reference, layers: int | None = None,
         grow_by: str = "reference", workdir: WorkDir | None = None, progress: bool = False,
         announce=print) -> tuple[object, Params]:
    """Inheritune's growth: a trained stack ``(config, params)`` grown to ``layers`` blocks
    (default: one more) by the reference's next blocks (``grow_by="reference"``), or — a SAFFU
    stack — by blocks solved explicitly on top of it from ``workdir`` (``grow_by="solve"``,
    which may grow past the reference's depth)."""
    from saffu.models import saffu as saffu_model
    from saffu.models import transformer
    depth = _depth(reference)
    if type(config) is not type(reference):
        raise SaffuError(f"the stack to grow holds a {config.kind}; it must be a {reference.kind} like the reference")
    if grow_by not in ("reference", "solve"):
        raise SaffuError(f"grow_by must be 'reference' or 'solve', got {grow_by!r}")
    if grow_by == "solve" and not kind_of(reference).grows_by_solving:
        raise SaffuError("--grow-by solve solves SAFFU blocks explicitly; a transformer grows by the reference's blocks")
    start = getattr(config, depth)
    target = layers or start + 1
    if target <= start:
        raise SaffuError(f"--inherit-layers {target} must exceed --start-from's {start} blocks")
    if depth == "layers":
        while config.layers < target:
            config, params = transformer.grow_layer(params, config, reference_params, reference)
        return config, params
    if dataclasses.replace(reference, blocks=config.blocks) != config:
        raise SaffuError("the stack to grow and the reference differ in more than their block count")
    if grow_by == "solve":
        from saffu.solve.stack import solve_explicit
        announce(f"solving blocks {start} … {target - 1} explicitly on top of the trained stack")
        grown = dataclasses.replace(config, blocks=target)
        params, _ = solve_explicit(workdir, grown, progress=progress, below=params)
        return grown, params
    if target > reference.blocks:
        raise SaffuError(f"the reference has {reference.blocks} blocks; cannot grow to {target} (--grow-by solve can)")
    while config.blocks < target:
        config, params = saffu_model.grow_block(params, config, reference_params["blocks"][config.blocks])
    return config, params


def _check_structured(config) -> None:
    """``--ffn-from``'s model must be a structured transformer (checked before its run is written)."""
    if not isinstance(config, TransformerConfig) or config.ffn == "dense":
        raise SaffuError("--ffn-from needs a structured transformer: --model transformer --ffn lowrank|blockdense|"
                         "blockshuffle")


def structured_from(dense_params: Params, dense_config, config) -> Params:
    """Every weight of a trained dense transformer, its MLP kernels turned into ``config``'s
    structure by SVD (trained-SVD init; kept as the dense guide when self-guided)."""
    from saffu.models.transformer import structure_mlp
    _check_structured(config)
    if not isinstance(dense_config, TransformerConfig):
        raise SaffuError(f"--ffn-from holds a {dense_config.kind}; it must be a dense transformer run")
    return structure_mlp(dense_params, dense_config, config)


def word_count(workdir: WorkDir, explicit_pass: bool):
    """The training words a run on ``workdir`` consumes (:class:`saffu.training.checkpoints.WordCount`):
    the training split's whitespace words per target token, and with ``explicit_pass`` (an
    explicit or residual start: its statistics read the split once) one pass before step 0."""
    from saffu.training.checkpoints import WordCount
    split = workdir.meta["splits"][workdir.train_split]
    words = split.get("words")
    if not words:
        return None                  # a work directory prepared before words were counted
    return WordCount(words / max(split["tokens"] - 1, 1), float(words) if explicit_pass else 0.0)


def train_run(workdir: WorkDir, run: str | Path, config, params: Params, train_config, mesh=None, on_eval=None,
              progress: bool = False, explicit_pass: bool = False) -> tuple[object, Params, dict]:
    """Train ``(config, params)`` on ``workdir``'s training split into ``run`` (from its last
    checkpoint when it has one; periodic evaluations on ``dev`` when there is one), then
    :func:`finish`. Returns ``(config, params, figures)``: the parameters (of a residual also
    the trained ones and the final ``λ``), the steps, and — unless the run had already
    finished — the training's seconds (``train_seconds``), tokens, tokens/s, FLOPs and peak memory.
    Checkpoints by words seen (``train_config.words_unit``) count ``explicit_pass`` (the start's
    statistics read the data once) as one pass (:func:`word_count`)."""
    from saffu.models.interface import parameter_count
    from saffu.training.checkpoints import latest_checkpoint_step
    from saffu.training.trainer import train
    dev = workdir.tokens("dev") if "dev" in workdir.meta["splits"] else None
    words = word_count(workdir, explicit_pass)
    params, history = train(config, params, workdir.tokens(workdir.train_split), train_config, run, dev_stream=dev,
                            on_eval=on_eval, progress=progress, mesh=mesh, words=words)
    config, params = finish(config, params)
    figures = {"params": parameter_count(params),
               "steps": history[-1]["step"] if history else (latest_checkpoint_step(run) or 0)}
    if isinstance(config, ResidualConfig):
        fixed = {name: params[name] for name in config.fixed_params if name in params}
        figures.update(trained_params=figures["params"] - parameter_count(fixed),
                       scale=float(params["scale"]) if "scale" in params else 0.0)    # annealed: λ ends at 0
    if history:
        figures.update({key: history[-1][key] for key in ("tokens", "tokens_per_s", "flops", "xla_flops",
                                                          "peak_rss_mb") if key in history[-1]})
        figures["train_seconds"] = history[-1]["seconds"]
    return config, params, figures


def finish(config, params: Params) -> tuple[object, Params]:
    """A trained model as it is kept and scored: without the cross-fit folds' tables (they
    served training only) and, self-guided, without the dense guide (gone by the end)."""
    params = {name: value for name, value in params.items() if name != "folds"}
    if getattr(config, "guide_share", 0):
        config, params = kind_of(config).drop_guide(params, config)
    return config, params


def start_training(workdir: WorkDir, run: str | Path, start: StartConfig, key: jax.Array, new_model=None,
                   residual: dict | None = None, factors: FactorConfig = FactorConfig(), progress: bool = False,
                   announce=print) -> tuple[object, Params, float]:
    """``(model config, parameters at step 0, seconds solving)`` of the training run ``run`` on
    ``workdir`` as ``start`` says: a residual over an exact run (:func:`residual_run`, with
    ``residual``'s ``scale`` / ``anneal_share`` / ``folds``), inherited blocks (:func:`inherit`,
    :func:`grow`; ``start.inherit_layers`` may be the number of blocks before the reference's
    first lazy layer), an explicit start (a transformer or a penzai model: :func:`explicit_start`;
    any other model: ``run``'s explicit solution) or a random one (with ``start.ffn_from``:
    :func:`structured_from`). ``new_model()`` gives the model config of a new run (an existing
    run keeps its own); the run's config is written (or checked)."""
    config, params, seconds = _start(workdir, Path(run), start, key, new_model, residual, factors, progress, announce)
    if kind_of(config).radius:
        workdir.check_radius(config.radius)  # also for explicit runs made from another work directory
    return config, params, seconds


def _start(workdir, run, start, key, new_model, residual, factors, progress, announce):
    """:func:`start_training` before its radius check."""
    existing = (run / "config.json").exists()
    kind = KINDS.get(load_run_config(run).kind if existing else start.model)
    model = lambda: check_inputs(run, workdir, streams=True) if existing else new_model()
    if start.ffn_from is not None and (start.init != "random" or start.residual is not None):
        raise SaffuError("--ffn-from starts a structured transformer of its own (--init random, no --residual)")
    if start.residual is not None or kind is RESIDUAL:
        if start.init != "random":
            raise SaffuError("--residual trains a randomly initialised model over the exact one: use --init random")
        config, params = residual_run(workdir, run, key, None if existing else new_model(), start.residual,
                                      bundle=start.bundle, progress=progress, announce=announce, **(residual or {}))
        return config, params, 0.0
    if start.init == "inherit":
        config, params = _inherited(workdir, start, progress, announce)
        start_run(run, config, workdir)
        return config, params, 0.0
    if start.init == "explicit" and kind is not None and kind.explicit_init is not None:
        config = model()
        params, seconds, _ = explicit_start(workdir, config, key, start, factors, progress)
        start_run(run, config, workdir)
        return config, params, seconds
    config = check_inputs(run, workdir, streams=True) if start.init == "explicit" else model()
    if kind_of(config).exact_tables(config):
        raise SaffuError(f"{run} holds a model with exact token-resolution tables, which are not trained; score it "
                         f"with `saffu eval` / `saffu blimp`" if start.init == "explicit" else
                         "exact token-resolution tables (the exact model, --exact-positions) come from the data and "
                         "have no random init; solve them with `saffu exact` / `saffu fit`")
    if start.init == "explicit":
        return config, load_explicit(run, config), 0.0
    if kind_of(config).radius:
        workdir.check_radius(config.radius)
    if start.ffn_from is not None:
        _check_structured(config)
    start_run(run, config, workdir)
    params = model_init(config, key)
    if start.ffn_from is not None:
        source = check_inputs(start.ffn_from, workdir)
        params = structured_from(load_params(start.ffn_from, source)[0], source, config)
    return config, params, 0.0


def _inherited(workdir: WorkDir, start: StartConfig, progress: bool, announce) -> tuple[object, Params]:
    """``(config, params)`` of ``--init inherit``: the first blocks of ``start.reference``, or
    ``start.start_from`` grown."""
    if start.reference is None:
        raise SaffuError("--init inherit needs --reference RUN, a trained transformer or SAFFU run")
    reference = check_inputs(start.reference, workdir)
    if kind_of(reference).depth is None:
        raise SaffuError(f"--reference {start.reference} holds a {reference.kind}; Inheritune takes a transformer "
                         f"or a SAFFU stack")
    if start.grow_by == "solve" and not kind_of(reference).grows_by_solving:
        raise SaffuError("--grow-by solve solves SAFFU blocks explicitly; a transformer grows by the reference's blocks")
    reference_params, _ = load_params(start.reference, reference)
    if start.start_from is None:
        return inherit(reference_params, reference, start.inherit_layers)
    begin = check_inputs(start.start_from, workdir)
    if type(begin) is not type(reference):
        raise SaffuError(f"--start-from {start.start_from} holds a {begin.kind}; it must be a {reference.kind} run "
                         f"like --reference")
    return grow(load_params(start.start_from, begin)[0], begin, reference_params, reference, start.inherit_layers,
                start.grow_by, workdir, progress, announce)
