"""Language-model figures from a total negative log-likelihood (formulation §4).

Every figure derives from three sums: total NLL in nats, number of predicted tokens, and the
split's UTF-8 bytes (plus one newline per document) and words (plus one end-of-document per
document), so models with different tokenizers compare on bits per byte and per-word
perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def language_model_metrics(total_nll: float, tokens: int, bytes_: int | None = None,
                           words: int | None = None, prefix: str = "") -> dict[str, float]:
    """Figures from a total NLL (nats) over ``tokens`` predicted tokens.

    Returns ``{prefix}loss`` (nats/token), ``{prefix}ppl`` (per token), and when the split's
    bytes / words are given ``{prefix}bpb`` (bits per byte) and ``{prefix}word_ppl``.
    """
    if tokens <= 0:
        raise ValueError("no predicted tokens to score")
    if not math.isfinite(total_nll):
        raise FloatingPointError(f"non-finite total NLL {total_nll}")
    out = {f"{prefix}loss": total_nll / tokens, f"{prefix}ppl": math.exp(total_nll / tokens)}
    if bytes_:
        out[f"{prefix}bpb"] = total_nll / math.log(2) / bytes_
    if words:
        out[f"{prefix}word_ppl"] = math.exp(total_nll / words)
    return out


def split_metrics(total_nll: float, split_info: Mapping[str, int], prefix: str) -> dict[str, float]:
    """:func:`language_model_metrics` for a whole prepared split (``WorkDir.split_info``)."""
    return language_model_metrics(total_nll, split_info["predicted_tokens"], split_info["bytes"],
                                  split_info["words"], prefix=prefix)
