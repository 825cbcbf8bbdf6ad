"""Run directories: the model's config, its explicit solution and its training checkpoints.

A run directory holds ``config.json`` (the model, the work directory it belongs to and the
fingerprints of its inputs), ``explicit/`` (the explicit solution, if solved),
``checkpoints/`` (orbax: step, params and optimizer state, the latest two),
``metrics.jsonl`` (one line per evaluation, if trained) and ``words/`` with ``words.json``
(the parameters when the training words consumed first reached 1M, 2M, …, 10M and every 10M
after: BabyLM's checkpoints, :func:`save_words`); a packed residual run also holds its exact
model's run in ``exact/``.

Pinned inputs: ``config.json`` records the work directory's fingerprint
(:attr:`saffu.data.workdir.WorkDir.fingerprint`) and, for a solved run, the content
fingerprint of its explicit solution (``explicit_sha256``); a residual run records the
fingerprint of the exact tables it was trained over (:attr:`ResidualConfig.explicit_sha256`)
and the exact run's path relative to its own. Loading checks them all: a run is never scored
against tables or a tokenizer other than its own without a word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from saffu._io import (
    SaffuError,
    atomic_write_json,
    check_free,
    disk_full_error,
    exclusive,
    is_disk_full,
    megabytes,
    tree_fingerprint,
)
from saffu.configs import ExactConfig, Params, ResidualConfig, SaffuConfig
from saffu.data.workdir import WorkDir
from saffu.engine.distributed import put_global
from saffu.models.interface import config_from_dict, kind_of, model_init, trainable


@contextlib.contextmanager
def _orbax_failures_unlogged():
    """orbax logs every failed background write (through absl's logger) with a traceback, then
    raises the error anyway; the caller reports it, as one line for a full disk."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    """The orbax manager of ``run_dir/checkpoints``: synchronous saves, the latest two kept."""
    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False), item_handlers=ocp.StandardCheckpointHandler())


def restore_here(manager: ocp.CheckpointManager, step: int) -> dict:
    """Checkpoint ``step`` of ``manager`` whole, every array on this process's first device,
    whatever saved it: one process, or a multi-process job (orbax restores an array to the
    devices that saved it unless told where, and refuses a topology it does not have)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree = manager.item_metadata(step)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), getattr(tree, "tree", tree))
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def save_run_config(run_dir: str | Path, config: SaffuConfig, workdir: WorkDir, **record) -> None:
    """Write ``config.json``: the model, the work directory it belongs to and its fingerprint
    (plus ``record``'s entries, e.g. ``explicit_sha256``). A residual's exact run is stored
    relative to ``run_dir`` (so the two survive moving together)."""
    fields = dataclasses.asdict(config)
    relative = lambda path: (os.path.relpath(Path(path).resolve(), Path(run_dir).resolve()) if Path(path).is_absolute()
                             else path)
    if isinstance(config, ResidualConfig):
        fields.update(explicit_run=relative(config.explicit_run), fold_runs=[relative(p) for p in config.fold_runs])
    atomic_write_json(Path(run_dir) / "config.json", {"model": fields, "workdir": str(workdir.path.resolve()),
                                                      "corpus": workdir.meta["corpus"],
                                                      "workdir_fingerprint": workdir.fingerprint, **record})


