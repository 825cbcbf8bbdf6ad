import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saffu import SaffuError, Smoothing, calibrate_temperature, conditional_probabilities, explicit_softmax_weights


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 12), m=st.integers(2, 15))
def test_explicit_solution_of_one_hot_features_is_stationary(seed, n, m):
    """Gradient Xᵀ(P − Y)/T of the cross-entropy is ~0 at W = log rownorm(F) (float64)."""
    rng = np.random.default_rng(seed)
    T = 400
    x_ids = rng.integers(0, n, T)
    y_ids = (x_ids * 3 + rng.integers(0, 3, T)) % m
    X = np.eye(n)[x_ids]
    Y = np.eye(m)[y_ids]
    F = X.T @ Y
    W = explicit_softmax_weights(F, Smoothing(kind="additive", alpha=1e-12))
    grad = X.T @ (_softmax(X @ W) - Y) / T
    assert np.abs(grad).max() < 1e-8     # tolerance: smoothing 1e-12 per cell, float64 rounding
    # and it is a minimum: a random perturbation never lowers the loss
    loss = lambda W_: -np.sum(Y * np.log(_softmax(X @ W_))) / T
    assert loss(W + 1e-3 * rng.standard_normal(W.shape)) >= loss(W) - 1e-12


def test_smoothing_formulas_against_hand_computation():
    F = np.array([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    prior = np.array([0.5, 0.25, 0.25])
    P = conditional_probabilities(F, Smoothing(kind="dirichlet", mu=4.0), prior)
    np.testing.assert_allclose(P[0], [(3 + 2) / 8, (1 + 1) / 8, (0 + 1) / 8], rtol=1e-15)
    np.testing.assert_allclose(P[1], prior, rtol=1e-15)          # unseen row -> prior
    P = conditional_probabilities(F, Smoothing(kind="additive", alpha=0.5))
    np.testing.assert_allclose(P[0], [3.5 / 5.5, 1.5 / 5.5, 0.5 / 5.5], rtol=1e-15)
    P = conditional_probabilities(F, Smoothing(kind="noise", alpha=0.1))
    assert (P > 0).all() and np.allclose(P.sum(axis=1), 1)
    np.testing.assert_array_equal(P, conditional_probabilities(F, Smoothing(kind="noise", alpha=0.1)))


def test_log_likelihood_ratio_form_subtracts_the_prior():
    F = np.array([[3.0, 1.0], [1.0, 3.0]])
    prior = np.array([0.5, 0.5])
    W = explicit_softmax_weights(F, Smoothing(mu=1.0), prior, log_likelihood_ratio=True)
    np.testing.assert_allclose(W, np.log(conditional_probabilities(F, Smoothing(mu=1.0), prior) / 0.5))


def test_invalid_inputs_are_clear_errors():
    with pytest.raises(SaffuError, match="non-negative"):
        conditional_probabilities(np.array([[1.0, -1.0]]))
    with pytest.raises(SaffuError, match="unknown smoothing"):
        Smoothing(kind="laplace")
    with pytest.raises(SaffuError, match="mu > 0"):
        Smoothing(mu=0.0)
    weights = explicit_softmax_weights(np.zeros((2, 3)))
    assert np.isfinite(weights).all()                                 # never log 0


def test_temperature_calibration_matches_a_grid_search_on_held_out_data():
    """The use it has: the temperature β of explicit log-likelihood ratios L that minimises a
    held-out NLL of softmax(log p + β L), against a float64 grid search."""
    rng = np.random.default_rng(0)
    m, T = 6, 500
    prior = np.full(m, 1 / m)
    F = rng.integers(0, 20, (4, m)).astype(float)
    L = explicit_softmax_weights(F, Smoothing(mu=2.0), prior, log_likelihood_ratio=True)
    x = rng.integers(0, 4, T)
    truth = _softmax(np.log(prior) + 0.6 * L[x])                       # held-out data sharper/flatter than F
    y = np.array([rng.choice(m, p=row) for row in truth])
    nll = lambda b: -np.log(_softmax(np.log(prior) + b * L[x])[np.arange(T), y]).mean()
    beta, value = calibrate_temperature(nll)
    grid = np.linspace(0.05, 4.0, 3951)
    best = grid[np.argmin([nll(b) for b in grid])]
    assert abs(beta - best) < 2e-3 and value <= nll(best) + 1e-9
    assert value < nll(1.0)                                             # calibration beats β = 1 here
