"""Set-up times: the README's two commands, ``make demo`` and ``make test``, on a fresh clone.

Clones the checkout's HEAD (``git clone``) into a temporary folder beside the checkout, so that
``../shared`` (the data) resolves exactly as it does for the checkout, runs ``make demo`` and then
``make test`` there, each timed from start to exit (wall seconds), with whether it passed and,
for the tests, pytest's summary line (``274 passed, 1 skipped``). The clone has no ``.venv``, so
each time includes creating it and installing, as a newcomer's first run does. The load averages
are read before ``make demo`` and after ``make test``. Writes ``results/setup.json``
(:func:`saffu.runner.write_result`: figures ``demo_seconds``, ``test_seconds``, ``test_summary``,
``demo_ok``, ``test_ok``, ``revision``, and what the demo wrote to ``runs/demo/metrics.json``),
then refreshes the results pages and the README's generated blocks
(``experiments/render_results.py``). Uncommitted changes of the checkout are not in the clone.

    python experiments/setup_times.py            # results/setup.json, docs/results/setup.md, README
    python experiments/setup_times.py --keep     # keep the clone afterwards (its path is printed)
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from saffu.eval.bench import Watch
from saffu.flags import script_main, script_options
from saffu.runner import write_result

ROOT = Path(__file__).resolve().parents[1]
COUNTS = ("failed", "passed", "skipped", "xfailed", "xpassed", "error", "errors")


def say(message: str) -> None:
    print(f"[setup_times] {message}", flush=True)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


def clean_environment(clone: Path) -> dict:
    """The environment of a newcomer's shell: no active virtual environment (neither the
    checkout's nor any other) and no PYTHONPATH, so ``make`` builds the clone's own ``.venv``;
    the tests' JAX compilation cache an empty folder in the clone (a newcomer's machine has
    none warm from earlier runs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(clone / ".jax-cache")
    venv = os.environ.get("VIRTUAL_ENV")
    keep = [p for p in env.get("PATH", "").split(os.pathsep)
            if p and not (venv and p.startswith(venv)) and not p.startswith(str(ROOT))]
    env["PATH"] = os.pathsep.join(keep)
    return env


def run_step(target: str, clone: Path, env: dict) -> tuple[float, bool, list[str]]:
    """``make TARGET`` in ``clone``: its wall seconds, whether it exited 0, and its last lines
    of output (echoed as they come)."""
    say(f"make {target} in {clone} ...")
    tail = collections.deque(maxlen=400)
    start = time.perf_counter()
    with subprocess.Popen(["make", target], cwd=clone, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1) as process:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        returncode = process.wait()
    seconds = time.perf_counter() - start
    say(f"make {target}: {seconds:.1f} s, exit status {returncode}")
    return seconds, returncode == 0, list(tail)


def test_summary(lines: list[str]) -> str:
    """pytest's closing counts without the timing, e.g. ``274 passed, 1 skipped`` from
    ``274 passed, 1 skipped, 9 deselected in 312.5s (0:05:12)``; deselected and warning counts
    are left out. Empty when no summary line was printed."""
    for line in reversed(lines):
        line = line.strip().strip("=").strip()
        match = re.fullmatch(r"((?:\d+ \w+)(?:, \d+ \w+)*) in [\d.]+s.*", line)
        if match:
            parts = [part for part in match[1].split(", ") if part.split(" ", 1)[1] in COUNTS]
            return ", ".join(parts)
    return ""


@dataclasses.dataclass
class Options:
    """What is kept and refreshed afterwards.

    Attributes:
      keep: keep the clone (default: removed at the end)
      render: refresh the results pages and the README's generated blocks (--no-render: write
        results/setup.json only; run experiments/render_results.py yourself)
    """

    keep: bool = False
    render: bool = True


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    revision = git("rev-parse", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        say("the checkout has uncommitted changes: the clone measures HEAD without them")
    clone = Path(tempfile.mkdtemp(prefix="saffu-setup-times-", dir=ROOT.parent))
    try:
        say(f"cloning {ROOT} at {revision[:7]} into {clone} (../shared resolves to {clone.parent / 'shared'})")
        git("clone", "--quiet", str(ROOT), str(clone), cwd=ROOT.parent)
        git("checkout", "--quiet", "--detach", revision, cwd=clone)
        env = clean_environment(clone)
        started = datetime.datetime.now(datetime.UTC)
        watch = Watch()             # the load averages before make demo and after make test
        demo_seconds, demo_ok, _ = run_step("demo", clone, env)
        test_seconds, test_ok, test_lines = run_step("test", clone, env)
        metrics_path = clone / "runs" / "demo" / "metrics.json"
        demo_metrics = json.loads(metrics_path.read_text()) if demo_ok and metrics_path.exists() else {}
        figures = {"demo_seconds": demo_seconds, "test_seconds": test_seconds, "test_summary": test_summary(test_lines),
                   "demo_ok": demo_ok, "test_ok": test_ok, "revision": revision[:7], "demo_metrics": demo_metrics}
        path = write_result(ROOT / "results", "setup", figures, seeds=[0], load=watch.load(),   # the demo's default seed
                            started=started)
        say(f"wrote {path.relative_to(ROOT)}: make demo {demo_seconds:.1f} s ({'ok' if demo_ok else 'FAILED'}), "
            f"make test {test_seconds:.1f} s ({figures['test_summary'] or 'no summary'}, "
            f"{'ok' if test_ok else 'FAILED'})")
    finally:
        if args.keep:
            say(f"kept the clone: {clone}")
        else:
            shutil.rmtree(clone, ignore_errors=True)
    if args.render:
        import render_results
        say("refreshing the results pages and the README's generated blocks")
        render_results.main([])
    else:
        say("now run: python experiments/render_results.py")
    return 0 if demo_ok and test_ok else 1


if __name__ == "__main__":
    script_main(main)
