"""Explicit init of any parameter tree, the explicit solution from the user's own ids, the
residual for any model, the init file and the Hugging Face export."""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import SaffuError
from saffu.cli import main
from saffu.configs import ExactConfig, TransformerConfig
from saffu.data.tokenizer import EOD_ID
from saffu.interop import (
    ExplicitPieces,
    ExplicitResidual,
    TokenSource,
    explicit_init,
    read_init_file,
    solve_exact_tables,
    solve_pieces,
    tied_matrix,
    write_init_file,
)
from saffu.interop.hf import export_hf, gpt2_logits, llama_logits, load_checkpoint
from saffu.models.interface import model_init, model_logits
from saffu.models.transformer import transformer_logits

V, D = 40, 8


def _pieces(vocab=V, rank=D, seed=0):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, vocab)
    bias = np.log((counts + 1) / (counts.sum() + vocab)).astype(np.float32)
    return ExplicitPieces(embedding=rng.standard_normal((vocab, rank)).astype(np.float32) * 3,
                          output=rng.standard_normal((rank, vocab)).astype(np.float32) * 5, bias=bias,
                          counts=counts, manifest={})


def _rms(x):
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _changed(before, after):
    """Names of the leaves that differ (same tree structure asserted)."""
    from saffu.interop.init import path_name
    a, tree_a = jax.tree_util.tree_flatten_with_path(before)
    b, tree_b = jax.tree_util.tree_flatten_with_path(after)
    assert tree_a == tree_b
    out = []
    for (path, x), (_, y) in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            out.append(path_name(path))
    return sorted(out)


def _check_pieces(pieces, emb, out_vd, bias=None, emb_before=None, out_before=None):
    """The embedding is E at the random leaf's RMS; the output kernel (as [V, d]) is Bᵀ likewise."""
    E, BT = pieces.embedding.astype(np.float64), pieces.output.T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(emb), E * _rms(emb_before) / _rms(E), rtol=1e-5, atol=1e-7)
    if out_vd is not None:
        np.testing.assert_allclose(np.asarray(out_vd), BT * _rms(out_before) / _rms(BT), rtol=1e-5, atol=1e-7)
    if bias is not None:
        np.testing.assert_array_equal(np.asarray(bias), pieces.bias)


def test_nnx_state_untied_with_bias():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.hidden = nnx.Linear(D, D, rngs=rngs)
            self.head = nnx.Linear(D, V, rngs=rngs)

    state = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
    pieces = _pieces()
    new = explicit_init(state, pieces, embedding="embed/embedding", output=lambda s: s["head"]["kernel"],
                        bias=("head", "bias"))
    assert type(new) is type(state)
    assert _changed(state, new) == ["embed/embedding", "head/bias", "head/kernel"]
    _check_pieces(pieces, new["embed"]["embedding"][...], np.asarray(new["head"]["kernel"][...]).T,
                  new["head"]["bias"][...], state["embed"]["embedding"][...], np.asarray(state["head"]["kernel"][...]).T)


def test_linen_bias_free_output_stored_v_by_d():
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Dense(D)(nn.Embed(V, D, name="wte")(tokens))
            return h @ self.param("lm_head", nn.initializers.normal(0.3), (V, D)).T

    params = Model().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
    pieces = _pieces()
    new = explicit_init(params, pieces, embedding="params/wte/embedding", output="params/lm_head")
    assert _changed(params, new) == ["params/lm_head", "params/wte/embedding"]
    _check_pieces(pieces, new["params"]["wte"]["embedding"], new["params"]["lm_head"], None,
                  params["params"]["wte"]["embedding"], params["params"]["lm_head"])
    assert new["params"]["Dense_0"]["kernel"] is params["params"]["Dense_0"]["kernel"]   # untouched leaves: the same arrays


def test_equinox_module_tied_in_bfloat16():
    import equinox as eqx

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        mix: eqx.nn.Linear

        def __init__(self, key):
            a, b = jax.random.split(key)
            self.embed = eqx.nn.Embedding(V, D, key=a, dtype=jnp.bfloat16)
            self.mix = eqx.nn.Linear(D, D, key=b)

    model = Model(jax.random.key(1))
    pieces = _pieces()
    new = explicit_init(model, pieces, embedding=lambda m: m.embed.weight, tied="mean")
    assert isinstance(new, Model) and new.mix.weight is model.mix.weight
    assert _changed(model, new) == ["embed/weight"] and new.embed.weight.dtype == jnp.bfloat16
    want = tied_matrix(pieces, "mean").astype(np.float64)
    want *= _rms(model.embed.weight) / _rms(want)
    np.testing.assert_allclose(np.asarray(new.embed.weight, np.float64), want, rtol=1e-2, atol=1e-3)


