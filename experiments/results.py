"""Results files: an experiment's figures in a small JSON under ``results/`` (committed), each
with what it takes to trust and reproduce them: the command, the date, the seeds, the machine
and the load it ran under.

    from results import write_result        # a script's own folder is on its import path
    write_result("soak", figures, seeds=[0])
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from saffu._io import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def machine() -> dict:
    """Where the figures were measured: processor, cores, memory, JAX backend and revision."""
    import jax
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "memory_gb": round(memory / 2**30, 1),
            "jax_backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "revision": revision + ("+changes" if dirty else "")}


def write_result(name: str, figures: dict, seeds: list[int], load: dict | None = None,
                 started: datetime.datetime | None = None) -> Path:
    """Write ``results/<name>.json``: ``figures`` and the command (as typed, from the project
    root), the date, ``seeds``, :func:`machine` and ``load`` (e.g. the load averages seen
    before and after the run; the 1-minute load average now by default)."""
    now = datetime.datetime.now(datetime.UTC)
    record = {"command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
              "date": (started or now).strftime("%Y-%m-%d"),
              "started": (started or now).isoformat(timespec="seconds"),
              "finished": now.isoformat(timespec="seconds"),
              "seeds": seeds, "machine": machine(),
              "load": load or {"load_average_1min": os.getloadavg()[0]}, "figures": figures}
    path = RESULTS / f"{name}.json"
    atomic_write_json(path, record)
    return path
