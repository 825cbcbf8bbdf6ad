"""Inheritune for the transformer: inheritance copies exactly the chosen weights, growth appends
the reference's next block with the right shapes and leaves the first blocks unchanged."""

import json

import jax
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import TransformerConfig
from saffu.models.transformer import grow_layer, inherit_layers


def _same(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    config = TransformerConfig(97, width=16, layers=4, heads=2, context_tokens=4, max_len=32)
    return config, config.init(jax.random.key(0))


def test_inheritance_copies_exactly_the_first_blocks_and_the_ends(reference):
    config, params = reference
    small, inherited = inherit_layers(params, config, 2)
    assert small == TransformerConfig(97, width=16, layers=2, heads=2, context_tokens=4, max_len=32)
    assert sorted(inherited["blocks"]) == [0, 1]
    for index in (0, 1):
        assert _same(inherited["blocks"][index], params["blocks"][index])
    for name in ("embed", "positions", "final_norm", "output"):
        assert _same(inherited[name], params[name])
    shapes = jax.eval_shape(lambda: small.init(jax.random.key(1)))      # random init's tree and shapes
    assert jax.tree.structure(shapes) == jax.tree.structure(inherited)
    assert all(s.shape == x.shape for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(inherited)))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 97)
    assert small.logits(inherited, tokens).shape == (2, 12, 97)
    for layers in (0, 5):
        with pytest.raises(SaffuError, match="inherit"):
            inherit_layers(params, config, layers)


def test_growth_appends_the_reference_block_and_keeps_the_first(reference):
    config, params = reference
    small, inherited = inherit_layers(params, config, 1)
    trained = jax.tree.map(lambda x: x + 1.0, inherited)               # stands for training
    grown_config, grown = grow_layer(trained, small, params, config)
    assert grown_config.layers == 2 and sorted(grown["blocks"]) == [0, 1]
    assert _same(grown["blocks"][0], trained["blocks"][0]) and _same(grown["blocks"][1], params["blocks"][1])
    assert _same(grown["output"], trained["output"])
    shapes = jax.eval_shape(lambda: grown_config.init(jax.random.key(1)))
    assert all(s.shape == x.shape for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(grown)))
    full_config, full = grown_config, grown
    while full_config.layers < config.layers:
        full_config, full = grow_layer(full, full_config, params, config)
    with pytest.raises(SaffuError, match="cannot inherit block 4"):
        grow_layer(full, full_config, params, config)
    other = TransformerConfig(97, width=32, layers=1, heads=2, context_tokens=4, max_len=32)
    with pytest.raises(SaffuError, match="differ"):
        grow_layer(other.init(jax.random.key(3)), other, params, config)


@pytest.mark.slow   # three small training runs through the CLI
def test_cli_inherits_and_grows(tiny_workdir, tmp_path, capsys):
    from saffu.cli import main
    from saffu.training.checkpoints import load_params, load_run_config
    work = ["--workdir", str(tiny_workdir.path)]
    small_model = ["--width", "16", "--attention-heads", "2", "--context", "4", "--max-len", "40", "--batch-size", "2",
                   "--seq-len", "16", "--steps", "2", "--eval-tokens", "64", "--quiet"]
    ref, half, grown, metrics = tmp_path / "ref", tmp_path / "half", tmp_path / "grown", tmp_path / "m.json"
    assert main(["train", *work, "--run", str(ref), "--init", "random", "--model", "transformer", "--layers", "3",
                 *small_model]) == 0
    assert main(["train", *work, "--run", str(half), "--init", "inherit", "--reference", str(ref), *small_model,
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["init"] == "inherit" and load_run_config(half).layers == 1
    # at learning rate 0 the grown run keeps what it was given: half's weights, then ref's block 1
    assert main(["train", *work, "--run", str(grown), "--init", "inherit", "--reference", str(ref),
                 "--start-from", str(half), "--learning-rate", "0", *small_model]) == 0
    config = load_run_config(grown)
    got, want_ref, want_half = (load_params(r, load_run_config(r))[0] for r in (grown, ref, half))
    assert config.layers == 2
    assert _same(got["blocks"][0], want_half["blocks"][0]) and _same(got["blocks"][1], want_ref["blocks"][1])
    assert _same(got["output"], want_half["output"])
    capsys.readouterr()
    assert main(["train", *work, "--run", str(tmp_path / "x"), "--init", "inherit", "--reference", str(ref),
                 "--inherit-layers", "4", *small_model]) == 2
    assert "inherit 1 to 3 blocks" in capsys.readouterr().err
