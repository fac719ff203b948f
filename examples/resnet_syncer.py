"""The syncer of the ResNet example (resnet_port.py's learners): the initial model, the run's
budget, and ``calibrate=``, which re-estimates the final model's BatchNorm statistics on its own
weights at the run's end (the merged ones were measured by the learners on theirs).

    python examples/resnet_syncer.py &
    python examples/resnet_port.py --id 0 --seed 0 & python examples/resnet_port.py --id 1 --seed 1
"""

import argparse
import logging

import torch
from resnet_model import ResNet, images

import ddiloco

ap = argparse.ArgumentParser()
ap.add_argument("--bind", default="tcp://127.0.0.1:5555")
ap.add_argument("--run-dir", default="runs/resnet")
ap.add_argument("--images", type=int, default=32_000, help="the run's budget: images the fleet processes")
ap.add_argument("--sync-every", type=int, default=20, help="H, inner steps between a fragment's syncs")
ap.add_argument("--linger", type=float, default=60.0, help="seconds it answers 'the run ended' after the end")
args = ap.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)
torch.manual_seed(0)

settings = [f"run.processed_tokens={args.images}", f"algo.sync_every={args.sync_every}",
            f"runtime.end_linger_s={args.linger}"]  # fmt: skip
calibration = [images(64, seed=-1 - i)[0] for i in range(50)]  # training data, never the held-out set
server = ddiloco.SyncerServer(
    ResNet(), args.bind, args.run_dir, config=ddiloco.load_config(None, settings),
    calibrate=lambda model: ddiloco.recalibrate_batch_norm(model, calibration),
)  # fmt: skip
print(f"final model: {server.serve()}")
