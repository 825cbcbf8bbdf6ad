"""The n-gram baseline on work directories and BLiMP: fit on the training split, score splits."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from saffu.configs import NgramConfig
from saffu.data.workdir import WorkDir
from saffu.engine import accounting
from saffu.eval.blimp import blimp_accuracy, load_blimp
from saffu.eval.metrics import split_metrics
from saffu.ngram import arpa
from saffu.ngram.kneser_ney import KneserNeyModel, fit_kneser_ney, kn_sentence_log_probs, log_probs, model_size


def ngram_splits(model: KneserNeyModel, workdir: WorkDir, splits: Sequence[str], *, chunk_size: int = 1 << 16,
                 progress: bool = False) -> dict[str, float]:
    """Score every target of each split of ``splits`` (positions ``1 … end``): the
    :func:`saffu.eval.metrics.split_metrics` figures (``{split}_loss``, ``_ppl``, ``_bpb``,
    ``_word_ppl``) and ``{split}_score_seconds``."""
    metrics: dict[str, float] = {}
    for split in splits:
        start = time.perf_counter()
        stream = workdir.tokens(split)
        scores = log_probs(model, stream, 1, len(stream), chunk_size=chunk_size,
                           progress=f"score {split}" if progress else None)
        metrics.update(split_metrics(-float(scores.sum()), workdir.split_info(split), f"{split}_"))
        metrics[f"{split}_score_seconds"] = time.perf_counter() - start
    return metrics


def ngram_blimp(model: KneserNeyModel, tokenizer, directory) -> dict[str, float]:
    """BLiMP accuracy of ``model`` (:func:`saffu.eval.blimp.blimp_accuracy`): every sentence scored
    as a document, :func:`kn_sentence_log_probs`."""
    pairs = load_blimp(directory)
    encode = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    good = kn_sentence_log_probs(model, encode([p.good for p in pairs]))
    bad = kn_sentence_log_probs(model, encode([p.bad for p in pairs]))
    return blimp_accuracy(pairs, good, bad)


def evaluate_workdir(workdir: WorkDir, order: int, split: str = "dev", *, chunk_size: int = 1 << 16,
                     progress: bool = False) -> dict[str, float]:
    """Fit an order-``order`` model on the training split of a :class:`saffu.data.workdir.WorkDir`
    and score every target of ``split`` (positions ``1 … end``).

    Returns the :func:`ngram_splits` figures of ``split`` plus ``order``, ``fit_seconds``,
    ``score_seconds``, ``ngrams_<k>`` (model entries per order; order 1 is the vocabulary)
    and ``discount_<k>_<j>``.
    """
    start = time.perf_counter()
    model = fit_kneser_ney(workdir.tokens(workdir.train_split), order, vocab_size=workdir.vocab_size,
                           chunk_size=chunk_size, progress="count n-grams" if progress else None)
    metrics: dict[str, float] = {"order": order, "fit_seconds": time.perf_counter() - start}
    metrics.update(ngram_splits(model, workdir, [split], chunk_size=chunk_size, progress=progress))
    metrics["score_seconds"] = metrics.pop(f"{split}_score_seconds")
    metrics.update({key: n for key, n in model_size(model).items() if key != "params"})
    for k in range(order):
        for j in range(3):
            metrics[f"discount_{k + 1}_{j + 1}"] = float(model.discounts[k, j])
    return metrics


def ngram_baseline(workdir, config: NgramConfig = NgramConfig(), arpa_path: Path | None = None,
                   blimp: Path | None = None, progress: bool = False) -> dict:
    """Interpolated modified Kneser-Ney of ``config.order`` on ``workdir``'s training split:
    fit seconds and tokens/s, model size, every other split's figures, optionally the ARPA file
    at ``arpa_path`` and BLiMP accuracy on the ``blimp`` folder, peak memory."""
    train_stream, start = workdir.tokens(workdir.train_split), time.perf_counter()
    model = fit_kneser_ney(train_stream, config.order, vocab_size=workdir.vocab_size,
                           progress="count n-grams" if progress else None)
    fit_seconds = time.perf_counter() - start
    metrics = {"order": config.order, "fit_seconds": fit_seconds, "tokens_per_s": (len(train_stream) - 1) / fit_seconds,
               **model_size(model), **ngram_splits(model, workdir, workdir.eval_splits, progress=progress)}
    if arpa_path:
        tick = time.perf_counter()
        arpa.write_arpa(model, arpa_path)
        metrics.update(arpa=str(arpa_path), arpa_seconds=time.perf_counter() - tick)
    if blimp:
        metrics.update(ngram_blimp(model, workdir.tokenizer(), blimp))
    return {**metrics, **accounting.memory_record()}
