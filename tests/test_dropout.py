"""The transformer's residual dropout: inverted-dropout statistics, training draws its masks from
(seed, step) so a resumed run is bit-identical, evaluation never drops, and models without it
refuse it."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import TrainConfig, TransformerConfig
from saffu.models.interface import model_init, target_loss
from saffu.models.transformer import Dropout
from saffu.training.trainer import train


def test_dropout_zeroes_its_share_and_keeps_the_mean():
    x = jnp.ones((2000, 64))
    drop = Dropout(0.25, jax.random.key(3))
    y = np.asarray(drop.apply(x, 0))
    assert abs((y == 0).mean() - 0.25) < 0.01                          # 128,000 draws: σ ≈ 0.0012
    np.testing.assert_allclose(y[y != 0], 1 / 0.75, rtol=1e-6)         # the kept ones scaled up
    assert abs(y.mean() - 1.0) < 0.01
    np.testing.assert_array_equal(y, np.asarray(drop.apply(x, 0)))     # same key, same use: same mask
    assert not np.array_equal(y, np.asarray(drop.apply(x, 1)))
    assert not np.array_equal(y, np.asarray(drop.at(1).apply(x, 0)))


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_training_dropout_changes_steps_not_evaluation_and_resumes_exactly(tiny_workdir, tmp_path):
    config = TransformerConfig(tiny_workdir.vocab_size, width=16, layers=1, heads=2, context_tokens=4, max_len=32,
                               block="gpt", output_bias=True)
    params = model_init(config, jax.random.key(1))
    stream, dev = tiny_workdir.tokens("train_10M"), tiny_workdir.tokens("dev")
    settings = TrainConfig(steps=4, batch_size=2, seq_len=16, eval_every=2, checkpoint_every=2, seed=5,
                           dropout=0.2, eval_windows=4)
    run = lambda name, cfg: train(config, params, stream, cfg, tmp_path / name, dev_stream=dev, progress=False)
    straight, history = run("a", settings)
    plain, plain_history = run("plain", TrainConfig(**{**settings.__dict__, "dropout": 0.0}))
    assert history[0]["dev_loss"] == plain_history[0]["dev_loss"]      # evaluation never drops
    assert history[1]["train_loss"] != plain_history[1]["train_loss"]
    run("b", settings)
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")                 # as if killed after step 2
    resumed, _ = run("b", settings)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))     # the same masks after a resume
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(plain)))


def test_dropout_is_refused_where_a_model_has_none(tiny_workdir):
    from saffu.models.saffu import SaffuConfig, init_params
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=4)
    windows = jnp.zeros((1, config.context + 4), jnp.int32)
    with pytest.raises(SaffuError, match="dropout"):
        target_loss(init_params(config, jax.random.key(0)), config, windows, jnp.ones((1, 4), bool),
                    Dropout(0.1, jax.random.key(0)))
    with pytest.raises(SaffuError, match="dropout"):
        TrainConfig(dropout=1.0)
