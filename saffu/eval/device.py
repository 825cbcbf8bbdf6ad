"""The device check (``saffu device-check``): throughput and agreement of the pipeline's three
costly parts on whatever JAX runs on (CPU, GPU, TPU), against a reference run of the same check,
usually made on a CPU (docs/reliability.md, "Running on an accelerator")::

    saffu device-check --workdir runs/babylm --train-tokens 200000 --steps 20 --batch-size 8 \\
        --eval-windows 64 --holdout-tokens 4096 --out runs/device_check_cpu
    saffu device-check --workdir runs/babylm --train-tokens 200000 --steps 20 --batch-size 8 \\
        --eval-windows 64 --holdout-tokens 4096 --out runs/device_check_gpu \\
        --reference runs/device_check_cpu/device_check.json

It measures and prints:

1. the backend, its devices and the jax version;
2. statistics throughput: the first solver pass (unigram counts and offset co-occurrences over
   the sparse bit cipher) over the training stream for each chunk size (the wall time includes
   the compilation, measured apart by a one-chunk pass), and whether the exact integer counts
   are identical for every chunk size (sha256 of the int64 states);
3. the explicit SAFFU solve: its seconds, every stage's seconds, the block-0 holdout loss;
4. warm-start training from the solved parameters in float32 and bfloat16 compute, the same
   steps: tokens/s, seconds, dev loss, and the dev-loss difference between the two;
5. against a reference: counts bit-identical (checksums), the holdout and float32 dev losses
   within ``rtol`` (relative), the bfloat16 dev loss within ``bf16_rtol``; one PASS/FAIL line
   per item.

``train_tokens`` cuts the work directory (:func:`saffu.data.workdir.subset_workdir`: whole
documents, seeded, into ``OUT/workdir``), so a CPU run stays short (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from saffu._io import SaffuError, atomic_write_json
from saffu.configs import DeviceCheckConfig, SaffuConfig, SolverConfig, TrainConfig
from saffu.data.workdir import open_workdir, subset_workdir
from saffu.engine.accumulators import accumulate_states, offset_cooccurrence, unigram_counts
from saffu.engine.codes import sparse_bit_cipher
from saffu.solve.stack import solve_explicit
from saffu.training.trainer import train

#: Settings that must match between a run and its ``--reference`` for the comparison to mean anything.
SETTINGS = ("train_tokens", "dev_tokens", "bits", "radius", "steps", "batch_size", "seq_len",
            "eval_windows", "solve_chunk_size", "holdout_tokens", "vocab_size", "train_stream_tokens")


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
    """The backend, its devices, the jax and Python versions, the host and the matmul precision."""
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
    """The explicit solve of ``config`` over ``workdir``: ``(params, its report with wall seconds)``."""
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


def training(config: SaffuConfig, params, workdir, check: DeviceCheckConfig, dtype: str, out: Path) -> dict:
    """``check.steps`` of warm-start training from ``params`` in ``dtype`` compute, in a fresh
    folder under ``out``: its tokens/s, seconds and dev loss before and after."""
    train_config = TrainConfig(steps=check.steps, batch_size=check.batch_size, seq_len=check.seq_len,
                               eval_every=check.steps, checkpoint_every=check.steps, eval_windows=check.eval_windows,
                               compute_dtype=dtype)
    with tempfile.TemporaryDirectory(dir=out, prefix=f"train_{dtype}_") as run_dir:   # fresh: never resumes
        tick = time.perf_counter()
        trained, history = train(config, params, workdir.tokens(workdir.train_split), train_config, run_dir,
                                 dev_stream=workdir.tokens("dev"), progress=False)
        jax.block_until_ready(trained)
        wall = time.perf_counter() - tick
    last = history[-1]
    record = {"compute_dtype": dtype, "steps": check.steps, "wall_seconds": wall,
              "tokens_per_s": last["tokens_per_s"], "seconds": last["seconds"], "dev_loss": last["dev_loss"],
              "train_loss": last["train_loss"], "dev_loss_step0": history[0]["dev_loss"],
              "skipped_steps": last["skipped_steps"],
              **{k: scalar(last[k]) for k in ("peak_rss_mb", "device_peak_mb") if k in last}}
    print(f"  {dtype:>8}: {record['tokens_per_s']:>10,.0f} tok/s   {record['seconds']:6.2f} s training "
          f"(wall {wall:.2f} s)   dev loss {record['dev_loss_step0']:.6f} -> {record['dev_loss']:.6f}", flush=True)
    return record


def relative(a: float, b: float) -> float:
    """``|a - b| / |b|``."""
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
    """The nested ``device_check.json`` record as one flat dict of figures (``--metrics-json``)."""
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


def device_check(workdir: str | Path, check: DeviceCheckConfig, out: str | Path) -> dict:
    """Run the device check of ``workdir`` at ``check``'s sizes, write ``OUT/device_check.json``
    (everything, nested) and return its figures as a flat dict (``pass``: every item passed;
    ``failed``: the items that did not, comma-separated)."""
    start = time.perf_counter()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reference = None
    if check.reference is not None:   # read first: a wrong path fails before the work
        try:
            reference = json.loads(Path(check.reference).read_text())
        except (OSError, ValueError) as err:
            raise SaffuError(f"--reference {check.reference}: not a readable device_check.json ({err})") from None

    load_before = os.getloadavg()[0]
    info = backend_info()
    print(f"backend {info['backend']} ({info['device_kind']}), {info['device_count']} device(s): "
          f"{', '.join(info['devices'])}; jax {info['jax_version']}", flush=True)

    data = open_workdir(workdir)
    if check.train_tokens is not None:
        tick = time.perf_counter()
        data = subset_workdir(data, out / "workdir", train_tokens=check.train_tokens, dev_tokens=check.dev_tokens)
        print(f"subset of {workdir}: {out / 'workdir'} ({time.perf_counter() - tick:.1f} s)", flush=True)
    stream = np.asarray(data.tokens(data.train_split))
    V = data.vocab_size
    settings = {"workdir": str(workdir), "train_tokens": check.train_tokens,
                "dev_tokens": check.dev_tokens if check.train_tokens is not None else None,
                "train_stream_tokens": len(stream), "vocab_size": V, "bits": check.bits, "radius": check.radius,
                "steps": check.steps, "batch_size": check.batch_size, "seq_len": check.seq_len,
                "eval_windows": check.eval_windows, "chunk_sizes": check.chunk_sizes,
                "solve_chunk_size": check.solve_chunk_size, "holdout_tokens": check.holdout_tokens}
    result = {"device": info, "settings": settings, "train_stream_sha256": sha256_int64(stream)}
    print(f"{len(stream):,} training tokens, V={V}, bits={check.bits}, radius={check.radius}", flush=True)

    print("statistics (unigram + offset co-occurrences):", flush=True)
    result["statistics"] = statistics(stream, V, check.bits, check.radius, check.chunk_sizes, check.repeats)
    print(f"  counts identical across chunk sizes: {result['statistics']['counts_identical']}; "
          f"best chunk size {result['statistics']['best_chunk_size']}", flush=True)

    config = SaffuConfig(vocab_size=V, bits=check.bits, radius=check.radius)
    print(f"explicit solve (chunk size {check.solve_chunk_size}):", flush=True)
    params, result["solve"] = solve(data, config, check.solve_chunk_size, check.holdout_tokens)

    print(f"warm-start training, {check.steps} steps of {check.batch_size}x{check.seq_len} tokens:", flush=True)
    result["train"] = {dtype: training(config, params, data, check, dtype, out) for dtype in ("float32", "bfloat16")}
    difference = result["train"]["bfloat16"]["dev_loss"] - result["train"]["float32"]["dev_loss"]
    result["train_bf16_minus_f32_dev_loss"] = difference
    result["train_bf16_speedup"] = (result["train"]["bfloat16"]["tokens_per_s"]
                                    / result["train"]["float32"]["tokens_per_s"])
    print(f"  bf16 - f32 dev loss {difference:+.6f}; bf16/f32 tokens/s {result['train_bf16_speedup']:.2f}", flush=True)

    failed = [] if result["statistics"]["counts_identical"] else ["counts_identical_across_chunk_sizes"]
    print(f"{'FAIL' if failed else 'PASS'}  counts_identical_across_chunk_sizes (and repeats; unigram total = "
          f"targets)", flush=True)
    if reference is not None:
        result["reference"] = {"path": str(check.reference), "device": reference["device"],
                               "rtol": check.rtol, "bf16_rtol": check.bf16_rtol}
        result["comparison"] = compare(result, reference, check.rtol, check.bf16_rtol)
        print(f"against {check.reference} ({reference['device']['backend']}, "
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
        failed += [c["item"] for c in result["comparison"] if not c["pass"]]
    result["pass"] = not failed
    result["seconds"] = time.perf_counter() - start
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    atomic_write_json(out / "device_check.json", result)
    print(f"{'FAIL' if failed else 'PASS'} overall; {result['seconds']:.1f} s (load {load_before:.1f} -> "
          f"{result['load_after']:.1f}); {out / 'device_check.json'}")
    return {**flat_metrics(result), "pass": result["pass"], "failed": ", ".join(failed),
            "seconds": result["seconds"], "load_before": load_before, "load_after": result["load_after"]}
