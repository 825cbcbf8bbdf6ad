"""The cross-fitted residual: folds of whole documents, each fold's exact model solved without
it, training steps that read only their fold's windows and tables, evaluation on the whole
split's tables."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saffu.configs import ExactConfig, TrainConfig, TransformerConfig
from saffu.data.folds import fold_documents, fold_targets, fold_window_starts, other_folds
from saffu.data.tokenizer import EOD_ID
from saffu.data.workdir import open_workdir
from saffu.models.exact import exact_logits
from saffu.models.interface import model_logits, target_nll
from saffu.training.checkpoints import load_explicit, save_explicit_run
from saffu.training.recipes import residual_start, solve_folds
from saffu.training.trainer import BatchSchedule

PLANTED = "zqx jv"          # bytes the tiny corpus never uses otherwise


@pytest.fixture(scope="module")
def planted_workdir(tmp_path_factory):
    """The tiny corpus with one document that alone holds the planted bytes."""
    from saffu import PrepareConfig, babylm_corpus, prepare
    from tests.conftest import TINY_DEV, TINY_TRAIN
    root = tmp_path_factory.mktemp("planted")
    (root / "train_10M").mkdir()
    (root / "dev").mkdir()
    lines = list(TINY_TRAIN)
    lines.insert(37, f"the cat saw {PLANTED} .")
    (root / "train_10M" / "a.train").write_text("\n".join(lines) + "\n")
    (root / "dev" / "a.dev").write_text("\n".join(TINY_DEV) + "\n")
    return prepare(babylm_corpus(root), root / "work", PrepareConfig(vocab_size=280), show_progress=False)


def small_exact(workdir):
    return ExactConfig(workdir.vocab_size, groups=((0,), (0, 1)), buckets=(2,), holdout_tokens=100)


def test_folds_cover_every_document_once_in_interleaved_blocks(tiny_workdir):
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    documents = tiny_workdir.split_info("train_10M")["documents"]
    for folds, blocks in ((2, 8), (3, 8), (2, 64)):
        per_fold = fold_documents(stream, folds, blocks)
        covered = sorted(r for ranges in per_fold for r in ranges)
        assert covered[0][0] == 0 and covered[-1][1] == documents
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))          # disjoint, no gap
        assert all(ranges for ranges in per_fold) and len(covered) == min(blocks, documents)
        targets = fold_targets(stream, folds, blocks)
        assert sum(e - b for ranges in targets for b, e in ranges) == len(stream) - 1   # every target once
        for k in range(folds):
            rest = other_folds(per_fold, k)
            assert sum(b - a for a, b in rest) + sum(b - a for a, b in per_fold[k]) == documents
        for k, starts in enumerate(fold_window_starts(stream, folds, 16, blocks)):
            inside = lambda s, k=k, targets=targets: any(b <= s and s + 16 <= e for b, e in targets[k])
            assert len(starts) and all(inside(int(s)) for s in starts)
    # every fold's targets end with a document's closing <eod>
    assert all(stream[e - 1] == EOD_ID for ranges in fold_targets(stream, 2, 8) for _, e in ranges)


def test_each_folds_exact_model_never_counted_its_own_fold(planted_workdir, tmp_path):
    stream = np.asarray(planted_workdir.tokens("train_10M"))
    counts = np.bincount(stream, minlength=planted_workdir.vocab_size)
    planted = sorted(i for i in set(planted_workdir.tokenizer().encode(PLANTED).ids) if counts[i] == 1)
    assert planted, "tokens of the planted document that no other document holds"
    config = small_exact(planted_workdir)
    runs, fingerprints, seconds = solve_folds(planted_workdir, config, 2, tmp_path / "folds", blocks=8)
    assert seconds > 0 and len(set(fingerprints)) == 2
    targets = fold_targets(stream, 2, 8)
    where = np.flatnonzero(np.isin(stream, planted))
    home = [k for k in range(2) if all(any(b <= p < e for b, e in targets[k]) for p in where)]
    assert len(home) == 1, "the planted document lies in one fold"
    home = home[0]
    never = int(np.flatnonzero(counts == 0)[-1])                 # a token no document holds
    for k, run in enumerate(runs):
        data = open_workdir(Path(run) / "data")
        prior = np.asarray(load_explicit(run, config)["log_prior"])
        if k == home:       # solved without the planted document: its tokens were never counted
            assert data.token_counts()[planted].sum() == 0
            np.testing.assert_array_equal(prior[planted], prior[never])
        else:
            assert (data.token_counts()[planted] == 1).all() and (prior[planted] > prior[never]).all()
    # a second call keeps the solved folds
    assert solve_folds(planted_workdir, config, 2, tmp_path / "folds", blocks=8)[1:] == (fingerprints, 0.0)


@pytest.mark.slow   # an exact solve, two fold solves and six steps' logits compared: about 15 s
def test_step_zero_is_each_folds_exact_model_on_that_folds_windows(tiny_workdir, tmp_path):
    from saffu.solve.exact import solve_exact
    config = small_exact(tiny_workdir)
    params, _ = solve_exact(tiny_workdir, config, progress=False)
    save_explicit_run(tmp_path / "exact", config, tiny_workdir, params)
    runs, _, _ = solve_folds(tiny_workdir, config, 2, tmp_path / "folds", blocks=8)
    base = TransformerConfig(tiny_workdir.vocab_size, width=16, layers=1, heads=2, context_tokens=4, max_len=64,
                             block="gpt", output_bias=True)
    model, start = residual_start(base, tmp_path / "exact", jax.random.key(0), fold_runs=tuple(runs), fold_blocks=8)
    assert model.fixed_params == ("explicit", "folds", "scale")
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    schedule = BatchSchedule(stream, model, TrainConfig(batch_size=2, seq_len=16, seed=3))
    targets = fold_targets(stream, 2, 8)
    for step in range(6):
        fold = step % 2
        assert model.step_inputs(step, 10) == {"fold": fold} and model.eval_inputs(step, 10) == {}
        windows, mask = schedule(step)
        assert mask.all()
        starts = [int(s) for s in schedule._starts[fold]]          # the step's windows come from its fold only
        assert all(any(b <= s and s + 16 <= e for b, e in targets[fold]) for s in starts)
        tokens = jnp.asarray(windows)
        tables = load_explicit(runs[fold], config)
        expected = jax.nn.log_softmax(exact_logits(tables, config, tokens), axis=-1)
        got = model_logits(model, {**start, "fold": jnp.int32(fold)}, tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
        whole = jax.nn.log_softmax(exact_logits(start["explicit"], config, tokens), axis=-1)
        np.testing.assert_allclose(np.asarray(model_logits(model, start, tokens)), np.asarray(whole), atol=1e-5)
        # the training loss (target_nll: the fold's lookup at the targets only) is that fold's NLL
        context = model.context
        picked = np.take_along_axis(np.asarray(expected, np.float64)[:, context - 1:-1],
                                    np.asarray(windows)[:, context:, None], axis=-1)[..., 0]
        nll = target_nll({**start, "fold": jnp.int32(fold)}, model, tokens, jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(nll), -picked, atol=1e-5)
    # no gradient reaches any table
    looked_up = lambda p: model_logits(model, {**start, **p, "fold": jnp.int32(1)}, tokens)[..., 3].sum()
    trained = lambda p: target_nll({**start, **p, "fold": jnp.int32(1)}, model, tokens, jnp.asarray(mask)).sum()
    for loss in (looked_up, trained):
        grads = jax.grad(loss, allow_int=True)({"folds": start["folds"], "explicit": start["explicit"]})
        assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads)
                   if jnp.issubdtype(g.dtype, jnp.floating))


@pytest.mark.slow   # an exact solve, two fold solves, a short training and its score: about 30 s
def test_cli_cross_fitted_residual_trains_and_scores_on_the_whole_splits_tables(tiny_workdir, tmp_path):
    from saffu.cli import main
    exact, metrics = tmp_path / "exact", tmp_path / "m.json"
    work = ["--workdir", str(tiny_workdir.path)]
    assert main(["exact", *work, "--run", str(exact), "--groups", "0 0,1", "--buckets", "2", "--holdout-tokens",
                 "100", "--quiet", "--metrics-json", str(metrics)]) == 0
    exact_bpb = json.loads(metrics.read_text())["dev_bpb"]
    run = tmp_path / "crossfit"
    small = ["--model", "transformer", "--block", "gpt", "--output-bias",
             "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
             "--max-len", "64", "--batch-size", "2", "--seq-len", "8", "--quiet"]
    assert main(["train", *work, "--run", str(run), "--init", "random", "--residual", str(exact), "--cross-fit", "2",
                 *small, "--steps", "2", "--learning-rate", "0", "--metrics-json", str(metrics)]) == 0
    trained = json.loads(metrics.read_text())
    assert trained["dev_bpb"] == pytest.approx(exact_bpb, rel=1e-5)         # evaluation: the whole split's tables
    recorded = json.loads((run / "config.json").read_text())["model"]
    assert recorded["folds"] == 2 and recorded["fold_runs"] == ["folds/fold0", "folds/fold1"]
    assert main(["train", *work, "--run", str(run), "--init", "random", *small, "--steps", "4",
                 "--learning-rate", "0"]) == 0                # resumes: the residual and its folds are the run's
    assert main(["eval", *work, "--run", str(run), "--quiet"]) == 0
