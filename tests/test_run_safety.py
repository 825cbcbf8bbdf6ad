"""Runs you can trust (docs/reliability.md): pinned inputs, one writer per run directory,
outputs probed before the work, a full disk as one line, a killed solve."""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from saffu.cli import main

SMALL_TRANSFORMER = ["--model", "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2",
                     "--context", "4", "--max-len", "64", "--batch-size", "2", "--seq-len", "16", "--quiet"]
SMALL_SAFFU = ["--bits", "16", "--radius", "4", "--batch-size", "2", "--seq-len", "16", "--quiet"]


def one_line(capsys) -> str:
    """The error output of the last command: exactly one ``saffu: error:`` line."""
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def leftovers(folder: Path) -> list[str]:
    """Temporary files or folders anything left under ``folder``."""
    return [str(p) for p in folder.rglob("*") if "tmp" in p.name and p.name != "tmp"]


def exact_command(workdir, run, groups="0 1 0,1"):
    return ["exact", "--workdir", str(workdir.path), "--run", str(run), "--groups", groups, "--buckets", "3",
            "--holdout-tokens", "200", "--eval-tokens", "100", "--quiet"]


def residual_runs(workdir, tmp_path, *runs) -> tuple[Path, Path, float]:
    """An exact run ``tmp_path/exact`` and a 2-step residual run over it per ``(run, extra
    flags)``; returns the exact run, the metrics file and the last run's dev bits per byte."""
    exact, metrics = tmp_path / "exact", tmp_path / "m.json"
    assert main(exact_command(workdir, exact)) == 0
    for run, extra in runs:
        assert main(["train", "--workdir", str(workdir.path), "--run", str(run), "--init", "random", "--residual",
                     str(exact), *extra, *SMALL_TRANSFORMER, "--steps", "2", "--eval-tokens", "100",
                     "--metrics-json", str(metrics)]) == 0
    return exact, metrics, json.loads(metrics.read_text())["dev_bpb"]


@pytest.fixture(scope="module")
def other_tokenizer_workdir(tmp_path_factory):
    """The tiny corpus in capitals: a tokenizer of the same size as the tiny one's, but another."""
    from saffu import PrepareConfig, prepare, text_files_corpus
    from tests.conftest import TINY_DEV, TINY_TRAIN
    root = tmp_path_factory.mktemp("capitals")
    (root / "train.txt").write_text("\n".join(TINY_TRAIN).upper() + "\n")
    (root / "dev.txt").write_text("\n".join(TINY_DEV).upper() + "\n")
    return prepare(text_files_corpus({"train_10M": [root / "train.txt"], "dev": [root / "dev.txt"]}), root / "work",
                   PrepareConfig(vocab_size=280), show_progress=False)


# --- pinned inputs ---------------------------------------------------------------------------

def test_a_run_refuses_another_tokenizer_of_the_same_size(tiny_workdir, other_tokenizer_workdir, tmp_path, capsys):
    assert other_tokenizer_workdir.vocab_size == tiny_workdir.vocab_size
    assert other_tokenizer_workdir.fingerprint["tokenizer"] != tiny_workdir.fingerprint["tokenizer"]
    run = tmp_path / "run"
    train = ["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", *SMALL_SAFFU,
             "--steps", "2", "--eval-tokens", "100"]
    assert main(train) == 0
    recorded = json.loads((run / "config.json").read_text())["workdir_fingerprint"]
    assert recorded == tiny_workdir.fingerprint
    capsys.readouterr()
    other = ["--workdir", str(other_tokenizer_workdir.path), "--run", str(run), "--quiet"]
    for command in (["eval", *other], ["generate", *other, "--num-samples", "1", "--max-tokens", "3"],
                    ["inspect", *other, "--windows", "2"],
                    ["train", *other, "--init", "random", *SMALL_SAFFU, "--steps", "4"]):
        assert main(command) == 2, command
        err = one_line(capsys)
        assert (tiny_workdir.fingerprint["tokenizer"] in err and other_tokenizer_workdir.fingerprint["tokenizer"] in err
                and "use the work directory the run was made from" in err)
    assert not (run / "attention.json").exists()


