"""Device check: throughput and agreement of the pipeline on whatever JAX runs on (CPU, GPU, TPU).

One short script for a machine with an accelerator, that also runs on a CPU (with a smaller
subset) so its figures can serve as the reference:

    python experiments/device_check.py --workdir runs/babylm --train-tokens 200000 --steps 20 \\
        --batch-size 8 --eval-windows 64 --holdout-tokens 4096 --out runs/device_check_cpu
    python experiments/device_check.py --workdir runs/babylm --train-tokens 200000 --steps 20 \\
        --batch-size 8 --eval-windows 64 --holdout-tokens 4096 --out runs/device_check_gpu \\
        --reference runs/device_check_cpu/device_check.json [--metrics-json m.json]

(about 3 minutes on 2 CPU cores; without ``--train-tokens`` and with the default training
sizes it measures at full size, for an accelerator). See docs/reliability.md, "Running on an
accelerator".

It measures and prints:

1. the backend, its devices and the jax version;
2. statistics throughput: the first solver pass (unigram counts and offset co-occurrences
   over the sparse bit cipher) over the training stream, for each ``--chunk-sizes`` (the
   wall time includes the compilation, measured apart by a one-chunk pass), and checks that
   the exact integer counts are identical for every chunk size (sha256 of the int64 states);
3. the explicit SAFFU solve: its seconds, the seconds of every stage, the block-0 holdout loss;
4. warm-start training from the solved parameters, float32 and bfloat16 compute, the same
   steps: tokens/s, seconds, dev loss, and the dev-loss difference between the two;
5. with ``--reference`` (a ``device_check.json`` of this script, same settings, usually from
   a CPU): counts must be bit-identical (checksums), the holdout and float32 dev losses
   within ``--rtol`` (relative), the bfloat16 dev loss within ``--bf16-rtol``. One PASS/FAIL
   line per item; the exit status is 1 if any item fails.

``--train-tokens`` (and ``--dev-tokens``) cut the work directory with
:func:`saffu.data.workdir.subset_workdir` (whole documents, seeded, into ``OUT/workdir``), so
a CPU run stays short. Outputs: ``OUT/device_check.json`` (everything, nested) and, with
``--metrics-json``, a flat dict of the figures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from saffu._io import SaffuError, atomic_write_json, write_metrics
from saffu.configs import SaffuConfig, SolverConfig, TrainConfig
from saffu.data.workdir import open_workdir, subset_workdir
from saffu.engine.accumulators import accumulate_states, offset_cooccurrence, unigram_counts
from saffu.engine.codes import sparse_bit_cipher
from saffu.flags import script_options
from saffu.solve.stack import solve_explicit
from saffu.training.trainer import train

#: Settings that must match between a run and its ``--reference`` for the comparison to mean anything.
SETTINGS = ("train_tokens", "dev_tokens", "bits", "radius", "steps", "batch_size", "seq_len",
            "eval_windows", "solve_chunk_size", "holdout_tokens", "vocab_size", "train_stream_tokens")


def chunk_sizes(text: str) -> tuple[int, ...]:
    """``4096,1<<15`` -> ``(4096, 32768)``."""
    sizes = []
    for part in text.split(","):
        base, _, shift = part.partition("<<")
        sizes.append(int(base) << int(shift or 0))     # a ValueError: a usage error
    return tuple(sizes)


@dataclasses.dataclass
class Options:
    """The device check's sizes, reference and tolerances.

    Attributes:
      workdir: prepared work directory
      train_tokens: cut the training split to about this many tokens (subset_workdir); default: all
      dev_tokens: with --train-tokens: dev split size of the subset
      steps: training steps per compute dtype
      batch_size: training windows per step
      seq_len: targets per training window
      eval_windows: dev windows of the dev-loss evaluation
      bits: cipher bits
      radius: offsets M (SAFFU radius)
      chunk_sizes: statistics chunk sizes, comma-separated ('1<<15' is accepted)
      repeats: statistics passes per chunk size, the fastest kept
      solve_chunk_size: chunk size of the solver's passes
      holdout_tokens: solver calibration holdout (at most a tenth of the training stream)
      out: output folder
      reference: device_check.json of a reference run (same settings)
      rtol: relative tolerance of the holdout and float32 dev losses
      bf16_rtol: relative tolerance of the bfloat16 dev loss
      metrics_json: flat JSON of the figures
    """

    workdir: Path = dataclasses.field(metadata={"required": True})
    train_tokens: int | None = None
    dev_tokens: int = 100_000
    steps: int = 100
    batch_size: int = TrainConfig.batch_size
    seq_len: int = TrainConfig.seq_len
    eval_windows: int = TrainConfig.eval_windows
    bits: int = 128
    radius: int = 8
    chunk_sizes: tuple[int, ...] = dataclasses.field(default=(1 << 12, 1 << 15, 1 << 17),
                                                     metadata={"type": chunk_sizes})
    repeats: int = 2
    solve_chunk_size: int = SolverConfig.chunk_size
    holdout_tokens: int = SolverConfig.holdout_tokens
    out: Path = Path("runs/device_check")
    reference: Path | None = None
    rtol: float = 1e-3
    bf16_rtol: float = 1e-2
    metrics_json: Path | None = None


def _check(options: Options) -> None:
    if min(options.chunk_sizes) < 1:
        raise SaffuError("chunk sizes must be positive")


def sha256_int64(*arrays) -> str:
    """sha256 of the arrays as contiguous little-endian int64 (the same on every machine)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(np.asarray(array), dtype="<i8").tobytes())
    return digest.hexdigest()


