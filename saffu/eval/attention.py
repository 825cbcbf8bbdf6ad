"""Attention diagnostics: is a layer's attention degenerate ("lazy")?

For every layer and head of a model with attention — the transformer, SAFFU stacks, the
factorised model, and the trainable part of an explicit residual — the post-softmax attention
matrix ``A[query, key]`` is averaged over a batch of evenly spaced windows of a split
(:func:`mean_attention`). SAFFU and the factorised model attend over offsets ``δ`` back from
each position; their matrices are put on absolute positions, ``A[p, p − δ] = a[p, δ]``, and
mass on an invisible row (the boundary code or ``<pad>``, not a position) is left out, so their
rows sum to at most 1.

Per head (:func:`attention_profile`):

* the **effective rank** at energy ``e`` (default 90%): the smallest ``r`` with
  ``Σ_{i ≤ r} σ_i² ≥ e · Σ_i σ_i²`` over the singular values ``σ`` of the averaged matrix
  (:func:`effective_rank`);
* the **largest column's share** of the mass, ``max_k Σ_q A[q, k] / Σ A``: 1 when every query
  attends to one key (the first token of the window, say), about ``ln(S) / S`` for uniform
  causal attention;
* the **first visible key's share**: the mean mass a query puts on the first key it may see
  (the ``<eod>`` ending the previous document, or the window's first token). Attention stops at
  document boundaries here, so a sink forms at each document's start, not in one column.

Per layer: the maximum effective rank over its heads and a **lazy** flag, set when that
maximum is at most ``lazy_rank`` (default 1: every head's averaged attention has collapsed to
rank 1, which in causal attention means one column).

Models that attend over offsets cannot collapse that way (a query sees only its ``M`` most
recent rows); :func:`offset_profile` measures their counterpart, every query on one offset.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from saffu._io import SaffuError, atomic_write_json
from saffu.configs import InspectConfig, ResidualConfig
from saffu.data.windows import evenly_spaced_windows
from saffu.models.interface import base_of, kind_of, traits
from saffu.models.residual import base_params
from saffu.models.transformer import causal_mask

ENERGY = InspectConfig.energy
LAZY_RANK = InspectConfig.lazy_rank


def effective_rank(matrix: np.ndarray, energy: float = ENERGY) -> int:
    """The smallest ``r`` with ``Σ_{i ≤ r} σ_i² ≥ energy · Σ_i σ_i²`` of ``matrix float[N, K]``
    (singular values in float64; 0 for the zero matrix). ``energy`` in ``(0, 1]``."""
    if not 0 < energy <= 1:
        raise SaffuError(f"the energy threshold must lie in (0, 1], got {energy}")
    squares = np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False) ** 2
    total = squares.sum()
    if total == 0:
        return 0
    return int(min(np.searchsorted(np.cumsum(squares), energy * total * (1 - 1e-12)) + 1, len(squares)))


def top_column(matrix: np.ndarray) -> tuple[float, int]:
    """``(share, column)``: the column of ``matrix float[N, K]`` with the most mass and its
    share of the total (0 and -1 for the zero matrix)."""
    columns = np.asarray(matrix, np.float64).sum(axis=0)
    total = columns.sum()
    if total == 0:
        return 0.0, -1
    column = int(np.argmax(columns))
    return float(columns[column] / total), column


def has_attention(config) -> bool:
    """Whether :func:`mean_attention` has anything to average for a model of ``config`` (of an
    explicit residual, its trainable part ``f_θ``)."""
    return traits(config).attends(base_of(config))


def first_visible(tokens: jax.Array, across_documents: bool = False) -> jax.Array:
    """``int32[B, S]``: the first key each query may see, by the transformer's own mask
    (:func:`~saffu.models.transformer.causal_mask`; SAFFU's offsets stop at ``<eod>`` too): the
    last ``<eod>`` at or before it (the one that ends the previous document, or the query itself),
    else position 0; across documents (a mask that never reads ``<pad>``), the row's first token
    other than ``<pad>`` for the queries at or after it, else position 0."""
    return jnp.argmax(causal_mask(jnp.asarray(tokens), across_documents)[:, 0], axis=-1).astype(jnp.int32)


def _across(config) -> bool:
    """Whether ``config``'s attention reads across documents (the transformer's default)."""
    return bool(getattr(base_of(config), "across_documents", False))


def _offset_layers(params, config, tokens: jax.Array):
    """Per layer of an offset model (SAFFU stack or factorised), its heads' attention
    ``[B, S, M_h]`` and the offsets' visibility ``bool[B, S, M]``."""
    return kind_of(config).attention(params, config, tokens)


