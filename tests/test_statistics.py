import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saffu import (
    SaffuError,
    accumulate,
    accumulate_states,
    blend_background,
    code_background,
    dense_codes,
    document_context,
    document_context_at,
    feature_target,
    local_mesh,
    merge_states,
    offset_cooccurrence,
    sparse_bit_cipher,
    unigram_counts,
)
from saffu.data.tokenizer import EOD_ID, PAD_ID


def random_stream(seed: int, length: int, vocab_size: int, eod_rate: float = 0.1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    stream = rng.integers(2, vocab_size, length)
    stream[rng.random(length) < eod_rate] = EOD_ID
    stream[0] = EOD_ID
    return stream.astype(np.uint16)


def reference_contexts(stream: np.ndarray, radius: int) -> np.ndarray:
    """Plain-loop reference: context[t, δ] for targets t = 1 … N−1 (pad across documents)."""
    contexts = np.full((len(stream) - 1, radius), PAD_ID, np.int64)
    for target in range(1, len(stream)):
        head = target - 1
        for delta in range(radius):
            j = head - delta
            if j < 0 or (stream[j + 1:head + 1] == EOD_ID).any():
                break
            contexts[target - 1, delta] = stream[j]
    return contexts


def reference_offset_counts(stream, codes, vocab_size, radius):
    """Integer state of offset_cooccurrence computed with np.add.at (exact reference)."""
    L, K = codes.bit_index.shape[1], codes.dim
    counts = np.zeros((radius, L, K, vocab_size), np.int64)
    contexts = reference_contexts(stream, radius)
    targets = stream[1:].astype(np.int64)
    for delta in range(radius):
        ctx = contexts[:, delta]
        for slot in range(L):
            bits = codes.bit_index[ctx, slot]
            keep = bits >= 0
            np.add.at(counts, (delta, codes.level[ctx][keep] - 1, bits[keep], targets[keep]), 1)
    return counts


def test_document_context_hides_earlier_documents():
    #          0  1  2  3  4  5  6
    window = jnp.asarray([EOD_ID, 5, 6, EOD_ID, 7, 8, 9], jnp.int32)
    context, targets = document_context(window, radius=3)
    # targets window[3:] = eod, 7, 8, 9 with heads 6, eod, 7, 8
    np.testing.assert_array_equal(targets, [EOD_ID, 7, 8, 9])
    np.testing.assert_array_equal(context, [[6, 5, EOD_ID],
                                            [EOD_ID, PAD_ID, PAD_ID],
                                            [7, EOD_ID, PAD_ID],
                                            [8, 7, EOD_ID]])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), radius=st.integers(1, 6), targets=st.integers(1, 60),
       eod_rate=st.sampled_from([0.0, 0.2, 0.6]))
@pytest.mark.slow        # among the fast suite's slowest: CI's slow suite runs it (make test-slow)
def test_context_of_rows_in_any_order_equals_the_windows_context(seed, radius, targets, eod_rate):
    rng = np.random.default_rng(seed)
    window = random_stream(seed, radius + targets, 50, eod_rate).astype(np.int32)
    window[0] = rng.integers(2, 50)                                    # the window need not open a document
    rows = rng.permutation(targets)[:rng.integers(1, targets + 1)].astype(np.int32)
    boundaries = np.cumsum(window == EOD_ID, dtype=np.int32)
    context, target = document_context(jnp.asarray(window), radius)
    got_context, got_target = document_context_at(jnp.asarray(window), jnp.asarray(boundaries), jnp.asarray(rows),
                                                  radius)
    np.testing.assert_array_equal(got_context, np.asarray(context)[rows])
    np.testing.assert_array_equal(got_target, np.asarray(target)[rows])


