"""Streaming co-occurrence statistics: optax-style accumulators, sharded over local devices.

An :class:`Accumulator` is a pure triple (formulation §1–3; house style):

* ``init() -> state`` — a pytree of zeros for one device,
* ``update(state, batch, context, inputs) -> state`` — jittable, on one :class:`Batch` of
  ``C`` targets (their window of the stream, per-target document contexts, targets and tail
  mask), the pass's ``context`` (a pytree of arrays, for example solved weights, as optax's
  ``update(updates, state, params)``) and the accumulator's own ``inputs`` (a pytree of arrays
  fixed at construction, for example the cipher's bit table). Both reach the compiled step as
  arguments, never as compile-time constants,
* ``finalize(host_state) -> statistics`` — on the host, in float64.

The compiled step is cached per static configuration (the accumulators' ``update`` callables,
the shapes of states, inputs and context, the mesh and the chunk size) when every ``update`` is
a hashable value — a frozen dataclass of static parameters, or a module-level function — so
repeated passes, and accumulators rebuilt with new codes or weights of the same shapes, compile
once. An ``update`` that is a closure (``feature_target``'s) is compiled for each pass: no
executable cache is keyed on closures.

States are sums, so two states (two chunks, two devices, two hosts) merge by addition:
:func:`accumulate` keeps one state per local device (a leading device axis sharded over a
``jax.sharding.Mesh``), never communicates while streaming, and adds the per-device states
once at the end. Count states are ``int32`` — exact, and independent of chunking and device
count — while feature states are floating point. Memory is the states plus one chunk, never
proportional to the corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
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

    In a pass of order-free accumulators (:attr:`Accumulator.order_free`) the ``C`` rows are
    the chunk's targets in target order and ``window`` is ``None``.

    Attributes:
      window: ``int32[R + C]`` — the stream: ``R`` tokens of left context, then the targets
        (``None`` in target order).
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
      init: ``() -> state`` for one device, a pytree of zeros.
      update: ``(state, Batch, context, inputs) -> state``; ``context`` is the pass's pytree
        of arrays (weights), the same for every accumulator of a pass; ``inputs`` is this
        accumulator's own pytree of arrays (``inputs`` below). A hashable value (frozen
        dataclass, module-level function) lets passes share one compiled step.
      finalize: ``(state summed over devices, as numpy) -> statistics``.
      capacity: the most targets one pass may stream while integer states stay exact
        (no cell can pass 2^31); :func:`accumulate_states` refuses longer ranges — split
        them and :func:`merge_states` the (int64) results.
      inputs: pytree of arrays ``update`` reads (for example an ``int32[V, L]`` bit table),
        passed to the compiled step as an argument; ``None`` for none.
      order_free: ``update`` reads each target's ``context``, ``targets`` and ``mask`` rows
        only (never ``window``) and its state is an exact integer sum, so the targets may
        arrive in any order. A pass whose accumulators are all order-free streams each block of
        targets sorted by target (:func:`accumulate_states`), which keeps a target-major
        scatter inside the CPU's cache.
    """

    radius: int
    init: Callable[[], State]
    update: Callable[[State, Batch, Any, Any], State]
    finalize: Callable[[State], Any]
    capacity: int = 2**31 - 1
    inputs: Any = None
    order_free: bool = False


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


def document_context_at(window: jax.Array, boundaries: jax.Array, rows: jax.Array,
                        radius: int) -> tuple[jax.Array, jax.Array]:
    """:func:`document_context` of some of a window's targets, in any order.

    Args:
      window: ``int32[R + S]`` — ``R = radius`` tokens of left context, then ``S`` targets.
      boundaries: ``int32[R + S]`` — ``cumsum(window == <eod>)``.
      rows: ``int32[C]`` — which targets (``0 ≤ rows < S``), in the order wanted.
      radius: ``R``.

    Returns:
      ``context int32[C, R]`` and ``targets int32[C]``: row ``c`` is row ``rows[c]`` of
      :func:`document_context` ``(window, radius)``. A target's ``R + 1`` tokens are one
      contiguous slice of the window (and of ``boundaries``).
    """
    span = lambda a: jax.vmap(lambda i: jax.lax.dynamic_slice(a, (i,), (radius + 1,)))(rows)
    tokens, documents = span(window), span(boundaries)           # [C, R + 1]: target at R, head at R − 1
    same_document = documents[:, radius - 1::-1] == documents[:, radius - 1:radius]
    return jnp.where(same_document, tokens[:, radius - 1::-1], PAD_ID), tokens[:, radius]


