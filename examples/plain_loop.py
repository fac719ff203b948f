"""The smallest learner: a plain PyTorch loop plus three lines. Start a syncer first:

    python -c "import torch, ddiloco; torch.manual_seed(0); \
ddiloco.SyncerServer(torch.nn.Linear(8, 1), 'tcp://127.0.0.1:5555', 'runs/plain').serve()"
    python examples/plain_loop.py --id 0 --keys runs/plain/keys & \
python examples/plain_loop.py --id 1 --keys runs/plain/keys

The syncer makes the run's CURVE keys in ``runs/plain/keys``; each learner passes that folder as
``key=`` (``--keys``, which defaults to it). With ``--syncer none`` it trains alone
(``syncer=None``: no network, no keys, for debugging).
"""

import argparse

import torch

import ddiloco

ap = argparse.ArgumentParser()
ap.add_argument("--syncer", default="tcp://127.0.0.1:5555", help="the syncer's address; 'none' to train alone")
ap.add_argument("--id", type=int, default=0)
ap.add_argument("--keys", default="runs/plain/keys", help="the syncer's keys folder (it makes them in RUN_DIR/keys)")
ap.add_argument("--steps", type=int, default=3000)
args = ap.parse_args()

torch.manual_seed(args.id)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
target = torch.arange(8.0)

syncer = None if args.syncer == "none" else args.syncer
with ddiloco.Learner(model, syncer, learner_id=args.id, optimizer=optimizer, key=args.keys) as learner:  # +
    for _ in range(args.steps):
        x = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        learner.step(tokens=len(x))  # +
print(f"learner {args.id}: loss {loss.item():.4f}, global versions {learner.versions}")
