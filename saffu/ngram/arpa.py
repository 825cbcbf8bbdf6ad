"""ARPA files of :class:`saffu.ngram.kneser_ney.KneserNeyModel` (kenlm's text format).

ARPA form. The interpolated model is exactly a backoff model: a seen ``h w`` gets
``p_k(w | h)``, the backoff weight of a seen context ``h`` is ``γ(h)``, every other backoff is
1, and ``p(w | h) = bo(h) · p(w | h')`` for unseen ``h w``. Seen n-grams are closed under
prefixes and suffixes, as kenlm requires. :func:`write_arpa` names tokens ``t<id>``, writes
``<s>`` (log10 prob ``-99``) and ``</s>`` for ``<eod>``, and ``<unk>`` with the probability
of an unseen token (never used: the vocabulary is closed).
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from saffu._io import SaffuError, atomic_open
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.ngram.counts import lookup
from saffu.ngram.kneser_ney import KneserNeyModel

_LN10 = math.log(10.0)


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
            suffix = lookup(keys[j - 1], np.where(suffix >= 0, suffix * V + tokens[:, k - j], -1))
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
