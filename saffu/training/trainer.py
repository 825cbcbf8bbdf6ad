"""The one trainer of every model (SAFFU, the transformer, the bigram layer), with optax.

Warm start (explicit init) and cold start (random init) differ only in the parameters passed
in. AdamW with linear warm-up + cosine decay, global-norm clipping, fixed-shape batches of
windows (``int32[B, R + T]``), one compiled step, periodic dev evaluation, orbax checkpoints
and exact resume: the batch of step ``i`` is a pure function of ``(seed, i)`` and the
checkpoint holds the step, the parameters and the optimizer state, so a resumed run continues
with the same data, RNG and optimizer state as an uninterrupted one.

Accelerator habits: the step donates the parameters and optimizer state (updated in place);
the next batch is put on the device while the current step runs; the host reads the loss
only every ``log_every`` steps (and at evaluations and checkpoints), so the device runs
ahead; ``compute_dtype="bfloat16"`` runs the forward and backward passes in bf16 with float32
master weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from saffu._io import SaffuError, check_free, disk_full_error, exclusive, is_disk_full, megabytes
from saffu.configs import TrainConfig
from saffu.data.folds import fold_window_starts
from saffu.data.windows import evenly_spaced_windows, shuffled_window_starts, stack_windows
from saffu.engine import accounting
from saffu.engine.distributed import global_mesh, is_writer, local_copy, local_mesh, put_global, sum_over_processes
from saffu.models.interface import Params, target_loss
from saffu.models.transformer import Dropout
from saffu.training.checkpoints import (
    WordCount,
    checkpoint_manager,
    remove_failed_save,
    remove_stale_temporaries,
    restore_training_state,
    save_training_state,
    save_words,
    tree_bytes,
    word_milestones,
    words_index,
    words_manager,
)

#: Any model config with the shared interface (:mod:`saffu.models.interface`).
Model = object


def make_optimizer(config: TrainConfig, steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a linear warm-up + cosine decay schedule.

    With ``config.freeze``, the named parameters' Adam moments stay at zero until
    ``thaw_step`` (an ``optax.multi_transform`` whose frozen part is :func:`wait_until`), so a
    thawed parameter starts Adam afresh rather than from moments gathered while it could not
    move; the learning-rate schedule and the weight decay stay on the global step. (The step
    also zeroes the frozen parameters' updates, weight decay included.)"""
    warmup = min(config.warmup_steps, steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, max(steps, warmup + 1))
    if not config.freeze:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                           optax.adamw(schedule, eps=config.adam_eps, weight_decay=config.weight_decay))
    frozen = set(config.freeze)
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if getattr(path[-1], "key", None) in frozen else "free", params)
    adam = optax.scale_by_adam(eps=config.adam_eps)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.multi_transform({"free": adam, "frozen": wait_until(config.thaw_step, adam)}, labels),
                       optax.add_decayed_weights(config.weight_decay),
                       optax.scale_by_learning_rate(schedule))


class WaitState(NamedTuple):
    inner: optax.OptState
    count: jax.Array