def test_other_streams_with_the_same_tokenizer_score_but_do_not_resume(tiny_workdir, tmp_path, capsys):
    from saffu.data.workdir import subset_workdir
    part = subset_workdir(tiny_workdir, tmp_path / "part", train_fraction=0.5)
    assert part.fingerprint["tokenizer"] == tiny_workdir.fingerprint["tokenizer"]
    assert part.fingerprint["streams"] != tiny_workdir.fingerprint["streams"]
    run = tmp_path / "run"
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", *SMALL_SAFFU,
                 "--steps", "2", "--eval-tokens", "100"]) == 0
    assert main(["eval", "--workdir", str(part.path), "--run", str(run), "--quiet", "--eval-tokens", "100"]) == 0
    capsys.readouterr()
    assert main(["train", "--workdir", str(part.path), "--run", str(run), "--init", "random", *SMALL_SAFFU,
                 "--steps", "4"]) == 2
    assert "streams" in one_line(capsys)


@pytest.mark.slow   # two exact solves, two residual trainings and their scores through the CLI: about 20 s
def test_a_residual_run_refuses_its_exact_run_solved_again_unless_packed(tiny_workdir, tmp_path, capsys):
    work = ["--workdir", str(tiny_workdir.path)]
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    exact, metrics, before = residual_runs(tiny_workdir, tmp_path, (plain, []), (packed, ["--bundle"]))
    # the plain run points at the exact run relative to itself; the packed one holds a copy
    assert json.loads((plain / "config.json").read_text())["model"]["explicit_run"] == "../exact"
    assert json.loads((packed / "config.json").read_text())["model"]["explicit_run"] == "exact"
    assert main(exact_command(tiny_workdir, exact, groups="0 0,1")) == 0           # solved again, other groups
    capsys.readouterr()
    for command in ("eval", "blimp"):
        extra = ["--blimp", str(tmp_path)] if command == "blimp" else []
        assert main([command, *work, "--run", str(plain), "--quiet", *extra]) == 2
        err = one_line(capsys)
        assert "solved again" in err and err.count("fingerprint") == 1 and "saffu pack" in err
    assert main(["train", *work, "--run", str(plain), "--init", "random", *SMALL_TRANSFORMER, "--steps", "4"]) == 2
    one_line(capsys)
    moved = tmp_path / "elsewhere" / "packed"                     # a packed run survives moving
    moved.parent.mkdir()
    shutil.move(packed, moved)
    assert main(["eval", *work, "--run", str(moved), "--quiet", "--eval-tokens", "100",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == before
    assert main(["pack", "--run", str(plain), "--quiet"]) == 2                      # packing checks the tables too
    assert "solved again" in one_line(capsys)


@pytest.mark.slow   # an exact solve, a residual training and two scores through the CLI: about 15 s
def test_pack_makes_a_plain_residual_run_movable(tiny_workdir, tmp_path, capsys):
    work = ["--workdir", str(tiny_workdir.path)]
    run = tmp_path / "run"
    exact, metrics, before = residual_runs(tiny_workdir, tmp_path, (run, []))
    assert main(["pack", "--run", str(run), "--quiet"]) == 0
    shutil.rmtree(exact)
    assert main(["eval", *work, "--run", str(run), "--quiet", "--eval-tokens", "100",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == before
    assert main(["pack", "--run", str(run), "--quiet"]) == 0                         # packing twice is a no-op
    capsys.readouterr()
    assert main(["pack", "--run", str(exact.parent / "run" / "exact"), "--quiet"]) == 2
    assert "only residual runs" in one_line(capsys)


def test_tables_that_do_not_match_their_config_are_refused(tiny_workdir, tmp_path, capsys):
    """A solve killed between committing new tables and writing their config.json leaves no
    config (so no run); tables under another solve's config are refused."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(exact_command(tiny_workdir, first)) == 0
    assert main(exact_command(tiny_workdir, second, groups="0 0,1")) == 0
    shutil.rmtree(first / "explicit")
    shutil.copytree(second / "explicit", first / "explicit")
    capsys.readouterr()
    assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(first), "--quiet"]) == 2
    assert "interrupted solve" in one_line(capsys)


# --- outputs probed before the work ------------------------------------------------------------

def test_unwritable_outputs_are_refused_before_any_work_also_as_root(tiny_workdir, tmp_path, capsys, monkeypatch):
    import saffu.solve.stack
    monkeypatch.setattr(saffu.solve.stack, "solve_explicit", lambda *a, **k: pytest.fail("solved before the check"))
    work = ["--workdir", str(tiny_workdir.path)]
    assert main(["fit", *work, "--run", str(tmp_path / "run"), *SMALL_SAFFU[:4], "--quiet",
                 "--metrics-json", "/proc/saffu-test/m.json"]) == 2
    assert "cannot write --metrics-json /proc/saffu-test/m.json" in one_line(capsys)
    assert not (tmp_path / "run").exists()
    for command in (["fit", *work, *SMALL_SAFFU[:4]], ["train", *work, "--init", "random", *SMALL_SAFFU]):
        assert main([*command, "--run", "/proc/saffu-test/run", "--quiet"]) == 2
        assert "cannot write --run /proc/saffu-test/run" in one_line(capsys)
    assert main(["ngram", *work, "--arpa", "/proc/saffu-test/lm.arpa", "--quiet"]) == 2
    assert "--arpa" in one_line(capsys)
    assert not Path("/proc/saffu-test").exists()


# --- one writer per run directory ----------------------------------------------------------------

def hold_lock(directory: Path, what: str = "a test holder") -> subprocess.Popen:
    """A process holding ``directory``'s write lock until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from saffu._io import exclusive
        with exclusive({str(directory)!r}, {what!r}):
            print("held", flush=True)
            time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.mark.parametrize("command", ["prepare", "stats", "fit", "exact", "factorise", "train", "ngram", "pack"])
def test_a_second_writer_is_one_line_naming_the_holder(command, tiny_workdir, tiny_corpus_dir, tmp_path, capsys):
    work = ["--workdir", str(tiny_workdir.path)]
    run = tmp_path / "run"
    argv, locked = {
        "prepare": (["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(tmp_path / "w")], tmp_path / "w"),
        "stats": (["stats", *work, "--save-statistics"], tiny_workdir.path),
        "fit": (["fit", *work, "--run", str(run)], run),
        "exact": (["exact", *work, "--run", str(run)], run),
        "factorise": (["factorise", *work, "--run", str(run)], run),
        "train": (["train", *work, "--run", str(run), "--init", "random", *SMALL_SAFFU], run),
        "ngram": (["ngram", *work, "--arpa", str(tmp_path / "lm.arpa")], tmp_path),
        "pack": (["pack", "--run", str(run)], run),
    }[command]
    holder = hold_lock(locked)
    try:
        assert main([*argv, "--quiet"]) == 2
        err = one_line(capsys)
        assert f"is in use by process {holder.pid} (a test holder)" in err
    finally:
        holder.send_signal(signal.SIGKILL)          # a killed holder's lock never blocks
        holder.wait()
    from saffu._io import exclusive
    with exclusive(locked, "the test"):
        assert f"process {os.getpid()} (the test)" in (Path(locked) / ".saffu.lock").read_text()


@pytest.mark.slow   # two training subprocesses at once: about 30 s
def test_two_concurrent_trainings_of_one_run(tiny_workdir, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "saffu", "train", "--workdir", str(tiny_workdir.path), "--run", str(run),
               "--init", "random", *SMALL_SAFFU, "--steps", "300", "--checkpoint-every", "10", "--eval-every", "20",
               "--eval-tokens", "100"]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "10").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)
    second = subprocess.run(command, capture_output=True, text=True)
    assert first.wait() == 0, first.stderr.read()
    assert second.returncode == 2
    assert second.stderr.strip().count("\n") == 0 and f"in use by process {first.pid}" in second.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 301, 20))                                   # one run's lines, in order
    assert not leftovers(run)


def test_a_reader_of_a_run_in_training_reads_its_last_committed_checkpoint(tiny_workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", *SMALL_SAFFU,
                 "--steps", "4", "--checkpoint-every", "2", "--eval-tokens", "100"]) == 0
    partial = run / "checkpoints" / "6.orbax-checkpoint-tmp-1234567"    # a save in progress
    partial.mkdir()
    (partial / "_CHECKPOINT_METADATA").write_text("{")
    metrics = tmp_path / "m.json"
    assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet", "--eval-tokens", "100",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["weights"] == "checkpoint step 4"
    assert partial.exists()                                             # a reader removes nothing


# --- a full disk -------------------------------------------------------------------------------

@contextlib.contextmanager
def small_disk(path: Path, size: str = "4m"):
    """A small tmpfs at ``path`` (the tests run as root here and in CI), else ``None``."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` up to ``leave`` bytes free; returns the filler file (delete it: space is back)."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(free - leave, 0))
    return filler


@pytest.mark.parametrize("command", ["prepare", "exact", "fit", "train"])
def test_a_full_disk_is_one_line_before_the_work(command, tiny_workdir, tiny_corpus_dir, tmp_path, capsys,
                                                 monkeypatch):
    import saffu._io
    with small_disk(tmp_path / "disk") as disk:
        if disk is None:                      # no mount here: the free space is what the check is told
            disk = tmp_path / "disk"
            monkeypatch.setattr(saffu._io, "free_bytes", lambda path: 8192)
        else:
            fill(disk, 8192)
        work = ["--workdir", str(tiny_workdir.path)]
        argv = {"prepare": ["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(disk / "w"),
                            "--vocab-size", "280"],
                "exact": exact_command(tiny_workdir, disk / "run"),
                "fit": ["fit", *work, "--run", str(disk / "run"), *SMALL_SAFFU[:4]],
                "train": ["train", *work, "--run", str(disk / "run"), "--init", "random", *SMALL_SAFFU,
                          "--steps", "2"]}[command]
        assert main([*argv, "--quiet"]) == 2
        err = one_line(capsys)
        assert "the disk is full" in err or "are free" in err
        assert "MB" in err and not leftovers(disk)
        assert not (disk / "run" / "config.json").exists() or command == "train"
        assert not (disk / "w" / "meta.json").exists() and not list(disk.glob("run/checkpoints/[0-9]*"))


def failing_writes(monkeypatch, target: str, when=lambda *args: True):
    """Make orbax's ``target`` save (``"explicit"`` or ``"checkpoint"``) fail like a full disk:
    it leaves a partial temporary folder, then raises orbax's error."""
    import orbax.checkpoint as ocp
    cls, method = (ocp.StandardCheckpointer, "save") if target == "explicit" else (ocp.CheckpointManager, "save")
    real = getattr(cls, method)

    def save(self, first, *args, **kwargs):
        if not when(first):
            return real(self, first, *args, **kwargs)
        folder = Path(first).parent if target == "explicit" else Path(self.directory)
        name = (Path(first).name if target == "explicit" else str(first)) + ".orbax-checkpoint-tmp-99"
        (folder / name / "d").mkdir(parents=True)
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing in OCDBT database at local file "{folder / name}": '
                         f"No space left on device [os_error_code='28']")
    monkeypatch.setattr(cls, method, save)


