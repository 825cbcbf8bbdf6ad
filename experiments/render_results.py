"""Results pages generated from the results files: ``results/<name>.json`` (written by the
experiments, :mod:`results`) -> ``docs/results/<name>.md``, and the README's generated blocks
(the lines between ``<!-- generated: NAME -->`` and ``<!-- /generated -->``: ``headline``, the
headline table; ``setup``, the set-up commands' measured times). No figure on a page or in a
block is typed by hand; ``tests/test_results_pages.py`` regenerates them and fails on any
difference.

    python experiments/render_results.py            # rewrite every page and the README's blocks
    python experiments/render_results.py --check    # exit 1 if a page or a block differs from its file
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jinja2

from saffu.flags import script_options

ROOT = Path(__file__).resolve().parents[1]
RESULTS, PAGES = ROOT / "results", ROOT / "docs" / "results"
README = ROOT / "README.md"
#: Hand-written readings of the pages (``docs/readings/<name>.md``): what the tables say, in words.
READINGS = ROOT / "docs" / "readings"
#: The pages and README blocks as Jinja templates (``experiments/pages/<name>.md``): text, tables and their loops.
TEMPLATES = Path(__file__).resolve().parent / "pages"
#: The templates' environment: ``{{ x | fmt(".4f") }}`` is ``format(x, ".4f")``; an undefined name is an error.
JINJA = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                           keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
JINJA.filters.update(fmt=format, zip=zip)


def provenance(record: dict) -> str:
    """Where the figures come from: command, date, seeds, machine, load."""
    machine = record["machine"]
    load = ", ".join(f"{key.replace('_', ' ')}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}"
                     for key, value in record["load"].items())
    return (f"Command: `{record['command']}`  \n"
            f"Date: {record['date']} ({record['started']} to {record['finished']}); seeds: "
            f"{', '.join(map(str, record['seeds']))}  \n"
            f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB, JAX {machine['jax']} "
            f"({machine['jax_backend']}), revision {machine['revision']}  \n"
            f"Load: {load}")


def _page(name: str, record: dict, **values) -> str:
    """``experiments/pages/<name>.md`` (a Jinja template) rendered with the record's figures ``f``,
    its :func:`provenance` and ``values`` (the tables and what the page computes)."""
    return JINJA.get_template(f"{name}.md").render(f=record["figures"], record=record, provenance=provenance(record),
                                                   **values)


def _yes(value) -> str:
    return "yes" if value else "NO"


def soak(record: dict) -> str:
    f = record["figures"]
    return _page("soak", record, long_consistent=_yes(f["long_metrics_consistent"]),
                 steps_per_resume=f["resume_steps"] // f["resumes"],
                 resumed_consistent=_yes(f["resumed_metrics_consistent"]),
                 resumed_equal=_yes(f["resumed_equals_uninterrupted"]))


def _others(rows: list[dict]) -> list[dict]:
    """The rows of any other architecture than the project's transformer."""
    return [r for r in rows if r["architecture"] != "saffu"]


def _other_names(rows: list[dict]) -> str:
    """The other architectures of ``rows`` as the results file names them (``"a and b"``)."""
    return " and ".join(sorted({r["architecture_name"] for r in _others(rows)}))


def budgets(record: dict) -> str:
    f = record["figures"]
    others = sorted({r["start"] for r in _others(f["rows"])})
    other_note = ("" if not others else
                  f" Rows {' / '.join(f'`{start}`' for start in others)}: {_other_names(f['rows'])} of\n"
                  "[any_model](any_model.md) (same width, depth, data and trainer), each explicit start's\n"
                  "multiplier against its own architecture's random init's curve.")
    probes, plot = _probes(f.get("probes", {})), Path(f["plot"]).name
    return _page("budgets", record, other_note=other_note, plot=plot, probes=probes)


