"""One trainer for warm start (explicit init) and cold start (random init), with optax.

AdamW with linear warm-up + cosine decay, global-norm clipping, fixed-shape batches of
windows (``int32[B, R + T]``), one jitted step, periodic dev evaluation, orbax checkpoints
and exact resume: the batch of step ``i`` is a pure function of ``(seed, i)`` and the
checkpoint holds the step, the parameters and the optimizer state, so a resumed run continues
with the same data, RNG and optimizer state as an uninterrupted one. ``init`` is the only
difference between warm and cold start.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from saffu import accounting
from saffu._io import SaffuError
from saffu.batches import shuffled_window_starts, stack_windows
from saffu.configs import TrainConfig
from saffu.model import Params, SaffuConfig, window_loss
from saffu.statistics import local_mesh

INITS = ("explicit", "random")


def make_optimizer(config: TrainConfig, steps: int) -> optax.GradientTransformation:
    warmup = min(config.warmup_steps, steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, max(steps, warmup + 1))
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.adamw(schedule, eps=config.adam_eps, weight_decay=config.weight_decay))


def steps_per_epoch(num_targets: int, config: TrainConfig) -> int:
    return max(num_targets // (config.seq_len * config.batch_size), 1)


def run_steps(train_stream: np.ndarray, config: TrainConfig) -> int:
    """The optimizer steps of a run on ``train_stream``: ``config.steps``, or one epoch for 0."""
    return config.steps or steps_per_epoch(len(train_stream) - 1, config)


class BatchSchedule:
    """The batch of every step as a pure function of ``(seed, step)``: windows in a seeded
    shuffled order per epoch, so resuming at step ``i`` sees exactly the data it would have."""

    def __init__(self, stream: np.ndarray, model: SaffuConfig, config: TrainConfig):
        self.stream, self.model, self.config = stream, model, config
        self.per_epoch = steps_per_epoch(len(stream) - 1, config)
        self._key = jax.random.fold_in(jax.random.key(config.seed), 1)  # data stream of the seed
        self._epoch, self._starts = -1, None

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._starts = shuffled_window_starts(1, len(self.stream), self.config.seq_len,
                                                  jax.random.fold_in(self._key, epoch))
        starts = self._starts[index * self.config.batch_size:(index + 1) * self.config.batch_size]
        return stack_windows(self.stream, starts, [len(self.stream)] * len(starts), self.model.context,
                             self.config.seq_len)


def evenly_spaced_windows(stream: np.ndarray, model: SaffuConfig, seq_len: int, count: int):
    """``count`` non-overlapping windows spread evenly over the whole stream (a dev subset
    that samples every file, not only the first)."""
    last = max(len(stream) - seq_len, 1)
    starts = np.unique(np.linspace(1, last, min(count, max(last // seq_len, 1))).astype(int))
    windows, mask = stack_windows(stream, starts, [len(stream)] * len(starts), model.context, seq_len)
    return jnp.asarray(windows), jnp.asarray(mask)


def _checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False))


def data_parallel_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D ``("data",)`` mesh over the first ``num_devices`` local devices (all by default)."""
    return local_mesh(num_devices, axis_name="data")