def test_a_solve_whose_save_fails_is_one_line_and_leaves_nothing(tiny_workdir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(exact_command(tiny_workdir, run)) == 0                      # an earlier solve
    with monkeypatch.context() as patch:
        failing_writes(patch, "explicit")
        assert main(exact_command(tiny_workdir, run, groups="0 0,1")) == 2
    err = one_line(capsys)
    assert "cannot write" in err and "the disk is full" in err and "MB" in err
    assert not leftovers(run) and not (run / "config.json").exists()        # no config beside old tables
    assert main(exact_command(tiny_workdir, run, groups="0 0,1")) == 0       # space is back: it saves


def test_a_checkpoint_that_does_not_fit_then_resumes_bit_identical(tiny_workdir, tmp_path, capsys, monkeypatch):
    from saffu.training.checkpoints import load_params, load_run_config
    train = lambda run: ["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random",
                         *SMALL_SAFFU, "--steps", "8", "--checkpoint-every", "2", "--eval-every", "2",
                         "--eval-tokens", "100"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(train(straight)) == 0
    with monkeypatch.context() as patch:
        failing_writes(patch, "checkpoint", when=lambda step: step == 6)
        assert main(train(run)) == 2
    err = one_line(capsys)
    assert "checkpoints/6" in err and "resumes from its checkpoint at step 4" in err
    assert not leftovers(run) and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    assert main(train(run)) == 0                                            # space is back
    config = load_run_config(run)
    for x, y in zip(jax.tree.leaves(load_params(straight, config)[0]), jax.tree.leaves(load_params(run, config)[0])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4, 6, 8]


def test_metrics_that_do_not_fit_are_one_line(tiny_workdir, tmp_path, capsys, monkeypatch):
    import builtins
    real_open = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        if str(file).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", full_open)
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(tmp_path / "run"), "--init", "random",
                 *SMALL_SAFFU, "--steps", "2"]) == 2
    assert "metrics.jsonl: the disk is full" in one_line(capsys)


