"""Jobs: the whole tasks the ``saffu`` command and the experiments run, each one library call
over the stages below (scoring a run's splits, the demo's main job, the Kneser-Ney baseline, a
run's attention profile). The command line only parses flags into configs, calls these and
prints; an experiment calls the same functions, so no script re-implements one.

Each job returns its figures as a flat ``dict`` (what ``--metrics-json`` writes) and reports
its progress through ``say`` (a ``str -> None``; silent by default).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from saffu import configs
from saffu._io import atomic_write_json

Say = Callable[[str], None]


def _silent(message: str) -> None:
    pass


def eval_splits(workdir) -> list[str]:
    """Every split of ``workdir`` but the training split."""
    return [s for s in workdir.meta["splits"] if s != workdir.train_split]


def score_splits(params, config, workdir, splits=None, eval_tokens: int = configs.EvalConfig.eval_tokens,
                 progress: bool = False, say: Say = _silent) -> dict:
    """Figures of every non-training split of ``workdir`` (or ``splits``) under ``config`` with
    ``params`` (:func:`saffu.eval.scoring.evaluate_split`): about ``eval_tokens`` tokens of
    whole documents each (0: every token)."""
    from saffu.eval.scoring import evaluate_split
    limit, metrics = eval_tokens or None, {}
    for split in splits or eval_splits(workdir):
        total = workdir.split_info(split)["predicted_tokens"]
        say(f"evaluating {split}: all {total:,} tokens" if limit is None or limit >= total else
            f"evaluating {split}: about {limit:,} of its {total:,} tokens, whole documents from evenly spaced parts "
            f"of it (--eval-tokens 0 scores all)")
        metrics.update(evaluate_split(params, config, workdir, split, limit, progress))
    return metrics


def demo(corpus_path: str | Path, out: str | Path, bigram: configs.BigramConfig, config: configs.DemoConfig,
         radius: int, saffu_mu: float, learning_rate: float, name: str | None = None, progress: bool = False,
         say: Say = _silent) -> tuple[dict, Path, object]:
    """The main job on a corpus: prepare it into ``out/data`` (BPE of ``config.vocab_size``),
    solve and score the explicit bigram layer (``bigram``), solve an explicit SAFFU model
    (``radius``, ``config.bits``-bit codes, Dirichlet ``saffu_mu``) into ``out/saffu`` (made
    afresh), score dev, warm-start it for ``config.steps`` AdamW steps at ``learning_rate`` and
    score dev again. Returns ``(figures, run directory, work directory)``."""
    from saffu.data.corpus import babylm_corpus
    from saffu.data.workdir import prepare
    from saffu.eval.metrics import split_metrics
    from saffu.eval.scoring import evaluate_split
    from saffu.models.interface import parameter_count
    from saffu.training.recipes import count_model, solve_run
    from saffu.training.trainer import train
    start, out = time.perf_counter(), Path(out)
    workdir = prepare(babylm_corpus(corpus_path, name=name), out / "data",
                      configs.PrepareConfig(vocab_size=config.vocab_size), show_progress=progress)
    nlls, _ = count_model(workdir, "bigram", bigram, ["dev"], progress)
    metrics = split_metrics(nlls["dev"], workdir.split_info("dev"), "bigram_dev_")
    model = configs.SaffuConfig(vocab_size=workdir.vocab_size, bits=config.bits, radius=radius)
    say(f"solving explicit SAFFU (radius {radius}, {config.bits}-bit codes) on "
        f"{workdir.split_info(workdir.train_split)['tokens']:,} training tokens")
    run = out / "saffu"
    if run.exists():   # the demo's own run: a rerun trains again instead of finding it finished
        shutil.rmtree(run)
    solver = configs.SolverConfig(smoothing=configs.Smoothing(mu=saffu_mu))
    params, report, _ = solve_run(workdir, run, model, solver, progress=progress)
    metrics.update(explicit_seconds=report["seconds"], params=parameter_count(params))
    metrics.update(evaluate_split(params, model, workdir, "dev", progress=progress, prefix="explicit_dev_"))
    say(f"warm start: {config.steps} AdamW steps from the explicit solution")
    train_config = configs.TrainConfig(steps=config.steps, learning_rate=learning_rate, eval_every=config.steps,
                                       checkpoint_every=0)
    trained, history = train(model, params, workdir.tokens(workdir.train_split), train_config, run,
                             dev_stream=workdir.tokens("dev"), progress=progress)
    metrics.update(warm_steps=config.steps, warm_seconds=history[-1]["seconds"])
    metrics.update(evaluate_split(trained, model, workdir, "dev", progress=progress, prefix="warm_dev_"))
    metrics["total_seconds"] = time.perf_counter() - start
    return metrics, run, workdir


def ngram_baseline(workdir, config: configs.NgramConfig = configs.NgramConfig(), arpa_path: Path | None = None,
                   blimp: Path | None = None, progress: bool = False) -> dict:
    """Interpolated modified Kneser-Ney of ``config.order`` on ``workdir``'s training split:
    fit seconds and tokens/s, model size, every other split's figures, optionally the ARPA file
    at ``arpa_path`` and BLiMP accuracy on the ``blimp`` folder, peak memory."""
    from saffu.engine import accounting
    from saffu.eval import ngram
    from saffu.ngram import arpa, kneser_ney
    train_stream, start = workdir.tokens(workdir.train_split), time.perf_counter()
    model = kneser_ney.fit_kneser_ney(train_stream, config.order, vocab_size=workdir.vocab_size,
                                      progress="count n-grams" if progress else None)
    fit_seconds = time.perf_counter() - start
    metrics = {"order": config.order, "fit_seconds": fit_seconds, "tokens_per_s": (len(train_stream) - 1) / fit_seconds,
               **kneser_ney.model_size(model), **ngram.ngram_splits(model, workdir, eval_splits(workdir), progress=progress)}
    if arpa_path:
        tick = time.perf_counter()
        arpa.write_arpa(model, arpa_path)
        metrics.update(arpa=str(arpa_path), arpa_seconds=time.perf_counter() - tick)
    if blimp:
        metrics.update(ngram.ngram_blimp(model, workdir.tokenizer(), blimp))
    return {**metrics, **accounting.memory_record()}


def run_attention_profile(params, config, workdir, inspect: configs.InspectConfig, out: Path, label: str,
                      progress: bool = False) -> tuple[dict, dict]:
    """The attention profile of a run (:func:`saffu.eval.attention.inspect_attention` over
    ``inspect.windows`` windows of ``inspect.split``), written to ``out.json`` with its plot at
    ``out.png``. Returns ``(profile, flat figures)``."""
    from saffu.eval.attention import flat_metrics, inspect_attention, plot_profiles
    profile = inspect_attention(params, config, workdir.tokens(inspect.split), inspect.windows, inspect.seq_len,
                                inspect.energy, inspect.lazy_rank, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out.with_suffix(".json"), out.with_suffix(".png")
    atomic_write_json(json_path, {"run": label, "split": inspect.split, **profile})
    what = f"{profile['windows']} {inspect.split} windows of {profile['window_tokens']} tokens"
    plot_profiles({label: profile}, plot_path, f"attention of {label}: {what}")
    return profile, {**flat_metrics(profile), "json": str(json_path), "plot": str(plot_path)}


def run_layers_before_lazy(reference_run: Path, workdir, progress: bool = False, say: Say = _silent) -> int | None:
    """The blocks of a trained transformer or SAFFU run before its first lazy layer (its attention
    profile, :func:`saffu.eval.attention.layers_before_lazy`): what ``--inherit-before-lazy``
    inherits. ``None`` for another kind (the inheritance recipe says what it must be)."""
    from saffu.eval.attention import inspect_attention
    from saffu.eval.attention import layers_before_lazy as before_lazy
    from saffu.models.interface import kind_of
    from saffu.training.checkpoints import check_inputs, load_params
    reference = check_inputs(reference_run, workdir)
    depth = kind_of(reference).depth
    if depth is None:
        return None
    profile = inspect_attention(load_params(reference_run, reference)[0], reference, workdir.tokens("dev"),
                                progress=progress)
    layers = before_lazy(profile, getattr(reference, depth))
    say(f"the reference's lazy layers: {profile['lazy_layers'] or 'none'}; inheriting {layers} blocks")
    return layers
