"""BLiMP minimal pairs: a model is right when it gives ``sentence_good`` a higher total
log-probability than ``sentence_bad`` (ties count as wrong).

Each sentence is scored as a document: after an ``<eod>`` (the document start), the sum of
its tokens' log-probabilities (the closing ``<eod>`` is not scored). Works on any subset of
the 67 paradigm files (``*.jsonl`` with ``sentence_good``, ``sentence_bad``, ``field``,
``UID``); reports accuracy overall, per field and per paradigm.

Scoring is batched so it costs about what a forward pass over the sentences' own tokens does:
every sentence of a set is encoded once, and calls of one fixed size (parameters as jit
arguments) read rows packed with many sentences, ``<eod> s₁ <eod> s₂ …``: behind ``context``
tokens of ``<pad>`` for a model that reads only a document's own tokens (:func:`document_local`),
or with no context at all and each token's absolute position given for the transformer (and a
residual over one, :func:`saffu.models.interface.positional`), so no row is padded to a bucket
and no ``<pad>`` context is computed. Any other model reads one sentence per row in a few
length buckets. A progress bar counts the calls, with an estimate of the time left. The
log-probabilities are :func:`saffu.models.interface.target_nll`'s (no ``V``-wide log-softmax,
no output layer at context positions).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import EVAL_SEQ_LEN
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.data.windows import length_buckets
from saffu.models.interface import base_of, positional, read_alone, target_nll, traits
from saffu.models.saffu import Params, SaffuConfig


class Pair(NamedTuple):
    paradigm: str
    field: str
    good: str
    bad: str


def field_name(field: str) -> str:
    """One spelling per BLiMP field: releases write ``syntax/semantics`` in some files and
    ``syntax_semantics`` in others, which must count as one field."""
    return re.sub(r"[\s/-]+", "_", field.strip())


def load_blimp(directory: str | Path) -> list[Pair]:
    """Every pair of every ``*.jsonl`` paradigm file in ``directory``."""
    directory = Path(directory)
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if not files:
        raise SaffuError(f"{directory} holds no BLiMP *.jsonl files; pass the folder of paradigm files "
                         f"(for example ../shared/data/blimp)")
    pairs = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pairs.append(Pair(row.get("UID", path.stem), field_name(row.get("field", "unknown")),
                                  row["sentence_good"], row["sentence_bad"]))
            except (ValueError, KeyError) as err:
                raise SaffuError(f"{path}:{number} is not a BLiMP pair ({err}); fix or remove the line") from None
    return pairs


#: Target slots per row of packed sentences (more when a sentence is longer).
PACKED_ROW = EVAL_SEQ_LEN
#: Token positions per call, ``rows × (context + targets)``: four rows of the default SAFFU
#: (``4 × (8 + 256)``); on CPU calls of a few thousand positions or fewer run faster per token
#: than larger ones (activations and logits stay in cache; ``experiments/bench_scoring.py``).
CALL_POSITIONS = 4 * (SaffuConfig.radius + EVAL_SEQ_LEN)
#: Token positions per call of rows packed with their absolute positions (the transformer).
POSITIONED_CALL = 512
#: Columns per row packed with positions (``<eod>`` and targets): attention costs a row's
#: width per position, so short rows, yet long enough that a row wastes little at its end.
POSITIONED_ROW = 64

#: Per-target NLL of windows, with the parameters as arguments and the config and the number
#: of context tokens static.
_target_nll = jax.jit(target_nll, static_argnums=(1, 4))


def document_local(config) -> bool:
    """Whether the model's prediction at a position depends only on the tokens of its own
    document and their offsets, never on where the document sits in the window: true of a
    SAFFU stack (every row outside the document, or before the window, is the boundary code),
    not of the transformer (learned absolute positions). Such a model can score many
    sentences packed into one row, ``<eod> s₁ <eod> s₂ …``, each with the same inputs as
    alone (equal up to float rounding). The exact model, and a residual over a SAFFU stack, are too."""
    return traits(config).document_local


def _packed_rows(lengths: np.ndarray, width: int) -> list[list[int]]:
    """Sentence indices per row, longest first, each row holding sentences of ``length + 1``
    target slots (the tokens and the ``<eod>`` that opens the next) within ``width``."""
    rows, row, used = [], [], 0
    for i in np.argsort(-lengths, kind="stable"):
        if row and used + lengths[i] + 1 > width:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += int(lengths[i]) + 1
    if row:
        rows.append(row)
    return rows


def _layout(config, pack: bool | None) -> str:
    """How :func:`sentence_log_probs` lays sentences out: ``"local"`` (packed behind ``context``
    pads), ``"positioned"`` (packed, positions given) or ``"rows"`` (one per row, bucketed)."""
    if pack is False:
        return "rows"
    if document_local(config):
        return "local"
    if positional(config):
        return "positioned"
    return "local" if pack else "rows"


def sentence_log_probs(params: Params, config: SaffuConfig, tokenizer, sentences: list[str],
                       batch_size: int | None = None, progress: bool = True,
                       pack: bool | None = None) -> np.ndarray:
    """Total log-probability (nats) of every sentence as a document, ``float64[N]``: after
    an ``<eod>``, the sum of its tokens' log-probabilities (the closing ``<eod>`` unscored;
    an empty sentence scores 0).

    Sentences are batched by length, longest first. By default (``pack=None``; ``True`` packs
    too) a :func:`document_local` model reads rows of ``PACKED_ROW`` targets holding many
    sentences, ``<eod> s₁ <eod> s₂ …``, behind ``context`` tokens of ``<pad>``; a
    :func:`~saffu.models.interface.positional` one (the transformer) reads rows of
    ``POSITIONED_ROW`` columns packed the same way with no context, each token given the
    absolute position it has alone (its sentence's ``<eod>`` at ``context − 1``), attention
    stopping at every ``<eod>``. Any other model (or ``pack=False``) reads one sentence per
    row, its ``<eod>`` last of the ``context`` tokens (as at a document start), rows grouped in
    power-of-two length buckets. Every layout gives each sentence the inputs it has alone after
    ``<pad> … <pad> <eod>``. ``batch_size`` rows per call (default: about ``CALL_POSITIONS``
    positions, ``POSITIONED_CALL`` for positioned rows); the progress bar counts calls.
    Per-token NLLs are float32; each sentence's sum is float64, in token order, on the host.
    """
    config = read_alone(config)      # a sentence is a document alone: rows may pack many
    encoded = [enc.ids for enc in tokenizer.encode_batch(list(sentences), add_special_tokens=False)]
    lengths = np.asarray([len(ids) for ids in encoded], np.int64)
    R = config.context
    layout = _layout(config, pack)
    context, call_positions = (1, POSITIONED_CALL) if layout == "positioned" else (R, CALL_POSITIONS)
    longest = int(lengths.max(initial=0))
    if layout == "positioned":
        max_len = base_of(config).max_len
        if R + longest > max_len:
            raise SaffuError(f"a sentence of {longest} tokens after {R} of context is longer than the "
                             f"transformer's max_len {max_len}")
        width = max(POSITIONED_ROW, 1 << int(np.ceil(np.log2(longest + 2)))) - 1
        groups = [(width, _packed_rows(lengths, width))]
    elif layout == "local":
        width = max(PACKED_ROW, 1 << int(np.ceil(np.log2(longest + 1))))
        groups = [(width, _packed_rows(lengths, width))]
    else:
        groups = [(width, [[i] for i in members]) for width, members in length_buckets(lengths)]
    calls = []                                                     # (targets per row, rows, rows per call)
    for width, rows in groups:
        per_call = batch_size or max(1, call_positions // (context + width))
        calls += [(width, rows[start:start + per_call], per_call) for start in range(0, len(rows), per_call)]
    total = np.zeros(len(encoded))
    pending = None

    def add(result, owner):
        scored = owner >= 0
        nll = np.asarray(result)[scored].astype(np.float64)
        total[:] += np.bincount(owner[scored], weights=nll, minlength=len(encoded))

    # calls of one shape cost the same, so the bar counts them (a steady estimate of the time left)
    for width, batch, per_call in tqdm(calls, desc="blimp", unit="batch", disable=not progress, leave=False):
        windows = np.full((per_call, context + width), PAD_ID, np.int32)
        windows[:, context - 1] = EOD_ID
        positions = np.zeros((per_call, context + width), np.int32)
        owner = np.full((per_call, width), -1, np.int64)          # sentence of every target slot
        for r, row in enumerate(batch):
            at = 0
            for i in row:
                ids, n = encoded[i], len(encoded[i])
                windows[r, context + at:context + at + n] = ids
                positions[r, context - 1 + at:context + at + n] = np.arange(R - 1, R + n)
                owner[r, at:at + n] = i
                at += n
                if at < width:
                    windows[r, context + at] = EOD_ID              # closes it, opens the next
                at += 1
        result = _target_nll(params, config, jnp.asarray(windows), jnp.asarray(owner >= 0), context,
                             jnp.asarray(positions) if layout == "positioned" else None)
        if pending is not None:                                    # read back while this one runs
            add(*pending)
        pending = (result, owner)
    if pending is not None:
        add(*pending)
    return -total


def blimp_accuracy(pairs: list[Pair], good_scores: np.ndarray, bad_scores: np.ndarray) -> dict[str, float]:
    """``blimp_accuracy`` overall, ``blimp_field_<f>`` and ``blimp_<paradigm>`` accuracies
    (a pair is right only when good > bad strictly)."""
    right = np.asarray(good_scores) > np.asarray(bad_scores)
    by_field, by_paradigm = defaultdict(list), defaultdict(list)
    for pair, ok in zip(pairs, right):
        by_field[pair.field].append(ok)
        by_paradigm[pair.paradigm].append(ok)
    metrics = {"blimp_accuracy": float(right.mean()), "blimp_pairs": len(pairs)}
    metrics.update({f"blimp_field_{f}": float(np.mean(v)) for f, v in sorted(by_field.items())})
    metrics.update({f"blimp_{p}": float(np.mean(v)) for p, v in sorted(by_paradigm.items())})
    return metrics


def evaluate_blimp(params: Params, config: SaffuConfig, tokenizer, directory: str | Path,
                   progress: bool = True) -> dict[str, float]:
    """Load the pairs of ``directory``, score them and return :func:`blimp_accuracy`."""
    pairs = load_blimp(directory)
    scores = sentence_log_probs(params, config, tokenizer, [p.good for p in pairs] + [p.bad for p in pairs],
                                progress=progress)
    good, bad = scores[:len(pairs)], scores[len(pairs):]
    return blimp_accuracy(pairs, good, bad)
