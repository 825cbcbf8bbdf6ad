"""The factorised explicit model: a SAFFU variant that reads explicit embeddings instead of
cipher codes (:class:`saffu.configs.FactorisedConfig`).

For every position ``t`` of a batch of sequences, with ``x_{t−p}`` the token ``p`` places back
(``<pad>`` where that lies before the document start — a row of its own, learned like a token)::

    h_t = Σ_{p < P} E_p[x_{t−p}] + Σ_h u_h G_h
    u_h = aᵀX,  a = softmax((X x_h) W_A^h),  X = E_0[x_{t−m}] for m < max(1, M >> h)
    logits_t = b + h_t B

The explicit solution (:func:`saffu.solve.factors.solve_factorised`) sets ``E_p`` and ``B`` from
a rank-``r`` factorisation of the exact offset matrices ``L_p[c, y]``, ``b = log p``, and
``G_h = 0``, ``W_A = 0``; training moves all of them. Parameters are a plain dict::

    {"embeddings": float32[P, V, r], "output_weights": float32[r, V], "output_bias": float32[V],
     "attention_{h}": float32[M_h, M_h], "value_weights": float32[H, r, r]}

With a structured output factor (``config.output``, :mod:`saffu.models.structured`) the dense
``output_weights`` is replaced by ``"output_factors"`` (the structure's factors):
:func:`structure_output` sets them from a dense ``B`` by SVD — from the explicit solution's
``B``, a closed-form structured init; random init takes the SVD of a random ``B``. Self-guided
(``config.guide_share``), that dense ``B`` stays as ``"output_guide"`` and is mixed in while
training's ``α`` falls to 0: with the explicit ``B`` the guide is an explicit solution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from saffu._io import SaffuError
from saffu.configs import FactorisedConfig, Params
from saffu.data.tokenizer import PAD_ID
from saffu.models.exact import document_contexts
from saffu.models.kinds import ModelKind
from saffu.models.structured import apply_structure, from_dense, structure_size, zero_last_factor


def init_params(config: FactorisedConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random init (cold start): weights ``N(0, scale²)``, the output bias 0."""
    P, V, r, H = config.positions, config.vocab_size, config.rank, config.heads
    keys = iter(jax.random.split(key, H + 3))
    params = {"embeddings": scale * jax.random.normal(next(keys), (P, V, r)),
              "output_weights": scale * jax.random.normal(next(keys), (r, V)),
              "output_bias": jnp.zeros((V,)),
              "value_weights": scale * jax.random.normal(next(keys), (H, r, r))}
    for h in range(H):
        params[f"attention_{h}"] = scale * jax.random.normal(next(keys), (config.head_radius(h),) * 2)
    return structure_output(params, config)


def structure_output(params: Params, config: FactorisedConfig) -> Params:
    """``params`` with a dense ``output_weights float32[r, V]`` (random, or the explicit
    solution's) turned into ``config.output``'s factors (``params["output_factors"]``) by SVD
    (:func:`saffu.models.structured.from_dense`) and, self-guided (``config.guide_share``), kept
    as the dense guide ``params["output_guide"]``; unchanged for a dense output or params that
    already hold factors."""
    if config.output == "dense" or "output_factors" in params:
        return params
    size = structure_size(config.output, config.rank, config.vocab_size, config.output_share, config.output_blocks)
    params = dict(params)
    dense = jnp.asarray(params.pop("output_weights"), jnp.float32)
    params["output_factors"] = from_dense(config.output, dense, size, config.output_blocks)
    if config.guide_share:
        params["output_guide"] = dense
    return params


def drop_output_guide(params: Params, config: FactorisedConfig) -> tuple[FactorisedConfig, Params]:
    """A self-guided factorised model after its guided phase: the config without the guide and
    the params without the dense guide ``B`` (the logits without ``guide_alpha`` are the same)."""
    if not config.guide_share:
        return config, params
    return (dataclasses.replace(config, guide_share=0.0),
            {name: value for name, value in params.items() if name != "output_guide"})


def _heads(params: Params, config: FactorisedConfig, context: jax.Array):
    """Per head, its rows ``X [B, S, M_h, r]`` and attention ``[B, S, M_h]`` over them."""
    for head in range(config.heads):
        X = params["embeddings"][0][context[..., :config.head_radius(head)]]
        similarity = jnp.einsum("...mr,...r->...m", X, X[..., 0, :])
        yield X, jax.nn.softmax(similarity @ params[f"attention_{head}"], axis=-1)


def hidden_states(params: Params, config: FactorisedConfig, tokens: jax.Array) -> jax.Array:
    """``h_t`` of every position: ``int32[B, S]`` -> ``float32[B, S, r]``."""
    context = document_contexts(tokens, config.context)                     # [B, S, R], <pad> outside
    P = config.positions
    h = jnp.sum(params["embeddings"][jnp.arange(P), context[..., :P]], axis=-2)   # [B, S, r]
    for head, (X, attention) in enumerate(_heads(params, config, context)):
        h = h + jnp.einsum("...m,...mr->...r", attention, X) @ params["value_weights"][head]
    return h


def factorised_attention(params: Params, config: FactorisedConfig,
                         tokens: jax.Array) -> list[tuple[list[jax.Array], jax.Array]]:
    """The one layer's heads' attention ``[float32[B, S, M_h]]`` (query position × offset) and
    each offset's visibility ``bool[B, S, M]`` (an invisible row is ``<pad>``'s embedding), as
    :func:`saffu.models.saffu.saffu_attention`."""
    if not config.heads:
        return []
    context = document_contexts(tokens, config.context)
    visible = context != PAD_ID
    return [([attention for _, attention in _heads(params, config, context)], visible[..., :config.radius])]


def factorised_logits(params: Params, config: FactorisedConfig, tokens: jax.Array) -> jax.Array:
    """Next-token logits at every position: ``int32[B, S]`` -> ``float32[B, S, V]``. A
    self-guided model's ``params["guide_alpha"]`` (``float32[]``, from
    :meth:`FactorisedConfig.step_inputs`) gives ``α · h B_guide + (1 − α) · S(h)``; without it
    the guide is not read."""
    h = hidden_states(params, config, tokens)
    logits = (h @ params["output_weights"] if config.output == "dense"
              else apply_structure(config.output, params["output_factors"], h))
    if "guide_alpha" in params:
        if not config.guide_share or "output_guide" not in params:
            raise SaffuError("a guide weight α was given to a factorised model without a dense guide")
        alpha = params["guide_alpha"]
        logits = alpha * (h @ params["output_guide"]) + (1 - alpha) * logits
    return logits + params["output_bias"][None, None, :]


def zero_output(params: Params) -> Params:
    """``params`` (a copy) with ``output_bias`` and ``output_weights`` (or a structured output's
    last factor) at zero, so the logits are exactly 0."""
    params = {**params, "output_bias": jnp.zeros_like(params["output_bias"])}
    zero_last_factor(params)
    return params


KIND = ModelKind(
    "factorised", FactorisedConfig, factorised_logits, init=init_params, zero_output=zero_output, radius=True,
    attention=factorised_attention, attends_by="offsets", attends=lambda config: config.heads > 0,
    solve_command="saffu factorise", drop_guide=drop_output_guide)