def scalar(value):
    """A JSON scalar of a report value (numpy / jax scalars included), or None."""
    if hasattr(value, "item") and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (int, float, str, bool)) or value is None else None


def backend_info() -> dict:
    devices = jax.devices()
    info = {"backend": jax.default_backend(), "devices": [str(d) for d in devices],
            "device_count": len(devices), "device_kind": devices[0].device_kind,
            "jax_version": jax.__version__, "python": platform.python_version(), "host": platform.node(),
            # None: XLA's default, which may use TF32 for float32 matmuls on recent NVIDIA GPUs
            "default_matmul_precision": jax.config.jax_default_matmul_precision}
    try:
        import jaxlib
        info["jaxlib_version"] = jaxlib.__version__
    except (ImportError, AttributeError):
        pass
    return info


def statistics(stream: np.ndarray, vocab_size: int, bits: int, radius: int, chunk_sizes: tuple[int, ...],
               repeats: int) -> dict:
    """Unigram + offset counts over ``stream`` per chunk size: wall seconds (with and without
    compilation) and checksums of the exact int64 states (identical over chunk sizes and repeats)."""
    accumulators = {"unigram": unigram_counts(vocab_size),
                    "offsets": offset_cooccurrence(sparse_bit_cipher(vocab_size, bits), vocab_size, radius)}
    targets = len(stream) - 1
    runs = {}
    for chunk_size in chunk_sizes:
        # Every call compiles its own step, so a pass's time includes compilation: a one-chunk
        # pass (compilation + one step) measures it apart; the best of ``repeats`` of each.
        one_chunk, seconds, checksums = math.inf, math.inf, set()
        for _ in range(repeats):
            tick = time.perf_counter()
            jax.block_until_ready(accumulate_states(stream, accumulators, end=min(1 + chunk_size, len(stream)),
                                                    chunk_size=chunk_size, progress=None))
            one_chunk = min(one_chunk, time.perf_counter() - tick)
            tick = time.perf_counter()
            states = jax.block_until_ready(accumulate_states(stream, accumulators, chunk_size=chunk_size,
                                                             progress=None))
            seconds = min(seconds, time.perf_counter() - tick)
            checksums.add((sha256_int64(states["unigram"]), sha256_int64(states["offsets"])))
        streamed = seconds - one_chunk
        run = {"chunk_size": chunk_size, "seconds": seconds, "one_chunk_seconds": one_chunk,
               "tokens_per_s": targets / seconds,
               "steady_tokens_per_s": (targets - min(chunk_size, targets)) / streamed
               if targets > chunk_size and streamed > 0 else None,
               "repeats": repeats, "repeats_identical": len(checksums) == 1,
               "unigram_sha256": sha256_int64(states["unigram"]),
               "offsets_sha256": sha256_int64(states["offsets"]),
               "unigram_total": int(np.asarray(states["unigram"], np.int64).sum()),
               "offsets_total": int(np.asarray(states["offsets"], np.int64).sum())}
        runs[str(chunk_size)] = run
        steady = "n/a" if run["steady_tokens_per_s"] is None else f"{run['steady_tokens_per_s']:,.0f}"
        print(f"  chunk {chunk_size:>7}: {seconds:7.2f} s ({one_chunk:.2f} s compile + first chunk)   "
              f"{run['tokens_per_s']:>12,.0f} tok/s   steady {steady:>12} tok/s   "
              f"offsets {run['offsets_sha256'][:12]}", flush=True)
    keys = {(r["unigram_sha256"], r["offsets_sha256"]) for r in runs.values()}
    keys |= {None for r in runs.values() if not r["repeats_identical"]}
    best = max(runs.values(), key=lambda r: r["tokens_per_s"])
    totals_ok = all(r["unigram_total"] == targets for r in runs.values())
    return {"targets": targets, "runs": runs, "counts_identical": len(keys) == 1 and totals_ok,
            "unigram_sha256": next(iter(runs.values()))["unigram_sha256"],
            "offsets_sha256": next(iter(runs.values()))["offsets_sha256"],
            "best_chunk_size": best["chunk_size"], "best_tokens_per_s": best["tokens_per_s"]}


