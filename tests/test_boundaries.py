"""What the tests may reach: saffu alone. An experiment is a program; a test that needs one runs
it (``subprocess``), so the experiments can change shape without a test importing their insides."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_test_imports_an_experiment_or_edits_the_import_path():
    scripts = {p.stem for p in (ROOT / "experiments").glob("*.py")} | {"experiments"}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.name}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in scripts]
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"{path.name}:{node.lineno}: sys.path")
    assert not found, "tests reach into experiments/:\n" + "\n".join(found)
