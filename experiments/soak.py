"""Soak: does a long training run (many epochs), and a run stopped and resumed many times in one
process, keep its resident memory flat and its metrics file consistent?

* ``epochs``: one run of ``--epochs`` epochs of the default corpus (evaluation and checkpoint
  every ``--every`` steps); the resident set size (current, not peak) after every evaluation.
* ``resumes``: the same model and steps, stopped right after each of ``--resumes`` checkpoints
  (as a kill would stop it) and resumed by calling the trainer again in the same process; the
  resident set size after every resume. Its final parameters must equal the uninterrupted
  run's bit for bit, and its ``metrics.jsonl`` must hold each evaluation step once, in order,
  the same records as the uninterrupted run's (timings aside).

Writes ``results/soak.json`` (figures, command, date, seed, machine, load) and prints a summary.

    python experiments/soak.py --epochs 20 --resumes 40
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import tempfile
import time
from pathlib import Path

import numpy as np

from saffu.eval.bench import Watch
from saffu.flags import script_main, script_options
from saffu.models.interface import model_init
from saffu.runner import history, prepared, write_result

RESULTS = Path(__file__).resolve().parents[1] / "results"

#: Fields of a metrics record that are timings or memory, not results.
VOLATILE = ("seconds", "tokens_per_s", "peak_rss_mb", "device_peak_mb")


def memory(name: str, rss: list[float], per: str) -> dict:
    """The figures of the resident set sizes ``rss`` (MB, one per evaluation or resume ``per``) of
    the run ``name``: the first, last and largest, and over the second half (after warm-up:
    compilation, first allocations) the growth and the slope of a straight line fitted to it."""
    half = rss[len(rss) // 2:]
    slope = float(np.polyfit(np.arange(len(half)), half, 1)[0]) if len(half) > 1 else 0.0
    return {f"{name}_rss_first_mb": rss[0], f"{name}_rss_last_mb": rss[-1], f"{name}_rss_max_mb": max(rss),
            f"{name}_rss_second_half_growth_mb": half[-1] - half[0],
            f"{name}_rss_second_half_slope_mb_per_{per}": slope}


class Stop(Exception):
    """Raised right after a checkpoint: the run stops as a kill would stop it there."""


@dataclasses.dataclass
class Options:
    """The soak's runs.

    Attributes:
      workdir: a prepared work directory (default: the embedded corpus, prepared into a temporary folder)
      epochs: epochs of the long run
      resumes: stops and resumes of the resumed run
      every: steps between evaluations and checkpoints of the long run
      resume_every: steps between the resumed run's stops
      width: transformer width
      seed: the seed of both runs
      write: write results/soak.json (--no-write: print only)
    """

    workdir: Path | None = None
    epochs: int = 20
    resumes: int = 40
    every: int = 100
    resume_every: int = 10
    width: int = 32
    seed: int = 0
    write: bool = True


def main(argv=None):
    args = script_options(Options, argv, __doc__.splitlines()[0])

    import jax

    from saffu import open_workdir
    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.engine.accounting import rss_mb
    from saffu.training import trainer
    from saffu.training.checkpoints import load_params

    watch = Watch()         # the load averages before and after
    scratch = tempfile.TemporaryDirectory(prefix="saffu-soak-")
    root = Path(scratch.name)
    workdir = open_workdir(args.workdir or prepared(root / "work"))
    model = TransformerConfig(workdir.vocab_size, width=args.width, layers=2, heads=2, context_tokens=16, max_len=96,
                              block="gpt", output_bias=True, across_documents=False)
    stream, dev = workdir.tokens(workdir.train_split), workdir.tokens("dev")
    base = TrainConfig(batch_size=16, seq_len=64, eval_every=args.every, checkpoint_every=args.every,
                       eval_windows=16, seed=args.seed)
    per_epoch = trainer.steps_per_epoch(len(stream) - 1, base)
    params = model_init(model, jax.random.key(args.seed))

    # the long run: RSS after each evaluation
    long_config = TrainConfig(**{**base.__dict__, "steps": args.epochs * per_epoch})
    rss_long = []
    tick = time.perf_counter()
    trainer.train(model, params, stream, long_config, root / "long", dev_stream=dev, progress=False,
                  on_eval=lambda record: rss_long.append(rss_mb()))
    long_seconds = time.perf_counter() - tick

    # the same steps, stopped after every ``--resumes``-th share of them and resumed in-process
    steps = args.resumes * args.resume_every
    config = TrainConfig(**{**base.__dict__, "steps": steps, "eval_every": args.resume_every,
                            "checkpoint_every": args.resume_every})
    straight, _ = trainer.train(model, params, stream, config, root / "straight", dev_stream=dev, progress=False)
    real_save, target = trainer.save_training_state, {"step": 0}

    def save_then_stop(manager, step, *rest):
        real_save(manager, step, *rest)
        if step == target["step"] and step < steps:
            raise Stop
    trainer.save_training_state = save_then_stop
    rss_resumes = []
    for i in range(1, args.resumes + 1):
        target["step"] = i * args.resume_every
        with contextlib.suppress(Stop):
            trainer.train(model, params, stream, config, root / "resumed", dev_stream=dev, progress=False)
        rss_resumes.append(rss_mb())
    trainer.save_training_state = real_save
    resumed, _ = load_params(root / "resumed", model)
    identical = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)))
    strip = lambda lines: [{k: v for k, v in r.items() if k not in VOLATILE} for r in lines]
    lines = history(root / "resumed")
    eval_steps = [r["step"] for r in lines]
    consistent = (eval_steps == list(range(0, steps + 1, args.resume_every))
                  and strip(lines) == strip(history(root / "straight")))
    long_steps = [r["step"] for r in history(root / "long")]

    figures = {
        "long_epochs": args.epochs, "long_steps": args.epochs * per_epoch, "long_seconds": long_seconds,
        "long_evaluations": len(rss_long), **memory("long", rss_long, "eval"),
        "long_metrics_consistent": long_steps == sorted(set(long_steps)),
        "resumes": args.resumes, "resume_steps": steps, **memory("resume", rss_resumes, "resume"),
        "resumed_equals_uninterrupted": identical, "resumed_metrics_consistent": consistent,
        "model": f"transformer width {args.width}, 2 layers, vocabulary {workdir.vocab_size}",
        "corpus": workdir.meta["corpus"], "train_tokens": int(len(stream)),
    }
    for key, value in figures.items():
        print(f"  {key:<44} {value:.2f}" if isinstance(value, float) else f"  {key:<44} {value}")
    if args.write:
        path = write_result(RESULTS, "soak", {**figures, "rss_long_mb": rss_long, "rss_resumes_mb": rss_resumes},
                            seeds=[args.seed], load=watch.load(),
                            started=datetime.datetime.fromtimestamp(watch.started, datetime.UTC))
        print(f"written to {path}")
    scratch.cleanup()
    return 0 if identical and consistent and figures["long_metrics_consistent"] else 1


if __name__ == "__main__":
    script_main(main)
