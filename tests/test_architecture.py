"""The layering the design promises, checked on the source (tests/test_solvers.py checks solvers/ never imports torch).

- passes/ are analyses and transforms of fx graphs: they never import the planner,
  the recorder, the report, the plan, the options or the backend;
- every private torch name (``torch._x``, ``torch.utils._x``, ``partitioners._x``) is
  touched only in ``fxremat/_torch_compat.py``;
- no module imports another module's private (underscore) names;
- the package's module-level imports have no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fxremat"
TOP_ONLY = {"planner", "recorder", "report", "plan", "options", "backend", "explain", "cli", "viz", "verify"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module, top_level_only: bool) -> list[tuple[str, list[str]]]:
    """(imported module, names) for each import in ``tree``."""
    is_package = module == "fxremat" or module.endswith("__init__")
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, is_package)
            found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_passes_never_import_the_layers_above_them():
    for module, tree in _modules().items():
        if not module.startswith("fxremat.passes"):
            continue
        for target, names in _imports(module, tree, top_level_only=False):
            targets = {target} | {f"{target}.{n}" for n in names}
            upward = [t for t in targets if t.startswith("fxremat.") and t.split(".")[1] in TOP_ONLY]
            assert not upward, f"{module} imports {upward}: passes/ must not depend on the planner's layers"


def _private_torch(node: ast.AST) -> str | None:
    """The dotted name when ``node`` is an attribute chain rooted at torch with a private segment."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    parts.reverse()
    private = [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
    if parts[0] in ("torch", "partitioners") and private:
        return ".".join(parts)
    return None


def test_only_the_compat_module_touches_private_torch_names():
    for module, tree in _modules().items():
        if module == "fxremat._torch_compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    if name.startswith("torch"):
                        assert not any(p.startswith("_") for p in name.split(".")[1:]), f"{module} imports {name}"
            elif isinstance(node, ast.Attribute):
                found = _private_torch(node)
                assert found is None, (
                    f"{module} line {node.lineno} touches {found}: move it into fxremat/_torch_compat.py"
                )


def test_no_module_imports_another_modules_private_names():
    for module, tree in _modules().items():
        for target, names in _imports(module, tree, top_level_only=False):
            if target.startswith("fxremat") and target != "fxremat._torch_compat":
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not private, f"{module} imports private {private} from {target}"


def test_module_level_imports_have_no_cycle():
    modules = _modules()
    graph = {
        m: {t for t, _ in _imports(m, tree, top_level_only=True) if t in modules and t != m}
        for m, tree in modules.items()
    }
    # The package __init__ re-exports the public API: it sits on top and imports everything.
    graph = {m: deps - {"fxremat"} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail(f"import cycle: {' -> '.join(path + [m, d])}")
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_architecture_checks_can_fail():
    """The checks above find what they look for (so a pass means something)."""
    bad = ast.parse(
        "import torch\nx = torch._dynamo.reset\nfrom ..planner import partition\nfrom .fusion import _hint\n"
    )
    assert any(_private_torch(n) for n in ast.walk(bad) if isinstance(n, ast.Attribute))
    imports = _imports("fxremat.passes.cost", bad, top_level_only=False)
    assert ("fxremat.planner", ["partition"]) in imports
    assert ("fxremat.passes.fusion", ["_hint"]) in imports
