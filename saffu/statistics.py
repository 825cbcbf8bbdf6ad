"""Streaming co-occurrence statistics: optax-style accumulators, sharded over local devices.

An :class:`Accumulator` is a pure triple (formulation §1–3; house style):

* ``init() -> state`` — a pytree of zeros for one device,
* ``update(state, context, targets, mask) -> state`` — jittable; ``context`` is
  ``int32[C, R]`` (``context[c, δ]`` is the token ``δ`` positions before the head of target
  ``c``, ``<pad>`` before its document start), ``targets`` is ``int32[C]``, ``mask`` is
  ``bool[C]`` (False on the padded tail of the last chunk),
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
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.codes import SparseCodes
from saffu.tokenizer import EOD_ID, PAD_ID

State = Any
_DEVICE_AXIS = "devices"


class Accumulator(NamedTuple):
    """A streaming statistic (see the module docstring).

    Attributes:
      radius: how many context tokens ``update`` reads (``context[:, :radius]``).
      init: ``() -> state`` for one device.
      update: ``(state, context int32[C, R], targets int32[C], mask bool[C]) -> state``.
      finalize: ``(state summed over devices, as numpy) -> statistics``.
    """

    radius: int
    init: Callable[[], State]
    update: Callable[[State, jax.Array, jax.Array, jax.Array], State]
    finalize: Callable[[State], Any]


def merge_states(a: State, b: State) -> State:
    """Two states of the same accumulator (chunks, devices or hosts) merged by addition."""
    return jax.tree.map(lambda x, y: x + y, a, b)


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

    def update(state, context, targets, mask):
        del context
        return state.at[jnp.where(mask, targets, vocab_size)].add(1, mode="drop")

    return Accumulator(0, init, update, lambda state: np.asarray(state, np.int64))


def offset_cooccurrence(codes: SparseCodes, vocab_size: int, radius: int) -> Accumulator:
    """Offset co-occurrences ``F_δ = Σ_t c(w_{t−δ})ᵀ e(w_{t+1})`` for ``δ = 0 … M−1``
    (formulation §3 stage 1), over the sparse bit-cipher ``c`` without background.

    The state counts, exactly and in integers, how often bit ``k`` of a level-``l`` context
    token at offset ``δ`` precedes target ``v``: ``int32[M·L·K·V]``. Since a level-``l`` code
    has value ``1/l`` on each of its bits, ``F_δ = Σ_l G[δ, l] / l`` (finalize, float64).

    Finalized: ``float64[M, K, V]``. Blend a background with :func:`blend_background`.
    """
    bit_index = np.asarray(codes.bit_index)
    levels = np.asarray(codes.level)
    num_levels, dim = bit_index.shape[1], codes.dim
    size = radius * num_levels * dim * vocab_size
    if size >= 2**31 - 1:
        raise SaffuError(f"offset statistics of {size:,} cells exceed int32 indexing; "
                         f"reduce --radius, --bits or --vocab-size")

    def init():
        return jnp.zeros((size,), jnp.int32)  # int32 counts: exact up to 2^31 per cell

    def update(state, context, targets, mask):
        context = context[:, :radius]                                    # [C, M]
        bits = jnp.asarray(bit_index)[context]                           # [C, M, L]
        level = jnp.asarray(levels)[context] - 1                         # [C, M]
        offset = jnp.arange(radius, dtype=jnp.int32)[None, :, None]
        cell = ((offset * num_levels + level[..., None]) * dim + bits) * vocab_size
        cell = cell + targets[:, None, None]
        cell = jnp.where((bits >= 0) & mask[:, None, None], cell, size)  # size -> dropped
        return state.at[cell.reshape(-1)].add(1, mode="drop")

    def finalize(state):
        counts = np.asarray(state, np.float64).reshape(radius, num_levels, dim, vocab_size)
        inverse_level = 1.0 / np.arange(1, num_levels + 1, dtype=np.float64)
        return np.einsum("mlkv,l->mkv", counts, inverse_level)

    return Accumulator(radius, init, update, finalize)


def blend_background(cooccurrence: np.ndarray, background: np.ndarray, weight: float) -> np.ndarray:
    """Offset statistics for codes blended with a background, ``(1 − λ) c + λ b``.

    Args:
      cooccurrence: ``float64[M, K, V]`` from :func:`offset_cooccurrence` (sparse codes).
      background: ``float64[K]`` from :func:`saffu.codes.code_background`.
      weight: ``λ``.

    Since codes sum to 1, ``Σ_k F_δ[k, v]`` is the target count, so
    ``F'_δ = (1 − λ) F_δ + λ b ⊗ Σ_k F_δ[k, :]`` exactly.
    """
    target_counts = cooccurrence.sum(axis=1, keepdims=True)              # [M, 1, V]
    return (1.0 - weight) * cooccurrence + weight * background[None, :, None] * target_counts


def feature_target(feature_fn: Callable[[jax.Array], jax.Array], num_features: int,
                   num_targets: int, radius: int,
                   target_fn: Callable[[jax.Array], jax.Array] | None = None,
                   dtype=jnp.float32) -> Accumulator:
    """Generic ``F = Σ_t φ(context_t)ᵀ y_t`` for any jittable non-negative feature map.

    Args:
      feature_fn: ``int32[C, radius] -> float[C, N]``, non-negative (later SAFFU stages pass
        attention values, hidden softmaxes, …).
      num_features: ``N``.
      num_targets: ``T`` — ``V`` for one-hot next-token targets, or the width of ``target_fn``.
      radius: context tokens the feature map reads.
      target_fn: ``int32[C] -> float[C, T]`` target distributions (for example the next
        token's cipher code); ``None`` means one-hot ``e(w_{t+1})`` over ``T = V`` tokens.
      dtype: accumulation dtype (float32 unless x64 is enabled).

    Finalized: ``float64[N, T]``; raises SaffuError if a feature was negative.
    """

    def init():
        shape = (num_targets, num_features) if target_fn is None else (num_features, num_targets)
        return jnp.zeros(shape, dtype)

    def update(state, context, targets, mask):
        features = feature_fn(context[:, :radius]).astype(dtype) * mask[:, None]
        if target_fn is None:  # rows of the target-major state: a scatter, no one-hot matrix
            return state.at[targets].add(features)
        return state + features.T @ target_fn(targets).astype(dtype)

    def finalize(state):
        stats = np.asarray(state, np.float64)
        stats = stats.T if target_fn is None else stats
        if (stats < 0).any():
            raise SaffuError("the feature function produced negative values; explicit "
                             "solutions need non-negative features (formulation §1)")
        return stats

    return Accumulator(radius, init, update, finalize)


def local_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` local devices (all by default)."""
    devices = jax.local_devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise SaffuError(f"asked for {num_devices} devices, {len(devices)} are available")
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (_DEVICE_AXIS,))