def solve(workdir, config: SaffuConfig, chunk_size: int, holdout_tokens: int):
    tick = time.perf_counter()
    params, report = solve_explicit(workdir, config, SolverConfig(chunk_size=chunk_size, holdout_tokens=holdout_tokens),
                                    progress=False)
    jax.block_until_ready(params)
    wall = time.perf_counter() - tick
    record = {key: scalar(value) for key, value in report.items() if scalar(value) is not None}
    record["wall_seconds"] = wall
    stages = ", ".join(f"{k[len('seconds_'):]} {v:.2f}" for k, v in record.items() if k.startswith("seconds_"))
    print(f"  {record['seconds']:.2f} s (wall {wall:.2f} s; {stages})   "
          f"block0 holdout loss {record['block0_holdout_loss']:.6f}", flush=True)
    return params, record


def training(config: SaffuConfig, params, workdir, args, dtype: str, out: Path) -> dict:
    train_config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                               eval_every=args.steps, checkpoint_every=args.steps, eval_windows=args.eval_windows,
                               compute_dtype=dtype)
    with tempfile.TemporaryDirectory(dir=out, prefix=f"train_{dtype}_") as run_dir:   # fresh: never resumes
        tick = time.perf_counter()
        trained, history = train(config, params, workdir.tokens(workdir.train_split), train_config, run_dir,
                                 dev_stream=workdir.tokens("dev"), progress=False)
        jax.block_until_ready(trained)
        wall = time.perf_counter() - tick
    last = history[-1]
    record = {"compute_dtype": dtype, "steps": args.steps, "wall_seconds": wall,
              "tokens_per_s": last["tokens_per_s"], "seconds": last["seconds"], "dev_loss": last["dev_loss"],
              "train_loss": last["train_loss"], "dev_loss_step0": history[0]["dev_loss"],
              "skipped_steps": last["skipped_steps"],
              **{k: scalar(last[k]) for k in ("peak_rss_mb", "device_peak_mb") if k in last}}
    print(f"  {dtype:>8}: {record['tokens_per_s']:>10,.0f} tok/s   {record['seconds']:6.2f} s training "
          f"(wall {wall:.2f} s)   dev loss {record['dev_loss_step0']:.6f} -> {record['dev_loss']:.6f}", flush=True)
    return record


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(result: dict, reference: dict, rtol: float, bf16_rtol: float) -> list[dict]:
    """PASS/FAIL items of ``result`` against ``reference``."""
    items = []

    def item(name, ok, detail):
        items.append({"item": name, "pass": bool(ok), "detail": detail})

    mismatched = {k: (result["settings"].get(k), reference["settings"].get(k)) for k in SETTINGS
                  if result["settings"].get(k) != reference["settings"].get(k)}
    item("settings", not mismatched, "identical" if not mismatched else
         "differ: " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in mismatched.items()))
    item("train_stream", result["train_stream_sha256"] == reference["train_stream_sha256"],
         "sha256 of the training token stream")
    for key in ("unigram_sha256", "offsets_sha256"):
        ours, theirs = result["statistics"][key], reference["statistics"][key]
        item(key.replace("_sha256", "_counts"), ours == theirs, f"{ours[:16]} vs {theirs[:16]} (exact)")
    ours, theirs = result["solve"]["block0_holdout_loss"], reference["solve"]["block0_holdout_loss"]
    item("block0_holdout_loss", relative(ours, theirs) <= rtol,
         f"{ours:.6f} vs {theirs:.6f}, rel {relative(ours, theirs):.1e} (rtol {rtol:g})")
    for dtype, tol in (("float32", rtol), ("bfloat16", bf16_rtol)):
        for key in ("dev_loss_step0", "dev_loss"):
            ours, theirs = result["train"][dtype][key], reference["train"][dtype][key]
            item(f"{dtype}_{key}", relative(ours, theirs) <= tol,
                 f"{ours:.6f} vs {theirs:.6f}, rel {relative(ours, theirs):.1e} (rtol {tol:g})")
    return items


