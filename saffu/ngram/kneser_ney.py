"""Interpolated modified Kneser-Ney n-gram baseline (Chen & Goodman 1998) on the exact counts
of :mod:`saffu.ngram.counts`; ARPA files are :mod:`saffu.ngram.arpa`.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.ngram.counts import NgramTable, check_range, count_ngrams, gather, iter_rows, lookup, ngram_columns

FALLBACK_DISCOUNTS = (0.5, 1.0, 1.5)


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
            context_ids = lookup(tables[k - 2].keys, context_ids[parent] * V + first)
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
            ctx = lookup(model.keys[k - 2], ctx)
        ngram = lookup(model.keys[k - 1], np.where((ngram >= 0) & (token >= 0), ngram * V + token, -1))
        found = ngram >= 0
        result = np.where(found, gather(model.log_prob[k - 1], ngram), result)
        backoff = np.where(found, 0.0, backoff + gather(model.log_backoff[k - 2], ctx))
    return result + backoff


def log_probs(model: KneserNeyModel, stream: np.ndarray, begin: int = 1, end: int | None = None, *,
              chunk_size: int = 1 << 16, progress: str | None = None) -> np.ndarray:
    """Natural-log probability of every target in ``[begin, end)`` given its in-document
    context, ``float64[end − begin]``."""
    end = check_range(stream, begin, end)
    out = np.zeros(end - begin)
    position = 0
    for rows in iter_rows(stream, ngram_columns(model.order), begin, end, model.vocab_size, chunk_size, progress):
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


def kn_sentence_log_probs(model: KneserNeyModel, token_id_lists: Sequence[Sequence[int]]) -> np.ndarray:
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


def model_size(model: KneserNeyModel) -> dict[str, int]:
    """``ngrams_<k>`` (entries per order; order 1 is the vocabulary) and ``params``: one
    probability per n-gram and one backoff weight per n-gram below the top order."""
    entries = model.num_ngrams()
    return {"params": int(sum(entries) + sum(entries[:-1])), **{f"ngrams_{k}": n for k, n in enumerate(entries, 1)}}
