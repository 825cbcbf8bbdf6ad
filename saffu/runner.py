"""A run is a value: its spec, the sections ``saffu train --config`` reads (``start``, ``model``,
``train``, ``options``, :func:`saffu.flags.train_spec`, and ``eval``), any of them partial (the
rest are the defaults). A sweep is a dict of named specs, run one process per core, each in its own folder
``OUT/NAME``; a finished run (its ``result.json`` written under the same spec) is skipped, an
interrupted one resumes from its last checkpoint; :func:`gather` turns the folders back into rows.

    from saffu.runner import gather, grid, sweep
    specs = grid({"start": {"init": "explicit", "model": "transformer"}, "train": {"steps": 457}},
                 {"train.learning_rate": [0.003, 0.01], "train.weight_decay": [0.0, 0.1]})
    sweep(specs, "runs/sweep", workdir="runs/babylm", jobs=2)
    rows = gather("runs/sweep")     # one dict per finished run: its spec's values, figures, compute

``saffu sweep GRID --workdir W --out OUT`` does the same from a file holding ``base`` and ``axes``.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import itertools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from saffu import configs
from saffu._io import SaffuError, atomic_write_json, read_settings
from saffu.eval.race import compute_with_solve
from saffu.flags import DEFAULT_CORPUS

#: The sections of a run spec (:func:`saffu.flags.spec_defaults` reads them).
SECTIONS = ("start", "model", "train", "options", "eval")
#: What a run folder holds: the spec it was started with, the training's figures, its log.
SPEC, RESULT, LOG = "spec.json", "result.json", "log.txt"


def spec_hash(spec: Mapping) -> str:
    """12 hex digits of the SHA-256 of ``spec`` as canonical JSON (sorted keys): equal specs,
    equal hashes, however their dicts were built."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def check_spec(spec: Mapping) -> dict:
    """``spec`` as a plain dict of its sections; one error line for anything else."""
    if not isinstance(spec, Mapping):
        raise SaffuError(f"a run spec is a mapping of sections ({', '.join(SECTIONS)}), not {type(spec).__name__}")
    unknown = set(spec) - set(SECTIONS)
    if unknown:
        raise SaffuError(f"a run spec has the sections {', '.join(SECTIONS)}; not {', '.join(sorted(unknown))}")
    for section, values in spec.items():
        if not isinstance(values, Mapping):
            raise SaffuError(f"the run spec's section {section!r} must be a mapping of settings")
    return json.loads(json.dumps(spec))


def flatten(spec: Mapping) -> dict:
    """``{"section.setting": value}`` of a spec."""
    return {f"{section}.{name}": value for section, values in spec.items() for name, value in values.items()}


def with_value(spec: Mapping, dotted: str, value) -> dict:
    """A copy of ``spec`` with ``dotted`` (``"train.learning_rate"``) set to ``value``."""
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name:
        raise SaffuError(f"{dotted!r} names no setting: write section.setting, a section of {', '.join(SECTIONS)}")
    out = copy.deepcopy(dict(spec))
    out.setdefault(section, {})[name] = value
    return out


def grid(base: Mapping, axes: Mapping[str, list]) -> dict[str, dict]:
    """Every combination of ``axes`` (``{"train.learning_rate": [0.003, 0.01], …}``) over
    ``base``: ``{name: spec}``, each name the axes' settings and values
    (``"learning_rate=0.003,weight_decay=0"``), in the order of the product."""
    base = check_spec(base)
    for dotted, values in axes.items():
        if not isinstance(values, list) or not values:
            raise SaffuError(f"the axis {dotted!r} takes a non-empty list of values")
        with_value(base, dotted, values[0])        # a well-formed name
    names = [dotted.partition(".")[2] for dotted in axes]
    specs = {}
    for combination in itertools.product(*axes.values()):
        spec = base
        for dotted, value in zip(axes, combination):
            spec = with_value(spec, dotted, value)
        name = ",".join(f"{n}={_label(v)}" for n, v in zip(names, combination)) or "base"
        specs[name] = spec
    return specs


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else "-".join(map(str, value)) if isinstance(value, list) \
        else str(value)


