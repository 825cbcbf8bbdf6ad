"""Log-likelihoods of continuations after contexts, for any model saffu trains: what an
evaluation harness asks a language model (lm-evaluation-harness's ``loglikelihood``; its
``loglikelihood_rolling`` is a sum of them over a document's windows).

A request is ``(context ids, continuation ids)``; the context normally opens with ``<eod>``
(a document start). Each request reads one row laid out as saffu lays out a document at the
start of a window: ``R − 1`` tokens of ``<pad>`` (``R = config.context``), then the context and
the continuation, so the first context token sits at position ``R − 1`` (where :mod:`saffu.eval.blimp`
puts a sentence's ``<eod>``: a BLiMP sentence scored here with the context ``[<eod>]`` gets
exactly :func:`saffu.eval.blimp.sentence_log_probs`' figure). A request longer than the model's
window (:func:`max_tokens`) keeps its last tokens, as Hugging Face models in the harness do.

Rows are sorted by length, longest first, and grouped in power-of-two widths (a few window
shapes, few compilations); a progress bar counts the calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import TransformerConfig
from saffu.data.tokenizer import PAD_ID
from saffu.data.windows import length_buckets
from saffu.models.interface import base_of, target_logits

#: Token positions per call (rows × width); on CPU calls of a few thousand positions run
#: faster per token than larger ones (``experiments/bench_scoring.py``).
CALL_POSITIONS = 2048
#: The longest request a model without a window limit reads in one row (SAFFU and the exact
#: model read any length; rows this long are rare and cost ``V`` floats per position).
UNBOUNDED = 4096


def max_tokens(config) -> int:
    """Tokens (context and continuation) one row holds after its ``R − 1`` pads: the
    transformer's ``max_len − R + 1`` (a residual's over one: its base's), :data:`UNBOUNDED` otherwise."""
    base = base_of(config)
    if isinstance(base, TransformerConfig):
        return base.max_len - config.context + 1
    return UNBOUNDED


@functools.partial(jax.jit, static_argnums=(1, 4))
def _scores(params, config, windows: jax.Array, scored: jax.Array, context: int) -> tuple[jax.Array, jax.Array]:
    """Per-row log-probability ``float32[B]`` of the targets where ``scored bool[B, T]``, and
    whether each of them is the model's most likely token, ``bool[B]``, of ``windows int32[B, context + T]``."""
    logits = target_logits(params, config, windows, context).astype(jnp.float32)
    targets = windows[:, context:]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.sum(jnp.where(scored, picked, 0.0), axis=-1), jnp.all(greedy | ~scored, axis=-1)


def continuation_log_probs(params, config, requests: list[tuple[list[int], list[int]]],
                           batch_size: int | None = None, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(log-probability float64[N], greedy bool[N])`` of every request's continuation after its
    context (see the module docstring): the sum (nats) of the continuation tokens'
    log-probabilities, and whether each of them is the model's argmax there.

    ``requests``: ``(context ids, continuation ids)`` pairs, the context at least one token
    (``[<eod>]`` for a continuation at a document start), the continuation at least one.
    ``batch_size``: rows per call (default: about :data:`CALL_POSITIONS` positions)."""
    limit = max_tokens(config)
    rows = []
    for number, (context, continuation) in enumerate(requests):
        if not len(context) or not len(continuation):
            raise SaffuError(f"request {number} has an empty context or continuation; a continuation at a document "
                             f"start takes the context [<eod>]")
        rows.append((list(context) + list(continuation))[-(limit + 1):])      # the last tokens, when too long
    lengths = np.asarray([len(row) for row in rows], np.int64)
    scored_counts = np.asarray([min(len(c), len(row) - 1) for (_, c), row in zip(requests, rows)], np.int64)
    lead = config.context - 1
    calls = []
    for w, bucket in length_buckets(lengths - 1, cap=limit):       # rows of one width, longest first
        members = sorted(bucket, key=lambda i: -lengths[i])
        per_call = batch_size or max(1, CALL_POSITIONS // (lead + 1 + int(w)))
        calls += [(int(w), members[s:s + per_call], per_call) for s in range(0, len(members), per_call)]
    log_probs, greedy = np.zeros(len(rows)), np.zeros(len(rows), bool)
    for w, members, per_call in tqdm(calls, desc="continuations", unit="batch", disable=not progress, leave=False):
        windows = np.full((per_call, lead + 1 + w), PAD_ID, np.int32)
        scored = np.zeros((per_call, w), bool)
        for r, i in enumerate(members):
            windows[r, lead:lead + lengths[i]] = rows[i]
            scored[r, lengths[i] - 1 - scored_counts[i]:lengths[i] - 1] = True
        total, best = _scores(params, config, jnp.asarray(windows), jnp.asarray(scored), lead + 1)
        total, best = np.asarray(total, np.float64), np.asarray(best)
        log_probs[members] = total[:len(members)]
        greedy[members] = best[:len(members)]
    return log_probs, greedy
