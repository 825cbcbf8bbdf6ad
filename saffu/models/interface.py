"""What every model shares: the interface the trainer, the evaluators and BLiMP rely on,
and the losses written against it.

A model is its config (:class:`saffu.configs.SaffuConfig`, :class:`~saffu.configs.TransformerConfig`,
:class:`~saffu.configs.BigramConfig`), a frozen dataclass — hashable, so it is a static jit
argument — with

* ``context``: tokens of left context a prediction may read;
* ``logits(params, tokens int32[B, S]) -> float[B, S, V]``: position ``p`` predicts token
  ``p + 1``; ``params`` is a pytree of arrays, always a jit argument, never a constant;
* ``forward_flops(seq_len) -> float``: analytic forward FLOPs per predicted token;
* ``eval_seq_len``: targets per evaluation window;
* optionally ``fixed_params``: top-level parameter names that are inputs, never trained;
* optionally ``step_inputs(step, steps) -> dict``: per-step inputs (e.g. self-guided training's
  ``guide_alpha``) merged into the params of that training step, and ``step_forward_flops(seq_len,
  inputs)``: the forward FLOPs of a step with those inputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


Params = dict[str, Any]


def window_nll(params: Params, config, windows: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-target NLL (nats) ``float32[B, T]`` of ``windows int32[B, R + T]`` whose first
    ``R = config.context`` tokens are context only; zero where ``mask bool[B, T]`` is False.
    ``config`` is any model config (see the module docstring)."""
    context = config.context
    logits = config.logits(params, windows)[:, context - 1:-1]
    targets = windows[:, context:]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0] * mask


def window_loss(params: Params, config, windows: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed NLL (nats) and target count of :func:`window_nll`'s windows."""
    return jnp.sum(window_nll(params, config, windows, mask)), jnp.sum(mask)


def parameter_count(params: Params) -> int:
    """Number of scalars in the parameter pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
