"""The single-layer cipher bigram model: ``p(w_{t+1} | w_t) = softmax(c(w_t) W)``.

The smallest SAFFU-family model (radius 1, no hidden layer) and the baseline every
contextual model must beat. Its explicit solution (formulation §1) uses the offset-0
co-occurrence of the cipher code of the head with the next token, in log-likelihood-ratio
form with a calibrated temperature::

    logits(u) = log p + β · c(u) (log P(· | k) − log p)        W = β W_llr + log p

(the two are equal because every code sums to 1). :func:`train_bigram` trains the same layer
with Adam from the explicit solution (warm start) or from random init (cold start).
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from saffu import statistics
from saffu._io import atomic_write_bytes
from saffu.codes import bit_cipher_codes, code_background, sparse_bit_cipher
from saffu.configs import BigramConfig, BigramTrainConfig, CipherConfig
from saffu.evaluation import pair_counts
from saffu.explicit import calibrate_temperature, explicit_softmax_weights, unigram_prior
from saffu.workdir import WorkDir


class BigramModel(NamedTuple):
    """Parameters of the layer: ``logits(u) = codes[u] @ weights``.

    Attributes:
      codes: ``float32[V, K]`` cipher codes (fixed, not trained).
      weights: ``float32[K, V]``.
    """

    codes: jax.Array
    weights: jax.Array


@jax.jit
def _pair_nll(codes, weights, heads, targets, counts):
    """Σ counts · (logsumexp(codes[h] W) − (codes[h] W)[t]) over distinct (head, target) pairs."""
    vocab_size = codes.shape[0]
    block = 512
    padded = -(-vocab_size // block) * block
    codes_padded = jnp.zeros((padded, codes.shape[1]), codes.dtype).at[:vocab_size].set(codes)

    def row_lse(block_codes):
        return jax.nn.logsumexp(block_codes @ weights, axis=-1)

    lse = jax.lax.map(row_lse, codes_padded.reshape(-1, block, codes.shape[1])).reshape(-1)
    picked = jnp.einsum("pk,kp->p", codes[heads], weights[:, targets])
    return jnp.sum(counts * (lse[heads] - picked))


def bigram_nll(model: BigramModel, pairs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Total NLL (nats) of :func:`saffu.evaluation.pair_counts` pairs under ``model``."""
    heads, targets, counts = pairs
    return float(_pair_nll(model.codes, model.weights, jnp.asarray(heads), jnp.asarray(targets),
                           jnp.asarray(counts, jnp.float32)))


