"""The explicit solution from the user's own tokens: no re-tokenising through ``saffu prepare``.

:class:`TokenSource` holds the user's training documents — a flat token stream whose
documents are separated by ``eod_id``, an iterable of token arrays, or an iterable of texts with
a tokenizer (a ``tokenizers.Tokenizer``, the path of its JSON file, or any callable
``str -> list[int]``). :func:`workdir_from_tokens` writes it as a saffu work directory, so every
solver reads it as it reads a prepared corpus; the ids are only renumbered on the way in (the
user's boundary token becomes saffu's ``<eod>`` = 1 and the user's padding token — or, without
one, the rarest token — saffu's ``<pad>`` = 0, by two swaps) and back on the way out
(:meth:`TokenSource.to_user`), so every piece is indexed by the user's own ids.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from saffu._io import SaffuError, atomic_write_json, exclusive
from saffu.configs import FactorConfig, FactorisedConfig
from saffu.data import tokenizer as tok
from saffu.data.workdir import META_VERSION, WorkDir, open_workdir
from saffu.interop.pieces import ExplicitPieces


@dataclasses.dataclass
class TokenSource:
    """The user's training documents and how their ids map onto saffu's.

    Attributes:
      documents: a 1-D integer array (documents separated by ``eod_id``), an iterable of
        integer sequences (one per document), or an iterable of ``str`` (with ``tokenizer``).
      vocab_size: ``V`` of the user's tokenizer (every id must be below it).
      eod_id: the user's document-boundary token (e.g. GPT-2's ``<|endoftext|>``, 50256).
      pad_id: the user's padding token; ``None``: the rarest token of the documents stands in
        for "before the document" (its few occurrences as context are then merged with it).
      tokenizer: what turns texts into ids (``tokenizers.Tokenizer``, its JSON path, or a
        callable); also fingerprinted into the manifest when it is a ``tokenizers`` one.
      name: the corpus name written to the manifest.
    """

    documents: Any
    vocab_size: int
    eod_id: int
    pad_id: int | None = None
    tokenizer: Any = None
    name: str = "user-tokens"

    def __post_init__(self):
        if not 0 <= self.eod_id < self.vocab_size:
            raise SaffuError(f"eod_id {self.eod_id} is not a token id of a vocabulary of {self.vocab_size:,}")
        if self.pad_id is not None and not (0 <= self.pad_id < self.vocab_size and self.pad_id != self.eod_id):
            raise SaffuError(f"pad_id {self.pad_id} must be a token id other than eod_id {self.eod_id}")
        self._map: np.ndarray | None = None

    def _encoder(self) -> Callable[[str], list[int]]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise SaffuError("the documents are texts: give a tokenizer (a tokenizers.Tokenizer, its JSON path "
                             "or a callable str -> ids)")
        if isinstance(tokenizer, (str, Path)):
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(tokenizer))
        if hasattr(tokenizer, "encode") and hasattr(tokenizer, "token_to_id"):      # a tokenizers.Tokenizer
            return lambda text: tokenizer.encode(text).ids
        if callable(tokenizer):
            return tokenizer
        raise SaffuError(f"a tokenizer must be a tokenizers.Tokenizer, its JSON path or a callable, "
                         f"not {type(tokenizer).__name__}")

    def stream(self) -> np.ndarray:
        """The user's ids as one stream ``<eod> doc_1 <eod> doc_2 <eod> …``, ``int64[N]``."""
        docs = self.documents
        if isinstance(docs, np.ndarray) or (hasattr(docs, "shape") and hasattr(docs, "dtype")):
            flat = np.asarray(docs).reshape(-1).astype(np.int64)
            if not np.issubdtype(np.asarray(docs).dtype, np.integer):
                raise SaffuError(f"a token stream must hold integer ids, not {np.asarray(docs).dtype}")
            parts = [np.asarray([self.eod_id]), flat] + ([] if len(flat) and flat[-1] == self.eod_id
                                                         else [np.asarray([self.eod_id])])
            stream = np.concatenate(parts)
            if len(flat) and flat[0] == self.eod_id:
                stream = stream[1:]
        else:
            encode = None
            parts = [np.asarray([self.eod_id])]
            for doc in docs:
                if isinstance(doc, str):
                    encode = encode or self._encoder()
                    doc = encode(doc)
                ids = np.asarray(doc, np.int64).reshape(-1)
                if len(ids):
                    parts += [ids, np.asarray([self.eod_id])]
            stream = np.concatenate(parts)
        if len(stream) < 3:
            raise SaffuError("the documents hold no tokens")
        low, high = int(stream.min()), int(stream.max())
        if low < 0 or high >= self.vocab_size:
            raise SaffuError(f"token id {low if low < 0 else high} is outside the vocabulary of {self.vocab_size:,}")
        return stream

    def id_map(self, stream: np.ndarray | None = None) -> np.ndarray:
        """``int64[V]``: the saffu id of every user id (two swaps: the user's eod with ``<eod>``,
        then the user's pad with ``<pad>``). Made from ``stream`` (:meth:`stream`, which picks
        the rarest token when there is no ``pad_id``) the first time, then kept."""
        if self._map is None:
            if stream is None:
                raise SaffuError("the id map is made when the documents are written (workdir_from_tokens)")
            pad = self.pad_id
            if pad is None:
                counts = np.bincount(stream, minlength=self.vocab_size)
                counts[self.eod_id] = np.iinfo(np.int64).max
                pad = int(np.flatnonzero(counts == counts.min())[-1])
            perm = np.arange(self.vocab_size)            # perm[saffu id] = user id
            for user, ours in ((self.eod_id, tok.EOD_ID), (pad, tok.PAD_ID)):
                i = int(np.flatnonzero(perm == user)[0])
                perm[[i, ours]] = perm[[ours, i]]
            self._map = np.empty_like(perm)
            self._map[perm] = np.arange(self.vocab_size)
            self._pad = pad
        return self._map

    def to_user(self, rows: np.ndarray, axis: int = 0) -> np.ndarray:
        """A ``V``-long axis indexed by saffu ids re-indexed by the user's ids."""
        return np.take(rows, self.id_map(), axis=axis)


