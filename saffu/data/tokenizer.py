"""Byte-level BPE trained with the ``tokenizers`` library, with ids ranked by frequency.

Id layout (the bit-cipher depends on it, formulation §2):

* ``0`` — ``<pad>``: never produced by encoding; fills context before a document start.
* ``1`` — ``<eod>``: end of document, one per corpus line; it also opens the first document.
* ``2 …`` — every other token, in order of decreasing frequency on the training split
  (ties by the trainer's own id), so id ``i`` has frequency rank ``i - 2``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from saffu._io import atomic_write_bytes

PAD_TOKEN, EOD_TOKEN = "<pad>", "<eod>"
PAD_ID, EOD_ID = 0, 1
SPECIAL_TOKENS = (PAD_TOKEN, EOD_TOKEN)


def _as_text(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` reading ``<pad>`` / ``<eod>`` written in a text as that text (bytes), never as
    the special tokens: only the pipeline puts an end of document (the setting is not saved in
    ``tokenizer.json``, so every tokenizer made or loaded here gets it)."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def train_bpe(documents: Iterable[str], vocab_size: int, min_frequency: int = 2,
              show_progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens (specials included).

    The trainer may stop below ``vocab_size`` when the corpus supports no more merges.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return _as_text(tokenizer)


def encode_batches(tokenizer: Tokenizer, documents: Iterable[str],
                   batch_size: int = 4096) -> Iterator[list[list[int]]]:
    """Encode documents in batches (the library parallelises each batch)."""
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == batch_size:
            yield [enc.ids for enc in tokenizer.encode_batch(batch, add_special_tokens=False)]
            batch = []
    if batch:
        yield [enc.ids for enc in tokenizer.encode_batch(batch, add_special_tokens=False)]


def rerank_by_frequency(tokenizer: Tokenizer, documents: Iterable[str]) -> tuple[Tokenizer, np.ndarray]:
    """Renumber ``tokenizer``'s vocabulary so ids follow the layout in the module docstring.

    Returns the re-ranked tokenizer and the training count of every new id, ``int64[V]``
    (``<eod>`` counted once per document; ``<pad>`` is 0).
    """
    counts: Counter[int] = Counter()
    num_docs = 0
    for batch in encode_batches(tokenizer, documents):
        num_docs += len(batch)
        for ids in batch:
            counts.update(ids)
    old_vocab: dict[str, int] = tokenizer.get_vocab()
    regular = [tok for tok in old_vocab if tok not in SPECIAL_TOKENS]
    regular.sort(key=lambda tok: (-counts[old_vocab[tok]], old_vocab[tok]))
    order = list(SPECIAL_TOKENS) + regular
    new_vocab = {tok: i for i, tok in enumerate(order)}

    spec = json.loads(tokenizer.to_str())
    spec["model"]["vocab"] = new_vocab
    for added in spec.get("added_tokens", []):
        added["id"] = new_vocab[added["content"]]
    reranked = _as_text(Tokenizer.from_str(json.dumps(spec)))

    new_counts = np.zeros(len(order), dtype=np.int64)
    for tok, new_id in new_vocab.items():
        if tok not in SPECIAL_TOKENS:
            new_counts[new_id] = counts[old_vocab[tok]]
    new_counts[EOD_ID] = num_docs
    return reranked, new_counts


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Save as ``tokenizer.json`` (atomically)."""
    atomic_write_bytes(path, tokenizer.to_str(pretty=True).encode())


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer saved by :func:`save_tokenizer` and check its special-token ids."""
    from saffu._io import SaffuError
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises plain Exceptions with long messages
        raise SaffuError(f"cannot load tokenizer {path} ({str(err).splitlines()[0]}); "
                         f"run `saffu prepare` again") from None
    for tok, want in zip(SPECIAL_TOKENS, (PAD_ID, EOD_ID)):
        if tokenizer.token_to_id(tok) != want:
            raise SaffuError(f"tokenizer {path} was not made by saffu ({tok} is not id {want}); "
                             f"run `saffu prepare` again")
    return _as_text(tokenizer)


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Token ids -> text; ``<eod>`` becomes a newline, ``<pad>`` is dropped."""
    pieces, current = [], []
    for i in ids:
        if i == EOD_ID:
            pieces.append(tokenizer.decode(current) + "\n")
            current = []
        elif i != PAD_ID:
            current.append(int(i))
    pieces.append(tokenizer.decode(current))
    return "".join(pieces)
