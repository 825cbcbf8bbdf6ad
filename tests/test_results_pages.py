"""The results pages (docs/results/*.md) and the README's generated blocks are what
experiments/render_results.py makes of the results files (results/*.json): a figure typed by hand,
or a page left behind by its file, fails. So does a measured figure typed into the README or a
docs page (the figure check below)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RENDERER = ROOT / "experiments" / "render_results.py"


def test_every_results_page_and_readme_block_is_generated_from_its_results_file():
    """``render_results.py --check`` renders every page and README block again and exits 1 on a
    difference (run as a program: tests import only saffu)."""
    done = subprocess.run([sys.executable, str(RENDERER), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr + "\nrun python experiments/render_results.py"
    results = {p.stem for p in (ROOT / "results").glob("*.json")}
    pages = {p.stem for p in (ROOT / "docs" / "results").glob("*.md")}
    assert pages <= results, f"pages without a results file: {sorted(pages - results)}"
    readings = {p.stem for p in (ROOT / "docs" / "readings").glob("*.md")}
    assert readings <= pages, f"readings of no page: {sorted(readings - pages)}"


def test_the_check_fails_on_a_page_that_differs(tmp_path):
    """The check above can fail: a copy of the project whose page was edited by hand is refused."""
    page = next((ROOT / "docs" / "results").glob("*.md"))
    for folder in ("experiments", "results", "docs"):
        subprocess.run(["cp", "-r", str(ROOT / folder), str(tmp_path / folder)], check=True)
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    edited = tmp_path / "docs" / "results" / page.name
    edited.write_text(edited.read_text() + "\ntyped by hand\n")
    done = subprocess.run([sys.executable, str(tmp_path / "experiments" / "render_results.py"), "--check"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1 and f"docs/results/{page.name}" in done.stdout


def test_every_results_file_says_where_its_figures_come_from():
    for path in (ROOT / "results").glob("*.json"):
        record = json.loads(path.read_text())
        for key in ("command", "date", "seeds", "machine", "load", "figures"):
            assert key in record, f"{path.name} lacks {key!r}"


def test_every_generated_block_of_the_readme_is_closed():
    text = (ROOT / "README.md").read_text()
    names = re.findall(r"^<!-- generated: ([\w-]+) -->$", text, re.M)
    assert names and text.count("<!-- /generated -->") == len(names), "README.md: a generated block is not closed"


# --- the figure check -------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)+(?![\w])")
UNIT = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:×|[ \u00a0]?%|[ \u00a0](?:s|seconds|min|minutes|tokens/s|bits/byte|"
                  r"GB|MB|nats|passed)(?![\w/]))")


def documentation() -> list[Path]:
    """README.md and every docs page but the generated results pages."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if (ROOT / "docs" / "results") not in p.parents)
    return [ROOT / "README.md", *pages]


def prose(text: str):
    """``(line number, line)`` of every line outside fenced code blocks and generated blocks,
    with inline code spans blanked out."""
    fenced = generated = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if line.startswith("<!-- generated:"):
            generated = True
        if fenced or generated:
            generated = generated and not line.startswith("<!-- /generated")
            continue
        yield number, CODE_SPAN.sub(" ", line)


def measured_figures(path: Path) -> list[str]:
    """``file:line: text`` of every line of ``path`` with a measured figure in its prose."""
    named = " ".join(p.read_text() for p in (ROOT / "results").glob("*.json"))
    text = path.read_text()
    lines, found = text.splitlines(), []
    for number, line in prose(text):
        bad = False
        for target in IMAGE.findall(line):
            image = (path.parent / target).resolve()
            if (ROOT / "docs" / "figures") in image.parents and image.name not in named:
                bad = True                      # a plot that no results file names
        words = LINK_TARGET.sub("]", line)
        decimals = [n for n in NUMBER.findall(words) if n.count(".") == 1]   # x.y.z is a version
        if bad or decimals or UNIT.search(words):
            found.append(f"{path.relative_to(ROOT)}:{number}: {lines[number - 1].strip()}")
    return found


def test_no_measured_figure_is_typed_into_the_readme_or_the_docs():
    """Every measured figure in README.md and docs/ comes from a results file (results/*.json)
    through experiments/render_results.py: the results pages (docs/results/*.md) and the README's
    generated blocks. Anywhere else in README.md and docs/**/*.md — outside fenced code blocks,
    inline code spans and generated blocks — a line fails when it holds

    * a decimal number (``1.8031``, ``0.36``), unless it is a version string (``x.y.z``) or part
      of a link target;
    * a number directly followed by ``×`` or ``%``, or by `` s``, `` seconds``, `` min``,
      `` minutes``, `` tokens/s``, `` bits/byte``, `` GB``, `` MB``, `` nats`` or `` passed``;
    * an image link to ``docs/figures/*.png`` that no results file names.

    Configuration values are not measurements: write them as code (``--learning-rate 0.003``).
    Figures measured before results files existed are in git history (README.md at 08ca574)."""
    found = [line for path in documentation() for line in measured_figures(path)]
    assert not found, "measured figures typed by hand (generate them from a results file):\n" + "\n".join(found)


def test_the_figure_check_catches_what_it_says():
    lines = dict(prose("dev 1.8031 bits/byte\n`lr 0.003` in code\nversion 0.10.2\n4 × 256 tokens\n"
                       "```\n1.5 s in a block\n```\nends 3.97× ahead\n12 passed\n"
                       "<!-- generated: x -->\n1.25\n<!-- /generated -->\n45 s solve\n3 seeds\n"))
    assert sorted(lines) == [1, 2, 3, 4, 8, 9, 13, 14]
    flagged = {n for n, line in lines.items()
               if [d for d in NUMBER.findall(LINK_TARGET.sub("]", line)) if d.count(".") == 1] or UNIT.search(line)}
    assert flagged == {1, 8, 9, 13}


def test_every_link_into_the_repository_points_to_a_file():
    missing = []
    for path in documentation():
        for number, line in prose(path.read_text()):
            for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                resolved = (path.parent / target).resolve()
                if ROOT in resolved.parents and not resolved.exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)
