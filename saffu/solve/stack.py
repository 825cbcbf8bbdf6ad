"""The compositional explicit solution of a SAFFU stack (formulation §3), stage by stage.

For block ``l`` (blocks are solved in order, each reading the solved blocks below it), with
``X`` the block's windows and ``y`` the next token, every stage is one streaming pass over the
counted part of the training split and uses only weights already solved:

1. positional predictors ``F_δ = Σ X[δ]ᵀ e(y)``, ``P_δ = rownorm(F_δ)`` (exact integer counts
   for the first block, whose rows are cipher codes);
2. attention ``W_A^h = log rownorm(Σ sᵀ q)`` with ``s = X x_h`` and ``q(m) ∝ exp(X[m]ᵀ log
   P_m[:, y])`` — each position's responsibility for the true next token;
3. direct output: ``W_g = log P_g(y | ·) − log p(y)`` per group (the ``positions`` nearest
   rows reuse ``F_δ``; values ``u_h`` are counted with the solved attention), bias ``log p``;
   chain output: ``W_1`` from ``Σ [u; x_h]ᵀ c(y)`` (hidden target: the next token's cipher
   code, so ``D = K``), then ``W_2`` from ``Σ zᵀ e(y)`` with ``z`` computed by the solved ``W_1``;
4. calibration of one temperature per group (direct) or per layer (chain) on the last
   ``holdout_tokens`` of the training stream, which no count saw (Newton's method for the
   direct form, whose loss is convex in its temperatures; L-BFGS for the chain); a structured
   chain (``config.chain``) then takes the SVD of its calibrated dense layers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from saffu._io import SaffuError
from saffu.configs import SolverConfig
from saffu.data.tokenizer import PAD_ID
from saffu.data.windows import range_windows
from saffu.data.workdir import WorkDir
from saffu.engine import accounting
from saffu.engine.accumulators import Batch, accumulate, feature_target, offset_cooccurrence, unigram_counts
from saffu.engine.codes import sparse_bit_cipher
from saffu.engine.explicit import Smoothing, conditional_probabilities, unigram_prior
from saffu.models.exact import document_contexts, table_rows
from saffu.models.interface import window_loss
from saffu.models.saffu import (
    Params,
    SaffuConfig,
    attention_values,
    block_inputs,
    block_windows,
    cipher_table,
    hidden_features,
    init_params,
    output_groups,
    structure_chain,
)
from saffu.ngram.counts import count_rows
from saffu.solve.exact import build_group

HIGHEST = jax.lax.Precision.HIGHEST


def _llr(cooccurrence: np.ndarray, smoothing: Smoothing, prior: np.ndarray) -> np.ndarray:
    """``log P(y | i) − log p(y)``, ``float32[N, V]``."""
    return np.log(conditional_probabilities(cooccurrence, smoothing, prior) / prior[None, :]).astype(np.float32)


def _block_windows_for_targets(solved: Params, config: SaffuConfig, block: int, batch: Batch) -> jax.Array:
    """Block ``block``'s windows ``X [C, M, K]`` for the targets of an accumulator batch
    (``solved``: the codes and the blocks below, jit arguments)."""
    context = batch.window.shape[0] - batch.targets.shape[0]
    sequence, visible = block_inputs(solved, config, batch.window[None], block)
    X = block_windows(sequence, visible, solved["codes"][PAD_ID])[0]
    return X[context - 1:-1]


def _sparse_codes(config: SaffuConfig) -> dict[str, np.ndarray]:
    """Block 0's rows in sparse form: token ``v``'s cipher code (no background) has the value
    ``code_vals[v, i]`` (``1/level``, or 0 for an unused slot) at coordinate ``code_bits[v, i]``,
    ``i < L``; the ``<pad>`` code included."""
    sparse = sparse_bit_cipher(config.vocab_size, config.bits)
    return {"code_bits": np.maximum(sparse.bit_index, 0).astype(np.int32),
            "code_vals": np.where(sparse.bit_index >= 0, 1.0 / sparse.level[:, None], 0.0).astype(np.float32)}


def _sparse_windows(batch: Batch, ctx, radius: int) -> tuple[jax.Array, jax.Array]:
    """Block 0's windows ``X [C, radius, K]`` in sparse form, from the batch's token contexts:
    ``bits int32[C, radius, L]`` and ``vals float32[C, radius, L]``, dense-equivalent to
    :func:`_block_windows_for_targets` (whose ``<pad>`` rows are the ``<pad>`` code, as are
    ``batch.context``'s)."""
    context = batch.context[:, :radius]
    return ctx["code_bits"][context], ctx["code_vals"][context]


def _sparse_similarity(bits: jax.Array, vals: jax.Array) -> jax.Array:
    """``X[m] · X[0]`` for every row of sparse windows (:func:`_sparse_windows`), ``[C, m]``:
    the products of the values on the coordinates two rows share."""
    shared = (bits[:, :, :, None] == bits[:, None, 0, None, :]).astype(jnp.float32)   # [C, m, L, L]
    return jnp.einsum("cmi,cj,cmij->cm", vals, vals[:, 0], shared)


def solve_explicit(workdir: WorkDir, config: SaffuConfig, solver: SolverConfig = SolverConfig(),
                   mesh=None, progress: bool = True, below: Params | None = None) -> tuple[Params, dict[str, Any]]:
    """Explicit parameters of ``config`` from the training split of ``workdir``.

    ``below``: the params of a stack's first ``k < config.blocks`` blocks (trained or solved,
    ``{"blocks": {0: …, …, k − 1: …}}``); they are kept unchanged and only blocks ``k … L − 1`` are
    solved, each reading the blocks under it — a SAFFU stack grown by explicit blocks on top of
    a trained one (Inheritune's growth). ``report["solved_blocks"]`` says how many were solved.

    Returns the params dict (exactly the structure of :func:`saffu.models.saffu.init_params`, the
    fixed cipher codes ``"codes"`` included) and a
    report with the seconds of every stage, the calibrated temperatures, the holdout loss and
    the compute: ``seconds``, ``tokens_per_s`` (counted tokens per second), ``xla_flops``
    (XLA's count over every streaming pass and calibration step; XLA counts no FLOPs for the
    scatter-adds of counting), ``flops`` (:func:`analytic_solve_flops`) and ``peak_rss_mb``.
    """
    with accounting.flop_ledger() as ledger:
        params, report = _solve(workdir, config, solver, mesh, progress, below)
    report["flops"] = analytic_solve_flops(config, report)
    report["xla_flops"] = ledger.total if ledger.complete else None
    report["tokens_per_s"] = report["counted_tokens"] / report["seconds"]
    report.update(accounting.memory_record())
    return params, report


def analytic_solve_flops(config: SaffuConfig, report: dict[str, Any]) -> float:
    """Analytic operation count of a solve (2 per multiply-add, 1 per count increment).

    Per counted token and solved block: the positional counts (``M·K`` increments, dense-code
    equivalent), the attention pass (every head's similarities and scores, the responsibilities
    ``X · log P[:, y]`` and the ``sᵀq`` outer product), the value pass (the attention forward and
    the value counts) and, for the chain, the hidden-layer pass. Per calibration evaluation and
    holdout token: a forward pass plus the gradient and Hessian over the groups (direct form:
    ``2·G²·V``) or a backward pass (chain: two more forward passes).
    """
    K, M, V, H = config.dim, config.radius, config.vocab_size, config.heads
    radii = [config.head_radius(h) for h in range(H)]
    attention_forward = sum(2 * (2 * m * K + m * m) for m in radii)
    per_token = (M * K                                                  # positional counts
                 + attention_forward + 2 * M * K + sum(m * m for m in radii)   # attention stage
                 + attention_forward + config.groups * K)                # value stage
    if config.hidden:
        per_token += 2 * (H + 1) * K * config.hidden + config.hidden + K * K
    evaluation = config.forward_flops() + (2 * config.groups ** 2 * V if config.hidden == 0
                                           else 2 * config.forward_flops())
    return float(report.get("solved_blocks", config.blocks) * per_token * report["counted_tokens"]
                 + report["calibration_evaluations"] * report["holdout_tokens"] * evaluation)


def _stack_below(below: Params, config: SaffuConfig, template: Params) -> dict[int, Params]:
    """The given lower blocks of a stack, checked against ``config``'s block shapes."""
    blocks = below.get("blocks", {}) if isinstance(below, dict) else {}
    k = len(blocks)
    if not 1 <= k < config.blocks or sorted(blocks) != list(range(k)):
        raise SaffuError(f"below must hold blocks 0 … k − 1 of the stack with 1 ≤ k < {config.blocks} "
                         f"(the stack's --blocks); got {sorted(blocks)}")
    if config.exact_positions:
        raise SaffuError("a stack with exact-position groups has one block; there is nothing to solve on top")
    for index in range(k):
        same = jax.tree.structure(blocks[index]) == jax.tree.structure(template["blocks"][index]) and all(
            np.shape(a) == b.shape for a, b in zip(jax.tree.leaves(blocks[index]),
                                                    jax.tree.leaves(template["blocks"][index])))
        if not same:
            raise SaffuError(f"block {index} of below does not have the shapes of this stack's blocks "
                             f"(radius, heads, positions, hidden, bits and vocabulary must agree)")
    return {index: jax.tree.map(jnp.asarray, blocks[index]) for index in range(k)}


def _solve(workdir, config, solver, mesh, progress, below=None):
    if config.vocab_size != workdir.vocab_size:
        raise SaffuError(f"model vocabulary {config.vocab_size} differs from the work directory's "
                         f"{workdir.vocab_size}; use --vocab-size {workdir.vocab_size}")
    if config.hidden not in (0, config.dim):
        raise SaffuError(f"the explicit chain's hidden target is the next token's cipher code, so it "
                         f"needs --hidden {config.dim} (K = bits + 1); got {config.hidden}")
    workdir.check_radius(config.radius)
    start = time.perf_counter()
    stream = workdir.tokens(workdir.train_split)
    holdout = min(solver.holdout_tokens, len(stream) // 10)
    counted_end = len(stream) - holdout
    V, K, M = config.vocab_size, config.dim, config.radius
    codes = np.asarray(cipher_table(config))
    template = init_params(config, jax.random.key(0))
    # the fixed codes are a parameter (a jit argument of every pass), as in the model
    solved: Params = {"blocks": {} if below is None else _stack_below(below, config, template),
                      "codes": jnp.asarray(codes)}
    first = len(solved["blocks"])
    report: dict[str, Any] = {"counted_tokens": counted_end - 1, "holdout_tokens": holdout, "streaming_passes": 0,
                              "calibration_evaluations": 0, "solved_blocks": config.blocks - first}

    def run(accumulators, label, context=None):
        tick = time.perf_counter()
        out = accumulate(stream, accumulators, end=counted_end, chunk_size=solver.chunk_size, mesh=mesh,
                         context=context, progress=label if progress else None)
        report[f"seconds_{label}"] = time.perf_counter() - tick
        report["streaming_passes"] += 1
        return out

    if first:       # the unigram prior, which block 0's positional pass would have counted
        prior = unigram_prior(run({"unigram": unigram_counts(V)}, "unigram")["unigram"])
    for index in range(first, config.blocks):
        tag = f"block{index}"
        # Every pass reads its weights from ``context`` (a jit argument), never from a closure.
        windows_of = lambda batch, ctx, index=index: _block_windows_for_targets(ctx["solved"], config, index, batch)
        # Stage 1: positional predictors (and the unigram prior).
        if index == 0:
            stats = run({"unigram": unigram_counts(V),
                         "offsets": offset_cooccurrence(sparse_bit_cipher(V, config.bits), V, M)},
                        f"{tag}_positional")
            prior = unigram_prior(stats["unigram"])
            offsets = stats["offsets"]                                          # [M, K, V]
            if config.exact_positions:     # exact token groups: sparse tables of the same counted range
                solved["exact"] = _exact_groups(stream, counted_end, config, prior, solver, progress)
        else:
            acc = feature_target(lambda b, ctx: windows_of(b, ctx).reshape(b.targets.shape[0], M * K),
                                 M * K, V, config.context)
            offsets = run({"offsets": acc}, f"{tag}_positional", {"solved": solved})["offsets"].reshape(M, K, V)
        log_positional = np.stack([np.log(conditional_probabilities(offsets[d], solver.smoothing, prior))
                                   for d in range(M)]).astype(np.float32)          # [M, K, V]
        # target-major copy: a target's M·K entries are one contiguous row for the gather
        log_positional_by_target = np.ascontiguousarray(log_positional.transpose(2, 0, 1))  # [V, M, K]

        # Stage 2: attention, every head in one pass. Block 0's rows are sparse cipher codes
        # (1–2 non-zeros of K): their non-zeros are gathered instead of building dense windows.
        def responsibilities(batch, ctx, radius):
            if index == 0:
                bits, vals = _sparse_windows(batch, ctx, radius)                   # [C, m, L]
                cell = (batch.targets[:, None, None] * M + jnp.arange(radius)[None, :, None]) * K + bits
                picked = ctx["log_positional_by_target"].reshape(-1)[cell]         # [C, m, L]
                return jax.nn.softmax(jnp.sum(vals * picked, axis=-1), axis=-1)
            X = windows_of(batch, ctx)[:, :radius]                                  # [C, m, K]
            picked = ctx["log_positional_by_target"][batch.targets, :radius]        # [C, m, K]
            return jax.nn.softmax(jnp.einsum("cmk,cmk->cm", X, picked), axis=-1)

        def similarity(batch, ctx, radius):
            if index == 0:
                return _sparse_similarity(*_sparse_windows(batch, ctx, radius))
            X = windows_of(batch, ctx)
            return jnp.einsum("cmk,ck->cm", X[:, :radius], X[:, 0])

        heads = {}
        for h in range(config.heads):
            r = config.head_radius(h)
            heads[f"attention_{h}"] = feature_target(
                lambda b, ctx, r=r: similarity(b, ctx, r), r, r, config.context,
                target_fn=lambda b, ctx, r=r: responsibilities(b, ctx, r))
        sparse_codes = _sparse_codes(config) if index == 0 else {}
        attention_stats = run(heads, f"{tag}_attention",
                              {"solved": solved, "log_positional_by_target": log_positional_by_target,
                               **sparse_codes})
        block = {name: np.log(conditional_probabilities(attention_stats[name], Smoothing("additive", alpha=1e-3)))
                 .astype(np.float32) for name in heads}

        def values_of(batch, ctx):
            X = windows_of(batch, ctx)
            return X, attention_values(ctx["block"], config, X)

        def sparse_values(batch, ctx):
            """Block 0's linear values ``u_h = Σ_m a_m X[m]``, scattered from the sparse rows (no
            dense windows; the direct form's value pass reads only the values)."""
            values = []
            for h in range(config.heads):
                bits, vals = _sparse_windows(batch, ctx, config.head_radius(h))
                attention = jax.nn.softmax(_sparse_similarity(bits, vals) @ ctx["block"][f"attention_{h}"], axis=-1)
                rows = jnp.arange(bits.shape[0])[:, None, None]
                values.append(jnp.zeros((bits.shape[0], K)).at[rows, bits].add(attention[:, :, None] * vals))
            return values

        # Stage 3: output layer(s).
        context = {"solved": solved, "block": dict(block)}
        if config.hidden == 0:
            if index == 0 and config.value_form == "linear":
                value_of = lambda b, ctx, h: sparse_values(b, ctx)[h]
                context.update(sparse_codes)
            else:
                value_of = lambda b, ctx, h: values_of(b, ctx)[1][h]
            value_accs = {f"value_{h}": feature_target(lambda b, ctx, h=h: value_of(b, ctx, h), K, V, config.context)
                          for h in range(config.heads)}
            value_stats = run(value_accs, f"{tag}_values", context)
            group_stats = [offsets[d] for d in config.cipher_positions] + [value_stats[f"value_{h}"]
                                                                            for h in range(config.heads)]
            block["group_weights"] = np.stack([_llr(F, solver.smoothing, prior) for F in group_stats])
        else:
            code_prior = prior @ codes.astype(np.float64)      # expected code of the next token
            code_prior = code_prior / code_prior.sum()
            hidden_acc = feature_target(lambda b, ctx: hidden_features(config, *values_of(b, ctx)),
                                        (config.heads + 1) * K, K, config.context,
                                        target_fn=lambda b, ctx: ctx["codes"][b.targets])
            F1 = run({"hidden": hidden_acc}, f"{tag}_hidden", {**context, "codes": codes})["hidden"]
            F1 = F1.reshape(config.heads + 1, K, K)
            block["hidden_weights"] = np.concatenate([_llr(F, solver.smoothing, code_prior) for F in F1])
            block["hidden_bias"] = np.log(code_prior).astype(np.float32)

            def z_of(batch, ctx):
                X, values = values_of(batch, ctx)
                hidden = hidden_features(config, X, values) @ ctx["block"]["hidden_weights"]
                return jax.nn.softmax(hidden + ctx["block"]["hidden_bias"][None, :], axis=-1)

            F2 = run({"output": feature_target(z_of, K, V, config.context)}, f"{tag}_output",
                     {"solved": solved, "block": dict(block)})["output"]
            block["output_weights"] = _llr(F2, solver.smoothing, prior)
        block["output_bias"] = np.log(prior).astype(np.float32)
        block = {name: jnp.asarray(value) for name, value in block.items()}

        # Stage 4: temperatures on the holdout.
        tick = time.perf_counter()
        temperatures, holdout_loss, evaluations = _calibrate(solved, block, index, config, stream, counted_end,
                                                             solver) if holdout else (None, float("nan"), 0)
        report["calibration_evaluations"] += evaluations
        # a structured chain: its calibrated dense layers' SVD (closed-form structured init)
        solved["blocks"][index] = structure_chain(_scaled(block, config, temperatures), config)
        if config.exact_positions and temperatures is not None:      # the exact groups' temperatures
            solved["exact"]["beta"] = temperatures[config.cipher_groups:]
        report[f"seconds_{tag}_calibration"] = time.perf_counter() - tick
        report[f"{tag}_holdout_loss"] = holdout_loss
        if temperatures is not None:
            for i, t in enumerate(np.asarray(temperatures)):
                report[f"{tag}_temperature_{i}"] = float(t)
    report["seconds"] = time.perf_counter() - start
    _check_structure(solved["blocks"], template["blocks"])
    return solved, report


def _exact_groups(stream, counted_end: int, config: SaffuConfig, prior: np.ndarray, solver: SolverConfig,
                  progress: bool) -> Params:
    """The exact output groups of ``config.exact_positions`` (:attr:`SaffuConfig.exact_config`):
    exact sparse counts of ``[1, counted_end)`` and their Witten-Bell tables, temperatures 1."""
    exact = config.exact_config
    groups = []
    for (p,) in exact.groups:
        rows, counts = count_rows(stream, (p,), [(1, counted_end)], vocab_size=config.vocab_size,
                                  chunk_size=solver.chunk_size, progress=f"exact offset {p}" if progress else None)
        groups.append(build_group(rows, counts, 1, prior, exact.mu, exact.buckets, per_type=True)[0])
    return jax.tree.map(jnp.asarray, {"beta": np.ones(len(groups), np.float32), "groups": groups})


def _scaled(block: Params, config: SaffuConfig, temperatures) -> Params:
    """Fold temperatures into the weights (biases untouched): per group, or per layer."""
    if temperatures is None:
        return dict(block)
    out = dict(block)
    if config.hidden == 0:
        out["group_weights"] = block["group_weights"] * temperatures[:config.cipher_groups, None, None]
    else:
        out["hidden_weights"] = block["hidden_weights"] * temperatures[0]
        out["output_weights"] = block["output_weights"] * temperatures[1]
    return out


@functools.partial(jax.jit, static_argnames=("config",))
def _chain_loss_and_grad(temperatures, solved, block, windows, masks, *, config):
    """Mean holdout NLL of the chain stack ``config`` (truncated at the block being solved, its
    top block ``block`` scaled by ``temperatures``) and its gradient in the temperatures."""
    index = config.blocks - 1
    count = jnp.sum(masks).astype(jnp.float32)

    def loss(t):
        params = {**solved, "blocks": {**solved["blocks"], index: _scaled(block, config, t)}}
        step = lambda total, batch: (total + window_loss(params, config, *batch)[0], None)
        return jax.lax.scan(step, jnp.zeros(()), (windows, masks))[0] / count
    return jax.value_and_grad(loss)(temperatures)


@functools.partial(jax.jit, static_argnames=("config",))
def _group_features(windows, solved, block, *, config):
    """The direct-form feature groups ``[B, T, G, K]`` of the top block of ``config`` (the stack
    truncated at the block being solved) at the targets of ``windows [B, R + T]``; the codes,
    the blocks below and ``block`` are arguments, never constants."""
    index, context = config.blocks - 1, config.context
    sequence, visible = block_inputs(solved, config, windows, index)
    X = block_windows(sequence, visible, solved["codes"][PAD_ID])[:, context - 1:-1]   # [B, T, M, K]
    return output_groups(config, X, attention_values(block, config, X))


@jax.jit
def _project(rows, weights):
    """``rows @ weights`` in full float32 precision on every backend (no TF32 / bf16 passes)."""
    return jnp.matmul(rows, weights, precision=HIGHEST)


#: An exact group's rows of distinct context tokens (:func:`saffu.models.exact.table_rows`).
_table_rows = jax.jit(table_rows)


@jax.jit
def _loss_gradient_hessian(beta, bias, tables, index_of, targets, weights):
    """Summed NLL, gradient ``[G]`` and Hessian ``[G, G]`` in the temperatures ``β`` of
    ``logits = b + Σ_g β_g tables_g[index_of_g]`` over chunks of targets (see :func:`_newton_direct`)."""
    G = len(tables)

    def one(carry, chunk):
        idx, y, weight = chunk
        L = [tables[g][idx[g]] for g in range(G)]                             # G × [rows, V]
        logits = sum(beta[g] * L[g] for g in range(G)) + bias[None, :]
        shift = jnp.max(logits, axis=-1)
        e = jnp.exp(logits - shift[:, None])                                   # unnormalised p
        Z = jnp.sum(e, axis=-1)
        picked = jnp.stack([jnp.take_along_axis(L[g], y[:, None], axis=-1)[:, 0] for g in range(G)], axis=-1)
        mean = jnp.stack([jnp.sum(e * L[g], axis=-1) for g in range(G)], axis=-1) / Z[:, None]
        pair = {(g, h): jnp.sum(e * L[g] * L[h], axis=-1) / Z for g in range(G) for h in range(g, G)}
        second = jnp.stack([jnp.stack([pair[min(g, h), max(g, h)] for h in range(G)], axis=-1)
                            for g in range(G)], axis=-2)                         # [rows, G, G]
        nll = jnp.log(Z) + shift - picked @ beta - bias[y]
        loss, grad, hess = carry
        return (loss + jnp.sum(weight * nll),
                grad + weight @ (mean - picked),
                hess + jnp.einsum("r,rgh->gh", weight, second - mean[:, :, None] * mean[:, None, :])), None

    init = (jnp.zeros(()), jnp.zeros((G,)), jnp.zeros((G, G)))
    return jax.lax.scan(one, init, (index_of, targets, weights))[0]


def _calibrate(solved, block, index, config, stream, counted_end, solver):
    """Minimise the holdout NLL of the stack truncated at block ``index`` over its temperatures:
    Newton's method for the direct form (convex: the logits are linear in the temperatures),
    L-BFGS for the chain."""
    truncated = dataclasses.replace(config, blocks=index + 1)
    batches = list(range_windows(stream, [(counted_end, len(stream))], truncated.context, 256, 8))
    windows = jnp.asarray(np.stack([w for w, _ in batches]))                 # [n, 8, R + 256]
    masks = jnp.asarray(np.stack([m for _, m in batches]))
    if config.hidden == 0:
        return _newton_direct(solved, block, truncated, windows, masks, solver)
    arguments = (solved, block, windows, masks)      # weights and data are arguments, not constants
    compiled = _chain_loss_and_grad.lower(jnp.ones(2, jnp.float32), *arguments, config=truncated).compile()
    fun = lambda t: tuple(np.asarray(x, np.float64) for x in compiled(jnp.asarray(t, jnp.float32), *arguments))
    result = scipy.optimize.minimize(fun, np.ones(2), jac=True, method="L-BFGS-B", bounds=[(0.0, 5.0)] * 2,
                                     options={"maxiter": solver.calibration_iterations})
    accounting.record("calibration", compiled, result.nfev)
    return jnp.asarray(result.x, jnp.float32), float(result.fun), int(result.nfev)


def _newton_direct(solved, block, config, windows, masks, solver, rows: int = 64, parts: int = 8):
    """Newton steps on ``β`` for ``logits = b + Σ_g β_g L_g``: gradient ``Σ E_p[L_g] − L_g[y]``,
    Hessian ``Σ Cov_p(L_g, L_h)`` (positive semi-definite), both in one pass per step.

    The group logits ``L_g = groups_g W_g`` do not depend on ``β``, so they are computed once,
    before the steps: one row per *distinct* feature row of each group (the position groups of
    block 0 are cipher codes, so a few thousand distinct rows for the whole holdout), kept as
    a table ``[U_g, V]`` and an index ``[N]`` into it. A step then streams the tables ``rows``
    targets at a time (small enough that its intermediates stay in cache), doing only the
    softmax and the moments. The steps start from β found on one of ``parts`` interleaved
    slices of the holdout, so most steps cost a fraction of a full pass.

    Returns ``β``, the mean holdout NLL and the evaluations in whole-holdout equivalents.
    """
    context, G = config.context, config.cipher_groups
    stack = {"blocks": solved["blocks"], "codes": solved["codes"]}       # weights as arguments, never constants
    compiled = _group_features.lower(windows[0], stack, block, config=config).compile()
    accounting.record("calibration", compiled, len(windows))
    features = np.concatenate([np.asarray(compiled(w, stack, block)).reshape(-1, G, config.dim) for w in windows])

    def project(rows_, weights):
        compiled = _project.lower(rows_, weights).compile()
        accounting.record("calibration", compiled, 1)
        return compiled(rows_, weights)

    tables, index_of = [], []
    for g in range(G):
        group = np.ascontiguousarray(features[:, g])
        as_bytes = group.view(np.dtype((np.void, group.shape[1] * group.itemsize)))[:, 0]   # exact row equality
        _, first, inverse = np.unique(as_bytes, return_index=True, return_inverse=True)
        tables.append(project(jnp.asarray(group[first]), block["group_weights"][g]))   # [U_g, V]
        index_of.append(inverse.reshape(-1))
    if config.exact_positions:     # exact groups: one row per distinct token at the group's offset
        tokens = np.concatenate([np.asarray(document_contexts(w, context))[:, context - 1:-1].reshape(-1, context)
                                 for w in windows])
        for p, group in zip(config.exact_positions, solved["exact"]["groups"]):
            distinct, inverse = np.unique(tokens[:, p], return_inverse=True)
            tables.append(_table_rows(group, jnp.asarray(distinct, jnp.int32)))
            index_of.append(inverse.reshape(-1))
    G = len(tables)
    num = features.shape[0]
    padded = -(-num // (rows * parts)) * rows * parts                             # pads weigh 0
    # part p holds chunks p, p + parts, …: interleaved slices of the holdout, one compiled shape
    split = lambda a: np.pad(a, (0, padded - num)).reshape(-1, parts, rows).swapaxes(0, 1)   # [parts, n, rows]
    index_of = np.stack([split(i.astype(np.int32)) for i in index_of], axis=2)     # [parts, n, G, rows]
    targets = split(np.asarray(windows[:, :, context:]).reshape(-1).astype(np.int32))
    weights = split(np.asarray(masks).reshape(-1).astype(np.float32))
    part_data = [tuple(jnp.asarray(a[p]) for a in (index_of, targets, weights)) for p in range(parts)]

    compiled = _loss_gradient_hessian.lower(jnp.ones(G, jnp.float32), block["output_bias"], tables,
                                            *part_data[0]).compile()
    calls = 0

    def newton(beta, used):
        """Newton steps from ``beta`` on the parts ``used``; returns β and the mean NLL at the
        last evaluation (the loss changes by O(step²) in the last step)."""
        nonlocal calls
        total = float(weights[used].sum())
        for _ in range(solver.calibration_iterations):
            results = [compiled(jnp.asarray(beta, jnp.float32), block["output_bias"], tables, *part_data[p])
                       for p in used]
            loss, grad, hess = (sum(np.asarray(r[i], np.float64) for r in results) for i in range(3))
            calls += len(used)
            step = np.linalg.solve(hess + 1e-6 * total * np.eye(G), grad)
            new_beta = np.clip(beta - step, 0.0, 5.0)
            converged = np.abs(new_beta - beta).max() < 1e-3
            beta = new_beta
            if converged:
                break
        return beta, float(loss) / total

    # Warm start on one part (1/parts of the cost per step), then the same Newton steps on the
    # whole holdout from there: the optimum (the result) is the whole holdout's, in fewer full steps.
    beta, _ = newton(np.ones(G), [0])
    beta, loss = newton(beta, list(range(parts)))
    accounting.record("calibration", compiled, calls)
    return jnp.asarray(beta, jnp.float32), loss, calls / parts


def _check_structure(solved: Params, template: Params) -> None:
    same = jax.tree.structure(solved) == jax.tree.structure(template) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(solved), jax.tree.leaves(template)))
    if not same:  # a bug, not a user error
        raise AssertionError("explicit parameters do not match the model's structure")
