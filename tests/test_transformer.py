"""The transformer baseline: masking, sizing, the shared trainer and CLI, compute accounting."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import SaffuError
from saffu.engine import accounting
from saffu.cli import main
from saffu.data.tokenizer import EOD_ID
from saffu.models.interface import window_loss
from saffu.models.saffu import SaffuConfig
from saffu.models.transformer import TransformerConfig, parameter_count_of, sized_like
from saffu.solve.saffu import SolverConfig, solve_explicit
from saffu.training.trainer import TrainConfig, train


SMALL = dict(width=16, layers=2, heads=2, context_tokens=4, max_len=64)


def test_attention_is_causal_and_stays_in_its_document():
    config = TransformerConfig(vocab_size=40, **SMALL)
    params = config.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 40, (2, 20)).astype(np.int32)
    tokens[:, 8] = EOD_ID
    base = np.asarray(config.logits(params, jnp.asarray(tokens)))
    later = tokens.copy()
    later[:, 14] = 3 if tokens[0, 14] != 3 else 4                       # a later token changes...
    changed = np.asarray(config.logits(params, jnp.asarray(later)))
    np.testing.assert_allclose(changed[:, :14], base[:, :14], atol=1e-5)   # ...no earlier position moves
    assert np.abs(changed[:, 14:] - base[:, 14:]).max() > 1e-3
    earlier = tokens.copy()
    earlier[:, 2] = 3 if tokens[0, 2] != 3 else 4                        # a token of the previous document
    moved = np.asarray(config.logits(params, jnp.asarray(earlier)))
    np.testing.assert_allclose(moved[:, 8:], base[:, 8:], atol=1e-5)      # is invisible after the <eod>
    assert np.abs(moved[:, 2:8] - base[:, 2:8]).max() > 1e-3


def test_sizing_matches_the_target_and_counts_without_allocating():
    config = sized_like(8192, 3_180_000)
    assert abs(parameter_count_of(config) - 3_180_000) / 3_180_000 < 0.1
    small = TransformerConfig(vocab_size=40, **SMALL)
    assert parameter_count_of(small) == sum(x.size for x in jax.tree.leaves(small.init(jax.random.key(1))))


def test_bad_configs_and_windows_are_clear_errors():
    with pytest.raises(SaffuError, match="multiple"):
        TransformerConfig(vocab_size=40, width=10, heads=3)
    config = TransformerConfig(vocab_size=40, width=8, layers=1, heads=2, context_tokens=2, max_len=8)
    with pytest.raises(SaffuError, match="max_len"):
        config.logits(config.init(jax.random.key(0)), jnp.zeros((1, 9), jnp.int32))


@pytest.mark.parametrize("config", [TransformerConfig(vocab_size=40, **SMALL), SaffuConfig(vocab_size=40, bits=8)],
                         ids=["transformer", "saffu"])
def test_analytic_flops_agree_with_xla(config):
    """The analytic forward count is the dense work; XLA also counts the masked half of the
    attention matrix, softmaxes and norms, so it may be somewhat higher, never lower by much."""
    params = config.init(jax.random.key(0))
    seq_len = 32
    windows = jnp.zeros((2, config.context + seq_len), jnp.int32)
    mask = jnp.ones((2, seq_len), bool)
    compiled = jax.jit(lambda p, w, m: window_loss(p, config, w, m)[0]).lower(params, windows, mask).compile()
    ratio = accounting.xla_flops(compiled) / (config.forward_flops(seq_len) * 2 * seq_len)
    assert 0.9 < ratio < 2.5


def test_same_trainer_lowers_the_loss_and_accounts_for_compute(tiny_workdir, tmp_path):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL)
    settings = TrainConfig(steps=30, batch_size=4, seq_len=16, learning_rate=1e-2, warmup_steps=5, eval_every=10)
    _, history = train(config, config.init(jax.random.key(0)), tiny_workdir.tokens("train_10M"), settings,
                       tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert history[-1]["dev_loss"] < history[0]["dev_loss"] - 1.0
    last = history[-1]
    assert last["tokens"] == 30 * 4 * 16 and last["peak_rss_mb"] > 0
    # the analytic count (3 × forward per trained token) against XLA's count of the compiled
    # training step, an independent measure: backward ≈ 2 × forward, plus what XLA also counts
    assert 0.8 < last["xla_flops"] / last["flops"] < 2.5
    assert last["flops"] == pytest.approx(3 * history[1]["flops"])            # linear in steps (30 vs 10)


def test_solver_reports_its_compute(tiny_workdir):
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=3)
    _, report = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=64, chunk_size=128), progress=False)
    assert report["streaming_passes"] == 3 and report["calibration_evaluations"] >= 1
    assert report["xla_flops"] > 0 and report["flops"] > 0 and report["peak_rss_mb"] > 0
    train_tokens = len(tiny_workdir.tokens("train_10M"))
    assert report["counted_tokens"] == train_tokens - 64 - 1          # every target but the holdout's
    assert report["holdout_tokens"] == 64 and report["tokens_per_s"] > 0


def test_cli_trains_evaluates_and_scores_blimp_on_a_transformer(tiny_workdir, tmp_path, capsys):
    run, metrics = tmp_path / "tf", tmp_path / "m.json"
    args = ["--workdir", str(tiny_workdir.path), "--run", str(run)]
    assert main(["train", *args, "--init", "random", "--model", "transformer", "--width", "16", "--layers", "1",
                 "--attention-heads", "2", "--context", "4", "--max-len", "40", "--steps", "4", "--batch-size", "2",
                 "--seq-len", "16", "--quiet", "--metrics-json", str(metrics)]) == 0
    figures = json.loads(metrics.read_text())
    assert figures["model"] == "transformer" and figures["steps"] == 4 and figures["xla_flops"] > 0
    assert "dev_bpb" in figures
    assert main(["eval", *args, "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(figures["dev_bpb"])
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    (blimp / "p.jsonl").write_text(json.dumps({"sentence_good": "the cat sat .", "sentence_bad": "cat the sat .",
                                               "field": "syntax", "UID": "p"}) + "\n")
    assert main(["blimp", *args, "--blimp", str(blimp), "--quiet", "--metrics-json", str(metrics)]) == 0
    assert "blimp_accuracy" in json.loads(metrics.read_text())
    capsys.readouterr()
    # explicit init of the transformer solves factors from the training split (tests/test_residual.py);
    # a held-out tail as long as the whole split is refused with a clear error
    assert main(["train", *args, "--init", "explicit", "--model", "transformer", "--holdout-tokens", "1000000"]) == 2
    assert "covers the whole training split" in capsys.readouterr().err
