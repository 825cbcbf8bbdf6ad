"""Several processes (hosts), one set of statistics: JAX's own multi-process runtime.

Every process runs the same command after :func:`initialize`. :func:`saffu.accumulate_states`
then gives each process its own contiguous range of whole documents (:func:`document_shard`:
no overlap, no gaps), accumulates it on the process's local devices, and adds the per-process
states with a collective (``multihost_utils.process_allgather``), so every process ends with
the same totals — bit-identical to one process for the integer counts — and solves the same
explicit weights. The exact sparse counter (:func:`saffu.ngram.counts.count_rows`) does the
same with its tables of distinct rows (:func:`merge_rows_over_processes`). On CPU the
collectives use gloo; on GPU/TPU clusters the platform's own.

Training runs the same way (:func:`saffu.training.trainer.train` with a mesh over every
process's devices, :func:`global_mesh`): each process builds the same batch, keeps its own rows
(:func:`put_global`) and computes their gradients, and one all-reduce adds them. On one machine
:func:`spawn_local` starts the other processes of such a job, each pinned to a core of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

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


def local_coordinator() -> str:
    """``"127.0.0.1:PORT"`` with a port free now: where process 0 of a job on this machine listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def spawn_local(argv: list[str], num_processes: int) -> tuple[str, list[subprocess.Popen]]:
    """Start processes ``1 … num_processes − 1`` of a job on this machine, each running
    ``python -m saffu <argv> --coordinator C --process-id i --quiet`` (their standard output
    discarded: process 0 reports), and pin this process (process 0; call before any JAX work)
    and each of them to one core of their own when there are enough cores (one process per core
    is what runs a CPU at its speed: one process's XLA threads leave a second core half idle).

    Returns ``(coordinator "127.0.0.1:PORT", the started processes)``."""
    coordinator = local_coordinator()
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= num_processes
    started = []
    for process_id in range(1, num_processes):
        core = {cores[process_id]} if pin else None
        started.append(subprocess.Popen(
            [sys.executable, "-m", "saffu", *argv, "--coordinator", coordinator, "--process-id", str(process_id),
             "--quiet"], stdout=subprocess.DEVNULL,
            preexec_fn=(lambda core=core: os.sched_setaffinity(0, core)) if pin else None))
    if pin:
        os.sched_setaffinity(0, {cores[0]})
    return coordinator, started


def is_writer() -> bool:
    """Whether this process writes a job's files (process 0; the only one of a one-process job)."""
    return jax.process_index() == 0


def global_mesh(axis_name: str = "data") -> Mesh:
    """A 1-D mesh named ``axis_name`` over every device of every process (process by process)."""
    return Mesh(np.asarray(jax.devices()), (axis_name,))


def put_global(tree, sharding: Sharding):
    """Every array of ``tree`` (the same full value on every process) as one array of
    ``sharding``, which may span several processes: each process places only its own part
    (``jax.make_array_from_callback``; ``jax.device_put`` within one process)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                               lambda index: np.asarray(x)[index]), tree)


def local_copy(tree):
    """Every array of ``tree`` as this process's own copy on one of its devices: a replicated
    array of a multi-process job becomes an array jit can use without the other processes."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)


def leave() -> None:
    """End this process's part in a multi-process job (``jax.distributed.shutdown``: every
    process waits there for the others). Call it where all of them are done with collectives;
    afterwards each process computes on its own devices only, e.g. process 0 scoring a model
    while the others exit (were they to exit first, their shutdown would wait for it)."""
    global _LEFT
    if jax.process_count() > 1 and not _LEFT:
        jax.distributed.shutdown()
        _LEFT = True


_LEFT = False


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
