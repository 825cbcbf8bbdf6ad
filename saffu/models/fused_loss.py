"""The output layer and its cross-entropy in one pass over chunks of tokens: the ``N × V``
logits are never held in full, and the gradient is computed with the loss.

A language model's last layer and loss, ``Σ_n w_n (logsumexp(h_n W + b) − (h_n W + b)[y_n])``,
hold ``N × V`` logits (16 windows × 256 targets × 8,192 tokens: 134 MB) and, differentiated
naively, write and read that array several times more (the softmax, the scatter of ``−1`` at the
targets, its transpose for ``∂W``). On a CPU those passes, and the page faults of a freshly
allocated array of that size, cost more than the three products. :func:`linear_nll_sum` runs the
products chunk by chunk (a chunk's logits stay in cache), and its forward pass under
differentiation already computes ``∂h``, ``∂W`` and ``∂b`` (``softmax − onehot`` is known as soon
as the chunk's log-sum-exp is), so the backward pass only scales them by the incoming cotangent:
three products of the output layer's size, as the plain formula has, and no recomputation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: Tokens per chunk: a chunk's logits (256 × 8,192 floats, 8 MB) fit the processor's cache.
CHUNK = 256


def _chunked(h: jax.Array, targets: jax.Array, weights: jax.Array, chunk: int):
    """``h [N, d]``, ``targets [N]``, ``weights [N]`` in ``⌈N / chunk⌉`` equal chunks of at most
    ``chunk`` tokens (the last padded with zero weight): ``[count, size, …]``."""
    n = h.shape[0]
    chunk = -(-n // -(-n // chunk))        # as even chunks as the count allows: little padding
    pad = -n % chunk
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    count = (n + pad) // chunk
    return h.reshape(count, chunk, -1), targets.reshape(count, chunk), weights.reshape(count, chunk)


def _chunk_logits(h: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """``float32[C, V]`` logits of one chunk ``h [C, d]`` (products accumulated in float32)."""
    return jnp.dot(h, kernel, preferred_element_type=jnp.float32) + bias.astype(jnp.float32)[None]


def _chunk_nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(logsumexp, nll) float32[C]`` of a chunk's logits."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return lse, lse - picked


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def linear_nll_sum(h: jax.Array, kernel: jax.Array, bias: jax.Array, targets: jax.Array, weights: jax.Array,
                   chunk: int = CHUNK) -> jax.Array:
    """``Σ_n weights[n] · NLL_n`` (``float32[]``) of ``softmax(h W + b)`` at ``targets``:
    ``h [N, d]``, ``kernel [d, V]``, ``bias [V]``, ``targets int32[N]``, ``weights float32[N]``
    (e.g. a mask), ``chunk`` tokens at a time. Differentiable in ``h``, ``kernel`` and ``bias``;
    equal to the plain formula (the whole logits, a log-softmax, a gather) up to float32 rounding,
    and so are its gradients."""
    return _forward(h, kernel, bias, targets, weights, chunk, with_grads=False)[0]


def _forward(h, kernel, bias, targets, weights, chunk, with_grads: bool):
    """The loss and, ``with_grads``, ``(∂h, ∂W, ∂b)`` of a unit cotangent, in one scan over chunks."""
    n = h.shape[0]
    hs, ts, ws = _chunked(h, targets, weights.astype(jnp.float32), chunk)
    vocab = kernel.shape[1]

    def step(carry, args):
        h_c, t_c, w_c = args
        logits = _chunk_logits(h_c, kernel, bias)
        lse, nll = _chunk_nll(logits, t_c)
        loss = carry[0] + jnp.sum(nll * w_c)
        if not with_grads:
            return (loss,), None
        # ∂loss/∂logits = w · (softmax − onehot(target)), in place of the logits
        probs = jnp.exp(logits - lse[:, None])
        grad = (jnp.where(jnp.arange(vocab)[None] == t_c[:, None], probs - 1.0, probs) * w_c[:, None])
        d_kernel = carry[1] + jnp.dot(h_c.T, grad.astype(h_c.dtype), preferred_element_type=jnp.float32)
        d_bias = carry[2] + jnp.sum(grad, axis=0)
        d_h = jnp.dot(grad.astype(kernel.dtype), kernel.T, preferred_element_type=jnp.float32).astype(h.dtype)
        return (loss, d_kernel, d_bias), d_h

    zero = jnp.zeros((), jnp.float32)
    if not with_grads:
        (loss,), _ = jax.lax.scan(step, (zero,), (hs, ts, ws))
        return loss, None
    init = (zero, jnp.zeros(kernel.shape, jnp.float32), jnp.zeros(bias.shape, jnp.float32))
    (loss, d_kernel, d_bias), d_h = jax.lax.scan(step, init, (hs, ts, ws))
    grads = (d_h.reshape(-1, h.shape[1])[:n], d_kernel.astype(kernel.dtype), d_bias.astype(bias.dtype))
    return loss, grads


def _bwd(chunk, grads, cotangent):
    d_h, d_kernel, d_bias = grads
    scale = lambda g: (g * cotangent.astype(g.dtype)).astype(g.dtype)
    return scale(d_h), scale(d_kernel), scale(d_bias), None, None


linear_nll_sum.defvjp(functools.partial(_forward, with_grads=True), _bwd)
