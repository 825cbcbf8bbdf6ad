"""The budget sweep (experiments/budgets.py), run as a program (tests import only saffu) in a
copy of the project whose results/ starts empty, so no earlier session's rows join in, on run
folders written by hand."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of experiments/ beside an empty results/ (and docs/results/ for the plot)."""
    shutil.copytree(ROOT / "experiments", tmp_path / "experiments", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "results").mkdir()
    (tmp_path / "docs" / "results").mkdir(parents=True)
    return tmp_path


def budgets(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "experiments/budgets.py", *args], cwd=project, capture_output=True,
                          text=True)


def result(project: Path, folder: str, **fields) -> None:
    """A finished run under ``runs/budgets/runs``: a run of the runner (``spec.json``, the
    figures of ``saffu train``, its metrics and config) named ``START_eE_wW_sS_lrR``."""
    run = project / "runs" / "budgets" / "runs" / folder
    run.mkdir(parents=True)
    epochs = fields.get("epochs") or 1
    history = [{"step": 0, "flops": 0.0, "seconds": 0.0, "train_loss": 9.0, "dev_loss": 9.0},
               {"step": 100 * epochs, "flops": 1e12 * epochs, "seconds": 100.0 * epochs, "train_loss": 4.0,
                "dev_loss": 2.2 * fields["dev_bpb"]}]
    figures = {"params": 10, "solve_seconds": 0.0, "dev_loss": 4.0, "flops": history[-1]["flops"], **fields}
    (run / "spec.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": {"vocab_size": 8192}, "workdir": "runs/babylm"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    (run / "result.json").write_text(json.dumps(figures))


def report(project: Path) -> list[dict]:
    done = budgets(project, "--out", "runs/budgets", "--report")
    assert done.returncode == 0, done.stderr
    return json.loads((project / "results" / "budgets.json").read_text())["figures"]["rows"]


@pytest.mark.parametrize("spec", ["cold:1:128", "cold:1:128:0:-0.01", "warm:1:128:0", "cold:1:128:0:0.01:9"])
def test_a_bad_run_spec_is_one_usage_error(project, spec):
    done = budgets(project, "--workdir", "nowhere", "--runs", spec)
    assert done.returncode == 2 and spec in done.stderr and "Traceback" not in done.stderr


def test_the_plan_lists_the_sweep_and_which_runs_are_finished(project):
    result(project, "cold_e1_w128_s0_lr0.01", dev_bpb=1.5)
    done = budgets(project, "--out", "runs/budgets", "--plan")
    assert done.returncode == 0, done.stderr
    plan, extra = done.stdout.split("beyond the issue's sweep")
    runs = [line.split() for line in plan.splitlines() if "epochs" in line]
    # the sweep: four starts at 1 / 2 / 4 epochs, three at width 256 for 1 / 2, a second seed at 4
    assert len(runs) == 12 + 6 + 2
    assert sorted(r[0] for r in runs if r[4] == "256") == sorted(["cold", "explicit-init", "residual-crossfit"] * 2)
    assert sorted(r[0] for r in runs if r[6] == "1") == ["cold", "explicit-init"]
    assert "cold  1 epochs  width 128  seed 0  lr 0.01: dev 1.5000 bits/byte" in plan
    assert "explicit-init  4 epochs  width 128  seed 0  lr 0.01: to run" in plan
    assert "llama-explicit  1 epochs  width 128  seed 0  lr 0.01: to run\n" in extra


@pytest.mark.slow   # three small trainings and an exact solve through the runner: about a minute
def test_the_sweeps_runs_train_through_the_runner_and_report(project, tiny_workdir):
    # width 16 and --quick's one block on short windows: the sweep's specs on the tiny corpus
    exact = [sys.executable, "-m", "saffu", "exact", "--workdir", str(tiny_workdir.path), "--run", "runs/exact",
             "--groups", "0 0,1", "--buckets", "--holdout-tokens", "64", "--quiet"]
    assert subprocess.run(exact, cwd=project, capture_output=True).returncode == 0
    done = budgets(project, "--workdir", str(tiny_workdir.path), "--out", "runs/budgets", "--runs", "cold:1:16:0",
                   "explicit-init:1:16:0", "residual-crossfit:1:16:0", "llama-explicit:1:16:0", "--exact-run",
                   "runs/exact", "--quick", "--report", "--no-write")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = project / "runs" / "budgets" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["cold_e1_w16_s0_lr0.01", "explicit-init_e1_w16_s0_lr0.01",
                                                       "llama-explicit_e1_w16_s0_lr0.01",
                                                       "residual-crossfit_e1_w16_s0_lr0.003"]
    spec = json.loads((runs / "residual-crossfit_e1_w16_s0_lr0.003" / "spec.json").read_text())
    assert spec["options"] == {"residual_scale": "fixed", "cross_fit": 2, "holdout_tokens": 256}
    assert (spec["model"]["width"], spec["model"]["layers"], spec["train"]["seq_len"]) == (16, 1, 32)
    assert spec["start"]["residual"] == str(project / "runs" / "exact")
    llama = json.loads((runs / "llama-explicit_e1_w16_s0_lr0.01" / "spec.json").read_text())   # penzai's, any_model's start
    assert (llama["model"]["kind"], llama["model"]["family"], llama["start"]["explicit_pieces"]) == (
        "penzai", "llama", ["embeddings", "output"])
    printed = [line.split() for line in done.stdout.splitlines() if line.startswith("V 280 width 16 1 epochs")]
    assert [line[6] for line in printed] == ["cold", "explicit-init", "residual-crossfit", "llama-explicit"]


def test_an_explicit_start_is_measured_against_its_cold_curve_with_seeds_averaged(project):
    result(project, "cold_e1_w128_s0_lr0.01", dev_bpb=2.0)
    result(project, "cold_e4_w128_s0_lr0.01", epochs=4, dev_bpb=1.8)
    result(project, "cold_e4_w128_s1_lr0.01", epochs=4, dev_bpb=1.7)
    result(project, "explicit-init_e1_w128_s0_lr0.01", dev_bpb=1.8)
    rows = report(project)
    explicit = next(r for r in rows if r["start"] == "explicit-init")
    # cold's 4-epoch point is the mean of its two seeds (4e12, 1.75): 1.8 lies 0.2 / 0.25 of the way
    # from 1 epoch (1e12, 2.0) to it in log compute
    assert explicit["multiplier_is"] == "interpolated"
    assert explicit["cold_compute_to_match"] == pytest.approx(math.exp(math.log(1e12) + 0.8 * math.log(4)))
    assert explicit["multiplier_text"] == f"{explicit['cold_compute_to_match'] / 1e12:.2f}×"
    assert (project / "docs" / "results" / "budgets.png").exists()


def test_another_architectures_explicit_start_is_measured_against_its_own_random_init(project):
    # the project's transformer: a cold start far better than the Llama-like one's random init
    result(project, "cold_e1_w128_s0_lr0.01", dev_bpb=1.5)
    result(project, "cold_e2_w128_s0_lr0.01", epochs=2, dev_bpb=1.45)
    result(project, "llama-random_e1_w128_s0_lr0.01", dev_bpb=2.0)
    result(project, "llama-random_e2_w128_s0_lr0.01", epochs=2, dev_bpb=1.8)
    result(project, "llama-explicit_e1_w128_s0_lr0.01", dev_bpb=1.9)
    # not the sweep's: any_model.py's run of a fixed number of steps, an init variant it does not run
    result(project, "llama-explicit_n30_w128_s0_lr0.01", dev_bpb=1.0)
    result(project, "llama-explicit-rms0_e1_w128_s0_lr0.01", dev_bpb=1.0)
    rows = report(project)
    assert sorted((r["start"], r["epochs"]) for r in rows) == [
        ("cold", 1), ("cold", 2), ("llama-explicit", 1), ("llama-random", 1), ("llama-random", 2)]
    explicit = next(r for r in rows if r["start"] == "llama-explicit")
    # halfway in bits per byte between random's 1- and 2-epoch runs: the geometric mean of their compute,
    # not "before" cold's curve (the project's transformer, which is better than 1.9 at every budget)
    assert (explicit["multiplier_is"], explicit["cold_start"]) == ("interpolated", "llama-random")
    assert explicit["cold_compute_to_match"] == pytest.approx(math.sqrt(1e12 * 2e12))
    assert explicit["reproduce"].endswith("--runs llama-explicit:1:128:0")
    # its steps to the final loss of the random init of the same budget (2.2 × 2.0 = 4.4 nats)
    assert explicit["share_of_steps_to_cold"] == pytest.approx((9.0 - 4.4) / (9.0 - 2.2 * 1.9))


def test_a_cross_fitted_residual_is_its_own_start_per_number_of_folds(project):
    result(project, "cold_e1_w128_s0_lr0.01", dev_bpb=1.9)
    result(project, "residual_e1_w128_s0_lr0.003", dev_bpb=1.79)
    for start, bpb in (("residual-crossfit", 1.788), ("residual-crossfit-k4", 1.785), ("residual-crossfit-k3", 1.5)):
        result(project, f"{start}_e1_w128_s0_lr0.003", dev_bpb=bpb)     # K = 3 is no start of the sweep: left out
    rows = report(project)
    assert [(r["start"], r["folds"], r["dev_bpb"]) for r in rows] == [
        ("cold", 0, 1.9), ("residual", 0, 1.79), ("residual-crossfit", 2, 1.788), ("residual-crossfit-k4", 4, 1.785)]
    assert rows[-1]["reproduce"].endswith("--runs residual-crossfit-k4:1:128:0")
    assert all(r["multiplier_is"] == "beyond" for r in rows[1:])      # each against the cold curve
