"""What a newcomer meets first: fast help with defaults, outputs checked before the work,
clear one-line messages, figures formatted for people, files others can read."""

import json
import os
import stat
import subprocess
import sys

import pytest

from saffu import configs
from saffu._io import atomic_write_json
from saffu.cli import build_parser, human, main


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_and_help_load_no_jax():
    # the package and the parser import no array library: `saffu --help` answers at once
    loaded = _python("import sys, saffu, saffu.cli; saffu.cli.build_parser(); "
                     "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'numpy') if m in sys.modules))")
    assert loaded == "[]"
    # a name from the package still loads its module on first use
    assert _python("import saffu; print(saffu.open_workdir.__module__)") == "saffu.data.workdir"


def test_cli_defaults_are_the_configs_defaults():
    parse = lambda *argv: vars(build_parser().parse_args(argv))
    fit = parse("fit", "--workdir", "w", "--run", "r")
    stats = parse("stats", "--workdir", "w")
    train = parse("train", "--workdir", "w", "--run", "r", "--init", "random")
    solver, bigram, trainer = configs.SolverConfig(), configs.BigramConfig(), configs.TrainConfig()
    assert (fit["mu"], fit["holdout_tokens"], fit["chunk_size"]) == (
        solver.smoothing.mu, solver.holdout_tokens, solver.chunk_size)
    assert (stats["mu"], stats["holdout_tokens"], stats["chunk_size"]) == (
        bigram.smoothing.mu, bigram.holdout_tokens, bigram.chunk_size)
    for flag in ("steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "eval_every",
                 "checkpoint_every", "adam_eps", "on_nonfinite", "log_every", "compute_dtype"):
        assert train[flag] == getattr(trainer, flag), flag
    assert train["layers"] == configs.TransformerConfig.layers and train["radius"] == configs.SaffuConfig.radius


@pytest.mark.parametrize("command, shown", [("fit", "(default: 3000.0)"), ("stats", "(default: 100.0)"),
                                            ("train", "(default: 0.003)")])
def test_help_shows_defaults_and_says_what_mu_belongs_to(command, shown):
    out = subprocess.run([sys.executable, "-m", "saffu", command, "--help"], capture_output=True, text=True).stdout
    assert shown in " ".join(out.split())
    if command != "train":
        assert "Dirichlet prior strength of" in out


@pytest.mark.parametrize("command", ["eval", "generate", "blimp"])
def test_every_command_has_a_description(command):
    out = subprocess.run([sys.executable, "-m", "saffu", command, "--help"], capture_output=True, text=True).stdout
    _, _, rest = out.partition("\n\n")
    assert rest.split("\n")[0].strip() and not rest.startswith("options:")


def test_metrics_json_is_checked_before_the_work(tmp_path, tiny_workdir, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--workdir", str(tiny_workdir.path), "--run", str(run), "--bits", "16", "--radius", "4",
                 "--quiet", "--metrics-json", str(tmp_path)]) == 2          # a directory, not a file
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error: cannot write --metrics-json") and "\n" not in err
    assert not run.exists()                                                 # nothing was solved or written
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(blocker), "--init", "random",
                 "--quiet"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_figures_are_formatted_for_people(capsys):
    assert human(447882832528.0) == "4.479e+11"
    assert human(1428424) == "1,428,424"
    assert human(5.34) == "5.3400" and human(9123.44) == "9,123.4" and human("explicit") == "explicit"
    from saffu.cli import _print_metrics
    _print_metrics("title", {"a": 1, "a_much_longer_key": 2.5})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].index("1") == lines[2].index("2.5000")                  # one aligned value column


def test_written_files_follow_the_umask(tmp_path, monkeypatch):
    import saffu._io
    old = os.umask(0o027)
    try:
        assert saffu._io._umask() == 0o027 and os.umask(old) == 0o027      # read without changing it
    finally:
        os.umask(old)
    # not the owner-only 0600 of a temporary file: what the umask gives any new file
    assert 0o666 & ~old == saffu._io.FILE_MODE
    atomic_write_json(tmp_path / "config.json", {"a": 1})
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == 0o666 & ~old
    monkeypatch.setattr(saffu._io, "FILE_MODE", 0o644)
    atomic_write_json(tmp_path / "shared.json", {"a": 1})
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o644


def test_a_binary_corpus_warns_and_strict_refuses(tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(128, 256)) * 200 + b"\nsome text\n" * 50)
    args = ["prepare", "--train-files", str(binary), "--workdir", str(tmp_path / "w"), "--vocab-size", "259",
            "--allow-smaller-vocab", "--quiet"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "saffu: warning:" in err and "invalid UTF-8" in err and "split 'train'" in err
    assert main(args + ["--strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error:") and str(binary) in err and "\n" not in err


def test_text_files_errors_name_the_files_not_a_babylm_split(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["prepare", "--train-files", str(empty), "--workdir", str(tmp_path / "w"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "train_10M" not in err and str(empty) in err


def test_training_says_it_resumes_and_how_to_resume(tmp_path, tiny_workdir, capsys):
    run = tmp_path / "run"
    common = ["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", "--bits", "16",
              "--radius", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--checkpoint-every", "2",
              "--eval-tokens", "50"]
    assert main(common + ["--steps", "2"]) == 0
    assert "resuming" not in capsys.readouterr().out
    assert main(common + ["--steps", "4", "--metrics-json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "step 2 of 4" in out
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["steps"] == 4
    # tokens/s of the resumed call: its own 2 steps over its own seconds (not the run's cumulative seconds)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at_resume = next(r["seconds"] for r in records if r["step"] == 2)
    assert metrics["tokens_per_s"] == pytest.approx(2 * 2 * 16 / (metrics["train_seconds"] - at_resume), rel=1e-6)
    assert main(common + ["--steps", "4"]) == 0                             # finished: says so, trains nothing
    assert "already finished" in capsys.readouterr().out


def test_an_interrupted_training_says_rerun_resumes(tmp_path, tiny_workdir, capsys, monkeypatch):
    import saffu.training.trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(saffu.training.trainer, "train", interrupted)
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(tmp_path / "run"), "--init", "random",
                 "--bits", "16", "--radius", "4", "--quiet"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: interrupted; rerun the same command to resume") and "\n" not in err


def test_eval_names_the_weights_it_loaded(tmp_path, tiny_workdir, capsys):
    run = tmp_path / "run"
    base = ["--workdir", str(tiny_workdir.path), "--run", str(run)]
    assert main(["train", *base, "--init", "random", "--bits", "16", "--radius", "4", "--steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--quiet"]) == 0
    assert main(["eval", *base, "--eval-tokens", "0", "--metrics-json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: checkpoint" not in out
    assert json.loads((tmp_path / "e.json").read_text())["weights"] == "checkpoint step 2"


def test_a_clone_folder_named_saffu_does_not_shadow_the_package(tmp_path):
    # `make` installs in editable_mode=compat: the checkout is on sys.path, so a script run from
    # the parent of a clone called `saffu` (a namespace-package candidate) still finds the package
    (tmp_path / "saffu" / "tests").mkdir(parents=True)
    script = tmp_path / "script.py"
    script.write_text("import saffu\nprint(saffu.babylm_corpus.__module__)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "saffu.data.corpus", done.stderr[-300:]
