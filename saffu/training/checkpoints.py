"""Run directories: the model's config, its explicit solution and its training checkpoints.

A run directory holds ``config.json`` (the model and the work directory it belongs to),
``explicit/`` (the explicit solution, if solved), ``checkpoints/`` (orbax: step, params and
optimizer state, the latest two) and ``metrics.jsonl`` (one line per evaluation, if trained).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from saffu._io import SaffuError, atomic_write_json
from saffu.configs import ExactConfig, FactorisedConfig, ResidualConfig, SaffuConfig, TransformerConfig
from saffu.data.workdir import WorkDir


Params = dict


def checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    """The orbax manager of ``run_dir/checkpoints``: synchronous saves, the latest two kept."""
    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False))


def save_run_config(run_dir: str | Path, config: SaffuConfig, workdir: WorkDir) -> None:
    """Write ``config.json``: the model and the work directory it belongs to."""
    atomic_write_json(Path(run_dir) / "config.json", {"model": dataclasses.asdict(config),
                                                      "workdir": str(workdir.path.resolve()),
                                                      "corpus": workdir.meta["corpus"]})


def model_config(fields: dict):
    """A model config from its ``dataclasses.asdict`` form: :class:`SaffuConfig`, or by ``kind``
    :class:`saffu.configs.TransformerConfig`, :class:`saffu.configs.ExactConfig` or
    :class:`saffu.configs.FactorisedConfig`."""
    kinds = {"saffu": SaffuConfig, "transformer": TransformerConfig, "exact": ExactConfig,
             "factorised": FactorisedConfig, "residual": ResidualConfig}
    kind = fields.get("kind", "saffu")
    if kind == "residual":   # the two parts are configs of their own
        fields = {**fields, "base": model_config(fields["base"]), "explicit": model_config(fields["explicit"])}
    if kind not in kinds:
        raise SaffuError(f"unknown model kind {kind!r}; this saffu knows {', '.join(kinds)}")
    if kind == "exact":     # JSON lists back to the hashable tuples of the config
        fields = {**fields, "groups": tuple(tuple(g) for g in fields["groups"]), "buckets": tuple(fields["buckets"])}
    if kind == "saffu" and "exact_positions" in fields:
        fields = {**fields, "exact_positions": tuple(fields["exact_positions"])}
    return kinds[kind](**fields)


def load_run_config(run_dir: str | Path):
    """The model config of a run directory (SAFFU or transformer)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise SaffuError(f"{run_dir} is not a saffu run (no config.json); create it with `saffu fit` "
                         f"or `saffu train --init random`")
    try:
        return model_config(json.loads(path.read_text())["model"])
    except (ValueError, KeyError, TypeError) as err:
        raise SaffuError(f"{path} is unreadable ({err}); remove the run directory and start again") from None


def save_explicit(run_dir: str | Path, params: Params) -> None:
    """Save explicit parameters to ``run_dir/explicit`` (orbax, replacing an older one)."""
    path = (Path(run_dir) / "explicit").resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params, force=True)


def load_explicit(run_dir: str | Path, config) -> Params:
    """The explicit solution saved in ``run_dir/explicit``: for SAFFU in the structure and shapes
    of :func:`saffu.models.saffu.init_params`; for the exact model as saved (its table sizes come
    from the data)."""
    path = (Path(run_dir) / "explicit").resolve()
    if config.kind not in ("saffu", "exact", "factorised"):
        raise SaffuError(f"{run_dir} holds a {config.kind}, which has no explicit solution; it has no "
                         f"checkpoint yet: train it with `saffu train --run {run_dir}`")
    if not path.exists():
        command = {"exact": "saffu exact", "factorised": "saffu factorise"}.get(config.kind, "saffu fit")
        raise SaffuError(f"{run_dir} has no explicit solution; run `{command} --run {run_dir}` first")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path)
    except Exception as err:  # orbax raises several types for damaged checkpoints
        raise SaffuError(f"cannot read {path} ({type(err).__name__}); solve the run again") from None
    if config.kind == "exact":
        return jax.tree.map(jnp.asarray, restored)
    params = retype({"blocks": restored["blocks"]} if getattr(config, "exact_positions", ()) else restored,
                    jax.eval_shape(lambda: config.init(jax.random.key(0))))
    if getattr(config, "exact_positions", ()):     # the exact groups' tables: sizes from the data
        params["exact"] = jax.tree.map(jnp.asarray, restored["exact"])
    return params


