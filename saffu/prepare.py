"""``saffu prepare``: corpus -> tokenizer -> memory-mapped token streams + ``meta.json``.

Work directory layout::

    W/tokenizer.json        byte-level BPE, ids ranked by training frequency
    W/tokens/<split>.bin    the split's token stream, raw little-endian uint16/uint32
    W/meta.json             written last: vocab size, dtype, and per split the number of
                            tokens, predicted tokens, documents, bytes, words and replaced bytes

A stream is ``<eod> doc_1 <eod> doc_2 <eod> …``: the leading ``<eod>`` opens the first
document so every document token (and every closing ``<eod>``) is predicted from something.
A work directory without ``meta.json`` is incomplete and is rebuilt, never used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from saffu import tokenizer as tok
from saffu._io import SaffuError, atomic_write_json
from saffu.corpus import Corpus, ReadStats, check_not_empty, iter_documents

META_VERSION = 2


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How to turn a corpus into a work directory.

    Attributes:
      vocab_size: BPE vocabulary size including ``<pad>`` and ``<eod>``.
      train_split: the split the tokenizer (and later every statistic) is trained on.
      eval_splits: further splits to tokenize if the corpus has them (``dev``, ``test``).
      min_frequency: minimum pair frequency for a BPE merge.
      allow_smaller_vocab: accept a vocabulary smaller than ``vocab_size`` when the training
        split supports no more merges (otherwise that is an error).
    """

    vocab_size: int = 8192
    train_split: str = "train_10M"
    eval_splits: tuple[str, ...] = ("dev", "test")
    min_frequency: int = 2
    allow_smaller_vocab: bool = False


@dataclasses.dataclass(frozen=True)
class WorkDir:
    """A prepared work directory (see the module docstring), opened read-only."""

    path: Path
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def train_split(self) -> str:
        return self.meta["train_split"]

    def tokens(self, split: str) -> np.ndarray:
        """The token stream of ``split`` as a read-only memory map, ``uint16|uint32[N]``."""
        if split not in self.meta["splits"]:
            have = ", ".join(self.meta["splits"])
            raise SaffuError(f"work directory {self.path} has no split {split!r} "
                             f"(it has: {have}); prepare it from a corpus that has that split")
        info = self.meta["splits"][split]
        return np.memmap(self.path / "tokens" / f"{split}.bin", dtype=self.meta["dtype"],
                         mode="r", shape=(info["tokens"],))

    def split_info(self, split: str) -> dict[str, int]:
        """Counts of ``split``: tokens, predicted_tokens, documents, bytes, words, replaced_bytes."""
        self.tokens(split)  # validates the name
        return self.meta["splits"][split]

    def check_radius(self, radius: int, split: str | None = None) -> None:
        """A clear error when a context of ``radius`` tokens is longer than every document of
        ``split`` (default: the training split), so its far rows would always be padding."""
        split = split or self.train_split
        longest = self.split_info(split)["longest_document"]
        if radius > longest + 1:  # the opening <eod> is the (radius)-th row of the longest document
            raise SaffuError(f"--radius {radius} is longer than every document of {split} in {self.path} (the "
                             f"longest has {longest} tokens); use --radius {max(longest + 1, 1)} or less")

    def token_counts(self) -> np.ndarray:
        """Training-split count of every token id, ``int64[V]``."""
        return np.asarray(self.meta["train_token_counts"], dtype=np.int64)

    def tokenizer(self):
        return tok.load_tokenizer(self.path / "tokenizer.json")


