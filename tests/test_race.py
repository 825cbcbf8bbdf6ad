"""The fair race's arithmetic: a multiplier and its kind on hand-made cold curves, and the tuning
record's refusal of a best value at a grid edge."""

import math

import pytest

from saffu._io import SaffuError
from saffu.eval.race import LOWER_BOUND, MEASURED, UPPER_BOUND, choose, multiplier, running_best

#: cold at 1, 2, 4, 8 units of compute; its 8-unit budget ends worse than its 4-unit one
COLD = [(2.0, 1.80), (1.0, 1.90), (4.0, 1.75), (8.0, 1.78)]


def test_a_loss_inside_the_cold_curve_is_measured_by_log_interpolation():
    m = multiplier(COLD, 1.85, 0.5)                     # halfway between 1.90 (1 unit) and 1.80 (2 units)
    assert m.kind == MEASURED
    assert m.cold_compute == pytest.approx(math.sqrt(2.0))
    assert m.value == pytest.approx(math.sqrt(2.0) / 0.5)
    assert multiplier(COLD, 1.80, 1.0) == (2.0, MEASURED, 2.0)   # exactly on a budget


def test_a_loss_below_the_cold_curve_is_a_lower_bound_and_above_it_an_upper_bound():
    below = multiplier(COLD, 1.70, 1.0)
    assert below.kind == LOWER_BOUND and below.value == 8.0          # cold's largest compute
    above = multiplier(COLD, 1.95, 2.0)
    assert above.kind == UPPER_BOUND and above.value == 0.5          # cold's smallest budget was better
    # the curve's running best: 8 units (1.78) counts as 1.75, so 1.76 lies inside (2 → 4 units)
    assert running_best(COLD)[-1] == (8.0, 1.75)
    assert multiplier(COLD, 1.76, 1.0).kind == MEASURED


def test_multiplier_refuses_what_it_cannot_measure():
    with pytest.raises(SaffuError, match="cold curve"):
        multiplier([], 1.8, 1.0)
    with pytest.raises(SaffuError, match="positive"):
        multiplier(COLD, 1.8, 0.0)