@dataclasses.dataclass(frozen=True)
class _CountTargets:
    """``update`` of :func:`unigram_counts`: ``int32[V]`` state, one count per unmasked target."""

    vocab_size: int

    def __call__(self, state: jax.Array, batch: Batch, context: Any, inputs: Any) -> jax.Array:
        return state.at[jnp.where(batch.mask, batch.targets, self.vocab_size)].add(1, mode="drop")


def unigram_counts(vocab_size: int) -> Accumulator:
    """Target counts ``n[v] = Σ_t [w_{t+1} = v]``, exact. Finalized: ``int64[V]``."""

    def init():
        return jnp.zeros((vocab_size,), jnp.int32)  # int32: exact up to 2^31 per token

    return Accumulator(0, init, _CountTargets(vocab_size), lambda state: np.asarray(state, np.int64),
                       order_free=True)


@dataclasses.dataclass(frozen=True)
class _OffsetUpdate:
    """``update`` of :func:`offset_cooccurrence` (static layout only; the codes are ``inputs``).

    ``inputs``: ``slots int32[V, L]`` (bit of each slot, ``−1`` for none), and per layout
    ``increment int32[V, L]`` (the integer each slot adds) or ``level_slice int32[V]``.
    The state is ``int32[V · M · S · K]``, target-major.
    """

    radius: int
    dim: int
    slices: int
    size: int

    def __call__(self, state: jax.Array, batch: Batch, context: Any, inputs: dict) -> jax.Array:
        radius, dim, slices, size = self.radius, self.dim, self.slices, self.size
        tokens, targets, mask = batch.context[:, :radius], batch.targets, batch.mask   # [C, M]
        bits = inputs["slots"][tokens]                                                  # [C, M, L]
        row = targets[:, None] * radius + jnp.arange(radius, dtype=jnp.int32)[None, :]
        if "level_slice" in inputs:
            row = row * slices + inputs["level_slice"][tokens]
        cell = row[..., None] * dim + bits
        cell = jnp.where((bits >= 0) & mask[:, None, None], cell, size)                 # size -> dropped
        if "increment" in inputs:
            return state.at[cell.reshape(-1)].add(inputs["increment"][tokens].reshape(-1), mode="drop")
        return state.at[cell.reshape(-1)].add(1, mode="drop")


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

    # the codes are runtime inputs of the compiled step (numpy here; placed on the mesh per pass)
    inputs = {"slots": np.ascontiguousarray(slots, np.int32)}
    if increment is not None:
        inputs["increment"] = increment
    if level_slice is not None:
        inputs["level_slice"] = level_slice

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
    return Accumulator(radius, init, _OffsetUpdate(radius, dim, slices, size), finalize, capacity, inputs,
                       order_free=True)


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

    def update(state, batch, context, inputs):
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


def _is_static(update: Callable) -> bool:
    """Whether ``update`` can key the step cache: a frozen dataclass (hashed by its static
    fields) or a function with no closure and not nested in another (hashed by identity, and
    holding no arrays). Closures, partials and bound methods are not."""
    if dataclasses.is_dataclass(update) and not isinstance(update, type):
        return bool(update.__dataclass_params__.frozen)
    return (isinstance(update, types.FunctionType) and update.__closure__ is None
            and "<locals>" not in update.__qualname__)


def _specs(tree: Any, sharding: NamedSharding) -> tuple:
    """A hashable description of a pytree of arrays: ``(treedef, ShapeDtypeStructs)``."""
    leaves, treedef = jax.tree.flatten(tree)
    dtype = lambda x: jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
    return treedef, tuple(jax.ShapeDtypeStruct(np.shape(x), dtype(x), sharding=sharding,
                                               weak_type=getattr(x, "weak_type", False)) for x in leaves)


#: Chunks per sorted block in target order (:func:`accumulate_states`): the block's targets are
#: sorted, then streamed a chunk at a time, so each chunk's scatter lands in a narrow slice of
#: a target-major state (measured on `V` = 8,192: 8 and 16 alike, 4 slower; a whole block
#: scattered in one step gains nothing, its intermediates leave the cache).
TARGET_ORDER_CHUNKS = 8


