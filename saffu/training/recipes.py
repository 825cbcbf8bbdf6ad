"""Recipes the command line and the experiments share: how a model to train is put together
from solved pieces.

* :func:`solve_folds` — the exact model of every fold's complement, for a cross-fitted
  residual (:class:`saffu.configs.ResidualConfig` with ``folds``).
* :func:`residual_start` — a residual model's config and its step-0 parameters over an exact
  run (cross-fitted or not).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from saffu._io import SaffuError, tree_fingerprint
from saffu.configs import FOLD_BLOCKS, ExactConfig, ResidualConfig
from saffu.data.folds import complement, fold_documents
from saffu.data.workdir import WorkDir, subset_workdir
from saffu.models.residual import with_explicit
from saffu.training.checkpoints import load_explicit, load_run_config, run_record, save_explicit_run

Params = dict


def solve_folds(source: WorkDir, config: ExactConfig, folds: int, out: str | Path, blocks: int = FOLD_BLOCKS,
                progress: bool = False) -> tuple[list[str], list[str], float]:
    """For each fold ``k`` of ``source``'s training split (:mod:`saffu.data.folds`), the exact
    model ``config`` solved from every other fold: the documents of the complement as a
    subset work directory (``out/fold<k>/data``), solved and saved as an exact run
    (``out/fold<k>``). A fold whose run already holds this config for this data is kept.

    Returns ``(run paths, content fingerprints, seconds spent solving)``, in fold order.
    """
    from saffu.solve.exact import solve_exact
    out = Path(out)
    documents = fold_documents(source.tokens(source.train_split), folds, blocks)
    runs, fingerprints, seconds = [], [], 0.0
    for k in range(folds):
        run = out / f"fold{k}"
        data = subset_workdir(source, run / "data", train_documents=complement(documents, k), show_progress=progress)
        if not ((run / "config.json").is_file() and load_run_config(run) == config
                and run_record(run).get("workdir_fingerprint") == data.fingerprint):
            tick = time.perf_counter()
            params, _ = solve_exact(data, config, progress=progress)
            save_explicit_run(run, config, data, jax.device_get(params))
            seconds += time.perf_counter() - tick
        runs.append(str(run.resolve()))
        fingerprints.append(run_record(run)["explicit_sha256"])
    return runs, fingerprints, seconds


def residual_start(base, explicit_run: str | Path, key: jax.Array, scale: str = "fixed", anneal_share: float = 0.5,
                   fold_runs: tuple[str, ...] = (), fold_blocks: int = FOLD_BLOCKS,
                   config: ResidualConfig | None = None) -> tuple[ResidualConfig, Params]:
    """``(ResidualConfig, parameters at step 0)`` of a residual over the exact run
    ``explicit_run``: ``f_θ`` (``base``) randomly initialised from ``key`` with its output
    layer at zero, the exact tables as fixed inputs (their content fingerprint recorded), and
    with ``fold_runs`` (:func:`solve_folds`) the cross-fitted training tables. Given an
    existing run's ``config``, its tables are loaded and checked against its fingerprints."""
    if config is None:
        explicit_config = load_run_config(explicit_run)
        if explicit_config.kind != "exact":
            raise SaffuError(f"{explicit_run} holds a {explicit_config.kind}; a residual needs a `saffu exact` run")
        explicit = load_explicit(explicit_run, explicit_config)
        folds = [load_explicit(run, explicit_config) for run in fold_runs]
        if any(load_run_config(run) != explicit_config for run in fold_runs):
            raise SaffuError(f"a fold run holds another exact model than {explicit_run}; solve the folds again")
        config = ResidualConfig(base, explicit_config, str(Path(explicit_run).resolve()), scale=scale,
                                anneal_share=anneal_share, explicit_sha256=tree_fingerprint(explicit),
                                folds=len(fold_runs), fold_blocks=fold_blocks,
                                fold_runs=tuple(str(Path(run).resolve()) for run in fold_runs),
                                fold_sha256=tuple(tree_fingerprint(tables) for tables in folds))
    else:
        explicit = load_explicit(config.explicit_run, config.explicit, config.explicit_sha256)
        folds = [load_explicit(run, config.explicit, sha) for run, sha in zip(config.fold_runs, config.fold_sha256)]
    params = with_explicit(config.init(key), explicit, folds if config.folds else None)
    return config, params
