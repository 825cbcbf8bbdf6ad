"""penzai's transformers behind saffu's model interface, so saffu's trainer, scoring and
:func:`saffu.interop.explicit_init` work on a model saffu did not write
(``pip install -e '.[models]'``).

:class:`PenzaiModel` builds penzai's Llama-like transformer (``llama``: RMSNorm, RoPE, SwiGLU;
untied, or one matrix for the embeddings and the output with ``tied``) or its GPT-NeoX
(``neox``: LayerNorm, parallel attention and MLP, partial RoPE, GELU). Its parameters, penzai's
``ParameterValue`` s, become a plain dict ``{label: float32 array}`` (the named axes in penzai's
order), which the trainer optimises like any parameter tree and :func:`explicit_init` addresses by
label (:meth:`PenzaiModel.selectors`)::

    from saffu.interop import explicit_init, solve_pieces
    from saffu.interop.penzai import PenzaiModel
    from saffu.models.interface import model_init
    model = PenzaiModel("llama", vocab_size=8192)
    params = model_init(model, jax.random.key(0))
    params = explicit_init(params, solve_pieces(workdir, 128), embedding_rms=1.0, **model.selectors())
"""

from __future__ import annotations

import dataclasses

from saffu._io import SaffuError

FAMILIES = ("llama", "neox")


def _penzai():
    try:
        import penzai
    except ImportError:
        raise SaffuError("penzai is not installed: pip install -e '.[models]'") from None
    return penzai


@dataclasses.dataclass(frozen=True)
class PenzaiModel:
    """A penzai transformer: params ``{label: float32 array}``,
    ``logits(params, tokens int32[B, S]) -> float32[B, S, V]``, position ``p`` predicting ``p + 1``.

    Attributes:
      family: ``"llama"`` or ``"neox"``.
      vocab_size: ``V``.
      width: the model width ``d``.
      layers: decoder blocks.
      heads: attention heads (each ``d / heads`` wide).
      mlp: the MLP's hidden width (the Llama-like SwiGLU takes two thirds of it, so its weights
        match a plain MLP's).
      tied: one matrix for the embeddings and the output (``llama`` only).
      context_tokens: left context before a window's targets when training and scoring.
    """

    family: str
    vocab_size: int
    width: int = 128
    layers: int = 5
    heads: int = 4
    mlp: int = 512
    tied: bool = False
    context_tokens: int = 32
    kind: str = "penzai"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise SaffuError(f"penzai family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.tied and self.family != "llama":
            raise SaffuError("a tied matrix is penzai's Llama-like option; GPT-NeoX is untied")
        if self.width % self.heads:
            raise SaffuError(f"width {self.width} must be a multiple of heads {self.heads}")

    @property
    def context(self) -> int:
        return self.context_tokens

    @property
    def eval_seq_len(self) -> int:
        return 256

    def build(self, key):
        """penzai's model with its random init drawn from ``key``."""
        _penzai()
        from penzai.models.transformer.variants import gpt_neox, llamalike_common
        if self.family == "llama":
            config = llamalike_common.LlamalikeTransformerConfig(
                num_kv_heads=self.heads, query_head_multiplier=1, embedding_dim=self.width,
                projection_dim=self.width // self.heads, mlp_hidden_dim=self.mlp * 2 // 3,
                num_decoder_blocks=self.layers, vocab_size=self.vocab_size, mlp_variant="swiglu",
                tie_embedder_and_logits=self.tied)
            return llamalike_common.build_llamalike_transformer(config, init_base_rng=key)
        config = gpt_neox.GPTNeoXTransformerConfig(
            num_attention_heads=self.heads, embedding_dim=self.width, projection_dim=self.width // self.heads,
            mlp_hidden_dim=self.mlp, num_decoder_blocks=self.layers, vocab_size=self.vocab_size,
            activation_fn="gelu_approx", rope_subset_size=(self.width // self.heads) // 4, rope_wavelength=10_000,
            layernorm_epsilon=1e-5, parameter_dtype="float32", activation_dtype="float32")
        return gpt_neox.build_gpt_neox_transformer(config, init_base_rng=key)

    def init(self, key) -> dict:
        """penzai's random init as ``{label: array}``."""
        from penzai import pz
        _, values = pz.unbind_params(self.build(key), freeze=True)
        return {v.label: v.value.unwrap(*v.value.named_shape) for v in values}

    def logits(self, params: dict, tokens):
        """``float32[B, S, V]`` of ``tokens int32[B, S]``."""
        import jax
        from penzai import pz
        # built inside the trace, so the model's own constants (scales, rotary tables) are traced
        # values rather than arrays captured by the executable; the unused random init is dead code
        unbound, values = pz.unbind_params(self.build(jax.random.key(0)), freeze=True)
        values = [pz.ParameterValue(label=v.label, value=pz.nx.wrap(params[v.label]).tag(*v.value.named_shape))
                  for v in values]
        named = pz.bind_variables(unbound, values)(pz.nx.wrap(tokens).tag("batch", "seq"))
        return named.unwrap("batch", "seq", "vocabulary")

    def forward_flops(self, seq_len: int) -> float:
        """Multiply-add FLOPs (×2) per predicted token of a window of ``seq_len`` targets."""
        d, L, V = self.width, self.layers, self.vocab_size
        mean_visible = (self.context + seq_len + 1) / 2
        mlp = 3 * d * (self.mlp * 2 // 3) if self.family == "llama" else 2 * d * self.mlp
        return 2.0 * (L * (4 * d * d + mlp + 2 * mean_visible * d) + d * V)

    def selectors(self) -> dict:
        """:func:`saffu.interop.explicit_init`'s keyword arguments naming this model's leaves: the
        embeddings ``[V, d]`` and, untied, the output kernel ``[d, V]`` (neither family has an
        output bias)."""
        if self.tied:
            return {"embedding": "transformer/embedder.embeddings"}
        return {"embedding": "transformer/embedder.embeddings", "output": "transformer/lm_head.weights"}