GRID = {"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.0, 0.1], "dropout": [0.0, 0.1]}


def probes(loss):
    return [({"learning_rate": lr, "weight_decay": wd, "dropout": p}, loss(lr, wd, p))
            for lr in GRID["learning_rate"] for wd in GRID["weight_decay"] for p in GRID["dropout"]]


def test_the_best_inside_the_grid_is_chosen():
    loss = lambda lr, wd, p: (math.log10(lr) + 2.2) ** 2 + (0.0 if wd == 0.0 else 0.01) + (0.0 if p else 0.02)
    with pytest.raises(SaffuError, match="best dropout"):   # best at dropout 0.1, the grid's largest
        choose(GRID, probes(loss))
    wider = {**GRID, "dropout": [0.0, 0.1, 0.2]}
    loss2 = lambda lr, wd, p: (math.log10(lr) + 2.2) ** 2 + (0.0 if wd == 0.0 else 0.01) + abs(p - 0.1)
    chosen = choose(wider, [({"learning_rate": lr, "weight_decay": wd, "dropout": p}, loss2(lr, wd, p))
                            for lr in GRID["learning_rate"] for wd in GRID["weight_decay"] for p in wider["dropout"]])
    assert chosen == {"learning_rate": 1e-2, "weight_decay": 0.0, "dropout": 0.1}   # weight decay 0: its floor


@pytest.mark.parametrize("best_lr, edge", [(3e-2, "largest"), (1e-3, "smallest")])
def test_a_best_rate_at_a_grid_edge_is_refused(best_lr, edge):
    loss = lambda lr, wd, p: abs(math.log10(lr) - math.log10(best_lr)) + wd + p
    with pytest.raises(SaffuError, match=f"best learning_rate .* grid's {edge}"):
        choose(GRID, probes(loss))


def test_a_grid_with_a_missing_probe_is_refused():
    with pytest.raises(SaffuError, match="no probe"):
        choose(GRID, probes(lambda lr, wd, p: lr)[:-1])


def test_compute_counts_the_solve_at_the_training_rate():
    from saffu.eval.race import compute_with_solve
    assert compute_with_solve(1e12, 100.0) == 1e12
    assert compute_with_solve(1e12, 100.0, 25.0) == pytest.approx(1.25e12)
    with pytest.raises(SaffuError, match="training seconds"):
        compute_with_solve(1e12, 0.0, 1.0)
    from saffu.eval.race import row_compute
    assert row_compute({"flops": 1e12, "train_seconds": 100.0, "solve_seconds": 25.0}) == pytest.approx(1.25e12)
    assert row_compute({"flops": 1e12, "train_seconds": 100.0}) == 1e12          # a cold run: no solve


def test_a_printed_bound_still_holds():
    from saffu.eval.race import bound_text
    assert bound_text(1.9964, LOWER_BOUND) == "≥ 1.99×"            # a lower bound rounds down
    assert bound_text(1.0012, UPPER_BOUND) == "≤ 1.01×"            # an upper bound rounds up
    assert bound_text(2.3461, MEASURED) == "2.35×"                 # a measured one to the nearest
    with pytest.raises(SaffuError, match="kind"):
        bound_text(2.0, "beyond")


def test_steps_to_a_loss_are_read_off_the_periodic_curve():
    from saffu.eval.race import steps_to_reach
    curve = [(0, 9.0), (50, 5.0), (100, 4.5), (150, 4.0)]
    assert steps_to_reach(curve, 4.75) == pytest.approx(75.0)      # halfway between the evaluations at 50 and 100
    assert steps_to_reach(curve, 5.0) == pytest.approx(50.0)
    assert steps_to_reach(list(reversed(curve)), 5.0) == pytest.approx(50.0)   # any order
    assert steps_to_reach(curve, 9.5) == 0.0                        # already there at the start
    assert steps_to_reach(curve, 3.9) is None                       # never


def _recorded(loss, asked: list):
    """A ``losses`` callable of :func:`saffu.eval.race.search` that 'runs' every combination it is
    given (``loss(values)``), recording each it had not run before in ``asked``."""
    def losses(combos):
        for values in combos:
            if values not in asked:
                asked.append(values)
        return [(values, loss(values)) for values in combos]
    return losses


def test_the_search_grows_the_grid_past_an_edge_until_the_best_is_inside():
    from saffu.eval.race import search
    # the best rate is 0.1 (beyond the grid's 0.03), the best weight decay 0.3 (beyond 0.1), no dropout
    loss = lambda v: (math.log10(v["learning_rate"]) + 1) ** 2 + (v["weight_decay"] - 0.3) ** 2 + v["dropout"]
    asked = []
    found = search(GRID, _recorded(loss, asked))
    assert found.chosen == {"learning_rate": 0.1, "weight_decay": 0.3, "dropout": 0.0} and found.why == ""
    assert found.grid["learning_rate"] == [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3]      # half-decade steps, one past
    assert found.grid["weight_decay"] == [0.0, 0.1, 0.3, 0.9]
    assert len(asked) == len(found.probes) == 6 * 4 * 2            # every combination once, no more


def test_a_report_grows_the_grid_only_as_far_as_its_runs_go():
    from saffu.eval.race import combinations, search
    loss = lambda v: (math.log10(v["learning_rate"]) + 1) ** 2 + v["weight_decay"] + v["dropout"]
    have = {tuple(v.values()): loss(v) for v in combinations({**GRID, "learning_rate": GRID["learning_rate"] + [0.1]})}
    runs = lambda combos: [(v, have[tuple(v.values())]) for v in combos if tuple(v.values()) in have]
    found = search(GRID, runs, extend=False)            # 0.1 is run but is itself the edge; 0.3 is not
    assert found.chosen is None and "largest" in found.why and found.grid["learning_rate"][-1] == 0.1
    have.update({tuple(v.values()): loss(v) for v in combinations({**GRID, "learning_rate": [0.3]})})
    assert search(GRID, runs, extend=False).chosen == {"learning_rate": 0.1, "weight_decay": 0.0, "dropout": 0.0}


def test_a_budgets_rates_grow_by_two_and_stop_at_their_limit():
    from saffu.eval.race import GROW_BY_TWO, search
    asked = []
    found = search({"learning_rate": [0.015, 0.03, 0.06]},
                   _recorded(lambda v: abs(math.log(v["learning_rate"] / 0.012)), asked), rules=GROW_BY_TWO, max_values=6)
    assert found.chosen == {"learning_rate": 0.015} and found.grid["learning_rate"] == [0.0075, 0.015, 0.03, 0.06]
    falling = search({"learning_rate": [0.015, 0.03, 0.06]}, _recorded(lambda v: -v["learning_rate"], []),
                     rules=GROW_BY_TWO, max_values=6)      # always better higher: grows to 6 rates, then gives up
    assert falling.chosen is None and len(falling.grid["learning_rate"]) == 6 and "largest" in falling.why


def test_a_longer_budgets_rate_search_keeps_the_grids_other_values():
    from saffu.eval.race import rate_search
    chosen = {"learning_rate": 0.01, "weight_decay": 0.9, "dropout": 0.0}
    asked = []
    found = rate_search(chosen, _recorded(lambda v: abs(math.log(v["learning_rate"] / 0.004)), asked))
    # 0.005 is the best of 0.005 / 0.01 / 0.02, an edge: 0.0025 is run, and 0.005 is then inside
    assert found.grid == {"learning_rate": [0.0025, 0.005, 0.01, 0.02]}
    assert found.chosen == {**chosen, "learning_rate": 0.005}
    assert all(values == {**chosen, "learning_rate": values["learning_rate"]} for values in asked)
    assert [values for values, _ in found.probes] == [{**chosen, "learning_rate": r} for r in found.grid["learning_rate"]]
    assert rate_search(chosen, lambda combos: []).chosen is None         # no runs: nothing chosen


def test_a_cold_curve_is_each_budgets_best_run_or_its_seeds_averaged():
    from saffu.eval.race import best_per_budget, mean_curve
    rows = [{"epochs": 1, "dev_bpb": 1.9, "compute": 1.0, "name": "a"}, {"epochs": 4, "dev_bpb": 1.7, "compute": 4.0,
            "name": "b"}, {"epochs": 1, "dev_bpb": 1.8, "compute": 3.0, "name": "c"},
            {"epochs": 1, "dev_bpb": 1.8, "compute": 5.0, "name": "d"}]
    best = best_per_budget(rows)
    assert list(best) == [1, 4] and best[1]["name"] == "c" and best[4]["name"] == "b"      # the first of equals
    assert mean_curve(rows) == [(3.0, pytest.approx(5.5 / 3)), (4.0, 1.7)]


def test_the_tuned_race_measures_each_explicit_start_against_its_own_cold_curve():
    from saffu.eval.race import tuned_race
    run = lambda name, epochs, bpb, compute: {"name": name, "epochs": epochs, "dev_bpb": bpb, "flops": compute,
                                              "dev_loss": 4.0, "train_loss": 3.5}
    runs = {"cold": [run("c1", 1.0, 2.0, 1.0), run("c1b", 1.0, 2.1, 1.0), run("c4", 4.0, 1.8, 4.0),
                     run("cq", 0.25, 1.0, 0.25)],           # a quarter-epoch probe is no budget
            "explicit": [run("e1", 1.0, 1.9, 1.0), run("e2", 2.0, 1.7, 2.0)], "lonely": [run("l1", 1.0, 1.0, 1.0)]}
    race = tuned_race(runs, {"explicit": "cold", "lonely": "nowhere"}, compute=lambda r: r["flops"])
    assert list(race) == ["explicit"]                       # a start whose cold start has no runs is left out
    one, two = race["explicit"]
    assert one["cold_curve"] == [(1.0, 2.0), (4.0, 1.8)]      # cold's best of each budget
    assert (one["epochs"], one["name"], one["multiplier_kind"], one["cold"]) == (1.0, "e1", MEASURED, "cold")
    assert one["multiplier"] == pytest.approx(2.0) and one["cold_gap_nats"] == 0.5     # halfway: √(1 · 4) = 2
    assert two["multiplier_kind"] == LOWER_BOUND and two["cold_gap_nats"] is None     # cold ran no 2 epochs


def test_a_race_is_drawn_one_panel_per_cold_start(tmp_path):
    from saffu.eval.plots import plot_race
    row = {"epochs": 1.0, "dev_bpb": 1.9, "compute": 1.0, "cold": "cold", "cold_curve": [(1.0, 2.0), (4.0, 1.8)]}
    path = tmp_path / "figures" / "race.png"
    assert plot_race({"explicit": [row]}, path, heading=str, label=str, xlabel="compute", ylabel="bits per byte")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert not plot_race({}, tmp_path / "none.png", heading=str, label=str, xlabel="", ylabel="")
    assert not (tmp_path / "none.png").exists()


def test_curves_are_drawn_on_linear_axes_at_the_asked_size(tmp_path):
    import struct

    from saffu.eval.plots import Series, plot_curves
    path = tmp_path / "figures" / "curves.png"
    series = [Series([(0, 9.0), (50, 5.0), (100, 4.0)], "inherit, 2 blocks", {"color": "tab:red", "alpha": 0.5}),
              Series([(100, 4.0), (150, 3.8)], "inherit, 3 blocks", {"color": "tab:red"}), Series([], "none")]
    plot_curves(path, series, xlabel="steps", ylabel="dev loss", levels=[(3.9, {"color": "black", "label": "ref"})],
                ylim=(3.5, 5.0), size=(8, 4.5), legend={"fontsize": 8})
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and struct.unpack(">II", data[16:24]) == (880, 495)     # 8 × 4.5 in at 110 dpi