def run_record(run_dir: str | Path) -> dict:
    """The whole ``config.json`` of a run directory (model, work directory, fingerprints)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise SaffuError(f"{run_dir} is not a saffu run (no config.json); create it with `saffu fit` "
                         f"or `saffu train --init random`")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise SaffuError(f"{path} is unreadable ({err}); remove the run directory and start again") from None


def check_inputs(run_dir: str | Path, workdir: WorkDir, streams: bool = False):
    """The model config of ``run_dir`` after checking that ``workdir`` is the one it was made
    from: the same vocabulary size and tokenizer (by content), and with ``streams`` (training
    and resuming) the same token streams. One :class:`SaffuError` naming both fingerprints
    and the fix otherwise. Runs saved before fingerprints were recorded are checked by size."""
    config = load_run_config(run_dir)
    if config.vocab_size != workdir.vocab_size:
        raise SaffuError(f"run {run_dir} has a model of {config.vocab_size:,} tokens but {workdir.path} a tokenizer "
                         f"of {workdir.vocab_size:,}; use the work directory the run was made from")
    record = run_record(run_dir)
    recorded = record.get("workdir_fingerprint")
    for part in ("tokenizer",) + (("streams",) if streams else ()):
        if recorded and recorded.get(part) != workdir.fingerprint[part]:
            raise SaffuError(f"run {run_dir} was made with a work directory whose {part} has fingerprint "
                             f"{recorded.get(part)}, but {workdir.path} has {workdir.fingerprint[part]}; use the "
                             f"work directory the run was made from ({record.get('workdir', '?')})")
    return config


def load_run_config(run_dir: str | Path):
    """The model config of a run directory (any kind; a residual's exact runs as absolute
    paths, resolved from the run directory when stored relative to it)."""
    path = Path(run_dir) / "config.json"
    record = run_record(run_dir)
    try:
        config = config_from_dict(record["model"])
    except (KeyError, TypeError) as err:
        raise SaffuError(f"{path} is unreadable ({err}); remove the run directory and start again") from None
    if isinstance(config, ResidualConfig):
        absolute = lambda path: path if Path(path).is_absolute() else str((Path(run_dir) / path).resolve())
        config = dataclasses.replace(config, explicit_run=absolute(config.explicit_run),
                                     fold_runs=tuple(absolute(p) for p in config.fold_runs))
    return config


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the temporary folders a killed save left in ``run_dir`` and its ``checkpoints/``
    (orbax's ``*.orbax-checkpoint-tmp*``). Only call it while holding the run's write lock
    (:func:`saffu._io.exclusive`): then no save is in progress. Returns what was removed."""
    run_dir = Path(run_dir)
    stale = [p for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir()
             for p in folder.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return stale


def pack_run(run_dir: str | Path) -> dict:
    """Copy a residual run's exact model (its ``config.json`` and ``explicit/``) into
    ``run_dir/exact`` and point the run at it (stored relative), so the run survives moving and
    the exact run being re-solved or deleted. The tables' content fingerprint is checked
    against the one the run recorded before copying. Returns ``{"exact_run", "bytes"}``."""
    run_dir = Path(run_dir)
    config = load_run_config(run_dir)
    if not isinstance(config, ResidualConfig):
        raise SaffuError(f"{run_dir} holds a {config.kind}, which reads no other run; only residual runs need packing")
    source, target = Path(config.explicit_run), run_dir / "exact"
    size = sum(p.stat().st_size for p in (source / "explicit").rglob("*") if p.is_file())
    if source.resolve() == target.resolve():
        return {"exact_run": str(source), "bytes": size}
    load_explicit(source, config.explicit, config.explicit_sha256)      # the tables the run was trained over
    with exclusive(run_dir):
        remove_stale_temporaries(run_dir)
        check_free(run_dir, size, "the exact model's tables", "free space first")
        staging = run_dir / "exact.orbax-checkpoint-tmp-pack"      # removed as stale if this is killed
        try:
            shutil.copytree(source / "explicit", staging / "explicit")
            shutil.copy2(source / "config.json", staging / "config.json")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            if is_disk_full(err):
                raise disk_full_error(target, err, size) from None
            raise
        record = run_record(run_dir)
        record["model"]["explicit_run"] = "exact"
        atomic_write_json(run_dir / "config.json", record)
    return {"exact_run": str(source), "bytes": size}


def remove_failed_save(run_dir: str | Path, settle: float = 1.0, patience: float = 30.0) -> None:
    """Remove the temporary folders of a save that just failed. orbax's writer threads may
    still add files after the error reaches the caller, and each then finds orbax's event loop
    closed and prints a traceback: the folders are removed, and those tracebacks swallowed,
    until for ``settle`` seconds no folder reappears and nothing is printed (at most
    ``patience`` seconds)."""
    deadline, quiet_since, printed = time.monotonic() + patience, None, 0
    with contextlib.redirect_stderr(io.StringIO()) as swallowed:
        while time.monotonic() < deadline:
            active = bool(remove_stale_temporaries(run_dir)) or len(swallowed.getvalue()) != printed
            printed = len(swallowed.getvalue())
            if active:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle:
                return
            time.sleep(0.05)


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays (or shape structs)."""
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _compressible(config) -> bool:
    """Whether a solution's tables shrink on disk far below their bytes in memory (the exact
    model's sparse tables: about 18× at V = 8,192), so that free space cannot be judged
    before the write."""
    return kind_of(config).exact_tables(config)


def save_explicit_run(run_dir: str | Path, config, workdir: WorkDir, params: Params, retry=None) -> str:
    """Commit an explicit solution to ``run_dir``: its ``config.json`` is removed first and
    written last, with the solution's content fingerprint, after ``explicit/`` is committed — so
    a save killed at any point leaves either the old run or no run, never a config beside
    tables it does not describe. The run's write lock is held meanwhile and stale temporary
    folders of a killed save are removed. Dense solutions' bytes are compared with the free
    space before writing (the exact model's tables compress too well to judge); a full disk
    (early or during the write) removes the partial folder and calls
    ``retry(error, run_dir)`` if given — it returns a directory to try again (the same one
    after freeing space, or another) or ``None`` to give up — else raises one
    :class:`SaffuError`. Returns the directory the solution was saved to."""
    fingerprint = tree_fingerprint(params)
    while True:
        run_dir = Path(run_dir)
        try:
            with exclusive(run_dir):
                remove_stale_temporaries(run_dir)
                (run_dir / "config.json").unlink(missing_ok=True)
                if not _compressible(config):       # dense floats: about their own size on disk
                    check_free(run_dir, tree_bytes(params) + (1 << 20), f"the explicit solution ({config.kind})",
                               "free space and rerun, or give another --run")
                save_explicit(run_dir, params)
                save_run_config(run_dir, config, workdir, explicit_sha256=fingerprint)
            return str(run_dir)
        except SaffuError as err:     # a failed write cleaned up after itself (save_explicit); a refused
            if retry is None:         # lock must not touch the other writer's temporary folders
                raise
            run_dir = retry(err, run_dir)
            if run_dir is None:
                raise


def save_explicit(run_dir: str | Path, params: Params) -> None:
    """Save explicit parameters to ``run_dir/explicit`` (orbax, replacing an older one); a full
    disk is one :class:`SaffuError` (the partial folder removed). Runs use
    :func:`save_explicit_run`, which also pins the config to the solution."""
    path = (Path(run_dir) / "explicit").resolve()
    try:
        with _orbax_failures_unlogged(), ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, params, force=True)
    except Exception as err:  # orbax wraps the OSError of a full disk in errors of its own
        if not is_disk_full(err):
            raise
        remove_failed_save(run_dir)
        raise disk_full_error(path, err, then=f"the solution holds {megabytes(tree_bytes(params))} in memory (less "
                                              f"on disk, compressed); free space and rerun, or give another --run") from None


def load_explicit(run_dir: str | Path, config, expect: str = "") -> Params:
    """The explicit solution saved in ``run_dir/explicit``: for SAFFU in the structure and shapes
    of :func:`saffu.models.saffu.init_params`; for the exact model as saved (its table sizes come
    from the data). Its content must match the fingerprint ``config.json`` recorded when it was
    saved (and ``expect``, where a run that reads it recorded one): one :class:`SaffuError`
    otherwise."""
    path = (Path(run_dir) / "explicit").resolve()
    command = kind_of(config).solve_command
    if command is None:
        if latest_checkpoint_step(run_dir) is not None:
            raise SaffuError(f"{run_dir} holds a {config.kind}, which keeps no explicit solution (an explicit "
                             f"init is its state before step 1, not saved); use --checkpoint latest for its "
                             f"trained weights")
        raise SaffuError(f"{run_dir} holds a {config.kind}, which has no explicit solution; it has no "
                         f"checkpoint yet: train it with `saffu train --run {run_dir}`")
    if not path.exists():
        raise SaffuError(f"{run_dir} has no explicit solution; run `{command} --run {run_dir}` first")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path)
    except Exception as err:  # orbax raises several types for damaged checkpoints
        raise SaffuError(f"cannot read {path} ({type(err).__name__}); solve the run again") from None
    recorded = run_record(run_dir).get("explicit_sha256", "") if (Path(run_dir) / "config.json").is_file() else ""
    if recorded or expect:
        found = tree_fingerprint(restored)
        if recorded and found != recorded:
            raise SaffuError(f"the explicit solution in {path} (fingerprint {found}) is not the one {run_dir}/config.json "
                             f"describes ({recorded}): an interrupted solve; solve the run again")
        if expect and found != expect:
            raise SaffuError(f"{run_dir} now holds explicit tables with fingerprint {found}, but this run was trained "
                             f"over {expect}: it was solved again since; re-solve it as before (the run's config.json "
                             f"records the exact model) or train again (`saffu pack` keeps a run's tables with it)")
    if isinstance(config, ExactConfig):
        return jax.tree.map(jnp.asarray, restored)
    params = retype({"blocks": restored["blocks"]} if getattr(config, "exact_positions", ()) else restored,
                    with_config_inputs(jax.eval_shape(lambda: model_init(config, jax.random.key(0))), config))
    if getattr(config, "exact_positions", ()):     # the exact groups' tables: sizes from the data
        params["exact"] = jax.tree.map(jnp.asarray, restored["exact"])
    return params


def load_weights(run_dir: str | Path, config, checkpoint: str = "latest", step: int | None = None,
                 words: int | str | None = None) -> tuple[Params, str]:
    """The weights a command reads and what they are: at a kept ``step`` or words milestone
    ``words`` (``"5M"`` or an int) when one is given (:func:`load_params_at`), else
    :func:`load_params` with ``checkpoint``. One error line for both or for a choice the run lacks."""
    if step is None and words is None:
        return load_params(run_dir, config, checkpoint)
    if step is not None and words is not None:
        raise SaffuError("give --step or --words, not both")
    if checkpoint != "latest":
        raise SaffuError("--step and --words pick a training checkpoint; leave --checkpoint at latest")
    return load_params_at(run_dir, config, step, parse_words(words) if isinstance(words, str) else words)


def load_params_at(run_dir: str | Path, config, step: int | None = None,
                   words: int | None = None) -> tuple[Params, str]:
    """The parameters of a trained run (a transformer, SAFFU stack, residual, …) at training
    ``step`` (a kept training checkpoint or a words checkpoint) or at the milestone of ``words``
    words (see :func:`save_words`), and what was loaded; one error line naming what the run keeps
    otherwise. A residual's explicit tables come from its explicit run, as :func:`load_params`'s do."""
    run_dir = Path(run_dir)
    milestones = words_index(run_dir)
    if words is not None:
        match = [m for m in milestones if m["words"] == words]
        if not match:
            kept = ", ".join(m["label"] for m in milestones) or "none"
            raise SaffuError(f"{run_dir} keeps no checkpoint at {words_label(words)} words (it keeps: {kept})")
        step = match[0]["step"]
    if not trainable(config):
        raise SaffuError(f"a {config.kind} run is loaded whole (--checkpoint); --step and --words pick a trained "
                         f"model's checkpoints")
    if isinstance(config, ResidualConfig):       # the trained part is kept; the explicit tables come from its explicit run
        params, template = _residual_parts(config)
        trained, label = _restore_at(run_dir, jax.eval_shape(lambda: template), step, milestones)
        return _with_tables(config, {**params, **trained}), label
    template = with_config_inputs(jax.eval_shape(lambda: model_init(config, jax.random.key(0))), config)
    return _restore_at(run_dir, template, step, milestones)


def _restore_at(run_dir: Path, template: Params, step: int, milestones: list[dict]) -> tuple[Params, str]:
    """The parameters ``template`` (abstract) kept at ``step`` in ``run_dir``'s training or words checkpoints."""
    for folder in ("checkpoints", "words"):
        directory = run_dir / folder
        if not directory.is_dir():
            continue
        manager = checkpoint_manager(directory) if folder == "checkpoints" else words_manager(directory)
        try:
            if step in manager.all_steps():
                seen = [m for m in milestones if m["step"] == step]
                label = f"checkpoint step {step}" + (f" ({seen[0]['words_seen']:,} words)" if seen else "")
                return retype(restore_here(manager, step)["params"], template), label
        finally:
            manager.close()
    kept = sorted({*(m["step"] for m in milestones), *_training_steps(run_dir)})
    raise SaffuError(f"{run_dir} keeps no checkpoint at step {step} (it keeps steps: "
                     f"{', '.join(map(str, kept)) or 'none'})")


def _training_steps(run_dir: str | Path) -> list[int]:
    """The steps of the finished training checkpoints in ``run_dir/checkpoints``, ascending. Read
    from the folder's names, not through a manager: in a multi-process job a manager's creation
    is a collective, and whether the folder exists yet may differ between processes (process 0
    makes it), so a manager here would leave them in different collectives."""
    directory = Path(run_dir) / "checkpoints"
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


def _residual_parts(config) -> tuple[Params, Params]:
    """A residual's step-0 parameters (without its explicit tables) and the part of them
    training keeps (all but its ``fixed_params``)."""
    params = model_init(config, jax.random.key(0))
    return params, {name: value for name, value in params.items() if name not in config.fixed_params}


def _with_tables(config, params: Params) -> Params:
    """A residual's ``params`` with the explicit tables of its explicit run."""
    from saffu.models.residual import with_explicit
    return with_explicit(params, load_explicit(config.explicit_run, config.explicit, config.explicit_sha256))


def load_params(run_dir: str | Path, config, which: str = "latest") -> tuple[Params, str]:
    """``which="latest"``: the last training checkpoint, else the explicit solution;
    ``which="explicit"``: the explicit solution. Returns the params and what was loaded.
    A residual model's explicit tables come from its ``explicit_run``; without a checkpoint
    (or with ``"explicit"``) it is its step-0 state, which is the explicit model."""
    if isinstance(config, ResidualConfig):
        params, trained = _residual_parts(config)
        latest = load_latest_params(run_dir, trained) if which == "latest" else None
        if latest is None:
            return _with_tables(config, params), "explicit (step 0)"
        return _with_tables(config, {**params, **latest[0]}), f"checkpoint step {latest[1]}"
    if which == "latest" and trainable(config):
        template = with_config_inputs(jax.eval_shape(lambda: model_init(config, jax.random.key(0))), config)
        latest = load_latest_params(run_dir, template)
        if latest is not None:
            return latest[0], f"checkpoint step {latest[1]}"
    return load_explicit(run_dir, config), "explicit"


def save_training_state(manager: ocp.CheckpointManager, step: int, params: Params, opt_state) -> None:
    """Checkpoint ``{"step", "params", "opt_state"}`` as step ``step`` (synchronously)."""
    with _orbax_failures_unlogged():
        manager.save(step, args=ocp.args.StandardSave({"step": _step_array(step, params), "params": params,
                                                      "opt_state": opt_state}))


def _step_array(step: int, params: Params) -> jax.Array:
    """``int32[]`` ``step``, placed like the parameters (a multi-process job's checkpoint holds
    arrays of its global mesh only)."""
    if jax.process_count() == 1:
        return jnp.asarray(step, jnp.int32)
    return put_global(np.asarray(step, np.int32), jax.tree.leaves(params)[0].sharding)


class WordCount(NamedTuple):
    """How many whitespace words of training text a run has consumed: ``before`` step 0 (an
    explicit start's statistics pass: one pass over the data) plus ``per_token`` per trained
    target token (the split's words over its targets, so an epoch of tokens is an epoch of words)."""

    per_token: float
    before: float = 0.0

    def at(self, tokens: int) -> float:
        """Words consumed after ``tokens`` trained target tokens."""
        return self.before + self.per_token * tokens


def word_milestones(unit: int, up_to: float) -> list[int]:
    """BabyLM's checkpoint word counts up to ``up_to``: ``1, 2, …, 10`` then every ``10`` × ``unit``."""
    if unit <= 0:
        return []
    out, count = [], unit
    while count <= up_to:
        out.append(count)
        count += unit if count < 10 * unit else 10 * unit
    return out


def words_label(words: int) -> str:
    """``1000000`` -> ``"1M"``, ``500000`` -> ``"500k"``, ``1500`` -> ``"1500"``."""
    for size, suffix in ((1_000_000_000, "B"), (1_000_000, "M"), (1_000, "k")):
        if words >= size and words % size == 0:
            return f"{words // size}{suffix}"
    return str(words)


def parse_words(text: str) -> int:
    """``"5M"``, ``"500k"``, ``"2B"`` or ``"1500"`` -> that many words; one error line otherwise."""
    text = text.strip()
    scale = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = -1
    if value <= 0 or value != int(value):
        raise SaffuError(f"--words takes a count of words such as 5M, 500k or 2000000, not {text!r}")
    return int(value)


def words_manager(directory: Path) -> ocp.CheckpointManager:
    """The orbax manager of ``RUN/words``: step and params of every milestone, all kept."""
    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=None, create=True, enable_async_checkpointing=False), item_handlers=ocp.StandardCheckpointHandler())


