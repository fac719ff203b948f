"""The layering rules of docs/architecture.md, checked on the import graph of the source."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddiloco"
# What the pure core must never touch: no sockets, threads, clocks, files, processes or randomness.
IO_MODULES = {
    "socket",
    "threading",
    "time",
    "datetime",
    "os",
    "io",
    "pathlib",
    "subprocess",
    "multiprocessing",
    "signal",
    "asyncio",
    "random",
    "logging",
    "zmq",
    "shutil",
    "tempfile",
}
SHARED = ("training", "report", "chaos", "goodput", "workloads")


def imports() -> dict[str, set[str]]:
    """Module (dotted, under ddiloco) -> every module it imports, absolute."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.level:  # relative: resolve against the package
                    base = name.split(".")[: -node.level] if path.name != "__init__.py" else name.split(".")
                    found.add(".".join([*base, node.module]))
                else:
                    found.add(node.module)
        graph[name] = found
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    graph = imports()
    assert "ddiloco.core.syncer" in graph and "ddiloco.service.syncer" in graph and "ddiloco.sim.simulation" in graph
    assert "ddiloco.core.merge" in graph["ddiloco.core.syncer"]


def test_core_imports_only_itself_and_no_io():
    for module, deps in imports().items():
        if layer(module) != "core":
            continue
        for dep in deps:
            if dep.startswith("ddiloco"):
                assert layer(dep) in ("core", "errors"), f"{module} imports {dep}: the core imports nothing else"
            assert dep.split(".")[0] not in IO_MODULES, f"{module} imports {dep}: the core does no I/O"


def test_the_two_drivers_never_import_each_other_and_shared_layers_import_neither():
    for module, deps in imports().items():
        for dep in deps:
            if not dep.startswith("ddiloco."):
                continue
            if layer(module) == "sim":
                assert layer(dep) != "service", f"{module} imports {dep}"
            if layer(module) == "service":
                assert layer(dep) != "sim", f"{module} imports {dep}"
            if layer(module) in SHARED:
                assert layer(dep) not in ("sim", "service"), f"{module} imports {dep}"
