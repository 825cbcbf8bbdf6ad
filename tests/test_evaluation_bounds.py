"""Bounded evaluation scores whole documents from the whole split, with exact bytes and words."""

import os

import jax
import numpy as np
import pytest
from conftest import TINY_DEV

from saffu import SaffuError
from saffu.data.tokenizer import EOD_ID
from saffu.data.windows import total_nll
from saffu.eval.metrics import split_metrics
from saffu.eval.scoring import evaluate_split
from saffu.models.interface import model_init, window_loss
from saffu.models.saffu import SaffuConfig, init_params
from saffu.models.transformer import TransformerConfig


def _config(workdir):
    return SaffuConfig(vocab_size=workdir.vocab_size, bits=16, radius=3)


def _documents(stream, ranges):
    """The documents (token ids, without their closing <eod>) of target ranges of whole documents."""
    return [doc.tolist() for begin, end in ranges
            for doc in np.split(stream[begin:end - 1], np.flatnonzero(stream[begin:end - 1] == EOD_ID))]


def test_a_sample_is_whole_documents_spread_over_the_split_with_their_counts(tiny_workdir):
    stream = np.asarray(tiny_workdir.tokens("dev"))
    info = tiny_workdir.split_info("dev")
    assert tiny_workdir.sample_documents("dev", info["predicted_tokens"]) == ([(1, len(stream))], info)
    want = info["predicted_tokens"] // 3
    ranges, counts = tiny_workdir.sample_documents("dev", want)
    for begin, end in ranges:
        assert stream[begin - 1] == EOD_ID and stream[end - 1] == EOD_ID   # whole documents, closing <eod> scored
    documents = _documents(stream, ranges)
    texts = tiny_workdir.tokenizer().decode_batch([[i for i in d if i != EOD_ID] for d in documents])
    assert counts["documents"] == len(documents)
    assert counts["predicted_tokens"] == sum(end - begin for begin, end in ranges)
    assert abs(counts["predicted_tokens"] - want) <= max(map(len, documents)) + 1
    assert ranges[-1][1] > len(stream) // 2                              # not only the start of the split
    assert counts["bytes"] == sum(len(text.encode()) + 1 for text in texts)
    assert counts["words"] == sum(len(text.split()) + 1 for text in texts)


def test_a_split_is_decoded_once_per_process_until_its_tokens_change(tiny_workdir, tmp_path, monkeypatch):
    import shutil

    from saffu.data import workdir as wd
    copy = wd.open_workdir(shutil.copytree(tiny_workdir.path, tmp_path / "copy"))
    calls = []
    decode = wd._document_text_counts
    monkeypatch.setattr(wd, "_document_text_counts", lambda *a, **k: calls.append(a[1]) or decode(*a, **k))
    want = copy.split_info("dev")["predicted_tokens"] // 3
    first = copy.sample_documents("dev", want)
    assert copy.sample_documents("dev", want) == first and copy.sample_documents("dev", want // 2)[1] != first[1]
    assert calls == ["dev"]                                     # three samples, one decoding
    tokens = copy.path / "tokens" / "dev.bin"
    tokens.write_bytes(tokens.read_bytes())                     # the split written again: counted again
    os.utime(tokens, ns=(1, 1))
    assert copy.sample_documents("dev", want) == first and calls == ["dev", "dev"]


def test_bounded_evaluation_equals_first_principles(tiny_workdir):
    config = _config(tiny_workdir)
    params = init_params(config, jax.random.key(0), scale=0.5)
    stream = np.asarray(tiny_workdir.tokens("dev"))
    info = tiny_workdir.split_info("dev")
    full = evaluate_split(params, config, tiny_workdir, "dev", progress=False)
    assert full["dev_whole_split"] is True
    assert full["dev_tokens"] == info["predicted_tokens"] and full["dev_documents"] == info["documents"]
    covering = evaluate_split(params, config, tiny_workdir, "dev", max_tokens=info["predicted_tokens"],
                              progress=False)
    assert covering == full                                           # a bound that covers the split is the split

    bound = info["predicted_tokens"] // 2
    part = evaluate_split(params, config, tiny_workdir, "dev", max_tokens=bound, progress=False, prefix="p_")
    ranges, counts = tiny_workdir.sample_documents("dev", bound)
    assert part["p_whole_split"] is False and part["p_documents"] == counts["documents"] < info["documents"]
    # the same figures from first principles: each run of documents scored on its own, the raw text's counts
    nll, count = 0.0, 0
    for begin, end in ranges:
        n, c = total_nll(lambda w, m: window_loss(params, config, w, m), stream, [(begin, end)], config.context,
                         seq_len=8, batch_size=3)
        nll, count = nll + n, count + c
    texts = tiny_workdir.tokenizer().decode_batch([[i for i in d if i != EOD_ID] for d in _documents(stream, ranges)])
    assert all(text in TINY_DEV for text in texts)
    expected = split_metrics(nll, {"predicted_tokens": count, "bytes": sum(len(t.encode()) + 1 for t in texts),
                                   "words": sum(len(t.split()) + 1 for t in texts)}, "p_")
    for key, value in expected.items():
        assert part[key] == pytest.approx(value, rel=1e-5)
    with pytest.raises(SaffuError, match="eval-tokens"):
        evaluate_split(params, config, tiny_workdir, "dev", max_tokens=-1, progress=False)


def test_the_transformer_evaluates_through_the_same_path(tiny_workdir):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, width=16, layers=1, heads=2,
                               context_tokens=4, max_len=40, block="gpt", output_bias=True)
    params = model_init(config, jax.random.key(0))
    full = evaluate_split(params, config, tiny_workdir, "dev", progress=False)
    part = evaluate_split(params, config, tiny_workdir, "dev", max_tokens=30, progress=False)
    assert np.isfinite(full["dev_bpb"]) and np.isfinite(part["dev_bpb"])
    assert part["dev_tokens"] < full["dev_tokens"] and not part["dev_whole_split"]
