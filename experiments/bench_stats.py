"""Benchmark: offset co-occurrence statistics three ways, side by side, in one run.

Computes ``F_δ = Σ_t c(w_{t−δ})ᵀ e(w_{t+1})`` for ``δ = 0 … M−1`` over the whole training
split of a prepared work directory with (1) the saffu engine (jit-compiled int32 scatter
accumulators sharded over local devices; its default target order, and stream order for
comparison), (2) numpy ``np.add.at``, (3) ``scipy.sparse`` (COO -> summed duplicates). All
three start from the token stream and share the same sparse cipher representation; the script
checks they agree and reports throughput and speed-ups.
The repeats are interleaved (engine, numpy, scipy, engine, ...) so machine load hits every
method alike; medians, per-repeat speed-ups and the load averages are reported.

Guarding against regressions:

* ``--write-result`` stores the figures in ``results/bench_stats.json`` (with the command,
  date, machine and load, by :func:`saffu.runner.write_result`);
* ``--check`` exits nonzero when the engine is below ``--min-speedup`` times numpy (10 by
  default), when its speed-up over numpy is more than ``--max-slowdown`` times below the
  stored one (numpy in the same run is the yardstick, so the check survives a busy machine),
  or when a timed pass compiled its step.

    python experiments/bench_stats.py --workdir W --metrics-json b.json
    python experiments/bench_stats.py --workdir W --repeats 5 --write-result
    python experiments/bench_stats.py --workdir W --check
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse

from saffu import accumulate_states, local_mesh, offset_cooccurrence, open_workdir, sparse_bit_cipher
from saffu._io import write_metrics
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.engine.accumulators import _compiled_step
from saffu.eval import bench
from saffu.flags import script_main, script_options
from saffu.runner import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "results" / "bench_stats.json"


@dataclasses.dataclass
class Options:
    """The statistics, the timing and the regression check.

    Attributes:
      workdir: prepared work directory
      radius: offsets M
      bits: cipher bits
      devices: also time the engine sharded over this many forced CPU devices (XLA_FLAGS; one per
        core by default); the headline figures use one device, JAX's default on a CPU host
      chunk_size: tokens per chunk of the engine
      repeats: timing repeats per method (median is kept)
      metrics_json: write the figures here as a flat JSON object
      write_result: store the figures in results/bench_stats.json
      check: exit nonzero on a regression against the stored figures (see --min-speedup, --max-slowdown)
      min_speedup: --check: the least median speed-up of the one-device engine over np.add.at
      max_slowdown: --check: the most the speed-up over numpy may fall below the stored one (a factor)
    """

    workdir: Path = dataclasses.field(metadata={"required": True})
    radius: int = 8
    bits: int = 128
    devices: int = os.cpu_count()
    chunk_size: int = 1 << 15
    repeats: int = 3
    metrics_json: Path | None = None
    write_result: bool = False
    check: bool = False
    min_speedup: float = 10.0
    max_slowdown: float = 1.5


ARGS = script_options(Options, None, __doc__.splitlines()[0])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.devices}").strip()


def numpy_contexts(stream: np.ndarray, radius: int) -> np.ndarray:
    """``int64[N−1, M]`` context tokens of every target, ``<pad>`` across document starts."""
    stream = np.asarray(stream, np.int64)
    boundaries = np.cumsum(stream == EOD_ID)
    heads = np.arange(len(stream) - 1)
    contexts = np.full((len(heads), radius), PAD_ID, np.int64)
    for delta in range(radius):
        position = heads - delta
        ok = position >= 0
        ok[ok] = boundaries[position[ok]] == boundaries[heads[ok]]
        contexts[ok, delta] = stream[position[ok]]
    return contexts


def code_entries(stream, codes, radius):
    """Per offset, the non-zero (bit, target, value) entries of ``c(w_{t−δ}) ⊗ e(w_{t+1})``."""
    contexts = numpy_contexts(stream, radius)
    targets = np.asarray(stream[1:], np.int64)
    for delta in range(radius):
        ctx = contexts[:, delta]
        bits = codes.bit_index[ctx]                                    # [T, L]
        keep = bits >= 0
        values = np.broadcast_to((1.0 / codes.level[ctx])[:, None], bits.shape)
        yield delta, bits[keep], np.broadcast_to(targets[:, None], bits.shape)[keep], values[keep]


def with_numpy(stream, codes, vocab_size, radius):
    F = np.zeros((radius, codes.dim, vocab_size))
    for delta, bits, targets, values in code_entries(stream, codes, radius):
        np.add.at(F[delta], (bits, targets), values)
    return F


def with_scipy(stream, codes, vocab_size, radius):
    rows, cols, data = [], [], []
    for delta, bits, targets, values in code_entries(stream, codes, radius):
        rows.append(delta * codes.dim + bits)
        cols.append(targets)
        data.append(values)
    matrix = scipy.sparse.coo_matrix((np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))),
                                     shape=(radius * codes.dim, vocab_size))
    return matrix.tocsr().toarray().reshape(radius, codes.dim, vocab_size)   # tocsr sums duplicates


def with_engine(stream, acc, mesh, chunk_size, target_order=None):
    state = accumulate_states(stream, {"F": acc}, mesh=mesh, chunk_size=chunk_size, progress=None,
                              target_order=target_order)["F"]
    return acc.finalize(state)


def main():
    workdir = open_workdir(ARGS.workdir)
    stream = np.asarray(workdir.tokens(workdir.train_split))
    vocab_size, radius = workdir.vocab_size, ARGS.radius
    codes = sparse_bit_cipher(vocab_size, ARGS.bits)
    tokens = len(stream) - 1
    mesh, single = local_mesh(), local_mesh(1)            # all ARGS.devices forced CPU devices; one
    print(f"{tokens:,} training tokens, V={vocab_size}, M={radius}, bits={ARGS.bits}, "
          f"median of {ARGS.repeats} interleaved runs")

    acc = offset_cooccurrence(codes, vocab_size, radius)   # reused: its step compiles once
    start = time.perf_counter()
    with_engine(stream[:ARGS.chunk_size], acc, mesh, ARGS.chunk_size)
    compile_seconds = time.perf_counter() - start
    with_engine(stream[:ARGS.chunk_size], acc, single, ARGS.chunk_size)
    with_engine(stream[:ARGS.chunk_size], acc, single, ARGS.chunk_size, False)
    watch = bench.Watch()
    compiled_before = _compiled_step.cache_info().misses
    runs, F = bench.interleave({    # interleaved, so machine noise hits every method alike; named as in the figures
        "engine_sharded": lambda: with_engine(stream, acc, mesh, ARGS.chunk_size),
        "engine": lambda: with_engine(stream, acc, single, ARGS.chunk_size),
        "engine_stream_order": lambda: with_engine(stream, acc, single, ARGS.chunk_size, False),
        "numpy": lambda: with_numpy(stream, codes, vocab_size, radius),
        "scipy": lambda: with_scipy(stream, codes, vocab_size, radius)}, ARGS.repeats)
    step_compilations = _compiled_step.cache_info().misses - compiled_before   # 0: every timed pass reused its step
    load = watch.load()
    seconds = {name: float(np.median(times)) for name, times in runs.items()}
    paired = [n / e for n, e in zip(runs["numpy"], runs["engine"])]   # same repeat, same load

    agree_numpy = float(np.abs(F["engine_sharded"] - F["numpy"]).max())
    agree_scipy = float(np.abs(F["engine_sharded"] - F["scipy"]).max())
    same_order = np.array_equal(F["engine_sharded"], F["engine_stream_order"])
    if not (agree_numpy < 1e-6 and agree_scipy < 1e-6 and same_order):
        sys.exit(f"results disagree: max |engine - numpy| = {agree_numpy}, |engine - scipy| = {agree_scipy}, "
                 f"target order equal to stream order: {same_order}")
    metrics = {
        "tokens": tokens, "vocab_size": vocab_size, "radius": radius, "bits": ARGS.bits,
        "sharded_devices": int(mesh.devices.size), "engine_compile_seconds": compile_seconds,
        **{f"{name}_seconds": median for name, median in seconds.items()},
        **{f"{name}_seconds_per_repeat": times for name, times in runs.items()},
        "target_order_gain": float(np.median([s / t for s, t in zip(runs["engine_stream_order"], runs["engine"])])),
        "tokens_per_s": tokens / seconds["engine"], "tokens_per_s_sharded": tokens / seconds["engine_sharded"],
        "numpy_tokens_per_s": tokens / seconds["numpy"], "scipy_tokens_per_s": tokens / seconds["scipy"],
        **{f"speedup_vs_{peer}{suffix}": seconds[peer] / seconds[engine] for peer in ("numpy", "scipy")
           for engine, suffix in (("engine", ""), ("engine_sharded", "_sharded"))},
        "max_abs_diff_numpy": agree_numpy, "max_abs_diff_scipy": agree_scipy, "repeats": ARGS.repeats,
        "chunk_size": ARGS.chunk_size, "step_compilations_timed": step_compilations,
        "speedup_vs_numpy_per_repeat": paired, "min_speedup_vs_numpy": min(paired), "load": load,
    }
    n = mesh.devices.size
    print(bench.table([
        {"method": "engine, 1 device", "seconds": seconds["engine"]},
        {"method": "engine, stream order", "seconds": seconds["engine_stream_order"]},
        {"method": f"engine, {n} devices", "seconds": seconds["engine_sharded"]},
        *({"method": method, "seconds": seconds[name], "one": seconds["engine"], "all": seconds["engine_sharded"]}
          for name, method in (("numpy", "numpy np.add.at"), ("scipy", "scipy COO->sum")))],
        [("method", "method", ""), ("seconds", "seconds", ".3f"), ("tokens/s", lambda r: tokens / r["seconds"], ",.0f"),
         ("engine ×, 1 device", lambda r: bench.ratio(r["seconds"], r.get("one")), ".1f"),
         (f"engine ×, {n} devices", lambda r: bench.ratio(r["seconds"], r.get("all")), ".1f")], width=22))
    print(f"first call compiles: {compile_seconds:.2f} s; target order is {metrics['target_order_gain']:.2f}x as fast "
          f"as stream order (median of the repeats' ratios)")
    print(f"agreement: max |Δ| numpy {agree_numpy:.2e}, scipy {agree_scipy:.2e}")
    print(f"per repeat vs numpy: {', '.join(f'{x:.1f}x' for x in paired)}; step compilations in timed passes: "
          f"{step_compilations}; load average {load['load_average_1min_before']:.2f} -> "
          f"{load['load_average_1min_after']:.2f}")
    write_metrics(ARGS.metrics_json, {key: value for key, value in metrics.items() if isinstance(value, (int, float))})
    return metrics


def check(metrics: dict) -> list[str]:
    """Regressions of ``metrics`` against ``--min-speedup`` and the stored figures (empty: none)."""
    failures = []
    if metrics["speedup_vs_numpy"] < ARGS.min_speedup:
        failures.append(f"engine {metrics['speedup_vs_numpy']:.1f}x numpy, below {ARGS.min_speedup:g}x")
    if metrics["step_compilations_timed"]:
        failures.append(f"the timed passes compiled the step {metrics['step_compilations_timed']} times")
    if not RESULT.exists():
        failures.append(f"no stored figures in {RESULT}; run with --write-result first")
        return failures
    record = json.loads(RESULT.read_text())
    stored = record["figures"]
    slowdown = stored["speedup_vs_numpy"] / metrics["speedup_vs_numpy"]
    print(f"stored ({record['date']}): engine {stored['engine_seconds']:.3f} s, "
          f"{stored['speedup_vs_numpy']:.1f}x numpy; now {metrics['engine_seconds']:.3f} s, "
          f"{metrics['speedup_vs_numpy']:.1f}x: " + (f"{slowdown:.2f}x slower" if slowdown > 1 else
                                                    f"{1 / slowdown:.2f}x faster") + " relative to numpy")
    if slowdown > ARGS.max_slowdown:
        failures.append(f"speed-up over numpy {slowdown:.2f}x below the stored one (limit {ARGS.max_slowdown:g}x)")
    return failures


def cli() -> None:
    started = datetime.datetime.now(datetime.UTC)
    figures = main()
    if ARGS.write_result:
        path = write_result(ROOT / 'results', 'bench_stats', figures, seeds=[], started=started, load=figures['load'])
        print(f"wrote {path}")
    if ARGS.check:
        problems = check(figures)
        for problem in problems:
            print(f"REGRESSION: {problem}", file=sys.stderr)
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    script_main(cli)
