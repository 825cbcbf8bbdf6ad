"""The explicit solution of the token-resolution model (:mod:`saffu.models.exact`).

1. Held-out documents: ``holdout_tokens`` of whole training documents from evenly spaced
   blocks of the split (every source file is represented), never counted.
2. One exact sparse count per group over the rest (:func:`saffu.ngram.counts.count_rows`, the
   counter behind the n-gram tables): distinct (context, target) rows with ``int64`` counts.
3. Tables per group: the context search levels, per-context constants
   ``log(μ / (n(c) + μ))`` and count buckets, and the seen entries
   ``log(1 + n(c, y) / (μ p(y)))`` — sparse rows of at most ``k`` entries, dense ``V``-wide rows
   for the contexts with more (``k`` per group minimises the bytes of both).
4. Temperatures ``β[g, bucket]`` by Newton's method on the held-out documents: the logits are
   linear in ``β``, so the loss is convex; gradient ``Σ E_p[L] − L[y]`` and Hessian
   ``Σ Cov_p(L_g, L_h)`` per position, scattered onto the active (group, bucket) pairs.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import ExactConfig
from saffu.data.windows import range_windows
from saffu.data.workdir import WorkDir
from saffu.engine import accounting
from saffu.engine.explicit import unigram_prior
from saffu.models.exact import Params, group_rows
from saffu.ngram.counts import count_rows

#: Upper bound of a temperature (rarely seen contexts want large ones: μ shrinks them hard).
BETA_MAX = 10.0
#: Sparse-row widths tried per group (the one with the fewest bytes is kept).
ROW_WIDTHS = (4, 8, 16, 32, 64, 128, 256, 512)


def outside_ranges(ranges: list[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """The target ranges of ``[begin, end)`` outside the sorted, disjoint ``ranges``."""
    out, cursor = [], begin
    for a, b in sorted(ranges):
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return out


def kneser_ney_discounts(counts: np.ndarray) -> np.ndarray:
    """Modified Kneser-Ney discounts ``[D1, D2, D3+]`` from the count-of-counts ``n_1 … n_4``
    of one group's rows (Chen & Goodman): ``Y = n1 / (n1 + 2 n2)``, ``D_i = i − (i + 1) Y n_{i+1} / n_i``,
    clipped into ``[0.1, 0.9 i]`` (a small corpus can give discounts outside ``(0, i)``)."""
    n = [max(int((counts == i).sum()), 1) for i in range(1, 5)]
    y = n[0] / (n[0] + 2 * n[1])
    raw = np.array([1 - 2 * y * n[1] / n[0], 2 - 3 * y * n[2] / n[1], 3 - 4 * y * n[3] / n[2]])
    return np.clip(raw, 0.1, 0.9 * np.arange(1, 4))


def continuation_counts(child_rows: np.ndarray, order: int) -> np.ndarray:
    """``N1+(• c y)`` for every distinct (context, target) row of a group with ``order`` context
    tokens, from the rows of a child group whose offsets extend it by one (the child's first
    ``order`` tokens are the group's context): the distinct extensions seen with each row, in the
    group's (lexicographic) row order."""
    keys = np.concatenate([child_rows[:, :order], child_rows[:, -1:]], axis=1)
    return np.unique(keys, axis=0, return_counts=True)[1].astype(np.int64)    # lexicographic, as the rows


def build_group(rows: np.ndarray, counts: np.ndarray, order: int, prior: np.ndarray, mu: float,
                buckets: tuple[int, ...], row_prior: np.ndarray | None = None, per_type: bool = False,
                discount: bool = False, smooth_counts: np.ndarray | None = None, shift: np.ndarray | None = None):
    """The tables of one group from its counted rows.

    Args:
      rows: ``int32[U, n + 1]`` distinct (context tokens, target) rows, lexicographically sorted.
      counts: ``int64[U]``.
      order: ``n``, context tokens per row.
      prior: ``float64[V]`` unigram ``p``.
      mu, buckets: see :class:`saffu.configs.ExactConfig`.
      per_type: Witten-Bell strength ``μ_c = mu · t(c)`` (``t(c)``: distinct targets seen after
        ``c``) instead of one ``μ`` for every context.
      row_prior: ``float64[U]``, the probability of each row's target under the distribution the
        group is smoothed towards (a nested group's parent conditional); ``None``: ``prior``.
        A seen entry is ``log(1 + n(c, y) / (μ · row_prior))`` either way, and the value ``L`` is
        relative to that distribution.
      discount: interpolated modified Kneser-Ney instead: ``P(y | c) = (n(c, y) − D(n(c, y))) / n(c)
        + γ(c) · row_prior`` with ``γ(c) = Σ_y D(n(c, y)) / n(c)`` (discounts from the group's
        count-of-counts, :func:`kneser_ney_discounts`); seen entries
        ``log(1 + (n − D) / (n(c) γ(c) row_prior))``, const ``log γ(c)``.
      smooth_counts: ``int64[U]``, the counts the smoothing uses in place of ``counts`` (Kneser-Ney
        continuation counts, :func:`continuation_counts`); buckets stay on ``counts``.
      shift: ``float64[V]`` added to the row of every context (stored once, as the group's
        ``"shift"``: the rows stay sparse): ``log(row_prior / p)`` for a root group smoothed
        towards a distribution other than the prior ``p`` (Kneser-Ney's continuation unigram),
        so ``L`` stays relative to ``p``.

    Returns the group's arrays (numpy; see :mod:`saffu.models.exact`), a summary (contexts,
    seen pairs, dense contexts, row width ``k``, megabytes) and ``float64[U]``, the smoothed
    ``log P_g(y | c)`` of every row (what a nested child is smoothed towards).
    """
    V = len(prior)
    context = rows[:, :order].astype(np.int64)
    levels = []
    ids = context[:, 0]                                   # level 1: the token is its id
    num_ids = V
    for j in range(1, order):
        keys = ids * V + context[:, j]                    # < num_ids · V: exact in int64
        unique, ids = np.unique(keys, return_inverse=True)
        ids = ids.reshape(-1)
        parent, token = unique // V, unique % V
        start = np.searchsorted(parent, np.arange(num_ids + 2)).astype(np.int32)
        start[-2:] = len(unique)                          # the sentinel parent has no children
        levels.append({"start": start, "token": token.astype(np.int32)})
        num_ids = len(unique)
    C = num_ids
    bucket_count = np.bincount(ids, weights=counts, minlength=C)          # n(c), raw: the buckets
    smooth = (counts if smooth_counts is None else smooth_counts).astype(np.float64)
    n_context = np.bincount(ids, weights=smooth, minlength=C)             # n(c) the smoothing sees
    types = np.bincount(ids, minlength=C)                                 # seen targets of c
    targets = rows[:, order].astype(np.int64)
    row_prior = prior[targets] if row_prior is None else row_prior
    if discount:          # modified Kneser-Ney (a context never seen: γ = 1, const 0)
        d = kneser_ney_discounts(smooth)[np.minimum(smooth, 3).astype(np.int64) - 1]
        mass = np.bincount(ids, weights=d, minlength=C)                   # Σ_y D(n(c, y)) = n(c) γ(c)
        delta64 = np.log1p((smooth - d) / (mass[ids] * row_prior))
        const64 = np.log(np.where(n_context > 0, mass / np.maximum(n_context, 1), 1.0))
    else:
        # μ_c: one μ (Dirichlet) or μ · t(c) (Witten-Bell; a context never seen keeps μ: n(c) = 0, const 0)
        strength = np.where(types > 0, mu * types, mu) if per_type else np.full(C, mu)
        delta64 = np.log1p(smooth / (strength[ids] * row_prior))          # L − const, seen pairs
        const64 = np.log(strength / (n_context + strength))                 # every unseen pair of c
    delta = delta64.astype(np.float32)
    const = np.zeros(C + 1, np.float32)
    const[:C] = const64
    log_p_rows = np.log(row_prior) + const64[ids] + delta64
    bucket = np.zeros(C + 1, np.int32)
    bucket[:C] = np.searchsorted(np.asarray(buckets), bucket_count, side="right")
    # the row width k that minimises sparse (C·k·8 bytes) plus dense ((#contexts > k)·V·4) storage
    cost = {k: (C + 1) * k * 8 + int((types > k).sum()) * V * 4 for k in ROW_WIDTHS}
    k = min(cost, key=cost.get)
    dense = types > k
    dense_index = np.full(C + 1, int(dense.sum()), np.int32)
    dense_index[:C][dense] = np.arange(int(dense.sum()))
    dense_rows = np.zeros((int(dense.sum()) + 1, V), np.float32)
    in_dense = dense[ids]
    dense_rows[dense_index[ids[in_dense]], targets[in_dense]] += delta[in_dense]
    # sparse rows: rank of each pair within its context (rows are sorted by context id)
    first_of_context = np.searchsorted(ids, np.arange(C))
    rank = np.arange(len(ids)) - first_of_context[ids]
    ell_col = np.full((C + 1, k), V, np.int32)
    ell_val = np.zeros((C + 1, k), np.float32)
    sparse = ~in_dense
    ell_col[ids[sparse], rank[sparse]] = targets[sparse]
    ell_val[ids[sparse], rank[sparse]] = delta[sparse]
    group = {"levels": levels, "const": const, "bucket": bucket, "ell_col": ell_col, "ell_val": ell_val,
             "dense_index": dense_index, "dense_rows": dense_rows}
    if shift is not None:
        group["shift"] = shift.astype(np.float32)
    size = sum(a.nbytes for a in jax.tree.leaves(group))
    return group, {"contexts": int(C), "pairs": int(len(rows)), "dense_contexts": int(dense.sum()),
                   "row_width": int(k), "megabytes": size / 2**20}, log_p_rows


def host_context_ids(levels: list[dict[str, np.ndarray]], context: np.ndarray, vocab_size: int) -> np.ndarray:
    """:func:`saffu.models.exact.context_ids` on the host, in numpy: ``int[U, n]`` context tokens
    -> ``int64[U]`` context ids (``-1`` where absent)."""
    ids = context[:, 0].astype(np.int64)
    for j, level in enumerate(levels, start=1):
        start, token = level["start"], level["token"]
        parent = np.repeat(np.arange(len(start) - 1), np.diff(start))       # parent id of every child
        keys = parent * vocab_size + token                                   # sorted
        query = ids * vocab_size + context[:, j]
        where = np.minimum(np.searchsorted(keys, query), max(len(keys) - 1, 0))
        found = (ids >= 0) & (len(keys) > 0) & (keys[where] == query)
        ids = np.where(found, where, -1)
    return ids


def parent_group(groups: tuple[tuple[int, ...], ...], g: int) -> int | None:
    """The group a nested group is smoothed towards: the longest other group whose offsets are a
    proper prefix of group ``g``'s (``(0, 1)`` for ``(0, 1, 2)``), or ``None``."""
    offsets = groups[g]
    prefixes = [i for i, other in enumerate(groups) if len(other) < len(offsets) and offsets[:len(other)] == other]
    return max(prefixes, key=lambda i: len(groups[i])) if prefixes else None


def held_out_prior(workdir: WorkDir, vocab_size: int, holdout_tokens: int, chunk_size: int, progress: bool):
    """The training stream split for an explicit solve: ``holdout_tokens`` of whole documents
    from evenly spaced blocks (never counted), the counted rest, and the unigram prior of the
    counted targets. Returns ``(stream, holdout ranges, counted ranges, prior float64[V],
    report)`` with ``counted_tokens`` and ``holdout_tokens`` in the report."""
    if vocab_size != workdir.vocab_size:
        raise SaffuError(f"model vocabulary {vocab_size} differs from the work directory's "
                         f"{workdir.vocab_size}; use --vocab-size {workdir.vocab_size}")
    split = workdir.train_split
    stream = workdir.tokens(split)
    holdout = workdir.sample_documents(split, holdout_tokens)[0] if holdout_tokens else []
    if holdout == [(1, len(stream))]:
        raise SaffuError(f"--holdout-tokens {holdout_tokens:,} covers the whole training split; use fewer")
    counted = outside_ranges(holdout, 1, len(stream))
    rows, counts = count_rows(stream, (), counted, vocab_size=vocab_size, chunk_size=chunk_size,
                              progress="unigram" if progress else None)
    target_counts = np.zeros(vocab_size, np.int64)
    target_counts[rows[:, 0]] = counts
    report = {"counted_tokens": sum(b - a for a, b in counted), "holdout_tokens": sum(b - a for a, b in holdout)}
    return stream, holdout, counted, unigram_prior(target_counts), report


def solve_exact(workdir: WorkDir, config: ExactConfig, progress: bool = True) -> tuple[Params, dict[str, Any]]:
    """Explicit parameters of ``config`` from the training split of ``workdir``.

    Returns the params (see :mod:`saffu.models.exact`) and a report: ``seconds`` and
    ``seconds_count`` / ``seconds_tables`` / ``seconds_calibration``, ``counted_tokens``,
    ``holdout_tokens``, ``holdout_loss`` (nats/token at the calibrated ``β``), on the first
    quarter of the held-out batches ``holdout_loss_beta1`` (``β = 1``) and
    ``holdout_loss_first_part`` (at that quarter's optimum), per group ``group{g}_contexts`` /
    ``_pairs`` / ``_dense_contexts`` / ``_row_width`` / ``_megabytes``, the temperatures
    ``beta_{g}_{b}`` and ``peak_rss_mb``.
    """
    start = tick = time.perf_counter()
    stream, holdout, counted, prior, report = held_out_prior(workdir, config.vocab_size, config.holdout_tokens,
                                                             config.chunk_size, progress)
    V = config.vocab_size
    label = lambda name: name if progress else None
    counted_rows = [count_rows(stream, offsets, counted, vocab_size=V, chunk_size=config.chunk_size,
                               progress=label(f"group {offsets}")) for offsets in config.groups]
    report["seconds_count"] = time.perf_counter() - tick
    tick = time.perf_counter()
    groups: list = [None] * len(config.groups)
    log_p_rows: list = [None] * len(config.groups)
    parents = [parent_group(config.groups, g) if config.nested else None for g in range(len(config.groups))]
    kneser_ney = config.smoothing == "kneser_ney"
    for g in sorted(range(len(config.groups)), key=lambda i: len(config.groups[i])):   # parents first
        offsets, (rows, counts) = config.groups[g], counted_rows[g]
        parent = parents[g]
        # Kneser-Ney: a nested group that a child (one offset longer) is smoothed towards counts continuations
        children = [h for h in range(len(config.groups)) if parents[h] == g
                    and len(config.groups[h]) == len(offsets) + 1]
        smooth_counts = (continuation_counts(counted_rows[children[0]][0], len(offsets))
                         if kneser_ney and children else None)
        if smooth_counts is not None and len(smooth_counts) != len(rows):
            raise AssertionError(f"group {offsets}: {len(smooth_counts)} continuation rows for {len(rows)} rows")
        shift = None
        row_prior = None
        if parent is not None:         # P_parent(y | the parent's part of c) at every seen row
            m = len(config.groups[parent])
            parent_rows = counted_rows[parent][0]
            parent_ids = host_context_ids(groups[parent]["levels"], parent_rows[:, :m], V)
            keys = parent_ids * V + parent_rows[:, m]                         # sorted, like the rows
            query = host_context_ids(groups[parent]["levels"], rows[:, :m], V) * V + rows[:, -1]
            row_prior = np.exp(log_p_rows[parent][np.searchsorted(keys, query)])
        elif smooth_counts is not None:  # a Kneser-Ney chain's root: towards the continuation unigram
            distinct = np.bincount(rows[:, -1], minlength=V) + 0.5            # N1+(• y), floored
            continuation = distinct / distinct.sum()
            row_prior, shift = continuation[rows[:, -1]], np.log(continuation) - np.log(prior)
        groups[g], summary, log_p_rows[g] = build_group(
            rows, counts, len(offsets), prior, config.mu, config.buckets, row_prior,
            config.smoothing in ("witten_bell", "kneser_ney"), kneser_ney and (parent is not None or shift is not None),
            smooth_counts, shift)
        report.update({f"group{g}_{key}": value for key, value in summary.items()})
        report[f"group{g}_parent"] = -1 if parent is None else parent
    params = jax.tree.map(jnp.asarray, {"log_prior": np.log(prior).astype(np.float32),
                                        "beta": np.ones((len(config.groups), config.num_buckets), np.float32),
                                        "groups": groups})
    report["seconds_tables"] = time.perf_counter() - tick
    tick = time.perf_counter()
    if holdout:
        beta, loss, loss_beta1, first_loss, evaluations = calibrate(params, config, stream, holdout, progress)
        params["beta"] = beta
        report.update(holdout_loss=loss, holdout_loss_beta1=loss_beta1, holdout_loss_first_part=first_loss,
                      calibration_evaluations=evaluations)
        for g in range(len(config.groups)):
            for b in range(config.num_buckets):
                report[f"beta_{g}_{b}"] = float(beta[g, b])
    report["seconds_calibration"] = time.perf_counter() - tick
    report["seconds"] = time.perf_counter() - start
    report.update(accounting.memory_record())
    return params, report


def exact_rows(params: Params, config: ExactConfig, tokens: jax.Array):
    """The exact model as ``logits = base + Σ_g β[g, bucket_g] · row_g``: ``tokens int32[B, S]``
    -> ``(base float32[V] or [B·S, V], iterator of (row_g float32[B·S, V], bucket_g int32[B·S]))``
    (what :func:`calibrate` fits the temperatures of)."""
    return params["log_prior"], group_rows(params, config, tokens)


def _newton_terms(params: Params, config, rows_fn, windows: jax.Array, mask: jax.Array):
    """Loss, gradient ``float32[G·B]`` and Hessian ``float32[G·B, G·B]`` of the summed NLL of
    one batch of windows over the temperatures ``params["beta"]`` (``float32[G, B]``) of a model
    whose logits ``rows_fn(params, config, windows)`` splits as in :func:`exact_rows`, and the
    target count.

    The moments are plain float32 sums over the vocabulary (one per group and one per pair of
    groups), not matmuls, so no backend lowers their precision."""
    context = config.context
    G, B = params["beta"].shape
    rows, active = [], []
    base, group_terms = rows_fn(params, config, windows)
    for g, (row, bucket) in enumerate(group_terms):
        rows.append(row)
        active.append(g * B + bucket)
    slot = jnp.stack(active, axis=1)                                       # [P, G]
    beta = params["beta"].reshape(-1)[slot]                                # [P, G]
    logits = jnp.broadcast_to(base, rows[0].shape) + sum(beta[:, g, None] * rows[g] for g in range(G))
    log_p = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(log_p)
    targets = jnp.pad(windows[:, 1:], ((0, 0), (0, 1))).reshape(-1)       # position p predicts p + 1
    weight = jnp.zeros(windows.shape, jnp.float32).at[:, context - 1:-1].set(mask).reshape(-1)
    nll = -jnp.take_along_axis(log_p, targets[:, None], axis=1)[:, 0]
    picked = jnp.stack([jnp.take_along_axis(r, targets[:, None], axis=1)[:, 0] for r in rows], axis=1)  # [P, G]
    weighted = [p * r for r in rows]
    mean = jnp.stack([jnp.sum(w, axis=-1) for w in weighted], axis=1)     # [P, G]
    pair = {(g, h): jnp.sum(weighted[g] * rows[h], axis=-1) for g in range(G) for h in range(g, G)}
    second = jnp.stack([jnp.stack([pair[min(g, h), max(g, h)] for h in range(G)], axis=-1) for g in range(G)],
                       axis=-2)                                            # [P, G, G]
    cov = second - mean[:, :, None] * mean[:, None, :]
    onehot = jax.nn.one_hot(slot, G * B)                                   # [P, G, G·B]
    grad = jnp.einsum("pg,pga->a", weight[:, None] * (mean - picked), onehot)
    hess = jnp.einsum("pgh,pga,phb->ab", weight[:, None, None] * cov, onehot, onehot)
    return jnp.sum(weight * nll), grad, hess, jnp.sum(weight)


#: :func:`_newton_terms` jitted once: the config and ``rows_fn`` (a module-level function) are its
#: static configuration, the params and the batch its arguments.
_newton_step = jax.jit(_newton_terms, static_argnums=(1, 2))


def _penalty(G: int, B: int, strength: float) -> np.ndarray:
    """``P`` of the smoothness penalty ``½ βᵀ P β = ½ strength · Σ_g Σ_b (β[g, b+1] − β[g, b])²``:
    neighbouring count buckets of a group get similar temperatures (a bucket that few held-out
    contexts fall in borrows from its neighbours instead of running to a bound)."""
    D = np.zeros((G * (B - 1), G * B))
    for g in range(G):
        for b in range(B - 1):
            D[g * (B - 1) + b, g * B + b], D[g * (B - 1) + b, g * B + b + 1] = -1.0, 1.0
    return strength * D.T @ D


def calibrate(params: Params, config, stream: np.ndarray, ranges: list[tuple[int, int]],
              progress: bool = True, seq_len: int = 128, batch_size: int = 4, smoothness: float = 0.01,
              parts: int = 4, rows_fn=exact_rows, iterations: int | None = None, final_iterations: int = 3):
    """Damped Newton on ``β[g, bucket]`` (``params["beta"]``) over the targets of ``ranges``
    (convex), for the exact model or any model that ``rows_fn`` splits as :func:`exact_rows`
    does; ``iterations`` (on the first part) defaults to ``config.calibration_iterations``,
    ``final_iterations`` are those on all of the batches.

    Minimises the mean held-out NLL plus the smoothness penalty of :func:`_penalty` (weight
    ``smoothness`` per held-out token). Starts from ``β = 1/G`` (summed LLR groups over-count
    shared evidence) and runs on an interleaved ``1/parts`` of the held-out batches first, then
    on all of them from there (the optimum is the whole slice's; most steps cost a fraction of
    a pass); a step that raises the objective is halved. Returns ``(β float32[G, B], held-out
    NLL at β, held-out NLL of the first part at β = 1 and at the first part's own optimum (the
    two comparable figures: the same tokens), evaluations in whole-slice equivalents)``.
    Batches hold ``batch_size`` windows of ``seq_len`` targets.
    """
    batches = [(jnp.asarray(w), jnp.asarray(m)) for w, m in range_windows(stream, ranges, config.context, seq_len,
                                                                          batch_size)]
    G, B = params["beta"].shape
    evaluations = 0.0
    penalty = _penalty(G, B, smoothness)
    objective = lambda loss, beta: loss + 0.5 * beta @ penalty @ beta

    def evaluate(beta: np.ndarray, used):
        nonlocal evaluations
        evaluations += len(used) / len(batches)
        current = {**params, "beta": jnp.asarray(beta.reshape(G, B), jnp.float32)}
        total, grad, hess, count = 0.0, np.zeros(G * B), np.zeros((G * B, G * B)), 0.0
        for windows, mask in used:
            l, gr, h, c = _newton_step(current, config, rows_fn, windows, mask)
            total, grad, hess, count = (total + float(l), grad + np.asarray(gr, np.float64),
                                        hess + np.asarray(h, np.float64), count + float(c))
        return total / count, grad / count, hess / count

    def newton(beta: np.ndarray, used, iterations: int):
        loss, grad, hess = evaluate(beta, used)
        for _ in range(iterations):
            direction = -np.linalg.solve(hess + penalty + 1e-6 * np.eye(G * B), grad + penalty @ beta)
            for _ in range(4):                                  # halve a step that does not descend
                candidate = np.clip(beta + direction, 0.0, BETA_MAX)
                new_loss, new_grad, new_hess = evaluate(candidate, used)
                if objective(new_loss, candidate) <= objective(loss, beta) + 1e-9:
                    break
                direction = direction / 2
            else:
                break                                           # no descent left: at the optimum
            moved = np.abs(candidate - beta).max()
            beta, loss, grad, hess = candidate, new_loss, new_grad, new_hess
            if moved < 1e-2:
                break
        return beta, loss

    first = batches[::parts]
    loss_beta1 = evaluate(np.ones(G * B), first)[0]
    with tqdm(total=2, desc="calibrate", disable=not progress, leave=False) as bar:
        beta, first_loss = newton(np.full(G * B, 1.0 / G), first,
                                  config.calibration_iterations if iterations is None else iterations)
        bar.update()
        beta, loss = newton(beta, batches, final_iterations)
        bar.update()
    return jnp.asarray(beta.reshape(G, B), jnp.float32), float(loss), float(loss_beta1), float(first_loss), evaluations
