"""A trained saffu transformer as a Hugging Face checkpoint (``saffu export``): the gpt block
as ``GPT2LMHeadModel``, the llama block as ``LlamaForCausalLM``.

The gpt block is GPT-2's architecture (pre-norm blocks, learned absolute positions, ``gelu_new``
MLP, biased attention projections, a final LayerNorm); the llama block is Llama's (RMSNorm,
rotary positions in the rotate-half layout, SwiGLU, no biases). The differences:

* saffu's output layer is untied and may have a bias. Neither architecture has an output bias,
  so a run trained with ``--output-bias`` does not export (the default has none); the
  untied output becomes ``lm_head.weight`` with ``tie_word_embeddings = false``.
* saffu reads a document from position ``context − 1`` (its ``<eod>`` there, the first position
  training predicts from; :mod:`saffu.eval.blimp`, :mod:`saffu.eval.continuations`,
  ``saffu generate``); Hugging Face from position 0. The gpt block's position table is written
  from row ``context − 1`` on (``n_positions = max_len − context + 1``), so a text read from
  position 0 there gets saffu's logits; rotary positions need no shift (only distances count).
* Hugging Face's attention is plainly causal, as saffu's is by default (``across_documents``):
  they agree on every input. A run trained with ``--no-across-documents`` never attends across an
  ``<eod>``; its export agrees with it on every input that holds one document (how BabyLM's
  evaluation scores), and its model card says so.

The checkpoint is ``config.json``, ``model.safetensors`` (PyTorch names; GPT-2's ``Conv1D``
weights stored ``[in, out]``), ``generation_config.json`` and the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``; the tokenizer puts
``<eod>`` in front of a text, as saffu reads every document after one), loadable by
``transformers.AutoModelForCausalLM.from_pretrained(DIR)``. :func:`gpt2_logits` and
:func:`llama_logits` are independent float64 NumPy forwards of the two architectures (the round
trip's references).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np

from saffu._io import FILE_MODE, SaffuError, atomic_write_json, probe_writable
from saffu.configs import ResidualConfig, TransformerConfig
from saffu.data.tokenizer import EOD_ID, EOD_TOKEN, PAD_ID, PAD_TOKEN
from saffu.models.transformer import ROPE_BASE

#: nnx.LayerNorm's epsilon, written as GPT-2's ``layer_norm_epsilon``.
LAYER_NORM_EPSILON = 1e-6
#: nnx.RMSNorm's epsilon, written as Llama's ``rms_norm_eps``.
RMS_NORM_EPSILON = 1e-6


def exportable(config) -> None:
    """One :class:`SaffuError` line when ``config`` cannot be written as GPT-2."""
    if isinstance(config, ResidualConfig):
        raise SaffuError("a residual run is its exact tables plus a transformer; it has no plain-model form to "
                         "export (export a transformer run, trained without --residual)")
    if not isinstance(config, TransformerConfig):
        raise SaffuError(f"a {config.kind} run has no Hugging Face architecture; export a transformer run")
    if config.output_bias:
        raise SaffuError("this transformer's output layer has a bias, which GPT-2 and Llama lack; train it with "
                         "--no-output-bias (the default) to export it")
    if config.ffn != "dense" or config.guide_share:
        raise SaffuError(f"a structured MLP (--ffn {config.ffn}) has no Hugging Face form; export a dense transformer")


def hf_config(config) -> dict:
    """``config.json`` of the Hugging Face model of ``config``'s block and shape."""
    return gpt2_config(config) if config.block == "gpt" else llama_config(config)


def hf_state(params, config) -> dict[str, np.ndarray]:
    """saffu transformer params → the Hugging Face ``state_dict`` arrays of its block (float32)."""
    return gpt2_state(params, config) if config.block == "gpt" else llama_state(params, config)


def gpt2_config(config) -> dict:
    """``config.json`` of a GPT-2 with ``config``'s shape (:class:`saffu.configs.TransformerConfig`)."""
    positions = config.max_len - config.context + 1        # saffu's rows context − 1 … max_len − 1
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": positions, "n_ctx": positions, "n_embd": config.width,
            "n_layer": config.layers, "n_head": config.heads, "n_inner": config.mlp_ratio * config.width,
            "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPSILON,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "tie_word_embeddings": False, "bos_token_id": EOD_ID, "eos_token_id": EOD_ID,
            "pad_token_id": PAD_ID, "torch_dtype": "float32"}


