"""Imports flow one way (the house rule): config/request -> memory -> sched -> model -> dist ->
engine -> server/sim. A module may import its own layer and the layers before it, never a later
one; in particular the model never imports dist/. Read from the source (every import, those
inside functions and under TYPE_CHECKING too), so a new back edge fails here."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"config", "request", "sampling", "slo", "outputs", "tokenizer"},
    {"memory"},
    {"sched"},
    {"model"},
    {"dist"},
    {"engine", "builder", "kv_sizing", "llm", "async_engine", "__init__"},
    {"server", "sim"},
]
# The back edges there are, each for its reason: these modules build engines (so they stand
# where the builder does), and moving them out of their packages would change the commands
# users type. A new back edge fails the test; one mended must leave this list.
KNOWN_BACK_EDGES = {
    ("nanoserve.sched.profile", "nanoserve.builder"): "`python -m nanoserve.tools.profile` builds an engine",
    ("nanoserve.sched.profile", "nanoserve.model.runner"): "...and times its runner's steps",
    ("nanoserve.parallel.launch", "nanoserve.builder"): "each worker process builds its rank's runner",
    ("nanoserve.cluster.cluster", "nanoserve.builder"): "KunServe's cluster: an engine per instance",
    ("nanoserve.cluster.instance", "nanoserve.builder"): "one KunServe instance: an engine in its process",
    ("nanoserve.cluster.instance", "nanoserve.engine"): "...",
    ("nanoserve.cluster.member", "nanoserve.engine"): "an instance's engine taking part in a drop or restore",
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(LAYERS):
        if name in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package or file to LAYERS")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("nanoserve"):
            found.append((node.lineno, node.module))  # its package decides the layer
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("nanoserve")]
    return found


def test_imports_flow_one_way():
    back_edges = {}
    for path in sorted((ROOT / "nanoserve").rglob("*.py")):
        module = module_name(path)
        for line, target in imports(path):
            if target != "nanoserve" and layer_of(target) > layer_of(module):
                back_edges.setdefault((module, target), f"{path.relative_to(ROOT)}:{line}")
    new = {edge: where for edge, where in back_edges.items() if edge not in KNOWN_BACK_EDGES}
    assert not new, "imports against the layer order:\n" + "\n".join(f"{w} imports {t}" for (_, t), w in new.items())
    assert set(back_edges) == set(KNOWN_BACK_EDGES), "mended: drop from KNOWN_BACK_EDGES " + str(
        set(KNOWN_BACK_EDGES) - set(back_edges))


def test_the_model_never_imports_dist():
    model = ROOT / "nanoserve" / "model"
    offending = [f"{p.name}:{line} {target}" for p in model.rglob("*.py") for line, target in imports(p)
                 if target.startswith("nanoserve.parallel")]
    assert not offending


def test_a_back_edge_is_caught(tmp_path):
    """The checker itself: a model module importing dist/ is a back edge."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from nanoserve.parallel.executor import Executor\n")
    (line, target), = imports(path)
    assert line == 2 and layer_of(target) > layer_of("nanoserve.model.probe")
