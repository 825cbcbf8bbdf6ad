"""Benchmark machinery the speed experiments share (``experiments/bench_*.py``): measurements in
processes of their own pinned to cores, timings interleaved so a shared machine's load drifts hit
every variant alike, medians over rounds, ratios, the load the run saw and a plain-text table.

A measurement's process reports its figures as one line of its standard output,
``RESULT <json>`` (:data:`RESULT_PREFIX`, :func:`emit`); :func:`run_pinned` starts such
processes and reads that line back. A process that must not import ``saffu`` (a peer library's,
or an earlier revision's ``saffu``) prints the same line itself.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: What starts the line of a measurement process's standard output that holds its figures (JSON).
RESULT_PREFIX = "RESULT "


def emit(figures: Mapping[str, Any]) -> None:
    """Print ``figures`` as a measurement process's result line (``RESULT <json>``)."""
    print(RESULT_PREFIX + json.dumps(figures), flush=True)


def python_call(module: str, function: str, *arguments) -> list[str]:
    """The argv of a fresh Python (this one's interpreter) that imports ``function`` from
    ``module`` and calls it with ``arguments`` (each written as its ``repr``): a measurement process
    that parses no flags and imports only what ``module`` does (``module`` found on its
    ``PYTHONPATH`` or in its working directory)."""
    call = f"from {module} import {function}; {function}({', '.join(map(repr, arguments))})"
    return [sys.executable, "-c", call]


