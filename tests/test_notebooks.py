"""The notebooks run top to bottom (so they cannot rot): executed with nbclient in a fresh kernel.

Their stored outputs are what a reader sees on GitHub, so they must not leak a machine's paths,
and running them must leave nothing behind (scratch data goes in a temporary folder that the
notebook removes itself).
"""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: an absolute path of some machine: Linux/macOS home, temp and work folders, or a Windows drive
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users|mnt|opt|srv|private|var/folders)/"
                           r"|(?<![\w])[A-Za-z]:\\[\w.-]")
#: caches and environments that running Python (or pytest) may create, not files a notebook left
UNTRACKED_NOISE = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}


def output_texts(notebook):
    """Every piece of text in the code cells' outputs (streams, text data, errors), no images."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            pieces = []
            if "text" in output:
                pieces.append(output["text"])
            for mime, value in output.get("data", {}).items():
                if mime.startswith("text/") or mime.endswith("json"):
                    pieces.append(value if isinstance(value, str) else repr(value))
            if output.get("output_type") == "error":
                pieces += [output.get("ename", ""), output.get("evalue", ""), *output.get("traceback", [])]
            for piece in pieces:
                yield index, "".join(piece) if isinstance(piece, list) else str(piece)


def leaked_paths(notebook) -> list[str]:
    return [f"cell {index}: …{text[max(m.start() - 40, 0):m.end() + 40]}…"
            for index, text in output_texts(notebook) for m in ABSOLUTE_PATH.finditer(text)]


def repo_listing() -> set[str]:
    """Files and folders of the repository, less caches and environments."""
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in UNTRACKED_NOISE and not d.endswith(".egg-info")]
        relative = Path(folder).relative_to(ROOT)
        found.update(str(relative / name) for name in dirs + files)
    return found


def test_the_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"cold_vs_warm.ipynb", "explicit_weights.ipynb"}


def test_the_path_pattern():
    assert ABSOLUTE_PATH.search("see /work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21")
    assert ABSOLUTE_PATH.search("written to /tmp/saffu-cold-warm-x1y2/data")
    assert ABSOLUTE_PATH.search(r"C:\Users\someone\saffu")
    assert not ABSOLUTE_PATH.search("dev 0.8512 bits/byte, 3e-3 steps/s, data/default_corpus, ·the -> ·river")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_leak_no_paths(path):
    notebook = nbformat.read(path, as_version=4)
    assert any(cell.get("outputs") for cell in notebook.cells), f"{path.name} is stored without its outputs"
    assert not leaked_paths(notebook), f"{path.name}: stored outputs show machine paths"


@pytest.mark.slow   # minutes each: `make test-slow` (CI runs it)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    # the kernel is a new process: give it one plain CPU device, not the tests' forced four,
    # and a temporary folder of its own, so anything it leaves there is seen
    monkeypatch.setenv("XLA_FLAGS", "")
    kernel_tmp = tmp_path / "kernel-tmp"
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    before = repo_listing()
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    images = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "every notebook draws its figures"
    assert not leaked_paths(notebook), "fresh outputs show machine paths"
    assert sorted(repo_listing() - before) == [], "running the notebook left files in the repository"
    assert sorted(p.name for p in kernel_tmp.iterdir()) == [], "running the notebook left temporary files"