def load_params(run_dir: str | Path, config, which: str = "latest") -> tuple[Params, str]:
    """``which="latest"``: the last training checkpoint, else the explicit solution;
    ``which="explicit"``: the explicit solution. Returns the params and what was loaded.
    A residual model's explicit tables come from its ``explicit_run``; without a checkpoint
    (or with ``"explicit"``) it is its step-0 state, which is the explicit model."""
    if config.kind == "residual":
        from saffu.models.residual import with_explicit
        explicit = load_explicit(config.explicit_run, config.explicit)
        params = config.init(jax.random.key(0))
        trained = {name: value for name, value in params.items() if name not in config.fixed_params}
        latest = load_latest_params(run_dir, trained) if which == "latest" else None
        if latest is None:
            return with_explicit(params, explicit), "explicit (step 0)"
        return with_explicit({**params, **latest[0]}, explicit), f"checkpoint step {latest[1]}"
    if which == "latest" and hasattr(config, "init"):
        template = jax.eval_shape(lambda: config.init(jax.random.key(0)))
        latest = load_latest_params(run_dir, template)
        if latest is not None:
            return latest[0], f"checkpoint step {latest[1]}"
    return load_explicit(run_dir, config), "explicit"


def save_training_state(manager: ocp.CheckpointManager, step: int, params: Params, opt_state) -> None:
    """Checkpoint ``{"step", "params", "opt_state"}`` as step ``step`` (synchronously)."""
    manager.save(step, args=ocp.args.StandardSave({"step": jnp.asarray(step, jnp.int32), "params": params,
                                                  "opt_state": opt_state}))


def restore_training_state(manager: ocp.CheckpointManager, run_dir: Path, params: Params, opt_state,
                           metrics_path: Path) -> tuple[int, Params, object, float]:
    """Resume from the latest checkpoint of ``manager``, if any.

    Returns ``(step, params, opt_state, seconds)``: with no checkpoint, ``(0, params,
    opt_state, 0.0)`` as given; else the checkpoint's, and the training seconds recorded at its
    step in ``metrics_path``, whose later lines (from an interrupted run) are dropped.
    """
    if manager.latest_step() is None:
        return 0, params, opt_state, 0.0
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    try:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    except Exception as err:  # orbax raises several types for unreadable / mismatched trees
        step_dir = run_dir / "checkpoints" / str(manager.latest_step())
        raise SaffuError(f"cannot resume from {step_dir} ({type(err).__name__}); it is from another model "
                         f"or damaged: delete {step_dir} to resume from the checkpoint before it, or use a "
                         f"new --run directory") from None
    step = int(state["step"])
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    metrics_path.write_text("".join(line + "\n" for line in kept))
    seconds = json.loads(kept[-1])["seconds"] if kept else 0.0
    return step, state["params"], state["opt_state"], seconds


def latest_checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the latest training checkpoint in ``run_dir/checkpoints``, or None."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return None
    manager = checkpoint_manager(directory)
    try:
        return manager.latest_step()
    finally:
        manager.close()


def load_latest_params(run_dir: str | Path, template: Params) -> tuple[Params, int] | None:
    """The parameters of the latest training checkpoint in ``run_dir`` and its step, or None."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.exists():
        return None
    manager = checkpoint_manager(directory)
    step = manager.latest_step()
    if step is None:
        return None
    try:
        state = manager.restore(step, args=ocp.args.StandardRestore())
        return retype(state["params"], template), step
    except Exception as err:  # orbax raises several types for unreadable / mismatched trees
        raise SaffuError(f"cannot read the checkpoint of step {step} in {directory} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120]}); it is damaged or from another model: use "
                         f"--checkpoint explicit for the explicit solution, or delete {directory / str(step)} "
                         f"to fall back to the checkpoint before it") from None
    finally:
        manager.close()


def retype(restored: Any, template: Params) -> Params:
    """``restored`` in ``template``'s structure (orbax may turn int keys into strings);
    a clear error when shapes differ (a checkpoint of another model)."""
    if isinstance(template, dict):
        if not isinstance(restored, dict):
            raise SaffuError("checkpoint structure differs from the model's; it is from another model")
        out = {}
        for key, value in template.items():
            found = restored.get(key, restored.get(str(key)))
            if found is None:
                raise SaffuError(f"checkpoint lacks parameter {key!r}; it is from another model")
            out[key] = retype(found, value)
        return out
    array = jnp.asarray(restored)
    if array.shape != np.shape(template):
        raise SaffuError(f"checkpoint parameter has shape {array.shape}, the model needs {np.shape(template)}; "
                         f"it is from another model")
    return array
