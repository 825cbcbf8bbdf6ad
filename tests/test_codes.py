import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saffu import CipherConfig, SaffuError, bit_cipher_codes, min_bits, sparse_bit_cipher
from saffu.data.tokenizer import EOD_ID, PAD_ID


@settings(max_examples=40, deadline=None)
@given(vocab_size=st.integers(3, 3000), extra_bits=st.integers(0, 6))
def test_codes_are_distinct_normalised_and_frequency_ordered(vocab_size, extra_bits):
    bits = min_bits(vocab_size) + extra_bits
    codes = bit_cipher_codes(vocab_size, CipherConfig(bits=bits))
    assert codes.shape == (vocab_size, bits + 1)
    np.testing.assert_allclose(codes.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (codes >= 0).all()
    regular = codes[2:]
    assert len({row.tobytes() for row in regular}) == vocab_size - 2          # distinct
    assert (regular[:, bits] == 0).all()                                      # boundary dim reserved
    levels = (regular > 0).sum(axis=1)
    assert (np.diff(levels) >= 0).all()                                       # frequent -> fewer bits
    n_onehot = min(bits, vocab_size - 2)
    np.testing.assert_array_equal(regular[:n_onehot, :n_onehot], np.eye(n_onehot))
    for special in (PAD_ID, EOD_ID):
        assert codes[special, bits] == 1.0
    np.testing.assert_array_equal(codes, bit_cipher_codes(vocab_size, CipherConfig(bits=bits)))


def test_level_two_codes_reuse_the_least_frequent_bits():
    sparse = sparse_bit_cipher(2 + 4 + 2, bits=4)
    assert sparse.bit_index[2 + 4].tolist() == [2, 3]
    assert sparse.bit_index[2 + 5].tolist() == [1, 3]
    assert sparse.level.tolist() == [1, 1, 1, 1, 1, 1, 2, 2]


def test_background_blend_has_no_zero_coordinate():
    counts = np.arange(100, 0, -1)
    codes = bit_cipher_codes(100, CipherConfig(bits=10, background=0.1), counts)
    assert (codes > 0).all()
    np.testing.assert_allclose(codes.sum(axis=1), 1.0, atol=1e-12)
    with pytest.raises(SaffuError):
        bit_cipher_codes(100, CipherConfig(bits=10, background=0.1))


def test_too_few_bits_is_a_clear_error():
    with pytest.raises(SaffuError, match="--bits 13"):
        sparse_bit_cipher(8192, bits=12)
    assert min_bits(8192) == 13
