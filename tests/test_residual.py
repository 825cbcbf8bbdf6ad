"""Explicit warm start of the transformer: the explicit residual (step 0 is the exact model, no
gradient reaches the frozen tables) and the explicit init (random init's tree and shapes)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu._io import SaffuError
from saffu.configs import (
    ExactConfig,
    FactorConfig,
    FactorisedConfig,
    ResidualConfig,
    SaffuConfig,
    StartConfig,
    TrainConfig,
    TransformerConfig,
)
from saffu.models.interface import model_init, model_logits, target_loss, window_loss
from saffu.models.residual import base_params, with_explicit
from saffu.models.transformer import explicit_transformer_init
from saffu.solve.exact import solve_exact
from saffu.solve.factors import solve_factorised
from saffu.training.trainer import train


@pytest.fixture(scope="module")
def exact_model(tiny_workdir):
    config = ExactConfig(tiny_workdir.vocab_size, groups=((0,), (1,), (0, 1)), buckets=(3,), holdout_tokens=200)
    params, _ = solve_exact(tiny_workdir, config, progress=False)
    return config, params


def _windows(workdir, count=3, length=24):
    stream = np.asarray(workdir.tokens(workdir.train_split))
    return jnp.asarray(np.stack([stream[i * 40:i * 40 + length] for i in range(count)]), jnp.int32)


def _residual(workdir, exact_model, base, scale="fixed"):
    explicit_config, explicit = exact_model
    config = ResidualConfig(base, explicit_config, "unused", scale=scale)
    return config, with_explicit(model_init(config, jax.random.key(3)), explicit)


@pytest.mark.parametrize("base_kind", ["transformer", "saffu", "factorised"])
def test_residual_at_step_zero_is_the_explicit_model(tiny_workdir, exact_model, base_kind):
    V = tiny_workdir.vocab_size
    base = {"transformer": TransformerConfig(V, width=16, layers=1, heads=2, context_tokens=4, max_len=64,
                                             block="gpt", output_bias=True),
            "saffu": SaffuConfig(V, bits=10, radius=4, heads=1),
            "factorised": FactorisedConfig(V, rank=8, positions=2, radius=4)}[base_kind]
    config, params = _residual(tiny_workdir, exact_model, base)
    tokens = _windows(tiny_workdir)
    got = jax.nn.log_softmax(model_logits(config, params, tokens), axis=-1)
    want = jax.nn.log_softmax(model_logits(exact_model[0], exact_model[1], tokens), axis=-1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert float(jnp.abs(model_logits(base, base_params(params, config), tokens)).max()) == 0.0   # f_θ starts at exactly 0


def _per_group_log_probs(explicit_config, explicit, tokens):
    """The exact model's log-probabilities one group at a time over its padded tables (the
    lookup the residual's fused one over compacted tables replaces)."""
    from saffu.models.exact import group_rows
    B, S = tokens.shape
    logits = jnp.broadcast_to(explicit["log_prior"], (B * S, explicit_config.vocab_size))
    for g, (row, bucket) in enumerate(group_rows(explicit, explicit_config, tokens)):
        logits = logits + explicit["beta"][g, bucket][:, None] * row
    return jax.nn.log_softmax(logits.reshape(B, S, -1), axis=-1)


