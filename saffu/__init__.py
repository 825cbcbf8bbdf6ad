"""saffu: explicit (closed-form) SAFFU language models in JAX.

The pipeline, one module per stage: corpus -> tokenizer -> prepare (token streams) ->
codes (bit-cipher) -> statistics (streaming accumulators) -> explicit (closed-form weights)
-> model / solver (the SAFFU stack and its stage-by-stage explicit solution; the single-layer
bigram in ``bigram``) -> training (optax warm or cold start) -> evaluation / runs. Baselines on the same tokens:
``transformer`` (flax decoder-only, same trainer) and ``kneser_ney`` (interpolated modified
Kneser-Ney from the engine's n-gram counts, ARPA output); ``blimp`` scores any of them;
``accounting`` measures FLOPs and memory.
"""

from saffu._io import SaffuError
from saffu.bigram import (BigramConfig, BigramModel, BigramTrainConfig, bigram_nll, fit_explicit_bigram,
                          random_bigram, train_bigram)
from saffu.codes import (CipherConfig, SparseCodes, bit_cipher_codes, code_background, dense_codes,
                         min_bits, sparse_bit_cipher)
from saffu.corpus import Corpus, babylm_corpus, iter_documents, text_files_corpus
from saffu.download import download_babylm
from saffu.evaluation import language_model_metrics, pair_counts, split_metrics
from saffu.explicit import (Smoothing, calibrate_temperature, conditional_probabilities,
                            explicit_softmax_weights, unigram_prior)
from saffu.prepare import PrepareConfig, WorkDir, open_workdir, prepare
from saffu.model import Saffu, SaffuConfig, init_params, parameter_count, saffu_logits, window_loss
from saffu.runs import evaluate_split, generate, load_explicit, load_params, save_explicit
from saffu.solver import SolverConfig, solve_explicit
from saffu.training import TrainConfig, train
from saffu.transformer import Transformer, TransformerConfig
from saffu.kneser_ney import KneserNeyModel, fit_kneser_ney, read_arpa, write_arpa
from saffu.statistics import (Accumulator, Batch, accumulate, accumulate_states, blend_background,
                              document_context, feature_target, local_mesh, merge_states,
                              offset_cooccurrence, unigram_counts)

__version__ = "0.1.0"

__all__ = [
    "Saffu", "SaffuConfig", "SolverConfig", "TrainConfig", "evaluate_split", "generate", "init_params",
    "load_explicit", "load_params", "parameter_count", "saffu_logits", "save_explicit", "solve_explicit",
    "train", "window_loss", "BigramTrainConfig", "Transformer", "TransformerConfig",
    "KneserNeyModel", "fit_kneser_ney", "read_arpa", "write_arpa",
    "Accumulator", "Batch", "BigramConfig", "BigramModel", "CipherConfig", "Corpus", "PrepareConfig",
    "SaffuError", "Smoothing", "SparseCodes", "WorkDir", "accumulate",
    "accumulate_states", "babylm_corpus", "bigram_nll", "bit_cipher_codes", "blend_background",
    "calibrate_temperature", "code_background", "conditional_probabilities", "dense_codes",
    "document_context", "download_babylm", "explicit_softmax_weights", "feature_target",
    "fit_explicit_bigram", "iter_documents", "language_model_metrics", "local_mesh",
    "merge_states", "min_bits", "offset_cooccurrence", "open_workdir", "pair_counts", "prepare",
    "random_bigram", "sparse_bit_cipher", "split_metrics", "text_files_corpus", "train_bigram",
    "unigram_counts", "unigram_prior",
]