def _probes(probes: dict) -> str:
    """The learning-rate probes run into the sweep's folders: per start, each rate's last
    periodic dev loss and the rate chosen."""
    if not probes:
        return ""
    lines = [f"* {start}: " + " / ".join(f"lr {rate} {loss:.4f}" for rate, loss in entry["losses"].items())
             + f" nats on {entry['fraction']:.0%} of train → lr {entry['learning_rate']:g}"
             for start, entry in probes.items()]
    return ("\nLearning-rate probes run with the sweep (one run per rate, one epoch of the share, seed 0, "
            "its last periodic dev loss):\n\n" + "\n".join(lines) + "\n")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def setup(record: dict) -> str:
    f = record["figures"]
    return _page("setup", record, demo_time=_duration(f["demo_seconds"]), demo_ok=_yes(f["demo_ok"]),
                 test_time=_duration(f["test_seconds"]), test_ok=_yes(f["test_ok"])).rstrip("\n") + "\n"


def bench_bf16(record: dict) -> str:
    f = record["figures"]
    mm = f["matmul"]["seconds"]
    compiled = ("as a float32 product between conversions" if f["matmul"]["bf16_to_bf16_converts_to_f32"]
                else "without conversions to float32")
    return _page("bench_bf16", record, units=", ".join(f["cpu_bf16_units"]) or "none", shape=mm_shape(f),
                 ms={k: v * 1e3 for k, v in mm.items()}, compiled=compiled, ratio=mm["bf16_to_f32"] / mm["float32"],
                 model=f["training"]["model"], variants=sorted(f["training"]["seconds_per_step"], key=lambda n: n != "float32"))


#: bench_train's variants as its page names them.
TRAIN_VARIANTS = {"saffu": "saffu", "saffu-before": "saffu, revision before the speed work",
                  "saffu-dp2": "saffu, data-parallel over 2 host devices (`--devices 2`)",
                  "saffu-mp2": "saffu, data-parallel over 2 processes, one per core (`--num-processes 2`)",
                  "torch-eager": "PyTorch, eager", "torch-compile": "PyTorch, `torch.compile`"}


def bench_train(record: dict) -> str:
    f = record["figures"]
    ratio = lambda key: f"{f[key]:.2f}×" if f.get(key) else "not measured"
    backend = ("No accelerator row: no GPU was available to this run (JAX backend cpu)." if f.get("backend", "cpu") == "cpu"
               else f"JAX backend: {f['backend']}.")
    return _page("bench_train", record, backend=backend, before=ratio("speedup_vs_before"), best_two=f.get("best_two_core_variant"),
                 gflop=f["xla_flops_per_step"] / 1e9, m=f["model"], labels=TRAIN_VARIANTS, torch=ratio("speedup_vs_torch"),
                 two=ratio("speedup_two_cores"), xla_from=f.get("xla_flops_from", "saffu"))


SCORED = (("transformer", "transformer (random init)"), ("exact", "exact model"), ("residual", "explicit residual"))


def bench_scoring(record: dict) -> str:
    f = record["figures"]
    settings = f["settings"]
    train = f["transformer"]["train_tokens_per_s"]
    rows = []
    for key, label in SCORED:
        m = f[key]
        trains = f"{m['train_tokens_per_s']:,.0f}" if "train_tokens_per_s" in m else "— (solved)"
        rows.append(f"| {label} | {trains} | {m['before_score_tokens_per_s']:,.0f} → {m['score_tokens_per_s']:,.0f} "
                    f"({m['score_vs_train']:.2f}×) | {m['before_blimp_tokens_per_s']:,.0f} → {m['blimp_tokens_per_s']:,.0f} "
                    f"({m['blimp_vs_train']:.2f}×) | {m['blimp_seconds']:.0f} s | "
                    f"{abs(m['score_loss'] - m['before_score_loss']):.1e} |")
    ratio = f["residual_vs_transformer"]
    return _page("bench_scoring", record, ratio=ratio, settings=settings, table="\n".join(rows), train=train,
                 workdir=Path(settings["workdir"]).name)


def mm_shape(f: dict) -> str:
    rows, width, vocab = f["matmul"]["shape"]
    return f"{rows:,} × {width}] @ [{width} × {vocab:,}"


#: How a multiplier of each kind (saffu.eval.race) is printed before its value.
BOUND = {"measured": "", "lower_bound": "≥ ", "upper_bound": "≤ "}
JINJA.filters["bound"] = BOUND.__getitem__