@functools.partial(jax.jit, static_argnums=1)
def _summed(params, config, tokens: jax.Array, weights: jax.Array):
    """Per layer, per head: the attention of ``tokens int32[B, S]`` summed over the batch with
    ``weights float32[B]``, ``[S, S]`` (transformer) or ``[S, M_h]`` with the invisible offsets
    zeroed (offset models); and the summed mass on each query's first visible key."""
    if isinstance(config, ResidualConfig):
        params, config = base_params(params, config), config.base
    first = first_visible(tokens, _across(config))                              # [B, S]
    kind = kind_of(config)
    if kind.attends_by == "keys":
        maps, starts = [], []
        for a in kind.attention(params, config, tokens):                 # [B, H, S, S]
            on_first = jnp.take_along_axis(a, first[:, None, :, None], axis=-1)[..., 0]
            maps.append(list(jnp.einsum("b,bhqk->hqk", weights, a)))
            starts.append(list(jnp.einsum("b,bhq->h", weights, on_first)))
        return maps, starts
    layers = _offset_layers(params, config, tokens)
    back = jnp.arange(tokens.shape[1])[None, :] - first                         # offset of the first key
    maps, starts = [], []
    for heads, visible in layers:
        seen = [a * visible[..., :a.shape[-1]] for a in heads]
        maps.append([jnp.einsum("b,bsm->sm", weights, a) for a in seen])
        starts.append([jnp.einsum("b,bs->", weights, jnp.where(
            back < a.shape[-1], jnp.take_along_axis(a, jnp.minimum(back, a.shape[-1] - 1)[..., None], axis=-1)[..., 0],
            0.0)) for a in seen])
    return maps, starts


def _absolute(relative: np.ndarray, size: int) -> np.ndarray:
    """``[S, M]`` over offsets -> ``[S, S]`` over positions: ``A[p, p − δ] = relative[p, δ]``."""
    matrix = np.zeros((size, size))
    for delta in range(min(relative.shape[1], size)):
        rows = np.arange(delta, size)
        matrix[rows, rows - delta] = relative[delta:, delta]
    return matrix


def attention_summary(params, config, windows: np.ndarray, batch_size: int = 16,
                      progress: str | None = None) -> tuple[list[list[np.ndarray]], list[list[float]]]:
    """``(maps, first_shares)``: per layer, per head, the post-softmax attention ``float64[S, S]``
    (query × key, absolute positions) averaged over ``windows int32[N, S]`` (see the module
    docstring), and the mean mass a query puts on its first visible key (:func:`first_visible`:
    where a sink forms when attention stops at document boundaries), ``batch_size`` windows per
    compiled call. ``config`` is a transformer, SAFFU, factorised or residual config."""
    if not has_attention(config):
        raise SaffuError(f"a {config.kind} model has no attention to inspect")
    windows = np.asarray(windows)
    if windows.ndim != 2 or len(windows) == 0:
        raise SaffuError(f"need a non-empty int[N, S] batch of windows, got shape {windows.shape}")
    N, S = windows.shape
    totals = None
    for start in tqdm(range(0, N, batch_size), desc=progress, disable=progress is None, leave=False):
        batch = windows[start:start + batch_size]
        weights = np.zeros(batch_size, np.float32)
        weights[:len(batch)] = 1                  # one compiled shape: the last batch is padded, weight 0
        batch = np.concatenate([batch, np.repeat(batch[-1:], batch_size - len(batch), axis=0)])
        summed = _summed(params, config, jnp.asarray(batch, jnp.int32), jnp.asarray(weights))
        summed = jax.tree.map(lambda x: np.asarray(x, np.float64), summed)
        totals = summed if totals is None else jax.tree.map(np.add, totals, summed)
    maps, starts = totals
    absolute = traits(config).attends_by == "keys"
    maps = [[head / N if absolute else _absolute(head / N, S) for head in layer] for layer in maps]
    return maps, [[float(mass) / (N * S) for mass in layer] for layer in starts]