def workdir_from_tokens(source: TokenSource, out: str | Path) -> WorkDir:
    """Write ``source``'s documents as the training split of a work directory at ``out``
    (saffu ids, see the module docstring; ``meta["id_map"]`` holds the user's ``eod``/``pad``).
    Bytes and words are not known from ids, so bits-per-byte figures need a prepared corpus."""
    out = Path(out)
    with exclusive(out, "workdir_from_tokens"):
        stream = source.stream()
        mapping = source.id_map(stream)
        ours = mapping[stream]
        dtype = np.dtype(np.uint16 if source.vocab_size <= 1 << 16 else np.uint32)
        (out / "meta.json").unlink(missing_ok=True)
        shutil.rmtree(out / "tokens", ignore_errors=True)
        (out / "tokens").mkdir(parents=True)
        ours.astype(dtype).tofile(out / "tokens" / "train.bin")
        eods = np.flatnonzero(ours == tok.EOD_ID)
        counts = np.bincount(ours[1:], minlength=source.vocab_size)
        tokenizer = source.tokenizer
        if isinstance(tokenizer, (str, Path)):
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        elif hasattr(tokenizer, "to_str") and hasattr(tokenizer, "token_to_id"):
            (out / "tokenizer.json").write_text(tokenizer.to_str())
        info = {"tokens": len(ours), "predicted_tokens": int(len(ours) - 1), "documents": int(len(eods) - 1),
                "bytes": 0, "words": 0, "replaced_bytes": 0, "longest_document": int(np.diff(eods).max() - 1)}
        atomic_write_json(out / "meta.json", {
            "version": META_VERSION, "corpus": source.name, "vocab_size": source.vocab_size,
            "requested_vocab_size": source.vocab_size, "dtype": dtype.name, "train_split": "train",
            "pad_id": tok.PAD_ID, "eod_id": tok.EOD_ID, "splits": {"train": info},
            "train_token_counts": counts.tolist(), "files": {"train": []},
            "id_map": {"user_eod_id": source.eod_id, "user_pad_id": source._pad, "pad_given": source.pad_id is not None},
        })
    return open_workdir(out)


