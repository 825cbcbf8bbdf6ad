"""Scoring and sampling any model with the shared interface (SAFFU, the transformer, the
bigram layer): bits per byte on a split (whole, or a spread sample of whole documents), and
text generation. Run directories (configs, explicit solutions, checkpoints) are
:mod:`saffu.training.checkpoints`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from saffu._io import SaffuError
from saffu.configs import EvalConfig, GenerateConfig, TransformerConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID, decode
from saffu.data.windows import total_nll
from saffu.data.workdir import WorkDir
from saffu.eval.metrics import split_metrics
from saffu.models.interface import model_logits, positional, read_alone, target_loss
from saffu.models.saffu import Params, SaffuConfig

#: Windows per evaluation call: ``2 × (context + eval_seq_len)`` positions, whose float32
#: logits (``× V``) stay near 16 MB at ``V = 8192``; on CPU smaller calls run faster per token
#: than 16 windows (activations and logits stay in cache; ``experiments/bench_scoring.py``).
EVAL_BATCH = 2

#: The loss of a batch of windows (:func:`saffu.models.interface.target_loss`: logits at the
#: predicting positions only, ``logsumexp − logit`` without a log-softmax array) with the
#: parameters as arguments (not compile-time constants) and the model config static: one
#: compilation per config and window shape, shared by every evaluation of the process.
_window_loss = jax.jit(target_loss, static_argnums=1)


def evaluate_split(params: Params, config: SaffuConfig, workdir: WorkDir, split: str,
                   max_tokens: int | None = None, progress: bool = True, prefix: str | None = None,
                   batch_size: int = EVAL_BATCH) -> dict:
    """Loss, perplexity, bits per byte and per-word perplexity of ``split``.

    All of it when ``max_tokens`` is None or 0 (or covers the split); otherwise whole
    documents totalling about ``max_tokens`` targets, drawn from evenly spaced blocks of the
    split (:meth:`saffu.data.workdir.WorkDir.sample_documents`, so every source file counts, not
    only the first) with their exact bytes and words. Besides ``{prefix}loss``, ``ppl``,
    ``bpb`` and ``word_ppl`` the figures hold ``{prefix}tokens`` (targets scored, ``<eod>``
    included), ``{prefix}documents`` and ``{prefix}whole_split``. ``prefix`` defaults to
    ``"{split}_"``.

    The cost is the model's forward pass over ``batch_size`` windows of ``config.context +
    config.eval_seq_len`` tokens per call (a short range's last window shortened when that
    saves enough, :func:`saffu.data.windows.window_plan`), with the output layer at predicting
    positions only and no log-softmax array (:func:`saffu.models.interface.target_loss`); for a
    SAFFU stack on CPU nearly all of it is the ``V``-wide output matmul. A document's scores do
    not depend on what precedes it or where it sits (SAFFU windows and the transformer's
    attention stop at ``<eod>``; a transformer's windows start at documents and give every
    document's tokens the positions they have from its ``<eod>`` at ``context − 1``, a long
    document continuing in windows of ``eval_seq_len`` targets behind ``context`` of its own
    tokens: :func:`saffu.data.windows.document_ranges`), so a sample scores each document
    exactly as the whole split does.
    """
    if max_tokens is not None and max_tokens < 0:
        raise SaffuError(f"--eval-tokens must be ≥ 0 (0: whole splits), got {max_tokens}")
    stream = workdir.tokens(split)
    ranges, info = workdir.sample_documents(split, max_tokens or len(stream))
    positioned = positional(config)
    loss = lambda windows, mask, *positions: _window_loss(params, config, windows, mask, None, *positions)
    nll, count = total_nll(loss, stream, ranges, config.context, config.eval_seq_len, batch_size,
                           progress=f"eval {split}" if progress else None, positioned=positioned)
    if count != info["predicted_tokens"]:
        raise SaffuError(f"scored {count} targets of {split} but expected {info['predicted_tokens']}; "
                         f"the work directory is damaged, run `saffu prepare` again")
    prefix = f"{split}_" if prefix is None else prefix
    return {**split_metrics(nll, info, prefix), f"{prefix}tokens": count,
            f"{prefix}documents": int(info["documents"]), f"{prefix}whole_split": ranges == [(1, len(stream))]}


def document_nll(params: Params, config, documents: list[list[int]], batch_size: int = EVAL_BATCH) -> np.ndarray:
    """Each document's negative log-likelihood, ``float64[N]`` nats, scored as :func:`evaluate_split`
    scores a document of a split: its tokens ``int`` (a closing ``<eod>`` included if it is
    there) read after an ``<eod>``, in windows of ``config.eval_seq_len`` targets, a long
    document continuing behind ``config.context`` of its own tokens, with the positions a
    document has in a split (:func:`saffu.data.windows.document_ranges`). Summed over a split's
    documents (each with its closing ``<eod>``) it is the split's NLL for a model that reads each
    document alone (a transformer across documents reads a split's earlier documents too, and
    here nothing before the ``<eod>``: :func:`~saffu.models.interface.read_alone`); an empty
    document scores 0."""
    config = read_alone(config)
    loss = lambda windows, mask, *positions: _window_loss(params, config, windows, mask, None, *positions)
    positioned, out = positional(config), np.zeros(len(documents))
    for number, ids in enumerate(documents):
        if len(ids):
            stream = np.asarray([EOD_ID, *ids], np.int32)
            out[number] = total_nll(loss, stream, [(1, len(stream))], config.context, config.eval_seq_len,
                                    batch_size, tight=False, positioned=positioned)[0]
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _sample_next(params: Params, config, top_k: int, windows: jax.Array, key: jax.Array,
                 temperature: jax.Array) -> jax.Array:
    """The next token of every window, ``int32[B]``, from ``softmax(logits / temperature)``
    restricted to the ``top_k`` most likely tokens (all for 0), never ``<pad>``; the weights
    are arguments, so one compilation serves every call of a config and shape."""
    return _pick(model_logits(config, params, windows)[:, -1], top_k, key, temperature)


def _pick(logits: jax.Array, top_k: int, key: jax.Array, temperature: jax.Array) -> jax.Array:
    """A token of each row of ``logits float[B, V]`` from ``softmax(logits / temperature)`` over
    its ``top_k`` most likely tokens (all for 0), never ``<pad>``: ``int32[B]``."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        threshold = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    logits = logits.at[:, PAD_ID].set(-jnp.inf)
    return jax.random.categorical(key, logits)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _cached_samples(params: Params, config, top_k: int, steps: int, start: jax.Array, key: jax.Array,
                    temperature: jax.Array) -> jax.Array:
    """``steps`` sampled tokens ``int32[B, steps]`` after ``start int32[B, S]`` with the
    transformer's key/value cache (:func:`saffu.models.transformer.decode_step`): the start read
    in one scan from position ``context − 1`` (where evaluation puts a document's ``<eod>``), then
    one position per new token, all in one executable (no host read per token)."""
    from saffu.models.transformer import decode_cache, decode_step
    cache = decode_cache(config, start.shape[0], config.context - 1)
    read = lambda cache, tokens: decode_step(params, config, cache, tokens)[::-1]    # (cache, logits)
    cache, logits = jax.lax.scan(read, cache, start.T)

    def sample(carry, step_key):
        cache, logits = carry
        token = _pick(logits, top_k, step_key, temperature)
        logits, cache = decode_step(params, config, cache, token)
        return (cache, logits), token

    _, tokens = jax.lax.scan(sample, (cache, logits[-1]), jax.random.split(key, steps))
    return tokens.T