def train(model, params: Params, train_stream: np.ndarray, config: TrainConfig,
          run_dir: str | Path, dev_stream: np.ndarray | None = None,
          on_eval: Callable[[dict], None] | None = None, progress: bool = True,
          mesh: Mesh | None = None) -> tuple[Params, list[dict]]:
    """Train ``params`` (explicit or random init) of ``model`` — a :class:`SaffuConfig` or
    any config with the same interface (``context``, ``logits``, ``forward_flops``, e.g. the
    transformer's) — and checkpoint into ``run_dir/checkpoints``.

    If ``run_dir`` already holds checkpoints of this run, training resumes from the latest
    one. Each evaluation appends one JSON line to ``run_dir/metrics.jsonl`` with ``step``,
    ``tokens``, ``seconds`` (training time, evaluation excluded), ``tokens_per_s``, ``flops``
    (analytic: 3 × the model's forward FLOPs per trained token), ``xla_flops`` (XLA's count of
    one compiled step × steps; None where the backend has no cost analysis), ``peak_rss_mb``
    (and ``device_peak_mb`` on accelerators), ``train_loss``, ``dev_loss`` (nats/token on the evenly spaced dev windows) and
    ``skipped_steps`` (non-finite steps skipped by this call, with ``on_nonfinite="skip"``).

    With a ``mesh`` (see :func:`data_parallel_mesh`) each batch is split over its ``"data"``
    axis and the parameters and optimizer state are replicated; XLA inserts the gradient
    all-reduce. The same code runs on one CPU, several forced CPU devices, a GPU or a TPU slice.

    Returns the final parameters and the evaluation history of this call.
    """
    run_dir = Path(run_dir)
    steps = run_steps(train_stream, config)
    optimizer = make_optimizer(config, steps)
    schedule = BatchSchedule(train_stream, model, config)
    frozen = set(config.freeze)

    def loss_fn(p, windows, mask):
        nll, count = window_loss(p, model, windows, mask)
        return nll / jnp.maximum(count, 1)

    @jax.jit
    def train_step(p, opt_state, step, windows, mask):
        loss, grads = jax.value_and_grad(loss_fn)(p, windows, mask)
        updates, new_opt_state = optimizer.update(grads, opt_state, p)
        if frozen:
            keep = step >= config.thaw_step
            updates = jax.tree_util.tree_map_with_path(
                lambda path, u: jnp.where(keep, u, 0.0) if path[-1].key in frozen else u, updates)
        finite = jnp.isfinite(loss) & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        # a non-finite step is never applied: parameters and optimizer state stay as they were
        new_p = jax.tree.map(lambda new, old: jnp.where(finite, new, old), optax.apply_updates(p, updates), p)
        new_opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_opt_state, opt_state)
        return new_p, new_opt_state, loss, finite

    eval_batch = None if dev_stream is None else evenly_spaced_windows(dev_stream, model, config.seq_len,
                                                                       config.eval_windows)
    dev_loss_fn = jax.jit(lambda p, w, m: window_loss(p, model, w, m))

    def dev_loss(p):
        """Mean NLL of the dev windows, ``batch_size`` windows per call (the logits of all of
        them at once would dominate peak memory: 256 × 256 × V floats)."""
        windows, mask = eval_batch
        size = config.batch_size
        pad = -len(windows) % size
        if pad:   # fully masked filler windows keep one compiled shape
            windows = jnp.concatenate([windows, jnp.zeros((pad,) + windows.shape[1:], windows.dtype)])
            mask = jnp.concatenate([mask, jnp.zeros((pad,) + mask.shape[1:], bool)])
        totals = [dev_loss_fn(p, windows[i:i + size], mask[i:i + size]) for i in range(0, len(windows), size)]
        return sum(float(nll) for nll, _ in totals) / sum(float(count) for _, count in totals)

    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
    manager = _checkpoint_manager(run_dir / "checkpoints")
    metrics_path = run_dir / "metrics.jsonl"
    seconds = 0.0
    if manager.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        try:
            state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
        except Exception as err:  # orbax raises several types for unreadable / mismatched trees
            step_dir = run_dir / "checkpoints" / str(manager.latest_step())
            raise SaffuError(f"cannot resume from {step_dir} ({type(err).__name__}); it is from another model "
                             f"or damaged: delete {step_dir} to resume from the checkpoint before it, or use a "
                             f"new --run directory") from None
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        kept = [line for line in lines if json.loads(line)["step"] <= int(state["step"])]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        seconds = json.loads(kept[-1])["seconds"] if kept else 0.0
    params, opt_state, start = state["params"], state["opt_state"], int(state["step"])
    seconds_at_start = seconds   # tokens/s counts this call's steps over this call's seconds
    if mesh is not None:
        if config.batch_size % mesh.devices.size:
            raise SaffuError(f"--batch-size {config.batch_size} must be a multiple of the {mesh.devices.size} devices")
        replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        params, opt_state = jax.device_put((params, opt_state), replicated)
        put_batch = lambda array: jax.device_put(array, split)
    else:
        put_batch = jnp.asarray

    history: list[dict] = []
    skipped = 0
    tokens_per_step = config.batch_size * config.seq_len
    # ahead-of-time compilation: XLA's FLOP count of one step comes with the one compilation
    first_windows, first_mask = schedule(min(start, steps - 1))
    compiled_step = train_step.lower(params, opt_state, jnp.asarray(start), put_batch(first_windows),
                                     put_batch(first_mask)).compile()
    step_xla_flops = accounting.xla_flops(compiled_step)
    step_flops = accounting.training_flops(model, tokens_per_step, config.seq_len)

    def evaluate(step, recent):
        if eval_batch is None:
            return
        record = {"step": step, "tokens": step * tokens_per_step, "seconds": seconds,
                  "tokens_per_s": (step - start) * tokens_per_step / max(seconds - seconds_at_start, 1e-9)
                  if step > start else math.nan,
                  "flops": step * step_flops,
                  "xla_flops": None if step_xla_flops is None else step * step_xla_flops,
                  **accounting.memory_record(),
                  "train_loss": float(np.mean(recent)) if recent else math.nan, "dev_loss": dev_loss(params),
                  "skipped_steps": skipped}
        history.append(record)
        with open(metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if on_eval:
            on_eval(record)

    if start == 0:
        evaluate(0, [])
    recent: list[float] = []
    for step in tqdm(range(start, steps), initial=start, total=steps, desc="train", disable=not progress,
                     leave=False):
        windows, mask = schedule(step)
        tick = time.perf_counter()
        params, opt_state, loss, finite = compiled_step(params, opt_state, jnp.asarray(step), put_batch(windows),
                                                        put_batch(mask))
        loss, finite = float(loss), bool(finite)  # synchronises, so the timing is honest
        seconds += time.perf_counter() - tick
        if not finite:
            if config.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite loss or gradient at step {step + 1} (loss {loss}); the step was not applied "
                    f"and the last checkpoint is intact: lower --learning-rate or use --on-nonfinite skip")
            skipped += 1
        else:
            recent.append(loss)
        done = step + 1
        if done % config.eval_every == 0 or done == steps:
            evaluate(done, recent)
            recent = []
        if done % config.checkpoint_every == 0 or done == steps:
            manager.save(done, args=ocp.args.StandardSave(
                {"step": jnp.asarray(done, jnp.int32), "params": params, "opt_state": opt_state}))
    manager.wait_until_finished()
    manager.close()
    return params, history