def mean_attention(params, config, windows: np.ndarray, batch_size: int = 16,
                   progress: str | None = None) -> list[list[np.ndarray]]:
    """The maps of :func:`attention_summary`: per layer, per head, ``float64[S, S]``."""
    return attention_summary(params, config, windows, batch_size, progress)[0]


@functools.partial(jax.jit, static_argnums=1)
def _offset_sums(params, config, tokens: jax.Array, weights: jax.Array):
    """Per layer, per head of an offset model: over the queries that see every offset of the
    head, the attention summed per offset ``[M_h]``, the summed top weight and the query count."""
    if isinstance(config, ResidualConfig):
        params, config = base_params(params, config), config.base
    layers = _offset_layers(params, config, tokens)
    sums = []
    for heads, visible in layers:
        per_head = []
        for a in heads:                                                        # [B, S, M_h]
            full = visible[..., :a.shape[-1]].all(axis=-1) * weights[:, None]   # [B, S]
            per_head.append((jnp.einsum("bs,bsm->m", full, a), jnp.sum(full * a.max(axis=-1)), jnp.sum(full)))
        sums.append(per_head)
    return sums


def offset_profile(params, config, windows: np.ndarray, batch_size: int = 16) -> list[dict]:
    """Where an offset model's attention goes (SAFFU stacks, the factorised model, a residual over
    them). These attend over the ``M_h`` most recent rows only, so the lazy layer of global
    attention — every query on one key, rank 1 — cannot form; its counterpart is every query on
    one offset, a shift, which has full rank. Over the queries of ``windows int32[N, S]`` that see
    every offset of a head: per layer and head, the mean weight on each offset
    ``δ = 0 … M_h − 1`` (``mean_by_offset``, sums to 1) and the mean of each query's largest weight
    (``mean_top_weight``: ``1/M_h`` for uniform attention, 1 when collapsed onto one offset); per
    layer, ``mean_top_weight`` the largest over its heads."""
    model = base_of(config)
    if traits(config).attends_by != "offsets" or not getattr(model, "heads", 0):
        raise SaffuError(f"a {model.kind} model does not attend over offsets")
    windows = np.asarray(windows)
    if windows.ndim != 2 or len(windows) == 0:
        raise SaffuError(f"need a non-empty int[N, S] batch of windows, got shape {windows.shape}")
    totals = None
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        weights = np.zeros(batch_size, np.float32)
        weights[:len(batch)] = 1                  # one compiled shape: the last batch is padded, weight 0
        batch = np.concatenate([batch, np.repeat(batch[-1:], batch_size - len(batch), axis=0)])
        sums = jax.tree.map(lambda x: np.asarray(x, np.float64),
                            _offset_sums(params, config, jnp.asarray(batch, jnp.int32), jnp.asarray(weights)))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    layers = []
    for index, heads in enumerate(totals):
        rows = [{"head": h, "mean_by_offset": (by_offset / max(count, 1)).tolist(),
                 "mean_top_weight": float(top / max(count, 1)), "queries": int(count)}
                for h, (by_offset, top, count) in enumerate(heads)]
        layers.append({"layer": index, "mean_top_weight": max(row["mean_top_weight"] for row in rows), "heads": rows})
    return layers


def attention_profile(maps: list[list[np.ndarray]], energy: float = ENERGY, lazy_rank: int = LAZY_RANK,
                      first_shares: list[list[float]] | None = None) -> dict:
    """Effective ranks, largest-column shares and lazy flags of :func:`attention_summary`'s maps
    (and, given, its first-key shares)::

        {"energy", "lazy_rank", "size": S, "lazy_layers": [l, ...],
         "layers": [{"layer", "max_rank", "mean_top_column_share", "mean_first_key_share", "lazy",
                     "heads": [{"head", "rank", "top_column_share", "top_column", "first_key_share",
                                "mass"}]}]}

    ``mass`` is the mean row sum (1, or less where an offset model attended to the boundary);
    the first-key shares are ``nan`` when not given."""
    if lazy_rank < 0:
        raise SaffuError(f"--lazy-rank must be ≥ 0, got {lazy_rank}")
    layers = []
    for index, heads in enumerate(maps):
        rows = []
        for h, matrix in enumerate(heads):
            share, column = top_column(matrix)
            first = first_shares[index][h] if first_shares is not None else math.nan
            rows.append({"head": h, "rank": effective_rank(matrix, energy), "top_column_share": share,
                         "top_column": column, "first_key_share": first,
                         "mass": float(np.asarray(matrix).sum(axis=1).mean())})
        max_rank = max(row["rank"] for row in rows)
        layers.append({"layer": index, "max_rank": max_rank, "lazy": max_rank <= lazy_rank,
                       "mean_top_column_share": float(np.mean([row["top_column_share"] for row in rows])),
                       "mean_first_key_share": float(np.mean([row["first_key_share"] for row in rows])),
                       "heads": rows})
    size = int(maps[0][0].shape[0]) if maps and maps[0] else 0
    return {"energy": energy, "lazy_rank": lazy_rank, "size": size,
            "lazy_layers": [layer["layer"] for layer in layers if layer["lazy"]], "layers": layers}


