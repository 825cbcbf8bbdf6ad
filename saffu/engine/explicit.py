"""Explicit (closed-form) softmax weights and temperature calibration (formulation §1).

For ``p = softmax(x W)`` with non-negative features ``x`` and co-occurrence
``F = Σ_t x_tᵀ y_t``, every stationary point satisfies ``Xᵀ P = F``; the explicit solution is
``W[i, j] = log(F[i, j] / f[i])``, ``f[i] = Σ_j F[i, j]`` — exact for one-hot features, a
normalised geometric mixture ``∏_i P(j | i)^{x_i}`` otherwise. Zero counts are smoothed so
``log 0`` never reaches a model.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.optimize

from saffu._io import SaffuError
from saffu.configs import Smoothing


def unigram_prior(counts: np.ndarray) -> np.ndarray:
    """Add-one smoothed unigram distribution ``p(j) = (n_j + 1) / (n + V)``, ``float64[V]``
    (never zero, so its log is finite)."""
    counts = np.asarray(counts, np.float64)
    return (counts + 1.0) / (counts.sum() + counts.shape[0])


def conditional_probabilities(cooccurrence: np.ndarray, smoothing: Smoothing = Smoothing(),
                              prior: np.ndarray | None = None) -> np.ndarray:
    """Smoothed ``P(j | i)`` from ``F``.

    Args:
      cooccurrence: ``float[N, M]`` non-negative feature–target co-occurrence ``F``.
      smoothing: see :class:`Smoothing`.
      prior: ``float64[M]`` target prior ``p`` (Dirichlet only); default the add-one
        smoothed column sums of ``F``.

    Returns ``float64[N, M]``, rows summing to 1, strictly positive.
    """
    F = np.asarray(cooccurrence, np.float64)
    if F.ndim != 2:
        raise ValueError(f"co-occurrence must be 2-D [features, targets], got shape {F.shape}")
    if (F < 0).any() or not np.isfinite(F).all():
        raise SaffuError("co-occurrence statistics must be finite and non-negative")
    return _SMOOTHED[smoothing.kind](F, smoothing, prior)


def _dirichlet(F: np.ndarray, smoothing: Smoothing, prior: np.ndarray | None) -> np.ndarray:
    p = unigram_prior(F.sum(axis=0)) if prior is None else np.asarray(prior, np.float64)
    if p.shape != (F.shape[1],) or (p <= 0).any():
        raise SaffuError(f"prior must be positive with shape ({F.shape[1]},)")
    p = p / p.sum()
    return (F + smoothing.mu * p[None, :]) / (F.sum(axis=1, keepdims=True) + smoothing.mu)


def _pseudo_counts(F: np.ndarray, smoothing: Smoothing, noisy: bool) -> np.ndarray:
    noise = 1.0 - np.random.default_rng(smoothing.seed).random(F.shape) if noisy else 1.0   # in (0, 1]
    F = F + smoothing.alpha * noise
    return F / F.sum(axis=1, keepdims=True)


#: Each smoothing (``Smoothing.kind``): ``(F float64[N, M], smoothing, prior) -> rows``.
_SMOOTHED = {"dirichlet": _dirichlet,
             "additive": lambda F, smoothing, prior: _pseudo_counts(F, smoothing, noisy=False),
             "noise": lambda F, smoothing, prior: _pseudo_counts(F, smoothing, noisy=True)}


def explicit_softmax_weights(cooccurrence: np.ndarray, smoothing: Smoothing = Smoothing(),
                             prior: np.ndarray | None = None,
                             log_likelihood_ratio: bool = False) -> np.ndarray:
    """The explicit solution ``W = log rownorm(F)`` (smoothed), ``float64[N, M]``.

    With ``log_likelihood_ratio`` the prior is subtracted, ``W[i, j] = log P(j|i) − log p(j)``
    (naive Bayes over feature groups; pair it with an output bias ``log p``), where ``p`` is
    ``prior`` or the add-one smoothed column sums of ``F``.
    """
    weights = np.log(conditional_probabilities(cooccurrence, smoothing, prior))
    if log_likelihood_ratio:
        p = unigram_prior(np.asarray(cooccurrence).sum(axis=0)) if prior is None else prior
        weights = weights - np.log(np.asarray(p, np.float64) / np.sum(p))[None, :]
    return weights


def calibrate_temperature(loss_fn: Callable[[float], float], bounds: tuple[float, float] = (0.05, 4.0),
                          tolerance: float = 1e-3) -> tuple[float, float]:
    """1-D search for the layer temperature ``β`` minimising ``loss_fn(β)`` (bounded Brent).

    ``loss_fn`` must score data the counts did not see (a held-out slice of the training
    stream): on counted data the search over-trusts the statistics (formulation §1).
    Returns ``(β, loss at β)``.
    """
    result = scipy.optimize.minimize_scalar(loss_fn, bounds=bounds, method="bounded",
                                            options={"xatol": tolerance})
    return float(result.x), float(result.fun)
