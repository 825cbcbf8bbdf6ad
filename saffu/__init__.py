"""saffu: explicit (closed-form) SAFFU language models in JAX.

The pipeline, one module per stage: corpus -> tokenizer -> prepare (token streams) ->
codes (bit-cipher) -> statistics (streaming accumulators) -> explicit (closed-form weights)
-> model / solver (the SAFFU stack and its stage-by-stage explicit solution; the single-layer
bigram in ``bigram``) -> training (optax warm or cold start) -> evaluation / runs. Baselines on the same tokens:
``transformer`` (flax decoder-only, same trainer) and ``kneser_ney`` (interpolated modified
Kneser-Ney from the engine's n-gram counts, ARPA output); ``blimp`` scores any of them;
``accounting`` measures FLOPs and memory. Every configuration lives in ``configs``.

The names below are imported on first use, so ``import saffu`` (and ``saffu --help``) does
not load jax, flax, optax or orbax until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "saffu._io": ["SaffuError"],
    "saffu.configs": ["BigramConfig", "BigramTrainConfig", "CipherConfig", "PrepareConfig", "SaffuConfig",
                      "Smoothing", "SolverConfig", "TrainConfig", "TransformerConfig", "min_bits"],
    "saffu.bigram": ["BigramModel", "bigram_nll", "fit_explicit_bigram", "random_bigram", "train_bigram"],
    "saffu.codes": ["SparseCodes", "bit_cipher_codes", "code_background", "dense_codes", "sparse_bit_cipher"],
    "saffu.corpus": ["Corpus", "babylm_corpus", "iter_documents", "text_files_corpus"],
    "saffu.download": ["download_babylm"],
    "saffu.evaluation": ["language_model_metrics", "pair_counts", "split_metrics"],
    "saffu.explicit": ["calibrate_temperature", "conditional_probabilities", "explicit_softmax_weights",
                       "unigram_prior"],
    "saffu.workdir": ["WorkDir", "open_workdir", "prepare"],
    "saffu.model": ["Saffu", "init_params", "parameter_count", "saffu_logits", "window_loss"],
    "saffu.runs": ["evaluate_split", "generate", "load_explicit", "load_params", "save_explicit"],
    "saffu.solver": ["solve_explicit"],
    "saffu.training": ["train"],
    "saffu.transformer": ["Transformer"],
    "saffu.kneser_ney": ["KneserNeyModel", "fit_kneser_ney", "read_arpa", "write_arpa"],
    "saffu.statistics": ["Accumulator", "Batch", "accumulate", "accumulate_states", "blend_background",
                         "document_context", "feature_target", "local_mesh", "merge_states",
                         "offset_cooccurrence", "unigram_counts"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """Import the module that defines ``name`` on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'saffu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