def cached(config, positions: int) -> bool:
    """Whether :func:`generate` samples ``config`` with the key/value cache: a dense transformer
    whose ``max_len`` holds the ``positions`` (start and new tokens) after its ``context − 1``
    leading ones; else by whole windows."""
    return (isinstance(config, TransformerConfig) and config.ffn == "dense" and not config.guide_share
            and config.context - 1 + positions <= config.max_len)


def generate(params: Params, config: SaffuConfig, tokenizer, key: jax.Array,
             num_samples: int = GenerateConfig.num_samples, max_tokens: int = GenerateConfig.max_tokens,
             temperature: float = GenerateConfig.temperature, top_k: int = GenerateConfig.top_k,
             prompt: str = GenerateConfig.prompt) -> list[str]:
    """Sample documents: each starts after an ``<eod>`` (a document start), continues ``prompt``
    (its BPE tokens follow the ``<eod>``) and stops at the next ``<eod>`` or after
    ``max_tokens`` new tokens, from the ``top_k`` most likely tokens (``0``: the full
    distribution). Returns ``num_samples`` texts, each the prompt and its continuation
    (:func:`generate_ids` decoded). The defaults are :class:`saffu.configs.GenerateConfig`'s
    (``saffu generate``'s)."""
    prompt_ids = tokenizer.encode(prompt).ids if prompt else []
    samples = generate_ids(params, config, prompt_ids, key, num_samples, max_tokens, temperature, top_k)
    return [decode(tokenizer, [*prompt_ids, *ids]) for ids in samples]