@functools.lru_cache(maxsize=32)
def _compiled_step(updates: tuple[Callable, ...], state_specs: tuple, mesh: Mesh, radius: int, chunk_size: int,
                   input_specs: tuple, context_specs: tuple, block: int = 0):
    """The step of :func:`_sharded_step`, compiled for one static configuration: ``updates``
    (the accumulators' update callables), ``state_specs`` (per accumulator, one device's state
    ``(treedef, ShapeDtypeStructs)``), ``input_specs`` and ``context_specs`` (the same, for
    the accumulators' inputs and the pass's context, replicated), and ``block`` (0: stream
    order; else target order over blocks of that many targets). Cached only through
    :func:`_sharded_step`, which passes static updates alone."""
    state_trees = [jax.tree.unflatten(treedef, leaves) for treedef, leaves in state_specs]
    inputs = jax.tree.unflatten(*input_specs)
    context = jax.tree.unflatten(*context_specs)

    def apply(states, batch, inputs, context):
        return [jax.tree.map(lambda x: x[None], update(jax.tree.map(lambda x: x[0], state), batch, context, own))
                for update, state, own in zip(updates, states, inputs)]

    def in_stream_order(states, windows, masks, inputs, context):
        tokens, targets = document_context(windows[0], radius)
        return apply(states, Batch(windows[0], tokens, targets, masks[0]), inputs, context)

    def in_target_order(states, windows, boundaries, rows, valid, first, inputs, context):
        chunk = jax.lax.dynamic_slice(rows[0], (first,), (chunk_size,))
        tokens, targets = document_context_at(windows[0], boundaries[0], chunk, radius)
        mask = first + jnp.arange(chunk_size, dtype=jnp.int32) < valid[0]     # the sorted rows' masked tail
        return apply(states, Batch(None, tokens, targets, mask), inputs, context)

    split, replicated = PartitionSpec(_DEVICE_AXIS), PartitionSpec()
    num_devices = mesh.devices.size
    sharded = NamedSharding(mesh, split)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharded)
    states = [jax.tree.map(lambda s: spec((num_devices,) + s.shape, s.dtype), tree) for tree in state_trees]
    if block:
        local = in_target_order
        streams = (spec((num_devices, radius + block), jnp.int32),) * 2 + (spec((num_devices, block), jnp.int32),
                                                                          spec((num_devices,), jnp.int32))
        streams += (jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, replicated)),)
        in_specs = (split,) * 5 + (replicated,) * 3
    else:
        local = in_stream_order
        streams = (spec((num_devices, radius + chunk_size), jnp.int32), spec((num_devices, chunk_size), jnp.bool_))
        in_specs = (split,) * 3 + (replicated,) * 2
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=split), donate_argnums=0)
    return step.lower(states, *streams, inputs, context).compile()


def _sharded_step(accumulators: tuple[Accumulator, ...], mesh: Mesh, radius: int, chunk_size: int,
                  context: Any, inputs: Any = None, block: int = 0):
    """One step updating every accumulator on every device, compiled ahead of time for
    ``chunk_size`` targets per device and the shapes of ``context`` and of the accumulators'
    ``inputs`` (the executable also carries XLA's FLOP count). The context and the inputs are
    replicated on every device and are arguments of the executable: it holds no weights or
    codes of its own.

    In stream order (``block`` 0) called as ``step(states, int32[D, R + C] windows,
    bool[D, C] masks, inputs, context)``; in target order as ``step(states, int32[D, R + S]
    windows, int32[D, R + S] boundaries, int32[D, S] rows, int32[D] valid, int32 first,
    inputs, context)`` with ``S = block``: rows ``first … first + C − 1`` of each device's
    block, sorted by target (:func:`document_context_at`), those from ``valid`` on masked.
    ``states`` is a list (one per accumulator) of states with a leading device axis ``D`` and
    ``inputs`` a tuple of the accumulators' ``inputs``. Compiled once per static configuration
    when every ``update`` is static (:func:`_is_static`), else on every call."""
    replicated = NamedSharding(mesh, PartitionSpec())
    inputs = tuple(acc.inputs for acc in accumulators) if inputs is None else inputs
    key = (tuple(acc.update for acc in accumulators),
           tuple(_specs(jax.eval_shape(acc.init), None) for acc in accumulators),
           mesh, radius, chunk_size, _specs(inputs, replicated), _specs(context, replicated), block)
    if all(_is_static(acc.update) for acc in accumulators):
        return _compiled_step(*key)
    return _compiled_step.__wrapped__(*key)