def test_folded_unigram_is_what_a_bias_free_model_predicts_at_step_zero():
    """A bias-free model (RMS norm of the embedding, then the output kernel): with the explicit
    bigram part near zero, the folded model's next-token distribution is the unigram."""
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.full(V, 0.3))
    small = _pieces()
    pieces = dataclasses.replace(small, embedding=small.embedding * 1e-3, output=small.output * 1e-3,
                                 bias=np.log(p).astype(np.float32))

    def apply(params, tokens):
        x = params["embed"][tokens]
        return (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True))) @ params["head"]

    params = {"embed": jnp.asarray(rng.standard_normal((V, D)) * 0.02, jnp.float32),
              "head": jnp.asarray(rng.standard_normal((D, V)) * 0.02, jnp.float32)}
    sample = jnp.asarray(rng.integers(0, V, (4, 16)), jnp.int32)
    new = explicit_init(params, pieces, embedding="embed", output="head", fold=True, apply=apply, sample=sample)
    logp = np.asarray(jax.nn.log_softmax(apply(new, sample), -1), np.float64)
    # each context's strength (h · u / s) varies with its row norm by about 1%: a 2% tolerance
    np.testing.assert_allclose(logp, np.broadcast_to(np.log(p), logp.shape), rtol=0.02, atol=0.02)
    without = np.asarray(jax.nn.log_softmax(apply(explicit_init(params, pieces, embedding="embed", output="head"),
                                                  sample), -1))
    assert np.abs(without - np.log(p)).mean() > 1.0                     # unfolded, the unigram is lost
    with pytest.raises(SaffuError, match="give apply= and sample="):
        explicit_init(params, pieces, embedding="embed", output="head", fold=True)


def test_embedding_rms_sets_the_scale():
    params = {"embed": jnp.ones((V, D)) * 0.01, "head": jnp.ones((D, V))}
    new = explicit_init(params, _pieces(), embedding="embed", output="head", embedding_rms=1.0)
    assert _rms(new["embed"]) == pytest.approx(1.0, rel=1e-5) and _rms(new["head"]) == pytest.approx(1.0, rel=1e-5)


def test_tied_choices_are_the_pieces_at_equal_weight():
    pieces = _pieces()
    np.testing.assert_array_equal(tied_matrix(pieces, "embedding"), pieces.embedding)
    np.testing.assert_array_equal(tied_matrix(pieces, "output"), pieces.output.T)
    mean = tied_matrix(pieces, "mean").astype(np.float64)
    E, B = pieces.embedding.astype(np.float64), pieces.output.T.astype(np.float64)
    np.testing.assert_allclose(mean, (E / _rms(E) + B / _rms(B)) / 2, rtol=1e-6)
    with pytest.raises(SaffuError, match="unknown tied choice"):
        tied_matrix(pieces, "sum")


def test_wrong_vocabulary_rank_or_leaf_is_one_line():
    params = {"embed": jnp.ones((V + 1, D)), "head": jnp.ones((D, V + 1))}
    with pytest.raises(SaffuError, match=r"shape \(41, 8\).*vocabulary of 40 tokens") as err:
        explicit_init(params, _pieces(), embedding="embed", output="head")
    assert "\n" not in str(err.value)
    with pytest.raises(SaffuError, match="rank 6 but the model's width is 8; solve them at rank 8"):
        explicit_init({"embed": jnp.ones((V, D))}, _pieces(rank=6), embedding="embed")
    with pytest.raises(SaffuError, match="no embedding leaf 'emb' in the parameters; did you mean a/emb"):
        explicit_init({"a": {"emb": jnp.ones((V, D))}}, _pieces(), embedding="emb")


def _documents(seed=0, count=300):
    rng = np.random.default_rng(seed)
    # a Markov chain over ids 2 … V − 2, so the next token depends on the current one
    step = rng.integers(1, 4, V)
    docs = []
    for _ in range(count):
        x = [int(rng.integers(2, V - 1))]
        for _ in range(int(rng.integers(4, 30))):
            x.append(2 + (x[-1] - 2 + int(step[x[-1]]) * int(rng.integers(1, 3))) % (V - 3))
        docs.append(np.asarray(x))
    return docs


