"""The wings' dependency arrows (DESIGN.md "Layout"): checked on every module's imports, lazy ones included."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardsync"

# wing -> wings (and outside packages) it must never import
FORBIDDEN = {
    "plan": ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.tools", "shardsync.zoo",
             "shardsync.cli", "torch.distributed"),
    "transport": ("shardsync.plan", "shardsync.engine", "shardsync.integrations", "shardsync.tools", "shardsync.zoo",
                  "shardsync.cli"),
    "engine": ("shardsync.integrations", "shardsync.tools", "shardsync.zoo", "shardsync.cli", "vllm", "ray"),
    "sources": ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.tools", "shardsync.zoo",
                "shardsync.cli", "vllm", "ray"),
    "integrations": ("shardsync.tools", "shardsync.zoo", "shardsync.cli"),
    "tools": ("shardsync.cli",),
}


def _imports(path: pathlib.Path) -> set[str]:
    rel = path.relative_to(PKG.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                out.add(mod)
                if not node.module:
                    out.update(f"{mod}.{a.name}" for a in node.names)
            else:
                out.add(node.module or "")
    return out


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_dependencies_point_one_way(wing):
    files = sorted((PKG / wing).rglob("*.py"))
    assert files, f"wing {wing}/ is missing"
    bad = [(str(f.relative_to(PKG)), imp) for f in files for imp in sorted(_imports(f))
           if any(imp == x or imp.startswith(x + ".") for x in FORBIDDEN[wing])]
    assert not bad, f"{wing}/ imports what it must not: {bad}"


def test_no_flat_modules_left():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert top == ["__init__", "cli", "errors", "source", "types"], top
