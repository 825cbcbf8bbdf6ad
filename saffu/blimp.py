"""BLiMP minimal pairs: a model is right when it gives ``sentence_good`` a higher total
log-probability than ``sentence_bad`` (ties count as wrong).

Each sentence is scored as a document: after an ``<eod>`` (the document start), the sum of
its tokens' log-probabilities (the closing ``<eod>`` is not scored). Works on any subset of
the 67 paradigm files (``*.jsonl`` with ``sentence_good``, ``sentence_bad``, ``field``,
``UID``); reports accuracy overall, per field and per paradigm.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.model import Params, SaffuConfig, window_nll
from saffu.tokenizer import EOD_ID, PAD_ID


class Pair(NamedTuple):
    paradigm: str
    field: str
    good: str
    bad: str


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
                pairs.append(Pair(row.get("UID", path.stem), row.get("field", "unknown"),
                                  row["sentence_good"], row["sentence_bad"]))
            except (ValueError, KeyError) as err:
                raise SaffuError(f"{path}:{number} is not a BLiMP pair ({err}); fix or remove the line") from None
    return pairs


def sentence_log_probs(params: Params, config: SaffuConfig, tokenizer, sentences: list[str],
                       batch_size: int = 64, progress: bool = True) -> np.ndarray:
    """Total log-probability (nats) of every sentence as a document, ``float64[N]``."""
    encoded = [ids for ids in (enc.ids for enc in tokenizer.encode_batch(sentences, add_special_tokens=False))]
    longest = max(len(ids) for ids in encoded)
    length = 1 << max(int(np.ceil(np.log2(max(longest, 1)))), 3)   # few distinct shapes: few compilations
    score = jax.jit(lambda w, m: jnp.sum(window_nll(params, config, w, m), axis=1))
    out = np.zeros(len(sentences))
    for start in tqdm(range(0, len(encoded), batch_size), desc="blimp", disable=not progress, leave=False):
        rows = encoded[start:start + batch_size]
        windows = np.full((batch_size, config.context + length), PAD_ID, np.int32)
        mask = np.zeros((batch_size, length), bool)
        windows[:, config.context - 1] = EOD_ID
        for i, ids in enumerate(rows):
            windows[i, config.context:config.context + len(ids)] = ids
            mask[i, :len(ids)] = True
        out[start:start + len(rows)] = -np.asarray(score(jnp.asarray(windows), jnp.asarray(mask)))[:len(rows)]
    return out


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
    good = sentence_log_probs(params, config, tokenizer, [p.good for p in pairs], progress=progress)
    bad = sentence_log_probs(params, config, tokenizer, [p.bad for p in pairs], progress=progress)
    return blimp_accuracy(pairs, good, bad)
