"""The results pages (docs/results/*.md) and the README's generated blocks are what
experiments/render_results.py makes of the results files (results/*.json): a figure typed by hand,
or a page left behind by its file, fails. So does a measured figure typed into the README or a
docs page (the figure check below)."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import render_results  # noqa: E402
from budgets import ARCHITECTURE_NAMES, CROSSFIT_FOLDS, architecture, cold_of  # noqa: E402


def _reported(row: dict) -> dict:
    """A sweep row as ``budgets.py --report`` writes it: with its architecture, its cold start and
    its folds (a cross-fitted residual's ``K``, else 0)."""
    return {**row, "architecture": architecture(row["start"]), "cold_start": cold_of(row["start"]),
            "architecture_name": ARCHITECTURE_NAMES[architecture(row["start"])],
            "folds": CROSSFIT_FOLDS.get(row["start"], 0)}


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
    for path in (ROOT / "results").glob("*.json"):
        record = json.loads(path.read_text())
        for key in ("command", "date", "seeds", "machine", "load", "figures"):
            assert key in record, f"{path.name} lacks {key!r}"


def test_the_readme_blocks_are_generated_from_the_results_files():
    text = render_results.README.read_text()
    names = re.findall(r"^<!-- generated: ([\w-]+) -->$", text, re.M)
    assert sorted(names) == sorted(render_results.README_BLOCKS), f"README.md's generated blocks: {names}"
    assert text.count("<!-- /generated -->") == len(names), "README.md: a generated block is not closed"
    assert render_results.render_readme(text) == text, (
        "README.md's generated blocks differ from the results files: run python experiments/render_results.py")


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


def test_the_headline_shows_the_sweeps_first_vocabulary_only(monkeypatch):
    row = lambda start, vocab, bpb: {"start": start, "width": 128, "epochs": 1, "seed": 0, "vocab_size": vocab,
                                     "dev_bpb": bpb, "finished": "2026-01-01T00:00:00"}
    budgets = {"date": "2026-01-01", "figures": {"rows": [row("cold", 8192, 1.9111), row("cold", 30433, 1.8222)]}}
    monkeypatch.setattr(render_results, "_load", lambda name: budgets if name == "budgets" else None)
    block = render_results.headline_block()
    assert "1.9111" in block and "1.8222" not in block


def test_the_budget_reading_tells_a_measured_shortfall_from_an_unknown_one():
    from budgets import multiplier_text

    def row(epochs, multiplier, how, start="explicit-init", bpb=1.8):
        return {"start": start, "width": 128, "epochs": epochs, "seed": 0, "vocab_size": 8192, "multiplier": multiplier,
                "multiplier_is": how, "multiplier_text": multiplier_text(multiplier, how), "train_loss": 4.0,
                "last_dev_window_loss": 4.1, "dev_bpb": bpb}
    reading = render_results._budget_reading([row(1, 3.5, "beyond"), row(2, 1.5, "interpolated"),
                                              row(4, 1.9964, "beyond"),
                                              # a better model of the budget whose lower bound is smaller: it is
                                              # the budget's best start (bounds do not rank); a worse one is not
                                              row(1, 3.1, "beyond", "residual", bpb=1.7),
                                              row(2, 9.0, "interpolated", "residual", bpb=1.9)])
    assert "1 epoch ≥ 3.10× (residual)" in reading and "2 epochs 1.50× (explicit-init)" in reading
    assert "4 epochs ≥ 1.99×" in reading                      # a lower bound is rounded down, never up
    assert "Below 2× at 2 epochs." in reading                 # measured on cold's curve
    assert "Not known yet at 4 epochs" in reading             # a lower bound under the bar says nothing yet


def test_the_budget_reading_says_when_cold_gets_worse_with_more_compute():
    cold = lambda epochs, bpb, train: {"start": "cold", "width": 128, "epochs": epochs, "seed": 0, "vocab_size": 8192,
                                       "dev_bpb": bpb, "train_loss": train, "last_dev_window_loss": train + 0.2}
    rows = [cold(1, 1.9, 4.6), cold(4, 1.8, 4.1), cold(8, 1.85, 4.15)]
    reading = render_results._budget_reading(rows + [{**cold(4, 1.75, 3.6), "start": "explicit-init", "multiplier": 1.9,
                                                      "multiplier_is": "beyond", "multiplier_text": "≥ 1.90×"}])
    assert "Cold is best at 4 epochs (1.8000)" in reading and "8 epochs 1.8500" in reading
    assert "would not tell" in reading
    monotone = render_results._budget_reading(rows[:2] + [{**cold(4, 1.75, 3.6), "start": "explicit-init",
                                                           "multiplier": 1.9, "multiplier_is": "beyond",
                                                           "multiplier_text": "≥ 1.90×"}])
    assert "Cold is best" not in monotone and "a longer cold run would tell" in monotone
    # worse on dev while the training loss fell: said as such, not as the optimisation
    fitted = render_results._budget_reading([cold(1, 1.9, 4.6), cold(2, 1.95, 4.5),
                                             {**cold(1, 1.8, 4.3), "start": "explicit-init", "multiplier": 1.5,
                                              "multiplier_is": "beyond", "multiplier_text": "≥ 1.50×"}])
    assert "Cold is best at 1 epoch (1.9000)" in fitted and "training loss fell (4.600 → 4.500)" in fitted
    assert "not overfitting" not in fitted


def test_the_seed_reading_sets_each_lead_against_the_seed_spread():
    def row(start, seed, bpb, multiplier=None):
        r = {"start": start, "width": 128, "epochs": 4, "seed": seed, "vocab_size": 8192, "dev_bpb": bpb}
        return {**r, "multiplier": 2.5, "multiplier_is": "beyond", "multiplier_text": multiplier} if multiplier else r
    rows = [row("cold", 0, 1.82), row("cold", 1, 1.83), row("explicit-init", 0, 1.76, "≥ 1.99×"),
            row("explicit-init", 1, 1.84, "≤ 0.90×"), row("residual", 0, 1.78, "≥ 2.10×")]
    reading = render_results._seed_reading(rows)
    assert "4 epochs, seeds 0 / 1: cold 1.8200 / 1.8300 (spread 0.0100)" in reading
    assert "explicit-init 1.7600 / 1.8400 (spread 0.0800)" in reading
    # the lead is paired by seed, and a seed behind cold is said
    assert "explicit-init's lead over cold of the same seed: 0.0600 / -0.0100 bits/byte, not every seed ahead" in reading
    assert "its multiplier per seed ≥ 1.99× / ≤ 0.90×" in reading
    assert "residual 1.78" not in reading                     # one seed only: nothing to compare
    assert render_results._seed_reading(rows[::2]) == ""       # no budget with two seeds of one start


def test_the_readme_lasts_block_lists_the_other_seeds_under_the_table(monkeypatch):
    def row(start, epochs, seed, bpb):
        r = _reported({"start": start, "width": 128, "epochs": epochs, "seed": seed, "vocab_size": 8192,
                       "dev_bpb": bpb, "train_seconds": 600.0, "solve_seconds": 0.0})
        return r if start == "cold" else {**r, "multiplier": 2.0, "multiplier_is": "beyond", "multiplier_text": "≥ 2.00×"}
    rows = [row("cold", 4, 0, 1.8211), row("explicit-init", 4, 0, 1.7511),
            row("cold", 4, 1, 1.8322), row("explicit-init", 4, 1, 1.7622)]
    monkeypatch.setattr(render_results, "_load", lambda name: {"figures": {"rows": rows}} if name == "budgets" else None)
    block = render_results.lasts_block()
    assert "| 4 | 1.8211 | explicit init | 1.7511 |" in block            # the table is seed 0's
    assert "Seed 1 at 4 epochs: cold 1.8322, explicit init 1.7622 (compute multiplier ≥ 2.00×)." in block


def test_another_architecture_is_read_on_its_own_and_kept_out_of_the_transformers_readings(monkeypatch):
    def row(start, epochs, bpb, multiplier=None, share=None):
        r = _reported({"start": start, "width": 128, "epochs": epochs, "seed": 0, "vocab_size": 8192, "dev_bpb": bpb,
                       "train_loss": 4.0, "last_dev_window_loss": 4.1, "train_seconds": 600.0, "solve_seconds": 0.0})
        if multiplier:
            r.update(multiplier=2.5, multiplier_is="beyond", multiplier_text=multiplier, share_of_steps_to_cold=share)
        return r
    rows = [row("cold", 1, 1.9211), row("explicit-init", 1, 1.8011, "≥ 7.90×", 0.2),
            row("llama-random", 1, 1.9611), row("llama-explicit", 1, 1.7111, "≥ 9.50×", 0.15),
            row("llama-random", 2, 1.8811)]
    other = render_results._other_architecture(rows)
    assert ("1 epoch, seed 0: llama-random 1.9611, llama-explicit 1.7111 (lead 0.2500 bits/byte); "
            "compute multiplier ≥ 9.50×; 15.0% of its steps") in other
    assert "2 epochs, seed 0: llama-random 1.8811 (its explicit start not run yet)." in other
    assert "explicit-init" not in other and render_results._other_architecture(rows[:2]) == ""
    best = render_results._best_model(rows)
    assert "Best model of the sweep: llama-explicit, 1 epoch, width 128, V 8,192: 1.7111 bits/byte, at or below" in best
    assert "the project's transformer's best is explicit-init, 1 epoch, width 128, V 8,192: 1.8011" in best
    assert "That is penzai's Llama-like transformer" in best
    page = render_results.budgets({**render_results._load("budgets"),
                                   "figures": {"rows": rows, "table": "", "plot": "budgets.png"}})
    assert "Rows `llama-explicit` / `llama-random`: penzai's Llama-like transformer of" in page
    # the transformer's own readings and the README's table leave the other architecture out
    assert "llama" not in render_results._budget_reading(render_results._ours(rows))
    monkeypatch.setattr(render_results, "_load", lambda name: {"figures": {"rows": rows}} if name == "budgets" else None)
    block = render_results.lasts_block()
    assert "| 1 | 1.9211 | explicit init | 1.8011 |" in block and "llama" not in block


def test_the_cross_fitting_reading_sets_each_number_of_folds_against_the_plain_residual():
    def row(start, bpb, train, dev):
        return _reported({"start": start, "width": 128, "epochs": 1, "seed": 0, "vocab_size": 8192, "dev_bpb": bpb,
                          "train_loss": train, "last_dev_window_loss": dev})
    rows = [row("residual", 1.7905, 2.0, 4.4), row("residual-crossfit-k4", 1.7850, 4.3, 4.35),
            row("residual-crossfit", 1.7882, 4.5, 4.4), row("explicit-init", 1.8031, 4.2, 4.3)]
    reading = render_results._crossfit_gaps(rows)
    two, four = [line for line in reading.splitlines() if line.startswith("* ")]
    assert two.startswith("* V 8,192, width 128, 1 epoch, seed 0, K = 2 folds: train–dev gap 2.400 nats (plain "
                          "residual) against -0.100 (cross-fitted), 104% of it closed; dev 1.7905 against 1.7882")
    assert "K = 4 folds: train–dev gap 2.400 nats (plain residual) against 0.050 (cross-fitted), 98% of it" in four
    assert render_results._crossfit_gaps(rows[1:]) == ""            # no plain residual at that budget


def test_the_cross_fitting_reading_sets_its_best_number_of_folds_against_the_target():
    def row(start, bpb, epochs=1, width=128):
        return _reported({"start": start, "width": width, "epochs": epochs, "seed": 0, "vocab_size": 8192,
                          "dev_bpb": bpb, "train_loss": 4.3, "last_dev_window_loss": 4.3})
    rows = [row("residual", 1.7905), row("residual-crossfit", 1.7882), row("residual-crossfit-k4", 1.7901),
            row("residual-crossfit-k8", 1.7897), row("residual-crossfit", 1.7805, epochs=4),
            row("residual-crossfit", 1.7700, width=256)]                  # another width: not the target's
    last = render_results._crossfit_gaps(rows).strip().splitlines()[-1]
    assert last == ("The cross-fitted residual at 1 epoch, width 128, V 8,192: best with K = 2 folds, 1.7882 "
                    "bits/byte, above the target of 1.78; K = 4 1.7901, K = 8 1.7897: more folds (more of the split "
                    "in each fold's exact model) did not lower it. Its best at any budget: 4 epochs, K = 2, "
                    "1.7805 bits/byte.")
    rows[2] = row("residual-crossfit-k4", 1.7790)
    last = render_results._crossfit_gaps(rows[:4]).strip().splitlines()[-1]
    assert last == ("The cross-fitted residual at 1 epoch, width 128, V 8,192: best with K = 4 folds, 1.7790 "
                    "bits/byte, at or below the target of 1.78; K = 2 1.7882, K = 8 1.7897: K = 4 did better than "
                    "2 folds.")


def test_the_readme_lasts_block_says_at_which_budget_the_multiplier_falls_under_2x_and_why(monkeypatch):
    def row(start, epochs, bpb, train, multiplier=None):
        r = _reported({"start": start, "width": 128, "epochs": epochs, "seed": 0, "vocab_size": 8192, "dev_bpb": bpb,
                       "train_loss": train, "last_dev_window_loss": train + 0.2, "train_seconds": 600.0,
                       "solve_seconds": 0.0})
        return r if multiplier is None else {**r, "multiplier": multiplier, "multiplier_is": "beyond",
                                             "multiplier_text": f"≥ {multiplier:.2f}×"}
    rows = [row("cold", 1, 1.92, 4.7), row("explicit-init", 1, 1.80, 4.3, 7.9),
            row("cold", 4, 1.82, 4.10), row("explicit-init", 4, 1.75, 3.6, 1.99), row("cold", 8, 1.86, 4.15)]
    monkeypatch.setattr(render_results, "_load", lambda name: {"figures": {"rows": rows}} if name == "budgets" else None)
    block = render_results.lasts_block()
    assert "Not known yet at 4 epochs: only a lower bound under 2×" in block
    assert "Cold is best at 4 epochs (1.8200) and worse with more compute at its learning rate (8 epochs 1.8600)" in block
    rows[3]["multiplier"] = 2.5                                          # every budget at or above the bar: no reading
    assert "Not known yet" not in render_results.lasts_block() and "Cold is best" not in render_results.lasts_block()