def inspect_attention(params, config, stream: np.ndarray, windows: int = InspectConfig.windows, seq_len: int | None = None,
                      energy: float = ENERGY, lazy_rank: int = LAZY_RANK, batch_size: int = 16,
                      progress: bool = False) -> dict:
    """:func:`attention_profile` of ``windows`` evenly spaced windows of ``stream`` (a split's
    tokens), each ``config.context + seq_len`` tokens long (``seq_len`` defaults to the model's
    ``eval_seq_len``); the profile also holds ``windows``, ``window_tokens`` and
    ``first_key_share_if_uniform``, the first-key share of attention uniform over the visible keys;
    for a model that attends over offsets, also its :func:`offset_profile` (``offsets``)."""
    if windows < 1:
        raise SaffuError(f"--windows must be ≥ 1, got {windows}")
    if not 0 < energy <= 1 or lazy_rank < 0:          # checked before the forward passes, not after
        raise SaffuError(f"need an energy threshold in (0, 1] and --lazy-rank ≥ 0, got {energy} and {lazy_rank}")
    seq_len = seq_len or config.eval_seq_len
    if seq_len < 1:
        raise SaffuError(f"--seq-len must be ≥ 1, got {seq_len}")
    batch, _ = evenly_spaced_windows(np.asarray(stream), config, seq_len, windows)
    maps, first_shares = attention_summary(params, config, np.asarray(batch), batch_size,
                                           progress="attention" if progress else None)
    profile = attention_profile(maps, energy, lazy_rank, first_shares)
    if traits(config).attends_by == "offsets":
        profile["offsets"] = offset_profile(params, config, np.asarray(batch), batch_size)
    visible = np.arange(batch.shape[1])[None, :] - np.asarray(first_visible(batch, _across(config))) + 1  # keys seen
    return {**profile, "windows": int(batch.shape[0]), "window_tokens": int(batch.shape[1]),
            "first_key_share_if_uniform": float(np.mean(1.0 / visible))}


