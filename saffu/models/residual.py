"""Explicit residual: a trainable model that learns only what a fixed explicit model misses
(:class:`saffu.configs.ResidualConfig`)::

    logits = λ · log P_explicit(y | context) + f_θ(context)

``P_explicit`` is the exact token-resolution model (:mod:`saffu.models.exact`: sparse gathers
and a ``V``-wide log-softmax per position), ``f_θ`` the transformer, SAFFU or the factorised
model. ``f_θ``'s output layer starts at zero, so at step 0 the residual model *is* the
explicit model; the explicit tables are inputs (``fixed_params``): the trainer never
differentiates or updates them, and :func:`residual_logits` stops their gradient as well.
Parameters::

    {"model": f_θ's params, "scale": float32[] (λ), "explicit": the exact model's params,
     and f_θ's fixed inputs beside them (SAFFU's "codes")}

With an annealed ``λ`` (``scale="annealed"``) ``"scale"`` is not a parameter but a per-step
input (:meth:`saffu.configs.ResidualConfig.step_inputs`); without it the logits are ``f_θ``'s
alone and the explicit tables are not read — the trained model after its anneal.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from saffu.configs import Params, ResidualConfig
from saffu.models.exact import compact_tables, exact_logits


def residual_init(config: ResidualConfig, key: jax.Array, base_init: Callable, zero_output: Callable) -> Params:
    """The trainable part at step 0: ``f_θ`` randomly initialised (``base_init(config.base,
    key)``, :func:`saffu.models.interface.model_init`) with its output layer at zero
    (``zero_output``, its kind's :attr:`~saffu.models.kinds.ModelKind.zero_output`), and
    ``λ = config.scale_init`` (annealed: no ``"scale"``; the trainer passes each step's ``λ``)."""
    base = zero_output(base_init(config.base, key))
    fixed = {name: base.pop(name) for name in getattr(config.base, "fixed_params", ()) if name in base}
    model = {"model": base, **fixed}       # f_θ's fixed inputs (SAFFU's codes) beside it, never trained
    if config.scale == "annealed":
        return model
    return {**model, "scale": jnp.asarray(config.scale_init, jnp.float32)}


def with_explicit(params: Params, explicit: Params, folds: list[Params] | None = None) -> Params:
    """``params`` (:func:`residual_init` or a checkpoint of it) with the explicit model's
    tables (:func:`saffu.solve.exact.solve_exact`, or ``load_explicit`` of its run) added, and
    for training a cross-fitted residual each fold's tables (the exact model solved without
    that fold, in fold order). The tables are held compacted
    (:func:`saffu.models.exact.compact_tables`: the same logits in a fraction of the memory)."""
    return {**params, "explicit": compact_tables(explicit),
            **({"folds": [compact_tables(tables) for tables in folds]} if folds is not None else {})}


def explicit_log_probs(params: Params, config: ResidualConfig, tokens: jax.Array) -> jax.Array:
    """``log P_explicit`` at every position, gradient stopped: ``int32[B, S]`` -> ``float32[B, S, V]``.
    With a ``"fold"`` input (a cross-fitted training step) the tables are that fold's
    (``params["folds"][fold]``, chosen by ``lax.switch``: only that fold's lookup runs, no
    table is copied); otherwise the whole split's (``params["explicit"]``)."""
    if "fold" in params:
        folds = jax.tree.map(jax.lax.stop_gradient, params["folds"])
        branches = [lambda tokens, tables=tables: exact_logits(tables, config.explicit, tokens).astype(jnp.float32)
                    for tables in folds]
        logits = jax.lax.switch(params["fold"], branches, tokens)
    else:
        frozen = jax.tree.map(jax.lax.stop_gradient, params["explicit"])
        logits = exact_logits(frozen, config.explicit, tokens).astype(jnp.float32)
    return jax.nn.log_softmax(logits, axis=-1)


def base_params(params: Params, config: ResidualConfig) -> Params:
    """``f_θ``'s whole params: ``params["model"]`` with its fixed inputs (SAFFU's codes), which
    the residual keeps beside it."""
    return {**params["model"], **{name: params[name] for name in getattr(config.base, "fixed_params", ())}}


def residual_logits(params: Params, config: ResidualConfig, tokens: jax.Array, base_logits: Callable) -> jax.Array:
    """``λ · log P_explicit + f_θ``: ``int32[B, S]`` -> ``float32[B, S, V]``, ``f_θ`` by
    ``base_logits(config.base, params, tokens)`` (:func:`saffu.models.interface.model_logits`);
    ``f_θ`` alone when ``params`` hold no ``"scale"`` (an annealed residual after its anneal)."""
    trained = base_logits(config.base, base_params(params, config), tokens)
    if "scale" not in params:
        return trained
    return params["scale"].astype(trained.dtype) * explicit_log_probs(params, config, tokens).astype(trained.dtype) \
        + trained