def test_residual_loss_and_gradients_equal_the_per_group_lookup(tiny_workdir, exact_model):
    V = tiny_workdir.vocab_size
    explicit_config, explicit = exact_model
    base = TransformerConfig(V, width=16, layers=1, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)
    config, params = _residual(tiny_workdir, exact_model, base, scale="learned")
    assert "ell_col" not in params["explicit"]["groups"][0]                 # held compacted
    tokens = _windows(tiny_workdir)
    reference = _per_group_log_probs(explicit_config, explicit, tokens)
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(model_logits(config, params, tokens), axis=-1)),
                               np.asarray(reference), atol=1e-5)               # step 0: the exact model
    params["model"] = model_init(base, jax.random.key(4))                     # a non-zero f_θ, and λ ≠ 1
    params["scale"] = jnp.float32(0.8)
    mask = jnp.ones((tokens.shape[0], tokens.shape[1] - config.context), bool)

    def loss(trained):
        nll, count = window_loss({**params, **trained}, config, tokens, mask)
        return nll / count

    def reference_loss(trained):
        logits = trained["scale"] * reference + model_logits(base, trained["model"], tokens)
        log_probs = jax.nn.log_softmax(logits[:, config.context - 1:-1], axis=-1)
        return -jnp.take_along_axis(log_probs, tokens[:, config.context:, None], axis=-1).mean()

    def training_loss(trained):     # the trainer's: f's logits the buffer λ·e is added into, targets only
        nll, count = target_loss({**params, **trained}, config, tokens, mask)
        return nll / count

    trained = {"model": params["model"], "scale": params["scale"]}
    want, want_grads = jax.jit(jax.value_and_grad(reference_loss))(trained)
    for f in (loss, training_loss):
        got, got_grads = jax.jit(jax.value_and_grad(f))(trained)
        assert abs(float(got) - float(want)) < 1e-5
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


@pytest.mark.slow
def test_no_gradient_reaches_the_frozen_explicit_tables(tiny_workdir, exact_model, tmp_path):
    V = tiny_workdir.vocab_size
    base = TransformerConfig(V, width=16, layers=1, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)
    config, params = _residual(tiny_workdir, exact_model, base, scale="learned")
    tokens = _windows(tiny_workdir)
    mask = jnp.ones((tokens.shape[0], tokens.shape[1] - config.context), bool)
    leaves, treedef = jax.tree.flatten(params["explicit"])
    where = [i for i, leaf in enumerate(leaves) if leaf.dtype == jnp.float32]

    def loss(floats):
        explicit = list(leaves)
        for i, leaf in zip(where, floats):
            explicit[i] = leaf
        nll, count = window_loss({**params, "explicit": jax.tree.unflatten(treedef, explicit)}, config, tokens, mask)
        return nll / count

    grads = jax.grad(loss)([leaves[i] for i in where])
    assert where and all(float(jnp.abs(g).max()) == 0.0 for g in grads)

    stream = tiny_workdir.tokens(tiny_workdir.train_split)
    before = jax.tree.map(np.asarray, params)
    trained, history = train(config, params, stream, TrainConfig(steps=6, batch_size=2, seq_len=16, eval_every=3,
                                                                 learning_rate=1e-2, warmup_steps=1),
                             tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert jax.tree.all(jax.tree.map(np.array_equal, before["explicit"], jax.tree.map(np.asarray, trained["explicit"])))
    assert float(trained["scale"]) != 1.0                                     # λ learned
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before["model"], trained["model"])
    assert all(jax.tree.leaves(changed["output"]))                           # f_θ left zero
    assert history[0]["step"] == 0 and history[-1]["step"] == 6


