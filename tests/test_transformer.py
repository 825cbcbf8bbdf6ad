"""The transformer baseline: masking, sizing, the shared trainer and CLI, compute accounting."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import SaffuError
from saffu.cli import main
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.engine import accounting
from saffu.models.interface import config_from_dict, model_init, model_logits, window_loss
from saffu.models.saffu import SaffuConfig
from saffu.models.transformer import TransformerConfig, parameter_count_of, sized_like, transformer_logits
from saffu.solve.stack import SolverConfig, solve_explicit
from saffu.training.checkpoints import load_params
from saffu.training.trainer import TrainConfig, train

SMALL = dict(width=16, layers=2, heads=2, context_tokens=4, max_len=64, block="gpt", output_bias=True)


def test_attention_is_causal_and_stays_in_its_document():
    config = TransformerConfig(vocab_size=40, **SMALL, across_documents=False)
    params = model_init(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 40, (2, 20)).astype(np.int32)
    tokens[:, 8] = EOD_ID
    base = np.asarray(model_logits(config, params, jnp.asarray(tokens)))
    later = tokens.copy()
    later[:, 14] = 3 if tokens[0, 14] != 3 else 4                       # a later token changes...
    changed = np.asarray(model_logits(config, params, jnp.asarray(later)))
    np.testing.assert_allclose(changed[:, :14], base[:, :14], atol=1e-5)   # ...no earlier position moves
    assert np.abs(changed[:, 14:] - base[:, 14:]).max() > 1e-3
    earlier = tokens.copy()
    earlier[:, 2] = 3 if tokens[0, 2] != 3 else 4                        # a token of the previous document
    moved = np.asarray(model_logits(config, params, jnp.asarray(earlier)))
    np.testing.assert_allclose(moved[:, 8:], base[:, 8:], atol=1e-5)      # is invisible after the <eod>
    assert np.abs(moved[:, 2:8] - base[:, 2:8]).max() > 1e-3


def test_attention_across_documents_reads_every_earlier_token_but_padding():
    """The default mask: the earlier document is context after an ``<eod>``; ``<pad>`` (before a
    stream, or a text read alone) is read by no token, so a text behind pads gets the logits it
    has alone, and a saved config without the field (before this default) loads document-local."""
    config = TransformerConfig(vocab_size=40, **SMALL)
    assert config.across_documents
    params = model_init(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(2, 40, (2, 20)).astype(np.int32)
    tokens[:, 8] = EOD_ID
    base = np.asarray(model_logits(config, params, jnp.asarray(tokens)))
    earlier = tokens.copy()
    earlier[:, 2] = 3 if tokens[0, 2] != 3 else 4                        # a token of the previous document
    moved = np.asarray(model_logits(config, params, jnp.asarray(earlier)))
    np.testing.assert_allclose(moved[:, :2], base[:, :2], atol=1e-5)
    assert np.abs(moved[:, 8:] - base[:, 8:]).max() > 1e-3                 # is read after the <eod>
    text = tokens[:, 8:]                                                   # <eod> and a document
    padded = np.concatenate([np.full((2, 8), PAD_ID, np.int32), text], axis=1)
    behind = np.asarray(model_logits(config, params, jnp.asarray(padded)))[:, 8:]
    positions = jnp.broadcast_to(jnp.arange(8, 20), text.shape)            # the places the gpt block's table gives them
    alone = np.asarray(transformer_logits(params, config, jnp.asarray(text), positions=positions))
    np.testing.assert_allclose(behind, alone, atol=1e-5)
    local = dataclasses.replace(config, across_documents=False)
    np.testing.assert_allclose(np.asarray(model_logits(local, params, jnp.asarray(padded)))[:, 8:], alone, atol=1e-5)
    saved = {k: v for k, v in dataclasses.asdict(config).items() if k != "across_documents"}
    assert config_from_dict(saved) == local


def test_sizing_matches_the_target_and_counts_without_allocating():
    config = sized_like(8192, 3_180_000)
    assert abs(parameter_count_of(config) - 3_180_000) / 3_180_000 < 0.1
    small = TransformerConfig(vocab_size=40, **SMALL)
    assert parameter_count_of(small) == sum(x.size for x in jax.tree.leaves(model_init(small, jax.random.key(1))))


def test_bad_configs_and_windows_are_clear_errors():
    with pytest.raises(SaffuError, match="multiple"):
        TransformerConfig(vocab_size=40, width=10, heads=3, block="gpt", output_bias=True)
    config = TransformerConfig(vocab_size=40, width=8, layers=1, heads=2, context_tokens=2, max_len=8,
                               block="gpt", output_bias=True)
    with pytest.raises(SaffuError, match="max_len"):
        model_logits(config, model_init(config, jax.random.key(0)), jnp.zeros((1, 9), jnp.int32))


# (config, multiply-adds per predicted token at seq_len 32, multiply-adds of the compiled loss of
# 2 windows), counted by hand. Sizes where the matmuls dominate, so XLA's count is close to them.
FLOP_CASES = [
    # width 64, 2 layers, MLP 256, V = 40, window 4 + 32 = 36 tokens, mean visible keys (36 + 1) / 2:
    # per token 2 layers × (q, k, v, out 4·64² + MLP 2·64·256) + 2 layers × scores and mixing
    # 2·18.5·64 + output 64·40; compiled: every one of the 36 positions, the whole 36 × 36
    # attention square (XLA computes the masked half too)
    (TransformerConfig(vocab_size=40, **{**SMALL, "width": 64}),
     2 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 18.5 * 64 + 64 * 40,
     2 * (2 * 36 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 36 * 36 * 64 + 36 * 64 * 40)),
    # K = 33 code dims, radius 8, one head, 2 positions, V = 256: per token similarities 8·33,
    # scores through the 8 × 8 attention 8², value 8·33, output 3 groups × 33·256; compiled: 8 + 32 = 40 positions
    # the llama block, same sizes: its SwiGLU MLP has 3 matrices of 64 × 176 (2/3 of 4·64, rounded up to 8)
    (TransformerConfig(vocab_size=40, **{**SMALL, "width": 64, "block": "llama"}),
     2 * (4 * 64 * 64 + 3 * 64 * 176) + 2 * 2 * 18.5 * 64 + 64 * 40,
     2 * (2 * 36 * (4 * 64 * 64 + 3 * 64 * 176) + 2 * 2 * 36 * 36 * 64 + 36 * 64 * 40)),
    (SaffuConfig(vocab_size=256, bits=32),
     8 * 33 + 8 * 8 + 8 * 33 + 3 * 33 * 256,
     2 * 40 * (8 * 33 + 8 * 8 + 8 * 33 + 3 * 33 * 256)),
]


@pytest.mark.parametrize("config, per_token, compiled_macs", FLOP_CASES, ids=["transformer", "llama", "saffu"])
def test_analytic_flops_agree_with_xla(config, per_token, compiled_macs):
    """The analytic forward count (2 FLOPs per multiply-add per predicted token) is the hand
    count; XLA's count of the compiled loss is at least the multiply-adds it must do and above
    them only by elementwise work (norms, GELU, softmaxes, log-softmax: a few flops per element of
    tensors far smaller than the matmuls here; measured 4.4% and 3.9%), bounded at 6%: tight enough
    that a count with the causal half of the attention square or without the context positions
    fails."""
    assert config.forward_flops(32) == 2 * per_token
    params = model_init(config, jax.random.key(0))
    seq_len = 32
    # one window: the transformer's attention loops over windows (lax.map), and XLA counts a loop's
    # body once, so one trip is the only count that is the whole computation
    windows = jnp.zeros((1, config.context + seq_len), jnp.int32)
    mask = jnp.ones((1, seq_len), bool)
    compiled = jax.jit(lambda p, w, m: window_loss(p, config, w, m)[0]).lower(params, windows, mask).compile()
    ratio = accounting.xla_flops(compiled) / compiled_macs        # 2 FLOPs per multiply-add, half the windows
    assert 1.0 <= ratio < 1.06


def test_same_trainer_lowers_the_loss_and_accounts_for_compute(tiny_workdir, tmp_path):
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, **SMALL)
    settings = TrainConfig(steps=30, batch_size=4, seq_len=16, learning_rate=1e-2, warmup_steps=5, eval_every=10)
    _, history = train(config, model_init(config, jax.random.key(0)), tiny_workdir.tokens("train_10M"), settings,
                       tmp_path / "run", dev_stream=tiny_workdir.tokens("dev"), progress=False)
    assert history[-1]["dev_loss"] < history[0]["dev_loss"] - 1.0
    last = history[-1]
    assert last["tokens"] == 30 * 4 * 16 and last["peak_rss_mb"] > 0
    assert 0 < accounting.rss_mb() <= accounting.peak_rss_mb() + 1.0      # now, never above the peak so far
    # the analytic count, by hand: 3 × forward (2 FLOPs per multiply-add) per trained token, and a
    # token's forward at width 16, 2 layers, MLP 64, V = 280, mean visible keys (4 + 16 + 1) / 2
    assert tiny_workdir.vocab_size == 280
    per_token = 2 * (4 * 16 * 16 + 2 * 16 * 64) + 2 * 2 * 10.5 * 16 + 16 * 280
    assert last["flops"] == 30 * 4 * 16 * 3 * 2 * per_token
    # XLA's count of a compiled step against its matmuls by hand: the forward's at every one of
    # the 4 × 20 window positions (the whole 20 × 20 attention square), and two backward matmuls
    # for each (all operands depend on the weights): at least 3 × those; above them by the
    # elementwise work (18% of the forward's at width 16, see test_analytic_flops_agree_with_xla's
    # reasoning) and AdamW's ~30 flops per each of the 16,856 weights (9%): measured 1.25, bound 1.3
    forward_macs = 4 * (2 * 20 * (4 * 16 * 16 + 2 * 16 * 64) + 2 * 2 * 20 * 20 * 16 + 20 * 16 * 280)
    assert 1.0 <= last["xla_flops"] / 30 / (3 * 2 * forward_macs) < 1.3
    assert last["flops"] == pytest.approx(3 * history[1]["flops"])            # linear in steps (30 vs 10)


def test_solver_reports_its_compute(tiny_workdir):
    config = SaffuConfig(vocab_size=tiny_workdir.vocab_size, bits=16, radius=3)
    _, report = solve_explicit(tiny_workdir, config, SolverConfig(holdout_tokens=64, chunk_size=128), progress=False)
    assert report["streaming_passes"] == 3 and report["calibration_evaluations"] >= 1
    assert report["xla_flops"] > 0 and report["flops"] > 0 and report["peak_rss_mb"] > 0
    train_tokens = len(tiny_workdir.tokens("train_10M"))
    assert report["counted_tokens"] == train_tokens - 64 - 1          # every target but the holdout's
    assert report["holdout_tokens"] == 64 and report["tokens_per_s"] > 0


@pytest.mark.slow
def test_cli_trains_evaluates_and_scores_blimp_on_a_transformer(tiny_workdir, tmp_path, capsys):
    run, metrics = tmp_path / "tf", tmp_path / "m.json"
    args = ["--workdir", str(tiny_workdir.path), "--run", str(run)]
    assert main(["train", *args, "--init", "random", "--model", "transformer", "--block", "gpt", "--output-bias",
                 "--width", "16", "--layers", "1",
                 "--attention-heads", "2", "--context", "4", "--max-len", "40", "--steps", "4", "--batch-size", "2",
                 "--seq-len", "16", "--learning-rate", "0.01", "--quiet", "--metrics-json", str(metrics)]) == 0
    figures = json.loads(metrics.read_text())
    assert figures["model"] == "transformer" and figures["steps"] == 4 and figures["xla_flops"] > 0
    # bits per byte from the dev loss, the dev split's targets (every token after the leading
    # <eod>) and its UTF-8 bytes (one newline per document), counted here from the corpus itself
    dev_bytes = sum(len(line.encode()) + 1 for line in __import__("conftest").TINY_DEV)
    predicted = len(tiny_workdir.tokens("dev")) - 1
    assert figures["dev_tokens"] == predicted and tiny_workdir.split_info("dev")["bytes"] == dev_bytes
    assert figures["dev_bpb"] == pytest.approx(figures["dev_loss"] * predicted / (math.log(2) * dev_bytes), rel=1e-9)
    # four steps learn something: below the uniform ln V (here 5.32 against 5.63), and on the
    # same dev windows below step 0's loss (5.37 against 6.04)
    assert figures["dev_loss"] < math.log(tiny_workdir.vocab_size) - 0.15
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 4] and evals[1]["dev_loss"] < evals[0]["dev_loss"] - 0.4
    assert main(["eval", *args, "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(figures["dev_bpb"])
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    (blimp / "p.jsonl").write_text(json.dumps({"sentence_good": "the cat sat .", "sentence_bad": "cat the sat .",
                                               "field": "syntax", "UID": "p"}) + "\n")
    assert main(["blimp", *args, "--blimp", str(blimp), "--quiet", "--metrics-json", str(metrics)]) == 0
    # the pair is right iff the good sentence is likelier: each scored here as a document after
    # "<pad> <pad> <pad> <eod>", float64 log-softmax of the trained weights' logits, token by token
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, width=16, layers=1, heads=2, context_tokens=4,
                               max_len=40, block="gpt", output_bias=True)
    params, _ = load_params(run, config)
    scores = []
    for sentence in ("the cat sat .", "cat the sat ."):
        ids = tiny_workdir.tokenizer().encode(sentence, add_special_tokens=False).ids
        window = np.asarray([PAD_ID] * 3 + [EOD_ID] + ids, np.int32)
        z = np.asarray(model_logits(config, params, jnp.asarray(window[None])), np.float64)[0]
        log_probs = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        scores.append(sum(log_probs[3 + t, token] for t, token in enumerate(ids)))
    assert abs(scores[0] - scores[1]) > 1e-3                              # not a tie that rounding could flip
    assert json.loads(metrics.read_text())["blimp_accuracy"] == float(scores[0] > scores[1])
    capsys.readouterr()
    # explicit init of the transformer solves factors from the training split (tests/test_residual.py);
    # a held-out tail as long as the whole split is refused with a clear error
    assert main(["train", *args, "--init", "explicit", "--model", "transformer", "--holdout-tokens", "1000000"]) == 2
    assert "covers the whole training split" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["transformer", "saffu"])
def test_greedy_generation_continues_the_prompt_as_a_whole_sequence_forward_does(tiny_workdir, kind):
    """``generate(..., prompt=P, top_k=1)`` — the transformer through its key/value cache, SAFFU
    by a window of its context — against a float64 greedy reference that feeds the whole
    ``<eod> P …`` sequence to the model each step, its ``<eod>`` at position ``context − 1`` (where
    evaluation puts a document start), and takes the best non-``<pad>`` token: the same text."""
    from saffu.data.tokenizer import decode
    from saffu.eval.scoring import cached, generate
    V = tiny_workdir.vocab_size
    config = {"transformer": TransformerConfig(V, width=16, layers=2, heads=2, context_tokens=24, max_len=64,
                                               block="gpt", output_bias=True),
              "saffu": SaffuConfig(V, bits=10, radius=4, heads=1)}[kind]
    params = model_init(config, jax.random.key(5))
    assert cached(config, 20) == (kind == "transformer")
    tokenizer, prompt = tiny_workdir.tokenizer(), "the cat"
    sequence = [EOD_ID, *tokenizer.encode(prompt).ids]
    forward = jax.jit(lambda tokens: model_logits(config, params, tokens))     # one shape: compiled once
    for _ in range(6):
        lead = [PAD_ID] * (config.context - 1)
        padded = lead + sequence + [PAD_ID] * (16 - len(sequence))            # causal: the pads after are unseen
        logits = np.asarray(forward(jnp.asarray([padded], jnp.int32)), np.float64)[0, len(lead) + len(sequence) - 1]
        logits[PAD_ID] = -np.inf
        token = int(np.argmax(logits))
        if token == EOD_ID:
            break
        sequence.append(token)
    texts = generate(params, config, tokenizer, jax.random.key(0), num_samples=2, max_tokens=6, top_k=1,
                     prompt=prompt)
    assert texts == [decode(tokenizer, sequence[1:])] * 2
    assert texts[0].startswith(prompt)


def test_the_key_value_cache_gives_the_whole_sequence_logits():
    """:func:`decode_step`, one position at a time, equals the whole-sequence forward at every
    position (two documents in a row: attention stays inside each, or with ``across_documents``
    sees the earlier one too), with and without an output bias; float32 on both sides, tolerance 1e-5."""
    from saffu.models.transformer import decode_cache, decode_step
    tokens = jnp.asarray([[EOD_ID, 5, 7, 9, EOD_ID, 3, 4, 8, 2, EOD_ID, 6],
                          [EOD_ID, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], jnp.int32)
    step = jax.jit(decode_step, static_argnums=1)
    for bias, block, across in ((True, "gpt", False), (False, "gpt", False), (True, "llama", False),
                                (False, "llama", True), (True, "gpt", True)):
        config = TransformerConfig(50, width=16, layers=2, heads=2, context_tokens=4, max_len=16, output_bias=bias,
                                   block=block, across_documents=across)
        params = model_init(config, jax.random.key(0))
        cache, rows = decode_cache(config, 2), []
        for t in range(tokens.shape[1]):
            logits, cache = step(params, config, cache, tokens[:, t])
            rows.append(np.asarray(logits))
        np.testing.assert_allclose(np.stack(rows, 1), np.asarray(model_logits(config, params, tokens)), atol=1e-5)
    # the second document of the first row sees the first only across documents
    local = model_logits(dataclasses.replace(config, across_documents=False), params, tokens)
    assert not np.allclose(np.asarray(local)[0, 4:], np.asarray(rows)[4:, 0], atol=1e-3)
    np.testing.assert_allclose(np.asarray(local)[0, :4], np.stack(rows, 1)[0, :4], atol=1e-5)
    config = dataclasses.replace(config, across_documents=False)
    # a cache that starts at position 3: the forward of the same tokens behind 3 unseen pads
    cache, rows = decode_cache(config, 2, start=3), []
    for t in range(tokens.shape[1] - 3):
        logits, cache = step(params, config, cache, tokens[:, t])
        rows.append(np.asarray(logits))
    behind = jnp.concatenate([jnp.full((2, 3), PAD_ID, jnp.int32), tokens[:, :-3]], axis=1)
    np.testing.assert_allclose(np.stack(rows, 1), np.asarray(model_logits(config, params, behind))[:, 3:], atol=1e-5)
    with pytest.raises(SaffuError, match="dense transformer"):
        decode_step(params, TransformerConfig(50, width=16, layers=1, heads=2, context_tokens=4, max_len=16,
                                              ffn="lowrank", block="gpt", output_bias=True), cache, tokens[:, 0])


def _dot_operand_dtypes(fn, *args) -> set[tuple[str, ...]]:
    """The operand dtypes of every ``dot_general`` in ``fn``'s jaxpr (nested jaxprs included)."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_a_bf16_forward_multiplies_in_bf16_and_stays_close_to_float32():
    """``--compute-dtype bfloat16`` casts the weights; every product of the forward must then
    take bf16 operands (the token embedding lookup once promoted everything back to float32)."""
    config = TransformerConfig(vocab_size=40, **SMALL)
    params = model_init(config, jax.random.key(0))
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 40, (2, 12)), jnp.int32)
    logits = lambda p, t: model_logits(config, p, t)
    assert _dot_operand_dtypes(logits, half, tokens) == {("bfloat16", "bfloat16")}
    assert _dot_operand_dtypes(logits, params, tokens) == {("float32", "float32")}
    # close to the float32 forward of the same (bf16-rounded) weights: logits of order 1, bf16's
    # 8-bit mantissa over 2 blocks
    rounded = jax.tree.map(lambda x: x.astype(jnp.float32), half)
    np.testing.assert_allclose(np.asarray(logits(half, tokens), np.float32), np.asarray(logits(rounded, tokens)),
                               atol=0.1)
