"""Explicit low-rank factors of the exact offset groups, and the factorised model's solution.

1. Held-out documents and exact sparse counts per offset ``p < P`` (:func:`saffu.ngram.counts.
   count_rows`), as :func:`saffu.solve.exact.solve_exact` does.
2. Per offset the exact explicit matrix ``L_p[c, y] = log P_p(y | c) − log p(y)`` (Witten-Bell,
   smoothed towards the unigram). Its constant part — ``log(μ_c / (n(c) + μ_c))`` on every unseen
   pair of a row — adds the same value to every logit of a context and cancels in the softmax,
   so only the seen entries ``S_p[c, y] = log(1 + n(c, y) / (μ_c p(y)))`` (sparse, ≥ 0) are
   factorised: ``logits = log p + Σ_p S_p[x_{t−p}]`` is the same model.
3. One randomized SVD (:func:`randomized_svd`) of the stacked, weighted matrix
   ``A = [W_0 S_0 D; W_1 S_1 D; …]`` (``P·V × V``; ``W_p = diag(√n_p(c))``: a context's error
   counts as often as it is seen; ``D = diag(p(y)^a)``), never formed densely: the products are
   sparse matrix products. Then ``E_p = W_p⁻¹ U_p √Σ`` and ``B = √Σ Vᵀ D⁻¹``, so
   ``E_p B ≈ S_p`` in the weighted least-squares sense.
4. A few likelihood steps on the statistics (:func:`refine_factors`): least squares on log-ratios
   is not the softmax's loss, so from the SVD's factors ``E, B`` take Adam steps on
   ``Σ_p Σ_c n_p(c) · KL(P̃_p(·|c) ‖ softmax(log p + E_p[c] B))`` — each offset's smoothed
   conditional as the target of its rows, ``V × V`` per offset in row blocks, a cost independent
   of the corpus length. By default only the previous token's rows (and ``B``) move, for six
   steps: on babylm-2023-4src they took the dev sample from 0.20 bits/byte behind the sparse
   source to 0.01 behind it; ten steps reach it (``FactorConfig.refine_steps`` /
   ``refine_offsets``).
5. Temperatures per offset and context-count bucket, ``E_p[c] ← β[p, bucket(n_p(c))] E_p[c]``, by
   :func:`saffu.solve.exact.calibrate` on the held-out documents (the logits are linear in
   them: convex), folded into ``E_p``; the attention and ``G_h`` start at zero.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.sparse as sp
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import FactorConfig, FactorisedConfig
from saffu.data.workdir import WorkDir
from saffu.engine import accounting
from saffu.models.exact import document_contexts
from saffu.models.factorised import Params, init_params, structure_output
from saffu.ngram.counts import count_rows
from saffu.solve.exact import calibrate, held_out_prior


def randomized_svd(matvec: Callable[[np.ndarray], np.ndarray], rmatvec: Callable[[np.ndarray], np.ndarray],
                   shape: tuple[int, int], rank: int, oversample: int = 16, power_iterations: int = 2,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The leading ``rank`` singular triplets of a matrix ``A`` (``m × n``) known only through
    its products (Halko, Martinsson & Tropp 2011, algorithm 4.4 with 5.1).

    Args:
      matvec: ``X float64[n, k] -> A X float64[m, k]``.
      rmatvec: ``Y float64[m, k] -> Aᵀ Y float64[n, k]``.
      shape: ``(m, n)``.
      rank: ``r ≤ min(m, n)``.
      oversample: extra random directions (``r + oversample`` in all, at most ``min(m, n)``).
      power_iterations: subspace iterations (each orthonormalised), sharpening a slowly
        decaying spectrum.
      seed: of the Gaussian test matrix.

    Returns ``U float64[m, r]``, ``s float64[r]`` (descending), ``Vt float64[r, n]``. Exact (to
    rounding) when ``A`` has rank ``≤ r + oversample``.
    """
    m, n = shape
    if not 1 <= rank <= min(m, n):
        raise SaffuError(f"rank {rank} must be between 1 and {min(m, n)}")
    width = min(rank + oversample, m, n)
    Q, _ = np.linalg.qr(matvec(np.random.default_rng(seed).standard_normal((n, width))))
    for _ in range(power_iterations):
        Z, _ = np.linalg.qr(rmatvec(Q))
        Q, _ = np.linalg.qr(matvec(Z))
    U_small, s, Vt = np.linalg.svd(rmatvec(Q).T, full_matrices=False)          # Qᵀ A = Ũ Σ Vᵀ
    return (Q @ U_small)[:, :rank], s[:rank], Vt[:rank]


