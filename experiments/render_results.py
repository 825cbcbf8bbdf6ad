"""Results pages generated from the results files: ``results/<name>.json`` (written by the
experiments, :func:`saffu.runner.write_result`) -> ``docs/results/<name>.md``, and the README's generated blocks
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
from pathlib import Path

import jinja2

from saffu.flags import script_main, script_options

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
#: How a multiplier of each kind (saffu.eval.race) is printed before its value (the ``bound`` filter).
BOUND = {"measured": "", "lower_bound": "≥ ", "upper_bound": "≤ "}
#: The templates' other filters: ``zip``, ``bound`` (:data:`BOUND`), ``basename`` (a path's file
#: name) and ``duration`` (seconds as ``45 s``, or in minutes from 90 s: ``2.5 min``).
JINJA.filters.update(fmt=format, zip=zip, bound=BOUND.__getitem__, basename=lambda path: Path(path).name,
                     duration=lambda seconds: f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min")


def _page(name: str, record: dict, **values) -> str:
    """``experiments/pages/<name>.md`` (a Jinja template) rendered with the record's figures ``f``,
    the record, its provenance (``experiments/pages/_provenance.md``: command, date, seeds, machine,
    load) and ``values`` (what the page computes)."""
    return JINJA.get_template(f"{name}.md").render(f=record["figures"], record=record, **values,
                                                   provenance=JINJA.get_template("_provenance.md").render(record))


def bench_bf16(record: dict) -> str:
    f = record["figures"]
    mm = f["matmul"]["seconds"]
    compiled = ("as a float32 product between conversions" if f["matmul"]["bf16_to_bf16_converts_to_f32"]
                else "without conversions to float32")
    return _page("bench_bf16", record, units=", ".join(f["cpu_bf16_units"]) or "none", shape=mm_shape(f),
                 ms={k: v * 1e3 for k, v in mm.items()}, compiled=compiled, ratio=mm["bf16_to_f32"] / mm["float32"],
                 model=f["training"]["model"], variants=sorted(f["training"]["seconds_per_step"], key=lambda n: n != "float32"))


def mm_shape(f: dict) -> str:
    rows, width, vocab = f["matmul"]["shape"]
    return f"{rows:,} × {width}] @ [{width} × {vocab:,}"


def tuned_runs(f: dict) -> list[dict]:
    """Every run of ``results/tuning.json``'s figures ``f`` of an epoch or more: the tuned starts'
    budgets' runs, then the other architectures' runs."""
    runs = [r for t in f["starts"].values() for b in t["budgets"].values() for r in b["runs"]]
    return runs + [r for rows in f.get("architectures", {}).values() for r in rows]


def tuning(record: dict) -> str:
    return _page("tuning", record, rescored=[r for r in tuned_runs(record["figures"]) if r.get("rescored")])


RENDERERS = {"tuning": tuning, "bench_bf16": bench_bf16}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _race_best(tuning: dict | None) -> list[tuple[str, dict]]:
    """The tuned race's rows (``results/tuning.json``): per architecture's cold curve and budget, the
    explicit start with the lowest dev figure and its run, as ``(start, run)``: the default's first
    (``llama-cold-nobias-xdoc``, attention across documents), then the document-local llama block's."""
    best = {}
    for start, runs in (tuning["figures"].get("race", {}) if tuning else {}).items():
        for r in runs:
            key = (r["cold"], r["epochs"])
            if key not in best or r["dev_bpb"] < best[key][1]["dev_bpb"]:
                best[key] = (start, r)
    first = ("llama-cold-nobias-xdoc", "llama-cold-nobias")
    return [best[key] for key in sorted(best, key=lambda key: (first.index(key[0]) if key[0] in first else 2, key))]


def headline_block() -> str:
    """The README's headline table: the tuned race's best explicit start per architecture and
    budget (:func:`_race_best`) and the lowest figure of any run within four epochs (:func:`tuned_runs`), then the two penzai models of the any-model run (random against
    explicit init), each linking its results page. The budget sweep's rows against its untuned cold
    start stay on their page (``docs/results/budgets.md``)."""
    tuning = _load("tuning")
    runs = tuned_runs(tuning["figures"]) if tuning else []
    return _block("headline", tuning=tuning, any_model=_load("any_model"), race=_race_best(tuning),
                  best=min((r for r in runs if r["epochs"] <= 4), key=lambda r: r["dev_bpb"], default=None))


def _records(block: str, **files: str) -> dict:
    """``{key: results/<file>.json's record}`` of a README block; a missing results file is one
    error naming it."""
    records = {key: _load(file) for key, file in files.items()}
    missing = [f"results/{files[key]}.json" for key, record in records.items() if record is None]
    if missing:
        raise SystemExit(f"README block {block!r} needs {', '.join(missing)}: run the experiment that writes it")
    return records


def _block(name: str, **values) -> str:
    """``experiments/pages/readme_<name>.md`` filled in with ``values`` (records, :func:`_records`)."""
    return JINJA.get_template(f"readme_{name}.md").render(**values)


def setup_block() -> str:
    """The README's set-up times: ``make demo`` and ``make test`` on a fresh clone."""
    return _block("setup", **_records("setup", setup="setup"))


def speed_block() -> str:
    """The README's throughput lines: scoring and BLiMP against training, the statistics engine
    against numpy and a PyTorch peer, bf16 against float32 on the measuring backend."""
    return _block("speed", **_records("speed", scoring="bench_scoring", stats="bench_stats", train="bench_train",
                                      bf16="bench_bf16"))


def tuning_block() -> str:
    """Each start's tuned values and its dev figure at each budget of ``results/tuning.json``
    (or that it is not measured yet)."""
    return _block("tuning", tuning=_load("tuning"))


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
    script_main(main)
