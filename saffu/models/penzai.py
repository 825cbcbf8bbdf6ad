"""penzai's transformers as a saffu model kind (``penzai``; ``pip install -e '.[models]'``):
``saffu train --model penzai`` trains one, its run folder holds its config like any other
(``config.json``'s ``model``: :class:`saffu.configs.PenzaiConfig`), and ``saffu eval``, resuming
and the harness model rebuild it from there.

penzai builds its Llama-like transformer (``family="llama"``; untied, or one matrix for the
embeddings and the output with ``tied``) or its GPT-NeoX (``"neox"``). Its parameters, penzai's
``ParameterValue`` s, become a plain dict ``{label: float32 array}`` (the named axes in penzai's
order), which the trainer optimises like any parameter tree; an explicit start
(:func:`explicit_penzai_init`) sets the leaves :meth:`PenzaiConfig.selectors` names. penzai is
imported only when a model is built, so registering the kind needs no penzai.
"""

from __future__ import annotations

import jax
import numpy as np

from saffu._io import SaffuError
from saffu.configs import (
    EXPLICIT_PIECES,
    PENZAI_EMBEDDING,
    PENZAI_OUTPUT,
    TIED_CHOICES,
    Params,
    PenzaiConfig,
)
from saffu.models.kinds import ModelKind


def _penzai():
    try:
        import penzai
    except ImportError:
        raise SaffuError("penzai is not installed: pip install -e '.[models]'") from None
    return penzai


def build(config: PenzaiConfig, key: jax.Array):
    """penzai's model of ``config`` with its random init drawn from ``key``."""
    _penzai()
    from penzai.models.transformer.variants import gpt_neox, llamalike_common
    if config.family == "llama":
        settings = llamalike_common.LlamalikeTransformerConfig(
            num_kv_heads=config.heads, query_head_multiplier=1, embedding_dim=config.width,
            projection_dim=config.width // config.heads, mlp_hidden_dim=config.mlp * 2 // 3,
            num_decoder_blocks=config.layers, vocab_size=config.vocab_size, mlp_variant="swiglu",
            tie_embedder_and_logits=config.tied)
        return llamalike_common.build_llamalike_transformer(settings, init_base_rng=key)
    settings = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=config.heads, embedding_dim=config.width, projection_dim=config.width // config.heads,
        mlp_hidden_dim=config.mlp, num_decoder_blocks=config.layers, vocab_size=config.vocab_size,
        activation_fn="gelu_approx", rope_subset_size=(config.width // config.heads) // 4, rope_wavelength=10_000,
        layernorm_epsilon=1e-5, parameter_dtype="float32", activation_dtype="float32")
    return gpt_neox.build_gpt_neox_transformer(settings, init_base_rng=key)


def penzai_init(config: PenzaiConfig, key: jax.Array) -> Params:
    """penzai's random init of ``config`` as ``{label: float32 array}`` (the embeddings
    ``[V, d]`` at ``1/√d``, the untied output kernel ``[d, V]``)."""
    from penzai import pz
    _, values = pz.unbind_params(build(config, key), freeze=True)
    return {v.label: v.value.unwrap(*v.value.named_shape) for v in values}


def penzai_logits(params: Params, config: PenzaiConfig, tokens: jax.Array) -> jax.Array:
    """``float32[B, S, V]`` of ``tokens int32[B, S]``, position ``p`` predicting ``p + 1``."""
    from penzai import pz
    # built inside the trace, so the model's own constants (scales, rotary tables) are traced
    # values rather than arrays captured by the executable; the unused random init is dead code
    unbound, values = pz.unbind_params(build(config, jax.random.key(0)), freeze=True)
    values = [pz.ParameterValue(label=v.label, value=pz.nx.wrap(params[v.label]).tag(*v.value.named_shape))
              for v in values]
    named = pz.bind_variables(unbound, values)(pz.nx.wrap(tokens).tag("batch", "seq"))
    return named.unwrap("batch", "seq", "vocabulary")


def _rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _at_rms(matrix: np.ndarray, rms: float, like: jax.Array) -> jax.Array:
    """``matrix`` rescaled to root-mean-square ``rms`` (kept where either is zero), in ``like``'s dtype."""
    own = _rms(matrix)
    return jax.numpy.asarray(matrix * (rms / own) if rms > 0 and own > 0 else matrix, dtype=like.dtype)