def command(folder: Path, workdir: str | Path, python: str = sys.executable) -> list[str]:
    """The ``saffu train`` command of the run in ``folder`` (its spec in ``folder/spec.json``)."""
    return [python, "-m", "saffu", "train", "--config", str(folder / SPEC), "--workdir", str(workdir),
            "--run", str(folder), "--metrics-json", str(folder / RESULT), "--quiet"]


def _prepare(spec: Mapping, folder: Path) -> bool:
    """Write ``folder/spec.json`` for ``spec``; ``True`` when the run is finished already. A
    folder holding another spec is refused, naming the settings that differ."""
    spec = check_spec(spec)
    path = folder / SPEC
    if path.exists():
        earlier = json.loads(path.read_text())
        if spec_hash(earlier) != spec_hash(spec):
            ours, theirs = flatten(spec), flatten(earlier)
            differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise SaffuError(f"{folder} holds a run of another spec (differing: {', '.join(differ)}); "
                             f"give this one another name or out folder")
        return (folder / RESULT).exists()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, spec)
    return False


def run(spec: Mapping, out: str | Path, workdir: str | Path, name: str | None = None,
        core: int | None = None) -> dict:
    """Train ``spec`` in ``out/name`` (``name`` default: its :func:`spec_hash`) unless it has
    finished there already, then return its row (:func:`gather_one`). ``core`` pins the process
    to that CPU core (``taskset``). Raises :class:`SaffuError` when the training fails (its log
    is ``out/name/log.txt``)."""
    folder = Path(out) / (name or spec_hash(spec))
    if not _prepare(spec, folder):
        process = _start(folder, workdir, core)
        if process.wait():
            raise SaffuError(f"{folder} failed (exit {process.returncode}); see {folder / LOG}")
    return gather_one(folder)


def _start(folder: Path, workdir, core: int | None) -> subprocess.Popen:
    line = command(folder, workdir)
    pin = ["taskset", "-c", str(core)] if core is not None else []
    with open(folder / LOG, "a") as log:
        log.write(f"$ {shlex.join(line)}\n")
        log.flush()
        return subprocess.Popen(pin + line, stdout=log, stderr=subprocess.STDOUT)


def sweep(specs: Mapping[str, Mapping], out: str | Path, workdir: str | Path, jobs: int = 2,
          say: Callable[[str], None] = print) -> list[dict]:
    """Run every named spec of ``specs`` not finished in ``out`` yet, ``jobs`` at a time, each
    pinned to a core of its own (when ``jobs > 1``); returns the rows of all of them
    (:func:`gather_one`), in the order of ``specs``. A failed run is reported and the others
    go on; :class:`SaffuError` at the end names the failed ones."""
    out = Path(out)
    if jobs < 1:
        raise SaffuError(f"jobs must be ≥ 1, not {jobs}")
    pending = [name for name, spec in specs.items() if not _prepare(spec, out / name)]
    say(f"{len(specs) - len(pending)} of {len(specs)} runs finished already; {len(pending)} to run")
    cores = sorted(os.sched_getaffinity(0))
    running: dict[int, tuple[subprocess.Popen, str, float]] = {}
    failed = []
    while pending or running:
        for slot in range(jobs):
            if slot not in running and pending:
                name = pending.pop(0)
                core = cores[slot % len(cores)] if jobs > 1 else None
                running[slot] = (_start(out / name, workdir, core), name, time.time())
        time.sleep(0.5)
        for slot, (process, name, began) in list(running.items()):
            if process.poll() is None:
                continue
            del running[slot]
            if process.returncode:
                failed.append(name)
                say(f"{name}: failed (exit {process.returncode}); see {out / name / LOG}")
            else:
                row = gather_one(out / name)
                say(f"{name}: dev {row.get('dev_bpb', float('nan')):.4f} bits/byte ({time.time() - began:,.0f} s)")
    if failed:
        raise SaffuError(f"{len(failed)} of {len(specs)} runs failed: {', '.join(failed)}")
    return [gather_one(out / name) for name in specs]