def test_an_interactive_solve_asks_where_to_save_instead_of_losing_it(tiny_workdir, tmp_path, capsys, monkeypatch):
    import saffu.cli
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    answers = iter([str(elsewhere)])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    with monkeypatch.context() as patch:
        failing_writes(patch, "explicit", when=lambda path: str(run) in str(path))
        assert saffu.cli.main([*exact_command(tiny_workdir, run), "--metrics-json", str(tmp_path / "m.json")]) == 0
    assert (elsewhere / "config.json").exists() and not (run / "config.json").exists() and not leftovers(tmp_path)
    assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(elsewhere), "--quiet",
                 "--eval-tokens", "100"]) == 0


# --- a killed solve ------------------------------------------------------------------------------

KILL_DURING = {
    # orbax has written part of the temporary folder when the process dies
    "save": textwrap.dedent("""
        import orbax.checkpoint as ocp
        def save(self, path, *args, **kwargs):
            partial = Path(str(path) + ".orbax-checkpoint-tmp-1234") / "ocdbt.process_0"
            partial.mkdir(parents=True)
            (partial / "manifest.ocdbt").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
        ocp.StandardCheckpointer.save = save
    """),
    # the tables are committed, their config.json not yet
    "config": textwrap.dedent("""
        import saffu.training.checkpoints as checkpoints
        checkpoints.save_run_config = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    """),
}


