"""bench/harness: the benches' shared harness. The committed cells stay readable (every cached
cell's file name is the key its bench computes from the cell's own settings), the bench modules
import each other without a cycle and the harness imports no bench, and the small pieces
(cells, statistics, tables, the runtime benchmark's paired report) do what they say. Nothing is
trained or started."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _load(name: str) -> ModuleType:
    """A bench script as a module (each puts bench/ on sys.path for its harness itself)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _bench_imports() -> dict[str, set[str]]:
    """Bench module -> the bench modules it imports anywhere (lazy imports in functions too)."""
    files = {p.stem: p for p in BENCH.glob("*.py")}
    files.update({f"harness.{p.stem}": p for p in (BENCH / "harness").glob("*.py") if p.stem != "__init__"})
    known = set(files) | {"harness"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in known and m != "harness"} - {name}
    return graph


def test_bench_modules_import_without_a_cycle_and_the_harness_imports_no_bench() -> None:
    graph = _bench_imports()
    assert "soak" not in graph["soak_insider"], "soak_insider must not import soak (the old cycle)"
    for name, deps in graph.items():
        if name.startswith("harness."):
            assert all(d.startswith("harness.") for d in deps), (name, deps)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, n])}"
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            visit(d, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_every_cached_wan_cell_is_found_under_the_key_its_settings_give() -> None:
    wan = _load("wan")
    cells = sorted(p for p in (BENCH / "cache" / "wan").glob("*.json") if p.stem != "relay")
    assert cells
    for path in cells:
        rec = json.loads(path.read_text())
        name = rec.get("name") or rec["key"].rsplit("-", 1)[0]
        extra = {"kill_at": wan.FAULTS[name].kill_at} if name in wan.FAULTS else {}
        assert wan.key_of(name, rec["settings"], extra) == path.stem


def test_every_cached_scale_cell_is_found_under_the_key_its_size_and_code_give() -> None:
    scale = _load("scale")
    cells = sorted((BENCH / "cache" / "scale" / "size").glob("*.json"))
    assert cells
    for path in cells:
        c = json.loads(path.read_text())
        size = scale.Size(c["name"], c["hidden"], c["depth"], c["learners"], c["seconds"])
        assert scale.cell_key(size, c["code_digest"]) == path.stem == c["key"]
    assert scale.latest_cells(None), "the report's reader finds the cached cells"


def test_cells_are_keyed_by_their_settings_and_written_whole(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from harness.cells import CellCache, cell_key, digest
    finally:
        sys.path.remove(str(BENCH))
    assert digest({"a": 1, "b": [2, 3]}) == digest({"b": [2, 3], "a": 1})  # canonical: key order is no setting
    assert cell_key("x", {"a": 1}) != cell_key("x", {"a": 2})
    assert cell_key("x", {"a": 1}).startswith("x-") and len(cell_key("x", {"a": 1})) == 2 + 12
    cache = CellCache(tmp_path / "c")
    assert cache.get("k") is None
    runs: list[int] = []
    got = cache.get_or_run("k", lambda: runs.append(1) or {"loss": 1.5})
    assert got == {"loss": 1.5} and cache.get_or_run("k", lambda: {"loss": 9.0}) == {"loss": 1.5} and runs == [1]
    assert not list((tmp_path / "c").glob("*.tmp"))
    (tmp_path / "c" / "torn.json").write_text('{"loss": ')
    assert cache.get("torn") is None and [p.stem for p, _ in cache.cells()] == ["k"]


def test_statistics_and_tables() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from harness.sampling import quantile_low, quantile_rank, rate, spread
        from harness.tables import met, table
    finally:
        sys.path.remove(str(BENCH))
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert quantile_low(xs, 0.9) == 4.0 and quantile_low([], 0.9) is None
    assert quantile_rank(xs, 0.99) == 5.0 and math.isnan(quantile_rank([], 0.5))
    assert rate([0.5, 1.0, 1.5, 2.0], 1.0, 2.0) == 2.0  # [t0, t1)
    s = spread([1.2, 0.9, 1.05])
    assert s["n"] == 3 and s["min"] == 0.9 and s["max"] == 1.2
    assert s["mean"] == pytest.approx(1.05) and s["stdev"] == pytest.approx(0.15)
    assert math.isnan(spread([1.0])["stdev"])
    assert [met(None), met(True), met(False)] == ["-", "yes", "**no**"]
    assert table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]


def test_runtime_pairs_report_says_each_pair_and_the_spread() -> None:
    runtime = _load("runtime")
    assert runtime.on_off_ratio([2.0, 3.0], [2.0, 2.0]) == pytest.approx(1.25)
    assert math.isnan(runtime.on_off_ratio([2.0, 3.0], [0.0, 2.0]))  # a learner that made no step off
    rows = [
        {"pair": k, "steps_per_s_off": off, "steps_per_s_on": on, "ratio": runtime.on_off_ratio(on, off),
         "syncer_cpu_share": 0.05}
        for k, (off, on) in enumerate([([3.0, 3.0], [3.6, 3.6]), ([3.0, 3.0], [2.7, 2.7]), ([3.0, 3.0], [3.0, 3.0])])
    ]  # fmt: skip
    from harness.sampling import spread

    rep = {"pairs": rows, "ratio": spread([r["ratio"] for r in rows]), "phase_s": 60.0, "warmup_s": 10.0}
    rep.update({"command": "python bench/runtime.py --pairs 3", "date": "d", "machine": {"cpus": 2}, "wall_s": 600.0})
    md = runtime.pairs_markdown(rep)
    assert "| 0 | 3.00, 3.00 | 3.60, 3.60 | 1.200 | 5.0% |" in md and "| 1 | 3.00, 3.00 | 2.70, 2.70 | 0.900 |" in md
    assert "mean 1.033, min 0.900, max 1.200, standard deviation 0.153" in md


def test_cluster_starts_pauses_resumes_restarts_and_stops_its_roles(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from harness.cluster import Cluster, Launch, wait_until
        from harness.sampling import read_proc
    finally:
        sys.path.remove(str(BENCH))
    c = Cluster(tmp_path)
    c.start("sleeper", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert wait_until(lambda: "up" in (tmp_path / "sleeper.log").read_text(), 30)
    state = lambda: (read_proc(f"/proc/{c.pid('sleeper')}/stat") or "").rsplit(")", 1)[1].split()[0]  # noqa: E731
    c.pause("sleeper")
    assert wait_until(lambda: state() == "T", 10)
    c.resume("sleeper")
    assert wait_until(lambda: state() != "T", 10)
    first = c.pid("sleeper")
    c.restart("sleeper")
    assert c.alive("sleeper") and c.pid("sleeper") != first and len(c.spawned["sleeper"]) == 2
    c.pause("sleeper")  # a paused role is resumed to be stopped
    c.stop()
    assert not c.alive("sleeper")
    assert c.status("syncer-0") == {} and c.steps(0) == []
    run = Launch(["--help"], tmp_path / "train.log")
    assert run.wait() == 0 and "run-dir" in (tmp_path / "train.log").read_text()
