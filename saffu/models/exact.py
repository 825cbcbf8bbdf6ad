"""The token-resolution explicit model: exact-token context groups, stored sparsely.

For groups ``g`` (each a tuple of context offsets, :class:`saffu.configs.ExactConfig`) with
context ``c_g`` (the tokens at those offsets, ``<pad>`` before the document start)::

    logits(y) = log p(y) + Σ_g β_g[b_g] · L_g[c_g, y]
    L_g[c, y] = log P_g(y | c) − log p(y),    P_g(y | c) = (n(c, y) + μ p(y)) / (n(c) + μ)

with ``b_g`` the count bucket of ``c_g``. Every unseen pair of a context has the same value,
``const(c) = log(μ / (n(c) + μ))``, so a context is stored as that constant plus its seen
entries ``L − const = log(1 + n(c, y) / (μ p(y)))`` (positive): contexts with at most ``k``
seen targets as a padded sparse row (``ell_col``, ``ell_val``: ``k`` columns, padding column
``V`` is dropped), the others (frequent contexts) as a dense ``V``-wide row. A context never
seen — or never seen with its conjunction — has ``L = 0`` (the prior).

Contexts are found inside jit: the first token of a group is its own id; every further token
is a binary search among the children of the context so far (``levels``: CSR ``start`` and
sorted ``token`` arrays), so nothing is hashed and no ``V^n`` key is ever formed. The
parameters (a pytree of arrays, :func:`saffu.solve.exact.solve_exact`)::

    {"log_prior": float32[V], "beta": float32[G, B],
     "groups": [{"levels": [{"start": int32[C_{j-1} + 2], "token": int32[C_j]}, …],
                 "const": float32[C + 1], "bucket": int32[C + 1],
                 "ell_col": int32[C + 1, k], "ell_val": float32[C + 1, k],
                 "dense_index": int32[C + 1], "dense_rows": float32[D + 1, V],
                 "shift": float32[V] (optional)}, …]}

(row ``C`` of every per-context array, and dense row ``D``, is the "unseen context" sentinel).
The lookup also takes the tables compacted (:func:`compact_tables`, what the residual holds): each
group's padded ``ell_col``/``ell_val`` replaced by its seen entries alone, in context order —
``"sparse_start": int32[C + 2]`` (context ``c``'s entries are ``sparse_start[c] …
sparse_start[c + 1] − 1``), ``"sparse_col": int32[E + 1]``, ``"sparse_val": float32[E + 1]``
(entry ``E`` the padding ``(V, 0)``) and ``"sparse_slots": int32[k]`` (``0 … k − 1``, the padded
width) — the same values, about a tenth of the bytes.
A group with a ``"shift"`` (a Kneser-Ney chain's root, smoothed towards the continuation
unigram rather than ``p``) adds it to the row of every context but the sentinel: one ``V``-vector
for the group, so no group ever stores ``V × V`` (runs solved before it was introduced stored the
shift in dense rows instead; they load and score the same).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from saffu.configs import ExactConfig, Params
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.models.kinds import ModelKind


def document_contexts(tokens: jax.Array, radius: int) -> jax.Array:
    """``int32[B, S]`` -> ``int32[B, S, R]``: ``[b, p, δ]`` is the token ``δ`` positions before
    position ``p`` (``δ = 0``: the token at ``p``, the head predicting ``p + 1``), ``<pad>`` when
    an ``<eod>`` lies in ``(p − δ, p]`` (an earlier document) or before the window."""
    boundaries = jnp.cumsum(tokens == EOD_ID, axis=1)
    columns = []
    for delta in range(radius):
        shifted = jnp.pad(tokens, ((0, 0), (delta, 0)), constant_values=PAD_ID)[:, :tokens.shape[1]]
        shifted_bounds = jnp.pad(boundaries, ((0, 0), (delta, 0)), constant_values=-1)[:, :tokens.shape[1]]
        columns.append(jnp.where(shifted_bounds == boundaries, shifted, PAD_ID))
    return jnp.stack(columns, axis=-1)


def _search(level: Params, parent: jax.Array, token: jax.Array, steps: int) -> jax.Array:
    """Ids of ``token`` among the children of ``parent`` (``int32[P]`` each): a lower-bound
    binary search in ``level["token"][start[parent] : start[parent + 1]]``; the sentinel
    ``len(level["token"])`` where absent."""
    start, children = level["start"], level["token"]
    size = children.shape[0]
    lo, end = start[parent], start[parent + 1]

    def body(_, bounds):
        lo, hi = bounds
        active = lo < hi
        mid = (lo + hi) // 2
        right = children[jnp.minimum(mid, size - 1)] < token
        return jnp.where(active & right, mid + 1, lo), jnp.where(active & ~right, mid, hi)

    lo, _ = jax.lax.fori_loop(0, steps, body, (lo, end))
    found = (lo < end) & (children[jnp.minimum(lo, max(size - 1, 0))] == token) if size else jnp.zeros_like(lo, bool)
    return jnp.where(found, lo, size)


def context_ids(group: Params, context: jax.Array, vocab_size: int) -> jax.Array:
    """``int32[P, n]`` context tokens of one group (its offsets' order) -> ``int32[P]`` context
    ids (the sentinel ``C`` for contexts never counted)."""
    ids = context[:, 0]
    steps = max(math.ceil(math.log2(vocab_size + 1)), 1)
    for j, level in enumerate(group["levels"], start=1):
        ids = _search(level, ids, context[:, j], steps)
    return ids


def group_ids(params: Params, config: ExactConfig, tokens: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Every group's context id and count bucket (its own context's, or group
    ``config.bucket_by``'s) at every position of ``tokens int32[B, S]``: two lists of ``G``
    ``int32[B·S]`` arrays."""
    B, S = tokens.shape
    context = document_contexts(tokens, config.context).reshape(B * S, config.context)
    ids = [context_ids(group, context[:, list(offsets)], config.vocab_size)
           for offsets, group in zip(config.groups, params["groups"])]
    if config.bucket_by is not None:
        shared = params["groups"][config.bucket_by]["bucket"][ids[config.bucket_by]]
        return ids, [shared] * len(ids)
    return ids, [group["bucket"][group_ids] for group, group_ids in zip(params["groups"], ids)]


def group_rows(params: Params, config: ExactConfig, tokens: jax.Array):
    """Per group, for every position of ``tokens int32[B, S]``: its ``V``-wide row
    ``L_g[c_g, :]`` and its count bucket (its own context's, or group ``config.bucket_by``'s).
    Yields ``(float32[B·S, V], int32[B·S])`` pairs, one group at a time (so at most one extra
    ``[B·S, V]`` array is live per group)."""
    ids, buckets = group_ids(params, config, tokens)
    for group, group_ids_, bucket in zip(params["groups"], ids, buckets):
        yield table_rows(group, group_ids_), bucket


def sparse_entries(group: Params, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The seen entries of one group's contexts ``int32[N]``, padded to the group's width ``k``:
    ``(columns int32[N, k], values float32[N, k])``, padding column ``V`` (value 0). Either
    layout: the padded ``ell_col``/``ell_val`` or the compact ``sparse_*`` arrays."""
    if "ell_col" in group:
        return group["ell_col"][ids], group["ell_val"][ids]
    start, end = group["sparse_start"][ids], group["sparse_start"][ids + 1]
    entry = start[:, None] + group["sparse_slots"][None, :]
    entry = jnp.where(entry < end[:, None], entry, group["sparse_col"].shape[0] - 1)     # the padding entry
    return group["sparse_col"][entry], group["sparse_val"][entry]


def table_rows(group: Params, ids: jax.Array) -> jax.Array:
    """The ``V``-wide rows ``L_g[c, :]`` of one group's contexts ``int32[N]`` (ids from
    :func:`context_ids`; for a one-token group the token itself) -> ``float32[N, V]``."""
    row = group["dense_rows"][group["dense_index"][ids]] + group["const"][ids][:, None]
    if "shift" in group:                  # every context but the "never counted" sentinel
        counted = ids < group["const"].shape[0] - 1
        row = row + jnp.where(counted[:, None], group["shift"], 0.0)
    columns, values = sparse_entries(group, ids)
    return row.at[jnp.arange(ids.shape[0])[:, None], columns].add(values, mode="drop")


def exact_logits(params: Params, config: ExactConfig, tokens: jax.Array, *, first: int = 0,
                 base: jax.Array | None = None, scale: jax.Array | float = 1.0) -> jax.Array:
    """Next-token logits at every position: ``tokens int32[B, S]`` -> ``float32[B, S, V]``.

    ``log p + Σ_g β_g · L_g`` built in one ``[B·S, V]`` buffer: the per-position scalars (each
    group's ``β_g · const_g``) and ``V``-vectors (Kneser-Ney shifts, dense rows of frequent
    contexts) in one elementwise pass, then every group's seen entries (scaled by ``β_g``) in one
    scatter-add — no per-group ``V``-wide row is ever materialised.

    ``first``: only positions ``first …`` (``float32[B, S − first, V]``; the earlier tokens are
    read as their context). ``base float32[B, S − first, V]`` and ``scale`` (a scalar): the
    result is ``base + scale · logits``, built in the same buffer (a residual's combination with
    no second ``V``-wide array)."""
    B, S = tokens.shape
    V = config.vocab_size
    ids, buckets = group_ids(params, config, tokens)
    if first:
        keep = lambda x: x.reshape(B, S)[:, first:].reshape(-1)
        ids, buckets = [keep(x) for x in ids], [keep(x) for x in buckets]
        S -= first
    offset = jnp.zeros(B * S, jnp.float32)
    logits = scale * params["log_prior"][None, :]
    if base is not None:
        logits = base.reshape(B * S, V).astype(jnp.float32) + logits
    columns, values = [], []
    for g, (group, group_ids_, bucket) in enumerate(zip(params["groups"], ids, buckets)):
        weight = scale * params["beta"][g, bucket]                            # float32[B·S]
        offset = offset + weight * group["const"][group_ids_]
        if "shift" in group:              # every context but the "never counted" sentinel
            counted = group_ids_ < group["const"].shape[0] - 1
            logits = logits + jnp.where(counted, weight, 0.0)[:, None] * group["shift"][None, :]
        logits = logits + weight[:, None] * group["dense_rows"][group["dense_index"][group_ids_]]
        group_columns, group_values = sparse_entries(group, group_ids_)
        columns.append(group_columns)
        values.append(weight[:, None] * group_values)
    logits = logits + offset[:, None]
    rows = jnp.arange(B * S)[:, None]
    logits = logits.at[rows, jnp.concatenate(columns, axis=1)].add(jnp.concatenate(values, axis=1), mode="drop")
    return logits.reshape(B, S, V)


def compact_tables(params: Params) -> Params:
    """The exact model's tables with every group's padded sparse rows (``ell_col``, ``ell_val``:
    ``[C + 1, k]``) replaced by their seen entries alone (``sparse_start``, ``sparse_col``,
    ``sparse_val``, ``sparse_slots``; see the module docstring): the same logits, a fraction of
    the memory. Tables already compact are returned as they are; the other arrays are shared."""
    vocab_size = params["log_prior"].shape[0]
    groups = []
    for group in params["groups"]:
        if "ell_col" not in group:
            groups.append(group)
            continue
        group = dict(group)
        columns, values = np.asarray(group.pop("ell_col")), np.asarray(group.pop("ell_val"))
        seen = columns < vocab_size
        start = np.zeros(columns.shape[0] + 1, np.int64)
        np.cumsum(seen.sum(axis=1), out=start[1:])
        group["sparse_start"] = jnp.asarray(start.astype(np.int32))
        group["sparse_col"] = jnp.asarray(np.append(columns[seen], vocab_size).astype(np.int32))
        group["sparse_val"] = jnp.asarray(np.append(values[seen], 0.0).astype(np.float32))
        group["sparse_slots"] = jnp.arange(columns.shape[1], dtype=jnp.int32)
        groups.append(group)
    return {**params, "groups": groups}


def exact_target_logits(params: Params, config: ExactConfig, tokens: jax.Array, context: int,
                        base: jax.Array | None = None, scale: jax.Array | float = 1.0) -> jax.Array:
    """The exact model's logits predicting ``tokens[:, context:]`` (its prediction at ``p``
    reads only ``tokens[p − config.context + 1 … p]`` inside its document): run on that slice of
    the window alone (``<pad>`` on the left where the window holds fewer tokens of context), its
    ``V``-wide rows at the predicting positions only: ``float32[B, S − context, V]``; with
    ``base`` (that shape) and ``scale``, ``base + scale · logits``."""
    radius = config.context
    head = tokens[:, max(context - radius, 0):-1]
    if radius > context:
        head = jnp.pad(head, ((0, 0), (radius - context, 0)), constant_values=PAD_ID)
    return exact_logits(params, config, head, first=radius - 1, base=base, scale=scale)


KIND = ModelKind(
    "exact", ExactConfig, exact_logits,
    # JSON lists back to the hashable tuples of the config
    from_fields=lambda fields: ExactConfig(**{**fields, "groups": tuple(tuple(g) for g in fields["groups"]),
                                              "buckets": tuple(fields["buckets"])}),
    target_logits=lambda params, config, windows, context, positions=None: exact_target_logits(
        params, config, windows, context),
    document_local=True, solve_command="saffu exact", exact_tables=lambda config: True)
