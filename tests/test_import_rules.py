"""The layering rules of docs/architecture.md, checked on the import graph of the source.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy
import is still a dependency), under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddiloco"
# What the pure layers (core, protocol) must never touch: no sockets, threads, clocks, files,
# processes or randomness.
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
SHARED = ("training", "report", "chaos", "goodput", "workloads", "link")


def module_name(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module the source of module ``name`` imports, absolute. ``from X import y`` counts
    as importing ``X.y`` when that is a module of ours (``known``), else ``X``."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.add(sub if sub in known else module)
    return found


def imports(root: Path = SRC) -> dict[str, set[str]]:
    """Module (dotted, under ddiloco) -> every module it imports, absolute."""
    paths = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    graph = {}
    for p in paths:
        name = module_name(p, root)
        graph[name] = imports_of(p.read_text(), name, p.name == "__init__.py", known)
    return graph


def layer(module: str) -> str:
    """The package or top-level module of ours that ``module`` belongs to (``core``, ``config``;
    ``""`` for the ``ddiloco`` package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Layer -> the other layers it imports (ours only)."""
    out: dict[str, set[str]] = {layer(m): set() for m in graph}
    for module, deps in graph.items():
        for dep in deps:
            if (dep == "ddiloco" or dep.startswith("ddiloco.")) and layer(dep) != layer(module):
                out[layer(module)].add(layer(dep))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan), each sorted: a group is a
    set of layers that import each other, directly or around a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def pure_violations(graph: dict[str, set[str]], name: str, allowed: set[str], stdlib_only: bool) -> list[str]:
    """What the modules of layer ``name`` import that they must not: another layer of ours
    outside ``allowed``, a module that does I/O, and (``stdlib_only``) anything third-party but
    torch."""
    bad = []
    for module, deps in sorted(graph.items()):
        if layer(module) != name:
            continue
        for dep in sorted(deps):
            top = dep.split(".")[0]
            if top == "ddiloco":
                if layer(dep) not in {name, *allowed}:
                    bad.append(f"{module} imports {dep}: {name} imports only {', '.join(sorted(allowed))} of ours")
            elif top in IO_MODULES:
                bad.append(f"{module} imports {dep}: {name} does no I/O")
            elif stdlib_only and top not in sys.stdlib_module_names and top != "torch":
                bad.append(f"{module} imports {dep}: {name} imports the standard library and torch only")
    return bad


def test_the_graph_is_read():
    graph = imports()
    assert (
        "ddiloco.core.syncer" in graph
        and "ddiloco.service.syncer.service" in graph
        and "ddiloco.sim.simulation" in graph
    )
    assert "ddiloco.core.merge" in graph["ddiloco.core.round"]
    # lazy imports inside functions count (cli imports the drivers per command)
    assert any(layer(d) == "service" for d in graph["ddiloco.cli"])


def test_imports_resolve_relative_and_from_package_forms():
    known = {"ddiloco.a", "ddiloco.a.x", "ddiloco.a.y", "ddiloco.b", "ddiloco.b.z"}
    src = "from . import y\nfrom .y import f\nfrom ..b import z\nfrom ddiloco.b import g\n"
    src += "def h():\n    import ddiloco.b.z\n"  # a lazy import counts
    assert imports_of(src, "ddiloco.a.x", False, known) == {"ddiloco.a.y", "ddiloco.b.z", "ddiloco.b"}
    assert imports_of("from . import x\n", "ddiloco.a", True, known) == {"ddiloco.a.x"}


def test_no_import_cycle_between_our_packages_and_top_level_modules():
    graph = imports()
    found = cycles(layer_graph(graph))
    # Name the module-level imports that close each ring, so the message says what to move.
    edges = [
        f"{module} imports {dep}"
        for group in found
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.startswith("ddiloco.") and layer(module) != layer(dep) and {layer(module), layer(dep)} <= set(group)
    ]
    assert found == [], f"layers that import each other (lazy imports included): {found}; " + "; ".join(edges)


def test_the_cycle_check_finds_a_ring():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = {"ddiloco.x.m": {"ddiloco.y.n"}, "ddiloco.y.n": set(), "ddiloco.y.o": {"ddiloco.x"}}
    assert cycles(layer_graph(graph)) == [["x", "y"]]  # a lazy import one way, a top one the other


def test_core_imports_only_itself_and_no_io():
    assert pure_violations(imports(), "core", {"errors"}, stdlib_only=False) == []


def test_protocol_imports_only_the_core_and_no_io():
    # ddiloco.protocol may not exist yet: the rule then holds trivially, and holds once it does.
    assert pure_violations(imports(), "protocol", {"core", "errors"}, stdlib_only=True) == []


def test_the_protocol_rule_catches_what_it_must():
    graph = {
        "ddiloco.protocol.session": {"ddiloco.core.syncer", "ddiloco.errors", "dataclasses", "torch", "typing"},
        "ddiloco.protocol.bad": {"ddiloco.service.base.wire", "time", "numpy", "ddiloco.protocol.session"},
    }
    bad = pure_violations(graph, "protocol", {"core", "errors"}, stdlib_only=True)
    assert [b.split(":")[0] for b in bad] == [
        "ddiloco.protocol.bad imports ddiloco.service.base.wire",
        "ddiloco.protocol.bad imports numpy",
        "ddiloco.protocol.bad imports time",
    ]


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


def test_the_link_emulator_imports_only_errors_and_its_scheduler_does_no_io():
    graph = imports()
    ours = [
        f"{m} imports {d}"
        for m, deps in sorted(graph.items())
        if layer(m) == "link"
        for d in sorted(deps)
        if d.startswith("ddiloco.") and layer(d) not in ("link", "errors")
    ]
    assert ours == [], "ddiloco.link imports only ddiloco.errors of ours (chaos imports it): " + "; ".join(ours)
    # config and shaper are the pure part, tested in virtual time: no clock, socket or event loop
    pure = {"ddiloco.link.config", "ddiloco.link.shaper"}
    bad = [
        f"{m} imports {d}" for m in sorted(pure) for d in sorted(graph[m]) if d.split(".")[0] in IO_MODULES - {"random"}
    ]
    assert bad == []


# The wings of service/ (docs/architecture.md): each imports only the wings listed for it.
WINGS = {"base": set(), "syncer": {"base"}, "learner": {"base"}, "ops": {"base", "syncer", "learner"}}


def wing(module: str) -> str | None:
    """The wing of ``service`` that ``module`` belongs to (None outside the service, or for the
    ``ddiloco.service`` package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "service" else None


def wing_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        own = wing(module)
        if layer(module) == "service" and own not in WINGS and module != "ddiloco.service":
            bad.append(f"{module} is in no wing: put it in one of {', '.join(WINGS)}")
            continue
        for dep in sorted(deps):
            theirs = wing(dep)
            if own is not None and theirs is not None and theirs != own and theirs not in WINGS.get(own, set()):
                allowed = ", ".join(sorted(WINGS[own])) or "no other wing"
                bad.append(f"{module} imports {dep}: the {own} wing imports {allowed}")
    return bad


def test_the_service_wings_import_only_the_wings_below_them():
    graph = imports()
    assert {wing(m) for m in graph if layer(m) == "service"} - {None} == set(WINGS)
    assert wing_violations(graph) == []


def test_the_wing_rule_catches_what_it_must():
    graph = {
        "ddiloco.service.base.wire": {"ddiloco.service.syncer.store"},
        "ddiloco.service.syncer.service": {"ddiloco.service.base.wire", "ddiloco.service.learner.api"},
        "ddiloco.service.learner.api": {"ddiloco.service.base.keys"},
        "ddiloco.service.ops.launcher": {"ddiloco.service.syncer.store", "ddiloco.service.learner.process"},
        "ddiloco.service.stray": set(),
    }
    assert wing_violations(graph) == [
        "ddiloco.service.base.wire imports ddiloco.service.syncer.store: the base wing imports no other wing",
        "ddiloco.service.stray is in no wing: put it in one of base, syncer, learner, ops",
        "ddiloco.service.syncer.service imports ddiloco.service.learner.api: the syncer wing imports base",
    ]


# docs/architecture.md's table: what each folder or top-level module may import of ours.
LEAVES = ("errors", "lifecycle", "methods", "cli_types")
ALLOWED: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "": set(),  # the ddiloco package's __init__ (its names come in lazily)
    "__main__": {"cli"},
    "core": {"errors"},
    "protocol": {"core", "errors"},
    "link": {"errors"},
    "workloads": {"errors"},
    "chaos": {"errors", "link"},
    "training": {"core", "errors", "protocol", "workloads"},
    "config": {"chaos", "core", "errors", "protocol", "training", "workloads"},
    "settings": {"config", "errors"},
    "config_reference": {"config", "methods"},
    "report": {"config", "core", "errors", "protocol"},
    "goodput": {"chaos", "core", "errors", "link", "protocol", "report"},
    "sim": {"chaos", "config", "core", "errors", "link", "protocol", "report", "training", "workloads"},
    "service": {
        *("chaos", "config", "core", "errors", "lifecycle", "link", "protocol"),
        *("report", "settings", "training", "workloads"),
    },
    "export": {"config", "errors", "report", "service", "training"},
    "export_cmd": {"config", "errors", "export", "report", "service", "workloads"},
    "migrate_cmd": {"errors", "report", "service"},
    "api": {"config", "core", "errors", "export", "service", "training", "workloads"},
}


def table_violations(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Each import of ours across folders that the table does not allow; ``cli`` may import
    anything (it is the top), and a folder missing from the table is named."""
    bad = []
    for name, deps in sorted(layer_graph(graph).items()):
        if name == "cli":
            continue
        if name not in allowed:
            bad.append(f"{name or 'ddiloco'} is not in the table of docs/architecture.md: add its row")
            continue
        for dep in sorted(deps - allowed[name]):
            bad.append(
                f"{name or 'ddiloco'} imports {dep}: its row allows {', '.join(sorted(allowed[name])) or 'nothing'}"
            )
    return bad


def test_every_folder_imports_only_what_its_row_allows():
    assert table_violations(imports(), ALLOWED) == []


def test_the_table_has_no_ring_and_its_rule_catches_what_it_must():
    assert cycles({k: set(v) for k, v in ALLOWED.items()}) == []
    graph = {"ddiloco.training.inner": {"ddiloco.config"}, "ddiloco.newthing.x": set(), "ddiloco.cli": {"ddiloco.sim"}}
    assert table_violations(graph, ALLOWED) == [
        "newthing is not in the table of docs/architecture.md: add its row",
        "training imports config: its row allows core, errors, protocol, workloads",
    ]
