"""The SAFFU block and stacks in flax NNX (formulation §3).

One block, for every position ``p`` of a sequence of ``K``-dim distributions (the cipher codes
of the tokens for the first block), with ``X ∈ R^{M×K}`` the ``M`` most recent rows
(``X[0] = x_h`` is the head, rows before the document start are the boundary code):

* attention without projections, per head ``h`` over its own radius ``M_h = max(1, M >> h)``:
  ``s = X x_h``, ``a = softmax(s W_A^h)``;
* value ``u_h = aᵀ X`` (``value_form="linear"``) or the log-space value
  ``u_h = softmax(aᵀ log X)`` (a renormalised geometric mixture, ``value_form="log"``);
* output, either **direct** over feature groups (``hidden = 0``):
  ``logits = b + Σ_g g W_g`` with groups the ``positions`` nearest rows ``X[0…P−1]`` and the
  values ``u_h``; or a **chain** (``hidden = D``): ``z = softmax([u_1 … u_H; x_h] W_1 + b_1)``,
  ``logits = z W_2 + b_2``, whose ``W_1`` and ``W_2`` may be structured (``config.chain``,
  :func:`structure_chain`).

Mixed features (``exact_positions``, direct form, one block): a position group ``p`` listed
there reads exact token identity instead of its cipher code — its term is
``β_p · L_p[x_{t−p}, :]``, the sparse Witten-Bell table of :mod:`saffu.models.exact`, held in
``params["exact"]`` (data-sized, never trained) — and the cipher weights ``W_g`` cover the other
groups only.

Blocks stack: block ``l + 1`` reads ``softmax(logits_l) · C`` (the expected cipher code of the
next token) at every position. The whole stack is causal and runs over all positions of a
batch of sequences in one jitted call. Parameters are plain arrays in a nested dict
``{"blocks": {0: {...}, 1: ...}}``: the :class:`Saffu` NNX module holds them as ``nnx.Param``
and the pure functions here compute with the dict (what the trainer and the explicit solver
use). The cipher codes ``C float32[V, K]`` are the parameter ``params["codes"]``: a fixed input
(:attr:`SaffuConfig.fixed_params`), never trained, and like every parameter a jit argument, never
a constant of an executable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from saffu._io import SaffuError
from saffu.configs import CipherConfig, Params, SaffuConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.engine.codes import bit_cipher_codes
from saffu.models.exact import document_contexts, table_rows
from saffu.models.kinds import ModelKind
from saffu.models.structured import apply_structure, from_dense, zero_last_factor


@functools.lru_cache(maxsize=4)
def _codes(vocab_size: int, bits: int) -> np.ndarray:
    """The host array of :func:`cipher_table` (read-only: one copy serves every caller)."""
    codes = bit_cipher_codes(vocab_size, CipherConfig(bits=bits)).astype(np.float32)
    codes.setflags(write=False)
    return codes


def cipher_table(config: SaffuConfig) -> jax.Array:
    """The fixed (untrained) cipher codes ``C`` of ``config``, ``float32[V, K]``: the value of
    ``params["codes"]`` (:func:`init_params`, the explicit solution). Host side only: a jitted
    function reads the codes from its params argument, never from here."""
    return jnp.asarray(_codes(config.vocab_size, config.bits))


def _codes_of(params: Params) -> jax.Array:
    """``params["codes"]``, a fixed input: no gradient flows into it."""
    return jax.lax.stop_gradient(params["codes"])


def init_params(config: SaffuConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random init (cold start): weights ``N(0, scale²)``, biases 0, and the fixed cipher codes
    ``"codes"`` (:func:`cipher_table`). Returns the params dict (the cipher part only: exact
    features, :attr:`SaffuConfig.exact_positions`, come from data —
    :func:`saffu.solve.stack.solve_explicit` adds them as ``params["exact"]``)."""
    K, V = config.dim, config.vocab_size
    blocks = {}
    for index, block_key in enumerate(jax.random.split(key, config.blocks)):
        keys = iter(jax.random.split(block_key, config.heads + 2))
        block = {f"attention_{h}": scale * jax.random.normal(next(keys), (config.head_radius(h),) * 2)
                 for h in range(config.heads)}
        if config.hidden == 0:
            block["group_weights"] = scale * jax.random.normal(next(keys), (config.cipher_groups, K, V))
        else:
            D = config.hidden
            block["hidden_weights"] = scale * jax.random.normal(next(keys), ((config.heads + 1) * K, D))
            block["hidden_bias"] = jnp.zeros((D,))
            block["output_weights"] = scale * jax.random.normal(next(keys), (D, V))
        block["output_bias"] = jnp.zeros((V,))
        blocks[index] = structure_chain(block, config)
    return {"blocks": blocks, "codes": cipher_table(config)}


