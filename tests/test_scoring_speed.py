"""The fast scoring paths (:func:`saffu.models.interface.target_nll`: logits at predicting
positions only, ``logsumexp − logit``; smaller evaluation calls; BLiMP rows packed with their
positions) give the scores of the reference computation: a whole-window forward, a float64
log-softmax and a gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu.configs import ExactConfig, ResidualConfig, SaffuConfig, TrainConfig, TransformerConfig
from saffu.data.windows import stack_windows, total_nll, window_plan
from saffu.eval.scoring import evaluate_split
from saffu.models.interface import model_init, model_logits, target_logits, target_nll, window_loss
from saffu.models.residual import with_explicit
from saffu.models.saffu import init_params
from saffu.solve.exact import solve_exact
from saffu.training.trainer import DevLoss


@pytest.fixture(scope="module")
def models(tiny_workdir):
    """Tiny models of every scored kind, each with random (non-zero) output weights."""
    V = tiny_workdir.vocab_size
    exact_config = ExactConfig(V, groups=((0,), (1,), (0, 1)), buckets=(3,), holdout_tokens=200)
    exact, _ = solve_exact(tiny_workdir, exact_config, progress=False)
    transformer = TransformerConfig(V, width=16, layers=2, heads=2, context_tokens=6, max_len=64,
                                    block="gpt", output_bias=True, across_documents=False)
    saffu = SaffuConfig(V, bits=12, radius=3, blocks=2, positions=1)
    out = {"transformer": (transformer, model_init(transformer, jax.random.key(0))),
           "saffu": (saffu, init_params(saffu, jax.random.key(1), scale=0.5)),
           "exact": (exact_config, exact)}
    for name, base in (("residual", transformer), ("residual-saffu", saffu)):
        config = ResidualConfig(base, exact_config, "unused")
        params = with_explicit(model_init(config, jax.random.key(2)), exact)
        fresh = model_init(base, jax.random.key(3)) if base.kind == "transformer" \
            else init_params(base, jax.random.key(3), scale=0.5)
        params["model"] = {k: fresh[k] for k in params["model"]}            # a non-zero f_θ
        params["scale"] = jnp.float32(0.7)
        out[name] = (config, params)
    return out


def _reference_nll(params, config, windows, mask, context=None):
    """The reference: the whole window's logits, a float64 log-softmax, the target's entry."""
    context = config.context if context is None else context
    logits = np.asarray(model_logits(config, params, jnp.asarray(windows)), np.float64)[:, context - 1:-1]
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, np.asarray(windows)[:, context:, None], axis=-1)[..., 0] * mask


def _sample_windows(workdir, config, seq_len=20, count=5):
    stream = np.asarray(workdir.tokens("dev"))
    starts = [1, 7, 30, 55, len(stream) - 9][:count]          # one inside a document, one running off the end
    return stack_windows(stream, starts, [len(stream)] * len(starts), config.context, seq_len)


KINDS = ["transformer", "saffu", "exact", "residual", "residual-saffu"]


@pytest.mark.parametrize("kind", KINDS)
def test_target_nll_equals_the_float64_log_softmax(tiny_workdir, models, kind):
    config, params = models[kind]
    windows, mask = _sample_windows(tiny_workdir, config)
    got = np.asarray(jax.jit(target_nll, static_argnums=1)(params, config, jnp.asarray(windows), jnp.asarray(mask)))
    want = _reference_nll(params, config, windows, mask)
    assert mask.sum() > 60 and (~mask).any()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["transformer", "exact", "residual"])
def test_target_logits_with_less_context_and_positions(tiny_workdir, models, kind):
    """A window holding fewer context tokens than the model's, with each token's position given,
    scores a document that starts at its ``<eod>`` as the full window does."""
    config, params = models[kind]
    stream = np.asarray(tiny_workdir.tokens("dev"))
    start = int(np.flatnonzero(stream == 1)[3])                     # a document's opening <eod>
    windows, _ = stack_windows(stream, [start - 2], [len(stream)], config.context, 20)
    eod = config.context + 2                                        # the <eod>'s column
    assert windows[0, eod] == 1
    short = windows[:, eod:]
    positions = np.arange(eod, windows.shape[1], dtype=np.int32)[None]
    targeted = jax.jit(target_logits, static_argnums=(1, 3))              # compiled: eager dispatch is slow
    got = jax.nn.log_softmax(targeted(params, config, jnp.asarray(short), 1, jnp.asarray(positions)))
    want = jax.nn.log_softmax(jax.jit(model_logits, static_argnums=0)(config, params, jnp.asarray(windows)))[:, eod:-1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("sample", [None, 60], ids=["whole", "sample"])
@pytest.mark.parametrize("kind", ["transformer", "saffu", "residual"])
def test_evaluate_split_equals_the_old_loss(tiny_workdir, models, kind, sample):
    """The whole split, and a sample of short ranges (whose last windows are shortened), score as
    the previous path did: full windows of ``eval_seq_len`` targets, 16 per call, window_loss.
    A model that reads positions (the transformer, a residual over one) scores each document as
    that path does in a window of its own, its ``<eod>`` the last context token."""
    config, params = models[kind]
    stream = tiny_workdir.tokens("dev")
    ranges, _ = tiny_workdir.sample_documents("dev", sample or len(stream))
    assert sample is None or len(ranges) > 1
    if kind != "saffu":                                          # one range per document
        eods = np.flatnonzero(np.asarray(stream) == 1)
        ranges = [(int(a) + 1, int(b) + 1) for a, b in zip(eods[:-1], eods[1:])
                  if any(lo <= a + 1 and b + 1 <= hi for lo, hi in ranges)]
    old = jax.jit(window_loss, static_argnums=1)
    nll, count = total_nll(lambda w, m: old(params, config, w, m), stream, ranges, config.context,
                           config.eval_seq_len, 16, tight=False)
    got = evaluate_split(params, config, tiny_workdir, "dev", sample, progress=False)
    assert got["dev_tokens"] == count
    assert abs(got["dev_loss"] - nll / count) < 1e-5


def test_tight_plan_covers_every_target_once():
    ranges = [(1, 30), (40, 41), (50, 600), (700, 790)] + [(1000 + 100 * i, 1020 + 100 * i) for i in range(300)]
    for tight in (False, True):
        plan = window_plan(ranges, 256, 4, tight)
        covered = sorted(t for width, batch in plan for s, end in batch for t in range(s, min(s + width, end)))
        assert covered == sorted(t for begin, end in ranges for t in range(begin, end))
        assert all(len(batch) <= 4 for _, batch in plan)
    widths = [width for width, _ in window_plan(ranges, 256, 4, True)]
    assert set(widths) == {256, 32}     # 302 windows of 32 save 9,664 slots against 64; the lone 64, 128 do not
    assert window_plan([(1, 5000)], 256, 4, True) == window_plan([(1, 5000)], 256, 4)   # a whole split: one shape


def test_tight_plan_weighs_each_width_against_the_shapes_kept():
    # 55 short ranges: each step up (32 -> 64 -> 128 -> 256) saves under TIGHT_SAVING alone,
    # but scoring them at 32 instead of 256 saves 55 * 224 = 12,320 slots, worth a shape
    ranges = [(1000 * i + 1, 1000 * i + 21) for i in range(55)] + [(100_000, 101_000)]
    widths = [width for width, _ in window_plan(ranges, 256, 2, True)]
    assert set(widths) == {256, 32}
    slots = sum(width * len(batch) for width, batch in window_plan(ranges, 256, 2, True))
    assert slots == 55 * 32 + 4 * 256


@pytest.mark.parametrize("kind", ["transformer", "exact"])
def test_dev_loss_equals_the_old_formula(tiny_workdir, models, kind):
    config, params = models[kind]
    stream = np.asarray(tiny_workdir.tokens("dev"))
    train_config = TrainConfig(seq_len=16, batch_size=16, eval_windows=10)
    dev = DevLoss(config, stream, train_config)
    assert dev.size < train_config.batch_size and len(dev.windows) % dev.size == 0
    windows, mask = np.asarray(dev.windows), np.asarray(dev.mask)
    want = _reference_nll(params, config, windows, mask)
    total, count = want.sum(), mask.sum()
    assert abs(dev(params) - total / count) < 1e-5