def latest_checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the latest training checkpoint in ``run_dir/checkpoints``, or None."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return None
    manager = _checkpoint_manager(directory)
    try:
        return manager.latest_step()
    finally:
        manager.close()


def load_latest_params(run_dir: str | Path, template: Params) -> tuple[Params, int] | None:
    """The parameters of the latest training checkpoint in ``run_dir`` and its step, or None."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.exists():
        return None
    manager = _checkpoint_manager(directory)
    step = manager.latest_step()
    if step is None:
        return None
    try:
        state = manager.restore(step, args=ocp.args.StandardRestore())
        return retype(state["params"], template), step
    except Exception as err:  # orbax raises several types for unreadable / mismatched trees
        raise SaffuError(f"cannot read the checkpoint of step {step} in {directory} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120]}); it is damaged or from another model: use "
                         f"--checkpoint explicit for the explicit solution, or delete {directory / str(step)} "
                         f"to fall back to the checkpoint before it") from None
    finally:
        manager.close()


def retype(restored: Any, template: Params) -> Params:
    """``restored`` in ``template``'s structure (orbax may turn int keys into strings);
    a clear error when shapes differ (a checkpoint of another model)."""
    if isinstance(template, dict):
        if not isinstance(restored, dict):
            raise SaffuError("checkpoint structure differs from the model's; it is from another model")
        out = {}
        for key, value in template.items():
            found = restored.get(key, restored.get(str(key)))
            if found is None:
                raise SaffuError(f"checkpoint lacks parameter {key!r}; it is from another model")
            out[key] = retype(found, value)
        return out
    array = jnp.asarray(restored)
    if array.shape != np.shape(template):
        raise SaffuError(f"checkpoint parameter has shape {array.shape}, the model needs {np.shape(template)}; "
                         f"it is from another model")
    return array
