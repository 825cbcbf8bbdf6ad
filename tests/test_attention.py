"""Attention diagnostics: the rank measure on matrices of known rank, lazy flags on constructed
attention, the averaged maps against float64 numpy references, and `saffu inspect`."""

import json

import jax
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import FactorisedConfig, ResidualConfig, SaffuConfig, TransformerConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.eval.attention import (
    attention_profile,
    attention_summary,
    effective_rank,
    first_visible,
    mean_attention,
    offset_profile,
    top_column,
)
from saffu.models.interface import model_init
from saffu.models.saffu import cipher_table


def test_effective_rank_of_matrices_of_known_rank():
    rng = np.random.default_rng(0)
    for rank in (1, 3, 7):
        matrix = rng.normal(size=(20, rank)) @ rng.normal(size=(rank, 15))
        assert effective_rank(matrix, energy=1.0) == rank
        assert effective_rank(matrix, energy=0.5) <= rank
    # singular values 3, 2, 1: energies 9, 4, 1 of 14; 90% (12.6) needs two, 60% (8.4) one
    q1, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    q2, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    matrix = q1[:, :3] @ np.diag([3.0, 2.0, 1.0]) @ q2[:3]
    assert [effective_rank(matrix, e) for e in (0.6, 0.9, 0.99, 1.0)] == [1, 2, 3, 3]
    assert effective_rank(np.eye(4), 0.5) == 2                          # exactly at the threshold
    assert effective_rank(np.zeros((3, 3))) == 0
    with pytest.raises(SaffuError, match="energy"):
        effective_rank(np.eye(2), 0.0)


def test_a_single_column_layer_is_lazy_and_a_diagonal_one_is_not():
    S = 12
    sink = np.zeros((S, S))
    sink[:, 0] = 1.0                                                     # every query on the first key
    diagonal = np.eye(S)                                                 # every query on itself
    uniform = np.tril(np.ones((S, S))) / np.arange(1, S + 1)[:, None]   # causal uniform
    profile = attention_profile([[sink, sink], [sink, diagonal], [uniform]], energy=0.9, lazy_rank=1)
    assert profile["lazy_layers"] == [0]
    first, mixed, spread = profile["layers"]
    assert first["max_rank"] == 1 and first["mean_top_column_share"] == pytest.approx(1.0)
    assert [h["rank"] for h in mixed["heads"]] == [1, effective_rank(diagonal, 0.9)] and not mixed["lazy"]
    assert mixed["heads"][1]["top_column_share"] == pytest.approx(1 / S)
    assert top_column(uniform) == (pytest.approx(sum(1 / np.arange(1, S + 1)) / S), 0)
    assert not spread["lazy"] and profile["size"] == S
    assert attention_profile([[diagonal]], lazy_rank=S)["lazy_layers"] == [0]


def test_first_visible_key_is_the_last_eod_at_or_before_the_query():
    E = EOD_ID
    tokens = np.array([[5, E, 7, 8, E, E, 9], [E, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9]], np.int32)
    want = [[0, 1, 1, 1, 4, 5, 5], [0, 0, 0, 0, 0, 0, 0], [0] * 7]
    np.testing.assert_array_equal(np.asarray(first_visible(tokens)), want)
    # across documents: the first token that is not <pad>, for the queries from it on
    P = PAD_ID
    tokens = np.array([[P, P, E, 7, E, 9], [5, E, 7, 8, E, 9], [P] * 6], np.int32)
    want = [[0, 0, 2, 2, 2, 2], [0] * 6, [0] * 6]
    np.testing.assert_array_equal(np.asarray(first_visible(tokens, across_documents=True)), want)


