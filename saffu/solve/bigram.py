"""The explicit solution of the cipher bigram layer (formulation §1), and the unigram model.

One statistics pass counts the offset-0 co-occurrence of the head's cipher code with the next
token; the layer is its log-likelihood ratio with a temperature ``β`` calibrated on the
held-out training tail::

    logits(u) = log p + β · c(u) (log P(· | k) − log p)        W = β W_llr + log p

(the two are equal because every code sums to 1).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from saffu._io import atomic_write_bytes
from saffu.configs import BigramConfig
from saffu.data.workdir import WorkDir
from saffu.engine.accumulators import accumulate, blend_background, offset_cooccurrence, unigram_counts
from saffu.engine.codes import bit_cipher_codes, code_background, sparse_bit_cipher
from saffu.engine.explicit import calibrate_temperature, explicit_softmax_weights, unigram_prior
from saffu.engine.rows import pair_counts
from saffu.models.bigram import Params, bigram_nll


def fit_explicit_bigram(workdir: WorkDir, config: BigramConfig = BigramConfig(),
                        mesh=None, progress: bool = True) -> tuple[Params, dict]:
    """The explicit bigram solution from one statistics pass over the training split.

    Returns the layer's parameters (``codes float32[V, K]``, ``weights float32[K, V]``, as
    :mod:`saffu.models.bigram`) and a report: ``beta``, ``holdout_loss`` (nats/token at ``β``),
    ``holdout_loss_beta1``, ``stats_seconds``, ``seconds`` (whole fit), ``counted_tokens``.
    """
    start = time.perf_counter()
    stream = workdir.tokens(workdir.train_split)
    vocab_size = workdir.vocab_size
    holdout = min(config.holdout_tokens, max(len(stream) // 10, 0))
    counted_end = len(stream) - holdout
    sparse = sparse_bit_cipher(vocab_size, config.cipher.bits)
    accumulators = {"unigram": unigram_counts(vocab_size),
                    "cooccurrence": offset_cooccurrence(sparse, vocab_size, radius=1)}
    stats = accumulate(stream, accumulators, end=counted_end, chunk_size=config.chunk_size, mesh=mesh,
                       progress="statistics" if progress else None)
    cooccurrence = stats["cooccurrence"][0]                                    # [K, V]
    codes = bit_cipher_codes(vocab_size, config.cipher, workdir.token_counts())
    if config.cipher.background:
        cooccurrence = blend_background(
            stats["cooccurrence"], code_background(sparse, workdir.token_counts()),
            config.cipher.background)[0]
    prior = unigram_prior(stats["unigram"])
    llr = explicit_softmax_weights(cooccurrence, config.smoothing, prior, log_likelihood_ratio=True)
    log_prior = np.log(prior)
    codes_j = jnp.asarray(codes, jnp.float32)

    def model_at(beta: float) -> Params:
        return {"codes": codes_j, "weights": jnp.asarray(beta * llr + log_prior[None, :], jnp.float32)}

    report = {"stats_seconds": stats["seconds"], "counted_tokens": counted_end - 1}
    if holdout:
        pairs = pair_counts(stream, counted_end, len(stream), vocab_size)
        loss = lambda beta: bigram_nll(model_at(beta), pairs) / holdout
        beta, holdout_loss = calibrate_temperature(loss)
        report.update(holdout_loss=holdout_loss, holdout_loss_beta1=loss(1.0))
    else:
        beta = 1.0
    report.update(beta=beta, seconds=time.perf_counter() - start)
    return model_at(beta), report


def unigram_log_prior(workdir: WorkDir, progress: bool = True) -> np.ndarray:
    """The unigram model of the training split: ``log p``, ``float64[V]`` (add-one smoothed,
    :func:`saffu.engine.explicit.unigram_prior`), from one statistics pass."""
    stats = accumulate(workdir.tokens(workdir.train_split), {"unigram": unigram_counts(workdir.vocab_size)},
                       progress="statistics" if progress else None)
    return np.log(unigram_prior(stats["unigram"]))


def unigram_nll(log_prior: np.ndarray, pairs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Total NLL (nats) of :func:`saffu.engine.rows.pair_counts` pairs under the unigram ``log_prior``."""
    _, targets, counts = pairs
    return float(-(counts * log_prior[targets]).sum())


def save_offset_statistics(workdir: WorkDir, path: str | Path | None, bits: int, radius: int,
                           chunk_size: int = BigramConfig.chunk_size, progress: bool = True) -> dict:
    """Offset co-occurrences ``F_δ`` (``float64[M, K, V]``, δ < ``radius``) of the cipher codes
    with the next token, and unigram counts, from one pass over the training split, written to
    ``path`` as ``statistics.npz`` (keys ``offset_cooccurrence``, ``unigram``, ``bits``,
    ``radius``; nothing is written when ``path`` is None, as on every process but the first of
    a multi-process job). Returns ``offset_stats_seconds`` and ``offset_stats_tokens_per_s``."""
    stream = workdir.tokens(workdir.train_split)
    codes = sparse_bit_cipher(workdir.vocab_size, bits)
    stats = accumulate(
        stream, {"offset_cooccurrence": offset_cooccurrence(codes, workdir.vocab_size, radius),
                 "unigram": unigram_counts(workdir.vocab_size)},
        chunk_size=chunk_size, progress=f"offsets M={radius}" if progress else None)
    if path is not None:
        buffer = io.BytesIO()
        np.savez(buffer, offset_cooccurrence=stats["offset_cooccurrence"], unigram=stats["unigram"],
                 bits=bits, radius=radius)
        atomic_write_bytes(path, buffer.getvalue())
    return {"offset_stats_seconds": stats["seconds"],
            "offset_stats_tokens_per_s": (len(stream) - 1) / stats["seconds"]}


