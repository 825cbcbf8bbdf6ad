"""Structured feed-forward layers: LowRank, BlockDense, BlockShuffle, SVD init, self-guided training."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saffu import SaffuError
from saffu.cli import main
from saffu.configs import FactorisedConfig, TransformerConfig
from saffu.engine import accounting
from saffu.models.factorised import drop_output_guide, factorised_logits, structure_output
from saffu.models.interface import model_init, model_logits, parameter_count, window_loss
from saffu.models.structured import (
    apply_structure,
    factor_shapes,
    from_dense,
    guide_alpha,
    structure_params,
    structure_size,
    to_dense,
)
from saffu.models.transformer import drop_guide, parameter_count_of
from saffu.training.trainer import TrainConfig, train

KINDS = ("lowrank", "blockdense", "blockshuffle")
SMALL = dict(width=16, layers=2, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)


def _random_factors(kind, n_in, n_out, size, blocks, seed=0):
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.normal(size=shape), jnp.float32)
            for name, shape in factor_shapes(kind, n_in, n_out, size, blocks).items()}


def _dense_reference(kind, factors, blocks):
    """The dense matrix of a structure, built in float64 numpy from the definitions."""
    f = {name: np.asarray(value, np.float64) for name, value in factors.items()}
    if kind == "lowrank":
        return f["down"] @ f["up"]
    if kind == "blockdense":
        block_diagonal = np.zeros((sum(b.shape[0] for b in f["blocks"]), sum(b.shape[1] for b in f["blocks"])))
        rows = cols = 0
        for block in f["blocks"]:
            block_diagonal[rows:rows + block.shape[0], cols:cols + block.shape[1]] = block
            rows, cols = rows + block.shape[0], cols + block.shape[1]
        return block_diagonal @ f["up"]
    # blockshuffle: B₁ (block-diagonal), the deal f (element k of block i -> k·b + i), B₂, f⁻¹
    b, _, m = f["first"].shape
    o = f["second"].shape[2]
    h, n_out = b * m, b * o

    def block_diagonal(blocks_):
        out = np.zeros((sum(x.shape[0] for x in blocks_), sum(x.shape[1] for x in blocks_)))
        r = c = 0
        for x in blocks_:
            out[r:r + x.shape[0], c:c + x.shape[1]] = x
            r, c = r + x.shape[0], c + x.shape[1]
        return out

    deal = np.zeros((h, h))
    for i in range(b):
        for k in range(m):
            deal[i * m + k, k * b + i] = 1              # row vector convention: z @ deal
    undeal = np.zeros((n_out, n_out))
    for j in range(b):
        for q in range(o):
            undeal[q * b + j, j * o + q] = 1            # the inverse deal of the output
    return block_diagonal(f["first"]) @ deal @ block_diagonal(f["second"]) @ undeal


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(32, 128), (128, 32)])
def test_each_structure_computes_its_definition(kind, shape):
    n_in, n_out = shape
    size = structure_size(kind, n_in, n_out, 0.5, 4)
    factors = _random_factors(kind, n_in, n_out, size, 4)
    reference = _dense_reference(kind, factors, 4)
    np.testing.assert_allclose(np.asarray(to_dense(kind, factors)), reference, rtol=1e-4, atol=1e-4)
    x = np.random.default_rng(1).normal(size=(3, 5, n_in))
    np.testing.assert_allclose(np.asarray(apply_structure(kind, factors, jnp.asarray(x, jnp.float32))),
                               x @ reference, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_structure_built_from_a_dense_matrix_equals_it_where_the_rank_allows(kind):
    """A dense matrix that a structure can hold exactly (made by that structure) comes back
    exactly from its SVD; the block structures then also hold any matrix of full size."""
    n_in, n_out = 32, 64
    size = structure_size(kind, n_in, n_out, 0.5, 4)
    W = np.asarray(to_dense(kind, _random_factors(kind, n_in, n_out, size, 4, seed=3)), np.float64)
    rebuilt = to_dense(kind, from_dense(kind, jnp.asarray(W, jnp.float32), size, 4))
    np.testing.assert_allclose(np.asarray(rebuilt), W, rtol=1e-4, atol=1e-4 * np.abs(W).max())
    full = {"lowrank": min(n_in, n_out), "blockdense": n_in, "blockshuffle": 4 * 4 * (n_in // 4)}[kind]
    dense = np.random.default_rng(4).normal(size=(n_in, n_out))
    np.testing.assert_allclose(np.asarray(to_dense(kind, from_dense(kind, jnp.asarray(dense, jnp.float32), full, 4))),
                               dense, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(rank=st.integers(1, 12), seed=st.integers(0, 1000))
def test_lowrank_svd_init_is_the_rank_r_truncation(rank, seed):
    W = np.random.default_rng(seed).normal(size=(24, 40))
    U, S, Vt = np.linalg.svd(W, full_matrices=False)
    truncated = (U[:, :rank] * S[:rank]) @ Vt[:rank]
    factors = from_dense("lowrank", jnp.asarray(W, jnp.float32), rank)
    # float32 SVD against float64 numpy: entries ~1, singular values ~10
    np.testing.assert_allclose(np.asarray(to_dense("lowrank", factors)), truncated, atol=1e-3)
    # the balanced split: D = U_r √S_r, U = √S_r V_rᵀ
    np.testing.assert_allclose(np.abs(np.asarray(factors["down"])), np.abs(U[:, :rank] * np.sqrt(S[:rank])), atol=1e-3)


def test_blockdense_svd_init_truncates_each_row_block():
    W = np.random.default_rng(5).normal(size=(32, 48))
    factors = from_dense("blockdense", jnp.asarray(W, jnp.float32), 8, 4)       # rank 2 per row block
    rebuilt = np.asarray(to_dense("blockdense", factors))
    for i in range(4):
        U, S, Vt = np.linalg.svd(W[8 * i:8 * (i + 1)], full_matrices=False)
        np.testing.assert_allclose(rebuilt[8 * i:8 * (i + 1)], (U[:, :2] * S[:2]) @ Vt[:2], atol=1e-4)


def test_parameter_counts_follow_the_budget():
    # the transformer's MLP at width 128: 128 -> 512 and back, 65,536 dense weights each
    assert structure_size("lowrank", 128, 512, 0.32) == 32
    assert structure_params("lowrank", 128, 512, 0.32) == 32 * (128 + 512)
    assert structure_size("blockdense", 128, 512, 0.32, 4) == 36
    assert structure_params("blockdense", 128, 512, 0.32, 4) == 128 * 9 + 36 * 512
    assert structure_size("blockshuffle", 512, 128, 0.63, 4) == 256
    assert structure_params("blockshuffle", 512, 128, 0.63, 4) == 512 * 64 + 256 * 32
    for kind in KINDS:
        for share in (0.32, 0.63):
            weights = structure_params(kind, 128, 512, share)
            assert 0.5 * share * 65536 < weights <= share * 65536
    assert structure_params("dense", 128, 512, 0.32) == 65536
    config = TransformerConfig(vocab_size=40, ffn="lowrank", ffn_share=0.5, **SMALL)
    dense = TransformerConfig(vocab_size=40, **SMALL)
    saved = 2 * (2 * 16 * 64 - 2 * structure_params("lowrank", 16, 64, 0.5))      # 2 blocks of 2 layers
    assert parameter_count_of(dense) - parameter_count_of(config) == saved
    assert dense.forward_flops(16) - config.forward_flops(16) == 2 * saved


def test_bad_structures_are_clear_errors():
    with pytest.raises(SaffuError, match="unknown structure"):
        structure_size("sparse", 8, 8, 0.5)
    with pytest.raises(SaffuError, match="share"):
        TransformerConfig(vocab_size=40, ffn="lowrank", ffn_share=1.5, **SMALL)
    with pytest.raises(SaffuError, match="divisible"):
        TransformerConfig(vocab_size=40, ffn="blockshuffle", ffn_blocks=3, **SMALL)
    with pytest.raises(SaffuError, match="structured"):
        TransformerConfig(vocab_size=40, guide_share=0.5, **SMALL)
    with pytest.raises(SaffuError, match="self-guided"):
        TransformerConfig(vocab_size=40, ffn="lowrank", guide_share=2.0, **SMALL)


def test_alpha_schedule_runs_from_one_to_gone():
    assert guide_alpha(0, 10) == 1.0
    assert guide_alpha(5, 10) == pytest.approx(0.5)
    values = [guide_alpha(step, 10) for step in range(10)]
    assert all(a > b for a, b in zip(values, values[1:])) and values[-1] > 0
    assert guide_alpha(10, 10) is None and guide_alpha(11, 10) is None
    config = TransformerConfig(vocab_size=40, ffn="lowrank", guide_share=0.5, **SMALL)
    assert config.guide_steps(100) == 50
    assert config.step_inputs(0, 100) == {"guide_alpha": 1.0}
    assert config.step_inputs(49, 100)["guide_alpha"] > 0 and config.step_inputs(50, 100) == {}
    assert TransformerConfig(vocab_size=40, ffn="lowrank", **SMALL).step_inputs(0, 100) == {}


@pytest.mark.parametrize("kind", KINDS)
def test_the_guide_mixes_dense_and_structured_paths(kind):
    """α = 1: the model is the dense transformer with the guide kernels; α = 0 and no α at
    all: the structured model, and the guide is not read; after drop_guide the same logits."""
    config = TransformerConfig(vocab_size=40, ffn=kind, ffn_share=0.5, guide_share=0.5, **SMALL)
    params = model_init(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 40, (2, 12)), jnp.int32)
    dense_config = TransformerConfig(vocab_size=40, **SMALL)
    as_dense = {**params, "blocks": {i: {**block, **{layer: {"kernel": block[layer]["guide"], "bias": block[layer]["bias"]}
                                                    for layer in ("mlp_in", "mlp_out")}}
                                     for i, block in params["blocks"].items()}}
    np.testing.assert_allclose(np.asarray(model_logits(config, {**params, "guide_alpha": np.float32(1)}, tokens)),
                               np.asarray(model_logits(dense_config, as_dense, tokens)), atol=1e-4)
    plain = np.asarray(model_logits(config, params, tokens))
    unguided_logits = model_logits(config, {**params, "guide_alpha": np.float32(0)}, tokens)
    np.testing.assert_allclose(np.asarray(unguided_logits), plain, atol=1e-5)
    unguided, stripped = drop_guide(params, config)
    assert unguided.guide_share == 0 and parameter_count(stripped) == parameter_count_of(unguided)
    np.testing.assert_allclose(np.asarray(model_logits(unguided, stripped, tokens)), plain, atol=1e-6)
    half = np.asarray(model_logits(config, {**params, "guide_alpha": np.float32(0.5)}, tokens))
    assert np.abs(half - plain).max() > 1e-4
    with pytest.raises(SaffuError, match="without self-guided"):
        model_logits(dense_config, {**model_init(dense_config, jax.random.key(0)), "guide_alpha": np.float32(1)}, tokens)


@pytest.mark.slow
def test_self_guided_training_drops_the_dense_path_from_the_compiled_step(tiny_workdir, tmp_path):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, ffn="lowrank", ffn_share=0.32,
                               guide_share=0.5, **SMALL)
    settings_ = TrainConfig(steps=8, batch_size=2, seq_len=16, learning_rate=1e-2, warmup_steps=2, eval_every=2,
                            eval_windows=2)
    _, history = train(config, model_init(config, jax.random.key(0)), tiny_workdir.tokens("train_10M"), settings_,
                       tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    xla = [record["xla_flops"] for record in history]
    analytic = [record["flops"] for record in history]
    guided_step = (xla[1] - xla[0]) / 2                        # steps 0-1: guided
    plain_step = (xla[4] - xla[3]) / 2                         # steps 6-7: the dense path is gone
    # what the guided step adds, by hand: the dense guide's two matmuls (16 × 64 and 64 × 16) in
    # 2 layers at every one of the 2 × 20 window positions, forward and two backward matmuls each;
    # above that its GELU, the α mix and AdamW on its 4,096 weights (measured 1.40×, bound 1.5×)
    guide_flops = 3 * 2 * (2 * 20 * 2 * (16 * 64 + 64 * 16))
    assert guide_flops <= guided_step - plain_step < 1.5 * guide_flops
    unguided = TransformerConfig(vocab_size=tiny_workdir.vocab_size, ffn="lowrank", ffn_share=0.32, **SMALL)
    windows = jnp.zeros((2, config.context + 16), jnp.int32)
    mask = jnp.ones((2, 16), bool)
    params = model_init(unguided, jax.random.key(0))
    compiled = jax.jit(jax.grad(lambda p: window_loss(p, unguided, windows, mask)[0])).lower(params).compile()
    # the unguided phase's step is a structured model's step (plus the optimizer's update)
    assert plain_step < accounting.xla_flops(compiled) * 1.5
    # the analytic count by hand, 3 × forward (2 FLOPs per multiply-add) per trained token, 2 steps
    # of 2 × 16 tokens: V = 280, width 16, 2 layers, the low-rank MLP at rank 4 (4 · (16 + 64) ≤
    # 0.32 · 16 · 64 weights per layer), mean visible keys (4 + 16 + 1) / 2
    assert tiny_workdir.vocab_size == 280 and structure_size("lowrank", 16, 64, 0.32) == 4
    plain_token = 2 * (2 * (4 * 16 * 16 + 2 * 4 * (16 + 64)) + 2 * 2 * 10.5 * 16 + 16 * 280)
    # guided: also the dense guide (2 layers × 2 · 16 · 64 multiply-adds) and the α mix of the two
    # paths' outputs (3 FLOPs for each of the 64 + 16 outputs per layer)
    guided_token = plain_token + 2 * 2 * (2 * 16 * 64) + 3 * 2 * (64 + 16)
    assert analytic[4] - analytic[3] == 2 * 3 * plain_token * 2 * 16
    assert analytic[1] - analytic[0] == 2 * 3 * guided_token * 2 * 16
    # and it learns through the switch (dev loss here 6.32 at step 0, 5.39 at step 8)
    assert history[-1]["dev_loss"] < history[0]["dev_loss"] - 0.5


def test_factorised_output_factor_from_the_explicit_svd():
    config = FactorisedConfig(vocab_size=64, rank=16, positions=2, heads=1, radius=4)
    structured = FactorisedConfig(vocab_size=64, rank=16, positions=2, heads=1, radius=4, output="lowrank",
                                  output_share=0.5)
    params = model_init(config, jax.random.key(0))
    rank = structure_size("lowrank", 16, 64, 0.5)
    made = structure_output(params, structured)
    assert "output_weights" not in made and set(made["output_factors"]) == {"down", "up"}
    U, S, Vt = np.linalg.svd(np.asarray(params["output_weights"], np.float64), full_matrices=False)
    truncated = (U[:, :rank] * S[:rank]) @ Vt[:rank]
    np.testing.assert_allclose(np.asarray(to_dense("lowrank", made["output_factors"])), truncated, atol=1e-5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (2, 10)), jnp.int32)
    exact = {**params, "output_weights": jnp.asarray(truncated, jnp.float32)}
    np.testing.assert_allclose(np.asarray(factorised_logits(made, structured, tokens)),
                               np.asarray(factorised_logits(exact, config, tokens)), atol=1e-4)
    # by hand: rank 6 is the largest with 6 · (16 + 64) ≤ 0.5 · 16 · 64 weights, which replace the
    # dense 16 × 64 output factor; each weight is one multiply-add (2 FLOPs) per predicted token
    assert rank == 6
    assert parameter_count(params) - parameter_count(made) == 16 * 64 - 6 * (16 + 64)
    assert config.forward_flops() - structured.forward_flops() == 2 * (16 * 64 - 6 * (16 + 64))
    assert set(model_init(structured, jax.random.key(1))) == set(made)


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_a_self_guided_factorised_output_starts_as_its_dense_guide(tiny_workdir, tmp_path):
    """With the explicit B as the guide, α = 1 is the dense explicit model, α = 0 and no α the
    structured one; dropping the guide keeps the logits; the guided steps run the dense B."""
    dense = FactorisedConfig(vocab_size=64, rank=16, positions=2, heads=1, radius=4)
    guided = FactorisedConfig(vocab_size=64, rank=16, positions=2, heads=1, radius=4, output="blockdense",
                              output_share=0.5, guide_share=0.5)
    explicit = model_init(dense, jax.random.key(0))                          # stands for the explicit solution
    made = structure_output(explicit, guided)
    np.testing.assert_array_equal(np.asarray(made["output_guide"]), np.asarray(explicit["output_weights"]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (2, 10)), jnp.int32)
    at = lambda alpha: np.asarray(factorised_logits({**made, "guide_alpha": jnp.float32(alpha)}, guided, tokens))
    np.testing.assert_allclose(at(1.0), np.asarray(factorised_logits(explicit, dense, tokens)), atol=1e-5)
    plain, structured = drop_output_guide(made, guided)
    assert plain.guide_share == 0 and "output_guide" not in structured
    np.testing.assert_allclose(at(0.0), np.asarray(factorised_logits(structured, plain, tokens)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(factorised_logits(made, guided, tokens)),
                               np.asarray(factorised_logits(structured, plain, tokens)), atol=1e-6)
    np.testing.assert_allclose(at(0.25), 0.25 * at(1.0) + 0.75 * at(0.0), atol=1e-4)
    assert guided.step_forward_flops(16, {"guide_alpha": 1}) - guided.forward_flops(16) == 2 * 16 * 64 + 3 * 64
    assert guided.step_inputs(0, 10) == {"guide_alpha": 1.0} and guided.step_inputs(5, 10) == {}
    with pytest.raises(SaffuError, match="nothing to guide"):
        FactorisedConfig(vocab_size=64, rank=16, guide_share=0.5)
    with pytest.raises(SaffuError, match="without a dense guide"):
        factorised_logits({**structured, "guide_alpha": jnp.float32(1)}, plain, tokens)
    # solved: the guide is the explicit dense B, the factors its SVD
    from saffu.configs import FactorConfig
    from saffu.solve.factors import solve_factorised
    shape = dict(vocab_size=tiny_workdir.vocab_size, rank=16, positions=2, heads=1, radius=4)
    solver = FactorConfig(holdout_tokens=200, buckets=(3,))
    explicit_dense, _ = solve_factorised(tiny_workdir, FactorisedConfig(**shape), solver, progress=False)
    explicit_guided, _ = solve_factorised(tiny_workdir, FactorisedConfig(**shape, output="lowrank", guide_share=0.5),
                                          solver, progress=False)
    np.testing.assert_array_equal(np.asarray(explicit_guided["output_guide"]),
                                  np.asarray(explicit_dense["output_weights"]))
    # trained: the guided steps cost the dense B on top, then the step is the structured model's
    config = FactorisedConfig(vocab_size=tiny_workdir.vocab_size, rank=16, positions=2, heads=1, radius=4,
                              output="lowrank", output_share=0.32, guide_share=0.5)
    settings_ = TrainConfig(steps=8, batch_size=2, seq_len=16, learning_rate=1e-2, warmup_steps=2, eval_every=2,
                            eval_windows=2)
    _, history = train(config, model_init(config, jax.random.key(0)), tiny_workdir.tokens("train_10M"), settings_,
                       tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    xla = [record["xla_flops"] for record in history]
    # the guided step adds, by hand, the dense B (16 × 280) at every one of the 2 × 20 window
    # positions, forward and two backward matmuls; above that the α mix over V and AdamW on B's
    # 4,480 weights (measured 1.12×, bound 1.25×)
    assert tiny_workdir.vocab_size == 280
    guide_flops = 3 * 2 * (2 * 20 * 16 * 280)
    assert guide_flops <= (xla[1] - xla[0]) / 2 - (xla[4] - xla[3]) / 2 < 1.25 * guide_flops
    # and it learns through the switch (dev loss here 5.635 at step 0, 5.566 at step 8)
    assert history[-1]["dev_loss"] < history[0]["dev_loss"] - 0.03


@pytest.mark.slow
def test_cli_trains_a_self_guided_structured_transformer(tiny_workdir, tmp_path):
    run, metrics, dense_run = tmp_path / "sg", tmp_path / "m.json", tmp_path / "dense"
    shape = ["--init", "random", "--model", "transformer", "--block", "gpt", "--output-bias",
             "--width", "16", "--layers", "1", "--attention-heads", "2",
             "--context", "4", "--max-len", "40", "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--quiet"]
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(dense_run), *shape]) == 0
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(run), *shape, "--ffn", "blockdense",
                 "--ffn-share", "0.5", "--self-guided", "0.5", "--ffn-from", str(dense_run),
                 "--metrics-json", str(metrics)]) == 0
    figures = json.loads(metrics.read_text())
    dense = TransformerConfig(vocab_size=tiny_workdir.vocab_size, width=16, layers=1, heads=2, context_tokens=4,
                              max_len=40, block="gpt", output_bias=True)
    assert figures["params"] < parameter_count_of(dense)
    # bits per byte from the dev loss, the dev targets (every token after the leading <eod>) and
    # the dev split's UTF-8 bytes (one newline per document), counted here from the corpus
    dev_bytes = sum(len(line.encode()) + 1 for line in __import__("conftest").TINY_DEV)
    predicted = len(tiny_workdir.tokens("dev")) - 1
    assert figures["dev_bpb"] == pytest.approx(figures["dev_loss"] * predicted / (np.log(2) * dev_bytes), rel=1e-9)
    assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(figures["dev_bpb"])


def test_a_residual_over_a_structured_factorised_model_starts_at_zero():
    from saffu.models.factorised import zero_output
    config = FactorisedConfig(vocab_size=64, rank=16, positions=2, heads=1, radius=4, output="blockshuffle",
                              output_share=0.5)
    params = zero_output(model_init(config, jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (2, 10)), jnp.int32)
    assert float(jnp.abs(model_logits(config, params, tokens)).max()) == 0.0
    assert float(jnp.abs(params["output_factors"]["first"]).max()) > 0      # gradients can flow


def test_a_structured_transformer_from_a_trained_dense_one():
    """Every weight copied; each MLP kernel becomes its SVD, kept as the guide: at α = 1 the
    model is the dense one, without α it is the dense one with rank-truncated MLP kernels."""
    from saffu.models.transformer import structure_mlp
    dense_config = TransformerConfig(vocab_size=40, **SMALL)
    dense = model_init(dense_config, jax.random.key(3))
    config = TransformerConfig(vocab_size=40, ffn="lowrank", ffn_share=0.5, guide_share=0.5, **SMALL)
    params = structure_mlp(dense, dense_config, config)
    assert jax.tree.structure(params) == jax.tree.structure(model_init(config, jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(2).integers(2, 40, (2, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(model_logits(config, {**params, "guide_alpha": np.float32(1)}, tokens)),
                               np.asarray(model_logits(dense_config, dense, tokens)), atol=1e-5)
    truncated = jax.tree.map(jnp.array, dense)
    for index, block in truncated["blocks"].items():
        for name in ("mlp_in", "mlp_out"):
            block[name]["kernel"] = to_dense("lowrank", {k: params["blocks"][index][name][k] for k in ("down", "up")})
    np.testing.assert_allclose(np.asarray(model_logits(config, params, tokens)),
                               np.asarray(model_logits(dense_config, truncated, tokens)), atol=1e-5)
    with pytest.raises(SaffuError, match="same width"):
        structure_mlp(dense, dense_config, TransformerConfig(vocab_size=40, ffn="lowrank", **{**SMALL, "layers": 1}))


@pytest.mark.slow
def test_a_structured_saffu_chain_is_its_dense_chain_and_solves_in_closed_form(tiny_workdir):
    """A structured chain computes the dense chain of its factors' products; the explicit
    structured chain's layers are the truncated SVD of the explicit dense chain's (block 0, which
    reads nothing solved); a residual over it starts at zero; sizes and FLOPs follow the budget."""
    from saffu.configs import SaffuConfig, SolverConfig
    from saffu.models.saffu import init_params, saffu_logits, zero_output
    from saffu.solve.stack import solve_explicit
    shape = dict(vocab_size=tiny_workdir.vocab_size, bits=10, radius=3, hidden=11)
    dense, chain = SaffuConfig(**shape), SaffuConfig(**shape, chain="lowrank", chain_share=0.5)
    params = init_params(chain, jax.random.key(0))
    block = params["blocks"][0]
    assert {"hidden_factors", "output_factors"} <= set(block) and "output_weights" not in block
    as_dense = {"blocks": {0: {**{k: v for k, v in block.items() if not k.endswith("_factors")},
                               "hidden_weights": to_dense("lowrank", block["hidden_factors"]),
                               "output_weights": to_dense("lowrank", block["output_factors"])}},
                "codes": params["codes"]}
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, tiny_workdir.vocab_size, (2, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(saffu_logits(params, chain, tokens)),
                               np.asarray(saffu_logits(as_dense, dense, tokens)), atol=1e-5)
    assert parameter_count(params) < parameter_count(init_params(dense, jax.random.key(0)))
    assert chain.forward_flops() < dense.forward_flops()
    solver = SolverConfig(holdout_tokens=64)
    explicit_dense, _ = solve_explicit(tiny_workdir, dense, solver, progress=False)
    explicit_chain, _ = solve_explicit(tiny_workdir, chain, solver, progress=False)
    for layer in ("hidden", "output"):
        W = np.asarray(explicit_dense["blocks"][0][f"{layer}_weights"], np.float64)
        U, S, Vt = np.linalg.svd(W, full_matrices=False)
        r = chain.chain_size(layer)
        np.testing.assert_allclose(np.asarray(to_dense("lowrank", explicit_chain["blocks"][0][f"{layer}_factors"])),
                                   (U[:, :r] * S[:r]) @ Vt[:r], atol=1e-4 * np.abs(W).max())
    zero = zero_output(explicit_chain)
    np.testing.assert_array_equal(np.asarray(saffu_logits(zero, chain, tokens)), 0.0)
    with pytest.raises(SaffuError, match="needs --hidden"):
        SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=10, chain="lowrank")
