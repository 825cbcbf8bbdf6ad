import json
import subprocess
import sys

import numpy as np
import pytest

from saffu import BigramConfig, CipherConfig, TrainConfig, bigram_nll, fit_explicit_bigram, pair_counts, random_bigram, train
from saffu.cli import main
from saffu.engine.explicit import unigram_prior


def test_bigram_nll_matches_float64_reference(tiny_workdir):
    model, report = fit_explicit_bigram(tiny_workdir, BigramConfig(cipher=CipherConfig(bits=16)),
                                        progress=False)
    dev = np.asarray(tiny_workdir.tokens("dev"), np.int64)
    logits = np.asarray(model["codes"], np.float64)[dev[:-1]] @ np.asarray(model["weights"], np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    reference = -log_probs[np.arange(len(dev) - 1), dev[1:]].sum()
    got = bigram_nll(model, pair_counts(dev, vocab_size=tiny_workdir.vocab_size))
    assert got == pytest.approx(reference, rel=1e-5)          # float32 model vs float64 reference
    assert 0.05 <= report["beta"] <= 4.0


def test_explicit_bigram_beats_unigram_and_adam_improves_random_init(tiny_workdir, tmp_path):
    vocab_size = tiny_workdir.vocab_size
    dev = pair_counts(tiny_workdir.tokens("dev"), vocab_size=vocab_size)
    tokens = dev[2].sum()
    model, _ = fit_explicit_bigram(tiny_workdir, BigramConfig(cipher=CipherConfig(bits=16)), progress=False)
    unigram = -(dev[2] * np.log(unigram_prior(tiny_workdir.token_counts()))[dev[1]]).sum() / tokens
    explicit = bigram_nll(model, dev) / tokens
    assert explicit < unigram - 0.5
    import jax
    layer = BigramConfig(cipher=CipherConfig(bits=16), vocab_size=vocab_size)
    cold = random_bigram(layer, vocab_size, jax.random.key(0))
    trained, history = train(layer, cold, tiny_workdir.tokens("train_10M"),
                             TrainConfig(steps=30, batch_size=4, seq_len=16, learning_rate=0.05, eval_every=10,
                                         warmup_steps=5),
                             tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert [h["step"] for h in history] == [0, 10, 20, 30]
    assert bigram_nll(trained, dev) / tokens < bigram_nll(cold, dev) / tokens - 0.5
    assert history[-1]["dev_loss"] < history[0]["dev_loss"] - 0.5
    # the codes are inputs, never trained; only the weights move
    np.testing.assert_array_equal(np.asarray(trained["codes"]), np.asarray(cold["codes"]))
    assert not np.allclose(np.asarray(trained["weights"]), np.asarray(cold["weights"]))


def test_cli_prepare_and_stats_write_metrics(tmp_path, tiny_corpus_dir, capsys):
    work, prep, stats = tmp_path / "w", tmp_path / "p.json", tmp_path / "m.json"
    assert main(["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(work), "--vocab-size", "280",
                 "--quiet", "--metrics-json", str(prep)]) == 0
    assert json.loads(prep.read_text())["dev_bytes"] > 0
    assert main(["stats", "--workdir", str(work), "--model", "bigram", "--bits", "16", "--radius", "3",
                 "--quiet", "--metrics-json", str(stats)]) == 0
    metrics = json.loads(stats.read_text())
    for key in ("dev_loss", "dev_bpb", "dev_ppl", "dev_word_ppl", "seconds", "beta"):
        assert np.isfinite(metrics[key])
    assert np.exp(metrics["dev_loss"]) == pytest.approx(metrics["dev_ppl"])
    saved = np.load(work / "statistics.npz")
    assert saved["offset_cooccurrence"].shape == (3, 17, metrics["vocab_size"])
    assert "dev_loss" in capsys.readouterr().out


def test_metrics_json_to_unwritable_path_is_one_line(tmp_path, tiny_workdir, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["stats", "--workdir", str(tiny_workdir.path), "--model", "unigram", "--quiet",
                 "--metrics-json", str(blocker / "m.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error: cannot write") and "\n" not in err


@pytest.mark.parametrize("command", ["prepare", "stats", "download", "demo", "fit", "train", "eval", "generate", "blimp"])
def test_every_command_has_help(command):
    out = subprocess.run([sys.executable, "-m", "saffu", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--metrics-json" in out.stdout


def test_demo_runs_end_to_end_on_the_embedded_corpus(tmp_path):
    metrics_path = tmp_path / "demo.json"
    assert main(["demo", "--workdir", str(tmp_path / "demo"), "--steps", "5", "--quiet",
                 "--metrics-json", str(metrics_path)]) == 0
    metrics = json.loads(metrics_path.read_text())
    assert metrics["explicit_dev_bpb"] < metrics["bigram_dev_bpb"] and np.isfinite(metrics["warm_dev_bpb"])
