"""The benchmarks' shared machinery (:mod:`saffu.eval.bench`): medians over rounds, ratios,
interleaved timings, the result line of a measurement's process, the printed table, a model's
training step run one at a time and the op-by-op profile of a compiled function."""

import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu.configs import TrainConfig, TransformerConfig
from saffu.eval import bench
from saffu.models.interface import model_init


def test_ratio_is_none_when_either_side_is_missing_or_the_divisor_zero():
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(0.0, 2.0) == 0.0
    assert bench.ratio(None, 2.0) is None
    assert bench.ratio(3.0, None) is None
    assert bench.ratio(3.0, 0.0) is None


def test_median_row_takes_every_numbers_median_and_keeps_the_rounds():
    rows = [{"seconds": 3.0, "count": 10, "name": "a", "ok": True, "shape": [1, 2]},
            {"seconds": 1.0, "count": 30, "name": "b", "ok": False, "shape": [3, 4]},
            {"seconds": 2.0, "count": 20, "name": "c", "ok": False, "shape": [5, 6]}]
    row = bench.median_row(rows, per_round=("seconds", "missing"))
    assert row["seconds"] == 2.0 and row["count"] == 20
    # anything that is not a number (booleans included) is the first round's
    assert row["name"] == "a" and row["ok"] is True and row["shape"] == [1, 2]
    assert row["per_round"] == {"seconds": [3.0, 1.0, 2.0]}
    assert bench.median_row(rows[:2])["seconds"] == 2.0          # an even count: the mean of the middle two


def test_interleave_runs_every_call_once_a_round_in_turn():
    calls, counter = [], iter(range(100))

    def call(name):
        return lambda: calls.append(name) or next(counter)

    seconds, last = bench.interleave({"a": call("a"), "b": call("b"), "c": call("c")}, 3)
    assert calls == ["a", "b", "c"] * 3
    assert {name: len(times) for name, times in seconds.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for times in seconds.values() for t in times)
    assert last == {"a": 6, "b": 7, "c": 8}
    calls.clear()
    bench.interleave({"a": call("a"), "b": call("b")}, 3, reverse_odd_rounds=True)
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_run_pinned_returns_the_first_processes_last_result_line(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nfrom saffu.eval import bench\n"
                      "print('RESULT {\"early\": 1}')\nprint('other output')\n"
                      "bench.emit({'id': int(sys.argv[1]), 'x': [1.5]})\n")
    figures = bench.run_pinned([[sys.executable, str(script), "0"], [sys.executable, str(script), "1"]], [None, None])
    assert figures == {"id": 0, "x": [1.5]}


