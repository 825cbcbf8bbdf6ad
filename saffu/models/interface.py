"""The model interface and the kind registry: what the trainer, the evaluators and BLiMP call,
and the losses written against it.

A model is its config (:mod:`saffu.configs`: :class:`~saffu.configs.SaffuConfig`,
:class:`~saffu.configs.TransformerConfig`, :class:`~saffu.configs.ExactConfig`,
:class:`~saffu.configs.FactorisedConfig`, :class:`~saffu.configs.ResidualConfig`,
:class:`~saffu.configs.BigramConfig`), a frozen dataclass of plain data — hashable, so it is a
static jit argument — naming its ``kind`` and giving

* ``context``: tokens of left context a prediction may read;
* ``forward_flops(seq_len) -> float``: analytic forward FLOPs per predicted token;
* ``eval_seq_len``: targets per evaluation window;
* optionally ``fixed_params``: top-level parameter names that are inputs, never trained;
* optionally ``step_inputs(step, steps) -> dict``: per-step inputs (e.g. self-guided training's
  ``guide_alpha``) merged into the params of that training step, and ``step_forward_flops(seq_len,
  inputs)``: the forward FLOPs of a step with those inputs.

The code of a kind is found here, by the config's ``kind`` (:data:`KINDS`); a model of a kind
this registry does not know (a third-party model trained by saffu's trainer) brings its own
``init(key)`` and ``logits(params, tokens)`` methods, which these functions call:

* :func:`model_init` ``(config, key) -> params``: random init (cold start), a pytree of arrays;
* :func:`model_logits` ``(config, params, tokens int32[B, S]) -> float[B, S, V]``: position ``p``
  predicts token ``p + 1``; ``params`` is always a jit argument, never a constant;
* :func:`config_from_dict`: a config back from its ``dataclasses.asdict`` form (a run's
  ``config.json``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import SaffuError
from saffu.configs import BigramConfig, ExactConfig, FactorisedConfig, Params, ResidualConfig, SaffuConfig, TransformerConfig
from saffu.data.tokenizer import PAD_ID
from saffu.models import bigram, exact, factorised, residual, transformer
from saffu.models import saffu as saffu_model
from saffu.models.fused_loss import linear_nll_sum

#: Every model kind: its config class, and (but the residual's, which wraps the others and
#: imports this module) its random init and its logits, ``(params, config, tokens)``.
KINDS = {"saffu": (SaffuConfig, saffu_model.init_params, saffu_model.saffu_logits),
         "transformer": (TransformerConfig, transformer.transformer_init, transformer.transformer_logits),
         "exact": (ExactConfig, None, exact.exact_logits),
         "factorised": (FactorisedConfig, factorised.init_params, factorised.factorised_logits),
         "bigram": (BigramConfig, None, lambda params, config, tokens: bigram.bigram_logits(params, tokens)),
         "residual": (ResidualConfig, None, None)}


def _kind(config) -> str:
    """``config``'s registered kind, or ``"external"`` for a model that brings its own ``logits``."""
    kind = getattr(config, "kind", None)
    if kind in KINDS:
        return kind
    if callable(getattr(config, "logits", None)):
        return "external"
    raise SaffuError(f"not a model config: {type(config).__name__} (kinds: {', '.join(KINDS)}; or a model with "
                     f"its own init and logits methods)")


def trainable(config) -> bool:
    """Whether a model kind has a random init (and so can be trained from one): all but the
    exact model and the bigram layer, which are solved."""
    kind = _kind(config)
    return kind in ("residual", "external") or KINDS[kind][1] is not None


def model_init(config, key: jax.Array) -> Params:
    """Random init (cold start) of any model kind with a trainable init: a pytree of arrays.
    A residual's is its trainable part with the output layer at zero
    (:func:`saffu.models.residual.residual_init`; the explicit tables are added by
    :func:`~saffu.models.residual.with_explicit`)."""
    kind = _kind(config)
    if kind == "external":
        return config.init(key)
    if kind == "residual":
        return residual.residual_init(config, key, model_init)        # the residual wraps the other kinds
    init = KINDS[kind][1]
    if init is None:
        raise SaffuError(f"a {kind} model has no random init: it is solved (its explicit solution is its start)")
    return init(config, key)