def structure_chain(block: Params, config: SaffuConfig) -> Params:
    """A chain block's dense ``hidden_weights`` / ``output_weights`` (random, or the explicit
    solution's) turned into ``config.chain``'s factors (``hidden_factors`` / ``output_factors``)
    by SVD (:func:`saffu.models.structured.from_dense`); unchanged for a dense chain, the direct
    form, or a block that already holds factors."""
    if config.chain == "dense" or config.hidden == 0:
        return block
    block = dict(block)
    for layer in ("hidden", "output"):
        if f"{layer}_weights" in block:
            dense = jnp.asarray(block.pop(f"{layer}_weights"), jnp.float32)
            block[f"{layer}_factors"] = from_dense(config.chain, dense, config.chain_size(layer), config.chain_blocks)
    return block


def _chain_layer(block: Params, config: SaffuConfig, layer: str, x: jax.Array) -> jax.Array:
    """``x W`` of the chain's ``layer`` (``hidden`` or ``output``), dense or structured."""
    if f"{layer}_factors" in block:
        return apply_structure(config.chain, block[f"{layer}_factors"], x)
    return x @ block[f"{layer}_weights"]


def same_document(tokens: jax.Array, radius: int) -> jax.Array:
    """``bool[B, S, M]``: row ``p − δ`` is in position ``p``'s document (and ``p − δ ≥ 0``).

    Position ``p − δ`` is visible from ``p`` iff no ``<eod>`` lies in ``(p − δ, p]``.
    """
    boundaries = jnp.cumsum(tokens == EOD_ID, axis=1)                    # [B, S]
    position = jnp.arange(tokens.shape[1])[:, None] - jnp.arange(radius)[None, :]   # [S, M]
    safe = jnp.maximum(position, 0)
    visible = boundaries[:, safe] == boundaries[:, :, None]
    return visible & (position >= 0)[None]


def _add_last(x: jax.Array, bias: jax.Array) -> jax.Array:
    """``x + bias`` along the last axis, with explicit rank (rank promotion is an error here)."""
    return x + bias.reshape((1,) * (x.ndim - 1) + bias.shape)


def block_windows(sequence: jax.Array, visible: jax.Array, pad_row: jax.Array) -> jax.Array:
    """``X[b, p, δ] = sequence[b, p − δ]`` where visible, else the boundary row; ``[B, S, M, K]``."""
    position = jnp.maximum(jnp.arange(sequence.shape[1])[:, None] - jnp.arange(visible.shape[2])[None, :], 0)
    rows = sequence[:, position]                                         # [B, S, M, K]
    return jnp.where(visible[..., None], rows, pad_row.reshape((1,) * (rows.ndim - 1) + pad_row.shape))


def head_attention(block: Params, config: SaffuConfig, X: jax.Array) -> list[jax.Array]:
    """Per head ``h``, the attention ``a = softmax((X x_h) W_A^h)`` of every position over its
    ``M_h`` most recent rows (offset ``δ = 0`` is the head row), each ``[..., M_h]``."""
    head_row = X[..., 0, :]
    weights = []
    for h in range(config.heads):
        similarity = jnp.einsum("...mk,...k->...m", X[..., :config.head_radius(h), :], head_row)
        weights.append(jax.nn.softmax(similarity @ block[f"attention_{h}"], axis=-1))
    return weights


def attention_values(block: Params, config: SaffuConfig, X: jax.Array) -> list[jax.Array]:
    """Per head, the attended value ``u_h`` of every position, each ``[..., K]``."""
    values = []
    for h, attention in enumerate(head_attention(block, config, X)):
        Xh = X[..., :config.head_radius(h), :]
        if config.value_form == "linear":
            values.append(jnp.einsum("...m,...mk->...k", attention, Xh))
        else:
            values.append(jax.nn.softmax(jnp.einsum("...m,...mk->...k", attention, jnp.log(Xh + 1e-6)), axis=-1))
    return values


def output_groups(config: SaffuConfig, X: jax.Array, values: list[jax.Array]) -> jax.Array:
    """Direct-form feature groups ``[..., G, K]``: the ``positions`` nearest rows (those that read
    cipher codes), then values."""
    rows = X[..., :config.positions, :] if not config.exact_positions else X[..., config.cipher_positions, :]
    return jnp.concatenate([rows, jnp.stack(values, axis=-2)], axis=-2)


