"""The model interface and the kind registry: what the trainer, the evaluators and BLiMP call,
and the losses written against it.

A model is its config (:mod:`saffu.configs`: :class:`~saffu.configs.SaffuConfig`,
:class:`~saffu.configs.TransformerConfig`, :class:`~saffu.configs.ExactConfig`,
:class:`~saffu.configs.FactorisedConfig`, :class:`~saffu.configs.ResidualConfig`,
:class:`~saffu.configs.BigramConfig`, :class:`~saffu.configs.PenzaiConfig`), a frozen dataclass
of plain data — hashable, so it is a static jit argument — naming its ``kind`` and giving

* ``context``: tokens of left context a prediction may read;
* ``forward_flops(seq_len) -> float``: analytic forward FLOPs per predicted token;
* ``eval_seq_len``: targets per evaluation window;
* optionally ``fixed_params``: top-level parameter names that are inputs, never trained;
* optionally ``step_inputs(step, steps) -> dict``: per-step inputs (e.g. self-guided training's
  ``guide_alpha``) merged into the params of that training step, and ``step_forward_flops(seq_len,
  inputs)``: the forward FLOPs of a step with those inputs.

The code of a kind is its record (:class:`saffu.models.kinds.ModelKind`), which each model
module registers next to its code (``KIND``) and :data:`KINDS` collects; :func:`kind_of` finds a
config's. A model of a kind this registry does not know (a third-party model trained by saffu's
trainer) brings its own ``init(key)`` and ``logits(params, tokens)`` methods, which these
functions call:

* :func:`model_init` ``(config, key) -> params``: random init (cold start), a pytree of arrays;
* :func:`model_logits` ``(config, params, tokens int32[B, S]) -> float[B, S, V]``: position ``p``
  predicts token ``p + 1``; ``params`` is always a jit argument, never a constant;
* :func:`config_from_dict`: a config back from its ``dataclasses.asdict`` form (a run's
  ``config.json``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import SaffuError
from saffu.configs import Params, ResidualConfig
from saffu.models import bigram, exact, factorised, penzai, residual, transformer
from saffu.models import saffu as saffu_model
from saffu.models.kinds import ModelKind


def _no_positions(params, config, windows, context, positions=None):
    if positions is not None:
        raise SaffuError("a model that brings its own logits cannot be given token positions")
    return config.logits(params, windows)[:, context - 1:-1]


#: The record of a model that brings its own ``init(key)`` and ``logits(params, tokens)``.
EXTERNAL = ModelKind("external", object, lambda params, config, tokens: config.logits(params, tokens),
                     init=lambda config, key: config.init(key), target_logits=_no_positions)


def _residual_fields(fields: dict) -> ResidualConfig:
    """A residual config from its ``dataclasses.asdict`` form: its two parts are configs of their own."""
    return ResidualConfig(**{**fields, "base": config_from_dict(fields["base"]),
                             "explicit": config_from_dict(fields["explicit"]),
                             "fold_runs": tuple(fields.get("fold_runs", ())),
                             "fold_sha256": tuple(fields.get("fold_sha256", ()))})


def _residual_target_logits(params: Params, config: ResidualConfig, windows: jax.Array, context: int,
                            positions: jax.Array | None = None) -> jax.Array:
    trained = target_logits(residual.base_params(params, config), config.base, windows, context, positions)
    if "scale" not in params:
        return trained
    # λ · e + f: the explicit part's log-softmax shifts each position's logits by a constant,
    # which the NLL's own normalisation cancels (log-probabilities are unchanged); f is the
    # buffer the explicit part is added into
    return _explicit_target_logits(params, config, windows, context, trained.astype(jnp.float32))


#: The explicit residual over another kind: it wraps the others, so its record lives here.
RESIDUAL = ModelKind(
    "residual", ResidualConfig,
    lambda params, config, tokens: residual.residual_logits(params, config, tokens, model_logits),
    init=lambda config, key: residual.residual_init(config, key, model_init, kind_of(config.base).zero_output),
    from_fields=_residual_fields, target_logits=_residual_target_logits)

#: Every model kind by name: each registered next to its code (``KIND`` in its module), and the residual.
KINDS = {kind.name: kind for kind in (saffu_model.KIND, transformer.KIND, exact.KIND, factorised.KIND,
                                      bigram.KIND, penzai.KIND, RESIDUAL)}


def kind_of(config) -> ModelKind:
    """``config``'s registered kind (:class:`~saffu.models.kinds.ModelKind`), or the record of a
    model that brings its own ``init`` and ``logits`` methods (``name == "external"``)."""
    kind = KINDS.get(getattr(config, "kind", None))
    if kind is not None and isinstance(config, kind.config):
        return kind
    if callable(getattr(config, "logits", None)):
        return EXTERNAL
    raise SaffuError(f"not a model config: {type(config).__name__} (kinds: {', '.join(KINDS)}; or a model with "
                     f"its own init and logits methods)")


def base_of(config):
    """The model a residual trains (``f_θ``, its ``base``), or ``config`` itself: the model whose
    architecture (positions, attention, document locality) a question about ``config`` is about."""
    return config.base if isinstance(config, ResidualConfig) else config


def traits(config) -> ModelKind:
    """The kind of :func:`base_of` ``config``: what its predictions read (positions, documents)
    and how it attends."""
    return kind_of(base_of(config))


def trainable(config) -> bool:
    """Whether a model kind has a random init (and so can be trained from one): all but the
    exact model and the bigram layer, which are solved."""
    return kind_of(config).init is not None


def model_init(config, key: jax.Array) -> Params:
    """Random init (cold start) of any model kind with a trainable init: a pytree of arrays.
    A residual's is its trainable part with the output layer at zero
    (:func:`saffu.models.residual.residual_init`; the explicit tables are added by
    :func:`~saffu.models.residual.with_explicit`)."""
    kind = kind_of(config)
    if kind.init is None:
        raise SaffuError(f"a {kind.name} model has no random init: it is solved (its explicit solution is its start)")
    return kind.init(config, key)


def model_logits(config, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits of any model kind: ``tokens int32[B, S]`` -> ``float[B, S, V]``, position ``p``
    predicting token ``p + 1``."""
    return kind_of(config).logits(params, config, tokens)


