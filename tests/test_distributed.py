"""Multi-process statistics with jax.distributed (2 real local processes, CPU collectives)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from saffu.data.tokenizer import EOD_ID
from saffu.engine.distributed import document_shard


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_document_shards_cover_the_range_once_and_cut_at_documents(tiny_workdir):
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    for n in (1, 2, 3, 7):
        ranges = [document_shard(stream, i, n, 1, len(stream)) for i in range(n)]
        assert ranges[0][0] == 1 and ranges[-1][1] == len(stream)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))               # no gaps, no overlap
        assert all(stream[lo - 1] == EOD_ID for lo, hi in ranges if lo < hi)       # whole documents


def run_two_processes(argv: list[str], tmp_path) -> None:
    """``saffu *argv`` as a 2-process jax.distributed job on this machine (metrics to multi{i}.json)."""
    coordinator = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen([sys.executable, "-m", "saffu", *argv, "--num-processes", "2", "--process-id",
                                   str(i), "--coordinator", coordinator,
                                   "--metrics-json", str(tmp_path / f"multi{i}.json")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    for process in processes:
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err.decode()[-2000:]


@pytest.mark.slow
def test_two_processes_give_bit_identical_statistics(tiny_workdir, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    shutil.copytree(tiny_workdir.path, single)
    shutil.copytree(tiny_workdir.path, multi)
    stats = ["stats", "--model", "bigram", "--bits", "16", "--radius", "3", "--holdout-tokens", "200",
             "--save-statistics", "--quiet"]
    subprocess.run([sys.executable, "-m", "saffu", *stats, "--workdir", str(single),
                    "--metrics-json", str(tmp_path / "single.json")], check=True, capture_output=True)
    run_two_processes([*stats, "--workdir", str(multi)], tmp_path)
    a, b = np.load(single / "statistics.npz"), np.load(multi / "statistics.npz")
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])                             # bit-identical
    single_metrics = json.loads((tmp_path / "single.json").read_text())
    multi_metrics = json.loads((tmp_path / "multi0.json").read_text())
    assert not (tmp_path / "multi1.json").exists()                                   # process 0 writes
    assert multi_metrics["dev_loss"] == single_metrics["dev_loss"]                   # same explicit model
    assert multi_metrics["beta"] == single_metrics["beta"]


@pytest.mark.slow   # two jax.distributed processes and a full exact solve: about 15 s
def test_two_processes_give_a_bit_identical_exact_model(tiny_workdir, tmp_path):
    import jax

    from saffu.training.checkpoints import load_explicit, load_run_config
    exact = ["exact", "--workdir", str(tiny_workdir.path), "--groups", "0 1 0,1", "--buckets", "3", "10",
             "--holdout-tokens", "200", "--eval-tokens", "0", "--quiet"]
    subprocess.run([sys.executable, "-m", "saffu", *exact, "--run", str(tmp_path / "single"),
                    "--metrics-json", str(tmp_path / "single.json")], check=True, capture_output=True)
    run_two_processes([*exact, "--run", str(tmp_path / "multi")], tmp_path)
    config = load_run_config(tmp_path / "single")
    assert load_run_config(tmp_path / "multi") == config
    a, b = load_explicit(tmp_path / "single", config), load_explicit(tmp_path / "multi", config)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))                   # bit-identical tables, β
    single_metrics = json.loads((tmp_path / "single.json").read_text())
    multi_metrics = json.loads((tmp_path / "multi0.json").read_text())
    assert not (tmp_path / "multi1.json").exists()                                   # process 0 writes
    timing = lambda key: key.startswith("seconds") or key.endswith("peak_mb") or key == "peak_rss_mb"
    assert set(multi_metrics) == set(single_metrics)
    assert {k: v for k, v in multi_metrics.items() if not timing(k)} == \
        {k: v for k, v in single_metrics.items() if not timing(k)}                    # counts, losses, β exactly


def test_data_parallel_training_follows_the_unsharded_trajectory(tiny_workdir, tmp_path):
    import jax

    from saffu.models.saffu import SaffuConfig, init_params
    from saffu.training.trainer import TrainConfig, data_parallel_mesh, train
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=4)
    settings = TrainConfig(steps=6, batch_size=4, seq_len=16, eval_every=2, seed=2)
    runs = {}
    for devices in (1, 4):
        runs[devices] = train(config, init_params(config, jax.random.key(2)), tiny_workdir.tokens("train_10M"),
                              settings, tmp_path / f"d{devices}", dev_stream=tiny_workdir.tokens("dev"),
                              progress=False, mesh=data_parallel_mesh(devices))
    (p1, h1), (p4, h4) = runs[1], runs[4]
    np.testing.assert_allclose([r["train_loss"] for r in h1[1:]], [r["train_loss"] for r in h4[1:]], rtol=1e-5)
    np.testing.assert_allclose([r["dev_loss"] for r in h1], [r["dev_loss"] for r in h4], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)   # float32 reduction order


@pytest.mark.slow   # two local jax.distributed trainings and their resumes: about a minute
def test_two_processes_train_like_one_and_resume(tiny_workdir, tmp_path):
    import jax

    from saffu.training.checkpoints import load_params, load_run_config
    train = ["train", "--workdir", str(tiny_workdir.path), "--init", "random", "--model", "transformer",
             "--block", "gpt", "--output-bias", "--width", "16", "--layers", "1", "--heads", "2", "--context", "4",
             "--seq-len", "16", "--batch-size", "4", "--eval-every", "2", "--eval-tokens", "0", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one device per process, as on a CPU
    saffu = lambda *argv: subprocess.run([sys.executable, "-m", "saffu", *train, *argv], capture_output=True,
                                         text=True, timeout=300, env=env)
    for steps in (4, 6):       # 4 steps, then resumed to 6 from the checkpoint at step 4
        one = saffu("--steps", str(steps), "--run", str(tmp_path / "one"))
        two = saffu("--steps", str(steps), "--run", str(tmp_path / "two"), "--num-processes", "2",
                    "--metrics-json", str(tmp_path / "two.json"))   # process 0 starts process 1 itself
        # the job's first error comes first (a crash's stack dumps follow it)
        assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[:4000]
        assert "saffu: warning" not in two.stderr                           # process 1 ended cleanly
    lines = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines("two")] == [r["step"] for r in lines("one")] == [0, 2, 4, 6]   # written once
    np.testing.assert_allclose([r["dev_loss"] for r in lines("two")], [r["dev_loss"] for r in lines("one")], rtol=1e-5)
    np.testing.assert_allclose([r["train_loss"] for r in lines("two")[1:]], [r["train_loss"] for r in lines("one")[1:]],
                               rtol=1e-5)
    assert json.loads((tmp_path / "two.json").read_text())["steps"] == 6
    assert not (tmp_path / "two" / "checkpoints" / "6.orbax-checkpoint-tmp").exists()
    config = load_run_config(tmp_path / "one")      # a one-process run reads the job's checkpoint too
    a, b = load_params(tmp_path / "one", config)[0], load_params(tmp_path / "two", config)[0]
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if "key" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            continue     # its gradient is 0 (softmax ignores a shift shared by all keys): Adam moves it by float noise
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)   # float32 reduction order


def test_a_process_of_a_job_needs_its_coordinator(tiny_workdir, tmp_path):
    from saffu.cli import main
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(tmp_path / "r"), "--init", "random",
                 "--num-processes", "2", "--process-id", "1", "--quiet"]) == 2