def exact_features(exact: Params, config: SaffuConfig, tokens: jax.Array) -> jax.Array:
    """The exact groups' logits ``Σ_p β_p L_p[x_{t−p}, :]`` of every position:
    ``int32[B, S]`` -> ``float32[B, S, V]``; ``exact`` is ``{"beta": float32[E], "groups": [tables]}``
    (:mod:`saffu.models.exact`; a one-token group's context id is the token)."""
    B, S = tokens.shape
    context = document_contexts(tokens, max(config.exact_positions) + 1).reshape(B * S, -1)
    total = sum(exact["beta"][e] * table_rows(group, context[:, p])
                for e, (p, group) in enumerate(zip(config.exact_positions, exact["groups"])))
    return total.reshape(B, S, config.vocab_size)


def hidden_features(config: SaffuConfig, X: jax.Array, values: list[jax.Array]) -> jax.Array:
    """Chain-form hidden-layer input ``[u_1 … u_H; x_h]``, ``[..., (H + 1)·K]``."""
    return jnp.concatenate(values + [X[..., 0, :]], axis=-1)


def block_logits(block: Params, config: SaffuConfig, X: jax.Array) -> jax.Array:
    """One block on windows ``X [..., M, K]`` -> next-token logits ``[..., V]``."""
    values = attention_values(block, config, X)
    if config.hidden == 0:
        groups = output_groups(config, X, values)
        flat = groups.reshape(groups.shape[:-2] + (-1,))
        weights = block["group_weights"].reshape(-1, config.vocab_size)
        return _add_last(flat @ weights, block["output_bias"])
    z = jax.nn.softmax(_add_last(_chain_layer(block, config, "hidden", hidden_features(config, X, values)),
                                 block["hidden_bias"]), axis=-1)
    return _add_last(_chain_layer(block, config, "output", z), block["output_bias"])


def block_inputs(params: Params, config: SaffuConfig, tokens: jax.Array, upto: int) -> tuple[jax.Array, jax.Array]:
    """The sequence block ``upto`` reads, ``[B, S, K]``, and the visibility mask ``[B, S, M]``
    (from ``params["codes"]`` and the first ``upto`` blocks of ``params["blocks"]``)."""
    codes = _codes_of(params)
    sequence = codes[tokens]
    visible = same_document(tokens, config.radius)
    for index in range(upto):
        X = block_windows(sequence, visible, codes[PAD_ID])
        sequence = jax.nn.softmax(block_logits(params["blocks"][index], config, X), axis=-1) @ codes
    return sequence, visible


def saffu_logits(params: Params, config: SaffuConfig, tokens: jax.Array) -> jax.Array:
    """Next-token logits at every position: ``tokens int32[B, S]`` -> ``float32[B, S, V]``
    (position ``p`` predicts token ``p + 1``)."""
    sequence, visible = block_inputs(params, config, tokens, config.blocks - 1)
    X = block_windows(sequence, visible, _codes_of(params)[PAD_ID])
    logits = block_logits(params["blocks"][config.blocks - 1], config, X)
    if config.exact_positions:
        logits = logits + exact_features(params["exact"], config, tokens)
    return logits


def saffu_attention(params: Params, config: SaffuConfig, tokens: jax.Array) -> list[tuple[list[jax.Array], jax.Array]]:
    """Per block, its heads' attention ``[float32[B, S, M_h]]`` (:func:`head_attention`: query
    position × offset) and the visibility ``bool[B, S, M]`` of each offset (an invisible row is
    the boundary code, not a position) for ``tokens int32[B, S]``."""
    codes = _codes_of(params)
    sequence, visible = codes[tokens], same_document(tokens, config.radius)
    maps = []
    for index in range(config.blocks):             # one pass up the stack, as block_inputs goes
        block = params["blocks"][index]
        X = block_windows(sequence, visible, codes[PAD_ID])
        maps.append((head_attention(block, config, X), visible))
        if index + 1 < config.blocks:
            sequence = jax.nn.softmax(block_logits(block, config, X), axis=-1) @ codes
    return maps