def test_pieces_from_user_ids_line_up_with_a_prepared_copy(tmp_path):
    """Solved from the user's ids (eod = V − 1, no pad) the pieces equal those of the same
    stream written in saffu's ids, re-indexed — and the bias is the counted log-unigram."""
    docs = _documents()
    source = TokenSource(docs, vocab_size=V, eod_id=V - 1)
    pieces = solve_pieces(source, rank=6, progress=False)
    counted = pieces.manifest["counted_tokens"]
    assert pieces.counts.sum() == counted and pieces.counts[V - 1] > 0     # eod closes every counted document
    np.testing.assert_allclose(pieces.bias, np.log((pieces.counts + 1) / (counted + V)), rtol=1e-6)
    stream = np.concatenate([[V - 1]] + [np.append(d, V - 1) for d in docs])
    assert pieces.counts.sum() <= len(stream) - 1
    again = solve_pieces(TokenSource(stream, vocab_size=V, eod_id=V - 1), rank=6, progress=False)
    np.testing.assert_array_equal(again.counts, pieces.counts)              # a flat stream: the same documents
    np.testing.assert_allclose(again.embedding, pieces.embedding, rtol=1e-5, atol=1e-6)
    with pytest.raises(SaffuError, match="outside the vocabulary"):
        TokenSource([np.asarray([3, V])], vocab_size=V, eod_id=V - 1).stream()


def test_texts_with_a_tokenizer_callable():
    words = ["the", "cat", "sat", "on", "a", "mat"]
    encode = lambda text: [2 + words.index(w) for w in text.split()]
    source = TokenSource(["the cat sat", "a cat sat on the mat"] * 40, vocab_size=10, eod_id=9, pad_id=8,
                         tokenizer=encode)
    pieces = solve_pieces(source, rank=3, progress=False)
    assert pieces.counts[2 + words.index("cat")] > 0 and pieces.counts[8] == 0 and pieces.counts[0] == 0


@pytest.mark.slow
def test_residual_wrapper_starts_at_the_exact_model_and_never_moves_it():
    docs = _documents(1)
    source = TokenSource(docs, vocab_size=V, eod_id=V - 1)
    config, tables, id_map = solve_exact_tables(source, ExactConfig(V, groups=((0,), (0, 1))), progress=False)

    def apply(params, tokens):                         # any model: embedding -> tanh -> head + bias
        return jnp.tanh(params["embed"][tokens]) @ params["head"] + params["bias"][None, None]

    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
              "head": jnp.asarray(rng.standard_normal((D, V)), jnp.float32), "bias": jnp.zeros(V)}
    residual = ExplicitResidual(apply, config, tables, id_map=id_map)
    start = residual.init(params, output=["head", "bias"])
    tokens = jnp.asarray(np.concatenate([[V - 1], docs[0], [V - 1], docs[1]])[None, :24], jnp.int32)
    logits = residual.logits(start, residual.tables, tokens)
    # step 0 is the exact model, in the user's ids: compare with its tables read in saffu's ids
    ours = jnp.asarray(id_map)[tokens]
    exact = jax.nn.log_softmax(model_logits(config, residual.tables, ours), -1)[..., np.asarray(id_map)]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(exact), atol=1e-5)

    def loss(p, t):
        logp = jax.nn.log_softmax(residual.logits(p, t, tokens[:, :-1]), -1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    grad_params, grad_tables = jax.grad(loss, argnums=(0, 1), allow_int=True)(start, residual.tables)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grad_tables) if g.dtype.kind == "f")
    assert float(jnp.abs(grad_params["model"]["head"]).max()) > 0


def test_init_file_round_trip(tmp_path):
    from safetensors.numpy import load_file
    pieces = _pieces()
    write_init_file(pieces, tmp_path / "init.safetensors")
    loaded = load_file(str(tmp_path / "init.safetensors"))
    np.testing.assert_array_equal(loaded["log_unigram"], pieces.bias)
    np.testing.assert_array_equal(loaded["output_kernel"], pieces.output)
    np.testing.assert_allclose(loaded["embedding_rms"][0], _rms(pieces.embedding), rtol=1e-6)
    manifest = json.loads((tmp_path / "init.json").read_text())
    assert manifest["vocab_size"] == V and manifest["rank"] == D
    again = read_init_file(tmp_path / "init.safetensors")
    np.testing.assert_array_equal(again.embedding, pieces.embedding)
    with pytest.raises(SaffuError, match=r"ends in \.safetensors"):
        write_init_file(pieces, tmp_path / "init.bin")


