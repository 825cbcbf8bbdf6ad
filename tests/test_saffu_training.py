import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from saffu.cli import main
from saffu.data.windows import evenly_spaced_windows
from saffu.eval.scoring import evaluate_split, generate
from saffu.models.interface import window_loss
from saffu.models.saffu import Saffu, SaffuConfig, cipher_table, init_params
from saffu.solve.stack import SolverConfig, solve_explicit
from saffu.training.checkpoints import load_explicit, load_params, save_explicit
from saffu.training.trainer import TrainConfig, train


def tiny_config(workdir, **overrides):
    return SaffuConfig(vocab_size=workdir.vocab_size, bits=16, radius=4, **overrides)


@pytest.mark.parametrize("overrides", [dict(heads=2, positions=2), dict(hidden=17), dict(blocks=2, positions=1)],
                         ids=["direct", "chain", "stacked"])
def test_explicit_parameters_have_the_model_structure(tiny_workdir, overrides):
    config = tiny_config(tiny_workdir, **overrides)
    params, report = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=200), progress=False)
    abstract = jax.eval_shape(lambda: Saffu(config, rngs=nnx.Rngs(0)).params())
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)))
    # the codes are an input, never solved: the cipher table itself
    np.testing.assert_array_equal(np.asarray(params["codes"]), np.asarray(cipher_table(config)))
    # the solution predicts: its dev loss and its top block's loss on the held-out training tail
    # are far below the uniform ln V = 5.63 (here 1.75 / 3.18 / 3.06 and 1.31 / 3.08 / 2.96)
    uniform = np.log(config.vocab_size)
    assert evaluate_split(params, config, tiny_workdir, "dev", progress=False)["dev_loss"] < uniform - 2
    assert report["seconds"] > 0 and report[f"block{config.blocks - 1}_holdout_loss"] < uniform - 2


@pytest.mark.slow
def test_explicit_then_warm_steps_then_eval_and_generate(tiny_workdir, tmp_path):
    config = tiny_config(tiny_workdir)
    params, _ = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=200), progress=False)
    explicit = evaluate_split(params, config, tiny_workdir, "dev", progress=False)
    prior = (tiny_workdir.token_counts() + 1) / (tiny_workdir.token_counts().sum() + config.vocab_size)
    unigram_dev = -np.log(prior[np.asarray(tiny_workdir.tokens("dev"))[1:]]).mean()
    assert explicit["dev_loss"] < unigram_dev - 1.0                    # the context is used (here 1.75 vs 3.20)
    trained, history = train(config, params, tiny_workdir.tokens("train_10M"),
                             TrainConfig(steps=2, batch_size=4, seq_len=32, eval_every=1, learning_rate=1e-3),
                             tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert [h["step"] for h in history] == [0, 1, 2]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    # a warm start starts exactly at the explicit solution: step 0 is its loss on the dev windows
    windows, mask = evenly_spaced_windows(tiny_workdir.tokens("dev"), config, 32, TrainConfig().eval_windows)
    nll, count = window_loss(params, config, windows, mask)
    assert history[0]["dev_loss"] == pytest.approx(float(nll) / float(count), rel=1e-5)
    warm = evaluate_split(trained, config, tiny_workdir, "dev", progress=False)
    assert abs(warm["dev_loss"] - explicit["dev_loss"]) < 0.05         # two small steps keep the solution
    texts = generate(trained, config, tiny_workdir.tokenizer(), jax.random.key(0), num_samples=2, max_tokens=20)
    assert len(texts) == 2 and all("\n" not in t for t in texts)


def test_checkpoint_round_trip_and_exact_resume(tiny_workdir, tmp_path):
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(1))
    stream = tiny_workdir.tokens("train_10M")
    settings = TrainConfig(steps=6, batch_size=2, seq_len=16, eval_every=3, checkpoint_every=3, seed=5)
    straight, _ = train(config, params, stream, settings, tmp_path / "a", progress=False)
    resumed_dir = tmp_path / "b"
    train(config, params, stream, settings, resumed_dir, progress=False)
    shutil.rmtree(resumed_dir / "checkpoints" / "6")                    # as if killed after step 3
    resumed, history = train(config, params, stream, settings, resumed_dir, progress=False)
    assert history == []                                                # no dev stream, no evals
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))     # bit-identical on CPU
    loaded, which = load_params(resumed_dir, config)
    assert which == "checkpoint step 6"
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_explicit(tmp_path / "c", params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(load_explicit(tmp_path / "c", config))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_interrupted_before_its_first_checkpoint_starts_its_metrics_over(tiny_workdir, tmp_path):
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(1))
    settings = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=1, checkpoint_every=0)
    run = tmp_path / "run"
    train(config, params, tiny_workdir.tokens("train_10M"), settings, run, dev_stream=tiny_workdir.tokens("dev"),
          progress=False)
    first = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints")                                  # as if killed before its one checkpoint
    _, history = train(config, params, tiny_workdir.tokens("train_10M"), settings, run,
                       dev_stream=tiny_workdir.tokens("dev"), progress=False)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [h["step"] for h in history] == [0, 1, 2]
    assert [json.loads(line)["dev_loss"] for line in lines] == [json.loads(line)["dev_loss"]
                                                                 for line in first.splitlines()]


