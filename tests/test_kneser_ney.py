"""Interpolated modified Kneser-Ney: exact counts, the estimator against hand computations and a
plain-Python reference, normalisation, ARPA round trips and kenlm's reading of our ARPA files."""

import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from saffu import SaffuError
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.eval import ngram as kn_eval
from saffu.ngram import arpa
from saffu.ngram import counts as ngram_counts
from saffu.ngram import kneser_ney as kn


def stream_of(documents) -> np.ndarray:
    """``<eod> doc_1 <eod> doc_2 <eod> …`` as ``uint16``."""
    stream = [EOD_ID]
    for doc in documents:
        stream.extend(int(t) for t in doc)
        stream.append(EOD_ID)
    return np.asarray(stream, np.uint16)


def zipf_documents(seed: int, count: int, vocab_size: int, longest: int = 25) -> list[list[int]]:
    """Random documents (some empty) over ids ``2 … V−1`` with Zipf-like frequencies."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab_size - 1)
    weights /= weights.sum()
    return [list(rng.choice(np.arange(2, vocab_size), size=rng.integers(0, longest), p=weights))
            for _ in range(count)]


def reference_counts(stream: np.ndarray, order: int, begin: int = 1, end: int | None = None) -> list[Counter]:
    """Plain loops: ``counts[k−1][(x_1 … x_k)]`` over targets ``[begin, end)``, in-document."""
    end = len(stream) if end is None else end
    counts = [Counter() for _ in range(order)]
    for t in range(begin, end):
        start = max(j for j in range(t) if stream[j] == EOD_ID)       # the document's opening <eod>
        history = [int(x) for x in stream[start:t]] + [int(stream[t])]
        for k in range(1, min(order, len(history)) + 1):
            counts[k - 1][tuple(history[-k:])] += 1
    return counts


class ReferenceKN:
    """Interpolated modified Kneser-Ney from the formulas, with dictionaries (float64)."""

    def __init__(self, documents, order: int, vocab_size: int):
        self.order, self.vocab_size = order, vocab_size
        raw = reference_counts(stream_of(documents), order)
        self.adjusted = []
        for k in range(1, order + 1):
            if k == order:
                self.adjusted.append(dict(raw[k - 1]))
                continue
            extensions = defaultdict(set)
            for gram in raw[k]:
                extensions[gram[1:]].add(gram[0])
            self.adjusted.append({g: (c if k > 1 and g[0] == EOD_ID else len(extensions[g]))
                                  for g, c in raw[k - 1].items()})
        self.discounts = []
        for counts in self.adjusted:
            n = [sum(1 for a in counts.values() if a == j) for j in (1, 2, 3, 4)]
            if min(n[:3]) > 0:
                y = n[0] / (n[0] + 2 * n[1])
                d = [j - (j + 1) * y * n[j] / n[j - 1] for j in (1, 2, 3)]
                self.discounts.append(d if min(d) > 0 else [0.5, 1.0, 1.5])
            else:
                self.discounts.append([0.5, 1.0, 1.5])
        self.by_context = [defaultdict(dict) for _ in range(order)]
        for k, counts in enumerate(self.adjusted, 1):
            for gram, a in counts.items():
                self.by_context[k - 1][gram[:-1]][gram[-1]] = a

    def prob(self, context: tuple, word: int) -> float:
        k = len(context) + 1
        lower = 1.0 / (self.vocab_size - 1) if k == 1 else self.prob(context[1:], word)
        followers = self.by_context[k - 1].get(context)
        if not followers:
            return lower
        d = self.discounts[k - 1]
        total = sum(followers.values())
        gamma = sum(d[min(a, 3) - 1] for a in followers.values()) / total
        a = followers.get(word, 0)
        return (a - d[min(a, 3) - 1] if a else 0.0) / total + gamma * lower

    def log_probs(self, documents) -> list[float]:
        out = []
        for doc in documents:
            history = [EOD_ID] + [int(t) for t in doc]
            for i, word in enumerate([int(t) for t in doc] + [EOD_ID]):
                context = tuple(history[:i + 1][-(self.order - 1):]) if self.order > 1 else ()
                out.append(math.log(self.prob(context, word)))
        return out


# --------------------------------------------------------------------------- counts

@pytest.mark.parametrize("seed, order", [(0, 1), (1, 3), (2, 5)])
def test_counts_are_exact_and_independent_of_chunking(seed, order, monkeypatch):
    documents = zipf_documents(seed, 60, vocab_size=9, longest=12) + [[]]
    stream = stream_of(documents)
    expected = reference_counts(stream, order)
    monkeypatch.setattr(ngram_counts, "_MERGE_ROWS", 40)                     # force merges across chunks
    for chunk_size in (37, 1 << 12):
        tables = ngram_counts.count_ngrams(stream, order, vocab_size=9, chunk_size=chunk_size)
        assert len(tables) == order
        for k, table in enumerate(tables, 1):
            got = {tuple(int(x) for x in row): int(c) for row, c in zip(table.tokens, table.counts)}
            assert got == dict(expected[k - 1])
            assert table.tokens.shape[1] == k and np.all(np.diff(table.keys) > 0)


def test_counts_of_a_target_range_read_context_before_it():
    stream = stream_of(zipf_documents(3, 20, vocab_size=7))
    begin, end = 17, len(stream) - 9
    tables = ngram_counts.count_ngrams(stream, 4, vocab_size=7, begin=begin, end=end, chunk_size=16)
    expected = reference_counts(stream, 4, begin, end)
    for k, table in enumerate(tables, 1):
        assert {tuple(map(int, r)): int(c) for r, c in zip(table.tokens, table.counts)} == dict(expected[k - 1])


def test_bad_streams_are_user_errors():
    with pytest.raises(SaffuError, match="start with <eod>"):
        ngram_counts.count_ngrams(np.asarray([2, 3, EOD_ID], np.uint16), 2)
    with pytest.raises(SaffuError, match="<pad>"):
        ngram_counts.count_ngrams(np.asarray([EOD_ID, 2, PAD_ID, 3, EOD_ID], np.uint16), 2)
    with pytest.raises(SaffuError, match="vocabulary"):
        ngram_counts.count_ngrams(np.asarray([EOD_ID, 2, 9, EOD_ID], np.uint16), 2, vocab_size=5)


# --------------------------------------------------------------------------- estimator

def test_discounts_follow_chen_goodman_and_fall_back():
    # n = (10, 4, 2, 1): Y = 10/18 = 5/9; D1 = 1 − 2·Y·4/10, D2 = 2 − 3·Y·2/4, D3+ = 3 − 4·Y·1/2
    discounts, fallback = kn.modified_kn_discounts([10, 4, 2, 1])
    np.testing.assert_allclose(discounts, [5 / 9, 7 / 6, 17 / 9], rtol=1e-15)
    assert not fallback
    for undefined in ([3, 1, 0, 0], [0, 0, 0, 0], [10, 1, 10, 0]):     # n3 = 0, empty, D2 < 0
        discounts, fallback = kn.modified_kn_discounts(undefined)
        assert fallback and discounts.tolist() == [0.5, 1.0, 1.5]


def test_bigram_by_hand():
    """Documents "a b" and "a" (a = 2, b = 3, V = 4: <pad>, <eod>, a, b).

    Bigrams (highest order, raw counts): <s> a ×2, a b, b </s>, a </s>; count-of-counts
    n = (3, 1, 0, 0) → fallback D = (0.5, 1, 1.5). Unigram continuation counts: a ← {<s>}: 1,
    b ← {a}: 1, </s> ← {a, b}: 2, so n = (2, 1, 0, 0) → fallback too; total 4.
    p1(a) = p1(b) = (1 − 0.5)/4 + γ0/3 and p1(</s>) = (2 − 1)/4 + γ0/3 with γ0 = (0.5·2 + 1·1)/4
    = 1/2: 7/24, 7/24, 10/24.
    Context <s> (a ×2, total 2, γ = 1·1/2): p(a|<s>) = 1/2 + 7/48 = 31/48.
    Context a (b, </s> once each, γ = 0.5·2/2): p(b|a) = 1/4 + 7/48 = 19/48, p(</s>|a) = 22/48.
    Context b (</s> once, γ = 1/2): p(</s>|b) = 1/2 + 5/24 = 17/24, p(a|b) = 7/48.
    """
    model = kn.fit_kneser_ney(stream_of([[2, 3], [2]]), 2, vocab_size=4)
    assert model.fallback == (True, True)
    np.testing.assert_array_equal(model.discounts, [[0.5, 1.0, 1.5]] * 2)
    np.testing.assert_allclose(np.exp(kn.next_token_log_probs(model, [2, 3])[1:]), [17 / 24, 7 / 48, 7 / 48])
    np.testing.assert_allclose(np.exp(kn.next_token_log_probs(model, [EOD_ID])[1:]), [10 / 48, 31 / 48, 7 / 48])
    np.testing.assert_allclose(np.exp(kn.next_token_log_probs(model, [])[1:]), [10 / 24, 7 / 24, 7 / 24])
    scores = kn.log_probs(model, stream_of([[2, 3], [3]]))   # a|<s>, b|a, </s>|b, b|<s>, </s>|b
    np.testing.assert_allclose(np.exp(scores), [31 / 48, 19 / 48, 17 / 24, 7 / 48, 17 / 24], rtol=1e-13)


@pytest.mark.parametrize("order", [2, 3, 5])
def test_model_matches_a_plain_python_reference(order):
    vocab_size = 24
    documents = zipf_documents(4, 320, vocab_size)
    train, held_out = documents[:280], documents[280:] + [[], [vocab_size - 1, vocab_size - 1]]
    model = kn.fit_kneser_ney(stream_of(train), order, vocab_size=vocab_size, chunk_size=512)
    reference = ReferenceKN(train, order, vocab_size)
    assert not any(model.fallback[1:])                   # the discount formula itself is exercised
    np.testing.assert_allclose(model.discounts, reference.discounts, rtol=1e-12)
    got = kn.log_probs(model, stream_of(held_out), chunk_size=512)
    np.testing.assert_allclose(got, reference.log_probs(held_out), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_next_token_distributions_sum_to_one(order):
    vocab_size = 20
    documents = zipf_documents(5, 150, vocab_size)
    model = kn.fit_kneser_ney(stream_of(documents), order, vocab_size=vocab_size, chunk_size=512)
    seen = documents[0] if len(documents[0]) > 4 else next(d for d in documents if len(d) > 4)
    histories = [[], [EOD_ID], [EOD_ID] + seen[:1], [EOD_ID] + seen[:4], seen[:4],
                 [EOD_ID, vocab_size - 1, vocab_size - 1, vocab_size - 1], [3, 2, 9, 9, 9, 9, 3, EOD_ID, 2]]
    for history in histories:
        log_p = kn.next_token_log_probs(model, history)
        assert log_p[PAD_ID] == -np.inf and np.all(np.isfinite(log_p[1:]))
        assert abs(np.exp(log_p[1:]).sum() - 1.0) < 1e-9


def test_sentence_scores_are_document_scores_without_the_closing_eod():
    model = kn.fit_kneser_ney(stream_of(zipf_documents(6, 100, 16)), 3, vocab_size=16)
    sentences = [[2, 3, 4], [], [15, 15], [5]]
    got = kn.kn_sentence_log_probs(model, sentences)
    for sentence, score in zip(sentences, got):
        scores = kn.log_probs(model, stream_of([sentence]))
        assert score == pytest.approx(scores[:-1].sum(), abs=1e-12)
    assert got[1] == 0.0
    with pytest.raises(SaffuError, match="regular token ids"):
        kn.kn_sentence_log_probs(model, [[2, EOD_ID, 3]])


# --------------------------------------------------------------------------- ARPA

def test_arpa_round_trip(tmp_path):
    vocab_size = 18
    documents = zipf_documents(7, 150, vocab_size)
    model = kn.fit_kneser_ney(stream_of(documents[:120]), 4, vocab_size=vocab_size)
    path = tmp_path / "model.arpa"
    arpa.write_arpa(model, path)
    text = path.read_text()
    assert text.lstrip().startswith("\\data\\") and text.rstrip().endswith("\\end\\")
    assert f"ngram 1={vocab_size + 1}" in text and "-99\t<s>\t" in text and "\t<unk>" in text
    back = arpa.read_arpa(path)
    assert back.order == 4 and back.vocab_size == vocab_size
    for k in range(4):
        np.testing.assert_array_equal(back.keys[k], model.keys[k])
        np.testing.assert_allclose(back.log_prob[k], model.log_prob[k], atol=2e-7)
        np.testing.assert_allclose(back.log_backoff[k], model.log_backoff[k], atol=2e-7)
    held_out = stream_of(documents[120:])
    np.testing.assert_allclose(kn.log_probs(back, held_out), kn.log_probs(model, held_out), atol=1e-6)
    names = ["<pad>", "<eod>"] + [f"w_{i}" for i in range(2, vocab_size)]
    arpa.write_arpa(model, tmp_path / "named.arpa", names)
    again = arpa.read_arpa(tmp_path / "named.arpa", names)
    np.testing.assert_allclose(kn.log_probs(again, held_out), kn.log_probs(model, held_out), atol=1e-6)


def test_arpa_errors(tmp_path):
    model = kn.fit_kneser_ney(stream_of([[2, 3], [3, 2]]), 2, vocab_size=4)
    with pytest.raises(SaffuError, match="whitespace"):
        arpa.write_arpa(model, tmp_path / "x.arpa", ["<pad>", "<eod>", "a b", "c"])
    broken = tmp_path / "broken.arpa"
    lines = ["\\data\\", "ngram 1=3", "ngram 2=1", "ngram 3=1", "", "\\1-grams:", "-1\t</s>\t0",
             "-1\tt2\t0", "-1\tt3\t0", "", "\\2-grams:", "-0.5\tt2 t3\t0", "", "\\3-grams:", "-0.2\tt3 t3 t2",
             "", "\\end\\"]
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(SaffuError, match="suffix of the 3-gram 't3 t3 t2' is missing"):
        arpa.read_arpa(broken)
    broken.write_text("\n".join(lines[:-3] + ["-0.2\tt2 t3 t7", "", "\\end\\"]) + "\n")
    with pytest.raises(SaffuError, match="'t7'"):
        arpa.read_arpa(broken)


def test_kenlm_reads_our_arpa_files_identically(tmp_path):
    kenlm = pytest.importorskip("kenlm")
    vocab_size = 26
    documents = zipf_documents(8, 360, vocab_size)
    held_out = documents[300:] + [[], [vocab_size - 1, 2, vocab_size - 1]]
    for order in (3, 5):
        model = kn.fit_kneser_ney(stream_of(documents[:300]), order, vocab_size=vocab_size)
        path = tmp_path / f"order{order}.arpa"
        arpa.write_arpa(model, path)
        lm = kenlm.Model(str(path))
        assert lm.order == order
        ours = kn.log_probs(model, stream_of(held_out)) / math.log(10)
        theirs = [score for doc in held_out for score, _, _ in
                  lm.full_scores(" ".join(f"t{t}" for t in doc), bos=True, eos=True)]
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


# --------------------------------------------------------------------------- work directories

def test_evaluate_workdir(tiny_workdir):
    unigram = kn_eval.evaluate_workdir(tiny_workdir, 1)
    trigram = kn_eval.evaluate_workdir(tiny_workdir, 3)
    assert {"dev_loss", "dev_ppl", "dev_bpb", "fit_seconds", "score_seconds", "ngrams_3"} <= set(trigram)
    assert trigram["dev_loss"] < unigram["dev_loss"]
    model = kn.fit_kneser_ney(tiny_workdir.tokens("train_10M"), 3, vocab_size=tiny_workdir.vocab_size)
    dev = tiny_workdir.tokens("dev")
    total = -kn.log_probs(model, dev).sum()
    assert trigram["dev_loss"] == pytest.approx(total / (len(dev) - 1), rel=1e-12)


def test_cli_ngram_scores_writes_arpa_and_blimp(tiny_workdir, tmp_path):
    import json

    from saffu.cli import main
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    (blimp / "p.jsonl").write_text(json.dumps({"sentence_good": "the cat sat on the mat .", "field": "syntax",
                                               "sentence_bad": "mat the on sat cat the .", "UID": "p"}) + "\n")
    metrics_path = tmp_path / "kn.json"
    assert main(["ngram", "--workdir", str(tiny_workdir.path), "--order", "3", "--arpa", str(tmp_path / "kn.arpa"),
                 "--blimp", str(blimp), "--quiet", "--metrics-json", str(metrics_path)]) == 0
    metrics = json.loads(metrics_path.read_text())
    reference = kn_eval.evaluate_workdir(tiny_workdir, 3)
    assert metrics["dev_loss"] == pytest.approx(reference["dev_loss"], rel=1e-12)
    assert metrics["ngrams_3"] == reference["ngrams_3"] and metrics["blimp_accuracy"] == 1.0
    assert arpa.read_arpa(tmp_path / "kn.arpa").num_ngrams() == kn.fit_kneser_ney(
        tiny_workdir.tokens("train_10M"), 3, vocab_size=tiny_workdir.vocab_size).num_ngrams()
