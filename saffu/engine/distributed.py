"""Several processes (hosts), one set of statistics: JAX's own multi-process runtime.

Every process runs the same command after :func:`initialize`. :func:`saffu.accumulate_states`
then gives each process its own contiguous range of whole documents (:func:`document_shard`:
no overlap, no gaps), accumulates it on the process's local devices, and adds the per-process
states with a collective (``multihost_utils.process_allgather``), so every process ends with
the same totals — bit-identical to one process for the integer counts — and solves the same
explicit weights. The exact sparse counter (:func:`saffu.ngram.counts.count_rows`) does the
same with its tables of distinct rows (:func:`merge_rows_over_processes`). On CPU the
collectives use gloo; on GPU/TPU clusters the platform's own.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID
from saffu.engine.rows import merge_rows

#: The mesh axis the statistics shard their per-device states over.
DEVICE_AXIS = "devices"


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join a ``num_processes``-process job whose process 0 listens at ``coordinator``
    (``HOST:PORT``). Call before any other JAX work."""
    if not 0 <= process_id < num_processes:
        raise SaffuError(f"--process-id {process_id} must be in [0, {num_processes})")
    # CPU collectives must be chosen explicitly; GPU and TPU backends ignore this setting
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def document_shard(stream: np.ndarray, process_id: int, num_processes: int, begin: int, end: int) -> tuple[int, int]:
    """Process ``process_id``'s target range inside ``[begin, end)``: ``num_processes``
    contiguous ranges of about equal size, cut only where a document starts (right after an
    ``<eod>``), covering ``[begin, end)`` exactly once."""
    starts = np.flatnonzero(np.asarray(stream[begin - 1:end - 1]) == EOD_ID) + begin  # targets opening a document
    cuts = [begin]
    for k in range(1, num_processes):
        ideal = begin + k * (end - begin) / num_processes
        index = np.searchsorted(starts, ideal)
        cuts.append(int(starts[index]) if index < len(starts) else end)
    cuts.append(end)
    cuts = np.maximum.accumulate(np.clip(cuts, begin, end))
    return int(cuts[process_id]), int(cuts[process_id + 1])


def sum_over_processes(state: np.ndarray) -> np.ndarray:
    """Add one host array over all processes (identical result everywhere; integers widened
    to int64, processes added in order)."""
    if jax.process_count() == 1:
        return state
    from jax.experimental import multihost_utils
    gathered = np.asarray(multihost_utils.process_allgather(state))
    wide = np.int64 if np.issubdtype(gathered.dtype, np.integer) else np.float64
    total = gathered[0].astype(wide)
    for other in gathered[1:]:
        total += other
    return total


def merge_rows_over_processes(rows: np.ndarray, counts: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge every process's sparse count table (:func:`saffu.ngram.counts.count_rows` of its own
    documents) into one, identical on every process; with one process the input is returned.

    Args:
      rows: ``int32[U_i, n]`` this process's distinct rows (``U_i`` differs between processes).
      counts: ``int64[U_i]`` their exact counts.
      vocab_size: ``V``.

    Returns ``rows int32[U, n]`` (distinct, lexicographically sorted) and ``int64[U]`` counts
    summed over processes — exact: the counts travel as two ``int32`` halves, so the collective
    needs no x64.
    """
    if jax.process_count() == 1:
        return rows, counts
    from jax.experimental import multihost_utils
    counts = np.asarray(counts, np.int64)
    halves = np.stack([(counts >> 32).astype(np.int32), (counts & 0xFFFFFFFF).astype(np.uint32).view(np.int32)], 1)
    table = np.concatenate([np.asarray(rows, np.int32), halves], axis=1)                # [U_i, n + 2]
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(table)], np.int32))).reshape(-1)
    padded = np.zeros((max(int(lengths.max()), 1), table.shape[1]), np.int32)
    padded[:len(table)] = table
    gathered = np.asarray(multihost_utils.process_allgather(padded))                  # [P, max U_i, n + 2]
    parts = []
    for length, part in zip(lengths, gathered):
        part = part[:length]
        high, low = part[:, -2].astype(np.int64), part[:, -1].view(np.uint32).astype(np.int64)
        parts.append((part[:, :-2], (high << 32) | low))
    return merge_rows(parts, vocab_size)


def local_mesh(num_devices: int | None = None, axis_name: str = DEVICE_AXIS) -> Mesh:
    """A 1-D mesh named ``axis_name`` over the first ``num_devices`` local devices (all by default)."""
    devices = jax.local_devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise SaffuError(f"asked for {num_devices} devices, {len(devices)} are available")
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (axis_name,))