def open_workdir(path: str | Path) -> WorkDir:
    """Open a work directory written by :func:`prepare`; a clear error if it is not one."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise SaffuError(f"{path} is not a prepared work directory (no meta.json); "
                         f"run `saffu prepare --corpus C --workdir {path}` first")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise SaffuError(f"{meta_path} is unreadable ({err}); run `saffu prepare` again") from None
    if meta.get("version") != META_VERSION:
        raise SaffuError(f"{meta_path} has format version {meta.get('version')}, this saffu "
                         f"reads {META_VERSION}; run `saffu prepare` again")
    for split, info in meta["splits"].items():
        file = path / "tokens" / f"{split}.bin"
        itemsize = np.dtype(meta["dtype"]).itemsize
        if not file.is_file() or file.stat().st_size != info["tokens"] * itemsize:
            raise SaffuError(f"{file} is missing or truncated; run `saffu prepare` again")
    return WorkDir(path=path, meta=meta)


def _write_stream(tokenizer, files, out: Path, dtype: np.dtype, desc: str,
                  show_progress: bool) -> dict[str, int]:
    stats = ReadStats()
    total = sum(f.stat().st_size for f in files)
    tmp = out.with_suffix(".bin.tmp")
    num_tokens = 0
    longest = 0
    with open(tmp, "wb") as handle, tqdm(total=total, unit="B", unit_scale=True, desc=desc,
                                         leave=False, disable=not show_progress) as bar:
        handle.write(np.asarray([tok.EOD_ID], dtype=dtype).tobytes())
        num_tokens += 1
        seen_bytes = 0
        for batch in tok.encode_batches(tokenizer, iter_documents(files, stats)):
            flat = []
            for ids in batch:
                flat.extend(ids)
                flat.append(tok.EOD_ID)
                longest = max(longest, len(ids))
            handle.write(np.asarray(flat, dtype=dtype).tobytes())
            num_tokens += len(flat)
            bar.update(stats.bytes - seen_bytes)
            seen_bytes = stats.bytes
    os.replace(tmp, out)
    return {"tokens": num_tokens, "predicted_tokens": num_tokens - 1,
            "documents": stats.documents, "bytes": stats.bytes, "words": stats.words,
            "replaced_bytes": stats.replaced_bytes, "longest_document": longest}


def prepare(corpus: Corpus, workdir: str | Path, config: PrepareConfig = PrepareConfig(),
            show_progress: bool = True) -> WorkDir:
    """Train the tokenizer on ``config.train_split`` and write every split's token stream.

    Any previous content of ``workdir/tokens`` and ``meta.json`` is replaced; ``meta.json`` is
    written last, so an interrupted run leaves a directory that :func:`open_workdir` rejects.

    Returns the opened :class:`WorkDir`.
    """
    start = time.perf_counter()
    if config.vocab_size < 3:
        raise SaffuError(f"--vocab-size {config.vocab_size} is too small; use at least 259 "
                         f"(256 bytes + specials) for a useful BPE vocabulary")
    train_files = corpus.files(config.train_split)
    check_not_empty(train_files, config.train_split)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "meta.json").unlink(missing_ok=True)
    shutil.rmtree(workdir / "tokens", ignore_errors=True)
    (workdir / "tokens").mkdir()

    bpe = tok.train_bpe(iter_documents(train_files), config.vocab_size,
                        config.min_frequency, show_progress=show_progress)
    vocab_size = bpe.get_vocab_size()
    if vocab_size < config.vocab_size and not config.allow_smaller_vocab:
        raise SaffuError(f"the training split ({', '.join(str(f) for f in train_files[:2])}"
                         f"{', …' if len(train_files) > 2 else ''}) supports only {vocab_size} BPE tokens, "
                         f"fewer than --vocab-size {config.vocab_size}; use --vocab-size {vocab_size} or less, "
                         f"or pass --allow-smaller-vocab")
    bpe, counts = tok.rerank_by_frequency(bpe, iter_documents(train_files))
    tok.save_tokenizer(bpe, workdir / "tokenizer.json")
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)

    splits = {}
    for split in (config.train_split,) + tuple(config.eval_splits):
        if split not in corpus.splits:
            continue
        splits[split] = _write_stream(bpe, corpus.files(split), workdir / "tokens" / f"{split}.bin",
                                      dtype, desc=f"tokenize {split}", show_progress=show_progress)
    meta = {
        "version": META_VERSION, "corpus": corpus.name, "vocab_size": vocab_size,
        "requested_vocab_size": config.vocab_size, "dtype": dtype.name,
        "train_split": config.train_split, "pad_id": tok.PAD_ID, "eod_id": tok.EOD_ID,
        "splits": splits, "train_token_counts": counts.tolist(),
        "files": {s: [str(f) for f in corpus.files(s)] for s in splits},
        "seconds": time.perf_counter() - start,
    }
    atomic_write_json(workdir / "meta.json", meta)
    return open_workdir(workdir)