def test_cli_init_weights(tiny_workdir, tmp_path, capsys):
    from safetensors.numpy import load_file
    out = tmp_path / "init.safetensors"
    assert main(["init-weights", "--workdir", str(tiny_workdir.path), "--rank", "8", "--out", str(out),
                 "--holdout-tokens", "64", "--quiet", "--metrics-json", str(tmp_path / "m.json")]) == 0
    tensors = load_file(str(out))
    n = tensors["unigram_counts"]
    assert tensors["embedding"].shape == (tiny_workdir.vocab_size, 8)
    np.testing.assert_allclose(tensors["log_unigram"], np.log((n + 1) / (n.sum() + len(n))), rtol=1e-5)
    # the counts are the training split's targets but the held-out documents' (about 64 tokens)
    held_out = json.loads((tmp_path / "init.json").read_text())["holdout_tokens"]
    assert 64 <= held_out < 100 and n.sum() == tiny_workdir.split_info("train_10M")["predicted_tokens"] - held_out
    assert json.loads((tmp_path / "m.json").read_text())["rank"] == 8


SMALL = {"width": 16, "layers": 2, "heads": 2, "context_tokens": 4, "max_len": 24, "output_bias": False}


def _noisy(config, seed=3):
    params = model_init(config, jax.random.key(seed))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed + 1), x.shape), params)  # no zero biases


