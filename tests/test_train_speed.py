"""The faster training step computes what the plain one does: the fused output layer and
cross-entropy against a float64 numpy reference (loss and gradients), the window-by-window
attention against flax's multi-head attention (values and gradients), the transformer's
training loss against the whole-logits formula, data-parallel steps over two host devices
against one device, and the host allocator setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from saffu.configs import TrainConfig, TransformerConfig
from saffu.data.tokenizer import EOD_ID
from saffu.models.fused_loss import linear_nll_sum
from saffu.models.interface import model_init, target_loss, window_loss
from saffu.models.transformer import causal_mask, self_attention


def _reference(h, kernel, bias, targets, weights):
    """float64 numpy: the loss and its gradients in ``h``, ``kernel``, ``bias``."""
    h, kernel, bias = (np.asarray(x, np.float64) for x in (h, kernel, bias))
    logits = h @ kernel + bias
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = -log_probs[np.arange(len(targets)), targets]
    grad = np.exp(log_probs)
    grad[np.arange(len(targets)), targets] -= 1.0
    grad *= np.asarray(weights, np.float64)[:, None]
    return (nll * weights).sum(), grad @ kernel.T, h.T @ grad, grad.sum(axis=0)


@pytest.mark.parametrize("n, chunk", [(37, 8), (64, 16), (5, 256)])
def test_fused_loss_and_gradients_equal_a_float64_reference(n, chunk):
    """Any number of tokens (a last chunk padded with zero weight), masked tokens included;
    float32 against float64: relative 1e-5 on the loss, absolute 1e-5 on gradients of order 0.1."""
    rng = np.random.default_rng(n)
    d, vocab = 12, 50
    h = rng.normal(size=(n, d)).astype(np.float32)
    kernel = (0.5 * rng.normal(size=(d, vocab))).astype(np.float32)
    bias = rng.normal(size=vocab).astype(np.float32)
    targets = rng.integers(0, vocab, n).astype(np.int32)
    weights = (rng.random(n) > 0.3).astype(np.float32)
    loss, d_h, d_kernel, d_bias = _reference(h, kernel, bias, targets, weights)
    value, grads = jax.value_and_grad(linear_nll_sum, argnums=(0, 1, 2))(h, kernel, bias, targets, weights, chunk)
    np.testing.assert_allclose(float(value), loss, rtol=1e-5)
    for got, want in zip(grads, (d_h, d_kernel, d_bias)):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # without differentiation: the same value, no gradient computed
    np.testing.assert_allclose(float(jax.jit(linear_nll_sum, static_argnums=5)(h, kernel, bias, targets, weights,
                                                                                chunk)), loss, rtol=1e-5)


def test_fused_loss_scales_its_gradient_by_the_cotangent():
    rng = np.random.default_rng(0)
    h, kernel, bias = rng.normal(size=(9, 4)), rng.normal(size=(4, 7)), rng.normal(size=7)
    h, kernel, bias = (jnp.asarray(x, jnp.float32) for x in (h, kernel, bias))
    targets, weights = jnp.arange(9) % 7, jnp.ones(9)
    once = jax.grad(lambda k: linear_nll_sum(h, k, bias, targets, weights, 4))(kernel)
    thrice = jax.grad(lambda k: 3.0 * linear_nll_sum(h, k, bias, targets, weights, 4))(kernel)
    np.testing.assert_allclose(np.asarray(thrice), 3 * np.asarray(once), rtol=1e-6)


def _tokens(batch: int, length: int, vocab: int, seed: int = 0) -> jnp.ndarray:
    """Random tokens with a few ``<eod>``s, so the document mask cuts windows."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, vocab, (batch, length))
    tokens[rng.random((batch, length)) < 0.08] = EOD_ID
    return jnp.asarray(tokens, jnp.int32)


def test_attention_equals_flax_multi_head_attention_and_its_gradients():
    """The one-product projections and the window-by-window softmax with its written-out
    backward pass give flax's values and gradients (in the input and every parameter)."""
    module = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=False, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (3, 11, 16))
    mask = causal_mask(_tokens(3, 11, 30))
    cotangent = jax.random.normal(jax.random.key(2), (3, 11, 16))

    def loss(params, x, ours):
        m = nnx.merge(graphdef, params)
        out = self_attention(m, x, mask) if ours else m(x, mask=mask)
        return jnp.sum(out * cotangent)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for ours, theirs in zip(grads(params, x, True), grads(params, x, False)):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(loss(params, x, True)), float(loss(params, x, False)), rtol=1e-5)