def offset_matrix(rows: np.ndarray, counts: np.ndarray, prior: np.ndarray, mu: float) -> sp.csr_matrix:
    """The seen entries of one exact offset group, ``S[c, y] = log(1 + n(c, y) / (μ_c p(y)))``
    with Witten-Bell ``μ_c = mu · t(c)`` (:func:`saffu.solve.exact.build_group` with
    ``per_type``): ``rows int32[U, 2]`` (context token, target), ``counts int64[U]``,
    ``prior float64[V]`` -> ``float64`` CSR ``[V, V]``."""
    V = len(prior)
    context, target = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    types = np.bincount(context, minlength=V)
    values = np.log1p(counts / (mu * types[context] * prior[target]))
    return sp.csr_matrix((values, (context, target)), shape=(V, V))


def offset_targets(rows: np.ndarray, counts: np.ndarray, prior: np.ndarray, mu: float):
    """One exact offset group's smoothed conditionals as likelihood targets for
    :func:`refine_factors`: ``n(c) · P̃(y | c) = ρ_c n(c, y) + ρ_c μ_c p(y)`` with the Witten-Bell
    ``P̃(y | c) = (n(c, y) + μ_c p(y)) / (n(c) + μ_c)``, ``μ_c = mu · t(c)`` and
    ``ρ_c = n(c) / (n(c) + μ_c)`` (:func:`offset_matrix`'s model: ``log P̃ = log p + S + const_c``).

    Args:
      rows: ``int32[U, 2]`` (context token, target); counts: ``int64[U]``; prior: ``float64[V]``.

    Returns the seen part ``ρ_c n(c, y)`` (``float64`` CSR ``[V, V]``), ``n(c) float64[V]`` and the
    prior's weight ``ρ_c μ_c float64[V]``.
    """
    V = len(prior)
    context, target = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    seen = np.bincount(context, weights=counts, minlength=V)
    mu_c = mu * np.bincount(context, minlength=V)
    rho = np.divide(seen, seen + mu_c, out=np.zeros(V), where=seen > 0)
    return sp.csr_matrix((rho[context] * counts, (context, target)), shape=(V, V)), seen, rho * mu_c


#: Bytes of one row block's ``V``-wide float32 logits in :func:`refine_factors` (V = 8,192: 256
#: rows; 30,433: 64): blocks whose arrays stay in cache. Per row, blocks of 256 took 0.22 s per
#: 8,192 rows against 0.44–0.47 s for 512–2,048 (V = 8,192, rank 96, this 2-core CPU).
REFINE_BLOCK_BYTES = 1 << 23


class RefineBlocks(NamedTuple):
    """Every refined offset's targets in row blocks of ``size`` rows, stacked (one compiled shape):
    block ``i`` covers rows ``start[i] … start[i] + size`` of offset ``offset[i]``; its seen targets
    are ``values`` at ``(rows, cols)`` (padding: weight 0 at ``(0, 0)``), ``n`` and ``smooth`` are
    ``n(c)`` and the prior's weight ``ρ_c μ_c`` of its rows (0 past ``V``), ``weight`` is ``Σ n``
    over every block (the loss's normaliser)."""

    offset: jax.Array      # int32[N]
    start: jax.Array       # int32[N]
    rows: jax.Array        # int32[N, C]
    cols: jax.Array        # int32[N, C]
    values: jax.Array      # float32[N, C]
    n: jax.Array           # float32[N, size]
    smooth: jax.Array      # float32[N, size]
    weight: float


