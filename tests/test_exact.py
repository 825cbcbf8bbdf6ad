"""The token-resolution explicit model: sparse tables against the dense float64 formula, the
context search, mergeable exact counts, calibration."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu import SaffuError
from saffu.configs import ExactConfig
from saffu.data.tokenizer import EOD_ID, PAD_ID
from saffu.engine.distributed import document_shard
from saffu.engine.rows import merge_rows
from saffu.models.exact import compact_tables, context_ids, exact_logits, group_rows, table_rows
from saffu.ngram.counts import count_rows
from saffu.solve.exact import build_group, outside_ranges, solve_exact


def in_document_context(stream, head, offsets):
    """Plain loops: the tokens at ``offsets`` before ``head`` in its document, else <pad>."""
    out = []
    for delta in offsets:
        j = head - delta
        visible = j >= 0 and not any(stream[i] == EOD_ID for i in range(j + 1, head + 1))
        out.append(int(stream[j]) if visible else PAD_ID)
    return tuple(out)


@pytest.mark.parametrize("bucket_by, nested, smoothing", [(None, False, "dirichlet"), (2, False, "dirichlet"),
                                                         (None, True, "dirichlet"), (2, True, "dirichlet"),
                                                         (None, True, "witten_bell"), (None, True, "kneser_ney")])
def test_sparse_model_equals_the_dense_float64_formula(tiny_workdir, bucket_by, nested, smoothing):
    V = tiny_workdir.vocab_size
    mu = 5.0 if smoothing == "dirichlet" else 0.7
    config = ExactConfig(vocab_size=V, groups=((0,), (2,), (0, 1)), buckets=(3, 10), holdout_tokens=200, mu=mu,
                         bucket_by=bucket_by, nested=nested, smoothing=smoothing)
    params, report = solve_exact(tiny_workdir, config, progress=False)
    assert report["holdout_loss_first_part"] < report["holdout_loss_beta1"]     # the same tokens
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    holdout = tiny_workdir.sample_documents("train_10M", 200)[0]
    counted = outside_ranges(holdout, 1, len(stream))
    unigram, pairs = Counter(), [Counter() for _ in config.groups]
    for a, b in counted:
        for t in range(a, b):
            unigram[int(stream[t])] += 1
            for g, offsets in enumerate(config.groups):
                pairs[g][(in_document_context(stream, t - 1, offsets), int(stream[t]))] += 1
    n = np.array([unigram[v] for v in range(V)], np.float64)
    prior = (n + 1) / (n.sum() + V)
    dev = np.asarray(tiny_workdir.tokens("dev"))[:50]
    beta = np.asarray(params["beta"], np.float64)
    reference = np.tile(np.log(prior), (len(dev), 1))
    context_count = [Counter() for _ in config.groups]
    for g in range(len(config.groups)):
        for (c, _), count in pairs[g].items():
            context_count[g][c] += count
    # Kneser-Ney: (0,) counts continuations N1+(• c y) (distinct x_{t-2} in (0, 1)'s rows) and is
    # smoothed towards the continuation unigram N1+(• y); both nested levels are discounted
    continuation = Counter(((c[0],), y) for c, y in pairs[2])
    smooth = [continuation if smoothing == "kneser_ney" else pairs[0], pairs[1], pairs[2]]
    distinct = np.bincount([y for _, y in pairs[0]], minlength=V) + 0.5
    p_continuation = distinct / distinct.sum()

    def discounts(table):
        n = [max(sum(1 for k in table.values() if k == i), 1) for i in range(1, 5)]
        y = n[0] / (n[0] + 2 * n[1])
        return [0.0] + [min(max(i - (i + 1) * y * n[i] / n[i - 1], 0.1), 0.9 * i) for i in range(1, 4)]

    def conditional(g, p):
        """Group g's smoothed P(· | its context at p), and the distribution L is relative to."""
        relative = conditional(0, p)[0] if nested and g == 2 else prior     # (0, 1) extends (0,)
        c = in_document_context(dev, p, config.groups[g])
        seen = np.array([smooth[g].get((c, y), 0) for y in range(V)], np.float64)
        if seen.sum() == 0:                               # a context never counted: L = 0
            return relative, relative
        if smoothing == "kneser_ney" and g != 1:          # modified Kneser-Ney on the nested chain
            towards = p_continuation if g == 0 else relative
            d = np.array(discounts(smooth[g]))[np.minimum(seen, 3).astype(int)]
            return (seen - d) / seen.sum() + d.sum() / seen.sum() * towards, relative
        strength = config.mu * (seen > 0).sum() if smoothing != "dirichlet" else config.mu
        return (seen + strength * relative) / (seen.sum() + strength), relative

    for g in range(len(config.groups)):
        by = g if bucket_by is None else bucket_by
        for p in range(len(dev)):
            smoothed, relative = conditional(g, p)
            by_count = context_count[by][in_document_context(dev, p, config.groups[by])]
            bucket = np.searchsorted(config.buckets, by_count, side="right")
            reference[p] += beta[g, bucket] * (np.log(smoothed) - np.log(relative))
    got = np.asarray(exact_logits(params, config, jnp.asarray(dev[None].astype(np.int32))))[0]
    np.testing.assert_allclose(got, reference, atol=1e-5)            # float32 tables vs float64
    if smoothing == "kneser_ney":     # the root's log(p_cont / p) is one stored V-vector, its rows stay sparse
        assert params["groups"][0]["shift"].shape == (V,)
        assert report["group0_dense_contexts"] < report["group0_contexts"]


