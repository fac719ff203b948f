"""A plain ResNet training loop: BatchNorm, a one-cycle LR, gradient accumulation and gradient
clipping (the model and data: resnet_model.py). resnet_port.py is the same loop as a ddiloco
learner; tests/test_examples_port.py counts the lines the port adds.

    python examples/resnet_plain.py --steps 300
"""

import argparse

import torch
import torch.nn.functional as F
from resnet_model import ResNet, held_out_loss, images

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
ap.add_argument("--seed", type=int, default=0, help="the data's and the model's seed")
ap.add_argument("--out", default="resnet.pt")
args = ap.parse_args()
torch.set_num_threads(1)

torch.manual_seed(args.seed)
model = ResNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=args.steps, pct_start=0.3)
accumulate, batch_size = 2, 32
for step in range(args.steps):
    model.train()
    for micro in range(accumulate):
        x, y = images(batch_size, seed=args.seed * 1_000_003 + step * accumulate + micro)
        loss = F.cross_entropy(model(x), y) / accumulate
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
print(f"held-out loss {held_out_loss(model):.4f}")
torch.save(model.state_dict(), args.out)