def test_frozen_parameters_wait_for_the_thaw_step(tiny_workdir, tmp_path):
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(2))
    stream = tiny_workdir.tokens("train_10M")
    frozen, _ = train(config, params, stream, TrainConfig(steps=2, batch_size=2, seq_len=16, freeze=("attention_0",),
                                                          thaw_step=5), tmp_path / "f", progress=False)
    np.testing.assert_array_equal(frozen["blocks"][0]["attention_0"], params["blocks"][0]["attention_0"])
    assert not np.array_equal(frozen["blocks"][0]["group_weights"], params["blocks"][0]["group_weights"])


def test_cli_fit_train_eval_generate(tiny_workdir, tmp_path, capsys):
    run, work = tmp_path / "run", str(tiny_workdir.path)
    common = ["--workdir", work, "--run", str(run), "--quiet"]
    assert main(["fit", *common, "--bits", "16", "--radius", "4", "--holdout-tokens", "200",
                 "--metrics-json", str(tmp_path / "fit.json")]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    config = tiny_config(tiny_workdir)
    assert fit["params"] == sum(x.size for x in jax.tree.leaves(init_params(config, jax.random.key(0))))
    # bits per byte from the dev loss, the dev targets (every token after the leading <eod>) and
    # the dev split's UTF-8 bytes (one newline per document), counted here from the corpus
    dev_bytes = sum(len(line.encode()) + 1 for line in __import__("conftest").TINY_DEV)
    predicted = len(tiny_workdir.tokens("dev")) - 1
    assert fit["dev_bpb"] == pytest.approx(fit["dev_loss"] * predicted / (np.log(2) * dev_bytes), rel=1e-9)
    assert fit["dev_loss"] < np.log(config.vocab_size) - 2              # here 1.75 against ln V = 5.63
    assert main(["train", *common, "--init", "explicit", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--metrics-json", str(tmp_path / "train.json")]) == 0
    assert json.loads((tmp_path / "train.json").read_text())["steps"] == 2
    assert main(["eval", *common, "--metrics-json", str(tmp_path / "eval.json")]) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["weights"] == "checkpoint step 2"
    assert main(["generate", *common, "--num-samples", "2", "--max-tokens", "10",
                 "--metrics-json", str(tmp_path / "gen.json")]) == 0
    assert json.loads((tmp_path / "gen.json").read_text())["samples"] == 2
    capsys.readouterr()
    assert main(["eval", "--workdir", work, "--run", str(tmp_path / "nothing"), "--quiet"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_run_from_another_work_directory_is_one_line(tiny_workdir, tmp_path, capsys):
    from saffu import PrepareConfig, prepare, text_files_corpus
    other_text = tmp_path / "other.txt"
    other_text.write_text("completely different words here\n" * 50)
    other = prepare(text_files_corpus({"train_10M": [other_text], "dev": [other_text]}), tmp_path / "other",
                    PrepareConfig(vocab_size=270, allow_smaller_vocab=True), show_progress=False)
    run = tmp_path / "run"
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", "--bits", "16",
                 "--radius", "2", "--steps", "1", "--batch-size", "1", "--seq-len", "8", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", "--workdir", str(other.path), "--run", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer" in err and "\n" not in err


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_steps_are_never_applied_nor_checkpointed(tiny_workdir, tmp_path, policy):
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(4))
    settings = TrainConfig(steps=6, batch_size=2, seq_len=16, learning_rate=1e38, warmup_steps=2,
                           checkpoint_every=1, eval_every=1, on_nonfinite=policy)
    run = tmp_path / policy
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="not applied"):
            train(config, params, tiny_workdir.tokens("train_10M"), settings, run,
                  dev_stream=tiny_workdir.tokens("dev"), progress=False)
    else:
        final, history = train(config, params, tiny_workdir.tokens("train_10M"), settings, run,
                               dev_stream=tiny_workdir.tokens("dev"), progress=False)
        assert history[-1]["skipped_steps"] > 0
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final))
        # the fixed codes are untouched, the blocks took the applied steps (here ~5e37: finite)
        np.testing.assert_array_equal(np.asarray(final["codes"]), np.asarray(params["codes"]))
        assert not np.array_equal(np.asarray(final["blocks"][0]["group_weights"]),
                                  np.asarray(params["blocks"][0]["group_weights"]))
    saved, _ = load_params(run, config)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved))
    if policy == "skip":      # the last checkpoint holds the last applied step's weights, bit for bit
        for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_radius_longer_than_every_document_is_one_line(tiny_workdir, tmp_path, capsys):
    longest = tiny_workdir.split_info("train_10M")["longest_document"]
    assert longest == max(len(tiny_workdir.tokenizer().encode(line).ids)
                          for line in __import__("conftest").TINY_TRAIN)
    for command in (["fit"], ["train", "--init", "random"]):
        assert main([*command, "--workdir", str(tiny_workdir.path), "--run", str(tmp_path / command[0]),
                     "--bits", "16", "--radius", str(longest + 5), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert "longer than every document" in err and f"--radius {longest + 1}" in err and "\n" not in err
        assert not (tmp_path / command[0]).exists()                  # nothing half-made


def test_asynchronous_loss_reads_change_nothing_but_when_the_host_looks(tiny_workdir, tmp_path):
    """The step donates its inputs and the host reads the loss every ``log_every`` steps: the
    trained weights and the recorded losses do not depend on ``log_every``, and the caller's
    parameters survive (they are copied, never donated)."""
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(5))
    before = jax.tree.map(np.asarray, params)
    results = []
    for log_every in (1, 4):
        settings = TrainConfig(steps=8, batch_size=2, seq_len=16, learning_rate=0.01, warmup_steps=2,
                               eval_every=8, checkpoint_every=8, log_every=log_every)
        results.append(train(config, params, tiny_workdir.tokens("train_10M"), settings, tmp_path / str(log_every),
                             dev_stream=tiny_workdir.tokens("dev"), progress=False))
    (a, history_a), (b, history_b) = results
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for key in ("train_loss", "dev_loss"):
        assert history_a[-1][key] == pytest.approx(history_b[-1][key], rel=1e-6)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_bfloat16_compute_trains_close_to_float32(tiny_workdir, tmp_path):
    """bf16 forward/backward with float32 master weights: a different computation (the weights
    differ) that learns about as well (tolerance: 0.05 nats/token of dev loss after 20 steps)."""
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(6))
    out = {}
    for dtype in ("float32", "bfloat16"):
        settings = TrainConfig(steps=20, batch_size=2, seq_len=16, learning_rate=0.03, warmup_steps=2,
                               eval_every=20, checkpoint_every=20, compute_dtype=dtype)
        out[dtype] = train(config, params, tiny_workdir.tokens("train_10M"), settings, tmp_path / dtype,
                           dev_stream=tiny_workdir.tokens("dev"), progress=False)
    (f32, h32), (bf16, h16) = out["float32"], out["bfloat16"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16))               # master weights stay f32
    assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(f32),
                                                                                 jax.tree.leaves(bf16)))
    assert h16[-1]["dev_loss"] < h16[0]["dev_loss"] - 0.1
    assert h16[-1]["dev_loss"] == pytest.approx(h32[-1]["dev_loss"], abs=0.05)