def tuning(record: dict) -> str:
    f = record["figures"]
    runs = [r for t in f["starts"].values() for b in t["budgets"].values() for r in b["runs"]]
    runs += [r for rows in f.get("architectures", {}).values() for r in rows]
    return _page("tuning", record, plot=Path(f.get("plot", "tuning.png")).name,
                 rescored=[r for r in runs if r.get("rescored")])


RENDERERS = {"tuning": tuning, "bench_train": bench_train, "bench_bf16": bench_bf16, "bench_scoring": bench_scoring, "soak": soak, "budgets": budgets, "setup": setup}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _width(flags: list[str]) -> int:
    """The width a start's ``saffu train`` flags give (``--width``; the default 128)."""
    return int(flags[flags.index("--width") + 1]) if "--width" in flags else 128


def _race_rows() -> list[str]:
    """The tuned race's rows (``results/tuning.json``): per architecture's cold curve and budget,
    the explicit start with the lowest dev figure and its multiplier, measured or a bound."""
    tuning = _load("tuning")
    if not tuning:
        return []
    best, f = {}, tuning["figures"]
    for start, runs in f.get("race", {}).items():
        for r in runs:
            key = (r["cold"], r["epochs"])
            if key not in best or r["dev_bpb"] < best[key][1]["dev_bpb"]:
                best[key] = (start, r)
    flags = f.get("flags", {})
    searched = lambda cold: "tuned" if f["starts"].get(cold, {}).get("chosen") else "at width 128's tuned values"
    return [f"| saffu's transformer (`{' '.join(flags.get(cold, []))}`), width {_width(flags.get(cold, []))}, "
            f"{epochs:g} epoch{'s' if epochs != 1 else ''}, {searched(cold)} | {start} against {cold} | {r['dev_bpb']:.4f} | "
            f"compute multiplier {BOUND[r['multiplier_kind']]}{r['multiplier']:.2f}× ({r['multiplier_kind'].replace('_', ' ')}) | "
            f"{tuning['date']} | [tuning](docs/results/tuning.md) |"
            for (cold, epochs), (start, r) in sorted(best.items(), key=lambda item: (item[0][0] != "llama-cold-nobias",
                                                                                      item[0]))]


def headline_block() -> str:
    """The README's headline table: the tuned race's best explicit start per architecture and
    budget (:func:`_race_rows`), then the two penzai models of the any-model run (random against
    explicit init), each linking its results page. The budget sweep's rows against its untuned cold
    start stay on their page (``docs/results/budgets.md``)."""
    rows = _race_rows()
    any_model = _load("any_model")
    if any_model:
        f = any_model["figures"]
        for model, name in (("llama", "penzai's Llama-like"), ("neox", "penzai's GPT-NeoX")):
            if f"{model}_random_dev_bpb" not in f:
                continue
            rows.append(f"| {name}, {f[model + '_steps']} steps (one epoch) | random init → explicit init | "
                        f"{f[model + '_random_dev_bpb']:.4f} → {f[model + '_explicit_dev_bpb']:.4f} | "
                        f"explicit init reaches random init's final loss in {f[model + '_explicit_share_of_steps']:.0%} of the steps | "
                        f"{any_model['date']} | [any_model](docs/results/any_model.md) |")
    if not rows:
        return "No results file yet: run the experiments that write `results/tuning.json` and `results/any_model.json`.\n"
    return ("| model, budget | start | whole-dev bits/byte | against the cold start | measured | figures |\n"
            "|---|---|---:|---|---|---|\n" + "\n".join(rows) + "\n")


def _records(block: str, **files: str) -> dict:
    """``{key: results/<file>.json's record}`` of a README block; a missing results file is one
    error naming it."""
    records = {key: _load(file) for key, file in files.items()}
    missing = [f"results/{files[key]}.json" for key, record in records.items() if record is None]
    if missing:
        raise SystemExit(f"README block {block!r} needs {', '.join(missing)}: run the experiment that writes it")
    return records


def _block(name: str, records: dict, **values) -> str:
    """``experiments/pages/readme_<name>.md`` filled in with ``records`` (:func:`_records`) and ``values``."""
    return JINJA.get_template(f"readme_{name}.md").render(**records, **values)


