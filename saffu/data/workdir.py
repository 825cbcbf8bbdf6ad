"""``saffu prepare``: corpus -> tokenizer -> memory-mapped token streams + ``meta.json``.

Work directory layout::

    W/tokenizer.json        byte-level BPE, ids ranked by training frequency
    W/tokens/<split>.bin    the split's token stream, raw little-endian uint16/uint32
    W/meta.json             written last: vocab size, dtype, and per split the number of
                            tokens, predicted tokens, documents, bytes, words and replaced bytes

A stream is ``<eod> doc_1 <eod> doc_2 <eod> …``: the leading ``<eod>`` opens the first
document so every document token (and every closing ``<eod>``) is predicted from something.
A work directory without ``meta.json`` is incomplete and is rebuilt, never used.

:func:`subset_workdir` writes a smaller work directory of whole documents of another's (same
tokenizer, exact counts, ``meta["subset"]`` saying where it came from), for sweeps that need a
fixed slice of a corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from saffu._io import FINGERPRINT_DIGITS, SaffuError, SaffuWarning, atomic_open, atomic_write_json, file_fingerprint
from saffu.configs import PrepareConfig
from saffu.data import tokenizer as tok
from saffu.data.corpus import Corpus, ReadStats, check_not_empty, iter_documents

META_VERSION = 2


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

    @property
    def eval_splits(self) -> list[str]:
        """Every split but the training split, in the order they were prepared."""
        return [split for split in self.meta["splits"] if split != self.train_split]

    def tokens(self, split: str) -> np.ndarray:
        """The token stream of ``split`` as a read-only memory map, ``uint16|uint32[N]``."""
        if split not in self.meta["splits"]:
            have = ", ".join(self.meta["splits"])
            raise SaffuError(f"work directory {self.path} has no split {split!r} "
                             f"(it has: {have}); prepare it from a corpus that has that split")
        info = self.meta["splits"][split]
        return np.memmap(self.path / "tokens" / f"{split}.bin", dtype=self.meta["dtype"],
                         mode="r", shape=(info["tokens"],))

    @functools.cached_property
    def fingerprint(self) -> dict[str, str]:
        """What a run made from this work directory depends on, by content:
        ``{"tokenizer": sha256 of tokenizer.json, "streams": sha256 of every split's name,
        dtype and tokens}`` (hex prefixes). Re-preparing the same corpus gives the same
        fingerprint; another tokenizer of the same size, or other text, does not."""
        digest = hashlib.sha256()
        for split in sorted(self.meta["splits"]):
            digest.update(f"{split}|{self.meta['dtype']}|".encode())
            digest.update(np.ascontiguousarray(self.tokens(split)).tobytes())
        tokenizer = self.path / "tokenizer.json"
        return {"tokenizer": file_fingerprint(tokenizer) if tokenizer.exists() or "id_map" not in self.meta
                else "none", "streams": digest.hexdigest()[:FINGERPRINT_DIGITS]}

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

    def sample_documents(self, split: str, tokens: int, seed: int = 0) -> tuple[list[tuple[int, int]], dict]:
        """Whole documents of ``split`` totalling about ``tokens`` predicted tokens, drawn from
        :data:`SUBSET_BLOCKS` evenly spaced blocks of the stream as :func:`subset_workdir` draws
        them (so every source file of a split is represented, not only the first).

        Returns the target ranges ``[(begin, end), …]`` (stream positions, each a run of whole
        documents with their closing ``<eod>``; the ``<eod>`` before ``begin`` is context) and
        their exact counts, like :meth:`split_info`: ``documents``, ``predicted_tokens``,
        ``bytes``, ``words``, ``replaced_bytes``. Asking for the whole split or more returns
        ``[(1, len(stream))]`` and the stored counts.
        """
        info = self.split_info(split)
        stream = self.tokens(split)
        if tokens >= info["predicted_tokens"]:
            return [(1, len(stream))], dict(info)
        stream = np.asarray(stream)
        first, last = _document_bounds(stream, self, split)
        lengths = last - first + 1                        # a document's tokens and its closing <eod>
        ranges = _select_documents(lengths, tokens, seed)
        chosen = np.concatenate([np.arange(a, b) for a, b in ranges])
        per_doc = _cached_text_counts(self, split, stream, first, last)
        counts = {"documents": len(chosen), "predicted_tokens": int(lengths[chosen].sum()),
                  **{key: int(values[chosen].sum()) for key, values in per_doc.items()}}
        return [(int(first[a]), int(last[b - 1]) + 1) for a, b in ranges], counts


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
    num_tokens = 0
    longest = 0
    with atomic_open(out) as handle:
        handle.write(np.asarray([tok.EOD_ID], dtype=dtype).tobytes())
        num_tokens += 1
        for batch in tok.encode_batches(tokenizer, _read_with_progress(files, desc, show_progress, stats)):
            flat = []
            for ids in batch:
                flat.extend(ids)
                flat.append(tok.EOD_ID)
                longest = max(longest, len(ids))
            handle.write(np.asarray(flat, dtype=dtype).tobytes())
            num_tokens += len(flat)
    return {"tokens": num_tokens, "predicted_tokens": num_tokens - 1,
            "documents": stats.documents, "bytes": stats.bytes, "words": stats.words,
            "replaced_bytes": stats.replaced_bytes, "longest_document": longest}


def _read_with_progress(files, desc: str, show_progress: bool, stats: ReadStats | None = None):
    """:func:`saffu.data.corpus.iter_documents` (counting into ``stats``) with a bytes progress bar."""
    stats = stats if stats is not None else ReadStats()
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc=desc, leave=False,
              disable=not show_progress) as bar:
        for document in iter_documents(files, stats):
            yield document
            bar.update(stats.bytes - bar.n)


def _check_mostly_text(split: str, files, info: dict[str, int], config: PrepareConfig) -> None:
    """Warn (or, with ``config.strict``, refuse) when more than ``config.max_replaced_share`` of
    a split's bytes are invalid UTF-8: such a file is most likely not text."""
    share = info["replaced_bytes"] / max(info["bytes"], 1)
    if share <= config.max_replaced_share:
        return
    names = ", ".join(str(f) for f in files[:3]) + (", …" if len(files) > 3 else "")
    message = (f"{share:.0%} of split {split!r} ({names}) is invalid UTF-8, read as U+FFFD: is it a text file? "
               f"Pass plain UTF-8 text, one document per line")
    if config.strict:
        raise SaffuError(message)
    warnings.warn(message + " (--strict makes this an error)", SaffuWarning, stacklevel=2)


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

    bpe = tok.train_bpe(_read_with_progress(train_files, "read for BPE", show_progress), config.vocab_size,
                        config.min_frequency, show_progress=False)
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
        _check_mostly_text(split, corpus.files(split), splits[split], config)
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