def model_logits(config, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits of any model kind: ``tokens int32[B, S]`` -> ``float[B, S, V]``, position ``p``
    predicting token ``p + 1``."""
    kind = _kind(config)
    if kind == "external":
        return config.logits(params, tokens)
    if kind == "residual":
        return residual.residual_logits(params, config, tokens, model_logits)
    return KINDS[kind][2](params, config, tokens)


def config_from_dict(fields: dict):
    """A model config from its ``dataclasses.asdict`` form (``kind`` names its class; no
    ``kind``: SAFFU, as runs saved before kinds were recorded)."""
    kind = fields.get("kind", "saffu")
    if kind not in KINDS:
        raise SaffuError(f"unknown model kind {kind!r}; this saffu knows {', '.join(KINDS)}")
    if kind == "residual":   # the two parts are configs of their own
        fields = {**fields, "base": config_from_dict(fields["base"]), "explicit": config_from_dict(fields["explicit"]),
                  "fold_runs": tuple(fields.get("fold_runs", ())), "fold_sha256": tuple(fields.get("fold_sha256", ()))}
    if kind == "exact":     # JSON lists back to the hashable tuples of the config
        fields = {**fields, "groups": tuple(tuple(g) for g in fields["groups"]), "buckets": tuple(fields["buckets"])}
    if kind == "saffu" and "exact_positions" in fields:
        fields = {**fields, "exact_positions": tuple(fields["exact_positions"])}
    if kind == "bigram":
        fields = {k: v for k, v in fields.items() if k != "kind"}
    if kind == "transformer":   # runs saved before the llama block became the default are gpt blocks with a bias
        fields = {"block": "gpt", "output_bias": True, **fields}
    return KINDS[kind][0](**fields)


def window_nll(params: Params, config, windows: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-target NLL (nats) ``float32[B, T]`` of ``windows int32[B, R + T]`` whose first
    ``R = config.context`` tokens are context only; zero where ``mask bool[B, T]`` is False.
    ``config`` is any model config (see the module docstring). The reference formula (the
    whole window's logits, a ``V``-wide log-softmax, a gather), which the tests compare against;
    training and scoring call :func:`target_nll`, which gives the same values at less cost."""
    context = config.context
    logits = model_logits(config, params, windows)[:, context - 1:-1]
    targets = windows[:, context:]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0] * mask


