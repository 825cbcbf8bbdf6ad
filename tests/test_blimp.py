import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import saffu.eval.blimp
from saffu import SaffuError
from saffu.cli import main
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.eval.blimp import Pair, blimp_accuracy, document_local, load_blimp, sentence_log_probs
from saffu.models.interface import model_init, model_logits
from saffu.models.saffu import SaffuConfig, init_params
from saffu.models.transformer import TransformerConfig

SENTENCES = ["the cat sat on the mat .", "a dog", "where is the cat ?", "", "the dog sat on the log . " * 3,
             "a dog", "cats", "the cat sat on the mat ."]


def _direct_scores(params, config, tokenizer, sentences, length=48):
    """Each sentence alone after ``<pad> … <eod>`` (then ``<pad>`` to a fixed length, unseen by
    the causal models), one row per call, log-softmax in float64."""
    logits_of = jax.jit(lambda params, tokens: model_logits(config, params, tokens))
    out = []
    for sentence in sentences:
        ids = tokenizer.encode(sentence).ids
        tokens = np.full(length, PAD_ID, np.int32)
        tokens[config.context - 1] = EOD_ID
        tokens[config.context:config.context + len(ids)] = ids
        logits = np.asarray(logits_of(params, jnp.asarray(tokens[None])), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out.append(sum(log_probs[config.context - 1 + i, t] for i, t in enumerate(ids)))
    return np.asarray(out)


MODELS = {
    "direct": lambda v: SaffuConfig(vocab_size=v, bits=16, radius=3),
    "chain-log": lambda v: SaffuConfig(vocab_size=v, bits=16, radius=4, heads=2, hidden=9, value_form="log"),
    "stacked": lambda v: SaffuConfig(vocab_size=v, bits=16, radius=3, blocks=2, positions=1),
    "transformer": lambda v: TransformerConfig(vocab_size=v, width=16, layers=2, heads=2, context_tokens=4,
                                               max_len=64, block="gpt", output_bias=True),     # across documents
    "transformer-local": lambda v: TransformerConfig(vocab_size=v, width=16, layers=2, heads=2, context_tokens=4,
                                                     max_len=64, block="gpt", output_bias=True, across_documents=False),
}


@pytest.mark.parametrize("pack", [None, False, True], ids=["default", "padded", "packed"])
@pytest.mark.parametrize("model", MODELS)
def test_sentence_scores_match_a_direct_forward(tiny_workdir, model, pack, monkeypatch):
    config = MODELS[model](tiny_workdir.vocab_size)
    params = init_params(config, jax.random.key(0), scale=0.5) if config.kind == "saffu" \
        else model_init(config, jax.random.key(0))
    tokenizer = tiny_workdir.tokenizer()
    monkeypatch.setattr(saffu.eval.blimp, "PACKED_ROW", 16)         # several rows, one longer sentence
    monkeypatch.setattr(saffu.eval.blimp, "POSITIONED_ROW", 16)     # (the transformer's packed rows)
    got = sentence_log_probs(params, config, tokenizer, SENTENCES, batch_size=2, progress=False, pack=pack)
    np.testing.assert_allclose(got, _direct_scores(params, config, tokenizer, SENTENCES), rtol=1e-5)
    assert got[3] == 0.0                                       # the empty sentence
    assert got[1] == got[5] and got[0] == got[7]               # equal sentences, equal scores


@pytest.mark.parametrize("pack", [None, False], ids=["default", "padded"])
@pytest.mark.parametrize("model", ["exact", "residual"])
def test_exact_and_residual_sentence_scores_match_a_direct_forward(tiny_workdir, model, pack):
    """The exact model (packed: it reads only a document's own tokens) and a residual over a
    transformer (packed with positions) score each sentence as alone."""
    from saffu.configs import ExactConfig, ResidualConfig
    from saffu.models.residual import with_explicit
    from saffu.solve.exact import solve_exact
    V = tiny_workdir.vocab_size
    exact_config = ExactConfig(V, groups=((0,), (1,), (0, 1)), buckets=(3,), holdout_tokens=200)
    exact, _ = solve_exact(tiny_workdir, exact_config, progress=False)
    config, params = exact_config, exact
    assert document_local(exact_config)
    if model == "residual":
        base = TransformerConfig(vocab_size=V, width=16, layers=2, heads=2, context_tokens=4, max_len=64,
                                 block="gpt", output_bias=True)
        config = ResidualConfig(base, exact_config, "unused")
        params = with_explicit({"model": model_init(base, jax.random.key(1)), "scale": jnp.float32(0.6)}, exact)
    tokenizer = tiny_workdir.tokenizer()
    got = sentence_log_probs(params, config, tokenizer, SENTENCES, batch_size=2, progress=False, pack=pack)
    np.testing.assert_allclose(got, _direct_scores(params, config, tokenizer, SENTENCES), rtol=1e-5)


def test_packed_and_padded_layouts_agree_with_default_batches(tiny_workdir):
    config = MODELS["stacked"](tiny_workdir.vocab_size)
    params = init_params(config, jax.random.key(1), scale=0.5)
    tokenizer = tiny_workdir.tokenizer()
    sentences = [" ".join(["the cat sat on the mat ."] * (i % 5)) + f" {i}" for i in range(300)]
    packed = sentence_log_probs(params, config, tokenizer, sentences, progress=False)
    padded = sentence_log_probs(params, config, tokenizer, sentences, progress=False, pack=False)
    np.testing.assert_allclose(packed, padded, rtol=1e-6)


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


def test_field_spellings_are_one_field(tmp_path):
    from saffu.eval.blimp import field_name, load_blimp
    assert field_name("syntax/semantics") == field_name("syntax_semantics") == field_name("syntax-semantics ")
    for name, field in (("a", "syntax/semantics"), ("b", "syntax_semantics")):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"sentence_good": "x", "sentence_bad": "y",
                                                            "field": field, "UID": name}) + "\n")
    metrics = blimp_accuracy(load_blimp(tmp_path), np.ones(2), np.zeros(2))
    assert [key for key in metrics if key.startswith("blimp_field_")] == ["blimp_field_syntax_semantics"]