def generate_ids(params: Params, config: SaffuConfig, prompt_ids, key: jax.Array,
                 num_samples: int = GenerateConfig.num_samples, max_tokens: int = GenerateConfig.max_tokens,
                 temperature: float = GenerateConfig.temperature, top_k: int = GenerateConfig.top_k) -> list[list[int]]:
    """The new token ids of :func:`generate`'s samples after ``<eod>`` and ``prompt_ids`` (each
    up to ``max_tokens``, without the closing ``<eod>``). A dense transformer (:func:`cached`)
    reads the whole sample so far through its key/value cache, one position per new token, in
    one jitted scan; another model reads the last ``config.context`` tokens in a window per new
    token (one forward pass and host read each)."""
    if temperature <= 0:
        raise SaffuError("--temperature must be > 0")
    R = config.context
    start = [EOD_ID, *prompt_ids]
    if cached(config, len(start) + max_tokens):
        tokens = np.asarray(_cached_samples(params, config, top_k, max_tokens,
                                            jnp.asarray([start] * num_samples, jnp.int32), key, jnp.float32(temperature)))
        return [row[:row.index(EOD_ID)] if EOD_ID in row else row for row in tokens.tolist()]
    windows = np.full((num_samples, R + 1 + len(start)), PAD_ID, np.int32)
    windows[:, -len(start):] = start
    windows = windows[:, -(R + 1):]
    outputs = [[] for _ in range(num_samples)]
    finished = np.zeros(num_samples, bool)
    for step_key in jax.random.split(key, max_tokens):
        tokens = np.asarray(_sample_next(params, config, top_k, jnp.asarray(windows), step_key,
                                         jnp.float32(temperature)))
        for i, token in enumerate(tokens):
            if not finished[i]:
                if token == EOD_ID:
                    finished[i] = True
                else:
                    outputs[i].append(int(token))
        if finished.all():
            break
        windows = np.concatenate([windows[:, 1:], tokens[:, None].astype(np.int32)], axis=1)
    return outputs


def score_splits(params, config, workdir, splits=None, eval_tokens: int = EvalConfig.eval_tokens,
                 progress: bool = False, say: Callable[[str], None] = lambda message: None) -> dict:
    """Figures of every non-training split of ``workdir`` (or ``splits``) under ``config`` with
    ``params`` (:func:`saffu.eval.scoring.evaluate_split`): about ``eval_tokens`` tokens of
    whole documents each (0: every token)."""
    limit, metrics = eval_tokens or None, {}
    for split in splits or workdir.eval_splits:
        total = workdir.split_info(split)["predicted_tokens"]
        say(f"evaluating {split}: all {total:,} tokens" if limit is None or limit >= total else
            f"evaluating {split}: about {limit:,} of its {total:,} tokens, whole documents from evenly spaced parts "
            f"of it (--eval-tokens 0 scores all)")
        metrics.update(evaluate_split(params, config, workdir, split, limit, progress))
    return metrics
