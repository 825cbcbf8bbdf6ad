"""Reliability guarantees (docs/reliability.md): interrupted runs, determinism, damaged
checkpoints, fuzzed inputs."""

import json
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from saffu import accumulate_states, local_mesh, offset_cooccurrence, sparse_bit_cipher, unigram_counts
from saffu.cli import main
from saffu.models.saffu import SaffuConfig, init_params
from saffu.solve.stack import SolverConfig, solve_explicit
from saffu.training.checkpoints import load_params
from saffu.training.trainer import TrainConfig, train


def train_command(workdir, run, steps):
    return [sys.executable, "-m", "saffu", "train", "--workdir", str(workdir.path), "--run", str(run),
            "--init", "random", "--bits", "16", "--radius", "4", "--steps", str(steps), "--batch-size", "2",
            "--seq-len", "16", "--checkpoint-every", "10", "--eval-every", "10000", "--eval-tokens", "200",
            "--seed", "3", "--quiet"]


@pytest.mark.slow   # three training subprocesses, one killed: about 30 s
def test_sigkill_mid_training_then_restart_ends_bit_identical(tiny_workdir, tmp_path):
    steps = 600
    straight = tmp_path / "straight"
    subprocess.run(train_command(tiny_workdir, straight, steps), check=True, capture_output=True)
    killed = tmp_path / "killed"
    process = subprocess.Popen(train_command(tiny_workdir, killed, steps), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "20").exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.kill()                                                      # SIGKILL: no clean-up runs
    process.wait()
    steps_on_disk = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert steps_on_disk and steps_on_disk[-1] < steps, "the run finished before it could be killed"
    subprocess.run(train_command(tiny_workdir, killed, steps), check=True, capture_output=True)
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=4)
    (a, which_a), (b, which_b) = load_params(straight, config), load_params(killed, config)
    assert which_a == which_b == f"checkpoint step {steps}"
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_same_seed_same_statistics_weights_and_curve(tiny_workdir, tmp_path):
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=4)
    first, _ = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=200), progress=False)
    second, _ = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=200), progress=False)
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    settings_ = TrainConfig(steps=8, batch_size=2, seq_len=16, eval_every=2, seed=11)
    runs = [train(config, init_params(config, jax.random.key(11)), tiny_workdir.tokens("train_10M"), settings_,
                  tmp_path / f"r{i}", dev_stream=tiny_workdir.tokens("dev"), progress=False) for i in range(2)]
    strip = lambda h: [{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_s", "peak_rss_mb")} for r in h]
    assert strip(runs[0][1]) == strip(runs[1][1])
    stream = tiny_workdir.tokens("train_10M")
    acc = {"u": unigram_counts(config.vocab_size),
           "o": offset_cooccurrence(sparse_bit_cipher(config.vocab_size, 16), config.vocab_size, 4)}
    by_devices = [accumulate_states(stream, acc, mesh=local_mesh(d), chunk_size=64, progress=None) for d in (1, 2, 4)]
    for other in by_devices[1:]:
        for name in acc:
            np.testing.assert_array_equal(by_devices[0][name], other[name])


def test_damaged_checkpoint_is_one_line_for_eval_and_resume(tiny_workdir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet"]
    assert main(["train", *args, "--init", "random", "--bits", "16", "--radius", "4", "--steps", "4",
                 "--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "2"]) == 0
    latest = run / "checkpoints" / "4"
    biggest = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])      # truncated
    capsys.readouterr()
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error:") and "\n" not in err and "checkpoint" in err
    assert main(["train", *args, "--init", "random", "--steps", "6", "--batch-size", "2", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot resume" in err and "\n" not in err


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"),
                    max_size=80))
@example(text="<eod>")          # the special tokens' names in a text are that text
@example(text="a<pad>b <eod>")
def test_tokenizer_round_trip_on_random_text(tiny_workdir, text):
    tokenizer = tiny_workdir.tokenizer()
    ids = tokenizer.encode(text).ids
    assert all(2 <= i < tiny_workdir.vocab_size for i in ids)              # never <pad> or <eod>
    assert tokenizer.decode(ids) == text


@settings(max_examples=25, deadline=None)
@given(documents=st.lists(st.lists(st.integers(2, 29), max_size=12), min_size=1, max_size=20),
       chunk=st.integers(3, 50))
@pytest.mark.slow
def test_accumulators_on_random_documents(documents, chunk):
    stream = [1]
    for doc in documents:
        stream += doc + [1]
    stream = np.asarray(stream, np.uint16)
    acc = {"u": unigram_counts(30), "o": offset_cooccurrence(sparse_bit_cipher(30, 5), 30, 3)}
    states = accumulate_states(stream, acc, chunk_size=chunk, progress=None)
    np.testing.assert_array_equal(states["u"], np.bincount(stream[1:], minlength=30))
    F = acc["o"].finalize(states["o"])
    np.testing.assert_allclose(F.sum(axis=(1, 2)), len(stream) - 1, rtol=1e-12)   # every target counted once
    assert (F >= 0).all()


def test_statistics_rerun_is_a_clean_restart(tiny_workdir, tmp_path):
    """A statistics pass keeps its sums in memory and writes statistics.npz by temp file +
    rename, so an interrupted pass leaves the old file (or none) and a rerun never
    double-counts."""
    import shutil
    work = tmp_path / "work"
    shutil.copytree(tiny_workdir.path, work)
    args = ["stats", "--workdir", str(work), "--model", "unigram", "--radius", "3", "--bits", "16", "--quiet"]
    assert main(args) == 0
    first = dict(np.load(work / "statistics.npz"))
    assert main(args) == 0
    second = dict(np.load(work / "statistics.npz"))
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert first["unigram"].sum() == len(tiny_workdir.tokens("train_10M")) - 1
    assert not list(work.glob(".*.tmp"))                                    # no temp files left behind


def test_resuming_with_another_model_shape_is_refused(tiny_workdir, tmp_path):
    from saffu import SaffuError
    stream = tiny_workdir.tokens("train_10M")
    small = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=4)
    train(small, init_params(small, jax.random.key(0)), stream, TrainConfig(steps=2, batch_size=2, seq_len=16),
          tmp_path / "run", progress=False)
    other = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=3)
    with pytest.raises(SaffuError, match="another model"):
        train(other, init_params(other, jax.random.key(0)), stream, TrainConfig(steps=4, batch_size=2, seq_len=16),
              tmp_path / "run", progress=False)


@pytest.mark.slow
def test_device_check_passes_against_itself_and_names_a_count_that_differs(tmp_path, tiny_workdir, capsys):
    """``saffu device-check`` on this backend against a reference made by the same check passes
    every item (counts bit for bit, losses within tolerance); a reference whose offset counts differ
    fails that item, exits 2 and names it."""
    sizes = ["--workdir", str(tiny_workdir.path), "--steps", "2", "--batch-size", "2", "--seq-len", "8",
             "--eval-windows", "2", "--bits", "16", "--radius", "2", "--chunk-sizes", "16", "64",
             "--repeats", "1", "--holdout-tokens", "32", "--solve-chunk-size", "64", "--quiet"]
    assert main(["device-check", *sizes, "--out", str(tmp_path / "ref")]) == 0
    reference = tmp_path / "ref" / "device_check.json"
    assert main(["device-check", *sizes, "--out", str(tmp_path / "same"), "--reference", str(reference),
                 "--metrics-json", str(tmp_path / "same.json")]) == 0
    same = json.loads((tmp_path / "same.json").read_text())
    assert same["pass"] and same["reference_pass"] and same["counts_identical"]
    assert same["reference_offsets_counts"] and same["reference_float32_dev_loss"]
    record = json.loads(reference.read_text())
    record["statistics"]["offsets_sha256"] = "0" * 64
    reference.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["device-check", *sizes, "--out", str(tmp_path / "other"), "--reference", str(reference),
                 "--metrics-json", str(tmp_path / "other.json")]) == 2
    other = json.loads((tmp_path / "other.json").read_text())
    assert not other["pass"] and other["failed"] == "offsets_counts"
    assert "FAIL  offsets_counts" in capsys.readouterr().out