def _windows(stream: np.ndarray, first_target: int, end: int, num_devices: int,
             chunk_size: int, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side of one step: ``int32[D, R + C]`` windows and ``bool[D, C]`` masks."""
    windows = np.full((num_devices, radius + chunk_size), PAD_ID, np.int32)
    masks = np.zeros((num_devices, chunk_size), bool)
    for d in range(num_devices):
        begin = first_target + d * chunk_size
        lo, hi = max(begin - radius, 0), min(begin + chunk_size, end)
        if hi > lo:
            windows[d, lo - (begin - radius):hi - (begin - radius)] = stream[lo:hi]
        if hi > begin:
            masks[d, :hi - begin] = True
    return windows, masks


def accumulate_states(stream: np.ndarray, accumulators: Mapping[str, Accumulator], *,
                      begin: int = 1, end: int | None = None, chunk_size: int = 1 << 15,
                      mesh: Mesh | None = None, progress: str | None = "statistics") -> dict[str, State]:
    """Stream ``stream[begin:end]`` as targets through every accumulator at once.

    Args:
      stream: ``int[N]`` token stream (a memory map is fine; it is read a chunk at a time).
      accumulators: name -> :class:`Accumulator`.
      begin, end: target positions ``[begin, end)``; position 0 (the opening ``<eod>``) is
        never a target. Context before ``begin`` is still read.
      chunk_size: targets per device per step (fixed shape: compiled once, tail masked).
      mesh: 1-D device mesh (default: all local devices).
      progress: progress-bar label, or ``None`` for none.

    Returns name -> state summed over devices, as numpy (``int64`` for counts, ``float64``
    otherwise), ready for ``finalize`` or for :func:`merge_states` with another host's.
    """
    end = len(stream) if end is None else end
    if not 1 <= begin <= end <= len(stream):
        raise SaffuError(f"target range [{begin}, {end}) is outside the stream of {len(stream)} tokens")
    mesh = mesh or local_mesh()
    num_devices = mesh.devices.size
    radius = max([acc.radius for acc in accumulators.values()] + [1])
    sharded = NamedSharding(mesh, PartitionSpec(_DEVICE_AXIS))
    names = list(accumulators)

    def local_update(states, windows, masks):
        context, targets = document_context(windows[0], radius)
        return [acc.update(state[0], context, targets, masks[0])[None]
                for acc, state in zip((accumulators[n] for n in names), states)]

    step = jax.jit(jax.shard_map(local_update, mesh=mesh,
                                 in_specs=(PartitionSpec(_DEVICE_AXIS),) * 3,
                                 out_specs=PartitionSpec(_DEVICE_AXIS)),
                   donate_argnums=0)
    states = [jax.device_put(jnp.stack([accumulators[n].init()] * num_devices), sharded)
              for n in names]
    per_step = num_devices * chunk_size
    with tqdm(total=end - begin, unit="tok", unit_scale=True, desc=progress,
              disable=progress is None, leave=False) as bar:
        for first in range(begin, end, per_step):
            windows, masks = _windows(stream, first, end, num_devices, chunk_size, radius)
            states = step(states, jax.device_put(windows, sharded), jax.device_put(masks, sharded))
            bar.update(min(per_step, end - first))
    out = {}
    for name, state in zip(names, states):
        host = np.asarray(jax.device_get(state))
        wide = np.int64 if np.issubdtype(host.dtype, np.integer) else np.float64
        out[name] = host.sum(axis=0, dtype=wide)
    return out


def accumulate(stream: np.ndarray, accumulators: Mapping[str, Accumulator], **kwargs) -> dict[str, Any]:
    """:func:`accumulate_states` followed by each accumulator's ``finalize``.

    Returns name -> finalized statistics, plus ``"seconds"`` (wall time of the pass).
    """
    start = time.perf_counter()
    states = accumulate_states(stream, accumulators, **kwargs)
    result: dict[str, Any] = {name: accumulators[name].finalize(state) for name, state in states.items()}
    result["seconds"] = time.perf_counter() - start
    return result
