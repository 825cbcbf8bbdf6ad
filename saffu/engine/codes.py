"""Bit-cipher token codes (formulation §2).

Regular tokens (ids ``2 …``, already in frequency order) get binary codes over ``bits``
coordinates: the ``bits`` most frequent tokens get one-hot codes, the next ones 2-bit codes,
then 3-bit, … Within a level, combinations are taken in lexicographic order over the bits
listed from least to most frequent, so the most frequent multi-bit tokens reuse the bits of
the least frequent one-hot tokens and frequent tokens share few bits. ``<pad>`` and ``<eod>``
use one extra coordinate (index ``bits``), the document boundary. Codes are L1-normalised
(each is a distribution over ``K = bits + 1`` coordinates) and may be blended with a
background distribution so no coordinate is exactly zero.

Because a code has at most ``L`` (its *level*) non-zero entries of value ``1/L``, the
accumulators work with the sparse form (:class:`SparseCodes`) and count integers exactly;
the dense form is rebuilt from it.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from saffu._io import SaffuError
from saffu.configs import NUM_SPECIAL, CipherConfig, min_bits
from saffu.data.tokenizer import EOD_ID, PAD_ID


class SparseCodes(NamedTuple):
    """Binary bit sets of every token id.

    Attributes:
      bit_index: ``int32[V, L]`` — the set bits of each token's code, ``-1`` where unused.
      level: ``int32[V]`` — number of set bits (1 for ``<pad>``/``<eod>``), ``1 ≤ level ≤ L``.
      dim: ``K = bits + 1``.
    """

    bit_index: np.ndarray
    level: np.ndarray
    dim: int

    @property
    def max_level(self) -> int:
        return self.bit_index.shape[1]


def sparse_bit_cipher(vocab_size: int, bits: int) -> SparseCodes:
    """Bit sets of the bit-cipher for ids ``0 … vocab_size − 1`` (see the module docstring).

    Raises SaffuError if ``bits`` is too small for every code to be distinct.
    """
    if bits < 1 or (1 << min(bits, 62)) - 1 < vocab_size - NUM_SPECIAL:
        raise SaffuError(f"{bits} bits give at most 2^{bits}-1 distinct codes, fewer than the "
                         f"{vocab_size - NUM_SPECIAL} regular tokens; use --bits {min_bits(vocab_size)} "
                         f"or more")
    num_regular = vocab_size - NUM_SPECIAL
    sets: list[tuple[int, ...]] = [(bit,) for bit in range(min(bits, num_regular))]
    order = list(range(bits - 1, -1, -1))  # least frequent bit first
    level = 2
    while len(sets) < num_regular:
        for combo in itertools.combinations(order, level):
            sets.append(tuple(sorted(combo)))
            if len(sets) == num_regular:
                break
        level += 1
    max_level = max((len(s) for s in sets), default=1)
    bit_index = np.full((vocab_size, max_level), -1, dtype=np.int32)
    levels = np.ones(vocab_size, dtype=np.int32)
    bit_index[PAD_ID, 0] = bits
    bit_index[EOD_ID, 0] = bits
    for rank, bit_set in enumerate(sets):
        token = rank + NUM_SPECIAL
        bit_index[token, :len(bit_set)] = bit_set
        levels[token] = len(bit_set)
    return SparseCodes(bit_index=bit_index, level=levels, dim=bits + 1)


def code_background(sparse: SparseCodes, token_counts: np.ndarray) -> np.ndarray:
    """The frequency background over code coordinates, ``float64[K]``:
    ``Σ_u p(u) v(u)`` with ``p`` the (add-one smoothed) training unigram distribution."""
    p = np.asarray(token_counts, np.float64) + 1.0
    p[PAD_ID] = 0.0
    p /= p.sum()
    return p @ dense_codes(sparse)


def dense_codes(sparse: SparseCodes) -> np.ndarray:
    """L1-normalised codes without background, ``float64[V, K]``."""
    vocab_size = sparse.level.shape[0]
    codes = np.zeros((vocab_size, sparse.dim), dtype=np.float64)
    rows, cols = np.nonzero(sparse.bit_index >= 0)
    codes[rows, sparse.bit_index[rows, cols]] = 1.0 / sparse.level[rows]
    return codes


def bit_cipher_codes(vocab_size: int, config: CipherConfig = CipherConfig(),
                     token_counts: np.ndarray | None = None) -> np.ndarray:
    """Dense bit-cipher codes, ``float64[V, K]`` with ``K = bits + 1``; each row sums to 1.

    Args:
      vocab_size: ``V``, ids laid out as in :mod:`saffu.data.tokenizer`.
      config: bits and background weight ``λ``.
      token_counts: ``int[V]`` training counts, needed only when ``λ > 0``.

    Returns ``(1 − λ) v(u) + λ background`` for every id ``u``.
    """
    sparse = sparse_bit_cipher(vocab_size, config.bits)
    codes = dense_codes(sparse)
    if config.background:
        if not 0.0 < config.background < 1.0:
            raise SaffuError(f"background weight {config.background} must be in [0, 1)")
        if token_counts is None:
            raise SaffuError("a background blend needs the training token counts")
        codes = (1.0 - config.background) * codes + config.background * code_background(
            sparse, token_counts)[None, :]
    return codes