def flat_metrics(result: dict) -> dict:
    flat = {"backend": result["device"]["backend"], "device_kind": result["device"]["device_kind"],
            "device_count": result["device"]["device_count"], "jax_version": result["device"]["jax_version"],
            "train_tokens": result["settings"]["train_stream_tokens"],
            "counts_identical": result["statistics"]["counts_identical"],
            "stats_best_chunk_size": result["statistics"]["best_chunk_size"],
            "stats_best_tokens_per_s": result["statistics"]["best_tokens_per_s"]}
    for size, run in result["statistics"]["runs"].items():
        flat[f"stats_tokens_per_s_{size}"] = run["tokens_per_s"]
        flat[f"stats_steady_tokens_per_s_{size}"] = run["steady_tokens_per_s"]
        flat[f"stats_seconds_{size}"] = run["seconds"]
    flat.update({f"solve_{k}": v for k, v in result["solve"].items() if k.startswith("seconds") or k.endswith("loss")})
    for dtype, run in result["train"].items():
        for key in ("tokens_per_s", "seconds", "dev_loss", "dev_loss_step0"):
            flat[f"train_{dtype}_{key}"] = run[key]
    flat["train_bf16_minus_f32_dev_loss"] = result["train_bf16_minus_f32_dev_loss"]
    if "comparison" in result:
        flat["reference_pass"] = result["reference_pass"]
        flat.update({f"reference_{c['item']}": c["pass"] for c in result["comparison"]})
    return flat


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0], check=_check)
    start = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    reference = None
    if args.reference is not None:   # read first: a wrong path fails before the work
        reference = json.loads(args.reference.read_text())

    load_before = os.getloadavg()[0]
    info = backend_info()
    print(f"backend {info['backend']} ({info['device_kind']}), {info['device_count']} device(s): "
          f"{', '.join(info['devices'])}; jax {info['jax_version']}", flush=True)

    workdir = open_workdir(args.workdir)
    if args.train_tokens is not None:
        tick = time.perf_counter()
        workdir = subset_workdir(workdir, out / "workdir", train_tokens=args.train_tokens, dev_tokens=args.dev_tokens)
        print(f"subset of {args.workdir}: {out / 'workdir'} ({time.perf_counter() - tick:.1f} s)", flush=True)
    stream = np.asarray(workdir.tokens(workdir.train_split))
    V = workdir.vocab_size
    settings = {"workdir": str(args.workdir), "train_tokens": args.train_tokens,
                "dev_tokens": args.dev_tokens if args.train_tokens is not None else None,
                "train_stream_tokens": len(stream), "vocab_size": V, "bits": args.bits, "radius": args.radius,
                "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                "eval_windows": args.eval_windows, "chunk_sizes": args.chunk_sizes,
                "solve_chunk_size": args.solve_chunk_size, "holdout_tokens": args.holdout_tokens}
    result = {"device": info, "settings": settings, "train_stream_sha256": sha256_int64(stream)}
    print(f"{len(stream):,} training tokens, V={V}, bits={args.bits}, radius={args.radius}", flush=True)

    print("statistics (unigram + offset co-occurrences):", flush=True)
    result["statistics"] = statistics(stream, V, args.bits, args.radius, args.chunk_sizes, args.repeats)
    print(f"  counts identical across chunk sizes: {result['statistics']['counts_identical']}; "
          f"best chunk size {result['statistics']['best_chunk_size']}", flush=True)

    config = SaffuConfig(vocab_size=V, bits=args.bits, radius=args.radius)
    print(f"explicit solve (chunk size {args.solve_chunk_size}):", flush=True)
    params, result["solve"] = solve(workdir, config, args.solve_chunk_size, args.holdout_tokens)

    print(f"warm-start training, {args.steps} steps of {args.batch_size}x{args.seq_len} tokens:", flush=True)
    result["train"] = {dtype: training(config, params, workdir, args, dtype, out) for dtype in ("float32", "bfloat16")}
    difference = result["train"]["bfloat16"]["dev_loss"] - result["train"]["float32"]["dev_loss"]
    result["train_bf16_minus_f32_dev_loss"] = difference
    result["train_bf16_speedup"] = (result["train"]["bfloat16"]["tokens_per_s"]
                                    / result["train"]["float32"]["tokens_per_s"])
    print(f"  bf16 - f32 dev loss {difference:+.6f}; bf16/f32 tokens/s {result['train_bf16_speedup']:.2f}", flush=True)

    failed = not result["statistics"]["counts_identical"]
    print(f"{'PASS' if not failed else 'FAIL'}  counts_identical_across_chunk_sizes (and repeats; unigram total = "
          f"targets)", flush=True)
    if reference is not None:
        result["reference"] = {"path": str(args.reference), "device": reference["device"],
                               "rtol": args.rtol, "bf16_rtol": args.bf16_rtol}
        result["comparison"] = compare(result, reference, args.rtol, args.bf16_rtol)
        print(f"against {args.reference} ({reference['device']['backend']}, "
              f"{reference['device']['device_kind']}):", flush=True)
        for c in result["comparison"]:
            print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['item']}: {c['detail']}", flush=True)
        for name, ours in (("statistics", result["statistics"]["best_tokens_per_s"]),
                           ("train float32", result["train"]["float32"]["tokens_per_s"]),
                           ("train bfloat16", result["train"]["bfloat16"]["tokens_per_s"])):
            theirs = (reference["statistics"]["best_tokens_per_s"] if name == "statistics"
                      else reference["train"][name.split()[1]]["tokens_per_s"])
            print(f"      {name} tokens/s: {ours:,.0f} vs reference {theirs:,.0f} ({ours / theirs:.1f}x)")
        result["reference_pass"] = all(c["pass"] for c in result["comparison"])
        failed = failed or not result["reference_pass"]
    result["pass"] = not failed
    result["seconds"] = time.perf_counter() - start
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    atomic_write_json(out / "device_check.json", result)
    write_metrics(args.metrics_json, {**flat_metrics(result), "pass": result["pass"], "seconds": result["seconds"],
                                      "load_before": load_before, "load_after": result["load_after"]})
    print(f"{'PASS' if not failed else 'FAIL'} overall; {result['seconds']:.1f} s (load {load_before:.1f} -> "
          f"{result['load_after']:.1f}); {out / 'device_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