def fit_explicit_bigram(workdir: WorkDir, config: BigramConfig = BigramConfig(),
                        mesh=None, progress: bool = True) -> tuple[BigramModel, dict]:
    """The explicit bigram solution from one statistics pass over the training split.

    Returns the model and a report: ``beta``, ``holdout_loss`` (nats/token at ``β``),
    ``holdout_loss_beta1``, ``stats_seconds``, ``seconds`` (whole fit), ``counted_tokens``.
    """
    start = time.perf_counter()
    stream = workdir.tokens(workdir.train_split)
    vocab_size = workdir.vocab_size
    holdout = min(config.holdout_tokens, max(len(stream) // 10, 0))
    counted_end = len(stream) - holdout
    sparse = sparse_bit_cipher(vocab_size, config.cipher.bits)
    accumulators = {"unigram": statistics.unigram_counts(vocab_size),
                    "cooccurrence": statistics.offset_cooccurrence(sparse, vocab_size, radius=1)}
    stats = statistics.accumulate(stream, accumulators, end=counted_end,
                                  chunk_size=config.chunk_size, mesh=mesh,
                                  progress="statistics" if progress else None)
    cooccurrence = stats["cooccurrence"][0]                                    # [K, V]
    codes = bit_cipher_codes(vocab_size, config.cipher, workdir.token_counts())
    if config.cipher.background:
        cooccurrence = statistics.blend_background(
            stats["cooccurrence"], code_background(sparse, workdir.token_counts()),
            config.cipher.background)[0]
    prior = unigram_prior(stats["unigram"])
    llr = explicit_softmax_weights(cooccurrence, config.smoothing, prior, log_likelihood_ratio=True)
    log_prior = np.log(prior)
    codes_j = jnp.asarray(codes, jnp.float32)

    def model_at(beta: float) -> BigramModel:
        return BigramModel(codes_j, jnp.asarray(beta * llr + log_prior[None, :], jnp.float32))

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
    :func:`saffu.explicit.unigram_prior`), from one statistics pass."""
    stats = statistics.accumulate(workdir.tokens(workdir.train_split),
                                  {"unigram": statistics.unigram_counts(workdir.vocab_size)},
                                  progress="statistics" if progress else None)
    return np.log(unigram_prior(stats["unigram"]))


def unigram_nll(log_prior: np.ndarray, pairs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Total NLL (nats) of :func:`saffu.evaluation.pair_counts` pairs under the unigram ``log_prior``."""
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
    stats = statistics.accumulate(
        stream, {"offset_cooccurrence": statistics.offset_cooccurrence(codes, workdir.vocab_size, radius),
                 "unigram": statistics.unigram_counts(workdir.vocab_size)},
        chunk_size=chunk_size, progress=f"offsets M={radius}" if progress else None)
    if path is not None:
        buffer = io.BytesIO()
        np.savez(buffer, offset_cooccurrence=stats["offset_cooccurrence"], unigram=stats["unigram"],
                 bits=bits, radius=radius)
        atomic_write_bytes(path, buffer.getvalue())
    return {"offset_stats_seconds": stats["seconds"],
            "offset_stats_tokens_per_s": (len(stream) - 1) / stats["seconds"]}


def random_bigram(vocab_size: int, cipher: CipherConfig, key: jax.Array, scale: float) -> BigramModel:
    """Cold start: codes fixed, ``weights ~ N(0, scale²)``, ``float32[K, V]``."""
    codes = jnp.asarray(bit_cipher_codes(vocab_size, dataclasses.replace(cipher, background=0.0)),
                        jnp.float32)
    return BigramModel(codes, scale * jax.random.normal(key, (cipher.dim, vocab_size), jnp.float32))


def train_bigram(model: BigramModel, train_stream: np.ndarray, config: BigramTrainConfig,
                 evaluate: Callable[[BigramModel], float] | None = None,
                 progress: bool = True) -> tuple[BigramModel, list[dict]]:
    """Train ``model.weights`` with AdamW (no weight decay) on (head, target) pairs.

    Args:
      model: the starting point (explicit solution or :func:`random_bigram`).
      train_stream: ``int[N]`` training token stream; targets are positions ``1 … N−1``.
      config: see :class:`BigramTrainConfig`.
      evaluate: ``model -> dev loss`` (nats/token), called every ``eval_every`` steps.

    Returns the trained model and the history: one dict per evaluation with ``step``,
    ``tokens``, ``seconds`` (training time, evaluation excluded), ``train_loss``, ``dev_loss``.
    """
    positions = np.arange(1, len(train_stream), dtype=np.int64)
    steps_per_epoch = len(positions) // config.batch_size
    steps = config.steps or steps_per_epoch
    data_key, _ = jax.random.split(jax.random.key(config.seed))
    warmup = min(config.warmup_steps, steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup,
                                                  max(steps, warmup + 1))
    optimizer = optax.chain(optax.clip_by_global_norm(config.clip_norm), optax.adam(schedule, eps=config.adam_eps))
    weights = model.weights
    opt_state = optimizer.init(weights)
    codes = model.codes
    stream = jnp.asarray(np.asarray(train_stream, np.int32))

    @jax.jit
    def step(weights, opt_state, batch_positions):
        heads, targets = stream[batch_positions - 1], stream[batch_positions]

        def loss_fn(w):
            logits = codes[heads] @ w
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(weights)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss

    rng = np.random.default_rng(np.asarray(jax.random.key_data(data_key)).ravel())
    order = rng.permutation(positions)
    history, train_seconds, recent = [], 0.0, []
    if evaluate is not None:
        history.append({"step": 0, "tokens": 0, "seconds": 0.0, "train_loss": math.nan,
                        "dev_loss": evaluate(model)})
    for i in tqdm(range(steps), desc="train", disable=not progress, leave=False):
        epoch_step = i % max(steps_per_epoch, 1)
        if epoch_step == 0 and i:
            order = rng.permutation(positions)
        batch = order[epoch_step * config.batch_size:(epoch_step + 1) * config.batch_size]
        tick = time.perf_counter()
        weights, opt_state, loss = step(weights, opt_state, jnp.asarray(batch, jnp.int32))
        loss = float(loss)  # syncs, so the timing is honest
        train_seconds += time.perf_counter() - tick
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at step {i + 1}")
        recent.append(loss)
        if evaluate is not None and ((i + 1) % config.eval_every == 0 or i + 1 == steps):
            history.append({"step": i + 1, "tokens": (i + 1) * config.batch_size,
                            "seconds": train_seconds, "train_loss": float(np.mean(recent)),
                            "dev_loss": evaluate(BigramModel(codes, weights))})
            recent = []
    return BigramModel(codes, weights), history
