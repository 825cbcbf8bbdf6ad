"""Explicit init of any JAX model's parameters: the token embedding, the output kernel and the
output bias set from the explicit solution, every other leaf untouched.

The parameters are any pytree — flax NNX ``State``, linen params, an equinox module, a plain
dict of arrays — and the three leaves are named by selectors (the way ``optax.masked`` and
``eqx.tree_at`` name leaves):

* a path string, ``"embed/embedding"`` (dict keys, attribute names and sequence indices joined
  by ``/``; a trailing ``value`` of an NNX variable may be left out),
* a tuple of keys, ``("embed", "embedding")``,
* a function of the tree returning the leaf, ``lambda m: m.embed.weight`` (an NNX variable or
  any one-leaf subtree is fine).

The pieces come from :class:`ExplicitPieces` (:func:`saffu.interop.tokens.solve_pieces`), or
from a source they are solved from at the model's own width (a work directory, its path, or the
user's token documents): ``d`` never has to match a rank solved before.

Each piece is rescaled to its leaf's own initial root-mean-square (pretrained vectors help a
random network only at the initialiser's scale) and cast to the leaf's dtype; a leaf
initialised at zero keeps the solution's scale. The bias is set as is (``log p(y)``).

A model without an output bias loses the unigram, the first thing a cold start learns.
``fold_unigram=True`` folds it into the other two pieces (:func:`fold_unigram`): the explicit
solution at rank ``d − 1`` in the subspace orthogonal to one direction ``u`` (``u ⟂ 1``, so a
LayerNorm's centring keeps it), every token's embedding a shared component along ``u``, and the
output kernel's ``u`` row the centred log-unigram over the expected normalised ``u`` component:
after the final norm, ``h · B`` carries ``log p(y)`` up to a constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from saffu._io import SaffuError
from saffu.interop.pieces import ExplicitPieces
from saffu.interop.tokens import TokenSource, solve_pieces
from saffu.models import penzai

Selector = str | Sequence[Any] | Callable[[Any], Any]



def path_name(path) -> str:
    """``jax.tree_util`` key path → ``"a/b/0/c"``; an NNX variable's trailing ``value`` dropped."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    while parts and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return "/".join(parts)


def _locate(tree, selector: Selector, role: str) -> int:
    """Index of the selected leaf in ``jax.tree_util.tree_leaves(tree)`` order."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if callable(selector):
        chosen = jax.tree_util.tree_leaves(selector(tree))
        if len(chosen) != 1:
            raise SaffuError(f"the {role} selector picked {len(chosen)} arrays; it must pick exactly one")
        for index, (_, leaf) in enumerate(flat):
            if leaf is chosen[0]:
                return index
        raise SaffuError(f"the {role} selector returned an array that is not a leaf of the parameters")
    want = selector if isinstance(selector, str) else "/".join(str(k) for k in selector)
    names = [path_name(path) for path, _ in flat]
    if want in names:
        return names.index(want)
    close = [n for n in names if n.split("/")[-1] == want.split("/")[-1]][:4]
    raise SaffuError(f"no {role} leaf {want!r} in the parameters" + (f"; did you mean {', '.join(close)}?" if close
                                                                     else f" (leaves: {', '.join(names[:6])}, …)"))


def _rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _like(piece: np.ndarray, leaf, gain: float = 1.0) -> jax.Array:
    """``piece`` at ``gain`` × ``leaf``'s root-mean-square (its own, if ``leaf`` is all zeros) and dtype."""
    target, own = gain * _rms(leaf), _rms(piece)
    scaled = piece * (target / own) if target > 0 and own > 0 else piece
    return jax.numpy.asarray(scaled, dtype=leaf.dtype)


def _layout(shape: tuple, vocab: int, role: str, layout: str) -> str:
    """``"vd"`` or ``"dv"``: how a ``[V, d]`` piece lies in a leaf of ``shape`` (one error line
    when the leaf is not a matrix with a ``V`` axis, or is square and ``layout`` is ``"auto"``)."""
    if len(shape) != 2 or vocab not in shape:
        raise SaffuError(f"the {role} leaf has shape {tuple(shape)} but the explicit pieces have a vocabulary of "
                         f"{vocab:,} tokens; solve them with the model's own tokenizer")
    if layout == "auto":
        if shape[0] == shape[1]:
            raise SaffuError(f"the {role} leaf is square {tuple(shape)}: say its layout (\"vd\" or \"dv\")")
        layout = "vd" if shape[0] == vocab else "dv"
    return layout


def _oriented(piece: np.ndarray, shape: tuple, vocab: int, role: str, layout: str) -> np.ndarray:
    """``piece`` (``[V, d]``) as ``[V, d]`` or ``[d, V]`` to match ``shape``."""
    return piece if _layout(shape, vocab, role, layout) == "vd" else piece.T