def _per_group_logits(params, config, tokens):
    """The lookup one group at a time: ``log p + Σ_g β_g · L_g``, each group's ``V``-wide row
    built on its own (the formulation the fused lookup replaces)."""
    B, S = tokens.shape
    logits = jnp.broadcast_to(params["log_prior"], (B * S, config.vocab_size))
    for g, (row, bucket) in enumerate(group_rows(params, config, tokens)):
        logits = logits + params["beta"][g, bucket][:, None] * row
    return logits.reshape(B, S, config.vocab_size)


@pytest.mark.parametrize("bucket_by", [None, 1])
def test_fused_lookup_over_compact_tables_equals_the_per_group_rows(tiny_workdir, bucket_by):
    V = tiny_workdir.vocab_size
    config = ExactConfig(vocab_size=V, groups=((0,), (1,), (0, 1)), buckets=(3,), holdout_tokens=200,
                         smoothing="kneser_ney", bucket_by=bucket_by)
    params, _ = solve_exact(tiny_workdir, config, progress=False)
    compact = compact_tables(params)
    assert all("ell_col" not in group and "sparse_col" in group for group in compact["groups"])
    assert all(a is b for a, b in zip(compact_tables(compact)["groups"], compact["groups"]))     # already compact
    padded_bytes = sum(group["ell_col"].nbytes + group["ell_val"].nbytes for group in params["groups"])
    compact_bytes = sum(group[name].nbytes for group in compact["groups"]
                        for name in ("sparse_start", "sparse_col", "sparse_val", "sparse_slots"))
    assert compact_bytes < padded_bytes
    stream = np.asarray(tiny_workdir.tokens("dev"))
    tokens = jnp.asarray(np.stack([stream[:40], stream[40:80]]).astype(np.int32))
    want = _per_group_logits(params, config, tokens)
    for tables in (params, compact):
        np.testing.assert_allclose(np.asarray(exact_logits(tables, config, tokens)), np.asarray(want), atol=1e-5)
    ids = jnp.arange(compact["groups"][2]["const"].shape[0], dtype=jnp.int32)        # every context, sentinel too
    np.testing.assert_array_equal(np.asarray(table_rows(compact["groups"][2], ids)),
                                  np.asarray(table_rows(params["groups"][2], ids)))
    log_probs = lambda logits: np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(log_probs(exact_logits(compact, config, tokens)), log_probs(want), atol=1e-5)


def test_context_search_finds_counted_contexts_and_only_those():
    rng = np.random.default_rng(0)
    V = 50
    rows = np.unique(rng.integers(0, V, (400, 4)), axis=0).astype(np.int32)   # 3 context tokens + target
    counts = rng.integers(1, 5, len(rows)).astype(np.int64)
    prior = np.full(V, 1.0 / V)
    group, summary, _ = build_group(rows, counts, 3, prior, 10.0, (2,))
    group = jax.tree.map(jnp.asarray, group)
    contexts = np.unique(rows[:, :3], axis=0)
    assert summary["contexts"] == len(contexts)
    ids = np.asarray(context_ids(group, jnp.asarray(contexts), V))
    np.testing.assert_array_equal(ids, np.arange(len(contexts)))             # lexicographic ids
    unseen = rng.integers(0, V, (300, 3)).astype(np.int32)
    known = {tuple(c) for c in contexts}
    unseen = unseen[[tuple(c) not in known for c in unseen]]
    assert (np.asarray(context_ids(group, jnp.asarray(unseen), V)) == len(contexts)).all()


