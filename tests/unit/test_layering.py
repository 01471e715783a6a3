"""Imports point down one order (docs/layout.md): cli -> server -> weights -> validation -> pool -> engine ->
speculation -> the shared modules, which import none of those; the offline tools (drafting, perfmodel) use the engine
and below, never the serving layers above it; and no two files import each other, directly or round a loop (every
import counts, at module level or inside a function)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rollout_service"
ORDER = ["cli", "server", "weights", "validation", "pool", "engine", "speculation"]
OFFLINE = {"drafting", "perfmodel", "demo", "protogen", "launcher"}


def modules() -> dict[str, Path]:
    return {".".join(f.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): f
            for f in ROOT.rglob("*.py")}


def imports(path: Path, known: dict) -> set[str]:
    """The project's modules a file imports (`from a.b import c` counts a.b, and a.b.c where that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollout_service"):
            out |= {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in known}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    return out


def unit(module: str) -> str:
    """A module's package below rollout_service (server, pool, ...), or its own name for a top-level module."""
    return module.split(".")[1] if "." in module else module


def test_every_import_points_down_the_layers():
    known = modules()
    wrong = []
    for module, path in known.items():
        src = unit(module)
        for dst in {unit(m) for m in imports(path, known)} - {src}:
            if src in ORDER and dst in ORDER and ORDER.index(dst) < ORDER.index(src):
                wrong.append(f"{module} imports {dst} (above it)")
            elif src not in ORDER and src not in OFFLINE and dst in ORDER:
                wrong.append(f"{module} (a shared module) imports {dst}")
            elif src in OFFLINE and dst in ORDER[:ORDER.index("engine")]:
                wrong.append(f"{module} (an offline tool) imports {dst}, a serving layer")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_two_files_import_each_other():
    known = modules()
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    loops = _loops(graph)
    assert loops == [], loops


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        group.append(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        out.append(sorted(group))
    return out


def test_the_checks_can_fail():
    """A loop and an upward import are found."""
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _loops({"a": {"b"}, "b": set()}) == []
    assert unit("rollout_service.pool.pool") == "pool" and unit("rollout_service.config") == "config"
