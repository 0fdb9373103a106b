"""The wings' dependency arrows (DESIGN.md "Layout"): checked on every module's imports, lazy ones included.

Product code is ``src/shardsync`` except ``programs/``, ``cli.py`` and ``testing/`` (the zoo, the harness, vLLM test
scaffolding): it never imports them; only ``integrations/``, ``verify/`` (and ``programs/``, ``testing/``) import
vllm; only ``integrations/ray``, ``programs/`` and ``testing/`` import ray. No import circle anywhere (lazy and
type-only imports counted); the engine's sides never import each other. ``import shardsync`` stays light
(the runtime, the sharded sources and vLLM load on first use) and the examples import only its public names.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "shardsync"
EXAMPLES = PKG.parents[1] / "examples"

# wing -> wings (and outside packages) it must never import
FORBIDDEN = {
    "plan": ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.programs", "shardsync.testing",
             "shardsync.cli", "torch.distributed"),
    "transport": ("shardsync.plan", "shardsync.engine", "shardsync.integrations", "shardsync.programs", "shardsync.testing",
                  "shardsync.cli"),
    "engine": ("shardsync.integrations", "shardsync.programs", "shardsync.testing", "shardsync.cli", "vllm", "ray"),
    "sources": ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.programs", "shardsync.testing",
                "shardsync.cli", "vllm", "ray"),
    "integrations": ("shardsync.programs", "shardsync.testing", "shardsync.verify", "shardsync.cli"),
    "security": ("shardsync.plan", "shardsync.engine", "shardsync.transport", "shardsync.integrations",
                 "shardsync.programs", "shardsync.testing", "shardsync.verify", "shardsync.cli", "torch"),
    "delta": ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.programs",
              "shardsync.testing", "shardsync.verify", "shardsync.cli", "torch.distributed"),
    "verify": ("shardsync.programs", "shardsync.testing", "shardsync.cli"),
    "programs": ("shardsync.cli",),
    "testing": ("shardsync.cli",),
    "engine/producer": ("shardsync.engine.consumer",),
    "engine/consumer": ("shardsync.engine.producer",),
    "engine/protocol": ("shardsync.engine.producer", "shardsync.engine.consumer", "shardsync.engine.coordinator",
                        "shardsync.engine.source_reads"),
    "engine/coordinator": ("shardsync.engine.producer", "shardsync.engine.consumer", "shardsync.engine.source_reads"),
}
NOT_PRODUCT = ("shardsync.programs", "shardsync.testing", "shardsync.cli")  # and any testing subpackage
VLLM_ALLOWED = ("shardsync.integrations", "shardsync.verify", "shardsync.programs", "shardsync.testing",
                "shardsync.cli")
RAY_ALLOWED = ("shardsync.integrations.ray", "shardsync.programs", "shardsync.testing")
# Ray imports outside integrations/ray and programs/ found when this rule was written (issue 22), each to move or be
# allowed by a decision; the test fails once one is gone, so that its entry goes too.
RAY_KNOWN = {
    "shardsync.transport.rdt": "the Ray Direct Transport (lazy `import ray`)",
    "shardsync.integrations.skyrl.select": "SkyRL runs on Ray: its strategy choice reaches every Ray worker through "
                                           "Ray's setup hook, and SkyRL's Ray 2.51 import needs a home on newer Ray",
}
# `import shardsync` must not load these (they load on first use of a public name)
HEAVY = ("vllm", "ray", "transformers", "torch.distributed.tensor", "torch.distributed.fsdp", "shardsync.engine",
         "shardsync.transport", "shardsync.integrations", "shardsync.sources", "shardsync.programs", "shardsync.testing")
# what examples may import from shardsync besides `shardsync` itself: the fresh-engine check their --verify runs
# (test scaffolding: a testing subpackage, or the module that holds the fresh reference until it moves there)
EXAMPLE_VERIFY = ("shardsync.verify",)


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _package(path: pathlib.Path) -> list[str]:
    """The package a module's relative imports start from ([] outside src/, e.g. an example)."""
    if not path.is_relative_to(PKG.parent):
        return []
    return list(path.relative_to(PKG.parent).with_suffix("").parts[:-1])


