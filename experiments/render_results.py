"""Results pages generated from the results files: ``results/<name>.json`` (written by the
experiments, :mod:`results`) -> ``docs/results/<name>.md``. No figure on a page is typed by hand;
``tests/test_results_pages.py`` regenerates every page and fails on any difference.

    python experiments/render_results.py            # rewrite every page
    python experiments/render_results.py --check    # exit 1 if a page differs from its file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, PAGES = ROOT / "results", ROOT / "docs" / "results"


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


def soak(record: dict) -> str:
    f = record["figures"]
    return f"""# Soak: resident memory and metrics over a long run and many resumes

Generated from [`results/soak.json`](../../results/soak.json) by `experiments/render_results.py`.

{provenance(record)}

Model: {f['model']}; corpus: {f['corpus']} ({f['train_tokens']:,} training tokens).

| run | length | resident memory (MB): first / last / max | growth over the second half | consistent |
|---|---|---|---|---|
| one run | {f['long_epochs']} epochs, {f['long_steps']:,} steps, {f['long_evaluations']} evaluations ({f['long_seconds']:.0f} s) | {f['long_rss_first_mb']:.0f} / {f['long_rss_last_mb']:.0f} / {f['long_rss_max_mb']:.0f} | {f['long_rss_second_half_growth_mb']:+.1f} MB ({f['long_rss_second_half_slope_mb_per_eval']:+.2f} MB per evaluation) | metrics file: {'yes' if f['long_metrics_consistent'] else 'NO'} |
| stopped after each checkpoint, resumed in the same process | {f['resumes']} resumes of {f['resume_steps'] // f['resumes']} steps | {f['resume_rss_first_mb']:.0f} / {f['resume_rss_last_mb']:.0f} / {f['resume_rss_max_mb']:.0f} | {f['resume_rss_second_half_growth_mb']:+.1f} MB ({f['resume_rss_second_half_slope_mb_per_resume']:+.2f} MB per resume) | metrics file: {'yes' if f['resumed_metrics_consistent'] else 'NO'}; final parameters equal to an uninterrupted run's: {'yes' if f['resumed_equals_uninterrupted'] else 'NO'} |

The first half of each run holds the compilations and first allocations; the growth over the
second half is what a longer run would keep adding. An in-process resume compiles its training
step again (each call builds its own jitted step), which is what the per-resume growth measures.
"""


def budgets(record: dict) -> str:
    f = record["figures"]
    return f"""# Budget sweep: does the explicit start last?

Generated from [`results/budgets.json`](../../results/budgets.json) by `experiments/render_results.py`.

{provenance(record)}

Transformer (5 layers) on babylm-2023-4src (BPE 8,192), each budget its own run with its own
warm-up and cosine schedule; whole-dev bits per byte. Compute = training FLOPs + the solve's
seconds at the run's own FLOPs per second. Multiplier = the compute a cold start of the same
width needs to reach the run's dev loss (interpolated in log compute over the cold runs) over
the run's compute; `≥`: cold never got there within the sweep (cold's largest compute over the
run's), `≤`: the run is worse than cold's smallest budget. Train loss: the mean over the steps
since the run's last periodic evaluation (a cross-fitted residual's on its folds' tables); dev
windows: that evaluation's loss on 128 evenly spaced dev windows — the train–dev gap is their
difference.

{f['table']}

![dev loss against compute]({Path(f['plot']).name})
"""


def any_model(record: dict) -> str:
    f = record["figures"]
    return f"""# Explicit init of models nobody here wrote

Generated from [`results/any_model.json`](../../results/any_model.json) by `experiments/render_results.py`.

{provenance(record)}

penzai's Llama-like transformer (`llama`: RMSNorm, RoPE, SwiGLU, untied) and GPT-NeoX (`neox`:
LayerNorm, parallel attention and MLP, partial RoPE, untied), width 128, 5 blocks, 4 heads, on
babylm-2023-4src (BPE 8,192), built by penzai and initialised through `saffu.interop.explicit_init`
only; neither has an output bias. Both inits train with the project's trainer (same windows and
data order, AdamW at lr 0.01 on warm-up + cosine); explicit init sets the embeddings (at RMS 1.0)
and the output kernel (at its random RMS) from the explicit pieces of rank 128. One epoch,
scored on the whole dev split; steps to random's final loss are read on the periodic dev windows.

{f['table']}

## 30 steps: the variants

The same trainer for 30 steps (lr 0.01, warm-up 15 steps), scored on 20,000 dev tokens of whole
documents. `llama-tied`: penzai's Llama-like with one matrix for the embeddings and the output
(penzai scales it by √d on the way in): `explicit` sets it to the mean of `E₀` and `Bᵀ` at equal
RMS (`tied_matrix(..., "mean")`) at the random matrix's own RMS, `explicit-tied-embedding` to
`E₀`, `explicit-tied-output` to `Bᵀ`, `explicit-rms1` the mean at RMS 1.0 (which makes the
step-0 logits huge). `saffu-nobias`: saffu's own transformer without an output bias (the layout
`saffu export` writes) through the same public API: `explicit` with the embeddings at RMS 1.0,
`explicit-rms0` at the random embeddings' own RMS.

{f['short_table']}
"""


RENDERERS = {"soak": soak, "budgets": budgets, "any_model": any_model}


def pages() -> dict[Path, str]:
    """Every page, rendered from the results files present."""
    out = {}
    for name, render in RENDERERS.items():
        path = RESULTS / f"{name}.json"
        if path.exists():
            out[PAGES / f"{name}.md"] = render(json.loads(path.read_text()))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
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