def layers_before_lazy(profile: dict, depth: int) -> int:
    """Inheritune's depth from the attention profile of a ``depth``-layer reference
    (:func:`inspect_attention`): the layers before its first lazy one, or half of them (at least
    one) when none is lazy or the very first is."""
    lazy = profile["lazy_layers"]
    return lazy[0] if lazy and lazy[0] >= 1 else max(1, depth // 2)


def profile_table(profile: dict) -> str:
    """A plain-text table of a profile, one line per layer."""
    offsets = profile.get("offsets")
    lines = [f"{'layer':>5}  {'max rank':>8}  {'ranks per head':<24} {'top column share':>16}  "
             f"{'first key share':>15}  lazy" + ("  top offset weight" if offsets else "")]
    for layer in profile["layers"]:
        ranks = " ".join(str(head["rank"]) for head in layer["heads"])
        lines.append(f"{layer['layer']:>5}  {layer['max_rank']:>8}  {ranks:<24} "
                     f"{layer['mean_top_column_share']:>16.3f}  {layer['mean_first_key_share']:>15.3f}  "
                     f"{'yes' if layer['lazy'] else 'no ':<4}"
                     + (f"  {offsets[layer['layer']]['mean_top_weight']:>17.3f}" if offsets else ""))
    return "\n".join(lines)


def plot_profiles(profiles: dict[str, dict], path: str | Path, title: str = "") -> None:
    """One figure: per layer, each head's effective rank (dots) and the layer's maximum (line),
    and each head's largest-column share, for every labelled profile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, profile) in enumerate(profiles.items()):
        colour = colours[i % len(colours)]
        layers = [layer["layer"] for layer in profile["layers"]]
        for layer in profile["layers"]:
            x = [layer["layer"]] * len(layer["heads"])
            axes[0].scatter(x, [h["rank"] for h in layer["heads"]], color=colour, alpha=0.5, s=14)
            axes[1].scatter(x, [h["top_column_share"] for h in layer["heads"]], color=colour, alpha=0.5, s=14)
        axes[0].plot(layers, [layer["max_rank"] for layer in profile["layers"]], color=colour, marker="o",
                     label=f"{label} (max over heads)")
        axes[1].plot(layers, [layer["mean_top_column_share"] for layer in profile["layers"]], color=colour,
                     marker="o", label=f"{label}: largest column")
        axes[1].plot(layers, [layer["mean_first_key_share"] for layer in profile["layers"]], color=colour,
                     marker="s", linestyle="--", label=f"{label}: first visible key")
    first = next(iter(profiles.values()))
    axes[0].axhline(first["lazy_rank"], color="black", linestyle=":", linewidth=1, label="lazy at or below")
    if "first_key_share_if_uniform" in first:
        axes[1].axhline(first["first_key_share_if_uniform"], color="black", linestyle=":", linewidth=1,
                        label="first visible key, uniform attention")
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"effective rank at {first['energy']:.0%} energy (of {first['size']})")
    axes[1].set_ylabel("share of the attention mass (mean over heads)")
    axes[1].set_ylim(0, 1.02)
    for axis in axes:
        axis.set_xlabel("layer")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def flat_metrics(profile: dict) -> dict:
    """The profile as flat ``name: number`` pairs (for ``--metrics-json``)."""
    flat = {"layers": len(profile["layers"]), "lazy_layers": len(profile["lazy_layers"]),
            "energy": profile["energy"], "lazy_rank": profile["lazy_rank"], "matrix_size": profile["size"]}
    for layer in profile["layers"]:
        flat[f"layer_{layer['layer']}_max_rank"] = layer["max_rank"]
        flat[f"layer_{layer['layer']}_top_column_share"] = round(layer["mean_top_column_share"], 6)
        flat[f"layer_{layer['layer']}_first_key_share"] = round(layer["mean_first_key_share"], 6)
    for layer in profile.get("offsets", []):
        flat[f"layer_{layer['layer']}_top_offset_weight"] = round(layer["mean_top_weight"], 6)
    return flat


def run_attention_profile(params, config, workdir, inspect: InspectConfig, out: Path, label: str,
                          progress: bool = False) -> tuple[dict, dict]:
    """The attention profile of a run (:func:`saffu.eval.attention.inspect_attention` over
    ``inspect.windows`` windows of ``inspect.split``), written to ``out.json`` with its plot at
    ``out.png``. Returns ``(profile, flat figures)``."""
    profile = inspect_attention(params, config, workdir.tokens(inspect.split), inspect.windows, inspect.seq_len,
                                inspect.energy, inspect.lazy_rank, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out.with_suffix(".json"), out.with_suffix(".png")
    atomic_write_json(json_path, {"run": label, "split": inspect.split, **profile})
    what = f"{profile['windows']} {inspect.split} windows of {profile['window_tokens']} tokens"
    plot_profiles({label: profile}, plot_path, f"attention of {label}: {what}")
    return profile, {**flat_metrics(profile), "json": str(json_path), "plot": str(plot_path)}


def run_layers_before_lazy(reference_run: Path, workdir, progress: bool = False,
                           say: Callable[[str], None] = lambda message: None) -> int | None:
    """The blocks of a trained transformer or SAFFU run before its first lazy layer (its attention
    profile, :func:`saffu.eval.attention.layers_before_lazy`): what ``--inherit-before-lazy``
    inherits. ``None`` for another kind (the inheritance recipe says what it must be)."""
    from saffu.training.checkpoints import check_inputs, load_params
    reference = check_inputs(reference_run, workdir)
    depth = kind_of(reference).depth
    if depth is None:
        return None
    profile = inspect_attention(load_params(reference_run, reference)[0], reference, workdir.tokens("dev"),
                                progress=progress)
    layers = layers_before_lazy(profile, getattr(reference, depth))
    say(f"the reference's lazy layers: {profile['lazy_layers'] or 'none'}; inheriting {layers} blocks")
    return layers
