"""The tuning protocol's report (experiments/tune.py), run as a program (tests import only saffu)
in a copy of the project: run folders stay on the machine that made them, so a report on a fresh
clone reads the runs ``results/tuning.json`` records, and a run folder made here joins them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "results" / "tuning.json"


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of experiments/ beside a copy of results/tuning.json, and no run folders."""
    shutil.copytree(ROOT / "experiments", tmp_path / "experiments", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "results").mkdir()
    (tmp_path / "docs" / "results").mkdir(parents=True)
    shutil.copy(RECORD, tmp_path / "results" / "tuning.json")
    return tmp_path


def report(project: Path) -> dict:
    done = subprocess.run([sys.executable, "experiments/tune.py", "--workdir", "runs/babylm", "--out", "runs/tune",
                           "--report", "--epochs", "1", "2", "4", "8"], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((project / "results" / "tuning.json").read_text())["figures"]


def test_a_fresh_clone_reports_the_recorded_runs_unchanged(project):
    before = json.loads(RECORD.read_text())["figures"]
    after = report(project)
    assert after["starts"] == before["starts"] and after["architectures"] == before["architectures"]
    assert after["race"] == before["race"]


def test_a_run_made_here_joins_the_recorded_ones(project):
    """A finished run folder of a budget (its ``result.json`` and metrics) is read from the
    folder and enters its start's budget beside the recorded runs: the record, less the best
    four-epoch cold run, and that run's folder here give the same budget with the folder's figure."""
    record = json.loads(RECORD.read_text())
    budget = record["figures"]["starts"]["llama-cold-nobias"]["budgets"]["4"]
    best = min(budget["runs"], key=lambda r: r["dev_bpb"])
    budget["runs"].remove(best)
    (project / "results" / "tuning.json").write_text(json.dumps(record))
    run = project / "runs" / "tune" / "runs" / best["name"]
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"dev_bpb": 1.5, "dev_loss": 3.9, "steps": best["steps"],
                                                 "flops": best["flops"], "dev_whole_split": True}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": best["steps"], "seconds": 2000.0, "train_loss": 3.8,
                                                   "dev_loss": 3.95}) + "\n")
    after = report(project)["starts"]["llama-cold-nobias"]["budgets"]["4"]
    runs = {r["name"]: r for r in after["runs"]}
    assert runs[best["name"]]["dev_bpb"] == 1.5 and len(runs) == len(budget["runs"]) + 1
    assert after["chosen"]["learning_rate"] == best["learning_rate"]
    race = json.loads((project / "results" / "tuning.json").read_text())["figures"]["race"]
    four = next(r for r in race["llama-explicit-nobias"] if r["epochs"] == 4)
    assert 1.5 in [bpb for _, bpb in four["cold_curve"]]
