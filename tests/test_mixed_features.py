"""SAFFU with exact output groups (SaffuConfig.exact_positions): cipher and exact features mixed."""

import json
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import SaffuConfig, SolverConfig
from saffu.models.saffu import saffu_logits
from saffu.solve.stack import solve_explicit

SOLVER = SolverConfig(holdout_tokens=300, chunk_size=256)


@pytest.fixture(scope="module")
def mixed(tiny_workdir):
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=3, positions=2, exact_positions=(0,))
    params, report = solve_explicit(tiny_workdir, config, SOLVER, progress=False)
    return config, params, report


def test_exact_group_is_the_dense_witten_bell_table(tiny_workdir, mixed):
    """The mixed logits are the cipher groups' plus β · (log P(y | x_t) − log p(y)), Witten-Bell
    κ = 2 counted on the same training range, computed here in float64 from raw counts."""
    config, params, report = mixed
    V = config.vocab_size
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    counted_end = len(stream) - report["holdout_tokens"]
    unigram, pairs = Counter(), Counter()
    for t in range(1, counted_end):
        unigram[int(stream[t])] += 1
        pairs[(int(stream[t - 1]), int(stream[t]))] += 1        # offset 0: the token before (an <eod> too)
    n = np.array([unigram[v] for v in range(V)], np.float64)
    prior = (n + 1) / (n.sum() + V)
    dev = np.asarray(tiny_workdir.tokens("dev"))[:60].astype(np.int32)
    tokens = jnp.asarray(dev[None])
    beta = float(params["exact"]["beta"][0])
    cipher_only = {**params, "exact": {**params["exact"], "beta": jnp.zeros(1)}}
    exact_part = np.asarray(saffu_logits(params, config, tokens) - saffu_logits(cipher_only, config, tokens))[0]
    for p in range(len(dev)):
        c = int(dev[p])
        seen = np.array([pairs.get((c, y), 0) for y in range(V)], np.float64)
        if seen.sum() == 0:
            np.testing.assert_allclose(exact_part[p], 0.0, atol=1e-6)
            continue
        strength = 2.0 * (seen > 0).sum()
        reference = beta * (np.log((seen + strength * prior) / (seen.sum() + strength)) - np.log(prior))
        np.testing.assert_allclose(exact_part[p], reference, atol=2e-5)


def test_cipher_groups_of_a_mixed_model_are_an_all_cipher_saffu(tiny_workdir, mixed):
    """With the exact temperature at 0 the mixed model is the all-cipher SAFFU whose exact
    position's weights are zero and whose other weights are the mixed model's."""
    config, params, _ = mixed
    cipher = SaffuConfig(vocab_size=config.vocab_size, bits=16, radius=3, positions=2)
    block = dict(params["blocks"][0])
    weights = block["group_weights"]                                           # [cipher groups, K, V]
    block["group_weights"] = jnp.concatenate([jnp.zeros_like(weights[:1]), weights])
    tokens = jnp.asarray(np.asarray(tiny_workdir.tokens("dev"))[None, :80].astype(np.int32))
    silent = {**params, "exact": {**params["exact"], "beta": jnp.zeros(1)}}
    all_cipher = {"blocks": {0: block}, "codes": params["codes"]}
    np.testing.assert_allclose(np.asarray(saffu_logits(silent, config, tokens)),
                               np.asarray(saffu_logits(all_cipher, cipher, tokens)), atol=1e-5)


def test_mixed_model_calibrates_its_exact_temperature(mixed):
    config, params, report = mixed
    assert report["block0_temperature_2"] == pytest.approx(float(params["exact"]["beta"][0]))
    assert params["blocks"][0]["group_weights"].shape[0] == config.cipher_groups == 2
    assert np.isfinite(report["block0_holdout_loss"])


def test_bad_exact_positions_are_clear_errors():
    with pytest.raises(SaffuError, match="exact-positions"):
        SaffuConfig(vocab_size=300, positions=2, exact_positions=(2,))
    with pytest.raises(SaffuError, match="one block"):
        SaffuConfig(vocab_size=300, positions=2, exact_positions=(0,), blocks=2)


def test_cli_fits_scores_and_refuses_to_train_a_mixed_model(tiny_workdir, tmp_path):
    from saffu.cli import main
    run, metrics = tmp_path / "mixed", tmp_path / "m.json"
    common = ["--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet", "--metrics-json", str(metrics)]
    assert main(["fit", *common, "--bits", "16", "--radius", "3", "--exact-positions", "0", "--holdout-tokens",
                 "300", "--chunk-size", "256"]) == 0
    solved = json.loads(metrics.read_text())
    assert main(["eval", *common]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(solved["dev_bpb"], rel=1e-6)
    assert main(["train", *common, "--init", "explicit", "--steps", "1"]) == 2
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(tmp_path / "cold"), "--quiet",
                 "--init", "random", "--exact-positions", "0"]) == 2
    assert not (tmp_path / "cold").exists()
