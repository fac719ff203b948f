"""A ResNet-style loop ported to ddiloco (issue 35): its added lines, and its exported model's
BatchNorm statistics against the same model's after recalibration.

    python bench/resnet_port.py               # 2 seeds, ~2 min on 2 cores

Per seed: ``examples/resnet_plain.py`` (one process, 300 steps of 2 x 32 images) and
``examples/resnet_port.py`` as two learners against a ``SyncerServer`` with a budget
(32,000 images: 250 steps each at an even pace), on loopback. Reported:
the held-out loss of the plain model, of the port's saved model (the final global weights, its
statistics re-estimated by ``ddiloco.recalibrate_batch_norm`` on 50 batches), of that model
recalibrated again on 50 other batches, of the syncer's ``final/model.safetensors`` (its statistics
re-estimated by ``calibrate=``, as ``examples/resnet_syncer.py`` does) and of it recalibrated
again, and of the final weights with the learners' merged statistics. Results in
``docs/results/resnet_port.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.cluster import free_port, wait_until  # noqa: E402  (bench/harness, beside this script)
from harness.paths import CACHE, RESULTS, ROOT  # noqa: E402
from harness.tables import facts, met, publish, table  # noqa: E402

EXAMPLES = ROOT / "examples"
BUDGET = 32_000
SYNC_EVERY = 20
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{EXAMPLES}"}


def loss_line(text: str) -> float:
    found = re.findall(r"held-out loss ([0-9.]+)", text)
    if not found:
        raise RuntimeError(f"no 'held-out loss' line in:\n{text[-2000:]}")
    return float(found[-1])


def run_seed(seed: int, out: Path) -> dict[str, Any]:
    """The plain loop and the port (a syncer, two learners) with model seed ``seed``."""
    import torch

    import ddiloco

    folder = out / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    plain = subprocess.run(
        [sys.executable, str(EXAMPLES / "resnet_plain.py"), "--seed", str(seed), "--out", "plain.pt"],
        cwd=folder, env=ENV, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    port = free_port()
    # examples/resnet_syncer.py's syncer, whose calibrate= first keeps the merged model it is given
    syncer_code = (
        "import torch, ddiloco, logging\nfrom resnet_model import ResNet, images\n"
        "logging.basicConfig(level=logging.INFO)\ntorch.set_num_threads(1)\n"
        f"torch.manual_seed({seed})\ncalibration = [images(64, seed=-1 - i)[0] for i in range(50)]\n"
        "def calibrate(model):\n    torch.save(model.state_dict(), 'merged.pt')\n"
        "    ddiloco.recalibrate_batch_norm(model, calibration)\n"
        f"ddiloco.SyncerServer(ResNet(), 'tcp://127.0.0.1:{port}', 'runs/resnet', config=ddiloco.load_config(None, "
        f"['run.processed_tokens={BUDGET}', 'algo.sync_every={SYNC_EVERY}', 'runtime.end_linger_s=2']), "
        "calibrate=calibrate).serve()\n"
    )
    log = open(folder / "syncer.log", "w")
    syncer = subprocess.Popen([sys.executable, "-c", syncer_code], cwd=folder, env=ENV, stdout=log, stderr=log)
    began = time.time()
    try:
        wait_until(lambda: (folder / "runs" / "resnet" / "status" / "syncer-0.json").exists(), 60)
        learners = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(EXAMPLES / "resnet_port.py"),
                    "--syncer",
                    f"tcp://127.0.0.1:{port}",
                    "--id",
                    str(m),
                    "--seed",
                    str(2 * seed + m),
                    "--out",
                    f"learner-{m}.pt",
                ],
                cwd=folder,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for m in (0, 1)
        ]
        outs = [p.communicate(timeout=900)[0] for p in learners]
        syncer.wait(timeout=300)
    finally:
        for p in [syncer, *locals().get("learners", [])]:
            if p.poll() is None:
                p.kill()
        log.close()
    codes = [p.returncode for p in learners]
    if codes != [0, 0] or syncer.returncode != 0:
        raise RuntimeError(f"seed {seed}: learners exited {codes}, syncer {syncer.returncode}; see {folder}")
    for m, text in enumerate(outs):
        (folder / f"learner-{m}.log").write_text(text)
    sys.path.insert(0, str(EXAMPLES))
    from resnet_model import ResNet, held_out_loss, images

    torch.set_num_threads(1)
    model = ResNet()
    model.load_state_dict(torch.load(folder / "learner-0.pt"))
    saved = held_out_loss(model)
    ddiloco.recalibrate_batch_norm(model, (images(64, seed=10_000 + i) for i in range(50)))
    saved_again = held_out_loss(model)
    export = ResNet()
    export.load_state_dict(ddiloco.load_state_dict(folder / "runs" / "resnet"))
    calibrated = held_out_loss(export)
    ddiloco.recalibrate_batch_norm(export, (images(64, seed=10_000 + i) for i in range(50)))
    calibrated_again = held_out_loss(export)
    merged = ResNet()
    merged.load_state_dict(torch.load(folder / "merged.pt"))
    return {
        "seed": seed,
        "plain_loss": loss_line(plain.stdout),
        "port_losses": [loss_line(t) for t in outs],
        "port_saved_loss": saved,
        "port_saved_recalibrated_again": saved_again,
        "saved_ratio": saved / saved_again,
        "export_loss": calibrated,
        "export_recalibrated_again": calibrated_again,
        "export_ratio": calibrated / calibrated_again,
        "merged_statistics_loss": held_out_loss(merged),
        "fleet_wall_s": round(time.time() - began, 1),
    }


def added() -> list[str]:
    """The port's added lines, counted by the tests' script."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_examples_port import added_lines

    return added_lines(EXAMPLES / "resnet_plain.py", EXAMPLES / "resnet_port.py")


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# A ResNet-style loop as a ddiloco learner",
        "",
        f"`{report['command']}` on {report['date']}. `examples/resnet_plain.py` (BatchNorm, one-cycle LR, "
        "gradient accumulation 2 x 32, clipping; 300 steps) and `examples/resnet_port.py`: two learners against a "
        f"`SyncerServer` on loopback, budget {BUDGET:,} images (250 steps each at an even pace), H = {SYNC_EVERY}. "
        "Losses are cross-entropy (nats/image) on 2,000 held-out images, in eval mode.",
        "",
        f"Lines the port adds or changes (tests/test_examples_port.py's count): **{len(report['added'])}** "
        f"(at most 15: {met(len(report['added']) <= 15)}).",
        "",
        "```python",
        *report["added"],
        "```",
        "",
    ]
    rows = [
        [
            r["seed"], f"{r['plain_loss']:.4f}", f"{r['port_saved_loss']:.4f}", f"{r['saved_ratio']:.4f}",
            met(abs(r["saved_ratio"] - 1) <= 0.01), f"{r['export_loss']:.4f}", f"{r['export_ratio']:.4f}",
            met(abs(r["export_ratio"] - 1) <= 0.01), f"{r['merged_statistics_loss']:.4f}",
        ]
        for r in report["seeds"]
    ]  # fmt: skip
    lines += table(
        [
            "seed", "plain", "port's saved model", "over it recalibrated again", "within 1%",
            "syncer's final model (calibrate=)", "over it recalibrated again", "within 1%",
            "final weights with the merged statistics",
        ],
        rows,
    )  # fmt: skip
    lines += [
        "",
        "The port saves the final global weights with statistics re-estimated on them (its one line "
        "`ddiloco.recalibrate_batch_norm`); the syncer (`examples/resnet_syncer.py`) does the same for "
        '`final/model.safetensors` with `calibrate=`. "Recalibrated again" measures each once more on 50 other '
        "training batches: the ratio is what a further recalibration would change. The last column is the final "
        "weights with the learners' merged statistics (what `final/model.safetensors` held before `calibrate=`): "
        "measured by each learner on its own weights, they do not fit the merged ones (with SGD and momentum the "
        "merged weights' scale differs from every learner's; docs/library.md, section 7).",
        "",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seeds", default="0,1", help="comma-separated model seeds")
    args = ap.parse_args()
    out = CACHE / "resnet_port" / time.strftime("%Y%m%d-%H%M%S")
    seeds = [run_seed(int(s), out) for s in args.seeds.split(",")]
    command = "python bench/resnet_port.py" + ("" if args.seeds == "0,1" else f" --seeds {args.seeds}")
    report = {**facts(command), "seeds": seeds, "added": added(), "budget": BUDGET, "sync_every": SYNC_EVERY}
    publish(RESULTS, "resnet_port", report, markdown(report))


if __name__ == "__main__":
    main()