def gpt2_state(params, config) -> dict[str, np.ndarray]:
    """saffu transformer params → GPT-2 ``state_dict`` arrays (float32, PyTorch names); the
    position table from saffu's row ``context − 1`` (a document's ``<eod>``) on."""
    d = config.width
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
    state = {"transformer.wte.weight": f32(params["embed"]["embedding"]),
             "transformer.wpe.weight": f32(np.asarray(params["positions"])[config.context - 1:]),
             "transformer.ln_f.weight": f32(params["final_norm"]["scale"]),
             "transformer.ln_f.bias": f32(params["final_norm"]["bias"]),
             "lm_head.weight": f32(np.asarray(params["output"]["kernel"]).T)}
    for i in range(config.layers):
        block, name = params["blocks"][i], f"transformer.h.{i}"
        attention = block["attention"]
        qkv = [np.asarray(attention[k]["kernel"]).reshape(d, d) for k in ("query", "key", "value")]
        state.update({
            f"{name}.ln_1.weight": f32(block["attention_norm"]["scale"]),
            f"{name}.ln_1.bias": f32(block["attention_norm"]["bias"]),
            f"{name}.attn.c_attn.weight": f32(np.concatenate(qkv, axis=1)),
            f"{name}.attn.c_attn.bias": f32(np.concatenate([np.asarray(attention[k]["bias"]).reshape(d)
                                                            for k in ("query", "key", "value")])),
            f"{name}.attn.c_proj.weight": f32(np.asarray(attention["out"]["kernel"]).reshape(d, d)),
            f"{name}.attn.c_proj.bias": f32(attention["out"]["bias"]),
            f"{name}.ln_2.weight": f32(block["mlp_norm"]["scale"]),
            f"{name}.ln_2.bias": f32(block["mlp_norm"]["bias"]),
            f"{name}.mlp.c_fc.weight": f32(block["mlp_in"]["kernel"]),
            f"{name}.mlp.c_fc.bias": f32(block["mlp_in"]["bias"]),
            f"{name}.mlp.c_proj.weight": f32(block["mlp_out"]["kernel"]),
            f"{name}.mlp.c_proj.bias": f32(block["mlp_out"]["bias"]),
        })
    return state


