import json

import jax
import numpy as np
import pytest

from saffu import SaffuError
from saffu.blimp import Pair, blimp_accuracy, load_blimp, sentence_log_probs
from saffu.cli import main
from saffu.model import SaffuConfig, init_params, saffu_logits
from saffu.tokenizer import EOD_ID, PAD_ID


def test_sentence_scores_match_a_direct_forward(tiny_workdir):
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=3)
    params = init_params(config, jax.random.key(0), scale=0.5)
    tokenizer = tiny_workdir.tokenizer()
    sentences = ["the cat sat on the mat .", "a dog", "where is the cat ?"]
    got = sentence_log_probs(params, config, tokenizer, sentences, batch_size=2, progress=False)
    for sentence, score in zip(sentences, got):
        ids = tokenizer.encode(sentence).ids
        tokens = np.asarray([PAD_ID] * (config.context - 1) + [EOD_ID] + ids, np.int32)
        logits = np.asarray(saffu_logits(params, config, tokens[None]), np.float64)[0]
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        expected = sum(log_probs[config.context - 1 + i, t] for i, t in enumerate(ids))
        assert score == pytest.approx(expected, rel=1e-5)


def test_accuracy_counts_ties_as_wrong_and_groups():
    pairs = [Pair("p1", "syntax", "a", "b"), Pair("p1", "syntax", "c", "d"), Pair("p2", "semantics", "e", "f")]
    metrics = blimp_accuracy(pairs, np.array([-1.0, -2.0, -3.0]), np.array([-2.0, -2.0, -1.0]))
    assert metrics["blimp_accuracy"] == pytest.approx(1 / 3)                 # the tie is wrong
    assert metrics["blimp_p1"] == 0.5 and metrics["blimp_p2"] == 0.0
    assert metrics["blimp_field_syntax"] == 0.5 and metrics["blimp_pairs"] == 3


def test_trained_model_prefers_the_grammatical_word_order(tiny_workdir, tmp_path, capsys):
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    rows = [{"sentence_good": "the cat sat on the mat .", "sentence_bad": "mat the on sat cat the .",
             "field": "syntax", "UID": "word_order"},
            {"sentence_good": "where is the cat ?", "sentence_bad": "cat the is where ?",
             "field": "syntax", "UID": "word_order"}]
    (blimp / "word_order.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, work = tmp_path / "run", str(tiny_workdir.path)
    assert main(["fit", "--workdir", work, "--run", str(run), "--bits", "16", "--radius", "4",
                 "--holdout-tokens", "200", "--quiet"]) == 0
    assert main(["blimp", "--workdir", work, "--run", str(run), "--blimp", str(blimp), "--quiet",
                 "--metrics-json", str(tmp_path / "b.json")]) == 0
    metrics = json.loads((tmp_path / "b.json").read_text())
    assert metrics["blimp_accuracy"] == 1.0 and metrics["blimp_word_order"] == 1.0
    with pytest.raises(SaffuError, match="no BLiMP"):
        load_blimp(tmp_path / "missing")
