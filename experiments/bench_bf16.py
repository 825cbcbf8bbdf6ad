"""What ``--compute-dtype bfloat16`` does on this backend: training steps of the transformer in
float32 and bfloat16, side by side in one process (alternating, after compilation), and the
output layer's matmul alone three ways (f32, bf16 → bf16, bf16 inputs → f32 accumulation).

XLA's CPU backend runs a bf16 × bf16 → bf16 product by converting both operands to float32 and
the result back (no bf16 arithmetic at all, plus the conversions), while bf16 × bf16 → f32 runs
natively where the processor has bf16 dot-product units (``avx512_bf16``, AMX). The script
reports which of the two the compiler chose and the step times side by side, so a backend on
which bf16 does not pay shows it.

    python experiments/bench_bf16.py                     # printed table + --metrics-json
    python experiments/bench_bf16.py --write-result      # results/bench_bf16.json
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import write_metrics
from saffu.configs import TrainConfig, TransformerConfig
from saffu.flags import script_options
from saffu.models.interface import model_init
from saffu.training.trainer import StepStats, make_optimizer, make_train_step

#: The compute dtypes compared.
VARIANTS = ("float32", "bfloat16")


@dataclasses.dataclass
class Options:
    """The model and the timing of the comparison.

    Attributes:
      vocab_size: V (the default work directory's BPE)
      width: model width d
      layers: transformer layers
      batch_size: windows per step
      seq_len: targets per window
      steps: timed steps per dtype and round
      rounds: alternating rounds (the median step is kept)
      quick: a small model and few steps (about a minute)
      metrics_json: also write the figures here
      write_result: write results/bench_bf16.json
    """

    vocab_size: int = 8192
    width: int = 128
    layers: int = 5
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 6
    rounds: int = 3
    quick: bool = False
    metrics_json: Path | None = None
    write_result: bool = False


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_figures(args) -> dict:
    """Median seconds of the output layer's product ``[B·T, d] @ [d, V]`` three ways, and
    whether XLA compiled the bf16 → bf16 product with conversions to float32."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (args.batch_size * args.seq_len, args.width))
    w = jax.random.normal(key, (args.width, args.vocab_size))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    plain = jax.jit(jnp.matmul)
    wide = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    hlo = plain.lower(xb, wb).compile().as_text()
    converted = "f32[" in hlo and "convert" in hlo
    figures = {"float32": _median_seconds(plain, x, w, repeats=5 * args.rounds),
               "bf16_to_bf16": _median_seconds(plain, xb, wb, repeats=5 * args.rounds),
               "bf16_to_f32": _median_seconds(wide, xb, wb, repeats=5 * args.rounds)}
    return {"seconds": figures, "bf16_to_bf16_converts_to_f32": converted,
            "shape": [args.batch_size * args.seq_len, args.width, args.vocab_size]}


def _compiled_step(model: TransformerConfig, config: TrainConfig):
    """The jitted training step compiled for one batch shape, with fresh params and optimizer state."""
    optimizer = make_optimizer(config, config.steps)
    params = model_init(model, jax.random.key(0))
    opt_state = optimizer.init(params)
    step = make_train_step(model, optimizer, config)
    return step.lower(params, opt_state, StepStats.zeros(), jnp.int32(0), *_batch(config, model), {}).compile(), \
        params, opt_state


def _batch(config: TrainConfig, model: TransformerConfig):
    rng = np.random.default_rng(0)
    windows = rng.integers(2, model.vocab_size, (config.batch_size, config.seq_len + model.context))
    return jnp.asarray(windows, jnp.int32), jnp.ones((config.batch_size, config.seq_len), bool)


def step_figures(args) -> dict:
    """Median seconds per training step of the transformer in each variant (:data:`VARIANTS`),
    alternating round by round after compilation, and each variant's mean loss of its last round."""
    model = TransformerConfig(args.vocab_size, args.width, args.layers, 4, context_tokens=1,
                              max_len=args.seq_len + 1, block="gpt", output_bias=True)
    states = {}
    for name in VARIANTS:
        config = TrainConfig(steps=1000, batch_size=args.batch_size, seq_len=args.seq_len, compute_dtype=name)
        step, params, opt_state = _compiled_step(model, config)
        states[name] = [step, params, opt_state]
    windows, mask = _batch(config, model)
    times, losses = {name: [] for name in VARIANTS}, {}
    for round_ in range(args.rounds + 1):               # round 0 warms up
        for name in VARIANTS:
            step, params, opt_state = states[name]
            stats = StepStats.zeros()
            start = time.perf_counter()
            for i in range(args.steps):
                params, opt_state, stats = step(params, opt_state, stats, jnp.int32(i), windows, mask, {})
            jax.block_until_ready(stats)
            if round_:
                times[name].append((time.perf_counter() - start) / args.steps)
            states[name][1:] = [params, opt_state]
            losses[name] = float(stats.loss_sum) / max(int(stats.applied), 1)
    seconds = {name: statistics.median(times[name]) for name in VARIANTS}
    tokens = args.batch_size * args.seq_len
    return {"seconds_per_step": seconds, "tokens_per_s": {n: tokens / s for n, s in seconds.items()},
            "bf16_over_f32_step": seconds["bfloat16"] / seconds["float32"],
            "mean_loss_last_round": losses,
            "model": {"vocab_size": args.vocab_size, "width": args.width, "layers": args.layers,
                      "batch_size": args.batch_size, "seq_len": args.seq_len}}


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    if args.quick:
        args.vocab_size, args.width, args.layers, args.seq_len, args.steps, args.rounds = 2048, 64, 2, 64, 3, 2
    load_before = os.getloadavg()[0]
    figures = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
               "cpu_bf16_units": _cpu_bf16_units(), "matmul": matmul_figures(args), "training": step_figures(args)}
    load = {"load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0]}
    mm, tr = figures["matmul"]["seconds"], figures["training"]
    print(f"backend {figures['backend']} ({figures['device']}); bf16 units: {figures['cpu_bf16_units'] or 'none found'}")
    print(f"output-layer matmul {figures['matmul']['shape']}: f32 {mm['float32'] * 1e3:.1f} ms, "
          f"bf16→bf16 {mm['bf16_to_bf16'] * 1e3:.1f} ms, bf16→f32 {mm['bf16_to_f32'] * 1e3:.1f} ms"
          f"{' (bf16→bf16 compiled as f32 with conversions)' if figures['matmul']['bf16_to_bf16_converts_to_f32'] else ''}")
    for name in VARIANTS:
        print(f"training step {name:>8}: {tr['seconds_per_step'][name] * 1e3:7.1f} ms "
              f"({tr['tokens_per_s'][name]:,.0f} tokens/s, mean loss {tr['mean_loss_last_round'][name]:.4f})")
    print(f"bf16 step time over float32's: {tr['bf16_over_f32_step']:.2f}; load {load}")
    write_metrics(args.metrics_json, _flat({**figures, "load": load}))
    if args.write_result:
        from results import write_result
        print(f"wrote {write_result('bench_bf16', figures, seeds=[0], load=load)}")
    return 0


def _flat(figures: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a_b": 1}``; lists joined with commas."""
    out = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}_"))
        else:
            out[f"{prefix}{key}"] = ",".join(map(str, value)) if isinstance(value, list) else value
    return out


def _cpu_bf16_units() -> list[str]:
    """The processor's bf16 dot-product features from ``/proc/cpuinfo`` (empty elsewhere)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return []
    flags = next((line.split(":", 1)[1].split() for line in path.read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx_ne_convert"))


if __name__ == "__main__":
    sys.exit(main())
