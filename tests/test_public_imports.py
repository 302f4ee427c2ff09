"""Nothing outside the library and its tests imports a private module of mlemlib (``mlemlib._io``,
``mlemlib.backends._build``...): the workflow's scripts, the benchmark tools and the user's tools use its public
names, which keep their meaning when the private ones change."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def private_imports(path: Path) -> list[str]:
    """The modules of mlemlib that ``path`` imports whose dotted name has a part starting with "_"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "mlemlib" and any(p.startswith("_") and p != "__main__" for p in parts[1:]):
                found.append(name)
    return found


def test_private_imports_finds_them(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from mlemlib._io import atomic_path\nimport mlemlib.backends._build\nfrom mlemlib import norm\n"
                   "from mlemlib.backends import _build\n")
    assert private_imports(src) == ["mlemlib._io", "mlemlib._io.atomic_path", "mlemlib.backends._build",
                                    "mlemlib.backends._build"]


def test_scripts_and_tools_import_no_private_module():
    files = [p for d in ("scripts", "perf", "tools") for p in (REPO / d).rglob("*.py")]
    assert files
    offenders = {str(p.relative_to(REPO)): private_imports(p) for p in files if private_imports(p)}
    assert offenders == {}
