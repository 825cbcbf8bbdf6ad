"""Streaming co-occurrence statistics: optax-style accumulators, sharded over local devices.

An :class:`Accumulator` is a pure triple (formulation §1–3; house style):

* ``init() -> state`` — a pytree of zeros for one device,
* ``update(state, batch, context) -> state`` — jittable, on one :class:`Batch` of ``C``
  targets (their window of the stream, per-target document contexts, targets and tail mask)
  and the pass's ``context``: a pytree of arrays (for example solved weights) that reaches
  the compiled step as an argument, never as a compile-time constant (as optax's
  ``update(updates, state, params)``),
* ``finalize(host_state) -> statistics`` — on the host, in float64.

States are sums, so two states (two chunks, two devices, two hosts) merge by addition:
:func:`accumulate` keeps one state per local device (a leading device axis sharded over a
``jax.sharding.Mesh``), never communicates while streaming, and adds the per-device states
once at the end. Count states are ``int32`` — exact, and independent of chunking and device
count — while feature states are floating point. Memory is the states plus one chunk, never
proportional to the corpus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.data.windows import stack_windows
from saffu.engine import accounting, distributed
from saffu.engine.codes import SparseCodes

State = Any
_DEVICE_AXIS = distributed.DEVICE_AXIS


class Batch(NamedTuple):
    """One device's chunk of ``C`` targets, as every accumulator sees it.

    Attributes:
      window: ``int32[R + C]`` — the stream: ``R`` tokens of left context, then the targets.
      context: ``int32[C, R]`` — ``context[c, δ]`` is the token ``δ`` positions before the
        head of target ``c`` (the head is ``δ = 0``), ``<pad>`` before its document start.
      targets: ``int32[C]``.
      mask: ``bool[C]`` — False on the padded tail of the last chunk.
    """

    window: jax.Array
    context: jax.Array
    targets: jax.Array
    mask: jax.Array


class Accumulator(NamedTuple):
    """A streaming statistic (see the module docstring).

    Attributes:
      radius: how many context tokens ``update`` reads (``context[:, :radius]``).
      init: ``() -> state`` for one device.
      update: ``(state, Batch, context) -> state``; ``context`` is the pass's pytree of
        arrays (weights), the same for every accumulator of a pass.
      finalize: ``(state summed over devices, as numpy) -> statistics``.
      capacity: the most targets one pass may stream while integer states stay exact
        (no cell can pass 2^31); :func:`accumulate_states` refuses longer ranges — split
        them and :func:`merge_states` the (int64) results.
    """

    radius: int
    init: Callable[[], State]
    update: Callable[[State, Batch], State]
    finalize: Callable[[State], Any]
    capacity: int = 2**31 - 1


def merge_states(a: State, b: State) -> State:
    """Two host states of the same accumulator (ranges, hosts) merged by addition; integer
    counts are widened to int64 so the sum stays exact."""

    def add(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.integer):
            return x.astype(np.int64) + y
        return x + y

    return jax.tree.map(add, a, b)


def document_context(window: jax.Array, radius: int) -> tuple[jax.Array, jax.Array]:
    """Split one window of the token stream into contexts and targets.

    Args:
      window: ``int32[R + C]`` — ``R = radius`` tokens of left context, then ``C`` targets.
      radius: ``R``.

    Returns:
      ``context int32[C, R]`` with ``context[c, δ] = window[R + c − 1 − δ]``, replaced by
      ``<pad>`` when an ``<eod>`` lies strictly between that position and the head (the token
      right before the target) — earlier documents are invisible; and ``targets int32[C]``.
    """
    num_targets = window.shape[0] - radius
    # boundaries[i] = number of <eod> in window[:i + 1]; positions j ≤ h share the head's
    # document iff no <eod> lies in (j, h], i.e. boundaries[j] == boundaries[h].
    boundaries = jnp.cumsum(window == EOD_ID)
    head = radius - 1 + jnp.arange(num_targets)[:, None]
    position = head - jnp.arange(radius)[None, :]
    same_document = boundaries[position] == boundaries[head]
    context = jnp.where(same_document, window[position], PAD_ID)
    return context, window[radius:]


def unigram_counts(vocab_size: int) -> Accumulator:
    """Target counts ``n[v] = Σ_t [w_{t+1} = v]``, exact. Finalized: ``int64[V]``."""

    def init():
        return jnp.zeros((vocab_size,), jnp.int32)  # int32: exact up to 2^31 per token

    def update(state, batch, context):
        return state.at[jnp.where(batch.mask, batch.targets, vocab_size)].add(1, mode="drop")

    return Accumulator(0, init, update, lambda state: np.asarray(state, np.int64))


def offset_cooccurrence(codes: SparseCodes, vocab_size: int, radius: int) -> Accumulator:
    """Offset co-occurrences ``F_δ = Σ_t c(w_{t−δ})ᵀ e(w_{t+1})`` for ``δ = 0 … M−1``
    (formulation §3 stage 1), over the sparse bit-cipher ``c`` without background.

    Counting is exact and in integers. A level-``l`` code has value ``1/l`` on each of its
    bits; with ``D = lcm(1 … L)`` each (offset, bit, target) cell adds the integer ``D / l``
    and ``F_δ = state / D``. Three layouts of that one idea, chosen by ``L``:

    * ``D = L`` (``L ≤ 2``, the default 128-bit codes): every token fills exactly ``L`` slots
      (a level-1 token repeats its bit), so every update adds the constant 1 — the fastest
      scatter, with no dropped slots;
    * ``D ≤ 12`` (``L ≤ 4``): ``L`` slots adding ``D / l``;
    * otherwise one state slice per level (adding 1) and ``F_δ = Σ_l state_l / l``.

    The state is target-major, ``int32[V, M, S, K]`` (``S`` level slices, usually 1): the
    ``M·L`` updates of one target land in one small block, which keeps the scatter in cache.

    Finalized: ``float64[M, K, V]``. Blend a background with :func:`blend_background`.
    """
    bit_index = np.asarray(codes.bit_index)
    levels = np.asarray(codes.level)
    max_level, dim = bit_index.shape[1], codes.dim
    common = int(np.lcm.reduce(np.arange(1, max_level + 1)))
    if common == max_level:                          # repeat bits to fill every slot
        slots = np.repeat(bit_index[:, :1], max_level, axis=1)
        for token in np.nonzero(levels == max_level)[0]:
            slots[token] = bit_index[token]
        increment, slices, level_slice, denominator = None, 1, None, common
    elif common <= 12:
        slots, slices, level_slice, denominator = bit_index, 1, None, common
        increment = np.repeat((common // levels)[:, None], max_level, axis=1).astype(np.int32)
    else:
        slots, increment, slices, denominator = bit_index, None, max_level, 1
        level_slice = (levels - 1).astype(np.int32)
    size = vocab_size * radius * slices * dim
    if size >= 2**31 - 1:
        raise SaffuError(f"offset statistics of {size:,} cells exceed int32 indexing; "
                         f"reduce --radius, --bits or --vocab-size")

    def init():
        # int32: exact while no cell passes 2^31, which ``capacity`` guarantees
        return jnp.zeros((size,), jnp.int32)

    def update(state, batch, _):
        context, targets, mask = batch.context[:, :radius], batch.targets, batch.mask  # [C, M]
        bits = jnp.asarray(slots)[context]                               # [C, M, L]
        row = targets[:, None] * radius + jnp.arange(radius, dtype=jnp.int32)[None, :]
        if level_slice is not None:
            row = row * slices + jnp.asarray(level_slice)[context]
        cell = row[..., None] * dim + bits
        cell = jnp.where((bits >= 0) & mask[:, None, None], cell, size)  # size -> dropped
        if increment is None:
            return state.at[cell.reshape(-1)].add(1, mode="drop")
        return state.at[cell.reshape(-1)].add(jnp.asarray(increment)[context].reshape(-1), mode="drop")

    def finalize(state):
        counts = np.asarray(state).reshape(vocab_size, radius, slices, dim)
        if slices == 1:
            cooccurrence = counts[:, :, 0] / float(denominator)
        else:
            cooccurrence = counts[:, :, 0].astype(np.float64)
            for level in range(2, slices + 1):
                cooccurrence += counts[:, :, level - 1] / level
        return cooccurrence.transpose(1, 2, 0)                            # [M, K, V]

    max_increment = 1 if increment is None else int(increment.max())
    capacity = (2**31 - 1) // (max_increment * max_level)
    return Accumulator(radius, init, update, finalize, capacity)


def blend_background(cooccurrence: np.ndarray, background: np.ndarray, weight: float) -> np.ndarray:
    """Offset statistics for codes blended with a background, ``(1 − λ) c + λ b``.

    Args:
      cooccurrence: ``float64[M, K, V]`` from :func:`offset_cooccurrence` (sparse codes).
      background: ``float64[K]`` from :func:`saffu.engine.codes.code_background`.
      weight: ``λ``.

    Since codes sum to 1, ``Σ_k F_δ[k, v]`` is the target count, so
    ``F'_δ = (1 − λ) F_δ + λ b ⊗ Σ_k F_δ[k, :]`` exactly.
    """
    target_counts = cooccurrence.sum(axis=1, keepdims=True)              # [M, 1, V]
    return (1.0 - weight) * cooccurrence + weight * background[None, :, None] * target_counts


def feature_target(feature_fn: Callable[[Batch, Any], jax.Array], num_features: int,
                   num_targets: int, radius: int,
                   target_fn: Callable[[Batch, Any], jax.Array] | None = None,
                   dtype=jnp.float32) -> Accumulator:
    """Generic ``F = Σ_t φ_tᵀ y_t`` for any jittable non-negative feature map.

    Args:
      feature_fn: ``(Batch, context) -> float[C, N]``, non-negative; it may read the
        per-target ``batch.context[:, :radius]`` or run a sequence model with the weights in
        ``context`` over ``batch.window`` (the SAFFU solver computes attention values and
        hidden softmaxes this way).
      num_features: ``N``.
      num_targets: ``T`` — ``V`` for one-hot next-token targets, or the width of ``target_fn``.
      radius: context tokens the feature map reads.
      target_fn: ``(Batch, context) -> float[C, T]`` target distributions (for example the next
        token's cipher code, or responsibilities that depend on the context);
        ``None`` means one-hot ``e(w_{t+1})`` over ``T = V`` tokens.
      dtype: accumulation dtype (float32 unless x64 is enabled).

    Finalized: ``float64[N, T]``; raises SaffuError if a feature was negative.
    """

    def init():
        shape = (num_targets, num_features) if target_fn is None else (num_features, num_targets)
        return jnp.zeros(shape, dtype)

    def update(state, batch, context):
        features = feature_fn(batch, context).astype(dtype) * batch.mask[:, None]
        if target_fn is None:  # rows of the target-major state: a scatter, no one-hot matrix
            return state.at[batch.targets].add(features)
        return state + features.T @ target_fn(batch, context).astype(dtype)

    def finalize(state):
        stats = np.asarray(state, np.float64)
        stats = stats.T if target_fn is None else stats
        if (stats < 0).any():
            raise SaffuError("the feature function produced negative values; explicit "
                             "solutions need non-negative features (formulation §1)")
        return stats

    return Accumulator(radius, init, update, finalize)


def _windows(stream: np.ndarray, first_target: int, end: int, num_devices: int,
             chunk_size: int, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side of one step: ``int32[D, R + C]`` windows and ``bool[D, C]`` masks, device
    ``d`` taking the ``d``-th chunk of ``C`` targets."""
    starts = first_target + chunk_size * np.arange(num_devices)
    return stack_windows(stream, starts, [end] * num_devices, radius, chunk_size)


def _sharded_step(accumulators: tuple[Accumulator, ...], mesh: Mesh, radius: int, chunk_size: int,
                  context: Any):
    """One step updating every accumulator on every device, compiled ahead of time for
    ``chunk_size`` targets per device and ``context``'s shapes (the executable also carries
    XLA's FLOP count). The context is replicated on every device and is an argument of the
    executable: it holds no weights of its own."""

    def local_update(states, windows, masks, context):
        tokens, targets = document_context(windows[0], radius)
        batch = Batch(windows[0], tokens, targets, masks[0])
        return [acc.update(state[0], batch, context)[None] for acc, state in zip(accumulators, states)]

    split, replicated = PartitionSpec(_DEVICE_AXIS), PartitionSpec()
    step = jax.jit(jax.shard_map(local_update, mesh=mesh, in_specs=(split, split, split, replicated),
                                 out_specs=split),
                   donate_argnums=0)
    num_devices = mesh.devices.size
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, split))
    states = [spec((num_devices,) + s.shape, s.dtype) for s in (jax.eval_shape(acc.init) for acc in accumulators)]
    return step.lower(states, spec((num_devices, radius + chunk_size), jnp.int32),
                      spec((num_devices, chunk_size), jnp.bool_), context).compile()


