"""The budget sweep's compute multiplier (experiments/budgets.py) against hand-made curves."""

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
                                  "warm:1:128:0"])
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