def tied_matrix(pieces: ExplicitPieces, choice: str = "mean") -> np.ndarray:
    """One ``float32[V, r]`` matrix for a model whose embedding is also its output kernel:
    ``"embedding"`` (``E_0``), ``"output"`` (``Bᵀ``) or ``"mean"`` (the two at equal
    root-mean-square, averaged); :func:`saffu.models.penzai.tied_matrix` of the pieces."""
    return penzai.tied_matrix(pieces.embedding, pieces.output, choice)


def best_rank(pieces: ExplicitPieces, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(E [V, k], B [k, V])``, float64: the best rank-``k`` approximation of ``E B`` (thin SVD
    through two QRs, never ``V × V``), split evenly by the singular values' square roots."""
    E, B = np.asarray(pieces.embedding, np.float64), np.asarray(pieces.output, np.float64)
    if rank > E.shape[1]:
        raise SaffuError(f"the explicit pieces have rank {E.shape[1]}; folding needs at least {rank}")
    qe, re = np.linalg.qr(E)
    qb, rb = np.linalg.qr(B.T)
    u, s, vt = np.linalg.svd(re @ rb.T)
    root = np.sqrt(s[:rank])
    return qe @ (u[:, :rank] * root), (root[:, None] * vt[:rank]) @ qb.T


#: ``|c u|`` over the mean embedding row norm when the unigram is folded in: measured on
#: penzai's Llama-like and GPT-NeoX at init (babylm-2023-4src, V = 8,192, d = 128; unigram
#: cross-entropy 6.17 nats): step-0 loss 6.35 / 6.29 at 3, 6.20 / 6.18 at 10, against 9.03 / 9.04
#: for random init and 8.98 / 9.01 for the explicit pieces without the unigram. Training does not
#: keep it: at lr 0.01 the loss jumps to 8.6 / 9.7 by step 10 and ends 30 steps at 6.83 / 6.70
#: against random init's 6.30 / 6.07 (the normalised ``u`` component is ~0.5, so the kernel's
#: ``u`` row is large and every early update of the blocks moves it); hence ``fold=False`` by default.
FOLD_SHARE = 10.0


def fold_unigram(pieces: ExplicitPieces, width: int, embedding_rms: float, output_rms: float,
                 share: float = FOLD_SHARE) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of a model without an output bias, the unigram to be folded in (see the module
    docstring): ``(embedding float64[V, d], output kernel float64[d, V] without the unigram,
    u float64[d], centred log-unigram float64[V])``.

    ``u = (+1, −1, +1, …) / √d``; the rank-``(d − 1)`` factors (:func:`best_rank`) are placed in
    an orthonormal basis of ``u⊥``; every embedding row gains ``c u`` with ``|c u|`` = ``share``
    × the mean row norm, then the embeddings are rescaled to ``embedding_rms`` and the output
    factor to ``output_rms``. The caller adds ``u ⊗ log-unigram / s`` to the output kernel, ``s``
    the model's mean normalised ``u`` component at the last layer (measured: it depends on the
    blocks' random contribution and the norms' scales)."""
    d = width
    E1, B1 = best_rank(pieces, d - 1)
    u = np.where(np.arange(d) % 2 == 0, 1.0, -1.0) / np.sqrt(d)
    basis = np.linalg.qr(np.concatenate([u[:, None], np.eye(d)], axis=1))[0][:, 1:d]      # [d, d − 1] ⟂ u
    E = E1 @ basis.T
    E = E + share * np.linalg.norm(E, axis=1).mean() * u[None, :]
    E *= embedding_rms / _rms(E)
    B = basis @ B1
    B *= output_rms / _rms(B)
    log_p = np.asarray(pieces.bias, np.float64)
    return E, B, u, log_p - log_p.mean()


def explicit_init(params, pieces, *, embedding: Selector, output: Selector | None = None,
                  bias: Selector | None = None, tied: str = "mean", output_layout: str = "auto",
                  embedding_layout: str = "auto", fold: bool = False, apply: Callable | None = None,
                  sample=None, fold_share: float = FOLD_SHARE, embedding_rms: float | None = None,
                  progress: bool = False):
    """``params`` with its token embedding, output kernel and output bias set from the explicit
    solution; the same tree type and structure, every other leaf the same object.

    Args:
      params: the model's parameters, any pytree (see the module docstring).
      pieces: :class:`ExplicitPieces` of rank ``d`` (the embedding's width), or where to solve
        them at rank ``d``: a :class:`saffu.data.workdir.WorkDir`, a work directory's path, or a
        :class:`saffu.interop.tokens.TokenSource`.
      embedding: selector of the token embedding, ``[V, d]`` (or ``[d, V]``).
      output: selector of the output kernel, ``[d, V]`` or ``[V, d]``; ``None`` or the same
        leaf as ``embedding`` for tied embeddings.
      bias: selector of the output bias ``[V]``; ``None`` for a model without one.
      tied: the closed form of a tied matrix (:func:`tied_matrix`).
      output_layout, embedding_layout: ``"auto"``, ``"vd"`` or ``"dv"`` (only needed when ``d = V``).
      fold: fold the unigram into the embedding and the output kernel (:func:`fold_unigram`),
        for an untied model without an output bias; ``apply(params, sample) -> logits`` and
        ``sample`` (``int[B, S]`` tokens) measure the model's normalised ``u`` component with
        one forward pass; ``fold_share``: the shared component's weight.
      embedding_rms: the explicit embeddings' root-mean-square (``None``: the leaf's own). A
        model whose embeddings start much smaller than its blocks' outputs (penzai's ``1/√d``
        next to its blocks) buries them in the residual stream at init; at ``1.0`` (the scale a
        norm layer outputs) they reach its output: ``docs/results/any_model.md`` compares the two
        on penzai's Llama-like and GPT-NeoX. A tied matrix is also the output kernel: keep its
        own RMS there (at 1.0 the step-0 logits are huge).
      progress: show the solve's progress when the pieces are solved here.

    Raises :class:`saffu._io.SaffuError` (one line) when a leaf is missing, its vocabulary
    differs from the pieces', or the pieces' rank differs from ``d``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaves = list(leaves)
    e = _locate(params, embedding, "embedding")
    o = _locate(params, output, "output") if output is not None else e
    shape = tuple(leaves[e].shape)
    if len(shape) != 2:
        raise SaffuError(f"the embedding leaf has shape {shape}; it must be a matrix [V, d]")
    vocab = pieces.vocab_size if isinstance(pieces, ExplicitPieces) else _vocab_of(pieces)
    embedding_layout = _layout(shape, vocab, "embedding", embedding_layout)
    width = shape[1] if embedding_layout == "vd" else shape[0]
    if not isinstance(pieces, ExplicitPieces):
        pieces = solve_pieces(pieces, rank=width, progress=progress)
    V = pieces.vocab_size
    if pieces.rank != width and not (fold and pieces.rank >= width - 1):
        raise SaffuError(f"the explicit pieces have rank {pieces.rank} but the model's width is {width}; "
                         f"solve them at rank {width} (or pass the work directory and they are)")
    gain = embedding_rms / _rms(leaves[e]) if embedding_rms and _rms(leaves[e]) > 0 else 1.0
    if fold:
        if o == e or bias is not None:
            raise SaffuError("folding the unigram is for an untied output layer without a bias")
        if apply is None or sample is None:
            raise SaffuError("folding the unigram measures the model with one forward pass: give apply= and sample=")
        E, B, u, centred = fold_unigram(pieces, width, embedding_rms or _rms(leaves[e]), _rms(leaves[o]), fold_share)
        put = lambda i, matrix, layout, role: jax.numpy.asarray(
            _oriented(matrix, tuple(leaves[i].shape), V, role, layout), dtype=leaves[i].dtype)
        leaves[e] = put(e, E, embedding_layout, "embedding")
        leaves[o] = put(o, np.outer(centred, u), output_layout, "output")          # logits = (h · u) · centred
        logits = np.asarray(apply(jax.tree_util.tree_unflatten(treedef, leaves), sample), np.float64)
        s = float(np.mean(logits @ centred) / (centred @ centred))
        if abs(s) < 1e-6:
            raise SaffuError("the model's last layer carries no trace of the folded direction; fold=False")
        leaves[o] = put(o, (B + np.outer(u, centred / s)).T, output_layout, "output")
    elif o == e:
        leaves[e] = _like(_oriented(tied_matrix(pieces, tied), shape, V, "embedding", embedding_layout), leaves[e],
                          gain)
    else:
        leaves[e] = _like(_oriented(pieces.embedding, shape, V, "embedding", embedding_layout), leaves[e], gain)
        leaves[o] = _like(_oriented(pieces.output.T, tuple(leaves[o].shape), V, "output", output_layout), leaves[o])
    if bias is not None:
        b = _locate(params, bias, "bias")
        if tuple(leaves[b].shape) != (V,):
            raise SaffuError(f"the output bias has shape {tuple(leaves[b].shape)}; the explicit pieces have a "
                             f"vocabulary of {V:,} tokens")
        leaves[b] = jax.numpy.asarray(pieces.bias, dtype=leaves[b].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _vocab_of(source) -> int:
    from saffu.data.workdir import WorkDir, open_workdir
    if isinstance(source, TokenSource):
        return source.vocab_size
    if isinstance(source, WorkDir):
        return source.vocab_size
    return open_workdir(source).vocab_size