def solve_pieces(source, rank: int, solver: FactorConfig | None = None, progress: bool = True) -> ExplicitPieces:
    """:class:`ExplicitPieces` of rank ``rank`` from ``source``: a work directory (or its path)
    or a :class:`TokenSource` (written to a temporary work directory first, ids mapped back).

    The factors are :func:`saffu.solve.factors.solve_factorised` of one offset (the current
    token → the next), with ``solver.holdout_tokens`` of whole documents held out to calibrate
    them (at most a tenth of a small training split)."""
    from saffu.solve.factors import solve_factorised
    solver = solver or FactorConfig()
    if isinstance(source, TokenSource):
        with tempfile.TemporaryDirectory(prefix="saffu-tokens-") as tmp:
            workdir = workdir_from_tokens(source, tmp)
            pieces = _solve(workdir, rank, solver, progress, solve_factorised)
            mapped = {"embedding": source.to_user(pieces.embedding, 0), "output": source.to_user(pieces.output, 1),
                      "bias": source.to_user(pieces.bias, 0), "counts": source.to_user(pieces.counts, 0)}
            return ExplicitPieces(**mapped, manifest={**pieces.manifest, "id_map": workdir.meta["id_map"]})
    workdir = source if isinstance(source, WorkDir) else open_workdir(source)
    return _solve(workdir, rank, solver, progress, solve_factorised)


def _solve(workdir: WorkDir, rank: int, solver: FactorConfig, progress: bool, solve_factorised) -> ExplicitPieces:
    solver = _capped_holdout(solver, workdir)
    config = FactorisedConfig(workdir.vocab_size, rank=rank, positions=1)
    factors, report = solve_factorised(workdir, config, solver, progress=progress)
    from saffu.solve.exact import held_out_prior
    _, _, _, prior, counted = held_out_prior(workdir, workdir.vocab_size, solver.holdout_tokens, solver.chunk_size, False)
    counts = _counted_targets(prior, counted["counted_tokens"])
    manifest = {"corpus": workdir.meta.get("corpus"), "vocab_size": workdir.vocab_size, "rank": rank,
                "workdir_fingerprint": workdir.fingerprint, "solver": dataclasses.asdict(solver),
                "counted_tokens": report.get("counted_tokens"), "holdout_tokens": report.get("holdout_tokens"),
                "holdout_loss": report.get("holdout_loss"), "seconds": report.get("seconds")}
    json.dumps(manifest)  # plain data only
    return ExplicitPieces(embedding=np.asarray(factors["embeddings"][0], np.float32),
                          output=np.asarray(factors["output_weights"], np.float32),
                          bias=np.asarray(factors["output_bias"], np.float32), counts=counts, manifest=manifest)


def _capped_holdout(config, workdir: WorkDir):
    """``config`` (a :class:`FactorConfig` or :class:`ExactConfig`) holding out at most a tenth
    of ``workdir``'s training targets for calibration."""
    most = workdir.split_info(workdir.train_split)["predicted_tokens"] // 10
    return dataclasses.replace(config, holdout_tokens=most) if config.holdout_tokens > most else config


def _counted_targets(prior, counted: int) -> np.ndarray:
    """The ``int64[V]`` target counts behind an add-one unigram ``(n_y + 1) / (n + V)`` of
    ``n = counted`` targets (float64: exact far past any corpus size)."""
    p = np.asarray(prior, np.float64)
    return np.rint(p * (counted + p.shape[0])).astype(np.int64) - 1


def solve_exact_tables(source: TokenSource, config=None, progress: bool = True):
    """The exact model (:func:`saffu.solve.exact.solve_exact`) of ``source``'s documents, for
    :class:`saffu.interop.residual.ExplicitResidual`. Returns ``(ExactConfig, tables, id_map
    int64[V])``: the tables use saffu's ids, ``id_map`` takes the user's ids there."""
    from saffu.configs import ExactConfig
    from saffu.solve.exact import solve_exact
    config = config or ExactConfig(source.vocab_size)
    if config.vocab_size != source.vocab_size:
        raise SaffuError(f"the exact model's vocabulary {config.vocab_size:,} differs from the documents' "
                         f"{source.vocab_size:,}")
    with tempfile.TemporaryDirectory(prefix="saffu-tokens-") as tmp:
        workdir = workdir_from_tokens(source, tmp)
        config = _capped_holdout(config, workdir)
        tables, _ = solve_exact(workdir, config, progress=progress)
        tables = jax.tree.map(np.asarray, tables)
    return config, tables, source.id_map()
