"""Interpolated modified Kneser-Ney n-gram baseline (Chen & Goodman 1998), with ARPA output.

Documents and sentence marks. A stream is ``<eod> doc_1 <eod> doc_2 <eod> …``. The target at
position ``t`` is predicted from the tokens before it *in its own document*; the ``<eod>``
that opens a document is the sentence start ``<s>`` and a target ``<eod>`` is the sentence end
``</s>``. No n-gram crosses a document boundary — exactly the sentences of kenlm / ARPA. In
the token tuples of this module (``NgramTable.tokens``) an ``<eod>`` can only stand first
(``<s>``, in an n-gram of order ≥ 2) or last (``</s>``, the predicted token), so the id is
unambiguous by position. The vocabulary is every id except ``<pad>``: ``V − 1`` tokens, with
``<eod>`` as ``</s>``.

Counting. The (order)-gram of every target comes from the statistics engine's document
contexts: a jitted step turns each :func:`saffu.batches.window_at` window into
:func:`saffu.statistics.document_context` rows (``<pad>`` before the document start, which
here means "no token"); the host merges exact ``int64`` counts of distinct rows chunk by
chunk. The engine's :class:`saffu.statistics.Accumulator` keeps a dense ``int32`` state of a
fixed shape, which cannot hold a sparse table of unknown size (``V^5`` cells for 5-grams), so
this module has its own sparse counter on the engine's windows and contexts. Rows are made
exact without packing all tokens in one integer (``V^5`` passes ``2^63`` for ``V = 8192``):
n-grams are numbered hierarchically, ``key(x_1 … x_k) = id(x_2 … x_k) · V + x_1`` where ``id``
is the index of the suffix in the sorted table one order lower (order 1: the token id
itself), so every key stays below ``(table size) · V``.

Estimator. For an n-gram ``g = h w`` of order ``k`` the adjusted count ``a(g)`` is

* the raw count at the highest order ``N``;
* the raw count for n-grams that start with ``<s>`` at any order (they have no left
  extension: a document starts there — Heafield et al. 2013, as kenlm's ``lmplz`` does);
* the continuation count ``N1+(• g)`` (distinct one-token left extensions) otherwise.

Three discounts per order come from the count-of-counts ``n_j`` of the adjusted counts of that
order (over all its n-grams, the ``<s>``-initial ones with their raw counts):
``Y = n_1 / (n_1 + 2 n_2)``, ``D_j = j − (j + 1) Y n_{j+1} / n_j`` (``j = 1, 2, 3``; ``D_3``
serves every count ≥ 3). When a discount is undefined (some ``n_j = 0``) or not positive —
tiny corpora — the order uses lmplz's ``--discount_fallback`` values
``(0.5, 1.0, 1.5)`` and :attr:`KneserNeyModel.fallback` records it. Then

``p_k(w | h) = (a(h w) − D(a(h w))) / Σ_v a(h v) + γ(h) · p_{k−1}(w | h')``,
``γ(h) = (D_1 N_1(h •) + D_2 N_2(h •) + D_3 N_3+(h •)) / Σ_v a(h v)``

with ``h'`` the context without its oldest token, ``p_k(w | h) = p_{k−1}(w | h')`` for a
context never seen, and at the bottom ``p_0(w) = 1 / (V − 1)`` (uniform over the vocabulary,
``</s>`` included, ``<s>`` and ``<pad>`` excluded). A target is scored with its whole
in-document context up to ``N − 1`` tokens: near a document start that context begins with
``<s>`` and is shorter, exactly as kenlm scores the start of a sentence.

ARPA form. The interpolated model is exactly a backoff model: a seen ``h w`` gets
``p_k(w | h)``, the backoff weight of a seen context ``h`` is ``γ(h)``, every other backoff is
1, and ``p(w | h) = bo(h) · p(w | h')`` for unseen ``h w``. Seen n-grams are closed under
prefixes and suffixes, as kenlm requires. :func:`write_arpa` names tokens ``t<id>``, writes
``<s>`` (log10 prob ``-99``) and ``</s>`` for ``<eod>``, and ``<unk>`` with the probability
of an unseen token (never used: the vocabulary is closed).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import re
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError, atomic_open
from saffu.batches import window_at
from saffu.evaluation import split_metrics
from saffu.workdir import WorkDir
from saffu.statistics import document_context
from saffu.tokenizer import EOD_ID, PAD_ID

FALLBACK_DISCOUNTS = (0.5, 1.0, 1.5)
_LN10 = math.log(10.0)
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


@dataclasses.dataclass(frozen=True)
class KneserNeyModel:
    """An interpolated modified Kneser-Ney model in backoff form (module docstring).

    Attributes:
      order: ``N``.
      vocab_size: ``V`` (ids ``0 … V−1``; ``<pad>`` is not in the vocabulary).
      keys: per order ``k = 1 … N`` (index ``k − 1``): order 1 ``arange(V)`` (dense, the token
        id); order ``k ≥ 2`` the sorted :attr:`NgramTable.keys` of the seen n-grams.
      log_prob: per order, ``float64[M_k]`` natural-log ``p_k(w | h)`` of each n-gram. Order 1
        is dense over ids: ``[<pad>] = −inf``, ``[<eod>] = log p(</s>)``.
      log_backoff: per order, ``float64[M_k]`` natural-log ``γ`` of each n-gram as a context
        (0 where it is none; always 0 at order ``N``). Order 1: ``[<eod>]`` is ``γ(<s>)``.
      discounts: ``float64[N, 3]`` — ``D_1, D_2, D_3+`` per order (NaN when read from ARPA).
      fallback: per order, whether the discounts are the fallback values.
      unk_log_prob: natural-log probability written for ``<unk>`` (an unseen token's).
    """

    order: int
    vocab_size: int
    keys: tuple[np.ndarray, ...]
    log_prob: tuple[np.ndarray, ...]
    log_backoff: tuple[np.ndarray, ...]
    discounts: np.ndarray
    fallback: tuple[bool, ...]
    unk_log_prob: float

    def num_ngrams(self) -> list[int]:
        """Entries per order (order 1: the vocabulary, ``V − 1``)."""
        return [self.vocab_size - 1] + [len(k) for k in self.keys[1:]]


# --------------------------------------------------------------------------- counting

@functools.lru_cache(maxsize=16)
def _rows_step(radius: int, order: int):
    """Jitted ``int32[R + C] window -> int32[C, order]`` rows: the ``order − 1`` in-document
    context tokens, oldest first, then the target (``<pad>`` where the document has no token)."""

    @jax.jit
    def rows(window):
        context, targets = document_context(window, radius)
        return jnp.concatenate([context[:, :order - 1][:, ::-1], targets[:, None]], axis=1)

    return rows


def _check_range(stream: np.ndarray, begin: int, end: int | None) -> int:
    end = len(stream) if end is None else end
    if not 1 <= begin <= end <= len(stream):
        raise SaffuError(f"target range [{begin}, {end}) is outside the stream of {len(stream)} tokens")
    return end


def _iter_rows(stream: np.ndarray, order: int, begin: int, end: int, vocab_size: int,
               chunk_size: int, progress: str | None) -> Iterator[np.ndarray]:
    """Rows (see :func:`_rows_step`) of targets ``[begin, end)``, a chunk at a time."""
    radius = max(order - 1, 1)
    step = _rows_step(radius, order)
    if (np.asarray(stream[max(begin - radius, 0):begin]) >= vocab_size).any():
        raise SaffuError(f"the stream holds token ids ≥ the vocabulary size {vocab_size}; "
                         f"use the model of this work directory's vocabulary")
    with tqdm(total=end - begin, unit="tok", unit_scale=True, desc=progress,
              disable=progress is None, leave=False) as bar:
        for first in range(begin, end, chunk_size):
            window, mask = window_at(stream, first, end, radius, chunk_size)
            rows = np.asarray(step(window))[:int(mask.sum())]
            targets = rows[:, -1]
            if (targets == PAD_ID).any():
                raise SaffuError("the stream holds <pad> tokens; token streams never contain <pad> "
                                 "(run `saffu prepare` again)")
            if (targets >= vocab_size).any() or (targets < 0).any():
                raise SaffuError(f"the stream holds token ids outside [0, {vocab_size}); use the model "
                                 f"of this work directory's vocabulary")
            bar.update(len(rows))
            yield rows


def _unique_rows(rows: np.ndarray, counts: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
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
    end = _check_range(stream, begin, end)
    if len(stream) == 0 or int(stream[0]) != EOD_ID:
        raise SaffuError("the token stream must start with <eod> (the opening document start); "
                         "use a stream written by `saffu prepare`")
    if vocab_size is None:
        vocab_size = max(int(np.max(stream[:end])) + 1, EOD_ID + 1)
    pending_rows: list[np.ndarray] = []
    pending_counts: list[np.ndarray] = []
    pending = 0
    for rows in _iter_rows(stream, order, begin, end, vocab_size, chunk_size, progress):
        rows, counts = _unique_rows(rows, np.ones(len(rows), np.int64), vocab_size)
        pending_rows.append(rows)
        pending_counts.append(counts)
        pending += len(rows)
        if pending > _MERGE_ROWS and len(pending_rows) > 1:
            merged = _unique_rows(np.concatenate(pending_rows), np.concatenate(pending_counts), vocab_size)
            pending_rows, pending_counts, pending = [merged[0]], [merged[1]], len(merged[0])
    if not pending_rows:
        raise SaffuError(f"no targets to count in [{begin}, {end})")
    rows, counts = _unique_rows(np.concatenate(pending_rows), np.concatenate(pending_counts), vocab_size)
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


# --------------------------------------------------------------------------- estimation

def modified_kn_discounts(count_of_counts: Sequence[int]) -> tuple[np.ndarray, bool]:
    """Chen & Goodman's ``D_1, D_2, D_3+`` from ``n_1 … n_4`` (counts of adjusted counts 1…4).

    Returns ``float64[3]`` and whether the fallback ``(0.5, 1.0, 1.5)`` was used (some ``n_j``
    zero, or a discount not positive).
    """
    n1, n2, n3, n4 = (float(n) for n in count_of_counts[:4])
    if min(n1, n2, n3) > 0:
        y = n1 / (n1 + 2.0 * n2)
        discounts = np.array([1.0 - 2.0 * y * n2 / n1, 2.0 - 3.0 * y * n3 / n2, 3.0 - 4.0 * y * n4 / n3])
        if np.all(np.isfinite(discounts)) and np.all(discounts > 0):
            return discounts, False
    return np.array(FALLBACK_DISCOUNTS, np.float64), True


def _discount_terms(adjusted: np.ndarray) -> tuple[np.ndarray, bool, np.ndarray]:
    """Discounts of one order and the discount ``D(a)`` of every adjusted count ``a ≥ 1``."""
    positive = adjusted[adjusted > 0]
    count_of_counts = [int(np.sum(positive == j)) for j in (1, 2, 3, 4)]
    discounts, fallback = modified_kn_discounts(count_of_counts)
    per_count = np.where(adjusted > 0, discounts[np.clip(adjusted, 1, 3) - 1], 0.0)
    return discounts, fallback, per_count


def _lookup(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row index of each query key in the sorted ``keys``, ``-1`` when absent (or query < 0)."""
    index = np.searchsorted(keys, queries)
    index = np.minimum(index, len(keys) - 1) if len(keys) else np.zeros_like(queries)
    found = (queries >= 0) & (len(keys) > 0)
    if len(keys):
        found &= keys[index] == queries
    return np.where(found, index, -1)


def _gather(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[index]`` where ``index ≥ 0``, 0 elsewhere (also for an empty ``values``)."""
    if len(values) == 0:
        return np.zeros(index.shape)
    return np.where(index >= 0, values[np.maximum(index, 0)], 0.0)


def estimate_kneser_ney(tables: Sequence[NgramTable], vocab_size: int) -> KneserNeyModel:
    """The interpolated modified Kneser-Ney model of :func:`count_ngrams` tables.

    Args:
      tables: orders ``1 … N``, as :func:`count_ngrams` returns them.
      vocab_size: ``V``, as used for the keys.

    Returns a :class:`KneserNeyModel` (see the module docstring for the estimator).
    """
    order, V = len(tables), vocab_size
    if order < 1 or len(tables[0].keys) == 0:
        raise SaffuError("no n-grams to estimate from; count a non-empty stream")
    if V < 3:
        raise SaffuError(f"vocabulary size {V} is too small (need <pad>, <eod> and a token)")
    # adjusted counts, per order (order 1 dense over ids)
    adjusted: list[np.ndarray] = []
    for k in range(1, order + 1):
        if k == order:
            raw = tables[k - 1].counts
            if k == 1:
                dense = np.zeros(V, np.int64)
                dense[tables[0].keys] = raw
                raw = dense
            adjusted.append(raw.astype(np.int64))
            continue
        size = V if k == 1 else len(tables[k - 1].keys)
        continuation = np.bincount(tables[k].keys // V, minlength=size).astype(np.int64)
        if k == 1:
            adjusted.append(continuation)
        else:
            starts_with_bos = tables[k - 1].tokens[:, 0] == EOD_ID
            adjusted.append(np.where(starts_with_bos, tables[k - 1].counts, continuation))
        if k > 1 and (adjusted[-1] <= 0).any():
            raise SaffuError(f"order-{k} n-grams without a left extension; count them with count_ngrams")
    discounts = np.zeros((order, 3))
    fallback = []

    # order 1: interpolated with the uniform distribution over the V − 1 vocabulary ids
    a1 = adjusted[0].copy()
    a1[PAD_ID] = 0
    discounts[0], fell_back, d1 = _discount_terms(a1)
    fallback.append(fell_back)
    total = float(a1.sum())
    gamma0 = float(d1.sum()) / total
    p1 = (a1 - d1) / total + gamma0 / (V - 1)
    p1[PAD_ID] = 0.0
    with np.errstate(divide="ignore"):
        log_probs = [np.log(p1)]
    log_backoffs = [np.zeros(V)]
    keys = [np.arange(V, dtype=np.int64)]
    probs = p1
    context_ids = None                    # order-(k−1) id of each order-k n-gram's context
    for k in range(2, order + 1):
        table, a = tables[k - 1], adjusted[k - 1]
        first = (table.keys % V)
        parent = table.keys // V
        if k == 2:
            context_ids = first
        else:
            context_ids = _lookup(tables[k - 2].keys, context_ids[parent] * V + first)
            if (context_ids < 0).any():
                raise SaffuError("n-gram tables are not prefix-closed; count them with count_ngrams")
        discounts[k - 1], fell_back, d = _discount_terms(a)
        fallback.append(fell_back)
        num_contexts = V if k == 2 else len(tables[k - 2].keys)
        context_total = np.bincount(context_ids, weights=a, minlength=num_contexts)
        context_discount = np.bincount(context_ids, weights=d, minlength=num_contexts)
        with np.errstate(divide="ignore", invalid="ignore"):
            gamma = np.where(context_total > 0, context_discount / context_total, 1.0)
        probs = (a - d) / context_total[context_ids] + gamma[context_ids] * probs[parent]
        log_backoffs[k - 2] = np.where(context_total > 0, np.log(gamma), 0.0)
        log_probs.append(np.log(probs))
        log_backoffs.append(np.zeros(len(table.keys)))
        keys.append(table.keys)
    return KneserNeyModel(order, V, tuple(keys), tuple(log_probs), tuple(log_backoffs), discounts,
                          tuple(fallback), math.log(gamma0 / (V - 1)))


def fit_kneser_ney(stream: np.ndarray, order: int, *, vocab_size: int | None = None, begin: int = 1,
                   end: int | None = None, chunk_size: int = 1 << 16,
                   progress: str | None = None) -> KneserNeyModel:
    """:func:`count_ngrams` then :func:`estimate_kneser_ney` on targets ``[begin, end)``."""
    if vocab_size is None:
        vocab_size = max(int(np.max(stream)) + 1, EOD_ID + 2)
    tables = count_ngrams(stream, order, vocab_size=vocab_size, begin=begin, end=end,
                          chunk_size=chunk_size, progress=progress)
    return estimate_kneser_ney(tables, vocab_size)


# --------------------------------------------------------------------------- scoring

def score_rows(model: KneserNeyModel, rows: np.ndarray) -> np.ndarray:
    """Natural-log ``p(target | context)`` of rows ``int[T, n]``: context tokens oldest first
    (``<pad>`` = no token, an ``<eod>`` only first, as ``<s>``), then the target. Only the last
    ``N − 1`` context tokens are read. Returns ``float64[T]`` (ARPA backoff evaluation)."""
    rows = np.asarray(rows, np.int64)
    V, order = model.vocab_size, model.order
    targets = rows[:, -1]
    if len(rows) and (targets.min() < 0 or targets.max() >= V):
        raise SaffuError(f"target ids outside the model's vocabulary [0, {V})")
    width = rows.shape[1] - 1

    def context(delta: int) -> np.ndarray:    # token delta + 1 positions before the target
        if delta >= width:
            return np.full(len(rows), -1, np.int64)
        column = rows[:, width - 1 - delta]
        return np.where(column == PAD_ID, -1, column)

    result = model.log_prob[0][targets].copy()
    backoff = np.zeros(len(rows))
    ngram = targets.copy()                     # id of (x_{k−1} … x_1 w) at order k
    ctx = context(0)                           # id of (x_{k−1} … x_1) at order k − 1
    for k in range(2, order + 1):
        token = context(k - 2)
        if k > 2:
            ctx = np.where((ctx >= 0) & (token >= 0), ctx * V + token, -1)
            ctx = _lookup(model.keys[k - 2], ctx)
        ngram = _lookup(model.keys[k - 1], np.where((ngram >= 0) & (token >= 0), ngram * V + token, -1))
        found = ngram >= 0
        result = np.where(found, _gather(model.log_prob[k - 1], ngram), result)
        backoff = np.where(found, 0.0, backoff + _gather(model.log_backoff[k - 2], ctx))
    return result + backoff


def log_probs(model: KneserNeyModel, stream: np.ndarray, begin: int = 1, end: int | None = None, *,
              chunk_size: int = 1 << 16, progress: str | None = None) -> np.ndarray:
    """Natural-log probability of every target in ``[begin, end)`` given its in-document
    context, ``float64[end − begin]``."""
    end = _check_range(stream, begin, end)
    out = np.zeros(end - begin)
    position = 0
    for rows in _iter_rows(stream, model.order, begin, end, model.vocab_size, chunk_size, progress):
        out[position:position + len(rows)] = score_rows(model, rows)
        position += len(rows)
    return out


def next_token_log_probs(model: KneserNeyModel, history: Sequence[int]) -> np.ndarray:
    """``log p(· | history)`` over every id, ``float64[V]`` (``<pad>``: ``−inf``).

    ``history`` is the document so far, oldest first; an ``<eod>`` in it is the start of the
    current document (``<s>``) and everything before it is ignored. Without one the history is
    the tail of a longer document.
    """
    history = [int(t) for t in history]
    if EOD_ID in history:
        history = history[len(history) - 1 - history[::-1].index(EOD_ID):]
    width = max(model.order - 1, 1)
    context = ([PAD_ID] * width + history)[-width:] if history else [PAD_ID] * width
    targets = np.arange(1, model.vocab_size)
    rows = np.concatenate([np.tile(np.asarray(context, np.int64), (len(targets), 1)), targets[:, None]], axis=1)
    out = np.full(model.vocab_size, -np.inf)
    out[1:] = score_rows(model, rows)
    return out


def sentence_log_probs(model: KneserNeyModel, token_id_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """Total natural-log probability of each sentence scored as a document: its tokens after
    an ``<eod>``; the closing ``<eod>`` is not scored (as BLiMP wants). ``float64[N]``."""
    lengths = np.asarray([len(ids) for ids in token_id_lists], np.int64)
    if len(lengths) == 0:
        return np.zeros(0)
    stream = [EOD_ID]
    for ids in token_id_lists:
        stream.extend(int(t) for t in ids)
        stream.append(EOD_ID)
    stream = np.asarray(stream, np.int64)
    if (stream[stream != EOD_ID] <= EOD_ID).any() or np.any(np.diff(np.nonzero(stream == EOD_ID)[0]) != lengths + 1):
        raise SaffuError("sentences must hold regular token ids only (no <pad> or <eod>)")
    scores = log_probs(model, stream, 1, len(stream))   # score of position t at t − 1
    cumulative = np.concatenate([[0.0], np.cumsum(scores)])
    starts = 1 + np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])        # first token of each sentence
    return cumulative[starts + lengths - 1] - cumulative[starts - 1]


# --------------------------------------------------------------------------- ARPA

def _token_names(vocab_size: int, token_names: Sequence[str] | None) -> np.ndarray:
    names = [f"t{i}" for i in range(vocab_size)] if token_names is None else [str(n) for n in token_names]
    if len(names) < vocab_size:
        raise SaffuError(f"{len(names)} token names for a vocabulary of {vocab_size}")
    reserved = {"<s>", "</s>", "<unk>"}
    for i, name in enumerate(names[:vocab_size]):
        if i in (PAD_ID, EOD_ID):
            continue
        if not name or re.search(r"\s", name) or name in reserved:
            raise SaffuError(f"token {i} has the name {name!r}; ARPA names must be non-empty, without "
                             f"whitespace and not <s>, </s> or <unk>")
    if len(set(names[2:vocab_size])) != vocab_size - 2:
        raise SaffuError("token names must be distinct")
    return np.asarray(names[:vocab_size], dtype=object)


def model_tokens(model: KneserNeyModel) -> list[np.ndarray]:
    """The n-grams of every order as ``int32[M_k, k]`` token rows, oldest first (order 1 dense:
    ``arange(V)[:, None]``)."""
    V = model.vocab_size
    tokens = [np.arange(V, dtype=np.int32)[:, None]]
    for k in range(2, model.order + 1):
        keys = model.keys[k - 1]
        parent = keys // V
        tokens.append(np.concatenate([(keys % V)[:, None].astype(np.int32), tokens[-1][parent]], axis=1))
    return tokens


def write_arpa(model: KneserNeyModel, path: str | Path, token_names: Sequence[str] | None = None,
               decimals: int = 7) -> None:
    """Write ``model`` as a standard ARPA file (log10 probabilities and backoffs), atomically.

    Args:
      token_names: a whitespace-free name per id (default ``t<id>``); ``<pad>``'s and
        ``<eod>``'s names are not used (``<eod>`` is ``<s>`` first and ``</s>`` last).
      decimals: digits after the decimal point.
    """
    names = _token_names(model.vocab_size, token_names)
    context_names, word_names = names.copy(), names.copy()
    context_names[EOD_ID], word_names[EOD_ID] = "<s>", "</s>"
    tokens = model_tokens(model)
    fmt = f"{{:.{decimals}f}}"
    V, order = model.vocab_size, model.order
    counts = [V + 1] + [len(k) for k in model.keys[1:]]
    with atomic_open(path, "w", encoding="utf-8", newline="\n") as out:
        out.write("\n\\data\\\n")
        out.writelines(f"ngram {k}={n}\n" for k, n in enumerate(counts, 1))
        for k in range(1, order + 1):
            out.write(f"\n\\{k}-grams:\n")
            lp = model.log_prob[k - 1] / _LN10
            bo = model.log_backoff[k - 1] / _LN10
            with_backoff = k < order
            if k == 1:
                lines = [f"{fmt.format(model.unk_log_prob / _LN10)}\t<unk>" + ("\t0" if with_backoff else ""),
                         "-99\t<s>" + (f"\t{fmt.format(bo[EOD_ID])}" if with_backoff else ""),
                         f"{fmt.format(lp[EOD_ID])}\t</s>" + ("\t0" if with_backoff else "")]
                ids = np.arange(2, V)
                words = names[ids]
                lp, bo = lp[ids], bo[ids]
            else:
                rows = tokens[k - 1]
                columns = [context_names[rows[:, 0]]] + [names[rows[:, j]] for j in range(1, k - 1)]
                columns.append(word_names[rows[:, -1]])
                words = [" ".join(parts) for parts in zip(*columns)]
                lines = []
            if with_backoff:
                lines.extend(f"{fmt.format(p)}\t{w}\t{fmt.format(b)}" for p, w, b in zip(lp, words, bo))
            else:
                lines.extend(f"{fmt.format(p)}\t{w}" for p, w in zip(lp, words))
            out.write("\n".join(lines) + "\n")
        out.write("\n\\end\\\n")


def read_arpa(path: str | Path, token_names: Sequence[str] | None = None,
              vocab_size: int | None = None) -> KneserNeyModel:
    """Read an ARPA file written by :func:`write_arpa` (or any ARPA over the same names).

    Args:
      token_names: the names used when writing (default ``t<id>``).
      vocab_size: ``V`` (default: the largest id named + 1). Ids without a unigram entry get
        the ``<unk>`` probability, as kenlm scores unknown words.

    Returns a :class:`KneserNeyModel` (discounts NaN); a clear error when an n-gram's suffix
    is missing or a word is unknown.
    """
    collecting = gc.isenabled()
    gc.disable()           # millions of small lists: the cycle collector would dominate
    try:
        return _read_arpa(Path(path), token_names, vocab_size)
    finally:
        if collecting:
            gc.enable()


def _read_arpa(path: Path, token_names: Sequence[str] | None, vocab_size: int | None) -> KneserNeyModel:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SaffuError(f"cannot read ARPA file {path}: {err.strerror}") from None
    sections: dict[int, list[str]] = {}
    declared: dict[int, int] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if current and not line.startswith("\\"):
            sections[current].append(line)
        elif line == "\\data\\":
            current = 0
        elif line == "\\end\\":
            break
        elif (match := re.fullmatch(r"\\(\d+)-grams:", line)) is not None:
            current = int(match.group(1))
            sections[current] = []
        elif current == 0:
            if (found := re.fullmatch(r"ngram\s+(\d+)\s*=\s*(\d+)", line)) is not None:
                declared[int(found.group(1))] = int(found.group(2))
        elif current:
            sections[current].append(line)
    order = max(sections, default=0)
    if order < 1 or sorted(sections) != list(range(1, order + 1)):
        raise SaffuError(f"{path} is not an ARPA file (no consecutive \\k-grams: sections)")
    for k, n in declared.items():
        if len(sections.get(k, [])) != n:
            raise SaffuError(f"{path}: \\data\\ declares {n} {k}-grams, the file has {len(sections.get(k, []))}")

    def split_section(k: int) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
        """Words, natural-log probabilities and backoffs of the ``k``-gram lines."""
        parts = [line.split() for line in sections[k]]
        lengths = np.fromiter(map(len, parts), np.int64, len(parts))
        if ((lengths != k + 1) & (lengths != k + 2)).any():
            bad = parts[int(np.nonzero((lengths != k + 1) & (lengths != k + 2))[0][0])]
            raise SaffuError(f"{path}: malformed {k}-gram line {' '.join(bad)!r}")
        try:
            probs = np.fromiter((float(p[0]) for p in parts), np.float64, len(parts)) * _LN10
            backoffs = np.fromiter((float(p[k + 1]) if len(p) == k + 2 else 0.0 for p in parts),
                                   np.float64, len(parts)) * _LN10
        except ValueError as err:
            raise SaffuError(f"{path}: unreadable number in the {k}-grams ({err})") from None
        return [p[1:k + 1] for p in parts], probs, backoffs

    words1, probs1, backoffs1 = split_section(1)
    if token_names is None:
        ids = {}
        for (word,) in words1:
            if (match := re.fullmatch(r"t(\d+)", word)) is not None:
                ids[word] = int(match.group(1))
            elif word not in ("<s>", "</s>", "<unk>"):
                raise SaffuError(f"{path}: unknown word {word!r}; pass the token names it was written with")
    else:
        ids = {str(n): i for i, n in enumerate(token_names) if i not in (PAD_ID, EOD_ID)}
    V = vocab_size or max(list(ids.values()) + [EOD_ID + 1]) + 1
    unk = next((float(p) for (w,), p in zip(words1, probs1) if w == "<unk>"), -np.inf)
    log_prob1, log_backoff1 = np.full(V, unk), np.zeros(V)
    for (word,), lp, bo in zip(words1, probs1, backoffs1):
        if word == "<s>":
            log_backoff1[EOD_ID] = bo
        elif word == "</s>":
            log_prob1[EOD_ID] = lp
        elif word != "<unk>":
            i = ids.get(word, V)
            if i >= V:
                raise SaffuError(f"{path}: unknown word {word!r} (or outside the vocabulary of {V}); pass the "
                                 f"token names it was written with")
            log_prob1[i], log_backoff1[i] = lp, bo
    log_prob1[PAD_ID] = -np.inf
    first_ids, last_ids = dict(ids, **{"<s>": EOD_ID}), dict(ids, **{"</s>": EOD_ID})
    keys, log_prob, log_backoff = [np.arange(V, dtype=np.int64)], [log_prob1], [log_backoff1]
    for k in range(2, order + 1):
        words, probs, backoffs = split_section(k)
        try:
            tokens = np.array([[first_ids[w[0]], *(ids[x] for x in w[1:-1]), last_ids[w[-1]]] for w in words],
                              np.int64).reshape(len(words), k)
        except KeyError as err:
            raise SaffuError(f"{path}: a {k}-gram has the word {err.args[0]!r}, which is not a vocabulary "
                             f"token in that position") from None
        if (tokens >= V).any():
            raise SaffuError(f"{path}: a {k}-gram names a token outside the vocabulary of {V}")
        suffix = tokens[:, -1]
        for j in range(2, k):
            suffix = _lookup(keys[j - 1], np.where(suffix >= 0, suffix * V + tokens[:, k - j], -1))
        if (suffix < 0).any():
            bad = int(np.nonzero(suffix < 0)[0][0])
            raise SaffuError(f"{path}: the suffix of the {k}-gram {' '.join(words[bad])!r} is missing")
        order_keys = suffix * V + tokens[:, 0]
        sort = np.argsort(order_keys, kind="stable")
        keys.append(order_keys[sort])
        log_prob.append(probs[sort])
        log_backoff.append(backoffs[sort])
    return KneserNeyModel(order, V, tuple(keys), tuple(log_prob), tuple(log_backoff),
                          np.full((order, 3), np.nan), (False,) * order, float(unk))


# --------------------------------------------------------------------------- work directories

def score_splits(model: KneserNeyModel, workdir: WorkDir, splits: Sequence[str], *, chunk_size: int = 1 << 16,
                 progress: bool = False) -> dict[str, float]:
    """Score every target of each split of ``splits`` (positions ``1 … end``): the
    :func:`saffu.evaluation.split_metrics` figures (``{split}_loss``, ``_ppl``, ``_bpb``,
    ``_word_ppl``) and ``{split}_score_seconds``."""
    metrics: dict[str, float] = {}
    for split in splits:
        start = time.perf_counter()
        stream = workdir.tokens(split)
        scores = log_probs(model, stream, 1, len(stream), chunk_size=chunk_size,
                           progress=f"score {split}" if progress else None)
        metrics.update(split_metrics(-float(scores.sum()), workdir.split_info(split), f"{split}_"))
        metrics[f"{split}_score_seconds"] = time.perf_counter() - start
    return metrics


def model_size(model: KneserNeyModel) -> dict[str, int]:
    """``ngrams_<k>`` (entries per order; order 1 is the vocabulary) and ``params``: one
    probability per n-gram and one backoff weight per n-gram below the top order."""
    entries = model.num_ngrams()
    return {"params": int(sum(entries) + sum(entries[:-1])), **{f"ngrams_{k}": n for k, n in enumerate(entries, 1)}}


def evaluate_blimp(model: KneserNeyModel, tokenizer, directory) -> dict[str, float]:
    """BLiMP accuracy of ``model`` (:func:`saffu.blimp.blimp_accuracy`): every sentence scored
    as a document, :func:`sentence_log_probs`."""
    from saffu.blimp import blimp_accuracy, load_blimp
    pairs = load_blimp(directory)
    encode = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    good = sentence_log_probs(model, encode([p.good for p in pairs]))
    bad = sentence_log_probs(model, encode([p.bad for p in pairs]))
    return blimp_accuracy(pairs, good, bad)


def evaluate_workdir(workdir: WorkDir, order: int, split: str = "dev", *, chunk_size: int = 1 << 16,
                     progress: bool = False) -> dict[str, float]:
    """Fit an order-``order`` model on the training split of a :class:`saffu.workdir.WorkDir`
    and score every target of ``split`` (positions ``1 … end``).

    Returns the :func:`score_splits` figures of ``split`` plus ``order``, ``fit_seconds``,
    ``score_seconds``, ``ngrams_<k>`` (model entries per order; order 1 is the vocabulary)
    and ``discount_<k>_<j>``.
    """
    start = time.perf_counter()
    model = fit_kneser_ney(workdir.tokens(workdir.train_split), order, vocab_size=workdir.vocab_size,
                           chunk_size=chunk_size, progress="count n-grams" if progress else None)
    metrics: dict[str, float] = {"order": order, "fit_seconds": time.perf_counter() - start}
    metrics.update(score_splits(model, workdir, [split], chunk_size=chunk_size, progress=progress))
    metrics["score_seconds"] = metrics.pop(f"{split}_score_seconds")
    metrics.update({key: n for key, n in model_size(model).items() if key != "params"})
    for k in range(order):
        for j in range(3):
            metrics[f"discount_{k + 1}_{j + 1}"] = float(model.discounts[k, j])
    return metrics