def wait_until(step: int, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` from update ``step`` on; before it, zero updates and ``inner``'s state kept as
    initialised (no moment accumulates)."""
    def init(params):
        return WaitState(inner.init(params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        new_updates, new_inner = inner.update(updates, state.inner, params)
        active = state.count >= step
        new_updates = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(active, new, old), new_inner, state.inner)
        return new_updates, WaitState(new_inner, state.count + 1)

    return optax.GradientTransformation(init, update)


def steps_per_epoch(num_targets: int, config: TrainConfig) -> int:
    """Steps that see ``num_targets`` targets once (at least 1)."""
    return max(num_targets // (config.seq_len * config.batch_size), 1)


def run_steps(train_stream: np.ndarray, config: TrainConfig) -> int:
    """The optimizer steps of a run on ``train_stream``: ``config.steps``, or one epoch for 0."""
    return config.steps or steps_per_epoch(len(train_stream) - 1, config)


class BatchSchedule:
    """The batch of every step as a pure function of ``(seed, step)``: windows in a seeded
    shuffled order per epoch, so resuming at step ``i`` sees exactly the data it would have.

    A cross-fitted residual (a model with ``folds``: one pool of window starts per fold,
    :func:`saffu.data.folds.fold_window_starts`) has step ``s`` draw its windows from pool
    ``s mod K`` only, each pool in its own seeded order per epoch (wrapping around when a pool
    runs short)."""

    def __init__(self, stream: np.ndarray, model: Model, config: TrainConfig):
        self.stream, self.model, self.config = stream, model, config
        self.per_epoch = steps_per_epoch(len(stream) - 1, config)
        self._key = jax.random.fold_in(jax.random.key(config.seed), 1)  # data stream of the seed
        self._epoch, self._starts = -1, None
        folds = getattr(model, "folds", 0)
        pools = fold_window_starts(stream, folds, config.seq_len, model.fold_blocks) if folds else None
        if pools is not None and any(len(pool) == 0 for pool in pools):
            raise SaffuError(f"a fold holds no whole window of {config.seq_len} targets; use a shorter --seq-len "
                             f"or fewer folds")
        self._pools = pools

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, index = divmod(step, self.per_epoch)
        size = self.config.batch_size
        if epoch != self._epoch:
            self._epoch = epoch
            key = jax.random.fold_in(self._key, epoch)
            self._starts = (shuffled_window_starts(1, len(self.stream), self.config.seq_len, key) if self._pools is None
                            else [_permuted(pool, jax.random.fold_in(key, p)) for p, pool in enumerate(self._pools)])
        if self._pools is None:
            starts = self._starts[index * size:(index + 1) * size]
        else:
            pool = self._starts[step % len(self._pools)]
            starts = pool[np.arange(index // len(self._pools) * size, (index // len(self._pools) + 1) * size) % len(pool)]
        return stack_windows(self.stream, starts, [len(self.stream)] * len(starts), self.model.context,
                             self.config.seq_len)


def _permuted(values: np.ndarray, key: jax.Array) -> np.ndarray:
    """``values`` in a seeded random order."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()).permutation(values)


def data_parallel_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D ``("data",)`` mesh over the first ``num_devices`` local devices (all by default);
    in a multi-process job (:func:`saffu.engine.distributed.initialize`) over every device of
    every process (``num_devices`` must then be None)."""
    if jax.process_count() > 1:
        if num_devices is not None:
            raise SaffuError("a multi-process job trains over every device of every process; drop --devices")
        return global_mesh("data")
    return local_mesh(num_devices, axis_name="data")


class StepStats(NamedTuple):
    """Device-side running totals between two host reads (no per-step synchronisation).

    Attributes:
      loss_sum: ``float32[]`` sum of the losses of the applied steps.
      applied: ``int32[]`` steps applied.
      skipped: ``int32[]`` non-finite steps, never applied.
      first_skipped: ``int32[]`` the first skipped step (``-1``: none).
    """

    loss_sum: jax.Array
    applied: jax.Array
    skipped: jax.Array
    first_skipped: jax.Array

    @staticmethod
    def zeros() -> StepStats:
        return StepStats(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                         jnp.full((), -1, jnp.int32))


def _trainable_mask(config: TrainConfig, params: Params, step: jax.Array) -> Params:
    """Per leaf: ``True`` where the update is applied: ``config.freeze`` names wait for
    ``thaw_step`` (the model's ``fixed_params`` are not in the trained tree at all)."""
    frozen = set(config.freeze)

    def keep(path, _):
        name = getattr(path[-1], "key", None)
        if name in frozen:
            return step >= config.thaw_step
        return jnp.asarray(True)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_train_step(model: Model, optimizer: optax.GradientTransformation, config: TrainConfig,
                    mesh: Mesh | None = None) -> Callable:
    """The jitted step ``(params, opt_state, stats, step, windows int32[B, R + T], mask bool[B, T],
    fixed) -> (params, opt_state, stats)``, donating ``params``, ``opt_state`` and ``stats``.
    ``fixed`` holds the model's ``fixed_params`` (inputs: neither differentiated nor updated,
    and never cast to the compute dtype); ``params`` the trained rest.

    ``config.dropout`` drops the transformer's residual branches with masks drawn from
    ``(seed, step)`` (and the device's index under a mesh), so a resumed run draws the same ones.

    The loss is the mean NLL of the batch's targets, computed as scoring computes it
    (:func:`saffu.models.interface.target_loss`: the output layer only where a target is scored,
    ``logsumexp − logit`` instead of a ``V``-wide log-softmax array). A step whose loss or gradients are not
    finite is not applied (parameters and optimizer state are returned unchanged) and is
    counted in ``stats``; the host decides what to do at its next read.

    With a ``mesh`` (:func:`data_parallel_mesh`; the batch split over its ``"data"`` axis, the
    rest replicated) each device computes the summed NLL, target count and gradients of its
    own windows (``jax.shard_map``: no device sees another's activations), and one ``psum``
    adds them up before the (replicated) optimizer update: the same loss and gradients as on
    one device, up to the order of float32 sums.
    """
    compute = jnp.dtype(config.compute_dtype)
    dropout_key = jax.random.fold_in(jax.random.key(config.seed), 2)     # 0: init, 1: data order

    def nll_fn(p, windows, mask, fixed, key):
        if compute != jnp.float32:
            p = jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
        dropout = Dropout(config.dropout, key) if config.dropout else None
        nll, count = target_loss({**p, **fixed}, model, windows, mask, dropout)
        return nll.astype(jnp.float32), count

    def sums(p, windows, mask, fixed, key):
        """``(summed NLL, target count, gradients of the summed NLL)`` of these windows."""
        (nll, count), grads = jax.value_and_grad(nll_fn, has_aux=True)(p, windows, mask, fixed, key)
        return nll, count, grads

    if mesh is not None:
        local, replicated, split = sums, PartitionSpec(), PartitionSpec("data")

        def reduced(p, windows, mask, fixed, key):
            """One all-reduce of one flat vector (NLL, count, every gradient): a collective per
            leaf costs its latency (milliseconds across processes) dozens of times a step. Each
            device draws its own dropout masks."""
            nll, count, grads = local(p, windows, mask, fixed, jax.random.fold_in(key, jax.lax.axis_index("data")))
            flat, unravel = jax.flatten_util.ravel_pytree(grads)
            total = jax.lax.psum(jnp.concatenate([nll[None].astype(flat.dtype), count[None].astype(flat.dtype),
                                                  flat]), "data")
            return total[0], total[1].astype(count.dtype), unravel(total[2:])

        sums = jax.shard_map(reduced, mesh=mesh, in_specs=(replicated, split, split, replicated, replicated),
                             out_specs=replicated, check_vma=False)

    def loss_and_grads(p, windows, mask, fixed, key):
        nll, count, grads = sums(p, windows, mask, fixed, key)
        scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
        return nll * scale, jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)

    def step_fn(p, opt_state, stats: StepStats, step, windows, mask, fixed):
        loss, grads = loss_and_grads(p, windows, mask, fixed, jax.random.fold_in(dropout_key, step))
        updates, new_opt_state = optimizer.update(grads, opt_state, p)
        updates = jax.tree.map(lambda u, keep: jnp.where(keep, u, 0.0), updates,
                               _trainable_mask(config, updates, step))
        finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        # a non-finite step is never applied: parameters and optimizer state stay as they were
        new_p = jax.tree.map(lambda new, old: jnp.where(finite, new, old), optax.apply_updates(p, updates), p)
        new_opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_opt_state, opt_state)
        stats = StepStats(stats.loss_sum + jnp.where(finite, loss, 0.0), stats.applied + finite,
                          stats.skipped + (~finite),
                          jnp.where((stats.first_skipped < 0) & ~finite, step, stats.first_skipped))
        return new_p, new_opt_state, stats

    return jax.jit(step_fn, donate_argnums=(0, 1, 2))


class DevLoss:
    """Mean NLL (nats/token) of ``count`` evenly spaced dev windows ``int32[count, R + T]``,
    ``DEV_BATCH`` windows per call (the logits of all of them at once would dominate peak
    memory: 256 × 256 × V floats; on CPU small calls are also faster per token) with
    :func:`saffu.models.interface.target_loss` (:func:`window_loss`'s values at a forward
    pass's cost); the parameters are a jit argument, so one compilation serves every evaluation.
    In a multi-process job each process scores every ``P``-th call's windows on its own copy of
    the parameters and the sums are added over processes."""

    #: Windows per call.
    DEV_BATCH = 2

    def __init__(self, model: Model, stream: np.ndarray, config: TrainConfig):
        windows, mask = evenly_spaced_windows(stream, model, config.seq_len, config.eval_windows)
        self.size = min(self.DEV_BATCH, config.batch_size)
        pad = -len(windows) % self.size
        if pad:   # fully masked filler windows keep one compiled shape
            windows = jnp.concatenate([windows, jnp.zeros((pad,) + windows.shape[1:], windows.dtype)])
            mask = jnp.concatenate([mask, jnp.zeros((pad,) + mask.shape[1:], bool)])
        self.windows, self.mask = windows, mask
        self._loss = jax.jit(lambda p, w, m: target_loss(p, model, w, m))

    def __call__(self, params: Params) -> float:
        params, share = local_copy(params), range(jax.process_index() * self.size, len(self.windows),
                                                  jax.process_count() * self.size)
        totals = [self._loss(params, self.windows[i:i + self.size], self.mask[i:i + self.size]) for i in share]
        nll, count = (sum(float(nll) for nll, _ in totals), sum(float(count) for _, count in totals))
        if jax.process_count() > 1:
            nll, count = (float(x) for x in sum_over_processes(np.asarray([nll, count], np.float32)))
        return nll / count


class _Meter:
    """Training seconds (evaluation and checkpointing excluded), the losses read since the last
    evaluation and the skipped steps, read from the device's :class:`StepStats`."""

    def __init__(self, seconds: float):
        self.seconds, self.seconds_at_start = seconds, seconds
        self.loss_total, self.applied = 0.0, 0       # since the last evaluation
        self.last_loss = math.nan
        self.skipped = 0
        self._tick = time.perf_counter()

    def read(self, stats: StepStats, config: TrainConfig) -> None:
        """Synchronise with the device (the device time so far counts as training)."""
        loss_sum, applied, skipped, first = (np.asarray(x) for x in jax.device_get(stats))
        self.seconds += time.perf_counter() - self._tick
        if applied:
            self.loss_total += float(loss_sum)
            self.applied += int(applied)
            self.last_loss = float(loss_sum) / int(applied)
        if skipped and config.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradient at step {int(first) + 1}; that step was not applied and no "
                f"checkpoint holds non-finite values: lower --learning-rate or use --on-nonfinite skip")
        self.skipped += int(skipped)

    def train_loss(self) -> float:
        """Mean loss of the steps applied since the last call; the totals restart."""
        loss = self.loss_total / self.applied if self.applied else math.nan
        self.loss_total, self.applied = 0.0, 0
        return loss

    def resume(self) -> None:
        """Restart the clock after an evaluation or a checkpoint."""
        self._tick = time.perf_counter()


def _resume_hint(manager) -> str:
    """What rerunning does, from the last committed checkpoint of ``manager``."""
    last = manager.latest_step()
    return ("free space and rerun the same command: it starts again (no checkpoint was committed)" if last is None
            else f"free space and rerun the same command: it resumes from its checkpoint at step {last:,}")


def _check_room(run_dir: Path, manager, checkpoint_bytes: int, start: int, steps: int, config: TrainConfig) -> None:
    """Refuse before training when the checkpoints still to come cannot fit: at most
    ``max_to_keep + 1`` (2 + 1: a new one is written before the oldest goes) exist at once."""
    if start >= steps:
        return
    saves_left = len({min(s, steps) for s in range(start + 1, steps + 1)
                      if s == steps or (config.checkpoint_every and s % config.checkpoint_every == 0)})
    existing = len(manager.all_steps())
    more = max(min(3, existing + saves_left) - existing, 0)
    check_free(run_dir, more * checkpoint_bytes + (1 << 20),
               f"{more} training checkpoint{'s' if more != 1 else ''} of {megabytes(checkpoint_bytes)}",
               "free space, or train into a --run on another disk")


def _save(manager, run_dir: Path, step: int, params: Params, opt_state, checkpoint_bytes: int) -> None:
    """Checkpoint ``step``; a full disk is one :class:`SaffuError` (the partial folder removed,
    the earlier checkpoints intact)."""
    try:
        save_training_state(manager, step, params, opt_state)
    except Exception as err:   # orbax wraps the OSError of a full disk in errors of its own
        if not is_disk_full(err):
            raise
        remove_failed_save(run_dir)
        raise disk_full_error(run_dir / "checkpoints" / str(step), err, checkpoint_bytes,
                              _resume_hint(manager)) from None


def train(model: Model, params: Params, train_stream: np.ndarray, config: TrainConfig,
          run_dir: str | Path, dev_stream: np.ndarray | None = None,
          on_eval: Callable[[dict], None] | None = None, progress: bool = True,
          mesh: Mesh | None = None, words: WordCount | None = None) -> tuple[Params, list[dict]]:
    """Train ``params`` (explicit or random init) of ``model`` — any config with the shared
    interface (:mod:`saffu.models.interface`) — and checkpoint into ``run_dir/checkpoints``.

    If ``run_dir`` already holds checkpoints of this run, training resumes from the latest
    one. Each evaluation appends one JSON line to ``run_dir/metrics.jsonl`` with ``step``,
    ``tokens``, ``seconds`` (training time, evaluation excluded), ``tokens_per_s`` (this call's
    steps over this call's seconds), ``flops`` (analytic: 3 × the model's forward FLOPs per
    trained token), ``xla_flops`` (XLA's count of one compiled step × steps; None where the
    backend has no cost analysis; a lower bound for a step that loops, see
    :func:`saffu.engine.accounting.xla_flops`), ``peak_rss_mb`` (and ``device_peak_mb`` on accelerators),
    ``train_loss`` (mean of the losses read since the last evaluation), ``dev_loss``
    (nats/token on the evenly spaced dev windows) and ``skipped_steps`` (non-finite steps
    skipped by this call, with ``on_nonfinite="skip"``).

    With a ``mesh`` (see :func:`data_parallel_mesh`) each batch is split over its ``"data"``
    axis and the parameters and optimizer state are replicated; XLA inserts the gradient
    all-reduce. The same code runs on one CPU, several forced CPU devices, a GPU or a TPU slice.
    The caller's ``params`` are copied, never donated. The model's ``fixed_params`` (e.g. the
    explicit tables of a residual model) are inputs of every step: not differentiated, without
    optimizer state and not in the checkpoints (the caller supplies them again on resume).
    A model's ``step_inputs(step, steps)`` (e.g. self-guided training's ``guide_alpha``) join
    them per step; each set of their names is compiled once, so a phase that drops an input
    (the dense guide once ``α`` reaches 0) runs a step without that computation, and ``flops`` /
    ``xla_flops`` add up each step's own count.

    A mesh over the devices of several processes (a multi-process job,
    :func:`saffu.engine.distributed.initialize`; :func:`data_parallel_mesh` gives it) trains
    the same way: every process runs this call with the same arguments, builds the same batch
    and places its own rows; process 0 alone holds the run's lock, writes ``metrics.jsonl``, shows
    progress and calls ``on_eval``; the checkpoints are written together (orbax).

    With ``words`` (how many training words the run has consumed by each step) and
    ``config.words_unit``, the parameters are also kept when the words consumed first reach
    each milestone of :func:`saffu.training.checkpoints.word_milestones` (in ``run_dir/words``,
    indexed by ``run_dir/words.json``; a milestone an explicit start reached before step 0 is
    kept at step 0).

    Returns the final parameters (this process's own copy) and the evaluation history of this call.
    """
    with exclusive(run_dir) if is_writer() else contextlib.nullcontext():
        return _train(model, params, train_stream, config, Path(run_dir), dev_stream, on_eval,
                      progress and is_writer(), mesh, words)


def event_writer(run_dir: Path, start: int):
    """A tensorboardX ``SummaryWriter`` of ``run_dir/tensorboard`` (``purge_step``: a resumed run's
    events after its checkpoint step, and all of a restarted one's, are dropped, as its
    ``metrics.jsonl`` lines are)."""
    try:
        from tensorboardX import SummaryWriter
    except ModuleNotFoundError:
        raise SaffuError("--tensorboard writes event files with tensorboardX: pip install -e '.[tensorboard]'") from None
    return SummaryWriter(logdir=str(run_dir / "tensorboard"), purge_step=start)


def _train(model, params, train_stream, config, run_dir: Path, dev_stream, on_eval, progress, mesh, words):
    """:func:`train` while holding ``run_dir``'s write lock."""
    if is_writer():
        remove_stale_temporaries(run_dir)  # a killed save's folders: no other writer is running
    steps = run_steps(train_stream, config)
    optimizer = make_optimizer(config, steps)
    schedule = BatchSchedule(train_stream, model, config)
    dev_loss = None if dev_stream is None else DevLoss(model, dev_stream, config)
    names = set(getattr(model, "fixed_params", ()))
    fixed = {name: value for name, value in params.items() if name in names}
    params = jax.tree.map(jnp.array, {name: value for name, value in params.items() if name not in names})  # a
    # copy: the step donates its input
    opt_state = optimizer.init(params)
    if mesh is not None:      # placed before restoring, so the restored arrays come with the mesh's sharding
        if config.batch_size % mesh.devices.size:
            raise SaffuError(f"--batch-size {config.batch_size} must be a multiple of the {mesh.devices.size} devices")
        replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        params, opt_state, fixed = put_global((params, opt_state, fixed), replicated)
        put_batch = lambda batch: put_global(batch, split)
    else:
        put_batch = jax.device_put
    manager = checkpoint_manager(run_dir / "checkpoints")
    metrics_path = run_dir / "metrics.jsonl"
    start, params, opt_state, seconds = restore_training_state(manager, run_dir, params, opt_state, metrics_path)
    events = event_writer(run_dir, start) if config.tensorboard and is_writer() else None
    checkpoint_bytes = tree_bytes(params) + tree_bytes(opt_state)
    _check_room(run_dir, manager, checkpoint_bytes, start, steps, config)

    # a model's per-step inputs (e.g. self-guided training's α) join ``fixed``; each set of their
    # names is one phase with its own compiled step (compiled ahead of time: XLA's FLOP count of
    # one step comes with the compilation)
    step_inputs = getattr(model, "step_inputs", lambda step, steps: {})
    eval_inputs = getattr(model, "eval_inputs", step_inputs)      # e.g. no training fold
    put_inputs = (lambda inputs: put_global(inputs, replicated)) if mesh is not None else (lambda inputs: inputs)
    batch = put_batch(schedule(min(start, steps - 1)))
    stats = StepStats.zeros()
    train_step = make_train_step(model, optimizer, config, mesh)
    tokens_per_step = config.batch_size * config.seq_len
    phases: dict[tuple, tuple] = {}

    def phase(step: int) -> tuple:
        """``(compiled step, analytic FLOPs, XLA FLOPs or None, inputs)`` of training step ``step``."""
        inputs = step_inputs(step, steps)
        key = tuple(sorted(inputs))
        if key not in phases:
            compiled = train_step.lower(params, opt_state, stats, jnp.asarray(step), *batch,
                                        {**fixed, **put_inputs(inputs)}).compile()
            per_device = accounting.xla_flops(compiled)     # a partitioned program's count is one device's
            phases[key] = (compiled, accounting.training_flops(model, tokens_per_step, config.seq_len, inputs),
                           None if per_device is None else per_device * (mesh.devices.size if mesh else 1))
        return (*phases[key], inputs)

    flops_done, xla_done = 0.0, 0.0
    by_words = words is not None and config.words_unit > 0
    words_kept = words_manager(run_dir / "words") if by_words else None
    reached_before = {m["words"] for m in words_index(run_dir)}

    def keep_words(step: int) -> None:
        """Keep the parameters at ``step`` if the words consumed by then reach a new milestone."""
        if not by_words:
            return
        seen = words.at(step * tokens_per_step)
        reached = [w for w in word_milestones(config.words_unit, seen) if w not in reached_before]
        if reached:
            save_words(words_kept, run_dir, step, params, reached, seen, words, is_writer())
            reached_before.update(reached)

    def count(step_flops: float, step_xla_flops: float | None) -> None:
        nonlocal flops_done, xla_done
        flops_done += step_flops
        xla_done = None if xla_done is None or step_xla_flops is None else xla_done + step_xla_flops

    for earlier in range(start):         # a resumed run: the FLOPs of the steps before it
        count(*phase(earlier)[1:3])
    meter = _Meter(seconds)
    history: list[dict] = []

    def evaluate(step: int) -> None:
        if dev_loss is None:
            return
        done_here = step - start
        record = {"step": step, "tokens": step * tokens_per_step, "seconds": meter.seconds,
                  "tokens_per_s": done_here * tokens_per_step / max(meter.seconds - meter.seconds_at_start, 1e-9)
                  if done_here else math.nan,
                  "flops": flops_done, "xla_flops": xla_done,
                  **accounting.memory_record(),
                  "train_loss": meter.train_loss(),
                  "dev_loss": dev_loss({**params, **fixed, **put_inputs(eval_inputs(step, steps))}),
                  "skipped_steps": meter.skipped}
        history.append(record)
        if not is_writer():
            return
        try:
            with open(metrics_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise disk_full_error(metrics_path, err, then=_resume_hint(manager)) from None
        if events is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    events.add_scalar(key, value, step)
            events.flush()
        if on_eval:
            on_eval(record)

    try:
        if start == 0:
            evaluate(0)
            keep_words(0)
        meter.resume()
        bar = tqdm(range(start, steps), initial=start, total=steps, desc="train", disable=not progress, leave=False)
        for step in bar:
            compiled_step, step_flops, step_xla_flops, inputs = phase(step)
            params, opt_state, stats = compiled_step(params, opt_state, stats, jnp.asarray(step), *batch,
                                                     {**fixed, **put_inputs(inputs)})
            count(step_flops, step_xla_flops)
            done = step + 1
            if done < steps:      # prefetch: the next batch goes to the device while this step runs
                batch = put_batch(schedule(done))
            keep_words(done)
            eval_now = done % config.eval_every == 0 or done == steps
            save_now = done == steps or (config.checkpoint_every and done % config.checkpoint_every == 0)
            if eval_now or save_now or done % config.log_every == 0:
                meter.read(stats, config)
                stats = StepStats.zeros()
                bar.set_postfix(loss=f"{meter.last_loss:.4f}", refresh=False)
                if eval_now:
                    evaluate(done)
                if save_now:
                    _save(manager, run_dir, done, params, opt_state, checkpoint_bytes)
                meter.resume()
        manager.wait_until_finished()
    finally:               # also when stopped (an error, Ctrl-C): the managers' threads end
        manager.close()
        if words_kept is not None:
            words_kept.close()
        if events is not None:
            events.close()
    return local_copy({**params, **fixed}), history
