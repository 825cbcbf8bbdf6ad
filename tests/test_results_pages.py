"""The results pages (docs/results/*.md) are what experiments/render_results.py makes of the
results files (results/*.json): a figure typed by hand, or a page left behind by its file, fails."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import render_results  # noqa: E402


def test_every_results_page_is_generated_from_its_results_file():
    rendered = render_results.pages()
    assert rendered, "no results file under results/"
    for path, text in rendered.items():
        assert path.exists(), f"{path.relative_to(ROOT)} is missing: run python experiments/render_results.py"
        assert path.read_text() == text, (f"{path.relative_to(ROOT)} differs from its results file: "
                                          f"run python experiments/render_results.py")
    pages = set((ROOT / "docs" / "results").glob("*.md"))
    assert pages == set(rendered), f"pages without a results file: {sorted(map(str, pages - set(rendered)))}"


def test_every_results_file_says_where_its_figures_come_from():
    import json
    for path in (ROOT / "results").glob("*.json"):
        record = json.loads(path.read_text())
        for key in ("command", "date", "seeds", "machine", "load", "figures"):
            assert key in record, f"{path.name} lacks {key!r}"
