import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from saffu import SaffuError
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.models.interface import window_loss, window_nll
from saffu.models.saffu import Saffu, SaffuConfig, init_params, saffu_logits

CONFIGS = [
    SaffuConfig(vocab_size=40, bits=8, radius=4, heads=2, positions=2),
    SaffuConfig(vocab_size=40, bits=8, radius=3, heads=1, positions=0, value_form="log"),
    SaffuConfig(vocab_size=40, bits=8, radius=4, heads=2, hidden=9),
    SaffuConfig(vocab_size=40, bits=8, radius=2, heads=1, positions=1, blocks=2),
]


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def reference_logits(params, config, tokens):
    """Float64 numpy forward of one sequence, position by position (formulation §3)."""
    from saffu.models.saffu import cipher_table
    codes = np.asarray(cipher_table(config), np.float64)
    P = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    sequence = codes[tokens]
    S, M = len(tokens), config.radius
    for index in range(config.blocks):
        block = P["blocks"][index]
        logits = np.zeros((S, config.vocab_size))
        for p in range(S):
            X = np.tile(codes[PAD_ID], (M, 1))
            for d in range(M):
                j = p - d
                if j < 0 or (tokens[j + 1:p + 1] == EOD_ID).any():
                    break
                X[d] = sequence[j]
            values = []
            for h in range(config.heads):
                Xh = X[:config.head_radius(h)]
                a = _softmax((Xh @ X[0]) @ block[f"attention_{h}"])
                if config.value_form == "linear":
                    values.append(a @ Xh)
                else:
                    values.append(_softmax(a @ np.log(Xh + 1e-6)))
            if config.hidden == 0:
                groups = list(X[:config.positions]) + values
                logits[p] = block["output_bias"] + sum(g @ W for g, W in zip(groups, block["group_weights"]))
            else:
                z = _softmax(np.concatenate(values + [X[0]]) @ block["hidden_weights"] + block["hidden_bias"])
                logits[p] = z @ block["output_weights"] + block["output_bias"]
        sequence = _softmax(logits) @ codes
    return logits


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"M{c.radius}H{c.heads}D{c.hidden}{c.value_form}L{c.blocks}")
def test_forward_matches_float64_reference(config):
    params = init_params(config, jax.random.key(3), scale=0.5)
    tokens = np.array([EOD_ID, 5, 9, 9, 12, EOD_ID, 7, 3, 30, 2, 5, EOD_ID, 8], np.int32)
    got = np.asarray(saffu_logits(params, config, jnp.asarray(tokens)[None]))[0]
    np.testing.assert_allclose(got, reference_logits(params, config, tokens), rtol=2e-5, atol=2e-5)  # float32


def test_nnx_module_and_pure_function_agree():
    config = CONFIGS[0]
    model = Saffu(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[EOD_ID, 4, 5, 6, EOD_ID, 7]])
    np.testing.assert_array_equal(model(tokens), saffu_logits(model.params(), config, tokens))
    assert jax.tree.structure(model.params()) == jax.tree.structure(init_params(config, jax.random.key(0)))


def test_window_loss_masks_targets():
    """Per-target NLL against a float64 NumPy reference written independently of
    ``window_nll``: the position-by-position forward above, then, window by window and target
    by target, ``log Σ exp(z) − z[y]`` by hand from the logits of the position before the
    target (the first ``context`` tokens of a window are context only), zero where masked."""
    config = CONFIGS[0]
    params = init_params(config, jax.random.key(0), scale=0.5)
    T = 5
    windows = np.random.default_rng(0).integers(2, 40, (2, config.context + T)).astype(np.int32)
    windows[0, 5] = EOD_ID                                           # a document starts inside the window
    mask = np.array([[True] * 5, [True, True, False, False, False]])
    expected = np.zeros((2, T))
    for b in range(2):
        logits = reference_logits(params, config, windows[b])       # float64, [R + T, V]
        for t in range(T):
            if mask[b, t]:
                z = logits[config.context + t - 1]                     # predicts token context + t
                top = z.max()
                expected[b, t] = top + np.log(np.exp(z - top).sum()) - z[windows[b, config.context + t]]
    got = np.asarray(window_nll(params, config, jnp.asarray(windows), jnp.asarray(mask)))
    # float32 logits are within 2e-5 of the reference (test above), so an NLL within 2 × 2e-5 plus
    # float32 rounding of the log-sum-exp (values ~ 5 nats: ~1e-6)
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-5)
    assert (got[~mask] == 0).all() and (expected[mask] > 0.5).all()
    nll, count = window_loss(params, config, jnp.asarray(windows), jnp.asarray(mask))
    assert int(count) == 7
    assert float(nll) == pytest.approx(expected.sum(), abs=7 * 5e-5)


def test_invalid_configs_are_clear_errors():
    with pytest.raises(SaffuError, match="--bits"):
        SaffuConfig(vocab_size=8192, bits=12)
    with pytest.raises(SaffuError, match="--positions"):
        SaffuConfig(vocab_size=40, bits=8, radius=2, positions=3)
    with pytest.raises(SaffuError, match="value form"):
        SaffuConfig(vocab_size=40, bits=8, value_form="exp")


def test_a_model_of_its_own_kind_brings_its_init_and_logits():
    """A model the registry does not know (a third-party model trained by saffu's trainer) is
    called through its own methods; an object that is no model is a one-line error."""
    import dataclasses

    from saffu.models.interface import model_init, model_logits, trainable

    @dataclasses.dataclass(frozen=True)
    class Table:
        vocab_size: int = 5
        kind: str = "lookup-table"
        context = 1

        def init(self, key):
            return {"table": jax.random.normal(key, (self.vocab_size, self.vocab_size))}

        def logits(self, params, tokens):
            return params["table"][tokens]

    model = Table()
    params = model_init(model, jax.random.key(0))
    tokens = jnp.asarray([[0, 3, 4, 1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model_logits(model, params, tokens)),
                                  np.asarray(params["table"])[np.asarray(tokens)])
    assert trainable(model)
    with pytest.raises(SaffuError, match="not a model config: object"):
        model_logits(object(), params, tokens)