def _refine_blocks(targets, vocab_size: int) -> tuple[int, RefineBlocks]:
    """Row blocks of every offset's targets, padded to one shape and stacked: ``(block rows,
    RefineBlocks)``."""
    V = vocab_size
    fit = max(REFINE_BLOCK_BYTES // (4 * V), 1)
    size = int(min(1 << (fit.bit_length() - 1), V))
    slices = [(p, start, W[start:start + size].tocoo(), n[start:start + size], smooth[start:start + size])
              for p, (W, n, smooth) in enumerate(targets) for start in range(0, V, size)]
    capacity = max(1, max(part.nnz for _, _, part, _, _ in slices))
    count = len(slices)
    rows, cols = np.zeros((count, capacity), np.int32), np.zeros((count, capacity), np.int32)
    values = np.zeros((count, capacity), np.float32)                   # padding: weight 0 at (0, 0)
    n_rows, smooth_rows = np.zeros((count, size), np.float32), np.zeros((count, size), np.float32)
    weight = 0.0
    for i, (_, _, part, n, smooth) in enumerate(slices):
        rows[i, :part.nnz], cols[i, :part.nnz], values[i, :part.nnz] = part.row, part.col, part.data
        n_rows[i, :len(n)], smooth_rows[i, :len(smooth)] = n, smooth
        weight += float(n.sum())
    blocks = RefineBlocks(jnp.asarray([p for p, *_ in slices], jnp.int32),
                          jnp.asarray([start for _, start, *_ in slices], jnp.int32),
                          *map(jnp.asarray, (rows, cols, values, n_rows, smooth_rows)), weight)
    return size, blocks


def _block_loss(E_block, B, log_prior, prior, rows, cols, values, n, smooth):
    """One row block of :func:`statistics_loss`: ``Σ_c n(c) lse(z_c) − Σ T z`` with
    ``z = log p + E_block B`` and ``T`` the block's dense targets ``n(c) P̃(·|c)``."""
    z = log_prior[None, :] + E_block @ B
    T = jnp.zeros_like(z).at[rows, cols].add(values) + smooth[:, None] * prior[None, :]
    return jnp.sum(n * jax.nn.logsumexp(z, axis=1)) - jnp.sum(T * z)


def _loss_grads(E, B, log_prior, prior, blocks: RefineBlocks, size: int):
    """:func:`statistics_loss` traced: the blocks in order (one block's ``size × V`` logits live
    at a time), each block's gradient added into the rows it covers."""
    _, V, r = E.shape
    padded = jnp.pad(E, ((0, 0), (0, -V % size), (0, 0)))
    block_grads = jax.value_and_grad(_block_loss, argnums=(0, 1))

    def one(carry, block):
        total, grad_E, grad_B = carry
        p, start, rows, cols, values, n, smooth = block
        E_block = jax.lax.dynamic_slice(padded[p], (start, 0), (size, r))
        loss, (g_E, g_B) = block_grads(E_block, B, log_prior, prior, rows, cols, values, n, smooth)
        grad_E = jax.lax.dynamic_update_slice(grad_E, g_E[None], (p, start, 0))   # blocks never overlap
        return (total + loss, grad_E, grad_B + g_B), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros_like(padded), jnp.zeros_like(B))
    (total, grad_E, grad_B), _ = jax.lax.scan(one, init, tuple(blocks)[:7])
    weight = blocks.weight
    return total / weight, grad_E[:, :V] / weight, grad_B / weight


@functools.partial(jax.jit, static_argnames=("size",))
def _statistics_loss(E, B, log_prior, prior, blocks: RefineBlocks, size: int):
    return _loss_grads(E, B, log_prior, prior, blocks, size)


