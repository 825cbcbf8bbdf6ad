"""Fixed-shape windows of a token stream for the sequence models (training and evaluation).

A window is ``R`` tokens of context followed by ``T`` targets, ``int32[R + T]``; positions
before the stream start are ``<pad>``, targets past the end are masked. Every shape is fixed,
so jitted steps compile once.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import EVAL_SEQ_LEN
from saffu.data.tokenizer import EOD_ID, PAD_ID


def window_at(stream: np.ndarray, first_target: int, end: int, context: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The window whose targets start at ``first_target``: ``int32[R + T]`` and ``bool[T]``."""
    window = np.full(context + seq_len, PAD_ID, np.int32)
    lo, hi = max(first_target - context, 0), min(first_target + seq_len, end)
    if hi > lo:  # nothing to copy for a window wholly past the end (a padded device chunk)
        offset = lo - (first_target - context)
        window[offset:offset + hi - lo] = stream[lo:hi]
    mask = np.zeros(seq_len, bool)
    mask[:max(hi - first_target, 0)] = True
    return window, mask


def stack_windows(stream: np.ndarray, starts, ends, context: int, seq_len: int,
                  rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`window_at` for every ``(start, end)`` of ``zip(starts, ends)``, stacked:
    ``int32[B, R + T]`` and ``bool[B, T]``; with ``rows``, padded to ``B = rows`` with fully
    masked ``<pad>`` rows (one compiled shape for a short last batch)."""
    pairs = [window_at(stream, int(s), int(e), context, seq_len) for s, e in zip(starts, ends)]
    windows = np.full((rows or len(pairs), context + seq_len), PAD_ID, np.int32)
    mask = np.zeros((rows or len(pairs), seq_len), bool)
    for i, (window, row_mask) in enumerate(pairs):
        windows[i], mask[i] = window, row_mask
    return windows, mask


def length_buckets(lengths, cap: int | None = None) -> list[tuple[int, list[int]]]:
    """``(width, indices)`` per bucket of ``lengths int[N]``: each length rounded up to a power of
    two ≥ 8 (at most ``cap``), so a few row shapes (few compilations) serve any set of rows;
    buckets by width, indices in order."""
    lengths = np.asarray(lengths, np.int64)
    width = 1 << np.maximum(np.ceil(np.log2(np.maximum(lengths, 1))).astype(int), 3)
    if cap is not None:
        width = np.minimum(width, cap)
    return [(int(w), [int(i) for i in np.flatnonzero(width == w)]) for w in np.unique(width)]


#: Fewest targets of a tight window (:func:`window_plan`).
MIN_TIGHT = 16
#: Target slots a narrower tight width must save to earn its own shape (its compilation costs
#: about as much as scoring this many positions of a small model on CPU).
TIGHT_SAVING = 8192


def window_plan(ranges: list[tuple[int, int]], seq_len: int, batch_size: int,
                tight: bool = False) -> list[tuple[int, list[tuple[int, int]]]]:
    """The batches covering the targets of every ``[begin, end)`` of ``ranges`` once (no window
    crosses a range's end): ``[(targets per window T', [(first target, end), …]), …]``, each
    batch at most ``batch_size`` windows of one ``T'``.

    Without ``tight`` every window has ``T' = seq_len`` (in order). With it, the last window of
    a range holding ``n < seq_len`` targets has the least power of two ``≥ max(n, MIN_TIGHT)``
    instead, so a sample of many short ranges scores little padding; of those widths the plan
    keeps the set whose target slots plus ``TIGHT_SAVING`` per extra shape are fewest, each
    window taking the least kept width ≥ its own (few shapes, few compilations: the whole split
    keeps one). A window keeps its start
    and context, and a causal model's outputs at its targets do not depend on positions after
    them, so the scores are unchanged."""
    windows = [(s, end) for begin, end in ranges for s in range(begin, end, seq_len)]
    widths = [seq_len] * len(windows)
    if tight:
        for i, (s, end) in enumerate(windows):
            n = min(end - s, seq_len)
            widths[i] = min(seq_len, 1 << max(int(np.ceil(np.log2(max(n, 1)))), int(np.log2(MIN_TIGHT))))
        shapes = _tight_shapes(collections.Counter(widths), seq_len)
        widths = [min(shape for shape in shapes if shape >= width) for width in widths]
    plan = []
    for width in sorted(set(widths), reverse=True):
        members = [window for window, w in zip(windows, widths) if w == width]
        plan += [(width, members[i:i + batch_size]) for i in range(0, len(members), batch_size)]
    return plan


def _tight_shapes(natural: collections.Counter, seq_len: int) -> list[int]:
    """The window widths :func:`window_plan` keeps: of every subset of the natural widths
    (``natural``: width -> windows) that holds ``seq_len``, the one scoring the fewest target
    slots (each window at the least kept width ≥ its own) plus :data:`TIGHT_SAVING` per extra
    shape; the fewer shapes on a tie. At most ``log2(seq_len / MIN_TIGHT)`` narrower widths, so
    every subset is tried."""
    narrower = sorted(width for width in natural if width < seq_len)
    best = None
    for size in range(len(narrower) + 1):
        for kept in itertools.combinations(narrower, size):
            shapes = [*kept, seq_len]
            slots = sum(count * min(shape for shape in shapes if shape >= width) for width, count in natural.items())
            cost = slots + TIGHT_SAVING * size
            if best is None or cost < best[0]:          # strict: on a tie the fewer shapes, tried first
                best = (cost, shapes)
    return best[1]


def range_windows(stream: np.ndarray, ranges: list[tuple[int, int]], context: int, seq_len: int,
                  batch_size: int, tight: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches ``(int32[B, R + T'], bool[B, T'])`` covering the targets of every ``[begin, end)``
    of ``ranges`` once, in order (no window crosses a range's end); the last batch of a shape
    is padded with fully masked rows. ``T' = seq_len``, or with ``tight`` fewer for the last
    window of a short range (:func:`window_plan`)."""
    for width, batch in window_plan(ranges, seq_len, batch_size, tight):
        yield stack_windows(stream, [s for s, _ in batch], [e for _, e in batch], context, width, batch_size)


