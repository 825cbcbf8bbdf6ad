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
4. Temperatures per offset and context-count bucket, ``E_p[c] ← β[p, bucket(n_p(c))] E_p[c]``, by
   :func:`saffu.solve.exact.calibrate` on the held-out documents (the logits are linear in
   them: convex), folded into ``E_p``; the attention and ``G_h`` start at zero.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

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
    ``seconds_count`` / ``seconds_factorise`` / ``seconds_calibration``, ``counted_tokens``,
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
    matrices, row_weights = [], []
    for p in range(P):
        rows, counts = count_rows(stream, (p,), counted, vocab_size=V, chunk_size=solver.chunk_size,
                                  progress=label(f"offset {p}"))
        matrices.append(offset_matrix(rows, counts, prior, solver.mu))
        seen = np.bincount(rows[:, 0], weights=counts, minlength=V)                # n_p(c)
        row_weights.append(np.sqrt(np.maximum(seen, 1.0)))
    report["seconds_count"] = time.perf_counter() - start
    tick = time.perf_counter()
    E, B, s, energy = factorise(matrices, row_weights, prior ** solver.column_power, config.rank,
                                solver.oversample, solver.power_iterations, solver.seed)
    report.update(seconds_factorise=time.perf_counter() - tick, energy=energy, singular_max=float(s[0]),
                  singular_min=float(s[-1]), offset_pairs=int(sum(S.nnz for S in matrices)))
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