def setup_block() -> str:
    """The README's set-up times: ``make demo`` and ``make test`` on a fresh clone."""
    records = _records("setup", setup="setup")
    f = records["setup"]["figures"]
    status = {True: "passed", False: "FAILED"}
    return _block("setup", records, demo=_duration(f["demo_seconds"]), demo_ok=status[bool(f["demo_ok"])],
                  test=_duration(f["test_seconds"]))


def speed_block() -> str:
    """The README's throughput lines: scoring and BLiMP against training, the statistics engine
    against numpy and a PyTorch peer, bf16 against float32 on the measuring backend."""
    records = _records("speed", scoring="bench_scoring", stats="bench_stats", train="bench_train", bf16="bench_bf16")
    ratio = records["bf16"]["figures"]["training"]["bf16_over_f32_step"]
    return _block("speed", records, verdict="slower" if ratio > 1 else "faster")


def tuning_block() -> str:
    """Each start's tuned values and its dev figure at each budget of ``results/tuning.json``."""
    record = _load("tuning")
    if record is None:
        return "Not measured yet (`experiments/tune.py`).\n"
    lines = []
    for start, t in record["figures"]["starts"].items():
        if not t["chosen"]:
            lines.append(f"* {start}: its grid is not finished yet")
            continue
        c = t["chosen"]
        grid = (f"* {start}: grid at {record['figures']['protocol']['share_epochs']:g} epoch chose learning rate "
                f"{c['learning_rate']:g}, weight decay {c['weight_decay']:g}, dropout {c['dropout']:g}")
        budgets = []
        for epochs, b in t["budgets"].items():
            if b["chosen"]:
                run = next(r for r in b["runs"] if r["learning_rate"] == b["chosen"]["learning_rate"])
                budgets.append(f"{epochs} epoch{'s' if epochs != '1' else ''}: {run['dev_bpb']:.4f} bits/byte at rate "
                               f"{run['learning_rate']:g}")
        lines.append(grid + ("; whole dev, " + ", ".join(budgets) if budgets else ""))
    for start, rows in record["figures"].get("race", {}).items():
        lines.append(f"* {start} against the {rows[0]['cold']} curve: " + ", ".join(
            f"{r['epochs']:g} epoch{'s' if r['epochs'] != 1 else ''} {r['dev_bpb']:.4f} bits/byte, compute multiplier "
            f"{BOUND[r['multiplier_kind']]}{r['multiplier']:.2f}× ({r['multiplier_kind'].replace('_', ' ')})"
            for r in rows))
    return "\n".join(lines) + f" ({record['date']}, [tuning](docs/results/tuning.md))\n"


README_BLOCKS = {"tuning": tuning_block, "headline": headline_block, "setup": setup_block, "speed": speed_block}
BLOCK = re.compile(r"^<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /generated -->$", re.M | re.S)


def render_readme(text: str) -> str:
    """``text`` with every generated block's body rendered again from the results files."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in README_BLOCKS:
            raise SystemExit(f"README.md: unknown generated block {name!r} (known: {', '.join(README_BLOCKS)})")
        return f"<!-- generated: {name} -->\n{README_BLOCKS[name]()}<!-- /generated -->"
    return BLOCK.sub(body, text)


def reading(name: str) -> str:
    """The hand-written reading of a page (``docs/readings/<name>.md``, no figures: the figure check
    reads it as it reads every docs page), under its tables; empty where there is none."""
    path = READINGS / f"{name}.md"
    return f"\n## Reading\n\n{path.read_text().strip()}\n" if path.exists() else ""


def pages() -> dict[Path, str]:
    """Every page of a results file present and its template, with its reading (:func:`reading`):
    its renderer of :data:`RENDERERS`, or the template with the figures alone."""
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        render = RENDERERS.get(path.stem, lambda record, name=path.stem: _page(name, record))
        if (TEMPLATES / f"{path.stem}.md").exists():
            out[PAGES / f"{path.stem}.md"] = render(json.loads(path.read_text())) + reading(path.stem)
    return out


def outputs() -> dict[Path, str]:
    """Every generated file: the results pages and the README with its blocks rendered."""
    return {**pages(), README: render_readme(README.read_text())}


@dataclasses.dataclass
class Options:
    """Attributes:
      check: only compare; exit 1 on a difference"""
    check: bool = False


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'differs from its results file' if args.check else 'written'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
