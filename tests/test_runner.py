"""Runs as values (saffu.runner): grids of specs, a sweep that skips what has finished and
refuses a folder of another spec, rows gathered back, and ``saffu sweep``."""

import json
import os
from pathlib import Path

import pytest

from saffu._io import SaffuError
from saffu.cli import main
from saffu.runner import flatten, gather, grid, read_grid, spec_hash, sweep, with_value

ROOT = Path(__file__).resolve().parents[1]

TINY = {"start": {"init": "random", "model": "transformer"},
        "model": {"width": 16, "layers": 1, "heads": 2, "context_tokens": 4, "max_len": 24},
        "train": {"steps": 3, "batch_size": 2, "seq_len": 8, "eval_every": 3}, "eval": {"eval_tokens": 0}}


def test_a_grid_is_every_combination_named_by_its_values():
    specs = grid({"train": {"steps": 10}}, {"train.learning_rate": [0.003, 0.01], "model.block": ["gpt", "llama"]})
    assert list(specs) == ["learning_rate=0.003,block=gpt", "learning_rate=0.003,block=llama",
                           "learning_rate=0.01,block=gpt", "learning_rate=0.01,block=llama"]
    assert specs["learning_rate=0.01,block=gpt"] == {"train": {"steps": 10, "learning_rate": 0.01},
                                                     "model": {"block": "gpt"}}
    assert grid({"train": {"steps": 10}}, {}) == {"base": {"train": {"steps": 10}}}
    assert spec_hash({"a": {"x": 1, "y": 2}}) == spec_hash({"a": {"y": 2, "x": 1}}) != spec_hash({"a": {"x": 2}})
    assert flatten({"train": {"steps": 3}, "eval": {"eval_tokens": 0}}) == {"train.steps": 3, "eval.eval_tokens": 0}
    with pytest.raises(SaffuError, match=r"section\.setting"):
        with_value({}, "learning_rate", 0.1)
    with pytest.raises(SaffuError, match="non-empty list"):
        grid({}, {"train.learning_rate": []})
    with pytest.raises(SaffuError, match="sections"):
        grid({"optimiser": {}}, {})


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "grids").glob("*.toml")), ids=lambda p: p.name)
def test_every_experiment_grid_is_specs_saffu_train_takes(path, tmp_path):
    """Each spec of a grid file of experiments/grids: ``saffu train --config`` reads every one of
    its settings, and its model is a valid config of its kind (e.g. no self-guided dense MLP)."""
    from saffu.flags import MODEL, spec_defaults
    specs = grid(*read_grid(path))
    assert specs
    for spec in specs.values():
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        assert spec_defaults(tmp_path / "spec.json")["model"] == spec["model"]["kind"]
        cls = MODEL[spec["model"]["kind"]][0]
        cls(vocab_size=8192, **{k: v for k, v in spec["model"].items() if k != "kind"})


