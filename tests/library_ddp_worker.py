"""One rank of a 2-rank torchrun learner for tests/test_library.py: the user's own loop with
DDP or FSDP2 (``fully_shard``) inside and ``ddiloco.Learner`` around it.

Usage: torchrun ... library_ddp_worker.py ADDRESS OUT_DIR ddp|fsdp KEYS SETTINGS...

KEYS is the syncer's keys folder (a ``SyncerServer`` makes them in ``RUN_DIR/keys``): the
learner passes it as ``key=``, as a learner in another process must."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddiloco
from ddiloco.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_library import DictNet, loss_of, make_batch  # noqa: E402


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank (FSDP2 parameters gathered)."""
    return {
        k: (v.full_tensor() if type(v).__name__ == "DTensor" else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def main() -> None:
    torch.set_num_threads(1)
    address, out, mode, keys, settings = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different inits per rank: the join must make them equal
    model = DictNet()
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        trained = fully_shard(model)
    else:
        trained = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    cfg = load_config(None, settings)
    with ddiloco.Learner(trained, address, learner_id=0, config=cfg, optimizer=opt, key=keys) as learner:
        joined = full(model)
        for _ in range(150):
            batch = make_batch(g)
            loss = loss_of(trained, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=batch["input_ids"].numel())
            time.sleep(0.01)
        stats = {
            "applied": learner.stats.applied,
            "versions": learner.versions,
            "fleet_tokens": learner.fleet_tokens,
            "joined": joined,
            "params": full(model),
        }
    torch.save(stats, out / f"rank{rank}.pt")
    # Both ranks done with every collective before the group goes: once (under a loaded machine)
    # rank 1 aborted in gloo's teardown ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