@pytest.mark.slow   # two solver subprocesses per case: about 60 s in all
@pytest.mark.parametrize("solver", ["exact", "fit", "factorise"])
def test_sigkill_during_a_solvers_save_then_the_same_command_succeeds(solver, tiny_workdir, tmp_path):
    run = tmp_path / "run"
    argv = {"exact": exact_command(tiny_workdir, run),
            "fit": ["fit", "--workdir", str(tiny_workdir.path), "--run", str(run), *SMALL_SAFFU[:4], "--quiet"],
            "factorise": ["factorise", "--workdir", str(tiny_workdir.path), "--run", str(run), "--rank", "8",
                          "--positions", "2", "--holdout-tokens", "200", "--quiet"]}[solver]
    assert main(argv) == 0                                          # an earlier solve in the run
    for moment, patch in KILL_DURING.items():
        code = "import os, signal, sys\nfrom pathlib import Path\n" + patch + \
               f"\nfrom saffu.cli import main\nsys.exit(main({argv!r}))\n"
        killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        # no later command reads a half-written solution: the run is refused until solved again
        assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet"]) == 2, moment
        again = subprocess.run([sys.executable, "-m", "saffu", *argv], capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert not leftovers(run), moment
        assert main(["eval", "--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet",
                     "--eval-tokens", "100"]) == 0
