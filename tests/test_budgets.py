"""The budget sweep's compute multiplier (experiments/budgets.py) against hand-made curves."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from budgets import GRID, cold_compute_to_reach, compute


def test_cold_compute_is_interpolated_in_log_compute():
    curve = [(1e12, 2.0), (4e12, 1.8), (16e12, 1.7)]
    # halfway in bits per byte between the 1e12 and 4e12 budgets: the geometric mean of their compute
    assert cold_compute_to_reach(curve, 1.9) == (pytest.approx(2e12), "interpolated")
    assert cold_compute_to_reach(curve, 1.8) == (pytest.approx(4e12), "interpolated")
    need, how = cold_compute_to_reach(curve, 1.725)           # three quarters of the way from 4e12 to 16e12
    assert how == "interpolated" and need == pytest.approx(math.exp(math.log(4e12) + 0.75 * math.log(4)))
    assert cold_compute_to_reach(list(reversed(curve)), 1.9)[0] == pytest.approx(2e12)    # any order
    assert cold_compute_to_reach(curve, 1.6) == (16e12, "beyond")      # never reached: a lower bound
    assert cold_compute_to_reach(curve, 2.1) == (1e12, "before")       # reached before the first budget


def test_a_cold_curve_that_rises_is_read_as_its_running_minimum():
    curve = [(1e12, 2.0), (2e12, 1.8), (4e12, 1.85), (8e12, 1.6)]
    # 1.7 is first reached between 4e12 (best so far 1.8) and 8e12 (1.6): halfway
    assert cold_compute_to_reach(curve, 1.7) == (pytest.approx(math.sqrt(4e12 * 8e12)), "interpolated")


def test_a_runs_compute_counts_its_solve_at_its_own_flops_per_second():
    run = {"solve_seconds": 50.0, "history": [{"flops": 1e15, "seconds": 1000.0}]}
    assert compute(run) == pytest.approx(1.05e15)


def test_the_grid_is_the_issues_sweep():
    assert len(GRID) == 12 + 6 + 2
    assert {(s, e) for s, e, w, seed in GRID if w == 256} == {(s, e) for s in ("cold", "explicit-init", "residual-crossfit")
                                                               for e in (1, 2)}
    assert {(s, seed) for s, e, w, seed in GRID if seed == 1} == {("cold", 1), ("explicit-init", 1)}


def test_cold_seeds_of_one_budget_are_averaged():
    from budgets import cold_curve
    rows = [{"start": "cold", "width": 128, "epochs": 4, "compute": 4.0, "dev_bpb": 1.8},
            {"start": "cold", "width": 128, "epochs": 4, "compute": 6.0, "dev_bpb": 1.7},
            {"start": "cold", "width": 128, "epochs": 1, "compute": 1.0, "dev_bpb": 2.0},
            {"start": "cold", "width": 256, "epochs": 1, "compute": 9.0, "dev_bpb": 1.5},
            {"start": "cold", "width": 128, "epochs": 1, "compute": 3.0, "dev_bpb": 2.5, "vocab_size": 30433},
            {"start": "explicit-init", "width": 128, "epochs": 1, "compute": 1.1, "dev_bpb": 1.9}]
    rows = [{"vocab_size": 8192, **row} for row in rows]
    assert cold_curve(rows, 128) == [(1.0, 2.0), (5.0, pytest.approx(1.75))]
    assert cold_curve(rows, 128, 30433) == [(3.0, 2.5)]           # another vocabulary: a curve of its own


def test_steps_to_the_cold_loss_are_read_off_the_curves_of_the_same_budget():
    from budgets import share_of_steps_to_cold, steps_to_reach
    curve = [(0, 9.0), (50, 5.0), (100, 4.5), (150, 4.0)]
    assert steps_to_reach(curve, 4.75) == pytest.approx(75.0)          # halfway between the evaluations at 50 and 100
    assert steps_to_reach(curve, 5.0) == pytest.approx(50.0)
    assert steps_to_reach(curve, 9.5) == 0.0                            # already there at the start
    assert steps_to_reach(curve, 3.9) is None                           # never
    budget = {"vocab_size": 30433, "width": 128, "epochs": 1, "seed": 0}
    cold = {"start": "cold", "steps": 200, "curve": [(0, 9.0), (100, 5.0), (200, 4.5)], **budget}
    other = {**cold, "vocab_size": 8192, "curve": [(0, 9.0), (200, 3.0)]}     # another vocabulary: not compared
    explicit = {"start": "explicit-init", "steps": 200, "curve": curve + [(200, 3.8)], **budget}
    assert share_of_steps_to_cold(explicit, [other, cold, explicit]) == pytest.approx(100 / 200)
    assert share_of_steps_to_cold(explicit, [other, explicit]) is None


def test_printed_bounds_still_hold():
    from budgets import multiplier_text
    assert multiplier_text(1.9964, "beyond") == "≥ 1.99×"           # a lower bound rounds down
    assert multiplier_text(1.0012, "before") == "≤ 1.01×"           # an upper bound rounds up
    assert multiplier_text(2.3461, "interpolated") == "2.35×"       # a measured one to the nearest


@pytest.mark.parametrize("spec", ["cold:1:128", "cold:1:128:0:-0.01", "cold:1:128:0:0.01:2", "cold:x:128:0",
                                  "warm:1:128:0", "llama-explicit:1:256:0", "llama-random:1:128:0:0.03"])
def test_a_bad_run_spec_is_one_usage_error(spec, capsys):
    from budgets import main
    with pytest.raises(SystemExit) as exit_:
        main(["--workdir", "nowhere", "--runs", spec])
    assert exit_.value.code == 2 and spec in capsys.readouterr().err


def test_the_plans_estimate_is_the_median_step_times_the_steps_plus_the_starts_solve():
    from budgets import estimate_minutes
    row = lambda start, epochs, seconds, solve, width=128, vocab=8192: {
        "start": start, "epochs": epochs, "width": width, "vocab_size": vocab, "steps": 100 * epochs,
        "train_seconds": seconds, "solve_seconds": solve}
    rows = [row("cold", 1, 200.0, 0.0), row("explicit-init", 2, 600.0, 30.0), row("cold", 2, 1000.0, 0.0),
            row("cold", 1, 9999.0, 0.0, width=256), row("cold", 1, 9999.0, 0.0, vocab=30433)]
    # per step: 2 / 3 / 5 s at width 128 and V 8,192 → median 3 s; 100 steps an epoch
    assert estimate_minutes(("explicit-init", 4, 128, 1), rows, 8192) == pytest.approx((3 * 400 + 30) / 60)
    assert estimate_minutes(("residual", 1, 128, 0), rows, 8192) == pytest.approx(3 * 100 / 60)   # solve unknown
    assert estimate_minutes(("cold", 1, 512, 0), rows, 8192) is None                            # no run that wide


def test_the_plans_estimate_reads_the_step_times_of_the_runs_own_architecture():
    from budgets import estimate_minutes
    row = lambda start, seconds: {"start": start, "epochs": 1, "width": 128, "vocab_size": 8192, "steps": 100,
                                  "train_seconds": seconds, "solve_seconds": 0.0}
    rows = [row("cold", 200.0), row("explicit-init", 200.0), row("llama-random", 600.0)]
    assert estimate_minutes(("llama-explicit", 2, 128, 0), rows, 8192) == pytest.approx(6 * 200 / 60)
    assert estimate_minutes(("cold", 2, 128, 0), rows, 8192) == pytest.approx(2 * 200 / 60)


def _result(tmp_path, folder, **fields):
    run = tmp_path / "runs" / folder
    run.mkdir(parents=True)
    epochs = fields.get("epochs") or 1
    fields = {"seed": 0, "learning_rate": 0.01, "trained_params": 10, "solve_seconds": 0.0, "vocab_size": 8192,
              "width": 128, "dev_loss": 4.0, **fields}
    fields.setdefault("history", [{"step": 0, "flops": 0.0, "seconds": 0.0, "train_loss": 9.0, "dev_loss": 9.0},
                                  {"step": 100 * epochs, "flops": 1e12 * epochs, "seconds": 100.0 * epochs,
                                   "train_loss": 4.0, "dev_loss": 2.2 * fields["dev_bpb"]}])
    (run / "result.json").write_text(json.dumps(fields))


def test_another_architectures_explicit_start_is_measured_against_its_own_random_init(tmp_path, monkeypatch, capsys):
    import budgets
    monkeypatch.setattr(budgets, "recorded_rows", lambda: [])          # this folder's runs only
    # the project's transformer: a cold start far better than the Llama-like one's random init
    _result(tmp_path, "cold_s0_f1", variant="cold", epochs=1, dev_bpb=1.5)
    _result(tmp_path, "cold_s0_f1_e2", variant="cold", epochs=2, dev_bpb=1.45)
    # any_model's results: random init at 1 and 2 epochs, explicit init at 1
    llama = {"model": "llama", "learning_rate": budgets.RATES["llama-random"]}
    _result(tmp_path, "llama_random_s0_e1", **llama, init="random", variant="random", epochs=1, dev_bpb=2.0)
    _result(tmp_path, "llama_random_s0_e2", **llama, init="random", variant="random", epochs=2, dev_bpb=1.8)
    _result(tmp_path, "llama_explicit_s0_e1", **llama, init="explicit", variant="explicit", epochs=1, dev_bpb=1.9)
    # not the sweep's: a fixed number of steps, an init variant it does not run
    _result(tmp_path, "llama_explicit_s0_30", **llama, init="explicit", variant="explicit", epochs=None, dev_bpb=1.0)
    _result(tmp_path, "llama_explicit-rms0_s0_e1", **llama, init="explicit", variant="explicit-rms0", epochs=1,
            dev_bpb=1.0)
    rows = budgets.report(tmp_path, write=False)["rows"]
    assert sorted((r["start"], r["epochs"]) for r in rows) == [
        ("cold", 1), ("cold", 2), ("llama-explicit", 1), ("llama-random", 1), ("llama-random", 2)]
    explicit = next(r for r in rows if r["start"] == "llama-explicit")
    # halfway in bits per byte between random's 1- and 2-epoch runs: the geometric mean of their compute,
    # not "before" cold's curve (the project's transformer, which is better than 1.9 at every budget)
    assert explicit["multiplier_is"] == "interpolated"
    assert explicit["cold_compute_to_match"] == pytest.approx(math.sqrt(1e12 * 2e12))
    assert explicit["reproduce"].endswith("--runs llama-explicit:1:128:0")
    # its steps to the final loss of the random init of the same budget (2.2 × 2.0 = 4.4 nats): 4.4 is
    # (9.0 - 4.4) / (9.0 - 4.18) of the way from step 0 to step 100
    assert explicit["share_of_steps_to_cold"] == pytest.approx((9.0 - 4.4) / (9.0 - 2.2 * 1.9) * 100 / 100)
    assert "llama-explicit" in capsys.readouterr().out



def test_the_plan_counts_and_times_the_runs_finished_on_this_machine(tmp_path, monkeypatch, capsys):
    import budgets
    monkeypatch.setattr(budgets, "recorded_rows", lambda: [])          # no earlier session's rows
    _result(tmp_path, "cold_s0_f1", variant="cold", epochs=1, dev_bpb=1.5)   # 100 steps in 100 s
    budgets.main(["--out", str(tmp_path), "--plan"])
    plan = capsys.readouterr().out
    assert "cold  1 epochs  width 128  seed 0  lr 0.01: dev 1.5000 bits/byte" in plan
    assert "explicit-init  4 epochs  width 128  seed 0  lr 0.01: to run, about 7 min on one core" in plan
    assert "llama-explicit  1 epochs  width 128  seed 0  lr 0.01: to run\n" in plan   # no run of its architecture


def test_each_start_is_measured_against_the_random_init_of_its_own_architecture():
    from budgets import STARTS, architecture, cold_of
    assert [(cold_of(s), architecture(s)) for s in ("cold", "residual-crossfit", "llama-random", "llama-explicit")] \
        == [("cold", "saffu"), ("cold", "saffu"), ("llama-random", "llama"), ("llama-random", "llama")]
    for start in STARTS:                      # a cold start is its own, of the same architecture
        assert cold_of(cold_of(start)) == cold_of(start) and architecture(cold_of(start)) == architecture(start)


def test_a_cross_fitted_residual_is_its_own_start_per_number_of_folds(tmp_path, monkeypatch):
    import budgets
    import warm_transformer
    monkeypatch.setattr(budgets, "recorded_rows", lambda: [])
    _result(tmp_path, "cold_s0_f1", variant="cold", epochs=1, dev_bpb=1.9)
    _result(tmp_path, "residual_s0_f1_lr0.003", variant="residual", learning_rate=0.003, epochs=1, dev_bpb=1.79)
    for folds, bpb in ((2, 1.788), (4, 1.785), (3, 1.5)):     # K = 3 is no start of the sweep: left out
        name = warm_transformer.run_name("residual-crossfit", 0, 1.0, 0.003, folds=folds)
        _result(tmp_path, name, variant="residual-crossfit", learning_rate=0.003, folds=folds, epochs=1, dev_bpb=bpb)
    assert warm_transformer.run_name("residual-crossfit", 0, 1.0, 0.003, folds=2) == "residual-crossfit_s0_f1_lr0.003"
    assert warm_transformer.run_name("residual", 0, 1.0, 0.003, folds=4) == "residual_s0_f1_lr0.003"
    rows = budgets.report(tmp_path, write=False)["rows"]
    assert [(r["start"], r["folds"], r["dev_bpb"]) for r in rows] == [
        ("cold", 0, 1.9), ("residual", 0, 1.79), ("residual-crossfit", 2, 1.788), ("residual-crossfit-k4", 4, 1.785)]
    assert rows[-1]["reproduce"].endswith("--runs residual-crossfit-k4:1:128:0")
    assert all(r["multiplier_is"] == "beyond" for r in rows[1:])      # each against the cold curve


def test_the_plans_estimate_divides_the_steps_measured_before_the_speed_work_by_its_speedup():
    from budgets import estimate_minutes
    row = lambda start, seconds, finished: {"start": start, "epochs": 1, "width": 128, "vocab_size": 8192,
                                            "steps": 100, "train_seconds": seconds, "solve_seconds": 0.0,
                                            "finished": finished}
    rows = [row("cold", 400.0, "2026-12-01T00:00:00+00:00"), row("explicit-init", 200.0, "2026-12-09T00:00:00+00:00"),
            row("llama-random", 600.0, "2026-12-01T00:00:00+00:00")]
    speedup = (2.0, "2026-12-06T00:00:00+00:00")
    # before: 4 s a step / 2 → 2; after: 2 s a step as measured → median 2 s, 100 steps an epoch
    assert estimate_minutes(("cold", 3, 128, 0), rows, 8192, speedup) == pytest.approx(3 * 200 / 60)
    # another architecture's step did not change
    assert estimate_minutes(("llama-explicit", 1, 128, 0), rows, 8192, speedup) == pytest.approx(600 / 60)
