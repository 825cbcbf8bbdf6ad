"""Scale benchmark: throughput against device count, peak memory against corpus size, and the
cost of the explicit solve against one epoch of backprop — all measured in one run.

Each measurement runs in a fresh worker process (so forced CPU device counts, set through
``XLA_FLAGS`` before JAX starts, and peak resident memory are per measurement):

* statistics passes (unigram + offsets, M = 8) and training steps, on 1, 2 and 4 devices;
* peak memory (max RSS) of a statistics pass plus training steps over 0.25×, 0.5× and 1× of
  the training split, and the statistics throughput per token at each size;
* the explicit SAFFU solve, against one epoch of backprop estimated from the measured
  training throughput.

    python experiments/bench_scale.py --workdir runs/babylm --metrics-json runs/scale.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from saffu._io import SaffuError
from saffu.flags import script_options


def worker(task: dict) -> dict:
    import jax
    import numpy as np

    from saffu import offset_cooccurrence, open_workdir, sparse_bit_cipher, unigram_counts
    from saffu.engine.accumulators import accumulate_states
    from saffu.engine.distributed import local_mesh
    from saffu.models.saffu import SaffuConfig, init_params
    from saffu.solve.stack import solve_explicit
    from saffu.training.trainer import TrainConfig, data_parallel_mesh, train

    workdir = open_workdir(task["workdir"])
    stream = np.asarray(workdir.tokens(workdir.train_split))
    stream = stream[: max(int(len(stream) * task.get("fraction", 1.0)), 2)]
    config = SaffuConfig(vocab_size=workdir.vocab_size)
    out = {"devices": len(jax.local_devices()), "tokens": len(stream) - 1}
    if task["kind"] in ("statistics", "memory"):
        acc = {"u": unigram_counts(config.vocab_size),
               "o": offset_cooccurrence(sparse_bit_cipher(config.vocab_size, config.bits), config.vocab_size, 8)}
        accumulate_states(stream[:70_000], acc, progress=None, mesh=local_mesh())       # compile
        start = time.perf_counter()
        accumulate_states(stream, acc, progress=None, mesh=local_mesh())
        out["statistics_seconds"] = time.perf_counter() - start
        out["statistics_tokens_per_s"] = (len(stream) - 1) / out["statistics_seconds"]
    if task["kind"] in ("training", "memory"):
        steps = task.get("steps", 12)
        mesh = data_parallel_mesh() if out["devices"] > 1 else None
        params = init_params(config, jax.random.key(0))
        run = Path(task["scratch"]) / f"run_{os.getpid()}"

        def timed(n, name):  # wall time of a whole call; each call compiles once
            settings = TrainConfig(steps=n, batch_size=16, seq_len=256, eval_every=10_000, checkpoint_every=10_000)
            tick = time.perf_counter()
            train(config, params, stream, settings, run.with_name(f"{run.name}_{name}"), progress=False, mesh=mesh)
            return time.perf_counter() - tick

        # steady state: the difference of two runs cancels compilation and checkpointing
        out["train_tokens_per_s"] = (steps - 1) * 16 * 256 / max(timed(steps, "n") - timed(1, "1"), 1e-9)
    if task["kind"] == "solve":
        _, report = solve_explicit(workdir, config, progress=False)
        out["solve_seconds"] = report["seconds"]
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_worker(task: dict, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(task)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclasses.dataclass
class Options:
    """The benchmark's inputs and outputs.

    Attributes:
      workdir: a prepared work directory
      scratch: folder of the workers' training runs
      metrics_json: write the figures as a JSON object here
      worker: one measurement's task, as JSON (the script's own worker processes)
    """

    workdir: Path | None = None
    scratch: Path = Path("runs/scale_scratch")
    metrics_json: Path | None = None
    worker: str | None = dataclasses.field(default=None, metadata={"hidden": True})


def _check(options: Options) -> None:
    if not options.worker and options.workdir is None:
        raise SaffuError("--workdir is required")


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0], check=_check)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    base = {"workdir": str(args.workdir), "scratch": str(args.scratch)}
    metrics: dict = {}
    for devices in (1, 2, 4):
        stats = run_worker({**base, "kind": "statistics"}, devices)
        training = run_worker({**base, "kind": "training"}, devices)
        metrics[f"statistics_tokens_per_s_{devices}dev"] = stats["statistics_tokens_per_s"]
        metrics[f"train_tokens_per_s_{devices}dev"] = training["train_tokens_per_s"]
        print(f"{devices} device(s): statistics {stats['statistics_tokens_per_s']:>12,.0f} tok/s   "
              f"training {training['train_tokens_per_s']:>8,.0f} tok/s")
    seconds = {}
    for fraction in (0.25, 0.5, 1.0):
        memory = run_worker({**base, "kind": "memory", "fraction": fraction}, 1)
        key = str(fraction).replace(".", "_")
        seconds[fraction] = (memory["tokens"], memory["statistics_seconds"])
        metrics[f"peak_rss_mb_{key}x"] = memory["peak_rss_mb"]
        metrics[f"statistics_tokens_per_s_{key}x"] = memory["statistics_tokens_per_s"]
        print(f"{fraction:4.2f}x of the training split ({memory['tokens']:,} tokens): peak RSS "
              f"{memory['peak_rss_mb']:7.1f} MB, statistics {memory['statistics_tokens_per_s']:>12,.0f} tok/s")
    metrics["peak_rss_ratio_1x_over_0_25x"] = metrics["peak_rss_mb_1_0x"] / metrics["peak_rss_mb_0_25x"]
    metrics["statistics_throughput_ratio_1x_over_0_25x"] = (metrics["statistics_tokens_per_s_1_0x"]
                                                           / metrics["statistics_tokens_per_s_0_25x"])
    # marginal throughput (cost of each further token, without the fixed per-pass cost of
    # allocating and reading back the state) between 0.25x-0.5x and 0.5x-1x
    (t1, s1), (t2, s2), (t4, s4) = seconds[0.25], seconds[0.5], seconds[1.0]
    metrics["statistics_marginal_ratio"] = ((t4 - t2) / max(s4 - s2, 1e-9)) / ((t2 - t1) / max(s2 - s1, 1e-9))
    metrics["statistics_fixed_seconds_per_pass"] = s1 - (s2 - s1)
    solve = run_worker({**base, "kind": "solve"}, 1)
    from saffu import open_workdir
    epoch_tokens = len(open_workdir(args.workdir).tokens(open_workdir(args.workdir).train_split)) - 1
    epoch_seconds = epoch_tokens / metrics["train_tokens_per_s_1dev"]
    metrics.update(solve_seconds=solve["solve_seconds"], epoch_backprop_seconds_estimated=epoch_seconds,
                   solve_over_epoch=solve["solve_seconds"] / epoch_seconds)
    print(f"peak RSS 1x / 0.25x = {metrics['peak_rss_ratio_1x_over_0_25x']:.3f} (goal: within 1.15); "
          f"statistics throughput 1x / 0.25x = {metrics['statistics_throughput_ratio_1x_over_0_25x']:.3f} "
          f"(goal: within 0.8-1.2); marginal throughput ratio {metrics['statistics_marginal_ratio']:.3f}, "
          f"fixed cost per pass ~{metrics['statistics_fixed_seconds_per_pass']:.3f} s")
    print(f"explicit solve {solve['solve_seconds']:.1f} s vs one epoch of backprop ~{epoch_seconds:.0f} s "
          f"(from {metrics['train_tokens_per_s_1dev']:,.0f} tok/s): ratio {metrics['solve_over_epoch']:.3f} (goal ≤ 0.05)")
    if args.metrics_json:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
