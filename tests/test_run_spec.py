"""A run holds its spec (``RUN/train.json``): ``saffu train --config`` reproduces the run from
it, flags given override it, and resuming with settings that change what the run learns is
refused in one line."""

import json

import pytest

from saffu.cli import main

SMALL = ["--model", "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
         "--max-len", "24", "--batch-size", "2", "--seq-len", "8", "--eval-tokens", "0", "--quiet"]


def _losses(run):
    return [json.loads(line)["train_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()][1:]


@pytest.mark.slow     # three short trainings through the CLI
def test_a_spec_reproduces_its_run_and_guards_its_resume(tiny_workdir, tmp_path, capsys):
    work = ["--workdir", str(tiny_workdir.path)]
    first = tmp_path / "first"
    assert main(["train", *work, "--run", str(first), "--init", "random", *SMALL, "--steps", "4", "--eval-every", "2",
                 "--learning-rate", "0.02", "--weight-decay", "0.1", "--seed", "3"]) == 0
    spec = json.loads((first / "train.json").read_text())
    assert spec["train"]["learning_rate"] == 0.02 and spec["model"]["width"] == 16 and spec["start"]["init"] == "random"
    again = tmp_path / "again"
    assert main(["train", *work, "--config", str(first / "train.json"), "--run", str(again), "--quiet"]) == 0
    assert _losses(again) == _losses(first)                  # the same losses, bit for bit
    other = tmp_path / "other"                                 # a flag given overrides the spec
    assert main(["train", *work, "--config", str(first / "train.json"), "--run", str(other), "--learning-rate", "0.002",
                 "--quiet"]) == 0
    assert json.loads((other / "train.json").read_text())["train"]["learning_rate"] == 0.002
    assert _losses(other)[-1] != _losses(first)[-1]
    capsys.readouterr()
    assert main(["train", *work, "--config", str(first / "train.json"), "--run", str(first), "--learning-rate",
                 "0.003", "--steps", "6"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "train.learning_rate 0.02 → 0.003" in error
    assert main(["train", *work, "--config", str(first / "train.json"), "--run", str(first), "--steps", "6",
                 "--quiet"]) == 0                              # more steps: a resume
    assert json.loads((first / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6


def test_a_bad_spec_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 0.01\nclip_norm = 2.0\n")
    assert main(["train", "--workdir", "w", "--run", "r", "--config", str(bad)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "clip_norm" in error and "no flag" in error
    bad.write_text("[optimiser]\nlr = 1\n")
    assert main(["train", "--workdir", "w", "--run", "r", "--config", str(bad)]) == 2
    assert "unknown sections" in capsys.readouterr().err