def run_pinned(commands: Sequence[Sequence[str]], cores: Sequence[str | None], cwd: str | Path | None = None,
               env: Mapping[str, str] | None = None) -> dict:
    """Run every command (an argv) in a process of its own, all at once, the ``i``-th pinned to
    the cores ``cores[i]`` (``taskset -c``'s list, e.g. ``"0"`` or ``"0,1"``; ``None``: not
    pinned), wait for them all and return the figures the first one reported (the JSON of its last
    :data:`RESULT_PREFIX` line). Raises :class:`RuntimeError` with the end of a failed process's
    standard error, or when the first reported nothing."""
    jobs = [subprocess.Popen([*(["taskset", "-c", core] if core else []), *command], cwd=cwd,
                             env=None if env is None else dict(env), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for command, core in zip(commands, cores, strict=True)]
    done = [(job, *job.communicate()) for job in jobs]
    for job, _, err in done:
        if job.returncode:
            raise RuntimeError(f"{' '.join(job.args)} failed (exit {job.returncode}):\n{err[-4000:]}")
    lines = [line for line in done[0][1].splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"{' '.join(done[0][0].args)} reported no figures:\n{done[0][2][-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def median_seconds(fn: Callable, *args, repeats: int) -> float:
    """Median wall seconds of ``fn(*args)`` (to completion: ``jax.block_until_ready`` of its
    output) over ``repeats`` calls after an untimed one (which compiles)."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(fn: Callable, *args, **kwargs) -> tuple[float, Any]:
    """``(seconds, output)``: the wall seconds of one call ``fn(*args, **kwargs)`` and what it
    returned (a call that returns before its work is done must wait for it itself)."""
    start = time.perf_counter()
    output = fn(*args, **kwargs)
    return time.perf_counter() - start, output


def in_rounds(calls: Mapping[Any, Callable[[], Any]], rounds: int,
              say: Callable[[int, Any, Any], Any] | None = None) -> dict[Any, list]:
    """Every one of ``calls`` once a round, in turn, for ``rounds`` rounds, so a load drift hits
    each alike (e.g. a measurement in a process of its own, :func:`run_pinned`): each name's
    outputs, one per round. ``say(round, name, output)`` (``round`` from 1) after every call,
    e.g. to print progress."""
    outputs: dict[Any, list] = {name: [] for name in calls}
    for round_ in range(1, rounds + 1):
        for name, call in calls.items():
            outputs[name].append(call())
            if say is not None:
                say(round_, name, outputs[name][-1])
    return outputs


def interleave(calls: Mapping[str, Callable[[], Any]], rounds: int,
               reverse_odd_rounds: bool = False) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time every one of ``calls`` once a round, in turn, for ``rounds`` rounds, so a load drift
    hits each alike (in reverse order on odd rounds with ``reverse_odd_rounds``, so neither
    always runs first). A call returns when its work is done (e.g. after ``jax.block_until_ready``).

    Returns ``(seconds, last)``: each name's wall seconds, one per round, and each one's output
    of the last round."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    last: dict[str, Any] = {}
    for round_ in range(rounds):
        names = list(calls)
        for name in (reversed(names) if reverse_odd_rounds and round_ % 2 else names):
            start = time.perf_counter()
            last[name] = calls[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds, last


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing (``None``) or ``b`` is zero."""
    return a / b if a is not None and b else None


def median_row(rows: Sequence[Mapping[str, Any]], per_round: Iterable[str] = ()) -> dict:
    """One measurement's figures over its rounds (``rows``, one dict a round, the same keys): the
    median of every number, any other value from the first round, and under ``"per_round"`` the
    rounds' own values of the keys ``per_round`` that the rows have."""
    row = {key: statistics.median(r[key] for r in rows) if _number(value) else value
           for key, value in rows[0].items()}
    row["per_round"] = {key: [r[key] for r in rows] for key in per_round if key in rows[0]}
    return row


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Stepper:
    """A model's jitted training step (:func:`saffu.training.trainer.make_train_step`, AdamW of
    :func:`~saffu.training.trainer.make_optimizer` over 1,000 steps) run one step at a time, for
    timing: ``batches`` random windows of ``stream`` (``train``'s batch: ``int32[B, R + T]`` windows
    and their ``bool[B, T]`` masks, made up front, seeded), cycled; the model's ``fixed_params``
    (e.g. a residual's explicit tables) are inputs of every step, as the trainer has them.

    Attributes:
      config: the model's config
      train: the training config (its batch size, window length and compute dtype)
      batches: the ``(windows, mask)`` pairs on the device
      count: steps run so far
    """

    def __init__(self, config, params: dict, stream, train, batches: int, seed: int = 0):
        import jax.numpy as jnp
        import numpy as np

        from saffu.data.windows import stack_windows
        from saffu.training.trainer import StepStats, make_optimizer, make_train_step
        self.config, self.train = config, train
        names = set(getattr(config, "fixed_params", ()))
        self.fixed = {k: v for k, v in params.items() if k in names}
        self.params = {k: v for k, v in params.items() if k not in names}
        optimizer = make_optimizer(train, 1000)
        self.opt_state, self.stats, self.count = optimizer.init(self.params), StepStats.zeros(), 0
        self.function = make_train_step(config, optimizer, train)
        rng, self.batches = np.random.default_rng(seed), []
        for _ in range(batches):
            starts = rng.integers(1, len(stream) - train.seq_len, train.batch_size)
            windows, mask = stack_windows(stream, starts, [len(stream)] * len(starts), config.context, train.seq_len)
            self.batches.append((jnp.asarray(windows), jnp.asarray(mask)))

    def step(self) -> None:
        """One step on the next batch, to completion (``jax.block_until_ready``)."""
        import jax
        windows, mask = self.batches[self.count % len(self.batches)]
        self.params, self.opt_state, self.stats = self.function(self.params, self.opt_state, self.stats,
                                                                jax.numpy.int32(self.count), windows, mask, self.fixed)
        jax.block_until_ready(self.stats)
        self.count += 1

    @property
    def tokens_per_step(self) -> int:
        """Targets a step trains on: the batch size times the window's targets."""
        return self.train.batch_size * self.train.seq_len

    def mean_loss(self) -> float:
        """The mean training loss of every step so far (``nan`` before the first)."""
        applied = int(self.stats.applied)
        return float(self.stats.loss_sum) / applied if applied else float("nan")


def alternate(steppers: Mapping[str, Stepper], rounds: int, warm: int = 2) -> tuple[dict[str, list[float]],
                                                                                   dict[str, float]]:
    """The steppers' steps timed alternately (:func:`interleave`, in reverse order on odd rounds),
    ``rounds`` rounds of one step each, after ``warm`` untimed steps of each (a compiling one and a
    warm one): ``(seconds, medians)``, each one's seconds per round and their median. Steppers of
    the same seed step through the same batches, so a difference is the step's, not the data's."""
    for stepper in steppers.values():
        for _ in range(warm):
            stepper.step()
    seconds = interleave({name: s.step for name, s in steppers.items()}, rounds, reverse_odd_rounds=True)[0]
    return seconds, {name: statistics.median(times) for name, times in seconds.items()}


class Watch:
    """The wall clock and the machine's load averages from when it is made: what a benchmark ran
    under (on a shared machine timings compare only within one run)."""

    def __init__(self):
        self.started, self.load_before = time.time(), os.getloadavg()

    def load(self) -> dict:
        """``{load_average_1min_before, load_average_1min_after, load_average_5min_after, cores,
        minutes}``: the 1-minute load average when the watch was made and now, the 5-minute one
        now, the cores and the minutes since."""
        now = os.getloadavg()
        return {"load_average_1min_before": self.load_before[0], "load_average_1min_after": now[0],
                "load_average_5min_after": now[1], "cores": os.cpu_count(),
                "minutes": (time.time() - self.started) / 60}


#: A table column: its title, the key of a row's value (or a function of the row) and its format.
Column = tuple[str, str | Callable[[Mapping], Any], str]


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column], width: int = 10) -> str:
    """A plain-text table: a line of the columns' titles, then a line per row, each cell
    ``format(value, format)`` (``—`` where the value is missing or ``None``) right-aligned in
    ``max(width, len(title) + 1)`` characters."""
    widths = [max(width, len(title) + 1) for title, _, _ in columns]

    def cell(row, key, form):
        value = key(row) if callable(key) else row.get(key)
        return "—" if value is None else format(value, form)

    lines = ["".join(f"{title:>{w}}" for (title, _, _), w in zip(columns, widths))]
    lines += ["".join(f"{cell(row, key, form):>{w}}" for (_, key, form), w in zip(columns, widths)) for row in rows]
    return "\n".join(lines)