def test_run_pinned_reports_a_failed_process_and_a_silent_one(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        bench.run_pinned([[sys.executable, "-c", "raise SystemExit('boom')"]], [None])
    with pytest.raises(RuntimeError, match="reported no figures"):
        bench.run_pinned([[sys.executable, "-c", "print('no result')"]], [None])
    with pytest.raises(ValueError):                     # one core list per command
        bench.run_pinned([[sys.executable, "-c", ""]], [None, None])


def test_emit_prints_one_parseable_line(capsys):
    bench.emit({"a": 1, "b": {"c": [2, 3]}})
    line = capsys.readouterr().out.strip()
    assert line.startswith(bench.RESULT_PREFIX)
    assert json.loads(line.removeprefix(bench.RESULT_PREFIX)) == {"a": 1, "b": {"c": [2, 3]}}


def test_table_formats_and_aligns_every_cell():
    rows = [{"name": "fast", "seconds": 0.5, "n": 1200}, {"name": "slow", "seconds": None}]
    text = bench.table(rows, [("name", "name", ""), ("ms", lambda r: r["seconds"] and r["seconds"] * 1e3, ".1f"),
                              ("n", "n", ",d")], width=8)
    lines = text.splitlines()
    assert lines == [f"{'name':>8}{'ms':>8}{'n':>8}", f"{'fast':>8}{'500.0':>8}{'1,200':>8}",
                     f"{'slow':>8}{'—':>8}{'—':>8}"]
    assert bench.table([], [("a long title", "x", "")], width=4) == " a long title"    # the title sets the width


def test_watch_reports_the_load_before_and_after():
    load = bench.Watch().load()
    assert set(load) == {"load_average_1min_before", "load_average_1min_after", "load_average_5min_after",
                         "cores", "minutes"}
    assert load["minutes"] >= 0 and load["cores"] >= 1


def test_cpu_features_are_a_sorted_subset_of_those_asked():
    found = bench.cpu_features(["sse2", "not_a_cpu_flag", "avx512_bf16"])
    assert found == sorted(found) and set(found) <= {"sse2", "avx512_bf16"}


def test_median_seconds_calls_once_untimed_then_repeats():
    calls = []
    seconds = bench.median_seconds(lambda x: calls.append(x) or jnp.asarray(x), 1.0, repeats=3)
    assert len(calls) == 4 and seconds >= 0


def test_stepper_runs_the_trainers_step_one_at_a_time(tiny_workdir):
    config = TransformerConfig(tiny_workdir.vocab_size, width=16, layers=1, heads=2, context_tokens=4, max_len=32)
    train = TrainConfig(batch_size=2, seq_len=8)
    stream = tiny_workdir.tokens(tiny_workdir.train_split)
    stepper = bench.Stepper(config, model_init(config, jax.random.key(0)), stream, train, 2)
    assert [tuple(w.shape) for w, _ in stepper.batches] == [(2, 4 + 8)] * 2
    assert [tuple(m.shape) for _, m in stepper.batches] == [(2, 8)] * 2
    assert math.isnan(stepper.mean_loss()) and stepper.tokens_per_step == 16
    before = np.asarray(stepper.params["output"]["kernel"]).copy()
    for _ in range(3):
        stepper.step()
    assert stepper.count == 3 and np.isfinite(stepper.mean_loss())
    assert not np.array_equal(before, np.asarray(stepper.params["output"]["kernel"]))   # it trained


def test_op_rows_group_an_operations_ops_and_name_their_source():
    def f(a, b):
        return sum(jnp.tanh(a @ b + i).sum() for i in range(3))
    x = jnp.ones((8, 16))
    hlo = jax.jit(f).lower(x, x.T).compile().as_text()
    dots = re.findall(r"%([\w.\-]+) = .*?op_name=\"[^\"]*/dot_general\"", hlo)     # the products' ops
    assert dots, hlo
    times = {name: 2.0 for name in dots} | {"copy.99": 1.0}       # an op the HLO does not name
    rows = bench.op_rows(times, hlo)
    assert rows[0]["kind"] == "matmul" and rows[0]["ops"] == len(dots) and rows[0]["what"] == "dot_general"
    assert rows[0]["ms_per_step"] == 2.0 * len(dots)
    assert rows[-1]["kind"] == "other" and rows[-1]["ms_per_step"] == 1.0
    assert math.isclose(sum(r["share"] for r in rows), 1.0)
    assert bench.op_rows(times, hlo, top=1) == rows[:1]
    assert bench.op_rows({}, hlo) == []


def test_op_profile_traces_a_compiled_function():
    x = jnp.ones((64, 64))
    compiled = jax.jit(lambda a: jnp.tanh(a @ a)).lower(x).compile()
    rows = bench.op_profile(lambda: jax.block_until_ready(compiled(x)), compiled.as_text(), steps=1)
    assert isinstance(rows, list)           # its ops may run on the calling thread: then it has none
    assert all(r["ms_per_step"] >= 0 for r in rows)


def test_timed_returns_the_calls_seconds_and_output():
    seconds, output = bench.timed(lambda a, b=0: a + b, 2, b=3)
    assert output == 5 and seconds >= 0


def test_in_rounds_collects_every_calls_outputs_round_by_round():
    calls, said, counter = [], [], iter(range(100))

    def call(name):
        return lambda: calls.append(name) or next(counter)

    outputs = bench.in_rounds({"a": call("a"), ("b", 2): call("b")}, 2, lambda *args: said.append(args))
    assert calls == ["a", "b", "a", "b"]
    assert outputs == {"a": [0, 2], ("b", 2): [1, 3]}
    assert said == [(1, "a", 0), (1, ("b", 2), 1), (2, "a", 2), (2, ("b", 2), 3)]
    assert bench.in_rounds({"a": call("a")}, 0) == {"a": []}


def test_python_call_runs_a_modules_function_in_a_fresh_python(tmp_path):
    (tmp_path / "child_module.py").write_text("from saffu.eval import bench\n"
                                              "def report(name, count, flag=None):\n"
                                              "    bench.emit({'name': name, 'count': count, 'flag': flag})\n")
    command = bench.python_call("child_module", "report", "a'b", 3, None)
    assert command[0] == sys.executable
    assert bench.run_pinned([command], [None], cwd=tmp_path) == {"name": "a'b", "count": 3, "flag": None}


def test_alternate_times_steppers_in_turn_after_their_warm_steps():
    class Counter:
        def __init__(self):
            self.count = 0

        def step(self):
            self.count += 1

    steppers = {"a": Counter(), "b": Counter()}
    seconds, medians = bench.alternate(steppers, 3, warm=2)
    assert {name: s.count for name, s in steppers.items()} == {"a": 5, "b": 5}
    assert {name: len(times) for name, times in seconds.items()} == {"a": 3, "b": 3}
    assert all(medians[name] == sorted(seconds[name])[1] for name in steppers)


def test_op_text_writes_a_line_per_op_row():
    rows = [{"kind": "matmul", "shape": "f32[8,16]", "what": "x" * 80, "ops": 3, "ms_per_step": 12.25, "share": 0.5},
            {"kind": "other", "shape": "", "what": "copies", "ops": 1, "ms_per_step": 1.0, "share": 0.04}]
    lines = bench.op_text(rows).splitlines()
    assert len(lines) == 2 and lines[0].startswith("     12.2 ms  50.0%   3 ×   matmul")
    assert lines[0].endswith("f32[8,16]  " + "x" * 60) and lines[1].endswith("copies")
    assert bench.op_text([]) == ""
