"""Exact sparse n-gram counts from the engine's document contexts.

Documents and sentence marks. A stream is ``<eod> doc_1 <eod> doc_2 <eod> …``. The target at
position ``t`` is predicted from the tokens before it *in its own document*; the ``<eod>``
that opens a document is the sentence start ``<s>`` and a target ``<eod>`` is the sentence end
``</s>``. No n-gram crosses a document boundary — exactly the sentences of kenlm / ARPA. In
the token tuples of this module (``NgramTable.tokens``) an ``<eod>`` can only stand first
(``<s>``, in an n-gram of order ≥ 2) or last (``</s>``, the predicted token), so the id is
unambiguous by position. The vocabulary is every id except ``<pad>``: ``V − 1`` tokens, with
``<eod>`` as ``</s>``.

Counting. The (order)-gram of every target comes from the statistics engine's document
contexts: a jitted step turns each :func:`saffu.data.windows.window_at` window into
:func:`saffu.engine.accumulators.document_context` rows (``<pad>`` before the document start, which
here means "no token"); the host merges exact ``int64`` counts of distinct rows chunk by
chunk. The engine's :class:`saffu.engine.accumulators.Accumulator` keeps a dense ``int32`` state of a
fixed shape, which cannot hold a sparse table of unknown size (``V^5`` cells for 5-grams), so
this module has its own sparse counter on the engine's windows and contexts. Rows are made
exact without packing all tokens in one integer (``V^5`` passes ``2^63`` for ``V = 8192``):
n-grams are numbered hierarchically, ``key(x_1 … x_k) = id(x_2 … x_k) · V + x_1`` where ``id``
is the index of the suffix in the sorted table one order lower (order 1: the token id
itself), so every key stays below ``(table size) · V``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.data.windows import window_at
from saffu.engine import distributed
from saffu.engine.accumulators import document_context
from saffu.engine.rows import unique_rows

_MERGE_ROWS = 1 << 22          # distinct rows kept pending before a merge


class NgramTable(NamedTuple):
    """Exact counts of the distinct n-grams of one order ``k``.

    Attributes:
      keys: ``int64[M]``, sorted: ``id(x_2 … x_k) · V + x_1`` (module docstring), where ``id``
        is a row index of the order ``k − 1`` table — for ``k = 2`` the token id ``x_2``
        itself; order 1: the token id.
      counts: ``int64[M]`` — how many targets end each n-gram (raw counts).
      tokens: ``int32[M, k]`` — the n-grams, oldest token first (``<eod>`` first = ``<s>``,
        last = ``</s>``).
    """

    keys: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray


def lookup(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row index of each query key in the sorted ``keys``, ``-1`` when absent (or query < 0)."""
    index = np.searchsorted(keys, queries)
    index = np.minimum(index, len(keys) - 1) if len(keys) else np.zeros_like(queries)
    found = (queries >= 0) & (len(keys) > 0)
    if len(keys):
        found &= keys[index] == queries
    return np.where(found, index, -1)