def config_from_dict(fields: dict):
    """A model config from its ``dataclasses.asdict`` form (``kind`` names its class; no
    ``kind``: SAFFU, as runs saved before kinds were recorded)."""
    name = fields.get("kind", "saffu")
    if name not in KINDS:
        raise SaffuError(f"unknown model kind {name!r}; this saffu knows {', '.join(KINDS)}")
    return KINDS[name].load(fields)


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
    that brings its own logits included: it takes no positions), and for a transformer that
    attends across documents (``across_documents``: its earlier documents are context, so a
    document is scored from where it sits in the window, as it was trained)."""
    return traits(config).positional(base_of(config))


def read_alone(config):
    """The config that reads one document alone (after its ``<eod>``, behind nothing but
    ``<pad>``) exactly as ``config`` does, and whose rows may hold many documents that never see
    each other: ``config``, or for a transformer that attends across documents (or a residual
    over one) the same model, document-local. BLiMP's sentences and a harness's texts are read so,
    packed many to a row (:mod:`saffu.eval.blimp`, :func:`saffu.eval.scoring.document_nll`)."""
    alone = traits(config).alone
    if alone is None:
        return config
    return dataclasses.replace(config, base=alone(config.base)) if isinstance(config, ResidualConfig) else alone(config)


def _explicit_target_logits(params: Params, config, windows: jax.Array, context: int,
                            trained: jax.Array) -> jax.Array:
    """A residual's ``trained + λ · e`` predicting ``windows[:, context:]``: ``float32[B, T, V]``,
    ``e`` its explicit logits (tables' gradient stopped, no log-softmax) added into
    ``trained float32[B, T, V]`` (``f_θ``'s logits). With a ``"fold"`` input (a cross-fitted
    training step) that fold's tables, chosen by ``lax.switch`` (only its lookup runs);
    otherwise the whole split's."""
    scale = params["scale"].astype(jnp.float32)
    lookup = lambda tables, windows, trained, scale: exact.exact_target_logits(
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
    kind = kind_of(config)
    if kind.target_logits is not None:
        return kind.target_logits(params, config, windows, context, positions)
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
    fused = kind_of(config).fused_loss
    if fused is not None:
        return fused(params, config, windows, mask, dropout, positions)
    if dropout is not None:
        raise SaffuError(f"dropout is a transformer's; a {kind_of(config).name} model trains without it (--dropout 0)")
    return jnp.sum(target_nll(params, config, windows, mask, positions=positions)), jnp.sum(mask)


def parameter_count(params: Params) -> int:
    """Number of scalars in the parameter pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