def accumulate_states(stream: np.ndarray, accumulators: Mapping[str, Accumulator], *,
                      begin: int = 1, end: int | None = None, chunk_size: int = 1 << 15,
                      mesh: Mesh | None = None, context: Any = None,
                      progress: str | None = "statistics") -> dict[str, State]:
    """Stream ``stream[begin:end]`` as targets through every accumulator at once.

    Args:
      stream: ``int[N]`` token stream (a memory map is fine; it is read a chunk at a time).
      accumulators: name -> :class:`Accumulator`.
      begin, end: target positions ``[begin, end)``; position 0 (the opening ``<eod>``) is
        never a target. Context before ``begin`` is still read.
      chunk_size: targets per device per step (fixed shape: compiled once, tail masked).
      mesh: 1-D device mesh (default: all local devices).
      context: pytree of arrays every accumulator's ``update`` receives (weights solved
        before this pass), replicated on the mesh; ``None`` for counts that need none.
      progress: progress-bar label, or ``None`` for none.

    In a multi-process job (:mod:`saffu.engine.distributed`) each process streams its own documents
    of ``[begin, end)`` and the states are added over processes, so every process returns the
    same totals.

    Returns name -> state summed over devices, as numpy, ready for ``finalize`` or for
    :func:`merge_states` with another range's or host's.
    """
    end = len(stream) if end is None else end
    if not 1 <= begin <= end <= len(stream):
        raise SaffuError(f"target range [{begin}, {end}) is outside the stream of {len(stream)} tokens")
    if jax.process_count() > 1:  # multi-process job: this process's documents, then a collective sum
        local_begin, local_end = distributed.document_shard(stream, jax.process_index(), jax.process_count(),
                                                            begin, end)
        local = _accumulate_local(stream, accumulators, local_begin, local_end, chunk_size, mesh, context,
                                  progress)
        return {name: distributed.sum_over_processes(state) for name, state in local.items()}
    return _accumulate_local(stream, accumulators, begin, end, chunk_size, mesh, context, progress)