def _resolve(node: ast.ImportFrom, pkg: list[str]) -> str:
    if not node.level:
        return node.module or ""
    base = pkg[: len(pkg) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: pathlib.Path) -> set[str]:
    pkg = _package(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(node, pkg)
            out.add(mod)
            if node.level and not node.module:
                out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _under(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == x or mod.startswith(x + ".") for x in prefixes)


def _is_testing(mod: str) -> bool:
    parts = mod.split(".")
    return parts[0] == "shardsync" and "testing" in parts[1:]


def _is_product(mod: str) -> bool:
    return not _under(mod, NOT_PRODUCT) and not _is_testing(mod)


@functools.cache
def _modules() -> dict[str, set[str]]:
    return {_module(f): _imports(f) for f in sorted(PKG.rglob("*.py"))}


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_dependencies_point_one_way(wing):
    files = sorted((PKG / wing).rglob("*.py"))  # a wing is a folder, e.g. "engine/producer"
    assert files, f"wing {wing}/ is missing"
    bad = [(str(f.relative_to(PKG)), imp) for f in files for imp in sorted(_imports(f))
           if any(imp == x or imp.startswith(x + ".") for x in FORBIDDEN[wing])]
    assert not bad, f"{wing}/ imports what it must not: {bad}"


def test_no_flat_modules_left():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert top == ["__init__", "cli", "config", "errors", "source", "types"], top


def test_product_code_never_imports_tools_zoo_or_testing_scaffolding():
    mods = _modules()
    assert any(_is_product(m) for m in mods) and not _is_product("shardsync.testing.vllm.fault_models")
    bad = [(m, imp) for m, imps in mods.items() if _is_product(m) for imp in sorted(imps)
           if _under(imp, ("shardsync.programs", "shardsync.testing")) or _is_testing(imp)]
    assert not bad, f"product code imports programs/ or testing/: {bad}"


def test_nothing_imports_the_cli():
    bad = [(m, imp) for m, imps in _modules().items() if m != "shardsync.cli" for imp in imps
           if _under(imp, ("shardsync.cli",))]
    assert not bad, bad


def test_only_integrations_and_tools_import_vllm():
    bad = [(m, imp) for m, imps in _modules().items() if not _under(m, VLLM_ALLOWED) for imp in sorted(imps)
           if _under(imp, ("vllm",))]
    assert not bad, f"vllm imported outside integrations/ and programs/: {bad}"


def test_only_the_ray_integration_and_tools_import_ray():
    found = {m: sorted(imp for imp in imps if _under(imp, ("ray",))) for m, imps in _modules().items()
             if not _under(m, RAY_ALLOWED)}
    found = {m: imps for m, imps in found.items() if imps}
    assert not found.keys() - RAY_KNOWN.keys(), f"ray imported outside integrations/ray and programs/: {found}"
    assert found.keys() == RAY_KNOWN.keys(), f"no longer imports ray, drop from RAY_KNOWN: {RAY_KNOWN.keys() - found}"


def _eager_imports(path: pathlib.Path) -> set[str]:
    """What importing ``path`` imports at once: module-level imports, not those in functions or under
    ``if TYPE_CHECKING``; ``from pkg import name`` also yields ``pkg.name`` (it may be a submodule)."""
    pkg, out = _package(path), set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node, pkg)
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit([n for n in getattr(node, field, []) if isinstance(n, ast.stmt | ast.excepthandler)])

    visit(ast.parse(path.read_text()).body)
    return out


def _file_of(mod: str) -> pathlib.Path | None:
    rel = pathlib.Path(*mod.split(".")[1:])
    for f in (PKG / rel / "__init__.py", (PKG / rel).with_suffix(".py")):
        if mod.startswith("shardsync") and f.is_file():
            return f
    return None


def test_import_shardsync_stays_light():
    """The eager import closure of ``shardsync/__init__.py`` (every package on the way included)."""
    seen, todo, outside = set(), ["shardsync"], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parents = [".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)]
        todo += [p for p in parents if p not in seen]
        f = _file_of(mod)
        if f is None:
            if not mod.startswith("shardsync."):
                outside.add(mod)
            continue
        todo += sorted(_eager_imports(f))
    heavy = sorted(m for m in seen | outside if _under(m, HEAVY))
    assert not heavy, f"import shardsync loads {heavy}"


def test_public_names_resolve_lazily_and_unknown_ones_fail():
    import shardsync

    assert len(shardsync.__all__) == len(set(shardsync.__all__))
    for name in shardsync.__all__:
        assert getattr(shardsync, name).__name__ == name, name
        assert name in dir(shardsync)
    for internal in ("RecordingTensor", "record_plan", "GroupPacker", "loopback_sync"):
        assert internal not in shardsync.__all__
        with pytest.raises(AttributeError, match=internal):
            getattr(shardsync, internal)
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo
    from shardsync.engine.producer.producer import Producer

    assert shardsync.ShardsyncTrainerInitInfo is ShardsyncTrainerInitInfo and shardsync.Producer is Producer


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_import_only_public_names(example):
    imps = _imports(EXAMPLES / example)
    bad = sorted(imp for imp in imps if _under(imp, ("shardsync",)) and imp != "shardsync"
                 and not (_is_testing(imp) or _under(imp, EXAMPLE_VERIFY)))
    assert not bad, f"examples/{example} imports shardsync internals: {bad}"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the shardsync modules it imports (lazy and type-only imports included; a package's own
    ``__init__`` on the way to a submodule is not an edge of the importer)."""
    mods = _modules()
    return {m: {i for i in imps if i in mods and i != m and not m.startswith(i + ".")} for m, imps in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    """No module imports, directly or through others, a module that imports it back: lazy imports (in a
    function) and type-only ones (under ``if TYPE_CHECKING``) count, they are arrows a reader must follow too."""
    circles = _circles(_module_graph())
    assert not circles, f"import circles: {circles}"


def test_file_names_are_unique():
    names: dict[str, list[str]] = {}
    for f in PKG.rglob("*.py"):
        if f.name != "__init__.py":
            names.setdefault(f.name, []).append(str(f.relative_to(PKG)))
    dup = {n: ps for n, ps in names.items() if len(ps) > 1}
    assert not dup, f"one file name in several folders: {dup}"


def test_nothing_cites_a_file_outside_the_repository():
    root = PKG.parents[1]
    files = [*PKG.rglob("*.py"), *root.glob("docs/*.md"), root / "README.md", *root.glob("tests/*.py"),
             *root.glob("benchmarks/*.py"), *root.glob("examples/*.py")]
    bad = [str(f.relative_to(root)) for f in files if f != pathlib.Path(__file__).resolve()
           and "DESIGN" + ".md" in f.read_text()]
    assert not bad, f"cite DESIGN.md, which is not in the repository: {bad}"