SMALL = {"width": 32, "layers": 2, "heads": 4, "context_tokens": 4, "max_len": 64, "block": "gpt", "output_bias": True}


def test_transformer_training_loss_equals_the_whole_logits_formula():
    """The trainer's loss (fused output layer and cross-entropy, the faster attention) equals
    :func:`window_loss` (the whole logits, a log-softmax, a gather), and so do their gradients."""
    config = TransformerConfig(vocab_size=60, **SMALL)
    params = model_init(config, jax.random.key(0))
    windows = _tokens(3, config.context + 20, 60, seed=3)
    mask = jnp.asarray(np.random.default_rng(4).random((3, 20)) > 0.2)
    fast = jax.value_and_grad(lambda p: target_loss(p, config, windows, mask)[0])
    plain = jax.value_and_grad(lambda p: window_loss(p, config, windows, mask)[0])
    (fast_loss, fast_grads), (plain_loss, plain_grads) = jax.jit(fast)(params), jax.jit(plain)(params)
    np.testing.assert_allclose(float(fast_loss), float(plain_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(fast_grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_a_data_parallel_step_over_two_devices_equals_one_device():
    """The same step with the batch split over two host devices (``jax.sharding``; the
    gradient all-reduce is XLA's) has the same loss and gradients as on one device, and ends at
    the same parameters (but the attention's key biases: their exact gradient is zero, the
    softmax being blind to a constant per query, so Adam's normalisation turns float32 noise in
    them into steps of the learning rate's size, on one device or two)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from saffu.training.trainer import StepStats, data_parallel_mesh, make_optimizer, make_train_step
    if len(jax.devices()) < 2:
        pytest.skip("needs two host devices (tests/conftest.py forces four)")
    config = TransformerConfig(vocab_size=60, **SMALL)
    settings = TrainConfig(steps=4, batch_size=4, seq_len=16, warmup_steps=1)
    optimizer = make_optimizer(settings, settings.steps)
    windows = _tokens(4, config.context + 16, 60, seed=5)
    mask = jnp.ones((4, 16), bool)
    grad = jax.jit(jax.grad(lambda p, w, m: target_loss(p, config, w, m)[0]))
    ends, grads = [], []
    for devices in (1, 2):
        params = model_init(config, jax.random.key(0))
        state = (params, optimizer.init(params), StepStats.zeros())
        batch = (windows, mask)
        if devices > 1:
            mesh = data_parallel_mesh(devices)
            state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
            batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
        grads.append(grad(state[0], *batch))
        step = make_train_step(config, optimizer, settings, mesh if devices > 1 else None)
        for i in range(2):
            state = step(*state, jnp.int32(i), *batch, {})
        ends.append(state)
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):   # float32 sums in another order
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * max(1.0, float(jnp.max(jnp.abs(a)))))
    (p1, _, s1), (p2, _, s2) = ends
    np.testing.assert_allclose(float(s1.loss_sum), float(s2.loss_sum), rtol=1e-6)
    flat = lambda p: jax.tree_util.tree_flatten_with_path(p)[0]
    compared = 0
    for (path, a), (_, b) in zip(flat(p1), flat(p2)):
        names = [getattr(k, "key", k) for k in path]
        if names[-2:] == ["key", "bias"]:
            continue
        # Adam divides each gradient element by its own scale: an element near zero moves by up to
        # the learning rate (3e-3) on float noise; 1e-4 is 3% of one step
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4, err_msg=str(names))
        compared += 1
    assert compared == len(flat(p1)) - config.layers


def test_the_host_allocator_keeps_freed_memory_on_glibc(monkeypatch):
    import platform

    import saffu._host as host
    assert host.keep_host_memory() is (platform.libc_ver()[0] == "glibc")      # import saffu set it
    monkeypatch.setattr(host, "_applied", None)
    monkeypatch.setenv("SAFFU_HOST_MALLOC", "default")
    assert host.keep_host_memory() is False                                     # the opt-out
