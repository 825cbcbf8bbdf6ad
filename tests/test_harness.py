"""The lm-evaluation-harness model: its continuation scores are saffu's own (BLiMP sentence by
sentence, documents token by token), its BLiMP accuracy through the harness equals
``saffu blimp``'s, and the command prints and writes the accuracies."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import TransformerConfig
from saffu.cli import main
from saffu.configs import SaffuConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.eval.blimp import evaluate_blimp, sentence_log_probs
from saffu.eval.continuations import continuation_log_probs, max_tokens
from saffu.models.interface import model_init, model_logits

lm_eval = pytest.importorskip("lm_eval")

SMALL = {"width": 16, "layers": 2, "heads": 2, "context_tokens": 4, "max_len": 24, "block": "gpt", "output_bias": True}
SENTENCES = ["the cat sat on the mat .", "the cats sat on the log .", "a dog saw the cats .", "where is the cat ?"]


def _blimp(folder, pairs_per_file=6):
    folder.mkdir()
    good = ["the cat sat on the mat .", "a dog saw the cats .", "the dogs saw the cats ."]
    bad = ["the cat sat on mat the .", "a dog saw cats the .", "dogs the saw the cats ."]
    for paradigm in ("order_a", "order_b"):
        rows = [{"sentence_good": good[i % 3], "sentence_bad": bad[(i + (paradigm == "order_b")) % 3],
                 "field": "syntax", "UID": paradigm} for i in range(pairs_per_file)]
        (folder / f"{paradigm}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _params(config, seed=3):
    params = model_init(config, jax.random.key(seed))
    return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(seed + 1), x.shape), params)


@pytest.mark.parametrize("kind", ["transformer", "saffu"])
def test_sentences_after_eod_score_as_saffu_blimp_does(tiny_workdir, kind):
    config = (TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL) if kind == "transformer"
              else SaffuConfig(vocab_size=tiny_workdir.vocab_size, radius=3, heads=2, hidden=8))
    params, tokenizer = _params(config), tiny_workdir.tokenizer()
    requests = [([EOD_ID], tokenizer.encode(s).ids) for s in SENTENCES]
    ours, _ = continuation_log_probs(params, config, requests, progress=False)
    np.testing.assert_allclose(ours, sentence_log_probs(params, config, tokenizer, SENTENCES, progress=False),
                               rtol=1e-5)


def test_context_continuation_and_greedy_match_the_full_forward(tiny_workdir):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL)
    params, tokenizer = _params(config), tiny_workdir.tokenizer()
    context, continuation = [EOD_ID, *tokenizer.encode("the cat").ids], tokenizer.encode(" sat on the mat").ids
    window = [PAD_ID] * (config.context - 1) + context + continuation
    logits = np.asarray(model_logits(config, params, jnp.asarray([window], jnp.int32))[0], np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    first = len(window) - len(continuation)
    expected = sum(log_probs[first - 1 + j, t] for j, t in enumerate(continuation))
    greedy = [int(np.argmax(logits[first - 1 + j])) for j in range(len(continuation))]   # teacher-forced
    best, worst = int(np.argmax(logits[first - 1])), int(np.argmin(logits[first - 1]))
    requests = [(context, continuation), (context, [best]), (context, [worst])]
    got, is_greedy = continuation_log_probs(params, config, requests, progress=False)
    assert got[0] == pytest.approx(expected, abs=1e-4)
    assert got[1] == pytest.approx(log_probs[first - 1, best], abs=1e-4)
    assert list(is_greedy) == [greedy == continuation, True, False]


def test_a_request_longer_than_the_window_keeps_its_last_tokens(tiny_workdir):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL)
    params = _params(config)
    limit = max_tokens(config)
    assert limit == config.max_len - config.context + 1
    stream = [int(t) for t in np.asarray(tiny_workdir.tokens("train_10M"))[1:60]]
    long, cut = (stream[:40], stream[40:44]), (stream[:40][-(limit + 1 - 4):], stream[40:44])
    got, _ = continuation_log_probs(params, config, [long, cut], progress=False)
    assert got[0] == pytest.approx(got[1], abs=1e-5)


@pytest.mark.parametrize("block", ["gpt", "llama", "saffu"])
def test_documents_score_alone_as_the_split_scores_them(tiny_workdir, block):
    """:func:`document_nll` (what the harness's rolling log-likelihood returns) of every dev
    document with its closing ``<eod>``, summed, is saffu's own dev NLL for a model that reads
    each document alone (document-local), also where a document is longer than an evaluation
    window (it continues behind its own tokens) and for absolute positions (the gpt block)."""
    from saffu.eval.scoring import document_nll, evaluate_split
    config = (SaffuConfig(vocab_size=tiny_workdir.vocab_size, radius=3, heads=2, hidden=8) if block == "saffu" else
              TransformerConfig(vocab_size=tiny_workdir.vocab_size, width=16, layers=2, heads=2, context_tokens=4,
                                max_len=12, block=block, output_bias=block == "gpt", across_documents=False))
    params = _params(config)
    stream = [int(t) for t in np.asarray(tiny_workdir.tokens("dev"))]
    eods = [i for i, t in enumerate(stream) if t == EOD_ID]
    documents = [stream[a + 1:b + 1] for a, b in zip(eods, eods[1:])]
    assert block == "saffu" or max(len(d) for d in documents) > config.eval_seq_len     # some need two windows
    split = evaluate_split(params, config, tiny_workdir, "dev", progress=False)
    assert split["dev_tokens"] == sum(len(d) for d in documents)
    ours = document_nll(params, config, documents)
    assert ours.sum() == pytest.approx(split["dev_loss"] * split["dev_tokens"], rel=1e-5)
    assert document_nll(params, config, [[]])[0] == 0.0


@pytest.mark.slow
def test_harness_blimp_equals_saffu_blimp_and_the_command_reports_it(tiny_workdir, tmp_path, capsys):
    from saffu.eval.scoring import document_nll
    from saffu.interop.harness import SaffuLM, evaluate, write_blimp_tasks
    from saffu.training.checkpoints import words_index
    blimp = _blimp(tmp_path / "blimp")
    args = ["--workdir", str(tiny_workdir.path), "--quiet"]
    assert main(["train", *args, "--run", str(tmp_path / "tf"), "--init", "random", "--model", "transformer",
                 "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4", "--max-len", "24",
                 "--steps", "30", "--batch-size", "4", "--seq-len", "8", "--eval-tokens", "0", "--words-unit", "100"]) == 0
    names = write_blimp_tasks(blimp, tmp_path / "tasks")
    assert names == ["saffu_blimp_order_a", "saffu_blimp_order_b", "saffu_blimp"]
    results = evaluate(tmp_path / "tf", ["saffu_blimp"], [tmp_path / "tasks"], progress=False)["results"]
    model = SaffuLM(tmp_path / "tf", progress=False)
    ours = evaluate_blimp(model.params, model.config, model.workdir.tokenizer(), blimp, progress=False)
    assert results["saffu_blimp"]["acc,none"] == pytest.approx(ours["blimp_accuracy"], abs=1e-3)
    for paradigm in ("order_a", "order_b"):
        assert results[f"saffu_blimp_{paradigm}"]["acc,none"] == pytest.approx(ours[f"blimp_{paradigm}"], abs=1e-3)
    # rolling log-likelihood of a text = saffu's own score of it as a document (after <eod>, in its windows)
    text = " ".join(SENTENCES * 4)
    request = type("Request", (), {"args": (text,)})()
    ids = model.tok_encode(text)
    assert len(ids) > model.config.eval_seq_len                               # more than one window
    expected = -document_nll(model.params, model.config, [ids])[0]
    assert model.loglikelihood_rolling([request])[0] == pytest.approx(expected, rel=1e-6)
    # the command: the harness's accuracies, printed and as JSON
    capsys.readouterr()
    assert main(["harness", "--run", str(tmp_path / "tf"), "--blimp", str(blimp), "--quiet",
                 "--metrics-json", str(tmp_path / "h.json")]) == 0
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "h.json").read_text())
    assert written["saffu_blimp_acc"] == pytest.approx(ours["blimp_accuracy"], abs=1e-3)
    assert "saffu_blimp" in printed and "saffu_blimp_order_a" in printed
    # an earlier checkpoint by words seen (BabyLM's intermediate checkpoints), from Python and the command
    first = words_index(tmp_path / "tf")[0]
    early = SaffuLM(tmp_path / "tf", words=first["label"], progress=False)
    assert early.weights.startswith(f"checkpoint step {first['step']} ")
    assert not np.allclose(early.params["output"]["kernel"], model.params["output"]["kernel"])
    assert main(["harness", "--run", str(tmp_path / "tf"), "--blimp", str(blimp), "--quiet", "--words",
                 first["label"], "--limit", "2"]) == 0


def test_registering_saffu_keeps_the_harness_own_models():
    from lm_eval.api.registry import get_model

    import saffu.interop.harness  # noqa: F401
    assert get_model("saffu").__name__ == "SaffuLM" and get_model("dummy").__name__ == "DummyLM"


def test_a_model_saffu_did_not_build_is_served_from_its_parameters(tiny_workdir):
    """SaffuLM.from_model: a third-party model (its own init and logits; here a bigram table) and
    its weights, scored after an ``<eod>`` as a run is, against a float64 numpy reference."""
    import dataclasses

    from saffu.interop.harness import SaffuLM

    @dataclasses.dataclass(frozen=True)
    class Bigram:
        vocab_size: int
        context = 1

        def init(self, key):
            return {"table": jax.random.normal(key, (self.vocab_size, self.vocab_size))}

        def logits(self, params, tokens):
            return params["table"][tokens]

    model = Bigram(tiny_workdir.vocab_size)
    params = model.init(jax.random.key(0))
    lm = SaffuLM.from_model(model, params, tiny_workdir.path, weights="trained elsewhere", progress=False)
    table = np.asarray(params["table"], np.float64)
    log_probs = table - np.log(np.exp(table - table.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - table.max(-1, keepdims=True)
    for text in SENTENCES:
        ids = lm.tok_encode(text)
        (got, _), = lm._loglikelihood_tokens([(("", text), [EOD_ID], ids)])
        assert got == pytest.approx(sum(log_probs[a, b] for a, b in zip([EOD_ID, *ids], ids)), rel=1e-5)
    assert lm.weights == "trained elsewhere" and lm.run is None
