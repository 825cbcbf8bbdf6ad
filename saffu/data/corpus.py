"""Corpora: the BabyLM directory layout, plain text files, and documents read from them.

A corpus is a mapping from split name to a list of text files. Every line of a file is one
document (BabyLM stores one text segment per line); the tokenizer turns each document
boundary into an end-of-document token. Bytes that are not valid UTF-8 are replaced by
U+FFFD and counted, never fatal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from saffu._io import SaffuError

#: BabyLM split name -> (sub-folder, file suffix).
BABYLM_SPLITS: dict[str, tuple[str, str]] = {
    "train_10M": ("train_10M", ".train"),
    "train_100M": ("train_100M", ".train"),
    "dev": ("dev", ".dev"),
    "test": ("test", ".test"),
}

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A named set of splits, each a tuple of text files (one document per line).

    Attributes:
      name: a label for reports (for example ``babylm-2023-4src``).
      splits: split name -> files, in a fixed (sorted) order so token streams are
        reproducible.
    """

    name: str
    splits: dict[str, tuple[Path, ...]]

    def files(self, split: str) -> tuple[Path, ...]:
        """The files of ``split``; a clear error when the corpus has no such split."""
        if split not in self.splits:
            have = ", ".join(sorted(self.splits)) or "none"
            raise SaffuError(
                f"corpus {self.name!r} has no split {split!r} (it has: {have}); "
                f"choose one of those")
        return self.splits[split]


@dataclasses.dataclass
class ReadStats:
    """Counts gathered while reading a split (mutable, filled by :func:`iter_documents`).

    ``bytes`` counts the raw UTF-8 bytes of every document plus one newline per document,
    the denominator of bits per byte; ``words`` counts whitespace-separated words plus one
    end-of-document per document, the denominator of per-word perplexity.
    """

    documents: int = 0
    bytes: int = 0
    words: int = 0
    replaced_bytes: int = 0


def babylm_corpus(root: str | Path, name: str | None = None) -> Corpus:
    """The BabyLM layout: ``<root>/train_10M/*.train``, ``train_100M/*.train``,
    ``dev/*.dev`` and ``test/*.test``; splits whose folder is absent are left out.

    Raises SaffuError when ``root`` is missing or holds none of those folders, or when a
    present split folder has no files of its kind.
    """
    root = Path(root)
    if not root.is_dir():
        raise SaffuError(
            f"corpus folder {root} does not exist; pass the folder that holds train_10M/ "
            f"and dev/ (for example ../shared/data/babylm/2023)")
    splits = {}
    for split, (folder, suffix) in BABYLM_SPLITS.items():
        if (root / folder).is_dir():
            files = tuple(sorted((root / folder).glob(f"*{suffix}")))
            if not files:
                raise SaffuError(f"{root / folder} holds no *{suffix} files; add the corpus "
                                 f"files or remove the empty folder")
            splits[split] = files
    if not splits:
        raise SaffuError(
            f"{root} has none of the BabyLM split folders ({', '.join(BABYLM_SPLITS)}); "
            f"point --corpus at the folder that holds them")
    return Corpus(name=name or root.name, splits=splits)


def text_files_corpus(splits: dict[str, Sequence[str | Path]], name: str = "text") -> Corpus:
    """A corpus from explicit lists of plain-text files per split (one document per line)."""
    checked = {}
    for split, files in splits.items():
        paths = tuple(Path(f) for f in files)
        if not paths:
            raise SaffuError(f"split {split!r} has no files; give at least one text file")
        for path in paths:
            if not path.is_file():
                raise SaffuError(f"corpus file {path} does not exist; check the path")
        checked[split] = paths
    return Corpus(name=name, splits=checked)


def iter_documents(files: Sequence[Path], stats: ReadStats | None = None,
                   max_line_bytes: int = 1 << 20) -> Iterator[str]:
    """Yield every line of ``files`` (without its newline) as one document.

    Invalid UTF-8 is decoded with U+FFFD replacements, counted in ``stats.replaced_bytes``
    (a run of invalid bytes that decodes to one U+FFFD counts once). Lines longer than
    ``max_line_bytes`` are split into pieces of at most that size so one runaway line
    cannot exhaust memory.
    """
    stats = stats if stats is not None else ReadStats()
    for path in files:
        try:
            handle = open(path, "rb")   # noqa: SIM115 (closed by the `with` below)
        except OSError as err:
            raise SaffuError(f"cannot read corpus file {path}: {err.strerror}") from None
        with handle:
            for raw in handle:
                raw = raw.rstrip(b"\n").rstrip(b"\r")
                for start in range(0, max(len(raw), 1), max_line_bytes):
                    piece = raw[start:start + max_line_bytes]
                    text = piece.decode("utf-8", errors="replace")
                    if _REPLACEMENT in text:
                        stats.replaced_bytes += (text.count(_REPLACEMENT)
                                                 - piece.count(_REPLACEMENT_UTF8))
                    stats.documents += 1
                    stats.bytes += len(piece) + 1
                    stats.words += len(text.split()) + 1
                    yield text


def check_not_empty(files: Sequence[Path], split: str) -> None:
    """Raise SaffuError if every file of ``split`` is empty or whitespace only."""
    for path in files:
        with open(path, "rb") as handle:
            for raw in handle:
                if raw.strip():
                    return
    raise SaffuError(f"split {split!r} is empty ({', '.join(str(f) for f in files)}); "
                     f"it needs at least one non-empty line of text")
