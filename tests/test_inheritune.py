"""Inheritune for the transformer and SAFFU stacks: inheritance copies exactly the chosen weights,
growth appends the reference's next block (or, SAFFU, blocks solved on top of the stack) with the
right shapes and leaves the first blocks unchanged."""

import json

import jax
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import SaffuConfig, TransformerConfig
from saffu.models.interface import model_init, model_logits
from saffu.models.transformer import grow_layer, inherit_layers


def _same(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    config = TransformerConfig(97, width=16, layers=4, heads=2, context_tokens=4, max_len=32, block="gpt", output_bias=True)
    return config, model_init(config, jax.random.key(0))


def test_inheritance_copies_exactly_the_first_blocks_and_the_ends(reference):
    config, params = reference
    small, inherited = inherit_layers(params, config, 2)
    assert small == TransformerConfig(97, width=16, layers=2, heads=2, context_tokens=4, max_len=32,
                                      block="gpt", output_bias=True)
    assert sorted(inherited["blocks"]) == [0, 1]
    for index in (0, 1):
        assert _same(inherited["blocks"][index], params["blocks"][index])
    for name in ("embed", "positions", "final_norm", "output"):
        assert _same(inherited[name], params[name])
    shapes = jax.eval_shape(lambda: model_init(small, jax.random.key(1)))      # random init's tree and shapes
    assert jax.tree.structure(shapes) == jax.tree.structure(inherited)
    assert all(s.shape == x.shape for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(inherited)))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 97)
    assert model_logits(small, inherited, tokens).shape == (2, 12, 97)
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
    shapes = jax.eval_shape(lambda: model_init(grown_config, jax.random.key(1)))
    assert all(s.shape == x.shape for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(grown)))
    full_config, full = grown_config, grown
    while full_config.layers < config.layers:
        full_config, full = grow_layer(full, full_config, params, config)
    with pytest.raises(SaffuError, match="cannot inherit block 4"):
        grow_layer(full, full_config, params, config)
    other = TransformerConfig(97, width=32, layers=1, heads=2, context_tokens=4, max_len=32, block="gpt", output_bias=True)
    with pytest.raises(SaffuError, match="differ"):
        grow_layer(model_init(other, jax.random.key(3)), other, params, config)


