"""Explicit low-rank factors (saffu.solve.factors) and the factorised model (saffu.models.factorised)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import ExactConfig, FactorConfig, FactorisedConfig
from saffu.engine.explicit import unigram_prior
from saffu.models.exact import exact_logits
from saffu.models.factorised import factorised_logits, init_params
from saffu.ngram.counts import count_rows
from saffu.solve.exact import solve_exact
from saffu.solve.factors import (
    _refine_blocks,
    factorise,
    offset_matrix,
    offset_targets,
    randomized_svd,
    refine_factors,
    solve_factorised,
    statistics_loss,
)


def test_randomized_svd_matches_numpy_on_a_matrix_of_known_rank():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((120, 7)) @ np.diag([50, 20, 9, 5, 2, 1, 0.5]) @ rng.standard_normal((7, 90))
    U, s, Vt = randomized_svd(lambda X: A @ X, lambda Y: A.T @ Y, A.shape, rank=7, oversample=5)
    reference = np.linalg.svd(A, compute_uv=False)
    np.testing.assert_allclose(s, reference[:7], rtol=1e-10)
    np.testing.assert_allclose((U * s) @ Vt, A, atol=1e-9)                   # rank 7: exact
    np.testing.assert_allclose(U.T @ U, np.eye(7), atol=1e-10)
    # fewer components than the rank: the leading triplets, as numpy's (signs aside)
    U3, s3, Vt3 = randomized_svd(lambda X: A @ X, lambda Y: A.T @ Y, A.shape, rank=3, oversample=4)
    u, _, vt = np.linalg.svd(A, full_matrices=False)
    np.testing.assert_allclose(s3, reference[:3], rtol=1e-8)
    np.testing.assert_allclose(np.abs(np.sum(U3 * u[:, :3], axis=0)), 1.0, atol=1e-8)
    np.testing.assert_allclose(np.abs(np.sum(Vt3 * vt[:3], axis=1)), 1.0, atol=1e-8)
    with pytest.raises(SaffuError, match="rank"):
        randomized_svd(lambda X: A @ X, lambda Y: A.T @ Y, A.shape, rank=91)


def _offset_matrices(workdir, positions, mu=2.0):
    stream = workdir.tokens(workdir.train_split)
    V = workdir.vocab_size
    unigram_rows, unigram_counts = count_rows(stream, (), [(1, len(stream))], vocab_size=V)
    counts = np.zeros(V, np.int64)
    counts[unigram_rows[:, 0]] = unigram_counts
    prior = unigram_prior(counts)
    out = []
    for p in range(positions):
        rows, pair_counts = count_rows(stream, (p,), [(1, len(stream))], vocab_size=V)
        out.append((offset_matrix(rows, pair_counts, prior, mu), rows, pair_counts))
    return prior, out


def test_offset_matrix_is_the_dense_witten_bell_formula(tiny_workdir):
    V = tiny_workdir.vocab_size
    prior, [(S, rows, counts)] = _offset_matrices(tiny_workdir, 1, mu=0.7)
    n = np.zeros((V, V))
    n[rows[:, 0], rows[:, 1]] = counts
    types = (n > 0).sum(axis=1, keepdims=True)
    reference = np.log1p(n / (0.7 * np.maximum(types, 1) * prior[None, :]))    # 0 where unseen
    np.testing.assert_allclose(S.toarray(), reference, rtol=1e-12, atol=0)


def test_full_rank_factors_are_the_sparse_exact_model(tiny_workdir):
    """At full rank the factorised model (temperatures 1) has the exact model's log-probabilities
    (offset groups, Witten-Bell, one temperature 1 each): the constants cancel in the softmax and
    the balanced factors multiply back to the matrices."""
    V, P = tiny_workdir.vocab_size, 2
    prior, parts = _offset_matrices(tiny_workdir, P)
    matrices = [S for S, _, _ in parts]
    weights = [np.sqrt(np.maximum(np.bincount(rows[:, 0], weights=counts, minlength=V), 1.0))
               for _, rows, counts in parts]
    E, B, _, energy = factorise(matrices, weights, prior ** 0.5, rank=V, oversample=0)
    assert energy == pytest.approx(1.0, abs=1e-9)
    for p in range(P):
        np.testing.assert_allclose(E[p] @ B, matrices[p].toarray(), atol=1e-8)
    config = FactorisedConfig(vocab_size=V, rank=V, positions=P, heads=0)
    params = {"embeddings": jnp.asarray(E, jnp.float32), "output_weights": jnp.asarray(B, jnp.float32),
              "output_bias": jnp.asarray(np.log(prior), jnp.float32), "value_weights": jnp.zeros((0, V, V))}
    exact = ExactConfig(vocab_size=V, groups=((0,), (1,)), buckets=(), holdout_tokens=0, smoothing="witten_bell",
                        nested=False)
    exact_params, _ = solve_exact(tiny_workdir, exact, progress=False)
    tokens = jnp.asarray(np.asarray(tiny_workdir.tokens("dev"))[None, :64].astype(np.int32))
    got = jax.nn.log_softmax(factorised_logits(params, config, tokens), axis=-1)
    want = jax.nn.log_softmax(exact_logits(exact_params, exact, tokens), axis=-1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4)   # float32 logits of ~10


def test_explicit_solution_has_the_random_init_tree_and_calibrates(tiny_workdir):
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=16, positions=2, radius=4, heads=2)
    params, report = solve_factorised(tiny_workdir, config, FactorConfig(holdout_tokens=200, buckets=(3,)),
                                      progress=False)
    template = init_params(config, jax.random.key(0))
    assert jax.tree.structure(params) == jax.tree.structure(template)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(template)))
    assert not np.any(np.asarray(params["value_weights"])) and not np.any(np.asarray(params["attention_0"]))
    assert report["holdout_loss_first_part"] < report["holdout_loss_unscaled"]   # the same tokens
    assert 0 < report["energy"] < 1
    E, B = np.asarray(params["embeddings"]), np.asarray(params["output_weights"])
    assert np.all(np.isfinite(E)) and np.all(np.isfinite(B))


def test_one_final_newton_step_reaches_the_held_out_optimum_of_three(tiny_workdir):
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=16, positions=2, radius=4, heads=1)
    reports = {final: solve_factorised(tiny_workdir, config, FactorConfig(holdout_tokens=300, buckets=(3,),
                                                                          final_iterations=final), progress=False)[1]
               for final in (0, 1, 3)}
    assert reports[1]["calibration_evaluations"] < reports[3]["calibration_evaluations"]
    assert reports[1]["holdout_loss"] <= reports[0]["holdout_loss"] + 1e-6          # the full-slice step helps
    assert reports[1]["holdout_loss"] == pytest.approx(reports[3]["holdout_loss"], abs=1e-3)
    with pytest.raises(SaffuError, match="final_iterations"):
        FactorConfig(final_iterations=-1)


def test_calibration_batches_sized_to_the_cache_keep_the_optimum(tiny_workdir, monkeypatch):
    import saffu.solve.factors as factors
    assert [factors.calibration_positions(v) for v in (512, 8192, 30433, 50000)] == [128, 128, 32, 16]
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=16, positions=2, radius=4, heads=1)
    solver = FactorConfig(holdout_tokens=300, buckets=(3,), final_iterations=5,     # to the whole slice's optimum
                          refine_steps=0)                                            # the calibration alone
    large = solve_factorised(tiny_workdir, config, solver, progress=False)[1]       # V = 280: 128 positions
    monkeypatch.setattr(factors, "calibration_positions", lambda vocab_size: 16)
    small = solve_factorised(tiny_workdir, config, solver, progress=False)[1]
    for key in (k for k in small if k.startswith("beta_") or k == "holdout_loss"):
        assert small[key] == pytest.approx(large[key], abs=1e-4), key


def test_attention_counts_only_once_its_value_map_moves(tiny_workdir):
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=8, positions=1, radius=4, heads=1)
    params = init_params(config, jax.random.key(1))
    tokens = jnp.asarray(np.asarray(tiny_workdir.tokens("dev"))[None, :40].astype(np.int32))
    still = {**params, "value_weights": jnp.zeros_like(params["value_weights"])}
    moved_attention = {**still, "attention_0": params["attention_0"] * 10}
    np.testing.assert_array_equal(factorised_logits(still, config, tokens),
                                  factorised_logits(moved_attention, config, tokens))
    assert not np.allclose(factorised_logits(params, config, tokens), factorised_logits(still, config, tokens))
    # a document's first position reads only <pad> rows before it: no earlier document leaks in
    stream = np.asarray(tiny_workdir.tokens("dev"))
    starts = np.flatnonzero(stream[:200] == 1) + 1
    start = int(starts[starts > 8][0])
    window = jnp.asarray(stream[None, start - 6:start + 4].astype(np.int32))
    other = np.asarray(window).copy()
    other[0, :5] = (other[0, :5] + 7) % (config.vocab_size - 2) + 2                  # change the earlier document
    a, b = factorised_logits(params, config, window), factorised_logits(params, config, jnp.asarray(other))
    np.testing.assert_allclose(np.asarray(a)[0, 6:], np.asarray(b)[0, 6:], atol=1e-6)


def test_cli_factorises_warm_starts_and_trains_cold(tiny_workdir, tmp_path):
    from saffu.cli import main
    run, metrics = tmp_path / "fact", tmp_path / "m.json"
    common = ["--workdir", str(tiny_workdir.path), "--quiet"]
    assert main(["factorise", *common, "--run", str(run), "--rank", "8", "--positions", "2", "--radius", "4",
                 "--holdout-tokens", "200", "--buckets", "3", "--metrics-json", str(metrics)]) == 0
    solved = json.loads(metrics.read_text())
    assert np.isfinite(solved["dev_bpb"]) and solved["params"] > 0
    assert main(["train", *common, "--run", str(run), "--init", "explicit", "--steps", "4", "--batch-size", "2",
                 "--seq-len", "16", "--eval-every", "2", "--metrics-json", str(metrics)]) == 0
    warm = json.loads(metrics.read_text())
    assert warm["model"] == "factorised" and warm["params"] == solved["params"]
    cold = tmp_path / "cold"
    assert main(["train", *common, "--run", str(cold), "--init", "random", "--model", "factorised", "--rank", "8",
                 "--positions", "2", "--radius", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["params"] == solved["params"]
    with pytest.raises(SaffuError, match="rank"):
        FactorisedConfig(vocab_size=10, rank=11)


def _dense_targets(rows, counts, prior, mu):
    """float64 reference of ``n(c) · P̃(y|c)`` (Witten-Bell towards the prior) and ``n(c)``."""
    V = len(prior)
    n = np.zeros((V, V))
    n[rows[:, 0], rows[:, 1]] = counts
    seen, types = n.sum(axis=1), (n > 0).sum(axis=1)
    mu_c = mu * types
    with np.errstate(invalid="ignore"):
        conditional = np.where(seen[:, None] > 0, (n + mu_c[:, None] * prior[None, :]) / (seen + mu_c)[:, None], 0.0)
    return seen[:, None] * conditional, seen


def test_statistics_loss_and_gradients_match_a_float64_reference(tiny_workdir):
    V, P, r = tiny_workdir.vocab_size, 2, 12
    prior, parts = _offset_matrices(tiny_workdir, P, mu=0.7)
    rng = np.random.default_rng(5)
    E, B = 0.3 * rng.standard_normal((P, V, r)), 0.3 * rng.standard_normal((r, V))
    targets = [offset_targets(rows, counts, prior, 0.7) for _, rows, counts in parts[:1]]   # offset 0 only
    loss, grad_E, grad_B = statistics_loss(jnp.asarray(E, jnp.float32), jnp.asarray(B, jnp.float32), prior,
                                           _refine_blocks(targets, V))
    T, seen = _dense_targets(parts[0][1], parts[0][2], prior, 0.7)
    z = np.log(prior)[None, :] + E[0] @ B
    lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
    G = seen[:, None] * np.exp(z - lse[:, None]) - T
    assert loss == pytest.approx((seen @ lse - (T * z).sum()) / seen.sum(), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad_E[0]), G @ B.T / seen.sum(), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_B), E[0].T @ G / seen.sum(), rtol=1e-3, atol=1e-6)
    assert not np.any(np.asarray(grad_E[1]))                       # offset 1 is not refined


def test_the_sparse_offsets_are_the_statistics_loss_optimum(tiny_workdir):
    """At full rank the factors are the sparse offsets (E_p B = S_p): the loss is the count-weighted
    entropy of the smoothed conditionals and the gradient vanishes — refinement has nothing to do."""
    V, P = tiny_workdir.vocab_size, 2
    prior, parts = _offset_matrices(tiny_workdir, P)
    weights = [np.sqrt(np.maximum(np.bincount(rows[:, 0], weights=counts, minlength=V), 1.0))
               for _, rows, counts in parts]
    E, B, _, _ = factorise([S for S, _, _ in parts], weights, prior ** 0.5, rank=V, oversample=0)
    targets = [offset_targets(rows, counts, prior, 2.0) for _, rows, counts in parts]
    loss, grad_E, grad_B = statistics_loss(jnp.asarray(E, jnp.float32), jnp.asarray(B, jnp.float32), prior,
                                           _refine_blocks(targets, V))
    entropy = total = 0.0
    for _, rows, counts in parts:
        T, seen = _dense_targets(rows, counts, prior, 2.0)
        entropy -= np.sum(T * np.log(np.where(T > 0, T / np.maximum(seen, 1)[:, None], 1.0)))
        total += seen.sum()
    assert loss == pytest.approx(entropy / total, rel=1e-4)
    assert float(jnp.abs(grad_E).max()) < 1e-4 and float(jnp.abs(grad_B).max()) < 1e-4


def test_refinement_lowers_the_statistics_loss_and_moves_only_the_refined_offsets(tiny_workdir):
    V, P = tiny_workdir.vocab_size, 2
    prior, parts = _offset_matrices(tiny_workdir, P)
    weights = [np.sqrt(np.maximum(np.bincount(rows[:, 0], weights=counts, minlength=V), 1.0))
               for _, rows, counts in parts]
    E, B, _, _ = factorise([S for S, _, _ in parts], weights, prior ** 0.5, rank=8)
    targets = [offset_targets(rows, counts, prior, 2.0) for _, rows, counts in parts[:1]]
    E2, B2, losses = refine_factors(E, B, targets, prior, steps=6, learning_rate=0.05, momentum=0.5)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.01
    final = statistics_loss(jnp.asarray(E2), jnp.asarray(B2), prior, _refine_blocks(targets, V))[0]
    assert final < losses[-1]
    np.testing.assert_array_equal(E2[1], E[1].astype(np.float32))  # offset 1 keeps the SVD's rows
    assert np.abs(E2[0] - E[0]).max() > 1e-3 and np.abs(B2 - B).max() > 1e-3
    with pytest.raises(SaffuError, match="refine 3 offsets"):
        refine_factors(E, B, targets * 3, prior, steps=1, learning_rate=0.05, momentum=0.5)


def test_solve_reports_the_refinement_and_zero_steps_are_the_svd_factors(tiny_workdir):
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=8, positions=2, radius=4, heads=0)
    refined = solve_factorised(tiny_workdir, config, FactorConfig(holdout_tokens=200, buckets=(3,)), progress=False)[1]
    assert refined["refine_loss_last_step"] < refined["refine_loss_svd"]
    plain = solve_factorised(tiny_workdir, config, FactorConfig(holdout_tokens=200, buckets=(3,), refine_steps=0),
                             progress=False)[1]
    assert "refine_loss_svd" not in plain and "seconds_refine" not in plain
    assert plain["energy"] == pytest.approx(refined["energy"])       # the same SVD underneath
    with pytest.raises(SaffuError, match="refine_offsets"):
        FactorConfig(refine_offsets=0)