def test_target_order_is_for_order_free_accumulators_only():
    stream = random_stream(5, 300, 25)
    seen = []

    def update(state, batch, context, inputs):
        seen.append(batch.window is not None)        # traced once: whether the step had the stream
        return state + batch.mask.sum()

    counting = {"u": unigram_counts(25),
                "n": unigram_counts(25)._replace(update=update, order_free=False)}
    with pytest.raises(SaffuError, match="order-free accumulators: n are not"):
        accumulate_states(stream, counting, chunk_size=16, progress=None, target_order=True)
    states = accumulate_states(stream, counting, chunk_size=16, progress=None)   # stream order by default
    assert seen == [True]
    np.testing.assert_array_equal(states["u"], np.bincount(stream[1:], minlength=25))
    sorted_states = accumulate_states(stream, {"u": unigram_counts(25)}, chunk_size=16, progress=None)
    np.testing.assert_array_equal(sorted_states["u"], states["u"])


# (vocab, bits) covering the three state layouts: max level 2 (repeated slots), 3 (weighted
# slots, lcm 6) and 5 (one slice per level, lcm 60)
LAYOUTS = [(20, 6), (40, 6), (33, 5)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), length=st.integers(2, 500), radius=st.integers(1, 4),
       chunk=st.integers(5, 200), devices=st.sampled_from([1, 2, 4]), layout=st.sampled_from(LAYOUTS),
       target_order=st.sampled_from([None, False]))