def inherit_blocks(params: Params, config: SaffuConfig, blocks: int) -> tuple[SaffuConfig, Params]:
    """Inheritune's start for a SAFFU stack: its first ``blocks`` blocks, every array copied
    unchanged. Each SAFFU block ends in its own output layer (block ``l + 1`` reads block ``l``'s
    predicted code), so the first blocks are a whole model: there is no separate final layer to
    take. Returns the smaller config (``blocks`` blocks, otherwise ``config``) and its params."""
    if not 1 <= blocks <= config.blocks:
        raise SaffuError(f"can inherit 1 to {config.blocks} blocks of a {config.blocks}-block SAFFU stack, "
                         f"not {blocks}")
    copy = lambda tree: jax.tree.map(jnp.array, tree)
    inherited = {name: copy(value) for name, value in params.items() if name != "blocks"}
    inherited["blocks"] = {index: copy(params["blocks"][index]) for index in range(blocks)}
    return dataclasses.replace(config, blocks=blocks), inherited


def grow_block(params: Params, config: SaffuConfig, block: Params) -> tuple[SaffuConfig, Params]:
    """Inheritune's growth of a SAFFU stack: ``params`` (``config.blocks = k`` blocks) with
    ``block`` appended as block ``k`` (a reference's block ``k``, or one solved on top of the stack:
    :func:`saffu.solve.stack.solve_explicit` with ``below``); the first ``k`` blocks stay as they
    are. ``block`` must have the shapes of a block of ``config``. Returns the config of ``k + 1``
    blocks and its params."""
    template = init_params(dataclasses.replace(config, blocks=1), jax.random.key(0))["blocks"][0]
    if (jax.tree.structure(block) != jax.tree.structure(template)
            or any(a.shape != b.shape for a, b in zip(jax.tree.leaves(block), jax.tree.leaves(template)))):
        raise SaffuError("the block to append does not have this SAFFU stack's block shapes "
                         "(radius, heads, positions, hidden, bits and vocabulary must agree)")
    k = config.blocks
    grown = {**params, "blocks": {**params["blocks"], k: jax.tree.map(jnp.array, block)}}
    return dataclasses.replace(config, blocks=k + 1), grown


class Codes(nnx.Variable):
    """The fixed cipher codes of a :class:`Saffu` module: an input, not an ``nnx.Param``."""


class SaffuBlock(nnx.Module):
    """One block's parameters as ``nnx.Param`` (names as in :func:`init_params`)."""

    def __init__(self, arrays: Params):
        for name, value in arrays.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))


class Saffu(nnx.Module):
    """A SAFFU stack as a flax NNX module: ``model(tokens [B, S]) -> logits [B, S, V]``."""

    def __init__(self, config: SaffuConfig, *, rngs: nnx.Rngs, params: Params | None = None):
        self.config = config
        params = params if params is not None else init_params(config, rngs.params())
        self.codes = Codes(jnp.asarray(params["codes"]) if "codes" in params else cipher_table(config))
        self.blocks = nnx.List([SaffuBlock(params["blocks"][i]) for i in range(config.blocks)])

    def params(self) -> Params:
        """The pure parameter dict (same structure as :func:`init_params`): the trained
        ``nnx.Param`` arrays and the fixed ``"codes"``."""
        return {**nnx.to_pure_dict(nnx.state(self, nnx.Param)), "codes": self.codes.get_value()}

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return saffu_logits(self.params(), self.config, tokens)


def zero_output(params: Params) -> Params:
    """``params`` (a copy) with the last block's output layer at zero — its ``output_bias`` and its
    ``group_weights`` or ``output_weights`` (the last factor of a structured chain) — so the
    logits are exactly 0."""
    params = jax.tree.map(lambda x: x, params)
    last = params["blocks"][max(params["blocks"])]
    last["output_bias"] = jnp.zeros_like(last["output_bias"])
    if "group_weights" in last:
        last["group_weights"] = jnp.zeros_like(last["group_weights"])
    else:
        zero_last_factor(last)
    return params


def _from_fields(fields: dict) -> SaffuConfig:
    if "exact_positions" in fields:     # JSON lists back to the config's hashable tuples
        fields = {**fields, "exact_positions": tuple(fields["exact_positions"])}
    return SaffuConfig(**fields)


KIND = ModelKind(
    "saffu", SaffuConfig, saffu_logits, init=init_params, from_fields=_from_fields, zero_output=zero_output,
    document_local=True, radius=True, depth="blocks", grows_by_solving=True, attention=saffu_attention,
    attends_by="offsets", attends=lambda config: config.heads > 0, solve_command="saffu fit",
    exact_tables=lambda config: bool(config.exact_positions))