def test_frozen_parameters_gather_no_adam_moments_and_start_afresh_at_the_thaw():
    from saffu.training.trainer import make_optimizer
    config = TrainConfig(freeze=("attention_0",), thaw_step=3, learning_rate=0.1, warmup_steps=0, weight_decay=0.0,
                         clip_norm=1e9)
    optimizer = make_optimizer(config, steps=10)
    params = {"w": jnp.ones(3), "attention_0": jnp.ones(2)}
    state = optimizer.init(params)
    grads = [{"w": jnp.full(3, 0.5 * (t + 1)), "attention_0": jnp.full(2, (-1.0) ** t * (t + 1))} for t in range(5)]
    fresh = optax.scale_by_adam(eps=config.adam_eps)           # what the thawed parameter must follow
    fresh_state = fresh.init(params["attention_0"])
    lr = optax.warmup_cosine_decay_schedule(0.0, 0.1, 0, 10)
    for t, g in enumerate(grads):
        updates, state = optimizer.update(g, state, params)
        moments = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                   if "attention_0" in jax.tree_util.keystr(path)]
        if t < 3:             # frozen: no update, and its moments stay at zero
            np.testing.assert_array_equal(updates["attention_0"], 0.0)
            assert moments and all(float(jnp.abs(m).max()) == 0.0 for m in moments)
        else:                 # thawed: Adam from scratch on the gradients since the thaw, the global schedule
            step_update, fresh_state = fresh.update(g["attention_0"], fresh_state)
            np.testing.assert_allclose(updates["attention_0"], -lr(t) * step_update, rtol=1e-6)
        assert float(jnp.abs(updates["w"]).max()) > 0                # the free parameters train throughout


def test_a_run_past_its_thaw_moves_the_frozen_parameters_only_after_it(tiny_workdir, tmp_path):
    config = tiny_config(tiny_workdir)
    params = init_params(config, jax.random.key(2))
    stream = tiny_workdir.tokens("train_10M")
    settings = TrainConfig(steps=8, batch_size=2, seq_len=16, freeze=("attention_0",), thaw_step=4,
                           checkpoint_every=4)
    final, _ = train(config, params, stream, settings, tmp_path / "f", progress=False)
    at_thaw, _ = train(config, params, stream, dataclasses.replace(settings, steps=4), tmp_path / "g", progress=False)
    np.testing.assert_array_equal(at_thaw["blocks"][0]["attention_0"], params["blocks"][0]["attention_0"])
    assert not np.allclose(final["blocks"][0]["attention_0"], params["blocks"][0]["attention_0"])