#: Evenly spaced blocks a subset's documents are drawn from (fewer for splits of few documents).
SUBSET_BLOCKS = 64


def subset_workdir(source: WorkDir, path: str | Path, *, train_tokens: int | None = None,
                   train_fraction: float | None = None, dev_tokens: int | None = None,
                   train_documents: list[tuple[int, int]] | None = None,
                   seed: int = 0, show_progress: bool = False) -> WorkDir:
    """A smaller work directory whose splits hold whole documents of ``source``'s.

    The training split keeps about ``train_tokens`` stream tokens (or ``train_fraction`` of
    them; neither: all of it), the ``dev`` split about ``dev_tokens`` (``None``: copied
    unchanged, as is every other split). The documents are taken in :data:`SUBSET_BLOCKS`
    evenly spaced blocks of the stream — per block a contiguous run of whole documents at a
    seeded offset, sized so the running total tracks the requested share — so every part of
    the stream is represented (BabyLM concatenates its sources in file order, so a prefix
    would hold only the first source) and local document order is kept; the subset lists
    its documents in source order, in the same stream format (``<eod> doc <eod> doc … <eod>``).

    Every count in ``meta.json`` is exact for the subset: tokens, predicted tokens, documents,
    longest document and the training token counts from the streams; bytes and words per
    document by decoding it with the work directory's byte-level BPE (checked first against
    the source totals over the whole split), or, when decoding does not reproduce them (the
    split had invalid UTF-8, read as U+FFFD), by re-reading the corpus files recorded in the
    source's ``meta.json``. Token ids keep the source tokenizer's frequency ranking.
    ``meta["subset"]`` records the source (path and a hash of its ``meta.json``), the
    request, the seed and the selected document ranges. If ``path`` already holds the same
    subset of the same source, it is opened and returned without rewriting.

    Args:
      source: the work directory to subset (opened by :func:`open_workdir`).
      path: the new work directory (must not be ``source``'s).
      train_tokens: target size of the training stream in tokens (``2 ≤ n ≤`` the source's).
      train_fraction: share of the source's training tokens in ``(0, 1]``.
      dev_tokens: target size of the ``dev`` stream in tokens.
      train_documents: instead of a size, the training documents to keep, as sorted,
        disjoint index ranges ``[a, b)`` (e.g. the folds of :mod:`saffu.data.folds`).
      seed: seed of the offsets of the runs within their blocks.
      show_progress: progress bars while counting.

    Returns the opened :class:`WorkDir`. Raises SaffuError for bad arguments.
    """
    start = time.perf_counter()
    path = Path(path)
    if sum(x is not None for x in (train_tokens, train_fraction, train_documents)) > 1:
        raise SaffuError("give one of train_tokens, train_fraction and train_documents, not both")
    if train_fraction is not None and not 0.0 < float(train_fraction) <= 1.0:
        raise SaffuError(f"train_fraction {train_fraction} must be in (0, 1]")
    if train_tokens is None and train_fraction is None and dev_tokens is None and train_documents is None:
        raise SaffuError("nothing to subset: give train_tokens, train_fraction, train_documents or dev_tokens")
    if path.resolve() == Path(source.path).resolve():
        raise SaffuError(f"the subset must go to a new directory, not the source {source.path}")
    train = source.train_split
    wanted: dict[str, int] = {}
    if train_tokens is not None:
        wanted[train] = _check_tokens(source, train, train_tokens, "train_tokens")
    elif train_fraction is not None:
        wanted[train] = max(2, int(round(float(train_fraction) * source.split_info(train)["tokens"])))
    elif train_documents is not None:
        train_documents = [(int(a), int(b)) for a, b in train_documents]
        documents = source.split_info(train)["documents"]
        if not train_documents or any(not 0 <= a < b <= documents for a, b in train_documents) or any(
                b > a for (_, b), (a, _) in zip(train_documents, train_documents[1:])):
            raise SaffuError(f"train_documents must be sorted, disjoint, non-empty ranges within the "
                             f"{documents:,} training documents")
        wanted[train] = sum(b - a for a, b in train_documents)
    if dev_tokens is not None:
        if train == "dev":
            raise SaffuError("dev is the training split here; use train_tokens instead of dev_tokens")
        wanted["dev"] = _check_tokens(source, "dev", dev_tokens, "dev_tokens")

    request = {"source": str(Path(source.path).resolve()),
               "source_meta_sha256": hashlib.sha256((Path(source.path) / "meta.json").read_bytes()).hexdigest(),
               "train_tokens": train_tokens, "train_fraction": train_fraction, "dev_tokens": dev_tokens,
               **({"train_documents": [list(r) for r in train_documents]} if train_documents is not None else {}),
               "seed": int(seed), "method": f"evenly spaced blocks (at most {SUBSET_BLOCKS})"}
    if (path / "meta.json").is_file():
        try:
            existing = open_workdir(path)
        except SaffuError:
            existing = None
        if existing is not None and existing.meta.get("subset", {}).get("request") == request:
            return existing

    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").unlink(missing_ok=True)
    shutil.rmtree(path / "tokens", ignore_errors=True)
    (path / "tokens").mkdir()
    shutil.copyfile(Path(source.path) / "tokenizer.json", path / "tokenizer.json")
    dtype = np.dtype(source.meta["dtype"])
    splits, selected, counts_from = {}, {}, {}
    train_counts = source.token_counts()
    for split, info in source.meta["splits"].items():
        out = path / "tokens" / f"{split}.bin"
        if split not in wanted:
            shutil.copyfile(Path(source.path) / "tokens" / f"{split}.bin", out)
            splits[split] = dict(info)
            continue
        stream = np.asarray(source.tokens(split))
        first, last = _document_bounds(stream, source, split)     # doc i: stream[first[i]:last[i]], then <eod>
        lengths = last - first + 1                                 # its tokens and its closing <eod>
        ranges = (train_documents if split == train and train_documents is not None
                  else _select_documents(lengths, wanted[split] - 1, seed))
        pieces = [stream[:1]] + [stream[first[a]:last[b - 1] + 1] for a, b in ranges]
        subset = np.concatenate(pieces).astype(dtype)
        with atomic_open(out) as handle:
            handle.write(subset.tobytes())
        chosen = np.concatenate([np.arange(a, b) for a, b in ranges])
        per_doc, counts_from[split] = _document_text_counts(source, split, stream, first, last, show_progress)
        splits[split] = {"tokens": int(len(subset)), "predicted_tokens": int(len(subset) - 1),
                         "documents": int(len(chosen)), "longest_document": int((lengths[chosen] - 1).max()),
                         **{key: int(values[chosen].sum()) for key, values in per_doc.items()}}
        selected[split] = [[int(a), int(b)] for a, b in ranges]
        if split == train:
            train_counts = np.bincount(subset, minlength=source.vocab_size).astype(np.int64)
            train_counts[tok.EOD_ID] -= 1                           # the opening <eod> closes no document
    meta = dict(source.meta)
    meta.update(splits=splits, train_token_counts=train_counts.tolist(), seconds=time.perf_counter() - start,
                subset={"request": request, "source_splits": {s: dict(source.meta["splits"][s]) for s in wanted},
                        "documents": selected, "counts_from": counts_from})
    atomic_write_json(path / "meta.json", meta)
    return open_workdir(path)


