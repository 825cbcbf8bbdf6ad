"""The project's transformer in flax NNX: the llama block (RMSNorm, rotary positions, SwiGLU, no
biases) or GPT-2's (LayerNorm, learned absolute positions, GELU MLP), an untied output layer with
or without a bias, trained by the same trainer on the same windows.

It speaks the model interface every kind does (:mod:`saffu.models.interface`), so
:func:`saffu.training.trainer.train`, evaluation, sampling and BLiMP scoring take it like any
other: :func:`transformer_init` ``(config, key) -> params`` (a nested dict of arrays) and
:func:`transformer_logits` ``(params, config, tokens int32[B, S]) -> float32[B, S, V]`` are
what ``model_init`` and ``model_logits`` call for ``kind="transformer"``.

Attention is causal. With ``TransformerConfig.across_documents`` (the default) a position reads
every earlier token but ``<pad>``, so the earlier documents of a window (BabyLM's documents are
lines) are context too; without it attention never crosses an ``<eod>``: position ``p`` sees ``q ≤ p`` iff no
``<eod>`` lies in ``(q, p]`` (as the SAFFU windows do), so a window that starts inside an
earlier document, or ``<pad>`` before a document, is invisible.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from saffu._io import SaffuError
from saffu.configs import EXPLICIT_PIECES, SAVED_BEFORE, Params, TransformerConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.models.fused_loss import linear_nll_sum
from saffu.models.kinds import ModelKind
from saffu.models.structured import StructuredLinear, from_dense, structure_size


def _mlp_layer(config: TransformerConfig, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Module:
    if config.ffn == "dense":
        return nnx.Linear(n_in, n_out, rngs=rngs)
    return StructuredLinear(n_in, n_out, config.ffn, config.ffn_share, config.ffn_blocks,
                            guided=config.guide_share > 0, rngs=rngs)


def _projections(module: nnx.MultiHeadAttention, x: jax.Array, rotary: jax.Array | None) -> tuple[jax.Array, ...]:
    """Queries, keys and values ``3 × [B, H, S, k]`` of ``x float[B, S, d]`` as one product (the
    queries and keys rotated by ``rotary int32[B, S]`` where given)."""
    batch, length, d = x.shape
    parts = (module.query, module.key, module.value)
    kernel = jnp.concatenate([part.kernel[...] for part in parts], axis=1)
    qkv = x.reshape(-1, d) @ kernel.reshape(d, 3 * d)
    if module.query.bias is not None:
        qkv = qkv + jnp.concatenate([part.bias[...] for part in parts], axis=0).reshape(1, 3 * d)
    q, k, v = qkv.reshape(batch, length, 3, module.num_heads, d // module.num_heads).transpose(2, 0, 3, 1, 4)
    if rotary is not None:
        q, k = rotate(q, rotary), rotate(k, rotary)
    return q, k, v


def attention_weights(module: nnx.MultiHeadAttention, x: jax.Array, mask: jax.Array,
                      rotary: jax.Array | None = None) -> jax.Array:
    """The post-softmax attention weights ``float32[B, H, S, S]`` (query × key) of
    :func:`self_attention` (``mask bool[B, 1, S, S]``; ``rotary``: the llama block's positions)."""
    q, k, _ = _projections(module, x, rotary)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def self_attention(module: nnx.MultiHeadAttention, x: jax.Array, mask: jax.Array,
                   rotary: jax.Array | None = None) -> jax.Array:
    """``module(x, mask=mask)`` (flax's multi-head self-attention, its parameters and its
    result) computed faster on a CPU: the query, key and value projections as one product
    ``[B·S, d] @ [d, 3d]``, and the softmax attention window by window with its backward pass
    written out (:func:`_softmax_attention`). ``x float[B, S, d]``, ``mask bool[B, 1, S, S]``
    (query × key) -> ``float[B, S, d]``. ``rotary int32[B, S]``: each token's position, by which
    the queries and keys are rotated (:func:`rotate`; the llama block). Projections without
    biases (``use_bias=False``) are supported."""
    batch, length, d = x.shape
    q, k, v = _projections(module, x, rotary)
    mixed = _softmax_attention(q * jnp.asarray(1 / math.sqrt(d // module.num_heads), q.dtype), k, v, mask)
    mixed = mixed.transpose(0, 2, 1, 3).reshape(-1, d)                                     # [B·S, H·k]
    out = mixed @ module.out.kernel[...].reshape(d, d)
    if module.out.bias is not None:
        out = out + module.out.bias[...][None]
    return out.reshape(batch, length, d)


#: Rotary positions' base: head dimension pair ``i`` turns by ``position · ROPE_BASE^(−2i/k)``.
ROPE_BASE = 10_000.0


def rotate(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary positions: ``x float[B, H, S, k]`` (queries or keys) turned by each token's
    ``positions int32[B, S]``, the two halves of the head dimension as the pairs (Hugging Face
    Llama's layout: ``x · cos + rotate_half(x) · sin``). A query and a key then score by their
    distance alone."""
    half = x.shape[-1] // 2
    frequencies = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)                # [k/2]
    angles = positions[:, None, :, None].astype(jnp.float32) * frequencies[None, None, None]  # [B, 1, S, k/2]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _window_scores(q, k, mask):
    """A window's masked scores ``float32[H, S, S]`` (``q, k [H, S, k]``, ``mask bool[1, S, S]``)."""
    scores = jnp.einsum("hqd,hkd->hqk", q, k, preferred_element_type=jnp.float32)
    return jnp.where(mask, scores, jnp.finfo(jnp.float32).min)


def _window_attention(q, k, v, mask):
    """One window's attention output ``[H, S, k]`` and log-sum-exp ``float32[H, S]`` of its scores."""
    scores = _window_scores(q, k, mask)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("hqk,hkd->hqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32) / total
    return out.astype(v.dtype), (top + jnp.log(total))[..., 0]


@jax.custom_vjp
def _softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """``softmax(q kᵀ, masked) v`` per head: ``q, k, v [B, H, S, k]`` (``q`` already scaled),
    ``mask bool[B, 1, S, S]`` -> ``[B, H, S, k]``, window by window."""
    return jax.lax.map(lambda args: _window_attention(*args)[0], (q, k, v, mask))


def _attention_fwd(q, k, v, mask):
    out, lse = jax.lax.map(lambda args: _window_attention(*args), (q, k, v, mask))
    return out, (q, k, v, mask, out, lse)


def _attention_bwd(residuals, d_out):
    """Per window: the weights ``P`` again from the scores and the log-sum-exp, then the
    softmax's backward as ``P ⊙ (dP − rowsum(dO ⊙ O))`` (``rowsum(dP ⊙ P) = rowsum(dO ⊙ O)``)."""
    def window(args):
        q, k, v, mask, out, lse, d_out = args
        weights = jnp.exp(_window_scores(q, k, mask) - lse[..., None])
        d_weights = jnp.einsum("hqd,hkd->hqk", d_out, v, preferred_element_type=jnp.float32)
        rows = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
        d_scores = (weights * (d_weights - rows)).astype(q.dtype)
        return (jnp.einsum("hqk,hkd->hqd", d_scores, k), jnp.einsum("hqk,hqd->hkd", d_scores, q),
                jnp.einsum("hqk,hqd->hkd", weights.astype(d_out.dtype), d_out).astype(v.dtype))

    q, k, v, mask, out, lse = residuals
    d_q, d_k, d_v = jax.lax.map(window, (q, k, v, mask, out, lse, d_out))
    return d_q, d_k, d_v, None


_softmax_attention.defvjp(_attention_fwd, _attention_bwd)


class Dropout(NamedTuple):
    """Residual dropout of one training step: each element is zeroed with probability ``rate``
    and the rest scaled by ``1 / (1 − rate)`` (inverted dropout: nothing changes at evaluation).

    Attributes:
      rate: the drop probability, in ``(0, 1)`` (a Python float: a rate of 0 is no ``Dropout``).
      key: this step's PRNG key; :meth:`at` derives one per layer, :meth:`apply` one per use.
    """

    rate: float
    key: jax.Array

    def at(self, layer: int) -> Dropout:
        """The dropout of layer ``layer`` (0: the embedded input; ``i + 1``: block ``i``)."""
        return Dropout(self.rate, jax.random.fold_in(self.key, layer))

    def apply(self, x: jax.Array, use: int) -> jax.Array:
        """``x`` (any shape) with dropout, the mask drawn from use ``use`` of this layer's key."""
        keep = jax.random.bernoulli(jax.random.fold_in(self.key, use), 1.0 - self.rate, x.shape)
        return jnp.where(keep, x * (1.0 / (1.0 - self.rate)), jnp.zeros((), x.dtype)).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + MLP(norm(x))``. The gpt block: LayerNorm,
    biased projections, a GELU MLP whose two layers are dense or structured
    (:mod:`saffu.models.structured`, ``config.ffn``). The llama block: RMSNorm, projections
    without biases, queries and keys rotated by position (:func:`rotate`), a SwiGLU MLP
    ``mlp_out(silu(mlp_gate(h)) · mlp_in(h))``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d = config.width
        self.llama = config.block == "llama"
        norm = nnx.RMSNorm if self.llama else nnx.LayerNorm
        self.attention_norm = norm(d, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=config.heads, in_features=d, decode=False,
                                                use_bias=not self.llama, rngs=rngs)
        self.mlp_norm = norm(d, rngs=rngs)
        if self.llama:
            self.mlp_gate = nnx.Linear(d, config.mlp_hidden, use_bias=False, rngs=rngs)
            self.mlp_in = nnx.Linear(d, config.mlp_hidden, use_bias=False, rngs=rngs)
            self.mlp_out = nnx.Linear(config.mlp_hidden, d, use_bias=False, rngs=rngs)
        else:
            self.mlp_in = _mlp_layer(config, d, config.mlp_ratio * d, rngs)
            self.mlp_out = _mlp_layer(config, config.mlp_ratio * d, d, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, sow_weights: bool = False,
                 alpha: jax.Array | None = None, dropout: Dropout | None = None,
                 rotary: jax.Array | None = None) -> jax.Array:
        """``dropout``: drop the attention's and the MLP's outputs before each joins the residual
        stream (training only); ``rotary int32[B, S]``: the tokens' positions (the llama block)."""
        drop = (lambda y, i: y) if dropout is None else (lambda y, i: dropout.apply(y, i))
        h = self.attention_norm(x)
        if sow_weights and self.llama:     # flax's attention has no rotary positions: the weights computed here
            self.sow(nnx.Intermediate, "attention_weights", attention_weights(self.attention, h, mask, rotary))
        # flax's own call keeps the gpt block's attention weights; the faster one computes the same
        x = x + drop(self.attention(h, mask=mask, sow_weights=True) if sow_weights and not self.llama
                     else self_attention(self.attention, h, mask, rotary), 0)
        h = self.mlp_norm(x).reshape(-1, x.shape[-1])                                     # [B·S, d]
        if self.llama:
            return x + drop(self.mlp_out(jax.nn.silu(self.mlp_gate(h)) * self.mlp_in(h)).reshape(x.shape), 1)
        guide = () if alpha is None else (alpha,)     # none: dense, structured, or the guide is gone
        return x + drop(self.mlp_out(jax.nn.gelu(self.mlp_in(h, *guide)), *guide).reshape(x.shape), 1)


class Transformer(nnx.Module):
    """``model(tokens int32[B, S]) -> logits float32[B, S, V]`` (position ``p`` predicts ``p + 1``)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.width, rngs=rngs)
        if config.block == "gpt":       # the llama block's positions are rotations, not a table
            self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.max_len, config.width)))
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = (nnx.RMSNorm if config.block == "llama" else nnx.LayerNorm)(config.width, rngs=rngs)
        self.output = nnx.Linear(config.width, config.vocab_size, use_bias=config.output_bias, rngs=rngs)

    def __call__(self, tokens: jax.Array, sow_weights: bool = False, alpha: jax.Array | None = None,
                 positions: jax.Array | None = None, predict_from: int = 0) -> jax.Array:
        """``sow_weights``: also keep every block's post-softmax attention weights
        (``block.attention.attention_weights``, see :func:`transformer_attention`); ``alpha``:
        the dense guide's weight of self-guided training (``None``: the structured MLP alone);
        ``positions int32[B, S]``: each token's position (``None``: ``0 … S − 1``); the logits of
        positions ``predict_from …`` only (the blocks still read every position)."""
        return self.output(self.features(tokens, sow_weights, alpha, positions, predict_from))

    def features(self, tokens: jax.Array, sow_weights: bool = False, alpha: jax.Array | None = None,
                 positions: jax.Array | None = None, predict_from: int = 0,
                 dropout: Dropout | None = None) -> jax.Array:
        """What the output layer reads: the final norm's ``float[B, S − predict_from, d]``
        (:meth:`__call__`'s arguments; ``dropout``: training's residual dropout, on the embedded
        input and on every block's two branches)."""
        length = tokens.shape[1]
        if positions is None and length > self.config.max_len:
            raise SaffuError(f"window of {length} tokens is longer than the transformer's max_len "
                             f"{self.config.max_len}; use a shorter --seq-len or a larger --max-len")
        # the table's own dtype (flax's Embed would cast to the dtype it was built with, float32,
        # and so promote every later product of a bf16 step back to float32)
        x = jnp.take(self.embed.embedding[...], tokens, axis=0)
        rotary = None
        if self.config.block == "llama":
            rotary = positions if positions is not None else jnp.broadcast_to(jnp.arange(length), tokens.shape)
        else:
            table = self.positions[...]
            x = x + (table[None, :length] if positions is None else table[positions])
        mask = causal_mask(tokens, self.config.across_documents)
        if dropout is not None:
            x = dropout.at(0).apply(x, 0)
        for index, block in enumerate(self.blocks):
            x = block(x, mask, sow_weights, alpha, None if dropout is None else dropout.at(index + 1), rotary)
        return self.final_norm(x[:, predict_from:])


def causal_mask(tokens: jax.Array, across_documents: bool = False) -> jax.Array:
    """``bool[B, 1, S, S]``: query ``p`` sees key ``q`` iff ``q ≤ p`` and no ``<eod>`` lies in
    ``(q, p]``; ``across_documents``: iff ``q ≤ p`` and ``q`` is no ``<pad>`` (unless ``p`` is
    one). ``<pad>`` stands for nothing, before a stream's start or a text read alone, so a token
    never reads it and a text behind pads reads as it does alone (as a Hugging Face export reads
    it, and the key/value cache)."""
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
    if across_documents:
        real = tokens != PAD_ID                                                              # [B, S]
        return (causal & (real[:, None, :] | ~real[:, :, None]))[:, None]
    boundaries = jnp.cumsum(tokens == EOD_ID, axis=1)                                  # [B, S]
    same = boundaries[:, :, None] == boundaries[:, None, :]
    return (same & causal)[:, None]


@functools.lru_cache(maxsize=16)
def _graph(config: TransformerConfig):
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)


def transformer_init(config: TransformerConfig, key: jax.Array) -> Params:
    """Random init (flax's initialisers, seeded by ``key``) as a pure nested dict."""
    model = Transformer(config, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _module(params: Params, config: TransformerConfig) -> Transformer:
    graphdef, template = _graph(config)
    state = jax.tree.map(lambda x: x, template)          # a fresh State to fill
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def transformer_logits(params: Params, config: TransformerConfig, tokens: jax.Array,
                       positions: jax.Array | None = None, predict_from: int = 0) -> jax.Array:
    """Next-token logits ``float32[B, S − predict_from, V]`` of ``tokens int32[B, S]`` with the
    params dict, at positions ``predict_from …`` (the output layer runs there only), each token at
    its ``positions int32[B, S]`` (``None``: ``0 … S − 1``; packed sentences read the positions
    they have alone). A self-guided model's ``params["guide_alpha"]`` (``float32[]``, from
    :meth:`TransformerConfig.step_inputs`) mixes in the dense guide; without it the guide is not read."""
    params, alpha = _split_guide(params, config)
    return _module(params, config)(tokens, alpha=alpha, positions=positions, predict_from=predict_from)


def transformer_features(params: Params, config: TransformerConfig, tokens: jax.Array,
                         positions: jax.Array | None = None, predict_from: int = 0,
                         dropout: Dropout | None = None) -> jax.Array:
    """What the output layer reads, ``float[B, S − predict_from, d]`` (the final norm's output):
    :func:`transformer_logits` is ``features @ params["output"]["kernel"] (+ bias)``. Same
    arguments as :func:`transformer_logits`, and training's ``dropout`` (:class:`Dropout`)."""
    params, alpha = _split_guide(params, config)
    return _module(params, config).features(tokens, alpha=alpha, positions=positions, predict_from=predict_from,
                                            dropout=dropout)


def _split_guide(params: Params, config: TransformerConfig) -> tuple[Params, jax.Array | None]:
    """``params`` without a self-guided model's ``"guide_alpha"``, and that weight (``None``: none given)."""
    if "guide_alpha" not in params:
        return params, None
    if not config.guide_share:
        raise SaffuError("a guide weight α was given to a transformer without self-guided training")
    params = dict(params)
    return params, params.pop("guide_alpha")


def drop_guide(params: Params, config: TransformerConfig) -> tuple[TransformerConfig, Params]:
    """A self-guided model after its guided phase: the config without the guide and the params
    without the dense guide kernels (the model computes the same logits; nothing else changes)."""
    if not config.guide_share:
        return config, params
    strip = lambda layer: {name: value for name, value in layer.items() if name != "guide"}
    blocks = {index: {**block, "mlp_in": strip(block["mlp_in"]), "mlp_out": strip(block["mlp_out"])}
              for index, block in params["blocks"].items()}
    return dataclasses.replace(config, guide_share=0.0), {**params, "blocks": blocks}


def transformer_attention(params: Params, config: TransformerConfig, tokens: jax.Array) -> list[jax.Array]:
    """Per block, the post-softmax attention weights ``float32[B, H, S, S]`` (query × key) of
    ``tokens int32[B, S]``; a query's row sums to 1 over the keys it may see."""
    forward = nnx.capture(lambda model, tokens: model(tokens, sow_weights=True), nnx.Intermediate)
    _, sown = forward(_module(params, config), tokens)
    blocks = nnx.to_pure_dict(sown)["blocks"]
    return [(blocks[index]["attention"] if "attention" in blocks[index] else blocks[index])["attention_weights"][0]
            for index in range(config.layers)]


def sized_like(vocab_size: int, target_params: int, width: int = 128, heads: int = 4,
               context_tokens: int = 32, max_len: int = 512) -> TransformerConfig:
    """The config of width ``width`` whose layer count brings its parameter count nearest to
    ``target_params`` (at least one layer)."""
    def count(layers):
        config = TransformerConfig(vocab_size, width, layers, heads, context_tokens=context_tokens, max_len=max_len)
        return parameter_count_of(config), config
    per_layer = count(2)[0] - count(1)[0]
    layers = max(1, round((target_params - count(1)[0]) / per_layer) + 1)
    return count(layers)[1]


def parameter_count_of(config: TransformerConfig) -> int:
    """Parameters of ``config`` without allocating them."""
    shapes = jax.eval_shape(lambda: transformer_init(config, jax.random.key(0)))
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)))


def explicit_transformer_init(config: TransformerConfig, key: jax.Array, factors: Params | None,
                              pieces: tuple[str, ...] = EXPLICIT_PIECES, embedding_rms: float | None = None,
                              output_rms: float | None = None) -> Params:
    """Random init (:func:`transformer_init` with ``key``) with ``pieces`` taken from the
    explicit low-rank factors of :func:`saffu.solve.factors.solve_factorised` at rank
    ``r = config.width`` (``factors["embeddings"] float32[P, V, r]``, ``["output_weights"]
    float32[r, V]``, ``["output_bias"] float32[V]``):

    * ``"bias"``: the output bias is ``log p(y)`` (the unigram: the first thing a cold start
      learns; skipped for a model without an output bias, ``config.output_bias = False``);
    * ``"embeddings"``: the token embeddings are ``E_0`` (the current token's explicit embedding),
      rescaled to the random embeddings' root-mean-square, or to ``embedding_rms`` where given
      (``1.0``: the scale a norm layer outputs, so the embeddings are not buried under the
      blocks' first outputs);
    * ``"output"``: the output kernel is ``B``, rescaled to the random kernel's root-mean-square,
      or to ``output_rms`` where given.

    No pieces: the random init with its embeddings rescaled to ``embedding_rms`` (the scale
    ablation; ``factors`` may be ``None``).

    Rescaling keeps the initialiser's variance (pretrained vectors help from scratch only at
    that scale); the blocks stay random. The parameter tree and every shape are those of random init.
    """
    unknown = set(pieces) - set(EXPLICIT_PIECES)
    if unknown:
        raise SaffuError(f"unknown explicit-init pieces {sorted(unknown)}; choose from {', '.join(EXPLICIT_PIECES)}")
    if any(value is not None and not value > 0 for value in (embedding_rms, output_rms)):
        raise SaffuError(f"the explicit embeddings' and output's RMS must be > 0, not {embedding_rms}, {output_rms}")
    params = transformer_init(config, key)
    rms = lambda x: jnp.sqrt(jnp.mean(jnp.square(x)))
    random = params["embed"]["embedding"]
    if not pieces:                  # the scale ablation: the random embeddings at embedding_rms
        params["embed"]["embedding"] = random * (rms(random) if embedding_rms is None else embedding_rms) / rms(random)
        return params
    E, B = factors["embeddings"][0], factors["output_weights"]
    if E.shape != (config.vocab_size, config.width) or B.shape != (config.width, config.vocab_size):
        raise SaffuError(f"explicit factors of shape {tuple(E.shape)} / {tuple(B.shape)} do not fit a transformer of "
                         f"width {config.width} and {config.vocab_size:,} tokens; solve them at rank {config.width}")
    if "bias" in pieces and config.output_bias:
        params["output"]["bias"] = jnp.asarray(factors["output_bias"], jnp.float32)
    if "embeddings" in pieces:
        scale = rms(random) if embedding_rms is None else embedding_rms
        params["embed"]["embedding"] = (E * (scale / rms(E))).astype(random.dtype)
    if "output" in pieces:
        random = params["output"]["kernel"]
        scale = rms(random) if output_rms is None else output_rms
        params["output"]["kernel"] = (B * (scale / rms(B))).astype(random.dtype)
    return params


def inherit_layers(params: Params, config: TransformerConfig, layers: int) -> tuple[TransformerConfig, Params]:
    """Inheritune's start: a model of the first ``layers`` blocks of a (trained) transformer,
    with its token embeddings, positions, final norm and output layer — every array copied
    unchanged. Returns the smaller config (``layers`` blocks, otherwise ``config``) and its params."""
    if not 1 <= layers <= config.layers:
        raise SaffuError(f"can inherit 1 to {config.layers} blocks of a {config.layers}-block transformer, "
                         f"not {layers}")
    small = dataclasses.replace(config, layers=layers)
    copy = lambda tree: jax.tree.map(jnp.array, tree)
    inherited = {name: copy(value) for name, value in params.items() if name != "blocks"}
    inherited["blocks"] = {index: copy(params["blocks"][index]) for index in range(layers)}
    return small, inherited


def grow_layer(params: Params, config: TransformerConfig, reference: Params,
               reference_config: TransformerConfig) -> tuple[TransformerConfig, Params]:
    """Inheritune's growth: ``params`` (``config.layers = k`` blocks, trained) with block ``k`` of
    ``reference`` (a transformer of the same width with more than ``k`` blocks) appended; the
    first ``k`` blocks and everything else stay as they are. Returns the config of ``k + 1``
    blocks and its params."""
    k = config.layers
    if dataclasses.replace(reference_config, layers=k) != config:
        raise SaffuError("the model to grow and the reference differ in more than their layer count")
    if k >= reference_config.layers:
        raise SaffuError(f"the reference has {reference_config.layers} blocks; a {k}-block model cannot "
                         f"inherit block {k} from it")
    grown = {**params, "blocks": {**params["blocks"], k: jax.tree.map(jnp.array, reference["blocks"][k])}}
    return dataclasses.replace(config, layers=k + 1), grown


def structure_mlp(dense_params: Params, dense_config: TransformerConfig, config: TransformerConfig) -> Params:
    """A structured-MLP transformer ``config`` started from a (trained) dense one: every weight of
    ``dense_params`` copied, each MLP layer's factors the SVD of its dense kernel
    (:func:`saffu.models.structured.from_dense`: trained-SVD init) and, self-guided, that kernel
    as the dense guide. The two configs may differ in their MLP structure only."""
    if config.ffn == "dense":
        raise SaffuError("structure_mlp makes a structured MLP: give a config with --ffn lowrank, blockdense "
                         "or blockshuffle")
    if dense_config.ffn != "dense" or dataclasses.replace(
            dense_config, ffn=config.ffn, ffn_share=config.ffn_share, ffn_blocks=config.ffn_blocks,
            guide_share=config.guide_share) != config:
        raise SaffuError("the MLP source must be a dense transformer with the same width, layers, heads, "
                         "vocabulary and lengths as the structured one")
    params = jax.tree.map(jnp.array, dense_params)
    for block in params["blocks"].values():
        for name in ("mlp_in", "mlp_out"):
            kernel, bias = block[name]["kernel"], block[name]["bias"]
            size = structure_size(config.ffn, *kernel.shape, config.ffn_share, config.ffn_blocks)
            block[name] = {**from_dense(config.ffn, kernel, size, config.ffn_blocks), "bias": bias}
            if config.guide_share:
                block[name]["guide"] = kernel
    return params


def _layer_norm(p: Params, x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """``nnx.LayerNorm`` (its default ``epsilon``) with the params dict ``{"scale", "bias"}``."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + epsilon) * p["scale"][None] + p["bias"][None]


def _rms_norm(p: Params, x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """``nnx.RMSNorm`` (its default ``epsilon``) with the params dict ``{"scale"}``."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + epsilon) * p["scale"][None]


def decode_cache(config: TransformerConfig, batch: int, start: int = 0) -> Params:
    """An empty key/value cache of ``batch`` sequences of up to ``config.max_len`` tokens:
    ``keys``, ``values`` ``float32[L, B, max_len, H, d/H]``, ``documents int32[B, max_len]`` (the
    document index of each cached position: ``<eod>``s up to it; ``-1`` where nothing is cached), ``document int32[B]`` (the
    current one) and ``length int32[]`` (the next position: ``start``, the first token's position;
    the positions before it hold nothing a token can see)."""
    shape = (config.layers, batch, config.max_len, config.heads, config.width // config.heads)
    return {"keys": jnp.zeros(shape, jnp.float32), "values": jnp.zeros(shape, jnp.float32),
            "documents": jnp.full((batch, config.max_len), -1, jnp.int32), "document": jnp.zeros((batch,), jnp.int32),
            "length": jnp.asarray(start, jnp.int32)}


def decode_step(params: Params, config: TransformerConfig, cache: Params, tokens: jax.Array) -> tuple[jax.Array, Params]:
    """One position of every sequence with the key/value cache: ``tokens int32[B]`` at position
    ``cache["length"]`` -> (next-token logits ``float32[B, V]``, the cache with it added). The
    logits equal :func:`transformer_logits`' at that position of the whole sequence of tokens
    other than ``<pad>`` (attention causal and inside the token's document unless
    ``across_documents``), at the cost of one position instead of all of them.
    A dense MLP only (a structured or self-guided one: :func:`transformer_logits`)."""
    if config.ffn != "dense" or config.guide_share:
        raise SaffuError("the key/value cache decodes a dense transformer; a structured MLP samples by whole windows")
    position = cache["length"]
    document = cache["document"] + (tokens == EOD_ID).astype(jnp.int32)                    # [B]
    documents = cache["documents"].at[:, position].set(document)
    seen = (documents >= 0) if config.across_documents else (documents == document[:, None])
    visible = (jnp.arange(config.max_len)[None] <= position) & seen                                # [B, T]
    llama = config.block == "llama"
    norm = _rms_norm if llama else _layer_norm
    bias = lambda layer: layer["bias"][None] if "bias" in layer else 0.0
    x = params["embed"]["embedding"][tokens]                                                # [B, d]
    if not llama:
        x = x + params["positions"][position][None]
    here = jnp.full((tokens.shape[0], 1), position)                                         # [B, 1]
    turn = (lambda y: rotate(y[:, :, None], here)[:, :, 0]) if llama else (lambda y: y)     # [B, H, k]
    keys, values = cache["keys"], cache["values"]
    for index in range(config.layers):
        block = params["blocks"][index]
        attention = block["attention"]
        h = norm(block["attention_norm"], x)
        project = lambda name, h=h, attention=attention: (jnp.einsum("bd,dhk->bhk", h, attention[name]["kernel"])
                                                          + bias(attention[name]))
        q = turn(project("query"))
        keys = keys.at[index, :, position].set(turn(project("key")))
        values = values.at[index, :, position].set(project("value"))
        scores = jnp.einsum("bhk,bthk->bht", q / jnp.sqrt(q.shape[-1]).astype(q.dtype), keys[index])
        scores = jnp.where(visible[:, None, :], scores, jnp.finfo(scores.dtype).min)
        mixed = jnp.einsum("bht,bthk->bhk", jax.nn.softmax(scores, axis=-1), values[index])
        x = x + jnp.einsum("bhk,hkd->bd", mixed, attention["out"]["kernel"]) + bias(attention["out"])
        h = norm(block["mlp_norm"], x)
        if llama:
            h = jax.nn.silu(h @ block["mlp_gate"]["kernel"]) * (h @ block["mlp_in"]["kernel"])
        else:
            h = jax.nn.gelu(h @ block["mlp_in"]["kernel"] + block["mlp_in"]["bias"][None])
        x = x + h @ block["mlp_out"]["kernel"] + bias(block["mlp_out"])
    logits = norm(params["final_norm"], x) @ params["output"]["kernel"]
    if "bias" in params["output"]:
        logits = logits + params["output"]["bias"][None]
    return logits, {"keys": keys, "values": values, "documents": documents, "document": document,
                    "length": position + 1}


def transformer_target_logits(params: Params, config: TransformerConfig, windows: jax.Array, context: int,
                              positions: jax.Array | None = None) -> jax.Array:
    """Logits ``float32[B, T, V]`` predicting ``windows[:, context:]`` of ``windows int32[B, context + T]``,
    the output layer run at those positions only (``positions`` as in :func:`transformer_logits`)."""
    return transformer_logits(params, config, windows[:, :-1], positions=None if positions is None
                              else positions[:, :-1], predict_from=context - 1)


def transformer_loss(params: Params, config: TransformerConfig, windows: jax.Array, mask: jax.Array,
                     dropout: Dropout | None = None, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Summed NLL (nats, ``float32[]``) and target count of ``windows int32[B, R + T]`` with ``mask
    bool[B, T]``, the output layer and cross-entropy fused chunk by chunk
    (:func:`saffu.models.fused_loss.linear_nll_sum`: no ``B × T × V`` logits; under
    differentiation the gradient comes with the loss). ``dropout``: a training step's residual
    dropout; ``positions int32[B, R + T]``: each token's position."""
    context = config.context
    h = transformer_features(params, config, windows[:, :-1], predict_from=context - 1, dropout=dropout,
                             positions=None if positions is None else positions[:, :-1])
    kernel = params["output"]["kernel"]
    bias = params["output"].get("bias", jnp.zeros(kernel.shape[1], kernel.dtype))
    nll = linear_nll_sum(h.reshape(-1, h.shape[-1]), kernel, bias, windows[:, context:].reshape(-1),
                         mask.reshape(-1).astype(jnp.float32))
    return nll, jnp.sum(mask)


def zero_output(params: Params) -> Params:
    """``params`` with the output layer (kernel and bias) at zero, so the logits are exactly 0."""
    return {**params, "output": jax.tree.map(jnp.zeros_like, params["output"])}


KIND = ModelKind(
    "transformer", TransformerConfig, transformer_logits, init=transformer_init,
    from_fields=lambda fields: TransformerConfig(**{**SAVED_BEFORE["transformer"], **fields}),
    target_logits=transformer_target_logits, fused_loss=transformer_loss, zero_output=zero_output,
    # across documents, a document's earlier documents are context: it is scored where it sits
    positional=lambda config: not config.across_documents, depth="layers", attention=transformer_attention,
    attends_by="keys", attends=lambda config: True, drop_guide=drop_guide,
    # alone, a document has nothing before its <eod> but <pad>, which attention across documents never reads
    alone=lambda config: dataclasses.replace(config, across_documents=False),
    explicit_init=lambda config, key, factors, start: explicit_transformer_init(
        config, key, factors, tuple(start.explicit_pieces), start.explicit_embedding_rms, start.explicit_output_rms))
