"""The explicit pieces a model is initialised from (:class:`ExplicitPieces`): what
:func:`saffu.interop.tokens.solve_pieces` solves, :func:`saffu.interop.init.explicit_init` sets
and :mod:`saffu.interop.weights_file` keeps."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ExplicitPieces:
    """The explicit pieces a model is initialised from, indexed by the user's token ids.

    Attributes:
      embedding: ``float32[V, r]`` — ``E_0``, the current token's explicit embedding.
      output: ``float32[r, V]`` — ``B``, the shared output factor (``logits = h B + b``).
      bias: ``float32[V]`` — ``log p(y)``, the add-one smoothed log-unigram of the counted
        training targets.
      counts: ``int64[V]`` — those targets' counts (``p(y) = (n_y + 1) / (n + V)``).
      manifest: where they came from (corpus, tokenizer fingerprint, rank, solve report).
    """

    embedding: np.ndarray
    output: np.ndarray
    bias: np.ndarray
    counts: np.ndarray
    manifest: dict

    @property
    def vocab_size(self) -> int:
        return int(self.bias.shape[0])

    @property
    def rank(self) -> int:
        return int(self.embedding.shape[1])