def _check_tokens(source: WorkDir, split: str, tokens, name: str) -> int:
    if split not in source.meta["splits"]:
        raise SaffuError(f"{name}: work directory {source.path} has no split {split!r}")
    available = source.split_info(split)["tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 2:
        raise SaffuError(f"{name} must be an integer ≥ 2 (the opening <eod> and one more token); got {tokens!r}")
    if tokens > available:
        raise SaffuError(f"{name} {tokens:,} is more than the {available:,} tokens of {split} in {source.path}; "
                         f"ask for {available:,} or fewer")
    return int(tokens)


def _document_bounds(stream: np.ndarray, source: WorkDir, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Token positions of every document of a stream: ``first int64[N]`` (its first token) and
    ``last int64[N]`` (its closing ``<eod>``), so document ``i`` is ``stream[first[i]:last[i]]``."""
    eods = np.flatnonzero(stream == tok.EOD_ID)
    if len(stream) == 0 or stream[0] != tok.EOD_ID or stream[-1] != tok.EOD_ID:
        raise SaffuError(f"{split} of {source.path} does not start and end with <eod>; run `saffu prepare` again")
    if len(eods) - 1 != source.split_info(split)["documents"]:
        raise SaffuError(f"{split} of {source.path} has {len(eods) - 1} documents, meta.json says "
                         f"{source.split_info(split)['documents']}; run `saffu prepare` again")
    return eods[:-1] + 1, eods[1:]


def _select_documents(lengths: np.ndarray, want: int, seed: int) -> list[tuple[int, int]]:
    """Whole documents totalling about ``want`` tokens: per block of the stream (blocks of equal
    tokens), a contiguous run starting at a seeded offset whose size keeps the running total
    within half a document of the pro-rata quota. Returns sorted, disjoint ``[start, stop)``
    document-index ranges (merged where adjacent)."""
    rng = np.random.default_rng(seed)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)                                    # token end of every document
    starts = ends - lengths
    num_blocks = max(1, min(SUBSET_BLOCKS, len(lengths)))
    block_of = np.minimum(starts * num_blocks // total, num_blocks - 1)
    chosen = np.zeros(len(lengths), bool)
    taken = 0
    for block in range(num_blocks):
        docs = np.flatnonzero(block_of == block)
        if len(docs) == 0:
            continue
        quota = int(round(want * int(ends[docs[-1]]) / total)) - taken   # running pro-rata share
        block_tokens = int(ends[docs[-1]] - starts[docs[0]])
        offset = int(rng.integers(0, max(block_tokens - quota, 0) + 1))
        first = int(np.searchsorted(starts[docs] - starts[docs[0]], offset))
        run = 0
        for i in np.roll(docs, -first):                          # contiguous, wrapping within the block
            if 2 * (run + lengths[i]) > 2 * quota + lengths[i]:  # adding it would overshoot by more than half
                break
            chosen[i] = True
            run += int(lengths[i])
        taken += run
    if not chosen.any():                                         # fewer tokens asked than any one document
        chosen[int(np.argmin(np.abs(lengths - want)))] = True
    edges = np.diff(np.concatenate([[0], chosen.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


#: Per-document text counts of recently sampled splits, keyed by the token file's path, size and
#: modification time (a split prepared again is counted again): a process that samples a split
#: again (every evaluation of a training run, a benchmark's second pass) decodes it once.
_TEXT_COUNTS: dict[tuple, dict[str, np.ndarray]] = {}


def _cached_text_counts(source: WorkDir, split: str, stream: np.ndarray, first: np.ndarray,
                        last: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`_document_text_counts` of ``split`` (its per-document arrays, read-only), computed
    once per process and token file (the last four splits are kept)."""
    file = (source.path / "tokens" / f"{split}.bin").resolve()
    status = file.stat()
    key = (str(file), status.st_size, status.st_mtime_ns)
    if key not in _TEXT_COUNTS:
        counts, _ = _document_text_counts(source, split, stream, first, last, show_progress=False)
        for values in counts.values():
            values.flags.writeable = False
        while len(_TEXT_COUNTS) >= 4:
            del _TEXT_COUNTS[next(iter(_TEXT_COUNTS))]
        _TEXT_COUNTS[key] = counts
    return _TEXT_COUNTS[key]


def _document_text_counts(source: WorkDir, split: str, stream: np.ndarray, first: np.ndarray,
                          last: np.ndarray, show_progress: bool) -> tuple[dict[str, np.ndarray], str]:
    """Per document of ``split``: ``bytes`` (UTF-8 plus a newline), ``words`` (plus an
    end-of-document) and ``replaced_bytes``, each ``int64[N]``, exactly as :func:`prepare`
    counted them, and where they came from. Decoding reproduces them when the split had no
    invalid UTF-8 (checked against the totals); otherwise the corpus files are read again."""
    info = source.split_info(split)
    n = len(first)
    counts = {key: np.zeros(n, np.int64) for key in ("bytes", "words", "replaced_bytes")}
    if "id_map" in source.meta:             # written from the user's token ids: no text is known
        return counts, "not known (token ids without text)"
    tokenizer = source.tokenizer()
    step = 4096
    for lo in tqdm(range(0, n, step), desc=f"decode {split}", leave=False, disable=not show_progress):
        texts = tokenizer.decode_batch([stream[a:b].tolist() for a, b in zip(first[lo:lo + step],
                                                                                last[lo:lo + step])])
        counts["bytes"][lo:lo + len(texts)] = [len(t.encode("utf-8")) + 1 for t in texts]
        counts["words"][lo:lo + len(texts)] = [len(t.split()) + 1 for t in texts]
    if (info["replaced_bytes"] == 0 and counts["bytes"].sum() == info["bytes"]
            and counts["words"].sum() == info["words"]):
        return counts, "decoded tokens"
    # Invalid UTF-8 was read as U+FFFD, so decoding cannot give back the raw byte counts:
    # read the documents again from the corpus files, as prepare did.
    files = [Path(f) for f in source.meta.get("files", {}).get(split, [])]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise SaffuError(f"the byte counts of {split} in {source.path} cannot be rebuilt by decoding (it had "
                         f"invalid UTF-8) and its corpus files are not readable from here "
                         f"({', '.join(missing) or 'none recorded'}); run from the directory `saffu prepare` "
                         f"ran in")
    stats = ReadStats()
    rows: list[tuple[int, int, int]] = []
    previous = (0, 0, 0)
    for _ in iter_documents(files, stats):
        current = (stats.bytes, stats.words, stats.replaced_bytes)
        rows.append(tuple(c - p for c, p in zip(current, previous)))
        previous = current
    table = np.asarray(rows, np.int64).reshape(-1, 3)
    if (len(table) != n or table[:, 0].sum() != info["bytes"] or table[:, 1].sum() != info["words"]
            or table[:, 2].sum() != info["replaced_bytes"]):
        raise SaffuError(f"the corpus files of {split} ({', '.join(map(str, files[:2]))}…) no longer match "
                         f"{source.path}/meta.json; run `saffu prepare` again")
    return ({"bytes": table[:, 0], "words": table[:, 1], "replaced_bytes": table[:, 2]},
            "corpus files (decoding cannot restore invalid UTF-8)")