def window_loss(params: Params, config, windows: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed NLL (nats) and target count of :func:`window_nll`'s windows."""
    return jnp.sum(window_nll(params, config, windows, mask)), jnp.sum(mask)


def positional(config) -> bool:
    """Whether the model reads absolute positions that :func:`target_logits` can be given (the
    transformer, or a residual over one): its predictions change when a document moves inside
    the window unless each token's ``positions`` are passed. False for every other kind (a model
    that brings its own logits included: it takes no positions)."""
    kind = _kind(config)
    return kind == "transformer" or (kind == "residual" and positional(config.base))


def _local_target_logits(params: Params, config: ExactConfig, tokens: jax.Array, context: int,
                         base: jax.Array | None = None, scale: jax.Array | float = 1.0) -> jax.Array:
    """The exact model's logits predicting ``tokens[:, context:]`` (its prediction at ``p``
    reads only ``tokens[p − config.context + 1 … p]`` inside its document): run on that slice of
    the window alone (``<pad>`` on the left where the window holds fewer tokens of context), its
    ``V``-wide rows at the predicting positions only: ``float32[B, S − context, V]``; with
    ``base`` (that shape) and ``scale``, ``base + scale · logits``."""
    radius = config.context
    head = tokens[:, max(context - radius, 0):-1]
    if radius > context:
        head = jnp.pad(head, ((0, 0), (radius - context, 0)), constant_values=PAD_ID)
    return exact.exact_logits(params, config, head, first=radius - 1, base=base, scale=scale)


def _explicit_target_logits(params: Params, config, windows: jax.Array, context: int,
                            trained: jax.Array) -> jax.Array:
    """A residual's ``trained + λ · e`` predicting ``windows[:, context:]``: ``float32[B, T, V]``,
    ``e`` its explicit logits (tables' gradient stopped, no log-softmax) added into
    ``trained float32[B, T, V]`` (``f_θ``'s logits). With a ``"fold"`` input (a cross-fitted
    training step) that fold's tables, chosen by ``lax.switch`` (only its lookup runs);
    otherwise the whole split's."""
    scale = params["scale"].astype(jnp.float32)
    lookup = lambda tables, windows, trained, scale: _local_target_logits(
        jax.tree.map(jax.lax.stop_gradient, tables), config.explicit, windows, context, trained, scale)
    if "fold" in params:
        branches = [lambda *args, tables=tables: lookup(tables, *args) for tables in params["folds"]]
        return jax.lax.switch(params["fold"], branches, windows, trained, scale)
    return lookup(params["explicit"], windows, trained, scale)


def target_logits(params: Params, config, windows: jax.Array, context: int | None = None,
                  positions: jax.Array | None = None) -> jax.Array:
    """Logits predicting ``windows[:, context:]`` (``context`` defaults to ``config.context``):
    ``windows int32[B, context + T]`` -> ``float32[B, T, V]``, equal to ``model_logits(...)[:,
    context - 1:-1]`` (a residual's up to a constant per position: its explicit part's
    log-softmax is left out, the log-probabilities are the same) but computing as little of the
    context positions as the kind allows (the transformer's output layer and the exact model's
    lookups run at predicting positions only).
    ``positions int32[B, context + T]``: each token's absolute position for a :func:`positional`
    model (``None``: ``0 …``); ignored by the others, which read only a document's own tokens."""
    context = config.context if context is None else context
    kind = _kind(config)
    if kind == "transformer":
        return transformer.transformer_logits(params, config, windows[:, :-1], positions=None if positions is None
                                              else positions[:, :-1], predict_from=context - 1)
    if kind == "exact":
        return _local_target_logits(params, config, windows, context)
    if kind == "residual":
        trained = target_logits(residual.base_params(params, config), config.base, windows, context, positions)
        if "scale" not in params:
            return trained
        # λ · e + f: the explicit part's log-softmax shifts each position's logits by a constant,
        # which the NLL's own normalisation cancels (log-probabilities are unchanged); f is the
        # buffer the explicit part is added into
        return _explicit_target_logits(params, config, windows, context, trained.astype(jnp.float32))
    if positions is not None and kind == "external":
        raise SaffuError("a model that brings its own logits cannot be given token positions")
    return model_logits(config, params, windows)[:, context - 1:-1]


def target_nll(params: Params, config, windows: jax.Array, mask: jax.Array, context: int | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """:func:`window_nll` at a forward pass's cost: per-target NLL (nats) ``float32[B, T]`` of
    ``windows int32[B, context + T]`` (zero where ``mask bool[B, T]`` is False), as
    ``logsumexp(logits) − logits[target]`` over :func:`target_logits` (no ``V``-wide
    log-softmax array). ``context`` and ``positions`` as in :func:`target_logits`; by default
    the values equal :func:`window_nll`'s up to float32 rounding."""
    context = config.context if context is None else context
    logits = target_logits(params, config, windows, context, positions).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, windows[:, context:, None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits, axis=-1) - picked) * mask


def target_loss(params: Params, config, windows: jax.Array, mask: jax.Array,
                dropout: transformer.Dropout | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Summed NLL (nats, ``float32[]``) and target count (``int32[]``) of :func:`target_nll`'s
    windows ``int32[B, R + T]`` with ``mask bool[B, T]``: :func:`window_loss`'s values, for training and scoring.

    A transformer's output layer and cross-entropy run fused, chunk by chunk
    (:func:`saffu.models.fused_loss.linear_nll_sum`: no ``B × T × V`` logits; under
    differentiation the gradient comes with the loss); the values are the same up to float32
    rounding. ``dropout``: a training step's residual dropout (the transformer only);
    ``positions int32[B, R + T]``: each token's position, for a :func:`positional` model (as in
    :func:`target_logits`)."""
    if dropout is not None and _kind(config) != "transformer":
        raise SaffuError(f"dropout is a transformer's; a {_kind(config)} model trains without it (--dropout 0)")
    if _kind(config) == "transformer":
        context = config.context
        h = transformer.transformer_features(params, config, windows[:, :-1], predict_from=context - 1,
                                             dropout=dropout,
                                             positions=None if positions is None else positions[:, :-1])
        output = params["output"]
        kernel = output["kernel"]
        bias = output.get("bias", jnp.zeros(kernel.shape[1], kernel.dtype))
        nll = linear_nll_sum(h.reshape(-1, h.shape[-1]), kernel, bias, windows[:, context:].reshape(-1),
                             mask.reshape(-1).astype(jnp.float32))
        return nll, jnp.sum(mask)
    return jnp.sum(target_nll(params, config, windows, mask, positions=positions)), jnp.sum(mask)


def parameter_count(params: Params) -> int:
    """Number of scalars in the parameter pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
