"""resnet_plain.py as a ddiloco learner: the same model, data, one-cycle LR (by the fleet's
position), gradient accumulation and clipping; it resumes at its data position, leaves when the
run ends, and re-estimates BatchNorm's statistics on the final weights before it saves them.
tests/test_examples_port.py counts the lines it adds to resnet_plain.py. Start its syncer first:

    python examples/resnet_syncer.py &
    python examples/resnet_port.py --id 0 --seed 0 & python examples/resnet_port.py --id 1 --seed 1

Each learner steps until the syncer ends the run at 32,000 images in all (250 steps each at an
even pace; ``--steps``, 300, is the most one takes).
"""

import argparse

import torch
import torch.nn.functional as F
from resnet_model import ResNet, held_out_loss, images

import ddiloco

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
ap.add_argument("--seed", type=int, default=0, help="the data's and the model's seed")
ap.add_argument("--out", default="resnet.pt")
ap.add_argument("--syncer", default="tcp://127.0.0.1:5555", help="the syncer's address")
ap.add_argument("--id", type=int, default=0, help="this learner's id")
ap.add_argument("--keys", default="runs/resnet/keys", help="the syncer's keys folder")
args = ap.parse_args()
torch.set_num_threads(1)

torch.manual_seed(args.seed)
model = ResNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
learner = ddiloco.Learner(model, args.syncer, learner_id=args.id, optimizer=optimizer, key=args.keys)
scheduler = ddiloco.fleet_scheduler(optimizer, learner, "one_cycle", warmup=0.3, start=1 / 25, final=1 / 25e4)
accumulate, batch_size = 2, 32
for step in range(learner.data_position, args.steps):
    model.train()
    for micro in range(accumulate):
        x, y = images(batch_size, seed=args.seed * 1_000_003 + step * accumulate + micro)
        loss = F.cross_entropy(model(x), y) / accumulate
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    learner.step(tokens=accumulate * batch_size)
    if learner.run_ended:
        break
learner.finish()
ddiloco.recalibrate_batch_norm(model, (images(64, seed=-1 - i) for i in range(50)))
print(f"held-out loss {held_out_loss(model):.4f}")
torch.save(model.state_dict(), args.out)
