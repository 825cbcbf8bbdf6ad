"""Benchmark: offset co-occurrence statistics three ways, side by side, in one run.

Computes ``F_δ = Σ_t c(w_{t−δ})ᵀ e(w_{t+1})`` for ``δ = 0 … M−1`` over the whole training
split of a prepared work directory with (1) the saffu engine (jit-compiled int32 scatter
accumulators sharded over local devices), (2) numpy ``np.add.at``, (3) ``scipy.sparse``
(COO -> summed duplicates). All three start from the token stream and share the same sparse
cipher representation; the script checks they agree and reports throughput and speed-ups.

    python experiments/bench_stats.py --workdir W --metrics-json b.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse

from saffu import accumulate_states, local_mesh, offset_cooccurrence, open_workdir, sparse_bit_cipher
from saffu._io import write_metrics
from saffu.data.tokenizer import EOD_ID, PAD_ID


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--workdir", type=Path, required=True, help="prepared work directory")
    parser.add_argument("--radius", type=int, default=8, help="offsets M")
    parser.add_argument("--bits", type=int, default=128, help="cipher bits")
    parser.add_argument("--devices", type=int, default=os.cpu_count(),
                        help="also time the engine sharded over this many forced CPU devices "
                             "(XLA_FLAGS; default: one per core). The headline figures use one "
                             "device, JAX's default on a CPU host")
    parser.add_argument("--chunk-size", type=int, default=1 << 15)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats per method (median is kept)")
    parser.add_argument("--metrics-json", type=Path)
    return parser.parse_args(argv)


ARGS = parse_args()
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


def with_engine(stream, acc, mesh, chunk_size):
    state = accumulate_states(stream, {"F": acc}, mesh=mesh, chunk_size=chunk_size, progress=None)["F"]
    return acc.finalize(state)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main():
    workdir = open_workdir(ARGS.workdir)
    stream = np.asarray(workdir.tokens(workdir.train_split))
    vocab_size, radius = workdir.vocab_size, ARGS.radius
    codes = sparse_bit_cipher(vocab_size, ARGS.bits)
    tokens = len(stream) - 1
    mesh = local_mesh()            # all ARGS.devices forced CPU devices
    print(f"{tokens:,} training tokens, V={vocab_size}, M={radius}, bits={ARGS.bits}, "
          f"median of {ARGS.repeats} interleaved runs")

    acc = offset_cooccurrence(codes, vocab_size, radius)   # reused: its step compiles once
    _, compile_seconds = timed(with_engine, stream[:ARGS.chunk_size], acc, mesh, ARGS.chunk_size)
    single = local_mesh(1)
    with_engine(stream[:ARGS.chunk_size], acc, single, ARGS.chunk_size)
    runs = {"engine": [], "engine_one_device": [], "numpy": [], "scipy": []}
    for _ in range(ARGS.repeats):  # interleaved, so machine noise hits every method alike
        F_engine, seconds = timed(with_engine, stream, acc, mesh, ARGS.chunk_size)
        runs["engine"].append(seconds)
        runs["engine_one_device"].append(timed(with_engine, stream, acc, single, ARGS.chunk_size)[1])
        F_numpy, seconds = timed(with_numpy, stream, codes, vocab_size, radius)
        runs["numpy"].append(seconds)
        F_scipy, seconds = timed(with_scipy, stream, codes, vocab_size, radius)
        runs["scipy"].append(seconds)
    sharded_seconds, engine_seconds, numpy_seconds, scipy_seconds = (
        float(np.median(runs[k])) for k in ("engine", "engine_one_device", "numpy", "scipy"))

    agree_numpy = float(np.abs(F_engine - F_numpy).max())
    agree_scipy = float(np.abs(F_engine - F_scipy).max())
    if not (agree_numpy < 1e-6 and agree_scipy < 1e-6):
        sys.exit(f"results disagree: max |engine - numpy| = {agree_numpy}, |engine - scipy| = {agree_scipy}")
    metrics = {
        "tokens": tokens, "vocab_size": vocab_size, "radius": radius, "bits": ARGS.bits,
        "sharded_devices": int(mesh.devices.size), "engine_seconds": engine_seconds,
        "engine_compile_seconds": compile_seconds, "engine_sharded_seconds": sharded_seconds,
        "numpy_seconds": numpy_seconds, "scipy_seconds": scipy_seconds,
        "tokens_per_s": tokens / engine_seconds, "tokens_per_s_sharded": tokens / sharded_seconds,
        "numpy_tokens_per_s": tokens / numpy_seconds, "scipy_tokens_per_s": tokens / scipy_seconds,
        "speedup_vs_numpy": numpy_seconds / engine_seconds, "speedup_vs_scipy": scipy_seconds / engine_seconds,
        "speedup_vs_numpy_sharded": numpy_seconds / sharded_seconds,
        "speedup_vs_scipy_sharded": scipy_seconds / sharded_seconds,
        "max_abs_diff_numpy": agree_numpy, "max_abs_diff_scipy": agree_scipy, "repeats": ARGS.repeats,
    }
    n = mesh.devices.size
    print(f"engine, 1 device : {engine_seconds:6.3f} s {metrics['tokens_per_s']:>12,.0f} tok/s "
          f"(first call compiles: {compile_seconds:.2f} s)")
    print(f"engine, {n} devices: {sharded_seconds:6.3f} s {metrics['tokens_per_s_sharded']:>12,.0f} tok/s")
    print(f"numpy np.add.at  : {numpy_seconds:6.3f} s {metrics['numpy_tokens_per_s']:>12,.0f} tok/s "
          f"-> engine {metrics['speedup_vs_numpy']:.1f}x ({metrics['speedup_vs_numpy_sharded']:.1f}x on {n})")
    print(f"scipy COO->sum   : {scipy_seconds:6.3f} s {metrics['scipy_tokens_per_s']:>12,.0f} tok/s "
          f"-> engine {metrics['speedup_vs_scipy']:.1f}x ({metrics['speedup_vs_scipy_sharded']:.1f}x on {n})")
    print(f"agreement: max |Δ| numpy {agree_numpy:.2e}, scipy {agree_scipy:.2e}")
    write_metrics(ARGS.metrics_json, metrics)


if __name__ == "__main__":
    main()