def words_index(run_dir: str | Path) -> list[dict]:
    """``RUN/words.json``'s milestones: ``{"words", "label", "step", "words_seen"}`` each, in order."""
    path = Path(run_dir) / "words.json"
    return json.loads(path.read_text())["milestones"] if path.is_file() else []


def save_words(manager: ocp.CheckpointManager, run_dir: Path, step: int, params: Params, reached: list[int],
               words_seen: float, count: WordCount, writer: bool = True) -> None:
    """Keep ``params`` at ``step`` (all processes of a job save together) and add the milestones
    ``reached`` to ``RUN/words.json`` (process 0 writes it), each with the words consumed then."""
    if step not in manager.all_steps():
        with _orbax_failures_unlogged():
            manager.save(step, args=ocp.args.StandardSave({"step": _step_array(step, params), "params": params}))
    if writer:
        rows = words_index(run_dir) + [{"words": w, "label": words_label(w), "step": step,
                                         "words_seen": round(words_seen)} for w in reached]
        atomic_write_json(run_dir / "words.json", {"words_per_token": count.per_token, "words_before": count.before,
                                                   "milestones": rows})


def restore_training_state(manager: ocp.CheckpointManager, run_dir: Path, params: Params, opt_state,
                           metrics_path: Path) -> tuple[int, Params, object, float]:
    """Resume from the latest checkpoint of ``manager``, if any.

    Returns ``(step, params, opt_state, seconds)``: with no checkpoint, ``(0, params,
    opt_state, 0.0)`` as given (and the lines of ``metrics_path`` that a run interrupted before
    its first checkpoint left are dropped: it starts over); else the checkpoint's, and the
    training seconds recorded at its step in ``metrics_path``, whose later lines are dropped.
    """
    if manager.latest_step() is None:
        if jax.process_index() == 0:
            metrics_path.unlink(missing_ok=True)
        return 0, params, opt_state, 0.0
    state = {"step": _step_array(0, params), "params": params, "opt_state": opt_state}
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
    if jax.process_index() == 0:       # a multi-process job's process 0 alone writes the metrics
        metrics_path.write_text("".join(line + "\n" for line in kept))
    seconds = json.loads(kept[-1])["seconds"] if kept else 0.0
    return step, state["params"], state["opt_state"], seconds