def _at_document_start(config, params, tokens):
    """saffu's logits of ``tokens`` read as a document is: from position ``context − 1`` on."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]) + config.context - 1, tokens.shape)
    return np.asarray(transformer_logits(params, config, jnp.asarray(tokens), positions=positions), np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_export_matches_an_independent_forward(tiny_workdir, tmp_path, block):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, block=block, **SMALL)
    params = _noisy(config)
    export_hf(params, config, tiny_workdir.path / "tokenizer.json", tmp_path / "hf")
    state, hf_config = load_checkpoint(tmp_path / "hf")
    assert hf_config["tie_word_embeddings"] is False and "lm_head.weight" in state
    assert hf_config["architectures"] == [{"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[block]]
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    eods = np.flatnonzero(stream == EOD_ID)
    forward = gpt2_logits if block == "gpt" else llama_logits
    # ten documents from their <eod>
    starts = [a for a, b in itertools.pairwise(eods) if b - a > 6][:10]
    tokens = np.stack([stream[s:s + 6] for s in starts]).astype(np.int32)
    assert len(starts) == 10
    np.testing.assert_allclose(_at_document_start(config, params, tokens), forward(state, hf_config, tokens),
                               atol=1e-4)
    # windows of several documents: attention across documents (the default) is Hugging Face's plain causal
    # mask, so they agree there too; a document-local run's attention differs after the second <eod>
    windows = np.stack([stream[a:a + 18] for a, b in itertools.pairwise(eods) if 2 < b - a < 12][:4]).astype(np.int32)
    assert windows.shape[0] == 4 and (np.sum(windows == EOD_ID, axis=1) >= 2).all()
    theirs = forward(state, hf_config, windows)
    np.testing.assert_allclose(_at_document_start(config, params, windows), theirs, atol=1e-4)
    local = _at_document_start(dataclasses.replace(config, across_documents=False), params, windows)
    assert np.abs(local - theirs).max() > 1e-2
    if block == "gpt":     # the table from saffu's row context − 1: as many positions as saffu reads after it
        assert hf_config["n_positions"] == config.max_len - config.context + 1


@pytest.mark.slow
def test_a_default_run_exports_and_a_biased_one_is_refused(tiny_workdir, tmp_path, capsys):
    args = ["--workdir", str(tiny_workdir.path), "--quiet"]
    common = ["--model", "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
              "--max-len", "24", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--eval-tokens", "0"]
    assert main(["train", *args, "--run", str(tmp_path / "biased"), "--init", "random", "--output-bias", *common]) == 0
    capsys.readouterr()
    assert main(["export", *args, "--run", str(tmp_path / "biased"), "--out", str(tmp_path / "x")]) != 0
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "train it with --no-output-bias" in error
    assert main(["train", *args, "--run", str(tmp_path / "free"), "--init", "random", *common]) == 0   # the defaults
    assert main(["export", *args, "--run", str(tmp_path / "free"), "--out", str(tmp_path / "hf"),
                 "--metrics-json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["architecture"] == "LlamaForCausalLM"
    capsys.readouterr()
    assert main(["export", *args, "--run", str(tmp_path / "free"), "--out", str(tmp_path / "hf2"),
                 "--checkpoint", "explicit"]) != 0
    error = capsys.readouterr().err
    assert "no checkpoint yet" not in error and "--checkpoint latest" in error          # it has one
    assert main(["export", *args, "--run", str(tmp_path / "free"), "--out", str(tmp_path / "free")]) != 0
    assert "holds a saffu run" in capsys.readouterr().err
    assert (tmp_path / "free" / "checkpoints").is_dir()                                 # the run untouched
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_transformers_loads_the_export(tiny_workdir, tmp_path, block):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from saffu.eval.scoring import generate
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, block=block, **SMALL)
    params = _noisy(config)
    export_hf(params, config, tiny_workdir.path / "tokenizer.json", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = np.asarray(tiny_workdir.tokens("train_10M")[0:7])[None].astype(np.int64)     # a document from its <eod>
    assert tokens[0, 0] == EOD_ID
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(_at_document_start(config, params, tokens.astype(np.int32)), theirs, atol=1e-4)
    # a plain prompt through the exported tokenizer gets saffu's context (<eod> first): the text-generation
    # pipeline's greedy text is `saffu generate --top-k 1`'s
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=str(tmp_path / "hf"))
    text = pipe("the cat", max_new_tokens=6, do_sample=False, return_full_text=True)[0]["generated_text"]
    ours = generate(params, config, tiny_workdir.tokenizer(), jax.random.key(0), num_samples=1, max_tokens=6,
                    top_k=1, prompt="the cat")[0]
    assert text == ours


def _small_export(tiny_workdir, out):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL)
    return export_hf(model_init(config, jax.random.key(3)), config, tiny_workdir.path / "tokenizer.json", out)


def test_export_refuses_a_run_or_foreign_files_and_leaves_them_untouched(tiny_workdir, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"kind": "transformer"}}))
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"architectures": ["BertModel"]}')
    (foreign / "notes.txt").write_text("mine")
    for out, message in ((run, "holds a saffu run"), (foreign, "notes.txt")):
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        with pytest.raises(SaffuError, match=message):
            _small_export(tiny_workdir, out)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "theirs"]      # no staging folder left


def test_export_files_are_plain_readable_and_replace_an_earlier_export(tiny_workdir, tmp_path):
    import stat

    from tokenizers import Tokenizer
    mask = os.umask(0o022)
    try:
        _small_export(tiny_workdir, tmp_path / "hf")
        report = _small_export(tiny_workdir, tmp_path / "hf")                  # over the earlier export
    finally:
        os.umask(mask)
    files = sorted((tmp_path / "hf").iterdir())
    assert [p.name for p in files] == report["files"] and not any(p.name.startswith(".") for p in files)  # no lock
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    specials = json.loads((tmp_path / "hf" / "special_tokens_map.json").read_text())
    assert "unk_token" not in specials                                          # byte-level BPE: nothing unknown
    ours = tiny_workdir.tokenizer()
    theirs = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    text = "the cat sat on the mat ."
    assert theirs.encode(text).ids == [EOD_ID, *ours.encode(text).ids]         # <eod> first, as saffu reads a text


@pytest.mark.slow
def test_checkpoints_by_words_seen_export_with_a_model_card(tiny_workdir, tmp_path, capsys):
    """Training keeps the weights when the words consumed first reach each milestone (here in
    units of 100 words: 100, 200, …); ``export --words`` and ``--step`` pick one, and the export's
    README.md says what the model is."""
    from saffu.training.checkpoints import words_index
    args = ["--workdir", str(tiny_workdir.path), "--quiet"]
    run = tmp_path / "run"
    assert main(["train", *args, "--run", str(run), "--init", "random", "--model", "transformer", "--width", "16",
                 "--layers", "1", "--attention-heads", "2", "--context", "4", "--max-len", "24", "--steps", "30",
                 "--batch-size", "2", "--seq-len", "8", "--eval-tokens", "0", "--no-output-bias",
                 "--words-unit", "100"]) == 0
    split = tiny_workdir.meta["splits"][tiny_workdir.train_split]
    per_step = 2 * 8 * split["words"] / (split["tokens"] - 1)
    kept = words_index(run)
    assert [m["words"] for m in kept] == [100 * k for k in range(1, int(30 * per_step // 100) + 1)]
    for m in kept:       # the first step at which the words consumed reach the milestone
        assert m["step"] * per_step >= m["words"] > (m["step"] - 1) * per_step
    capsys.readouterr()
    assert main(["export", *args, "--run", str(run), "--words", "200", "--out", str(tmp_path / "w200")]) == 0
    card = (tmp_path / "w200" / "README.md").read_text()
    assert f"checkpoint step {kept[1]['step']}" in card and "random init" in card and "--words-unit 100" in card
    assert main(["export", *args, "--run", str(run), "--step", str(kept[0]["step"]), "--out", str(tmp_path / "s")]) == 0
    state_words, _ = load_checkpoint(tmp_path / "w200")
    state_step, _ = load_checkpoint(tmp_path / "s")
    assert not np.allclose(state_words["lm_head.weight"], state_step["lm_head.weight"])    # two different steps
    capsys.readouterr()
    assert main(["export", *args, "--run", str(run), "--words", "5M", "--out", str(tmp_path / "x")]) != 0
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "keeps no checkpoint at 5M words" in error and "100, 200" in error
    assert main(["export", *args, "--run", str(run), "--step", "7", "--out", str(tmp_path / "x")]) != 0
    assert "keeps no checkpoint at step 7" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_weights_writes_a_hugging_face_checkpoint(tiny_workdir, tmp_path, arch):
    """``init-weights --hf-config``: the explicit embeddings and output kernel in a checkpoint of
    that architecture; with ``--random`` the same checkpoint but those, every other weight the same draw."""
    common = ["init-weights", "--workdir", str(tiny_workdir.path), "--rank", "16", "--layers", "1",
              "--attention-heads", "2", "--max-len", "24", "--hf-config", arch, "--holdout-tokens", "200", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "explicit")]) == 0
    assert main([*common, "--out", str(tmp_path / "random"), "--random"]) == 0
    (explicit, config), (random, _) = load_checkpoint(tmp_path / "explicit"), load_checkpoint(tmp_path / "random")
    assert config["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]]
    embed = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    changed = {name for name in explicit if not np.array_equal(explicit[name], random[name])}
    assert changed == {embed, "lm_head.weight"}
    assert (tmp_path / "explicit" / "tokenizer.json").is_file()
    assert "explicit" in (tmp_path / "explicit" / "README.md").read_text()


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("neox", False)])
def test_a_penzai_model_behind_the_model_interface_takes_explicit_init(family, tied):
    """penzai's transformer as a dict of arrays by label: saffu's model interface draws its init and
    runs its logits, and explicit_init sets exactly the leaves its selectors name."""
    pytest.importorskip("penzai")
    from saffu.interop.penzai import PenzaiModel
    model = PenzaiModel(family, vocab_size=V, width=16, layers=1, heads=2, mlp=24, tied=tied, context_tokens=4)
    params = model_init(model, jax.random.key(0))
    assert all(isinstance(label, str) for label in params) and set(model.selectors().values()) <= set(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 7)), jnp.int32)
    assert model_logits(model, params, tokens).shape == (2, 7, V)
    new = explicit_init(params, _pieces(rank=16), embedding_rms=1.0, **model.selectors())
    changed = {label for label in params if not np.array_equal(np.asarray(params[label]), np.asarray(new[label]))}
    assert changed == set(model.selectors().values())
    assert _rms(new["transformer/embedder.embeddings"]) == pytest.approx(1.0, rel=1e-3)
    assert np.isfinite(np.asarray(model_logits(model, new, tokens))).all() and model.forward_flops(8) > 0


def test_a_penzai_model_refuses_what_penzai_does_not_build():
    from saffu.interop.penzai import PenzaiModel
    with pytest.raises(SaffuError, match="family"):
        PenzaiModel("gpt2", vocab_size=V)
    with pytest.raises(SaffuError, match="tied"):
        PenzaiModel("neox", vocab_size=V, tied=True)
