"""subset_workdir: whole documents from every part of the stream, exact counts, reuse, errors."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import TINY_DEV, TINY_TRAIN

from saffu import PrepareConfig, SaffuError, open_workdir, prepare, text_files_corpus
from saffu._io import SaffuWarning
from saffu.data.corpus import ReadStats, iter_documents
from saffu.data.tokenizer import EOD_ID
from saffu.data.workdir import subset_workdir


def documents(stream) -> list[list[int]]:
    """The documents of a stream ``<eod> d <eod> d … <eod>`` (token lists, empty ones kept)."""
    stream = np.asarray(stream)
    assert stream[0] == EOD_ID and stream[-1] == EOD_ID
    eods = np.flatnonzero(stream == EOD_ID)
    return [stream[a + 1:b].tolist() for a, b in zip(eods[:-1], eods[1:])]


def chosen_indices(sub, split) -> list[int]:
    return [i for a, b in sub.meta["subset"]["documents"][split] for i in range(a, b)]


def expected_counts(lines, docs) -> dict:
    """Counts of the documents ``docs`` (token lists) whose source text lines are ``lines``,
    computed from the text, independently of the subset code."""
    return {"tokens": 1 + sum(len(d) + 1 for d in docs), "predicted_tokens": sum(len(d) + 1 for d in docs),
            "documents": len(docs), "bytes": sum(len(t.encode()) + 1 for t in lines),
            "words": sum(len(t.split()) + 1 for t in lines), "replaced_bytes": 0,
            "longest_document": max(len(d) for d in docs)}


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_fraction_subset_has_whole_documents_in_order_and_exact_counts(tiny_workdir, tmp_path, fraction):
    source_docs = documents(tiny_workdir.tokens("train_10M"))
    assert len(source_docs) == len(TINY_TRAIN)
    sub = subset_workdir(tiny_workdir, tmp_path / "sub", train_fraction=fraction, seed=3)
    assert open_workdir(tmp_path / "sub").meta == sub.meta
    assert sub.meta["version"] == tiny_workdir.meta["version"] and sub.vocab_size == tiny_workdir.vocab_size
    assert (sub.path / "tokenizer.json").read_bytes() == (tiny_workdir.path / "tokenizer.json").read_bytes()

    index = chosen_indices(sub, "train_10M")
    assert index == sorted(set(index))                                  # in source order, no repeats
    docs = documents(sub.tokens("train_10M"))
    assert docs == [source_docs[i] for i in index]                     # whole source documents
    assert sub.split_info("train_10M") == expected_counts([TINY_TRAIN[i] for i in index], docs)
    counts = Counter(t for d in docs for t in d)
    counts[EOD_ID] = len(docs)
    assert sub.token_counts().tolist() == [counts[i] for i in range(sub.vocab_size)]

    total = tiny_workdir.split_info("train_10M")["tokens"]
    longest = tiny_workdir.split_info("train_10M")["longest_document"]
    assert abs(sub.split_info("train_10M")["tokens"] - fraction * total) <= longest + 1
    n = len(source_docs)
    assert min(index) < n // 4 and max(index) >= 3 * n // 4             # both files, start and end
    if fraction == 1.0:
        assert np.array_equal(sub.tokens("train_10M"), tiny_workdir.tokens("train_10M"))
    # dev is copied unchanged; the request is recorded
    assert np.array_equal(sub.tokens("dev"), tiny_workdir.tokens("dev"))
    assert sub.split_info("dev") == tiny_workdir.split_info("dev")
    request = sub.meta["subset"]["request"]
    assert request["source"] == str(tiny_workdir.path.resolve())
    assert request["train_fraction"] == fraction and request["seed"] == 3 and request["train_tokens"] is None


def test_token_target_and_dev_subset(tiny_workdir, tmp_path):
    sub = subset_workdir(tiny_workdir, tmp_path / "sub", train_tokens=500, dev_tokens=60)
    assert abs(sub.split_info("train_10M")["tokens"] - 500) <= tiny_workdir.split_info("train_10M")["longest_document"]
    source_dev = documents(tiny_workdir.tokens("dev"))
    index = chosen_indices(sub, "dev")
    docs = documents(sub.tokens("dev"))
    assert docs == [source_dev[i] for i in index] and index == sorted(set(index))
    assert sub.split_info("dev") == expected_counts([TINY_DEV[i] for i in index], docs)
    assert abs(sub.split_info("dev")["tokens"] - 60) <= tiny_workdir.split_info("dev")["longest_document"]
    # dev only: the training split is copied unchanged
    dev_only = subset_workdir(tiny_workdir, tmp_path / "dev_only", dev_tokens=60)
    assert np.array_equal(dev_only.tokens("train_10M"), tiny_workdir.tokens("train_10M"))
    assert dev_only.meta["train_token_counts"] == tiny_workdir.meta["train_token_counts"]
    assert np.array_equal(dev_only.tokens("dev"), sub.tokens("dev"))


def test_same_subset_is_reused_and_a_new_request_rebuilds(tiny_workdir, tmp_path):
    path = tmp_path / "sub"
    first = subset_workdir(tiny_workdir, path, train_fraction=0.5)
    half_tokens = first.meta["splits"]["train_10M"]["tokens"]
    stamp = (path / "tokens" / "train_10M.bin").stat().st_mtime_ns
    again = subset_workdir(tiny_workdir, path, train_fraction=0.5)
    assert again.meta == first.meta and (path / "tokens" / "train_10M.bin").stat().st_mtime_ns == stamp
    other = subset_workdir(tiny_workdir, path, train_fraction=0.5, seed=1)
    assert other.meta["subset"]["request"]["seed"] == 1
    assert json.loads((path / "meta.json").read_text())["subset"]["request"]["seed"] == 1
    smaller = subset_workdir(tiny_workdir, path, train_fraction=0.25)
    assert smaller.split_info("train_10M")["tokens"] < half_tokens


@pytest.mark.parametrize("kwargs, message", [
    ({"train_fraction": 0.0}, "must be in (0, 1]"),
    ({"train_fraction": -0.5}, "must be in (0, 1]"),
    ({"train_fraction": 1.5}, "must be in (0, 1]"),
    ({"train_fraction": 0.5, "train_tokens": 100}, "not both"),
    ({"train_fraction": 0.5, "train_documents": [(0, 3)]}, "not both"),
    ({"train_documents": [(3, 1)]}, "sorted, disjoint"),
    ({"train_documents": [(0, 4), (2, 6)]}, "sorted, disjoint"),
    ({"train_documents": [(0, 10**6)]}, "sorted, disjoint"),
    ({"train_tokens": 10**9}, "more than the"),
    ({"train_tokens": 1}, "integer ≥ 2"),
    ({"train_tokens": 100.5}, "integer ≥ 2"),
    ({"dev_tokens": 10**9}, "more than the"),
    ({}, "nothing to subset"),
])
def test_bad_arguments(tiny_workdir, tmp_path, kwargs, message):
    """(Also ``train_documents``, the cross-fitting folds' way in.)"""
    with pytest.raises(SaffuError, match=message.replace("(", r"\(").replace(")", r"\)")):
        subset_workdir(tiny_workdir, tmp_path / "sub", **kwargs)
    assert not (tmp_path / "sub" / "meta.json").exists()


def test_subset_into_the_source_is_refused(tiny_workdir):
    with pytest.raises(SaffuError, match="new directory"):
        subset_workdir(tiny_workdir, tiny_workdir.path, train_fraction=0.5)


def test_invalid_utf8_counts_come_from_the_corpus_files(tmp_path):
    """Decoding cannot give back invalid bytes (read as U+FFFD), so the counts are re-read."""
    lines = [b"caf\xe9 ok", b"\xff\xfe end \xef\xbf\xbd", b"plain words here", b"", b"more plain text"] * 12
    path = tmp_path / "bad.train"
    path.write_bytes(b"\n".join(lines) + b"\n")
    corpus = text_files_corpus({"train_10M": [path], "dev": [path]})
    with pytest.warns(SaffuWarning, match="invalid UTF-8"):
        source = prepare(corpus, tmp_path / "w", PrepareConfig(vocab_size=270, allow_smaller_vocab=True),
                         show_progress=False)
    assert source.split_info("train_10M")["replaced_bytes"] > 0
    whole = subset_workdir(source, tmp_path / "whole", train_fraction=1.0)
    assert whole.split_info("train_10M") == source.split_info("train_10M")
    assert whole.meta["subset"]["counts_from"]["train_10M"].startswith("corpus files")
    half = subset_workdir(source, tmp_path / "half", train_fraction=0.5, dev_tokens=100)
    for split in ("train_10M", "dev"):
        index = chosen_indices(half, split)
        per_line = []
        for line in lines:
            single = tmp_path / "line.txt"
            single.write_bytes(line + b"\n")
            stats = ReadStats()
            list(iter_documents([single], stats))
            per_line.append(stats)
        info = half.split_info(split)
        assert info["bytes"] == sum(per_line[i].bytes for i in index)
        assert info["words"] == sum(per_line[i].words for i in index)
        assert info["replaced_bytes"] == sum(per_line[i].replaced_bytes for i in index)
        assert info["documents"] == len(index) == len(documents(half.tokens(split)))