@pytest.mark.parametrize("columns", [(), (0,), (3,), (0, 1, 2)])
def test_counts_of_two_document_shards_merge_to_one_pass(tiny_workdir, columns):
    """What each of two processes counts on its document shard, merged, is the one-process count."""
    stream = tiny_workdir.tokens("train_10M")
    V = tiny_workdir.vocab_size
    whole = count_rows(stream, columns, [(1, len(stream))], vocab_size=V, chunk_size=97)
    shards = [count_rows(stream, columns, [document_shard(stream, i, 2, 1, len(stream))], vocab_size=V,
                         chunk_size=64) for i in range(2)]
    merged = merge_rows(shards, V)
    np.testing.assert_array_equal(merged[0], whole[0])
    np.testing.assert_array_equal(merged[1], whole[1])
    assert whole[1].sum() == len(stream) - 1


def test_one_bucket_gives_one_temperature_per_group_at_the_holdout_optimum(tiny_workdir):
    V = tiny_workdir.vocab_size
    config = ExactConfig(vocab_size=V, groups=((0,), (1,)), buckets=(), holdout_tokens=300, mu=5.0)
    params, _ = solve_exact(tiny_workdir, config, progress=False)
    assert params["beta"].shape == (2, 1)
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    holdout = tiny_workdir.sample_documents("train_10M", 300)[0]
    targets = np.concatenate([np.arange(a, b) for a, b in holdout])

    def holdout_loss(beta):
        logits = np.asarray(exact_logits({**params, "beta": jnp.asarray(beta, jnp.float32)}, config,
                                          jnp.asarray(stream[None].astype(np.int32))), np.float64)[0]
        log_p = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        return -log_p[targets - 1, stream[targets]].mean()

    best = holdout_loss(np.asarray(params["beta"]))
    for g in range(2):
        for step in (-0.05, 0.05):
            moved = np.asarray(params["beta"]).copy()
            moved[g, 0] += step
            assert holdout_loss(moved) >= best - 1e-5


def test_bad_exact_configs_are_clear_errors():
    with pytest.raises(SaffuError, match="offsets"):
        ExactConfig(vocab_size=10, groups=((0, 0),))
    with pytest.raises(SaffuError, match="bucket"):
        ExactConfig(vocab_size=10, buckets=(10, 3))
    with pytest.raises(SaffuError, match="mu"):
        ExactConfig(vocab_size=10, mu=0.0)


def test_cli_solves_saves_scores_and_refuses_to_train_an_exact_model(tiny_workdir, tmp_path, capsys):
    import json

    from saffu.cli import main
    run, metrics = tmp_path / "exact", tmp_path / "m.json"
    args = ["--workdir", str(tiny_workdir.path), "--run", str(run)]
    assert main(["exact", *args, "--groups", "0 1 0,1", "--buckets", "3", "--holdout-tokens", "200", "--quiet",
                 "--metrics-json", str(metrics)]) == 0
    solved = json.loads(metrics.read_text())
    assert solved["holdout_loss_first_part"] < solved["holdout_loss_beta1"] and np.isfinite(solved["dev_bpb"])
    assert solved["group2_contexts"] > 0 and "beta_2_1" in solved
    assert main(["eval", *args, "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["dev_bpb"] == pytest.approx(solved["dev_bpb"], rel=1e-6)
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    (blimp / "p.jsonl").write_text(json.dumps({"sentence_good": "the cat sat on the mat .",
                                               "sentence_bad": "the cat mat on the sat .", "field": "syntax",
                                               "UID": "p"}) + "\n")
    assert main(["blimp", *args, "--blimp", str(blimp), "--quiet", "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["blimp_accuracy"] == 1.0
    assert main(["generate", *args, "--num-samples", "2", "--max-tokens", "6", "--quiet",
                 "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["samples"] == 2
    capsys.readouterr()
    assert main(["train", *args, "--init", "explicit", "--quiet"]) == 2
    assert "not trained" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["exact", *args, "--groups", "0 x"])
    assert "comma-separated offsets" in capsys.readouterr().err
