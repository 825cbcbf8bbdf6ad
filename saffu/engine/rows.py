"""Exact counts of distinct integer rows on the host: the sparse tables of the n-gram counts
(:mod:`saffu.ngram.counts`), their merge over ranges, devices and hosts
(:func:`saffu.engine.distributed.merge_rows_over_processes`), and the (head, target) pairs
a bigram is scored on.
"""

from __future__ import annotations

import numpy as np


def unique_rows(rows: np.ndarray, counts: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``int32[M, n]`` with summed ``int64`` counts (exact: hierarchical
    keys, never more than ``M · V``)."""
    ids = np.zeros(len(rows), np.int64)
    for column in range(rows.shape[1]):
        _, ids = np.unique(ids * vocab_size + rows[:, column], return_inverse=True)
        ids = ids.reshape(-1)
    size = int(ids.max()) + 1 if len(ids) else 0
    first = np.full(size, len(rows), np.int64)
    np.minimum.at(first, ids, np.arange(len(rows)))
    summed = np.zeros(size, np.int64)
    np.add.at(summed, ids, counts)
    return rows[first], summed


def merge_rows(parts: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Several :func:`saffu.ngram.counts.count_rows` results (ranges, hosts) as one: distinct rows, summed exact counts."""
    rows = np.concatenate([r for r, _ in parts])
    counts = np.concatenate([c for _, c in parts])
    return unique_rows(rows, counts, vocab_size)


def pair_counts(stream: np.ndarray, begin: int = 1, end: int | None = None,
                vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (head, target) pairs of ``stream[begin:end]`` as targets, with counts.

    Returns ``heads int32[P]``, ``targets int32[P]``, ``counts int64[P]`` (exact).
    """
    end = len(stream) if end is None else end
    heads = np.asarray(stream[begin - 1:end - 1], np.int64)
    targets = np.asarray(stream[begin:end], np.int64)
    vocab_size = vocab_size or int(max(heads.max(initial=0), targets.max(initial=0))) + 1
    keys, counts = np.unique(heads * vocab_size + targets, return_counts=True)
    return (keys // vocab_size).astype(np.int32), (keys % vocab_size).astype(np.int32), counts
