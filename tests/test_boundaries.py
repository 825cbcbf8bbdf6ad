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


def _names_kind(node: ast.AST) -> bool:
    """Whether ``node`` reads a ``kind``: ``kind``, ``x.kind``, ``getattr(x, "kind", …)``."""
    return ((isinstance(node, ast.Name) and node.id == "kind") or (isinstance(node, ast.Attribute) and node.attr == "kind")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "kind"))


def _strings(node: ast.AST) -> bool:
    """Whether ``node`` is a string literal, or a tuple, list or set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return bool(items) and all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in items)


def test_models_dispatch_through_the_registry_not_on_kind_strings():
    """Outside the registry (saffu/models/interface.py, saffu/models/kinds.py), code asks a
    config's :class:`~saffu.models.kinds.ModelKind` what the model does (or its class), and never
    compares a ``kind`` (``config.kind == "transformer"``, ``kind in (...)``)."""
    registry = {ROOT / "saffu/models/interface.py", ROOT / "saffu/models/kinds.py"}
    found = []
    for path in sorted((ROOT / "saffu").rglob("*.py")):
        if path in registry:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Compare) and any(map(_names_kind, [node.left, *node.comparators]))
                    and any(map(_strings, [node.left, *node.comparators]))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "kind compared outside the registry:\n" + "\n".join(found)


def test_experiments_parse_no_command_line_themselves():
    """An experiment declares its options as a dataclass, which :func:`saffu.flags.script_options`
    parses; no script imports argparse or edits the import path."""
    found = []
    for path in sorted((ROOT / "experiments").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno}: import {n}" for n in names if n.split(".")[0] == "argparse"]
        found += [f"{path.name}: sys.path" for _ in [0] if "sys.path" in text]
    assert not found, "experiments that parse their own command line:\n" + "\n".join(found)
