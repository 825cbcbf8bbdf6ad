"""Structured drop-in replacements for a dense layer ``y = x W + b`` (``W float32[n_in, n_out]``),
after Wei et al. (2024), "Building on Efficient Foundations: Effective Training of LLMs with
Structured Feedforward Layers":

* ``lowrank``: ``y = (x D) U`` with ``D [n_in, r]``, ``U [r, n_out]``;
* ``blockdense``: ``y = (x B) U`` with ``B`` block-diagonal (``b`` blocks ``[n_in/b, r/b]``) and ``U [r, n_out]``;
* ``blockshuffle``: ``y = f⁻¹((f(x B₁)) B₂)`` with ``B₁`` block-diagonal (``b`` blocks ``[n_in/b, h/b]``),
  ``B₂`` block-diagonal (``b`` blocks ``[h/b, n_out/b]``) and ``f`` the fixed shuffle that deals
  a vector's ``b`` blocks out like cards (element ``k`` of block ``i`` goes to ``k·b + i``), so
  every output block reads every input block; ``h = b²·c``.

A structure's size comes from a budget, the share of the dense layer's ``n_in·n_out`` weights
it may hold (:func:`structure_size`); the bias stays dense. Every structure can be set from a
dense matrix (:func:`from_dense`): the truncated SVD for ``lowrank`` (``D = U_r √S_r``,
``U = √S_r V_rᵀ``), the SVD of each row block for ``blockdense`` and of each (input block,
output block) pair for ``blockshuffle`` — exact wherever the rank allows, the best rank-limited
fit of each block otherwise. The dense matrix can be random (Wei et al.'s init), a trained dense
layer, or an explicit solution (a closed-form structured init).

Self-guided training (:class:`StructuredLinear` with ``guided=True``) keeps a dense guide ``W``
next to the structure: ``y = α·xW + (1 − α)·S(x) + b``; the model config's ``step_inputs``
sets ``α`` from the step (cosine 1 → 0 over a share of training), and once ``α`` is gone the
dense path is not computed at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from saffu._io import SaffuError
from saffu.configs import STRUCTURES, Params, factor_shapes, guide_alpha, structure_params, structure_size

# the sizing and the α schedule are plain Python, so they live with the configs (no jax there)
__all__ = [
    "FACTORS",
    "STRUCTURES",
    "StructuredLinear",
    "apply_structure",
    "factor_shapes",
    "from_dense",
    "guide_alpha",
    "structure_params",
    "structure_size",
    "to_dense",
    "zero_last_factor",
]

FACTORS = {"dense": ("kernel",), "lowrank": ("down", "up"), "blockdense": ("blocks", "up"),
           "blockshuffle": ("first", "second")}


def _deal(v: jax.Array, blocks: int) -> jax.Array:
    """The shuffle ``f`` on the last axis: element ``k`` of block ``i`` goes to ``k·blocks + i``."""
    n = v.shape[-1]
    return jnp.swapaxes(v.reshape(v.shape[:-1] + (blocks, n // blocks)), -1, -2).reshape(v.shape)


def _undeal(v: jax.Array, blocks: int) -> jax.Array:
    """``f⁻¹``: the inverse of :func:`_deal`."""
    n = v.shape[-1]
    return jnp.swapaxes(v.reshape(v.shape[:-1] + (n // blocks, blocks)), -1, -2).reshape(v.shape)


def _apply_blockdense(factors: Params, x: jax.Array) -> jax.Array:
    b = factors["blocks"].shape[0]
    inner = jnp.einsum("...bi,bir->...br", x.reshape(x.shape[:-1] + (b, -1)), factors["blocks"])
    return inner.reshape(x.shape[:-1] + (-1,)) @ factors["up"]


def _apply_blockshuffle(factors: Params, x: jax.Array) -> jax.Array:
    b = factors["first"].shape[0]
    inner = jnp.einsum("...bi,bim->...bm", x.reshape(x.shape[:-1] + (b, -1)), factors["first"])
    inner = _deal(inner.reshape(x.shape[:-1] + (-1,)), b)
    out = jnp.einsum("...bm,bmo->...bo", inner.reshape(x.shape[:-1] + (b, -1)), factors["second"])
    return _undeal(out.reshape(x.shape[:-1] + (-1,)), b)


#: Each structure's product ``(factors, x float[..., n_in]) -> float[..., n_out]``.
_APPLY = {"dense": lambda factors, x: x @ factors["kernel"],
          "lowrank": lambda factors, x: (x @ factors["down"]) @ factors["up"],
          "blockdense": _apply_blockdense, "blockshuffle": _apply_blockshuffle}


def _of(table: dict, structure: str):
    """``table``'s entry for ``structure``; one error line naming the structures otherwise."""
    if structure not in table:
        raise SaffuError(f"unknown structure {structure!r}; choose from {', '.join(STRUCTURES)}")
    return table[structure]


def apply_structure(structure: str, factors: Params, x: jax.Array) -> jax.Array:
    """``x float[..., n_in] -> float[..., n_out]`` through ``structure``'s ``factors`` (no bias)."""
    return _of(_APPLY, structure)(factors, x)


def to_dense(structure: str, factors: Params) -> jax.Array:
    """The dense matrix ``float32[n_in, n_out]`` that ``structure``'s ``factors`` compute."""
    first = factors[_of(FACTORS, structure)[0]]
    n_in = first.shape[0] if first.ndim == 2 else first.shape[0] * first.shape[1]   # a block-diagonal's blocks
    return apply_structure(structure, factors, jnp.eye(n_in, dtype=first.dtype))


