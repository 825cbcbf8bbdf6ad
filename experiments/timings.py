"""Wall-clock times of what a newcomer runs, measured on this machine, with the load it ran under.

Each step is a real command in its own process (what a user types), timed from start to exit;
the 1-minute load average is read before and after each, so a figure taken on a busy machine
says so. Its ``timings.md`` is the table of those times.

    python experiments/timings.py --corpus ../shared/data/babylm/2023 --blimp ../shared/data/blimp \\
        --out runs/timings [--with-tests]

Steps: ``saffu --help``; ``saffu demo`` on the embedded corpus (twice: a rerun must train
again); ``saffu prepare`` of the corpus; ``saffu stats`` (unigram, explicit bigram);
``saffu fit`` with its default bounded evaluation; ``saffu eval`` of the whole dev split;
``saffu blimp``; ``saffu ngram --order 5``; and with ``--with-tests`` the
``make test`` (and ``make test-slow``). Outputs in ``--out``: ``timings.json`` (per step
``seconds``, ``load_before``, ``load_after``, ``command``, and the step's own metrics where it
writes any) and ``timings.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from saffu._io import atomic_write_bytes, atomic_write_json, write_metrics

ROOT = Path(__file__).resolve().parent.parent


def timed(name: str, argv: list[str], out: Path, results: dict, metrics_json: Path | None = None) -> dict:
    """Run ``argv`` (output to ``out/<name>.log``), record its wall seconds and the load around it."""
    load_before = os.getloadavg()[0]
    log = out / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"`{shlex.join(argv)}` failed (exit {done.returncode}); see {log}")
    record = {"command": shlex.join(argv), "seconds": seconds, "load_before": load_before,
              "load_after": os.getloadavg()[0]}
    if metrics_json is not None and metrics_json.exists():
        record["metrics"] = json.loads(metrics_json.read_text())
    results[name] = record
    print(f"{name:>16}: {seconds:8.1f} s   load {record['load_before']:.1f} -> {record['load_after']:.1f}",
          flush=True)
    return record


def saffu(*args) -> list[str]:
    return [sys.executable, "-m", "saffu", *map(str, args)]


def table(results: dict) -> str:
    """The timings table: step, wall time, load, command."""
    rows = ["| step | wall time | load (1-min avg, before → after) | command |", "|---|---:|---:|---|"]
    for name, r in results.items():
        seconds = r["seconds"]
        shown = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
        command = r["command"].replace(sys.executable + " -m saffu", "saffu").replace(str(ROOT) + "/", "")
        rows.append(f"| {name} | {shown} | {r['load_before']:.1f} → {r['load_after']:.1f} | `{command}` |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="BabyLM-layout corpus folder")
    parser.add_argument("--blimp", type=Path, help="BLiMP folder (skips the BLiMP step when absent)")
    parser.add_argument("--out", type=Path, default=Path("runs/timings"), help="output folder")
    parser.add_argument("--with-tests", action="store_true", help="also time `make test` and `make test-slow`")
    parser.add_argument("--metrics-json", type=Path, help="flat JSON of the step seconds")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work, run = out / "babylm", out / "explicit"
    results: dict = {}

    results["help"] = min((timed("help", saffu("--help"), out, {}) for _ in range(3)), key=lambda r: r["seconds"])
    for name in ("demo", "demo (rerun)"):
        timed(name, saffu("demo", "--workdir", out / "demo", "--metrics-json", out / "demo.json"), out, results,
              out / "demo.json")
    timed("prepare", saffu("prepare", "--corpus", args.corpus, "--corpus-name", "babylm-2023-4src",
                           "--workdir", work, "--vocab-size", 8192), out, results)
    timed("unigram", saffu("stats", "--workdir", work, "--model", "unigram"), out, results)
    timed("bigram", saffu("stats", "--workdir", work, "--model", "bigram", "--metrics-json", out / "bigram.json"),
          out, results, out / "bigram.json")
    timed("fit", saffu("fit", "--workdir", work, "--run", run, "--metrics-json", out / "fit.json"), out, results,
          out / "fit.json")
    timed("eval (all dev)", saffu("eval", "--workdir", work, "--run", run, "--eval-tokens", 0,
                                  "--metrics-json", out / "eval.json"), out, results, out / "eval.json")
    if args.blimp:
        timed("blimp", saffu("blimp", "--workdir", work, "--run", run, "--blimp", args.blimp,
                             "--metrics-json", out / "blimp.json"), out, results, out / "blimp.json")
    timed("ngram 5", saffu("ngram", "--workdir", work, "--order", 5), out, results)
    if args.with_tests:
        timed("make test", ["make", "test"], out, results)
        timed("make test-slow", ["make", "test-slow"], out, results)

    atomic_write_json(out / "timings.json", results)
    atomic_write_bytes(out / "timings.md", table(results).encode())
    print(table(results))
    write_metrics(args.metrics_json, {f"{name}_seconds": r["seconds"] for name, r in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