def llama_config(config) -> dict:
    """``config.json`` of a Llama with ``config``'s shape (the llama block of :class:`saffu.configs.TransformerConfig`)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.width, "intermediate_size": config.mlp_hidden, "num_hidden_layers": config.layers,
            "num_attention_heads": config.heads, "num_key_value_heads": config.heads,
            "head_dim": config.width // config.heads, "hidden_act": "silu", "max_position_embeddings": config.max_len,
            "rms_norm_eps": RMS_NORM_EPSILON, "rope_theta": ROPE_BASE,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "bos_token_id": EOD_ID, "eos_token_id": EOD_ID, "pad_token_id": PAD_ID, "torch_dtype": "float32"}


def llama_state(params, config) -> dict[str, np.ndarray]:
    """saffu llama-block params → Llama ``state_dict`` arrays (float32, PyTorch names: ``nn.Linear``
    weights stored ``[out, in]``)."""
    d = config.width
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
    linear = lambda layer: f32(np.asarray(layer["kernel"]).T)
    state = {"model.embed_tokens.weight": f32(params["embed"]["embedding"]),
             "model.norm.weight": f32(params["final_norm"]["scale"]),
             "lm_head.weight": linear(params["output"])}
    for i in range(config.layers):
        block, name = params["blocks"][i], f"model.layers.{i}"
        attention = block["attention"]
        projection = lambda key, attention=attention: f32(np.asarray(attention[key]["kernel"]).reshape(d, d).T)
        state.update({
            f"{name}.input_layernorm.weight": f32(block["attention_norm"]["scale"]),
            f"{name}.self_attn.q_proj.weight": projection("query"),
            f"{name}.self_attn.k_proj.weight": projection("key"),
            f"{name}.self_attn.v_proj.weight": projection("value"),
            f"{name}.self_attn.o_proj.weight": f32(np.asarray(attention["out"]["kernel"]).reshape(d, d).T),
            f"{name}.post_attention_layernorm.weight": f32(block["mlp_norm"]["scale"]),
            f"{name}.mlp.gate_proj.weight": linear(block["mlp_gate"]),
            f"{name}.mlp.up_proj.weight": linear(block["mlp_in"]),
            f"{name}.mlp.down_proj.weight": linear(block["mlp_out"]),
        })
    return state


#: The files of an export; a folder holding these alone is an earlier export, which a new one replaces.
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json", "README.md"})


def model_card(run: str | Path, workdir, config, weights: str) -> str:
    """The export's ``README.md``: what the model is and how it was made, from the run's own
    files (``config.json``, ``train.json``, ``metrics.jsonl``, ``words.json``, a ``result.json``
    of ``--metrics-json``): data, words seen, start, tokenizer, training and its dev figures."""
    run = Path(run)
    read = lambda name: json.loads((run / name).read_text()) if (run / name).is_file() else None
    record, trained = read("config.json") or {}, read("train.json")
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    words = read("words.json")
    split = workdir.meta["splits"][workdir.train_split]
    architecture = "GPT2LMHeadModel" if config.block == "gpt" else "LlamaForCausalLM"
    lines = [f"# {run.name}: a saffu {config.block}-block transformer", "",
             f"A language model trained with saffu and exported as a Hugging Face `{architecture}` "
             f"({weights}).", "", "## Data", "",
             f"- corpus: {record.get('corpus', workdir.meta.get('corpus', '?'))}, training split "
             f"`{workdir.train_split}`: {split.get('words', 0):,} whitespace words, {split['tokens']:,} tokens, "
             f"{split.get('documents', 0):,} documents",
             f"- tokenizer: byte-level BPE of {config.vocab_size:,} tokens trained on that split; `<eod>` "
             f"(id {EOD_ID}) opens every document and the tokenizer puts it in front of a text"]
    if trained:
        start, train = trained["start"], trained["train"]
        lines += ["", "## Training", "",
                  f"- start: {start.get('init')}" + (" (explicit, closed-form weights solved from the data's "
                                                     "statistics: one pass over it)" if start.get("init") == "explicit"
                                                     else " (random init)" if start.get("init") == "random" else ""),
                  f"- AdamW: learning rate {train['learning_rate']:g} (warm-up {train['warmup_steps']} steps, "
                  f"cosine), weight decay {train['weight_decay']:g}, dropout {train['dropout']:g}, "
                  f"batch {train['batch_size']} × {train['seq_len']} tokens, seed {train['seed']}",
                  f"- command: `{trained['command']}`"]
    lines += ["", "## Model", "",
              f"- width {config.width}, {config.layers} layers, {config.heads} heads, "
              f"{config.context_tokens} tokens of context before the first prediction of a window"]
    if history:
        last = history[-1]
        lines += ["", "## Figures", "", f"- trained {last['step']:,} steps, {last['tokens']:,} target tokens",
                  f"- dev loss on evenly spaced windows at the last evaluation: {last['dev_loss']:.4f} nats/token"]
    result = read("result.json")
    if result and "dev_bpb" in result:
        lines.append(f"- whole dev split: {result['dev_bpb']:.4f} bits per byte, {result['dev_loss']:.4f} nats/token")
    if words and words["milestones"]:
        kept = ", ".join(f"{m['label']} (step {m['step']:,})" for m in words["milestones"])
        lines += ["", "## Checkpoints by words seen", "",
                  f"- kept in the run (export one with `saffu export --words N`): {kept}"]
    lines += ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH)", "tokenizer = AutoTokenizer.from_pretrained(PATH)",
              "```", ""]
    if not config.across_documents:
        lines += ["This run's attention never crossed an `<eod>` (`--no-across-documents`); give the model one "
                  "document at a time.", ""]
    return "\n".join(lines)


def check_out(out: Path) -> None:
    """Refuse an ``--out`` an export would damage: a file, a saffu run (its ``config.json`` would
    be overwritten and the run lost) or a folder holding files an export does not write. An
    empty folder or an earlier export is fine."""
    if out.exists() and not out.is_dir():
        raise SaffuError(f"--out {out} is a file; give a folder")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not names:
        return
    config = out / "config.json"
    try:
        is_run = config.is_file() and "model" in json.loads(config.read_text())
    except ValueError:
        is_run = False
    if is_run or (out / "checkpoints").exists() or (out / "explicit").exists():
        raise SaffuError(f"--out {out} holds a saffu run, which the export would overwrite; export into a new folder")
    foreign = sorted(names - EXPORT_FILES)
    if foreign:
        raise SaffuError(f"--out {out} holds files an export does not write ({', '.join(foreign[:5])}"
                         f"{', …' if len(foreign) > 5 else ''}); export into a new or empty folder")


def _tokenizer_with_leading_eod(tokenizer_json: str | Path) -> dict:
    """saffu's tokenizer as ``tokenizer.json``, with a post-processor that puts ``<eod>`` in front
    of every text (``add_special_tokens=True``, the Hugging Face default): saffu reads every
    document after an ``<eod>``, so a plain prompt then gets the context saffu gives it."""
    tokenizer = json.loads(Path(tokenizer_json).read_text())
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": EOD_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": EOD_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": EOD_TOKEN, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {EOD_TOKEN: {"id": EOD_TOKEN, "ids": [EOD_ID], "tokens": [EOD_TOKEN]}}}
    tokenizer["post_processor"] = template
    return tokenizer


def export_hf(params, config, tokenizer_json: str | Path, out: str | Path, card: str | None = None) -> dict:
    """Write the checkpoint (see the module docstring) to ``out``; returns what was written.

    The files are written into a private folder beside ``out`` and moved into place at the end
    (an earlier export there is replaced; anything else refused by :func:`check_out`), each
    readable as the user's umask allows; no lock or temporary file is left in ``out``. ``card``:
    the model card written as ``README.md`` (:func:`model_card`)."""
    from safetensors.numpy import save_file
    exportable(config)
    out = Path(out)
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    probe_writable(out, "--out", directory=True)
    state = hf_state(params, config)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.export-") as tmp:
        staging = Path(tmp) / "export"
        staging.mkdir()
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(staging / "config.json", hf_config(config))
        atomic_write_json(staging / "generation_config.json", {"bos_token_id": EOD_ID, "eos_token_id": EOD_ID,
                                                               "pad_token_id": PAD_ID})
        atomic_write_json(staging / "tokenizer.json", _tokenizer_with_leading_eod(tokenizer_json))
        specials = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}   # byte-level BPE: no unknowns
        atomic_write_json(staging / "special_tokens_map.json", specials)
        atomic_write_json(staging / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "model_max_length": config.max_len - config.context + 1,
                                                              "add_prefix_space": False, **specials})
        if card is not None:
            (staging / "README.md").write_text(card)
        for path in staging.iterdir():
            path.chmod(FILE_MODE)
        check_out(out)                               # still nothing but an earlier export there
        if out.exists():
            out.replace(Path(tmp) / "earlier")       # removed with the temporary folder
        staging.replace(out)
    return {"out": str(out), "architecture": hf_config(config)["architectures"][0], "tensors": len(state),
            "parameters": int(sum(v.size for v in state.values())), "files": sorted(p.name for p in out.iterdir())}


def _layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gpt2_logits(state: dict[str, np.ndarray], config: dict, tokens: np.ndarray) -> np.ndarray:
    """GPT-2's forward in float64 NumPy from a checkpoint's arrays and ``config.json``:
    ``int[B, S] -> float64[B, S, V]`` (plain causal attention, no dropout)."""
    s = {k: np.asarray(v, np.float64) for k, v in state.items()}
    B, S = tokens.shape
    d, heads, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    hd = d // heads
    x = s["transformer.wte.weight"][tokens] + s["transformer.wpe.weight"][np.arange(S)][None]
    causal = np.tril(np.ones((S, S), bool))
    for i in range(config["n_layer"]):
        p = lambda n, i=i: s[f"transformer.h.{i}.{n}"]
        h = _layer_norm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
        q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
        split = lambda t: t.reshape(B, S, heads, hd).transpose(0, 2, 1, 3)
        scores = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        mixed = (weights @ split(v)).transpose(0, 2, 1, 3).reshape(B, S, d)
        x = x + mixed @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = _layer_norm(x, p("ln_2.weight"), p("ln_2.bias"), eps)
        x = x + _gelu_new(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")) @ p("mlp.c_proj.weight") \
            + p("mlp.c_proj.bias")
    x = _layer_norm(x, s["transformer.ln_f.weight"], s["transformer.ln_f.bias"], eps)
    return x @ s["lm_head.weight"].T


def _rms_norm(x, weight, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * weight


def _rotate_half(x, positions, theta):
    """Llama's rotary embedding of ``x [B, H, S, k]`` at ``positions [S]`` (the rotate-half layout)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) / half)[None]                     # [S, k/2]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def llama_logits(state: dict[str, np.ndarray], config: dict, tokens: np.ndarray) -> np.ndarray:
    """Llama's forward in float64 NumPy from a checkpoint's arrays and ``config.json``:
    ``int[B, S] -> float64[B, S, V]`` (plain causal attention, positions ``0 … S − 1``)."""
    s = {k: np.asarray(v, np.float64) for k, v in state.items()}
    B, S = tokens.shape
    d, heads, eps = config["hidden_size"], config["num_attention_heads"], config["rms_norm_eps"]
    hd = d // heads
    x = s["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((S, S), bool))
    split = lambda t: t.reshape(B, S, heads, hd).transpose(0, 2, 1, 3)
    for i in range(config["num_hidden_layers"]):
        p = lambda n, i=i: s[f"model.layers.{i}.{n}"]
        h = _rms_norm(x, p("input_layernorm.weight"), eps)
        q, k, v = (split(h @ p(f"self_attn.{n}_proj.weight").T) for n in "qkv")
        q, k = (_rotate_half(t, np.arange(S, dtype=np.float64), config["rope_theta"]) for t in (q, k))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x + (weights @ v).transpose(0, 2, 1, 3).reshape(B, S, d) @ p("self_attn.o_proj.weight").T
        h = _rms_norm(x, p("post_attention_layernorm.weight"), eps)
        gate = h @ p("mlp.gate_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return _rms_norm(x, s["model.norm.weight"], eps) @ s["lm_head.weight"].T


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """``(state arrays, config.json)`` of an exported checkpoint folder."""
    from safetensors.numpy import load_file
    path = Path(path)
    return load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())
