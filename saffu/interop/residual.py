"""The explicit residual for any model: ``λ · log P_exact + apply(params, tokens)``.

:class:`ExplicitResidual` wraps the user's ``apply(params, tokens int32[B, S]) -> float[B, S, V]``
(any framework that gives JAX logits) with the exact token-resolution model
(:mod:`saffu.models.exact`) as a fixed input. It is meant for the user's own training loop::

    residual = ExplicitResidual.from_run(apply, "runs/exact")
    params = residual.init(params, output="lm_head/kernel")       # step 0: the exact model
    loss = lambda p, tokens: cross_entropy(residual.logits(p, residual.tables, tokens[:, :-1]), tokens[:, 1:])
    grads = jax.grad(loss)(params, batch)                          # plain jax.grad + optax

The tables go in as an argument (``residual.tables``), never as constants of the user's
executable, and their gradient is stopped: no update ever reaches them. Token ids given in
the user's numbering are mapped to the exact model's (``id_map``) and the log-probabilities
back, so a model solved from a :class:`saffu.interop.tokens.TokenSource` lines up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import SaffuError
from saffu.configs import ExactConfig
from saffu.interop.init import Selector, _locate
from saffu.models.interface import model_logits


class ExplicitResidual:
    """``logits = λ · log P_exact(y | context) + apply(params["model"], tokens)``.

    Args:
      apply: the user's forward, ``(params, tokens int32[B, S]) -> logits float[B, S, V]``.
      exact_config: the exact model's :class:`saffu.configs.ExactConfig`.
      tables: its parameters (:func:`saffu.solve.exact.solve_exact` or a loaded run).
      scale: ``λ``, the explicit part's weight (a trainable ``params["scale"]``).
      id_map: ``int[V]``, the exact model's id of every user id (``None``: the same ids).
    """

    def __init__(self, apply: Callable, exact_config, tables: Any, scale: float = 1.0,
                 id_map: np.ndarray | None = None):
        if not isinstance(exact_config, ExactConfig):
            raise SaffuError("the residual's explicit part must be an exact model (`saffu exact`)")
        self.apply, self.exact_config, self.scale = apply, exact_config, float(scale)
        self.tables = jax.tree.map(jnp.asarray, tables)
        self.id_map = None if id_map is None else jnp.asarray(id_map, jnp.int32)

    @classmethod
    def from_run(cls, apply: Callable, run: str | Path, scale: float = 1.0, id_map=None) -> ExplicitResidual:
        """The residual over a ``saffu exact`` run (its tables checked against its fingerprint)."""
        from saffu.training.checkpoints import load_explicit, load_run_config
        config = load_run_config(run)
        if not isinstance(config, ExactConfig):
            raise SaffuError(f"{run} holds a {config.kind}; the residual needs a `saffu exact` run")
        return cls(apply, config, load_explicit(run, config), scale, id_map)

    def init(self, params, output: Selector | list[Selector]) -> dict:
        """``{"model": params with the leaves that make its logits at zero, "scale": λ}``, so
        the wrapped model's logits are exactly ``λ · log P_exact`` at step 0. ``output``: the
        output kernel's selector (and its bias's, as a list) — see :mod:`saffu.interop.init`."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        for selector in (output if isinstance(output, list) else [output]):
            i = _locate(params, selector, "output")
            leaves[i] = jnp.zeros_like(leaves[i])
        return {"model": jax.tree_util.tree_unflatten(treedef, leaves), "scale": jnp.asarray(self.scale, jnp.float32)}

    def explicit_log_probs(self, tables, tokens: jax.Array) -> jax.Array:
        """``log P_exact`` of every next token, gradient stopped: ``int32[B, S] -> float32[B, S, V]``
        (in the user's ids)."""
        tables = jax.tree.map(jax.lax.stop_gradient, tables)
        ours = tokens if self.id_map is None else self.id_map[tokens]
        logp = jax.nn.log_softmax(model_logits(self.exact_config, tables, ours).astype(jnp.float32), axis=-1)
        return logp if self.id_map is None else jnp.take(logp, self.id_map, axis=-1)

    def logits(self, params: dict, tables, tokens: jax.Array) -> jax.Array:
        """``λ · log P_exact + apply(params["model"], tokens)``, ``float32[B, S, V]``."""
        trained = self.apply(params["model"], tokens).astype(jnp.float32)
        if trained.shape[-1] != self.exact_config.vocab_size:
            raise SaffuError(f"the model gives {trained.shape[-1]:,} logits per position; the exact model has a "
                             f"vocabulary of {self.exact_config.vocab_size:,}")
        return params["scale"] * self.explicit_log_probs(tables, tokens) + trained

    def __call__(self, params: dict, tokens: jax.Array) -> jax.Array:
        """:meth:`logits` with this residual's tables (outside a jit; inside one pass them)."""
        return self.logits(params, self.tables, tokens)