def _split_svd(W: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    """``(L [n, rank], R [rank, m])`` with ``L R`` the best rank-``rank`` fit of ``W [n, m]``
    (``L = U_r √S_r``, ``R = √S_r V_rᵀ``; zero-padded where ``rank`` exceeds ``min(n, m)``)."""
    U, S, Vt = jnp.linalg.svd(W, full_matrices=False)
    keep = min(rank, S.shape[0])
    root = jnp.sqrt(S[:keep])
    L = jnp.zeros((W.shape[0], rank), W.dtype).at[:, :keep].set(U[:, :keep] * root[None, :])
    R = jnp.zeros((rank, W.shape[1]), W.dtype).at[:keep].set(root[:, None] * Vt[:keep])
    return L, R


def _lowrank_from(W: jax.Array, size: int, blocks: int) -> Params:
    down, up = _split_svd(W, size)
    return {"down": down, "up": up}


def _blockdense_from(W: jax.Array, size: int, blocks: int) -> Params:
    pieces = [_split_svd(rows, size // blocks) for rows in jnp.split(W, blocks, axis=0)]
    return {"blocks": jnp.stack([L for L, _ in pieces]), "up": jnp.concatenate([R for _, R in pieces])}


def _blockshuffle_from(W: jax.Array, size: int, blocks: int) -> Params:
    # y = P y' with P the output shuffle f⁻¹; input block i reaches output block j of y'
    # through the c inner units k ∈ [j·c, (j+1)·c) of its own block, which the shuffle puts
    # at rows t = (k − j·c)·b + i of B₂'s block j: a rank-c product per (i, j) pair
    n_in, n_out = W.shape
    b = blocks
    m, c, a, o = size // b, size // (b * b), n_in // b, n_out // b
    perm = np.arange(n_out).reshape(o, b).T.reshape(-1)      # f⁻¹ as a gather: y[p] = y'[perm[p]]
    Wp = jnp.zeros_like(W).at[:, perm].set(W)                # the map onto y'
    first = jnp.zeros((b, a, m), W.dtype)
    second = jnp.zeros((b, m, o), W.dtype)
    for i in range(b):
        for j in range(b):
            L, R = _split_svd(Wp[i * a:(i + 1) * a, j * o:(j + 1) * o], c)
            first = first.at[i, :, j * c:(j + 1) * c].set(L)
            second = second.at[j, np.arange(c) * b + i].set(R)
    return {"first": first, "second": second}


#: Each structure's factors set from a dense matrix, ``(W, size, blocks) -> factors``.
_FROM_DENSE = {"dense": lambda W, size, blocks: {"kernel": W}, "lowrank": _lowrank_from,
               "blockdense": _blockdense_from, "blockshuffle": _blockshuffle_from}


def from_dense(structure: str, W: jax.Array, size: int, blocks: int = 4) -> Params:
    """``structure``'s factors at inner size ``size`` set from the dense ``W float[n_in, n_out]`` by
    SVD (see the module docstring); equal to ``W`` where each block's rank fits. Traceable
    (``jnp.linalg.svd``), so it runs under ``jax.eval_shape`` and ``jit``."""
    return _of(_FROM_DENSE, structure)(W, size, blocks)


def zero_last_factor(params: Params) -> None:
    """An output layer's ``output_weights`` at zero, or of a structured ``output_factors`` the last
    factor (the first stays random, so gradients flow), in place: the logits it feeds are 0."""
    if "output_weights" in params:
        params["output_weights"] = jnp.zeros_like(params["output_weights"])
    else:
        factors = params["output_factors"]
        last = sorted(factors, key=("down", "blocks", "first", "up", "second").index)[-1]
        params["output_factors"] = {**factors, last: jnp.zeros_like(factors[last])}


class StructuredLinear(nnx.Module):
    """``x float[..., n_in] -> float[..., n_out]``: ``structure`` plus a dense bias, its
    factors the SVD (:func:`from_dense`) of a random dense kernel drawn like ``nnx.Linear``'s
    (LeCun normal), as Wei et al. initialise. With ``guided``, that dense kernel stays as the
    guide ``W`` (param ``guide``): called with ``alpha``, ``y = α·xW + (1 − α)·S(x) + b``;
    called without, the structure alone (the guide is not read)."""

    def __init__(self, n_in: int, n_out: int, structure: str, share: float, blocks: int = 4,
                 guided: bool = False, *, rngs: nnx.Rngs):
        if structure not in STRUCTURES[1:]:
            raise SaffuError(f"StructuredLinear needs a structure ({', '.join(STRUCTURES[1:])}), not {structure!r}; "
                             f"use nnx.Linear for a dense layer")
        self.structure = structure
        dense = nnx.initializers.lecun_normal()(rngs.params(), (n_in, n_out))
        size = structure_size(structure, n_in, n_out, share, blocks)
        for name, value in from_dense(structure, dense, size, blocks).items():
            setattr(self, name, nnx.Param(value))
        self.bias = nnx.Param(jnp.zeros((n_out,)))
        self.guide = nnx.Param(dense) if guided else None

    def __call__(self, x: jax.Array, alpha: jax.Array | None = None) -> jax.Array:
        y = apply_structure(self.structure, {name: getattr(self, name)[...] for name in FACTORS[self.structure]}, x)
        if alpha is not None:
            if self.guide is None:
                raise SaffuError("a guide weight α was given to a structured layer built without a guide")
            y = alpha * (x @ self.guide[...]) + (1 - alpha) * y
        return y + self.bias[...].reshape((1,) * (y.ndim - 1) + (-1,))