def op_profile(run: Callable[[], Any], hlo: str, steps: int = 2, top: int = 15) -> list[dict]:
    """Where a compiled computation's time goes, op by op, on the CPU backend: ``run()`` (one call
    of the computation, to completion) ``steps`` times under a ``jax.profiler`` trace, each op
    timed on XLA's CPU worker threads (``tf_XLAEigen``) and grouped by :func:`op_rows` with the
    compiled HLO ``hlo`` (``compiled.as_text()``).

    Returns :func:`op_rows`'s rows, milliseconds per call of ``run`` (empty where no op ran on
    XLA's worker threads: another backend, or a computation small enough to run on the calling
    thread)."""
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[-1])
        times = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLAEigen"):
                    continue
                for event in line.events:
                    # the executor's own spans and loops hold other ops: count the leaves only
                    if not event.name.startswith("Thunk") and not event.name.startswith("while"):
                        times[event.name] += event.duration_ns / 1e6 / steps
    return op_rows(times, hlo, top)


def op_rows(ms_by_op: Mapping[str, float], hlo: str, top: int = 15) -> list[dict]:
    """Ops' times ``{HLO op name: milliseconds}`` joined with the compiled HLO text ``hlo`` (each
    op's JAX source operation, from its ``op_name`` metadata, and its result shape) and grouped: the
    same operation at every layer (or every chunk of a loop) is one row, its ops added up; a dot
    is of kind ``matmul``, an op the HLO does not name is of kind ``other``.

    Returns the ``top`` rows by time, ``[{kind, shape, what, ops, ms_per_step, share}]``, ``share``
    of the time of all the ops (empty when they took none)."""
    ops = {}
    for line in hlo.splitlines():
        found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) (\w+)\(.*?op_name=\"([^\"]*)\"", line)
        if found:
            ops[found.group(1)] = (found.group(2), found.group(3), found.group(4))
    whole = sum(ms_by_op.values())
    groups: dict[tuple, list] = {}
    for name, ms in ms_by_op.items():
        shape, kind, what = ops.get(name, ("", "other", "ops without a JAX source operation (copies, loop steps)"))
        kind = "matmul" if name.startswith("dot") or "dot_general" in what else kind
        group = groups.setdefault((kind, shape.split("{")[0], re.sub(r"^jit\([^)]*\)/", "", what)), [0.0, 0])
        group[0] += ms
        group[1] += 1
    rows = [{"kind": kind, "shape": shape, "what": what, "ops": count, "ms_per_step": ms, "share": ms / whole}
            for (kind, shape, what), (ms, count) in groups.items()] if whole else []
    return sorted(rows, key=lambda row: -row["ms_per_step"])[:top]


def op_text(rows: Iterable[Mapping[str, Any]], indent: str = "  ") -> str:
    """:func:`op_rows`'s rows as text, a line each: milliseconds per step, share of the time, ops,
    kind, result shape and the JAX operation (its first 60 characters)."""
    return "\n".join(f"{indent}{r['ms_per_step']:7.1f} ms {r['share']:6.1%} {r['ops']:>3} × {r['kind']:>8} "
                     f"{r['shape']:>20}  {r['what'][:60]}" for r in rows)


def cpu_features(names: Iterable[str]) -> list[str]:
    """Which of the processor feature flags ``names`` (e.g. ``avx512_bf16``) ``/proc/cpuinfo``
    lists, sorted (empty where there is no ``/proc/cpuinfo``)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return []
    flags = next((line.split(":", 1)[1].split() for line in path.read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(set(flags) & set(names))