def latest_checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the latest training checkpoint in ``run_dir/checkpoints``, or None (:func:`_training_steps`)."""
    return max(_training_steps(run_dir), default=None)


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
        state = restore_here(manager, step)
        return retype(state["params"], template), step
    except Exception as err:  # orbax raises several types for unreadable / mismatched trees
        raise SaffuError(f"cannot read the checkpoint of step {step} in {directory} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120]}); it is damaged or from another model: use "
                         f"--checkpoint explicit for the explicit solution, or delete {directory / str(step)} "
                         f"to fall back to the checkpoint before it") from None
    finally:
        manager.close()


#: Fixed inputs that the model's config alone determines (SAFFU's cipher codes): a checkpoint
#: need not hold them (a training checkpoint holds no fixed input; an explicit solution saved
#: before the codes were a parameter does not either), :func:`retype` takes them from the template.
CONFIG_INPUTS = ("codes",)


def with_config_inputs(template: Params, config) -> Params:
    """``template`` (shapes) with the :data:`CONFIG_INPUTS` of ``config`` as arrays: SAFFU's
    cipher codes (:func:`saffu.models.saffu.cipher_table`); other kinds unchanged."""
    if not isinstance(config, SaffuConfig):
        return template
    from saffu.models.saffu import cipher_table
    return {**template, "codes": cipher_table(config)}


def retype(restored: Any, template: Params) -> Params:
    """``restored`` in ``template``'s structure (orbax may turn int keys into strings);
    a clear error when shapes differ (a checkpoint of another model). A :data:`CONFIG_INPUTS`
    entry that ``restored`` lacks is the template's own, where the template holds it as an array
    (:func:`with_config_inputs`; a concrete init)."""
    if isinstance(template, dict):
        if not isinstance(restored, dict):
            raise SaffuError("checkpoint structure differs from the model's; it is from another model")
        out = {}
        for key, value in template.items():
            found = restored.get(key, restored.get(str(key)))
            if found is None and key in CONFIG_INPUTS and isinstance(value, (jax.Array, np.ndarray)):
                out[key] = value
                continue
            if found is None:
                raise SaffuError(f"checkpoint lacks parameter {key!r}; it is from another model")
            out[key] = retype(found, value)
        return out
    array = jnp.asarray(restored)
    if array.shape != np.shape(template):
        raise SaffuError(f"checkpoint parameter has shape {array.shape}, the model needs {np.shape(template)}; "
                         f"it is from another model")
    return array