def exact_run(workdir: str | Path, run: str | Path, flags: tuple[str, ...] = (),
              say: Callable[[str], None] = print) -> Path:
    """A ``saffu exact`` run of ``workdir``'s training split at ``run`` (what a residual start
    and the exact model are read from): made here, with ``saffu exact``'s ``flags`` (its defaults
    otherwise), unless ``run`` already holds one of ``workdir``. Raises :class:`SaffuError` when
    ``run`` holds a run of another work directory, or when making it fails (its log is
    ``run/log.txt``)."""
    from saffu.data.workdir import open_workdir
    from saffu.training.checkpoints import check_inputs
    run = Path(run)
    if (run / "config.json").exists():
        check_inputs(run, open_workdir(workdir), streams=True)      # tables counted from this training split
        return run
    run.mkdir(parents=True, exist_ok=True)
    line = [sys.executable, "-m", "saffu", "exact", "--workdir", str(workdir), "--run", str(run), *flags,
            "--quiet"]
    say(f"no exact run at {run}: making one ({shlex.join(['saffu', *line[3:]])})")
    with open(run / LOG, "a") as log:
        if subprocess.run(line, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SaffuError(f"saffu exact failed for {run}; see {run / LOG}")
    return run


def run_saffu(*words) -> None:
    """Run the command ``saffu WORDS --quiet`` (each word as ``str``) in a process of its own, its
    output captured. Raises :class:`SaffuError` with the last line of its standard error (saffu's
    one error line) when it fails."""
    done = subprocess.run([sys.executable, "-m", "saffu", *map(str, words), "--quiet"], capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise SaffuError(lines[-1] if lines else f"saffu {words[0]} failed (exit {done.returncode})")


def prepared(workdir: str | Path, corpus: str | Path | None = None, vocab_size: int = 512) -> Path:
    """``workdir`` holding a prepared work directory: ``saffu prepare`` of ``corpus`` (default: the
    embedded corpus, :data:`saffu.flags.DEFAULT_CORPUS`) at ``vocab_size`` (or the corpus's
    largest, if smaller), unless it holds one (its ``meta.json``) already. The quick modes' work
    directory."""
    workdir = Path(workdir)
    if not (workdir / "meta.json").exists():
        run_saffu("prepare", "--corpus", corpus or DEFAULT_CORPUS, "--workdir", workdir, "--vocab-size", vocab_size,
                  "--allow-smaller-vocab")
    return workdir


def gather_one(folder: str | Path) -> dict:
    """The row of a finished run folder: ``name``, ``spec_hash``, its spec's settings
    (``"train.learning_rate"``, …), every figure of its ``result.json``, the last training loss
    of its metrics, ``compute`` (FLOPs with the explicit solve,
    :func:`saffu.eval.race.compute_with_solve`) and ``gap_nats`` (dev loss minus the last
    training loss)."""
    folder = Path(folder)
    spec = json.loads((folder / SPEC).read_text())
    result = json.loads((folder / RESULT).read_text())
    records = history(folder)
    row = {"name": folder.name, "spec_hash": spec_hash(spec), **flatten(spec), **result}
    trained = [h for h in records if h.get("train_loss") == h.get("train_loss") and h.get("train_loss") is not None]
    if trained:
        row["train_loss"] = trained[-1]["train_loss"]
        if "dev_loss" in row:
            row["gap_nats"] = row["dev_loss"] - row["train_loss"]
    if records and row.get("flops") and records[-1].get("seconds"):
        row["compute"] = compute_with_solve(row["flops"], records[-1]["seconds"], row.get("solve_seconds", 0.0))
    return row


def history(folder: str | Path) -> list[dict]:
    """The records of a run folder's ``metrics.jsonl``, one per evaluation (blank lines skipped)."""
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_figures(result: Mapping, records: list[Mapping]) -> dict:
    """What a report keeps of a finished training, from its ``result.json`` ``result`` and its
    last record of ``records`` (:func:`history`): the whole-dev ``dev_bpb`` and ``dev_loss``, the
    last ``train_loss``, the last periodic dev loss on the dev windows
    (``last_dev_window_loss``), ``steps``, ``train_seconds`` (the last record's: also right for a
    run resumed at its end), ``solve_seconds`` (0 without a solve) and ``flops`` (``steps`` and
    ``flops`` the last record's, else the result's)."""
    last = records[-1]
    return {"dev_bpb": result["dev_bpb"], "dev_loss": result["dev_loss"], "train_loss": last["train_loss"],
            "last_dev_window_loss": last["dev_loss"], "steps": last.get("step", result.get("steps")),
            "train_seconds": last["seconds"], "solve_seconds": result.get("solve_seconds", 0.0),
            "flops": last.get("flops", result.get("flops"))}


def steps_per_epoch(workdir: str | Path, targets_per_step: int) -> int:
    """The steps of one epoch of ``workdir``'s training split at ``targets_per_step`` targets a
    step (batch size × sequence length); at least 1."""
    meta = json.loads((Path(workdir) / "meta.json").read_text())
    targets = meta["splits"][meta.get("train_split", "train_10M")]["tokens"] - 1
    return max(targets // targets_per_step, 1)


def recorded(path: str | Path) -> dict:
    """The figures of a results file (``results/NAME.json``), ``{}`` while there is none: the rows
    of earlier sessions, whose run folders stayed on the machine that made them."""
    path = Path(path)
    return json.loads(path.read_text())["figures"] if path.exists() else {}


def joined(here: list[dict], earlier: list[dict], key: Callable[[dict], object]) -> list[dict]:
    """The rows ``here`` (of this machine's run folders), then each row of ``earlier`` (recorded by
    earlier sessions, :func:`recorded`) whose ``key`` no row here has: a run made again here
    replaces its recorded row."""
    seen = {key(row) for row in here}
    return [*here, *(row for row in earlier if key(row) not in seen)]


def gather(out: str | Path) -> list[dict]:
    """The rows (:func:`gather_one`) of every finished run folder directly under ``out``, by name."""
    out = Path(out)
    return [gather_one(folder) for folder in sorted(out.iterdir()) if (folder / RESULT).exists()
            and (folder / SPEC).exists()] if out.is_dir() else []


def read_grid(path: str | Path) -> tuple[dict, dict]:
    """``(base, axes)`` of a grid file (TOML or JSON): ``base``, a spec, and ``axes``,
    ``{"section.setting": [values]}``; one error line for anything else."""
    data = read_settings(path, f"{path} is not a readable grid")
    unknown = set(data) - {"base", "axes"}
    if unknown or "base" not in data:
        raise SaffuError(f"{path}: a grid holds base (a run spec) and axes ({{section.setting: [values]}}), "
                         f"not {', '.join(sorted(unknown)) or 'no base'}")
    axes = {}
    for key, values in data.get("axes", {}).items():        # TOML's dotted keys arrive as tables
        if isinstance(values, dict):
            axes.update({f"{key}.{name}": v for name, v in values.items()})
        else:
            axes[key] = values
    return data["base"], axes


def demo(corpus_path: str | Path, out: str | Path, bigram: configs.BigramConfig, config: configs.DemoConfig,
         radius: int, saffu_mu: float, learning_rate: float, name: str | None = None, progress: bool = False,
         say: Callable[[str], None] = lambda message: None) -> tuple[dict, Path, object]:
    """The main job on a corpus: prepare it into ``out/data`` (BPE of ``config.vocab_size``),
    solve and score the explicit bigram layer (``bigram``), solve an explicit SAFFU model
    (``radius``, ``config.bits``-bit codes, Dirichlet ``saffu_mu``) into ``out/saffu`` (made
    afresh), score dev, warm-start it for ``config.steps`` AdamW steps at ``learning_rate`` and
    score dev again. Returns ``(figures, run directory, work directory)``."""
    from saffu.data.corpus import babylm_corpus
    from saffu.data.workdir import prepare
    from saffu.eval.metrics import split_metrics
    from saffu.eval.scoring import evaluate_split
    from saffu.models.interface import parameter_count
    from saffu.training.recipes import count_model, solve_run
    from saffu.training.trainer import train
    start, out = time.perf_counter(), Path(out)
    workdir = prepare(babylm_corpus(corpus_path, name=name), out / "data",
                      configs.PrepareConfig(vocab_size=config.vocab_size), show_progress=progress)
    nlls, _ = count_model(workdir, "bigram", bigram, ["dev"], progress)
    metrics = split_metrics(nlls["dev"], workdir.split_info("dev"), "bigram_dev_")
    model = configs.SaffuConfig(vocab_size=workdir.vocab_size, bits=config.bits, radius=radius)
    say(f"solving explicit SAFFU (radius {radius}, {config.bits}-bit codes) on "
        f"{workdir.split_info(workdir.train_split)['tokens']:,} training tokens")
    run = out / "saffu"
    if run.exists():   # the demo's own run: a rerun trains again instead of finding it finished
        shutil.rmtree(run)
    solver = configs.SolverConfig(smoothing=configs.Smoothing(mu=saffu_mu))
    params, report, _ = solve_run(workdir, run, model, solver, progress=progress)
    metrics.update(explicit_seconds=report["seconds"], params=parameter_count(params))
    metrics.update(evaluate_split(params, model, workdir, "dev", progress=progress, prefix="explicit_dev_"))
    say(f"warm start: {config.steps} AdamW steps from the explicit solution")
    train_config = configs.TrainConfig(steps=config.steps, learning_rate=learning_rate, eval_every=config.steps,
                                       checkpoint_every=0)
    trained, history = train(model, params, workdir.tokens(workdir.train_split), train_config, run,
                             dev_stream=workdir.tokens("dev"), progress=progress)
    metrics.update(warm_steps=config.steps, warm_seconds=history[-1]["seconds"])
    metrics.update(evaluate_split(trained, model, workdir, "dev", progress=progress, prefix="warm_dev_"))
    metrics["total_seconds"] = time.perf_counter() - start
    return metrics, run, workdir


def machine(root: str | Path = ".") -> dict:
    """Where figures were measured: processor, cores, memory, JAX backend and version, Python,
    and the git revision of the checkout at ``root`` (``+changes`` when its tracked files differ)."""
    import jax
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if cpuinfo.exists() else ""
    git = lambda *words: subprocess.run(["git", "-C", str(root), *words], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"cpu": model, "cores": os.cpu_count(), "memory_gb": round(memory / 2**30, 1),
            "jax_backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "revision": git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")}


def write_result(results: str | Path, name: str, figures: Mapping, seeds: list[int], load: Mapping | None = None,
                 started: datetime.datetime | None = None) -> Path:
    """Write ``RESULTS/<name>.json`` (``results``: a checkout's ``results/`` folder), an experiment's
    figures with what it takes to trust and reproduce them: the command as typed (from the
    checkout's root), the date, ``seeds``, :func:`machine` and ``load`` (e.g. the load averages
    before and after; the 1-minute load average now by default). :func:`recorded` reads it back."""
    now = datetime.datetime.now(datetime.UTC)
    path = Path(results) / f"{name}.json"
    atomic_write_json(path, {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": (started or now).strftime("%Y-%m-%d"), "started": (started or now).isoformat(timespec="seconds"),
        "finished": now.isoformat(timespec="seconds"), "seeds": seeds, "machine": machine(path.parent.parent),
        "load": dict(load) if load else {"load_average_1min": os.getloadavg()[0]}, "figures": dict(figures)})
    return path