def _layer_norm(x, params, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * params["scale"] + params["bias"]


def _reference_transformer_attention(params, config, tokens):
    """Block 0's attention in float64 numpy: ``[B, H, S, S]``."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    _, S = tokens.shape
    x = p["embed"]["embedding"][tokens] + p["positions"][:S]
    h = _layer_norm(x, p["blocks"][0]["attention_norm"])
    attention = p["blocks"][0]["attention"]
    q = np.einsum("bsd,dhk->bhsk", h, attention["query"]["kernel"]) + attention["query"]["bias"][None, :, None]
    k = np.einsum("bsd,dhk->bhsk", h, attention["key"]["kernel"]) + attention["key"]["bias"][None, :, None]
    logits = np.einsum("bhqc,bhkc->bhqk", q, k) / np.sqrt(q.shape[-1])
    document = np.cumsum(tokens == EOD_ID, axis=1)
    visible = (document[:, :, None] == document[:, None, :]) & np.tril(np.ones((S, S), bool))[None]
    logits = np.where(visible[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


def _windows(workdir, count, length):
    stream = np.asarray(workdir.tokens(workdir.train_split))
    return np.stack([stream[i * 37:i * 37 + length] for i in range(count)]).astype(np.int32)


def test_transformer_maps_equal_a_float64_reference_and_average_exactly(tiny_workdir):
    config = TransformerConfig(tiny_workdir.vocab_size, width=16, layers=2, heads=2, context_tokens=4, max_len=64,
                               block="gpt", output_bias=True, across_documents=False)
    params = model_init(config, jax.random.key(1))
    windows = _windows(tiny_workdir, 5, 20)
    assert (windows == EOD_ID).any()                                    # documents end inside windows
    maps, first = attention_summary(params, config, windows, batch_size=2)   # 2 + 2 + 1 (a padded batch)
    assert len(maps) == 2 and all(len(layer) == 2 and layer[0].shape == (20, 20) for layer in maps)
    reference = _reference_transformer_attention(params, config, windows)      # [B, H, S, S]
    np.testing.assert_allclose(np.stack(maps[0]), reference.mean(axis=0), atol=2e-6)
    starts = np.asarray(first_visible(windows))
    on_first = np.take_along_axis(reference, starts[:, None, :, None], axis=-1)[..., 0]   # [B, H, S]
    np.testing.assert_allclose(first[0], on_first.mean(axis=(0, 2)), atol=2e-6)
    for head in maps[1]:
        np.testing.assert_allclose(head.sum(axis=1), 1.0, atol=1e-5)  # rows of probabilities
        assert np.abs(np.triu(head, 1)).max() == 0.0                     # causal
    one_by_one = [mean_attention(params, config, windows[i:i + 1], batch_size=4) for i in range(5)]
    np.testing.assert_allclose(maps[1][1], np.mean([m[1][1] for m in one_by_one], axis=0), atol=1e-6)


def test_saffu_maps_are_offsets_placed_on_positions(tiny_workdir):
    config = SaffuConfig(tiny_workdir.vocab_size, bits=10, radius=4, heads=2, blocks=2)
    params = model_init(config, jax.random.key(2))
    params["blocks"][0]["attention_0"] = 3.0 * jax.random.normal(jax.random.key(5), (4, 4))
    windows = _windows(tiny_workdir, 3, 16)
    maps, first = attention_summary(params, config, windows)
    assert len(maps) == 2 and all(len(layer) == 2 for layer in maps)
    on_first = 0.0
    # block 0, head 0 in float64: rows X[δ] = code of x_{p−δ} (the boundary code where invisible)
    codes = np.asarray(cipher_table(config), np.float64)
    W = np.asarray(params["blocks"][0]["attention_0"], np.float64)
    want = np.zeros((16, 16))
    starts = np.asarray(first_visible(windows))
    for window, start in zip(windows, starts):
        document = np.cumsum(window == EOD_ID)
        for p in range(16):
            rows, seen = [], []
            for delta in range(4):
                visible = p - delta >= 0 and document[p - delta] == document[p]
                rows.append(codes[window[p - delta]] if visible else codes[PAD_ID])
                seen.append(visible)
            X = np.stack(rows)
            scores = (X @ X[0]) @ W
            a = np.exp(scores - scores.max())
            a /= a.sum()
            for delta in range(4):
                if seen[delta]:
                    want[p, p - delta] += a[delta] / len(windows)
            on_first += a[p - start[p]] / windows.size if p - start[p] < 4 else 0.0
    np.testing.assert_allclose(maps[0][0], want, atol=1e-5)
    assert first[0][0] == pytest.approx(on_first, abs=1e-5)
    assert np.all(maps[1][1].sum(axis=1) <= 1 + 1e-5)                    # boundary mass left out
    assert np.abs(np.triu(maps[1][0], 1)).max() == 0.0 and np.abs(np.tril(maps[1][0], -4)).max() == 0.0


def test_offset_profile_of_uniform_collapsed_and_recomputed_saffu_attention(tiny_workdir):
    """Zero attention weights attend uniformly (each offset 1/M); a large weight on offset 0's
    score collapses every query onto offset 0; a random block matches a float64 recomputation
    over the queries that see every offset."""
    config = SaffuConfig(tiny_workdir.vocab_size, bits=10, radius=4, heads=1, blocks=2)
    params = model_init(config, jax.random.key(2))
    windows = _windows(tiny_workdir, 3, 24)
    params["blocks"][0]["attention_0"] = np.zeros((4, 4), np.float32)
    collapse = np.zeros((4, 4), np.float32)
    collapse[0, 0] = 1e4                          # score of offset 0 = 1e4 · |x_h|² > 0, the others 0
    params["blocks"][1]["attention_0"] = collapse
    layers = offset_profile(params, config, windows)
    np.testing.assert_allclose(layers[0]["heads"][0]["mean_by_offset"], [0.25] * 4, atol=1e-6)
    assert layers[0]["mean_top_weight"] == pytest.approx(0.25, abs=1e-6)
    np.testing.assert_allclose(layers[1]["heads"][0]["mean_by_offset"], [1, 0, 0, 0], atol=1e-6)
    assert layers[1]["mean_top_weight"] == pytest.approx(1.0, abs=1e-6)
    W = 3.0 * np.asarray(jax.random.normal(jax.random.key(5), (4, 4)), np.float64)
    params["blocks"][0]["attention_0"] = W.astype(np.float32)
    codes = np.asarray(cipher_table(config), np.float64)
    total, top, count = np.zeros(4), 0.0, 0
    for window in windows:
        document = np.cumsum(window == EOD_ID)
        for p in range(3, len(window)):
            if document[p - 3] != document[p]:
                continue                          # a query that does not see all four offsets
            X = codes[window[p - np.arange(4)]]
            scores = (X @ X[0]) @ W
            a = np.exp(scores - scores.max())
            a /= a.sum()
            total, top, count = total + a, top + a.max(), count + 1
    head = offset_profile(params, config, windows, batch_size=2)[0]["heads"][0]
    assert head["queries"] == count > 0
    np.testing.assert_allclose(head["mean_by_offset"], total / count, atol=1e-5)
    assert head["mean_top_weight"] == pytest.approx(top / count, abs=1e-5)
    with pytest.raises(SaffuError, match="does not attend over offsets"):
        offset_profile({}, TransformerConfig(97, block="gpt", output_bias=True), windows)


def test_residual_and_factorised_models_show_their_trainable_attention(tiny_workdir, exact_model_small):
    V = tiny_workdir.vocab_size
    windows = _windows(tiny_workdir, 2, 12)
    base = TransformerConfig(V, width=16, layers=1, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)
    explicit_config, explicit = exact_model_small
    residual = ResidualConfig(base, explicit_config, "unused")
    params = {**model_init(residual, jax.random.key(0)), "explicit": explicit}
    np.testing.assert_allclose(mean_attention(params, residual, windows)[0][1],
                               mean_attention(params["model"], base, windows)[0][1])
    factorised = FactorisedConfig(V, rank=8, positions=2, radius=4, heads=1)
    maps = mean_attention(model_init(factorised, jax.random.key(0)), factorised, windows)
    assert len(maps) == 1 and maps[0][0].shape == (12, 12)
    with pytest.raises(SaffuError, match="no attention"):
        mean_attention(explicit, explicit_config, windows)
    with pytest.raises(SaffuError, match="no attention"):
        no_heads = FactorisedConfig(V, rank=8, positions=2, heads=0)
        mean_attention(model_init(no_heads, jax.random.key(0)), no_heads, windows)


@pytest.fixture(scope="module")
def exact_model_small(tiny_workdir):
    from saffu.configs import ExactConfig
    from saffu.solve.exact import solve_exact
    config = ExactConfig(tiny_workdir.vocab_size, groups=((0,),), buckets=(), holdout_tokens=200)
    params, _ = solve_exact(tiny_workdir, config, progress=False)
    return config, params


@pytest.mark.slow   # a training run and an inspection through the CLI: about 15 s
def test_cli_inspect_writes_json_and_a_plot(tiny_workdir, tmp_path, capsys):
    from saffu.cli import main
    run, metrics = tmp_path / "tf", tmp_path / "m.json"
    args = ["--workdir", str(tiny_workdir.path), "--run", str(run)]
    assert main(["train", *args, "--init", "random", "--model", "transformer", "--block", "gpt", "--output-bias",
                 "--width", "16", "--layers", "2",
                 "--attention-heads", "2", "--context", "4", "--max-len", "40", "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--eval-tokens", "64", "--quiet"]) == 0
    assert main(["inspect", *args, "--windows", "3", "--quiet", "--metrics-json", str(metrics)]) == 0
    figures = json.loads(metrics.read_text())
    profile = json.loads((run / "attention.json").read_text())
    assert figures["layers"] == 2 and "layer_1_max_rank" in figures and figures["matrix_size"] == profile["window_tokens"]
    assert 1 <= profile["windows"] <= 3 and [layer["layer"] for layer in profile["layers"]] == [0, 1]
    assert 0 < profile["first_key_share_if_uniform"] <= 1 and "layer_0_first_key_share" in figures
    assert (run / "attention.png").stat().st_size > 0
    assert "max rank" in capsys.readouterr().out
    assert main(["inspect", *args, "--energy", "1.5", "--quiet"]) == 2
    assert "energy" in capsys.readouterr().err
