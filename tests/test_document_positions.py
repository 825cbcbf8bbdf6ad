"""A transformer's evaluation gives every document the positions it has from its own ``<eod>``
(at ``context − 1``), wherever it sits in the split; a document longer than a window continues
in windows behind its own tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import SaffuError, TransformerConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.data.windows import document_positions, document_ranges, total_nll
from saffu.eval.continuations import continuation_log_probs
from saffu.models.interface import model_init, target_loss

E = EOD_ID


def test_ranges_start_at_documents_and_a_long_document_is_its_own():
    #                 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
    stream = np.array([E, 5, 6, E, 7, E, 8, 9, 9, 9, 9, 9, 9, E, 4, E, 3])
    # documents (targets): [1, 4) [4, 6) [6, 14) [14, 16) and the tail [16, 17)
    assert document_ranges(stream, [(1, 17)], 4) == [(1, 4), (4, 6), (6, 14), (14, 17)]
    assert document_ranges(stream, [(1, 17)], 5) == [(1, 6), (6, 14), (14, 17)]
    assert document_ranges(stream, [(4, 6), (14, 16)], 4) == [(4, 6), (14, 16)]
    with pytest.raises(SaffuError, match="document start"):
        document_ranges(stream, [(2, 6)], 4)


def test_positions_count_from_each_document_eod():
    R = 3
    windows = np.array([[PAD_ID, 9, E, 5, 6, E, 7, 8],       # two documents from index R − 1 = 2
                        [4, 4, 4, 4, 4, 4, E, PAD_ID]])      # a long document's continuation, then its end
    np.testing.assert_array_equal(document_positions(windows, R), [[0, 1, 2, 3, 4, 2, 3, 4],
                                                                   [0, 1, 2, 3, 4, 5, 2, 3]])


def test_a_split_scores_each_document_as_it_scores_alone(tiny_workdir):
    """The summed NLL of the dev split equals the sum, over its documents, of each document's
    tokens and closing ``<eod>`` scored alone from its ``<eod>`` at ``context − 1``
    (:func:`continuation_log_probs`), for a transformer with learned absolute positions; with
    window positions (the former evaluation) it does not."""
    config = TransformerConfig(vocab_size=tiny_workdir.vocab_size, width=16, layers=2, heads=2, context_tokens=4,
                               max_len=48, block="gpt", output_bias=True, across_documents=False)
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape),
                          model_init(config, jax.random.key(0)))
    stream = np.asarray(tiny_workdir.tokens("dev"))
    loss = jax.jit(lambda w, m, *p: target_loss(params, config, w, m, None, *p))
    nll, count = total_nll(loss, stream, [(1, len(stream))], config.context, 16, 4, positioned=True)
    eods = np.flatnonzero(stream == E)
    documents = [([E], [int(t) for t in stream[a + 1:b + 1]]) for a, b in zip(eods[:-1], eods[1:])]
    assert max(len(d) for _, d in documents) <= 16 and count == sum(len(d) for _, d in documents)
    alone = -continuation_log_probs(params, config, documents, progress=False)[0].sum()
    assert nll == pytest.approx(alone, rel=1e-5)
    placed, _ = total_nll(loss, stream, [(1, len(stream))], config.context, 16, 4)
    assert abs(placed - alone) > 1e-3 * alone


def test_positions_reach_the_loss_of_the_transformer():
    config = TransformerConfig(vocab_size=40, width=16, layers=1, heads=2, context_tokens=2, max_len=16,
                               block="gpt", output_bias=True)
    params = model_init(config, jax.random.key(0))
    windows = jnp.asarray([[PAD_ID, E, 5, 6, 7, E]], jnp.int32)
    mask = jnp.ones((1, 4), bool)
    plain = target_loss(params, config, windows, mask)[0]
    shifted = target_loss(params, config, windows, mask, None, jnp.arange(6)[None] + 3)[0]
    same = target_loss(params, config, windows, mask, None, jnp.arange(6)[None])[0]
    assert float(same) == pytest.approx(float(plain), abs=1e-6) and abs(float(shifted) - float(plain)) > 1e-4


def test_length_buckets_round_up_to_powers_of_two_within_the_cap():
    from saffu.data.windows import length_buckets
    assert length_buckets([1, 8, 9, 16, 17, 3]) == [(8, [0, 1, 5]), (16, [2, 3]), (32, [4])]
    assert length_buckets([9, 40, 100], cap=40) == [(16, [0]), (40, [1, 2])]