def _priors(prior: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``log p`` and ``p`` as float32 jit arguments."""
    return jnp.asarray(np.log(prior), jnp.float32), jnp.asarray(prior, jnp.float32)


def statistics_loss(E: jax.Array, B: jax.Array, prior: np.ndarray, blocks) -> tuple[float, jax.Array, jax.Array]:
    """The cross-entropy of the factorised offsets against their smoothed conditionals, per
    counted target: ``Σ_p Σ_c Σ_y n_p(c) P̃_p(y|c) · −log softmax(log p + E_p[c] B)_y / Σ_p Σ_c n_p(c)``
    over the offsets ``p`` that ``blocks`` hold (the sparse offsets' own value of it is their
    entropy; the excess is the count-weighted KL).

    Args:
      E: ``float32[P, V, r]``; B: ``float32[r, V]``; prior: ``float64[V]``;
      blocks: ``(block rows, blocks)`` of :func:`_refine_blocks`.

    Returns the loss (``float``) and its gradients ``float32[P, V, r]`` (zero for the offsets
    ``blocks`` leave out) and ``float32[r, V]``.
    """
    size, parts = blocks
    loss, grad_E, grad_B = _statistics_loss(E, B, *_priors(prior), parts, size)
    return float(loss), grad_E, grad_B


@functools.partial(jax.jit, static_argnames=("size", "steps", "learning_rate", "momentum"))
def _refine(E, B, log_prior, prior, blocks: RefineBlocks, size: int, steps: int, learning_rate: float,
            momentum: float):
    """``steps`` Adam steps on :func:`_loss_grads` in one executable: ``(E, B, losses float32[steps])``."""
    optimizer = optax.adam(learning_rate, b1=momentum)
    params = {"E": E, "B": B}

    def step(carry, _):
        params, state = carry
        loss, grad_E, grad_B = _loss_grads(params["E"], params["B"], log_prior, prior, blocks, size)
        updates, state = optimizer.update({"E": grad_E, "B": grad_B}, state, params)
        return (optax.apply_updates(params, updates), state), loss

    (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), None, length=steps)
    return params["E"], params["B"], losses


def refine_factors(E: np.ndarray, B: np.ndarray, targets, prior: np.ndarray, steps: int, learning_rate: float,
                   momentum: float, progress: bool = False) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """``steps`` Adam steps (``b1 = momentum``) on :func:`statistics_loss` from the factors ``E
    float[P, V, r]``, ``B float[r, V]`` (the SVD's), with ``targets`` the :func:`offset_targets`
    of the first ``len(targets) ≤ P`` offsets: their rows of ``E`` and all of ``B`` move, the
    other offsets' rows keep the SVD's values. Every step reads those offsets' ``V`` rows
    (``3 V² r`` multiply-adds each), not the corpus; in a multi-process job every process takes
    the same steps on the merged counts. All the steps are one jitted call (a ``lax.scan``; the
    statistics are its arguments, nothing is read back between steps). Returns the refined
    ``E float32[P, V, r]``, ``B float32[r, V]`` and the loss before each step (the first: the
    SVD's factors'; no pass after the last step is spent on its loss)."""
    if not 1 <= len(targets) <= E.shape[0]:
        raise SaffuError(f"refine {len(targets)} offsets of a model with {E.shape[0]}")
    size, blocks = _refine_blocks(targets, len(prior))
    with tqdm(total=steps, desc="refine", disable=not progress or not steps, leave=False) as bar:
        E, B, losses = _refine(jnp.asarray(E, jnp.float32), jnp.asarray(B, jnp.float32), *_priors(prior), blocks,
                               size=size, steps=int(steps), learning_rate=float(learning_rate),
                               momentum=float(momentum))
        losses = [float(loss) for loss in np.asarray(losses)]
        bar.update(steps)
    return np.asarray(E), np.asarray(B), losses


def factorise(matrices: list[sp.csr_matrix], row_weights: list[np.ndarray], column_weights: np.ndarray,
              rank: int, oversample: int = 16, power_iterations: int = 2, seed: int = 0):
    """Rank-``r`` factors of the stacked, weighted ``[W_0 S_0 D; …]`` (module docstring).

    Args:
      matrices: ``P`` sparse ``[V, V]``.
      row_weights: ``P`` arrays ``float64[V]`` (> 0), ``W_p``'s diagonals.
      column_weights: ``float64[V]`` (> 0), ``D``'s diagonal.
      rank, oversample, power_iterations, seed: see :func:`randomized_svd`.

    Returns ``E float64[P, V, r]``, ``B float64[r, V]`` (each component scaled so that ``E`` and
    ``B`` have equal root-mean-squares; ``E B`` is unchanged), the singular values
    ``float64[r]`` and the share of the weighted matrix's squared Frobenius norm that the rank
    keeps.
    """
    P, V = len(matrices), matrices[0].shape[0]
    A = (sp.vstack([sp.diags(w) @ S for S, w in zip(matrices, row_weights)]) @ sp.diags(column_weights)).tocsr()
    U, s, Vt = randomized_svd(lambda X: A @ X, lambda Y: A.T @ Y, A.shape, rank, oversample, power_iterations,
                              seed)
    root = np.sqrt(s)
    E = (U * root).reshape(P, V, rank) / np.stack(row_weights)[:, :, None]
    B = root[:, None] * Vt / column_weights[None, :]
    # balance each component (E_k c_k, B_k / c_k leaves E B unchanged) to equal root-mean-squares,
    # so gradient steps of one size (Adam's) suit both factors when training starts from them
    balance = np.sqrt(np.sqrt((B ** 2).mean(axis=1)) / np.sqrt((E ** 2).mean(axis=(0, 1))))
    return E * balance, B / balance[:, None], s, float((s ** 2).sum() / A.multiply(A).sum())


#: Bytes of the ``V``-wide float32 rows of one calibration batch: the factorised model's rows
#: are dense matmul outputs, and batches whose rows stay in cache cost a half to two thirds of
#: 512-position batches per held-out position on CPU (measured at V = 8,192 and 30,433; the
#: exact model's gathered rows measured no faster so, 91 s against 79 s, and keep their batches).
CALIBRATION_BLOCK_BYTES = 1 << 22


def calibration_positions(vocab_size: int) -> int:
    """Held-out positions per calibration batch of the factorised model: a power of two in
    ``[16, 128]`` whose ``V``-wide float32 rows take about :data:`CALIBRATION_BLOCK_BYTES`
    (V = 8,192: 128; V = 30,433: 32; V = 50,000: 16)."""
    fit = max(CALIBRATION_BLOCK_BYTES // (4 * vocab_size), 1)
    return int(min(max(1 << (fit.bit_length() - 1), 16), 128))


def factor_rows(params: Params, config: FactorisedConfig, tokens: jax.Array):
    """The explicit factorised model split as :func:`saffu.solve.exact.exact_rows` does, for
    :func:`saffu.solve.exact.calibrate`: base ``b``, and per offset ``p`` the row
    ``E_p[x_{t−p}] B`` with the count bucket ``params["bucket"][p, x_{t−p}]`` (``int32[P, V]``).
    The attention is left out: it is zero in the explicit solution (``G_h = 0``)."""
    B, S = tokens.shape
    context = document_contexts(tokens, config.context).reshape(B * S, config.context)
    terms = ((params["embeddings"][p][context[:, p]] @ params["output_weights"], params["bucket"][p][context[:, p]])
             for p in range(config.positions))
    return params["output_bias"][None, :], terms


def solve_factorised(workdir: WorkDir, config: FactorisedConfig, solver: FactorConfig = FactorConfig(),
                     progress: bool = True) -> tuple[Params, dict[str, Any]]:
    """Explicit parameters of ``config`` from the training split of ``workdir``.

    Returns the params (:mod:`saffu.models.factorised`) and a report: ``seconds`` and
    ``seconds_count`` / ``seconds_factorise`` / ``seconds_refine`` / ``seconds_calibration``,
    ``refine_loss_svd`` and ``refine_loss_last_step`` (:func:`statistics_loss` of the SVD's
    factors and before the last refinement step, nats per counted target; with
    ``solver.refine_steps``), ``counted_tokens``,
    ``holdout_tokens``, ``energy`` (share of the weighted matrix the rank keeps), the largest and
    smallest kept singular values, ``holdout_loss`` (nats/token, calibrated), on the first
    quarter of the held-out batches ``holdout_loss_unscaled`` (all temperatures 1) and
    ``holdout_loss_first_part`` (at that quarter's optimum), the temperatures ``beta_{p}_{b}`` and
    ``peak_rss_mb``. A structured output factor (``config.output``) is the SVD of the solved
    dense ``B`` (:func:`saffu.models.factorised.structure_output`); the temperatures are fitted
    with the dense ``B``.
    """
    start = time.perf_counter()
    stream, holdout, counted, prior, report = held_out_prior(workdir, config.vocab_size, solver.holdout_tokens,
                                                             solver.chunk_size, progress)
    V, P = config.vocab_size, config.positions
    label = lambda name: name if progress else None
    matrices, row_weights, targets = [], [], []
    for p in range(P):
        rows, counts = count_rows(stream, (p,), counted, vocab_size=V, chunk_size=solver.chunk_size,
                                  progress=label(f"offset {p}"))
        matrices.append(offset_matrix(rows, counts, prior, solver.mu))
        if solver.refine_steps and p < solver.refine_offsets:
            targets.append(offset_targets(rows, counts, prior, solver.mu))
        seen = np.bincount(rows[:, 0], weights=counts, minlength=V)                # n_p(c)
        row_weights.append(np.sqrt(np.maximum(seen, 1.0)))
    report["seconds_count"] = time.perf_counter() - start
    tick = time.perf_counter()
    E, B, s, energy = factorise(matrices, row_weights, prior ** solver.column_power, config.rank,
                                solver.oversample, solver.power_iterations, solver.seed)
    report.update(seconds_factorise=time.perf_counter() - tick, energy=energy, singular_max=float(s[0]),
                  singular_min=float(s[-1]), offset_pairs=int(sum(S.nnz for S in matrices)))
    if solver.refine_steps:
        tick = time.perf_counter()
        E, B, losses = refine_factors(E, B, targets, prior, solver.refine_steps, solver.refine_learning_rate,
                                      solver.refine_momentum, progress)
        report.update(seconds_refine=time.perf_counter() - tick, refine_loss_svd=losses[0],
                      refine_loss_last_step=losses[-1])
    dense = dataclasses.replace(config, output="dense", guide_share=0.0)   # a structured B: the SVD of the dense one
    params = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype),     # the init's tree, all zeros
                          jax.eval_shape(lambda: init_params(dense, jax.random.key(0))))
    params.update(embeddings=jnp.asarray(E, jnp.float32), output_weights=jnp.asarray(B, jnp.float32),
                  output_bias=jnp.asarray(np.log(prior), jnp.float32))
    tick = time.perf_counter()
    if holdout:
        bucket = np.stack([np.searchsorted(np.asarray(solver.buckets), w ** 2, side="right") for w in row_weights])
        calibrating = {**params, "beta": jnp.ones((P, len(solver.buckets) + 1), jnp.float32),
                       "bucket": jnp.asarray(bucket, jnp.int32)}
        beta, loss, unscaled, first_loss, evaluations = calibrate(
            calibrating, config, stream, holdout, progress, rows_fn=factor_rows,
            iterations=solver.calibration_iterations, final_iterations=solver.final_iterations,
            seq_len=calibration_positions(V), batch_size=1)
        scale = np.asarray(beta)[np.arange(P)[:, None], bucket]                    # [P, V]
        params["embeddings"] = params["embeddings"] * jnp.asarray(scale, jnp.float32)[:, :, None]
        report.update(holdout_loss=loss, holdout_loss_unscaled=unscaled, holdout_loss_first_part=first_loss,
                      calibration_evaluations=evaluations,
                      **{f"beta_{p}_{b}": float(beta[p, b]) for p in range(P) for b in range(beta.shape[1])})
    report["seconds_calibration"] = time.perf_counter() - tick
    params = structure_output(params, config)
    report["seconds"] = time.perf_counter() - start
    report.update(accounting.memory_record())
    return params, report