def tied_matrix(embedding: np.ndarray, output: np.ndarray, choice: str = "mean") -> np.ndarray:
    """One ``float32[V, r]`` matrix for a model whose embedding is also its output kernel, from
    the explicit embeddings ``E_0`` (``embedding [V, r]``) and output factor ``B`` (``output
    [r, V]``): ``"embedding"`` (``E_0``), ``"output"`` (``Bᵀ``) or ``"mean"`` (the two at equal
    root-mean-square, averaged)."""
    if choice not in TIED_CHOICES:
        raise SaffuError(f"unknown tied choice {choice!r}; choose from {', '.join(TIED_CHOICES)}")
    E, B = np.asarray(embedding, np.float64), np.asarray(output, np.float64).T
    if choice == "embedding":
        return E.astype(np.float32)
    if choice == "output":
        return B.astype(np.float32)
    return (0.5 * (E / _rms(E) + B / _rms(B))).astype(np.float32)


def explicit_penzai_init(config: PenzaiConfig, key: jax.Array, factors: Params | None, start) -> Params:
    """Random init (:func:`penzai_init` with ``key``) with the pieces ``start.explicit_pieces``
    (a :class:`saffu.configs.StartConfig`) taken from the explicit low-rank factors of
    :func:`saffu.solve.factors.solve_factorised` at rank ``r = config.width``
    (``factors["embeddings"] float32[P, V, r]``, ``["output_weights"] float32[r, V]``; ``None``
    when no piece is taken):

    * ``"embeddings"``: the token embeddings are ``E_0`` at ``start.explicit_embedding_rms``
      (default: the random embeddings' own root-mean-square); tied, the one matrix is
      :func:`tied_matrix` of ``start.explicit_tied`` at that scale;
    * ``"output"``: the untied output kernel is ``B`` at ``start.explicit_output_rms`` (default:
      the random kernel's);
    * ``"bias"``: nothing (neither family has an output bias);
    * no ``"embeddings"`` with ``start.explicit_embedding_rms`` given: the random embeddings
      rescaled to it (the scale ablation of an explicit start).

    The blocks stay random; the parameter tree and every shape are those of random init."""
    pieces = tuple(start.explicit_pieces)
    unknown = set(pieces) - set(EXPLICIT_PIECES)
    if unknown:
        raise SaffuError(f"unknown explicit-init pieces {sorted(unknown)}; choose from {', '.join(EXPLICIT_PIECES)}")
    params = penzai_init(config, key)
    embedding_rms, output_rms = start.explicit_embedding_rms, start.explicit_output_rms
    random = params[PENZAI_EMBEDDING]
    if {"embeddings", "output"} & set(pieces):
        E, B = np.asarray(factors["embeddings"][0]), np.asarray(factors["output_weights"])
        if E.shape != (config.vocab_size, config.width) or B.shape != (config.width, config.vocab_size):
            raise SaffuError(f"explicit factors of shape {E.shape} / {B.shape} do not fit a penzai model of width "
                             f"{config.width} and {config.vocab_size:,} tokens; solve them at rank {config.width}")
    if config.tied and "embeddings" in pieces:
        params[PENZAI_EMBEDDING] = _at_rms(tied_matrix(E, B, start.explicit_tied), embedding_rms or _rms(random), random)
    elif "embeddings" in pieces:
        params[PENZAI_EMBEDDING] = _at_rms(E, embedding_rms or _rms(random), random)
    elif embedding_rms is not None:
        params[PENZAI_EMBEDDING] = _at_rms(np.asarray(random, np.float64), embedding_rms, random)
    if "output" in pieces and not config.tied:
        kernel = params[PENZAI_OUTPUT]
        params[PENZAI_OUTPUT] = _at_rms(B, output_rms or _rms(kernel), kernel)
    return params


#: The model kind (:mod:`saffu.models.kinds`): a model penzai builds, started at random or
#: explicitly from the explicit factors.
KIND = ModelKind("penzai", PenzaiConfig, penzai_logits, init=penzai_init, explicit_init=explicit_penzai_init)