def gather(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[index]`` where ``index ≥ 0``, 0 elsewhere (also for an empty ``values``)."""
    if len(values) == 0:
        return np.zeros(index.shape)
    return np.where(index >= 0, values[np.maximum(index, 0)], 0.0)


@functools.partial(jax.jit, static_argnames=("radius", "columns"))
def _rows_step(window: jax.Array, radius: int, columns: tuple[int, ...]) -> jax.Array:
    """``int32[R + C] window -> int32[C, len(columns) + 1]`` rows: the in-document context tokens
    at ``columns`` (``δ`` = positions before the head, the head being ``δ = 0``; ``<pad>`` where
    the document has no token), then the target. One module-level jit: the radius and the
    columns are its static configuration, the window its argument."""
    context, targets = document_context(window, radius)
    return jnp.concatenate([context[:, list(columns)], targets[:, None]], axis=1)


def check_range(stream: np.ndarray, begin: int, end: int | None) -> int:
    end = len(stream) if end is None else end
    if not 1 <= begin <= end <= len(stream):
        raise SaffuError(f"target range [{begin}, {end}) is outside the stream of {len(stream)} tokens")
    return end


def ngram_columns(order: int) -> tuple[int, ...]:
    """The context columns of an ``order``-gram, oldest first: ``(order − 2, …, 1, 0)``."""
    return tuple(range(order - 2, -1, -1))


def iter_rows(stream: np.ndarray, columns: tuple[int, ...], begin: int, end: int, vocab_size: int,
              chunk_size: int, progress: str | None) -> Iterator[np.ndarray]:
    """Rows (see :func:`_rows_step`) of targets ``[begin, end)``, a chunk at a time;
    ``columns`` are context offsets (:func:`ngram_columns` for n-grams)."""
    radius = max(max(columns, default=0) + 1, 1)
    columns = tuple(int(c) for c in columns)
    if (np.asarray(stream[max(begin - radius, 0):begin]) >= vocab_size).any():
        raise SaffuError(f"the stream holds token ids ≥ the vocabulary size {vocab_size}; "
                         f"use the model of this work directory's vocabulary")
    with tqdm(total=end - begin, unit="tok", unit_scale=True, desc=progress,
              disable=progress is None, leave=False) as bar:
        for first in range(begin, end, chunk_size):
            window, mask = window_at(stream, first, end, radius, chunk_size)
            rows = np.asarray(_rows_step(window, radius=radius, columns=columns))[:int(mask.sum())]
            targets = rows[:, -1]
            if (targets == PAD_ID).any():
                raise SaffuError("the stream holds <pad> tokens; token streams never contain <pad> "
                                 "(run `saffu prepare` again)")
            if (targets >= vocab_size).any() or (targets < 0).any():
                raise SaffuError(f"the stream holds token ids outside [0, {vocab_size}); use the model "
                                 f"of this work directory's vocabulary")
            bar.update(len(rows))
            yield rows


def count_rows(stream: np.ndarray, columns: tuple[int, ...], ranges: list[tuple[int, int]], *,
               vocab_size: int, chunk_size: int = 1 << 16,
               progress: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact counts of the distinct (context tokens at ``columns``, target) rows of every target
    in the ``ranges``: the one sparse counter behind the n-gram tables and the exact explicit
    groups (:mod:`saffu.solve.exact`).

    Args:
      stream: ``int[N]`` token stream starting with ``<eod>`` (a memory map is fine).
      columns: context offsets ``δ`` (0 = the token right before the target); ``<pad>`` stands
        for "before the document start".
      ranges: target ranges ``[(begin, end), …]``; context before a range is still read.
      vocab_size: ``V``.
      chunk_size: targets per jitted step.
      progress: progress-bar label, or ``None``.

    Returns ``rows int32[U, len(columns) + 1]`` (lexicographically sorted) and their ``int64[U]``
    counts; counts of ranges and of hosts add (exact integers). In a multi-process job
    (:mod:`saffu.engine.distributed`) each process counts its own documents of every range and
    the tables are merged over processes, so every process returns the same (whole) table.
    """
    if len(stream) == 0 or int(stream[0]) != EOD_ID:
        raise SaffuError("the token stream must start with <eod> (the opening document start); "
                         "use a stream written by `saffu prepare`")
    local = [(begin, check_range(stream, begin, end)) for begin, end in ranges]
    if jax.process_count() > 1:  # multi-process job: this process's documents of each range, then a merge
        local = [distributed.document_shard(stream, jax.process_index(), jax.process_count(), begin, end)
                 for begin, end in local]
    pending_rows: list[np.ndarray] = []
    pending_counts: list[np.ndarray] = []
    pending = 0
    for begin, end in local:
        for rows in iter_rows(stream, columns, begin, end, vocab_size, chunk_size, progress):
            rows, counts = unique_rows(rows, np.ones(len(rows), np.int64), vocab_size)
            pending_rows.append(rows)
            pending_counts.append(counts)
            pending += len(rows)
            if pending > _MERGE_ROWS and len(pending_rows) > 1:
                merged = unique_rows(np.concatenate(pending_rows), np.concatenate(pending_counts), vocab_size)
                pending_rows, pending_counts, pending = [merged[0]], [merged[1]], len(merged[0])
    rows, counts = (unique_rows(np.concatenate(pending_rows), np.concatenate(pending_counts), vocab_size)
                    if pending_rows else (np.zeros((0, len(columns) + 1), np.int32), np.zeros(0, np.int64)))
    rows, counts = distributed.merge_rows_over_processes(rows, counts, vocab_size)
    if not len(rows):
        raise SaffuError(f"no targets to count in {ranges}")
    return rows, counts


def count_ngrams(stream: np.ndarray, order: int, *, vocab_size: int | None = None, begin: int = 1,
                 end: int | None = None, chunk_size: int = 1 << 16,
                 progress: str | None = None) -> list[NgramTable]:
    """Exact counts of every n-gram of orders ``1 … order`` ending at a target in ``[begin, end)``.

    Args:
      stream: ``int[N]`` token stream starting with ``<eod>`` (a memory map is fine).
      order: ``N ≥ 1``.
      vocab_size: ``V`` (default: the largest id + 1).
      begin, end: target positions (context before ``begin`` is still read).
      chunk_size: targets per jitted step.
      progress: progress-bar label, or ``None``.

    Returns ``[table_1, …, table_N]`` (:class:`NgramTable`); an n-gram of order ``k`` is counted
    once per target whose in-document context has at least ``k − 1`` tokens (``<s>`` included),
    so n-grams never cross a document boundary.
    """
    if order < 1:
        raise SaffuError(f"n-gram order {order} must be at least 1")
    end = check_range(stream, begin, end)
    if len(stream) == 0 or int(stream[0]) != EOD_ID:
        raise SaffuError("the token stream must start with <eod> (the opening document start); "
                         "use a stream written by `saffu prepare`")
    if vocab_size is None:
        vocab_size = max(int(np.max(stream[:end])) + 1, EOD_ID + 1)
    rows, counts = count_rows(stream, ngram_columns(order), [(begin, end)], vocab_size=vocab_size,
                              chunk_size=chunk_size, progress=progress)
    return _tables_from_rows(rows.astype(np.int64), counts, order, vocab_size)


def _tables_from_rows(rows: np.ndarray, counts: np.ndarray, order: int,
                      vocab_size: int) -> list[NgramTable]:
    """Per-order tables from distinct full rows ``int64[U, N]`` and their counts."""
    targets = rows[:, -1]
    seen = np.unique(targets)
    unigram_counts = np.zeros(vocab_size, np.int64)
    np.add.at(unigram_counts, targets, counts)
    tables = [NgramTable(seen, unigram_counts[seen], seen[:, None].astype(np.int32))]
    ids = targets.copy()                                   # order-1 id of each row: the token
    valid = np.ones(len(rows), bool)
    for k in range(2, order + 1):
        first = rows[:, order - k]
        valid &= first != PAD_ID
        keys, inverse = np.unique(ids[valid] * vocab_size + first[valid], return_inverse=True)
        inverse = inverse.reshape(-1)
        table_counts = np.zeros(len(keys), np.int64)
        np.add.at(table_counts, inverse, counts[valid])
        previous = tables[-1].tokens if k > 2 else None
        parent = keys // vocab_size
        suffix = parent[:, None].astype(np.int32) if previous is None else previous[parent]
        tokens = np.concatenate([(keys % vocab_size)[:, None].astype(np.int32), suffix], axis=1)
        tables.append(NgramTable(keys, table_counts, tokens))
        ids = np.full(len(rows), -1, np.int64)
        ids[valid] = inverse
    return tables