def document_ranges(stream: np.ndarray, ranges: list[tuple[int, int]], seq_len: int) -> list[tuple[int, int]]:
    """``ranges`` (target ranges of whole documents: the token before each ``begin`` is an
    ``<eod>``) cut at document starts into runs of consecutive whole documents of at most
    ``seq_len`` targets each (a document and its closing ``<eod>``); a longer document is a
    range of its own. A window of :func:`window_plan` then starts at a document start (its
    ``<eod>`` the last context token) or, inside a long document, ``seq_len`` targets after the
    previous window of that document: where a document sits no longer depends on its neighbours."""
    out = []
    for begin, end in ranges:
        starts = begin + np.flatnonzero(np.asarray(stream[begin - 1:end - 1]) == EOD_ID)
        if not len(starts) or starts[0] != begin:
            raise SaffuError(f"target range [{begin}, {end}) does not begin at a document start")
        bounds = np.append(starts, end)
        run = int(bounds[0])
        for here, after in itertools.pairwise(bounds):
            if after - run > seq_len and here > run:        # the run is full: a new one from this document
                out.append((run, int(here)))
                run = int(here)
            if after - here > seq_len:                      # a long document: a range of its own
                out.append((int(here), int(after)))
                run = int(after)
        if end > run:
            out.append((run, int(end)))
    return out


def document_positions(windows: np.ndarray, context: int) -> np.ndarray:
    """Each token's position ``int32[B, S]`` in windows of :func:`document_ranges`: a document
    whose ``<eod>`` is at or after index ``context − 1`` counts from there, its ``<eod>`` at
    ``context − 1`` (where saffu reads every document from); anything else (the context before,
    the continuation of a long document) keeps its index in the window."""
    index = np.arange(windows.shape[1])[None]
    last = np.maximum.accumulate(np.where(windows == EOD_ID, index, -1), axis=1)
    return np.where(last >= context - 1, context - 1 + index - last, index).astype(np.int32)


def total_nll(loss_fn: Callable, stream: np.ndarray, ranges: list[tuple[int, int]], context: int,
              seq_len: int = EVAL_SEQ_LEN, batch_size: int = 16, progress: str | None = None,
              tight: bool = True, positioned: bool = False) -> tuple[float, int]:
    """Sum a jitted ``loss_fn(windows int32[B, R + T'], mask bool[B, T']) -> (nll_sum, count)``
    over the targets of every ``[begin, end)`` of ``ranges``, in the batches of
    :func:`window_plan` (``tight``: a short range's last window shortened; ``loss_fn`` must
    take any ``T' ≤ seq_len``). With ``positioned`` (a model that reads absolute positions),
    the windows start at documents (:func:`document_ranges`) and ``loss_fn`` takes their
    :func:`document_positions` as a third argument: every document is scored from the same
    positions wherever it sits in the split.

    Returns ``(total NLL in nats, number of targets)``; sums are float64 on the host. The
    result of a batch is read back only after the next batch is dispatched, so the host
    prepares windows while the device computes.
    """
    if positioned:
        ranges = document_ranges(stream, ranges, seq_len)
    total, count = 0.0, 0
    num_batches = len(window_plan(ranges, seq_len, batch_size, tight))
    pending = None
    for windows, mask in tqdm(range_windows(stream, ranges, context, seq_len, batch_size, tight),
                              total=num_batches, desc=progress, disable=progress is None, leave=False):
        extra = (jnp.asarray(document_positions(windows, context)),) if positioned else ()
        result = loss_fn(jnp.asarray(windows), jnp.asarray(mask), *extra)
        if pending is not None:
            total += float(pending[0])
            count += int(pending[1])
        pending = result
    if pending is not None:
        total += float(pending[0])
        count += int(pending[1])
    return total, count


def shuffled_window_starts(begin: int, end: int, seq_len: int, key: jax.Array) -> np.ndarray:
    """Start positions of non-overlapping training windows over targets ``[begin, end)`` in a
    seeded random order (one epoch)."""
    starts = np.arange(begin, end, seq_len)
    seed = np.asarray(jax.random.key_data(key)).ravel()
    return np.random.default_rng(seed).permutation(starts)


def evenly_spaced_windows(stream: np.ndarray, model, seq_len: int, count: int):
    """``count`` non-overlapping windows of ``model.context + seq_len`` tokens spread evenly over
    the whole stream (a dev subset that samples every file, not only the first):
    ``int32[count', R + T]`` windows and ``bool[count', T]`` masks (``count' ≤ count``, fewer
    when the stream is short)."""
    last = max(len(stream) - seq_len, 1)
    starts = np.unique(np.linspace(1, last, min(count, max(last // seq_len, 1))).astype(int))
    windows, mask = stack_windows(stream, starts, [len(stream)] * len(starts), model.context, seq_len)
    return jnp.asarray(windows), jnp.asarray(mask)
