"""Benchmark: a training step of the explicit residual against the same plain transformer.

Both models are built as the training recipes build them (:func:`saffu.training.recipes.
residual_start` over a ``saffu exact`` run, the transformer of the same config alone), their
jitted training steps (:func:`saffu.training.trainer.make_train_step`, AdamW) compiled first,
then timed side by side in one process, alternating one step of each per round, on the same
real batches of the work directory's training split; the medians and their ratio
(residual / transformer) are reported with the load average. Each model's peak resident memory
is measured in a subprocess of its own (``resource.getrusage``: build, compile and a few steps),
with XLA's own account of the compiled step (argument and temporary bytes).

    python experiments/bench_residual.py --workdir runs/babylm --exact-run runs/budgets/exact/1 \\
        --metrics-json runs/bench_residual.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from saffu.flags import script_options

KINDS = ("transformer", "residual")


@dataclasses.dataclass
class Options:
    """The models, the batches and the timing.

    Attributes:
      workdir: prepared work directory
      exact_run: `saffu exact` run the residual is built over (made there first when it does not exist)
      width: transformer width
      layers: transformer layers
      batch_size: windows per step
      seq_len: targets per window
      scale: the residual's λ
      rounds: timed rounds (one step of each model per round)
      rss_steps: steps each memory subprocess runs after compiling
      child: internal: the model whose memory this subprocess measures
      metrics_json: write the figures here as JSON
    """

    workdir: Path = Path("runs/babylm")
    exact_run: Path = Path("runs/budgets/exact/1")
    width: int = 128
    layers: int = 5
    batch_size: int = 16
    seq_len: int = 256
    scale: str = dataclasses.field(default="fixed", metadata={"choices": ("fixed", "learned")})
    rounds: int = 8
    rss_steps: int = 3
    child: str | None = dataclasses.field(default=None, metadata={"choices": KINDS, "hidden": True})
    metrics_json: Path | None = None


def build(args, kind: str):
    """``(model config, trained params, fixed inputs, train config)`` of ``kind``."""
    import jax

    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.data.workdir import open_workdir
    from saffu.models.interface import model_init
    from saffu.training.recipes import residual_start
    workdir = open_workdir(args.workdir)
    base = TransformerConfig(workdir.vocab_size, width=args.width, layers=args.layers, block="gpt", output_bias=True)
    train = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    key = jax.random.key(0)
    if kind == "transformer":
        return base, model_init(base, key), {}, train
    config, params = residual_start(base, args.exact_run, key, scale=args.scale)
    names = set(config.fixed_params)
    return (config, {k: v for k, v in params.items() if k not in names},
            {k: v for k, v in params.items() if k in names}, train)


class Stepper:
    """One model's compiled training step over a fixed list of real batches."""

    def __init__(self, args, kind: str, batches: int = 4):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from saffu.data.workdir import open_workdir
        from saffu.training.trainer import BatchSchedule, StepStats, make_optimizer, make_train_step
        self.model, params, self.fixed, train = build(args, kind)
        stream = np.asarray(open_workdir(args.workdir).tokens("train_10M"))
        schedule = BatchSchedule(stream, self.model, train)
        self.batches = [jax.device_put(schedule(i)) for i in range(batches)]
        optimizer = make_optimizer(train, 1000)
        self.params = jax.tree.map(jnp.array, params)
        self.opt_state, self.stats = optimizer.init(self.params), StepStats.zeros()
        tick = time.perf_counter()
        lowered = make_train_step(self.model, optimizer, train).lower(
            self.params, self.opt_state, self.stats, jnp.asarray(0), *self.batches[0], self.fixed)
        self.step_fn = lowered.compile()
        self.compile_seconds = time.perf_counter() - tick
        memory = self.step_fn.memory_analysis()
        self.xla_bytes = None if memory is None else {
            "arguments": int(memory.argument_size_in_bytes), "temporaries": int(memory.temp_size_in_bytes),
            "outputs": int(memory.output_size_in_bytes)}
        self.count = 0

    def step(self) -> float:
        """Run one step (to completion); its wall seconds."""
        import jax
        import jax.numpy as jnp
        windows, mask = self.batches[self.count % len(self.batches)]
        tick = time.perf_counter()
        self.params, self.opt_state, self.stats = self.step_fn(self.params, self.opt_state, self.stats,
                                                               jnp.asarray(self.count), windows, mask, self.fixed)
        jax.block_until_ready(self.stats)
        self.count += 1
        return time.perf_counter() - tick

    def mean_loss(self) -> float:
        return float(self.stats.loss_sum) / max(int(self.stats.applied), 1)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, GiB (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def child(args) -> dict:
    """Peak RSS of building, compiling and running ``args.child``'s step (this process alone;
    started before the parent allocates anything large, since a child inherits its parent's
    high-water mark at the fork)."""
    stepper = Stepper(args, args.child)
    compiled = peak_rss_gb()
    seconds = [stepper.step() for _ in range(args.rss_steps)]
    return {"kind": args.child, "peak_rss_gb": peak_rss_gb(), "peak_rss_gb_until_compiled": compiled,
            "xla_bytes": stepper.xla_bytes, "compile_seconds": stepper.compile_seconds, "step_seconds": seconds,
            "mean_loss": stepper.mean_loss()}


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from saffu._io import SaffuError
    from saffu.runner import exact_run
    try:
        exact_run(args.workdir, args.exact_run)      # what the residual reads: made here on a fresh clone
    except SaffuError as err:
        raise SystemExit(f"--exact-run: {err}") from None
    result = {"command": " ".join([sys.executable, *sys.argv]), "load_average_before": os.getloadavg()}
    forwarded = list(sys.argv[1:])      # the memory first, while this process is small (see :func:`child`)
    if "--metrics-json" in forwarded:
        i = forwarded.index("--metrics-json")
        forwarded = forwarded[:i] + forwarded[i + 2:]
    rss = {}
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, *forwarded, "--child", kind], check=True,
                             capture_output=True, text=True).stdout
        rss[kind] = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_gb"] = {k: v["peak_rss_gb"] for k, v in rss.items()}
    result["peak_rss_extra_gb"] = rss["residual"]["peak_rss_gb"] - rss["transformer"]["peak_rss_gb"]
    result["subprocess"] = rss
    result["load_average_before_timing"] = os.getloadavg()
    steppers = {kind: Stepper(args, kind) for kind in KINDS}
    for stepper in steppers.values():          # one warm step each (first-run allocations)
        stepper.step()
    times = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        order = KINDS if r % 2 == 0 else KINDS[::-1]
        for kind in order:
            times[kind].append(steppers[kind].step())
    medians = {kind: statistics.median(t) for kind, t in times.items()}
    tokens = args.batch_size * args.seq_len
    result.update({
        "load_average_after": os.getloadavg(), "rounds": args.rounds, "tokens_per_step": tokens,
        "step_seconds": times, "median_step_seconds": medians,
        "min_step_seconds": {kind: min(t) for kind, t in times.items()},
        "step_time_ratio_of_minima": min(times["residual"]) / min(times["transformer"]),
        "tokens_per_second": {k: tokens / m for k, m in medians.items()},
        "step_time_ratio": medians["residual"] / medians["transformer"],
        "xla_bytes": {k: s.xla_bytes for k, s in steppers.items()},
        "compile_seconds": {k: s.compile_seconds for k, s in steppers.items()},
        "mean_loss": {k: s.mean_loss() for k, s in steppers.items()}})
    print(json.dumps({k: v for k, v in result.items() if k not in ("step_seconds", "subprocess")}, indent=1))
    if args.metrics_json:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