def accumulate_states(stream: np.ndarray, accumulators: Mapping[str, Accumulator], *,
                      begin: int = 1, end: int | None = None, chunk_size: int = 1 << 15,
                      mesh: Mesh | None = None, context: Any = None,
                      progress: str | None = "statistics", target_order: bool | None = None) -> dict[str, State]:
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
      target_order: stream each block of ``TARGET_ORDER_CHUNKS · chunk_size`` targets per
        device sorted by target (each chunk's updates then fall in a narrow slice of a
        target-major state); ``None`` (default) does so when every accumulator is
        :attr:`~Accumulator.order_free`, ``False`` keeps stream order. The states are the same
        either way.

    In a multi-process job (:mod:`saffu.engine.distributed`) each process streams its own documents
    of ``[begin, end)`` and the states are added over processes, so every process returns the
    same totals.

    Returns name -> state summed over devices, as numpy, ready for ``finalize`` or for
    :func:`merge_states` with another range's or host's.
    """
    end = len(stream) if end is None else end
    if not 1 <= begin <= end <= len(stream):
        raise SaffuError(f"target range [{begin}, {end}) is outside the stream of {len(stream)} tokens")
    order_free = all(acc.order_free for acc in accumulators.values())
    if target_order is None:
        target_order = order_free
    elif target_order and not order_free:
        raise SaffuError("target order needs order-free accumulators: "
                         + ", ".join(n for n, acc in accumulators.items() if not acc.order_free) + " are not")
    if jax.process_count() > 1:  # multi-process job: this process's documents, then a collective sum
        local_begin, local_end = distributed.document_shard(stream, jax.process_index(), jax.process_count(),
                                                            begin, end)
        local = _accumulate_local(stream, accumulators, local_begin, local_end, chunk_size, mesh, context,
                                  progress, target_order)
        return {name: distributed.sum_over_processes(state) for name, state in local.items()}
    return _accumulate_local(stream, accumulators, begin, end, chunk_size, mesh, context, progress, target_order)


def _accumulate_local(stream, accumulators, begin, end, chunk_size, mesh, context, progress,
                      target_order=False) -> dict[str, State]:
    """:func:`accumulate_states` on this process's local devices only."""
    for name, acc in accumulators.items():
        if end - begin > acc.capacity:
            raise SaffuError(f"{end - begin:,} targets exceed the exact range of accumulator {name!r} "
                             f"({acc.capacity:,}); stream the corpus in parts and merge_states them")
    mesh = mesh or distributed.local_mesh()
    num_devices = mesh.devices.size
    radius = max([acc.radius for acc in accumulators.values()] + [1])
    sharded = NamedSharding(mesh, PartitionSpec(_DEVICE_AXIS))
    replicated = NamedSharding(mesh, PartitionSpec())
    names = list(accumulators)
    accs = tuple(accumulators[n] for n in names)
    context = jax.device_put(context, replicated)
    inputs = jax.device_put(tuple(acc.inputs for acc in accs), replicated)
    block = TARGET_ORDER_CHUNKS * chunk_size if target_order else 0
    step = _sharded_step(accs, mesh, radius, chunk_size, context, inputs, block)
    # zeros allocated on the devices directly (init's documented value), one per device
    states = [jax.tree.map(lambda s: jnp.zeros((num_devices,) + s.shape, s.dtype, device=sharded),
                           jax.eval_shape(acc.init)) for acc in accs]
    put = lambda array: jax.device_put(array, sharded)
    calls = 0
    with tqdm(total=end - begin, unit="tok", unit_scale=True, desc=progress,
              disable=progress is None, leave=False) as bar:
        if not block:
            per_step = num_devices * chunk_size
            for first in range(begin, end, per_step):
                windows, masks = _windows(stream, first, end, num_devices, chunk_size, radius)
                states = step(states, put(windows), put(masks), inputs, context)
                calls += 1
                bar.update(min(per_step, end - first))
        else:
            per_block = num_devices * block
            for first in range(begin, end, per_block):
                windows, masks = _windows(stream, first, end, num_devices, block, radius)
                valid = masks.sum(axis=1, dtype=np.int32)
                block_args = [put(windows), put(np.cumsum(windows == EOD_ID, axis=1, dtype=np.int32)),
                              put(_target_rows(windows[:, radius:], masks)), put(valid)]
                for row in range(0, int(valid[0]), chunk_size):      # masked rows sort last
                    states = step(states, *block_args, np.int32(row), inputs, context)
                    calls += 1
                bar.update(int(valid.sum()))
    accounting.record("statistics", step, calls)
    # Adding the device states on the devices is exact: capacity bounds every cell's total.
    if num_devices == 1:
        return {name: np.asarray(state)[0] for name, state in zip(names, states)}
    return {name: np.asarray(_sum_devices(state)) for name, state in zip(names, states)}


def _target_rows(targets: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``int32[D, S]``: each device's targets sorted by token (stably; masked slots last)."""
    key = np.where(masks, targets, int(targets.max()) + 1)
    key = key.astype(np.uint16) if key.max() < 2**16 else key    # a 16-bit key sorts by radix
    return np.argsort(key, axis=1, kind="stable").astype(np.int32)


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
