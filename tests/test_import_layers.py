"""The house's floor plan, checked from the source (every import: module-level, inside
functions and under TYPE_CHECKING alike).

- Arrows only downward: a module imports only its own floor and the floors below it. The floors
  are the layers of the import-linter contract in pyproject.toml (one place; `lint-imports` in
  `make test` checks them too, with its own reading of the imports).
- No import cycle among nanoserve's modules, runtime or type-only, not even within a floor
  (a package's __init__ re-exporting its own children is not a cycle of design).
- No capability probe: no `hasattr`, no `getattr` with a default, no module-level `__getattr__`
  but the package's lazy `LLM`.
- `import nanoserve` and the bottom floor load no torch; the scheduler's floor loads neither
  the model, the parallel machinery nor the engine.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"


def floors() -> list[list[str]]:
    """pyproject's layers, bottom first: each a list of the package's top-level names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.replace("|", ":").split(":")] for layer in reversed(contract["layers"])]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The modules of `modules` that `path` imports, resolved to the longest known name."""
    me = module_name(path, root)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    edges = {module_name(p, root): imports(p, modules, root) for p in paths}
    # A package's __init__ re-exporting its children is not a cycle of design: drop child -> parent.
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floor_of(module: str, plan: list[list[str]]) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for level, names in enumerate(plan):
        if top in names:
            return level
    raise AssertionError(f"{module} is on no floor: add it to pyproject's [tool.importlinter] layers")


def test_imports_flow_downward_only():
    plan = floors()
    edges = graph(PACKAGE)
    upward = [f"{source} imports {target}" for source, targets in sorted(edges.items()) if source != "nanoserve"
              for target in sorted(targets) if target != "nanoserve"
              and floor_of(target, plan) > floor_of(source, plan)]
    assert not upward, "imports against the floor plan:\n" + "\n".join(upward)


def test_no_import_cycles():
    assert cycles(graph(PACKAGE)) == []


def test_the_experiments_have_no_cycles_and_stand_outside_the_package():
    assert cycles(graph(ROOT / "experiments")) == []
    inside = [p for p in PACKAGE.rglob("*.py") if "experiments" in imports(p, {"experiments"})]
    assert not inside, f"the package imports the experiments: {inside}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checkers themselves: a cycle, a type-only import, a relative import and a floor."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from .a import A\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert cycles(graph(package, tmp_path)) == [["pkg.a", "pkg.b"]]
    plan = floors()
    assert floor_of("nanoserve.sched.fcfs", plan) < floor_of("nanoserve.model.runner", plan)
    assert floor_of("nanoserve.config", plan) == floor_of("nanoserve.request", plan) == 0


def _probes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}")
        elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and path != PACKAGE / "__init__.py":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} __getattr__")
    return found


def test_no_capability_probes():
    """Capabilities are declared on the interfaces (a method with a default), not probed."""
    found = [probe for path in sorted(PACKAGE.rglob("*.py")) for probe in _probes(path)]
    assert not found, "\n".join(found)


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_package_and_its_bottom_floor_loads_no_torch():
    loaded = _loaded_after("import nanoserve, nanoserve.config, nanoserve.request, nanoserve.sampling, "
                           "nanoserve.slo, nanoserve.outputs, nanoserve.cli")
    assert "torch" not in loaded
    assert "nanoserve.llm" not in loaded  # LLM comes on first use


def test_the_scheduler_floor_loads_no_model_and_no_engine():
    loaded = _loaded_after("import nanoserve.sched, nanoserve.sched.base, nanoserve.sched.fcfs")
    above = [m for m in loaded if m.startswith(("nanoserve.model", "nanoserve.parallel", "nanoserve.engine",
                                                "nanoserve.executor", "nanoserve.builder", "nanoserve.llm"))]
    assert not above
