"""The package's modules import one another without a circle: every import counts, at module
level or inside a function (a deferred import still ties the two modules together)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ringreduce"


def module_name(path, root=PKG.parent):
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules, root=PKG.parent):
    """The package modules that `path` imports (ringreduce.x for `from . import x` too)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ((base + "." + node.module) if node.module else base) if node.level \
                else node.module
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph(pkg=PKG):
    paths = sorted(pkg.rglob("*.py"))
    modules = {module_name(p, pkg.parent) for p in paths}
    graph = {module_name(p, pkg.parent): imports_of(p, modules, pkg.parent) for p in paths}
    # A package's __init__ imports its submodules; a submodule importing its own package is the
    # usual reach for shared names, not a circle of the kind this test looks for.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def cycles(graph):
    """Every module that lies on an import circle, with one circle through it."""
    out = {}
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    out.setdefault(start, path + [start])
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, path + [dep]))
    return out


def test_the_package_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found.values())


def test_distributed_and_hierarchy_import_one_way():
    graph = import_graph()
    assert "ringreduce.hierarchy" in graph["ringreduce.distributed"]
    assert "ringreduce.distributed" not in graph["ringreduce.hierarchy"]


def test_a_deferred_import_is_seen(tmp_path):
    """The check itself: a function-level import that closes a circle is found."""
    pkg = tmp_path / "ringreduce"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert cycles(import_graph(pkg)).keys() == {"ringreduce.a", "ringreduce.b"}
