"""The import graph, read from the source (every import statement, lazy ones inside functions
included): no cycle between modules, and dependencies that run one way (docs/architecture.md):

    rollout -> engine -> kernels          rollout -> weight_sync     engine.worker -> weight_sync
    inside engine: frontend -> process -> core -> worker -> model, all of them -> the root contracts

A parent package's __init__ that a dotted import runs on the way is not counted as an edge."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "rollout", "kernels", "weight_sync")
ENGINE_LAYERS = ("frontend", "process", "core", "worker", "model")  # each may import those after it
FORBIDDEN = {"engine": ("rollout",), "kernels": ("engine", "rollout", "weight_sync"),
             "weight_sync": ("engine", "rollout")}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in mods else base)
    return {m for m in found if m in mods and m != name}


def graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def engine_layer(module: str) -> int | None:
    """The layer's position in ENGINE_LAYERS; None for the root contracts (and the package)."""
    parts = module.split(".")
    return ENGINE_LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in ENGINE_LAYERS else None


def test_the_graph_sees_the_imports():
    g = graph()  # a reader that found nothing would pass every rule below
    assert "engine.core.scheduler" in g["engine.core.engine_core"]
    assert "engine.protocol" in g["engine.process.core_proc"]
    assert "engine.core.engine_core" in g["engine.process.core_proc"]
    assert sum(map(len, g.values())) > 200


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_packages_import_one_way():
    bad = [(m, i) for m, deps in graph().items() for i in deps
           if i.split(".")[0] in FORBIDDEN.get(m.split(".")[0], ())]
    assert bad == []


def test_engine_layers_import_downwards():
    bad = []
    for m, deps in graph().items():
        if not m.startswith("engine.") or m == "engine":
            continue
        mine = engine_layer(m)
        for i in deps:
            if not i.startswith("engine"):
                continue
            theirs = engine_layer(i)
            if i == "engine" or (theirs is not None and (mine is None or theirs < mine)):
                bad.append((m, i))  # the root importing a layer, or a layer importing one above it
    assert bad == []