@pytest.mark.slow   # three small training runs through the CLI
def test_cli_inherits_and_grows(tiny_workdir, tmp_path, capsys):
    from saffu.cli import main
    from saffu.training.checkpoints import load_params, load_run_config
    work = ["--workdir", str(tiny_workdir.path)]
    small_model = ["--width", "16", "--attention-heads", "2", "--context", "4", "--max-len", "40", "--batch-size", "2",
                   "--seq-len", "16", "--steps", "2", "--eval-tokens", "64", "--quiet"]
    ref, half, grown, metrics = tmp_path / "ref", tmp_path / "half", tmp_path / "grown", tmp_path / "m.json"
    assert main(["train", *work, "--run", str(ref), "--init", "random", "--model", "transformer", "--block", "gpt",
                 "--output-bias", "--layers", "3",
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


# ---- SAFFU stacks ---------------------------------------------------------------------------

def _stack_config(vocab_size: int, blocks: int = 3, bits: int = 10):
    return SaffuConfig(vocab_size, bits=bits, radius=3, positions=1, blocks=blocks)


def test_saffu_inheritance_copies_the_first_blocks_and_growth_appends():
    from saffu.models.saffu import grow_block, inherit_blocks, init_params, saffu_logits
    config = _stack_config(97)
    params = init_params(config, jax.random.key(0))
    small, inherited = inherit_blocks(params, config, 2)
    assert small.blocks == 2 and sorted(inherited["blocks"]) == [0, 1]
    assert all(_same(inherited["blocks"][i], params["blocks"][i]) for i in (0, 1))
    shapes = jax.eval_shape(lambda: init_params(small, jax.random.key(1)))
    assert jax.tree.structure(shapes) == jax.tree.structure(inherited)
    # the inherited stack is the reference's stack cut after block 1
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 97)
    assert saffu_logits(inherited, small, tokens).shape == (2, 12, 97)
    trained = jax.tree.map(lambda x: x + 1.0, inherited)                  # stands for training
    grown_config, grown = grow_block(trained, small, params["blocks"][2])
    assert grown_config == config and sorted(grown["blocks"]) == [0, 1, 2]
    assert all(_same(grown["blocks"][i], trained["blocks"][i]) for i in (0, 1))
    assert _same(grown["blocks"][2], params["blocks"][2])
    for blocks in (0, 4):
        with pytest.raises(SaffuError, match="inherit 1 to 3 blocks"):
            inherit_blocks(params, config, blocks)
    wider = init_params(_stack_config(97, blocks=1, bits=12), jax.random.key(3))
    with pytest.raises(SaffuError, match="block shapes"):
        grow_block(trained, small, wider["blocks"][0])


@pytest.mark.slow
def test_blocks_solved_on_top_of_a_stack(tiny_workdir):
    """Solving blocks 1 … L−1 on top of the explicit block 0 gives exactly the whole explicit
    stack (same counts, same stages); on top of a changed (say trained) block 0 that block stays
    as given and the new blocks read it."""
    from saffu.configs import SolverConfig
    from saffu.models.saffu import inherit_blocks
    from saffu.solve.stack import solve_explicit
    config, solver = _stack_config(tiny_workdir.vocab_size), SolverConfig(holdout_tokens=64)
    full, report = solve_explicit(tiny_workdir, config, solver, progress=False)
    _, below = inherit_blocks(full, config, 1)
    grown, grown_report = solve_explicit(tiny_workdir, config, solver, progress=False, below=below)
    assert _same(grown, full)
    assert (report["solved_blocks"], grown_report["solved_blocks"]) == (3, 2)
    assert grown_report["flops"] < report["flops"]
    trained = jax.tree.map(lambda x: x * 0.5, below)
    on_trained, _ = solve_explicit(tiny_workdir, config, solver, progress=False, below=trained)
    assert _same(on_trained["blocks"][0], trained["blocks"][0])
    assert not np.allclose(on_trained["blocks"][1]["group_weights"], full["blocks"][1]["group_weights"])
    with pytest.raises(SaffuError, match="1 ≤ k < 3"):
        solve_explicit(tiny_workdir, config, solver, progress=False, below=full)
    with pytest.raises(SaffuError, match="shapes"):
        solve_explicit(tiny_workdir, _stack_config(tiny_workdir.vocab_size, bits=12), solver, progress=False,
                       below=below)


@pytest.mark.slow   # a SAFFU solve and two short training runs through the CLI
def test_cli_inherits_and_grows_a_saffu_stack(tiny_workdir, tmp_path):
    from saffu.cli import main
    from saffu.solve.stack import solve_explicit
    from saffu.training.checkpoints import load_params, load_run_config
    work = ["--workdir", str(tiny_workdir.path)]
    stack = ["--bits", "10", "--radius", "3", "--positions", "1"]
    short = ["--batch-size", "2", "--seq-len", "16", "--steps", "2", "--eval-tokens", "64", "--quiet"]
    ref, half, grown = tmp_path / "ref", tmp_path / "half", tmp_path / "grown"
    assert main(["fit", *work, "--run", str(ref), *stack, "--blocks", "2", "--holdout-tokens", "64",
                 "--eval-tokens", "64", "--quiet"]) == 0
    assert main(["train", *work, "--run", str(half), "--init", "inherit", "--reference", str(ref),
                 "--inherit-before-lazy", *short]) == 0
    assert load_run_config(half).blocks == 1             # no lazy block (SAFFU attends over offsets): half
    # at learning rate 0 the grown run keeps what it was given: half's block, then one solved on it
    assert main(["train", *work, "--run", str(grown), "--init", "inherit", "--reference", str(ref),
                 "--start-from", str(half), "--grow-by", "solve", "--inherit-layers", "3", "--learning-rate", "0",
                 *short]) == 0
    config = load_run_config(grown)
    got, trained = load_params(grown, config)[0], load_params(half, load_run_config(half))[0]
    assert config.blocks == 3 and _same(got["blocks"][0], trained["blocks"][0])
    from saffu.configs import SolverConfig
    want, _ = solve_explicit(tiny_workdir, config, SolverConfig(), progress=False, below=trained)
    assert all(np.allclose(got["blocks"][i][k], want["blocks"][i][k], rtol=1e-6, atol=1e-6)
               for i in (1, 2) for k in want["blocks"][i])


def test_inheritune_depth_stops_before_the_first_lazy_layer():
    from saffu.eval.attention import layers_before_lazy
    assert layers_before_lazy({"lazy_layers": [3, 4, 5]}, 6) == 3
    assert layers_before_lazy({"lazy_layers": []}, 6) == 3          # none lazy: half
    assert layers_before_lazy({"lazy_layers": [0, 1]}, 6) == 3      # the first is lazy: half
    assert layers_before_lazy({"lazy_layers": []}, 1) == 1