def test_a_grid_file_reads_toml_dotted_keys(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('[base.train]\nsteps = 5\n\n[axes]\n"train.learning_rate" = [0.1, 0.2]\n'
                    'model.width = [16, 32]\n')
    base, axes = read_grid(path)
    assert base == {"train": {"steps": 5}} and axes == {"train.learning_rate": [0.1, 0.2], "model.width": [16, 32]}
    (tmp_path / "bad.json").write_text(json.dumps({"axes": {}}))
    with pytest.raises(SaffuError, match="base"):
        read_grid(tmp_path / "bad.json")


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_a_sweep_runs_each_spec_once_and_gathers_rows(tiny_workdir, tmp_path, capsys):
    specs = grid(TINY, {"train.learning_rate": [0.003, 0.03]})
    said = []
    rows = sweep(specs, tmp_path / "out", tiny_workdir.path, jobs=2, say=said.append)
    assert said[0] == "0 of 2 runs finished already; 2 to run"
    assert [r["name"] for r in rows] == list(specs) and [r["train.learning_rate"] for r in rows] == [0.003, 0.03]
    for row in rows:
        assert row["steps"] == 3 and row["dev_whole_split"] and row["compute"] >= row["flops"] > 0
        assert row["gap_nats"] == pytest.approx(row["dev_loss"] - row["train_loss"])
        trained = json.loads((tmp_path / "out" / row["name"] / "train.json").read_text())
        assert trained["train"]["learning_rate"] == row["train.learning_rate"] and trained["model"]["width"] == 16
    assert rows[0]["dev_loss"] != rows[1]["dev_loss"]
    assert gather(tmp_path / "out") == rows
    said.clear()                                   # finished: nothing runs again
    assert sweep(specs, tmp_path / "out", tiny_workdir.path, jobs=2, say=said.append) == rows
    assert said == ["2 of 2 runs finished already; 0 to run"]
    changed = {name: with_value(spec, "train.steps", 4) for name, spec in specs.items()}
    with pytest.raises(SaffuError, match=r"another spec \(differing: train.steps\)"):
        sweep(changed, tmp_path / "out", tiny_workdir.path)
    # the command: the same grid from a file, the runs skipped, a row per run printed and written
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"base": TINY, "axes": {"train.learning_rate": [0.003, 0.03]}}))
    capsys.readouterr()
    assert main(["sweep", str(grid_file), "--workdir", str(tiny_workdir.path), "--out", str(tmp_path / "out"),
                 "--metrics-json", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 runs finished already" in printed and "learning_rate=0.03" in printed
    metrics = json.loads((tmp_path / "m.json").read_text())
    best = min(rows, key=lambda r: r["dev_bpb"])
    assert metrics["runs"] == 2 and metrics["best"] == best["name"] and metrics["best_dev_bpb"] == best["dev_bpb"]
    assert json.loads((tmp_path / "out" / "rows.json").read_text()) == rows


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_a_failed_run_is_named_and_the_others_finish(tiny_workdir, tmp_path):
    specs = {"good": TINY, "bad": with_value(TINY, "model.width", 15)}      # 15 is not a multiple of 2 heads
    said = []
    with pytest.raises(SaffuError, match="1 of 2 runs failed: bad"):
        sweep(specs, tmp_path / "out", tiny_workdir.path, jobs=1, say=said.append)
    assert (tmp_path / "out" / "good" / "result.json").exists() and any("bad: failed" in s for s in said)
    assert "saffu: error" in (tmp_path / "out" / "bad" / "log.txt").read_text()


@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_an_exact_run_is_made_once_and_then_reused(tiny_workdir, tmp_path):
    from saffu.runner import exact_run
    said = []
    run = exact_run(tiny_workdir.path, tmp_path / "exact", ("--holdout-tokens", "64"), say=said.append)
    record = json.loads((run / "config.json").read_text())
    assert record["model"]["kind"] == "exact" and len(said) == 1 and "saffu exact" in said[0]
    assert exact_run(tiny_workdir.path, run, say=said.append) == run and len(said) == 1     # there: not made again
    elsewhere = tmp_path / "elsewhere"           # an exact run of another work directory is refused, not read
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({**record, "workdir_fingerprint": {"tokenizer": "x"}}))
    with pytest.raises(SaffuError, match="was made with a work directory whose tokenizer has fingerprint x"):
        exact_run(tiny_workdir.path, elsewhere, say=said.append)
    with pytest.raises(SaffuError, match="saffu exact failed"):
        exact_run(tmp_path / "no_workdir", tmp_path / "other", say=said.append)


def test_a_report_reads_a_run_folders_final_figures_and_joins_the_recorded_rows(tmp_path):
    from saffu.runner import final_figures, history, joined, recorded, steps_per_epoch
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 50, "seconds": 10.0, "train_loss": 5.0, "dev_loss": 5.2})
                                       + "\n\n" + json.dumps({"step": 100, "seconds": 20.0, "flops": 2e12,
                                                              "train_loss": 4.0, "dev_loss": 4.3}) + "\n")
    records = history(run)
    assert [r["step"] for r in records] == [50, 100]                    # the blank line skipped
    figures = final_figures({"dev_bpb": 1.8, "dev_loss": 4.2, "solve_seconds": 5.0}, records)
    assert figures == {"dev_bpb": 1.8, "dev_loss": 4.2, "train_loss": 4.0, "last_dev_window_loss": 4.3, "steps": 100,
                       "train_seconds": 20.0, "solve_seconds": 5.0, "flops": 2e12}
    assert final_figures({"dev_bpb": 1.8, "dev_loss": 4.2, "flops": 3e12}, [{"seconds": 1.0, "train_loss": 4.0,
                                                                          "dev_loss": 4.1}])["flops"] == 3e12
    assert recorded(tmp_path / "results" / "none.json") == {}
    (tmp_path / "record.json").write_text(json.dumps({"command": "python x.py", "figures": {"rows": [{"name": "a"}]}}))
    assert recorded(tmp_path / "record.json") == {"rows": [{"name": "a"}]}
    here, earlier = [{"name": "a", "dev_bpb": 1.5}], [{"name": "a", "dev_bpb": 1.9}, {"name": "b", "dev_bpb": 2.0}]
    assert joined(here, earlier, key=lambda row: row["name"]) == [{"name": "a", "dev_bpb": 1.5},
                                                                  {"name": "b", "dev_bpb": 2.0}]
    (tmp_path / "meta.json").write_text(json.dumps({"train_split": "train", "splits": {"train": {"tokens": 1001}}}))
    assert steps_per_epoch(tmp_path, 100) == 10 and steps_per_epoch(tmp_path, 4096) == 1


