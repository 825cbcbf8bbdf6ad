"""The transformer's llama block (RMSNorm, projections without biases, rotary positions, a SwiGLU
MLP) against a float64 numpy forward written from the definitions, its rotary positions' relative
property, its sizes, and what refuses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import TransformerConfig
from saffu.data.tokenizer import EOD_ID
from saffu.models.interface import model_init, model_logits, target_loss
from saffu.models.transformer import rotate

CONFIG = TransformerConfig(60, width=16, layers=2, heads=2, context_tokens=4, max_len=32, block="llama", output_bias=True,
                           across_documents=False)


def _reference(params, config, tokens, kept=None):
    """float64 numpy logits ``[B, S, V]`` of the llama block, attention causal inside documents."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    rms = lambda x, scale: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale
    length, k = tokens.shape[1], config.width // config.heads
    angles = np.arange(length)[:, None] * 10_000.0 ** (-np.arange(k // 2) / (k // 2))      # [S, k/2]
    cos, sin = np.cos(angles), np.sin(angles)

    def turn(x):                                                                          # [B, S, H, k]
        a, b = x[..., :k // 2], x[..., k // 2:]
        c, s = cos[None, :, None], sin[None, :, None]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    document = np.cumsum(tokens == EOD_ID, axis=1)
    visible = (document[:, :, None] == document[:, None, :]) & np.tril(np.ones((length, length), bool))[None]
    x = p["embed"]["embedding"][tokens]
    for index in range(config.layers):
        block = p["blocks"][index]
        h = rms(x, block["attention_norm"]["scale"])
        q, key, v = (np.einsum("bsd,dhk->bshk", h, block["attention"][n]["kernel"]) for n in ("query", "key", "value"))
        scores = np.einsum("bshk,bthk->bhst", turn(q), turn(key)) / np.sqrt(k)
        scores = np.where(visible[:, None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        if kept is not None:
            kept.append(weights)
        x = x + np.einsum("bhst,bthk,hkd->bsd", weights, v, block["attention"]["out"]["kernel"])
        h = rms(x, block["mlp_norm"]["scale"])
        gate = h @ block["mlp_gate"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ block["mlp_in"]["kernel"])) @ block["mlp_out"]["kernel"]
    return rms(x, p["final_norm"]["scale"]) @ p["output"]["kernel"] + p["output"]["bias"]


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_the_llama_block_equals_a_float64_forward_and_its_training_loss():
    params = model_init(CONFIG, jax.random.key(0))
    noise = jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))
    params = jax.tree.unflatten(jax.tree.structure(params), [x + 0.1 * jax.random.normal(k, x.shape) for x, k in
                                                             zip(jax.tree.leaves(params), noise)])   # scales not 1
    tokens = np.asarray([[EOD_ID, 5, 7, 9, 11, EOD_ID, 3, 4, 8, 2, 13, 17],
                         [EOD_ID, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
    ours = np.asarray(model_logits(CONFIG, params, jnp.asarray(tokens)), np.float64)
    np.testing.assert_allclose(ours, _reference(params, CONFIG, tokens), atol=1e-4)
    # the fused training loss (window of context 4 + 8 targets) is the reference's NLL
    reference = _reference(params, CONFIG, tokens[:, :-1])[:, CONFIG.context - 1:]
    log_probs = reference - np.log(np.exp(reference - reference.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - reference.max(-1, keepdims=True)
    targets = tokens[:, CONFIG.context:]
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).sum()
    nll, count = target_loss(params, CONFIG, jnp.asarray(tokens), jnp.ones(targets.shape, bool))
    assert int(count) == targets.size
    assert float(nll) == pytest.approx(expected, rel=1e-5)


def test_rotary_scores_depend_on_the_distance_only():
    q, k = jax.random.normal(jax.random.key(2), (2, 1, 2, 3, 8))
    score = lambda pq, pk: float(jnp.sum(rotate(q, jnp.asarray([[pq] * 3])) * rotate(k, jnp.asarray([[pk] * 3]))))
    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_the_llama_block_sizes_and_refusals():
    assert CONFIG.mlp_hidden == 48 and TransformerConfig(8192, block="llama").mlp_hidden == 344   # 2/3 · 4d, to 8
    params = model_init(CONFIG, jax.random.key(0))
    assert "positions" not in params and "bias" not in params["blocks"][0]["attention"]["query"]
    assert set(params["blocks"][0]) == {"attention", "attention_norm", "mlp_norm", "mlp_gate", "mlp_in", "mlp_out"}
    with pytest.raises(SaffuError, match="dense SwiGLU"):
        TransformerConfig(60, block="llama", ffn="lowrank")
    with pytest.raises(SaffuError, match="even head width"):
        TransformerConfig(60, width=18, heads=2, block="llama")
    with pytest.raises(SaffuError, match="block"):
        TransformerConfig(60, block="mamba")
    from saffu.interop.hf import exportable
    exportable(TransformerConfig(60, block="llama", output_bias=False))                  # LlamaForCausalLM
    with pytest.raises(SaffuError, match="no-output-bias"):
        exportable(TransformerConfig(60, block="llama", output_bias=True))
    # attention profiles (saffu inspect) read the llama block's weights too: the reference's, layer by layer
    from saffu.models.transformer import transformer_attention
    tokens = np.asarray([[EOD_ID, 5, 7, 9, EOD_ID, 3, 4, 8]], np.int32)
    kept = []
    _reference(params, CONFIG, tokens, kept)
    for ours, theirs in zip(transformer_attention(params, CONFIG, jnp.asarray(tokens)), kept, strict=True):
        np.testing.assert_allclose(np.asarray(ours, np.float64), theirs, atol=1e-5)


@pytest.mark.slow    # an explicit solve, training and generation through the CLI: about half a minute
def test_cli_trains_an_explicit_llama_block_and_generates(tiny_workdir, tmp_path, capsys):
    import json

    from saffu.cli import main
    run, common = tmp_path / "llama", ["--workdir", str(tiny_workdir.path), "--quiet"]
    assert main(["train", *common, "--run", str(run), "--init", "explicit", "--model", "transformer", "--block", "llama",
                 "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4", "--max-len", "24",
                 "--steps", "3", "--batch-size", "2", "--seq-len", "8", "--holdout-tokens", "200", "--dropout", "0.1",
                 "--eval-tokens", "0", "--metrics-json", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["steps"] == 3 and np.isfinite(metrics["dev_loss"])
    assert json.loads((run / "config.json").read_text())["model"]["block"] == "llama"
    capsys.readouterr()
    assert main(["generate", *common, "--run", str(run), "--max-tokens", "5", "--num-samples", "1"]) == 0


def test_a_run_saved_before_the_llama_default_loads_as_the_gpt_block_it_is():
    import dataclasses

    from saffu.models.interface import config_from_dict
    old = dataclasses.asdict(TransformerConfig(60, block="gpt", output_bias=True))
    del old["block"], old["output_bias"]                   # a config.json written before those fields existed
    assert config_from_dict(old) == TransformerConfig(60, block="gpt", output_bias=True)
    assert config_from_dict(dataclasses.asdict(TransformerConfig(60))) == TransformerConfig(60)   # today's: as saved
