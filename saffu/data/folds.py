"""Folds of a training stream for cross-fitting: whole documents in evenly spaced blocks.

The stream (``<eod> doc_1 <eod> doc_2 <eod> …``, :mod:`saffu.data.workdir`) is cut at
document boundaries into ``blocks`` blocks of about equal tokens; block ``b`` belongs to fold
``b mod K``. So every fold holds every part of the stream (BabyLM concatenates its sources in
file order: contiguous halves would hold different sources), and no document is split. Document
``i`` is the targets ``(eod_i, eod_{i+1}]`` (its tokens and its closing ``<eod>``), so a block of
documents ``[a, b)`` is the target range ``[eod_a + 1, eod_b + 1)``.
"""

from __future__ import annotations

import numpy as np

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID

#: Blocks a stream is cut into (each fold takes every K-th).
FOLD_BLOCKS = 64


def _eods(stream: np.ndarray) -> np.ndarray:
    eods = np.flatnonzero(np.asarray(stream) == EOD_ID)
    if len(eods) < 2 or eods[0] != 0:
        raise SaffuError("a stream to fold must start with <eod> and hold at least one document")
    return eods


def fold_documents(stream: np.ndarray, folds: int, blocks: int = FOLD_BLOCKS) -> list[list[tuple[int, int]]]:
    """Per fold, its documents as index ranges ``[a, b)`` in stream order:
    ``stream uint[N]`` -> ``folds`` lists of ``(a, b)``. Blocks hold about ``N / blocks``
    tokens each (fewer blocks when there are fewer documents); every fold gets at least one."""
    if folds < 2:
        raise SaffuError(f"cross-fitting needs at least 2 folds, got {folds}")
    eods = _eods(stream)
    documents = len(eods) - 1
    blocks = min(max(blocks, folds), documents)
    if blocks < folds:
        raise SaffuError(f"the stream has {documents} documents, fewer than the {folds} folds")
    ends = eods[1:]                                   # the closing <eod> of each document
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, blocks) / blocks, side="left") + 1
    edges = np.unique(np.concatenate([[0], np.clip(cuts, 1, documents - 1), [documents]]))
    out: list[list[tuple[int, int]]] = [[] for _ in range(folds)]
    for b, (a, z) in enumerate(zip(edges[:-1], edges[1:])):
        out[b % folds].append((int(a), int(z)))
    return out


def fold_targets(stream: np.ndarray, folds: int, blocks: int = FOLD_BLOCKS) -> list[list[tuple[int, int]]]:
    """Per fold, its target position ranges ``[begin, end)`` of ``stream`` (whole documents,
    closing ``<eod>`` included), in stream order."""
    eods = _eods(stream)
    return [[(int(eods[a]) + 1, int(eods[z]) + 1) for a, z in ranges] for ranges in fold_documents(stream, folds, blocks)]


def other_folds(fold_ranges: list[list[tuple[int, int]]], k: int) -> list[tuple[int, int]]:
    """The ranges of every fold but ``k``, merged and in order (the data fold ``k``'s model is
    solved from)."""
    merged: list[list[int]] = []
    for a, z in sorted(r for i, ranges in enumerate(fold_ranges) if i != k for r in ranges):
        if merged and merged[-1][1] == a:
            merged[-1][1] = z
        else:
            merged.append([a, z])
    return [(a, z) for a, z in merged]


def fold_window_starts(stream: np.ndarray, folds: int, seq_len: int, blocks: int = FOLD_BLOCKS) -> list[np.ndarray]:
    """Per fold, the first target of every non-overlapping training window whose ``seq_len``
    targets all lie in that fold (``int64[W_k]``, in stream order)."""
    return [np.concatenate([np.arange(begin, end - seq_len + 1, seq_len) for begin, end in ranges]
                           or [np.zeros(0, np.int64)]).astype(np.int64)
            for ranges in fold_targets(stream, folds, blocks)]
