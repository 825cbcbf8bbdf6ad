"""The single-layer cipher bigram model: ``p(w_{t+1} | w_t) = softmax(c(w_t) W)``.

The smallest SAFFU-family model (radius 1, no hidden layer) and the baseline every
contextual model must beat. Its parameters are ``{"codes": float32[V, K], "weights":
float32[K, V]}``; the codes are fixed inputs (:attr:`BigramConfig.fixed_params`), never
trained. The explicit solution is :func:`saffu.solve.bigram.fit_explicit_bigram`; the
trainer (:func:`saffu.training.trainer.train`) trains the weights from it (warm start) or from
:func:`random_bigram` (cold start), as it trains every other model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from saffu.configs import BigramConfig, CipherConfig, Params
from saffu.engine.codes import bit_cipher_codes
from saffu.models.kinds import ModelKind


def bigram_logits(params: Params, tokens: jax.Array) -> jax.Array:
    """``int32[B, S]`` heads -> ``float32[B, S, V]`` next-token logits ``c(w_t) W``."""
    codes = jax.lax.stop_gradient(params["codes"])
    return codes[tokens] @ params["weights"]


@jax.jit
def _pair_nll(params, heads, targets, counts):
    """Σ counts · (logsumexp(codes[h] W) − (codes[h] W)[t]) over distinct (head, target) pairs."""
    codes, weights = params["codes"], params["weights"]
    vocab_size = codes.shape[0]
    block = 512
    padded = -(-vocab_size // block) * block
    codes_padded = jnp.zeros((padded, codes.shape[1]), codes.dtype).at[:vocab_size].set(codes)

    def row_lse(block_codes):
        return jax.nn.logsumexp(block_codes @ weights, axis=-1)

    lse = jax.lax.map(row_lse, codes_padded.reshape(-1, block, codes.shape[1])).reshape(-1)
    picked = jnp.einsum("pk,kp->p", codes[heads], weights[:, targets])
    return jnp.sum(counts * (lse[heads] - picked))


def bigram_nll(params: Params, pairs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Total NLL (nats) of :func:`saffu.engine.rows.pair_counts` pairs (``int[P]`` heads,
    targets and counts) under the layer ``params``; the weights are a jit argument."""
    heads, targets, counts = pairs
    return float(_pair_nll(params, jnp.asarray(heads), jnp.asarray(targets), jnp.asarray(counts, jnp.float32)))


def random_bigram(config: BigramConfig, vocab_size: int, key: jax.Array, scale: float = 0.02) -> Params:
    """Cold start: codes fixed (no background), ``weights ~ N(0, scale²)``, ``float32[K, V]``."""
    cipher: CipherConfig = dataclasses.replace(config.cipher, background=0.0)
    codes = jnp.asarray(bit_cipher_codes(vocab_size, cipher), jnp.float32)
    return {"codes": codes, "weights": scale * jax.random.normal(key, (cipher.dim, vocab_size), jnp.float32)}


KIND = ModelKind("bigram", BigramConfig, lambda params, config, tokens: bigram_logits(params, tokens),
                 from_fields=lambda fields: BigramConfig(**{k: v for k, v in fields.items() if k != "kind"}))