def test_a_saffu_command_runs_quietly_and_its_failure_is_its_error_line(tiny_workdir, tmp_path):
    from saffu.runner import run_saffu
    run_saffu("stats", "--workdir", tiny_workdir.path, "--metrics-json", tmp_path / "stats.json")
    assert "dev_bpb" in json.dumps(json.loads((tmp_path / "stats.json").read_text()))
    with pytest.raises(SaffuError, match=r"^saffu: error: .*nowhere") as caught:
        run_saffu("eval", "--workdir", tmp_path / "nowhere", "--run", tmp_path / "nowhere")
    assert "\n" not in str(caught.value)


def test_a_quick_work_directory_is_prepared_once(tiny_corpus_dir, tmp_path):
    from saffu.data.workdir import open_workdir
    from saffu.runner import prepared
    workdir = prepared(tmp_path / "quick", tiny_corpus_dir, vocab_size=4096)   # more than the corpus has: its largest
    meta = (workdir / "meta.json").stat().st_mtime_ns
    assert open_workdir(workdir).vocab_size < 4096 and prepared(workdir, tiny_corpus_dir) == workdir
    assert (workdir / "meta.json").stat().st_mtime_ns == meta                  # already prepared: left alone


def test_a_results_file_holds_its_figures_and_what_it_takes_to_trust_them(tmp_path):
    """:func:`saffu.runner.write_result` writes ``RESULTS/NAME.json`` with the figures, the
    command, the date, the seeds, the machine and the load; :func:`recorded` reads the figures back."""
    from saffu.runner import recorded, write_result
    path = write_result(tmp_path / "results", "probe", {"dev_bpb": 1.5, "rows": [1, 2]}, seeds=[0, 1],
                        load={"load_average_1min_before": 0.5})
    record = json.loads(path.read_text())
    assert path == tmp_path / "results" / "probe.json"
    assert record["figures"] == {"dev_bpb": 1.5, "rows": [1, 2]} == recorded(path)
    assert record["seeds"] == [0, 1] and record["load"] == {"load_average_1min_before": 0.5}
    assert record["command"].startswith("python ") and len(record["date"]) == 10
    assert record["machine"]["cores"] == os.cpu_count() and record["machine"]["jax_backend"] == "cpu"
    assert "load_average_1min" in json.loads(write_result(tmp_path / "results", "other", {}, seeds=[]).read_text())["load"]