def _accumulate_local(stream, accumulators, begin, end, chunk_size, mesh, context, progress) -> dict[str, State]:
    """:func:`accumulate_states` on this process's local devices only."""
    for name, acc in accumulators.items():
        if end - begin > acc.capacity:
            raise SaffuError(f"{end - begin:,} targets exceed the exact range of accumulator {name!r} "
                             f"({acc.capacity:,}); stream the corpus in parts and merge_states them")
    mesh = mesh or distributed.local_mesh()
    num_devices = mesh.devices.size
    radius = max([acc.radius for acc in accumulators.values()] + [1])
    sharded = NamedSharding(mesh, PartitionSpec(_DEVICE_AXIS))
    names = list(accumulators)
    context = jax.device_put(context, NamedSharding(mesh, PartitionSpec()))
    step = _sharded_step(tuple(accumulators[n] for n in names), mesh, radius, chunk_size, context)
    states = [jax.device_put(jnp.stack([accumulators[n].init()] * num_devices), sharded)
              for n in names]
    per_step = num_devices * chunk_size
    accounting.record("statistics", step, -(-(end - begin) // per_step))
    with tqdm(total=end - begin, unit="tok", unit_scale=True, desc=progress,
              disable=progress is None, leave=False) as bar:
        for first in range(begin, end, per_step):
            windows, masks = _windows(stream, first, end, num_devices, chunk_size, radius)
            states = step(states, jax.device_put(windows, sharded), jax.device_put(masks, sharded), context)
            bar.update(min(per_step, end - first))
    # Adding the device states on the devices is exact: capacity bounds every cell's total.
    if num_devices == 1:
        return {name: np.asarray(state)[0] for name, state in zip(names, states)}
    return {name: np.asarray(_sum_devices(state)) for name, state in zip(names, states)}


@jax.jit
def _sum_devices(state: jax.Array) -> jax.Array:
    return state.sum(axis=0, dtype=state.dtype)


def accumulate(stream: np.ndarray, accumulators: Mapping[str, Accumulator], **kwargs) -> dict[str, Any]:
    """:func:`accumulate_states` followed by each accumulator's ``finalize``.

    Returns name -> finalized statistics, plus ``"seconds"`` (wall time of the pass).
    """
    start = time.perf_counter()
    states = accumulate_states(stream, accumulators, **kwargs)
    result: dict[str, Any] = {name: accumulators[name].finalize(state) for name, state in states.items()}
    result["seconds"] = time.perf_counter() - start
    return result