def test_counts_equal_numpy_reference_for_any_chunking_and_device_count(seed, length, radius, chunk,
                                                                       devices, layout, target_order):
    """Exact in either streaming order: target order (the default for these order-free
    accumulators, sorted blocks of 8 chunks) and stream order."""
    vocab_size, bits = layout
    stream = random_stream(seed, length, vocab_size)
    codes = sparse_bit_cipher(vocab_size, bits)
    accumulators = {"unigram": unigram_counts(vocab_size),
                    "offsets": offset_cooccurrence(codes, vocab_size, radius)}
    states = accumulate_states(stream, accumulators, chunk_size=chunk, mesh=local_mesh(devices),
                               progress=None, target_order=target_order)
    np.testing.assert_array_equal(states["unigram"], np.bincount(stream[1:], minlength=vocab_size))
    F = accumulators["offsets"].finalize(states["offsets"])
    # exact: F·D is the integer Σ_l count_l · D / l of the plain-loop reference
    counts = reference_offset_counts(stream, codes, vocab_size, radius)       # [M, L, K, V]
    L = counts.shape[1]
    D = int(np.lcm.reduce(np.arange(1, L + 1)))
    exact = np.einsum("mlkv,l->mkv", counts, D // np.arange(1, L + 1))
    np.testing.assert_allclose(F * D, exact, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(np.rint(F * D).astype(np.int64), exact)
    # and against a float64 reference built from the dense codes
    dense = dense_codes(codes)
    contexts = reference_contexts(stream, radius)
    expected = np.zeros((radius, codes.dim, vocab_size))
    for delta in range(radius):
        np.add.at(expected[delta].T, stream[1:].astype(np.int64), dense[contexts[:, delta]])
    np.testing.assert_allclose(F, expected, rtol=1e-12, atol=1e-12)


def test_states_merge_by_addition_over_ranges():
    stream = random_stream(3, 500, 30)
    acc = {"offsets": offset_cooccurrence(sparse_bit_cipher(30, 5), 30, 3)}
    whole = accumulate_states(stream, acc, progress=None)
    first = accumulate_states(stream, acc, end=217, progress=None)
    second = accumulate_states(stream, acc, begin=217, progress=None)
    np.testing.assert_array_equal(merge_states(first, second)["offsets"], whole["offsets"])


def test_background_blend_equals_dense_blended_codes():
    vocab_size, radius, weight = 30, 2, 0.2
    stream = random_stream(4, 300, vocab_size)
    codes = sparse_bit_cipher(vocab_size, 5)
    counts = np.bincount(stream, minlength=vocab_size)
    F = accumulate(stream, {"o": offset_cooccurrence(codes, vocab_size, radius)}, progress=None)["o"]
    blended = blend_background(F, code_background(codes, counts), weight)
    dense = (1 - weight) * dense_codes(codes) + weight * code_background(codes, counts)
    contexts = reference_contexts(stream, radius)
    for delta in range(radius):
        expected = np.zeros((codes.dim, vocab_size))
        np.add.at(expected.T, stream[1:].astype(np.int64), dense[contexts[:, delta]])
        np.testing.assert_allclose(blended[delta], expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), chunk=st.integers(1, 200), devices=st.sampled_from([1, 2, 4]),
       dense_target=st.booleans())
def test_feature_target_accumulator_matches_numpy(seed, chunk, devices, dense_target):
    vocab_size, radius = 25, 3
    stream = random_stream(seed, 400, vocab_size)
    table = np.random.default_rng(seed).random((vocab_size, 6)).astype(np.float32)

    def features(batch, context):               # a non-negative map of the whole context
        return context["table"][batch.context[:, :radius]].sum(axis=1)

    target_table = np.random.default_rng(seed + 1).dirichlet(np.ones(4), vocab_size).astype(np.float32)
    target_fn = (lambda b, context: context["targets"][b.targets]) if dense_target else None
    acc = feature_target(features, 6, 4 if dense_target else vocab_size, radius, target_fn)
    F = accumulate(stream, {"f": acc}, chunk_size=chunk, mesh=local_mesh(devices), progress=None,
                   context={"table": table, "targets": target_table})["f"]
    contexts = reference_contexts(stream, radius)
    phi = table.astype(np.float64)[contexts].sum(axis=1)
    targets = stream[1:].astype(np.int64)
    Y = target_table.astype(np.float64)[targets] if dense_target else np.eye(vocab_size)[targets]
    np.testing.assert_allclose(F, phi.T @ Y, rtol=2e-5, atol=1e-4)   # float32 accumulation


def test_weights_reach_the_compiled_step_as_arguments_not_constants():
    """The context is an argument of the executable: no constant of its shape in the HLO, and
    one executable serves any weights of that shape."""
    from saffu.engine.accumulators import _sharded_step
    table = np.random.default_rng(0).random((25, 6)).astype(np.float32)
    acc = feature_target(lambda b, context: context["table"][b.context[:, 0]], 6, 25, 1)
    step = _sharded_step((acc,), local_mesh(1), 1, 16, {"table": table})
    constants = [line for line in step.as_text().splitlines() if "constant(" in line and "f32[25,6]" in line]
    assert constants == []
    stream = random_stream(1, 200, 25)
    twice = accumulate(stream, {"f": acc}, chunk_size=16, progress=None, context={"table": 2 * table})["f"]
    once = accumulate(stream, {"f": acc}, chunk_size=16, progress=None, context={"table": table})["f"]
    np.testing.assert_allclose(twice, 2 * once, rtol=1e-6)


def test_negative_features_are_rejected():
    stream = random_stream(0, 50, 10)
    acc = feature_target(lambda b, _: -jnp.ones((b.targets.shape[0], 2)), 2, 10, 1)
    with pytest.raises(SaffuError, match="non-negative"):
        accumulate(stream, {"f": acc}, progress=None)


def test_states_stay_on_all_devices_and_memory_is_chunk_sized():
    assert len(jax.local_devices()) == 4                # conftest forces 4 CPU devices
    stream = random_stream(0, 5000, 30)
    acc = {"u": unigram_counts(30)}
    small = accumulate_states(stream, acc, chunk_size=16, progress=None)
    assert small["u"].shape == (30,)                    # state size independent of the stream
    np.testing.assert_array_equal(small["u"], np.bincount(stream[1:], minlength=30))   # exact over 4 devices
    # one step reads one chunk of targets per device (plus its context), whatever the stream's length
    from saffu.engine.accumulators import _windows
    windows, mask = _windows(stream, 4990, len(stream), num_devices=4, chunk_size=16, radius=3)
    assert windows.shape == (4, 3 + 16) and mask.shape == (4, 16)
    assert mask.sum() == len(stream) - 4990 and not mask[1:].any()        # the tail past the end is masked
    with pytest.raises(SaffuError, match="outside the stream"):
        accumulate_states(stream, acc, begin=0, progress=None)


def test_passes_longer_than_the_exact_range_are_refused():
    stream = random_stream(1, 100, 30)
    limited = unigram_counts(30)._replace(capacity=50)
    with pytest.raises(SaffuError, match="exceed the exact range"):
        accumulate_states(stream, {"u": limited}, progress=None)
    halves = [accumulate_states(stream, {"u": limited}, begin=b, end=e, progress=None)
              for b, e in ((1, 50), (50, 100))]
    merged = merge_states(*halves)["u"]
    assert merged.dtype == np.int64
    np.testing.assert_array_equal(merged, np.bincount(stream[1:], minlength=30))


def permuted_codes(codes, seed):
    """The same cipher with its regular tokens' codes shuffled: equal shapes, different codes."""
    order = np.arange(len(codes.level))
    order[2:] = 2 + np.random.default_rng(seed).permutation(len(order) - 2)
    return codes._replace(bit_index=codes.bit_index[order], level=codes.level[order])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offset_step_compiles_once_over_passes_and_new_codes(layout):
    """Passes with the same static configuration share one executable, even with accumulators
    rebuilt from other codes of the same shapes (the codes are runtime inputs), and every pass
    still counts exactly what np.add.at counts."""
    from saffu.engine.accumulators import _compiled_step
    vocab_size, bits = layout
    radius, chunk = 3, 37                       # a chunk size no other test uses: a fresh cache entry
    stream = random_stream(11, 700, vocab_size)
    base = sparse_bit_cipher(vocab_size, bits)
    misses = []
    for seed in range(3):
        codes = base if seed == 0 else permuted_codes(base, seed)
        acc = offset_cooccurrence(codes, vocab_size, radius)
        states = accumulate_states(stream, {"u": unigram_counts(vocab_size), "o": acc}, chunk_size=chunk,
                                   mesh=local_mesh(1), progress=None)
        misses.append(_compiled_step.cache_info().misses)
        counts = reference_offset_counts(stream, codes, vocab_size, radius)              # [M, L, K, V]
        L = counts.shape[1]
        D = int(np.lcm.reduce(np.arange(1, L + 1)))
        exact = np.einsum("mlkv,l->mkv", counts, D // np.arange(1, L + 1))
        np.testing.assert_array_equal(np.rint(acc.finalize(states["o"]) * D).astype(np.int64), exact)
        np.testing.assert_array_equal(states["u"], np.bincount(stream[1:], minlength=vocab_size))
    assert misses[1] == misses[0] and misses[2] == misses[0]        # no compilation after the first pass


def test_offset_codes_reach_the_compiled_step_as_arguments_not_constants():
    from saffu.engine.accumulators import _sharded_step
    vocab_size, bits = 40, 6
    acc = offset_cooccurrence(sparse_bit_cipher(vocab_size, bits), vocab_size, 2)
    slots = acc.inputs["slots"]
    step = _sharded_step((acc,), local_mesh(1), 2, 16, None)
    table = f"s32[{slots.shape[0]},{slots.shape[1]}]"
    assert [line for line in step.as_text().splitlines() if "constant(" in line and table in line] == []
    assert any(table in line for line in step.as_text().splitlines() if "parameter(" in line)


def test_closure_updates_are_not_cached_but_static_ones_are():
    from saffu.engine.accumulators import _compiled_step, _is_static
    assert _is_static(unigram_counts(5).update) and _is_static(offset_cooccurrence(sparse_bit_cipher(20, 6), 20, 2).update)
    acc = feature_target(lambda b, context: context["table"][b.context[:, 0]], 6, 25, 1)
    assert not _is_static(acc.update)
    before = _compiled_step.cache_info().currsize
    accumulate(random_stream(2, 100, 25), {"f": acc}, chunk_size=16, progress=None,
               context={"table": np.ones((25, 6), np.float32)})
    assert _compiled_step.cache_info().currsize == before          # no executable cached on a closure
