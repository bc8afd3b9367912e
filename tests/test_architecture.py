"""The package's import structure: tiers that import only downwards. No import circle among
knnconv's modules (imports inside functions count), no knnconv import inside a function body,
and no runtime module importing the tooling (knnconv.tools)."""

from __future__ import annotations

import ast
from pathlib import Path

import knnconv

PACKAGE = Path(knnconv.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported knnconv module, whether the import sits inside a function) for each import
    of ``path``; ``from X import name`` counts name as a module where it is one."""
    tree = ast.parse(path.read_text())
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, nested) for alias in child.names
                             if alias.name.startswith("knnconv"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.startswith("knnconv"):
                    for alias in child.names:
                        candidate = f"{target}.{alias.name}"
                        found.append((candidate if candidate in MODULES else target, nested))
            visit(child, nested)

    visit(tree, False)
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_no_knnconv_import_inside_a_function():
    hidden = [(name, target) for name, edges in GRAPH.items() for target, nested in edges
              if nested]
    assert not hidden


def test_no_import_circle():
    edges = {name: {target for target, _ in found if target in MODULES and target != name}
             for name, found in GRAPH.items()}
    # a package's modules may import their package (its __init__ runs first either way), but
    # the package's __init__ importing them back is the edge that makes a circle
    state, cycles = {}, []

    def walk(node, stack):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                walk(target, stack + [target])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            walk(name, [name])
    assert not cycles


def test_the_runtime_never_imports_the_tooling():
    runtime = [name for name in MODULES if not name.startswith("knnconv.tools")
               and name != "knnconv.__main__"]
    offenders = [(name, target) for name in runtime for target, _ in GRAPH[name]
                 if target.startswith("knnconv.tools")]
    assert not offenders
