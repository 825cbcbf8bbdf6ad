"""saffu: explicit (closed-form) SAFFU language models in JAX.

The package is laid out as the pipeline runs, imports flowing one way (top to bottom; the
``[tool.importlinter]`` layers contract in ``pyproject.toml`` enforces it in ``make test``):

* ``configs`` — every configuration dataclass, plain data: the only defaults (imports no jax);
* ``data`` — corpus readers, download, BPE tokenizer, work directories (memory-mapped token
  streams, subsets, samples) and stream windows;
* ``engine`` — bit-cipher codes, streaming accumulators (mergeable sums), devices and hosts
  (meshes, multi-process sums), exact counts of distinct rows, closed-form smoothing formulas,
  FLOP and memory accounting;
* ``ngram`` — exact sparse n-gram counts, Kneser-Ney, ARPA files;
* ``models`` — the model interface and kind registry (``model_init``, ``model_logits``) and the
  losses written against it, the SAFFU stack, the cipher bigram
  layer, the exact token-resolution model, the factorised model, the transformer baseline,
  the explicit residual over any of them, structured drop-ins for dense layers (low-rank, block);
* ``solve`` — explicit solutions of the models (SAFFU stage by stage, the bigram layer, the
  exact groups, their low-rank factors);
* ``training`` — the one trainer (warm or cold start) and run directories / checkpoints;
* ``eval`` — metrics, scoring and generation, BLiMP, the n-gram baseline on work directories,
  attention diagnostics;
* ``interop`` — explicit init of any JAX model's parameters, the explicit solution and the
  residual from the user's own token ids, the framework-free init file, Hugging Face export;
* ``cli`` — parses flags and calls the stages above.

The names below are imported on first use, so ``import saffu`` (and ``saffu --help``) does
not load jax, flax, optax or orbax until something needs them.
"""

from __future__ import annotations

import importlib

from saffu._host import keep_host_memory

__version__ = "0.1.0"

keep_host_memory()

_EXPORTS = {
    "saffu._io": ["SaffuError"],
    "saffu.configs": ["BigramConfig", "CipherConfig", "ExactConfig", "FactorConfig", "FactorisedConfig",
                      "PrepareConfig", "ResidualConfig", "SaffuConfig", "Smoothing",
                      "SolverConfig", "TrainConfig", "TransformerConfig", "min_bits"],
    "saffu.data.corpus": ["Corpus", "babylm_corpus", "iter_documents", "text_files_corpus"],
    "saffu.data.download": ["download_babylm"],
    "saffu.data.workdir": ["WorkDir", "open_workdir", "prepare", "subset_workdir"],
    "saffu.engine.codes": ["SparseCodes", "bit_cipher_codes", "code_background", "dense_codes", "sparse_bit_cipher"],
    "saffu.engine.accumulators": ["Accumulator", "Batch", "accumulate", "accumulate_states", "blend_background",
                                  "document_context", "document_context_at", "feature_target", "merge_states",
                                  "offset_cooccurrence", "unigram_counts"],
    "saffu.engine.distributed": ["local_mesh"],
    "saffu.engine.rows": ["merge_rows", "pair_counts", "unique_rows"],
    "saffu.engine.explicit": ["calibrate_temperature", "conditional_probabilities", "explicit_softmax_weights",
                              "unigram_prior"],
    "saffu.ngram.counts": ["count_ngrams", "count_rows"],
    "saffu.ngram.kneser_ney": ["KneserNeyModel", "fit_kneser_ney"],
    "saffu.ngram.arpa": ["read_arpa", "write_arpa"],
    "saffu.models.interface": ["config_from_dict", "model_init", "model_logits", "parameter_count", "window_loss",
                               "window_nll"],
    "saffu.models.saffu": ["Saffu", "grow_block", "inherit_blocks", "init_params", "saffu_logits", "structure_chain"],
    "saffu.models.bigram": ["bigram_nll", "random_bigram"],
    "saffu.models.exact": ["exact_logits"],
    "saffu.models.factorised": ["drop_output_guide", "factorised_logits", "structure_output"],
    "saffu.models.structured": ["StructuredLinear", "apply_structure", "from_dense", "structure_size", "to_dense"],
    "saffu.models.transformer": ["Transformer", "drop_guide", "explicit_transformer_init", "grow_layer",
                                 "inherit_layers"],
    "saffu.models.residual": ["with_explicit"],
    "saffu.solve.stack": ["solve_explicit"],
    "saffu.solve.bigram": ["fit_explicit_bigram"],
    "saffu.solve.exact": ["solve_exact"],
    "saffu.solve.factors": ["randomized_svd", "solve_factorised"],
    "saffu.training.trainer": ["train"],
    "saffu.training.checkpoints": ["check_inputs", "load_explicit", "load_params", "pack_run", "save_explicit",
                                   "save_explicit_run"],
    "saffu.eval.metrics": ["language_model_metrics", "split_metrics"],
    "saffu.eval.scoring": ["evaluate_split", "generate", "generate_ids"],
    "saffu.eval.attention": ["attention_profile", "effective_rank", "inspect_attention", "layers_before_lazy",
                             "mean_attention", "offset_profile"],
    "saffu.interop.init": ["explicit_init", "tied_matrix"],
    "saffu.interop.pieces": ["ExplicitPieces"],
    "saffu.interop.tokens": ["TokenSource", "solve_exact_tables", "solve_pieces", "workdir_from_tokens"],
    "saffu.interop.residual": ["ExplicitResidual"],
    "saffu.interop.weights_file": ["read_init_file", "write_init_file"],
    "saffu.interop.hf": ["export_hf", "gpt2_logits", "llama_logits"],
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