@pytest.mark.slow
def test_annealed_residual_falls_to_its_trainable_model(tiny_workdir, exact_model, tmp_path):
    V = tiny_workdir.vocab_size
    base = TransformerConfig(V, width=16, layers=1, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)
    explicit_config, explicit = exact_model
    config = ResidualConfig(base, explicit_config, "unused", scale="annealed", anneal_share=0.5)
    params = with_explicit(model_init(config, jax.random.key(3)), explicit)
    assert "scale" not in params and config.fixed_params == ("explicit",)
    assert config.anneal_steps(6) == 3
    schedule = [config.step_inputs(step, 6).get("scale") for step in range(6)]
    assert schedule[0] == 1.0 and 1.0 > schedule[1] > schedule[2] > 0 and schedule[3:] == [None] * 3
    tokens = _windows(tiny_workdir)
    at_start = jax.nn.log_softmax(model_logits(config, {**params, **config.step_inputs(0, 6)}, tokens), axis=-1)
    want = jax.nn.log_softmax(model_logits(explicit_config, explicit, tokens), axis=-1)
    np.testing.assert_allclose(np.asarray(at_start), np.asarray(want), atol=1e-5)      # step 0: the explicit model
    np.testing.assert_array_equal(np.asarray(model_logits(config, params, tokens)),
                                  np.asarray(model_logits(base, base_params(params, config), tokens)))   # after: f_θ alone
    assert config.step_forward_flops(16, {"scale": 0.5}) == pytest.approx(
        base.forward_flops(16) + explicit_config.forward_flops(16) + 3.0 * V)
    assert config.forward_flops(16) == base.forward_flops(16)                     # inference: no lookup

    stream = tiny_workdir.tokens(tiny_workdir.train_split)
    trained, history = train(config, params, stream, TrainConfig(steps=6, batch_size=2, seq_len=16, eval_every=3,
                                                                 learning_rate=1e-2, warmup_steps=1),
                             tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert "scale" not in trained
    assert [h["step"] for h in history] == [0, 3, 6]
    with_lookup, without = history[1]["xla_flops"] / 3, (history[2]["xla_flops"] - history[1]["xla_flops"]) / 3
    assert without < with_lookup                              # steps after the anneal skip the explicit part
    assert history[2]["flops"] - history[1]["flops"] < history[1]["flops"] - history[0]["flops"]


def test_residual_config_errors(exact_model):
    explicit_config, _ = exact_model
    base = TransformerConfig(explicit_config.vocab_size, width=16, layers=1, heads=2, block="gpt", output_bias=True)
    with pytest.raises(SaffuError, match="scale"):
        ResidualConfig(base, explicit_config, "r", scale="annealed-ish")
    with pytest.raises(SaffuError, match="exact model"):
        ResidualConfig(base, base, "r")
    with pytest.raises(SaffuError, match="tokens"):
        ResidualConfig(TransformerConfig(explicit_config.vocab_size + 1, width=16, layers=1, heads=2,
                                         block="gpt", output_bias=True),
                       explicit_config, "r")
    assert ResidualConfig(base, explicit_config, "r").fixed_params == ("explicit", "scale")
    assert ResidualConfig(base, explicit_config, "r", scale="learned").fixed_params == ("explicit",)
    with pytest.raises(SaffuError, match="trainable part"):     # a solved model has no output layer to start at zero
        ResidualConfig(explicit_config, explicit_config, "r")


def test_explicit_init_keeps_the_random_tree_and_takes_the_factors(tiny_workdir):
    V = tiny_workdir.vocab_size
    config = TransformerConfig(V, width=16, layers=2, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)
    factors, _ = solve_factorised(tiny_workdir, FactorisedConfig(V, rank=16, positions=1),
                                  FactorConfig(holdout_tokens=200), progress=False)
    key = jax.random.key(0)
    random = model_init(config, key)
    params = explicit_transformer_init(config, key, factors)
    assert jax.tree.structure(params) == jax.tree.structure(random)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype), random)
    np.testing.assert_allclose(params["output"]["bias"], factors["output_bias"])
    rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))
    for got, like, source in [(params["embed"]["embedding"], random["embed"]["embedding"], factors["embeddings"][0]),
                              (params["output"]["kernel"], random["output"]["kernel"], factors["output_weights"])]:
        assert rms(got) == pytest.approx(rms(like), rel=1e-4)               # the initialiser's scale
        cosine = float(jnp.sum(got * source) / jnp.sqrt(jnp.sum(got ** 2) * jnp.sum(source ** 2)))
        assert cosine == pytest.approx(1.0, abs=1e-5)                        # the factor's direction
    at_one = explicit_transformer_init(config, key, factors, embedding_rms=1.0)     # the embeddings' scale given
    assert rms(at_one["embed"]["embedding"]) == pytest.approx(1.0, rel=1e-4)
    np.testing.assert_allclose(at_one["embed"]["embedding"] * rms(random["embed"]["embedding"]),
                               params["embed"]["embedding"], rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(at_one["output"]["kernel"], params["output"]["kernel"])
    small = explicit_transformer_init(config, key, factors, output_rms=0.0155)         # the output's scale given
    assert rms(small["output"]["kernel"]) == pytest.approx(0.0155, rel=1e-4)
    np.testing.assert_allclose(small["output"]["kernel"] * rms(random["output"]["kernel"]) / 0.0155,
                               params["output"]["kernel"], rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(small["embed"]["embedding"], params["embed"]["embedding"])
    only_bias = explicit_transformer_init(config, key, factors, ("bias",))
    np.testing.assert_array_equal(only_bias["embed"]["embedding"], random["embed"]["embedding"])
    np.testing.assert_array_equal(only_bias["blocks"][0]["mlp_in"]["kernel"], random["blocks"][0]["mlp_in"]["kernel"])
    with pytest.raises(SaffuError, match="rank 32"):
        explicit_transformer_init(TransformerConfig(V, width=32, layers=1, heads=2,
                                                    block="gpt", output_bias=True), key, factors)
    with pytest.raises(SaffuError, match="pieces"):
        explicit_transformer_init(config, key, factors, ("attention",))
    with pytest.raises(SaffuError, match="RMS must be > 0"):
        explicit_transformer_init(config, key, factors, embedding_rms=0.0)
    with pytest.raises(SaffuError, match="--explicit-embedding-rms must be > 0"):   # before any solve
        StartConfig(init="explicit", model="transformer", explicit_embedding_rms=-1.0)
    with pytest.raises(SaffuError, match="--explicit-output-rms must be > 0"):
        StartConfig(init="explicit", model="transformer", explicit_output_rms=0.0)


@pytest.mark.slow   # end to end through the CLI (exact, train, eval, blimp, generate): about 40 s
def test_cli_residual_and_explicit_transformer(tiny_workdir, exact_model, tmp_path, capsys):
    from saffu.cli import main
    exact_run, metrics = tmp_path / "exact", tmp_path / "m.json"
    work = ["--workdir", str(tiny_workdir.path)]
    assert main(["exact", *work, "--run", str(exact_run), "--groups", "0 1 0,1", "--buckets", "3",
                 "--holdout-tokens", "200", "--quiet", "--metrics-json", str(metrics)]) == 0
    exact_bpb = json.loads(metrics.read_text())["dev_bpb"]
    small = ["--model", "transformer", "--block", "gpt", "--output-bias",
             "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
             "--max-len", "64", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--quiet"]
    run = tmp_path / "residual"
    # zero steps of learning rate: the trained model is still the exact model
    assert main(["train", *work, "--run", str(run), "--init", "random", "--residual", str(exact_run), *small,
                 "--steps", "2", "--learning-rate", "0", "--metrics-json", str(metrics)]) == 0
    trained = json.loads(metrics.read_text())
    assert trained["model"] == "residual" and trained["dev_bpb"] == pytest.approx(exact_bpb, rel=1e-5)
    assert trained["params"] > trained["trained_params"] > 0 and trained["scale"] == 1.0
    assert main(["eval", *work, "--run", str(run), "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(exact_bpb, rel=1e-5)
    blimp = tmp_path / "blimp"                       # the explicit part counts in BLiMP and generation too
    blimp.mkdir()
    (blimp / "p.jsonl").write_text("".join(json.dumps({"sentence_good": good, "sentence_bad": bad, "field": "syntax",
                                                       "UID": "p"}) + "\n"
                                           for good, bad in [("the cat sat on the mat .", "the cat mat on the sat ."),
                                                             ("she saw a dog .", "she a saw dog .")]))
    scores = []
    for source in (exact_run, run):
        assert main(["blimp", *work, "--run", str(source), "--blimp", str(blimp), "--quiet",
                     "--metrics-json", str(metrics)]) == 0
        scores.append(json.loads(metrics.read_text()))
    assert scores[0]["blimp_accuracy"] == scores[1]["blimp_accuracy"]
    assert main(["generate", *work, "--run", str(run), "--num-samples", "2", "--max-tokens", "6", "--quiet",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["samples"] == 2
    assert main(["train", *work, "--run", str(run), "--init", "explicit", "--residual", str(exact_run), *small]) == 2
    assert "--init random" in capsys.readouterr().err
    annealed = tmp_path / "annealed"             # λ falls to 0: the trained model is f_θ alone, no lookup
    assert main(["train", *work, "--run", str(annealed), "--init", "random", "--residual", str(exact_run), *small,
                 "--steps", "4", "--residual-scale", "annealed", "--anneal-share", "0.5",
                 "--metrics-json", str(metrics)]) == 0
    trained = json.loads(metrics.read_text())
    assert trained["scale"] == 0.0 and trained["dev_bpb"] != pytest.approx(exact_bpb, rel=1e-3)
    assert main(["eval", *work, "--run", str(annealed), "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(trained["dev_bpb"], rel=1e-5)
    warm = tmp_path / "warm"
    assert main(["train", *work, "--run", str(warm), "--init", "explicit", *small, "--steps", "2",
                 "--explicit-pieces", "bias", "--holdout-tokens", "200", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["solve_seconds"] > 0


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_a_residual_run_keeps_checkpoints_by_words_seen(tiny_workdir, tmp_path, capsys):
    """A residual run counts the exact run's statistics pass as one pass over the data (the
    milestones it covers are kept at step 0, where the model is the exact model) and keeps the
    trained part at each later milestone; ``eval --words`` / ``--step`` read them back with the
    explicit tables of the exact run."""
    from saffu.cli import main
    from saffu.training.checkpoints import words_index
    exact_run, metrics = tmp_path / "exact", tmp_path / "m.json"
    work = ["--workdir", str(tiny_workdir.path), "--quiet"]
    assert main(["exact", *work, "--run", str(exact_run), "--groups", "0 1 0,1", "--buckets", "3",
                 "--holdout-tokens", "200", "--metrics-json", str(metrics)]) == 0
    exact_bpb = json.loads(metrics.read_text())["dev_bpb"]
    run = tmp_path / "residual"
    assert main(["train", *work, "--run", str(run), "--init", "random", "--residual", str(exact_run),
                 "--model", "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2",
                 "--context", "4", "--max-len", "64", "--batch-size", "2", "--seq-len", "16", "--steps", "24",
                 "--eval-tokens", "0", "--words-unit", "200", "--learning-rate", "0.03"]) == 0
    words = tiny_workdir.meta["splits"][tiny_workdir.train_split]["words"]
    kept = words_index(run)
    assert json.loads((run / "words.json").read_text())["words_before"] == words
    first, later = [m for m in kept if m["step"] == 0], [m for m in kept if m["step"] > 0]
    assert [m["words"] for m in first] == [200 * k for k in range(1, words // 200 + 1)] and later

    def dev_bpb(*which):
        assert main(["eval", *work, "--run", str(run), *which, "--metrics-json", str(metrics)]) == 0
        return json.loads(metrics.read_text())["dev_bpb"]

    assert dev_bpb("--words", first[-1]["label"]) == pytest.approx(exact_bpb, rel=1e-5)   # step 0: the exact model
    at_words = dev_bpb("--words", later[0]["label"])
    assert at_words != pytest.approx(exact_bpb, rel=1e-4)
    assert dev_bpb("--step", str(later[0]["step"])) == at_words
    capsys.readouterr()
    assert main(["eval", *work, "--run", str(run), "--step", "3", "--words", "1k"]) != 0
    assert "not both" in capsys.readouterr().err
